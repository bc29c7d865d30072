"""torch_splash: JAX's Pallas splash attention for PyTorch, with gradients."""

# Before anything imports JAX: keep JAX off a TPU that torch_xla or TorchTPU owns (_compat).
from . import _compat

_compat.keep_jax_off_the_tpu()

# torch_splash_jax checks the Python, JAX and numpy versions (torch_splash_jax.compat); torch here.
from torch_splash_jax import BlockSizes, SplashConstraintError, SplashDtypeError, SplashError, SplashVersionError
from torch_splash_jax import compat as _jax_compat

_jax_compat.check_versions(("torch",))

from . import masks
from .api import attention
from .flex import flex_attention, route_flex, soft_cap
from .sdpa import route_sdpa, scaled_dot_product_attention

__all__ = [
    "BlockSizes",
    "SplashConstraintError",
    "SplashDtypeError",
    "SplashError",
    "SplashVersionError",
    "attention",
    "flex_attention",
    "masks",
    "route_flex",
    "route_sdpa",
    "scaled_dot_product_attention",
    "soft_cap",
]
