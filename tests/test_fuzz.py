"""Differential fuzzing: torch_splash.attention against a float64 softmax reference on random calls
(shapes, GQA/MQA, every mask family and their compositions, segment ids with rows that see no key,
soft cap, sinks, views, explicit blocks), through JAX's kernels and through the active-block ones.
A small budget by default, a larger one under -m slow."""

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from helpers import reference

import torch_splash
from torch_splash import masks

HEADS = [(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)]


@st.composite
def mask_strategy(draw, heads):
    families = [
        st.just(None),
        st.just("causal"),
        st.builds(masks.CausalMask, st.integers(-150, 150)),
        st.builds(
            masks.LocalMask, st.none() | st.integers(0, 80), st.none() | st.integers(0, 40), st.integers(-50, 50)
        ),
        st.builds(masks.ChunkedCausalMask, st.integers(1, 200)),
        st.builds(masks.PrefixMask, st.integers(0, 100)),
        st.just(masks.from_mask_mod(lambda b, h, q, kv: (q - kv) % 7 != 3)),
    ]
    one = st.one_of(*families[2:])
    composed = st.tuples(one, one, st.booleans()).map(lambda t: t[0] & t[1] if t[2] else t[0] | t[1])
    per_head = st.lists(st.one_of(*families[2:-1]), min_size=heads, max_size=heads).map(
        lambda ms: masks.MultiHeadMask(tuple(ms))
    )
    return draw(st.one_of(*families, composed, per_head))


@st.composite
def calls(draw, active: bool = False):
    hq, hkv = draw(st.sampled_from(HEADS))
    batch, q_len, kv_len = draw(st.integers(1, 2)), draw(st.integers(1, 300)), draw(st.integers(1, 300))
    d = draw(st.sampled_from([64, 128]))
    options = dict(mask=draw(mask_strategy(hq)))  # the active kernels serve every mask too
    if draw(st.booleans()):  # a few documents; ids drawn per position, so some rows see no key
        n = draw(st.integers(1, 3))
        options["segment_ids"] = (
            torch.randint(0, n, (batch, q_len), generator=torch.Generator().manual_seed(q_len)),
            torch.randint(0, n, (batch, kv_len), generator=torch.Generator().manual_seed(kv_len)),
        )
    if draw(st.booleans()):
        options["soft_cap"] = draw(st.floats(1.0, 50.0))
    if draw(st.booleans()):
        options["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(hq)).requires_grad_()
    if active:  # the active kernels plan their own blocks
        options["block_sizes"] = torch_splash.BlockSizes(forward_kernel="active")
    elif draw(st.booleans()):
        options["block_sizes"] = torch_splash.BlockSizes(
            block_q=draw(st.sampled_from([128, 256])), block_kv=draw(st.sampled_from([128, 256]))
        )
    if draw(st.booleans()):
        options["scale"] = draw(st.floats(0.05, 0.5))
    transposed = draw(st.booleans())  # HF-style (B, L, H, D) storage seen through a transpose
    return (batch, hq, hkv, q_len, kv_len, d, transposed), options


def _check(shape, options):
    batch, hq, hkv, q_len, kv_len, d, transposed = shape
    g = torch.Generator().manual_seed(batch * 1000 + q_len)
    sizes = [(batch, hq, q_len, d), (batch, hkv, kv_len, d), (batch, hkv, kv_len, d)]
    if transposed:
        q, k, v = (torch.randn(b, length, h, dd, generator=g).transpose(1, 2) for b, h, length, dd in sizes)
    else:
        q, k, v = (torch.randn(s, generator=g) for s in sizes)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cotangent = torch.randn(batch, hq, q_len, d, generator=g)
    mask, rest = options["mask"], {n: o for n, o in options.items() if n != "mask"}
    out = torch_splash.attention(q, k, v, mask, **rest)
    grads = torch.autograd.grad((out * cotangent).sum(), [q, k, v] + ([rest["sinks"]] if "sinks" in rest else []))
    leaves = [t.detach().double().requires_grad_() for t in [q, k, v] + ([rest["sinks"]] if "sinks" in rest else [])]
    ref_rest = {n: o for n, o in rest.items() if n != "block_sizes"}
    if "sinks" in ref_rest:
        ref_rest["sinks"] = leaves[3]
    ref = reference(*leaves[:3], mask, dtype=torch.float64, **ref_rest)
    ref_grads = torch.autograd.grad((ref * cotangent.double()).sum(), leaves)
    # float32 kernels against float64: measured errors are about 1e-6 (out) and 1e-5 (grads)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    for name, mine, theirs in zip(["dq", "dk", "dv", "d_sinks"], grads, ref_grads):
        assert torch.isfinite(mine).all(), name
        torch.testing.assert_close(mine.double(), theirs, atol=2e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@hypothesis.settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
@hypothesis.given(calls())
def test_attention_matches_float64(call):
    _check(*call)


@pytest.mark.slow
@hypothesis.settings(max_examples=100, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(calls())
def test_attention_matches_float64_wide(call):
    _check(*call)


@hypothesis.settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
@hypothesis.given(calls(active=True))
def test_the_active_kernels_match_float64(call):
    _check(*call)


@pytest.mark.slow
@hypothesis.settings(max_examples=100, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(calls(active=True))
def test_the_active_kernels_match_float64_wide(call):
    _check(*call)
