"""torch_splash: JAX's Pallas splash attention for PyTorch, with gradients."""

import os as _os
import sys as _sys

if _os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
    # On TPU, torch_xla must open the device before JAX initialises its own TPU backend, or
    # torch_xla computations hang (torch_xla issue 8793). Do it before jax_core imports JAX.
    if "jax" in _sys.modules:
        import warnings as _warnings

        _warnings.warn("torch_splash: JAX was imported before torch_splash on a TPU host; import torch_splash "
                       "(or torch_xla) first so torch_xla opens the TPU before JAX does.", stacklevel=2)
    else:
        from torch_xla._internal.jax_workarounds import jax_import_guard as _jax_import_guard

        _jax_import_guard()

from jax_core import BlockSizes, SplashConstraintError, SplashDtypeError

from . import masks
from .bridge import attention
from .sdpa import route_sdpa, scaled_dot_product_attention

__all__ = [
    "BlockSizes",
    "SplashConstraintError",
    "SplashDtypeError",
    "attention",
    "masks",
    "route_sdpa",
    "scaled_dot_product_attention",
]
