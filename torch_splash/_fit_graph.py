"""A pending torch_xla step as torch_xla itself would compile it at a step boundary: the graph of
every live tensor with pending work, ordered as torch_xla orders its live tensors, and the
parameters it donates.

At a boundary (`torch_xla.sync()`, `xm.mark_step()`) torch_xla compiles one graph for all its
live tensors that have pending work, taken in the order of their ids, and declares as buffer
donors (XLAGraphExecutor::GetBufferDonors, on unless XLA_ENABLE_PARAM_ALIASING=0 or automatic
sharding) the parameters whose buffer belongs to a tensor that graph recomputes: a tensor updated
in place (weights, optimizer state, gradients accumulated into, KV caches), whose old buffer is
dead once the step has run. The compiler then reuses each donated buffer for an output of its
shape, so a step's state is counted once. The graph is taken as a serialized module, not as HLO
text, which XLA's parser does not always take back."""

from __future__ import annotations

import dataclasses
import gc
import re
import warnings

import torch

from torch_splash_jax import SplashConstraintError

from . import _compat


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's module as torch_xla compiles it: serialized HLO, the numbers of the parameters it
    donates, how many parameters it takes, and the bytes of those donated (all devices')."""

    proto: bytes
    donors: tuple[int, ...]
    parameters: int
    donated_bytes: int


# The HLO ops of a graph that only moves data: uploads, creation on the device, casts, copies
_DATA_MOVES = frozenset(
    ("parameter", "constant", "convert", "copy", "bitcast", "bitcast-convert", "reshape", "broadcast", "transpose")
    + ("tuple", "get-tuple-element")
)
_OPCODE = re.compile(r"^\s*(?:ROOT )?%\S+ = .*?\b([a-z][a-z0-9-]*)\(", re.MULTILINE)


def live_pending_tensors() -> list[torch.Tensor]:
    """The live torch_xla tensors that are part of the pending graph: what a step boundary would
    compute (the updated parameters and their gradients, optimizer state, caches, the loss),
    found from the objects Python holds, one per torch_xla tensor, in the order of torch_xla's
    tensor ids (the order of its live tensors)."""
    gc.collect()  # only what the script still holds
    found: dict[int, torch.Tensor] = {}

    def add(value):
        if isinstance(value, torch.Tensor) and value.device.type == "xla":
            found[id(value)] = value

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some module attributes, .grad of non-leaves
        for obj in gc.get_objects():
            kind = type(obj)  # exact types: a mapping subclass may compute its values (transformers' lazy maps)
            if isinstance(obj, torch.Tensor):
                add(obj)
                add(obj.grad)
            elif kind is dict:
                for value in obj.values():
                    add(value)
            elif kind is list or kind is tuple:
                for value in obj:
                    add(value)
    tensors = list(found.values())
    pending = [t for t, p in zip(tensors, _compat.needs_materialization_each(tensors)) if p] if tensors else []
    by_id = {_compat.tensor_id(t): t for t in pending}
    return [by_id[key] for key in sorted(by_id)]


def computes(tensors: list[torch.Tensor]) -> bool:
    """Whether a boundary with these live pending tensors computes a step: its graph reads a
    tensor already on the device (a parameter a tensor owns, not one torch_xla made of a number or
    a random seed) and does more than move it. A boundary that only uploads data, creates it on
    the device (zeros, a random init) or casts and copies it there is not a step."""
    if not tensors:
        return False
    owners, _ = _compat.graph_parameters(tensors)
    if all(owner < 0 for owner in owners):
        return False
    return not set(_OPCODE.findall(_compat.pending_hlo_text(tensors))) <= _DATA_MOVES


def pending_step(tensors: list[torch.Tensor] | None = None) -> Step:
    """The step that computes `tensors` (by default every live pending tensor), with the buffer
    donors torch_xla would declare for it at a step boundary."""
    tensors = live_pending_tensors() if tensors is None else tensors
    if not tensors:
        raise SplashConstraintError(
            "the step computes nothing: no live torch_xla tensor has pending work at its boundary "
            "(was everything already executed, or is nothing on torch_xla's device?)."
        )
    proto = _compat.pending_hlo_proto(tensors)
    owners, data = _compat.graph_parameters(tensors)
    donors: tuple[int, ...] = ()
    if _compat.param_aliasing_enabled():
        recomputed = {_compat.tensor_alias_id(t) for t in tensors}
        donors = tuple(number for number, owner in enumerate(owners) if owner >= 0 and owner in recomputed)
    donated = sum(data[number].numel() * data[number].element_size() for number in donors)
    return Step(proto, donors, len(owners), donated)
