"""The active-block kernels (`torch_splash_jax.active_kernels`, `BlockSizes(forward_kernel="active")`),
in Pallas interpret mode on the CPU: the forward against a float64 softmax reference (output and
logsumexp) and the backward against float64 gradients, their tables and blocks, and whole calls
through `torch_splash.attention` against SDPA with gradients (either kernel beside JAX's other).
Their Mosaic programs compile for v5e, v6e and v7x in tests/test_tpu_compile.py ("active-*")."""

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


@pytest.mark.parametrize("straight", [True, False], ids=["straight", "branches"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]!r}-{c[1]}x{c[2]}-{c[3]}x{c[4]}-{c[9]}")
def test_the_active_forward_matches_a_float64_softmax(case, straight):
    """float32 inputs: the kernel accumulates in float32 from float32 logits, so output and logsumexp
    agree with float64 to a few float32 roundings (measured about 5e-7); 1e-5 leaves room."""
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


@pytest.mark.parametrize(
    "mask,why",
    [
        (
            torch_splash.masks.MultiHeadMask([torch_splash.masks.CausalMask(0), torch_splash.masks.LocalMask(5)]),
            "shared by every head",
        ),
        (torch_splash.masks.DenseMask(np.tril(np.ones((64, 64), bool))), "shared by every head"),
    ],
)
def test_calls_the_active_forward_cannot_serve_are_refused_before_any_kernel_work(mask, why):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    with pytest.raises(torch_splash.SplashConstraintError, match=why):
        torch_splash.attention(q, k, v, mask, block_sizes=ACTIVE)


@pytest.mark.parametrize("field", ["forward_kernel", "backward_kernel"])
def test_an_unknown_kernel_is_refused(field):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    with pytest.raises(torch_splash.SplashConstraintError, match=f"{field}='fast'"):
        torch_splash.attention(q, k, v, "causal", block_sizes=torch_splash_jax.BlockSizes(**{field: "fast"}))


def test_a_per_head_mask_is_refused_for_the_active_backward_alone():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    mask = torch_splash.masks.MultiHeadMask([torch_splash.masks.CausalMask(0), torch_splash.masks.LocalMask(5)])
    blocks = torch_splash_jax.BlockSizes(backward_kernel="active")
    with pytest.raises(torch_splash.SplashConstraintError, match="backward_kernel='active'"):
        torch_splash.attention(q, k, v, mask, block_sizes=blocks)


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
