"""Block tables (the kernel's MaskInfo), built in NumPy without walking every block in Python.

JAX builds MaskInfo on the host with Python loops over every block, slicing and evaluating the
mask block by block: its cost grows with L^2 (seconds at 64K, minutes at 1M). For a structured
mask we classify all blocks at once from their index bounds (`Mask.blocks`), without evaluating
the mask element by element, then lay the tables out exactly as `_process_mask` does: `block_mask`
(0 empty, 1 partial, 2 full), `data_next` (the next non-empty block to fetch, in grid order,
wrapping), grid shrinking (fwd/dq drop empty kv columns, dkv empty q rows) and downcasting.

Two kinds of tables. A structured mask shared by all heads is evaluated in the kernel by its mask
function (`mask_info`, one device; `sharded_mask_info`, every query-sequence shard). Per-head masks
and masks that are data are read from stored partial blocks (`partial_mask_info`, which evaluates
only the blocks their bounds call partial, one row of blocks at a time for data). Time and memory
grow with the number of blocks and of partial blocks.
"""

from __future__ import annotations

import functools

import numpy as np

from . import compat, policy
from .masks import Mask

_mask_info = compat.splash_modules()[2]


# Rounded partial blocks are counted from at least this many: a short mask's few distinct blocks
# vary most between packings, and 16 extra blocks cost little beside the kernel's own.
MIN_PARTIAL_BLOCKS = 16


def bucket(n: int, limit: int | None = None) -> int:
    """n rounded up to one of four sizes per doubling (a multiple of 2**(e - 2) for n in [2**e,
    2**(e + 1)); n itself below 8), at most `limit` (and never below n): shapes that change rarely,
    at most 1/4 larger than needed."""
    step = 1 << max(n.bit_length() - 3, 0)
    rounded = -(-n // step) * step
    return rounded if limit is None else min(rounded, max(limit, n))


def _next_nonzero(nonzero_flat: np.ndarray, coordinate_flat: np.ndarray) -> np.ndarray:
    """For each grid step, the coordinate of the first non-empty step at or after it (wrapping)."""
    positions = np.arange(nonzero_flat.size)
    if not nonzero_flat.any():
        return np.zeros(nonzero_flat.size, np.int32)
    candidates = np.where(nonzero_flat, positions, nonzero_flat.size)
    following = np.minimum.accumulate(candidates[::-1])[::-1]
    following = np.where(following == nonzero_flat.size, np.argmax(nonzero_flat), following)
    return coordinate_flat[following].astype(np.int32)


def _shrink(block_mask: np.ndarray, data_next: np.ndarray, is_dkv: bool, width: int | None = None, mask_next=None):
    """Keep only the non-empty blocks of each q row (each kv column for dkv), padded to the widest
    (or to `width`, when several shards' tables must share one shape). Returns the shrunk
    block_mask, data_next and mask_next (None when not given)."""
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
    shrunk = []
    for table in (block_mask, data_next, mask_next):
        if table is None:
            shrunk.append(None)
            continue
        out = np.zeros(out_shape, np.int32)
        out[index] = table[rows, cols]
        shrunk.append(out)
    return tuple(shrunk)


def _shrunk_width(block_mask: np.ndarray, is_dkv: bool) -> int:
    """The most non-empty blocks in one q row (one kv column for dkv): the shrunk grid's width."""
    return int((block_mask > 0).sum(axis=0 if is_dkv else 1).max())


def _classify(spec: Mask, q_lo, q_hi, kv_len_padded: int, kv_len: int, block_kv: int) -> np.ndarray:
    """(rows, Lkv/bkv) int32 block kinds for q blocks spanning positions q_lo..q_hi (column
    vectors): 0 empty, 1 partial, 2 full; keys at or past kv_len are hidden. A block whose rows are
    not consecutive positions is classified by their hull, which can only call it partial where
    it is empty or full: still correct, the kernel masks partial blocks element by element."""
    k0 = np.arange(0, kv_len_padded, block_kv)[None, :]
    return _kinds_between(spec, q_lo, q_hi, k0, k0 + block_kv - 1, kv_len)


def _kinds_between(spec: Mask, q0, q1, k0, k1, kv_len: int) -> np.ndarray:
    """int32 kinds (0 empty, 1 partial, 2 full) of the blocks of rows q0..q1 and keys k0..k1
    (inclusive; arrays that broadcast); keys at or past kv_len are hidden."""
    # Padded keys: clamp each block to the real keys for `any`; a block reaching past them is not full.
    any_, all_ = spec.blocks(q0, q1, k0, np.minimum(k1, kv_len - 1))
    any_ = any_ & (k0 < kv_len)
    all_ = all_ & spec.blocks(q0, q1, k0, k1)[1] & (k1 < kv_len)
    return np.where(all_, 2, np.where(any_, 1, 0)).astype(np.int32)


def block_mask_table(spec: Mask, q_len_padded: int, kv_len_padded: int, kv_len: int, block_q: int, block_kv: int):
    """(Lq/bq, Lkv/bkv) int32: 0 empty, 1 partial, 2 full; keys at or past kv_len are hidden."""
    q0 = np.arange(0, q_len_padded, block_q)[:, None]
    return _classify(spec, q0, q0 + block_q - 1, kv_len_padded, kv_len, block_kv)


# A tile kind beside block_mask_table's 0, 1 and 2 (`diagonal_tiles`).
DIAGONAL = 3


def diagonal_tiles(spec: Mask, kinds: np.ndarray, rows: int, chunk: int, kv_len: int, strip: int) -> np.ndarray:
    """Tile kinds (nq tiles, nkv tiles) of `rows` x `chunk` tiles (block_mask_table's) with each
    partial tile that is causal-shaped in strip x strip sub-blocks marked DIAGONAL: square, and
    its sub-blocks (query strip i, key strip j) empty above the diagonal (j > i), full below it
    and partial on it. The active backward runs such a tile strip by strip, key strip j against
    query strips j.. only: 5/8 of the tile's work at 4 strips, where a partial tile computes all."""
    n = rows // strip
    if rows != chunk or rows % strip or n < 2:
        return kinds
    at = np.argwhere(kinds == 1)  # (tiles, 2): tile row, tile column
    if not at.size:
        return kinds
    offsets = np.arange(n) * strip
    q0 = (at[:, 0] * rows)[:, None, None] + offsets[None, :, None]
    k0 = (at[:, 1] * chunk)[:, None, None] + offsets[None, None, :]
    sub = _kinds_between(spec, q0, q0 + strip - 1, k0, k0 + strip - 1, kv_len)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    shape = np.where(j > i, 0, np.where(j < i, 2, 1))
    diagonal = (np.broadcast_to(sub, (len(at), n, n)) == shape).all(axis=(1, 2))
    out = kinds.copy()
    out[at[diagonal, 0], at[diagonal, 1]] = DIAGONAL
    return out


def _next_in_grid(steps: np.ndarray, coordinate: np.ndarray, is_dkv: bool) -> np.ndarray:
    """For (heads, q blocks, kv blocks) tables: at each grid step, `coordinate` at the first step at
    or after it, in the kernel's grid order and wrapping, where `steps` is true. The forward and dq
    grids walk (head, q, kv); the dkv grid walks (kv, head, q)."""
    heads, nq, nkv = steps.shape
    coordinate = np.broadcast_to(coordinate, steps.shape)
    if not is_dkv:
        return _next_nonzero(steps.reshape(-1), coordinate.reshape(-1)).reshape(heads, nq, nkv)
    order = (2, 0, 1)
    flat = _next_nonzero(steps.transpose(order).reshape(-1), coordinate.transpose(order).reshape(-1))
    return flat.reshape(nkv, heads, nq).transpose(1, 2, 0)


def _data_next(block_mask: np.ndarray, is_dkv: bool) -> np.ndarray:
    """The block each grid step fetches: its own where non-empty, else the next non-empty one
    (prefetched ahead of its turn): a kv block index, or a q block index for dkv."""
    heads, nq, nkv = block_mask.shape
    coordinate = np.arange(nq)[None, :, None] if is_dkv else np.arange(nkv)[None, None, :]
    return _next_in_grid(block_mask > 0, coordinate, is_dkv)


def _packed(block_mask, data_next, q_sequence) -> _mask_info.MaskInfo:
    small = compat.downcast_to_small_type
    return compat.mask_info(
        data_next=small(np.ascontiguousarray(data_next)),
        mask_next=None,
        block_mask=small(np.ascontiguousarray(block_mask)),
        partial_mask_blocks=None,
        q_sequence=q_sequence,
    )


@functools.lru_cache(maxsize=policy.MASK_TABLES)
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
    data_next = _data_next(block_mask[None], is_dkv)[0]
    if shrink_grid and block_mask.any():
        block_mask, data_next, _ = _shrink(block_mask, data_next, is_dkv)
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
    """The tables of every query-sequence shard for a structured mask shared by all heads:
    data_next and block_mask (S, 1, q blocks, width), one slice per shard along the leading axis.

    positions (S, P): the global query position of each row of each shard. Shard s's tables are
    the ones its rows need against every key; shrunk grids are padded to the widest shard's width,
    so that one program serves every shard. q_sequence (S, P) carries the positions into the
    kernel's mask function."""
    block_q, block_kv = block_shape
    rows = positions.reshape(positions.shape[0], -1, block_q)
    tables = [
        _classify(spec, r.min(axis=1)[:, None], r.max(axis=1)[:, None], kv_len_padded, kv_len, block_kv) for r in rows
    ]
    nexts = [_data_next(t[None], is_dkv)[0] for t in tables]
    if shrink_grid and any(t.any() for t in tables):
        width = max(_shrunk_width(t, is_dkv) for t in tables)
        tables, nexts, _ = zip(*[_shrink(t, n, is_dkv, width) for t, n in zip(tables, nexts)])
    return _packed(np.stack(tables)[:, None], np.stack(nexts)[:, None], positions.astype(np.int32))


def device_block_kinds(
    spec: Mask, q_positions: np.ndarray, kv_positions: np.ndarray, kv_len: int, block_q: int, block_kv: int
) -> np.ndarray:
    """(S, q blocks, kv blocks) int32 kinds (0 empty, 1 partial, 2 full) of each of S devices'
    blocks of a structured mask, for kernels that evaluate it at global positions: q_positions
    (S, Pq) the global position of each row a device holds, kv_positions (S, Pkv) of each key
    column, the columns at or past kv_len (one device's keys) padding. Each block is classified by
    the hull of its rows' and its real keys' positions, which can only call it partial where it is
    empty or full (rows that are not consecutive positions: the balanced layout), and a block with
    padding keys is never full."""
    shards = q_positions.shape[0]
    rows = q_positions.reshape(shards, -1, block_q)
    cols = kv_positions.reshape(shards, -1, block_kv)
    real = (np.arange(kv_positions.shape[1]) < kv_len).reshape(-1, block_kv)
    some, every = real.any(axis=1), real.all(axis=1)
    k0 = np.where(some, np.where(real, cols, np.iinfo(np.int32).max).min(axis=2), 0)[:, None, :]
    k1 = np.where(some, np.where(real, cols, -1).max(axis=2), 0)[:, None, :]
    any_, all_ = spec.blocks(rows.min(axis=2)[:, :, None], rows.max(axis=2)[:, :, None], k0, k1)
    shape = (shards, rows.shape[1], cols.shape[1])
    any_, all_ = (np.broadcast_to(x, shape) for x in (np.asarray(any_) & some, np.asarray(all_) & every))
    return np.where(all_, 2, np.where(any_, 1, 0)).astype(np.int32)


def _evaluate(spec: Mask, rows: np.ndarray, cols: np.ndarray, q_len: int, kv_len: int, dense: dict) -> np.ndarray:
    """(len(rows), len(cols)) bool: the mask at global query positions `rows` and key positions
    `cols` (-1: a padding row or column, hidden; keys at or past kv_len are padding too). `dense`
    caches the (Lq, Lkv) arrays of masks that are data."""
    r, c = rows[:, None], cols[None, :]
    if spec.blockwise:
        allowed = spec.allows(r, c)
        allowed = np.ones((), bool) if allowed is None else np.asarray(allowed)
    else:
        if spec not in dense:
            dense[spec] = spec.dense(q_len, kv_len)
        allowed = dense[spec][np.clip(r, 0, q_len - 1), np.clip(c, 0, kv_len - 1)]
    real_rows, real_cols = rows >= 0, (cols >= 0) & (cols < kv_len)
    if allowed.shape == (r.size, c.size) and real_rows.all() and real_cols.all():
        return allowed  # the common case, without three more (rows, cols) temporaries
    return np.broadcast_to(allowed, (r.size, c.size)) & real_rows[:, None] & real_cols[None, :]


def _head_blocks(spec: Mask, rows: np.ndarray, cols: np.ndarray, q_len: int, kv_len: int, dense):
    """One head's block kinds (q blocks, kv blocks) for the q blocks of `rows` (q blocks,
    block_q) against the kv blocks of `cols` (kv blocks, block_kv), both global positions with -1
    for padding, and its partial blocks [(q block, kv block, bool block)] in row-major order. A
    structured mask is classified from block bounds (hulls, where positions are not consecutive)
    and only its partial blocks are evaluated; a mask that is data is evaluated one row of blocks
    at a time."""
    nq, block_q = rows.shape
    nkv, block_kv = cols.shape
    real = rows >= 0
    real_cols = (cols >= 0) & (cols < kv_len)
    partial = []
    if spec.blockwise:
        lo, hi, some = _hull(rows, real)
        k_lo, k_hi, k_some = _hull(cols, real_cols)
        any_, all_ = spec.blocks(lo[:, None], hi[:, None], k_lo[None, :], k_hi[None, :])
        any_ = np.broadcast_to(np.asarray(any_, bool), (nq, nkv)) & some[:, None] & k_some[None, :]
        whole = real.all(axis=1)[:, None] & real_cols.all(axis=1)[None, :]  # no padding row or column
        kinds = np.where(np.asarray(all_, bool) & whole, 2, np.where(any_, 1, 0)).astype(np.int32)
        for q, c in np.argwhere(kinds == 1):
            block = _evaluate(spec, rows[q], cols[c], q_len, kv_len, dense)
            if not block.any():
                kinds[q, c] = 0
            elif block.all():
                kinds[q, c] = 2
            else:
                partial.append((q, c, block))
        return kinds, partial
    kinds = np.zeros((nq, nkv), np.int32)
    for q in range(nq):
        allowed = _evaluate(spec, rows[q], cols.reshape(-1), q_len, kv_len, dense).reshape(block_q, nkv, block_kv)
        any_, all_ = allowed.any(axis=(0, 2)), allowed.all(axis=(0, 2))
        kinds[q] = np.where(all_, 2, np.where(any_, 1, 0))
        partial += [(q, c, allowed[:, c]) for c in np.flatnonzero(kinds[q] == 1)]
    return kinds, partial


def _kinds_and_ids(spec: Mask, rows, cols, q_len: int, kv_len: int, dense: dict, found: dict, blocks: list):
    """`_head_blocks`' kinds and, per partial block, the index of its contents in `blocks` (the
    distinct partial blocks so far, `found` their keys), which it extends."""
    kinds, partial = _head_blocks(spec, rows, cols, q_len, kv_len, dense)
    ids = np.zeros_like(kinds)
    for q, c, block in partial:
        key = np.packbits(block).tobytes()
        if key not in found:
            found[key] = len(blocks)
            blocks.append(block)
        ids[q, c] = found[key]
    return kinds, ids


def stored_blocks(
    heads: tuple, q_len: int, q_len_padded: int, kv_len_padded: int, kv_len: int, block_q: int, block_kv: int
):
    """A mask read from stored blocks (data, or one mask per head) as the active-block kernels take
    it: kinds (G, nq, nkv) int32 (0 empty, 1 partial, 2 full; G 1 where every head has the same
    mask, else one per head), ids (G, nq, nkv) int32, the index in `blocks` of each partial block,
    and blocks (N, block_q, block_kv) bool, the distinct partial blocks. Padding rows (at or past
    q_len) and keys (at or past kv_len) are hidden."""
    unique = list(dict.fromkeys(heads))
    rows = np.arange(q_len_padded, dtype=np.int32)
    rows = np.where(rows < q_len, rows, -1).reshape(-1, block_q)
    cols = np.arange(kv_len_padded, dtype=np.int32).reshape(-1, block_kv)
    found: dict[bytes, int] = {}
    blocks, dense = [], {}
    each = [_kinds_and_ids(spec, rows, cols, q_len, kv_len, dense, found, blocks) for spec in unique]
    order = [unique.index(h) for h in heads] if len(unique) > 1 else [0]
    kinds = np.stack([each[u][0] for u in order]).astype(np.int32)
    ids = np.stack([each[u][1] for u in order]).astype(np.int32)
    stored = np.stack(blocks) if blocks else np.zeros((0, block_q, block_kv), bool)
    return kinds, ids, stored


def _hull(positions: np.ndarray, real: np.ndarray):
    """Per block (a row of `positions`): the lowest and highest real position, and whether it has
    any (blocks without one get 0, 0)."""
    some = real.any(axis=1)
    lo = np.where(real, positions, np.iinfo(np.int32).max).min(axis=1)
    hi = np.where(real, positions, np.iinfo(np.int32).min).max(axis=1)
    return np.where(some, lo, 0), np.where(some, hi, 0), some


def partial_mask_info(
    heads: tuple,
    positions: np.ndarray,
    q_len: int,
    kv_len_padded: int,
    kv_len: int,
    block_shape: tuple[int, int],
    is_dkv: bool,
    shrink_grid: bool,
    head_shards: int = 1,
    kv_positions: np.ndarray | None = None,
    rounded: bool = False,
) -> _mask_info.MaskInfo:
    """The tables of every query-sequence shard for per-head masks and masks that are data, which
    the kernel reads from stored partial blocks (no mask function); and of a ring step, for every
    mask.

    heads: one mask per query head, every head of every head shard. positions (S, P): the global
    query position of each row of each shard, -1 for a padding row. Lays the tables out as JAX's
    `_process_mask` does with `q_seq_shards=S` and `head_shards`: data_next, mask_next and
    block_mask (S, H or 1, q blocks, width) (one table for all heads when they share a mask, whose
    grid then shrinks), each shard's and head shard's "next" steps taken in its own grid order; and
    partial_mask_blocks (N, block_q, block_kv) ((N, block_kv, block_q) for dkv), the distinct
    partial blocks of every shard and head, which mask_next indexes. Rows need not be consecutive
    positions (the balanced layout): each partial block is evaluated at its own rows. kv_positions
    (S, kv_len_padded): the global key position of each column each shard attends to, -1 for
    padding (a ring step's); default: keys 0..kv_len for every shard, the columns past it padding.
    rounded: the shrunk grid's width (at most the unshrunk one) and N (from MIN_PARTIAL_BLOCKS)
    rounded up to a `bucket`, so that masks with other contents (documents packed anew) mostly give
    tables of the same shapes, which one compiled program takes as inputs; the added grid steps are
    empty (block_mask 0), where `_shrink` pads, and mask_next never names the added blocks."""
    block_q, block_kv = block_shape
    unique = list(dict.fromkeys(heads))  # numbered in order of first use, as JAX numbers masks
    shards = positions.shape[0]
    rows = positions.reshape(shards, -1, block_q)
    if kv_positions is None:
        kv_positions = np.broadcast_to(np.arange(kv_len_padded, dtype=np.int32), (shards, kv_len_padded))
    cols = kv_positions.reshape(shards, -1, block_kv)
    nq, nkv = rows.shape[1], cols.shape[1]
    kinds = np.zeros((shards, len(unique), nq, nkv), np.int32)
    ids = np.zeros_like(kinds)
    found: dict[bytes, int] = {}
    blocks, dense = [], {}
    for u, spec in enumerate(unique):
        for s in range(shards):
            kinds[s, u], ids[s, u] = _kinds_and_ids(spec, rows[s], cols[s], q_len, kv_len, dense, found, blocks)
    if len(unique) > 1:  # one table per head
        index = [unique.index(h) for h in heads]
        kinds, ids = kinds[:, index], ids[:, index]
    groups = head_shards if kinds.shape[1] > 1 else 1
    per_group = kinds.shape[1] // groups
    data_next, mask_next = np.zeros_like(kinds), np.zeros_like(kinds)
    for s in range(shards):
        for g in range(groups):
            heads_of_group = slice(g * per_group, (g + 1) * per_group)
            data_next[s, heads_of_group] = _data_next(kinds[s, heads_of_group], is_dkv)
            mask_next[s, heads_of_group] = _next_in_grid(kinds[s, heads_of_group] == 1, ids[s, heads_of_group], is_dkv)
    if shrink_grid and kinds.shape[1] == 1 and kinds.any():
        width = max(_shrunk_width(k[0], is_dkv) for k in kinds)
        if rounded:
            width = bucket(width, kinds.shape[-2 if is_dkv else -1])
        shrunk = [_shrink(k[0], d[0], is_dkv, width, m[0]) for k, d, m in zip(kinds, data_next, mask_next)]
        kinds, data_next, mask_next = (np.stack(t)[:, None] for t in zip(*shrunk))
    partial_blocks = None
    if blocks:
        count = bucket(max(len(blocks), MIN_PARTIAL_BLOCKS)) if rounded else len(blocks)
        partial_blocks = np.zeros((count, *(blocks[0].shape[::-1] if is_dkv else blocks[0].shape)), bool)
        for i, block in enumerate(blocks):  # bool, as _evaluate gives them
            partial_blocks[i] = block.T if is_dkv else block
    small = compat.downcast_to_small_type
    return compat.mask_info(
        data_next=small(np.ascontiguousarray(data_next)),
        mask_next=small(np.ascontiguousarray(mask_next)) if blocks else None,
        block_mask=small(np.ascontiguousarray(kinds)),
        partial_mask_blocks=partial_blocks,
        q_sequence=None,
    )
