"""The in-graph transport on torch_xla's CPU device: splash inside torch_xla's lazy graph."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import make_qkv, tpu_training_kernels, xla_metric_count

import torch_splash
from torch_splash import SplashConstraintError, _compat


def test_both_transports_give_identical_results(xla_device):
    q, k, v = make_qkv(2, 4, 2, 150, 150, 64, 64, torch.float32, device=xla_device)
    ids = torch.zeros(2, 150, dtype=torch.int32, device=xla_device)
    ids[:, 70:] = 1
    results = {}
    for transport in ("dlpack", "graph"):
        for t in (q, k, v):
            t.grad = None
        out = torch_splash.attention(q, k, v, "causal", segment_ids=ids, transport=transport)
        out.sum().backward()
        results[transport] = [t.cpu() for t in (out, q.grad, k.grad, v.grad)]
    for a, b in zip(results["dlpack"], results["graph"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_graph_transport_does_not_sync(xla_device):
    import torch_xla

    base = [t.detach() for t in make_qkv(1, 2, 2, 64, 64, 64, 64, torch.float32, device=xla_device)]
    torch_xla.sync()
    q, k, v = (t * 1.5 for t in base)  # pending
    executed = xla_metric_count("ExecuteTime")
    out = torch_splash.attention(q, k, v, "causal")  # automatic: pending inputs -> graph
    assert xla_metric_count("ExecuteTime") == executed  # nothing ran yet
    assert _compat.needs_materialization_each([out]) == [True]
    expected = torch_splash.attention(*(t.cpu() * 1.5 for t in base), "causal")
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_transport_choice_and_override(xla_device, monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, 64, torch.float32)
    with pytest.raises(SplashConstraintError, match="transport='graph' needs torch_xla tensors"):
        torch_splash.attention(q, k, v, transport="graph")
    with pytest.raises(SplashConstraintError, match="transport='nccl': expected one of"):
        torch_splash.attention(q, k, v, transport="nccl")
    monkeypatch.setenv("TORCH_SPLASH_TRANSPORT", "carrier-pigeon")
    with pytest.raises(SplashConstraintError, match=r"\$TORCH_SPLASH_TRANSPORT='carrier-pigeon'"):
        torch_splash.attention(q, k, v)
    monkeypatch.setenv("TORCH_SPLASH_TRANSPORT", "graph")
    xq, xk, xv = (t.detach().to(xla_device) for t in (q, k, v))
    import torch_xla

    torch_xla.sync()
    executed = xla_metric_count("ExecuteTime")
    out = torch_splash.attention(xq, xk, xv)  # materialised inputs, but the environment asks for graph
    assert xla_metric_count("ExecuteTime") == executed
    torch.testing.assert_close(out.cpu(), torch_splash.attention(q, k, v).detach(), atol=1e-6, rtol=1e-6)


class TinyModel(nn.Module):
    def __init__(self, attn, layers=2, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.attn, self.heads, self.kv_heads, self.head_dim = attn, heads, kv_heads, dim // heads
        self.embed = nn.Embedding(50, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, 50)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, length, _ = x.shape
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(x).split(
                [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1
            )
            q, k, v = (t.view(b, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
            x = x + proj(self.attn(q, k, v).transpose(1, 2).reshape(b, length, -1))
        return self.head(x)


def _train(attn, device, steps=4):
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    model = TinyModel(attn).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 50, (2, 129), generator=torch.Generator().manual_seed(1)).to(device)
    losses, executions, compiles = [], [], []
    for _ in range(steps):
        before_exec, before_compile = xla_metric_count("ExecuteTime"), xla_metric_count("CompileTime")
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        # sync() executes asynchronously: wait until it has run, or its count can land in the next
        # step (seen on a loaded machine: [0, 2, 1, 1])
        xm.wait_device_ops()
        losses.append(loss.item())
        executions.append(xla_metric_count("ExecuteTime") - before_exec)
        compiles.append(xla_metric_count("CompileTime") - before_compile)
    return losses, executions, compiles


def test_training_in_graph_is_one_graph_per_step_and_matches_sdpa(xla_device, monkeypatch):
    def splash(q, k, v):
        return torch_splash.attention(q, k, v, "causal", transport="graph")

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    losses, executions, compiles = _train(splash, xla_device)
    ref_losses, _, _ = _train(sdpa, "cpu")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-4)
    assert executions == [1] * len(executions), executions  # forward, backward, update: one XLA graph
    assert compiles[2:] == [0] * (len(compiles) - 2), compiles  # nothing recompiles once warm

    dl_losses, dl_executions, _ = _train(
        lambda q, k, v: torch_splash.attention(q, k, v, "causal", transport="dlpack"), xla_device
    )
    torch.testing.assert_close(torch.tensor(dl_losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-4)
    assert dl_executions[-1] > executions[-1]  # DLPack syncs the lazy graph at every attention call


def test_training_step_graph_for_tpu_holds_the_mosaic_kernels(xla_device, planned_for_tpu):
    """What torch_xla would compile on a TPU, built here: attention() with its kernels planned and
    lowered for TPU, forward and backward left in the lazy graph of torch_xla's CPU device (nothing
    executes: a Mosaic call cannot run on a CPU). JAX, whose only backend here is the CPU, lowered
    them; the graph of the gradients holds the forward kernel and the backward's (dkv, and dq
    unless the plan fuses it into dkv)."""
    import gc

    import jax
    import torch_xla
    import torch_xla.core.xla_model as xm

    q, k, v = make_qkv(2, 4, 2, 256, 256, 64, 64, torch.float32, device=xla_device)
    ids = torch.zeros(2, 256, dtype=torch.int32, device=xla_device)
    torch_xla.sync()
    xm.wait_device_ops()  # sync() executes asynchronously
    executed = xla_metric_count("ExecuteTime")
    out = torch_splash.attention(q, k, v, "causal", segment_ids=ids)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert xla_metric_count("ExecuteTime") == executed
    assert _compat.pending_hlo_text([out]).count('custom_call_target="tpu_custom_call"') == 1
    step = _compat.pending_hlo_text(list(grads))
    assert step.count('custom_call_target="tpu_custom_call"') == tpu_training_kernels(256, 256, 64)
    assert {d.platform for d in jax.devices()} == {"cpu"}
    del out, grads, q, k, v  # never executed: nothing may sync these graphs on a CPU
    gc.collect()


def test_an_evicted_program_is_not_kept_alive_by_the_in_graph_cache(xla_device):
    """torch_xla's computations are cached per program number (torch_splash_jax.policy.IN_GRAPH), not per
    program: once torch_splash_jax's cache drops a program, nothing of torch_splash keeps it."""
    import gc
    import weakref

    import torch_splash_jax

    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 72, 72, 32, 32, torch.float32, device=xla_device))
    torch_splash.attention(q, k, v, "causal", transport="graph")
    programs = [weakref.ref(p) for p in torch_splash_jax.program._programs.values()]
    assert programs
    torch_splash_jax.program.cache_clear()
    gc.collect()
    assert all(ref() is None for ref in programs)
