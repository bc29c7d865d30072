"""The TorchTPU transport (device "tpu"): every program runs through TorchTPU's public
`torch.tpu.pallas.jax_op`, as the one custom op torch_splash::tpu_program.

No TPU, and so no TorchTPU device, is reachable here. What stands in for a TPU run:
- test_tpu_compile.py compiles every program the transport would hand TorchTPU, exported as
  jax_op exports it, with the libtpu TorchTPU requires (v5e, v6e, v7x);
- the tests below run the torch side end to end (torch_splash's custom ops, autograd, fake tensors,
  torch.compile, the SDPA drop-in, HF) through jax_op itself, with TorchTPU's kernel runtime
  (`tpu_torch_pallas`: register, look up, call) and its output buffers on device "tpu" replaced by a
  CPU stand-in that compiles and runs the very module jax_op exported. The kernels in it are the
  interpret-mode ones (CPU tensors plan for the CPU); on a TPU they are the Mosaic ones compiled
  above. Nothing here proves TorchTPU's own runtime, which only a TPU can run.
"""

import collections
import importlib
import types

import jax
import pytest
import torch
from helpers import make_qkv, reference

import torch_splash
from torch_splash import _transport
from torch_splash.masks import CausalMask, LocalMask
from torch_splash_jax import compat

pytestmark = pytest.mark.torchtpu


class CpuStandInForTorchTpuRuntime:
    """TorchTPU's kernel runtime, on the CPU: keeps each module jax_op registers (the portable
    artifact of jax.export) and runs it, compiled for JAX's CPU device, when jax_op calls it."""

    def __init__(self):
        self.modules, self.executed, self.calls = {}, {}, collections.Counter()

    def register_custom_kernel(self, name, fingerprint, serialized_mlir_module):
        self.modules[(name, fingerprint)] = serialized_mlir_module

    def lookup_custom_kernel(self, name, fingerprint):
        return (name, fingerprint) in self.modules

    def call_custom_kernel(self, name, fingerprint, inputs, output_shapes, donate_argnums, device_assignment):
        self.calls[name] += 1
        arrays = [jax.dlpack.from_dlpack(t.detach().contiguous()) for t in inputs]
        outs = compat.run_portable_artifact_on_cpu(self.modules[(name, fingerprint)], arrays)
        assert [tuple(o.shape) for o in outs] == [tuple(s.shape) for s in output_shapes]
        return [torch.from_dlpack(o) for o in outs]


@pytest.fixture
def torchtpu(monkeypatch):
    pallas = importlib.import_module(compat.TORCHTPU_PALLAS_MODULE)
    runtime = CpuStandInForTorchTpuRuntime()
    monkeypatch.setattr(pallas, "tpu_torch_pallas", runtime)
    placeholder = pallas.torch_placeholder

    def on_cpu(array, mesh=None, partition_spec=None, device="tpu"):
        return placeholder(array, mesh=mesh, partition_spec=partition_spec, device="cpu" if device == "tpu" else device)

    monkeypatch.setattr(pallas, "torch_placeholder", on_cpu)
    monkeypatch.setattr(_transport, "choose", lambda tensors, requested: "torchtpu")  # as for device "tpu"
    return runtime


CASES = {
    "gqa-causal-ids": dict(heads=(8, 2), mask="causal", ids=True),
    "mqa-window-softcap": dict(heads=(4, 1), mask=CausalMask() & LocalMask(40), soft_cap=20.0),
    "per-head-sinks": dict(heads=(4, 2), mask=[CausalMask(), LocalMask(16), CausalMask(5), CausalMask()], sinks=True),
}


@pytest.mark.parametrize("name", CASES)
def test_attention_and_gradients_through_jax_op_with_a_cpu_stand_in_for_torchtpu_s_runtime(torchtpu, name):
    case = CASES[name]
    q, k, v = make_qkv(2, *case["heads"], 200, 200, 64, 64, torch.float32)
    ids = torch.randint(0, 3, (2, 200)).sort(-1).values.int() if case.get("ids") else None
    sinks = torch.randn(case["heads"][0], requires_grad=True) if case.get("sinks") else None
    options = dict(segment_ids=ids, soft_cap=case.get("soft_cap"), sinks=sinks)
    out = torch_splash.attention(q, k, v, case["mask"], **options)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v] + ([sinks] if sinks is not None else []), d_out)
    assert sum(torchtpu.calls.values()) == 2  # the forward, then the backward: each one TorchTPU call
    want = reference(q, k, v, case["mask"], **options)
    want_grads = torch.autograd.grad(want, [q, k, v] + ([sinks] if sinks is not None else []), d_out)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_sdpa_drop_in_and_torch_compile_through_jax_op(torchtpu):
    q, k, v = make_qkv(1, 4, 2, 130, 130, 32, 32, torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = torch_splash.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: torch_splash.attention(q, k, v, "causal"), fullgraph=True, backend="aot_eager"
    )
    out = compiled(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    assert q.grad is not None and sum(torchtpu.calls.values()) >= 3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fullgraph"])
def test_a_model_written_for_flex_attention_trains_through_jax_op(torchtpu, compiled):
    """torch_splash.flex_attention (by route_flex) with a document-causal BlockMask, on TorchTPU's
    path, eager and under torch.compile(fullgraph=True): losses and weights after three SGD steps as
    with FlexAttention's definition in torch ops."""
    from test_flex import assert_trains_like_torch, train_packed_documents, train_with_the_reference

    want = train_with_the_reference()
    torch._dynamo.reset()
    with torch_splash.route_flex():
        got = train_packed_documents("cpu", compiled=compiled)
    assert sum(torchtpu.calls.values()) == 2 * 3 * 2  # per step: each batch element's forward and backward
    assert_trains_like_torch(got, want)


def test_the_op_torchtpu_registers_passes_opcheck(torchtpu, monkeypatch):
    """torch_splash::tpu_program as TorchTPU's jax_op registers it: schema, fake tensors, dispatch."""
    numbers, number_of = [], _transport.program_number
    monkeypatch.setattr(_transport, "program_number", lambda fn: numbers.append(number_of(fn)) or numbers[-1])
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32))
    torch_splash.attention(q, k, v, "causal")
    op = _transport._torchtpu_op()
    torch.library.opcheck(op, ([q, k, v], numbers[-1]), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("family,layout", [("llama4", "left"), ("gpt_oss", "right")])
def test_hf_model_through_jax_op_with_a_cpu_stand_in_for_torchtpu_s_runtime(torchtpu, family, layout):
    """attn_implementation="splash" on TorchTPU's path: Llama 4's chunked layers with left padding
    (segment ids), gpt-oss's sinks and sliding windows; logits, loss and every gradient as the
    baseline's (the same tolerances as tests/test_hf.py)."""
    from test_hf import ATOL, BASELINE, batch, logits_and_grads, make_model

    model = make_model(family)
    ids, mask, positions, valid = batch(layout)
    ref = logits_and_grads(model, BASELINE[family], ids, mask, positions, valid)
    got = logits_and_grads(model, "splash", ids, mask, positions, valid)
    assert sum(torchtpu.calls.values()) == 4  # two layers, each one forward and one backward call
    torch.testing.assert_close(got[0][valid], ref[0][valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=0)
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], atol=ATOL, rtol=0, msg=name)


def test_with_torchtpu_installed_jax_stays_on_the_cpu():
    """TorchTPU installs libtpu where JAX finds it; torch_splash keeps JAX off the TPU TorchTPU owns
    (here: off a TPU that is not there, which JAX would otherwise try to open)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    script = "import torch_splash, jax; print(jax.config.jax_platforms, jax.devices()[0].platform)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cpu", "cpu"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fullgraph"])
def test_flex_attention_s_logsumexp_gradient_through_jax_op(torchtpu, compiled):
    """A masking score_mod with a soft cap, a document BlockMask, and a loss of the output and the
    logsumexp: through TorchTPU's path (eager and fullgraph), against the float64 reference."""
    from test_flex_score_mods import CASES as FLEX_CASES
    from test_flex_score_mods import _assert_close, _block_mask, _compiled, _exact, _inputs, _run

    case = FLEX_CASES["mask-of-scaled-soft-cap"]
    q, k, v = _inputs()
    block_mask = _block_mask(case)
    attend = _compiled() if compiled else torch_splash.flex_attention
    got = _run(attend, q, k, v, case[0], block_mask)
    _assert_close(got, _exact(q, k, v, case[0], block_mask))
    assert sum(torchtpu.calls.values()) >= 2 * 2  # each batch element's forward and backward


@pytest.mark.parametrize("name,generation", [("TPU v5e", "v5e"), ("TPU v6e", "v6e"), ("TPU v7", "v7x"), ("TPU", None)])
def test_torchtpu_s_chip_name_is_the_generation_its_kernels_are_planned_for(monkeypatch, name, generation):
    """On TorchTPU's device a call is planned for the chip TorchTPU names (its public
    `torch.tpu.get_device_name`, read from the PCI ids: stood in for here, where there is no TPU,
    and so no "tpu" device type either); one it does not name ("TPU") gets the kernels that serve
    every generation."""
    from torch_splash import _platform

    assert torch.tpu.get_device_name() == "TPU"  # this machine: no TPU on its PCI bus
    monkeypatch.setattr(torch.tpu, "get_device_name", lambda device=None: name)
    _platform._torchtpu_generation.cache_clear()  # read once a process: here, once a name
    try:
        assert _platform.generation_of(types.SimpleNamespace(type="tpu")) == generation
    finally:
        _platform._torchtpu_generation.cache_clear()
