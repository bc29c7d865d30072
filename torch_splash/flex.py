"""FlexAttention's interface, served block-sparse by the splash kernels.

`flex_attention` takes torch's arguments and gives torch's outputs: a `BlockMask` from
`create_block_mask` (any BLOCK_SIZE; mask_mods composed with `and_masks` / `or_masks`, depending
on b and h or not) becomes block tables for the splash kernels. Torch's own tables say which
blocks are empty, full or partial; only the partial ones are evaluated, with the BlockMask's
mask_mod at every (b, h) of the call whose b or h it reads, as torch's kernels evaluate it.
Blocks torch skips are never computed, and nothing (Lq, Lkv)-sized is built.

A mask that differs across the batch runs one batch element at a time (each with its own
tables); one that differs across heads keeps one table per head. The tables are inputs of the
splash program, so documents packed anew run the program already compiled when their tables round
to the same shapes.

Under torch.compile(fullgraph=True) the BlockMask is converted inside the graph (Dynamo traces the
mask_mod), and custom ops run the kernels on the result: see `graph_tables`.

A score_mod is read from its traced graph (`_score_mod`): the identity, factors (folded into the
scale), `soft_cap(cap)` (a valid score_mod for torch's flex_attention too, so one model runs both
ways) and -inf by a predicate of the indices (a mask, combined with the BlockMask's) are served;
any other is refused naming the operation. Key and value of batch 1 serve every batch element
(`_fold`), and the returned logsumexp is differentiable (`_gradients`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import threading
import weakref

import numpy as np
import torch
from torch.nn.attention import flex_attention as _torch_flex

from torch_splash_jax import BlockSparseMask, MultiHeadMask, SplashConstraintError, SplashDtypeError, policy

from . import _checks, _compat, _score_mod
from .api import attention, attention_backward

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


def _evaluate_blocks(mask_mod, b, h, rows: torch.Tensor, cols: torch.Tensor, shape, block_shape):
    """(n, bq, bkv) bool: mask_mod at batch b[i], head h[i] (ints, or (n,) tensors) over the
    blocks (rows[i], cols[i]) of the block grid, False past the lengths. Called as torch's
    create_mask calls it: vmapped, with 0-d index tensors, and never at an index past the lengths
    (a captured (B, L) tensor indexed there would fail)."""
    (q_len, kv_len), (bq, bkv) = shape, block_shape
    device = rows.device
    b, h = (torch.full_like(rows, i) if isinstance(i, int) else i for i in (b, h))
    q = rows[:, None] * bq + torch.arange(bq, device=device)  # (n, bq)
    kv = cols[:, None] * bkv + torch.arange(bkv, device=device)  # (n, bkv)
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    fn = torch.vmap(fn, in_dims=(0, 0, 0, 0))
    if torch.compiler.is_compiling():  # n is data there, unknown while tracing: one evaluation
        chunks = [slice(None)]
    else:
        step = max(1, _ELEMENTS_PER_EVALUATION // (bq * bkv))
        chunks = [slice(start, start + step) for start in range(0, rows.numel(), step)]
    out = []
    for part in chunks:
        qs, kvs = q[part], kv[part]
        with _compat.mask_mod_indexing():
            allowed = fn(b[part], h[part], qs.clamp(max=q_len - 1), kvs.clamp(max=kv_len - 1))
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise SplashDtypeError(
                f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} returned "
                f"{getattr(allowed, 'dtype', type(allowed).__name__)}: it must return a bool tensor."
            )
        out.append(allowed & (qs < q_len)[:, :, None] & (kvs < kv_len)[:, None, :])
    return torch.cat(out) if out else torch.zeros(0, bq, bkv, dtype=torch.bool, device=device)


def _block_kinds(block_mask, rows: int, cols: int) -> torch.Tensor:
    """(B', H', rows, cols) int8 from torch's ordered tables, on their device: 0 skipped, 1 partial
    (mask_mod applies), 2 full."""

    def dense(num_blocks, indices):
        listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        target = torch.where(listed, indices.long(), cols)  # unlisted: a column past the end
        table = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.int8, device=indices.device)
        return table.scatter(-1, target, torch.ones_like(target, dtype=torch.int8))[..., :cols]

    kinds = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    if block_mask.full_kv_num_blocks is not None:
        kinds = torch.where(dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices) > 0, 2, kinds)
    return kinds[..., :rows, :]


def _head_mask(mask_mod, b: int, h: int, kinds: torch.Tensor, shape, block_shape, device) -> BlockSparseMask:
    """One (b, h)'s mask: torch's block kinds (CPU), its partial blocks evaluated on `device`
    (where the mask_mod's captured tensors live)."""
    rows, cols = torch.nonzero(kinds == 1, as_tuple=True)
    blocks = _evaluate_blocks(mask_mod, b, h, rows.to(device), cols.to(device), shape, block_shape)
    return _stored_mask(kinds, rows, cols, blocks.cpu(), shape, block_shape)


def _stored_mask(kinds, rows, cols, blocks, shape, block_shape) -> BlockSparseMask:
    """A mask from torch's block kinds (rows, cols) int8 and its partial blocks evaluated (block
    (rows[i], cols[i]) is blocks[i]), all on the CPU."""
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
# A score_mod's mask is kept with it: by the BlockMask and the score_mod, alive while both are (the
# BlockMask when there is one, else the score_mod). Layers run in threads: a lock guards the cache.
_CONVERTED: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
_CONVERTED_LOCK = threading.Lock()


def _versions(tensors: tuple) -> tuple:
    return tuple((t, _compat.tensor_version(t)) for t in tensors)


def _same(held: tuple, now: tuple) -> bool:
    return len(held) == len(now) and all(t is u and version == w for (t, version), (u, w) in zip(held, now))


def block_mask_masks(block_mask, batch: int, heads: int, q_len: int, kv_len: int, score_mask=None, device=None) -> list:
    """The masks a BlockMask means for a (batch, heads, Lq, Lkv) call: one per batch element (one
    mask, or a MultiHeadMask), all equal when the mask does not depend on b. score_mask: the mask
    of a masking score_mod (`_score_mod.ScoreMask`), combined with the BlockMask's (block_mask
    may then be None: every block is evaluated, on `device`)."""
    if block_mask is not None:
        _check_block_mask(block_mask, batch, heads, q_len, kv_len)
        device = block_mask.kv_num_blocks.device
    mask_mod = _combined(block_mask, score_mask)
    reads, captured, code = _compat.mask_mod_trace(mask_mod, device)
    if captured is None:
        return _convert(block_mask, mask_mod, score_mask is not None, reads, batch, heads, q_len, kv_len, device)
    own = () if block_mask is None else _own_tensors(block_mask)
    now = _versions(tuple(t for t in own if t is not None) + captured)
    block_shape = _DEFAULT_BLOCK if block_mask is None else tuple(block_mask.BLOCK_SIZE)
    signature = ((batch, heads, q_len, kv_len), block_shape, code)
    owner = block_mask if block_mask is not None else score_mask.score_mod
    parts = (getattr(block_mask, "mask_mod", None), getattr(score_mask, "score_mod", None))
    key = (id(block_mask), id(parts[1]))
    with _CONVERTED_LOCK:
        held = _CONVERTED.get(key)
        if held is not None:
            alive, held_parts, held_signature, held_tensors, masks = held
            same = all(a is b for a, b in zip(held_parts, parts)) and held_signature == signature
            if alive() is owner and same and _same(held_tensors, now):
                _CONVERTED.move_to_end(key)
                return masks
    masks = _convert(block_mask, mask_mod, score_mask is not None, reads, batch, heads, q_len, kv_len, device)
    try:
        alive = weakref.ref(owner, functools.partial(_forget, key))
    except TypeError:  # a score_mod that takes no weak reference is converted at every call
        return masks
    with _CONVERTED_LOCK:
        _CONVERTED[key] = (alive, parts, signature, now, masks)
        while len(_CONVERTED) > policy.FLEX_MASKS:
            _CONVERTED.popitem(last=False)
    return masks


def _forget(key, _, cache=_CONVERTED, lock=_CONVERTED_LOCK) -> None:
    """Drops an entry whose BlockMask (or score_mod) died; bound to the cache itself, since it may
    run while the interpreter exits, after this module's globals are gone."""
    with lock:
        cache.pop(key, None)


def _own_tensors(block_mask) -> tuple:
    return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


# torch's own default BLOCK_SIZE: the blocks a score_mod's mask is evaluated in without a BlockMask.
_DEFAULT_BLOCK = (128, 128)


def _combined(block_mask, score_mask):
    """The mask_mod a call applies: the BlockMask's, the score_mod's mask, or both."""
    if score_mask is None:
        return block_mask.mask_mod
    if block_mask is None:
        return score_mask
    return _torch_flex.and_masks(block_mask.mask_mod, score_mask)


def _kinds(block_mask, scored: bool, shape, block_shape, device) -> torch.Tensor:
    """(B', H', rows, cols) int8 block kinds (`_block_kinds`) of a call; with a score_mod's mask,
    blocks full for the BlockMask are partial (the score_mod's mask applies there too), and
    without a BlockMask every block is."""
    rows, cols = -(-shape[0] // block_shape[0]), -(-shape[1] // block_shape[1])
    if block_mask is None:
        return torch.ones(1, 1, rows, cols, dtype=torch.int8, device=device)
    kinds = _block_kinds(block_mask, rows, cols)
    return kinds.clamp(max=1) if scored else kinds


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


def _convert(block_mask, mask_mod, scored: bool, reads: tuple, batch, heads, q_len, kv_len, device) -> list:
    block_shape = _DEFAULT_BLOCK if block_mask is None else tuple(int(n) for n in block_mask.BLOCK_SIZE)
    kinds = _kinds(block_mask, scored, (q_len, kv_len), block_shape, device).cpu()
    keys, assign = _evaluation_keys(*reads[:2], *kinds.shape[:2], batch, heads)
    masks = [_head_mask(mask_mod, b, h, kinds[tb, th], (q_len, kv_len), block_shape, device) for b, h, tb, th in keys]
    return _per_batch(masks, assign)


def _evaluation_keys(reads_b: bool, reads_h: bool, mask_batch: int, mask_heads: int, batch: int, heads: int):
    """Where a BlockMask's mask_mod is evaluated for a (batch, heads) call: the distinct (b, h it
    is evaluated at, b, h of torch's tables), and for each batch element and head the index of its
    own. A mask_mod that never reads b (or h) is evaluated once for every batch element (head)."""
    keys, assign = {}, []
    for b in range(batch):
        row = []
        for h in range(heads):
            key = (b if reads_b else 0, h if reads_h else 0, b if mask_batch > 1 else 0, h if mask_heads > 1 else 0)
            row.append(keys.setdefault(key, len(keys)))
        assign.append(tuple(row))
    return tuple(keys), tuple(assign)


def _per_batch(masks: list, assign: tuple) -> list:
    """One mask per batch element (a MultiHeadMask where its heads differ) from the masks evaluated
    and each (b, h)'s index among them; equal masks become one object."""
    seen = {}
    masks = [seen.setdefault(m, m) for m in masks]
    out = []
    for row in assign:
        per_head = [masks[i] for i in row]
        mask = per_head[0] if all(m is per_head[0] for m in per_head) else MultiHeadMask(tuple(per_head))
        out.append(seen.setdefault(mask, mask))
    return out


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
    if score_mod is not None and not callable(score_mod):
        raise SplashDtypeError(f"score_mod must be a function or None, got {type(score_mod).__name__}.")
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


class _WithLogsumexp(torch.autograd.Function):
    """An eager call that returns the logsumexp: both outputs differentiable, the lse's gradient
    through `_gradients`, as the compiled path's `flex_backward`."""

    @staticmethod
    def forward(ctx, query, key, value, masks, options):
        out, lse = _by_batch_element(attention, (query, key, value), masks, return_lse=True, **options)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.masks, ctx.options = masks, options
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        _refuse_double_backward()
        query, key, value, out, lse = ctx.saved_tensors
        d_out = torch.zeros_like(out) if d_out is None else d_out
        grads = _by_batch_element(_gradients, (query, key, value, out, lse, d_out, d_lse), ctx.masks, **ctx.options)
        return (*grads, None, None)


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # create_graph=True
        raise SplashConstraintError(
            "torch_splash.flex_attention supports one backward pass, not double backward "
            "(create_graph=True): the splash dq/dkv kernels have no derivative of their own."
        )


def _gradients(query, key, value, out, lse, d_out, d_lse, mask, *, scale=None, soft_cap=None):
    """dq, dk, dv from the output's gradient d_out and the logsumexp's d_lse (None: none).

    With g = d_lse, the logits' gradient is dS = P * (dP - (D - g)), D = rowsum(dO * O) the row
    statistic the dq/dkv kernels compute: the kernels run on value and d_out each with one more
    column, of ones in value and g in d_out, and a 0 in out, so that dP gains g and D stays; the
    extra column of dv is dropped. A row that sees no key has P = 0, so its g adds nothing."""
    if d_lse is None or not bool(d_lse.ne(0).any()):
        return attention_backward(query, key, value, out, lse, d_out, mask, scale=scale, soft_cap=soft_cap)
    ones = value.new_ones(value.shape[:-1] + (1,))
    g = torch.nan_to_num(d_lse, nan=0.0, posinf=0.0, neginf=0.0).to(d_out.dtype)[..., None]
    value, out, d_out = (
        torch.cat([value, ones], -1),
        torch.cat([out, out.new_zeros(out.shape[:-1] + (1,))], -1),
        torch.cat([d_out, g], -1),
    )
    dq, dk, dv = attention_backward(query, key, value, out, lse, d_out, mask, scale=scale, soft_cap=soft_cap)
    return dq, dk, dv[..., :-1]


# Under torch.compile the BlockMask is data of the graph, not an object this module can read: it is
# converted inside the graph. Torch's tables become block kinds; the partial blocks (how many is
# data: `partial_blocks`, a size Dynamo leaves unknown) are evaluated with the mask_mod, traced by
# Dynamo; and the `flex_forward` / `flex_backward` ops build the masks from those tensors where
# they run, then call the kernels as an eager call does. A new packing of documents is new data for
# the same graph.


@_compat.constant_while_tracing
def _reads(mask_mod, device) -> tuple[bool, bool]:
    """Whether a mask_mod reads b and h, decided while Dynamo traces (every mask_mod of the same
    code and captured functions reads the same)."""
    reads, _, _ = _compat.mask_mod_trace(mask_mod, device)
    return reads[0], reads[1]


@_compat.constant_while_tracing
def _call_text(assign: tuple, shape: tuple, block_shape: tuple, scale, cap) -> str:
    return json.dumps(dict(assign=assign, shape=shape, block_shape=block_shape, scale=scale, soft_cap=cap))


@functools.lru_cache(maxsize=policy.PLAN_TEXTS)
def _read_call(text: str) -> dict:
    call = json.loads(text)
    call["assign"] = tuple(tuple(row) for row in call["assign"])
    return call


def _traced(query, key, value, block_mask, scale, cap, score_mod=None, reads=None):
    """What flex_attention runs under torch.compile: (out, lse). score_mod: a masking score_mod
    whose mask reads `reads` of (b, h, q_idx, kv_idx)."""
    batch, heads, q_len, _ = _checks.static_shape(query)
    kv_len = _checks.static_shape(key)[2]
    if block_mask is None and score_mod is None:
        table = where = blocks = None
        assign, block_shape = ((0,) * heads,) * batch, (q_len, kv_len)
    else:
        table, where, blocks, assign, block_shape = graph_tables(
            block_mask, batch, heads, (q_len, kv_len), score_mod, reads, query.device
        )
    kv_batch, kv_heads = _checks.static_shape(key)[:2]
    folding = kv_batch != batch
    assign = _folded_assign(assign, (kv_batch, kv_heads), folding)
    text = _call_text(assign, (q_len, kv_len), block_shape, _checks.static_float(scale), _checks.static_float(cap))
    if not folding:
        return flex_forward(query, key, value, table, where, blocks, text)
    out, lse = flex_forward(_fold(query, kv_heads), key, value, table, where, blocks, text)
    return _unfold(out, batch, kv_heads), _unfold(lse, batch, kv_heads)


def graph_tables(block_mask, batch: int, heads: int, shape=None, score_mod=None, reads=None, device=None):
    """A BlockMask (and a masking score_mod's mask) as the compiled path's graph computes it for a
    (batch, heads) call: the block kinds of each (b, h) evaluated (K, rows, cols) int8,
    `partial_blocks` of them, those blocks evaluated (n + 1, bq, bkv) bool (the stand-in's
    included), for each batch element and head the index of its own among the K, and the block
    shape."""
    score_mask = None if score_mod is None else _score_mod.ScoreMask(score_mod)
    if block_mask is not None:
        q_len, kv_len, *block_shape = _checks.static_ints(*block_mask.seq_lengths, *block_mask.BLOCK_SIZE)
        device = block_mask.kv_num_blocks.device
        mask_reads = _reads(block_mask.mask_mod, device)
    else:
        (q_len, kv_len), block_shape, mask_reads = shape, list(_DEFAULT_BLOCK), (False, False)
    if reads is not None:
        mask_reads = (mask_reads[0] or reads[0], mask_reads[1] or reads[1])
    kinds = _kinds(block_mask, score_mask is not None, (q_len, kv_len), block_shape, device)
    keys, assign = _evaluation_keys(*mask_reads, *_checks.static_shape(kinds)[:2], batch, heads)
    table = torch.stack([kinds[tb, th] for _, _, tb, th in keys])
    where = partial_blocks(table)
    b = torch.tensor([key[0] for key in keys], device=where.device)[where[:, 0]]
    h = torch.tensor([key[1] for key in keys], device=where.device)[where[:, 0]]
    mask_mod = _combined(block_mask, score_mask)
    blocks = _evaluate_blocks(mask_mod, b, h, where[:, 1], where[:, 2], (q_len, kv_len), block_shape)
    return table, where, blocks, assign, tuple(block_shape)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, ...) as (1, B * Hq, ...), heads ordered (kv head, b, group member): one batch
    element whose query heads group onto the kv heads as each b's did (query head h uses kv head
    h // (heads / kv heads)), so keys and values of batch 1 serve every b uncopied."""
    batch, heads = t.shape[:2]
    return t.unflatten(1, (kv_heads, heads // kv_heads)).transpose(0, 1).reshape(1, batch * heads, *t.shape[2:])


def _unfold(t: torch.Tensor, batch: int, kv_heads: int) -> torch.Tensor:
    """`_fold`'s inverse: (1, B * Hq, ...) back to (B, Hq, ...)."""
    group = t.shape[1] // (batch * kv_heads)
    return t.reshape(kv_heads, batch, group, *t.shape[2:]).transpose(0, 1).reshape(batch, -1, *t.shape[2:])


def _folded_heads(batch: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(b, h) of each query head of `_fold`'s one batch element."""
    group = heads // kv_heads
    return [(b, kv * group + g) for kv in range(kv_heads) for b in range(batch) for g in range(group)]


def _folded_assign(assign: tuple, kv_shape: tuple, folding: bool) -> tuple:
    if not folding:
        return assign
    return (tuple(assign[b][h] for b, h in _folded_heads(len(assign), len(assign[0]), kv_shape[1])),)


def _folded_masks(masks: list, heads: int, kv_heads: int) -> list:
    """One batch element's mask (one, or per head) from one per b, heads as `_fold` orders them."""
    if all(m is masks[0] for m in masks) and not isinstance(masks[0], MultiHeadMask):
        return masks[:1]
    per_head = [m.masks[h] if isinstance(m, MultiHeadMask) else m for m in masks for h in range(heads)]
    folded = [per_head[b * heads + h] for b, h in _folded_heads(len(masks), heads, kv_heads)]
    return [folded[0] if all(m is folded[0] for m in folded) else MultiHeadMask(tuple(folded))]


@torch.library.custom_op("torch_splash::partial_blocks", mutates_args=())
def partial_blocks(kinds: torch.Tensor) -> torch.Tensor:
    """(n + 1, 3) int64: (table, row, column) of each partial block (kind 1) of the (K, rows, cols)
    block kinds, then one stand-in (0, 0, 0) that the masks leave out: the count is data, and
    tracing takes it as at least 1."""
    return torch.cat([torch.nonzero(kinds == 1), kinds.new_zeros((1, 3), dtype=torch.int64)])


@partial_blocks.register_fake
def _(kinds):
    return kinds.new_empty((_compat.dynamic_size(1), 3), dtype=torch.int64)


def graph_masks(table, where, blocks, assign: tuple, shape: tuple, block_shape: tuple) -> list:
    """One mask per batch element from `graph_tables`' tensors, where the compiled path's ops run;
    kept by content (`_GRAPH_MASKS`)."""
    key = _content_key(repr((assign, shape, block_shape)), (table, where, blocks))
    masks = _GRAPH_MASKS.get(key)
    if masks is None:  # two threads may both build them: equal masks, one kept
        masks = _GRAPH_MASKS.setdefault(key, _built_masks(table, where, blocks, assign, shape, block_shape))
    return masks


# The masks built last, by the content of the tensors they were built from. Every layer that passes
# one BlockMask, and the backward, gives its op equal tensors (often the very same ones: AOTAutograd
# merges common subexpressions, though not always the evaluated blocks), and building the masks
# costs 0.17 s at 128K tokens, where their key costs 0.02 s.
_GRAPH_MASKS = policy.Recent(policy.FLEX_MASKS)


def _content_key(text: str, tensors) -> bytes:
    digest = hashlib.blake2b(text.encode())
    for t in tensors:
        array = t.cpu().numpy()
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.packbits(array) if array.dtype == bool else array.tobytes())
    return digest.digest()


def _built_masks(table, where, blocks, assign: tuple, shape: tuple, block_shape: tuple) -> list:
    table, where, blocks = table.cpu(), where[:-1].cpu(), blocks[:-1].cpu()  # without the stand-in
    masks = []
    for k in range(table.shape[0]):
        own = where[:, 0] == k
        masks.append(_stored_mask(table[k], where[own, 1], where[own, 2], blocks[own], shape, block_shape))
    return _per_batch(masks, assign)


def _masks_of(table, where, blocks, call: str) -> tuple[list, dict]:
    """For a call of the compiled path's ops: one mask per batch element (None: every key), and
    the options of `attention`."""
    options = _read_call(call)
    kwargs = dict(scale=options["scale"], soft_cap=options["soft_cap"])
    if table is None:
        return [None] * len(options["assign"]), kwargs
    shape, block_shape = tuple(options["shape"]), tuple(options["block_shape"])
    return graph_masks(table, where, blocks, options["assign"], shape, block_shape), kwargs


@torch.library.custom_op("torch_splash::flex_forward", mutates_args=())
def flex_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor | None,
    where: torch.Tensor | None,
    blocks: torch.Tensor | None,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention's output and logsumexp (torch's convention) for the masks these tensors make."""
    masks, kwargs = _masks_of(table, where, blocks, call)
    out, lse = _by_batch_element(attention, (query, key, value), masks, return_lse=True, **kwargs)
    return out.contiguous(), lse.contiguous()  # as the fake


@flex_forward.register_fake
def _(query, key, value, table, where, blocks, call):
    return query.new_empty(query.shape[:-1] + value.shape[-1:]), query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torch_splash::flex_backward", mutates_args=())
def flex_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    d_lse: torch.Tensor | None,
    table: torch.Tensor | None,
    where: torch.Tensor | None,
    blocks: torch.Tensor | None,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of flex_forward from its outputs' gradients, by the dq/dkv kernels."""
    masks, kwargs = _masks_of(table, where, blocks, call)
    grads = _by_batch_element(_gradients, (query, key, value, out, lse, d_out, d_lse), masks, **kwargs)
    return tuple(t.contiguous() for t in grads)  # as the fake


@flex_backward.register_fake
def _(query, key, value, out, lse, d_out, d_lse, table, where, blocks, call):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous


def _save_for_backward(ctx, inputs, output):
    query, key, value, table, where, blocks, call = inputs
    ctx.call, ctx.table = call, table is not None
    ctx.save_for_backward(query, key, value, *output, *((table, where, blocks) if ctx.table else ()))


def _flex_gradients(ctx, d_out, d_lse):
    _refuse_double_backward()
    query, key, value, out, lse, *mask = ctx.saved_tensors
    d_out = torch.zeros_like(out) if d_out is None else d_out
    dq, dk, dv = flex_backward(query, key, value, out, lse, d_out, d_lse, *(mask or (None,) * 3), ctx.call)
    return dq, dk, dv, None, None, None, None


flex_forward.register_autograd(_flex_gradients, setup_context=_save_for_backward)


def _by_batch_element(fn, tensors: tuple, masks: list, **options):
    """``fn(*tensors, mask, **options)`` with one mask per batch element (None: every key): one call
    where the masks are one, else one per batch element, its results concatenated."""
    if all(m is masks[0] for m in masks):
        return fn(*tensors, masks[0], **options)
    parts = [
        fn(*(None if t is None else t[b : b + 1] for t in tensors), masks[b], **options) for b in range(len(masks))
    ]
    return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)


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
        key: (B or 1, Hkv, Lkv, E); Hkv == Hq, or with enable_gqa a divisor of Hq. Batch 1 serves
            every batch element of query (as torch broadcasts), uncopied.
        value: (as key's, Hkv, Lkv, Ev).
        score_mod: None, or one splash serves (see `_score_mod`): the identity, factors,
            ``torch_splash.soft_cap(cap)``, ``torch.where(predicate, score, -inf)``, and their
            compositions in that order.
        block_mask: None (every key), or a ``BlockMask`` from ``create_block_mask`` for (Lq, Lkv),
            with B and H each 1 or the call's.
        scale: default 1 / sqrt(E).
        enable_gqa: allow Hkv < Hq, as torch.
        return_lse: also return the logsumexp (B, Hq, Lq) float32, natural log, -inf on rows that
            see no key; differentiable.
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
    if key.shape[0] != value.shape[0] or key.shape[0] not in (1, batch):
        raise SplashConstraintError(
            f"query, key, value have batch sizes {batch}, {key.shape[0]}, {value.shape[0]}: key and value "
            "must have query's batch size, or both 1 (shared by every batch element, as torch broadcasts)."
        )
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    compiling = torch.compiler.is_compiling()
    if compiling and score_mod is not None and not isinstance(score_mod, SoftCap):
        refusal, *form = _form_while_tracing(score_mod, _SCORE_MOD_DEVICE)
        if refusal:
            raise SplashConstraintError(refusal)
    else:
        form = _form(score_mod, _SCORE_MOD_DEVICE)
    factor, cap, masks_score, reads = form
    if factor != 1.0:
        head_dim = _checks.static_shape(query)[3] if compiling else query.shape[3]
        scale = (head_dim**-0.5 if scale is None else scale) * factor
    score_mod = score_mod if masks_score else None
    if compiling:
        if block_mask is not None:
            _check_block_mask(block_mask, batch, heads, q_len, key.shape[2])
        out, lse = _traced(query, key, value, block_mask, scale, cap, score_mod, reads)
    else:
        if block_mask is None and score_mod is None:
            masks = [None] * batch
        else:
            score_mask = None if score_mod is None else _score_mod.ScoreMask(score_mod)
            masks = block_mask_masks(block_mask, batch, heads, q_len, key.shape[2], score_mask, _SCORE_MOD_DEVICE)
        folding = key.shape[0] != batch
        if folding:
            masks, query = _folded_masks(masks, heads, key.shape[1]), _fold(query, key.shape[1])
        options = dict(scale=scale, soft_cap=cap)
        if not want_lse:
            out = _by_batch_element(attention, (query, key, value), masks, **options)
            out = _unfold(out, batch, key.shape[1]) if folding else out
            return (out, _torch_flex.AuxOutput()) if return_aux is not None else out
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            out, lse = _WithLogsumexp.apply(query, key, value, masks, options)
        else:
            out, lse = _by_batch_element(attention, (query, key, value), masks, return_lse=True, **options)
        if folding:
            out, lse = _unfold(out, batch, key.shape[1]), _unfold(lse, batch, key.shape[1])
    if not want_lse:
        return (out, _torch_flex.AuxOutput()) if return_aux is not None else out
    return (out, _torch_flex.AuxOutput(lse=lse)) if return_aux is not None else (out, lse)


# Where a score_mod is traced, and its mask evaluated without a BlockMask: torch.fx cannot trace on
# torch_xla's device (its tensors become constants), and create_block_mask fails there too, so a
# model for torch_xla keeps what its mask_mods and score_mods capture on the CPU either way.
_SCORE_MOD_DEVICE = "cpu"


def _form(score_mod, device) -> tuple:
    """(factor of the scale, soft cap, whether it masks, which of (b, h) its mask reads)."""
    if score_mod is None:
        return 1.0, None, False, (False, False)
    if isinstance(score_mod, SoftCap):
        return 1.0, score_mod.cap, False, (False, False)
    form = _score_mod.analyse(score_mod, device)
    return form.factor, form.cap, form.masks, form.reads[:2]


@_compat.constant_while_tracing
def _form_while_tracing(score_mod, device) -> tuple:
    """(why it is refused or "", then `_form`'s), decided while Dynamo traces, which raises the
    refusal in the traced code. A factor read from a captured tensor would be a constant of the
    graph, blind to the tensor's next value: refused there."""
    try:
        form = _score_mod.analyse(score_mod, device)
    except SplashConstraintError as error:
        return str(error), 1.0, None, False, (False, False)
    if form.captured:
        refusal = (
            f"score_mod {getattr(score_mod, '__name__', score_mod)!r} multiplies the score by a captured "
            "tensor: under torch.compile splash folds factors into the scale, a constant of the graph. "
            "Pass the factor as flex_attention's scale=, or as a Python number."
        )
        return refusal, 1.0, None, False, (False, False)
    return "", form.factor, form.cap, form.masks, form.reads[:2]


@contextlib.contextmanager
def route_flex(*modules):
    """Routes calls of torch's ``flex_attention`` through ``torch_splash.flex_attention``.

    Within the block, torch's ``torch.nn.attention.flex_attention.flex_attention`` and every
    module global bound to it (``from torch.nn.attention.flex_attention import flex_attention`` at
    a module's top) call splash, and so does every other reference to torch's function, such as
    ``torch.compile(flex_attention)`` made before the block (torchtitan's class attribute,
    HuggingFace's compiled singleton); on exit they are torch's again. A call splash cannot serve
    raises its SplashError: there is no silent fallback to torch's (dense, on TPU) implementation.

    Args:
        *modules: only these modules' globals (torch's own function and attribute stay torch's);
            default: torch's function itself and every loaded module's globals.

    Yields:
        None.
    """
    # another block, open in another thread, may have rebound torch's module attribute
    original = getattr(_torch_flex.flex_attention, "_torch_splash_routes", _torch_flex.flex_attention)
    routed = lambda *args, **kwargs: flex_attention(*args, **kwargs)  # noqa: E731  one object per routing
    routed.__wrapped__ = flex_attention
    routed._torch_splash_routes = original
    namespaces = [vars(m) for m in modules] if modules else _compat.module_namespaces()
    swapped = []
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = routed
                swapped.append((namespace, name))
    # Torch's function object runs splash's call: what holds the object itself (a compiled wrapper
    # reaches it by its code) is routed too. Renamed globals above change what Dynamo guards on, so
    # graphs compiled outside the block are not reused in it, nor these outside it.
    swap = _compat.function_calls(original, __name__, "flex_attention") if not modules else contextlib.nullcontext()
    try:
        with swap:
            yield
    finally:
        restore = swapped if modules else [(d, n) for d in _compat.module_namespaces() for n in list(d)]
        for namespace, name in restore:
            if namespace.get(name) is routed:
                namespace[name] = original
