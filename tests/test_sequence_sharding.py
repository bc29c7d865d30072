"""The sequence-sharded program, shard by shard on one CPU: each shard's program, given its slice of
the block tables and query positions, reproduces its rows of the unsharded call's output and dq,
and the shards' dk, dv and d_sinks sum to the unsharded ones. (tests/test_spmd.py runs the same
through torch_xla SPMD on 4 devices.)"""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_core
from jax_core import SplashConstraintError
from jax_core import masks as M

MASKS = {
    "causal": M.CausalMask(),
    "causal-offset": M.CausalMask(offset=-40),
    "local": M.LocalMask(100, 0),
    "local-two-sided": M.LocalMask(30, 50),
    "chunked": M.ChunkedCausalMask(96),
    "prefix-lm": M.CausalMask() | M.PrefixMask(70),
    "window-and-causal": M.CausalMask() & M.LocalMask(64),
    "full": M.FullMask(),
}


def _plans(mask, length, shards, layout, **options):
    common = dict(
        batch=2,
        num_q_heads=4,
        num_kv_heads=options.pop("kv_heads", 2),
        kv_len=length,
        head_dim=32,
        head_dim_v=32,
        dtype="float32",
        mask=mask,
        scale=0.2,
        **options,
    )
    return jax_core.plan(q_len=length, **common), jax_core.plan(
        q_len=length, q_shards=shards, sequence_layout=layout, **common
    )


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_shards_reproduce_the_unsharded_call(mask, layout):
    length, shards = 1040, 4  # 260 rows per shard: padded per shard, several blocks at 128
    ids = mask in ("causal", "local")  # packed documents crossing shard boundaries
    sinks = mask == "chunked"
    kv_heads = 1 if mask == "prefix-lm" else 2  # MQA
    full, sharded = _plans(
        MASKS[mask],
        length,
        shards,
        layout,
        kv_heads=kv_heads,
        has_segment_ids=ids,
        has_sinks=sinks,
        block_sizes=jax_core.BlockSizes(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128),
    )
    rng = np.random.default_rng(0)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in [(2, 4, length, 32), (2, kv_heads, length, 32), (2, kv_heads, length, 32), (2, 4, length, 32)]
    )
    doc = jnp.asarray(np.stack([np.arange(length) // 300, np.arange(length) // 170]), jnp.int32)
    extra = [doc, doc] if ids else []
    sink = [jnp.asarray(rng.standard_normal(4), jnp.float32)] if sinks else []
    whole = jax_core.program(full)
    out, lse = whole.forward(q, k, v, *extra, *sink)
    grads = whole.backward(q, k, v, *extra, *sink, out, lse, d_out)

    program = jax_core.program(sharded)
    rows = sharded.shard_positions()[:, : sharded.q_len]
    assert sorted(rows.reshape(-1).tolist()) == list(range(length))  # every row on exactly one shard
    got_out, got_dq = np.zeros(out.shape, np.float32), np.zeros(q.shape, np.float32)
    summed = [0.0] * (len(grads) - 1)
    for s, r in enumerate(rows):
        tables = [jnp.asarray(a[s : s + 1]) for a in program.tables()]
        mine = [doc[:, r], doc] if ids else []
        o, shard_lse = program.forward(q[:, :, r], k, v, *mine, *sink, *tables)
        g = program.backward(q[:, :, r], k, v, *mine, *sink, *tables, o, shard_lse, d_out[:, :, r])
        got_out[:, :, r], got_dq[:, :, r] = o, g[0]
        summed = [a + b for a, b in zip(summed, g[1:])]
    np.testing.assert_allclose(got_out, out, atol=1e-6)
    np.testing.assert_allclose(got_dq, grads[0], atol=1e-6)
    for mine, theirs in zip(summed, grads[1:]):  # dk, dv (and d_sinks): f32 sums in another order
        np.testing.assert_allclose(mine, theirs, atol=2e-5, rtol=1e-5)


def test_balanced_layout_evens_causal_blocks():
    _, contiguous = _plans(M.CausalMask(), 8192, 4, "contiguous", platform="tpu")
    _, balanced = _plans(M.CausalMask(), 8192, 4, "balanced", platform="tpu")
    plain, even = (jax_core.program(p).blocks_per_shard() for p in (contiguous, balanced))
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
        _plans(M.CausalMask(), length, shards, layout)


def test_per_head_and_tensor_masks_are_refused_with_sequence_shards():
    for mask in (M.MultiHeadMask([M.CausalMask()] * 4), M.DenseMask(np.tril(np.ones((64, 64), bool)))):
        with pytest.raises(SplashConstraintError, match="with the query sequence sharded"):
            _plans(mask, 64, 2, "contiguous")
