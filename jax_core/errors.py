"""The one error type for a violated splash constraint.

It lives here, on the JAX side, because the planner that knows the kernel's rules raises it;
`torch_splash` re-exports it as its public error type. Pure Python: no JAX import.
"""


class SplashConstraintError(ValueError):
    """An input or option that the splash kernels cannot serve.

    Raised before any JAX work. The message names the argument as the caller wrote it, the value,
    the rule it breaks and the nearest valid values or the fix.
    """


class SplashDtypeError(TypeError):
    """Inputs whose dtypes the kernels cannot take (mismatched, integer, or unsupported float).

    Raised before any JAX work, naming the arguments, their dtypes and the cast that fixes it.
    """
