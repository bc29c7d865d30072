"""torch_splash.fit: the TPU compiler's verdict on a user's own torch_xla training step, without a
TPU. The compiler runs in a process of its own with the libtpu ./dev.sh installs
($TORCH_SPLASH_LIBTPU_DIR); the step is built on torch_xla's CPU device and never executed."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_splash
from torch_splash import fit

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
    report = fit.check(*_step(splash, 2048, dtype=torch.bfloat16), topology="v5e", estimate_time=True)
    assert report.fits and report.attention_calls == 1, report
    q = torch.empty(1, 4, 2048, 64, dtype=torch.bfloat16, device="meta")
    alone = fit.kernel_time(q, q, q, "causal", generation="v5e")
    assert report.attention_seconds == pytest.approx(alone.kernel_seconds)
    assert report.rest_seconds is not None and report.rest_seconds > 0
    assert "attention kernels, 1 call" in str(report) and "XLA's own estimate" in str(report)


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
    assert "torch_splash.fit: v5e:2x2, 1 chip: fits:" in done.stdout, done.stdout
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
    assert "torch_splash.fit: v5e:2x2, 4 chips: fits:" in done.stdout, done.stdout


def test_a_refusal_other_than_memory_is_shown_not_swallowed():
    report = fit.compile_step_hlo("HloModule broken\n\nENTRY main { oops }", "v5e")
    assert not report.fits and report.needed is None and report.error, report
    assert "refused the step" in str(report) and report.error.splitlines()[0] in str(report)
