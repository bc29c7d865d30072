"""Block sizes and padding: a pure function of shapes, options and the caller's block choices.

The splash kernels need, for every block set they run (forward; dq and dkv, or the fused dkv):
block_q | Lq, block_kv | Lkv, blocks no longer than the sequence, kv blocks and their compute
sub-blocks multiples of 128 with compute | block, and (on TPU only, where Mosaic checks block
shapes) forward q blocks multiples of 8 and backward q blocks multiples of 128. We pad both
sequences to a multiple of 128 and of every block on that axis, so these hold for any length.
Blocks the caller leaves as None are planned; blocks the caller sets are checked, and clamped when
they exceed the padded sequence (the fix the JAX error reports recommend).

Pure Python and NumPy on shapes: planning and its errors happen before any JAX computation (the
mask specs it reads come from `torch_splash_jax.masks`, which imports the kernel's mask module).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import policy
from .errors import SplashConstraintError
from .masks import FullMask, MultiHeadMask, shared_structured_mask
from .options import Immutable

LANES = 128  # NUM_LANES in the kernel: kv blocks live in vector lanes
SUBLANES = 8  # NUM_SUBLANES: the TPU's second-minor tile dimension

# Measured on a 2-core CPU in interpret mode (B=1, H=8, L=2048, D=128, causal; see docs/design.md):
# forward 0.16 s at 512 blocks vs 0.41 s at 128; forward+backward 0.53 s with the fused dkv kernel
# at (512, 512) vs 0.88 s for the separate dq kernel at its best and 16 s at 128 blocks.
# On TPU we keep MaxText's 512 blocks with separate dq and dkv kernels (no dq_unreduced buffer).
_TARGETS = {
    "cpu": dict(block=512, compute=512, fused=True),
    "tpu": dict(block=512, compute=512, fused=False),
}

# A TPU kernel's blocks must fit its VMEM. Measured with the TPU compiler for v5e (torch_splash_jax.aot):
# every kernel compiled whose block_q x block_kv x max(head_dim, 128) was at most 2**28 (2048 x 1024
# and 1024 x 2048 at head_dim 128; 1024 x 1024 at 256; 512 x 512 at 512), and every one above it
# was refused ("Ran out of memory in memory space vmem": 2048 x 2048 at 128; 1024 x 2048 and
# 2048 x 1024 at 256; the dkv kernel at 1024 x 1024 and head_dim 512). The kv compute block did
# not matter (2048 x 2048 failed with compute blocks of 512).
VMEM_BUDGET = 1 << 28
# A TPU kernel's block tables (one entry per q block x kv block, per head for per-head masks) are
# prefetched into SMEM, 1 MiB. Measured with the TPU compiler for v5e: a causal forward with
# 512 blocks compiled at 256K tokens (2**18 entries) and was refused at 384K ("Allocation
# (size=1179648) would exceed memory (size=1048576) ... space=smem": the int16 table alone).
SMEM_TABLE_ENTRIES = 1 << 18
# That is 768 KiB of tables for a mask the kernel evaluates (data_next up to int16, block_mask int8).
# A mask read from stored partial blocks (per-head masks, tensors) has a third table, mask_next (up
# to int16): 5 bytes an entry. Measured: a per-head step at 128K tokens on one v5e chip, 16 heads,
# planned to 2**18 entries, was refused ("Ran out of memory in memory space smem. Used 1.50M of
# 1.00M"); stored tables keep to the same 768 KiB.
SMEM_STORED_TABLE_ENTRIES = SMEM_TABLE_ENTRIES * 3 // 5
DQ_MAX_Q_BLOCK = 1024
_KERNEL_BLOCKS = (
    ("forward", "block_q", "block_kv"),
    ("dq", "block_q_dq", "block_kv_dq"),
    ("dkv", "block_q_dkv", "block_kv_dkv"),
)

_KV_FIELDS = ("block_kv", "block_kv_compute", "block_kv_dq", "block_kv_dkv", "block_kv_dkv_compute")
_Q_BWD_FIELDS = ("block_q_dq", "block_q_dkv")
_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")


@dataclasses.dataclass(unsafe_hash=True)
class BlockSizes(Immutable):
    """Explicit block sizes for the splash kernels: the JAX kernel's `BlockSizes` fields, each
    optional; fields left None are planned for the platform.

    Attributes:
        block_q, block_kv, block_kv_compute: the forward kernel's blocks.
        block_q_dkv, block_kv_dkv, block_kv_dkv_compute: the dkv kernel's (dq too when fused).
        block_q_dq, block_kv_dq: the separate dq kernel's; setting one selects it.
        use_fused_bwd_kernel: compute dq inside the dkv kernel.
        q_layout, k_layout, v_layout: "HEAD_DIM_MINOR" or "SEQ_MINOR".

    A block longer than the padded sequence is clamped to it. Refused with SplashConstraintError
    (when planned, before any JAX work): a kv block or compute block not a multiple of 128, a
    forward block_q not a multiple of 8, a backward q block not a multiple of 128, and on TPU blocks
    that do not fit VMEM or tables that do not fit SMEM (docs/tpu.md).
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_kv_compute: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_kv_dkv_compute: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    use_fused_bwd_kernel: bool | None = None
    q_layout: str | None = None
    k_layout: str | None = None
    v_layout: str | None = None


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
        real = _layout_positions(self.q_len, self.q_shards, self.sequence_layout)
        pad = np.repeat(real[:, -1:], self.q_len_padded - self.q_len, axis=1)
        return np.concatenate([real, pad], axis=1)

    def ring_kv_positions(self) -> np.ndarray:
        """(q_shards, kv_len_padded) int32, for a ring step: the global key position of each
        column each device attends to at `ring_step`, when it holds the keys of the shard
        `ring_step` places before its own (the ring passes k and v one shard onwards per step);
        -1 for padding columns."""
        real = _layout_positions(self.kv_len, self.q_shards, self.sequence_layout)
        held = np.roll(real, self.ring_step, axis=0)  # device d holds shard (d - step) mod S
        pad = np.full((self.q_shards, self.kv_len_padded - self.kv_len), -1, np.int32)
        return np.concatenate([held, pad], axis=1)

    @property
    def is_mqa(self) -> bool:
        return self.num_kv_heads == 1 and self.num_q_heads > 1

    def block_sizes(self) -> dict:
        return dict(self.blocks)


def _layout_positions(rows: int, shards: int, layout: str) -> np.ndarray:
    """(shards, rows) int32: the global position of each of a shard's `rows` in that layout."""
    if layout == "balanced":
        chunk = rows // 2
        order = np.array(balanced_chunk_order(shards))
        return (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(shards, rows).astype(np.int32)
    return (np.arange(shards)[:, None] * rows + np.arange(rows)[None, :]).astype(np.int32)


CONTEXT_PARALLEL = ("all_gather", "ring")


def check_context_parallel(strategy: str | None) -> None:
    """SplashConstraintError unless `strategy` is a context-parallel strategy (or None)."""
    if strategy not in (None, *CONTEXT_PARALLEL):
        raise SplashConstraintError(
            f"context_parallel={strategy!r}: expected 'all_gather' (k and v gathered whole on every device) or "
            "'ring' (k and v passed around the sequence shards)."
        )


def check_sequence_layout(layout: str | None) -> None:
    """SplashConstraintError unless `layout` is a sequence layout (or None, for the default)."""
    if layout not in (None, "contiguous", "balanced"):
        raise SplashConstraintError(f"sequence_layout={layout!r}: expected 'contiguous' or 'balanced'.")


def balanced_chunk_order(shards: int) -> list[int]:
    """The balanced sequence layout: the sequence's 2S chunks in the order the S shards hold them,
    chunks s and 2S-1-s on shard s, so that every shard gets as much causal work. The even chunk
    comes first, as in the contiguous layout (shard d: chunks 2d, 2d+1), so that every chunk is in
    the same half of its shard in both layouts and the devices convert between them half by half."""
    return [c for s in range(shards) for c in sorted((s, 2 * shards - 1 - s), key=lambda c: c % 2)]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _blocks_along(length: int, block: int) -> int:
    return -(-length // block)


def lane_padded(length: int) -> int:
    """The length every sequence is padded to at least: the next multiple of the lane width (128).
    A caller that pads keys to it itself (HF decoding) adds no padding the kernel would not."""
    return _round_up(length, LANES)


def _nearest_multiples(value: int, multiple: int) -> str:
    lo = max(multiple, value // multiple * multiple)
    hi = max(multiple, _round_up(value, multiple))
    return str(lo) if lo == hi else f"{lo} or {hi}"


def _check_user_blocks(bs: BlockSizes) -> None:
    for field in dataclasses.fields(BlockSizes):
        value = getattr(bs, field.name)
        if value is None:
            continue
        where = f"block_sizes.{field.name}={value!r}"
        if field.name == "use_fused_bwd_kernel":
            if not isinstance(value, bool):
                raise SplashConstraintError(f"{where}: must be True, False or None (planned).")
            continue
        if field.name.endswith("_layout"):
            if value not in _LAYOUTS:
                raise SplashConstraintError(f"{where}: must be one of {_LAYOUTS} or None.")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SplashConstraintError(f"{where}: block sizes are positive ints, or None to plan them.")
        if field.name in _KV_FIELDS and value % LANES:
            raise SplashConstraintError(
                f"{where} is not a multiple of {LANES}: kv blocks and their compute blocks are laid out "
                f"along the TPU's {LANES} vector lanes. Use {_nearest_multiples(value, LANES)}, or leave "
                "it None to have it planned."
            )
        if field.name in _Q_BWD_FIELDS and value % LANES:
            raise SplashConstraintError(
                f"{where} is not a multiple of {LANES}: the dq and dkv kernels put query blocks in the "
                f"TPU's lanes (and need it for segment ids). Use {_nearest_multiples(value, LANES)}, or "
                "leave it None."
            )
        if field.name == "block_q" and value % SUBLANES:
            raise SplashConstraintError(
                f"{where} is not a multiple of {SUBLANES} (the TPU sublane count that Mosaic tiles "
                f"query blocks by). Use {_nearest_multiples(value, SUBLANES)}, or leave it None."
            )
    if bs.q_layout == "SEQ_MINOR" and bs.block_q is not None and bs.block_q % LANES:
        raise SplashConstraintError(
            f"block_sizes.block_q={bs.block_q} with q_layout='SEQ_MINOR' puts the query sequence in "
            f"lanes, so it must be a multiple of {LANES}: use {_nearest_multiples(bs.block_q, LANES)}."
        )
    if bs.use_fused_bwd_kernel and (bs.block_q_dq is not None or bs.block_kv_dq is not None):
        raise SplashConstraintError(
            f"block_sizes.use_fused_bwd_kernel=True with block_q_dq={bs.block_q_dq}, "
            f"block_kv_dq={bs.block_kv_dq}: the fused backward computes dq inside the dkv kernel and "
            "has no dq blocks. Drop the dq blocks or set use_fused_bwd_kernel=False."
        )
    for block, compute in (("block_kv", "block_kv_compute"), ("block_kv_dkv", "block_kv_dkv_compute")):
        b, c = getattr(bs, block), getattr(bs, compute)
        if b is not None and c is not None and b % c:
            raise SplashConstraintError(
                f"block_sizes.{block}={b} is not a multiple of block_sizes.{compute}={c}: the kernel "
                f"walks each kv block in compute-sized steps. Use a {compute} that divides {b} "
                f"(e.g. {math.gcd(b, c)}), or leave it None."
            )


def _planned_block(length128: int, target: int) -> int:
    """The largest power-of-two multiple of 128 up to `target` whose padding waste stays small."""
    block = min(target, length128)
    block = 1 << (block.bit_length() - 1) if block & (block - 1) else block
    while block > LANES and _round_up(length128, block) - length128 > length128 // 8:
        block //= 2
    return block


def _fit_compute(block: int, compute: int) -> int:
    compute = min(compute, block)
    return compute if block % compute == 0 else math.gcd(block, compute)


def _fit_vmem(blocks: dict, user: BlockSizes, head_dim: int) -> None:
    """Halve planned blocks of a TPU kernel until it fits VMEM; explicit blocks that do not fit
    are the caller's to change."""
    for kernel, q_name, kv_name in _KERNEL_BLOCKS:
        if q_name not in blocks:
            continue
        while not _fits_vmem(blocks[q_name], blocks[kv_name], head_dim, kernel):
            planned = [n for n in (kv_name, q_name) if getattr(user, n) is None and blocks[n] > LANES]
            if kernel == "dq" and blocks[q_name] > DQ_MAX_Q_BLOCK:
                planned = [n for n in planned if n == q_name]
            if not planned:
                given = ", ".join(f"block_sizes.{n}={blocks[n]}" for n in (q_name, kv_name))
                raise SplashConstraintError(
                    f"{given}: the {kernel} kernel's blocks at head_dim {head_dim} do not fit the "
                    f"TPU's VMEM: block_q x block_kv x max(head_dim, 128) must be at most 2**28, and the dq "
                    f"kernel's q block at most {DQ_MAX_Q_BLOCK} (the TPU compiler refuses larger ones; e.g. "
                    "2048 x 1024 at head_dim 128, 1024 x 1024 at 256). Use smaller blocks, or leave them None to "
                    "have them planned."
                )
            name = max(planned, key=lambda n: blocks[n])
            blocks[name] //= 2


def _fits_vmem(q_block: int, kv_block: int, head_dim: int, kernel: str = "forward") -> bool:
    # The dq kernel's VMEM also grows with the sequence: at 512K tokens, head_dim 128, its 2048 x
    # 1024 blocks overran the scoped VMEM (16.88M of 16M) where 1024 x 2048 compiled; at 128K
    # both did. Its q block stays at most 1024.
    if kernel == "dq" and q_block > DQ_MAX_Q_BLOCK:
        return False
    return q_block * kv_block * max(head_dim, LANES) <= VMEM_BUDGET


def _fit_smem(
    blocks: dict, user: BlockSizes, head_dim: int, q128: int, kv128: int, table_heads: int, stored: bool
) -> None:
    """Grow planned blocks of a TPU kernel until its block tables fit SMEM, to at most half the VMEM
    budget: at 576K tokens a dq kernel grown to 2048 x 1024 (the budget's edge, which compiled at
    4K tokens) overran the scoped VMEM by 900K, so planned blocks keep that margin."""
    for kernel, q_name, kv_name in _KERNEL_BLOCKS:
        if q_name not in blocks:
            continue
        limit = SMEM_STORED_TABLE_ENTRIES if stored else SMEM_TABLE_ENTRIES
        while (entries := table_heads * _blocks_along(q128, blocks[q_name]) * _blocks_along(kv128, blocks[kv_name])) > (
            limit
        ):
            grown = {q_name: (blocks[q_name] * 2, blocks[kv_name]), kv_name: (blocks[q_name], blocks[kv_name] * 2)}
            candidates = [
                n
                for n, (bq, bkv) in grown.items()
                if getattr(user, n) is None
                and blocks[n] < (q128 if n == q_name else kv128)
                and _fits_vmem(2 * bq, bkv, head_dim, kernel)
            ]
            if not candidates:
                given = ", ".join(f"block_sizes.{n}={blocks[n]}" for n in (q_name, kv_name) if getattr(user, n))
                fixes = ["set larger explicit blocks, or leave them None to have them planned"] if given else []
                if table_heads > 1:
                    fixes.append("use one mask for all heads, or shard the heads over devices")
                fixes.append("shard the query sequence over devices (partition_spec)")
                raise SplashConstraintError(
                    f"Lq={q128}, Lkv={kv128} (rounded to 128){' with ' + given if given else ''}: the {kernel} kernel "
                    f"needs {entries} block-table entries ({table_heads} x {_blocks_along(q128, blocks[q_name])} x "
                    f"{_blocks_along(kv128, blocks[kv_name])}: heads x q blocks x kv blocks), more than the "
                    f"{limit} the TPU's 1 MiB SMEM holds{' (stored mask blocks add a table)' if stored else ''}, "
                    f"even with the largest blocks its VMEM allows. To fit: {'; '.join(fixes)}."
                )
            name = min(candidates, key=lambda n: blocks[n])
            blocks[name] *= 2


@functools.lru_cache(maxsize=policy.PLANS)
def plan_blocks(
    q_len: int,
    kv_len: int,
    user: BlockSizes,
    platform: str,
    head_dim: int = LANES,
    table_heads: int = 1,
    stored: bool = False,
) -> tuple[int, int, tuple]:
    """(q_len_padded, kv_len_padded, blocks) for one call; cached, it is a pure function."""
    _check_user_blocks(user)
    target = _TARGETS[platform]
    q128, kv128 = lane_padded(q_len), lane_padded(kv_len)
    fused = target["fused"] if user.use_fused_bwd_kernel is None else user.use_fused_bwd_kernel
    if user.use_fused_bwd_kernel is None and (user.block_q_dq or user.block_kv_dq):
        fused = False  # the caller asked for dq blocks, so they want the separate dq kernel

    def block(name: str, length128: int) -> int:
        given = getattr(user, name)
        return _planned_block(length128, target["block"]) if given is None else min(given, length128)

    q_names = ("block_q", "block_q_dkv") + (() if fused else ("block_q_dq",))
    kv_names = ("block_kv", "block_kv_dkv") + (() if fused else ("block_kv_dq",))
    blocks = {n: block(n, q128) for n in q_names}
    blocks.update({n: block(n, kv128) for n in kv_names})
    if platform == "tpu":
        _fit_vmem(blocks, user, head_dim)
        _fit_smem(blocks, user, head_dim, q128, kv128, table_heads, stored)
    for b, c in (("block_kv", "block_kv_compute"), ("block_kv_dkv", "block_kv_dkv_compute")):
        given = getattr(user, c)
        blocks[c] = _fit_compute(blocks[b], target["compute"] if given is None else given)
    q_pad = _round_up(q128, math.lcm(*(blocks[n] for n in q_names)))
    kv_pad = _round_up(kv128, math.lcm(*(blocks[n] for n in kv_names)))
    blocks["use_fused_bwd_kernel"] = fused
    for layout in ("q_layout", "k_layout", "v_layout"):
        if getattr(user, layout) is not None:
            blocks[layout] = getattr(user, layout)
    return q_pad, kv_pad, tuple(sorted(blocks.items()))


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
) -> Plan:
    """Plan one attention call. Shapes must already be checked by the caller (the torch side).

    With q_shards > 1 the query sequence (q_len, all of it) is split over that many devices, each
    attending its rows to every key: the plan is one shard's, and the shards' positions
    (`Plan.shard_positions`) and block tables become data of the program, not constants. With
    head_shards > 1, num_q_heads and num_kv_heads are one device's heads of that many: a per-head
    mask then has a mask for every device's heads, and its tables are data too.

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
        raise SplashConstraintError(
            f"block_sizes={block_sizes!r}: pass torch_splash.BlockSizes(...) (fields left None are "
            "planned), or None to plan them all."
        )
    per_head = isinstance(mask, MultiHeadMask)
    mask.check(num_q_heads * head_shards if per_head else num_q_heads, q_len, kv_len)
    check_sequence_layout(sequence_layout)
    if q_shards > 1 or sequence_layout == "balanced":
        q_len = _shard_length("Lq", q_len, q_shards, sequence_layout, f"{q_shards} sequence shards")
    check_context_parallel(context_parallel)
    ring = context_parallel == "ring"
    if ring:
        if q_shards < 2:
            raise SplashConstraintError(
                f"context_parallel='ring' over {q_shards} query-sequence shard: a ring needs the sequence sharded "
                "over 2 or more devices (name a mesh axis of size > 1 for dim 2 of partition_spec), or leave "
                "context_parallel unset."
            )
        why = "with context_parallel='ring' k and v are sharded like q, so "
        kv_len = _shard_length("Lkv", kv_len, q_shards, sequence_layout, f"the ring's {q_shards} shards", why)
    if platform not in _TARGETS:
        raise SplashConstraintError(f"platform={platform!r}: expected one of {sorted(_TARGETS)}.")
    table_heads = num_q_heads if per_head else 1  # per-head masks: one table per head
    stored = ring or shared_structured_mask(mask) is None  # the kernel reads stored partial blocks
    q_pad, kv_pad, blocks = plan_blocks(
        q_len, kv_len, block_sizes, platform, max(head_dim, head_dim_v), table_heads, stored
    )
    return Plan(
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
    )


def _shard_length(name: str, length: int, shards: int, layout: str, shards_named: str, why: str = "") -> int:
    """One shard's part of a sequence of `length` split over `shards` in `layout` (in two mirrored
    chunks each when balanced); SplashConstraintError naming `name` when it does not split."""
    balanced = layout == "balanced"
    parts = shards * (2 if balanced else 1)
    if length % parts:
        raise SplashConstraintError(
            f"{name}={length} does not split into {shards_named}{' of two mirrored chunks each' if balanced else ''}: "
            f"{why}{name} must be a multiple of {parts} (pad the sequence, e.g. to {_round_up(length, parts)}, or use "
            "another shard count)."
        )
    return length // shards


def ring_steps(plan: Plan) -> list[Plan]:
    """The plan of each step of a ring plan: step s attends to the keys s shards back."""
    return [dataclasses.replace(plan, ring_step=s) for s in range(plan.q_shards)]
