"""`Mask`, the base of every mask, and the structured masks: shape-free specifications a kernel
evaluates from positions.

A structured mask (full, causal, local, prefix, chunked, and their `&` / `|` compositions) is an
immutable, hashable dataclass with `allows(q_ids, kv_ids)`: a predicate written with operators that
work on NumPy arrays (the host builds the block tables with it) and on jnp arrays inside the Pallas
kernel (partial blocks are masked in-kernel; nothing L x L is stored). A `MultiHeadMask` holds one
mask per query head. The masks that are data are in `data_masks`; `masks` gives all of them.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from .errors import SplashConstraintError, SplashDtypeError
from .immutable import Immutable


def _check_int(owner: str, name: str, value, *, allow_none: bool = False, minimum: int | None = None):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SplashDtypeError(f"{owner}: {name}={value!r} must be an int{' or None' if allow_none else ''}.")
    if minimum is not None and value < minimum:
        raise SplashConstraintError(f"{owner}: {name}={value!r} must be >= {minimum}.")
    if abs(value) > _INT_LIMIT:
        raise SplashConstraintError(
            f"{owner}: {name}={value!r} is beyond +-2**30: the kernel adds it to int32 positions. Any value past "
            "the sequence lengths means the same as one at them, so use a smaller one."
        )
    return int(value)


_INT_LIMIT = 1 << 30


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _or(a, b):
    return None if a is None or b is None else a | b


def _floor_div(x, divisor: int):
    """x // divisor for a positive divisor, on NumPy values (the host) or traced ints (the kernel).
    In the kernel, `//` is jnp.floor_divide, whose integer lowering goes through `lax.sign`, and jax
    0.12's Mosaic lowering of `sign` asks for the target TPU's generation, which a lowering on the
    CPU does not know ("Unsupported TPU device kind: cpu"). Truncating division corrected by the
    remainder's sign is the same floor for every int and lowers without it."""
    if isinstance(x, (np.ndarray, np.generic, int)):
        return x // divisor
    from jax import lax

    quotient = lax.div(x, np.asarray(divisor, x.dtype))
    return quotient - (lax.rem(x, np.asarray(divisor, x.dtype)) < 0).astype(quotient.dtype)


class Mask(Immutable):
    """Base of every mask: `a & b` and `a | b` compose, as the JAX kernel's LogicalAnd/LogicalOr."""

    computable = True  # evaluable in-kernel from indices alone

    @property
    def blockwise(self) -> bool:
        """Whether the host can classify blocks from `blocks` and evaluate a partial block with
        `allows` on NumPy arrays (every structured mask, and masks given block by block), rather
        than reading a dense (Lq, Lkv) array."""
        return self.computable

    def allows(self, q_ids, kv_ids):
        """Bool array (broadcast of the ids) of allowed pairs, or None for "all allowed"."""
        raise NotImplementedError

    def may_empty_rows(self) -> bool:
        """False only when every query row is sure to see a key (enables the cheaper forward)."""
        return True

    def check(self, num_q_heads: int, q_len: int, kv_len: int) -> None:
        """Raise SplashConstraintError if this mask cannot describe a (num_q_heads, q_len, kv_len) call."""

    def blocks(self, q0, q1, k0, k1):
        """(any, all) allowed pair in each block of rows q0..q1 and keys k0..k1 (inclusive; arrays
        that broadcast), from the mask's structure alone. Exact for the primitive masks; for
        compositions `any` may over- and `all` under-estimate, which only costs skipped work."""
        raise NotImplementedError

    def dense(self, q_len: int, kv_len: int) -> np.ndarray:
        """The (Lq, Lkv) bool array this mask means (for tests, references and dense fallbacks)."""
        allowed = self.allows(np.arange(q_len)[:, None], np.arange(kv_len)[None, :])
        if allowed is None:
            return np.ones((q_len, kv_len), bool)
        return np.broadcast_to(allowed, (q_len, kv_len)).copy()

    def __and__(self, other):
        return _combine(And, self, other)

    def __or__(self, other):
        return _combine(Or, self, other)

    def __rand__(self, other):
        return _combine(And, other, self)

    def __ror__(self, other):
        return _combine(Or, other, self)

    def __bool__(self):
        raise SplashConstraintError("Masks have no truth value: combine them with & and |, not 'and' / 'or'.")


def not_a_mask(value) -> SplashDtypeError:
    """The refusal of a non-mask operand of & or | (the torch side's masks raise it too)."""
    return SplashDtypeError(
        f"cannot combine a mask with {type(value).__name__}: combine torch_splash.masks masks (a bool tensor "
        "goes through masks.from_tensor, a mask_mod through masks.from_mask_mod)."
    )


def _combine(op, left, right):
    """`left op right` for masks. A per-head mask combines head by head, so every composition stays
    a mask of one head each; a mask-like object of the torch side (a mask_mod, resolved at call
    time) combines through its own operators."""
    for side in (left, right):
        if getattr(side, "composes_with_masks", False) and not isinstance(side, Mask):
            return NotImplemented
        if not isinstance(side, Mask):
            raise not_a_mask(side)
    if isinstance(left, MultiHeadMask) or isinstance(right, MultiHeadMask):
        heads = [m.masks if isinstance(m, MultiHeadMask) else None for m in (left, right)]
        count = {len(h) for h in heads if h is not None}
        if len(count) > 1:
            raise SplashConstraintError(
                f"cannot combine per-head masks of {' and '.join(str(c) for c in sorted(count))} heads: they combine "
                "head by head, so their head counts must match."
            )
        (n,) = count
        left_heads, right_heads = (h if h is not None else (m,) * n for h, m in zip(heads, (left, right)))
        return MultiHeadMask(tuple(op(a, b) for a, b in zip(left_heads, right_heads)))
    return op(left, right)


@dataclasses.dataclass(unsafe_hash=True)
class FullMask(Mask):
    """Every query sees every key."""

    def allows(self, q_ids, kv_ids):
        return None

    def blocks(self, q0, q1, k0, k1):
        true = np.ones(np.broadcast_shapes(np.shape(q0), np.shape(k0)), bool)
        return true, true

    def may_empty_rows(self) -> bool:
        return False


@dataclasses.dataclass(unsafe_hash=True)
class CausalMask(Mask):
    """Row i sees keys j <= i + offset.

    offset=0 is SDPA's `is_causal` (top-left aligned); offset = Lkv - Lq is the bottom-right
    alignment of KV-cache decoding, where the last query sees every key.
    """

    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "offset", _check_int("CausalMask", "offset", self.offset))

    def allows(self, q_ids, kv_ids):
        return q_ids + self.offset >= kv_ids if self.offset else q_ids >= kv_ids

    def blocks(self, q0, q1, k0, k1):
        return k0 <= q1 + self.offset, k1 <= q0 + self.offset

    def may_empty_rows(self) -> bool:
        return self.offset < 0  # row i < -offset sees no key


@dataclasses.dataclass(unsafe_hash=True)
class LocalMask(Mask):
    """Row i sees keys j with i + offset - window_left <= j <= i + offset + window_right.

    None means unbounded on that side (the JAX kernel's definition). HF's `sliding_window=W`
    keeps W tokens including the current one: `LocalMask(W - 1, 0)`.
    """

    window_left: int | None
    window_right: int | None = 0
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(
            self, "window_left", _check_int("LocalMask", "window_left", self.window_left, allow_none=True, minimum=0)
        )
        object.__setattr__(
            self, "window_right", _check_int("LocalMask", "window_right", self.window_right, allow_none=True, minimum=0)
        )
        object.__setattr__(self, "offset", _check_int("LocalMask", "offset", self.offset))

    def allows(self, q_ids, kv_ids):
        allowed = None
        if self.window_left is not None:
            allowed = _and(allowed, kv_ids >= q_ids + (self.offset - self.window_left))
        if self.window_right is not None:
            allowed = _and(allowed, kv_ids <= q_ids + (self.offset + self.window_right))
        return allowed

    def blocks(self, q0, q1, k0, k1):
        # Row q allows [q + offset - left, q + offset + right]; these windows slide by one per row,
        # so over a block of rows they cover one contiguous range.
        shape = np.broadcast_shapes(np.shape(q0), np.shape(k0))
        any_, all_ = np.ones(shape, bool), np.ones(shape, bool)
        if self.window_left is not None:
            any_ = any_ & (k1 >= q0 + self.offset - self.window_left)
            all_ = all_ & (k0 >= q1 + self.offset - self.window_left)
        if self.window_right is not None:
            any_ = any_ & (k0 <= q1 + self.offset + self.window_right)
            all_ = all_ & (k1 <= q0 + self.offset + self.window_right)
        return any_, all_


@dataclasses.dataclass(unsafe_hash=True)
class PrefixMask(Mask):
    """Every query sees the first `length` keys: with `CausalMask() | PrefixMask(n)`, a prefix-LM
    mask (bidirectional over a prefix of n tokens, causal after it), still skipping blocks."""

    length: int

    def __post_init__(self):
        object.__setattr__(self, "length", _check_int("PrefixMask", "length", self.length, minimum=0))

    def allows(self, q_ids, kv_ids):
        return (kv_ids < self.length) & (q_ids >= 0)

    def blocks(self, q0, q1, k0, k1):
        shape = np.broadcast_shapes(np.shape(q0), np.shape(k0))
        return np.broadcast_to(k0 < self.length, shape), np.broadcast_to(k1 < self.length, shape)

    def may_empty_rows(self) -> bool:
        return self.length < 1


@dataclasses.dataclass(unsafe_hash=True)
class ChunkedCausalMask(Mask):
    """Causal attention within consecutive chunks of `chunk_size` tokens (Llama 4)."""

    chunk_size: int

    def __post_init__(self):
        object.__setattr__(
            self, "chunk_size", _check_int("ChunkedCausalMask", "chunk_size", self.chunk_size, minimum=1)
        )

    def allows(self, q_ids, kv_ids):
        c = self.chunk_size
        return (_floor_div(q_ids, c) == _floor_div(kv_ids, c)) & (q_ids >= kv_ids)

    def blocks(self, q0, q1, k0, k1):
        c = self.chunk_size
        first, last = np.maximum(q0 // c, k0 // c), np.minimum(q1 // c, k1 // c)  # shared chunks

        # A chunk strictly inside both ranges holds a causal pair; at the two end chunks, the
        # smallest key of the chunk must not exceed its largest query.
        def causal_pair_in(chunk):
            return np.maximum(k0, chunk * c) <= np.minimum(q1, chunk * c + c - 1)

        any_ = (first <= last) & ((last - first >= 2) | causal_pair_in(first) | causal_pair_in(last))
        all_ = (q0 // c == q1 // c) & (k0 // c == k1 // c) & (q0 // c == k0 // c) & (k1 <= q0)
        return any_, all_


@dataclasses.dataclass(unsafe_hash=True)
class _Composite(Mask):
    """Two masks combined elementwise by `_op` (`_merge` is the same on `allows`, where None means
    "all allowed")."""

    left: Mask
    right: Mask

    @property
    def computable(self):
        return self.left.computable and self.right.computable

    @property
    def blockwise(self):
        return self.left.blockwise and self.right.blockwise

    def allows(self, q_ids, kv_ids):
        return self._merge(self.left.allows(q_ids, kv_ids), self.right.allows(q_ids, kv_ids))

    def blocks(self, q0, q1, k0, k1):
        (any_l, all_l), (any_r, all_r) = self.left.blocks(q0, q1, k0, k1), self.right.blocks(q0, q1, k0, k1)
        return self._op(any_l, any_r), self._op(all_l, all_r)

    def check(self, num_q_heads, q_len, kv_len):
        self.left.check(num_q_heads, q_len, kv_len)
        self.right.check(num_q_heads, q_len, kv_len)

    def dense(self, q_len, kv_len):
        return self._op(self.left.dense(q_len, kv_len), self.right.dense(q_len, kv_len))


@dataclasses.dataclass(unsafe_hash=True)
class And(_Composite):
    _op = staticmethod(operator.and_)
    _merge = staticmethod(_and)


@dataclasses.dataclass(unsafe_hash=True)
class Or(_Composite):
    _op = staticmethod(operator.or_)
    _merge = staticmethod(_or)

    def may_empty_rows(self) -> bool:
        return self.left.may_empty_rows() and self.right.may_empty_rows()


@dataclasses.dataclass(unsafe_hash=True)
class MultiHeadMask(Mask):
    """One mask per query head (a tuple of masks, none of them per-head itself)."""

    masks: tuple

    def __post_init__(self):
        masks = tuple(self.masks)
        if not masks:
            raise SplashConstraintError("MultiHeadMask([]): give one mask per query head.")
        for m in masks:
            if not isinstance(m, Mask) or isinstance(m, MultiHeadMask):
                raise SplashDtypeError(f"MultiHeadMask takes masks of a single head each, got {type(m).__name__}.")
        object.__setattr__(self, "masks", masks)

    @property
    def computable(self):
        return False  # more than one unique mask: JAX stores the partial blocks

    def may_empty_rows(self) -> bool:
        return any(m.may_empty_rows() for m in self.masks)

    def check(self, num_q_heads, q_len, kv_len):
        if len(self.masks) != num_q_heads:
            raise SplashConstraintError(
                f"the per-head mask has {len(self.masks)} heads but q has {num_q_heads}: give one mask "
                "per query head (or one mask for all heads)."
            )
        for m in self.masks:
            m.check(1, q_len, kv_len)

    def dense(self, q_len, kv_len):
        return np.stack([m.dense(q_len, kv_len) for m in self.masks])


def shared_structured_mask(mask: Mask) -> Mask | None:
    """The structured mask every head shares, which the kernel evaluates from positions; None when
    heads have masks of their own or the mask is data (the kernel then reads stored blocks)."""
    heads = set(mask.masks) if isinstance(mask, MultiHeadMask) else {mask}
    shared = heads.pop() if len(heads) == 1 else None
    return shared if shared is not None and shared.computable else None


# The structured mask families: evaluated in-kernel from the indices, with int/None fields (or
# other structured masks). torch_splash registers them for torch.compile, and
# torch_splash_jax.serialization writes them as source text, from this one tuple.
STRUCTURED = (FullMask, CausalMask, LocalMask, PrefixMask, ChunkedCausalMask, And, Or, MultiHeadMask)


def leaves(spec: Mask):
    """The masks an `&` / `|` composition is made of (the mask itself when it is not one)."""
    if isinstance(spec, _Composite):
        yield from leaves(spec.left)
        yield from leaves(spec.right)
    else:
        yield spec
