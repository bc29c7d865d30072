"""How JAX programs reach torch: DLPack capsules to JAX arrays on the CPU (zero-copy), or the
program lowered to an HLO module for torch_xla's lazy graph.

DLPack has a per-call budget: `jax.dlpack.from_dlpack` spends about 130 us per array on a 2-core
CPU (mostly generic dtype and placement work around one C++ call); the C++ call alone takes about
15 us. A call through the bridge moves 5 to 9 arrays, so the public path alone would cost about
1 ms per attention call at small sizes. We call the C++ import directly and fall back to the
public API if it moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import mosaic


@functools.cache
def _cpu_device():
    return jax.devices("cpu")[0]


def _import_capsule():
    try:
        from jax._src.lib import xla_client

        return xla_client._xla.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):  # a JAX without the private import: use the public one
        return None


_IMPORT = _import_capsule()


class _Capsule:
    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, *args, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def from_capsule(capsule) -> jax.Array:
    """A jax.Array over a CPU DLPack capsule's buffer (the capsule is consumed)."""
    if _IMPORT is not None:
        return _IMPORT(capsule, _cpu_device(), None)
    return jax.dlpack.from_dlpack(_Capsule(capsule))


def hlo_module(
    fn, args: tuple[tuple[tuple[int, ...], str], ...], platform: str, mosaic_version: int | None = None
) -> bytes:
    """`fn` at these (shape, dtype name) arguments, lowered for `platform` ("cpu" or "tpu") to a
    serialized HLO module: what torch_xla splices into its lazy graph.

    Lowering names its platform instead of asking JAX's default backend: a Mosaic kernel lowered
    for TPU is serialized into its custom call and compiled by XLA where it runs, so JAX needs no
    TPU backend and never opens a TPU that torch_xla owns. keep_unused: the caller passes every
    argument as a parameter, so none may be pruned. TPU kernels are serialized at the Mosaic IR
    version `jax_core.mosaic` decides (`mosaic_version` overrides it, for tests).
    """
    structs = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in args]
    traced = jax.jit(fn, keep_unused=True).trace(*structs)
    if platform == "tpu":
        version = mosaic.ir_version() if mosaic_version is None else mosaic_version
        with mosaic.serialized_at(version):
            lowered = traced.lower(lowering_platforms=(platform,))
    else:
        lowered = traced.lower(lowering_platforms=(platform,))
    return lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
