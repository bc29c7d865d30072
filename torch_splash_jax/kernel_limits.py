"""The TPU's limits on the splash kernels' blocks, as measured with its compiler: lanes and
sublanes, VMEM per kernel, SMEM for the block tables, and the fused backward's dq buffer.

Pure Python: the numbers block planning (`block_planning`) and the checks of explicit block sizes
(`block_sizes`) apply.
"""

from __future__ import annotations

import dataclasses

# The TPU generations the planner and the estimator know (tpu_time.chips has their figures), and
# the device kinds PJRT reports for them (JAX's `device_kind`, torch_xla's `xla_device_kind`) and
# the chip names TorchTPU gives (`torch.tpu.get_device_name`: "TPU v7" is Ironwood, v7x).
GENERATIONS = ("v5e", "v5p", "v6e", "v7x")
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e",
                "TPU v6e": "v6e", "TPU7x": "v7x", "TPU v7x": "v7x", "TPU v7": "v7x"}  # fmt: skip
WIDE_MXU = ("v6e", "v7x")  # 256 x 256 MXUs; v5e's and v5p's are 128 x 128


LANES = 128  # NUM_LANES in the kernel: kv blocks live in vector lanes
SUBLANES = 8  # NUM_SUBLANES: the TPU's second-minor tile dimension

# A TPU kernel's blocks must fit its VMEM. Measured with the TPU compiler for v5e (torch_splash_jax.tpu_time.aot):
# every kernel compiled whose block_q x block_kv x max(head_dim, 128) was at most 2**28 (2048 x 1024
# and 1024 x 2048 at head_dim 128; 1024 x 1024 at 256; 512 x 512 at 512), and every one above it
# was refused ("Ran out of memory in memory space vmem": 2048 x 2048 at 128; 1024 x 2048 and
# 2048 x 1024 at 256; the dkv kernel at 1024 x 1024 and head_dim 512). The kv compute block did
# not matter there (2048 x 2048 failed with compute blocks of 512), but it does in the fused dkv
# kernel, which also holds dq for a compute block: 1024 x 1024 blocks at head_dim 256 compiled with
# compute blocks of 512 and were refused with 1024 on v5e and v5p, so there block_q_dkv x
# block_kv_dkv_compute x max(head_dim, 128) is at most half the budget.
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
# The active-block forward's tables hold four int32 an entry (q block, kv block, flags, tile
# kinds): the same 768 KiB.
ACTIVE_TABLE_ENTRIES = (768 << 10) // 16


def active_table_entries(stored: bool) -> int:
    """The most entries an active-block list may have: its tables fill SMEM (a fifth table, each
    entry's stored block, with a stored mask)."""
    return ACTIVE_TABLE_ENTRIES * 4 // 5 if stored else ACTIVE_TABLE_ENTRIES


DQ_MAX_Q_BLOCK = 1024
F32_MAX_FORWARD_Q_BLOCK = 1024
# The fused backward's dq buffer may always hold `fused_max_kv_blocks` copies of q, and more up to
# an eighth of the smallest TPU's HBM (v5e, 16 GiB): at 32K tokens, 16 heads, D=128 (and 16K at
# D=256), B=1 bf16, its 16 copies (2 GiB) keep the dkv kernel's 1024 x 2048 (1024 x 1024) blocks,
# estimated 1% to 6% faster than the trade to 8 copies (docs/benchmarks.md, "Search"); at 128K
# tokens 64 copies would be 32 GiB, and at B=4 the same 16 copies 8 GiB. Masks read from stored
# blocks keep the count bound (`plan`).
FUSED_DQ_BUFFER_BYTES = 2 << 30


# float16 has no TPU kernel (Mosaic refuses it: "Unsupported type in mosaic dialect: 'f16'"): the
# programs compute it in float32, as torch_splash computes torch.float16.
COMPUTED_AS = {"float16": "float32"}
_ITEMSIZE = {"bfloat16": 2, "float32": 4}


def compute_dtype(dtype: str) -> str:
    """The dtype the kernels run a call of `dtype` in."""
    return COMPUTED_AS.get(dtype, dtype)


def kernel_itemsize(dtype: str) -> int:
    """Bytes per element of q, k and v as the kernels hold them."""
    return _ITEMSIZE.get(compute_dtype(dtype), 4)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What sets a kernel's VMEM beside its blocks: head_dim, a mask read from stored blocks, the
    itemsize of q, k and v as the kernels hold them, segment ids."""

    head_dim: int = LANES
    stored: bool = False
    itemsize: int = 2
    segment_ids: bool = False
    soft_cap: bool = False
    # Blocks the caller chose: held to what was measured to compile, not to the planner's margin.
    explicit: bool = False

    def budget(self, kernel: str = "forward") -> int:
        """The budget of the rule `fits` applies: VMEM_BUDGET, halved for a mask read from stored
        blocks and for the forward with segment ids below head_dim 128 (measured, v5e, libtpu
        0.0.21: the forward at 2048 x 1024, head_dim 64, overran the scoped VMEM at 64K tokens,
        16.89M of 16M with 14 heads, 16.83M with 12, and at 128K, 16.33M, where head_dim 128 and 256
        compiled). kernel="fused": the fused dkv kernel's q block x kv compute block x max(head_dim,
        128), which also holds dq: half the budget, and half again with a soft cap above head_dim 128
        (at head_dim 256, 1024 x 1024 blocks and compute blocks of 512 overran it with 128 folded
        heads, 16.41M, where compute blocks of 256 compiled, and without the soft cap 512 did).

        float32 inputs halve every planned budget: the planner's bfloat16 blocks overran it in
        float32 (the forward at 2048 x 1024, head_dim 128, 32K tokens: 16.68M; the fused dkv kernel at
        1024 x 2048, compute blocks of 512: 16.19M), where halved ones compiled; with segment ids the
        dkv kernel's halves again (1024 x 512 at head_dim 256, 128K tokens, overran where 512 x 512
        compiled). Blocks the caller
        chose keep the bfloat16 budget, at which float32 was measured to compile (1024 x 1024 at
        head_dim 256 in every kernel), with the forward's q block at most 1024 (`fits`)."""
        budget = VMEM_BUDGET // (2 if self.itemsize > 2 and not self.explicit else 1)
        if kernel == "fused":
            return budget // (4 if self.soft_cap and self.head_dim > LANES else 2)
        if self.stored:
            budget //= 2
        if kernel == "forward" and self.segment_ids and self.head_dim < LANES:
            budget //= 2
        if kernel == "dkv" and self.segment_ids and self.itemsize > 2 and not self.explicit:
            budget //= 2
        return budget

    def fits(self, q_block: int, kv_block: int, kernel: str = "forward") -> bool:
        """Whether a kernel's (q, kv) blocks fit the TPU's VMEM (`kernel`: "forward", "dq" or "dkv")."""
        # The dq kernel's VMEM also grows with the sequence: at 512K tokens, head_dim 128, its 2048 x
        # 1024 blocks overran the scoped VMEM (16.88M of 16M) where 1024 x 2048 compiled; at 128K
        # both did. Its q block stays at most 1024. With a mask read from stored blocks the backward
        # kernels also hold the mask's blocks: at 128K tokens, 4 heads, a per-head mask, the dq kernel
        # at 1024 x 2048 overran the scoped VMEM (19.22M of 16M, v5e, libtpu 0.0.21) and so did the dkv
        # kernel at 1024 x 2048 with libtpu 0.0.52, where both compiled at 1024 x 1024; and so does the
        # forward, whose mask blocks are int32 on TPU (two buffers of 8 MiB at 2048 x 1024): with
        # FlexAttention's document mask at 8K tokens, 16 heads, D=128, 2048 x 1024 overran it (17.91M
        # of 16M, v5e, libtpu 0.0.21). With stored blocks every kernel keeps to half the budget.
        if kernel == "dq" and q_block > DQ_MAX_Q_BLOCK:
            return False
        # float32's forward at q blocks of 2048 overran the scoped VMEM (2048 x 1024 at head_dim 128
        # and 32K tokens; 2048 x 512 at 256), where 1024-row blocks compiled at the rule's edge
        if kernel == "forward" and self.itemsize > 2 and q_block > F32_MAX_FORWARD_Q_BLOCK:
            return False
        return q_block * kv_block * max(self.head_dim, LANES) <= self.budget(kernel)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def lane_padded(length: int) -> int:
    """The length every sequence is padded to at least: the next multiple of the lane width (128).
    A caller that pads keys to it itself (HF decoding) adds no padding the kernel would not."""
    return round_up(length, LANES)
