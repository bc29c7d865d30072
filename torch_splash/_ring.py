"""Ring context parallelism under torch_xla SPMD: the loop over a ring's steps, in one
manual-sharding region.

Each device keeps its shard of q (and the q segment ids); k, v and the kv segment ids are sharded
the same way and, between steps, passed one device onwards along the sequence axis by an XLA
collective permute. Each step runs that step's program (torch_splash_jax.ring: the splash
kernels with the step's block tables, merged by logsumexp) on whatever shard the device holds.
In the backward, dq accumulates in place while dk and dv travel with the keys they belong to, and
a last permute brings them home. The keys travel scaled by the softmax scale (the kernels take
them so) and move on once a step's kernels are done; dk and dv move during the next step's
kernels (docs/tpu.md: what libtpu's schedule overlaps). No device holds more than one shard of
anything, and none holds the next shard of keys before it needs it.
"""

from __future__ import annotations

import functools

import torch

from torch_splash_jax import policy
from torch_splash_jax import transport as jax_transport

from . import _compat, _sharding, _transport


def run(program, sharding, kind: str, named: dict, tables: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The ring's forward ((out, lse); "infer": (out,)) or backward ((dq, dk, dv[, d_sinks])) on
    global tensors (`named`, None for absent options), with every step's tables (every device's)."""
    present = {name: t for name, t in named.items() if t is not None}
    roles = [_sharding.ROLES[name] for name in present]
    for step in range(len(tables)):
        roles += [_sharding.table_role(axes) for axes in program.table_axes(step)]
    local = sharding.enter([*present.values(), *(t for ts in tables for t in ts)], roles)
    mine = dict(zip(present, local))
    given = iter(local[len(present) :])
    mine_tables = [[next(given) for _ in ts] for ts in tables]
    platform = program.plan.platform
    (mine["k"],) = _transport.run(program.scaled_keys, [mine["k"]], "graph", platform)
    if kind == "backward":
        return sharding.leave(_backward(program, mine, mine_tables, sharding, platform), ("q", "kv", "kv", "d_sinks"))
    out, lse = _forward(program, mine, mine_tables, sharding, platform)
    return sharding.leave([out, lse], ("q", "lse")) if kind == "forward" else sharding.leave([out], ("q",))


def _forward(program, named, tables, sharding, platform):
    held = {name: named[name] for name in ("k", "v", "kv_ids") if name in named}
    accumulated = {}
    for step in range(len(tables)):
        arrays = program.arguments("forward", step, tables[step], **{**named, **held, **accumulated})
        accumulated = dict(
            zip(("out_acc", "lse_acc"), _transport.run(program.forward[step], arrays, "graph", platform))
        )
        if step + 1 < len(tables):
            held = _sent_on(held, accumulated, sharding)
    finish = program.arguments("finish", **accumulated, sinks=named.get("sinks"))
    return _transport.run(program.finish, finish, "graph", platform)


def _backward(program, named, tables, sharding, platform):
    held = {name: named[name] for name in ("k", "v", "kv_ids") if name in named}
    dq, with_keys = {}, {}
    for step in range(len(tables)):
        arrays = program.arguments("backward", step, tables[step], **{**named, **held, **dq, **with_keys})
        results = dict(
            zip(("dq_acc", "dk_acc", "dv_acc"), _transport.run(program.backward[step], arrays, "graph", platform))
        )
        if step + 1 < len(tables):
            held = _sent_on(held, results, sharding)
        dq = dict(dq_acc=results["dq_acc"])
        # dk and dv go on to the device that holds their keys next (home, after the last step)
        with_keys = _pass_on(sharding, dict(dk_acc=results["dk_acc"], dv_acc=results["dv_acc"]))
    grads = [dq["dq_acc"], with_keys["dk_acc"], with_keys["dv_acc"]]
    if "sinks" in named:
        sinks = program.arguments("sinks_grad", **named)
        grads += _transport.run(program.sinks_grad, sinks, "graph", platform)
    return grads


def _sent_on(held: dict, results: dict, sharding) -> dict:
    """The keys (and their ids) the next step holds, sent on from this device's once this step's
    `results` are done (an optimization barrier ties the held keys to them, in place).
    Otherwise XLA starts the sends early: every step's at once (a device then holding every
    shard of k and v), or the backward's first in the forward (whose sends compute the same),
    and each next shard is alive a step before it is used. In the programs libtpu compiles a
    send of keys overlaps no kernel either way (docs/tpu.md), so nothing is lost by waiting. The
    tie also keeps the next step's kernels from running ahead of this step's sums of dk and dv
    (which wait for those arriving), each step's gradients kept alive until then."""
    import torch_xla.core.xla_model as xm

    xm.optimization_barrier_([*held.values(), *results.values()])
    return _pass_on(sharding, held)


def _pass_on(sharding, tensors: dict) -> dict:
    """Inside the manual-sharding region: each device's tensors sent to the next device of its
    ring (one collective permute each)."""
    args = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors.values())
    return dict(zip(tensors, _permute_function(args, sharding.ring_pairs())(list(tensors.values()))))


# One in-graph function per shapes and devices: torch_xla then sees the same graph every step.
@functools.lru_cache(maxsize=policy.IN_GRAPH)
def _permute_function(args: tuple, pairs: tuple):
    return _compat.in_graph_function("ring_permute", jax_transport.permute_module(args, pairs))
