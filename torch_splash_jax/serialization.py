"""Masks and plans as text, for interfaces that pass strings and arrays but not objects.

torch's custom ops take tensors, ints and strings, and torch.compile carries a string into its
nonstrict_trace region whatever built it. So a mask crosses as the source of its constructor calls
("And(CausalMask(0), LocalMask(3, 0, 0))"), and a plan as its fields with the mask in that form.
A mask that is data (DenseMask, BlockSparseMask) is written with its content digest and its
arrays' places in a list that crosses beside the text: "Stored('9f3c…', DenseMask(Data(0)))".

Reading a plan's text gives a plan equal to the one written: from a memo of recent texts, or
rebuilt from the arrays when the memo has lost it. The digest in the text makes the memo a cache
of content, never a registry something depends on.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator

import numpy as np

from . import policy
from .decode import DecodePlan
from .masks import DATA, STRUCTURED, Mask
from .plan import Plan

_KINDS = {"splash": Plan, "decode": DecodePlan}

_CALLS = {cls.__name__: cls for cls in (*STRUCTURED, *DATA)}


def mask_source(mask, arrays: list | None = None) -> str | None:
    """`mask` as constructor calls. A data mask's arrays are appended to `arrays` and written as
    their places in it; without `arrays`, a mask holding data has no source (None), as has anything
    that is not a mask."""
    if isinstance(mask, DATA):
        if arrays is None:
            return None
        parts = []
        for field in dataclasses.fields(mask):
            value = getattr(mask, field.name)
            if isinstance(value, np.ndarray):
                arrays.append(value)
                parts.append(f"Data({len(arrays) - 1})")
            else:
                parts.append(repr(_literal(value)))
        return f"Stored({mask.digest!r}, {type(mask).__name__}({', '.join(parts)}))"
    if type(mask) not in STRUCTURED:
        return None
    parts = []
    for field in dataclasses.fields(mask):
        value = getattr(mask, field.name)
        if isinstance(value, tuple):
            heads = [mask_source(m, arrays) for m in value]
            part = None if None in heads else "(" + "".join(f"{h}, " for h in heads) + ")"
        else:
            part = mask_source(value, arrays) if isinstance(value, Mask) else repr(_literal(value))
        if part is None:
            return None
        parts.append(part)
    return f"{type(mask).__name__}({', '.join(parts)})"


def mask_from_source(source: str, arrays=()) -> Mask:
    """The mask `mask_source` wrote, its data masks built from `arrays` (NumPy arrays, or anything
    np.asarray reads) and checked against their digests."""
    if not arrays:
        return _structured_from_source(source)
    return _build(ast.parse(source, mode="eval").body, arrays)


@functools.lru_cache(maxsize=policy.MASK_SOURCES)
def _structured_from_source(source: str) -> Mask:
    return _build(ast.parse(source, mode="eval").body, ())


def _build(node, arrays):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name, args = node.func.id, node.args
        if name in _CALLS:
            return _CALLS[name](*(_build(a, arrays) for a in args))
        if name == "Data" and len(args) == 1 and isinstance(args[0], ast.Constant) and type(args[0].value) is int:
            if args[0].value >= len(arrays):
                raise ValueError(f"mask source names array {args[0].value} of {len(arrays)} given")
            return np.asarray(arrays[args[0].value])
        if name == "Stored" and len(args) == 2 and isinstance(args[0], ast.Constant):
            mask = _build(args[1], arrays)
            if not isinstance(mask, DATA) or mask.digest != args[0].value:
                source = ast.unparse(args[1])
                raise ValueError(f"the arrays given for {source} are not the ones its source was written from")
            return mask
    if isinstance(node, ast.Tuple):
        return tuple(_build(e, arrays) for e in node.elts)
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) is int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_build(node.operand, arrays)
    raise ValueError(f"not a mask source: {ast.dump(node)}")


def _literal(value):
    """A field's value as Python literals. Under torch.compile an int field can be symbolic (an int
    argument that changed between calls); operator.index specialises it (Dynamo guards on the
    value) where repr cannot. NumPy scalars become the Python ones repr writes as literals."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_literal(v) for v in value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return operator.index(value)


def plan_text(plan: Plan | DecodePlan) -> tuple[str, list[np.ndarray]]:
    """The plan (a splash or a decode plan) as text, and the arrays of its data masks (in the order
    the text names them)."""
    arrays: list[np.ndarray] = []
    fields = {f.name: _literal(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name != "mask"}
    source = mask_source(plan.mask, arrays)
    if source is None:
        raise TypeError(f"a plan's mask has no source: {plan.mask!r}")
    kind = {"kind": "decode"} if isinstance(plan, DecodePlan) else {}
    text = repr({**kind, **fields, "mask": source})
    _PLANS.setdefault(text, plan)
    return text, arrays


def plan_fields(text: str) -> dict:
    """A plan's fields from its text, the mask as its source: what needs only shapes, without its data."""
    return ast.literal_eval(text)


def plan_from_text(text: str, arrays=()) -> Plan | DecodePlan:
    """The plan `plan_text` wrote, given the arrays it returned (NumPy arrays or anything np.asarray
    reads); equal to the plan written."""
    found = _PLANS.get(text)
    if found is None:
        fields = plan_fields(text)
        fields["mask"] = mask_from_source(fields["mask"], arrays)
        found = _PLANS.setdefault(text, _KINDS[fields.pop("kind", "splash")](**fields))
    return found


# The plans of the texts written or read last. Plans can hold dense masks: bounded.
_PLANS = policy.Recent(policy.PLAN_TEXTS)
