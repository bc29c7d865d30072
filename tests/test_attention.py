"""torch_splash.attention against torch SDPA (or a plain softmax for soft cap): outputs and grads."""

import itertools

import pytest
import torch
from helpers import assert_matches_reference, make_qkv

import torch_splash
from torch_splash.masks import CausalMask

HEADS = [(1, 1), (2, 2), (4, 1), (8, 4), (6, 2)]
DIMS = [(64, 64), (128, 128), (64, 32)]
LENGTHS = [1, 7, 127, 129, 1000]
MASKS = [None, "causal"]
DTYPES = [torch.float32, torch.bfloat16]

# A representative set that touches every value of every axis at least once; the full product is
# the slow sweep below.
REPRESENTATIVE = [
    # (heads, dims, Lq, Lkv, mask, dtype)
    ((1, 1), (64, 64), 1, 1, None, torch.float32),
    ((2, 2), (64, 64), 7, 7, "causal", torch.float32),
    ((4, 1), (128, 128), 127, 127, "causal", torch.float32),
    ((8, 4), (64, 32), 129, 129, None, torch.float32),
    ((6, 2), (128, 128), 1000, 1000, "causal", torch.float32),
    ((2, 2), (128, 128), 129, 129, "causal", torch.bfloat16),
    ((4, 1), (64, 32), 7, 7, None, torch.bfloat16),
    ((8, 4), (64, 64), 1000, 1000, "causal", torch.bfloat16),
    # cross attention, Lq != Lkv, top-left and bottom-right causal
    ((2, 2), (64, 64), 7, 300, "causal", torch.float32),
    ((8, 4), (64, 64), 300, 129, "causal", torch.float32),
    ((4, 1), (64, 64), 1, 1000, CausalMask(999), torch.float32),
    ((2, 2), (64, 32), 100, 333, CausalMask(233), torch.float32),
    ((6, 2), (64, 64), 129, 7, None, torch.bfloat16),
]


@pytest.mark.parametrize("heads,dims,q_len,kv_len,mask,dtype", REPRESENTATIVE)
def test_matches_sdpa(heads, dims, q_len, kv_len, mask, dtype):
    q, k, v = make_qkv(2, *heads, q_len, kv_len, *dims, dtype)
    assert_matches_reference(q, k, v, mask)


@pytest.mark.slow
@pytest.mark.parametrize("heads,dims,length,mask,dtype", list(itertools.product(HEADS, DIMS, LENGTHS, MASKS, DTYPES)))
def test_matches_sdpa_sweep(heads, dims, length, mask, dtype):
    q, k, v = make_qkv(2, *heads, length, length, *dims, dtype)
    assert_matches_reference(q, k, v, mask)


def test_unbatched_3d():
    q, k, v = (t.detach()[0].requires_grad_() for t in make_qkv(1, 4, 2, 33, 33, 64, 64, torch.float32))
    assert_matches_reference(q, k, v, "causal")


def test_rows_with_no_visible_key_give_zero_and_zero_grads():
    # offset -10: the first 10 rows see nothing; -200 empties whole 128-row blocks as well.
    for offset in (-10, -200):
        q, k, v = make_qkv(1, 2, 2, 300, 300, 64, 64, torch.float32)
        out = torch_splash.attention(q, k, v, CausalMask(offset))
        out.sum().backward()
        empty = slice(0, -offset)
        assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
        assert torch.equal(q.grad[:, :, empty], torch.zeros_like(q.grad[:, :, empty]))
        assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
        assert_matches_reference(q, k, v, CausalMask(offset))


def test_segment_ids_packed_documents():
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, 64, torch.float32)
    ids = torch.zeros(2, 300, dtype=torch.int64)
    ids[:, 100:] = 1
    ids[1, 250:] = 7
    assert_matches_reference(q, k, v, "causal", segment_ids=ids)
    assert_matches_reference(q, k, v, None, segment_ids=ids)


def test_segment_ids_pair_cross_attention_with_empty_rows():
    q, k, v = make_qkv(2, 2, 2, 40, 200, 64, 64, torch.float32)
    q_ids = torch.randint(0, 3, (2, 40))
    kv_ids = torch.randint(0, 2, (2, 200))  # queries with id 2 see no key at all
    assert_matches_reference(q, k, v, None, segment_ids=(q_ids, kv_ids))


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cap_against_plain_reference(dtype):
    q, k, v = make_qkv(2, 4, 2, 129, 129, 64, 64, dtype)
    q.data *= 4  # make the cap bite
    ids = torch.zeros(2, 129, dtype=torch.int32)
    ids[:, 60:] = 1
    assert_matches_reference(q, k, v, "causal", soft_cap=5.0, segment_ids=ids)


def test_explicit_scale():
    q, k, v = make_qkv(1, 2, 2, 50, 50, 64, 64, torch.float32)
    assert_matches_reference(q, k, v, "causal", scale=0.3)


def test_user_block_sizes_are_honoured_and_clamped():
    q, k, v = make_qkv(1, 2, 1, 200, 300, 64, 64, torch.float32)
    # block_kv 2048 is clamped to the padded kv length; separate dq kernel on request
    blocks = torch_splash.BlockSizes(block_q=256, block_kv=2048, block_q_dq=128, block_kv_dq=256)
    assert_matches_reference(q, k, v, "causal", block_sizes=blocks)


def test_tpu_plan_numerics_in_interpret_mode():
    """The TPU default plan (separate dq and dkv kernels) gives the same numbers, run on CPU."""
    q, k, v = make_qkv(1, 4, 2, 200, 200, 64, 64, torch.float32)
    blocks = torch_splash.BlockSizes(use_fused_bwd_kernel=False)
    assert_matches_reference(q, k, v, "causal", block_sizes=blocks)


def _float64_errors(fn, q, k, v, cotangent):
    """Max abs error of fn's causal output and gradients (in q's dtype) against float64 SDPA on the
    same inputs."""
    results = []
    for dtype in (q.dtype, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        if dtype == torch.float64:
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        else:
            out = fn(*leaves)
        (out.double() * cotangent).sum().backward()
        results.append([out.detach().double()] + [t.grad.double() for t in leaves])
    return [float((a - b).abs().max()) for a, b in zip(*results)]


@pytest.mark.parametrize("heads,length", [((4, 2), 300), ((2, 1), 1000)])
def test_float16_is_served_at_least_as_accurately_as_sdpa(heads, length):
    """float16 is computed in float32 and returned in float16: against a float64 reference its
    output and gradients are no further off than torch SDPA's own float16 results."""
    q, k, v = make_qkv(2, *heads, length, length, 64, 64, torch.float16)
    cotangent = torch.randn(q.shape[:-1] + (64,), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = torch_splash.attention(q, k, v, "causal")
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float16
    splash = _float64_errors(lambda *t: torch_splash.attention(*t, "causal"), q, k, v, cotangent)
    sdpa = _float64_errors(
        lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True),
        q,
        k,
        v,
        cotangent,
    )
    for name, mine, theirs in zip(["out", "dq", "dk", "dv"], splash, sdpa):
        # one float16 rounding of the result (half an ulp) is the floor both share
        assert mine <= theirs * 1.05 + 1e-6, (name, splash, sdpa)
    dropin = _float64_errors(
        lambda *t: torch_splash.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v, cotangent
    )
    assert dropin == splash  # the SDPA drop-in is the same computation


def test_explicit_blocks_with_rows_that_see_no_key_give_finite_correct_gradients():
    """A forward q block smaller than the dkv q block leaves rows whose q block was skipped with
    logsumexp -inf; the dkv kernel recomputed exp(logit - logsumexp) = inf there (dk, dv were inf)."""
    for mask in (CausalMask(-130), CausalMask(-300)):
        q, k, v = make_qkv(1, 2, 2, 512, 512, 64, 64, torch.float32)
        assert_matches_reference(q, k, v, mask, block_sizes=torch_splash.BlockSizes(block_q=128))


def test_segment_ids_of_any_integer_dtype():
    """Ids only matter for equality: int64 ids beyond the int32 range are renumbered, not truncated
    (2**33 and 2**33 + 2**32 used to become one id)."""
    q, k, v = make_qkv(2, 2, 2, 64, 64, 64, 64, torch.float32)
    ids = torch.full((2, 64), 2**33, dtype=torch.int64)
    ids[:, 20:] += 2**32
    ids[1, 50:] = -7
    assert_matches_reference(q, k, v, segment_ids=ids)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        assert_matches_reference(q, k, v, segment_ids=(ids != 2**33).to(dtype))


def test_backward_after_the_program_cache_evicted_the_forward_s_program():
    import torch_splash_jax

    q, k, v = make_qkv(1, 4, 2, 100, 100, 64, 64, torch.float32)
    out = torch_splash.attention(q, k, v, "causal", segment_ids=torch.zeros(1, 100, dtype=torch.int32))
    torch_splash_jax.program.cache_clear()  # as if more than the cache's worth of other shapes ran since
    out.sum().backward()
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    torch_splash.attention(q2, k2, v2, "causal", segment_ids=torch.zeros(1, 100, dtype=torch.int32)).sum().backward()
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
