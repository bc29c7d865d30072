"""Where a call's kernels are planned for: "cpu" (interpret mode) or "tpu", from the tensors'
device, or "tpu" for torch_xla CPU-device tensors within `planned_for_tpu` (the fit check's way of
building a TPU step on a machine without one); and for which TPU generation, where known."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from torch_splash_jax import SplashConstraintError
from torch_splash_jax.kernel_limits import DEVICE_KINDS

_FOR_TPU = threading.local()


@contextlib.contextmanager
def planned_for_tpu(generation: str | None = None):
    """Within it, torch_xla CPU-device tensors get kernels planned and lowered for TPU, spliced
    into torch_xla's lazy graph: the graph a TPU would run, built (and compiled for TPU by
    torch_splash.fit) on a machine without one. Nothing that reads such a graph's values can run
    here: the Mosaic kernels need a TPU. generation: the TPU generation ("v5e", "v5p", "v6e",
    "v7x") the kernels are built for (`torch_splash_jax.Plan.generation`), where known."""
    before = getattr(_FOR_TPU, "on", False), getattr(_FOR_TPU, "generation", None)
    _FOR_TPU.on, _FOR_TPU.generation = True, generation
    try:
        yield
    finally:
        _FOR_TPU.on, _FOR_TPU.generation = before


def generation_of(device: torch.device) -> str | None:
    """The TPU generation a call's kernels are built for: the one `planned_for_tpu` names, else
    the device's (torch_xla's TPU device kind; TorchTPU's chip name); None where none says (the
    CPU, a chip TorchTPU does not name: its kernels then are the ones that serve every generation)."""
    if getattr(_FOR_TPU, "on", False):
        return getattr(_FOR_TPU, "generation", None)
    if device.type == "tpu":
        return _torchtpu_generation()
    if device.type == "xla":
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.device_type() == "TPU":
            return DEVICE_KINDS.get(xm.xla_device_kind(device))
    return None


@functools.cache
def _torchtpu_generation() -> str | None:
    """The generation of the chip TorchTPU's public device module names ("TPU v6e", "TPU v7"; "TPU"
    when it does not know the chip), which it reads from the PCI bus: once a process, not a call."""
    return DEVICE_KINDS.get(torch.tpu.get_device_name())


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
