"""HuggingFace transformers: `attn_implementation="splash"`.

Importing this module registers an attention function and a mask function under the name "splash"
in transformers' AttentionInterface and AttentionMaskInterface (without the mask function,
transformers hands custom attention `attention_mask=None` and causal masking is silently lost).
`patch(model)` switches a model that is already loaded.

The mask function reads the mask transformers describes (causal or bidirectional, sliding windows,
Llama 4's chunks, KV-cache offsets, packed sequences) from HF's own mask-function factories and
turns it into one structured splash mask plus segment ids for padding, packing and chunks: nothing
(Lq, Lkv)-sized is built per batch element. A mask function it does not recognise (model-specific
overlays such as image token blocks) is materialised by HF's `sdpa_mask` and served through the
SDPA drop-in's dense path.

Tested with transformers 5.24.0 (the pinned version).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

import torch_splash_jax
from torch_splash_jax import SplashConstraintError, SplashDtypeError
from torch_splash_jax import compat as _jax_compat

from . import _compat
from . import masks as _masks
from .api import attention
from .sdpa import masked_attention

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
finally:  # an older transformers than supported is named, whether its import failed or not
    _jax_compat.check_versions(("transformers",))

mu = _compat.hf_masking()

NAME = "splash"


@dataclasses.dataclass(frozen=True)
class SplashMask:
    """What the "splash" mask function hands each attention layer in place of a (B, 1, Lq, Lkv) tensor."""

    mask: _masks.Mask
    segment_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    pad_keys_to: int | None = None  # decoding: keys padded to this length (kv ids 0 there)

    # `generate` with a compileable cache (StaticCache) makes each step's mask before the forward
    # and hands it back to the model as its attention_mask: transformers reads its `ndim` (a 2-D
    # mask would be a padding mask to build from), and the mask function returns it as it is.
    ndim = 4


class _Unrecognised(Exception):
    pass


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


@dataclasses.dataclass(frozen=True)
class _Structure:
    """An HF mask function in splash terms. left/right bound how far back/forward (in positions) a
    query may look, None meaning unbounded; packed: HF's packed-sequence ids (B, L); chunk: (chunk
    size, left padding (B,), positions (B, L) or None when positions are the indices), Llama 4's
    chunked attention, whose chunks start after each row's left padding."""

    left: int | None = None
    right: int | None = None
    packed: torch.Tensor | None = None
    chunk: tuple | None = None

    def __and__(self, other: _Structure) -> _Structure:
        if (self.packed is not None and other.packed is not None) or (self.chunk and other.chunk):
            raise _Unrecognised  # two packings or two chunkings: not one set of segment ids
        return _Structure(
            _min(self.left, other.left),
            _min(self.right, other.right),
            self.packed if self.packed is not None else other.packed,
            self.chunk or other.chunk,
        )


def _read(mask_function) -> _Structure:
    """The _Structure of an HF mask function built from HF's own factories; an AND of factories
    intersects. Raises _Unrecognised otherwise."""
    if mask_function is mu.causal_mask_function:
        return _Structure(right=0)
    if mask_function is mu.bidirectional_mask_function:
        return _Structure()
    factory, cells = _compat.hf_mask_closure(mask_function)
    if factory == "sliding_window_overlay":
        return _Structure(left=cells["sliding_window"] - 1)  # HF's W keeps W tokens, self included
    if factory == "sliding_window_bidirectional_overlay":
        return _Structure(left=cells["sliding_window"], right=cells["sliding_window"])
    if factory == "chunked_overlay":
        return _Structure(chunk=(cells["chunk_size"], cells["left_padding"], None))
    if factory == "packed_sequence_mask_function":
        return _Structure(packed=cells["packed_sequence_mask"])
    if factory == "and_masks":
        structure, remapped = _Structure(), False
        for part in cells["mask_functions"]:
            part_factory, remap = _compat.hf_mask_closure(part)
            if part_factory == "remap_positions_for_packed_sequence":
                # Within one packed sequence, positions step by one exactly as indices do, so a
                # remapped relative mask equals the plain one wherever the packed-ids mask allows;
                # chunks, which are not relative, are counted in the remapped positions.
                remapped = True
                part = _read(remap["mask_function"])
                if part.chunk:
                    part = dataclasses.replace(part, chunk=(*part.chunk[:2], remap["position_ids"]))
            else:
                part = _read(part)
            structure &= part
        if remapped and structure.packed is None:
            raise _Unrecognised
        return structure
    raise _Unrecognised


def _chunk_ids(chunk, batch_size: int, length: int, offset: int, device) -> torch.Tensor:
    """(B, length) chunk index of each position: HF's (position - left padding) // chunk size."""
    size, left_padding, positions = chunk
    if positions is None:  # offset may be a tensor (a decode step's position): added, never read
        positions = (torch.arange(length, device=device) + offset).expand(batch_size, length)
    return torch.div(positions - left_padding.to(positions.device)[:, None], size, rounding_mode="floor")


def _segments(structure: _Structure, batch_size, q_length, kv_length, q_offset, kv_offset, device):
    """(q ids, kv ids): queries see only keys of their own segment (packed sequence and chunk), or
    None when nothing segments the rows."""
    if structure.packed is None and not structure.chunk:
        return None
    q_ids = kv_ids = structure.packed
    if structure.chunk:
        q_chunks = _chunk_ids(structure.chunk, batch_size, q_length, q_offset, device)
        kv_chunks = _chunk_ids(structure.chunk, batch_size, kv_length, kv_offset, device)
        if structure.packed is None:
            q_ids, kv_ids = q_chunks, kv_chunks
        else:  # one id per (sequence, chunk) pair; chunks count from 0 within each packed sequence
            per_sequence = int(max(q_chunks.max(), kv_chunks.max())) + 1
            q_ids = structure.packed.to(device) * per_sequence + q_chunks
            kv_ids = structure.packed.to(device) * per_sequence + kv_chunks
    return q_ids, kv_ids


def _window_mask(left, right, offset: int) -> _masks.Mask:
    if left is None:
        return _masks.FullMask() if right is None else _masks.CausalMask(offset + right)
    return _masks.LocalMask(left, right, offset)


def splash_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=mu.causal_mask_function,
    attention_mask=None,
    **kwargs,
):
    """The "splash" entry of AttentionMaskInterface: a SplashMask, or for a mask function it does not
    recognise, HF's dense bool mask (B, 1, Lq, Lkv)."""
    if isinstance(attention_mask, SplashMask):  # made for this step already (see SplashMask.ndim)
        return attention_mask
    try:
        structure = _read(mask_function)
    except _Unrecognised:
        kwargs.pop("allow_is_causal_skip", None)
        return mu.sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            mask_function,
            attention_mask,
            allow_is_causal_skip=False,
            **kwargs,
        )
    device = kwargs.get("device", "cpu")
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    kv_valid = None
    # Whether a mask pads anything is a host read: on torch_xla it would execute the pending graph
    # every step, and under torch.compile it is a data-dependent branch. There padding always
    # becomes segment ids.
    if padding is not None and (
        padding.device.type == "xla" or torch.compiler.is_compiling() or not bool(padding.all())
    ):
        kv_valid = padding[:, kv_offset : kv_offset + kv_length]
    if q_length == 1 and structure.packed is None:
        # A StaticCache reports the position as a tensor: it stays one, so each decode step is the
        # same program with the position as data (on torch_xla, one graph for every step).
        segments = _segments(structure, batch_size, q_length, kv_length, q_offset, kv_offset, device)
        same_segment = None if segments is None else segments[1] == segments[0]
        return _decode_mask(
            batch_size, kv_length, q_offset - kv_offset, structure.left, structure.right, same_segment, kv_valid, device
        )
    q_offset = int(q_offset)  # a prefill's mask is a structured mask, whose offset is a constant
    segments = _segments(structure, batch_size, q_length, kv_length, q_offset, kv_offset, device)
    mask = _window_mask(structure.left, structure.right, q_offset - kv_offset)
    if segments is None and kv_valid is None:
        return SplashMask(mask)
    q_ids, kv_ids = (
        segments
        if segments is not None
        else (
            torch.zeros(batch_size, q_length, dtype=torch.int32),
            torch.zeros(batch_size, kv_length, dtype=torch.int32),
        )
    )
    if kv_valid is not None:
        # Padded keys get id 0, which no query has (real ids are >= 0, shifted to >= 1). HF masks
        # keys only: a padded query row still sees the real keys its mask allows, as in eager and
        # sdpa (with right padding the next-token logits are read at such a row), and a row that
        # sees none (left padding) returns 0.
        kv_ids = torch.where(kv_valid, kv_ids.to(kv_valid.device) + 1, 0)
        q_ids = q_ids.to(kv_ids.device) + 1
    return SplashMask(mask, (q_ids.to(torch.int32), kv_ids.to(torch.int32)))


def _decode_mask(batch_size, kv_length, offset, left, right, same_segment, kv_valid, device) -> SplashMask:
    """One query per row (decoding). The keys it sees form one range, [offset - left, offset + right],
    within its own chunk if chunked (same_segment, (B, Lkv)). That and the padding become kv segment
    ids over a full mask: data, which the decode kernel reads to skip the blocks no query sees. The
    keys are padded to `torch_splash_jax.lane_padded`, so a growing cache (DynamicCache) keeps its
    shapes for 128 steps, and a StaticCache, whose length does not change, keeps them for good:
    every such step reuses one compiled program. With the offset and the key length as
    compile-time constants, each step would compile its own."""
    if isinstance(offset, torch.Tensor):
        offset = offset.to(device)
    j = torch.arange(kv_length, device=device)
    visible = torch.ones(kv_length, dtype=torch.bool, device=device)
    if left is not None:
        visible &= j >= offset - left
    if right is not None:
        visible &= j <= offset + right
    kv_ids = visible.expand(batch_size, kv_length)
    if same_segment is not None:
        kv_ids = kv_ids & same_segment.to(device)
    if kv_valid is not None:
        kv_ids = kv_ids & kv_valid
    q_ids = torch.ones(batch_size, 1, dtype=torch.int32, device=device)
    return SplashMask(
        _masks.FullMask(),
        (q_ids.to(torch.int32), kv_ids.to(torch.int32)),
        pad_keys_to=torch_splash_jax.lane_padded(kv_length),
    )


_WARNED: set[str] = set()


def _refuse_unserved(module, key, attention_mask, kwargs) -> None:
    """What transformers' sdpa adapter warns about or serves and splash cannot, said before any work:
    attention weights (output_attentions=True: sdpa warns once and returns None, and so does splash),
    an additive position bias (T5-style models: sdpa adds it to its mask; splash has no bias input),
    and a sliding window when no mask function ran (attention_mask None): the window then lives only
    in this argument, which sdpa ignores, and splash refuses rather than attend past it."""
    if kwargs.get("output_attentions") and "output_attentions" not in _WARNED:
        _WARNED.add("output_attentions")
        warnings.warn(
            "torch_splash.hf: splash attention does not compute attention weights, so output_attentions=True "
            "returns None for them (as transformers' sdpa does). Use attn_implementation='eager' to get them.",
            stacklevel=3,
        )
    if kwargs.get("position_bias") is not None:
        raise SplashConstraintError(
            f"{type(module).__name__} passes position_bias, an additive attention bias: splash attention has no "
            "input for one. Load this model with attn_implementation='sdpa' or 'eager'."
        )
    window = kwargs.get("sliding_window")
    if window is not None and attention_mask is None and key.shape[2] > window:
        raise SplashConstraintError(
            f"{type(module).__name__} passes sliding_window={window} with attention_mask=None over {key.shape[2]} "
            "keys: no mask function ran, so splash cannot tell where the window lies. Let transformers build the "
            "mask (load the model with attn_implementation='splash', or torch_splash.hf.patch(model), and pass "
            "the model's attention_mask), or use attn_implementation='sdpa'."
        )


def splash_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """The "splash" entry of AttentionInterface: query (B, Hq, Lq, D), key/value (B, Hkv, Lkv, D),
    KV heads not repeated, s_aux (Hq,) attention sinks; returns ((B, Lq, Hq, D) contiguous, None).
    Of the other keyword arguments models pass, those that change the result and that splash does
    not serve warn once (output_attentions) or raise (see `_refuse_unserved`); the rest describe
    what the mask function already read (position_ids, cache positions) or the flash kernels'
    layouts, which transformers' own sdpa adapter ignores too."""
    _refuse_unserved(module, key, attention_mask, kwargs)
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
    """Register the attention and mask functions with transformers (done for "splash" on import).

    Args:
        name: the ``attn_implementation`` name; avoid "flash", "sdpa", "flex_attention", "/" and ":",
            which transformers treats specially.
    """
    AttentionInterface.register(name, splash_attention_forward)
    AttentionMaskInterface.register(name, splash_mask)


def patch(model, name: str = NAME):
    """Switch an already-loaded model (and its sub-models) to splash attention.

    Args:
        model: a transformers `PreTrainedModel`.
        name: the attention implementation name to register and select.

    Returns:
        The same model, now running attention through splash.

    Raises:
        SplashDtypeError: `model` is not a transformers model.
    """
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise SplashDtypeError(
            f"patch() takes a transformers PreTrainedModel, got {type(model).__name__}: load the model with "
            'transformers first (or pass attn_implementation="splash" to from_pretrained / from_config).'
        )
    register(name)
    model.set_attn_implementation(name)
    return model


register()
