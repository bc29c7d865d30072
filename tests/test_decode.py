"""The decode kernel (torch_splash_jax.decode): few query rows against a long cache.

Outputs against a float64 reference of the mask's meaning (tests/helpers.reference) and against
SDPA, for what the kernel serves: query tokens 1 to 16, positions at block edges and at 0, key
ranges that differ per batch element and left padding (segment ids), GQA groups of 1, 4 and 8,
MQA, windows, chunks, soft cap and sinks; several kv blocks, row blocks and splits (plans with
small blocks, at the JAX level); which kernel a call takes, and the refusals of kernel="decode".
"""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import mask_oracle, reference

import torch_splash
import torch_splash_jax
from torch_splash.masks import CausalMask, ChunkedCausalMask, LocalMask, PrefixMask
from torch_splash_jax import decode

# float32: the kernel accumulates in float32 as SDPA does; measured errors are about 1e-7.
F32 = dict(atol=2e-5, rtol=1e-5)


def _decode_traces() -> int:
    return torch_splash_jax.splash_program.TRACES["decode"]


def _inputs(batch, hq, hkv, q_len, kv_len, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, hq, q_len, d), (batch, hkv, kv_len, d), (batch, hkv, kv_len, d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.fixture
def decode_calls(monkeypatch):
    """The calls of the decode op (torch_splash._ops.decode) made while the test runs."""
    from torch_splash import _ops

    calls, op = [], _ops.decode

    def counted(*args, **kwargs):
        calls.append(args)
        return op(*args, **kwargs)

    monkeypatch.setattr(_ops, "decode", counted)
    return calls


def _takes_decode(calls, fn):
    """fn()'s result, asserting that it ran the decode kernel."""
    before = len(calls)
    out = fn()
    assert len(calls) > before, "the call did not take the decode kernel"
    return out


def _ids_for_lengths(lengths, kv_len, q_len, starts=None):
    """Segment ids keeping keys [start, length) of each batch element (left padding before start)."""
    j = torch.arange(kv_len)
    starts = torch.zeros_like(lengths) if starts is None else starts
    kv_ids = ((j >= starts[:, None]) & (j < lengths[:, None])).int()
    return torch.ones(len(lengths), q_len, dtype=torch.int32), kv_ids


CASES = [
    # (batch, hq, hkv, q_len, kv_len, mask, options)
    (2, 8, 2, 1, 700, CausalMask(699), {}),  # one token, GQA 4
    (2, 8, 1, 1, 700, CausalMask(699), {}),  # MQA (GQA 8)
    (1, 4, 4, 1, 300, CausalMask(0), {}),  # the query at position 0: it sees key 0 only
    (2, 8, 2, 16, 600, CausalMask(584), {}),  # 16 tokens: rows 64
    (2, 4, 4, 3, 500, LocalMask(100, 0, 497), {}),  # a sliding window
    (2, 8, 2, 4, 900, ChunkedCausalMask(256), {}),  # chunks
    pytest.param(2, 8, 2, 2, 400, CausalMask(398) | PrefixMask(7), {}, marks=pytest.mark.slow),  # a composition
    (2, 8, 2, 1, 500, CausalMask(499), dict(soft_cap=5.0, sinks=True)),
]


@pytest.mark.parametrize("batch,hq,hkv,q_len,kv_len,mask,options", CASES)
def test_decode_matches_the_float64_reference_and_sdpa(batch, hq, hkv, q_len, kv_len, mask, options, decode_calls):
    q, k, v = _inputs(batch, hq, hkv, q_len, kv_len)
    kwargs = dict(soft_cap=options.get("soft_cap"))
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(3))
    out = _takes_decode(decode_calls, lambda: torch_splash.attention(q, k, v, mask, **kwargs))
    ref64 = reference(q, k, v, mask, dtype=torch.float64, **kwargs)
    torch.testing.assert_close(out.double(), ref64, **F32)
    if not kwargs.get("soft_cap") and "sinks" not in kwargs:  # SDPA itself, where SDPA has the option
        allowed = mask_oracle(mask, q_len, kv_len, hq)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, allowed, enable_gqa=True), **F32)


def test_lengths_and_left_padding_per_batch_element_are_data(decode_calls):
    """Each batch element sees its own keys [start, length): segment ids, read on the device. Two
    calls with other lengths run the same program (no new trace)."""
    q, k, v = _inputs(3, 8, 2, 1, 1000)
    lengths, starts = torch.tensor([1000, 517, 1]), torch.tensor([0, 100, 0])
    ids = _ids_for_lengths(lengths, 1000, 1, starts)
    out = _takes_decode(decode_calls, lambda: torch_splash.attention(q, k, v, segment_ids=ids))
    torch.testing.assert_close(out.double(), reference(q, k, v, segment_ids=ids, dtype=torch.float64), **F32)
    traced = _decode_traces()
    ids = _ids_for_lengths(torch.tensor([3, 999, 640]), 1000, 1)
    out = torch_splash.attention(q, k, v, segment_ids=ids)
    torch.testing.assert_close(out.double(), reference(q, k, v, segment_ids=ids, dtype=torch.float64), **F32)
    assert _decode_traces() == traced


def test_a_batch_element_that_sees_no_key_returns_zero():
    q, k, v = _inputs(2, 4, 2, 1, 300)
    ids = (torch.ones(2, 1, dtype=torch.int32), torch.stack([torch.ones(300), torch.zeros(300)]).int())
    out, lse = torch_splash.attention(q, k, v, segment_ids=ids, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    torch.testing.assert_close(out[0].double(), reference(q, k, v, segment_ids=ids, dtype=torch.float64)[0], **F32)


def test_logsumexp_matches_the_float64_reference(decode_calls):
    q, k, v = _inputs(2, 8, 2, 16, 600)  # the program of a case above
    mask = CausalMask(584)
    out, lse = _takes_decode(decode_calls, lambda: torch_splash.attention(q, k, v, mask, return_lse=True))
    logits = (q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2)) * 64**-0.5
    allowed = mask_oracle(mask, 16, 600)
    expected = torch.logsumexp(logits.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(lse.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_half_precision_is_as_close_to_float64_as_sdpa(dtype, decode_calls):
    """Both against float64 on the same rounded inputs: the decode kernel's error is within a few
    roundings of SDPA's own in that dtype (float16 is computed in float32)."""
    q, k, v = _inputs(2, 8, 2, 2, 800, dtype=dtype)
    mask = CausalMask(798)
    out = _takes_decode(decode_calls, lambda: torch_splash.attention(q, k, v, mask))
    assert out.dtype == dtype
    ref64 = reference(q, k, v, mask, dtype=torch.float64)
    allowed = mask_oracle(mask, 2, 800)
    sdpa = F.scaled_dot_product_attention(q, k, v, allowed, enable_gqa=True)
    mine, theirs = (out.double() - ref64).abs().max(), (sdpa.double() - ref64).abs().max()
    assert mine <= 2 * theirs + 4e-3, (mine, theirs)


def _jax_decode(plan, q, k, v, q_ids=None, kv_ids=None, sinks=None):
    program = decode.DecodeProgram(plan)
    named = dict(q=q, k=k, v=v, q_ids=q_ids, kv_ids=kv_ids, sinks=sinks)
    out, lse = program.forward(*program.arguments(**{n: None if a is None else a.numpy() for n, a in named.items()}))
    return torch.from_numpy(np.asarray(out)), torch.from_numpy(np.asarray(lse))


def _plan(q, k, mask, **options):
    return decode.decode_plan(
        batch=q.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=k.shape[1],
        q_len=q.shape[2],
        kv_len=k.shape[2],
        head_dim=q.shape[3],
        head_dim_v=k.shape[3],
        dtype="float32",
        mask=mask,
        scale=q.shape[3] ** -0.5,
        soft_cap=None,
        has_segment_ids=options.get("ids", False),
        has_sinks=False,
        platform="cpu",
    )


@pytest.mark.parametrize(
    "blocks,lengths",
    [
        (dict(block_kv=128), [1000, 128, 129]),  # keys ending at and just past a block edge
        (dict(block_kv=128, splits=3), [1000, 255, 256]),  # splits share each element's range
        (dict(block_kv=256, block_heads=1), [1, 640, 1000]),  # one kv head per step
        (dict(block_kv=128, block_rows=8), [700, 1000, 384]),  # 32 rows in 4 row blocks
    ],
)
def test_kv_blocks_row_blocks_and_splits(blocks, lengths):
    """Plans with small blocks, so that lengths fall on, before and after block edges, rows span
    several row blocks and keys several splits (the planner picks larger ones at these lengths)."""
    q, k, v = _inputs(3, 16, 2, 4, 1000)
    mask = CausalMask(996)
    ids = _ids_for_lengths(torch.tensor(lengths), 1000, 4)
    plan = dataclasses.replace(_plan(q, k, mask, ids=True), **blocks)
    out, _ = _jax_decode(plan, q, k, v, *ids)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, segment_ids=ids, dtype=torch.float64), **F32)


def test_the_default_rule_takes_decode_shaped_calls_and_keeps_the_others(decode_calls):
    q, k, v = _inputs(1, 8, 2, 1, 300)
    _takes_decode(decode_calls, lambda: torch_splash.attention(q, k, v, CausalMask(299)))
    assert decode.takes_by_default(8, 2, 1, 300) and not decode.takes_by_default(8, 2, 300, 300)
    assert not decode.takes_by_default(32, 8, decode.AUTO_MAX_ROWS // 4 + 1, 32768)
    before = len(decode_calls)
    torch_splash.attention(q, k, v, CausalMask(299), kernel="splash")  # asked for
    torch_splash.attention(*_inputs(1, 8, 2, 300, 300), "causal")  # prefill: as many queries as keys
    torch_splash.attention(q, k, v, torch.ones(1, 300, dtype=torch.bool))  # a dense mask
    assert len(decode_calls) == before


def test_a_call_that_needs_gradients_keeps_the_splash_kernels(decode_calls):
    """The decode kernel has no backward: by default a call whose inputs require grad takes the splash
    kernels, and its gradients match SDPA's."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 8, 2, 1, 300))
    out = torch_splash.attention(q, k, v, CausalMask(299))
    out.sum().backward()
    assert not decode_calls
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True).sum().backward()
    for mine, theirs in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda q, k, v: torch_splash.attention(q.requires_grad_(), k, v, kernel="decode"), "needs gradients"),
        (
            lambda q, k, v: torch_splash.attention(q, k, v, torch.ones(1, 300, dtype=torch.bool), kernel="decode"),
            "mask",
        ),
        (
            lambda q, k, v: torch_splash.attention(
                q, k, v, block_sizes=torch_splash.BlockSizes(block_q=8), kernel="decode"
            ),
            "block_sizes",
        ),
        (lambda q, k, v: torch_splash.attention(q, k, v, [CausalMask(299)] * 8, kernel="decode"), "MultiHeadMask"),
        (lambda q, k, v: torch_splash.attention(q, k, v, kernel="fast"), "kernel='fast'"),
    ],
)
def test_kernel_decode_refuses_what_it_cannot_serve(call, message, decode_calls):
    q, k, v = _inputs(1, 8, 2, 1, 300)
    with pytest.raises(torch_splash.SplashConstraintError, match=message):
        call(q, k, v)
    assert not decode_calls


def test_the_sdpa_drop_in_takes_it_for_decode_calls(decode_calls):
    q, k, v = _inputs(2, 8, 2, 1, 500)
    out = _takes_decode(decode_calls, lambda: torch_splash.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), **F32)


def test_decode_under_torch_compile_fullgraph():
    """The decode op in the graph (a new program traced: Dynamo calls the op itself, not the module's name)."""
    q, k, v = _inputs(2, 8, 2, 1, 500)
    compiled = torch.compile(
        lambda q, k, v: torch_splash.attention(q, k, v, CausalMask(499)), fullgraph=True, backend="aot_eager"
    )
    torch_splash_jax.program.cache_clear()
    before = _decode_traces()
    out = compiled(q, k, v)
    assert _decode_traces() > before
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), **F32)


def test_decode_on_torch_xla_s_device_in_graph(xla_device):
    """The graph transport: the decode program spliced into torch_xla's lazy graph."""
    q, k, v = _inputs(2, 8, 2, 1, 500)
    ids = _ids_for_lengths(torch.tensor([500, 123]), 500, 1)
    out = torch_splash.attention(
        *(t.to(xla_device) for t in (q, k, v)), segment_ids=tuple(i.to(xla_device) for i in ids), transport="graph"
    )
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, segment_ids=ids, dtype=torch.float64), **F32)


@pytest.mark.torchtpu  # the estimator's libtpu is the current set's
def test_kernel_time_of_a_decode_shaped_call_estimates_the_decode_kernel():
    """torch_splash.fit.kernel_time estimates what attention would run: a decode step (one token,
    a 4K cache, no gradients) takes the decode kernel, not the splash forward, which the real v5e
    measured 5x slower on this call (docs/benchmarks.md, "The real chip")."""
    from torch_splash import fit

    q = torch.empty(8, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(8, 8, 4096, 128, dtype=torch.bfloat16, device="meta")
    step = fit.kernel_time(q, k, k, CausalMask(4095), generation="v5e")
    assert [kernel.kind for kernel in step.kernels] == ["decode"]
    splash = fit.kernel_time(q, k, k, CausalMask(4095), generation="v5e", kernel="splash", backward=False)
    assert [kernel.kind for kernel in splash.kernels] == ["forward"]
    assert step.kernel_seconds < splash.kernel_seconds / 2
