"""torch_splash: JAX's Pallas splash attention for PyTorch, with gradients."""

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
