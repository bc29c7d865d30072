"""Masks for `torch_splash.attention`: shape-free specs, bound to (Lq, Lkv) at call time.

Structured masks skip whole blocks of work and are evaluated inside the kernel:

- `FullMask()`; `CausalMask(offset=0)`: row i sees keys j <= i + offset (`"causal"` is
  `CausalMask(0)`, SDPA's top-left `is_causal`; `offset = Lkv - Lq` is bottom-right alignment).
- `LocalMask(window_left, window_right=0, offset=0)`: i + offset - window_left <= j <=
  i + offset + window_right, None meaning unbounded. HF's `sliding_window=W` (W tokens including
  the current one) is `LocalMask(W - 1, 0)`.
- `ChunkedCausalMask(chunk_size)`: causal within chunks (Llama 4).
- `PrefixMask(n)`: every query sees the first n keys (`CausalMask() | PrefixMask(n)`: prefix LM).
- `a & b`, `a | b`: composition, as the JAX kernel's LogicalAnd / LogicalOr. Every mask composes
  with every other (per-head masks head by head; data masks as data).
- `MultiHeadMask([...])` (or a plain list): one mask per query head.

Data masks: `from_tensor(bool_tensor)` for (Lq, Lkv) or (1 or Hq, Lq, Lkv), True = attend; and
`from_mask_mod(fn)` for FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool`, evaluated
vectorised at call time. Rows that see no key return 0 with zero gradients.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_splash import _compat
from torch_splash_jax import SplashConstraintError, SplashDtypeError, policy
from torch_splash_jax.immutable import Immutable
from torch_splash_jax.masks import (
    STRUCTURED,
    BlockSparseMask,
    CausalMask,
    ChunkedCausalMask,
    DenseMask,
    FullMask,
    LocalMask,
    Mask,
    MultiHeadMask,
    PrefixMask,
    not_a_mask,
)

__all__ = [
    "CausalMask",
    "ChunkedCausalMask",
    "DenseMask",
    "FullMask",
    "LocalMask",
    "Mask",
    "MaskMod",
    "MultiHeadMask",
    "PrefixMask",
    "from_mask_mod",
    "from_tensor",
]


def from_tensor(mask: torch.Tensor) -> Mask:
    """A data mask from a bool tensor.

    Args:
        mask: bool (Lq, Lkv), (1 or Hq, Lq, Lkv) or (1, 1 or Hq, Lq, Lkv); True = attend.

    Returns:
        A mask for `torch_splash.attention` at exactly that (Lq, Lkv); its partial blocks are stored.

    Raises:
        SplashDtypeError: not a tensor, or not bool.
        SplashConstraintError: of another rank.
    """
    if not isinstance(mask, torch.Tensor):
        raise SplashDtypeError(f"from_tensor takes a bool torch.Tensor, got {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise SplashDtypeError(
            f"mask has dtype {mask.dtype}: pass a bool mask (True = attend). For SDPA-style float "
            "masks of 0 and -inf use torch_splash.scaled_dot_product_attention."
        )
    if mask.dim() == 4 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.dim() not in (2, 3):
        raise SplashConstraintError(
            f"mask has shape {tuple(mask.shape)}: expected (Lq, Lkv) or (heads, Lq, Lkv); a mask "
            "that differs across the batch goes through segment_ids or scaled_dot_product_attention."
        )
    array = mask.detach().cpu().numpy()
    if array.ndim == 2:
        return DenseMask(array)
    if identical_along_first(mask):
        return DenseMask(array[0])
    return MultiHeadMask(tuple(DenseMask(m) for m in array))


def identical_along_first(t: torch.Tensor) -> bool:
    """Whether every slice of `t` along its first axis (heads, or batch) equals the first: the test
    that collapses a per-head (or per-batch) mask into one."""
    return t.shape[0] == 1 or bool((t == t[:1]).all())


class _Deferred(Immutable):
    """A mask that exists only once the call's shapes are known (a mask_mod, or a composition with
    one). It composes with every mask under & and |, resolved at call time."""

    composes_with_masks = True  # torch_splash_jax's masks hand & and | with these over to us

    def resolve(self, batch: int, heads: int, q_len: int, kv_len: int) -> Mask:
        raise NotImplementedError

    def __and__(self, other):
        return Composed("and", self, _operand(other))

    def __rand__(self, other):
        return Composed("and", _operand(other), self)

    def __or__(self, other):
        return Composed("or", self, _operand(other))

    def __ror__(self, other):
        return Composed("or", _operand(other), self)

    __bool__ = Mask.__bool__


def _operand(value):
    if isinstance(value, (Mask, _Deferred)):
        return value
    raise not_a_mask(value)


@dataclasses.dataclass(unsafe_hash=True)
class MaskMod(_Deferred):
    """A FlexAttention-style `mask_mod(b, h, q_idx, kv_idx) -> bool`, bound at call time."""

    fn: object

    def resolve(self, batch: int, heads: int, q_len: int, kv_len: int) -> Mask:
        return _resolve_mask_mod(self.fn, batch, heads, q_len, kv_len)


@dataclasses.dataclass(unsafe_hash=True)
class Composed(_Deferred):
    """`left & right` or `left | right` where a side is resolved at call time."""

    op: str
    left: object
    right: object

    def resolve(self, batch: int, heads: int, q_len: int, kv_len: int) -> Mask:
        left, right = (
            m.resolve(batch, heads, q_len, kv_len) if isinstance(m, _Deferred) else m for m in (self.left, self.right)
        )
        return left & right if self.op == "and" else left | right


def from_mask_mod(fn) -> MaskMod:
    """A data mask from FlexAttention's `mask_mod`.

    Args:
        fn: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, evaluated once per call on broadcast
            index tensors (never a Python loop over positions).

    Returns:
        A mask that composes with every other under ``&`` and ``|``, resolved at call time.

    Raises:
        SplashDtypeError: `fn` is not callable, or at call time does not return a bool tensor.
        SplashConstraintError: at call time, it depends on b (express per-sequence structure with
            ``segment_ids``, or use ``torch_splash.flex_attention`` with a BlockMask).
    """
    if not callable(fn):
        raise SplashDtypeError(
            f"from_mask_mod takes a callable mask_mod(b, h, q_idx, kv_idx), got {type(fn).__name__}."
        )
    return MaskMod(fn)


_RESOLVED = policy.Recent(policy.MASK_MODS)


def _resolve_mask_mod(fn, batch: int, heads: int, q_len: int, kv_len: int) -> Mask:
    """fn's mask at this call. Its value depends on what fn captured as well as on fn: the traced
    code holds its captured scalars, and its captured tensors are held and compared by identity and
    in-place version. A mask_mod that cannot be traced is evaluated at every call."""
    _, captured, code = _compat.mask_mod_trace(fn, "cpu")
    if captured is None:
        return _evaluate_mask_mod(fn, batch, heads, q_len, kv_len)
    key = (fn, batch, heads, q_len, kv_len, code, tuple((id(t), _compat.tensor_version(t)) for t in captured))
    held = _RESOLVED.get(key)
    # the held tensors keep their ids from being reused while the entry lives
    if held is not None and all(a is b for a, b in zip(held[0], captured)):
        return held[1]
    return _RESOLVED.setdefault(key, (captured, _evaluate_mask_mod(fn, batch, heads, q_len, kv_len)))[1]


def _evaluate_mask_mod(fn, batch: int, heads: int, q_len: int, kv_len: int) -> Mask:
    h = torch.arange(heads).view(heads, 1, 1)
    q = torch.arange(q_len).view(1, q_len, 1)
    kv = torch.arange(kv_len).view(1, 1, kv_len)

    def evaluate(b: int) -> torch.Tensor:
        out = fn(torch.tensor(b), h, q, kv)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise SplashDtypeError(
                f"mask_mod {getattr(fn, '__name__', fn)!r} returned {type(out).__name__}"
                f"{'' if not isinstance(out, torch.Tensor) else ' of dtype ' + str(out.dtype)}: "
                "it must return a bool tensor."
            )
        return torch.broadcast_to(out, (out.shape[0] if out.dim() == 3 else 1, q_len, kv_len))

    first = evaluate(0)
    for b in range(1, batch):
        if not torch.equal(evaluate(b), first):
            raise SplashConstraintError(
                f"mask_mod {getattr(fn, '__name__', fn)!r} depends on the batch index b (batch {b} differs "
                "from batch 0): one mask serves the whole batch here. Express per-sequence structure "
                "(documents, padding) with segment_ids, or pass a BlockMask (create_block_mask(fn, B, ...)) "
                "to torch_splash.flex_attention, which serves each batch element's mask."
            )
    return from_tensor(first)


def normalize(mask, batch: int, heads: int, q_len: int, kv_len: int) -> Mask:
    """Any accepted mask argument as a torch_splash_jax Mask (checked against the call's shapes by the plan)."""
    if mask is None:
        return FullMask()
    if isinstance(mask, str):
        if mask == "causal":
            return CausalMask(0)
        raise SplashConstraintError(f"mask={mask!r}: the only string mask is 'causal' (SDPA's is_causal).")
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, _Deferred):
        return mask.resolve(batch, heads, q_len, kv_len)
    if isinstance(mask, torch.Tensor):
        return from_tensor(mask)
    if isinstance(mask, (list, tuple)):
        return MultiHeadMask(tuple(normalize(m, batch, heads, q_len, kv_len) for m in mask))
    raise SplashDtypeError(
        f"mask of type {type(mask).__name__}: pass None, 'causal', a torch_splash.masks mask, a bool "
        "tensor, from_mask_mod(fn), or a list with one mask per query head."
    )


# Every mask type a caller can pass (torch.compile treats them as constants; see _compile_constants.py).
TYPES = (*STRUCTURED, DenseMask, BlockSparseMask, MaskMod, Composed)
