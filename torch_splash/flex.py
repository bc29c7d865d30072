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
mask_mod), and custom ops run the kernels on the result: see `_flex_ops.graph_tables`.

A score_mod is read from its traced graph (`_score_mod`): the identity, factors (folded into the
scale), `soft_cap(cap)` (a valid score_mod for torch's flex_attention too, so one model runs both
ways) and -inf by a predicate of the indices (a mask, combined with the BlockMask's) are served;
any other is refused naming the operation. Key and value of batch 1 serve every batch element
(`_flex_masks.fold`), and the returned logsumexp is differentiable (`_flex_ops.gradients`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.nn.attention import flex_attention as _torch_flex

from torch_splash_jax import SplashConstraintError, SplashDtypeError

from . import _checks, _compat, _flex_masks, _flex_ops, _score_mod
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
    through `_flex_ops.gradients`, as the compiled path's `flex_backward`."""

    @staticmethod
    def forward(ctx, query, key, value, masks, options):
        out, lse = _flex_ops.by_batch_element(attention, (query, key, value), masks, return_lse=True, **options)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.masks, ctx.options = masks, options
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        _flex_ops.refuse_double_backward()
        query, key, value, out, lse = ctx.saved_tensors
        d_out = torch.zeros_like(out) if d_out is None else d_out
        grads = _flex_ops.by_batch_element(
            _flex_ops.gradients, (query, key, value, out, lse, d_out, d_lse), ctx.masks, **ctx.options
        )
        return (*grads, None, None)


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
    if torch.compiler.is_compiling():
        out, lse = _compiled(query, key, value, score_mod, block_mask, scale, want_lse)
    else:
        out, lse = _eager(query, key, value, score_mod, block_mask, scale, want_lse)
    if not want_lse:
        return (out, _torch_flex.AuxOutput()) if return_aux is not None else out
    return (out, _torch_flex.AuxOutput(lse=lse)) if return_aux is not None else (out, lse)


def _compiled(query, key, value, score_mod, block_mask, scale, want_lse):
    """(out, lse) while Dynamo traces: the score_mod's form decided as a constant of the graph."""
    if score_mod is not None and not isinstance(score_mod, SoftCap):
        _compat.break_unless_constant(score_mod, _MADE_WHILE_TRACING)
        refusal, eager_serves, *form = _form_while_tracing(score_mod, _SCORE_MOD_DEVICE)
        if refusal:
            # under fullgraph the break is the error, saying why first
            where = "" if not eager_serves else " under torch.compile(fullgraph=True)"
            _compat.break_graph(f"torch_splash.flex_attention cannot serve this call{where}: {refusal}")
            if not torch.compiler.is_compiling():
                # without fullgraph, past the break this runs eagerly: the eager call raises the
                # SplashError itself, or serves a captured tensor's factor at its value of the moment
                return _eager(query, key, value, score_mod, block_mask, scale, want_lse)
            raise SplashConstraintError(refusal)
    else:
        form = _form(score_mod, _SCORE_MOD_DEVICE)
    factor, cap, masks_score, reads = form
    if factor != 1.0:
        scale = (_checks.static_shape(query)[3] ** -0.5 if scale is None else scale) * factor
    if block_mask is not None:
        batch, heads, q_len, _ = _checks.static_shape(query)
        _flex_masks.check_block_mask(block_mask, batch, heads, q_len, _checks.static_shape(key)[2])
    return _flex_ops.traced(query, key, value, block_mask, scale, cap, score_mod if masks_score else None, reads)


# Dynamo never traces an eager call: after a graph break (a score_mod made inside the compiled code)
# the call runs here, and the mask conversion's NumPy and the score_mod's own tracing are not for
# Dynamo to compile frame by frame.
@torch.compiler.disable
def _eager(query, key, value, score_mod, block_mask, scale, want_lse):
    """(out, lse or None) of an eager call."""
    factor, cap, masks_score, _ = _form(score_mod, _SCORE_MOD_DEVICE)
    if factor != 1.0:
        scale = (query.shape[3] ** -0.5 if scale is None else scale) * factor
    score_mod = score_mod if masks_score else None
    batch, heads, q_len, _ = query.shape
    if block_mask is None and score_mod is None:
        masks = [None] * batch
    else:
        score_mask = None if score_mod is None else _score_mod.ScoreMask(score_mod)
        masks = _flex_masks.block_mask_masks(
            block_mask, batch, heads, q_len, key.shape[2], score_mask, _SCORE_MOD_DEVICE
        )
    folding = key.shape[0] != batch
    if folding:
        masks, query = _flex_masks.folded_masks(masks, heads, key.shape[1]), _flex_masks.fold(query, key.shape[1])
    options = dict(scale=scale, soft_cap=cap)
    lse = None
    if not want_lse:
        out = _flex_ops.by_batch_element(attention, (query, key, value), masks, **options)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        out, lse = _WithLogsumexp.apply(query, key, value, masks, options)
    else:
        out, lse = _flex_ops.by_batch_element(attention, (query, key, value), masks, return_lse=True, **options)
    if folding:
        out = _flex_masks.unfold(out, batch, key.shape[1])
        lse = None if lse is None else _flex_masks.unfold(lse, batch, key.shape[1])
    return out, lse


_MADE_WHILE_TRACING = (
    "torch_splash.flex_attention reads a score_mod's graph before it runs the kernels, and a "
    "score_mod made inside the compiled code (a closure over values of the trace, such as a module's "
    "buffer or parameter) does not exist until that code runs: under torch.compile without "
    "fullgraph this call runs eagerly, and under fullgraph=True it cannot be served. Define the "
    "score_mod outside the compiled code (a module-level function, or one made once in __init__), "
    "or pass its factor as scale=."
)


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
    """(why it is refused or "", whether an eager call serves it, then `_form`'s), decided while
    Dynamo traces. A factor read from a captured tensor would be a constant of the graph, blind to
    the tensor's next value: refused there, served eagerly."""
    try:
        form = _score_mod.analyse(score_mod, device)
    except SplashConstraintError as error:
        return str(error), False, 1.0, None, False, (False, False)
    if form.captured:
        refusal = (
            f"score_mod {getattr(score_mod, '__name__', score_mod)!r} multiplies the score by a captured "
            "tensor: under torch.compile splash folds factors into the scale, a constant of the graph. "
            "Pass the factor as flex_attention's scale=, or as a Python number."
        )
        return refusal, True, 1.0, None, False, (False, False)
    return "", True, form.factor, form.cap, form.masks, form.reads[:2]


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
