"""DLPack capsules to JAX arrays on the CPU, zero-copy, at the cost the per-call budget allows.

`jax.dlpack.from_dlpack` spends about 130 us per array on a 2-core CPU (mostly generic dtype
and placement work around one C++ call); the C++ call alone takes about 15 us. A call through the
bridge moves 5 to 9 arrays, so the public path alone would cost about 1 ms per attention call at
small sizes. We call the C++ import directly and fall back to the public API if it moves.
"""

from __future__ import annotations

import functools

import jax


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
