"""What a kernel call does, in grid steps and bytes (`Work`): from a mask's block classes (tokamax's
kernels, calibration.py) or from a JAX splash kernel's own block tables (`tables_work`)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Work:
    """What one kernel call does, per parallel unit (the batch x heads a two-core chip splits).

    Grid steps per unit: `steps` in all; `first` and `last` along the reduction axis (kv for the
    forward and dq kernels, q for dkv); `full` and `partial` blocks (the rest are skipped).
    """

    kind: str  # "forward", "dq", "dkv"
    units: int
    steps: int
    first: int
    last: int
    full: int
    partial: int
    flops: float  # the useful MXU work of the whole call (blocks computed)
    read_bytes: float  # what the whole call reads from HBM (its writes are its outputs' bytes)
    # A kernel whose partial blocks run in tiles (the active kernels), a branch a tile: per tile, in
    # the kernel's order, how many partial blocks take its unmasked and its masked path.
    tiles: tuple = ()
    # A kernel whose partial blocks run as one stretch of code per tile pattern (the active kernels,
    # `active_kernels.tile_patterns`): per pattern, in the kernel's order, how many blocks take it.
    patterns: tuple = ()

    @property
    def run(self) -> int:
        return self.full + self.partial

    def per_list(self, lists: int) -> Work:
        """This work, counted for units that each walk `lists` block lists (one a query head), as
        that many units of one list each: the lists are the kernel grid's parallel axis, which a
        two-core chip splits between its cores. Counts become each list's average (every list is
        padded to the same steps); flops and bytes, the whole call's, stay."""
        if lists == 1:
            return self

        def share(n):
            return n // lists if n % lists == 0 else n / lists

        counts = {f: share(getattr(self, f)) for f in ("steps", "first", "last", "full", "partial")}
        return dataclasses.replace(
            self,
            units=self.units * lists,
            tiles=tuple(share(n) for n in self.tiles),
            patterns=tuple(share(n) for n in self.patterns),
            **counts,
        )


def block_classes(mask_fn, q_len: int, kv_len: int, block_q: int, block_kv: int) -> np.ndarray:
    """(q blocks, kv blocks) int8: 0 skipped, 1 partial, 2 full, for a mask given as
    `mask_fn(q_positions, kv_positions) -> bool array` over a block's corners and edges.

    Exact for masks whose allowed set, along each row and each column, is one interval (causal,
    local windows, segment ids over sorted documents): a block is full when its edges are, and
    empty when its edges are and no interval can hide inside it."""
    nq, nk = q_len // block_q, kv_len // block_kv
    out = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        rows = np.arange(i * block_q, (i + 1) * block_q)
        for j in range(nk):
            cols = np.arange(j * block_kv, (j + 1) * block_kv)
            edges = np.concatenate(
                [
                    mask_fn(rows[:, None], cols[None, [0, -1]]).ravel(),
                    mask_fn(rows[[0, -1], None], cols[None, :]).ravel(),
                ]
            )
            out[i, j] = 2 if edges.all() else 1 if edges.any() else 0
    return out


def causal(offset: int = 0, window: int | None = None):
    """tokamax's causal_mask(offset, window_size): key k is seen by query q when
    k <= q + offset and, with a window, k > q + offset - window."""

    def allowed(q, k):
        seen = k <= q + offset
        return seen if window is None else seen & (k > q + offset - window)

    return allowed


def full_mask(q, k):
    return np.ones(np.broadcast_shapes(np.shape(q), np.shape(k)), bool)


def forward_work(
    classes: np.ndarray,
    *,
    units: int,
    block_q: int,
    block_kv: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    grid: str,
) -> Work:
    """The forward kernel's work over `classes` (q blocks, kv blocks), shared by the `units`.

    grid: "active" (tokamax: one step per non-skipped block) or "rows" (JAX's splash: every q row
    runs the same number of steps, the most non-skipped blocks of any row)."""
    run = classes > 0
    rows = int(run.any(axis=1).sum()) if grid == "active" else classes.shape[0]
    steps = int(run.sum()) if grid == "active" else classes.shape[0] * max(int(run.sum(axis=1).max()), 1)
    blocks = int(run.sum())
    flops = 2.0 * units * blocks * block_q * block_kv * (head_dim + head_dim_v)
    q_bytes = rows * block_q * head_dim * itemsize
    kv_bytes = blocks * block_kv * (head_dim + head_dim_v) * itemsize
    return Work(
        kind="forward",
        units=units,
        steps=steps,
        first=rows,
        last=rows,
        full=int((classes == 2).sum()),
        partial=int((classes == 1).sum()),
        flops=flops,
        read_bytes=float(units * (q_bytes + kv_bytes)),
    )


def dkv_work(
    classes: np.ndarray,
    *,
    units: int,
    block_q: int,
    block_kv: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    grid: str,
    fused: bool,
) -> Work:
    """The dkv kernel's work (dq too when `fused`): `classes` as for the forward (q blocks, kv
    blocks); the kernel walks q for each kv block."""
    transposed = np.ascontiguousarray(classes.T)
    run = transposed > 0
    cols = int(run.any(axis=1).sum()) if grid == "active" else transposed.shape[0]
    steps = int(run.sum()) if grid == "active" else transposed.shape[0] * max(int(run.sum(axis=1).max()), 1)
    blocks = int(run.sum())
    # s = q k^T, p v... : q k^T again, dp = do v^T, dv += p^T do, dk += ds^T q (+ dq = ds k)
    matmuls = 5 if fused else 4
    flops = 2.0 * units * blocks * block_q * block_kv * head_dim * matmuls
    kv_bytes = cols * block_kv * (head_dim + head_dim_v) * itemsize  # k, v
    per_block = block_q * (head_dim + head_dim_v) * itemsize + block_q * 4 * 2  # q, do; lse, di
    return Work(
        kind="dkv",
        units=units,
        steps=steps,
        first=cols,
        last=cols,
        full=int((transposed == 2).sum()),
        partial=int((transposed == 1).sum()),
        flops=flops,
        read_bytes=float(units * (kv_bytes + blocks * per_block)),
    )


def tables_work(
    block_mask,
    kind: str,
    *,
    units: int,
    block_q: int,
    block_kv: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    fused: bool = False,
) -> Work:
    """A JAX splash kernel's work from its own block table (MaskInfo.block_mask: (heads or 1,
    rows, grid width), 0 skipped, 1 partial, 2 full; rows are q blocks, kv blocks for dkv). Every
    row runs `grid width` steps."""
    table = np.asarray(block_mask)
    heads, rows, width = table.shape
    per_head = lambda x: int(round(x / heads))  # noqa: E731  (one unit's share of a per-head table)
    blocks = int((table > 0).sum())
    block_flops = 2.0 * block_q * block_kv * (head_dim + head_dim_v)
    if kind == "forward":
        flops, moved = block_flops, block_kv * (head_dim + head_dim_v) * itemsize
        row = block_q * head_dim * itemsize
    elif kind == "dq":  # q k^T, do v^T, ds k
        flops = 2.0 * block_q * block_kv * (2 * head_dim + head_dim_v)
        moved, row = (
            block_kv * (head_dim + head_dim_v) * itemsize,
            block_q * (head_dim + head_dim_v) * itemsize + block_q * 8,
        )
    else:  # dkv: q k^T, do v^T, dv, dk (+ dq)
        flops = 2.0 * block_q * block_kv * ((3 if fused else 2) * head_dim + 2 * head_dim_v)
        moved = block_q * (head_dim + head_dim_v) * itemsize + block_q * 8
        row = block_kv * (head_dim + head_dim_v) * itemsize
    return Work(
        kind=kind,
        units=units,
        steps=rows * width,
        first=rows,
        last=rows,
        full=per_head((table == 2).sum()),
        partial=per_head((table == 1).sum()),
        flops=units * per_head(blocks) * flops,
        read_bytes=float(units * (per_head(blocks) * moved + rows * row)),
    )


def _tile_counts(
    grid, count: int, has_segment_ids: bool, rows: int, straight: bool = True
) -> tuple[list[int], list[int], float]:
    """Of the block lists' partial blocks (the host's kinds), as the active kernels run them: per
    tile, how many take its unmasked and its masked path when they run a branch a tile (else []);
    per straight-line tile pattern, how many take it (else []; none where `straight` is False, a
    stored mask's); and the tiles they compute (a DIAGONAL tile of `rows` rows counted by its share).
    A kernel built from constant lists with no partial entry has no tile code (`may_run_partial`);
    a stored mask's lists are its program's inputs, and its kernel has that code whatever they hold."""
    from ..active_kernels import DIAGONAL, FULL, KIND, PARTIAL, SKIP, STRIP, may_run_partial, tile_patterns

    grid = tuple(np.asarray(t) for t in grid)
    if straight and not may_run_partial(grid, has_segment_ids):
        return [], [], 0
    _, _, flags, sub = grid
    packed = sub[(flags & KIND) == PARTIAL]
    taken = [(packed >> (2 * i)) & KIND for i in range(count)]
    patterns = tile_patterns(grid, has_segment_ids, count) if straight else ()
    # a DIAGONAL tile (the backward's) computes (n + 1) / 2n of its area in n strips where it runs
    # straight, all of it as a branch
    strips = rows // STRIP
    share = (strips + 1) / (2 * strips) if patterns else 1.0
    computed = sum(int(((k != SKIP) & (k != DIAGONAL)).sum()) + share * int((k == DIAGONAL).sum()) for k in taken)
    if patterns:
        return [], [int((packed == p).sum()) for p in patterns], computed
    tiles = []
    for k in taken:
        tiles += [int((k == FULL).sum()), int(((k == PARTIAL) | (k == DIAGONAL)).sum())]
    return tiles, [], computed


def _mask_reads(block_index, block_elements: int) -> int:
    """The bytes a stored mask's blocks take from HBM per kernel call: a fetch wherever an entry
    names another block than the entry before it (`active_kernels.block_index`), as int32."""
    from ..active_kernels import MASK_BYTES

    if block_index is None:
        return 0
    index = np.asarray(block_index).reshape(-1)
    fetches = 1 + int((index[1:] != index[:-1]).sum())
    return fetches * block_elements * MASK_BYTES


def active_backward_work(
    grid,
    blocks: dict,
    *,
    units: int,
    group: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    has_segment_ids: bool = False,
    block_index=None,
) -> Work:
    """The active-block backward's work (`torch_splash_jax.active_kernels.backward`) from its block
    lists walked kv block after kv block (one list shared by the `units`, the batch x kv heads, each
    entry taken once per query head of the group; or one list a query head, each taken once, the
    units the kernel calls). Five matmuls a logit (q k^T, d_out v^T, p^T d_out, ds^T q, ds k); its
    reads count each step's q and d_out blocks, each kv block's k and v once, dq's float32 block
    read and written back every step (dq accumulates in HBM; a bound: a q block's first step reads
    none, its last writes q's dtype) and, for a mask read from stored
    blocks (block_index: each entry's), each block fetched. Segment ids refine the kinds on the
    device: this counts the host's kinds."""
    from ..active_kernels import FIRST, FULL, KIND, PARTIAL

    flags = np.asarray(grid[2])
    kind = flags & KIND
    block_q, block_kv = blocks["block_q"], blocks["block_kv"]
    rows, chunk = blocks["block_q_sub"] or block_q, blocks["block_kv_compute"]
    count = (block_q // rows) * (block_kv // chunk)
    tiles, patterns, computed = _tile_counts(grid, count, has_segment_ids, rows, straight=block_index is None)
    area = group * (int((kind == FULL).sum()) * block_q * block_kv + computed * rows * chunk)
    steps = group * int(flags.size)
    columns = int(((flags & FIRST) != 0).sum())
    per_step = block_q * (head_dim + head_dim_v) * itemsize + 2 * 4 * block_q * head_dim
    return Work(
        kind="dkv",
        units=units,
        steps=steps,
        first=columns,
        last=columns,
        full=group * int((kind == FULL).sum()),
        partial=group * int((kind == PARTIAL).sum()),
        flops=2.0 * units * area * (3 * head_dim + 2 * head_dim_v),
        read_bytes=float(
            units * (steps * per_step + columns * block_kv * (head_dim + head_dim_v) * itemsize)
            + units * _mask_reads(block_index, block_q * block_kv)
        ),
        tiles=tuple(group * taken for taken in tiles),
        patterns=tuple(group * taken for taken in patterns),
    )


def active_work(
    grid,
    blocks: dict,
    *,
    units: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    has_segment_ids: bool = False,
    block_index=None,
) -> Work:
    """The active-block forward's work (`torch_splash_jax.active_kernels`) from its block lists
    (q block, kv block, flags, tile kinds: one list shared by the `units`, or one a query head, the
    units then the kernel calls) and its blocks; block_index (each entry's stored block) for a mask
    read from stored blocks, whose fetches it counts. Segment ids refine the kinds on the device:
    this counts the host's kinds, an upper bound on the full blocks."""
    from ..active_kernels import FIRST, FULL, KIND, PARTIAL

    flags = np.asarray(grid[2])
    kind = flags & KIND
    block_q, block_kv = blocks["block_q"], blocks["block_kv"]
    rows, chunk = blocks["block_q_sub"] or block_q, blocks["block_kv_compute"]
    count = (block_q // rows) * (block_kv // chunk) if blocks["block_q_sub"] or block_index is not None else 0
    straight = block_index is None
    tiles, patterns, computed = _tile_counts(grid, count, has_segment_ids, rows, straight) if count else ([], [], 0)
    tile_area = computed * rows * chunk if count else int((kind == PARTIAL).sum()) * block_q * block_kv
    area = int((kind == FULL).sum()) * block_q * block_kv + tile_area
    runs = int(((kind == FULL) | (kind == PARTIAL)).sum())
    row_count = int(((flags & FIRST) != 0).sum())
    return Work(
        kind="forward",
        units=units,
        steps=int(flags.size),
        first=row_count,
        last=row_count,
        full=int((kind == FULL).sum()),
        partial=int((kind == PARTIAL).sum()),
        flops=2.0 * units * area * (head_dim + head_dim_v),
        read_bytes=float(
            units * (row_count * block_q * head_dim + runs * block_kv * (head_dim + head_dim_v)) * itemsize
            + units * _mask_reads(block_index, block_q * block_kv)
        ),
        tiles=tuple(tiles),
        patterns=tuple(patterns),
    )
