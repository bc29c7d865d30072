"""torch_splash: JAX's Pallas splash attention for PyTorch, with gradients."""

from jax_core import BlockSizes, SplashConstraintError, SplashDtypeError

from . import masks
from .bridge import attention

__all__ = ["BlockSizes", "SplashConstraintError", "SplashDtypeError", "attention", "masks"]
