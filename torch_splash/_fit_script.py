"""Running an unmodified torch_xla script up to the step boundary torch_splash.fit checks, and
taking that step's graph there without executing it.

The boundaries are torch_xla's own: `torch_xla.sync()`, `xm.mark_step()` and
`xm.optimizer_step(...)`, replaced for the run. Steps before the one checked run for real on
torch_xla's CPU device (with torch_splash's kernels in interpret mode): a generation loop's
second step is its steady state, with the cache its first step filled in as an argument."""

from __future__ import annotations

import contextlib
import runpy
import sys

from torch_splash_jax import SplashConstraintError

from . import _planning
from ._fit_graph import Step, pending_step
from ._fit_watch import building_one_step, watching_executions


class StepBoundary(BaseException):
    """Raised at the checked step's boundary (a BaseException: the script's own `except
    Exception` does not swallow it)."""


@contextlib.contextmanager
def _stopping_at_boundary(step: int, on_earlier_boundary, taken: list):
    """Boundaries before the `step`-th run as torch_xla runs them, then call
    `on_earlier_boundary(count)`; at the `step`-th the pending step goes into `taken` (while the
    script's frames, and so its tensors, are alive), and the script stops."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    saved = [(torch_xla, "sync"), (xm, "mark_step"), (xm, "optimizer_step")]
    originals = {name: getattr(owner, name) for owner, name in saved}
    count = [0]

    def boundary(original, *args, **kwargs):
        count[0] += 1
        if count[0] < step:
            original(*args, **kwargs)
            on_earlier_boundary(count[0])
            return
        taken.append(pending_step())
        raise StepBoundary

    def sync(*args, **kwargs):
        boundary(originals["sync"], *args, **kwargs)

    def mark_step(*args, **kwargs):
        boundary(originals["mark_step"], *args, **kwargs)

    def optimizer_step(optimizer, *args, **kwargs):
        optimizer.step(**(kwargs.get("optimizer_args") or {}))
        boundary(originals["mark_step"])

    torch_xla.sync, xm.mark_step, xm.optimizer_step = sync, mark_step, optimizer_step
    try:
        yield
    finally:
        for owner, name in saved:
            setattr(owner, name, originals[name])


def run_to_step(script: str, script_args: list[str], step: int = 1) -> tuple[Step, list]:
    """Run `script` to its `step`-th boundary; that step (unexecuted, its kernels planned for TPU)
    and the attention calls it makes (plan, with a backward)."""
    import torch_xla  # noqa: F401

    if step < 1:
        raise SplashConstraintError(f"step={step}: steps are counted from 1 (the first boundary).")
    sys.argv, taken = [script, *script_args], []
    with contextlib.ExitStack() as stack, watching_executions() as watch:
        calls = stack.enter_context(_planning.recording_plans())

        def start_building(after_a_step: bool):
            if after_a_step:  # (never before the script starts: that would start torch_xla's runtime
                watch.restart()  # before the script chooses SPMD)
                calls.clear()
            stack.enter_context(building_one_step(watch))

        if step == 1:
            start_building(False)
        with _stopping_at_boundary(step, lambda n: n == step - 1 and start_building(True), taken):
            try:
                runpy.run_path(script, run_name="__main__")
            except StepBoundary:
                pass
    if not taken:
        which = "without a step boundary" if step == 1 else f"before its step boundary number {step}"
        raise SplashConstraintError(
            f"{script} ended {which} (torch_xla.sync(), xm.mark_step(), xm.optimizer_step(...)): "
            "there is no step to check."
        )
    return taken[0], list(calls)
