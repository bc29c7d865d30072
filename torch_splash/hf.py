"""HuggingFace transformers: `attn_implementation="splash"`.

Importing this module registers an attention function and a mask function under the name "splash"
in transformers' AttentionInterface and AttentionMaskInterface (without the mask function,
transformers hands custom attention `attention_mask=None` and causal masking is silently lost).
`patch(model)` switches a model that is already loaded.

The mask function reads the mask transformers describes (causal or bidirectional, sliding windows,
KV-cache offsets, packed sequences) from HF's own mask-function factories and turns it into one
structured splash mask plus segment ids for padding and packing: nothing (Lq, Lkv)-sized is built
per batch element. A mask function it does not recognise (model-specific overlays such as image
token blocks) is materialised by HF's `sdpa_mask` and served through the SDPA drop-in's dense path.

Tested with transformers 5.24.0 (the pinned version).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface, masking_utils as mu
from transformers.masking_utils import AttentionMaskInterface

from jax_core import SplashConstraintError

from . import masks as _masks
from .bridge import attention
from .sdpa import masked_attention

NAME = "splash"


@dataclasses.dataclass(frozen=True)
class SplashMask:
    """What the "splash" mask function hands each attention layer in place of a (B, 1, Lq, Lkv) tensor."""

    mask: _masks.Mask
    segment_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    pad_keys_to: int | None = None  # decoding: keys padded to this length (kv ids 0 there)


class _Unrecognised(Exception):
    pass


# Every closure a factory returns shares the factory's code object: that identifies it.
_AND = mu.and_masks(mu.causal_mask_function).__code__
_SLIDING = mu.sliding_window_overlay(1).__code__
_SLIDING_BIDIRECTIONAL = mu.sliding_window_bidirectional_overlay(1).__code__
_PACKED = mu.packed_sequence_mask_function(None).__code__
_REMAPPED = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None).__code__


def _cells(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _read(mask_function):
    """(left, right, packed ids) of an HF mask function built from HF's own factories.

    left/right bound how far back/forward (in absolute positions) a query may look, None meaning
    unbounded; an AND of factories intersects the bounds. Raises _Unrecognised otherwise."""
    if mask_function is mu.causal_mask_function:
        return None, 0, None
    if mask_function is mu.bidirectional_mask_function:
        return None, None, None
    code = getattr(mask_function, "__code__", None)
    cells = _cells(mask_function) if code else {}
    if code is _SLIDING:
        return cells["sliding_window"] - 1, None, None  # HF's W keeps W tokens, self included
    if code is _SLIDING_BIDIRECTIONAL:
        return cells["sliding_window"], cells["sliding_window"], None
    if code is _PACKED:
        return None, None, cells["packed_sequence_mask"]
    if code is _AND:
        left = right = packed = None
        remapped = False
        for part in cells["mask_functions"]:
            if getattr(part, "__code__", None) is _REMAPPED:
                # Within one packed sequence, positions step by one exactly as indices do, so the
                # remapped relative mask equals the plain one wherever the packed-ids mask allows.
                remapped, part = True, _cells(part)["mask_function"]
            l, r, p = _read(part)
            if p is not None and packed is not None:
                raise _Unrecognised  # two packings: not one set of segment ids
            left, right, packed = _min(left, l), _min(right, r), p if packed is None else packed
        if remapped and packed is None:
            raise _Unrecognised
        return left, right, packed
    raise _Unrecognised


def _structured(left, right, offset: int) -> _masks.Mask:
    if left is None:
        return _masks.FullMask() if right is None else _masks.CausalMask(offset + right)
    return _masks.LocalMask(left, right, offset)


def splash_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=mu.causal_mask_function,
                attention_mask=None, **kwargs):
    """The "splash" entry of AttentionMaskInterface: a SplashMask, or for a mask function it does not
    recognise, HF's dense bool mask (B, 1, Lq, Lkv)."""
    q_offset = int(q_offset)  # StaticCache layers report it as a tensor
    try:
        left, right, packed = _read(mask_function)
    except _Unrecognised:
        kwargs.pop("allow_is_causal_skip", None)
        return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                            allow_is_causal_skip=False, **kwargs)
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    kv_valid = q_valid = None
    if padding is not None and not bool(padding.all()):
        kv_valid = padding[:, kv_offset:kv_offset + kv_length]
        q_valid = mu.prepare_padding_mask(attention_mask, q_offset + q_length, 0)[:, q_offset:q_offset + q_length]
    if q_length == 1 and packed is None:
        return _decode_mask(batch_size, kv_length, q_offset - kv_offset, left, right, kv_valid, q_valid,
                            kwargs.get("device", "cpu"))
    mask = _structured(left, right, q_offset - kv_offset)
    if packed is None and kv_valid is None:
        return SplashMask(mask)
    q_ids = packed if packed is not None else torch.zeros(batch_size, q_length, dtype=torch.int32)
    kv_ids = packed if packed is not None else torch.zeros(batch_size, kv_length, dtype=torch.int32)
    if kv_valid is not None:
        # Padded keys get id 0, which no query has; padded queries get -1, which no key has: their rows are 0.
        kv_ids = torch.where(kv_valid, kv_ids.to(kv_valid.device) + 1, 0)
        q_ids = torch.where(q_valid, q_ids.to(q_valid.device) + 1, -1)
    return SplashMask(mask, (q_ids.to(torch.int32), kv_ids.to(torch.int32)))


def _decode_mask(batch_size, kv_length, offset, left, right, kv_valid, q_valid, device) -> SplashMask:
    """One query per row (decoding). The keys it sees form one range, [offset - left, offset + right];
    it and the padding become kv segment ids over a full mask, and the keys are padded to the next
    multiple of 128 (the kernel pads there anyway). So every decode step until the cache crosses
    that multiple has the same shapes and mask and reuses one compiled program; with the mask's
    offset and the key length as compile-time constants, each step would compile its own."""
    j = torch.arange(kv_length, device=device)
    visible = torch.ones(kv_length, dtype=torch.bool, device=device)
    if left is not None:
        visible &= j >= offset - left
    if right is not None:
        visible &= j <= offset + right
    kv_ids = visible.expand(batch_size, kv_length) if kv_valid is None else visible & kv_valid
    q_ids = torch.ones(batch_size, 1, dtype=torch.int32, device=device)
    if q_valid is not None:
        q_ids = torch.where(q_valid, q_ids, -1)  # a padded query sees no key: its row is 0
    return SplashMask(_masks.FullMask(), (q_ids.to(torch.int32), kv_ids.to(torch.int32)),
                      pad_keys_to=-(-kv_length // 128) * 128)


def splash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             softcap=None, s_aux=None, **kwargs):
    """The "splash" entry of AttentionInterface: query (B, Hq, Lq, D), key/value (B, Hkv, Lkv, D),
    KV heads not repeated, s_aux (Hq,) attention sinks; returns ((B, Lq, Hq, D) contiguous, None)."""
    if dropout:
        raise SplashConstraintError(
            f"{type(module).__name__} has attention dropout {dropout} in training: splash attention has no "
            "dropout. Set the config's attention_dropout to 0.0, or train with attn_implementation='sdpa'."
        )
    options = dict(scale=scaling, soft_cap=softcap, sinks=s_aux)  # s_aux: gpt-oss's attention sinks
    if isinstance(attention_mask, SplashMask):
        segment_ids = attention_mask.segment_ids
        if attention_mask.pad_keys_to is not None:
            extra = attention_mask.pad_keys_to - key.shape[2]
            key, value = (torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in (key, value))
            segment_ids = (segment_ids[0], torch.nn.functional.pad(segment_ids[1], (0, extra)))
        out = attention(query, key, value, attention_mask.mask, segment_ids=segment_ids, **options)
    elif isinstance(attention_mask, torch.Tensor):  # a mask we did not recognise, or the user's own 4-D mask
        out = masked_attention(query, key, value, attention_mask, **options)
    else:  # no mask function ran (e.g. a paged cache): SDPA's rule, as in transformers' sdpa_attention
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = attention(query, key, value, "causal" if causal and query.shape[2] > 1 else None, **options)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Register the attention and mask functions under `name` (done for "splash" on import)."""
    AttentionInterface.register(name, splash_attention_forward)
    AttentionMaskInterface.register(name, splash_mask)


def patch(model, name: str = NAME):
    """Switch an already-loaded model (and its sub-models) to splash attention; returns the model."""
    register(name)
    model.set_attn_implementation(name)
    return model


register()
