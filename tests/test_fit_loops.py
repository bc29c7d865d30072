"""torch_splash.fit on the loops people write (issue #53): a first boundary that only moves data
onto the device is not a step, and a loop that logs an index of what its boundary computed is
checked as torch_xla runs it. The scripts run unmodified; fit compiles the step with libtpu
(deviceless), as in test_fit.py."""

import textwrap

import pytest
import torch

import torch_splash
from torch_splash import _compat, fit

pytestmark = pytest.mark.xla

UPLOAD_FIRST = """
import torch, torch_xla

device = torch_xla.device()
torch.manual_seed(0)
linear = torch.nn.Linear(256, 256, bias=False).to(device).to(torch.bfloat16)  # cast on the device
opt = torch.optim.SGD(linear.parameters(), lr=0.1)
x = torch.randn(8, 256, dtype=torch.bfloat16).to(device)
scale = torch.ones(256, device=device)  # made on the device
torch_xla.sync()  # the state on the device before the loop
for step in range(3):
    (linear(x).float() * scale).square().mean().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
"""


def _script(tmp_path, text: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_first_boundary_that_only_moves_data_is_not_a_step(tmp_path):
    """The script's boundary 1 uploads the weight, casts it to bf16 on the device and makes a
    tensor of ones there: no step. Step 1 is the script's boundary 2, checked with the weight
    updated in place and donated (counted once: nothing but temporaries on top of the arguments),
    and `step=2` counts steps the same way (the script's boundary 3)."""
    script = _script(tmp_path, UPLOAD_FIRST)
    report = fit.run_script(script, [], "v5e")
    weight = 256 * 256 * 2
    assert report.fits and report.step == "step 1", report
    assert report.donated == weight and report.total == report.arguments + report.temporaries, report
    assert "step 1 is the script's boundary 2: boundary 1 before it only moved data onto the device" in str(report)
    second = fit.run_script(script, [], "v5e", step=2)
    assert second.step == "step 2" and "step 2 is the script's boundary 3: boundary 1" in str(second), second
    assert second.donated == weight, second


def test_a_script_that_only_moves_data_has_no_step(tmp_path):
    script = _script(tmp_path, "import torch, torch_xla\nx = torch.ones(4).to(torch_xla.device())\ntorch_xla.sync()\n")
    with pytest.raises(torch_splash.SplashConstraintError, match="ended without a step boundary .* only moves data"):
        fit.run_script(script, [], "v5e")


def test_reading_what_a_boundary_computed_is_not_the_step_reading_its_own_work_is():
    """After a boundary, an index or a slice of what it computed (`w[0, :2].cpu()`, `.item()` of
    one element, `print` of a row) executes only that index, as torch_xla runs it: the step that
    follows is checked. An index of the step's own pending work executes part of the step before
    its boundary, and is refused with its line, as a read of a whole pending tensor is."""
    import torch_xla

    w = torch.randn(64, 128).to(torch_xla.device())  # TPU tiles of (8, 128): no padding
    _compat.materialize([w])  # as after a boundary

    def logged():
        print(w[0, :2].cpu(), w[1, 1].item(), w[2])  # a loop's log
        w.mul_(0.5)

    report = fit.check(logged, topology="v5e")
    assert report.fits and report.donated == w.numel() * 4, report

    def reads_its_own_work():
        w.mul_(0.5)
        w[0, 0].item()  # the step's own update, read before its boundary

    with pytest.raises(fit.EarlyExecution, match=r"test_fit_loops.py:\d+: w\[0, 0\]\.item\(\)"):
        fit.check(reads_its_own_work, topology="v5e")
