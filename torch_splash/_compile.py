"""torch.compile support: what lets Dynamo trace `attention` with its options as constants.

`attention`'s checks and planning run in a `nonstrict_trace` region (plain Python on fake
tensors), which leaves only the custom ops (`_ops.py`) in the graph. The options cross into that
region as constants Dynamo guards on: `BlockSizes` and every mask type are registered as pytree
constants here, and a structured mask crosses as the source text of its constructor calls
(torch_splash_jax.text): Dynamo passes a str whatever built it, but a mask object only if it was
built outside the compiled region.
"""

from __future__ import annotations

import torch_splash_jax

from . import _compat
from . import masks as _masks

for _option in (torch_splash_jax.BlockSizes, *_masks.TYPES):
    _compat.register_constant(_option)
