"""torch.compile support: the option types registered as constants, so that Dynamo can trace
`attention` with them.

`attention`'s checks and planning run in a `nonstrict_trace` region (plain Python on fake
tensors), which leaves only the custom ops (`_ops.py`) in the graph. The options cross into that
region as constants Dynamo guards on: `BlockSizes` and every mask type are registered as pytree
constants by `register_options` (called once, when `torch_splash.api` is imported), and a
structured mask crosses as the source text of its constructor calls
(torch_splash_jax.serialization): Dynamo passes a str whatever built it, but a mask object only if it was
built outside the compiled region.
"""

from __future__ import annotations

import torch_splash_jax

from . import _compat
from . import masks as _masks


def register_options() -> None:
    """Register `BlockSizes` and every mask type as pytree constants Dynamo guards on."""
    for option in (torch_splash_jax.BlockSizes, *_masks.TYPES):
        _compat.register_constant(option)
