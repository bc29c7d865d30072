"""The sharded program, device by device on one CPU: each device's program, given its slice of the
block tables (and query positions), reproduces its rows and heads of the unsharded call's output
and dq, and the devices' dk, dv and d_sinks sum to the unsharded ones. Sharded along the query
sequence for every mask family (per-head masks and masks that are data included), and over heads
with per-head masks. (tests/test_spmd.py runs the same through torch_xla SPMD on 4 devices.)"""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SEQUENCE_DATA_MASKS, SEQUENCE_MASKS, sharded_plans

import torch_splash_jax
from torch_splash_jax import SplashConstraintError
from torch_splash_jax import masks as M

MASKS, DATA_MASKS = SEQUENCE_MASKS, SEQUENCE_DATA_MASKS
_BALANCED_SLOW = {"full", "prefix-lm", "local-two-sided", "window-and-causal"}


def _devices_reproduce_the_unsharded_call(
    mask, length, shards, layout, head_shards=1, kv_heads=2, ids=False, sinks=False, kernels="splash"
):
    """Runs the unsharded program, then each device's (sequence shard s, head shard g) program on
    its rows, heads and tables, and compares. kernels: JAX's at 128 x 128 blocks, or the active
    kernels as planned."""
    jax_blocks = torch_splash_jax.BlockSizes(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128)
    full, sharded = sharded_plans(
        mask,
        length,
        shards,
        layout,
        head_shards,
        kv_heads=kv_heads,
        has_segment_ids=ids,
        has_sinks=sinks,
        block_sizes=jax_blocks if kernels == "splash" else None,
    )
    assert sharded.forward_kernel == sharded.backward_kernel == kernels
    rng = np.random.default_rng(0)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in [(2, 4, length, 32), (2, kv_heads, length, 32), (2, kv_heads, length, 32), (2, 4, length, 32)]
    )
    doc = jnp.asarray(np.stack([np.arange(length) // 300, np.arange(length) // 170]), jnp.int32)
    extra = [doc, doc] if ids else []
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
    whole = torch_splash_jax.program(full)
    given = [*extra, *([] if sink is None else [sink]), *whole.tables()]  # tables: a stored-block mask's
    out, lse = whole.forward(q, k, v, *given)
    grads = whole.backward(q, k, v, *given, out, lse, d_out)

    program = torch_splash_jax.program(sharded)
    assert program.sharded
    rows = sharded.shard_positions()[:, : sharded.q_len]
    assert sorted(rows.reshape(-1).tolist()) == list(range(length))  # every row on exactly one shard
    got = [np.zeros(x.shape, np.float32) for x in (out, q, k, v)]
    got_d_sinks = np.zeros(4, np.float32)
    hq, hkv = 4 // head_shards, kv_heads // head_shards
    for s, r in enumerate(rows):
        for g in range(head_shards):
            qh, kh = slice(g * hq, (g + 1) * hq), slice(g * hkv, (g + 1) * hkv)
            tables = [jnp.asarray(a) for a in program.device_tables(s, g)]
            mine = ([doc[:, r], doc] if ids else []) + ([] if sink is None else [sink[qh]])
            inputs = (q[:, qh][:, :, r], k[:, kh], v[:, kh])
            o, shard_lse = program.forward(*inputs, *mine, *tables)
            dq, dk, dv, *d_sinks = program.backward(*inputs, *mine, *tables, o, shard_lse, d_out[:, qh][:, :, r])
            got[0][:, qh, r], got[1][:, qh, r] = o, dq
            got[2][:, kh] += np.asarray(dk)
            got[3][:, kh] += np.asarray(dv)
            if d_sinks:
                got_d_sinks[qh] += np.asarray(d_sinks[0])
    np.testing.assert_allclose(got[0], out, atol=1e-6)
    np.testing.assert_allclose(got[1], grads[0], atol=1e-6)
    summed = got[2:] + ([got_d_sinks] if sinks else [])
    for mine, theirs in zip(summed, grads[1:], strict=True):  # dk, dv (and d_sinks): f32 sums in another order
        np.testing.assert_allclose(mine, theirs, atol=2e-5, rtol=1e-5)
    return program


# Every family in both layouts; the balanced layout of families whose work is not causal-shaped
# runs under -m slow (the stored-block tests below run the balanced layout on them too).
_LAYOUTS = [
    pytest.param(mask, layout, marks=[pytest.mark.slow] if layout == "balanced" and mask in _BALANCED_SLOW else [])
    for mask in MASKS
    for layout in ("contiguous", "balanced")
]


@pytest.mark.parametrize("mask,layout", _LAYOUTS)
def test_shards_reproduce_the_unsharded_call(mask, layout):
    # 260 rows per shard: padded per shard, several blocks at 128
    _devices_reproduce_the_unsharded_call(
        MASKS[mask],
        1040,
        4,
        layout,
        kv_heads=1 if mask == "prefix-lm" else 2,  # MQA
        ids=mask in ("causal", "local"),  # packed documents crossing shard boundaries
        sinks=mask == "chunked",
    )


@pytest.mark.parametrize(
    "mask,layout",
    [("causal", "balanced"), pytest.param("local", "contiguous", marks=pytest.mark.slow)]
    + [pytest.param(mask, "balanced", marks=pytest.mark.slow) for mask in ("chunked", "prefix-lm", "full")],
)
def test_shards_on_the_active_kernels_reproduce_the_unsharded_call(mask, layout, small_active_blocks):
    # each device's list and positions its inputs; 744 rows a device: several 256-row blocks
    program = _devices_reproduce_the_unsharded_call(
        MASKS[mask], 2976, 4, layout, kv_heads=1 if mask == "prefix-lm" else 2, ids=True, sinks=True, kernels="active"
    )
    assert program.active.entries > 1 and program.active_backward.entries > 1


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("mask", list(DATA_MASKS))
def test_shards_reproduce_the_unsharded_call_with_stored_mask_blocks(mask, layout):
    program = _devices_reproduce_the_unsharded_call(
        DATA_MASKS[mask],
        1040,
        4,
        layout,
        ids=mask == "tensor",
        sinks=mask == "per-head",
        kv_heads=1 if layout == "balanced" else 2,
    )
    assert all(t.ndim == 4 for t in program.tables())  # tables only, no query positions: stored blocks


@pytest.mark.parametrize("sequence_shards,layout", [(1, "contiguous"), (2, "balanced")])
def test_head_shards_with_per_head_masks_take_their_heads_tables(sequence_shards, layout):
    program = _devices_reproduce_the_unsharded_call(
        DATA_MASKS["per-head-tensor-and-structured"], 1040, sequence_shards, layout, head_shards=2, ids=True, sinks=True
    )
    assert program.table_axes() == [("seq", "heads")] * len(program.tables())


def test_balanced_layout_evens_causal_blocks():
    # the active kernels' blocks, 2048 x 2048: one chunk of the balanced layout each at 16K over 4
    _, contiguous = sharded_plans(M.CausalMask(), 16384, 4, "contiguous", platform="tpu")
    _, balanced = sharded_plans(M.CausalMask(), 16384, 4, "balanced", platform="tpu")
    assert contiguous.forward_kernel == balanced.forward_kernel == "active"
    plain, even = (torch_splash_jax.program(p).blocks_per_shard() for p in (contiguous, balanced))
    assert sum(plain) == sum(even) and len(set(even)) == 1
    assert plain == sorted(plain) and plain[-1] > 1.5 * even[0]  # the last contiguous shard does most


@pytest.mark.parametrize(
    "length,shards,layout,match",
    [
        (1030, 4, "contiguous", "Lq=1030 does not split into 4 sequence shards"),
        (1028, 4, "balanced", "of two mirrored chunks each: Lq must be a multiple of 8"),
        (1024, 4, "diagonal", "sequence_layout='diagonal'"),
    ],
)
def test_sequence_shards_that_do_not_divide_are_refused(length, shards, layout, match):
    with pytest.raises(SplashConstraintError, match=match):
        sharded_plans(M.CausalMask(), length, shards, layout)
