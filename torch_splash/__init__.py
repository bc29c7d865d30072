"""torch_splash: JAX's Pallas splash attention for PyTorch, with gradients."""

# torch_splash_jax checks the Python, JAX and numpy versions and keeps JAX off a TPU that torch_xla or
# TorchTPU owns before it imports JAX (torch_splash_jax.compat); torch is checked here.
from torch_splash_jax import BlockSizes, SplashConstraintError, SplashDtypeError, SplashError, SplashVersionError
from torch_splash_jax import compat as _compat

_compat.check_versions(("torch",))

from . import masks
from .api import attention
from .sdpa import route_sdpa, scaled_dot_product_attention

__all__ = [
    "BlockSizes",
    "SplashConstraintError",
    "SplashDtypeError",
    "SplashError",
    "SplashVersionError",
    "attention",
    "masks",
    "route_sdpa",
    "scaled_dot_product_attention",
]
