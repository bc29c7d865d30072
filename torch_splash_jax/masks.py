"""Every mask type in one place, and binding a mask to the kernel's padded (Lq, Lkv) grid.

The masks are defined in `structured_masks` (`Mask`, the structured families evaluated from
positions, their compositions and per-head masks) and `data_masks` (`DenseMask`,
`BlockSparseMask`); `bind` turns one into the JAX kernel's mask on the padded grid, with the padded
keys hidden. `__all__` is the JAX side's own: what its other modules take from here; users reach
the masks through `torch_splash_jax` and `torch_splash.masks`.
"""

from __future__ import annotations

import numpy as np

from . import compat
from .data_masks import DATA, BlockSparseMask, DenseMask
from .structured_masks import (
    STRUCTURED,
    And,
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    Mask,
    MultiHeadMask,
    Or,
    PrefixMask,
    leaves,
    not_a_mask,
    shared_structured_mask,
)

__all__ = [
    "DATA",
    "STRUCTURED",
    "And",
    "BlockSparseMask",
    "BoundMask",
    "CausalMask",
    "ChunkedCausalMask",
    "DenseMask",
    "FullMask",
    "LocalMask",
    "Mask",
    "MultiHeadMask",
    "Or",
    "PrefixMask",
    "bind",
    "leaves",
    "not_a_mask",
    "shared_structured_mask",
]

_splash_mask = compat.splash_modules()[1]


def bind(spec: Mask, num_heads: int, q_len_padded: int, kv_len_padded: int, kv_len: int):
    """The JAX MultiHeadMask for `spec` on the padded grid, with padded keys (j >= kv_len) hidden."""
    if isinstance(spec, MultiHeadMask):
        return _splash_mask.MultiHeadMask([_bind_one(m, q_len_padded, kv_len_padded, kv_len) for m in spec.masks])
    return _splash_mask.MultiHeadMask([_bind_one(spec, q_len_padded, kv_len_padded, kv_len)] * num_heads)


def _bind_one(spec: Mask, q_len_padded: int, kv_len_padded: int, kv_len: int) -> _splash_mask.Mask:
    if isinstance(spec, FullMask) and kv_len == kv_len_padded:
        return _splash_mask.FullMask((q_len_padded, kv_len_padded))  # no in-kernel masking at all
    if spec.computable:
        return BoundMask(spec, q_len_padded, kv_len_padded, kv_len)
    dense = spec.dense(*_call_shape(spec, q_len_padded, kv_len))
    padded = np.zeros((q_len_padded, kv_len_padded), bool)
    padded[: dense.shape[0], :kv_len] = dense
    return _splash_mask.NumpyMask(padded)


def _call_shape(spec: Mask, q_len_padded: int, kv_len: int) -> tuple[int, int]:
    """(Lq, Lkv) of the call, which a dense component fixes; Lq is not known from the padded grid."""
    for part in leaves(spec):
        if isinstance(part, DenseMask):
            return part.array.shape
    return q_len_padded, kv_len


class BoundMask(compat.computable_mask_base()):
    """A spec bound to the padded grid, with the keys at or past the real Lkv hidden.

    Hiding padded keys in the mask (rather than with segment ids) keeps them out of every softmax
    whatever segment ids the caller passes, and blocks wholly made of padding are skipped.
    """

    def __init__(self, spec, q_len_padded: int, kv_len_padded: int, kv_len: int):
        self.spec = spec
        self.kv_len = kv_len
        needs_bound = kv_len < kv_len_padded

        def mask_function(q_ids, kv_ids):
            allowed = spec.allows(q_ids, kv_ids)
            if needs_bound:
                real = kv_ids < kv_len
                allowed = real if allowed is None else allowed & real
            shape = np.broadcast_shapes(np.shape(q_ids), np.shape(kv_ids))
            if allowed is not None and np.shape(allowed) == shape:
                return allowed
            # JAX stacks the host-side blocks, so each must have the full block shape.
            full = (q_ids >= 0) & (kv_ids >= 0)
            return full if allowed is None else allowed & full

        super().__init__(shape=(q_len_padded, kv_len_padded), mask_function=mask_function)

    def _key(self):
        return (self.spec, self.shape, self.kv_len)

    def __eq__(self, other):
        return isinstance(other, BoundMask) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())
