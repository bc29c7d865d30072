"""One call's `Plan`: everything that changes its compiled program, from shapes and options.

`plan(...)` fills in what callers other than the torch side may leave out, checks the mask against
the shapes, splits the sequences over their shards (`sequence_layout`) and plans blocks and padding
(`block_planning`). Pure Python and NumPy on shapes: planning and its errors happen before any JAX
computation (the mask specs it reads come from `torch_splash_jax.masks`, which imports the kernel's
mask module).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import policy, tables
from .block_planning import (
    PLATFORMS,
    active_backward_blocks,
    active_backward_rows,
    active_block_kv,
    active_block_q,
    active_forward_blocks,
    active_forward_logits,
    active_row_sums,
    active_scheduler,
    plan_blocks,
)
from .block_sizes import BlockSizes
from .errors import SplashConstraintError, SplashDtypeError
from .kernel_limits import GENERATIONS, LANES, active_table_entries, kernel_itemsize
from .masks import FullMask, MultiHeadMask, shared_structured_mask
from .sequence_layout import device_lengths, layout_positions


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that changes the compiled program; the kernel cache is keyed on it."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    head_dim_v: int
    dtype: str
    mask: object
    scale: float
    soft_cap: float | None
    has_segment_ids: bool
    platform: str
    q_len_padded: int
    kv_len_padded: int
    blocks: tuple  # sorted (field, value) pairs for the JAX BlockSizes
    has_sinks: bool = False  # attention sinks: one learned logit per query head (gpt-oss)
    # Sequence sharding: q_len is one shard's rows of q_shards; "contiguous" shards hold
    # consecutive rows, "balanced" ones two mirrored chunks each (shard s: chunks s and 2S-1-s, the even one first).
    q_shards: int = 1
    sequence_layout: str = "contiguous"
    # Heads split over devices, counted only for per-head masks (num_q_heads is one device's
    # heads, the mask has every device's): each device then takes its heads' block tables as inputs.
    head_shards: int = 1
    # Context parallelism over the query-sequence shards: "all_gather" (every device sees every
    # key; kv_len is all of them) or "ring" (k and v are sharded like q and pass around the ring:
    # kv_len is one shard's keys, and ring_step says which shard's keys a program attends to).
    context_parallel: str = "all_gather"
    ring_step: int = 0
    # The kernels: "splash" (JAX's) or "active" (block_sizes.BlockSizes.forward_kernel, backward_kernel;
    # `plan` chooses them where the caller does not).
    forward_kernel: str = "splash"
    backward_kernel: str = "splash"
    # The TPU generation the program is built for, where the caller knows it (kernel_limits.GENERATIONS):
    # per-generation choices are made from it (`row_sums`, `forward_logits`, `scheduler`, `active_block_kv`,
    # `active_block_q`).
    # None: the choices that serve every generation.
    generation: str | None = None
    # Where the active forward sums each row's probabilities: "vector" (the vector unit, float32) or
    # "mxu" (`active_kernels.with_ones`); `plan` chooses per generation (block_planning.active_row_sums).
    row_sums: str = "vector"
    # How the active forward lays out a tile's logits: "rows" (queries by keys) or "transposed" (keys by
    # queries, its rows summed on the vector unit); `plan` chooses per generation (block_planning.
    # active_forward_logits).
    forward_logits: str = "rows"
    # The TPU compiler's scheduler for the active kernels: "default" or "lp" (`active_kernels.
    # compiler_params`); `plan` chooses per generation (block_planning.active_scheduler).
    scheduler: str = "default"
    # The active kernels' longest key block; `plan` chooses per generation and head_dim (block_planning.
    # active_block_kv). None: the choice for an unknown generation.
    active_block_kv: int | None = None
    # The active forward's longest q block; `plan` chooses per generation (block_planning.active_block_q).
    # None: the choice for an unknown generation.
    active_block_q: int | None = None

    @property
    def ring(self) -> bool:
        return self.context_parallel == "ring"

    @property
    def lse_len(self) -> int:
        """The logsumexp's length along the query axis, all shards together."""
        return self.q_len_padded * self.q_shards

    def shard_positions(self) -> np.ndarray:
        """(q_shards, q_len_padded) int32: the global query position of each row of each shard.
        Padded rows repeat the shard's last position (their outputs are dropped)."""
        real = layout_positions(self.q_len, self.q_shards, self.sequence_layout)
        pad = np.repeat(real[:, -1:], self.q_len_padded - self.q_len, axis=1)
        return np.concatenate([real, pad], axis=1)

    def ring_kv_positions(self) -> np.ndarray:
        """(q_shards, kv_len_padded) int32, for a ring step: the global key position of each
        column each device attends to at `ring_step`, when it holds the keys of the shard
        `ring_step` places before its own (the ring passes k and v one shard onwards per step);
        -1 for padding columns."""
        real = layout_positions(self.kv_len, self.q_shards, self.sequence_layout)
        held = np.roll(real, self.ring_step, axis=0)  # device d holds shard (d - step) mod S
        pad = np.full((self.q_shards, self.kv_len_padded - self.kv_len), -1, np.int32)
        return np.concatenate([held, pad], axis=1)

    def device_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """A sequence-sharded plan's global positions, every device's: of its rows (S, Lq padded),
        and of its keys (S, Lkv padded): the keys a ring step's device holds, or every key on every
        device (padding columns, past kv_len, are hidden however numbered)."""
        if self.ring:
            kv = self.ring_kv_positions()
        else:
            kv = np.broadcast_to(np.arange(self.kv_len_padded, dtype=np.int32), (self.q_shards, self.kv_len_padded))
        return self.shard_positions().astype(np.int32), np.ascontiguousarray(kv, dtype=np.int32)

    def device_position_runs(self, positions=None) -> tuple[np.ndarray, np.ndarray]:
        """`device_positions` (`positions`, where the caller has them) as runs of consecutive
        positions, every device's: the first position of each run of its rows (S, 1 or 2: the
        balanced layout's two chunks) and of its keys, runs of equal length over the real rows
        (keys) (`positions_of_runs` expands them). A program takes these, a few integers a device,
        rather than a position a row."""
        rows, keys = self.device_positions() if positions is None else positions
        parts = 2 if self.sequence_layout == "balanced" else 1
        kv_parts = parts if self.ring else 1
        return rows[:, : self.q_len : self.q_len // parts], keys[:, : self.kv_len : self.kv_len // kv_parts]

    def active_block_lengths(self) -> tuple[int, int]:
        """The lengths of q and k the active kernels' blocks divide: the padded lengths, but in the
        balanced layout one chunk of a shard where that is a multiple of the lanes (the keys' too in
        a ring): a block over both chunks holds rows far apart, whose kinds are those of the span
        between them (`tables.device_block_kinds`), partial where each chunk's block is full or empty."""
        q, kv = self.q_len_padded, self.kv_len_padded
        if self.q_shards > 1 and self.sequence_layout == "balanced":
            q = self.q_len // 2 if self.q_len % (2 * LANES) == 0 else q
            kv = self.kv_len // 2 if self.ring and self.kv_len % (2 * LANES) == 0 else kv
        return q, kv

    @property
    def batch_in_heads(self) -> bool:
        """Whether the kernels see the batch as more heads, (B * H, L, D), in one call: where every
        head shares one mask and no segment ids (which are per batch element) are given. The
        other plans run one kernel call per batch element, in a loop. Never a vmap over the batch:
        JAX's kernels (0.7 to 0.11) keep their accumulators as outputs with a constant block index,
        and a vmap gives those the batch axis, in VMEM: the forward at B=4, 4K tokens, 16 heads,
        D=128 overran v5e's 16 MiB of scoped VMEM (16.18M) with the blocks that fit at B=1."""
        return not self.has_segment_ids and not isinstance(self.mask, MultiHeadMask)

    @property
    def kernel_heads(self) -> tuple[int, int]:
        """(query heads, kv heads) one kernel call sees."""
        fold = self.batch if self.batch_in_heads else 1
        return self.num_q_heads * fold, self.num_kv_heads * fold

    @property
    def is_mqa(self) -> bool:
        """Whether the kernels are the MQA ones (k and v without a head axis): one kv head per call."""
        q_heads, kv_heads = self.kernel_heads
        return kv_heads == 1 and q_heads > 1

    def block_sizes(self) -> dict:
        return dict(self.blocks)


def plan(
    *,
    q_len: int,
    num_q_heads: int = 1,
    head_dim: int = LANES,
    batch: int = 1,
    num_kv_heads: int | None = None,
    kv_len: int | None = None,
    head_dim_v: int | None = None,
    dtype: str = "float32",
    mask=None,
    scale: float | None = None,
    soft_cap: float | None = None,
    has_segment_ids: bool = False,
    block_sizes: BlockSizes | None = None,
    platform: str = "cpu",
    has_sinks: bool = False,
    q_shards: int = 1,
    sequence_layout: str = "contiguous",
    head_shards: int = 1,
    context_parallel: str = "all_gather",
    generation: str | None = None,
) -> Plan:
    """Plan one attention call. Shapes must already be checked by the caller (the torch side).

    With q_shards > 1 the query sequence (q_len, all of it) is split over that many devices, each
    attending its rows to every key: the plan is one shard's, and the shards' positions
    (`Plan.shard_positions`) and block tables become data of the program, not constants. With
    head_shards > 1, num_q_heads and num_kv_heads are one device's heads of that many: a per-head
    mask then has a mask for every device's heads, and its tables are data too. generation: the
    TPU generation the program is for, where known (`Plan.generation`).

    Left out (as callers other than the torch side may): MHA, Lkv = Lq, Dv = D, float32, no mask,
    scale 1/sqrt(D)."""
    num_kv_heads = num_q_heads if num_kv_heads is None else num_kv_heads
    kv_len = q_len if kv_len is None else kv_len
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    mask = FullMask() if mask is None else mask
    scale = head_dim**-0.5 if scale is None else scale
    if block_sizes is None:
        block_sizes = BlockSizes()
    elif not isinstance(block_sizes, BlockSizes):
        raise SplashDtypeError(
            f"block_sizes={block_sizes!r}: pass torch_splash.BlockSizes(...) (fields left None are "
            "planned), or None to plan them all."
        )
    per_head = isinstance(mask, MultiHeadMask)
    mask.check(num_q_heads * head_shards if per_head else num_q_heads, q_len, kv_len)
    q_len, kv_len = device_lengths(q_len, kv_len, q_shards, sequence_layout, context_parallel)
    ring = context_parallel == "ring"
    if platform not in PLATFORMS:
        raise SplashConstraintError(f"platform={platform!r}: expected one of {list(PLATFORMS)}.")
    if generation is not None and generation not in GENERATIONS:
        raise SplashConstraintError(f"generation={generation!r}: expected one of {list(GENERATIONS)} or None.")
    table_heads = num_q_heads if per_head else 1  # per-head masks: one table per head
    stored = ring or shared_structured_mask(mask) is None  # the kernel reads stored partial blocks
    # Stored blocks keep the count bound: with them the fused dkv kernel at 512 x 2048 ran out of
    # VMEM in a 32K-token torch_xla step (FlexAttention's document mask, 16 heads, v5e, libtpu
    # 0.0.21), where the count bound runs the dq kernel.
    itemsize = kernel_itemsize(dtype)
    q_row_bytes = 0 if stored else batch * num_q_heads * head_dim * itemsize
    planning = (
        q_len,
        kv_len,
        block_sizes,
        platform,
        max(head_dim, head_dim_v),
        table_heads,
        stored,
        q_shards > 1,
        q_row_bytes,
        itemsize,
        has_segment_ids,
        soft_cap is not None,
    )
    try:
        q_pad, kv_pad, blocks = plan_blocks(*planning)
        refused = None
    except SplashConstraintError as error:  # JAX's tables past SMEM: refused below if a JAX kernel runs
        q_pad, kv_pad, blocks = plan_blocks(*planning, fit_tables=False)
        refused = error
    _check_active(
        block_sizes.forward_kernel, block_sizes.backward_kernel, mask, q_shards, head_shards, context_parallel
    )
    planned = Plan(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        mask=mask,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        has_segment_ids=has_segment_ids,
        platform=platform,
        q_len_padded=q_pad,
        kv_len_padded=kv_pad,
        blocks=blocks,
        has_sinks=has_sinks,
        q_shards=q_shards,
        sequence_layout=sequence_layout,
        head_shards=head_shards if per_head else 1,
        context_parallel=context_parallel,
        generation=generation,
        row_sums=active_row_sums(generation, head_dim_v),
        forward_logits=active_forward_logits(generation),
        scheduler=active_scheduler(generation),
        active_block_kv=active_block_kv(generation, max(head_dim, head_dim_v)),
        active_block_q=active_block_q(generation),
    )
    unserved = _unserved_sharding(mask, q_shards, head_shards, context_parallel) is not None
    forward_kernel, backward_kernel = _kernels(block_sizes, unserved, planned, table_heads)
    if refused is not None and "splash" in (forward_kernel, backward_kernel):
        raise refused
    return dataclasses.replace(planned, forward_kernel=forward_kernel, backward_kernel=backward_kernel)


# Fields of JAX's kernels alone: a caller who sets one asks for that JAX kernel (the layouts, for all of them).
_LAYOUTS = ("q_layout", "k_layout", "v_layout")
_JAX_FORWARD_FIELDS = ("block_q", "block_kv", "block_kv_compute", *_LAYOUTS)
_JAX_BACKWARD_FIELDS = (
    "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq", "block_kv_dq", "use_fused_bwd_kernel",
    *_LAYOUTS,
)  # fmt: skip


def _kernels(block_sizes: BlockSizes, unserved: bool, plan: Plan, lists: int):
    """(forward, backward) kernels: the caller's (a backward left None follows an explicit forward),
    else the active-block kernels wherever they serve the call, JAX's splash kernels where they do
    not (`unserved`: `_unserved_sharding`), where lists may outgrow SMEM (`_active_lists_fit`), and
    for a pass whose JAX blocks the caller set. The active kernels are the faster on every call measured on
    the v5e and, for the training step, faster or level on every call estimated for v5p, v6e and
    v7x (docs/tpu.md); the choice does not depend on `generation`."""
    forward = block_sizes.forward_kernel
    backward = block_sizes.backward_kernel or forward

    def planned(fields: tuple, is_backward: bool) -> str:
        if unserved or any(getattr(block_sizes, f) is not None for f in fields):
            return "splash"
        return "active" if _active_lists_fit(plan, lists, is_backward) else "splash"

    return forward or planned(_JAX_FORWARD_FIELDS, False), backward or planned(_JAX_BACKWARD_FIELDS, True)


def _active_lists_fit(plan: Plan, lists: int, backward: bool) -> bool:
    """Whether the active kernel's lists surely fit SMEM, as `splash_program` lays them out: a
    structured mask's counted from its block kinds (`_structured_lists_fit`), a stored mask's
    bounded by every block of each of its `lists` lists, rounded."""
    if shared_structured_mask(plan.mask) is not None:
        return _structured_lists_fit(plan, backward)
    blocks = _active_blocks(plan, backward, stored=True)
    every = (plan.q_len_padded // blocks["block_q"]) * (plan.kv_len_padded // blocks["block_kv"])
    return lists * tables.bucket(every) <= active_table_entries(True)


@functools.lru_cache(maxsize=policy.PLANS)
def _structured_lists_fit(plan: Plan, backward: bool) -> bool:
    """`_active_lists_fit` for a structured mask every head shares, from its block kinds (the
    backward's at its longest q blocks, its fallback; a sequence-sharded plan's on its longest
    device's list, at every step of a ring). Cached (its plan holds no data): `plan` runs at every
    call, and a ring's every step over 64 devices at 10M tokens took 9 s."""
    shared = shared_structured_mask(plan.mask)
    blocks = _active_blocks(plan, backward, stored=False)
    block_q, block_kv = blocks["block_q"], blocks["block_kv"]
    if plan.q_shards > 1:
        steps = ring_steps(plan) if plan.ring else [plan]
        kinds = [tables.device_block_kinds(shared, *p.device_positions(), p.kv_len, block_q, block_kv) for p in steps]
        kinds = np.concatenate(kinds) > 0
    else:
        q_pad, kv_pad = plan.q_len_padded, plan.kv_len_padded
        kinds = tables.block_mask_table(shared, q_pad, kv_pad, plan.kv_len, block_q, block_kv)[None] > 0
    per_walk = kinds.transpose(0, 2, 1) if backward else kinds  # the backward walks kv block after kv block
    return int(np.maximum(per_walk.sum(axis=2), 1).sum(axis=1).max()) <= active_table_entries(False)


def _active_blocks(plan: Plan, backward: bool, stored: bool) -> dict:
    """The active kernel's blocks as `splash_program` plans them where its lists are longest: the
    backward's at its longest q blocks (its fallback), the forward's at the q blocks of an unknown
    generation (the fallback of longer ones, `Plan.active_block_q`)."""
    (q_len, kv_len), head_dim = plan.active_block_lengths(), max(plan.head_dim, plan.head_dim_v)
    if backward:
        most_rows = active_backward_rows(stored)[-1]
        return active_backward_blocks(q_len, kv_len, head_dim, most_rows, stored, plan.active_block_kv)
    return active_forward_blocks(q_len, kv_len, head_dim, stored=stored, most_kv=plan.active_block_kv)


def with_forward_logits(plan: Plan, logits: str) -> Plan:
    """The same plan with its active forward's logits laid out `logits` ("rows" or "transposed",
    `Plan.forward_logits`); transposed, its rows summed on the vector unit."""
    row_sums = "vector" if logits == "transposed" else plan.row_sums
    return dataclasses.replace(plan, forward_logits=logits, row_sums=row_sums)


def with_kernels(plan: Plan, forward: str, backward: str | None = None) -> Plan:
    """The same plan with other kernels ("splash" or "active"; the backward's follows the
    forward's unless given), checked as `plan` checks them."""
    backward = backward or forward
    _check_active(forward, backward, plan.mask, plan.q_shards, plan.head_shards, plan.context_parallel)
    return dataclasses.replace(plan, forward_kernel=forward, backward_kernel=backward)


def _check_active(forward, backward, mask, q_shards: int, head_shards: int, context_parallel: str) -> None:
    """The calls the active-block kernels serve: unsharded calls and calls sharded over batch or
    heads, for any mask (structured masks are evaluated in the kernel, data and per-head masks read
    from stored blocks) but one mask per head sharded over heads; and calls sharded along the query
    sequence, all-gather or ring, with a structured mask every head shares (each device's list and
    positions are its inputs, the mask evaluated at those positions)."""
    option = "forward_kernel" if forward == "active" else "backward_kernel" if backward == "active" else None
    how = _unserved_sharding(mask, q_shards, head_shards, context_parallel)
    if option is not None and how is not None:
        raise SplashConstraintError(
            f"block_sizes.{option}='active': the call is sharded {how}, which the active-block kernels do not "
            f"serve. Use {option}='splash' (or None) for this call."
        )


def _unserved_sharding(mask, q_shards: int, head_shards: int, context_parallel: str) -> str | None:
    """How a call is sharded such that the active kernels do not serve it ("along the query
    sequence with a mask read from stored blocks", "... (a ring) ...", "over heads with one mask per
    head"): each device would need its own stored blocks. None where they serve it."""
    if (q_shards > 1 or context_parallel == "ring") and shared_structured_mask(mask) is None:
        ring = " (a ring)" if context_parallel == "ring" else ""
        return f"along the query sequence{ring} with a mask read from stored blocks (data, or one mask per head)"
    if head_shards > 1 and isinstance(mask, MultiHeadMask):
        return "over heads with one mask per head"
    return None


def ring_steps(plan: Plan) -> list[Plan]:
    """The plan of each step of a ring plan: step s attends to the keys s shards back."""
    return [dataclasses.replace(plan, ring_step=s) for s in range(plan.q_shards)]
