"""Attention sinks (gpt-oss): one learned logit per query head that every row also normalises over,
against a plain softmax reference with that logit as an extra, value-less key."""

import jax
import jax.export
import jax.numpy as jnp
import pytest
import torch
from helpers import TOL, backward_kernels, make_qkv, reference

import torch_splash
import torch_splash_jax
from torch_splash.masks import CausalMask, LocalMask

CASES = [
    # (hq, hkv, q_len, kv_len, mask, segment ids)
    (4, 2, 200, 200, "causal", False),
    (2, 2, 130, 130, CausalMask(-5), True),  # rows with no visible key: only the sink
    (4, 1, 100, 300, LocalMask(40, 0, 200), False),  # MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-L{c[2]}x{c[3]}-seg{c[5]}")
def test_sinks_match_the_reference(case, dtype):
    hq, hkv, q_len, kv_len, mask, with_ids = case
    q, k, v = make_qkv(2, hq, hkv, q_len, kv_len, 32, 32, dtype)
    sinks = torch.linspace(-1.0, 2.0, hq).to(dtype).requires_grad_()
    ids = (torch.arange(q_len)[None] >= torch.tensor([[60], [0]])).int() if with_ids else None
    cotangent = torch.randn(2, hq, q_len, 32, generator=torch.Generator().manual_seed(3))
    out = torch_splash.attention(q, k, v, mask, segment_ids=ids, sinks=sinks)
    (out.float() * cotangent).sum().backward()
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    ref = reference(q, k, v, mask, segment_ids=ids, sinks=sinks)
    (ref * cotangent).sum().backward()
    expected = [ref.detach()] + [t.grad for t in (q, k, v, sinks)]
    (atol_out, rtol_out), (atol_grad, rtol_grad) = TOL[dtype]["out"], TOL[dtype]["grad"]
    torch.testing.assert_close(got[0].float(), expected[0], atol=atol_out, rtol=rtol_out)
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got[1:], expected[1:]):
        # d_sinks sums over every row of the batch: scale the tolerance by the number of rows it adds up
        scale = 2 * q_len if name == "dsinks" else 1
        torch.testing.assert_close(g.float(), e.float(), atol=atol_grad * scale**0.5, rtol=rtol_grad, msg=name)


@pytest.mark.parametrize(
    "sinks,error,match",
    [
        (torch.zeros(3), torch_splash.SplashConstraintError, r"must be \(4,\): one logit per query head"),
        (torch.zeros(4, dtype=torch.int32), torch_splash.SplashDtypeError, "sinks are logits"),
        ([0.0] * 4, torch_splash.SplashDtypeError, "sinks must be a torch.Tensor"),
    ],
)
def test_bad_sinks_are_clear_errors(sinks, error, match):
    q, k, v = make_qkv(1, 4, 2, 16, 16, 32, 32, torch.float32)
    with pytest.raises(error, match=match):
        torch_splash.attention(q, k, v, sinks=sinks)


def test_sinks_lower_for_tpu():
    plan = torch_splash_jax.plan(
        batch=2,
        num_q_heads=8,
        num_kv_heads=2,
        q_len=1024,
        dtype="bfloat16",
        mask=CausalMask(0),
        platform="tpu",
        has_sinks=True,
    )
    program = torch_splash_jax.program(plan)
    args = [jax.ShapeDtypeStruct((2, h, 1024, 128), jnp.bfloat16) for h in (8, 2, 2)]
    args.append(jax.ShapeDtypeStruct((8,), jnp.float32))
    forward = jax.export.export(program.forward, platforms=["tpu"])(*args)
    out, lse = jax.eval_shape(program.forward, *args)
    backward = jax.export.export(program.backward, platforms=["tpu"])(*args, out, lse, out)
    calls = [m.mlir_module().count("custom_call @tpu_custom_call") for m in (forward, backward)]
    assert calls == [1, backward_kernels(plan.block_sizes())]
    assert backward.out_avals[3].shape == (8,)  # d_sinks


def test_sinks_trace_under_torch_compile():
    q, k, v = make_qkv(1, 4, 2, 64, 64, 32, 32, torch.float32)
    sinks = torch.zeros(4, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v, s: torch_splash.attention(q, k, v, "causal", sinks=s), fullgraph=True)(
        q, k, v, sinks
    )
    out.sum().backward()
    expected = reference(q, k, v, "causal", sinks=sinks)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    assert sinks.grad is not None and sinks.grad.shape == (4,)
