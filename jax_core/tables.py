"""Block tables (the kernel's MaskInfo) for structured masks, built from block bounds in NumPy.

JAX builds MaskInfo on the host with Python loops over every block, slicing and evaluating the
mask block by block: its cost grows with L^2 (seconds at 64K, minutes at 1M). For a structured
mask we classify all blocks at once from their index bounds (`Mask.blocks`), without evaluating
the mask element by element, then lay the tables out exactly as `_process_mask` does for one
mask shared by all heads on one device: `block_mask` (0 empty, 1 partial, 2 full), `data_next`
(the next non-empty block to fetch, in grid order, wrapping), grid shrinking (fwd/dq drop empty kv
columns, dkv empty q rows) and downcasting. Time and memory grow with the number of blocks.
"""

from __future__ import annotations

import functools

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as _mask_info

from .masks import Mask


def _next_nonzero(nonzero_flat: np.ndarray, coordinate_flat: np.ndarray) -> np.ndarray:
    """For each grid step, the coordinate of the first non-empty step at or after it (wrapping)."""
    positions = np.arange(nonzero_flat.size)
    if not nonzero_flat.any():
        return np.zeros(nonzero_flat.size, np.int32)
    candidates = np.where(nonzero_flat, positions, nonzero_flat.size)
    following = np.minimum.accumulate(candidates[::-1])[::-1]
    following = np.where(following == nonzero_flat.size, np.argmax(nonzero_flat), following)
    return coordinate_flat[following].astype(np.int32)


def _shrink(block_mask: np.ndarray, data_next: np.ndarray, is_dkv: bool, width: int | None = None):
    """Keep only the non-empty blocks of each q row (each kv column for dkv), padded to the widest
    (or to `width`, when several shards' tables must share one shape)."""
    nonzero = block_mask > 0
    width = _shrunk_width(block_mask, is_dkv) if width is None else width
    if is_dkv:  # columns, padded at the front, as `_shrink_mask_info_dkv`
        cols, rows = np.nonzero(nonzero.T)
        counts = nonzero.sum(axis=0)
        rank = np.arange(cols.size) - np.searchsorted(cols, cols)
        slot = width - counts[cols] + rank
        out_shape = (width, block_mask.shape[1])
        index = (slot, cols)
    else:  # rows, padded at the back, as `_shrink_mask_info`
        rows, cols = np.nonzero(nonzero)
        rank = np.arange(rows.size) - np.searchsorted(rows, rows)
        out_shape = (block_mask.shape[0], width)
        index = (rows, rank)
    shrunk_mask = np.zeros(out_shape, np.int32)
    shrunk_next = np.zeros(out_shape, np.int32)
    shrunk_mask[index] = block_mask[rows, cols]
    shrunk_next[index] = data_next[rows, cols]
    return shrunk_mask, shrunk_next


def _shrunk_width(block_mask: np.ndarray, is_dkv: bool) -> int:
    """The most non-empty blocks in one q row (one kv column for dkv): the shrunk grid's width."""
    return int((block_mask > 0).sum(axis=0 if is_dkv else 1).max())


def _classify(spec: Mask, q_lo, q_hi, kv_len_padded: int, kv_len: int, block_kv: int) -> np.ndarray:
    """(rows, Lkv/bkv) int32 block kinds for q blocks spanning positions q_lo..q_hi (column
    vectors): 0 empty, 1 partial, 2 full; keys at or past kv_len are hidden. A block whose rows are
    not consecutive positions is classified by their hull, which can only call it partial where
    it is empty or full: still correct, the kernel masks partial blocks element by element."""
    k0 = np.arange(0, kv_len_padded, block_kv)[None, :]
    k1 = k0 + block_kv - 1
    # Padded keys: clamp each block to the real keys for `any`; a block reaching past them is not full.
    any_, all_ = spec.blocks(q_lo, q_hi, k0, np.minimum(k1, kv_len - 1))
    any_ = any_ & (k0 < kv_len)
    all_ = all_ & spec.blocks(q_lo, q_hi, k0, k1)[1] & (k1 < kv_len)
    return np.where(all_, 2, np.where(any_, 1, 0)).astype(np.int32)


def block_mask_table(spec: Mask, q_len_padded: int, kv_len_padded: int, kv_len: int, block_q: int, block_kv: int):
    """(Lq/bq, Lkv/bkv) int32: 0 empty, 1 partial, 2 full; keys at or past kv_len are hidden."""
    q0 = np.arange(0, q_len_padded, block_q)[:, None]
    return _classify(spec, q0, q0 + block_q - 1, kv_len_padded, kv_len, block_kv)


def _data_next(block_mask: np.ndarray, is_dkv: bool) -> np.ndarray:
    nq, nkv = block_mask.shape
    if is_dkv:  # the dkv grid walks (kv, q) and prefetches q blocks
        order = block_mask.T.reshape(-1) > 0
        q_coord = np.broadcast_to(np.arange(nq)[None, :], (nkv, nq)).reshape(-1)
        return _next_nonzero(order, q_coord).reshape(nkv, nq).T
    kv_coord = np.broadcast_to(np.arange(nkv)[None, :], (nq, nkv)).reshape(-1)
    return _next_nonzero(block_mask.reshape(-1) > 0, kv_coord).reshape(nq, nkv)


def _packed(block_mask, data_next, q_sequence) -> _mask_info.MaskInfo:
    return _mask_info.MaskInfo(
        data_next=_mask_info._downcast_to_small_type(np.ascontiguousarray(data_next)),
        mask_next=None,
        block_mask=_mask_info._downcast_to_small_type(np.ascontiguousarray(block_mask)),
        partial_mask_blocks=None,
        q_sequence=q_sequence,
    )


@functools.lru_cache(maxsize=64)
def mask_info(
    spec: Mask,
    q_len_padded: int,
    kv_len_padded: int,
    kv_len: int,
    block_shape: tuple[int, int],
    is_dkv: bool,
    shrink_grid: bool,
    has_mask_function: bool,
) -> _mask_info.MaskInfo:
    """The MaskInfo `_process_mask` would build for this mask on every head of one device (NumPy)."""
    block_q, block_kv = block_shape
    block_mask = block_mask_table(spec, q_len_padded, kv_len_padded, kv_len, block_q, block_kv)
    data_next = _data_next(block_mask, is_dkv)
    if shrink_grid and block_mask.any():
        block_mask, data_next = _shrink(block_mask, data_next, is_dkv)
    q_sequence = np.arange(q_len_padded, dtype=np.int32) if has_mask_function else None
    return _packed(block_mask[None], data_next[None], q_sequence)


def sharded_mask_info(
    spec: Mask,
    positions: np.ndarray,
    kv_len_padded: int,
    kv_len: int,
    block_shape: tuple[int, int],
    is_dkv: bool,
    shrink_grid: bool,
) -> _mask_info.MaskInfo:
    """One MaskInfo per query-sequence shard, stacked along a leading shard axis.

    positions (S, P): the global query position of each row of each shard. Shard s's tables are
    the ones its rows need against every key; shrunk grids are padded to the widest shard's width,
    so that one program serves every shard. q_sequence (S, P) carries the positions into the
    kernel's mask function."""
    block_q, block_kv = block_shape
    rows = positions.reshape(positions.shape[0], -1, block_q)
    tables = [
        _classify(spec, r.min(axis=1)[:, None], r.max(axis=1)[:, None], kv_len_padded, kv_len, block_kv) for r in rows
    ]
    nexts = [_data_next(t, is_dkv) for t in tables]
    if shrink_grid and any(t.any() for t in tables):
        width = max(_shrunk_width(t, is_dkv) for t in tables)
        tables, nexts = zip(*[_shrink(t, n, is_dkv, width) for t, n in zip(tables, nexts)])
    return _packed(np.stack(tables), np.stack(nexts), positions.astype(np.int32))
