"""Will my training step fit on a TPU? The TPU compiler's own answer, on a machine without a TPU.

    python -m torch_splash.fit --topology v5e:2x2 train.py [script args]

runs an unmodified torch_xla script (PJRT_DEVICE=CPU) up to its first step boundary
(`torch_xla.sync()`, `xm.mark_step()` or `xm.optimizer_step(...)`; not `torch_xla.compile`, whose
own syncs are not intercepted; a boundary that only moves data onto the device is not a step), or
with `--step N` to its N-th (the steps before run for real on the CPU), by default to its second
when the first only creates the state later steps update in place (a loop's steady state), with
torch_splash's kernels planned and lowered for TPU, takes the graph that step built without
executing it, as torch_xla would compile it there (the same graph, parameter order and buffer
donation: tensors updated in place count once), compiles it with the TPU compiler (libtpu,
deviceless) for the named topology, prints a report and exits. `check(step_fn, *args,
topology=...)` does the same for a function that runs one step and returns a `Report`;
`largest_fitting(make_step, lengths, topology=...)` searches the longest sequence that fits;
`kernel_time(q, k, v, mask, generation=...)` estimates one attention call's kernel time.

The compiler runs in a process of its own, so this process keeps its JAX and torch_xla state.
libtpu is the release torch_xla pins (torch_splash_jax.mosaic.PINNED_LIBTPU; for v7x, which it
predates, the TPU time estimator's), found in $TORCH_SPLASH_LIBTPU_DIR, beside torch_splash, or in
~/.cache/torch_splash/libtpu-<release>; it is installed there only when asked (`--install-libtpu`
or $TORCH_SPLASH_INSTALL_LIBTPU=1). One chip unless the step is SPMD (`xr.use_spmd()` and a mesh):
then one partition per device, compiled for that many chips of the topology.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

from torch_splash_jax import SplashConstraintError

from . import _planning
from ._fit_compiler import compile_step, compile_step_hlo, libtpu_dir
from ._fit_graph import pending_step
from ._fit_report import Report, parse_topology
from ._fit_script import checked_step
from ._fit_watch import EarlyExecution, building_one_step, watching_executions
from ._platform import planned_for_tpu

__all__ = [
    "EarlyExecution",
    "Report",
    "check",
    "compile_step_hlo",
    "kernel_time",
    "largest_fitting",
    "libtpu_dir",
    "main",
    "parse_topology",
    "planned_for_tpu",
    "run_script",
]


def kernel_time(q, k, v, mask=None, *, generation: str, backward: bool | None = None, **options):
    """The estimated TPU device time of one `torch_splash.attention(q, k, v, mask, **options)`
    call on one device of `generation` ("v5e", "v5p", "v6e", "v7x"), from the TPU compiler's own
    schedule of the kernels it would run there, compiled here without a TPU. An estimate, not a
    measurement: `torch_splash_jax.tpu_time` says what it leaves out, and docs/benchmarks.md its
    error against tokamax's and the real chip's measured times.

    q, k, v may be meta tensors (only their shapes and dtypes are read). `backward`: whether the
    call is part of a training step (its forward and backward kernels are estimated); None (the
    default) means a training step except for a call the decode kernel serves by default (few
    query rows against a longer cache: `torch_splash_jax.decode`), which `attention` runs without
    gradients, in the decode kernel. `kernel="decode"` or `"splash"` chooses as `attention` does.
    Returns an Estimate: `.seconds` (kernels and, at XLA's own estimate, the ops around them),
    `.kernels` (each kernel's KernelTime), `.mxu_utilization`, `.binding_unit`, `.outgrown` (the
    kernels whose code outgrows one instruction overlay, where the estimate does not hold).
    """
    from torch_splash_jax import tpu_time

    from . import _checks

    tpu_time.chip(generation)
    unknown = set(options) - {"scale", "segment_ids", "soft_cap", "sinks", "block_sizes", "kernel"}
    if unknown:
        raise SplashConstraintError(
            f"kernel_time: {sorted(unknown)} are not options of one device's call "
            "(scale, segment_ids, soft_cap, sinks, block_sizes, kernel)."
        )
    get = options.get
    with planned_for_tpu(generation):  # meta tensors too: planned for TPU, never run
        call = _checks.check_call(q, k, v, mask, get("scale"), get("segment_ids"), get("soft_cap"), get("sinks"))
    if backward is None:  # a training step, unless attention would take the decode kernel without gradients
        backward = _planning.decode_plan(call, get("kernel"), get("block_sizes"), None, backward=False) is None
    plan = _planning.decode_plan(call, get("kernel"), get("block_sizes"), None, backward)
    if plan is None:
        plan = _planning.splash_plan(call, get("block_sizes"), "tpu", None)
    folder = libtpu_dir(tpu_time.ESTIMATOR_LIBTPU, "TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR")
    return tpu_time.estimate_in_subprocess(plan, generation, backward, libtpu_dir=str(folder))


def _partitions() -> int:
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count() if xr.is_spmd() else 1


def check(step_fn, *args, topology: str = "v5e", estimate_time: bool = False, **kwargs) -> Report:
    """Build one step's graph (`step_fn(*args, **kwargs)` on torch_xla CPU-device tensors, ending
    before its boundary), with torch_splash's kernels planned for TPU, and compile it for
    `topology` with the TPU compiler as torch_xla would at the boundary: every live tensor with
    pending work computed, the buffers of tensors updated in place donated. The step is not
    executed. With `estimate_time`, the report also gives the attention kernels' estimated time
    (`kernel_time` of each call) and XLA's own estimate of the rest of the step."""
    import torch_xla  # noqa: F401  (the step's tensors are torch_xla's)

    generation, _ = parse_topology(topology)
    with (
        watching_executions(settle=True) as watch,
        building_one_step(watch, generation),
        _planning.recording_plans() as calls,
    ):
        step_fn(*args, **kwargs)
        step = pending_step()
    report = compile_step(step, topology, _partitions())
    return _with_time(report, calls) if estimate_time else report


def _with_time(report: Report, calls: list) -> Report:
    """The report with the attention kernels' estimated time: one estimate per distinct plan."""
    from torch_splash_jax import tpu_time

    generation, _ = parse_topology(report.topology)
    tpu_time.chip(generation)  # an error listing the generations the estimator knows
    folder = str(libtpu_dir(tpu_time.ESTIMATOR_LIBTPU, "TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR"))
    seconds, outgrown, estimates = 0.0, 0, {}
    for plan, backward in calls:
        if (plan, backward) not in estimates:
            estimates[plan, backward] = tpu_time.estimate_in_subprocess(plan, generation, backward, folder)
        seconds += estimates[plan, backward].kernel_seconds
        outgrown += len(estimates[plan, backward].outgrown)
    rest = None
    if report.xla_estimated_cycles is not None:
        rest = report.xla_estimated_cycles / tpu_time.chip(generation).clock
    return dataclasses.replace(
        report, attention_seconds=seconds, attention_calls=len(calls), rest_seconds=rest, attention_outgrown=outgrown
    )


def largest_fitting(make_step, lengths, *, topology: str = "v5e") -> tuple[int | None, dict[int, Report]]:
    """The longest of `lengths` whose step fits (`make_step(length)` returns (step_fn, args)),
    searched by bisection over the sorted lengths; with every report measured."""
    lengths, reports = sorted(lengths), {}
    low, high, best = 0, len(lengths) - 1, None
    while low <= high:
        mid = (low + high) // 2
        step_fn, args = make_step(lengths[mid])
        reports[lengths[mid]] = report = check(step_fn, *args, topology=topology)
        gc.collect()
        if report.fits:
            best, low = lengths[mid], mid + 1
        else:
            high = mid - 1
    return best, reports


def run_script(
    script: str, script_args: list[str], topology: str, estimate_time: bool = False, step: int | None = None
) -> Report:
    """Run a torch_xla script up to the boundary of its `step`-th step and check that step. By
    default the first step, or the loop's steady state (step 2) when the first only differs from
    it by creating the state the steps after it update in place. Boundaries that only move data
    onto the device are not steps. The report says which step it checked (`Report.step`)."""
    generation, _ = parse_topology(topology)
    taken, label, notes = checked_step(script, script_args, step, generation)
    report = compile_step(taken.step, topology, _partitions())
    report = dataclasses.replace(report, step=label, notes=tuple(notes))
    return _with_time(report, taken.calls) if estimate_time else report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_splash.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e", help="v5e, v5e:2x2, v5e:4x4, v6e:2x2, v5p:2x2x1, v7x, ...")
    parser.add_argument(
        "--time", action="store_true", help="also estimate the attention kernels' time (docs/tpu_time.md)"
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="check the N-th step (the steps before it run on the CPU; boundaries that only move data onto the "
        "device are not steps). By default step 1, or the loop's steady state (step 2) when step 1 only creates "
        "the state the steps after it update in place",
    )
    parser.add_argument(
        "--install-libtpu",
        action="store_true",
        help="install the libtpu release the compiler needs into ~/.cache/torch_splash if it is missing",
    )
    parser.add_argument("script", nargs="?")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if not options.script:
        parser.error("give the training script to check")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if options.install_libtpu:
        os.environ["TORCH_SPLASH_INSTALL_LIBTPU"] = "1"
    try:
        report = run_script(options.script, options.script_args, options.topology, options.time, options.step)
    except SplashConstraintError as error:
        print(f"torch_splash.fit: {error}", file=sys.stderr)
        return 2
    print(f"torch_splash.fit: {report}")
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
