"""torch_splash.fit: the TPU compiler's verdict on a user's own torch_xla training step, without a
TPU. The compiler runs in a process of its own with the libtpu ./dev.sh installs
($TORCH_SPLASH_LIBTPU_DIR); the step is built on torch_xla's CPU device and never executed."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_splash
from torch_splash import _compat, fit

pytestmark = pytest.mark.xla


def _step(attention, length, heads=4, dim=64, dtype=torch.float32):
    """(step_fn, args): one training step of a one-layer attention block at `length` tokens."""
    import torch_xla

    device = torch_xla.device()
    torch.manual_seed(0)
    qkv = torch.nn.Linear(heads * dim, 3 * heads * dim).to(dtype).to(device)
    opt = torch.optim.SGD(qkv.parameters(), lr=0.1)
    x = torch.randn(1, length, heads * dim, dtype=dtype).to(device)

    def step(qkv, x):
        q, k, v = (t.view(1, length, heads, dim).transpose(1, 2) for t in qkv(x).chunk(3, -1))
        attention(q, k, v).float().square().mean().backward()
        opt.step()

    return step, qkv, x


def splash(q, k, v):
    return torch_splash.attention(q, k, v, "causal")


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_small_step_fits_with_its_hbm_figures():
    report = fit.check(*_step(splash, 2048), topology="v5e")
    assert report.fits and report.error is None, report
    assert report.chips == 1 and 0 < report.total < report.capacity
    assert report.total >= report.arguments and "fits" in str(report)


def test_the_step_s_attention_time_is_estimated_beside_its_hbm():
    """check(..., estimate_time=True): the attention kernels' estimated time (the forward and
    backward kernels of the one call in the step, from libtpu 0.0.52's schedule) and XLA's own
    estimate of the rest."""
    report = fit.check(*_step(splash, 1024, dtype=torch.bfloat16), topology="v5e", estimate_time=True)
    assert report.fits and report.attention_calls == 1, report
    q = torch.empty(1, 4, 1024, 64, dtype=torch.bfloat16, device="meta")
    alone = fit.kernel_time(q, q, q, "causal", generation="v5e")
    assert report.attention_seconds == pytest.approx(alone.kernel_seconds)
    assert report.rest_seconds is not None and report.rest_seconds > 0
    assert "attention kernels, 1 call" in str(report) and "XLA's own estimate" in str(report)


def test_a_report_says_how_many_kernels_outgrow_one_instruction_overlay():
    """The estimate of a kernel whose code outgrows one overlay does not hold: the report says so."""
    report = fit.Report("v5e:2x2", 1, True, 16 << 30, total=1 << 30, attention_seconds=0.02, attention_calls=1)
    assert "overlay" not in str(report)
    assert "1 of their kernels' code outgrows one instruction overlay" in str(
        dataclasses.replace(report, attention_outgrown=1)
    )


def test_a_step_too_large_for_the_chip_is_reported_with_the_compiler_s_figure():
    """SDPA materialises (H, L, L) scores: at 32K tokens and 16 heads in bf16 that is 32 GiB per
    score tensor, over one v5e chip's 15.75 GiB; the compiler says how much it needed."""
    report = fit.check(*_step(sdpa, 32768, heads=16, dim=128, dtype=torch.bfloat16), topology="v5e")
    assert not report.fits and report.error is None, report
    assert report.needed > report.capacity and "does NOT fit" in str(report)


def test_reading_a_value_before_the_boundary_is_reported_with_its_line():
    step, qkv, x = _step(splash, 256)

    def early(qkv, x):
        if qkv(x).sum().item() > 0:  # a read: executes the graph so far
            pass
        step(qkv, x)

    with pytest.raises(fit.EarlyExecution, match=r"test_fit.py:\d+: if qkv\(x\).sum\(\).item\(\) > 0"):
        fit.check(early, qkv, x, topology="v5e")


def test_an_unknown_topology_lists_the_known_ones():
    with pytest.raises(torch_splash.SplashConstraintError, match=r"topology='v9z:2x2' .* v5e\[:2x2\]"):
        fit.check(lambda: None, topology="v9z:2x2")


SCRIPT = """
import sys
import torch, torch.nn.functional as F
import torch_xla, torch_xla.core.xla_model as xm
import torch_splash

length = int(sys.argv[1])
device = torch_xla.device()
qkv = torch.nn.Linear(256, 768).to(device)
opt = torch.optim.SGD(qkv.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(2, length, 256).to(device)
    q, k, v = (t.view(2, length, 4, 64).transpose(1, 2) for t in qkv(x).chunk(3, -1))
    torch_splash.attention(q, k, v, "causal").square().mean().backward()
    xm.optimizer_step(opt)
"""


def _command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    command = [sys.executable, "-m", "torch_splash.fit", "--topology", "v5e:2x2", "--time", str(script), "1024"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)


def test_the_command_checks_an_unmodified_script_at_its_first_step_boundary(tmp_path):
    done = _command(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch_splash.fit: v5e:2x2, 1 chip, step 1: fits:" in done.stdout, done.stdout
    assert "attention kernels, 1 call: " in done.stdout and "XLA's own estimate" in done.stdout, done.stdout


def test_the_command_reports_a_script_without_a_step(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("import torch_xla\nx = torch_xla.device()\n")
    done = subprocess.run(
        [sys.executable, "-m", "torch_splash.fit", str(script)],
        capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "ended without a step boundary" in done.stderr, done.stderr[-2000:]


def test_a_libtpu_folder_without_libtpu_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_SPLASH_LIBTPU_DIR", str(tmp_path / "empty"))
    with pytest.raises(torch_splash.SplashConstraintError, match="holds no libtpu"):
        fit.libtpu_dir()


SPMD_SCRIPT = """
import numpy as np
import torch
import torch_xla, torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import torch_splash

xr.use_spmd()
device = torch_xla.device()
mesh = xs.Mesh(np.arange(4), (4,), ("seq",))
qkv = torch.nn.Linear(256, 768).to(device)
opt = torch.optim.SGD(qkv.parameters(), lr=0.1)
x = torch.randn(1, 4096, 256).to(device)
q, k, v = (t.view(1, 4096, 4, 64).transpose(1, 2) for t in qkv(x).chunk(3, -1))
out = torch_splash.attention(
    q, k, v, "causal", partition_spec=(None, None, "seq", None), mesh=mesh, sequence_layout="balanced"
)
out.square().mean().backward()
xm.optimizer_step(opt)
"""


def test_an_spmd_step_with_the_sequence_sharded_compiles_for_a_slice(tmp_path):
    """The query sequence sharded over a 4-device mesh (balanced): one partition per device,
    compiled for the 4 chips of v5e:2x2."""
    script = tmp_path / "spmd.py"
    script.write_text(textwrap.dedent(SPMD_SCRIPT))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    command = [sys.executable, "-m", "torch_splash.fit", "--topology", "v5e:2x2", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch_splash.fit: v5e:2x2, 4 chips, step 1: fits:" in done.stdout, done.stdout


def test_a_refusal_other_than_memory_is_shown_not_swallowed():
    report = fit.compile_step_hlo("HloModule broken\n\nENTRY main { oops }", "v5e")
    assert not report.fits and report.needed is None and report.error, report
    assert "refused the step" in str(report) and report.error.splitlines()[0] in str(report)


# --- Buffer donation: the step as torch_xla compiles it at its boundary -------------------------


def test_an_in_place_step_counts_its_weights_once():
    """A bias-free Linear(256, 256) in bf16 updated in place by SGD, its gradient freed before the
    boundary: torch_xla donates the weight's buffer, so the step's outputs (the new weight, 128
    KiB) live in the argument's buffer. The donated bytes are exactly the weight's, and nothing
    but temporaries comes on top of the arguments (HLO text without donors counted the weight
    twice: total = arguments + outputs + temporaries)."""
    import torch_xla

    device = torch_xla.device()
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16).to(device)
    opt = torch.optim.SGD(linear.parameters(), lr=0.1)
    x = torch.randn(8, 256, dtype=torch.bfloat16).to(device)

    def step():
        linear(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    report = fit.check(step, topology="v5e")
    weight = 256 * 256 * 2
    assert report.fits and report.donated == weight and report.outputs == weight, report
    assert report.total == report.arguments + report.temporaries, report
    assert report.arguments >= weight + x.numel() * 2, report


def test_one_in_place_op_and_a_scalar_compile_and_are_donated():
    """The smallest steps: one in-place op on a device matrix, and one on a device scalar; nothing
    else in the graph, no outputs but the updated state."""
    import torch_xla

    device = torch_xla.device()
    w = torch.zeros(512, 512).to(device)
    s = torch.tensor(3.5).to(device)
    _compat.materialize([w, s])  # on the device, as after a first step (a host scalar is a constant)
    report = fit.check(lambda: s.add_(1.0), topology="v5e")
    scalar = 512  # the TPU's smallest buffer
    assert report.fits and report.donated == report.arguments == report.outputs == scalar, report
    # a step is every pending tensor of the process, so s's update (never run) is part of this one too
    report = fit.check(lambda: w.add_(1.0), topology="v5e")
    assert report.fits and report.donated == w.numel() * 4 + scalar, report
    assert report.total - report.temporaries < w.numel() * 4 + 4096, report  # the tuple of outputs beside


def test_state_over_half_a_chip_fits_only_because_it_is_donated(monkeypatch):
    """9 GiB of bf16 state updated in place, on a v5e chip of 15.75 GiB. Donated (torch_xla's
    default) the new state lives in the old buffer and the step fits; undonated
    (XLA_ENABLE_PARAM_ALIASING=0) its arguments and outputs take 18 GiB, which the compiler still
    compiles (it refuses only temporaries that do not fit) and fit must call over the chip. The
    state is a torch_xla placeholder, a device tensor without a buffer: the host never holds it."""
    import torch_xla.core.xla_builder as xb

    state = 9 << 30

    def checked():
        w = xb.create_placeholder_tensor((state // 2 // 4096, 4096), torch.bfloat16)
        return fit.check(lambda: w.add_(1.0), topology="v5e")

    donated = checked()
    assert donated.fits and donated.donated == state and donated.total < donated.capacity, donated
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "0")
    undonated = checked()
    assert not undonated.fits and undonated.error is None and undonated.donated == 0, undonated
    assert undonated.needed == undonated.total >= 2 * state > undonated.capacity, undonated
    expected = "does NOT fit: needs 18.00 GiB of 15.75 GiB HBM per chip (arguments 9.00, outputs 9.00, of which 0.00"
    assert expected in str(undonated), undonated


AGREEMENT_SCRIPT = """
import json, sys
import torch, torch_xla
from torch_splash import fit

device = torch_xla.device()
torch.manual_seed(0)
if sys.argv[1] == "llama":
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(torch.bfloat16).to(device)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 512, (2, 128)).to(device)
    loss_of = lambda: model(input_ids=ids, labels=ids).loss
else:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(device)
    x = torch.randn(16, 256).to(device)
    loss_of = lambda: model(x).square().mean()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

def step():
    loss_of().backward()
    opt.step()
    opt.zero_grad()

step()
torch_xla.sync()  # the first step, run: the optimizer's state exists from here on
report = fit.check(step, topology="v5e")  # the second step, built and compiled by fit
torch_xla.sync()  # the same step, compiled (and run) by torch_xla itself: XLA dumps its module
print(json.dumps(dict(total=report.total, donated=report.donated, temporaries=report.temporaries)))
"""


def _hlo_module_of(hlo_proto: bytes) -> bytes:
    """The HloModuleProto inside XLA's dump, an HloProto (its field 1, length-delimited)."""

    def varint(at):
        value, shift = 0, 0
        while True:
            byte = hlo_proto[at]
            value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
            if byte < 0x80:
                return value, at

    at = 0
    while at < len(hlo_proto):
        tag, at = varint(at)
        assert tag & 7 == 2, tag  # HloProto's fields are all messages
        size, at = varint(at)
        if tag >> 3 == 1:
            return hlo_proto[at : at + size]
        at += size
    raise AssertionError("no hlo_module in the dump")


def _torch_xla_s_own_module(tmp_path, kind: str) -> tuple[dict, dict]:
    """fit's report of a model's second AdamW step, and the TPU compiler's figures for the module
    torch_xla compiled for that same step, with the buffer donors torch_xla declared (read from
    XLA's own dump of it)."""
    import json
    import re

    from torch_splash_jax.tpu_time import aot

    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent(AGREEMENT_SCRIPT))
    dump = tmp_path / "dump"
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_proto --xla_dump_hlo_as_text",
    }
    done = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = json.loads(done.stdout.strip().splitlines()[-1])
    last = sorted(dump.glob("module_*.SyncTensorsGraph.*.before_optimizations.txt"))[-1]
    header = last.read_text().splitlines()[0]
    donors = re.findall(r"\((\d+), \{\}\)", re.search(r"buffer_donor=\{([^}]*\})*[^}]*\}", header)[0])
    assert donors, header
    proto = tmp_path / "step.pb"
    proto.write_bytes(_hlo_module_of(last.with_name(last.name.replace(".txt", ".hlo.pb")).read_bytes()))
    from torch_splash._fit_compiler import compiler_libtpu_dir

    command = [sys.executable, "-m", "torch_splash_jax.tpu_time.aot", str(proto), "--topology", "v5e:2x2"]
    env = aot.environment(str(compiler_libtpu_dir("v5e")))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.getcwd()])
    done = subprocess.run(command + ["--donate", ",".join(donors)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return ours, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["mlp", pytest.param("llama", marks=pytest.mark.slow)])
def test_fit_s_hbm_is_that_of_torch_xla_s_own_donated_module(tmp_path, kind):
    """The second step of an MLP and of a tiny HF Llama (sdpa) with AdamW: weights and both moments
    updated in place. fit's figures equal those of the module torch_xla itself compiled for the
    step (dumped by XLA), compiled for v5e with the buffer donors torch_xla declared."""
    ours, theirs = _torch_xla_s_own_module(tmp_path, kind)
    assert theirs["fits"] and theirs["donated"] > 0, theirs
    assert ours["donated"] == theirs["donated"], (ours, theirs)
    assert ours["total"] == pytest.approx(theirs["total"], rel=0.01), (ours, theirs)


BIG_LLAMA_SCRIPT = """
import json, os
import torch, torch_xla
import torch_xla.core.xla_builder as xb
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from torch_splash import fit

device = torch_xla.device()
config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=7,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048)
with torch.device("meta"):  # shapes only: the host never holds the weights
    model = LlamaForCausalLM(config).to(torch.bfloat16)

def placeholder(t):  # a device tensor without a buffer: an argument of the step, never read
    return xb.create_placeholder_tensor(tuple(t.shape), t.dtype)

for module in model.modules():
    for name, p in [(n, p) for n, p in module._parameters.items() if p is not None]:
        module._parameters[name] = torch.nn.Parameter(placeholder(p))
model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # computed buffers: real, and small
model.set_attn_implementation("sdpa")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for p in model.parameters():  # a later step's state: both moments on the device (bf16, as AdamW keeps them)
    opt.state[p] = dict(step=torch.tensor(1.0), exp_avg=placeholder(p), exp_avg_sq=placeholder(p))
ids = torch.randint(0, 32000, (1, 1024)).to(device)

def step():
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()

report = fit.check(step, topology="v5e")
print(json.dumps(dict(fits=report.fits, total=report.total, donated=report.donated,
                      parameters=sum(p.numel() for p in model.parameters()))), flush=True)
torch_xla.sync()  # torch_xla compiles the same step with its own donors (XLA dumps it first); the test stops it there
"""


def _tail(path) -> str:
    return path.read_text()[-3000:]


def _dumped_then_stopped(script, env, dump, tmp_path) -> str:
    """Run `script` until XLA has dumped the module of its step boundary, then stop it: torch_xla
    would go on to compile it for the CPU (minutes, gigabytes) and run it on placeholders. A step
    with torch_splash's kernels planned for TPU ends there by itself: the CPU compiler cannot
    compile their Mosaic custom calls, and the process dies after the dump. Its stdout."""
    import time

    out = tmp_path / "stdout"
    with open(out, "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        child = subprocess.Popen([sys.executable, str(script)], stdout=stdout, stderr=stderr, env=env)
        sizes, deadline = None, time.monotonic() + 1800
        try:
            while time.monotonic() < deadline:
                ended = child.poll() is not None
                files = sorted(dump.glob("module_*.SyncTensorsGraph.*.before_optimizations.*"))
                now = [f.stat().st_size for f in files]
                if len(files) == 2 and (now == sizes or ended):  # the proto and the text, both written in full
                    break
                if ended:
                    pytest.fail(f"the script ended before XLA dumped its step: {_tail(tmp_path / 'stderr')}")
                sizes = now
                time.sleep(2)
            else:
                pytest.fail(f"the script hung before XLA dumped its step: {_tail(tmp_path / 'stderr')}")
        finally:
            child.kill()
            child.wait()
    return out.read_text()


@pytest.mark.slow
def test_a_1_5b_llama_adamw_step_fits_a_v5e_chip_only_donated(tmp_path):
    """An HF Llama of 1.5B parameters in bf16 (7 layers of Llama 2 7B's width: few layers keep the
    compile short), a training step with AdamW at 1K tokens, on one v5e chip (15.75 GiB): weights
    and both moments are 8.4 GiB, updated in place. Donated, as torch_xla
    runs it, the step fits; counted twice it would not. fit's verdict and HBM agree with the module
    torch_xla itself compiles for the step (dumped by XLA), compiled for v5e with torch_xla's
    donors, within 1%. The weights and moments are placeholders (device tensors without buffers)
    and the model is built on the meta device: nothing of that size is ever on the host."""
    import json
    import re

    from torch_splash._fit_compiler import compiler_libtpu_dir
    from torch_splash_jax.tpu_time import aot

    script, dump = tmp_path / "big.py", tmp_path / "dump"
    script.write_text(textwrap.dedent(BIG_LLAMA_SCRIPT))
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_proto --xla_dump_hlo_as_text",
    }
    ours = json.loads(_dumped_then_stopped(script, env, dump, tmp_path).strip().splitlines()[-1])
    assert 1.45e9 < ours["parameters"] < 1.55e9, ours
    text = next(dump.glob("module_*.SyncTensorsGraph.*.before_optimizations.txt"))
    header = text.read_text().splitlines()[0]
    donors = re.findall(r"\((\d+), \{\}\)", re.search(r"buffer_donor=\{([^}]*\})*[^}]*\}", header)[0])
    proto = tmp_path / "step.pb"
    proto.write_bytes(_hlo_module_of(text.with_name(text.name.replace(".txt", ".hlo.pb")).read_bytes()))
    command = [sys.executable, "-m", "torch_splash_jax.tpu_time.aot", str(proto), "--topology", "v5e:2x2"]
    aot_env = aot.environment(str(compiler_libtpu_dir("v5e")))
    aot_env["PYTHONPATH"] = os.pathsep.join([aot_env["PYTHONPATH"], os.getcwd()])
    done = subprocess.run(command + ["--donate", ",".join(donors)], capture_output=True, text=True, env=aot_env)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    capacity = 15.75 * (1 << 30)
    assert ours["fits"] and theirs["fits"] and theirs["total"] < capacity, (ours, theirs)
    assert ours["donated"] == theirs["donated"] > 8 << 30, (ours, theirs)
    assert ours["total"] == pytest.approx(theirs["total"], rel=0.01), (ours, theirs)
    # undonated, the state is an argument and an output of its own: over the chip
    assert theirs["arguments"] + theirs["outputs"] + theirs["temporaries"] > capacity, theirs


def test_fit_never_installs_libtpu_unless_asked(monkeypatch, tmp_path):
    """Missing, libtpu is refused with the command that installs it, and nothing is run."""
    from torch_splash import _fit_compiler

    monkeypatch.delenv("TORCH_SPLASH_LIBTPU_DIR", raising=False)
    monkeypatch.delenv("TORCH_SPLASH_INSTALL_LIBTPU", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(_fit_compiler.compat, "installed", lambda name: None)
    monkeypatch.setattr(_fit_compiler.subprocess, "run", lambda *a, **k: pytest.fail("ran a command"))
    folder = tmp_path / ".cache" / "torch_splash" / "libtpu-0.0.21"
    expected = f"pip install -q --no-deps --target {folder} libtpu==0.0.21"
    with pytest.raises(torch_splash.SplashConstraintError, match="--install-libtpu") as refused:
        fit.libtpu_dir("0.0.21")
    assert expected in str(refused.value)


def test_v7x_compiles_with_the_estimator_s_libtpu():
    """libtpu 0.0.21 (torch_xla's) knows no v7x; the estimator's release compiles the step."""
    import torch_xla

    w = torch.zeros(256, 256).to(torch_xla.device())
    report = fit.check(lambda: w.add_(1.0), topology="v7x")
    assert report.fits and report.donated == w.numel() * 4 and report.topology == "v7x", report


DECODE_SCRIPT = """
import torch, torch_xla
import torch_splash

device = torch_xla.device()
B, H, L, D = 2, 2, 1024, 64
k_cache = torch.zeros(B, H, L, D, dtype=torch.bfloat16).to(device)
v_cache = torch.zeros(B, H, L, D, dtype=torch.bfloat16).to(device)
proj = torch.nn.Linear(D, 3 * D).to(torch.bfloat16).to(device)
token = torch.randn(B, H, 1, D, dtype=torch.bfloat16).to(device)
with torch.no_grad():
    for position in range(4):  # a generate-style loop: one token a step, the cache updated in place
        q, k, v = proj(token).chunk(3, -1)
        index = torch.tensor([position], device=device)
        k_cache.index_copy_(2, index, k)
        v_cache.index_copy_(2, index, v)
        token = torch_splash.attention(q, k_cache, v_cache)
        torch_xla.sync()
"""


def test_a_decode_loop_s_second_step_counts_its_cache_once_and_is_timed(tmp_path):
    """`--step 2`: the first step runs on the CPU, the second (the loop's steady state: the cache
    an argument of the step, updated in place) is checked. Both caches (512 KiB each) are
    donated and counted once, and the step's one attention call (no backward) is estimated."""
    script = tmp_path / "decode.py"
    script.write_text(textwrap.dedent(DECODE_SCRIPT))
    report = fit.run_script(str(script), [], "v5e", estimate_time=True, step=2)
    cache = 2 * 2 * 1024 * 64 * 2
    assert report.fits and report.attention_calls == 1 and report.attention_seconds > 0, report
    assert report.donated == 2 * cache, report  # the caches; the token is a new tensor each step
    assert report.total == report.arguments + report.outputs - 2 * cache + report.temporaries, report
    assert report.outputs < 2 * cache + 16384, report  # the caches, and the token, q, k, v the script holds
