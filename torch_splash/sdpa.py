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
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

from jax_core import SplashConstraintError, SplashDtypeError, SplashError

from . import masks as _masks
from .bridge import attention


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
    handler = getattr(type(t).__torch_function__, "__func__", None)
    return isinstance(t, torch.nn.Parameter) or handler is torch.Tensor.__torch_function__.__func__


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


def _structured(mask2d: torch.Tensor) -> _masks.Mask:
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
    if mask.shape[0] == 1 or all(torch.equal(mask[0], m) for m in mask[1:]):
        return _structured(mask[0])
    return _masks.MultiHeadMask(tuple(_structured(m) for m in mask))


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """torch.nn.functional.scaled_dot_product_attention through the splash kernels.

    Same arguments and results as torch's, for (B, H, L, D) or (H, L, D) inputs. Raises
    SplashConstraintError for what splash cannot do: dropout_p > 0, float masks that are biases
    rather than 0/-inf, attn_mask together with is_causal, or Hq != Hkv without enable_gqa.
    """
    if dropout_p:
        raise SplashConstraintError(
            f"dropout_p={dropout_p}: splash attention has no attention dropout. Use dropout_p=0.0 "
            "(as at eval time) or torch's SDPA."
        )
    if attn_mask is not None and is_causal:
        raise SplashConstraintError(
            "attn_mask and is_causal=True together: pass one of them (as torch's SDPA requires)."
        )
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
        if query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
            raise SplashConstraintError(
                f"query has {query.shape[-3]} heads and key has {key.shape[-3]}: pass enable_gqa=True "
                "for grouped-query attention (as torch's SDPA requires)."
            )
    if attn_mask is None:
        return attention(query, key, value, "causal" if is_causal else None, scale=scale)
    return masked_attention(query, key, value, attn_mask, scale=scale)


def masked_attention(query, key, value, attn_mask, **options):
    """`attention(query, key, value, ...)` under an SDPA-style mask tensor (bool, or float 0/-inf
    broadcastable to (B, Hq, Lq, Lkv)); `options` (scale, soft_cap) pass through to `attention`."""
    if not isinstance(attn_mask, torch.Tensor):
        raise SplashConstraintError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}.")
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
    if mask.shape[0] == 1 or all(torch.equal(mask[0], m) for m in mask[1:]):
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
        if func is not F.scaled_dot_product_attention:
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
    """Route `torch.nn.functional.scaled_dot_product_attention` calls through splash, unedited models
    included. A call splash cannot serve (dropout, a float bias, a CUDA tensor, ...) runs torch's own
    SDPA instead, as if torch_splash were not installed; the first fallback in the block warns once
    with the reason."""
    with _RouteSDPA():
        yield
