"""The project's own attention kernels: a grid over the active blocks only.

JAX's splash kernel walks a 3-D grid (heads, q blocks, the widest row's kv blocks) and idles on
the steps a row lacks; it also evaluates the mask on every block. Here each head's grid is the list
of the (q block, kv block) pairs its mask touches, row after row, made on the host from the mask's
block kinds (`active_grid`): no idle steps, and blocks wholly inside the mask run a path with no
mask work at all. Logits are kept in base 2: the caller folds log2(e) into the keys' scale (soft
cap and sinks scaled to match, `LOG2E`), so each score costs one `exp2` where `exp` would cost a
multiply and an exponent; the logsumexp handed back is in natural log. The forward holds a tile's
logits queries by keys or, per generation, transposed (`_online_softmax_transposed`); the backward
always transposed.

Tables (int32, scalar-prefetched into SMEM): per entry of a head's list, its q block, its kv block,
flags (`KIND` bits: skip, partial, full; `FIRST` and `LAST` of its row) and its tiles' kinds (2 bits
a tile: a partial block runs in tiles of block_q_sub rows and block_kv_compute keys, and a tile the
mask leaves empty runs nothing, one it fills runs without mask work; the distinct patterns of tile
kinds run as straight-line code where their code stays small, `tile_patterns`). Every q block has at
least one entry, so every output block is written (a row with no allowed key writes 0 and a
logsumexp of -inf). Heads that share one mask share one list; with per-head lists the shorter
ones end in entries that repeat their last block with nothing to do (no fetch, no work).
Segment ids make kinds data: `segment_kinds` refines the host's kinds on the device (a full block
whose rows and keys all lie in one segment stays full, one whose segments cannot meet is skipped).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import compat
from .decode_kernel import MASKED  # exp2(MASKED - m) is 0 for any real maximum m, MASKED - MASKED is 0
from .kernel_limits import LANES, SUBLANES  # row statistics: (rows, LANES), or (SUBLANES, rows) transposed
from .tables import DIAGONAL

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

SKIP, PARTIAL, FULL = 0, 1, 2  # an entry's kind: the block kinds of tables.block_mask_table
KIND = 3
FIRST, LAST = 4, 8
FRESH = 16  # the backward's: the entry is its list's first to meet its q block (`column_grid`)
FINAL = 32  # the backward's: the entry is its list's last to meet its q block
NT = (((1,), (1,)), ((), ()))  # contract the last axes: q k^T
NN = (((1,), (0,)), ((), ()))
TN = (((0,), (0,)), ((), ()))  # contract the first axes: v^T p^T
MAX_TILES = 16  # 2 bits each in one int32 table entry
# A DIAGONAL tile (`tables.diagonal_tiles`) runs in strips of this many query rows and keys.
STRIP = LANES
# A stored mask's blocks are bool, which TPU memory holds as int32. int8 would take a quarter, but
# libtpu 0.0.21 (torch_xla 2.9's) aborts the process compiling an int8 block ("Check failed:
# rem == 0" in layout.h), where 0.0.52 compiles it.
MASK_BYTES = 4


def lane_tile(x, times: int):
    """x (rows, LANES) repeated `times` along its lanes."""
    return x if times == 1 else compat.lane_repeat(x, times)


def _online_softmax(s, v, m, total, acc_ref, rows):
    """One chunk of base-2 logits s (rows, chunk) into the running row maxima m and sums
    total ((rows, LANES), returned) and the output accumulator acc_ref[rows]. total None: the
    sums are acc_ref's last LANES lanes, summed by the MXU (`with_ones`)."""
    m_next = jnp.maximum(m, s.max(axis=1)[:, None])
    alpha = jnp.exp2(m - m_next)
    p = jnp.exp2(s - lane_tile(m_next, s.shape[1] // LANES))
    if total is not None:
        total = alpha * total + lax.broadcast_in_dim(p.sum(axis=1), total.shape, (0,))
    else:
        v = with_ones(v)
    pv = lax.dot_general(p.astype(v.dtype), v, NN, preferred_element_type=jnp.float32)
    acc_ref[rows, :] = _fit_lanes(alpha, acc_ref.shape[1]) * acc_ref[rows, :] + pv
    return m_next, total


def _online_softmax_transposed(s, v, m, total, acc_ref, rows: slice):
    """`_online_softmax` of logits laid out transposed, s (keys, rows), into m and total
    ((SUBLANES, rows), every sublane alike; returned) and acc_ref[:, rows] (Dv, rows): the rows'
    statistics reduce along sublanes (vector work, none across lanes), and p^T is the MXU's
    stationary operand in out^T = v^T p^T, where p @ v at Dv 128 fills half of a 256-wide MXU
    (`Plan.forward_logits`)."""
    m_next = jnp.maximum(m, s.max(axis=0, keepdims=True))
    alpha = jnp.exp2(m - m_next)
    p = jnp.exp2(s - m_next[:1])
    total = alpha * total + p.sum(axis=0, keepdims=True)
    pv = lax.dot_general(v, p.astype(v.dtype), TN, preferred_element_type=jnp.float32)
    acc_ref[:, rows] = alpha[:1] * acc_ref[:, rows] + pv
    return m_next, total


def with_ones(v):
    """v (keys, Dv) and LANES columns of ones: p @ with_ones(v) is p @ v and, in every one of its
    last LANES lanes, the rows' sums of p. Where Dv leaves half of a 256-wide MXU's columns
    idle (v6e, v7x at Dv 128), the MXU sums the rows in those columns at no cost in its time, and
    the vector unit saves an add a logit and the cross-lane unit its row reductions
    (`Plan.row_sums`, `block_planning.SUMS_ON_MXU`). The sums are of p as rounded to v's dtype: of the weights
    p @ v multiplies."""
    return jnp.concatenate([v, jnp.ones((v.shape[0], LANES), v.dtype)], axis=1)


def _as_bool(block):
    """A stored mask's block as bool (blocks of another dtype: nonzero allows)."""
    return block if block.dtype == jnp.bool_ else block != 0


def _fit_lanes(x, width: int):
    """A lane-dense row statistic (rows, LANES) as (rows, width)."""
    if width % LANES == 0:
        return lane_tile(x, width // LANES)
    return x[:, :width] if width < LANES else x[:, :1]


def active_grid(kinds: np.ndarray, tile_kinds: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(q block, kv block, flags, tile kinds), each (G, N) int32, from block kinds (G, nq, nkv) (0
    empty, 1 partial, 2 full): each of G lists walks its non-empty blocks row after row; a row with
    none gets one entry of kind SKIP; shorter lists are padded with entries repeating their last
    block, flags 0. tile_kinds: the same kinds at tile granularity, (G, nq * R, nkv * C) for R x C
    tiles a block, packed 2 bits a tile row-major (none: zeros)."""
    lists = []
    for table in kinds:
        rows, cols, flags = [], [], []
        for i, row in enumerate(table):
            active = np.flatnonzero(row)
            if active.size == 0:
                rows.append(i), cols.append(0 if not cols else cols[-1]), flags.append(SKIP | FIRST | LAST)
                continue
            for n, j in enumerate(active):
                rows.append(i)
                cols.append(j)
                flags.append(int(row[j]) | (FIRST if n == 0 else 0) | (LAST if n == active.size - 1 else 0))
        lists.append((rows, cols, flags))
    width = max(len(rows) for rows, _, _ in lists)
    out = np.zeros((3, len(lists), width), np.int32)
    for g, entries in enumerate(lists):
        for t, values in enumerate(entries):
            out[t, g, : len(values)] = values
            out[t, g, len(values) :] = values[-1] if t < 2 else 0
    q_block, kv_block, flags = out
    sub = np.zeros_like(flags)
    if tile_kinds is not None:  # (G, nq * R, nkv * C): 2 bits a tile, row-major within the block
        g_count, nq, nkv = kinds.shape
        r_count, c_count = tile_kinds.shape[1] // nq, tile_kinds.shape[2] // nkv
        tiles = tile_kinds.reshape(g_count, nq, r_count, nkv, c_count).transpose(0, 1, 3, 2, 4)
        tiles = tiles.reshape(g_count, nq, nkv, r_count * c_count).astype(np.int64)
        packed = (tiles << (2 * np.arange(r_count * c_count))).sum(axis=-1)
        sub = packed[np.arange(g_count)[:, None], q_block, kv_block].astype(np.int32)
    return q_block, kv_block, flags, sub


def tile_patterns(grid, has_segment_ids: bool, tiles: int) -> tuple[int, ...]:
    """The distinct tile patterns (packed tile kinds) of `grid`'s partial entries, for blocks of
    `tiles` tiles, where they can run as straight-line code: one stretch a pattern, so the
    scheduler overlaps a tile's softmax with the next tile's matmuls, where a branch a tile
    serialises them (the forward at 16K causal 2.4% faster on the v5e, a 4096 window at 32K 8%,
    packed documents 3x). Only while that code is no larger than the branches' (a tile body
    without mask work and one with, each tile; with segment ids both take mask work): past it
    the kernel's code outgrew what the chip runs at speed (2 to 7 times slower on the v5e); then
    () and a branch a tile. With segment ids a full entry may turn partial on the device
    (`segment_kinds`): its pattern counts too."""
    _, _, flags, sub = (np.asarray(x) for x in grid)
    patterns = [int(p) for p in np.unique(sub[_may_be_partial(flags, has_segment_ids)])]
    kinds = [k for p in patterns for k in _unpack(p, tiles)]
    masked = sum(k in (PARTIAL, DIAGONAL) or (k == FULL and has_segment_ids) for k in kinds)
    plain = sum(k == FULL and not has_segment_ids for k in kinds)
    fits = plain + masked <= 2 * tiles and masked <= (2 if has_segment_ids else 1) * tiles
    return tuple(patterns) if fits else ()


def _patterns(straight_patterns, grid, has_segment_ids: bool, tiles: int) -> tuple[int, ...]:
    """The tile patterns a kernel runs as straight-line code: `straight_patterns` where it names
    them, else `tile_patterns` of the grid where True, else none."""
    if isinstance(straight_patterns, tuple):
        return straight_patterns
    return tile_patterns(grid, has_segment_ids, tiles) if straight_patterns else ()


def _may_be_partial(flags: np.ndarray, has_segment_ids: bool) -> np.ndarray:
    """The entries that may run a partial block: the partial ones and, with segment ids, the full
    ones (`segment_kinds` may turn them partial on the device)."""
    kind = flags & KIND
    return (kind == PARTIAL) | ((kind == FULL) & has_segment_ids)


def may_run_partial(grid, has_segment_ids: bool) -> bool:
    """Whether an entry of `grid` may run a partial block (with segment ids a full entry may turn
    partial on the device); True where the tables are program inputs, not known when the kernel is
    built. A kernel whose entries are all full carries no partial block's code, which may push its
    code past what the chip runs at speed (`tile_patterns`): with its rows summed in the MXU, the
    full mask's forward at 16K took 37.0 ms on the v5e carrying 32 tile bodies it never ran, 17.9
    without them (with the vector sums 12.7 either way)."""
    flags = grid[2]
    return not isinstance(flags, np.ndarray) or bool(_may_be_partial(flags, has_segment_ids).any())


def _unpack(pattern: int, count: int) -> list[int]:
    """The 2-bit kinds of a packed table entry's `count` tiles, in bit order."""
    return [(pattern >> (2 * i)) & KIND for i in range(count)]


def _when_pattern(patterns: tuple[int, ...], lines: int, per_line: int, kind, entry_tiles, run) -> None:
    """In a kernel: for each static tile pattern, `run(kinds)` where the entry is partial and its
    packed tile kinds `entry_tiles` are that pattern; kinds as `lines` lists of `per_line` tiles,
    in bit order."""
    for pattern in patterns:
        kinds = _unpack(pattern, lines * per_line)
        split = [kinds[i * per_line : (i + 1) * per_line] for i in range(lines)]
        pl.when((kind == PARTIAL) & (entry_tiles == pattern))(functools.partial(run, split))


def segment_kinds(q_block, kv_block, flags, q_ids, kv_ids, block_q: int, block_kv: int):
    """The flags of `active_grid` refined by segment ids q_ids (Lq,), kv_ids (Lkv,) on the device:
    a full block stays full only where its rows and keys all share one segment id, a block whose
    rows' and keys' id ranges do not meet is skipped, the rest are partial."""

    def ranges(ids, block):
        ids = ids.reshape(-1, block)
        return ids.min(axis=1), ids.max(axis=1)

    q_lo, q_hi = (r[q_block] for r in ranges(q_ids, block_q))
    kv_lo, kv_hi = (r[kv_block] for r in ranges(kv_ids, block_kv))
    kind = flags & KIND
    one_segment = (q_lo == q_hi) & (kv_lo == kv_hi) & (q_lo == kv_lo)
    apart = (q_hi < kv_lo) | (kv_hi < q_lo)
    kind = jnp.where(kind == FULL, jnp.where(one_segment, FULL, PARTIAL), kind)
    kind = jnp.where(apart, SKIP, kind)
    return (flags & ~KIND) | kind


def stored_tiles(kinds: np.ndarray, block_ids: np.ndarray, blocks: np.ndarray, rows: int, chunk: int) -> np.ndarray:
    """The tile kinds (G, nq * R, nkv * C) of a mask read from stored blocks, for `active_grid`:
    kinds (G, nq, nkv) and block_ids (G, nq, nkv) (the stored block of each partial block; see
    `tables.stored_blocks`), blocks (N, block_q, block_kv) bool, in tiles of rows x chunk."""
    g, nq, nkv = kinds.shape
    r, c = blocks.shape[1] // rows, blocks.shape[2] // chunk
    tiles = np.broadcast_to(kinds[:, :, None, :, None], (g, nq, r, nkv, c)).copy()
    if len(blocks):
        split = blocks.reshape(-1, r, rows, c, chunk)
        each = np.where(split.all(axis=(2, 4)), FULL, np.where(split.any(axis=(2, 4)), PARTIAL, SKIP))
        partial = kinds == PARTIAL
        tiles.transpose(0, 1, 3, 2, 4)[partial] = each[block_ids[partial]]
    return tiles.reshape(g, nq * r, nkv * c).astype(np.int32)


def block_index(grid, block_ids: np.ndarray) -> np.ndarray:
    """Each entry's stored block, (G, N) int32 like the grid's tables: block_ids[g, q block, kv
    block] on partial entries; an entry that reads none names the block of the last one that
    did (the first ones: the first read), so the pipeline fetches nothing new for it."""
    q_block, kv_block, flags, _ = (np.asarray(x) for x in grid)
    lists = np.arange(q_block.shape[0])[:, None] if block_ids.shape[0] > 1 else 0
    index = np.asarray(block_ids)[lists, q_block, kv_block].astype(np.int32)
    reads = (flags & KIND) == PARTIAL
    out = np.zeros_like(index)
    for g in range(index.shape[0]):
        at = np.flatnonzero(reads[g])
        if at.size:
            last = np.maximum.accumulate(np.where(reads[g], np.arange(index.shape[1]), -1))
            out[g] = index[g, np.where(last < 0, at[0], last)]
    return out


def _allowed(refs, mask, tile_kind: int, rows: slice, cols: slice, q_start, kv_start, kv_len: int, transposed: bool):
    """Which logits of a tile (the queries `rows` of its q block by the keys `cols` of its kv block;
    `transposed`: keys along sublanes, queries along lanes) the mask, the real keys and the segment
    ids allow; None where all are. refs: (mask_ref, q_ids_ref, kv_ids_ref, q_pos_ref, kv_pos_ref),
    None where absent, each laid out like the logits; a stored mask (`mask` None) is read on
    partial tiles only (a full block that segment ids made partial has no stored block). q_start,
    kv_start: the blocks' first query and key."""
    mask_ref, q_ids_ref, kv_ids_ref, q_pos_ref, kv_pos_ref = refs
    every = slice(None)

    def at(ref, queries: slice, keys: slice):
        return ref[keys, queries] if transposed else ref[queries, keys]

    def index(start, count: int, along_keys: bool):
        shape, axis = ((count, 1), 0) if along_keys == transposed else ((1, count), 1)
        return start + lax.broadcasted_iota(jnp.int32, shape, axis)

    if mask is None:
        ok = _as_bool(at(mask_ref, rows, cols)) if tile_kind == PARTIAL else None
    else:
        keys = index(kv_start + cols.start, cols.stop - cols.start, True)
        if q_pos_ref is not None:
            ok = mask.allows(at(q_pos_ref, rows, every), at(kv_pos_ref, every, cols))
        else:
            ok = mask.allows(index(q_start + rows.start, rows.stop - rows.start, False), keys)
        real = keys < kv_len
        ok = real if ok is None else ok & real
    if q_ids_ref is not None:
        same = at(q_ids_ref, rows, every) == at(kv_ids_ref, every, cols)
        ok = same if ok is None else ok & same
    return ok


def _forward_kernel(
    q_block_ref,
    kv_block_ref,
    flags_ref,
    sub_kinds_ref,
    *refs,
    mask,
    kv_len: int,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_q_sub: int | None,
    soft_cap: float | None,
    has_segment_ids: bool,
    has_positions: bool,
    has_sinks: bool,
    per_head_lists: bool,
    width: int,
    patterns: tuple[int, ...],
    any_partial: bool,
    sums_on_mxu: bool,
    transposed: bool,
):
    if mask is None:  # read from stored blocks: the fifth table names each entry's
        block_index_ref, *refs = refs
    refs = list(refs)
    sinks_ref = refs.pop(0) if has_sinks else None
    q_ref, k_ref, v_ref = refs[:3]
    refs = refs[3:]
    q_ids_ref, kv_ids_ref = (refs.pop(0), refs.pop(0)) if has_segment_ids else (None, None)
    q_pos_ref, kv_pos_ref = (refs.pop(0), refs.pop(0)) if has_positions else (None, None)
    mask_ref = refs.pop(0) if mask is None else None
    mask_refs = (mask_ref, q_ids_ref, kv_ids_ref, q_pos_ref, kv_pos_ref)
    if sums_on_mxu:  # the row sums are acc_ref's last LANES lanes
        (out_ref, lse_ref, m_ref, acc_ref), l_ref = refs, None
    else:
        out_ref, lse_ref, m_ref, l_ref, acc_ref = refs

    def get(ref, rows: slice):  # a row statistic's rows: (rows, LANES), or (SUBLANES, rows) transposed
        return ref[:, rows] if transposed else ref[rows, :]

    def put(ref, rows: slice, value):
        if transposed:
            ref[:, rows] = value
        else:
            ref[rows, :] = value

    def sums(rows):
        return None if l_ref is None else get(l_ref, rows)

    def keep(rows, m, total):
        put(m_ref, rows, m)
        if l_ref is not None:
            put(l_ref, rows, total)

    online_softmax = _online_softmax_transposed if transposed else _online_softmax
    h, n = pl.program_id(0), pl.program_id(1)
    t = (h * width if per_head_lists else 0) + n
    flags = flags_ref[t]
    kind = flags & KIND

    @pl.when((flags & FIRST) != 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, MASKED)
        if l_ref is not None:
            l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    chunks = block_kv // block_kv_compute

    def logits(rows: slice, cols: slice, tile_kind: int, masked: bool):
        """The base-2 logits of the block's queries `rows` and keys `cols` (transposed: keys by rows)."""
        q, k = q_ref[rows, :], k_ref[cols, :]
        s = lax.dot_general(*((k, q) if transposed else (q, k)), NT, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if masked:
            starts = q_block_ref[t] * block_q, kv_block_ref[t] * block_kv
            ok = _allowed(mask_refs, mask, tile_kind, rows, cols, *starts, kv_len, transposed)
            s = jnp.where(ok, s, MASKED)
        return s

    def straight(kinds: list[list[int]], masked_full: bool):
        """A block as rows of tiles of static kinds (kinds[r][c]: rows r, keys chunk c), in one
        stretch of code; a row's statistics stay values between its chunks."""
        rows_per = block_q // len(kinds)
        for r, row_kinds in enumerate(kinds):
            if not any(row_kinds):
                continue
            rows = slice(r * rows_per, (r + 1) * rows_per)
            m, total = get(m_ref, rows), sums(rows)  # every lane (sublane) alike
            for c, tile_kind in enumerate(row_kinds):
                if tile_kind == SKIP:
                    continue
                cols = slice(c * block_kv_compute, (c + 1) * block_kv_compute)
                s = logits(rows, cols, tile_kind, tile_kind == PARTIAL or masked_full)
                m, total = online_softmax(s, v_ref[cols, :], m, total, acc_ref, rows)
            keep(rows, m, total)

    def tile(r: int, c: int, tile_kind: int):
        """One tile of a partial block: rows r of block_q_sub, keys chunk c."""
        rows = slice(r * block_q_sub, (r + 1) * block_q_sub)
        cols = slice(c * block_kv_compute, (c + 1) * block_kv_compute)
        s = logits(rows, cols, tile_kind, tile_kind == PARTIAL or has_segment_ids)
        keep(rows, *online_softmax(s, v_ref[cols, :], get(m_ref, rows), sums(rows), acc_ref, rows))

    def sub_tiled():
        tiles = sub_kinds_ref[t]
        for r in range(block_q // block_q_sub):
            for c in range(chunks):
                tile_kind = (tiles >> (2 * (r * chunks + c))) & KIND
                pl.when(tile_kind == FULL)(functools.partial(tile, r, c, FULL))
                pl.when(tile_kind == PARTIAL)(functools.partial(tile, r, c, PARTIAL))

    pl.when(kind == FULL)(functools.partial(straight, [[FULL] * chunks], False))
    if any_partial and not block_q_sub:
        pl.when(kind == PARTIAL)(functools.partial(straight, [[PARTIAL] * chunks], False))
    elif any_partial:
        row_tiles = block_q // block_q_sub
        run = functools.partial(straight, masked_full=has_segment_ids)
        _when_pattern(patterns, row_tiles, chunks, kind, sub_kinds_ref[t], run)
        if not patterns:
            pl.when(kind == PARTIAL)(sub_tiled)

    @pl.when((flags & LAST) != 0)
    def _finish():
        m, acc = m_ref[...], acc_ref[...]
        if sums_on_mxu:
            total, acc = acc[:, -LANES:], acc[:, :-LANES]
        else:
            total = l_ref[...]
        if transposed:  # one sublane of each statistic serves; the output is transposed back
            m, total = m[:1], total[:1]
        if has_sinks:
            sink = sinks_ref[h]
            m_all = jnp.maximum(m, sink)
            rescale = jnp.exp2(m - m_all)
            total = rescale * total + jnp.exp2(sink - m_all)
            acc = (rescale if transposed else rescale[:, :1]) * acc
            m = m_all
        seen = m > MASKED / 2  # the row met an allowed key
        lse = jnp.where(seen, (m + jnp.log2(total)) * LN2, -jnp.inf)
        if transposed:
            out = jnp.where(seen, acc / total, 0.0).T
        else:
            out = jnp.where(seen[:, :1], acc / total[:, :1], 0.0)
            lse = lse.T[:1]
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse


# The TPU compiler's instruction schedulers a kernel may ask for: its default, or the LP scheduler
# (the compiler's own flag), which packs the softmax's vector work differently: per generation,
# one or the other schedules the active kernels in fewer bundles (block_planning.LP_SCHEDULER).
SCHEDULER_FLAGS = {"default": None, "lp": {"XLA_TPU_FORCE_LP_LLO_SCHEDULER": True}}


def compiler_params(vmem_limit: int, scheduler: str):
    """An active kernel's Mosaic parameters: its grid's parallel and reduction axes, its VMEM limit,
    and the scheduler's flags."""
    if scheduler not in SCHEDULER_FLAGS:
        raise ValueError(f"scheduler={scheduler!r}: expected one of {sorted(SCHEDULER_FLAGS)}")
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit,
        flags=SCHEDULER_FLAGS[scheduler],
    )


def vmem_bytes(
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    stored_mask: bool = False,
) -> int:
    """The scoped VMEM the forward asks for: its double-buffered blocks (a stored mask's block
    too), its scratch and the float32 logits and probabilities of a chunk (a few copies live at
    once), twice over for the compiler's own temporaries, at least the 16 MiB TPUs give by
    default and at most v7x's 64 MiB."""
    blocks = 2 * itemsize * (block_q * (head_dim + head_dim_v) + block_kv * (head_dim + head_dim_v))
    blocks += 2 * MASK_BYTES * block_q * block_kv if stored_mask else 0
    scratch = 4 * block_q * (2 * LANES + head_dim_v) + 2 * 4 * 8 * block_q
    logits = 3 * 4 * block_q * block_kv_compute
    return int(min(64 << 20, max(16 << 20, 2 * (blocks + scratch + logits))))


def forward(
    q,
    k,
    v,
    grid,
    *,
    mask,
    kv_len: int,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_q_sub: int | None = None,
    soft_cap: float | None = None,
    segment_ids=None,
    positions=None,
    sinks=None,
    stored_mask=None,
    vmem_limit: int | None = None,
    straight_patterns: bool | tuple[int, ...] = True,
    sums_on_mxu: bool = False,
    transposed: bool = False,
    scheduler: str = "default",
    interpret: bool = False,
):
    """Attention over the active blocks: q (Hq, Lq, D), k (Hkv, Lkv, D) scaled by the softmax scale
    times LOG2E, v (Hkv, Lkv, Dv), lengths multiples of the blocks; `grid` the tables of
    `active_grid` (one list shared by every head, or one per head), segment_ids (q_ids (Lq,),
    kv_ids (Lkv,)) int32, sinks (Hq,) float32 in base 2. `mask` (a structured mask of
    `structured_masks`) is evaluated on partial blocks only, with keys at or past kv_len hidden, at
    the rows' and keys' own indices or, given positions (q_positions (Lq,), kv_positions (Lkv,))
    int32, at those (a device's shard of a sequence: `tables.device_block_kinds` gives its kinds);
    soft_cap in base 2 (the natural cap times LOG2E). stored_mask: (block_index (G, N) of
    `block_index`, blocks (M, block_q, block_kv) bool, or (M, block_kv, block_q) `transposed`) for a
    mask read from stored blocks instead (`mask` None; the grid's tile kinds from `stored_tiles`).
    straight_patterns: partial blocks run their tile patterns as straight-line code where
    `tile_patterns` allows (False: a branch a tile, always; a tuple: those patterns, found on the host
    where the grid is a program input). sums_on_mxu: the rows' sums of probabilities computed by the
    MXU (`with_ones`). transposed: each tile's logits laid out keys by queries
    (`_online_softmax_transposed`; its rows summed on the vector unit).
    scheduler: the TPU compiler's instruction scheduler for the kernel (`compiler_params`).
    Returns out (Hq, Lq, Dv) in q's dtype and the
    logsumexp (Hq, Lq) float32, natural log, -inf on rows with no allowed key (their output 0)."""
    num_heads, q_len, head_dim = q.shape
    kv_heads, _, head_dim_v = v.shape
    group = num_heads // kv_heads
    if transposed and sums_on_mxu:
        raise ValueError("transposed logits sum their rows on the vector unit: sums_on_mxu must be False")
    if stored_mask is not None:  # a stored block is read tile by tile: one tile at least
        block_q_sub = block_q_sub or block_q
    tiles = (block_q // block_q_sub) * (block_kv // block_kv_compute) if block_q_sub else 0
    if tiles > MAX_TILES:
        raise ValueError(f"{block_q}x{block_kv} blocks in {block_q_sub}x{block_kv_compute} tiles: at most {MAX_TILES}")
    if vmem_limit is None:
        vmem_limit = vmem_bytes(
            block_q, block_kv, block_kv_compute, head_dim, head_dim_v, q.dtype.itemsize, stored_mask is not None
        )
    q_block, kv_block, flags, sub_kinds = grid
    per_head_lists = q_block.shape[0] > 1
    width = q_block.shape[1]
    patterns = _patterns(straight_patterns, grid, segment_ids is not None, tiles) if tiles else ()
    if segment_ids is not None:
        flags = segment_kinds(q_block, kv_block, flags, *segment_ids, block_q, block_kv)
    tables = [jnp.asarray(x).reshape(-1) for x in (q_block, kv_block, flags, sub_kinds)]
    if stored_mask is not None:
        tables.append(jnp.asarray(stored_mask[0]).reshape(-1))

    def entry(h, n):
        return (h * width if per_head_lists else 0) + n

    def q_map(h, n, qb, kb, *_):
        return h, qb[entry(h, n)], 0

    def kv_map(h, n, qb, kb, *_):
        # not `//`: its floor-division lowering asks for the TPU's generation, which an export
        # without a TPU does not have (jax 0.12); heads are >= 0, so truncation is the same
        return lax.div(h, np.int32(group)), kb[entry(h, n)], 0

    def lse_map(h, n, qb, kb, *_):
        return h, 0, qb[entry(h, n)]

    in_specs, inputs = [], []
    if sinks is not None:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        inputs.append(sinks.astype(jnp.float32))
    in_specs += [
        pl.BlockSpec((None, block_q, head_dim), q_map),
        pl.BlockSpec((None, block_kv, head_dim), kv_map),
        pl.BlockSpec((None, block_kv, head_dim_v), kv_map),
    ]
    inputs += [q, k, v]

    def q_rows_map(h, n, qb, kb, *_):
        return (0, qb[entry(h, n)]) if transposed else (qb[entry(h, n)], 0)

    def kv_columns_map(h, n, qb, kb, *_):
        return (kb[entry(h, n)], 0) if transposed else (0, kb[entry(h, n)])

    # segment ids, then positions: a value per row and per key, laid out as the logits (rows along
    # sublanes, keys along lanes; transposed, the other way)
    q_shape, kv_shape = ((1, block_q), (block_kv, 1)) if transposed else ((block_q, 1), (1, block_kv))
    for pair in (segment_ids, positions):
        if pair is not None:
            in_specs += [pl.BlockSpec(q_shape, q_rows_map), pl.BlockSpec(kv_shape, kv_columns_map)]
            q_ids, kv_ids = pair[0].reshape(-1, 1), pair[1].reshape(1, -1)
            if transposed:
                q_ids, kv_ids = q_ids.T, kv_ids.T
            inputs += [q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)]
    if stored_mask is not None:

        def mask_map(h, n, qb, kb, fl, sk, index):
            return index[entry(h, n)], 0, 0

        block = (block_kv, block_q) if transposed else (block_q, block_kv)
        in_specs.append(pl.BlockSpec((None, *block), mask_map))
        inputs.append(jnp.asarray(stored_mask[1]))
    body = functools.partial(
        _forward_kernel,
        mask=mask,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv_compute,
        block_q_sub=block_q_sub,
        soft_cap=soft_cap,
        has_segment_ids=segment_ids is not None,
        has_positions=positions is not None,
        has_sinks=sinks is not None,
        per_head_lists=per_head_lists,
        width=width,
        patterns=patterns,
        any_partial=may_run_partial(grid, segment_ids is not None),
        sums_on_mxu=sums_on_mxu,
        transposed=transposed,
    )
    # the rows' maxima and sums (none with sums_on_mxu), and the output (its sums' lanes too)
    stats = (SUBLANES, block_q) if transposed else (block_q, LANES)
    acc = (head_dim_v, block_q) if transposed else (block_q, head_dim_v + LANES * sums_on_mxu)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tables),
        grid=(num_heads, width),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_q, head_dim_v), q_map), pl.BlockSpec((None, 1, block_q), lse_map)],
        scratch_shapes=[pltpu.VMEM(stats, jnp.float32)] * (1 if sums_on_mxu else 2) + [pltpu.VMEM(acc, jnp.float32)],
    )
    call = pl.pallas_call(
        body,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((num_heads, q_len, head_dim_v), q.dtype),
            jax.ShapeDtypeStruct((num_heads, 1, q_len), jnp.float32),
        ],
        compiler_params=compiler_params(vmem_limit, scheduler),
        interpret=interpret,
        name="active_forward",
    )
    call = compat.named_kernel_call(call, "active_forward")
    out, lse = call(*tables, *inputs)
    return out, lse[:, 0]


def column_grid(kinds: np.ndarray, tile_kinds: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """`active_grid` walked kv block after kv block (the backward's order): (q block, kv block,
    flags, tile kinds), FIRST and LAST marking a kv block's first and last entries, a kv block with
    no rows one entry of kind SKIP (its dk and dv are 0), FRESH and FINAL each list's first and last
    entry to meet its q block; tile (q rows r, keys c) of R x C tiles at bits 2 * (c * R + r)."""
    tiles = None if tile_kinds is None else tile_kinds.transpose(0, 2, 1)
    kv_block, q_block, flags, sub = active_grid(kinds.transpose(0, 2, 1), tiles)
    for g in range(q_block.shape[0]):
        real = np.flatnonzero(flags[g])  # padding entries have no flags
        first = np.unique(q_block[g, real], return_index=True)[1]
        last = len(real) - 1 - np.unique(q_block[g, real[::-1]], return_index=True)[1]
        flags[g, real[first]] |= FRESH
        flags[g, real[last]] |= FINAL
    return q_block, kv_block, flags, sub


def meets_every_q_block(grid, q_blocks: int) -> bool:
    """Whether each list of a backward grid (host tables) meets every one of q_blocks q blocks:
    then each q block's dq is first written at its FRESH entry, and needs no zeros beforehand, and
    finished at its FINAL one."""
    q_block, _, flags, _ = grid
    if not all(isinstance(t, np.ndarray) for t in (q_block, flags)):
        return False  # a stored mask's tables are the program's inputs
    return all(len(np.unique(q_block[g, flags[g] != 0])) == q_blocks for g in range(q_block.shape[0]))


def _backward_kernel(
    q_block_ref,
    kv_block_ref,
    flags_ref,
    sub_kinds_ref,
    *refs,
    mask,
    kv_len: int,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_q_sub: int,
    soft_cap: float | None,
    has_segment_ids: bool,
    group: int,
    steps: int,
    q_len: int,
    patterns: tuple[int, ...],
    any_partial: bool,
    per_head_lists: bool,
    dk_scale: float,
    fresh: bool,
    finish: bool,
    has_positions: bool,
    adds_kv: bool,
):
    if mask is None:  # read from stored blocks: the fifth table names each entry's
        block_index_ref, *refs = refs
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
    refs = refs[6:]
    q_ids_ref, kv_ids_ref = (refs.pop(0), refs.pop(0)) if has_segment_ids else (None, None)
    q_pos_ref, kv_pos_ref = (refs.pop(0), refs.pop(0)) if has_positions else (None, None)
    mask_ref = refs.pop(0) if mask is None else None
    # dk_in, dv_in: the sums dk and dv add into (their outputs alias them)
    dk_in, dv_in = (refs.pop(0), refs.pop(0)) if adds_kv else (None, None)
    if not fresh:  # dq_hbm aliases this input: what dq adds into
        refs = refs[1:]
    if finish:  # dq_done: each q block's dq in q's dtype, written at its FINAL step from dq_stage
        dk_ref, dv_ref, dq_hbm, dq_done, dk_acc, dv_acc, dq_slots, dq_stage, sems, state = refs
    else:
        dk_ref, dv_ref, dq_hbm, dk_acc, dv_acc, dq_slots, sems, state = refs
    h, n = pl.program_id(0), pl.program_id(1)

    def entry(m):
        """Step m's entry of the tables and its query head (with a list per query head, the
        grid's first axis is the query head and `group` 1)."""
        if per_head_lists:
            return h * steps + m, h
        e = lax.div(m, np.int32(group))
        return e, h * group + (m - e * group)

    e, qh = entry(n)
    flags = flags_ref[e]
    kind = flags & KIND
    first_of_column = ((flags & FIRST) != 0) & (qh == h * group)
    last_of_column = ((flags & LAST) != 0) & (qh == h * group + group - 1)

    # dq accumulates in place in HBM (the float32 dq_hbm): each step reads its q block's dq into one
    # of three VMEM slots, adds its share and writes it back, the read of the next step's block and
    # the write of the last one's in flight while this one computes. A step whose block is the one
    # before's keeps the slot; one whose block is the step before last's waits for that block's
    # write before reading it. With `fresh`, a block's first step (FRESH) zeroes its slot instead
    # of reading: dq_hbm is then written before it is read, and needs no zeros beforehand. With
    # `finish`, a block's last step (FINAL) writes it to dq_done in q's dtype, scaled to natural
    # log, instead: no pass over a float32 dq after the kernel (192 MiB at 16K tokens, 16 heads).
    # state[1]: the write in flight, the step before's: 1 to dq_hbm, 2 to dq_done, 0 none; state[2]:
    # whether this block's steps include its FINAL one.
    def key(m):
        e, qh = entry(jnp.clip(m, 0, steps - 1))
        return qh, q_block_ref[e]

    def same(a, b):
        (ha, qa), (hb, qb) = key(a), key(b)
        return (ha == hb) & (qa == qb)

    def dq_rows(m):
        """Step m's q block: its rows of dq_hbm and dq_done (query heads x q_len)."""
        qh, qb = key(m)
        return pl.ds(pl.multiple_of(qh * q_len + qb * block_q, SUBLANES), block_q)

    def dq_copy(slot, m, read: bool):
        hbm = dq_hbm.at[dq_rows(m), :]
        vmem = dq_slots.at[pl.ds(pl.multiple_of(slot * block_q, block_q), block_q), :]
        src, dst = (hbm, vmem) if read else (vmem, hbm)
        return pltpu.make_async_copy(src, dst, sems.at[0 if read else 1])

    def done_copy(m):
        return pltpu.make_async_copy(dq_stage, dq_done.at[dq_rows(m), :], sems.at[1])

    def flagged(m, flag: int):
        return (flags_ref[entry(jnp.clip(m, 0, steps - 1))[0]] & flag) != 0

    def unread(m):
        """Whether step m's block starts from zeros rather than from dq_hbm."""
        return flagged(m, FRESH) if fresh else False

    def wait_written(slot, m):
        """Wait for the write step m started from `slot` (the state says where to)."""
        pl.when(state[1] == 1)(lambda: dq_copy(slot, m, read=False).wait())
        if finish:
            pl.when(state[1] == 2)(lambda: done_copy(m).wait())
        state[1] = 0

    is_new = (n == 0) | jnp.logical_not(same(n, n - 1))
    next_new = (n + 1 < steps) & jnp.logical_not(same(n + 1, n))

    @pl.when(n == 0)
    def _start():
        state[0], state[1], state[2] = 0, 0, 0

    @pl.when((n == 0) & jnp.logical_not(unread(n)))
    def _first_read():
        dq_copy(0, n, read=True).start()

    cur = lax.rem(state[0], np.int32(3))

    @pl.when(is_new & jnp.logical_not(unread(n)))
    def _arrived():
        dq_copy(cur, n, read=True).wait()

    @pl.when(is_new & unread(n))
    def _zeros():
        dq_slots[pl.ds(pl.multiple_of(cur * block_q, block_q), block_q), :] = jnp.zeros(
            (block_q, dq_slots.shape[1]), jnp.float32
        )

    @pl.when(next_new & (n > 0) & same(n + 1, n - 1) & (state[1] == 1))
    def _written_before_read():
        dq_copy(lax.rem(cur + 2, np.int32(3)), n - 1, read=False).wait()
        state[1] = 0

    @pl.when(next_new & jnp.logical_not(unread(n + 1)))
    def _prefetch():
        dq_copy(lax.rem(cur + 1, np.int32(3)), n + 1, read=True).start()

    @pl.when(first_of_column)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    mask_refs = (mask_ref, q_ids_ref, kv_ids_ref, q_pos_ref, kv_pos_ref)

    def allowed(rows: slice, cols: slice, tile_kind: int):
        """Which logits, the block's keys `cols` (rows) by its queries `rows` (lanes), are allowed."""
        starts = q_block_ref[e] * block_q, kv_block_ref[e] * block_kv
        return _allowed(mask_refs, mask, tile_kind, rows, cols, *starts, kv_len, transposed=True)

    def tile(r: int, c: int, tile_kind: int, masked: bool, dk, dv):
        """Tile (query rows r, keys chunk c): its dq share added into the slot, dk and dv's returned
        (values in, values out) so that a chunk's sums stay out of VMEM between tiles."""
        rows = slice(r * block_q_sub, (r + 1) * block_q_sub)
        cols = slice(c * block_kv_compute, (c + 1) * block_kv_compute)
        return part(rows, cols, tile_kind, masked, dk, dv)

    def diagonal(r: int, c: int, dk, dv):
        """A DIAGONAL tile: key strip a against query strips a.. of tile row r only (the rest of
        the tile is empty); each strip's dk and dv are a slice of the chunk's."""
        parts = []
        for a in range(block_kv_compute // STRIP):
            rows = slice(r * block_q_sub + a * STRIP, (r + 1) * block_q_sub)
            cols = slice(c * block_kv_compute + a * STRIP, c * block_kv_compute + (a + 1) * STRIP)
            strip = slice(a * STRIP, (a + 1) * STRIP)
            parts.append(part(rows, cols, PARTIAL, True, dk[strip], dv[strip]))
        return (jnp.concatenate([p[n] for p in parts], axis=0) for n in (0, 1))

    def part(rows: slice, cols: slice, tile_kind: int, masked: bool, dk, dv):
        """The logits of queries `rows` and keys `cols` of the block: their dq share added into the
        slot, dk and dv (those keys') returned."""
        q, do = q_ref[rows, :], do_ref[rows, :]
        k, v = k_ref[cols, :], v_ref[cols, :]
        s = lax.dot_general(k, q, NT, preferred_element_type=jnp.float32)  # (keys, rows), base 2
        if soft_cap is not None:
            capped = jnp.tanh(s / soft_cap)
            s = soft_cap * capped
        if masked:
            s = jnp.where(allowed(rows, cols, tile_kind), s, MASKED)
        p = jnp.exp2(s - lse_ref[:, rows])
        dv = dv + lax.dot_general(p.astype(do.dtype), do, NN, preferred_element_type=jnp.float32)
        dp = lax.dot_general(v, do, NT, preferred_element_type=jnp.float32)
        ds = p * (dp - di_ref[:, rows])
        if soft_cap is not None:
            ds = ds * (1.0 - capped * capped)
        ds = ds.astype(q.dtype)
        dk = dk + lax.dot_general(ds, q, NN, preferred_element_type=jnp.float32)
        dq = lax.dot_general(ds.T, k, NN, preferred_element_type=jnp.float32)
        width = rows.stop - rows.start
        at = pl.ds(pl.multiple_of(cur * block_q + rows.start, math.gcd(block_q, rows.start or block_q)), width)
        dq_slots[at, : dq.shape[1]] = dq_slots[at, : dq.shape[1]] + dq
        return dk, dv

    row_tiles, chunks = block_q // block_q_sub, block_kv // block_kv_compute

    def straight(kinds: list[list[int]], masked_full: bool):
        """A block as columns of tiles of static kinds (kinds[c][r]: keys chunk c, rows r), in one
        stretch of code; a chunk's dk and dv stay values between its tiles."""
        for c, column in enumerate(kinds):
            if not any(column):
                continue
            cols = slice(c * block_kv_compute, (c + 1) * block_kv_compute)
            dk, dv = dk_acc[cols, :], dv_acc[cols, :]
            for r, tile_kind in enumerate(column):
                if tile_kind == DIAGONAL:
                    dk, dv = diagonal(r, c, dk, dv)
                elif tile_kind != SKIP:
                    dk, dv = tile(r, c, tile_kind, tile_kind == PARTIAL or masked_full, dk, dv)
            dk_acc[cols, :], dv_acc[cols, :] = dk, dv

    def tiled():
        tiles = sub_kinds_ref[e]
        for c in range(chunks):
            cols = slice(c * block_kv_compute, (c + 1) * block_kv_compute)
            for r in range(row_tiles):
                tile_kind = (tiles >> (2 * (c * row_tiles + r))) & KIND

                def run(kind_of_tile, r=r, c=c, cols=cols):
                    masked = kind_of_tile == PARTIAL or has_segment_ids
                    dk_acc[cols, :], dv_acc[cols, :] = tile(
                        r, c, kind_of_tile, masked, dk_acc[cols, :], dv_acc[cols, :]
                    )

                pl.when(tile_kind == FULL)(functools.partial(run, FULL))  # DIAGONAL runs as PARTIAL here
                pl.when((tile_kind == PARTIAL) | (tile_kind == DIAGONAL))(functools.partial(run, PARTIAL))

    pl.when(kind == FULL)(functools.partial(straight, [[FULL] * row_tiles] * chunks, has_segment_ids))
    if any_partial:
        run = functools.partial(straight, masked_full=has_segment_ids)
        _when_pattern(patterns, chunks, row_tiles, kind, sub_kinds_ref[e], run)
        if not patterns:
            pl.when(kind == PARTIAL)(tiled)

    @pl.when(state[1] != 0)
    def _written():
        wait_written(lax.rem(cur + 2, np.int32(3)), n - 1)

    def write_back():
        dq_copy(cur, n, read=False).start()
        state[1] = 1

    def write_done():
        at = pl.ds(pl.multiple_of(cur * block_q, block_q), block_q)
        dq_stage[...] = (dq_slots[at, :] * LN2).astype(dq_stage.dtype)
        done_copy(n).start()
        state[1], state[2] = 2, 0

    writes = next_new | (n + 1 == steps)
    if finish:
        # the run of steps on this block is its last where one is FINAL (a shorter list's padding
        # steps repeat its last block after it)
        @pl.when(flagged(n, FINAL))
        def _final():
            state[2] = 1

        final = state[2] == 1  # read once: write_done clears it
        pl.when(writes & final)(write_done)
        pl.when(writes & jnp.logical_not(final))(write_back)
    else:
        pl.when(writes)(write_back)

    @pl.when(next_new)
    def _advance():
        state[0] = state[0] + 1

    @pl.when(n + 1 == steps)
    def _drain():
        wait_written(cur, n)

    @pl.when(last_of_column)
    def _finish():
        dk, dv = dk_acc[...] * dk_scale if dk_scale != 1 else dk_acc[...], dv_acc[...]
        if adds_kv:
            dk, dv = dk + dk_in[...].astype(jnp.float32), dv + dv_in[...].astype(jnp.float32)
        dk_ref[...] = dk.astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_vmem_bytes(
    block_q: int,
    block_kv: int,
    block_q_sub: int,
    block_kv_compute: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    stored_mask: bool = False,
) -> int:
    """The scoped VMEM the backward asks for: its double-buffered blocks (a stored mask's block
    too), its float32 dk and dv sums, three dq slots and a finished dq block, and a tile's float32 logits,
    probabilities and their gradients, twice over for the compiler's temporaries, within 16 to 64
    MiB."""
    blocks = 2 * itemsize * (block_q * (head_dim + head_dim_v) + block_kv * (head_dim + head_dim_v))
    blocks += 2 * MASK_BYTES * block_q * block_kv if stored_mask else 0
    blocks += 2 * 2 * 4 * 8 * block_q + 2 * 4 * (head_dim + head_dim_v) * block_kv  # lse, di; dk, dv outputs
    scratch = 4 * block_kv * (head_dim + head_dim_v) + (3 * 4 + itemsize) * block_q * head_dim
    tile = 5 * 4 * block_q_sub * block_kv_compute
    return int(min(64 << 20, max(16 << 20, 2 * (blocks + scratch + tile))))


def backward(
    q,
    k,
    v,
    d_out,
    lse,
    di,
    grid,
    *,
    mask,
    kv_len: int,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_q_sub: int | None = None,
    soft_cap: float | None = None,
    segment_ids=None,
    positions=None,
    stored_mask=None,
    dq=None,
    dkv=None,
    dk_scale: float = 1.0,
    vmem_limit: int | None = None,
    straight_patterns: bool | tuple[int, ...] = True,
    scheduler: str = "default",
    interpret: bool = False,
):
    """The gradients of `forward`'s attention, one kernel over each kv head's active blocks, kv
    block after kv block: q (Hq, Lq, D), k (Hkv, Lkv, D) scaled by the softmax scale times LOG2E
    as `forward` takes it, v (Hkv, Lkv, Dv), d_out (Hq, Lq, Dv) in q's dtype, lse (Hq, Lq) natural
    log (+inf on rows that see no key: they get no gradient), di (Hq, Lq) float32, the rows' sums
    of out * d_out; `grid` the tables of `column_grid`: one list every head shares, or one per
    query head (then each query head walks its own list and its dk, dv are summed over the heads
    of its group afterwards). stored_mask: as in `forward`, with blocks (M, block_kv, block_q),
    transposed. dq: a sum to add dq into in place, in the kernel's own layout and units (`dq_rows`;
    its buffer is donated to the result, which is returned in the same form, for `finished_dq`).
    dkv: (dk, dv) in k's and v's shapes and dtypes to add into in place (their buffers donated to
    the results; one list every head shares). A ring gives all three, its sums over its steps.
    positions, straight_patterns and scheduler as in `forward`. dk_scale: a factor this call's dk is written
    with (the softmax scale gives the caller's k its gradient, with no pass over dk after the
    kernel).

    Returns dq (Hq, Lq, D), the gradient of q, in q's dtype where the kernel finishes each q
    block's (no dq given, every list meets every q block), else float32 (in the given sum's form,
    where given); dk (Hkv, Lkv, D), the gradient of the logits' k (k times the softmax scale) times
    dk_scale, and dv (Hkv, Lkv, Dv), both in k's dtype. dq and dk of GQA and MQA heads are summed
    over the query heads a kv head serves."""
    num_heads, q_len, head_dim = q.shape
    kv_heads, _, head_dim_v = v.shape
    group = num_heads // kv_heads
    block_q_sub = block_q_sub or block_q
    tiles = (block_q // block_q_sub) * (block_kv // block_kv_compute)
    if tiles > MAX_TILES:
        raise ValueError(f"{block_q}x{block_kv} blocks in {block_q_sub}x{block_kv_compute} tiles: at most {MAX_TILES}")
    if vmem_limit is None:
        vmem_limit = backward_vmem_bytes(
            block_q,
            block_kv,
            block_q_sub,
            block_kv_compute,
            head_dim,
            head_dim_v,
            q.dtype.itemsize,
            stored_mask is not None,
        )
    q_block, kv_block, flags, sub_kinds = grid
    per_head_lists = q_block.shape[0] > 1
    if per_head_lists and q_block.shape[0] != num_heads:
        raise ValueError(f"{q_block.shape[0]} lists for {num_heads} query heads")
    width = q_block.shape[1]
    patterns = _patterns(straight_patterns, grid, segment_ids is not None, tiles)
    if dkv is not None and per_head_lists:
        raise ValueError("dk and dv add into given sums with one list every head shares")
    if segment_ids is not None:
        flags = segment_kinds(q_block, kv_block, flags, *segment_ids, block_q, block_kv)
    tables = [jnp.asarray(x).reshape(-1) for x in (q_block, kv_block, flags, sub_kinds)]
    if stored_mask is not None:
        tables.append(jnp.asarray(stored_mask[0]).reshape(-1))
    # a list per query head: the grid walks query heads, each its own list, and a kv head's
    # gradients are summed over its query heads afterwards
    group_steps = 1 if per_head_lists else group
    steps = width * group_steps

    def entry(h, n):
        if per_head_lists:
            return h * width + n, h
        e = lax.div(n, np.int32(group))
        return e, h * group + (n - e * group)

    def q_map(h, n, qb, kb, *_):
        e, qh = entry(h, n)
        return qh, qb[e], 0

    def row_map(h, n, qb, kb, *_):
        e, qh = entry(h, n)
        return qh, 0, qb[e]

    def kv_map(h, n, qb, kb, *_):
        return lax.div(h, np.int32(group)) if per_head_lists else h, kb[entry(h, n)[0]], 0

    def kv_out_map(h, n, qb, kb, *_):  # a query head's own, with a list per query head
        return h, kb[entry(h, n)[0]], 0

    in_specs = [
        pl.BlockSpec((None, block_q, head_dim), q_map),
        pl.BlockSpec((None, block_kv, head_dim), kv_map),
        pl.BlockSpec((None, block_kv, head_dim_v), kv_map),
        pl.BlockSpec((None, block_q, head_dim_v), q_map),
        pl.BlockSpec((None, 1, block_q), row_map),
        pl.BlockSpec((None, 1, block_q), row_map),
    ]
    lse2 = jnp.where(jnp.isposinf(lse), jnp.inf, lse * LOG2E).astype(jnp.float32)
    inputs = [q, k, v, d_out, lse2[:, None, :], di.astype(jnp.float32)[:, None, :]]

    def q_rows_map(h, n, qb, kb, *_):
        return 0, qb[entry(h, n)[0]]

    def kv_columns_map(h, n, qb, kb, *_):
        return kb[entry(h, n)[0]], 0

    # segment ids, then positions: a value per row (rows along lanes here) and per key
    for pair in (segment_ids, positions):
        if pair is not None:
            in_specs += [pl.BlockSpec((1, block_q), q_rows_map), pl.BlockSpec((block_kv, 1), kv_columns_map)]
            inputs += [pair[0].reshape(1, -1).astype(jnp.int32), pair[1].reshape(-1, 1).astype(jnp.int32)]
    if stored_mask is not None:

        def mask_map(h, n, qb, kb, fl, sk, index):
            return index[entry(h, n)[0]], 0, 0

        in_specs.append(pl.BlockSpec((None, block_kv, block_q), mask_map))
        inputs.append(jnp.asarray(stored_mask[1]))
    aliases = {}
    if dkv is not None:  # read at each kv block's last step, as its sums are written
        for i, (grad, dim) in enumerate(zip(dkv, (head_dim, head_dim_v))):
            aliases[len(tables) + len(inputs)] = i
            in_specs.append(pl.BlockSpec((None, block_kv, dim), kv_out_map))
            inputs.append(grad)
    dq_width = dq_rows(num_heads, q_len, head_dim)[1]
    # Where every list meets every q block, each block's first step zeroes it: no zeros written
    # beforehand (128 MiB at 16K tokens, 16 heads, D=128)
    fresh = dq is None and meets_every_q_block(grid, q_len // block_q)
    # ... and its last step writes it in q's dtype, where each head's rows start on a whole tile
    # of that dtype (8 rows of 32 bits)
    finish = fresh and q_len * q.dtype.itemsize % (SUBLANES * 4) == 0
    given_dq = dq is not None
    if not fresh:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        inputs.append(dq if given_dq else jnp.zeros(dq_rows(num_heads, q_len, head_dim), jnp.float32))
        aliases[len(tables) + len(inputs) - 1] = 2
    body = functools.partial(
        _backward_kernel,
        mask=mask,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv_compute,
        block_q_sub=block_q_sub,
        soft_cap=soft_cap,
        has_segment_ids=segment_ids is not None,
        group=group_steps,
        steps=steps,
        q_len=q_len,
        patterns=patterns,
        any_partial=may_run_partial(grid, segment_ids is not None),
        per_head_lists=per_head_lists,
        dk_scale=float(dk_scale),
        fresh=fresh,
        finish=finish,
        has_positions=positions is not None,
        adds_kv=dkv is not None,
    )
    out_heads = num_heads if per_head_lists else kv_heads
    # summed over a group afterwards: in float32, as the kernel sums within a list
    kv_dtype = jnp.float32 if per_head_lists and group > 1 else k.dtype
    dq_shape = dq_rows(num_heads, q_len, head_dim)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tables),
        grid=(out_heads, steps),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, block_kv, head_dim), kv_out_map),
            pl.BlockSpec((None, block_kv, head_dim_v), kv_out_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ]
        + [pl.BlockSpec(memory_space=pl.ANY)] * finish,
        scratch_shapes=[
            pltpu.VMEM((block_kv, head_dim), jnp.float32),
            pltpu.VMEM((block_kv, head_dim_v), jnp.float32),
            pltpu.VMEM((3 * block_q, dq_width), jnp.float32),
            *[pltpu.VMEM((block_q, dq_width), q.dtype)] * finish,
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((3,), jnp.int32),
        ],
    )
    call = pl.pallas_call(
        body,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((out_heads,) + k.shape[1:], kv_dtype),
            jax.ShapeDtypeStruct((out_heads,) + v.shape[1:], kv_dtype),
            jax.ShapeDtypeStruct(dq_shape, jnp.float32),
        ]
        + [jax.ShapeDtypeStruct(dq_shape, q.dtype)] * finish,
        input_output_aliases=aliases,
        compiler_params=compiler_params(vmem_limit, scheduler),
        interpret=interpret,
        name="active_backward",
    )
    call = compat.named_kernel_call(call, "active_backward")
    dk, dv, dq, *done = call(*tables, *inputs)
    if out_heads != kv_heads:
        dk, dv = (g.reshape(kv_heads, group, *g.shape[1:]).sum(axis=1).astype(k.dtype) for g in (dk, dv))
    if given_dq:
        return dq, dk, dv
    return done[0].reshape(num_heads, q_len, dq_width)[..., :head_dim] if finish else finished_dq(dq, q.shape), dk, dv


def dq_rows(num_heads: int, q_len: int, head_dim: int) -> tuple[int, int]:
    """The shape of the backward's float32 dq sum: a row a query head's row, head_dim rounded up
    to the lanes (Mosaic copies only lane-aligned slices between HBM and VMEM, and only 2-D ones
    whose minor dim is under 128 lanes). Its values are the gradient of base-2 logits: dq / ln 2."""
    return num_heads * q_len, -(-head_dim // LANES) * LANES


def finished_dq(rows, shape: tuple[int, int, int]):
    """dq (Hq, Lq, D) float32 from the backward's sum (`dq_rows`)."""
    num_heads, q_len, head_dim = shape
    return (rows * LN2).reshape(num_heads, q_len, -1)[..., :head_dim]
