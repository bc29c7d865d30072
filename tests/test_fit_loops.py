"""torch_splash.fit on the loops people write (issue #53): a loop that logs an index of what its
boundary computed is checked as torch_xla runs it."""

import pytest
import torch

from torch_splash import _compat, fit

pytestmark = pytest.mark.xla


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
