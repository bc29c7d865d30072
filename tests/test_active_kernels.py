"""The active-block kernels (`torch_splash_jax.active_kernels`, `BlockSizes(forward_kernel="active")`),
in Pallas interpret mode on the CPU: the forward against a float64 softmax reference (output and
logsumexp) and the backward against float64 gradients, their tables and blocks, and whole calls
through `torch_splash.attention` against SDPA with gradients (either kernel beside JAX's other);
the backward's copies between HBM and VMEM also in Pallas's simulated TPU (`pltpu.InterpretParams`),
which plain interpret mode does not check.
Their Mosaic programs compile for v5e, v6e and v7x in tests/test_tpu_compile.py ("active-*")."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import TOL, assert_matches_reference, make_qkv, reference

import torch_splash
import torch_splash_jax
from torch_splash_jax import active_kernels, tables
from torch_splash_jax import structured_masks as sm
from torch_splash_jax.block_planning import active_backward_blocks, active_forward_blocks
from torch_splash_jax.data_masks import DenseMask

ACTIVE = torch_splash_jax.BlockSizes(forward_kernel="active")


def _float64_attention(q, k, v, allowed, scale, soft_cap=None, sinks=None):
    """(out, logsumexp) of softmax attention in float64; rows with no allowed key give 0 and -inf."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
    s = np.einsum("hqd,hkd->hqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    s = np.where(allowed, s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], s.shape[:2] + (1,))], axis=-1)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    seen = allowed.any(-1)
    out = np.where(seen[..., None], np.einsum("hqk,hkd->hqd", p, v) / np.where(total > 0, total, 1), 0)
    lse = np.where(seen | (sinks is not None), (m + np.log(np.where(total > 0, total, 1)))[..., 0], -np.inf)
    return out, lse


KERNEL_CASES = [
    # (mask, heads, kv heads, Lq, Lkv, kv_len, D, Dv, blocks (q, kv, chunk, tile rows), options)
    (sm.CausalMask(0), 4, 2, 512, 512, 512, 64, 64, (128, 256, 128, None), {}),
    (sm.FullMask(), 2, 2, 256, 768, 700, 64, 32, (128, 256, 128, None), {}),  # Dv != D, padded keys
    (sm.LocalMask(100, 0), 4, 1, 1024, 1024, 1024, 32, 32, (256, 256, 128, 64), {}),  # MQA, tiles
    (sm.CausalMask(-200), 2, 2, 512, 512, 512, 64, 64, (128, 128, 128, None), {}),  # rows with no key
    (sm.CausalMask(0), 4, 2, 512, 512, 512, 64, 64, (256, 256, 128, 64), dict(segment_ids=True)),
    (
        sm.CausalMask(0) & sm.LocalMask(300, 0),
        4,
        4,
        512,
        512,
        512,
        64,
        64,
        (256, 256, 128, 64),
        dict(soft_cap=5.0, sinks=True, segment_ids=True),
    ),
    (sm.ChunkedCausalMask(128) | sm.PrefixMask(64), 2, 1, 512, 512, 512, 64, 64, (128, 256, 128, 64), {}),
]


def _allowed_and_ids(mask, lq: int, lkv: int, kv_len: int, options: dict, rng):
    """A kernel case's allowed (Lq, Lkv) pairs (keys past kv_len hidden) and, where it has them,
    sorted random segment ids (as the kernels take them) that further restrict it."""
    allowed = np.zeros((lq, lkv), bool)
    allowed[:, :kv_len] = mask.dense(lq, kv_len)
    if not options.get("segment_ids"):
        return allowed, None
    q_ids = np.sort(rng.integers(0, 4, lq)).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 4, lkv)).astype(np.int32)
    allowed &= q_ids[:, None] == kv_ids[None, :]
    return allowed, (jnp.asarray(q_ids), jnp.asarray(kv_ids))


FORWARD_WAYS = {  # straight-line tiles, rows summed in the MXU, logits transposed
    "straight": (True, False, False),
    "branches": (False, False, False),
    "mxu-sums": (True, True, False),
    "transposed": (True, False, True),
    "transposed-branches": (False, False, True),
}


@pytest.mark.parametrize("way", FORWARD_WAYS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]!r}-{c[1]}x{c[2]}-{c[3]}x{c[4]}-{c[9]}")
def test_the_active_forward_matches_a_float64_softmax(case, way):
    """float32 inputs: the kernel accumulates in float32 from float32 logits, so output and logsumexp
    agree with float64 to a few float32 roundings (measured about 5e-7); 1e-5 leaves room. The
    same with the rows' sums in the MXU (`with_ones`; at any Dv here, where the planner takes it
    at Dv 128 on v6e only) and with the logits laid out transposed (`Plan.forward_logits`)."""
    straight, sums_on_mxu, transposed = FORWARD_WAYS[way]
    mask, hq, hkv, lq, lkv, kv_len, d, dv, (bq, bkv, chunk, rows), options = case
    rng = np.random.default_rng(0)
    q = rng.standard_normal((hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((hkv, lkv, d)).astype(np.float32)
    v = rng.standard_normal((hkv, lkv, dv)).astype(np.float32)
    scale = d**-0.5
    allowed, ids = _allowed_and_ids(mask, lq, lkv, kv_len, options, rng)
    sinks = rng.standard_normal(hq).astype(np.float32) if options.get("sinks") else None
    soft_cap = options.get("soft_cap")
    kinds = tables.block_mask_table(mask, lq, lkv, kv_len, bq, bkv)[None]
    tile_kinds = None if rows is None else tables.block_mask_table(mask, lq, lkv, kv_len, rows, chunk)[None]
    out, lse = active_kernels.forward(
        jnp.asarray(q),
        jnp.asarray(k * scale * active_kernels.LOG2E),
        jnp.asarray(v),
        active_kernels.active_grid(kinds, tile_kinds),
        mask=mask,
        kv_len=kv_len,
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=chunk,
        block_q_sub=rows,
        soft_cap=None if soft_cap is None else soft_cap * active_kernels.LOG2E,
        segment_ids=ids,
        sinks=None if sinks is None else jnp.asarray(sinks * active_kernels.LOG2E),
        straight_patterns=straight,
        sums_on_mxu=sums_on_mxu,
        transposed=transposed,
        interpret=True,
    )
    want_out, want_lse = _float64_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), allowed[None], scale, soft_cap, sinks
    )
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-5, rtol=1e-5)
    assert (np.isfinite(np.asarray(lse)) == np.isfinite(want_lse)).all()
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-5, rtol=1e-5)


def _float64_gradients(q, k, v, d_out, allowed, scale, soft_cap=None, sinks=None):
    """(lse, di, dq, dk, dv) of softmax attention in float64 for the cotangent d_out: lse +inf on
    rows with no allowed key (as the backward takes it), di the rows' sums of out * d_out."""
    group = q.shape[0] // k.shape[0]
    kr, vr = np.repeat(k, group, 0), np.repeat(v, group, 0)
    s = np.einsum("hqd,hkd->hqk", q, kr) * scale
    t = np.tanh(s / soft_cap) if soft_cap else None
    s = np.where(allowed, soft_cap * t if soft_cap else s, -np.inf)
    full = s if sinks is None else np.concatenate([s, np.broadcast_to(sinks[:, None, None], s.shape[:2] + (1,))], -1)
    m = full.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(full - m)
    total = np.maximum(e.sum(-1, keepdims=True), np.finfo(np.float64).tiny)
    p = (e / total)[..., : s.shape[-1]]
    di = (d_out * np.einsum("hqk,hkd->hqd", p, vr)).sum(-1)
    ds = p * (np.einsum("hqd,hkd->hqk", d_out, vr) - di[..., None])
    if soft_cap:
        ds = ds * (1 - t * t)
    dq = np.einsum("hqk,hkd->hqd", ds, kr) * scale
    dk = (np.einsum("hqk,hqd->hkd", ds, q) * scale).reshape(k.shape[0], group, *k.shape[1:]).sum(1)
    dv = np.einsum("hqk,hqd->hkd", p, d_out).reshape(v.shape[0], group, *v.shape[1:]).sum(1)
    lse = np.where(allowed.any(-1) | (sinks is not None), (m + np.log(total))[..., 0], np.inf)
    return lse, di, dq, dk, dv


@pytest.mark.parametrize("straight", [True, False], ids=["straight", "branches"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]!r}-{c[1]}x{c[2]}-{c[3]}x{c[4]}-{c[9]}")
def test_the_active_backward_matches_float64_gradients(case, straight):
    """float32 inputs, the float64 logsumexp and row sums given: dq, dk, dv within 1e-5 of the
    largest gradient (measured at most 2.3e-6: float32 sums of a few hundred products). The cases
    walk dq's in-place accumulation through its three paths: a q block met again at once (causal,
    one kv head), met again two steps on (full, two q blocks), and new at every step (GQA, MQA)."""
    mask, hq, hkv, lq, lkv, kv_len, d, dv, (bq, bkv, chunk, rows), options = case
    rng = np.random.default_rng(1)
    q, d_out = rng.standard_normal((hq, lq, d)), rng.standard_normal((hq, lq, dv))
    k, v = rng.standard_normal((hkv, lkv, d)), rng.standard_normal((hkv, lkv, dv))
    scale = d**-0.5
    allowed, ids = _allowed_and_ids(mask, lq, lkv, kv_len, options, rng)
    sinks = rng.standard_normal(hq) if options.get("sinks") else None
    soft_cap = options.get("soft_cap")
    lse, di, *want = _float64_gradients(q, k, v, d_out, allowed[None], scale, soft_cap, sinks)
    rows = 128  # the backward's tile rows are query lanes: a multiple of 128
    grid = active_kernels.column_grid(
        tables.block_mask_table(mask, lq, lkv, kv_len, bq, bkv)[None],
        tables.block_mask_table(mask, lq, lkv, kv_len, rows, chunk)[None],
    )
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    found = active_kernels.backward(
        f32(q), f32(k * scale * active_kernels.LOG2E), f32(v), f32(d_out), f32(lse), f32(di), grid,
        mask=mask, kv_len=kv_len, block_q=bq, block_kv=bkv, block_kv_compute=chunk, block_q_sub=rows,
        soft_cap=None if soft_cap is None else soft_cap * active_kernels.LOG2E, segment_ids=ids,
        straight_patterns=straight, interpret=True,
    )  # fmt: skip
    found = [np.asarray(found[0]), np.asarray(found[1]) * scale, np.asarray(found[2])]
    for name, got, expected in zip(("dq", "dk", "dv"), found, want):
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error <= 1e-5, (name, error)


# Blocks of 2 x 2 tiles of 256, so that a causal-shaped tile runs in two 128-key strips
DIAGONAL_CASES = [
    # (mask, heads, kv heads, Lq = Lkv, kv_len, D, Dv, options)
    (sm.CausalMask(0), 4, 2, 1024, 1024, 64, 64, {}),
    (sm.CausalMask(0) & sm.LocalMask(300, 0), 2, 2, 1024, 1000, 64, 32, dict(soft_cap=5.0, segment_ids=True)),
]


@pytest.mark.parametrize("straight", [True, False], ids=["straight", "branches"])
@pytest.mark.parametrize("case", DIAGONAL_CASES, ids=lambda c: f"{c[0]!r}-{c[7]}")
def test_causal_shaped_tiles_run_in_strips_and_match_float64_gradients(case, straight):
    """The backward runs a DIAGONAL tile (`tables.diagonal_tiles`) key strip by key strip, each
    against its queries from the diagonal on; straight, and as the branch that runs it whole.
    Tolerance as the backward's test above."""
    mask, hq, hkv, length, kv_len, d, dv, options = case
    rng = np.random.default_rng(2)
    q, d_out = rng.standard_normal((hq, length, d)), rng.standard_normal((hq, length, dv))
    k, v = rng.standard_normal((hkv, length, d)), rng.standard_normal((hkv, length, dv))
    scale, soft_cap = d**-0.5, options.get("soft_cap")
    allowed, ids = _allowed_and_ids(mask, length, length, kv_len, options, rng)
    lse, di, *want = _float64_gradients(q, k, v, d_out, allowed[None], scale, soft_cap, None)
    bq, bkv, tile = 512, 512, 256
    tile_kinds = tables.block_mask_table(mask, length, length, kv_len, tile, tile)
    tile_kinds = tables.diagonal_tiles(mask, tile_kinds, tile, tile, kv_len, active_kernels.STRIP)
    assert (np.diag(tile_kinds) == tables.DIAGONAL).all()
    grid = active_kernels.column_grid(
        tables.block_mask_table(mask, length, length, kv_len, bq, bkv)[None], tile_kinds[None]
    )
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    found = active_kernels.backward(
        f32(q), f32(k * scale * active_kernels.LOG2E), f32(v), f32(d_out), f32(lse), f32(di), grid,
        mask=mask, kv_len=kv_len, block_q=bq, block_kv=bkv, block_kv_compute=tile, block_q_sub=tile,
        soft_cap=None if soft_cap is None else soft_cap * active_kernels.LOG2E, segment_ids=ids, dk_scale=scale,
        straight_patterns=straight, interpret=True,
    )  # fmt: skip
    for name, got, expected in zip(("dq", "dk", "dv"), found, want):
        error = np.abs(np.asarray(got) - expected).max() / np.abs(expected).max()
        assert error <= 1e-5, (name, error)


TPU_INTERPRET_CASES = [
    # (heads' masks, query heads, kv heads, dtype, head_dim): the backward's dq kept in HBM between
    # steps and finished at each q block's last one, in the dtypes and list shapes that change it
    ("causal", 2, 2, "bfloat16", 128),  # one list both heads walk; dq finished in bf16
    ("causal", 4, 2, "float32", 64),  # GQA: each entry taken once a query head; dq's lanes padded
    ("per-head", 4, 2, "float32", 128),  # a list a head, the shorter ones padded
    ("first rows empty", 2, 2, "float32", 128),  # a q block no list meets: dq read from zeros
]


@pytest.mark.parametrize("case", TPU_INTERPRET_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[3]}-{c[4]}")
def test_the_backward_s_copies_and_semaphores_hold_in_tpu_interpret_mode(case):
    """Pallas's TPU interpret mode runs each DMA only when it is waited for, fills memory no one
    wrote with NaN and looks for races (JAX 0.12 raises on one): a write that is never waited
    for, or a read of a dq block before its write lands, changes the gradients there, where plain
    interpret mode (every copy at once) hides it, as it hid a finished dq block written twice. The gradients must be the
    plain interpret mode's, bit for bit: the same arithmetic in the same order."""
    from jax.experimental.pallas import tpu as pltpu

    kind, hq, hkv, dtype, d = case
    length, (bq, bkv, chunk, rows) = 512, (128, 256, 128, 128)
    rng = np.random.default_rng(3)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal((h, length, d)), dtype) for h in (hq, hkv, hkv, hq))
    lse = jnp.asarray(rng.standard_normal((hq, length)) + 8, jnp.float32)
    di = jnp.asarray(rng.standard_normal((hq, length)), jnp.float32)
    if kind == "causal":
        mask, stored = sm.CausalMask(0), None
        tile_kinds = tables.block_mask_table(mask, length, length, length, rows, chunk)
        kinds = tables.block_mask_table(mask, length, length, length, bq, bkv)[None]
        grid = active_kernels.column_grid(kinds, tile_kinds[None])
    else:
        if kind == "per-head":
            heads = _stored_heads("per-head", length, length, 3)
        else:
            array = np.tril(np.ones((length, length), bool))
            array[:bq] = False
            heads = (DenseMask(array),)
        mask = None
        kinds, block_ids, blocks = tables.stored_blocks(heads, length, length, length, length, bq, bkv)
        grid = active_kernels.column_grid(kinds, active_kernels.stored_tiles(kinds, block_ids, blocks, rows, chunk))
        stored = (active_kernels.block_index(grid, block_ids), blocks.transpose(0, 2, 1))
    assert active_kernels.meets_every_q_block(grid, length // bq) == (kind != "first rows empty")
    run = functools.partial(
        active_kernels.backward, q, k, v, d_out, lse, di, grid, mask=mask, kv_len=length, block_q=bq,
        block_kv=bkv, block_kv_compute=chunk, block_q_sub=rows, stored_mask=stored, dk_scale=0.5,
    )  # fmt: skip
    plain = run(interpret=True)
    simulated = run(interpret=pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True))
    for name, got, expected in zip(("dq", "dk", "dv"), simulated, plain):
        assert np.isfinite(np.asarray(expected, np.float32)).all(), name
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32), err_msg=name)


def test_only_causal_shaped_square_tiles_are_diagonal():
    causal = sm.CausalMask(0)
    kinds = tables.block_mask_table(causal, 2048, 2048, 2048, 512, 512)
    found = tables.diagonal_tiles(causal, kinds, 512, 512, 2048, 128)
    assert (found == np.where(np.eye(4, dtype=bool), tables.DIAGONAL, kinds)).all()
    # a window's far edge is partial but not causal-shaped; its diagonal tiles are
    window = causal & sm.LocalMask(600, 0)
    kinds = tables.block_mask_table(window, 2048, 2048, 2048, 512, 512)
    found = tables.diagonal_tiles(window, kinds, 512, 512, 2048, 128)
    assert (np.diag(found) == tables.DIAGONAL).all() and (found[np.tril_indices(4, -1)] != tables.DIAGONAL).all()
    # the diagonal shifted off the tiles' corners, and tiles that are not square, stay partial
    shifted = sm.CausalMask(64)
    kinds = tables.block_mask_table(shifted, 2048, 2048, 2048, 512, 512)
    assert (tables.diagonal_tiles(shifted, kinds, 512, 512, 2048, 128) == kinds).all()
    kinds = tables.block_mask_table(causal, 2048, 2048, 2048, 512, 256)
    assert (tables.diagonal_tiles(causal, kinds, 512, 256, 2048, 128) == kinds).all()


def _random_dense(lq: int, kv_len: int, seed: int):
    """A DenseMask with full, empty and partial blocks at the test's block sizes: causal with
    random holes and a band of rows that see no key."""
    rng = np.random.default_rng(seed)
    array = np.tril(np.ones((lq, kv_len), bool)) & (rng.random((lq, kv_len)) > 0.3)
    array[: lq // 4, kv_len // 2 :] = True  # a full region, past the diagonal
    array[lq // 2 : lq // 2 + 20] = False  # rows with no key
    return DenseMask(array)


STORED_CASES = [
    # (heads' masks, kv heads, Lq, Lkv, kv_len, blocks (q, kv, chunk, tile rows), options): masks
    # read from stored blocks, one shared (G 1) or one per query head (G = heads)
    ("dense", 2, 512, 512, 500, (128, 256, 128, 64), {}),
    ("dense", 2, 512, 512, 512, (256, 256, 128, 128), dict(segment_ids=True)),
    ("per-head", 2, 512, 512, 512, (128, 256, 128, 64), dict(soft_cap=5.0, sinks=True)),  # GQA 4 -> 2
    ("per-head", 1, 512, 640, 600, (256, 128, 128, None), {}),  # MQA, one tile a block
]


def _stored_heads(kind: str, lq: int, kv_len: int, seed: int) -> tuple:
    if kind == "dense":
        return (_random_dense(lq, kv_len, seed),) * 4
    return (sm.CausalMask(0), sm.LocalMask(64, 0), sm.ChunkedCausalMask(128), _random_dense(lq, kv_len, seed))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("straight", [True, False], ids=["straight", "branches"])
@pytest.mark.parametrize("case", STORED_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[4]}-{sorted(c[6])}")
def test_the_active_kernels_read_stored_masks_like_a_float64_softmax(case, straight, transposed):
    """Masks that are data, and one mask per query head, from stored blocks (`stored_tiles`,
    `block_index`): forward output and logsumexp (its logits laid out either way, the blocks as
    the kernel reads them), and dq, dk, dv (per-head lists in the backward, their dk and dv summed
    over a kv head's query heads; once, with the forward's rows), within the structured cases'
    tolerances of float64."""
    kind, hkv, lq, lkv, kv_len, (bq, bkv, chunk, rows), options = case
    hq, d = 4, 64
    heads = _stored_heads(kind, lq, kv_len, seed=3)
    rng = np.random.default_rng(2)
    q, d_out = rng.standard_normal((hq, lq, d)), rng.standard_normal((hq, lq, d))
    k, v = rng.standard_normal((hkv, lkv, d)), rng.standard_normal((hkv, lkv, d))
    scale = d**-0.5
    allowed = np.zeros((hq, lq, lkv), bool)
    allowed[:, :, :kv_len] = np.stack([h.dense(lq, kv_len) for h in heads])
    ids = None
    if options.get("segment_ids"):
        q_ids = np.sort(rng.integers(0, 3, lq)).astype(np.int32)
        kv_ids = np.sort(rng.integers(0, 3, lkv)).astype(np.int32)
        allowed &= (q_ids[:, None] == kv_ids[None, :])[None]
        ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    sinks = rng.standard_normal(hq) if options.get("sinks") else None
    soft_cap = options.get("soft_cap")
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    common = dict(
        mask=None, kv_len=kv_len, soft_cap=None if soft_cap is None else soft_cap * active_kernels.LOG2E,
        segment_ids=ids, straight_patterns=straight, interpret=True,
    )  # fmt: skip

    kinds, block_ids, blocks = tables.stored_blocks(heads, lq, lq, lkv, kv_len, bq, bkv)
    assert kinds.shape[0] == (1 if kind == "dense" else hq)
    tile_kinds = active_kernels.stored_tiles(kinds, block_ids, blocks, rows or bq, chunk)
    grid = active_kernels.active_grid(kinds, tile_kinds)
    out, lse = active_kernels.forward(
        f32(q), f32(k * scale * active_kernels.LOG2E), f32(v), grid, block_q=bq, block_kv=bkv,
        block_kv_compute=chunk, block_q_sub=rows, sinks=None if sinks is None else f32(sinks * active_kernels.LOG2E),
        stored_mask=(active_kernels.block_index(grid, block_ids), blocks.transpose(0, 2, 1) if transposed else blocks),
        transposed=transposed, **common,
    )  # fmt: skip
    want_out, want_lse = _float64_attention(q, k, v, allowed, scale, soft_cap, sinks)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-5, rtol=1e-5)
    finite = np.isfinite(want_lse)
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    if transposed:
        return

    lse, di, *want = _float64_gradients(q, k, v, d_out, allowed, scale, soft_cap, sinks)
    rows = 128  # the backward's tile rows are query lanes
    kinds, block_ids, blocks = tables.stored_blocks(heads, lq, lq, lkv, kv_len, bq, bkv)
    grid = active_kernels.column_grid(kinds, active_kernels.stored_tiles(kinds, block_ids, blocks, rows, chunk))
    found = active_kernels.backward(
        f32(q), f32(k * scale * active_kernels.LOG2E), f32(v), f32(d_out), f32(lse), f32(di), grid,
        block_q=bq, block_kv=bkv, block_kv_compute=chunk, block_q_sub=rows,
        stored_mask=(active_kernels.block_index(grid, block_ids), blocks.transpose(0, 2, 1)), **common,
    )  # fmt: skip
    found = [np.asarray(found[0]), np.asarray(found[1]) * scale, np.asarray(found[2])]
    for name, got, expected in zip(("dq", "dk", "dv"), found, want):
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error <= 1e-5, (name, error)


def test_a_stored_block_is_named_by_every_entry_that_reads_none():
    """Entries that read no stored block (full, empty) name the last block read, the first ones
    the first block read: the pipeline then fetches a block only where one is read."""
    heads = (_random_dense(512, 512, seed=4),)
    kinds, block_ids, blocks = tables.stored_blocks(heads, 512, 512, 512, 512, 128, 128)
    grid = active_kernels.active_grid(kinds)
    index = active_kernels.block_index(grid, block_ids)[0]
    partial = np.flatnonzero(grid[2][0] & active_kernels.KIND == active_kernels.PARTIAL)
    assert len(partial) and not (grid[2][0] & active_kernels.KIND == active_kernels.PARTIAL).all()
    assert (index[partial] == block_ids[0, grid[0][0, partial], grid[1][0, partial]]).all()
    assert (index[: partial[0]] == index[partial[0]]).all()
    reads = 1 + np.count_nonzero(np.diff(index))
    assert reads <= len(partial)
    for b in range(len(blocks)):  # each distinct block once
        assert not any((blocks[b] == blocks[o]).all() for o in range(b))


def test_the_column_grid_walks_each_kv_block_s_active_rows_once():
    mask = sm.CausalMask(-300) | sm.LocalMask(0, 0, 700)
    kinds = tables.block_mask_table(mask, 1024, 1280, 1024, 128, 256)  # the last kv block holds no key
    q_block, kv_block, flags, _ = active_kernels.column_grid(kinds[None])
    for j in range(kinds.shape[1]):
        mine = np.flatnonzero(kv_block[0] == j)
        assert flags[0, mine[0]] & active_kernels.FIRST and flags[0, mine[-1]] & active_kernels.LAST
        if not kinds[:, j].any():  # a kv block no row sees: one entry, which writes zero gradients
            assert len(mine) == 1 and flags[0, mine[0]] & active_kernels.KIND == active_kernels.SKIP
        else:
            assert list(q_block[0, mine]) == list(np.flatnonzero(kinds[:, j]))


def test_the_active_grid_walks_each_row_s_active_blocks_once():
    mask = sm.CausalMask(-300) | sm.LocalMask(0, 0, 700)  # first rows see nothing, then a diagonal
    kinds = tables.block_mask_table(mask, 1024, 1024, 1024, 128, 256)
    q_block, kv_block, flags, _ = active_kernels.active_grid(kinds[None])
    kind = flags[0] & active_kernels.KIND
    for i in range(kinds.shape[0]):
        mine = np.flatnonzero(q_block[0] == i)
        assert flags[0, mine[0]] & active_kernels.FIRST and flags[0, mine[-1]] & active_kernels.LAST
        if not kinds[i].any():  # a row with no key still has one entry, which only writes zeros
            assert len(mine) == 1 and kind[mine[0]] == active_kernels.SKIP
        else:
            assert list(kv_block[0, mine]) == list(np.flatnonzero(kinds[i]))
            assert list(kind[mine]) == list(kinds[i][kinds[i] > 0])


def test_per_head_lists_are_padded_with_entries_that_do_nothing():
    short = tables.block_mask_table(sm.LocalMask(0, 0), 512, 512, 512, 128, 128)
    long = tables.block_mask_table(sm.FullMask(), 512, 512, 512, 128, 128)
    q_block, kv_block, flags, _ = active_kernels.active_grid(np.stack([short, long]))
    assert q_block.shape == (2, 16) and (flags[0, 4:] == 0).all()
    assert (q_block[0, 4:] == q_block[0, 3]).all() and (kv_block[0, 4:] == kv_block[0, 3]).all()


@pytest.mark.parametrize(
    "q_len,kv_len,head_dim",
    [(16384, 16384, 128), (16384, 16384, 256), (640, 768, 128), (8, 128, 64), (129 * 8, 4096 + 128, 128)],
)
def test_the_active_blocks_divide_the_padded_lengths(q_len, kv_len, head_dim):
    for blocks, row_multiple in ((active_forward_blocks, 8), (active_backward_blocks, 128)):
        b = blocks(q_len, kv_len, head_dim)
        assert q_len % b["block_q"] == 0 and kv_len % b["block_kv"] == 0
        assert b["block_kv"] % b["block_kv_compute"] == 0 and b["block_kv_compute"] % 128 == 0
        if b["block_q_sub"]:
            assert b["block_q"] % b["block_q_sub"] == 0
            assert b["block_q_sub"] % row_multiple == 0 or b["block_q_sub"] == b["block_q"]
            tiles = (b["block_q"] // b["block_q_sub"]) * (b["block_kv"] // b["block_kv_compute"])
            assert tiles <= active_kernels.MAX_TILES


TORCH_CASES = [
    # (batch, hq, hkv, L, D, mask, options)
    (2, 4, 4, 300, 64, "causal", {}),  # the batch folded into heads, lengths off the 128 grid
    (2, 4, 2, 256, 32, torch_splash.masks.LocalMask(40, 0), dict(segment_ids=True)),  # one call per element
    (1, 4, 1, 200, 64, torch_splash.masks.CausalMask(-20), dict(soft_cap=20.0)),  # MQA, rows with no key
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: f"b{c[0]}-{c[1]}x{c[2]}-L{c[3]}-{sorted(c[6])}")
def test_attention_with_the_active_forward_matches_the_reference(case, dtype):
    """Output and gradients through torch_splash.attention, at the tolerances of every other call."""
    batch, hq, hkv, length, d, mask, options = case
    options = dict(options)
    q, k, v = make_qkv(batch, hq, hkv, length, length, d, d, dtype)
    if options.pop("segment_ids", False):
        options["segment_ids"] = (torch.arange(length)[None] >= torch.tensor([[100], [30]])).int()
    assert_matches_reference(q, k, v, mask, block_sizes=ACTIVE, **options)


@pytest.mark.parametrize("forward,backward", [("active", "splash"), ("splash", "active")])
def test_either_active_kernel_beside_jax_s_other_matches_the_reference(forward, backward):
    """Each backward takes either forward's output and logsumexp (both natural log)."""
    q, k, v = make_qkv(2, 4, 2, 256, 256, 32, 32, torch.float32)
    blocks = torch_splash_jax.BlockSizes(forward_kernel=forward, backward_kernel=backward)
    assert_matches_reference(q, k, v, torch_splash.masks.LocalMask(40, 0), block_sizes=blocks)


def test_sinks_through_the_active_forward_match_the_reference():
    q, k, v = make_qkv(2, 4, 2, 200, 200, 32, 32, torch.float32)
    sinks = torch.linspace(-1.0, 2.0, 4).requires_grad_()
    cotangent = torch.randn(2, 4, 200, 32, generator=torch.Generator().manual_seed(3))
    out = torch_splash.attention(q, k, v, "causal", sinks=sinks, block_sizes=ACTIVE)
    (out * cotangent).sum().backward()
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    ref = reference(q, k, v, "causal", sinks=sinks)
    (ref * cotangent).sum().backward()
    (atol_out, rtol_out), (atol_grad, rtol_grad) = TOL[torch.float32]["out"], TOL[torch.float32]["grad"]
    torch.testing.assert_close(got[0], ref.detach(), atol=atol_out, rtol=rtol_out)
    for mine, want in zip(got[1:], [t.grad for t in (q, k, v, sinks)]):
        torch.testing.assert_close(mine, want, atol=atol_grad, rtol=rtol_grad)


def test_bfloat16_through_the_active_forward_is_as_close_to_float64_as_jax_s_kernel():
    """Both forwards on the same bfloat16 inputs against a float64 reference. JAX's kernel multiplies
    p and v in float32; this one rounds p to bfloat16 for the MXU's bfloat16 rate, which may cost
    one bfloat16 rounding of the output (2**-8 relative) and no more (measured: 3.3e-3 of the
    largest output against JAX's 2.1e-3)."""
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 512, 512, 64, 64, torch.bfloat16))
    want = reference(q, k, v, "causal", dtype=torch.float64)
    errors = {}
    for name, blocks in (("splash", None), ("active", ACTIVE)):
        out = torch_splash.attention(q, k, v, "causal", block_sizes=blocks)
        errors[name] = float((out.double() - want).abs().max() / want.abs().max())
    assert errors["active"] <= errors["splash"] + 2**-8, errors


def test_bfloat16_with_the_rows_sums_in_the_mxu_or_transposed_logits_is_as_close_to_float64():
    """`Plan.row_sums="mxu"` sums each row's probabilities in the MXU (as rounded to bfloat16, the
    weights p @ v takes) where "vector" sums them on the vector unit in float32, and
    `Plan.forward_logits="transposed"` lays each tile's logits out keys by queries: on the same
    bfloat16 inputs, each as close to float64 as the first within a quarter of a bfloat16 rounding
    (2**-10), the logsumexp too (measured: output 2.2e-3 of its largest against 2.5e-3, logsumexp
    3.1e-3 against 2.8e-3; transposed, the first's errors: the same float32 sums in another order)."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 1024, 128)), jnp.bfloat16) for _ in range(3))
    x64 = [np.asarray(x.astype(jnp.float32), np.float64)[0] for x in (q, k, v)]
    allowed = np.broadcast_to(sm.CausalMask(0).dense(1024, 1024), (4, 1024, 1024))
    want_out, want_lse = _float64_attention(*x64, allowed, 128**-0.5)
    errors = {}
    plan = torch_splash_jax.plan(q_len=1024, num_q_heads=4, head_dim=128, dtype="bfloat16", mask=sm.CausalMask(0))
    assert (plan.forward_kernel, plan.row_sums, plan.forward_logits) == ("active", "vector", "rows")
    for row_sums, logits in (("vector", "rows"), ("mxu", "rows"), ("vector", "transposed")):
        program = torch_splash_jax.program(dataclasses.replace(plan, row_sums=row_sums, forward_logits=logits))
        out, lse = program.forward(*program.arguments("forward", tables=program.tables(), q=q, k=k, v=v))
        out = np.asarray(out.astype(jnp.float32), np.float64)[0]
        errors[row_sums, logits] = (
            np.abs(out - want_out).max() / np.abs(want_out).max(),
            np.abs(np.asarray(lse, np.float64)[0] - want_lse).max(),
        )
    first = errors.pop(("vector", "rows"))
    assert errors["mxu", "rows"] != first, "the same program ran twice"
    for way, error in errors.items():
        assert error[0] <= first[0] + 2**-10 and error[1] <= first[1] + 2**-10, (way, error, first)


def _holes(length: int, seed: int) -> np.ndarray:
    """Causal with random holes, and rows that see no key: a tensor mask with every block kind."""
    rng = np.random.default_rng(seed)
    array = np.tril(np.ones((length, length), bool)) & (rng.random((length, length)) > 0.2)
    array[length // 2 : length // 2 + 7] = False
    return array


STORED_TORCH_CASES = [
    # (batch, hq, hkv, L, mask, options): masks the active kernels read from stored blocks
    (2, 4, 2, 300, "tensor", {}),  # a bool tensor, lengths off the 128 grid
    (1, 4, 2, 256, "per-head", {}),  # one structured mask per head, GQA
    (2, 2, 1, 200, "per-head", dict(segment_ids=True, soft_cap=20.0)),  # MQA, a list per head
]


def _stored_mask(kind: str, heads: int, length: int):
    m = torch_splash.masks
    if kind == "tensor":
        return torch.from_numpy(_holes(length, seed=5))
    per_head = [m.CausalMask(0), m.LocalMask(40, 0), m.ChunkedCausalMask(64), m.DenseMask(_holes(length, 6))]
    return m.MultiHeadMask(per_head[:heads])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", STORED_TORCH_CASES, ids=lambda c: f"b{c[0]}-{c[1]}x{c[2]}-L{c[3]}-{c[4]}")
def test_stored_and_per_head_masks_through_the_active_kernels_match_the_reference(case, dtype):
    """Masks that are data and one mask per head run through both active kernels from stored
    blocks, at the tolerances of every other call."""
    batch, hq, hkv, length, kind, options = case
    options = dict(options)
    q, k, v = make_qkv(batch, hq, hkv, length, length, 32, 32, dtype)
    if options.pop("segment_ids", False):
        options["segment_ids"] = (torch.arange(length)[None] >= torch.tensor([[60], [130]])[:batch]).int()
    spec = DenseMask(_holes(length, seed=5)) if kind == "tensor" else _stored_mask(kind, hq, length)
    plan = torch_splash_jax.plan(
        q_len=length, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, dtype="float32", mask=spec, block_sizes=ACTIVE
    )  # fmt: skip
    program = torch_splash_jax.program(plan)
    assert program.active.stored is not None and program.active_backward.stored is not None
    assert_matches_reference(q, k, v, _stored_mask(kind, hq, length), block_sizes=ACTIVE, **options)


def test_tensor_masks_of_other_contents_run_the_same_active_program():
    """A stored mask's list and blocks are program inputs in rounded shapes: a tensor mask with
    other contents (padding anew, as each HF batch brings) traces nothing new."""
    from torch_splash_jax.splash_program import TRACES

    q, k, v = make_qkv(1, 2, 2, 256, 256, 32, 32, torch.float32)
    masks = [torch.from_numpy(_holes(256, seed)) for seed in (7, 8, 9)]
    torch_splash.attention(q, k, v, masks[0], block_sizes=ACTIVE).sum().backward()
    before = dict(TRACES)
    for mask in masks[1:]:
        assert_matches_reference(q, k, v, mask, block_sizes=ACTIVE)
    assert dict(TRACES) == before


def test_a_stored_mask_s_lists_past_smem_are_refused_naming_the_kernel():
    """One mask per head: a list per head, 64 of them of 1024 entries (full and causal at 32K in
    1024 x 1024 blocks), past the 39321 entries five tables an entry leave in SMEM."""
    mask = sm.MultiHeadMask((sm.FullMask(), sm.CausalMask(0)) * 32)
    plan = torch_splash_jax.plan(
        q_len=32768, num_q_heads=64, head_dim=128, dtype="bfloat16", mask=mask, platform="tpu", block_sizes=ACTIVE
    )
    with pytest.raises(torch_splash_jax.SplashConstraintError, match="forward_kernel='active': 65536 .* 39321"):
        torch_splash_jax.program(plan)


@pytest.mark.parametrize(
    "sharding,how",
    [
        (dict(q_shards=2), "along the query sequence with a mask read from stored blocks"),
        (dict(q_shards=2, context_parallel="ring"), r"along the query sequence \(a ring\) with a mask read"),
        (dict(head_shards=2), "over heads with one mask per head"),
    ],
)
def test_a_call_whose_devices_need_their_own_stored_blocks_is_refused_for_the_active_kernels(sharding, how):
    """Before any kernel work. The same calls with a structured mask every head shares are served
    (each device's list and positions its inputs)."""
    per_head = sm.MultiHeadMask((sm.CausalMask(0), sm.FullMask()) * 4)
    heads = 8 // sharding.get("head_shards", 1)  # one device's of the mask's 8
    options = dict(q_len=1024, num_q_heads=heads, head_dim=64, dtype="bfloat16", **sharding)
    active = torch_splash_jax.BlockSizes(backward_kernel="active")
    with pytest.raises(
        torch_splash_jax.SplashConstraintError, match=f"backward_kernel='active': the call is sharded {how}"
    ):
        torch_splash_jax.plan(mask=per_head, block_sizes=active, **options)
    served = torch_splash_jax.plan(mask=sm.CausalMask(0), block_sizes=active, **options)
    assert served.backward_kernel == "active"
    assert torch_splash_jax.plan(mask=sm.CausalMask(0), **options).forward_kernel == "active"


@pytest.mark.parametrize("field", ["forward_kernel", "backward_kernel"])
def test_an_unknown_kernel_is_refused(field):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    with pytest.raises(torch_splash.SplashConstraintError, match=f"{field}='fast'"):
        torch_splash.attention(q, k, v, "causal", block_sizes=torch_splash_jax.BlockSizes(**{field: "fast"}))


def test_the_estimator_s_work_counts_the_tiles_each_partial_block_takes():
    from torch_splash_jax.tpu_time import active_work

    def work(mask, length):
        plan = torch_splash_jax.plan(
            q_len=length, num_q_heads=8, head_dim=128, dtype="bfloat16", mask=mask, platform="tpu",
            block_sizes=ACTIVE,
        )  # fmt: skip
        active = torch_splash_jax.program(plan).active
        return active_work(active.grid, active.blocks, units=8, head_dim=128, head_dim_v=128, itemsize=2)

    causal = work(sm.CausalMask(0), 4096)
    assert (causal.steps, causal.first, causal.full, causal.partial) == (3, 2, 1, 2)
    # the two diagonal blocks take one straight-line pattern, 10 of their 16 tiles
    assert causal.patterns == (2,) and causal.tiles == ()
    assert causal.flops == 2.0 * 8 * (2048 * 2048 + 2 * 10 * 512 * 512) * 256
    # 3000-token chunks at 32K: more patterns than straight-line code may hold, a branch a tile;
    # 16 tiles a block, each with its unmasked and its masked path, as many taken as computed
    chunked = work(sm.ChunkedCausalMask(3000), 32768)
    assert chunked.patterns == () and len(chunked.tiles) == 32
    assert chunked.flops == 2.0 * 8 * sum(chunked.tiles) * 512 * 512 * 256


def test_the_active_kernels_are_the_default_where_their_lists_surely_fit_smem():
    """`BlockSizes` left None: the active kernels for an unsharded call whose lists surely fit SMEM
    (causal to 641,024 tokens, where the test below builds them), JAX's kernels past that, for a
    pass whose JAX blocks the caller set, and for calls sharded over heads with one mask per head
    (each device would need its own stored blocks); calls sharded over heads with one mask for all,
    and along the query sequence (all-gather or ring, each device's list its input), keep the
    active kernels. A call whose JAX tables would outgrow SMEM is refused only where a JAX kernel runs."""

    def kernels(length: int, **options):
        plan = torch_splash_jax.plan(
            q_len=length, num_q_heads=16, head_dim=128, dtype="bfloat16", mask=sm.CausalMask(0), platform="tpu",
            block_sizes=torch_splash_jax.BlockSizes(**options.pop("blocks", {})), **options,
        )  # fmt: skip
        return plan.forward_kernel, plan.backward_kernel

    assert kernels(641_024) == ("active", "active")
    assert kernels(641_025) == ("splash", "splash")
    assert kernels(4096, blocks=dict(block_q=1024)) == ("splash", "active")
    assert kernels(4096, blocks=dict(block_q_dkv=512)) == ("active", "splash")
    assert kernels(4096, blocks=dict(use_fused_bwd_kernel=False)) == ("active", "splash")
    assert kernels(4096, blocks=dict(forward_kernel="splash")) == ("splash", "splash")
    assert kernels(4096, q_shards=2) == ("active", "active")
    assert kernels(4096, q_shards=2, context_parallel="ring") == ("active", "active")
    assert kernels(4096, head_shards=2) == ("active", "active")
    # a ring whose JAX tables outgrow SMEM (past 4.25M tokens over 16 devices) runs the active kernels
    ring = dict(context_parallel="ring", sequence_layout="balanced")
    assert kernels(6 << 20, q_shards=16, **ring) == ("active", "active")
    with pytest.raises(torch_splash_jax.SplashConstraintError, match="SMEM"):  # past both: 1M a device
        kernels(4 << 20, q_shards=4, **ring)
    per_head = torch_splash_jax.plan(
        q_len=4096, num_q_heads=2, head_dim=128, dtype="bfloat16", platform="tpu", head_shards=2,
        mask=sm.MultiHeadMask((sm.CausalMask(0), sm.LocalMask(64, 0)) * 2),
    )  # fmt: skip
    assert (per_head.forward_kernel, per_head.backward_kernel) == ("splash", "splash")


def test_an_active_block_list_past_smem_is_refused_naming_the_kernel():
    """Causal: the forward's 2048 x 2048 blocks list 49,153 active blocks at 643,072 tokens, one
    more than the SMEM tables hold (docs/tpu.md); refused before any JAX work, naming the option.
    The backward's 1024-row blocks would overrun them from 454,656 tokens: it takes 2048-row blocks
    there, and serves as far as the forward."""

    def program(length, **kernels):
        plan = torch_splash_jax.plan(
            q_len=length, num_q_heads=1, head_dim=128, dtype="bfloat16", mask=sm.CausalMask(0), platform="tpu",
            block_sizes=torch_splash_jax.BlockSizes(**kernels),
        )  # fmt: skip
        return torch_splash_jax.program(plan)

    assert program(452608, backward_kernel="active").active_backward.blocks["block_q"] == 1024
    grown = program(454656, backward_kernel="active").active_backward
    assert grown.blocks["block_q"] == 2048 and grown.grid[0].size <= 49152
    assert program(641024, forward_kernel="active").active_backward.grid[0].size <= 49152
    with pytest.raises(torch_splash.SplashConstraintError, match="backward_kernel='active'.*SMEM"):
        program(643072, backward_kernel="active")
    with pytest.raises(torch_splash.SplashConstraintError, match="forward_kernel='active'.*SMEM"):
        program(643072, forward_kernel="active")


def test_partial_blocks_run_straight_line_while_their_patterns_need_no_more_code_than_branches():
    """Causal at 16K: one diagonal pattern (10 of 16 tiles) runs straight; a 3000-token chunked
    causal mask has 14 patterns, more tiles than the 32 bodies of a branch a tile: branches. With
    segment ids a full block's pattern (all 16 tiles) counts as well."""

    def patterns(mask, length, segment_ids=False):
        b = active_forward_blocks(length, length, 128)
        grid = active_kernels.active_grid(
            tables.block_mask_table(mask, length, length, length, b["block_q"], b["block_kv"])[None],
            tables.block_mask_table(mask, length, length, length, b["block_q_sub"], b["block_kv_compute"])[None],
        )
        return active_kernels.tile_patterns(grid, segment_ids, 16)

    (diagonal,) = patterns(sm.CausalMask(0), 16384)
    assert sum(k != active_kernels.SKIP for k in active_kernels._unpack(diagonal, 16)) == 10
    assert patterns(sm.ChunkedCausalMask(3000), 32768) == ()
    assert len(patterns(sm.CausalMask(0), 16384, segment_ids=True)) == 2


def test_the_tooling_s_generation_reaches_the_plan():
    """`kernel_time(generation=...)` and the fit check plan within `planned_for_tpu(generation)`:
    the plans made there are for that generation, and outside it for none."""
    from torch_splash import _checks, _planning
    from torch_splash.fit import planned_for_tpu

    q = torch.empty(1, 4, 256, 128, device="meta", dtype=torch.bfloat16)
    with planned_for_tpu("v7x"):
        call = _checks.check_call(q, q, q, "causal", None, None, None, None)
        assert _planning.splash_plan(call, None, "tpu", None).generation == "v7x"
    assert _planning.splash_plan(call, None, "tpu", None).generation is None
