"""Where a call's kernels are planned for: "cpu" (interpret mode) or "tpu", from the tensors'
device, or "tpu" for torch_xla CPU-device tensors within `planned_for_tpu` (the fit check's way of
building a TPU step on a machine without one)."""

from __future__ import annotations

import contextlib
import threading

import torch

from torch_splash_jax import SplashConstraintError

_FOR_TPU = threading.local()


@contextlib.contextmanager
def planned_for_tpu():
    """Within it, torch_xla CPU-device tensors get kernels planned and lowered for TPU, spliced
    into torch_xla's lazy graph: the graph a TPU would run, built (and compiled for TPU by
    torch_splash.fit) on a machine without one. Nothing that reads such a graph's values can run
    here: the Mosaic kernels need a TPU."""
    before = getattr(_FOR_TPU, "on", False)
    _FOR_TPU.on = True
    try:
        yield
    finally:
        _FOR_TPU.on = before


def platform_of(device: torch.device) -> str:
    """The kernel platform for tensors on `device`: 'cpu' (interpret mode) or 'tpu'."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "tpu":  # TorchTPU
        return "tpu"
    if device.type == "meta" and getattr(_FOR_TPU, "on", False):  # shapes only: planned, never run
        return "tpu"
    if device.type == "xla":
        import torch_xla.runtime as xr

        kind = xr.device_type()
        if kind == "CPU":
            return "tpu" if getattr(_FOR_TPU, "on", False) else "cpu"
        if kind == "TPU":
            return "tpu"
        raise SplashConstraintError(
            f"q is on torch_xla's {kind} device: torch_splash runs on the CPU or a TPU. Use PJRT_DEVICE=CPU or TPU."
        )
    raise SplashConstraintError(
        f"q is on {device}: torch_splash runs on CPU tensors, torch_xla tensors (CPU or TPU) and TorchTPU "
        "tensors (device 'tpu'). Move the inputs to one of those."
    )
