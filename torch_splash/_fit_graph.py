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

import collections
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
    donates, how many parameters it takes, and the bytes of those donated (all devices'). Then
    what a later step is compared with (`steady_state_of`), scalars left out (torch_xla makes a
    Python number a parameter or a constant by its value): its outputs' and its parameters'
    (shape, dtype), the outputs that update a tensor already on the device in place, and those
    that update a tensor the step created itself (state made fresh: a KV cache's zeros, an
    optimizer's moments) with their bytes (a scalar output's signature is None)."""

    proto: bytes
    donors: tuple[int, ...]
    parameters: int
    donated_bytes: int
    outputs: tuple = ()
    inputs: tuple = ()
    updates: tuple[int, ...] = ()
    fresh: tuple[int, ...] = ()
    fresh_bytes: int = 0


# The HLO ops of a graph that only moves data: uploads, creation on the device, casts, copies
_DATA_MOVES = frozenset(
    ("parameter", "constant", "convert", "copy", "bitcast", "bitcast-convert", "reshape", "broadcast", "transpose")
    + ("tuple", "get-tuple-element")
)
_OPCODE = re.compile(r"^\s*(?:ROOT )?%\S+ = .*?\b([a-z][a-z0-9-]*)\(", re.MULTILINE)


def _signature(t) -> tuple:
    return tuple(t.shape), str(t.dtype)


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


def steady_state_of(first: Step, second: Step) -> bool:
    """Whether `second` is `first` again once the state `first` created is on the device: the
    same outputs, and as inputs `first`'s and that state, which `second` updates in place. A step
    that differs otherwise (a prefill before decode steps: other shapes) is not."""

    def arrays(outputs):
        return collections.Counter(o for o in outputs if o is not None)

    if not first.fresh or arrays(first.outputs) != arrays(second.outputs):
        return False
    state = collections.Counter(second.outputs[k] for k in second.updates)
    state -= collections.Counter(first.outputs[k] for k in first.updates)
    return collections.Counter(second.inputs) == collections.Counter(first.inputs) + state


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
    aliases = [_compat.tensor_alias_id(t) for t in tensors]
    donors: tuple[int, ...] = ()
    if _compat.param_aliasing_enabled():
        recomputed = set(aliases)
        donors = tuple(number for number, owner in enumerate(owners) if owner >= 0 and owner in recomputed)
    donated = sum(data[number].numel() * data[number].element_size() for number in donors)
    owned = {owner for owner in owners if owner >= 0}
    ids = [_compat.tensor_id(t) for t in tensors]
    # an alias that is not the tensor's own id names the tensor it updated in place: one the graph
    # reads (on the device before the step), or one the step itself made
    updates = tuple(k for k, alias in enumerate(aliases) if alias in owned)
    fresh = tuple(k for k, alias in enumerate(aliases) if alias != ids[k] and alias not in owned)
    return Step(
        proto,
        donors,
        len(owners),
        donated,
        outputs=tuple(_signature(t) if t.dim() else None for t in tensors),
        inputs=tuple(sorted(_signature(d) for d in data if d.dim())),
        updates=tuple(k for k in updates if tensors[k].dim()),
        fresh=tuple(k for k in fresh if tensors[k].dim()),
        fresh_bytes=sum(tensors[k].numel() * tensors[k].element_size() for k in fresh),
    )
