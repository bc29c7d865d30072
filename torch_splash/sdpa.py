"""An SDPA drop-in, and a context manager that routes a model's SDPA calls through splash.

`scaled_dot_product_attention` has torch's signature and semantics. Masks become what the kernel
serves best: the causal and full patterns become structured masks (blocks skipped, no table), a
mask that differs across the batch only by key padding becomes segment ids plus one shared mask,
and any other batch-varying mask is served one batch element at a time.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from torch_splash_jax import SplashConstraintError, SplashDtypeError, SplashError

from . import _compat
from . import masks as _masks
from .api import attention

# torch's own function, whatever `torch.nn.functional.scaled_dot_product_attention` is bound to now:
# users install the drop-in by assigning it there.
_TORCH_SDPA = _compat.torch_sdpa()


def _causal_bias_mask(bias: CausalBias, q_len: int, kv_len: int) -> _masks.Mask:
    """torch's CausalBias (causal_upper_left / causal_lower_right) as the CausalMask it means. Its
    storage is never initialised: torch's SDPA recognises the object, and so must we."""
    if (bias.seq_len_q, bias.seq_len_kv) != (q_len, kv_len):
        raise SplashConstraintError(
            f"attn_mask is a CausalBias for (Lq, Lkv) = {(bias.seq_len_q, bias.seq_len_kv)} but the call has "
            f"{(q_len, kv_len)}: build it with the query and key lengths of this call."
        )
    return _masks.CausalMask(0 if bias.variant == CausalVariant.UPPER_LEFT else kv_len - q_len)


def _is_plain(t: torch.Tensor) -> bool:
    """A tensor whose values mean what they hold: not a subclass that overrides torch functions
    (such as CausalBias, whose storage is uninitialised)."""
    return isinstance(t, torch.nn.Parameter) or not _compat.overrides_torch_function(t)


def _bool_mask(attn_mask: torch.Tensor) -> torch.Tensor:
    if attn_mask.dtype == torch.bool:
        return attn_mask
    if not attn_mask.dtype.is_floating_point:
        raise SplashDtypeError(f"attn_mask has dtype {attn_mask.dtype}: SDPA masks are bool or float.")
    blocked = torch.isneginf(attn_mask) | (attn_mask <= torch.finfo(attn_mask.dtype).min)
    if not (blocked | (attn_mask == 0)).all():
        raise SplashConstraintError(
            "attn_mask is a float mask with values other than 0 and -inf (or the dtype's min): that is "
            "an additive bias, which splash attention has no input for. Use a bool mask, or torch's SDPA."
        )
    return ~blocked


def _structure_of(mask2d: torch.Tensor) -> _masks.Mask:
    """A structured mask equal to this (Lq, Lkv) bool mask, if there is one (no table needed)."""
    q_len, kv_len = mask2d.shape
    if mask2d.all():
        return _masks.FullMask()
    rows = torch.arange(q_len, device=mask2d.device)[:, None]
    cols = torch.arange(kv_len, device=mask2d.device)[None, :]
    for offset in {0, kv_len - q_len}:
        if torch.equal(mask2d, rows + offset >= cols):
            return _masks.CausalMask(offset)
    return _masks.from_tensor(mask2d)


def _shared_mask(mask: torch.Tensor) -> _masks.Mask:
    """(1 or H, Lq, Lkv) -> one mask, or one per head."""
    if _masks.identical_along_first(mask):
        return _structure_of(mask[0])
    return _masks.MultiHeadMask(tuple(_structure_of(m) for m in mask))


def _reject_like_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> None:
    """What torch's SDPA itself rejects, with its own error types and messages, so that code
    written for SDPA catches what it always caught: torch's own SDPA (`_TORCH_SDPA`, never the name
    the drop-in may be assigned to) runs on meta copies of the inputs (its input checks, no
    compute). Splash's own errors are left for what SDPA serves and splash cannot. Three refusals
    torch's meta path does not make are made here: a CausalBias with is_causal (torch's CausalBias
    dispatch makes it, and that dispatch calls SDPA by the rebindable name), integer inputs (torch
    2.9's meta path accepts them) and attn_mask with is_causal (an error torch documents; its CPU
    math path computes something equal to neither mask)."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(
            "scaled_dot_product_attention(): query, key and value must be tensors, got "
            f"{', '.join(type(t).__name__ for t in tensors)}."
        )
    if isinstance(attn_mask, CausalBias) and is_causal:
        raise ValueError("CausalBias should not be used with causal=True")  # torch's CausalBias dispatch
    if not torch.compiler.is_compiling():  # under compile the fake tensors are checked by the ops
        meta = [t.detach().to("meta") for t in tensors]
        mask = None  # a CausalBias's lengths are checked by splash; its dispatch would call the drop-in
        if isinstance(attn_mask, torch.Tensor) and _is_plain(attn_mask):
            mask = attn_mask.detach().to("meta")  # other subclasses and non-tensors: refused below, by splash
        _TORCH_SDPA(*meta, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if any(not t.dtype.is_floating_point for t in tensors):
        raise RuntimeError(f"Expected query, key and value to be floating point, but got {query.dtype}.")
    if is_causal and attn_mask is not None and not isinstance(attn_mask, CausalBias):
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """torch.nn.functional.scaled_dot_product_attention through the splash kernels.

    Args:
        query: (..., Hq, Lq, D); key: (..., Hkv, Lkv, D); value: (..., Hkv, Lkv, Dv). Leading batch
            dimensions broadcast as in torch (any number, or none); float32, bfloat16 or float16.
        attn_mask: None, a bool mask (True attends) or a float mask of 0 and -inf, broadcastable to
            (..., Hq, Lq, Lkv); or a torch.nn.attention.bias.CausalBias.
        dropout_p: must be 0.0.
        is_causal: SDPA's causal mask (top-left aligned when Lq != Lkv).
        scale: defaults to 1 / sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv.

    Returns:
        (..., Hq, Lq, Dv), query's dtype.

    Raises:
        RuntimeError: for what torch's SDPA itself rejects (fewer than 2 dimensions, mixed dtypes,
            head dims or head counts that do not match, batch or mask shapes that do not broadcast,
            a mask dtype that is neither bool nor query's, attn_mask with is_causal).
        SplashConstraintError, SplashDtypeError: for what SDPA serves and splash cannot (dropout,
            a float bias that is not 0/-inf, float64, ...).
    """
    _reject_like_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if dropout_p:
        raise SplashConstraintError(
            f"dropout_p={dropout_p}: splash attention has no attention dropout. Use dropout_p=0.0 "
            "(as at eval time) or torch's SDPA."
        )
    if query.dim() == 2:  # (L, D): one head, no batch
        plain = attn_mask is not None and not isinstance(attn_mask, CausalBias) and attn_mask.dim() >= 2
        mask = attn_mask[None] if plain else attn_mask
        return scaled_dot_product_attention(query[None], key[None], value[None], mask, 0.0, is_causal, scale)[0]
    batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    if any(t.dim() > 4 or t.shape[:-3] != batch for t in (query, key, value)):
        # Any other batch layout: broadcast, flattened to one batch dimension, and back.
        flat = [t.expand(*batch, *t.shape[-3:]).reshape(-1, *t.shape[-3:]) for t in (query, key, value)]
        if attn_mask is not None and not isinstance(attn_mask, CausalBias):
            full = (*batch, query.shape[-3], query.shape[-2], key.shape[-2])
            attn_mask = attn_mask.expand(full).reshape(-1, *full[-3:])
        out = scaled_dot_product_attention(*flat, attn_mask, 0.0, is_causal, scale, enable_gqa)
        return out.reshape(*batch, *out.shape[-3:])
    if attn_mask is None:
        return attention(query, key, value, "causal" if is_causal else None, scale=scale)
    return masked_attention(query, key, value, attn_mask, scale=scale)


def masked_attention(query, key, value, attn_mask, **options):
    """`attention(query, key, value, ...)` under an SDPA-style mask tensor (bool, or float 0/-inf
    broadcastable to (B, Hq, Lq, Lkv)); `options` (scale, soft_cap) pass through to `attention`."""
    if not isinstance(attn_mask, torch.Tensor):
        raise SplashDtypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}.")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if isinstance(attn_mask, CausalBias):
        return attention(query, key, value, _causal_bias_mask(attn_mask, q_len, kv_len), **options)
    if not _is_plain(attn_mask):
        raise SplashConstraintError(
            f"attn_mask is a {type(attn_mask).__name__}, a tensor subclass that overrides torch functions: its "
            "values may not be what it means, so splash does not read them. Pass a plain bool or float tensor."
        )
    batch, heads = (query.shape[0], query.shape[1]) if query.dim() == 4 else (1, query.shape[0])
    mask = _bool_mask(attn_mask)
    try:
        mask = (
            torch.broadcast_to(mask, (batch, heads, q_len, kv_len))
            if query.dim() == 4
            else torch.broadcast_to(mask, (heads, q_len, kv_len))[None]
        )
    except RuntimeError:
        raise SplashConstraintError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, Hq, Lq, Lkv) = "
            f"{(batch, heads, q_len, kv_len)}."
        ) from None
    # Keep the broadcast head axis at size 1 when the mask does not vary over heads.
    if attn_mask.dim() < 3 or attn_mask.shape[-3] == 1:
        mask = mask[:, :1]
    if _masks.identical_along_first(mask):  # the same mask for every batch element
        return attention(query, key, value, _shared_mask(mask[0]), **options)
    # Batch-varying: key padding (a per-batch set of valid keys over one shared mask) is segment ids.
    valid = mask.any(dim=(1, 2))  # (B, Lkv)
    shared = (mask | ~valid[:, None, None, :]).all(dim=0)  # (H or 1, Lq, Lkv)
    if torch.equal(mask, shared[None] & valid[:, None, None, :]):
        q_ids = torch.ones(batch, q_len, dtype=torch.int32, device=mask.device)
        segment_ids = (q_ids, valid.to(torch.int32))
        return attention(query, key, value, _shared_mask(shared), segment_ids=segment_ids, **options)
    return torch.cat(
        [
            attention(query[b : b + 1], key[b : b + 1], value[b : b + 1], _shared_mask(mask[b]), **options)
            for b in range(batch)
        ]
    )


class _RouteSDPA(torch.overrides.TorchFunctionMode):
    """Serves torch.nn.functional.scaled_dot_product_attention calls with splash. A mode, not a
    patched attribute: calls are caught however the caller reached the function, and a fallback
    calls torch's own function with the mode off, exactly as if torch_splash were not installed
    (tensor subclasses such as CausalBias, which recognise SDPA by identity, keep working)."""

    def __init__(self):
        super().__init__()
        self.warned = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        query = args[0] if args else kwargs.get("query")
        # Meta tensors: the drop-in's own input check (_reject_like_sdpa), reached when the drop-in is
        # also assigned over torch's name; nothing splash could serve.
        if func is not _TORCH_SDPA or getattr(query, "device", None) == torch.device("meta"):
            return func(*args, **kwargs)
        try:
            return scaled_dot_product_attention(*args, **kwargs)
        except SplashError as err:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"torch_splash.route_sdpa: falling back to torch SDPA for a call splash cannot serve: {err}",
                    stacklevel=2,
                )
            return func(*args, **kwargs)


@contextlib.contextmanager
def route_sdpa():
    """A context manager that routes `torch.nn.functional.scaled_dot_product_attention` calls through
    splash, unedited models included.

    Within the block each SDPA call runs `torch_splash.scaled_dot_product_attention`; a call splash
    cannot serve (dropout, a float bias, a CUDA tensor, ...) runs torch's own SDPA instead, as if
    torch_splash were not installed, and the first such fallback warns once with the reason. Inputs
    SDPA itself rejects raise SDPA's RuntimeError.

    Yields:
        None.
    """
    with _RouteSDPA():
        yield
