"""torch.compile support: what lets Dynamo trace `attention` with its options as constants.

`attention`'s checks and planning run in a `nonstrict_trace` region (plain Python on fake
tensors), which leaves only the custom ops (`_ops.py`) in the graph. The options cross into that
region as constants Dynamo guards on: `BlockSizes` and every mask type are registered as pytree
constants here, and a structured mask crosses as the source text of its constructor calls.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator

import torch_splash_jax
from torch_splash_jax import policy
from torch_splash_jax.masks import STRUCTURED, Mask

from . import _compat
from . import masks as _masks

for _option in (torch_splash_jax.BlockSizes, *_masks.TYPES):
    _compat.register_constant(_option)


# Structured masks cross into torch.compile's nonstrict_trace region as the text of their
# constructor calls: Dynamo passes a str whatever built it, but a mask object only if it was built
# outside the compiled region.
_STRUCTURED = {cls.__name__: cls for cls in STRUCTURED}


def to_source(mask) -> str | None:
    """A structured mask as constructor calls, e.g. "And(CausalMask(0), LocalMask(3, 0, 0))"; None
    for anything else (data masks, strings, tensors, lists)."""
    if type(mask) not in STRUCTURED:
        return None
    parts = []
    for field in dataclasses.fields(mask):
        value = getattr(mask, field.name)
        if isinstance(value, tuple):
            heads = [to_source(m) for m in value]
            part = None if None in heads else "(" + "".join(f"{h}, " for h in heads) + ")"
        else:
            # Under torch.compile an int field can be symbolic (an int argument that changed between
            # calls); operator.index specialises it (Dynamo guards on the value) where repr cannot.
            part = to_source(value) if isinstance(value, Mask) else repr(value and operator.index(value))
        if part is None:
            return None
        parts.append(part)
    return f"{type(mask).__name__}({', '.join(parts)})"


@functools.lru_cache(maxsize=policy.MASK_SOURCES)
def from_source(source: str) -> Mask:
    """The mask `to_source` wrote: constructor calls of the structured masks on int/None literals."""

    def build(node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _STRUCTURED:
            return _STRUCTURED[node.func.id](*(build(a) for a in node.args))
        if isinstance(node, ast.Tuple):
            return tuple(build(e) for e in node.elts)
        if isinstance(node, ast.Constant) and (node.value is None or type(node.value) is int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -build(node.operand)
        raise ValueError(f"not a mask source: {ast.dump(node)}")

    return build(ast.parse(source, mode="eval").body)
