"""TPU readiness without a TPU: the exact jitted functions the bridge runs, planned for TPU,
lower to Mosaic custom calls. Lowering for TPU enforces the block-shape rules interpret mode ignores."""

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backward_kernels

import torch_splash_jax
from torch_splash_jax.masks import CausalMask, FullMask

CONFIGS = [
    # (batch, hq, hkv, q_len, kv_len, d, dv, dtype, mask, segment ids)
    (2, 8, 8, 2048, 2048, 128, 128, "float32", CausalMask(0), False),
    (1, 4, 1, 1, 1000, 64, 64, "bfloat16", CausalMask(999), False),
    (2, 6, 2, 129, 129, 64, 32, "float32", FullMask(), True),
    (1, 2, 2, 7, 300, 128, 128, "bfloat16", CausalMask(0), True),
    (1, 8, 4, 1000, 1000, 64, 64, "float32", CausalMask(0), False),
]


def _plan(batch, hq, hkv, q_len, kv_len, d, dv, dtype, mask, seg, **kw):
    return torch_splash_jax.plan(
        batch=batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=d,
        head_dim_v=dv,
        dtype=dtype,
        mask=mask,
        scale=d**-0.5,
        has_segment_ids=seg,
        platform="tpu",
        **kw,
    )


def _count_custom_calls(exported) -> int:
    return exported.mlir_module().count("tpu_custom_call")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[1]}x{c[2]}-L{c[3]}x{c[4]}-{c[7]}-seg{c[9]}")
def test_forward_and_backward_lower_for_tpu(config):
    batch, hq, hkv, q_len, kv_len, d, dv, dtype, mask, seg = config
    plan = _plan(*config)
    program = torch_splash_jax.program(plan)
    dt = jnp.dtype(dtype)
    args = [
        jax.ShapeDtypeStruct((batch, hq, q_len, d), dt),
        jax.ShapeDtypeStruct((batch, hkv, kv_len, d), dt),
        jax.ShapeDtypeStruct((batch, hkv, kv_len, dv), dt),
    ]
    if seg:
        args += [jax.ShapeDtypeStruct((batch, q_len), jnp.int32), jax.ShapeDtypeStruct((batch, kv_len), jnp.int32)]
    fwd = jax.export.export(program.forward, platforms=["tpu"])(*args)
    assert _count_custom_calls(fwd) == 1
    out, lse = jax.eval_shape(program.forward, *args)
    bwd = jax.export.export(program.backward, platforms=["tpu"])(*args, out, lse, out)
    assert _count_custom_calls(bwd) == backward_kernels(plan.block_sizes())
    assert [a.shape for a in bwd.out_avals] == [a.shape for a in args[:3]]


def test_fused_backward_lowers_as_one_kernel():
    plan = _plan(
        1,
        4,
        2,
        256,
        256,
        128,
        128,
        "float32",
        CausalMask(0),
        False,
        block_sizes=torch_splash_jax.BlockSizes(use_fused_bwd_kernel=True),
    )
    program = torch_splash_jax.program(plan)
    args = [jax.ShapeDtypeStruct((1, h, 256, 128), jnp.float32) for h in (4, 2, 2)]
    out, lse = jax.eval_shape(program.forward, *args)
    bwd = jax.export.export(program.backward, platforms=["tpu"])(*args, out, lse, out)
    assert _count_custom_calls(bwd) == 1


def test_lowering_for_tpu_enforces_block_shapes_that_interpret_mode_ignores():
    """Why the planner keeps backward q blocks at multiples of 128: Mosaic refuses others."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((200, 256))])
    bad = sk.BlockSizes(block_q=100, block_kv=128, block_q_dkv=100, block_kv_dkv=128, block_q_dq=100, block_kv_dq=128)
    kernel = sk.make_splash_mha(mask, block_sizes=bad, head_shards=1, q_seq_shards=1)
    q = jax.ShapeDtypeStruct((1, 200, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 256, 128), jnp.float32)
    with pytest.raises(Exception, match="divisible by 8 and 128"):
        jax.export.export(jax.jit(kernel), platforms=["tpu"])(q, kv, kv)


FAMILIES = [
    torch_splash_jax.LocalMask(1023, 0),
    torch_splash_jax.ChunkedCausalMask(512),
    torch_splash_jax.CausalMask(0) & torch_splash_jax.LocalMask(255),
    torch_splash_jax.LocalMask(64, 64) | torch_splash_jax.CausalMask(-2000),
    torch_splash_jax.MultiHeadMask(
        (
            torch_splash_jax.CausalMask(0),
            torch_splash_jax.LocalMask(128),
            torch_splash_jax.FullMask(),
            torch_splash_jax.CausalMask(5),
        )
    ),
]


@pytest.mark.parametrize("mask", FAMILIES, ids=lambda m: type(m).__name__)
def test_each_mask_family_lowers_for_tpu_at_its_planned_blocks(mask):
    q_len = kv_len = 2000
    plan = _plan(1, 4, 2, q_len, kv_len, 128, 128, "bfloat16", mask, True)
    program = torch_splash_jax.program(plan)
    args = [jax.ShapeDtypeStruct((1, h, 2000, 128), jnp.bfloat16) for h in (4, 2, 2)]
    args += [jax.ShapeDtypeStruct((1, 2000), jnp.int32)] * 2
    args += [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in program.tables()]  # a per-head mask's
    fwd = jax.export.export(program.forward, platforms=["tpu"])(*args)
    assert _count_custom_calls(fwd) == 1
    out, lse = jax.eval_shape(program.forward, *args)
    bwd = jax.export.export(program.backward, platforms=["tpu"])(*args, out, lse, out)
    assert _count_custom_calls(bwd) == backward_kernels(plan.block_sizes())


def test_dense_mask_lowers_for_tpu():
    rng = np.random.default_rng(0)
    dense = torch_splash_jax.DenseMask(rng.random((300, 300)) > 0.5)
    plan = _plan(1, 2, 2, 300, 300, 64, 64, "float32", dense, False)
    program = torch_splash_jax.program(plan)
    args = [jax.ShapeDtypeStruct((1, 2, 300, 64), jnp.float32)] * 3
    args += [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in program.tables()]  # the mask's tables and blocks
    fwd = jax.export.export(program.forward, platforms=["tpu"])(*args)
    assert _count_custom_calls(fwd) == 1
