"""torch_splash: JAX's Pallas splash attention for PyTorch, with gradients."""

import os as _os


def _leave_the_tpu_to_torch_xla() -> None:
    """On a TPU host torch_xla owns the TPU, and JAX opening it too hangs torch_xla (torch_xla issues
    8793 and 8954). JAX only lowers the kernels for TPU, which needs no TPU backend
    (jax_core.transport.hlo_module), so JAX is kept on the CPU unless the caller set JAX_PLATFORMS.
    If JAX is not imported yet, torch_xla opens the TPU first, as torch_xla's own guard does."""
    import sys

    jax_came_first = "jax" in sys.modules
    if not jax_came_first:
        from torch_xla._internal.jax_workarounds import jax_import_guard

        jax_import_guard()
    import jax

    if not _os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # takes effect unless JAX has opened a backend already
    if jax_came_first and jax.devices()[0].platform != "cpu":
        import warnings

        warnings.warn(
            "torch_splash: JAX opened the TPU before torch_splash was imported, so torch_xla's "
            "computations may hang (torch_xla issue 8793). Import torch_splash before running JAX "
            "code, or set JAX_PLATFORMS=cpu.",
            stacklevel=3,
        )


if _os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
    _leave_the_tpu_to_torch_xla()

from jax_core import BlockSizes, SplashConstraintError, SplashDtypeError, SplashError

from . import masks
from .api import attention
from .sdpa import route_sdpa, scaled_dot_product_attention

__all__ = [
    "BlockSizes",
    "SplashConstraintError",
    "SplashDtypeError",
    "SplashError",
    "attention",
    "masks",
    "route_sdpa",
    "scaled_dot_product_attention",
]
