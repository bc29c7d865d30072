"""The planner: for any lengths and any valid caller blocks, every kernel constraint holds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_splash_jax
from torch_splash_jax.block_planning import plan_blocks
from torch_splash_jax.kernel_limits import FUSED_DQ_BUFFER_BYTES, LANES, SMEM_TABLE_ENTRIES, VMEM_BUDGET

lengths = st.integers(1, 70_000)
maybe_kv_block = st.none() | st.sampled_from([128, 256, 384, 512, 1024, 2048, 4096])
maybe_q_block = st.none() | st.sampled_from([8, 16, 64, 128, 256, 512, 1024])


@st.composite
def user_blocks(draw):
    fused = draw(st.none() | st.booleans())
    dq = (
        {}
        if fused
        else dict(block_q_dq=draw(st.none() | st.sampled_from([128, 256, 512])), block_kv_dq=draw(maybe_kv_block))
    )
    return torch_splash_jax.BlockSizes(
        block_q=draw(maybe_q_block),
        block_kv=draw(maybe_kv_block),
        block_q_dkv=draw(st.none() | st.sampled_from([128, 512])),
        block_kv_dkv=draw(maybe_kv_block),
        block_kv_compute=draw(st.none() | st.just(128)),
        use_fused_bwd_kernel=fused,
        **dq,
    )


@settings(max_examples=400, deadline=None)
@given(
    q_len=lengths,
    kv_len=lengths,
    user=user_blocks(),
    platform=st.sampled_from(["cpu", "tpu"]),
    head_dim=st.sampled_from([64, 128, 256, 512]),
    q_row_bytes=st.sampled_from([0, 16 * 2 * 128, 64 * 2 * 256]),
)
def test_every_plan_satisfies_every_kernel_constraint(q_len, kv_len, user, platform, head_dim, q_row_bytes):
    try:
        q_pad, kv_pad, blocks = plan_blocks(q_len, kv_len, user, platform, head_dim, q_row_bytes=q_row_bytes)
    except torch_splash_jax.SplashConstraintError as refused:
        # only on TPU: explicit blocks too large for VMEM, or too small for the tables to fit SMEM
        assert platform == "tpu" and ("the TPU's VMEM" in str(refused) or "SMEM holds" in str(refused))
        return
    b = dict(blocks)
    if platform == "tpu":
        if b["use_fused_bwd_kernel"]:  # the fused dkv kernel also holds dq for a compute block
            assert b["block_q_dkv"] * b["block_kv_dkv_compute"] * max(head_dim, LANES) <= VMEM_BUDGET // 2
            if user.use_fused_bwd_kernel is None:  # planned fused: its dq buffer stays at most 8 q's or 2 GiB
                copies = kv_pad // b["block_kv_dkv"]
                assert copies <= 8 or 0 < copies * q_pad * q_row_bytes <= FUSED_DQ_BUFFER_BYTES
        for q_name, kv_name in (
            ("block_q", "block_kv"),
            ("block_q_dkv", "block_kv_dkv"),
            ("block_q_dq", "block_kv_dq"),
        ):
            if q_name in b:
                assert b[q_name] * b[kv_name] * max(head_dim, LANES) <= VMEM_BUDGET
                assert (q_pad // b[q_name]) * (kv_pad // b[kv_name]) <= SMEM_TABLE_ENTRIES
        assert b.get("block_q_dq", 0) <= 1024
    assert q_pad >= q_len and kv_pad >= kv_len and q_pad % LANES == 0 and kv_pad % LANES == 0
    q_names = ["block_q", "block_q_dkv"] + ([] if b["use_fused_bwd_kernel"] else ["block_q_dq"])
    kv_names = ["block_kv", "block_kv_dkv"] + ([] if b["use_fused_bwd_kernel"] else ["block_kv_dq"])
    for n in q_names:
        assert q_pad % b[n] == 0 and b[n] <= q_pad
    for n in kv_names + ["block_kv_compute", "block_kv_dkv_compute"]:
        assert b[n] % LANES == 0 and kv_pad % b[n] == 0 and b[n] <= kv_pad
    assert b["block_q"] % 8 == 0  # TPU sublanes
    assert all(b[n] % LANES == 0 for n in q_names[1:])  # backward q blocks sit in lanes on TPU
    assert b["block_kv"] % b["block_kv_compute"] == 0 and b["block_kv_dkv"] % b["block_kv_dkv_compute"] == 0
    for field in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv"):  # honoured unless clamped
        given_value = getattr(user, field)
        if given_value is not None:
            assert b[field] == min(given_value, -(-(q_len if "q" in field.split("_")[1] else kv_len) // LANES) * LANES)
    if user == torch_splash_jax.BlockSizes():  # planned blocks waste at most 1/8 of the 128-aligned length
        for length, padded in ((q_len, q_pad), (kv_len, kv_pad)):
            aligned = -(-length // LANES) * LANES
            assert padded - aligned <= aligned // 8


def test_planned_blocks_prefer_large_sizes():
    q_pad, kv_pad, blocks = plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(), "cpu")
    assert (q_pad, kv_pad) == (4096, 4096)
    assert dict(blocks)["block_q"] == dict(blocks)["block_kv"] == 512
    assert plan_blocks(1, 1, torch_splash_jax.BlockSizes(), "cpu")[:2] == (128, 128)
    assert plan_blocks(1000, 1000, torch_splash_jax.BlockSizes(), "cpu")[:2] == (1024, 1024)


def test_tpu_blocks_that_do_not_fit_vmem_are_refused_or_planned_around():
    with pytest.raises(
        torch_splash_jax.SplashConstraintError, match=r"block_sizes.block_q_dq=2048.*dq kernel's q block"
    ):
        plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(block_q_dq=2048, block_kv_dq=512), "tpu", 128)
    # explicit: refused before any JAX work, naming the caller's fields (the TPU compiler's limit)
    with pytest.raises(
        torch_splash_jax.SplashConstraintError,
        match=r"block_sizes.block_q=2048, block_sizes.block_kv=2048: the forward kernel's blocks",
    ):
        plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(block_q=2048, block_kv=2048), "tpu", 128)
    with pytest.raises(
        torch_splash_jax.SplashConstraintError, match=r"block_q_dkv=1024, block_sizes.block_kv_dkv=1024"
    ):
        plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(block_q_dkv=1024, block_kv_dkv=1024), "tpu", 512)
    # at the edge it is allowed (tests/test_tpu_compile.py compiles it), and the CPU has no VMEM rule
    plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(block_q=2048, block_kv=1024), "tpu", 128)
    plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(block_q=2048, block_kv=2048), "cpu", 128)
    # planned blocks shrink for very large head dims
    for fused in (True, False):
        user = torch_splash_jax.BlockSizes(use_fused_bwd_kernel=fused)
        blocks = dict(plan_blocks(4096, 4096, user, "tpu", 2048)[2])
        for q_name, kv_name in (
            ("block_q", "block_kv"),
            ("block_q_dq", "block_kv_dq"),
            ("block_q_dkv", "block_kv_dkv"),
        ):
            if q_name in blocks:
                assert blocks[q_name] * blocks[kv_name] * 2048 <= 1 << 28
        if fused:
            assert blocks["block_q_dkv"] * blocks["block_kv_dkv_compute"] * 2048 <= 1 << 27


def test_the_fused_backward_s_compute_block_fits_vmem():
    """JAX's fused dkv kernel holds dq too: 1024 x 1024 blocks at head_dim 256 compiled for v5e and
    v5p with kv compute blocks of 512 and were refused with 1024 (tests/test_tpu_compile.py)."""
    fused = dict(block_q_dkv=1024, block_kv_dkv=1024, use_fused_bwd_kernel=True)
    blocks = dict(plan_blocks(4096, 4096, torch_splash_jax.BlockSizes(**fused), "tpu", 256)[2])
    assert blocks["block_kv_dkv_compute"] == 512
    explicit = torch_splash_jax.BlockSizes(**fused, block_kv_dkv_compute=1024)
    with pytest.raises(
        torch_splash_jax.SplashConstraintError,
        match=r"block_q_dkv=1024, block_sizes.block_kv_dkv_compute=1024 with the fused backward",
    ):
        plan_blocks(4096, 4096, explicit, "tpu", 256)
    separate = torch_splash_jax.BlockSizes(**dict(fused, use_fused_bwd_kernel=False), block_kv_dkv_compute=1024)
    assert dict(plan_blocks(4096, 4096, separate, "tpu", 256)[2])["block_kv_dkv_compute"] == 1024


SIXTEEN_HEADS = 16 * 2  # q's bytes per query position and head_dim: B=1, 16 heads, bf16


@pytest.mark.parametrize(
    "length,head_dim,q_row_bytes,dkv,fused",
    [
        (16384, 128, 0, (1024, 2048), True),
        (32768, 128, 0, (512, 4096), True),  # the same VMEM, its dq buffer kept to 8 q's
        (32768, 128, SIXTEEN_HEADS * 128, (1024, 2048), True),  # 16 q's are 2 GiB: kept
        (32768, 128, 4 * SIXTEEN_HEADS * 128, (512, 4096), True),  # at B=4 they would be 8 GiB
        (65536, 128, SIXTEEN_HEADS * 128, (1024, 2048), False),  # 16 q's at 512 x 4096 are 4 GiB
        (8192, 256, 0, (1024, 1024), True),
        (16384, 256, 0, (512, 2048), True),  # traded as at 128, its compute block halved to fit VMEM
        (16384, 256, SIXTEEN_HEADS * 256, (1024, 1024), True),
        (32768, 256, 0, (1024, 1024), False),
    ],
)
def test_the_tpu_plan_fuses_the_backward_while_its_dq_buffer_stays_small(length, head_dim, q_row_bytes, dkv, fused):
    """JAX's fused backward keeps a dq per kv block of the dkv kernel (at 128K tokens, 16 heads,
    2048-token kv blocks: 32 GiB); the plan fuses while that is at most 8 q's or 2 GiB, trading q
    blocks for kv blocks to get there, else runs the dq kernel; an explicit choice is the caller's."""
    q_pad, kv_pad, blocks = plan_blocks(
        length, length, torch_splash_jax.BlockSizes(), "tpu", head_dim, q_row_bytes=q_row_bytes
    )
    blocks = dict(blocks)
    assert (blocks["block_q_dkv"], blocks["block_kv_dkv"]) == dkv
    assert blocks["use_fused_bwd_kernel"] is fused
    assert ("block_q_dq" in blocks) is not fused
    assert (blocks["block_q"], blocks["block_kv"]) == ((2048, 1024) if head_dim == 128 else (1024, 1024))
    if fused:
        assert blocks["block_kv_dkv_compute"] == (256 if dkv == (512, 2048) and head_dim == 256 else 512)
        copies = kv_pad // blocks["block_kv_dkv"]
        assert copies <= 8 or copies * q_pad * q_row_bytes <= FUSED_DQ_BUFFER_BYTES
    explicit = dict(
        plan_blocks(length, length, torch_splash_jax.BlockSizes(use_fused_bwd_kernel=True), "tpu", head_dim)[2]
    )
    assert explicit["use_fused_bwd_kernel"] is True


def test_tpu_block_tables_that_do_not_fit_smem_grow_the_blocks_or_are_refused():
    def entries(q_len, blocks, table_heads=1):
        return [
            table_heads * -(-q_len // blocks[q]) * -(-q_len // blocks[kv])
            for q, kv in (("block_q", "block_kv"), ("block_q_dq", "block_kv_dq"), ("block_q_dkv", "block_kv_dkv"))
        ]

    assert dict(plan_blocks(262144, 262144, torch_splash_jax.BlockSizes(), "tpu", 128)[2])["block_q"] == 2048
    for length, heads in ((393216, 1), (524288, 1), (131072, 16)):
        blocks = dict(plan_blocks(length, length, torch_splash_jax.BlockSizes(), "tpu", 128, heads)[2])
        assert max(entries(length, blocks, heads)) <= SMEM_TABLE_ENTRIES
    # an explicit small q block: its kv block grows until the forward's table fits (compiled in test_tpu_compile)
    grown = dict(plan_blocks(393216, 393216, torch_splash_jax.BlockSizes(block_q=256), "tpu", 128)[2])
    assert (grown["block_q"], grown["block_kv"]) == (256, 4096)
    with pytest.raises(torch_splash_jax.SplashConstraintError, match=r"Lq=1048576, Lkv=1048576 .* SMEM"):
        plan_blocks(1 << 20, 1 << 20, torch_splash_jax.BlockSizes(), "tpu", 128)
    with pytest.raises(
        torch_splash_jax.SplashConstraintError, match=r"with block_sizes.block_q=512, block_sizes.block_kv=512"
    ):
        plan_blocks(393216, 393216, torch_splash_jax.BlockSizes(block_q=512, block_kv=512), "tpu", 128)


def test_stored_mask_tables_keep_to_the_smem_and_vmem_that_compiled():
    """Masks read from stored partial blocks add a third table (mask_next): a per-head step planned
    to 2**18 entries (16 heads at 128K) was refused by the TPU compiler for SMEM, so stored tables
    keep to 3/5 of the entries. One v5e chip then cannot hold 16 per-head tables at 128K (the error
    says to shard the query sequence); 4 sequence shards, or a mask the kernel evaluates, can. The
    dq and dkv kernels of a stored mask also keep to half the VMEM budget (1024 x 2048 overran it
    at 128K)."""
    from torch_splash_jax.kernel_limits import SMEM_STORED_TABLE_ENTRIES

    per_head = torch_splash_jax.MultiHeadMask([torch_splash_jax.CausalMask(), torch_splash_jax.LocalMask(4095, 0)] * 8)
    common = dict(batch=1, num_q_heads=16, num_kv_heads=8, head_dim=128, head_dim_v=128, dtype="bfloat16")
    common.update(scale=0.1, platform="tpu", kv_len=131072, q_len=131072)
    with pytest.raises(
        torch_splash_jax.SplashConstraintError,
        match=r"stored mask blocks add a table.*one mask for all heads.*shard the query sequence",
    ):
        torch_splash_jax.plan(mask=per_head, **common)
    torch_splash_jax.plan(mask=torch_splash_jax.CausalMask(), **common)  # one shared table: fits
    sharded = torch_splash_jax.plan(mask=per_head, q_shards=4, sequence_layout="balanced", **common)
    blocks = sharded.block_sizes()
    for q, kv in (("block_q", "block_kv"), ("block_q_dq", "block_kv_dq"), ("block_q_dkv", "block_kv_dkv")):
        assert 16 * (sharded.q_len_padded // blocks[q]) * (131072 // blocks[kv]) <= SMEM_STORED_TABLE_ENTRIES
    four_heads = torch_splash_jax.MultiHeadMask(
        [torch_splash_jax.CausalMask(), torch_splash_jax.LocalMask(4095, 0)] * 2
    )
    blocks = torch_splash_jax.plan(mask=four_heads, **dict(common, num_q_heads=4, num_kv_heads=2)).block_sizes()
    for q, kv in (("block_q_dq", "block_kv_dq"), ("block_q_dkv", "block_kv_dkv")):
        assert blocks[q] * blocks[kv] * 128 <= VMEM_BUDGET // 2


def test_a_tpu_plan_of_a_sharded_query_sequence_keeps_512_blocks_and_the_dq_kernel():
    """Sequence-sharded kernels evaluate their mask from the query positions: the ring's forward at
    2048 x 1024 ran out of VMEM where 512 blocks compiled (tests/test_commands.py compiles the ring)."""
    for strategy in ("all_gather", "ring"):
        plan = torch_splash_jax.plan(
            q_len=32768, num_q_heads=8, head_dim=128, dtype="bfloat16", mask=torch_splash_jax.CausalMask(),
            platform="tpu", q_shards=4, sequence_layout="balanced", context_parallel=strategy,
        )  # fmt: skip
        blocks = plan.block_sizes()
        assert blocks["use_fused_bwd_kernel"] is False
        assert {blocks[n] for n in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq")} == {512}


def test_the_dq_buffer_byte_bound_follows_the_call_and_leaves_stored_masks_to_the_count():
    """plan() sizes the fused backward's dq buffer from the call (batch, heads, head_dim, dtype):
    at 32K tokens, 16 bf16 heads of 128, its 16 q's (2 GiB) are kept at B=1 and traded at B=4. A
    mask read from stored blocks keeps the count bound (its fused 512 x 2048 overran VMEM), and is
    never traded to longer kv blocks (at 16K tokens they overran it too): the dq kernel runs."""
    causal = torch_splash_jax.CausalMask()
    per_head = torch_splash_jax.MultiHeadMask(
        tuple(causal if h % 2 else torch_splash_jax.LocalMask(4095, 0) for h in range(16))
    )

    def dkv(batch, mask, dtype="bfloat16", length=32768):
        blocks = torch_splash_jax.plan(
            q_len=length, num_q_heads=16, head_dim=128, batch=batch, dtype=dtype, mask=mask, platform="tpu"
        ).block_sizes()
        return blocks["use_fused_bwd_kernel"], blocks["block_q_dkv"], blocks["block_kv_dkv"]

    assert dkv(1, causal) == (True, 1024, 2048)
    assert dkv(4, causal) == (True, 512, 4096)
    # float32: half the VMEM budget (1024 x 1024 blocks), and even traded to 512 x 2048 its dq buffer
    # (16 q's of twice the bytes, 4 GiB) passes both bounds: the dq kernel runs
    assert dkv(1, causal, "float32") == (False, 1024, 1024)
    assert dkv(1, per_head) == (False, 1024, 1024)
    assert dkv(1, per_head, length=16384) == (False, 1024, 1024)  # was traded to 512 x 2048


def _plan(batch, hq, hkv, mask=None, dtype="float32", **options):
    return torch_splash_jax.plan(
        batch=batch, num_q_heads=hq, num_kv_heads=hkv, q_len=256, head_dim=64, dtype=dtype, mask=mask, **options
    )


def test_batches_run_as_heads_where_heads_and_batch_elements_share_the_mask():
    """The kernels see the batch as more heads where every head and batch element shares one mask;
    per-head masks and segment ids (per batch element) take one kernel call per element instead.
    MQA's kernel (k and v without a head axis) serves one kv head per call: a folded batch of B > 1
    MQA elements is a GQA call of B kv heads."""
    causal = torch_splash_jax.CausalMask()
    per_head = torch_splash_jax.MultiHeadMask((causal, torch_splash_jax.LocalMask(8)))
    assert (_plan(4, 16, 16, causal).batch_in_heads, _plan(4, 16, 16, causal).kernel_heads) == (True, (64, 64))
    assert (_plan(3, 4, 1).kernel_heads, _plan(3, 4, 1).is_mqa) == ((12, 3), False)
    assert (_plan(1, 4, 1).kernel_heads, _plan(1, 4, 1).is_mqa) == ((4, 1), True)
    with_ids = _plan(4, 4, 1, causal, has_segment_ids=True)
    assert (with_ids.batch_in_heads, with_ids.kernel_heads, with_ids.is_mqa) == (False, (4, 1), True)
    assert (_plan(4, 2, 2, per_head).batch_in_heads, _plan(4, 2, 2, per_head).kernel_heads) == (False, (2, 2))


def _run(program, plan, dtype, rounded_to=None, seed=0):
    """forward and backward of a program on random inputs of its plan's shapes, in `dtype` (first
    rounded to `rounded_to`)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = [
        (plan.batch, plan.num_q_heads, plan.q_len, plan.head_dim),
        (plan.batch, plan.num_kv_heads, plan.kv_len, plan.head_dim),
        (plan.batch, plan.num_kv_heads, plan.kv_len, plan.head_dim_v),
    ]

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(rounded_to or dtype).astype(dtype)

    q, k, v = (normal(*s) for s in shapes)
    named = dict(q=q, k=k, v=v)
    if plan.has_sinks:
        named["sinks"] = jnp.asarray(rng.standard_normal(plan.num_q_heads, np.float32))
    args = program.arguments("forward", tables=program.tables(), **named)
    out, lse = program.forward(*args)
    d_out = normal(*out.shape)
    return [out, *program.backward(*args, out, lse, d_out)]


def test_a_call_per_batch_element_gives_what_the_batch_as_heads_gives():
    """The two batch layouts run the same kernel on the same rows: equal results (GQA, sinks)."""
    from torch_splash_jax.splash_program import Program

    plan = _plan(3, 4, 2, torch_splash_jax.LocalMask(40), has_sinks=True)
    assert plan.batch_in_heads
    folded = _run(Program(plan), plan, "float32")
    looped = _run(Program(plan, batch_in_heads=False), plan, "float32")
    assert [x.shape for x in folded] == [x.shape for x in looped]
    for a, b in zip(folded, looped):
        np_a, np_b = (__import__("numpy").asarray(x) for x in (a, b))
        assert abs(np_a - np_b).max() <= 1e-5 * max(abs(np_b).max(), 1.0)


def test_float16_runs_as_float32_on_the_jax_side():
    """Mosaic has no float16 ("Unsupported type in mosaic dialect: 'f16'"): a float16 plan computes in
    float32 and returns float16, the float32 results rounded; its blocks are planned for 4-byte inputs."""
    import numpy as np

    from torch_splash_jax.splash_program import Program

    half, full = (_plan(2, 4, 2, torch_splash_jax.CausalMask(), dtype=d) for d in ("float16", "float32"))
    assert half.block_sizes() == full.block_sizes()
    got = _run(Program(half), half, "float16")
    expected = _run(Program(full), full, "float32", rounded_to="float16")  # the same inputs, in float32
    assert all(a.dtype == np.float16 for a in got)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]).astype(np.float16))
    # the backward reads the caller's output, which float16 holds rounded: within that rounding
    for a, b in zip(got[1:], expected[1:]):
        b = np.asarray(b)
        assert np.abs(np.asarray(a, np.float32) - b).max() <= 2**-9 * np.abs(b).max()


@pytest.mark.parametrize(
    "call,blocks",
    [
        # float32: 2048 x 1024 at head_dim 128 overran v5e's scoped VMEM (16.68M of 16M)
        (dict(dtype="float32"), dict(block_q=1024, block_kv=1024)),
        # segment ids below head_dim 128: the forward at 2048 x 1024 overran it (16.89M)
        (dict(head_dim=64, has_segment_ids=True), dict(block_q=1024, block_kv=1024)),
        (dict(head_dim=128, has_segment_ids=True), dict(block_q=2048, block_kv=1024)),
        # a soft cap at head_dim 256: the fused dkv kernel's compute block of 512 overran it (16.41M)
        (dict(head_dim=256, soft_cap=50.0), dict(block_q_dkv=1024, block_kv_dkv_compute=256)),
        (dict(head_dim=256), dict(block_q_dkv=1024, block_kv_dkv_compute=512)),
        # float32 (float16 computes in it) with segment ids: the dkv kernel at 1024 x 512 overran it
        (
            dict(dtype="float16", head_dim=256, has_segment_ids=True, soft_cap=50.0, q_len=131072, batch=1),
            dict(block_q_dkv=512, block_kv_dkv=512),
        ),
    ],
)
def test_the_vmem_rule_follows_what_the_tpu_compiler_refused(call, blocks):
    """Blocks the TPU compiler refused for v5e (libtpu 0.0.21, the sweep of tests/tpu_sweep.py) are
    never planned: the VMEM budget halves for float32 inputs, for the forward with segment ids below
    head_dim 128, for the fused dkv kernel's compute block with a soft cap above head_dim 128, and
    for the dkv kernel of float32 with segment ids."""
    fields = dict(q_len=8192, num_q_heads=16, head_dim=128, batch=8, dtype="bfloat16", platform="tpu")
    planned = torch_splash_jax.plan(**{**fields, **call}, mask=torch_splash_jax.CausalMask()).block_sizes()
    assert {name: planned[name] for name in blocks} == blocks


def test_float32_blocks_a_caller_sets_are_held_to_what_compiled():
    """The planner keeps float32 to half the VMEM budget; a caller's own float32 blocks keep the
    bfloat16 budget, at which 1024 x 1024 blocks compiled at head_dim 256 in every kernel (v5e),
    and are refused past it, and for the forward past 1024-row q blocks (2048 x 512 overran)."""
    every = dict.fromkeys(("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"), 1024)

    def blocks(**user):
        return plan_blocks(2048, 2048, torch_splash_jax.BlockSizes(**user), "tpu", 256, itemsize=4)[2]

    assert dict(blocks(**every))["block_q"] == 1024
    with pytest.raises(torch_splash_jax.SplashConstraintError, match="float32's forward q block at most 1024"):
        blocks(block_q=2048, block_kv=512)


def test_the_active_kernels_key_blocks_are_chosen_per_generation_above_head_dim_128():
    """2048-key blocks at head_dim 128; above it (q's or v's) 2048 on v6e and v7x, where the estimate
    has the step shorter and every kernel's code in one instruction overlay, and 1024 elsewhere and
    where the generation is not known; the programs' blocks follow the plan."""
    from torch_splash_jax.splash_program import Program

    generations = (None, "v5e", "v5p", "v6e", "v7x")
    fields = dict(q_len=16384, num_q_heads=2, dtype="bfloat16", platform="tpu", mask=torch_splash_jax.CausalMask())
    for dims, expected in (
        (dict(head_dim=128), [2048] * 5),
        (dict(head_dim=256), [1024, 1024, 1024, 2048, 2048]),
        (dict(head_dim=128, head_dim_v=256), [1024, 1024, 1024, 2048, 2048]),
    ):
        plans = [torch_splash_jax.plan(**fields, **dims, generation=g) for g in generations]
        assert [p.active_block_kv for p in plans] == expected
        for plan, most in zip(plans, expected):
            program = Program(plan)
            assert program.active.blocks["block_kv"] == most
            assert program.active_backward.blocks["block_kv"] == most


def test_the_active_forward_s_q_blocks_are_chosen_per_generation():
    """4096-row q blocks for the forward on v6e, where the estimate has it shorter by more than its
    miss on the v5e and its code in one instruction overlay, their partial blocks in 1024-row tiles
    (16 tiles of 512 keys) as straight-line code, else 2048; 2048 elsewhere and where the generation
    is not known (4096 outgrew the v5e's overlay and ran 2.1x to 3.0x as long; v7x's gains are
    within the miss). The backward's stay 1024 rows, a mask read from stored blocks keeps
    blocks of at most 1024, and the programs' blocks follow the plan."""
    from torch_splash_jax.splash_program import Program

    generations = (None, "v5e", "v5p", "v6e", "v7x")
    fields = dict(q_len=16384, num_q_heads=2, head_dim=128, dtype="bfloat16", platform="tpu")
    expected = [2048, 2048, 2048, 4096, 2048]
    plans = [torch_splash_jax.plan(**fields, mask=torch_splash_jax.CausalMask(), generation=g) for g in generations]
    assert [p.active_block_q for p in plans] == expected
    for plan, most in zip(plans, expected):
        program = Program(plan)
        assert program.active.blocks["block_q"] == most
        assert program.active.blocks["block_q_sub"] == most // 4
        assert program.active_backward.blocks["block_q"] == 1024
    # where the longer blocks would run a branch a tile (too many tile patterns for straight-line
    # code, which outgrew an instruction overlay), the forward falls back to 2048: causal at 6144
    # (3072-row blocks across 2048-key ones), a 4096 window at 32K
    short = torch_splash_jax.plan(**dict(fields, q_len=6144), mask=torch_splash_jax.CausalMask(), generation="v6e")
    assert Program(short).active.blocks["block_q"] == 2048
    window = torch_splash_jax.plan(
        **dict(fields, q_len=32768), mask=torch_splash_jax.LocalMask(4095, 0), generation="v6e"
    )
    assert window.active_block_q == 4096 and Program(window).active.blocks["block_q"] == 2048
    tri = torch_splash_jax.DenseMask(np.tri(4096, dtype=bool))
    stored = torch_splash_jax.plan(**dict(fields, q_len=4096), mask=tri, generation="v6e")
    assert stored.active_block_q == 4096 and Program(stored).active.blocks["block_q"] == 1024


def test_a_plan_is_for_a_known_generation_or_none_and_chooses_its_row_sums_logits_and_scheduler_by_it():
    """`Plan.generation` (the caller's, or torch_xla's device's) is one the estimator knows; the
    active forward sums its rows in the MXU on v6e where head_dim_v 128 leaves half of its 256-wide
    MXUs idle, on the vector unit everywhere else (and where the generation is not known); it lays
    its logits out transposed on v7x only; the active kernels ask for the compiler's LP scheduler
    on v7x only."""
    with pytest.raises(torch_splash_jax.SplashConstraintError, match="generation='v4'"):
        torch_splash_jax.plan(q_len=256, generation="v4")
    fields = dict(q_len=1024, num_q_heads=4, head_dim=128, dtype="bfloat16", platform="tpu")
    generations = (None, "v5e", "v5p", "v6e", "v7x")
    sums = [torch_splash_jax.plan(**fields, generation=g).row_sums for g in generations]
    assert sums == ["vector", "vector", "vector", "mxu", "vector"]
    logits = [torch_splash_jax.plan(**fields, generation=g).forward_logits for g in generations]
    assert logits == ["rows", "rows", "rows", "rows", "transposed"]
    schedulers = [torch_splash_jax.plan(**fields, generation=g).scheduler for g in generations]
    assert schedulers == ["default", "default", "default", "default", "lp"]
    for head_dim in (64, 256):
        assert torch_splash_jax.plan(**dict(fields, head_dim=head_dim), generation="v6e").row_sums == "vector"
