"""Building one step without running it: torch_splash's kernels planned for TPU, and any read of
a device value before the step's boundary (which would execute part of its graph early) caught,
with the user's line that made it. The reads are caught by wrapping torch.Tensor's reading
methods for the duration, and restored after.

A read of what an earlier boundary computed (`ids[0, 0].item()`, `logits[:, -1].cpu()` after the
boundary, as a generate loop logs its token) executes only its index or slice, which no step
computes: it runs as torch_xla runs it and is not counted against the step being built."""

from __future__ import annotations

import contextlib
import traceback

import torch

from torch_splash_jax import SplashConstraintError

from . import _compat
from ._platform import planned_for_tpu

# The torch.Tensor methods that read a value back to the host (`to` only when it goes to the CPU)
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__repr__", "__format__", "numpy")
READS += ("cpu", "to")


def _to_host(name: str, args, kwargs) -> bool:
    """Whether this call of a READS method reads the value back to the host: `to` does only when
    it goes to the CPU (it mostly moves tensors onto the device, or converts them there)."""
    if name != "to":
        return True
    where = kwargs.get("device", args[0] if args else None)
    if isinstance(where, torch.Tensor):
        where = where.device
    if isinstance(where, (str, torch.device)):
        return torch.device(where).type == "cpu"
    return False


def _already_computed(t: torch.Tensor) -> bool:
    """Whether reading `t` executes none of the pending graph: it has no pending work, or it is a
    view (an index, a slice) of a tensor that has none, whose execution is the view's alone."""
    if not _compat.needs_materialization([t]):
        return True
    base = _compat.view_base(t)
    return base is not None and not _compat.needs_materialization([base])


class EarlyExecution(SplashConstraintError):
    """The step read a device value before its boundary (`.item()`, a print, a Python branch on a
    tensor): part of its graph would have run early, so the graph at the boundary is not the step."""


class _Watch:
    """Executions torch_xla made since `restart()`, and the first user line that read a value."""

    def __init__(self):
        self.start = self.executions()
        self.line: list[str] = []
        self.reading = False  # inside a read already judged: the reads it makes itself are its own

    @staticmethod
    def executions() -> int:
        import torch_xla.debug.metrics as met

        data = met.metric_data("ExecuteTime")
        return 0 if data is None else data[0]

    def restart(self) -> None:
        """Count from here, once what is already scheduled has run."""
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        self.start, self.line[:] = self.executions(), []

    def executed(self) -> bool:
        return self.executions() > self.start

    @contextlib.contextmanager
    def not_counting(self):
        """Executions made within are not the step's (they are counted as they happen: a read
        waits for its value)."""
        before = self.executions()
        try:
            yield
        finally:
            self.start += self.executions() - before


@contextlib.contextmanager
def watching_executions(settle: bool = False):
    """Yields a _Watch: torch.Tensor's reading methods record the first user line that read an
    XLA tensor's value. With `settle`, it counts from when the executions already scheduled (a
    boundary runs its step asynchronously) have run: they are not the step's. (Not before a
    script starts: that would start torch_xla's runtime before the script chooses SPMD.)"""
    watch = _Watch()
    if settle:
        watch.restart()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def watched(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if watch.reading or self.device.type != "xla" or not _to_host(name, args, kwargs):
                return original(self, *args, **kwargs)
            watch.reading = True
            try:
                if _already_computed(self):
                    with watch.not_counting():
                        return original(self, *args, **kwargs)
                if not watch.line:
                    frames = [f for f in traceback.extract_stack()[:-1] if "/torch" not in f.filename]
                    if frames:
                        watch.line.append(f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}")
                return original(self, *args, **kwargs)
            finally:
                watch.reading = False

        return read

    for name in READS:
        setattr(torch.Tensor, name, watched(name))
    try:
        yield watch
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def early(watch: _Watch, error: BaseException | None = None) -> EarlyExecution:
    where = f" at {watch.line[0]}" if watch.line else ""
    cause = f" ({type(error).__name__}: {str(error).splitlines()[0][:200]})" if error is not None else ""
    return EarlyExecution(
        f"the step read a device value before its boundary{where}{cause}: that runs part of the graph early, "
        "so what reaches the boundary is not the whole step. Move the read after the step (or log with "
        "torch_xla's step closures)."
    )


@contextlib.contextmanager
def building_one_step(watch: _Watch, generation: str | None = None):
    """Inside: the graph is built with the kernels planned for TPU (for `generation`, where given);
    anything that executed part of it before its boundary is reported as EarlyExecution (naming
    the line it can find)."""
    with planned_for_tpu(generation):
        try:
            yield
        except Exception as error:
            if watch.executed() or watch.line:
                raise early(watch, error) from error
            raise
        if watch.executed():
            raise early(watch)
