"""torch_splash's errors: one base, one subclass per kind of mistake.

They live here, on the JAX side, because the planner that knows the kernel's rules raises them;
`torch_splash` re-exports them. Pure Python: no JAX import.
"""


class SplashError(Exception):
    """Base of every error torch_splash raises for an input or option it cannot serve. Catch this
    one to handle them all (`route_sdpa` falls back to torch's SDPA on it)."""


class SplashConstraintError(SplashError, ValueError):
    """An input or option that the splash kernels cannot serve (shapes, lengths, heads, devices,
    block sizes, masks, options).

    Raised before any JAX work. The message names the argument as the caller wrote it, the value,
    the rule it breaks and the nearest valid values or the fix.
    """


class SplashVersionError(SplashError, ImportError):
    """A Python, torch, JAX or companion package outside the versions torch_splash supports, or a
    release that moved an API torch_splash relies on (torch_splash_jax.compat). Raised at import, naming
    what was found and what is supported.
    """


class SplashDtypeError(SplashError, TypeError):
    """An argument of the wrong type (not a tensor where one is needed), or tensors whose dtypes the
    kernels cannot take (mismatched, integer where floats are needed, float64).

    Raised before any JAX work, naming the arguments, their types or dtypes and the fix.
    """
