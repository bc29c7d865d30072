"""Zero-copy crossing between torch and JAX through DLPack (CPU tensors, torch_xla CPU-device tensors).

JAX reads DLPack strides wrongly for non-contiguous tensors, so inputs are made contiguous first
(HF passes transposed views). A torch_xla tensor with pending lazy ops aborts the process inside
`to_dlpack`, so those are materialised first. On TPU no layer supports DLPack (see DESIGN.md): the
in-graph transport serves it.
"""

from __future__ import annotations

import torch

from jax_core.transport import from_capsule


def platform_of(device: torch.device) -> str:
    """The kernel platform for tensors on `device`: 'cpu' (interpret mode) or 'tpu'."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "xla":
        import torch_xla.runtime as xr

        kind = xr.device_type()
        if kind == "CPU":
            return "cpu"
        if kind == "TPU":
            return "tpu"
        raise NotImplementedError(f"torch_splash runs on CPU or TPU; torch_xla device type is {kind}.")
    raise NotImplementedError(
        f"torch_splash runs on CPU tensors and torch_xla tensors; got a tensor on {device}. "
        "Move it to the CPU or to torch_xla's device."
    )


def to_jax(tensors: list[torch.Tensor]) -> list:
    tensors = [t.detach().contiguous() for t in tensors]
    if not tensors or tensors[0].device.type == "cpu":
        return [from_capsule(t.__dlpack__()) for t in tensors]
    import torch_xla
    import torch_xla.utils.dlpack as xla_dlpack

    if platform_of(tensors[0].device) != "cpu":
        raise NotImplementedError(
            "DLPack cannot carry TPU buffers (torch_xla and JAX both refuse); the in-graph transport "
            "for TPU is not implemented yet."
        )
    torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=True)
    return [from_capsule(xla_dlpack.to_dlpack(t)) for t in tensors]


def to_torch(arrays, device: torch.device) -> list[torch.Tensor]:
    if device.type == "cpu":
        return [torch.from_dlpack(a) for a in arrays]
    import torch_xla.utils.dlpack as xla_dlpack

    return [xla_dlpack.from_dlpack(a) for a in arrays]
