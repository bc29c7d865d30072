"""FlexAttention's interface, served block-sparse by the splash kernels.

`flex_attention` takes torch's arguments and gives torch's outputs: a `BlockMask` from
`create_block_mask` (any BLOCK_SIZE; mask_mods composed with `and_masks` / `or_masks`, depending
on b and h or not) becomes block tables for the splash kernels. Torch's own tables say which
blocks are empty, full or partial; only the partial ones are evaluated, with the BlockMask's
mask_mod at every (b, h) of the call whose b or h it reads, as torch's kernels evaluate it.
Blocks torch skips are never computed, and nothing (Lq, Lkv)-sized is built.

A mask that differs across the batch runs one batch element at a time (each with its own
tables); one that differs across heads keeps one table per head. A new mask is a new splash
program, compiled on first use: masks that change every step (documents packed differently in
each batch) compile every step.

`soft_cap(cap)` is the one score_mod splash serves: a valid score_mod for torch's flex_attention
too, so one model runs both ways. Every other score_mod is refused by name.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import weakref

import torch
from torch.nn.attention import flex_attention as _torch_flex

from torch_splash_jax import BlockSparseMask, MultiHeadMask, SplashConstraintError, SplashDtypeError, policy

from . import _compat
from .api import attention

__all__ = ["flex_attention", "route_flex", "soft_cap"]


@dataclasses.dataclass(frozen=True)
class SoftCap:
    """The score_mod ``cap * tanh(score / cap)`` (Gemma 2's logit soft cap), which splash applies
    in its kernels and torch's flex_attention calls like any score_mod."""

    cap: float

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)


def soft_cap(cap: float) -> SoftCap:
    """A score_mod that soft-caps the scaled scores: ``cap * tanh(score / cap)``.

    Args:
        cap: a positive number.

    Returns:
        A score_mod for ``torch_splash.flex_attention`` and for torch's ``flex_attention`` alike.

    Raises:
        SplashDtypeError: cap is not a real number.
        SplashConstraintError: cap is not positive.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise SplashDtypeError(f"soft_cap takes a positive number, got {type(cap).__name__}.")
    if not cap > 0:
        raise SplashConstraintError(f"soft_cap({cap!r}): the cap must be positive.")
    return SoftCap(float(cap))


# Evaluating partial blocks: how many elements one call of the vmapped mask_mod may produce.
_ELEMENTS_PER_EVALUATION = 1 << 22


def _evaluate_blocks(mask_mod, b: int, h: int, rows: torch.Tensor, cols: torch.Tensor, shape, block_shape):
    """(n, bq, bkv) bool: mask_mod at batch b, head h over the blocks (rows[i], cols[i]) of the
    block grid, False past the lengths. Called as torch's create_mask calls it: vmapped, with 0-d
    index tensors, and never at an index past the lengths (a captured (B, L) tensor indexed there
    would fail)."""
    (q_len, kv_len), (bq, bkv) = shape, block_shape
    device = rows.device
    q = rows[:, None] * bq + torch.arange(bq, device=device)  # (n, bq)
    kv = cols[:, None] * bkv + torch.arange(bkv, device=device)  # (n, bkv)
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    fn = torch.vmap(fn, in_dims=(None, None, 0, 0))
    batch, head = torch.tensor(b, device=device), torch.tensor(h, device=device)
    step = max(1, _ELEMENTS_PER_EVALUATION // (bq * bkv))
    out = []
    for start in range(0, rows.numel(), step):
        qs, kvs = q[start : start + step], kv[start : start + step]
        with _compat.mask_mod_indexing():
            allowed = fn(batch, head, qs.clamp(max=q_len - 1), kvs.clamp(max=kv_len - 1))
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise SplashDtypeError(
                f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} returned "
                f"{getattr(allowed, 'dtype', type(allowed).__name__)}: it must return a bool tensor."
            )
        out.append(allowed & (qs < q_len)[:, :, None] & (kvs < kv_len)[:, None, :])
    return torch.cat(out).cpu() if out else torch.zeros(0, bq, bkv, dtype=torch.bool)


def _block_kinds(block_mask, rows: int, cols: int) -> torch.Tensor:
    """(B', H', rows, cols) int8 from torch's ordered tables: 0 skipped, 1 partial (mask_mod
    applies), 2 full."""

    def dense(num_blocks, indices):
        listed = torch.arange(indices.shape[-1]) < num_blocks[..., None].cpu()
        target = torch.where(listed, indices.cpu().long(), cols)  # unlisted: a column past the end
        table = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.int8)
        return table.scatter_(-1, target, 1)[..., :cols]

    kinds = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    if block_mask.full_kv_num_blocks is not None:
        kinds = torch.where(dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices) > 0, 2, kinds)
    return kinds[..., :rows, :]


def _head_mask(mask_mod, b: int, h: int, kinds: torch.Tensor, shape, block_shape, device) -> BlockSparseMask:
    """One (b, h)'s mask: torch's block kinds, its partial blocks evaluated on `device` (where the
    mask_mod's captured tensors live)."""
    rows, cols = torch.nonzero(kinds == 1, as_tuple=True)
    blocks = _evaluate_blocks(mask_mod, b, h, rows.to(device), cols.to(device), shape, block_shape)
    kinds = kinds.clone()
    # a partial block whose elements all hold (or none) is full (or skipped)
    some, every = blocks.flatten(1).any(1), blocks.flatten(1).all(1)
    kinds[rows[~some], cols[~some]] = 0
    kinds[rows[every], cols[every]] = 2
    partial = some & ~every
    rows, cols, blocks = rows[partial], cols[partial], blocks[partial]
    index = torch.full(kinds.shape, -1, dtype=torch.int32)
    index[rows, cols] = torch.arange(rows.numel(), dtype=torch.int32)
    return BlockSparseMask(kinds.numpy(), index.numpy(), blocks.numpy(), shape, block_shape)


# The masks of the BlockMasks converted last, by id: a model's layers share one BlockMask, and its
# conversion (the partial blocks evaluated, the masks hashed) costs 0.03 s at 8K tokens and 0.3 s at
# 128K per call. An entry serves a call while its BlockMask is alive and the call's shape, the
# BlockMask's mask_mod and its traced code (the scalars it captured included), its own tables and
# every tensor the mask_mod reads are the same, the tensors the same objects at the same version (an
# in-place change counts). A mask_mod that cannot be traced is converted at every call.
_CONVERTED: collections.OrderedDict[int, tuple] = collections.OrderedDict()


def _versions(tensors: tuple) -> tuple:
    return tuple((t, _compat.tensor_version(t)) for t in tensors)


def _same(held: tuple, now: tuple) -> bool:
    return len(held) == len(now) and all(t is u and version == w for (t, version), (u, w) in zip(held, now))


def block_mask_masks(block_mask, batch: int, heads: int, q_len: int, kv_len: int) -> list:
    """The masks a BlockMask means for a (batch, heads, Lq, Lkv) call: one per batch element (one
    mask, or a MultiHeadMask), all equal when the mask does not depend on b."""
    _check_block_mask(block_mask, batch, heads, q_len, kv_len)
    reads, captured, code = _compat.mask_mod_trace(block_mask.mask_mod, block_mask.kv_num_blocks.device)
    if captured is None:
        return _convert(block_mask, reads, batch, heads, q_len, kv_len)
    own = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    now = _versions(tuple(t for t in own if t is not None) + captured)
    signature = ((batch, heads, q_len, kv_len), tuple(block_mask.BLOCK_SIZE), code)
    key = id(block_mask)
    held = _CONVERTED.get(key)
    if held is not None:
        alive, mask_mod, held_signature, held_tensors, masks = held
        same_mask_mod = mask_mod is block_mask.mask_mod and held_signature == signature
        if alive() is block_mask and same_mask_mod and _same(held_tensors, now):
            _CONVERTED.move_to_end(key)
            return masks
    masks = _convert(block_mask, reads, batch, heads, q_len, kv_len)
    alive = weakref.ref(block_mask, lambda _: _CONVERTED.pop(key, None))
    _CONVERTED[key] = (alive, block_mask.mask_mod, signature, now, masks)
    while len(_CONVERTED) > policy.FLEX_MASKS:
        _CONVERTED.popitem(last=False)
    return masks


def _check_block_mask(block_mask, batch: int, heads: int, q_len: int, kv_len: int) -> None:
    if not isinstance(block_mask, _torch_flex.BlockMask):
        raise SplashDtypeError(
            f"block_mask must be a torch BlockMask (create_block_mask) or None, got {type(block_mask).__name__}."
        )
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        raise SplashConstraintError(
            f"block_mask is for (Lq, Lkv) = {tuple(block_mask.seq_lengths)} but the call has ({q_len}, {kv_len}): "
            "build it with create_block_mask(mask_mod, B, H, Lq, Lkv) at this call's lengths."
        )
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise SplashConstraintError(
            f"block_mask has (B, H) = ({mask_batch}, {mask_heads}) but the call has ({batch}, {heads}) query "
            "heads: each must be 1 (broadcast) or the call's."
        )


def _convert(block_mask, reads: tuple, batch: int, heads: int, q_len: int, kv_len: int) -> list:
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    block_shape = tuple(int(n) for n in block_mask.BLOCK_SIZE)
    rows, cols = -(-q_len // block_shape[0]), -(-kv_len // block_shape[1])
    kinds = _block_kinds(block_mask, rows, cols)
    device = block_mask.kv_num_blocks.device
    # A mask_mod that never reads b (or h) is evaluated once for every batch element (head).
    reads_b, reads_h, *_ = reads
    masks, seen, evaluated = [], {}, {}
    for b in range(batch):
        per_head = []
        for h in range(heads):
            key = (b if reads_b else 0, h if reads_h else 0, b if mask_batch > 1 else 0, h if mask_heads > 1 else 0)
            if key not in evaluated:
                table = kinds[key[2], key[3]]
                mask = _head_mask(block_mask.mask_mod, *key[:2], table, (q_len, kv_len), block_shape, device)
                evaluated[key] = seen.setdefault(mask, mask)  # one object per distinct mask
            per_head.append(evaluated[key])
        mask = per_head[0] if all(m is per_head[0] for m in per_head) else MultiHeadMask(tuple(per_head))
        masks.append(seen.setdefault(mask, mask))
    return masks


# torch's kernel options that tune its own kernels or promise what splash does not rely on: accepted
# and ignored (each may carry torch's "fwd_" / "bwd_" prefix). Others (BACKEND, FORCE_USE_FLEX_ATTENTION,
# anything unknown) ask for something of torch's kernels and are refused.
_TUNING_OPTIONS = (
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_M1",
    "BLOCK_N1",
    "BLOCK_M2",
    "BLOCK_N2",
    "num_warps",
    "num_stages",
    "USE_TMA",
    "kpack",
    "matrix_instr_nonkdim",
    "waves_per_eu",
    "BLOCKS_ARE_CONTIGUOUS",
    "WRITE_DQ",
    "PRESCALE_QK",
    "ROWS_GUARANTEED_SAFE",
)


def _check_options(score_mod, kernel_options, return_lse, return_aux):
    if return_lse and return_aux is not None:
        raise SplashConstraintError("pass return_aux=AuxRequest(lse=True) or return_lse=True, not both (as torch).")
    if score_mod is not None and not isinstance(score_mod, SoftCap):
        raise SplashConstraintError(
            f"score_mod {getattr(score_mod, '__name__', score_mod)!r}: splash serves one score_mod, "
            "torch_splash.soft_cap(cap) (cap * tanh(score / cap)); others have no splash kernel."
        )
    if kernel_options is not None:
        if not isinstance(kernel_options, dict):
            raise SplashDtypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}.")
        unknown = sorted(
            str(k) for k in kernel_options if str(k).removeprefix("fwd_").removeprefix("bwd_") not in _TUNING_OPTIONS
        )
        if unknown:
            raise SplashConstraintError(
                f"kernel_options {unknown}: splash takes only the options that tune torch's own kernels "
                f"({', '.join(_TUNING_OPTIONS)}), and ignores them, since it plans its own blocks."
            )
    if return_aux is not None and getattr(return_aux, "max_scores", False):
        raise SplashConstraintError("return_aux=AuxRequest(max_scores=True): splash returns the logsumexp only.")


class _LseWithoutGradient(torch.autograd.Function):
    """The returned logsumexp, which torch's flex_attention differentiates and splash cannot: a
    gradient reaching it is an error, never dropped silently."""

    @staticmethod
    def forward(lse, *inputs):
        return lse.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad is not None and bool(grad.ne(0).any()):
            raise SplashConstraintError(
                "a gradient reached the logsumexp torch_splash.flex_attention returned: splash's backward "
                "kernels do not take one. Detach the logsumexp (lse.detach()) where it enters the loss."
            )
        return (None,) * (1 + ctx.inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.inputs = len(inputs) - 1


@torch.compiler.disable
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod=None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux=None,
):
    """torch's ``flex_attention``, run by the splash kernels block-sparse.

    Args:
        query: (B, Hq, Lq, E).
        key: (B, Hkv, Lkv, E); Hkv == Hq, or with enable_gqa a divisor of Hq.
        value: (B, Hkv, Lkv, Ev).
        score_mod: None, or ``torch_splash.soft_cap(cap)``.
        block_mask: None (every key), or a ``BlockMask`` from ``create_block_mask`` for (Lq, Lkv),
            with B and H each 1 or the call's.
        scale: default 1 / sqrt(E).
        enable_gqa: allow Hkv < Hq, as torch.
        return_lse: also return the logsumexp (B, Hq, Lq) float32, natural log, -inf on rows that
            see no key. A gradient through it raises.
        kernel_options: the options that tune torch's kernels (BLOCK_M, num_warps, ...), ignored:
            splash plans its own blocks. Others (BACKEND, ...) raise.
        return_aux: ``AuxRequest(lse=True)`` returns ``(out, AuxOutput(lse=...))``.

    Returns:
        (B, Hq, Lq, Ev) in query's dtype (a row that sees no key is 0), with the logsumexp as
        asked. Differentiable in query, key and value.

    Raises:
        SplashConstraintError, SplashDtypeError: what splash cannot serve (another score_mod, a
        BlockMask for other lengths, GQA without enable_gqa, ...), before any kernel work.
    """
    _check_options(score_mod, kernel_options, return_lse, return_aux)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise SplashDtypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise SplashConstraintError(f"{name} has shape {tuple(t.shape)}: flex_attention takes (B, H, L, E).")
    batch, heads, q_len, _ = query.shape
    if key.shape[1] != heads and not enable_gqa:
        raise SplashConstraintError(
            f"query has {heads} heads and key {key.shape[1]}: pass enable_gqa=True for grouped-query attention."
        )
    masks = [None] * batch if block_mask is None else block_mask_masks(block_mask, batch, heads, q_len, key.shape[2])
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    options = dict(scale=scale, soft_cap=None if score_mod is None else score_mod.cap, return_lse=want_lse)
    if all(m is masks[0] for m in masks):
        result = attention(query, key, value, masks[0], **options)
    else:  # a mask per batch element
        parts = [
            attention(query[b : b + 1], key[b : b + 1], value[b : b + 1], masks[b], **options) for b in range(batch)
        ]
        result = tuple(torch.cat(p) for p in zip(*parts)) if want_lse else torch.cat(parts)
    if not want_lse:
        return (result, _torch_flex.AuxOutput()) if return_aux is not None else result
    out, lse = result
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        lse = _LseWithoutGradient.apply(lse, query, key, value)
    return (out, _torch_flex.AuxOutput(lse=lse)) if return_aux is not None else (out, lse)


@contextlib.contextmanager
def route_flex(*modules):
    """Routes calls of torch's ``flex_attention`` through ``torch_splash.flex_attention``.

    Within the block, torch's ``torch.nn.attention.flex_attention.flex_attention`` and every
    module global bound to it (``from torch.nn.attention.flex_attention import flex_attention`` at
    a module's top) call splash; on exit they are torch's again. A call splash cannot serve raises
    its SplashError: there is no silent fallback to torch's (dense, on TPU) implementation.

    Args:
        *modules: only these modules' globals (torch's own attribute stays); default: torch's
            attribute and every loaded module's.

    Yields:
        None.
    """
    original = _torch_flex.flex_attention
    routed = lambda *args, **kwargs: flex_attention(*args, **kwargs)  # noqa: E731  one object per routing
    routed.__wrapped__ = flex_attention
    namespaces = [vars(m) for m in modules] if modules else _module_namespaces()
    swapped = []
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = routed
                swapped.append((namespace, name))
    try:
        yield
    finally:
        restore = swapped if modules else [(d, n) for d in _module_namespaces() for n in list(d)]
        for namespace, name in restore:
            if namespace.get(name) is routed:
                namespace[name] = original


def _module_namespaces() -> list[dict]:
    return [d for d in (getattr(m, "__dict__", None) for m in list(sys.modules.values())) if isinstance(d, dict)]
