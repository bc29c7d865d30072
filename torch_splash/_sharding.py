"""torch_xla SPMD: splash attention shard-local, over batch and heads.

A Mosaic kernel cannot be partitioned by XLA, so the call runs in a manual-sharding region
(torch_xla's `enable_manual_sharding` / `disable_manual_sharding`, as its own flash attention
does): each device runs the single-device JAX program on its shard, traced at the local shapes.
No JAX `shard_map` and no JAX mesh are involved, so JAX's device numbering never has to agree
with torch_xla's.

What may be sharded: batch (axis 0) and heads (axis 1). Not the sequence: a query needs every key
of its row on its own device (the kv sequence may not be split), and the splash masks are laid
out over the whole query sequence; not head_dim, which the kernel contracts over. With GQA the
query and kv heads split by the same factor, which keeps each device's query heads with their kv
heads; a single kv head (MQA) is copied to each head shard.
"""

from __future__ import annotations

import dataclasses

import torch

from jax_core import SplashConstraintError

from . import _checks, _transport


def _axes(entry) -> tuple:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The mesh and the q/k/v partition spec of a call, checked against its shapes; equal for the
    same mesh object and spec (it keys the ops' call registry)."""

    mesh: object  # torch_xla.distributed.spmd.Mesh (compared by identity)
    batch: object  # mesh axis name(s) for dim 0, or None
    heads: object  # mesh axis name(s) for dim 1, or None

    def shards(self, entry) -> int:
        names = list(self.mesh.axis_names) if self.mesh.axis_names else []
        size = 1
        for axis in _axes(entry):
            index = names.index(axis) if isinstance(axis, str) else axis
            size *= self.mesh.mesh_shape[index]
        return size

    def local(self, batch: int, q_heads: int, kv_heads: int) -> tuple[int, int, int]:
        b, h = self.shards(self.batch), self.shards(self.heads)
        return batch // b, q_heads // h, kv_heads // h

    def spread_single_kv_head(self, call):
        """MQA sharded over heads: one copy of the kv head per head shard (an expand, whose
        gradient autograd sums), so each shard holds the kv head of its query heads."""
        h = self.shards(self.heads)
        if call.k.shape[1] != 1 or h == 1:
            return call
        b, _, length, _ = call.k.shape
        return dataclasses.replace(
            call, k=call.k.expand(b, h, length, call.k.shape[3]), v=call.v.expand(b, h, length, call.v.shape[3])
        )

    def spec(self, role: str) -> tuple:
        """Partition spec of a tensor by role: q (B, Hq, L, D), kv (B, Hkv, L, D), lse (B, Hq, L),
        ids (B, L), sinks (Hq,), and d_sinks: each device's sum over its own batch shard, given a
        leading axis of one so that the batch shards' partial sums line up along it."""
        return {
            "q": (self.batch, self.heads, None, None),
            "kv": (self.batch, self.heads, None, None),
            "lse": (self.batch, self.heads, None),
            "ids": (self.batch, None),
            "sinks": (self.heads,),
            "d_sinks": (self.batch, self.heads),
        }[role]

    def run(self, fn, tensors, in_roles, out_roles, platform: str) -> list[torch.Tensor]:
        """fn on each device's shard of `tensors`, in torch_xla's lazy graph; outputs are global."""
        import torch_xla.distributed.spmd as xs

        # Clones: annotating is in place, and the caller's tensors may be sharded otherwise (XLA
        # then reshards the clone, as shard_map reshards to its in_specs).
        local = [
            xs.enable_manual_sharding(t.clone(), self.spec(r), mesh=self.mesh).global_tensor
            for t, r in zip(tensors, in_roles)
        ]
        outs = _transport.run(fn, local, "graph", platform)
        return [self._global(o, r) for o, r in zip(outs, out_roles)]

    def _global(self, local: torch.Tensor, role: str) -> torch.Tensor:
        """A device's output back as the global tensor. The sinks' gradient sums over the batch:
        each device's kernel summed its own shard, so the shards' sums leave the manual region
        along a new batch axis and are added up outside it, where XLA can all-reduce them."""
        import torch_xla.distributed.spmd as xs

        if role == "d_sinks":
            local = local[None]
        spec = self.spec(role)
        out = xs.disable_manual_sharding(local, spec, self._full_shape(local, spec), mesh=self.mesh).global_tensor
        return out.sum(0) if role == "d_sinks" else out

    def _full_shape(self, t: torch.Tensor, spec) -> torch.Size:
        return torch.Size(d * self.shards(entry) for d, entry in zip(t.shape, spec))


def check(partition_spec, mesh, call, transport: str | None) -> Sharding | None:
    """The Sharding of a checked call, or None; SplashConstraintError for what cannot be sharded."""
    if partition_spec is None:
        if mesh is not None:
            raise SplashConstraintError("mesh= was given without partition_spec=: pass both (or neither).")
        return None
    spec = tuple(tuple(e) if isinstance(e, list) else e for e in partition_spec)  # hashable
    if call.unbatched or len(spec) != 4:
        raise SplashConstraintError(
            f"partition_spec={partition_spec!r}: give one entry per dimension of batched 4-D q, k, v "
            "(batch, heads, seq_len, head_dim)."
        )
    if spec[2] is not None or spec[3] is not None:
        raise SplashConstraintError(
            f"partition_spec={partition_spec!r} shards the sequence or head_dim: splash attention shards batch "
            "and heads only (every query needs all keys of its row on its device). "
            "Use (batch_axes, head_axes, None, None)."
        )
    if call.q.device.type != "xla":
        raise SplashConstraintError(f"partition_spec= shards torch_xla SPMD tensors; q is on {call.q.device}.")
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        raise SplashConstraintError("partition_spec= needs torch_xla SPMD: call torch_xla.runtime.use_spmd() first.")
    mesh = mesh if mesh is not None else xs.get_global_mesh()
    if mesh is None:
        raise SplashConstraintError("partition_spec= needs a mesh: pass mesh= or set one with xs.set_global_mesh().")
    if transport == "dlpack":
        raise SplashConstraintError(
            "transport='dlpack' cannot carry sharded tensors: leave transport unset (in-graph)."
        )
    names = list(mesh.axis_names) if mesh.axis_names else []
    for axis in _axes(spec[0]) + _axes(spec[1]):
        if isinstance(axis, str) and axis not in names:
            raise SplashConstraintError(f"partition_spec names mesh axis {axis!r}; the mesh has axes {names}.")
    batch, q_heads, kv_heads = call.q.shape[0], call.q.shape[1], call.k.shape[1]
    sharding = Sharding(mesh, spec[0], spec[1])
    b, h = sharding.shards(spec[0]), sharding.shards(spec[1])
    if batch % b:
        raise SplashConstraintError(f"batch size {batch} does not split over {b} batch shards ({spec[0]!r}).")
    if q_heads % h:
        raise SplashConstraintError(f"{q_heads} query heads do not split over {h} head shards ({spec[1]!r}).")
    if kv_heads % h and kv_heads != 1:
        raise SplashConstraintError(
            f"{kv_heads} kv heads do not split over {h} head shards ({spec[1]!r}): with GQA both head counts must "
            f"be multiples of the head shards (a single kv head is copied to each). Valid head shard counts: "
            f"{_checks.common_divisors(q_heads, kv_heads)}."
        )
    return sharding
