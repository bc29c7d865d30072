"""How tensors reach the JAX programs: DLPack (zero-copy), torch_xla's own lazy graph, or TorchTPU.

"dlpack": CPU tensors and torch_xla CPU-device tensors cross to JAX and back without a copy; the
program runs eagerly, so a torch_xla input's pending graph is executed first (a sync).
"graph": torch_xla tensors only. JAX lowers the jitted program to HLO for the kernels' platform
and torch_xla splices it into its lazy graph, where XLA runs it next to the rest of the model: no
sync, no host round trip. It is the only way on TPU, where no layer supports DLPack. (torch_xla's
`call_jax` does the same but lowers for JAX's default backend, so on a TPU host JAX would open the
TPU that torch_xla owns; naming the platform keeps JAX on the CPU.)
"torchtpu": TorchTPU tensors (device "tpu"). One TorchTPU custom op, `torch_splash::tpu_program`
made by TorchTPU's public `torch.tpu.pallas.jax_op`, runs every program: TorchTPU exports the
program for TPU with `jax.export` (at the Mosaic IR version torch_splash_jax.mosaic decides) and runs it
on the tensors' device.

JAX reads DLPack strides wrongly for non-contiguous tensors, so DLPack inputs are made contiguous
first (HF passes transposed views). A torch_xla tensor with pending lazy ops aborts the process
inside `to_dlpack`, so those are materialised first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from torch_splash_jax import SplashConstraintError, compat, mosaic, policy
from torch_splash_jax.transport import from_capsule, hlo_module, numbered, numbered_program, program_number

from . import _compat, _platform

TRANSPORTS = ("dlpack", "graph", "torchtpu")
# Where each transport's package comes from, for the refusal when it is missing.
_PACKAGES = {"graph": ("torch_xla", "xla"), "torchtpu": ("torch_tpu", "torchtpu")}


def choose(tensors: list[torch.Tensor], requested: str | None) -> str:
    """The transport for this call: the caller's, else $TORCH_SPLASH_TRANSPORT (for torch_xla
    tensors), else automatic (in-graph on TPU and whenever a torch_xla input is part of a pending
    lazy graph)."""
    source = "transport"
    if requested is None and os.environ.get("TORCH_SPLASH_TRANSPORT"):
        requested, source = os.environ["TORCH_SPLASH_TRANSPORT"], "$TORCH_SPLASH_TRANSPORT"
    if requested is not None and requested not in TRANSPORTS:
        raise SplashConstraintError(f"{source}={requested!r}: expected one of {TRANSPORTS} (or unset for automatic).")
    if requested in _PACKAGES:
        package, extra = _PACKAGES[requested]
        if importlib.util.find_spec(package) is None:
            raise SplashConstraintError(
                f"{source}={requested!r} needs {package}, which is not installed: pip install 'torch_splash[{extra}]'."
            )
    device = tensors[0].device
    if device.type == "tpu":  # TorchTPU: its jax_op is the only way onto its device
        if requested not in (None, "torchtpu") and source == "transport":
            raise SplashConstraintError(
                f"{source}={requested!r} cannot carry TorchTPU tensors (device 'tpu'): use 'torchtpu' or leave it "
                "unset."
            )
        return "torchtpu"
    if requested == "torchtpu" and source == "transport":
        raise SplashConstraintError(
            f"{source}='torchtpu' needs TorchTPU tensors (device 'tpu'); these are on {device}. Leave it unset."
        )
    if device.type != "xla":  # DLPack is the only way; only an explicit per-call request is an error
        if requested == "graph" and source == "transport":
            raise SplashConstraintError(
                f"{source}='graph' needs torch_xla tensors; these are on {device}. Use 'dlpack' or leave it unset."
            )
        return "dlpack"
    compat.check_torch_xla()
    on_tpu = _platform.platform_of(device) == "tpu"
    if requested == "torchtpu":
        requested = None  # from $TORCH_SPLASH_TRANSPORT, which names TorchTPU's transport only for its tensors
    if requested == "dlpack" and on_tpu:
        raise SplashConstraintError(
            f"{source}='dlpack' cannot carry TPU buffers (torch_xla and JAX both refuse): use 'graph' or leave it "
            "unset (in-graph is the default on TPU)."
        )
    if requested is not None:
        return requested
    if on_tpu:
        return "graph"
    return "graph" if _compat.needs_materialization(tensors) else "dlpack"


def run(fn, tensors: list[torch.Tensor], transport: str, platform: str) -> list[torch.Tensor]:
    """fn (a stable jitted JAX function, built for `platform`) on torch tensors, through the chosen
    transport."""
    if transport == "graph":
        args = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)
        return list(_in_graph(program_number(fn), args, platform)(list(tensors)))
    if transport == "torchtpu":
        tensors = [t.contiguous() for t in tensors]
        version = mosaic.ir_version() if platform == "tpu" else None  # None: interpret kernels have no Mosaic
        with contextlib.nullcontext() if version is None else compat.mosaic_ir_version(version):
            return list(_torchtpu_op()(tensors, program_number(fn)))  # TorchTPU exports on a cache miss
    out = fn(*to_jax(tensors))
    return to_torch(out if isinstance(out, (tuple, list)) else [out], tensors[0].device)


@functools.lru_cache(maxsize=policy.IN_GRAPH)
def _in_graph(number: int, args: tuple, platform: str):
    """The program numbered `number` at `args`, as a function of torch_xla tensors that adds it to
    the lazy graph. One object per program and shapes: torch_xla then sees the same computation
    every step and compiles it once. Keyed on the number, so the cache keeps no program alive."""
    fn = numbered(number)
    name = f"splash_{getattr(fn, '__name__', 'program').lstrip('_')}"
    return _compat.in_graph_function(name, hlo_module(fn, args, platform))


@functools.cache
def _torchtpu_op():
    """torch_splash::tpu_program, TorchTPU's custom op for `numbered_program` (made once)."""
    from torch.tpu import pallas

    return pallas.jax_op("torch_splash::tpu_program", numbered_program)


def to_jax(tensors: list[torch.Tensor]) -> list:
    tensors = [t.detach().contiguous() for t in tensors]
    if not tensors or tensors[0].device.type == "cpu":
        return [from_capsule(t.__dlpack__()) for t in tensors]
    import torch_xla.utils.dlpack as xla_dlpack

    _compat.materialize(tensors)
    return [from_capsule(xla_dlpack.to_dlpack(t)) for t in tensors]


def to_torch(arrays, device: torch.device) -> list[torch.Tensor]:
    if device.type == "cpu":
        return [torch.from_dlpack(a) for a in arrays]
    import torch_xla.utils.dlpack as xla_dlpack

    return [xla_dlpack.from_dlpack(a) for a in arrays]
