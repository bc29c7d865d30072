"""Shape-free mask specifications and their binding to the kernel's padded (Lq, Lkv) grid.

A spec is a frozen, hashable dataclass with `allows(q_ids, kv_ids)`: a predicate written with
operators that work on NumPy arrays (the host builds the block tables with it) and on jnp arrays
inside the Pallas kernel (partial blocks are masked in-kernel, nothing L x L is materialised).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _splash_mask


@dataclasses.dataclass(frozen=True)
class FullMask:
    """Every query sees every key."""

    def allows(self, q_ids, kv_ids):
        return None  # no constraint; `bind` adds only the padding bound

    def may_empty_rows(self) -> bool:
        return False

    def describe(self) -> str:
        return "FullMask()"


@dataclasses.dataclass(frozen=True)
class CausalMask:
    """Row i sees keys j <= i + offset.

    offset=0 is SDPA's `is_causal` (top-left aligned); offset = Lkv - Lq is the bottom-right
    alignment of KV-cache decoding, where the last query sees every key.
    """

    offset: int = 0

    def __post_init__(self):
        if isinstance(self.offset, bool) or not isinstance(self.offset, (int, np.integer)):
            from .errors import SplashConstraintError

            raise SplashConstraintError(
                f"CausalMask(offset={self.offset!r}): offset must be an int "
                "(0 for SDPA's is_causal, Lkv - Lq for bottom-right alignment)."
            )
        object.__setattr__(self, "offset", int(self.offset))

    def allows(self, q_ids, kv_ids):
        return q_ids + self.offset >= kv_ids if self.offset else q_ids >= kv_ids

    def may_empty_rows(self) -> bool:
        return self.offset < 0  # row i < -offset sees no key

    def describe(self) -> str:
        return f"CausalMask(offset={self.offset})"


def bind(spec, q_len_padded: int, kv_len_padded: int, kv_len: int) -> _splash_mask.Mask:
    """The JAX mask for `spec` on the padded grid, padded keys (j >= kv_len) hidden."""
    if isinstance(spec, FullMask) and kv_len == kv_len_padded:
        return _splash_mask.FullMask((q_len_padded, kv_len_padded))  # no in-kernel masking at all
    return BoundMask(spec, q_len_padded, kv_len_padded, kv_len)


class BoundMask(_splash_mask._ComputableMask):
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
            if not needs_bound:
                return allowed
            in_range = kv_ids < kv_len
            return in_range if allowed is None else allowed & in_range

        super().__init__(shape=(q_len_padded, kv_len_padded), mask_function=mask_function)

    def _key(self):
        return (self.spec, self.shape, self.kv_len)

    def __eq__(self, other):
        return isinstance(other, BoundMask) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())
