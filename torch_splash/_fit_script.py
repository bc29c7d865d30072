"""Running an unmodified torch_xla script up to the step boundary torch_splash.fit checks, and
taking that step's graph there without executing it.

The boundaries are torch_xla's own: `torch_xla.sync()`, `xm.mark_step()` and
`xm.optimizer_step(...)`, replaced for the run. A boundary that only moves data onto the device
(`_fit_graph.computes`) runs and is not a step. Steps before the one checked run for real on
torch_xla's CPU device (with torch_splash's kernels in interpret mode): a generation loop's
second step is its steady state, with the cache its first step filled in as an argument.

By default (`checked_step(..., step=None)`) the first step is checked, unless it creates state
that the steps after it update in place (a KV cache, an optimizer's moments: `Step.fresh`): then
the script runs again, its first step for real, and its second step is checked if it is the first
again with that state as its arguments (`_fit_graph.steady_state_of`). The first step's TPU graph
cannot run here (its Mosaic kernels need a TPU), hence the second run."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import runpy
import sys

from torch_splash_jax import SplashConstraintError

from . import _planning
from ._fit_graph import Step, computes, live_pending_tensors, pending_step, steady_state_of
from ._fit_watch import building_one_step, watching_executions


class StepBoundary(BaseException):
    """Raised at the checked step's boundary (a BaseException: the script's own `except
    Exception` does not swallow it)."""


class NoSuchStep(SplashConstraintError):
    """The script ended before the step asked for."""


@dataclasses.dataclass(frozen=True)
class Taken:
    """The step checked: its graph, the attention calls it makes (plan, with a backward), the
    script's boundary it ends at, and the boundaries before it that only moved data."""

    step: Step
    calls: list
    boundary: int
    moves: tuple[int, ...]


@dataclasses.dataclass
class _Counts:
    boundaries: int = 0
    steps: int = 0
    moves: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _stopping_at_boundary(step: int, calls: list, on_boundary, taken: list):
    """Boundaries before the `step`-th step run as torch_xla runs them, then call
    `on_boundary(steps so far)`; at the `step`-th the pending step goes into `taken` (while the
    script's frames, and so its tensors, are alive), and the script stops. A boundary whose graph
    calls torch_splash's kernels planned for TPU is a step whatever else it does: it cannot run."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    saved = [(torch_xla, "sync"), (xm, "mark_step"), (xm, "optimizer_step")]
    originals = {name: getattr(owner, name) for owner, name in saved}
    counts = _Counts()

    def boundary(original, *args, **kwargs):
        counts.boundaries += 1
        tensors = live_pending_tensors()
        if calls or computes(tensors):
            counts.steps += 1
            if counts.steps == step:
                taken.append(Taken(pending_step(tensors), list(calls), counts.boundaries, tuple(counts.moves)))
                raise StepBoundary
        else:
            counts.moves.append(counts.boundaries)
        del tensors
        original(*args, **kwargs)
        calls.clear()
        on_boundary(counts.steps)

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


def run_to_step(script: str, script_args: list[str], step: int = 1, generation: str | None = None) -> Taken:
    """Run `script` to the boundary of its `step`-th step; that step (unexecuted, its kernels
    planned for TPU, for `generation` where given) and the attention calls it makes."""
    import torch_xla  # noqa: F401

    if step < 1:
        raise SplashConstraintError(f"step={step}: steps are counted from 1 (the first boundary with work).")
    sys.argv, taken = [script, *script_args], []
    with contextlib.ExitStack() as stack, watching_executions() as watch:
        calls = stack.enter_context(_planning.recording_plans())
        building = []

        def on_boundary(steps: int):
            if building:  # a boundary that only moved data, inside the step being built: not its work
                watch.restart()
            elif steps == step - 1:  # (never before the script starts: that would start torch_xla's
                watch.restart()  # runtime before the script chooses SPMD)
                building.append(stack.enter_context(building_one_step(watch, generation)))

        if step == 1:
            building.append(stack.enter_context(building_one_step(watch, generation)))
        with _stopping_at_boundary(step, calls, on_boundary, taken):
            try:
                runpy.run_path(script, run_name="__main__")
            except StepBoundary:
                pass
    if not taken:
        which = "without a step boundary" if step == 1 else f"before the boundary of its step {step}"
        raise NoSuchStep(
            f"{script} ended {which} (torch_xla.sync(), xm.mark_step(), xm.optimizer_step(...) with work to "
            "compute: a boundary that only moves data onto the device is not a step): there is no step to check."
        )
    return taken[0]


def checked_step(
    script: str, script_args: list[str], step: int | None = None, generation: str | None = None
) -> tuple[Taken, str, list[str]]:
    """The step fit checks in `script`: the `step`-th, or by default the first or the loop's steady
    state (module docstring). With its label for the report and notes on how it was chosen."""
    if step is not None:
        taken = run_to_step(script, script_args, step, generation)
        return taken, f"step {step}", _moves(taken, step)
    first = run_to_step(script, script_args, 1, generation)
    if not first.step.fresh:
        return first, "step 1", _moves(first, 1)
    made = f"step 1 creates state that the steps after it update in place ({_size(first.step.fresh_bytes)})"
    gc.collect()  # the first run's tensors, before the script runs again
    if live_pending_tensors():  # held past the run (by a cache of the script's libraries?): the second
        # run's first boundary would execute them, TPU kernels included
        return first, "step 1", [*_moves(first, 1), f"{made}, but its tensors outlive the run: --step 2 checks step 2"]
    try:
        second = run_to_step(script, script_args, 2, generation)
    except NoSuchStep:
        return first, "step 1", [*_moves(first, 1), f"{made}, but the script has no step 2"]
    if not steady_state_of(first.step, second.step):
        note = f"{made}, but step 2 is another step (other shapes: a prefill, then decode steps?): --step 2 checks it"
        return first, "step 1", [*_moves(first, 1), note]
    note = (
        f"{made}: step 1 ran on the CPU, and step 2 is checked, the same step with that state as donated "
        "arguments, counted once (--step 1 checks step 1)"
    )
    return second, "steady state (step 2)", [*_moves(second, 2), note]


def _size(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 27 else f"{size / (1 << 20):.1f} MiB"


def _moves(taken: Taken, step: int) -> list[str]:
    if not taken.moves:
        return []
    *others, last = taken.moves
    which = f"boundaries {', '.join(map(str, others))} and {last}" if others else f"boundary {last}"
    return [
        f"step {step} is the script's boundary {taken.boundary}: {which} before it only moved data onto the "
        "device, which is not a step"
    ]
