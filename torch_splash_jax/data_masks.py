"""The masks that are data, bound to one (Lq, Lkv) and equal by content: `DenseMask` (a bool
array) and `BlockSparseMask` (FlexAttention's blocks: kinds and partial blocks).

Neither is evaluated from positions in the kernel: the kernel reads their stored partial blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from .errors import SplashConstraintError
from .structured_masks import Mask


@dataclasses.dataclass(eq=False)
class DenseMask(Mask):
    """A bool array (Lq, Lkv), True = attend, bound to that one shape. Equal by content."""

    array: np.ndarray
    computable = False

    def __post_init__(self):
        array = np.asarray(self.array)
        if array.dtype != np.bool_ or array.ndim != 2:
            raise SplashConstraintError(
                f"a dense mask must be a 2-D bool array (Lq, Lkv), got {array.dtype} of shape {array.shape}."
            )
        array = np.ascontiguousarray(array)
        array.setflags(write=False)
        object.__setattr__(self, "array", array)
        object.__setattr__(self, "_digest", hashlib.blake2b(array.tobytes(), digest_size=16).digest())

    @property
    def digest(self) -> str:
        """The content's hash (hex): equal masks, equal digests."""
        return self._digest.hex()

    def __eq__(self, other):
        return isinstance(other, DenseMask) and self.array.shape == other.array.shape and self._digest == other._digest

    def __hash__(self):
        return hash((self.array.shape, self._digest))

    def __repr__(self):
        return f"DenseMask(shape={self.array.shape}, allowed={int(self.array.sum())})"

    def allows(self, q_ids, kv_ids):
        raise TypeError("a DenseMask is data, not a function of the indices")

    def check(self, num_q_heads, q_len, kv_len):
        if self.array.shape != (q_len, kv_len):
            raise SplashConstraintError(
                f"the mask has shape {self.array.shape} but the call has (Lq, Lkv) = ({q_len}, {kv_len}): "
                "a tensor mask must cover exactly the queries and keys passed."
            )

    def dense(self, q_len, kv_len):
        self.check(1, q_len, kv_len)
        return self.array


@dataclasses.dataclass(eq=False)
class BlockSparseMask(Mask):
    """A mask given block by block, bound to one (Lq, Lkv): FlexAttention's BlockMask, with its
    partial blocks evaluated. Equal by content.

    kinds (Lq/bq, Lkv/bkv) int8, blocks of shape (bq, bkv) (the last of each axis may reach past
    the lengths): 0 empty, 1 partial, 2 full. partial_index (same shape) int32: the index in
    partial_blocks (N, bq, bkv) bool of each partial block's elements, -1 elsewhere. Nothing
    (Lq, Lkv)-sized is held; the host classifies the kernel's blocks from prefix sums of the kinds
    and reads partial ones by lookup (`blockwise`), and the kernel reads them from stored blocks."""

    kinds: np.ndarray
    partial_index: np.ndarray
    partial_blocks: np.ndarray
    shape: tuple
    block_shape: tuple
    computable = False
    blockwise = True

    def __post_init__(self):
        kinds = np.ascontiguousarray(self.kinds, np.int8)
        index = np.ascontiguousarray(self.partial_index, np.int32)
        blocks = np.ascontiguousarray(self.partial_blocks, np.bool_)
        shape = tuple(int(n) for n in self.shape)
        block_shape = tuple(int(n) for n in self.block_shape)
        if (
            kinds.ndim != 2
            or index.shape != kinds.shape
            or len(shape) != 2
            or len(block_shape) != 2
            or blocks.ndim != 3
            or blocks.shape[1:] != block_shape
        ):
            raise SplashConstraintError(
                f"BlockSparseMask: kinds {kinds.shape} and partial_index {index.shape} must be the same 2-D shape, "
                f"partial_blocks (N, *block_shape) (got {blocks.shape} for block_shape {block_shape}), shape (Lq, Lkv)."
            )
        if not np.array_equal(kinds == 1, index >= 0) or index.max(initial=-1) >= blocks.shape[0]:
            raise SplashConstraintError(
                "BlockSparseMask: partial_index must name a block of partial_blocks for each partial block "
                "(kind 1), and -1 for the others."
            )
        if any(-(-length // size) != count for length, size, count in zip(shape, block_shape, kinds.shape)):
            raise SplashConstraintError(
                f"BlockSparseMask: {kinds.shape} blocks of {block_shape} do not cover (Lq, Lkv) = {shape}."
            )
        for name, array in (("kinds", kinds), ("partial_index", index), ("partial_blocks", blocks)):
            array.setflags(write=False)
            object.__setattr__(self, name, array)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "block_shape", block_shape)
        digest = hashlib.blake2b(repr(block_shape).encode(), digest_size=16)
        for array in (kinds, index, blocks):
            digest.update(repr(array.shape).encode())
            digest.update(array.tobytes())
        object.__setattr__(self, "_digest", digest.digest())
        # Prefix sums of non-empty and of full blocks: any / all over a range of blocks in O(1).
        for name, table in (("_some", kinds > 0), ("_full", kinds == 2)):
            sums = np.zeros((kinds.shape[0] + 1, kinds.shape[1] + 1), np.int64)
            sums[1:, 1:] = table.cumsum(0).cumsum(1)
            object.__setattr__(self, name, sums)

    @property
    def digest(self) -> str:
        """The content's hash (hex): equal masks, equal digests."""
        return self._digest.hex()

    def __eq__(self, other):
        return isinstance(other, BlockSparseMask) and self.shape == other.shape and self._digest == other._digest

    def __hash__(self):
        return hash((self.shape, self._digest))

    def __repr__(self):
        return (
            f"BlockSparseMask(shape={self.shape}, blocks={self.block_shape}, "
            f"partial={int((self.kinds == 1).sum())}, full={int((self.kinds == 2).sum())})"
        )

    def check(self, num_q_heads, q_len, kv_len):
        if self.shape != (q_len, kv_len):
            raise SplashConstraintError(
                f"the block mask is for (Lq, Lkv) = {self.shape} but the call has ({q_len}, {kv_len}): "
                "build it with the query and key lengths of this call."
            )

    def allows(self, q_ids, kv_ids):
        q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
        rows, cols = _span(q_ids, self.shape[0], 0), _span(kv_ids, self.shape[1], 1)
        if rows is not None and cols is not None:
            return self._rectangle(rows, cols)
        inside = (q_ids >= 0) & (q_ids < self.shape[0]) & (kv_ids >= 0) & (kv_ids < self.shape[1])
        q = np.clip(q_ids, 0, self.shape[0] - 1)
        kv = np.clip(kv_ids, 0, self.shape[1] - 1)
        (bq, bkv), row, col = self.block_shape, q // self.block_shape[0], kv // self.block_shape[1]
        kind, index = self.kinds[row, col], self.partial_index[row, col]
        if self.partial_blocks.shape[0]:
            element = self.partial_blocks[np.maximum(index, 0), q % bq, kv % bkv]
        else:
            element = np.zeros(np.broadcast_shapes(q.shape, kv.shape), bool)
        return inside & ((kind == 2) | ((kind == 1) & element))

    def _rectangle(self, rows: range, cols: range) -> np.ndarray:
        """The mask over consecutive rows x consecutive columns, copied block by block (the host's
        partial blocks of the kernel: a gather per element is ten times slower)."""
        (bq, bkv), out = self.block_shape, np.zeros((len(rows), len(cols)), bool)
        for rb in range(rows.start // bq, (rows.stop - 1) // bq + 1):
            r0, r1 = max(rows.start, rb * bq), min(rows.stop, (rb + 1) * bq)
            for cb in range(cols.start // bkv, (cols.stop - 1) // bkv + 1):
                kind = self.kinds[rb, cb]
                if kind == 0:
                    continue
                c0, c1 = max(cols.start, cb * bkv), min(cols.stop, (cb + 1) * bkv)
                target = out[r0 - rows.start : r1 - rows.start, c0 - cols.start : c1 - cols.start]
                if kind == 2:
                    target[...] = True
                else:
                    block = self.partial_blocks[self.partial_index[rb, cb]]
                    target[...] = block[r0 - rb * bq : r1 - rb * bq, c0 - cb * bkv : c1 - cb * bkv]
        return out

    def _count(self, sums, r0, r1, c0, c1):
        return sums[r1 + 1, c1 + 1] - sums[r0, c1 + 1] - sums[r1 + 1, c0] + sums[r0, c0]

    def blocks(self, q0, q1, k0, k1):
        (bq, bkv), (nq, nkv) = self.block_shape, self.kinds.shape
        r0, r1 = (np.clip(np.asarray(x) // bq, 0, nq - 1) for x in (q0, q1))
        c0, c1 = (np.clip(np.asarray(x) // bkv, 0, nkv - 1) for x in (k0, k1))
        area = (r1 - r0 + 1) * (c1 - c0 + 1)
        return self._count(self._some, r0, r1, c0, c1) > 0, self._count(self._full, r0, r1, c0, c1) == area

    def dense(self, q_len, kv_len):
        self.check(1, q_len, kv_len)
        return self.allows(np.arange(q_len)[:, None], np.arange(kv_len)[None, :])


def _span(ids: np.ndarray, length: int, axis: int) -> range | None:
    """The positions as a range, when `ids` is a vector along `axis` (of a 2-D array) of consecutive
    positions inside 0..length; else None."""
    if ids.ndim != 2 or ids.shape[1 - axis] != 1 or ids.size == 0:
        return None
    flat = ids.reshape(-1)
    start = int(flat[0])
    if start < 0 or start + flat.size > length or not np.array_equal(flat, np.arange(start, start + flat.size)):
        return None
    return range(start, start + flat.size)


# The masks that are data: arrays, bound to one (Lq, Lkv), equal by content.
DATA = (DenseMask, BlockSparseMask)
