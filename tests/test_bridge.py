"""The bridge itself: zero-copy transport, devices, caching, autograd contract."""

import jax
import numpy as np
import pytest
import torch
from helpers import assert_matches_reference, make_qkv

import torch_splash
import torch_splash._ops as ops
import torch_splash_jax
from torch_splash import _compat, _transport
from torch_splash.masks import CausalMask


def _xla_pointer(t):

    return _compat.buffer_pointer(t)


def test_dlpack_is_zero_copy_both_ways_on_cpu():
    t = torch.randn(2, 3, 128, 64)
    (a,) = _transport.to_jax([t])
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    (back,) = _transport.to_torch([a], t.device)
    assert back.data_ptr() == t.data_ptr()


def test_dlpack_is_zero_copy_both_ways_on_xla_device(xla_device):
    t = torch.randn(2, 3, 128, 64).to(xla_device)
    (a,) = _transport.to_jax([t])
    assert a.unsafe_buffer_pointer() == _xla_pointer(t)
    (back,) = _transport.to_torch([a], t.device)
    assert back.device == t.device and _xla_pointer(back) == a.unsafe_buffer_pointer()


def test_kernel_reads_the_callers_buffers(monkeypatch):
    """Contiguous inputs reach the jitted program as the very buffers torch allocated."""
    seen = {}
    real_program = torch_splash_jax.program

    class Spy:
        def __init__(self, program):
            self.program = program

        def __getattr__(self, name):  # anything not spied on is the program's own
            return getattr(self.program, name)

        def forward(self, *arrays):
            seen["forward"] = [a.unsafe_buffer_pointer() for a in arrays]
            return self.program.forward(*arrays)

        def infer(self, *arrays):
            seen["infer"] = [a.unsafe_buffer_pointer() for a in arrays]
            return self.program.infer(*arrays)

    monkeypatch.setattr(ops.torch_splash_jax, "program", lambda plan: Spy(real_program(plan)))
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, 64, torch.float32)
    out = torch_splash.attention(q, k, v)
    assert seen["forward"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert out.device == q.device
    with torch.no_grad():
        torch_splash.attention(q, k, v)
    assert seen["infer"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]


def test_non_contiguous_inputs_like_hf_transposed_views():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 50, h, 64, generator=g) for h in (4, 2, 2))  # (B, L, H, D)
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
    assert not q.is_contiguous()
    assert_matches_reference(q, k, v, "causal")


def test_second_call_traces_nothing():
    q, k, v = make_qkv(1, 2, 2, 40, 40, 64, 64, torch.float32, seed=3)
    torch_splash.attention(q, k, v, "causal", scale=0.123).sum().backward()
    before = dict(torch_splash_jax.splash_program.TRACES)
    for _ in range(2):
        torch_splash.attention(q, k, v, "causal", scale=0.123).sum().backward()
    assert dict(torch_splash_jax.splash_program.TRACES) == before
    torch_splash.attention(q, k, v, "causal", scale=0.5).sum().backward()  # a new option is a new program
    assert torch_splash_jax.splash_program.TRACES["forward"] == before["forward"] + 1
    assert torch_splash_jax.splash_program.TRACES["backward"] == before["backward"] + 1


def test_backward_runs_only_the_backward_kernels():
    plan = torch_splash_jax.plan(
        num_q_heads=2,
        q_len=200,
        head_dim=64,
        mask=torch_splash_jax.CausalMask(0),
        block_sizes=torch_splash_jax.BlockSizes(use_fused_bwd_kernel=False),
    )
    program = torch_splash_jax.program(plan)
    args = [jax.ShapeDtypeStruct((1, 2, 200, 64), "float32")] * 3
    out, lse = jax.eval_shape(program.forward, *args)
    backward = str(jax.make_jaxpr(program.backward)(*args, out, lse, out))
    forward = str(jax.make_jaxpr(program.forward)(*args))
    assert forward.count("pallas_call[") == 1
    assert backward.count("pallas_call[") == 2  # dkv and dq; no forward kernel
    assert "splash_mha_fwd" not in backward


def test_double_backward_is_a_clear_error():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, 64, torch.float32)
    out = torch_splash.attention(q, k, v)
    with pytest.raises(torch_splash.SplashConstraintError, match="not double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("mask,ids", [(None, False), ("causal", True), (CausalMask(-5), False)])
def test_inference_without_grad_matches_training_forward(mask, ids):
    q, k, v = make_qkv(1, 2, 2, 40, 40, 64, 64, torch.float32)
    segment_ids = (torch.arange(40) // 17)[None] if ids else None
    with_grad = torch_splash.attention(q, k, v, mask, segment_ids=segment_ids)
    with torch.no_grad():
        without = torch_splash.attention(q, k, v, mask, segment_ids=segment_ids)
    assert without.grad_fn is None and with_grad.grad_fn is not None
    torch.testing.assert_close(without, with_grad.detach(), atol=1e-6, rtol=1e-6)


def test_gradient_only_for_some_inputs():
    """k without grad: dq and dv still match SDPA's, and k gets none."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, 64, torch.float32)
    k = k.detach()
    torch_splash.attention(q, k, v, "causal").sum().backward()
    ref_q, ref_v = (t.detach().clone().requires_grad_() for t in (q, v))
    torch.nn.functional.scaled_dot_product_attention(ref_q, k, ref_v, is_causal=True).sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v.grad, ref_v.grad, atol=1e-5, rtol=1e-5)
    assert k.grad is None


def test_torch_compile_runs_attention_eagerly_with_a_graph_break():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, 64, torch.float32)

    def step(q, k, v):
        return (torch_splash.attention(q * 2, k, v, "causal") + 1).square().sum()

    compiled = torch.compile(step, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = step(q, k, v)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-5)


def _forget_plans():
    """Every plan the memo of texts holds evicted, by writing as many others."""
    from torch_splash_jax import policy, serialization

    for length in range(1, policy.PLAN_TEXTS + 1):
        serialization.plan_text(torch_splash_jax.plan(q_len=length, head_dim=8, mask=torch_splash_jax.CausalMask(0)))


def test_a_pending_backward_rebuilds_its_plan_from_the_text_and_mask_data_it_carries():
    """The ops hold a plan as text and its mask's data as tensors, no number into a table: a
    backward still to come runs after every plan the memo kept is gone, dense mask included."""

    q, k, v = make_qkv(1, 2, 2, 24, 24, 32, 32, torch.float32)
    allowed = torch.rand(24, 24, generator=torch.Generator().manual_seed(0)) < 0.7
    allowed |= torch.eye(24, dtype=torch.bool)
    out = torch_splash.attention(q, k, v, allowed)
    _forget_plans()
    torch_splash_jax.program.cache_clear()
    out.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=allowed).sum().backward()
    for got, expected in zip((q, k, v), ref):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-4, rtol=0)


def test_a_plans_text_names_its_data_by_digest_and_refuses_other_data():
    from torch_splash_jax import serialization

    dense = torch_splash_jax.DenseMask(np.tril(np.ones((40, 40), bool)))
    plan = torch_splash_jax.plan(q_len=40, head_dim=32, mask=torch_splash_jax.CausalMask(0) & dense)
    text, arrays = serialization.plan_text(plan)
    assert dense.digest in text and len(arrays) == 1
    _forget_plans()
    assert serialization.plan_from_text(text, arrays) == plan
    _forget_plans()
    with pytest.raises(ValueError, match="not the ones its source was written from"):
        serialization.plan_from_text(text, [np.ones((40, 40), bool)])
