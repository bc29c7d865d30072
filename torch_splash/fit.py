"""Will my training step fit on a TPU? The TPU compiler's own answer, on a machine without a TPU.

    python -m torch_splash.fit --topology v5e:2x2 train.py [script args]

runs an unmodified torch_xla script (PJRT_DEVICE=CPU) up to its first step boundary
(`torch_xla.sync()`, `xm.mark_step()` or `xm.optimizer_step(...)`; not `torch_xla.compile`, whose
own syncs are not intercepted), with torch_splash's kernels planned and lowered for TPU, takes the
graph that step built without executing it, compiles it with the TPU compiler (libtpu,
deviceless) for the named topology, prints a report and exits. `check(step_fn, *args,
topology=...)` does the same for a function that runs one step and returns a `Report`;
`largest_fitting(make_step, lengths, topology=...)` searches the longest sequence that fits.

The compiler runs in a process of its own, so this process keeps its JAX and torch_xla state.
libtpu is the release torch_xla pins (torch_splash_jax.mosaic.PINNED_LIBTPU), found in
$TORCH_SPLASH_LIBTPU_DIR or installed once into ~/.cache/torch_splash/libtpu-<release>. One chip
unless the step is SPMD (`xr.use_spmd()` and a mesh): then one partition per device, compiled for
that many chips of the topology.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import tempfile
import traceback
import warnings

import torch

from torch_splash_jax import SplashConstraintError, compat, mosaic
from torch_splash_jax.tpu_time import aot

from . import _compat, _transport
from ._transport import planned_for_tpu

__all__ = ["Report", "check", "kernel_time", "largest_fitting", "main", "planned_for_tpu"]

# HBM per chip, as libtpu 0.0.21's compiler states it when a step does not fit (measured: v5e
# "Used 49.17G of 15.75G hbm"; the others in "Allocation ... would exceed memory (size=...)"). A
# refusal's own figure replaces it. (That libtpu knows no v7x.)
CAPACITY_GIB = {"v4": 32.0, "v5e": 15.75, "v5p": 96.0, "v6e": 31.5}
_TOPOLOGY = re.compile(rf"^({'|'.join(CAPACITY_GIB)})(?::(\d+(?:x\d+){{1,2}}))?$")


class EarlyExecution(SplashConstraintError):
    """The step read a device value before its boundary (`.item()`, a print, a Python branch on a
    tensor): part of its graph would have run early, so the graph at the boundary is not the step."""


@dataclasses.dataclass(frozen=True)
class Report:
    """The TPU compiler's verdict on one step, per chip, in bytes."""

    topology: str
    chips: int
    fits: bool
    capacity: int
    arguments: int = 0
    outputs: int = 0
    temporaries: int = 0
    code: int = 0
    total: int = 0  # arguments + outputs (less what they alias) + temporaries
    needed: int | None = None  # the compiler's figure when it does not fit
    needed_is_lower_bound: bool = False
    error: str | None = None  # a refusal other than memory, its first lines
    xla_estimated_cycles: int | None = None  # XLA's own estimate of the step's ops but the kernels
    # With check(..., estimate_time=True): the attention kernels' estimated time per chip
    # (torch_splash_jax.tpu_time, docs/tpu_time.md), seconds, over `attention_calls` calls
    attention_seconds: float | None = None
    attention_calls: int = 0
    rest_seconds: float | None = None  # xla_estimated_cycles at the estimator's clock

    def __str__(self) -> str:
        gib = 1 << 30
        head = f"{self.topology}, {self.chips} chip{'s' if self.chips > 1 else ''}:"
        if self.error is not None:
            return f"{head} the TPU compiler refused the step:\n{self.error}"
        if not self.fits:
            at_least = "at least " if self.needed_is_lower_bound else ""
            return (
                f"{head} does NOT fit: needs {at_least}{self.needed / gib:.2f} GiB of {self.capacity / gib:.2f} GiB HBM"
            )
        text = (
            f"{head} fits: {self.total / gib:.2f} GiB of {self.capacity / gib:.2f} GiB HBM per chip "
            f"(arguments {self.arguments / gib:.2f}, outputs {self.outputs / gib:.2f}, "
            f"temporaries {self.temporaries / gib:.2f}, generated code {self.code / gib:.3f} GiB)"
        )
        if self.attention_seconds is not None:
            text += (
                f"\n  attention kernels, {self.attention_calls} call{'s' if self.attention_calls != 1 else ''}: "
                f"{self.attention_seconds * 1e3:.3f} ms per chip, estimated from the TPU compiler's schedule"
            )
            if self.rest_seconds is not None:
                text += f"; the rest of the step, XLA's own estimate: {self.rest_seconds * 1e3:.3f} ms"
        return text


def parse_topology(topology: str) -> tuple[str, str]:
    """(generation, libtpu topology name): "v5e" -> one host of v5e ("v5e:2x2"), "v5e:4x4" as given."""
    found = _TOPOLOGY.match(topology or "")
    if found is None:
        known = ", ".join(f"{g}[:{aot.TOPOLOGIES[g].split(':')[1]}]" for g in CAPACITY_GIB)
        raise SplashConstraintError(
            f"topology={topology!r} is not one torch_splash.fit knows: use one of {known} (e.g. v5e:2x2, v5e:4x4)."
        )
    generation, shape = found.group(1), found.group(2)
    return generation, aot.TOPOLOGIES[generation] if shape is None else f"{generation}:{shape}"


def libtpu_dir(release: str = mosaic.PINNED_LIBTPU, variable: str = "TORCH_SPLASH_LIBTPU_DIR") -> pathlib.Path:
    """A folder holding libtpu `release` for a compiler's process: $`variable`, or that release
    installed once under ~/.cache/torch_splash (never where JAX would take it for a backend). By
    default the release torch_xla pins, for HBM; `kernel_time` asks for the one its estimates
    were calibrated with."""
    given = os.environ.get(variable)
    if not given and compat.installed("libtpu") == release:  # installed beside torch_splash (TorchTPU's)
        return pathlib.Path(importlib.metadata.distribution("libtpu").locate_file(""))
    folder = pathlib.Path(given) if given else pathlib.Path.home() / ".cache" / "torch_splash" / f"libtpu-{release}"
    if (folder / "libtpu" / "libtpu.so").is_file():
        return folder
    if given:
        raise SplashConstraintError(f"${variable}={given} holds no libtpu/libtpu.so.")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), f"libtpu=={release}"]
    print(f"torch_splash.fit: installing libtpu=={release} into {folder} (once)", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (folder / "libtpu" / "libtpu.so").is_file():
        raise SplashConstraintError(
            f"torch_splash.fit needs libtpu=={release} and could not install it ({done.stderr.strip()[-300:]}). "
            f"Install it yourself: pip install --no-deps --target DIR libtpu=={release}, then set {variable}=DIR."
        )
    return folder


def kernel_time(q, k, v, mask=None, *, generation: str, backward: bool = True, **options):
    """The estimated TPU device time of one `torch_splash.attention(q, k, v, mask, **options)`
    call on one device of `generation` ("v5e", "v5p", "v6e", "v7x"), from the TPU compiler's own
    schedule of the kernels it would run there, compiled here without a TPU. An estimate, not a
    measurement: `torch_splash_jax.tpu_time` says what it leaves out, and docs/benchmarks.md its
    error against tokamax's measured TPU times.

    q, k, v may be meta tensors (only their shapes and dtypes are read). With `backward`, the
    estimate covers a training step's forward and backward kernels. Returns an Estimate:
    `.seconds` (kernels and, at XLA's own estimate, the ops around them), `.kernels` (each
    kernel's KernelTime), `.mxu_utilization`, `.binding_unit`.
    """
    from torch_splash_jax import tpu_time

    from . import _checks, api

    tpu_time.chip(generation)
    unknown = set(options) - {"scale", "segment_ids", "soft_cap", "sinks", "block_sizes"}
    if unknown:
        raise SplashConstraintError(
            f"kernel_time: {sorted(unknown)} are not options of one device's call "
            "(scale, segment_ids, soft_cap, sinks, block_sizes)."
        )
    get = options.get
    with planned_for_tpu():  # meta tensors too: planned for TPU, never run
        call = _checks.check_call(q, k, v, mask, get("scale"), get("segment_ids"), get("soft_cap"), get("sinks"))
    plan = api._plan(call, get("block_sizes"), "tpu", None)
    folder = libtpu_dir(tpu_time.ESTIMATOR_LIBTPU, "TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR")
    return tpu_time.estimate_in_subprocess(plan, generation, backward, libtpu_dir=str(folder))


def compile_step_hlo(hlo_text: str, topology: str, partitions: int = 1) -> Report:
    """Compile a torch_xla step's HLO text for `partitions` chips of `topology`, in a process of
    its own (libtpu there, never here) that imports JAX but not torch (torch_splash_jax.tpu_time.aot's
    command line): importing torch and torch_splash cost that process about 7 of its 15 seconds."""
    generation, name = parse_topology(topology)
    env = aot.environment(str(libtpu_dir()))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(pathlib.Path(__file__).resolve().parent.parent)])
    with tempfile.NamedTemporaryFile("w", suffix=".hlo", delete=False) as f:
        f.write(hlo_text)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch_splash_jax.tpu_time.aot", f.name,
             "--topology", name, "--partitions", str(partitions)],
            capture_output=True, text=True, env=env, timeout=3600,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"torch_splash.fit: the TPU compiler's process failed:\n{done.stderr[-3000:]}")
    fields = json.loads(lines[-1])
    fields.setdefault("capacity", int(CAPACITY_GIB[generation] * (1 << 30)))  # the compiler's own when it refused
    return Report(topology=topology, **fields)


def _live_pending_tensors() -> list[torch.Tensor]:
    """The live torch_xla tensors that are part of the pending graph: what a step boundary would
    compute (the updated parameters and their gradients, optimizer state, the loss). Found from
    the objects Python holds: tensors, the gradients of tensors, the values of dicts, lists and
    tuples (an optimizer's state)."""

    gc.collect()  # only what the script still holds
    found: dict[int, torch.Tensor] = {}

    def add(value):
        if isinstance(value, torch.Tensor) and value.device.type == "xla":
            found[id(value)] = value

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some module attributes, .grad of non-leaves
        for obj in gc.get_objects():
            kind = type(obj)  # exact types: a mapping subclass may compute its values (transformers' lazy maps)
            if isinstance(obj, torch.Tensor):
                add(obj)
                add(obj.grad)
            elif kind is dict:
                for value in obj.values():
                    add(value)
            elif kind is list or kind is tuple:
                for value in obj:
                    add(value)
    tensors = list(found.values())
    return [t for t, p in zip(tensors, _compat.needs_materialization_each(tensors)) if p] if tensors else []


@contextlib.contextmanager
def _watching_executions():
    """Records the first user line that made torch_xla execute (a `.item()`, a print, ...)."""
    import torch_xla.debug.metrics as met

    def executions():
        data = met.metric_data("ExecuteTime")
        return 0 if data is None else data[0]

    first_line: list[str] = []
    reads = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__repr__", "__format__", "numpy")
    originals = {name: getattr(torch.Tensor, name) for name in reads}

    def watched(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if self.device.type == "xla" and not first_line:
                frames = [f for f in traceback.extract_stack()[:-1] if "/torch" not in f.filename]
                if frames:
                    first_line.append(f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}")
            return original(self, *args, **kwargs)

        return read

    start = executions()
    for name in reads:
        setattr(torch.Tensor, name, watched(name))
    state = {"executed": lambda: executions() > start, "line": first_line}
    try:
        yield state
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _early(state, error: BaseException | None = None) -> EarlyExecution:
    where = f" at {state['line'][0]}" if state["line"] else ""
    cause = f" ({type(error).__name__}: {str(error).splitlines()[0][:200]})" if error is not None else ""
    return EarlyExecution(
        f"the step read a device value before its boundary{where}{cause}: that runs part of the graph early, "
        "so what reaches the boundary is not the whole step. Move the read after the step (or log with "
        "torch_xla's step closures)."
    )


@contextlib.contextmanager
def _building_one_step():
    """Inside: the step's graph is built with the kernels planned for TPU; anything that executed
    part of it before its boundary is reported as EarlyExecution (naming the line it can find)."""
    with planned_for_tpu(), _watching_executions() as state:
        try:
            yield
        except Exception as error:
            if state["executed"]() or state["line"]:
                raise _early(state, error) from error
            raise
        if state["executed"]():
            raise _early(state)


def _partitions() -> int:
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count() if xr.is_spmd() else 1


def check(step_fn, *args, topology: str = "v5e", estimate_time: bool = False, **kwargs) -> Report:
    """Build one training step's graph (`step_fn(*args, **kwargs)` on torch_xla CPU-device tensors,
    ending before its boundary), with torch_splash's kernels planned for TPU, and compile it for
    `topology` with the TPU compiler. The step is not executed. With `estimate_time`, the report
    also gives the attention kernels' estimated time (`kernel_time` of each call) and XLA's own
    estimate of the rest of the step."""
    import torch_xla  # noqa: F401  (the step's tensors are torch_xla's)

    parse_topology(topology)
    with _building_one_step(), _transport.recording_plans() as calls:
        step_fn(*args, **kwargs)
        hlo = _compat.pending_hlo_text(_live_pending_tensors())
    report = compile_step_hlo(hlo, topology, _partitions())
    return _with_time(report, calls) if estimate_time else report


def _with_time(report: Report, calls: list) -> Report:
    """The report with the attention kernels' estimated time: one estimate per distinct plan."""
    from torch_splash_jax import tpu_time

    generation, _ = parse_topology(report.topology)
    tpu_time.chip(generation)  # an error listing the generations the estimator knows
    folder = str(libtpu_dir(tpu_time.ESTIMATOR_LIBTPU, "TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR"))
    seconds, estimates = 0.0, {}
    for plan, backward in calls:
        if (plan, backward) not in estimates:
            estimates[plan, backward] = tpu_time.estimate_in_subprocess(plan, generation, backward, folder)
        seconds += estimates[plan, backward].kernel_seconds
    rest = None
    if report.xla_estimated_cycles is not None:
        rest = report.xla_estimated_cycles / tpu_time.chip(generation).clock
    return dataclasses.replace(report, attention_seconds=seconds, attention_calls=len(calls), rest_seconds=rest)


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


class _StepBoundary(BaseException):
    """Raised at the script's first step boundary (a BaseException: the script's own `except
    Exception` does not swallow it)."""


@contextlib.contextmanager
def _stopping_at_the_first_boundary(graph: list):
    """At the first boundary, the pending graph's HLO goes into `graph` (while the script's frames,
    and so its tensors, are alive), and the script stops."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    def boundary(*args, **kwargs):
        graph.append(_compat.pending_hlo_text(_live_pending_tensors()))
        raise _StepBoundary

    def optimizer_step(optimizer, *args, **kwargs):
        optimizer.step(**(kwargs.get("optimizer_args") or {}))
        boundary()

    saved = [(torch_xla, "sync"), (xm, "mark_step"), (xm, "optimizer_step")]
    originals = [getattr(owner, name) for owner, name in saved]
    torch_xla.sync, xm.mark_step, xm.optimizer_step = boundary, boundary, optimizer_step
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals):
            setattr(owner, name, original)


def run_script(script: str, script_args: list[str], topology: str, estimate_time: bool = False) -> Report:
    """Run a torch_xla training script up to its first step boundary and check that step."""
    import torch_xla  # noqa: F401

    parse_topology(topology)
    sys.argv, graph = [script, *script_args], []
    with _building_one_step(), _stopping_at_the_first_boundary(graph), _transport.recording_plans() as calls:
        try:
            runpy.run_path(script, run_name="__main__")
        except _StepBoundary:
            pass
    if not graph:
        raise SplashConstraintError(
            f"{script} ended without a step boundary (torch_xla.sync(), xm.mark_step(), "
            "xm.optimizer_step(...)): there is no step to check."
        )
    report = compile_step_hlo(graph[0], topology, _partitions())
    return _with_time(report, calls) if estimate_time else report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_splash.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e", help="v5e, v5e:2x2, v5e:4x4, v6e:2x2, v5p:2x2x1, ...")
    parser.add_argument(
        "--time", action="store_true", help="also estimate the attention kernels' time (docs/tpu_time.md)"
    )
    parser.add_argument("script", nargs="?")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if not options.script:
        parser.error("give the training script to check")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        report = run_script(options.script, options.script_args, options.topology, options.time)
    except SplashConstraintError as error:
        print(f"torch_splash.fit: {error}", file=sys.stderr)
        return 2
    print(f"torch_splash.fit: {report}")
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
