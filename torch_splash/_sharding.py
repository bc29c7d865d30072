"""torch_xla SPMD: splash attention shard-local, over batch, heads and the query sequence.

A Mosaic kernel cannot be partitioned by XLA, so the call runs in a manual-sharding region
(torch_xla's `enable_manual_sharding` / `disable_manual_sharding`, as its own flash attention
does): each device runs the single-device JAX program on its shard, traced at the local shapes.
No JAX `shard_map` and no JAX mesh are involved, so JAX's device numbering never has to agree
with torch_xla's.

What may be sharded: batch (axis 0), heads (axis 1) and the query sequence (axis 2); not
head_dim, which the kernel contracts over. With GQA the query and kv heads split by the same
factor, which keeps each device's query heads with their kv heads; a single kv head (MQA) is copied
to each head shard. With the query sequence sharded, each device attends its own query rows to
every key: k, v and the kv segment ids reach every device of the sequence axis whole (XLA gathers
them), q, the output, the logsumexp and dq stay sharded, and each device's dk, dv (and d_sinks)
are partial sums that leave the manual region along an axis of their own and are summed outside
it. The block tables and query positions of every shard are inputs sharded along the sequence
axis (per-head block tables along the heads too), so that one program serves every device. The
"balanced" layout gives each device two mirrored chunks of the sequence (shard s: chunks s and
2S-1-s of 2S), so that causal work is even; the devices exchange halves of their shards on
entering the manual region and exchange them back on leaving it, so the caller's tensors stay in
order. The kv sequence is never sharded on its own: a k or v the caller sharded
along it, with the query sequence whole, is refused.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

import numpy as np
import torch

import torch_splash_jax
from torch_splash_jax import SplashConstraintError, policy
from torch_splash_jax import transport as jax_transport

from . import _checks, _compat, _transport

# How each named input of a program is sharded under SPMD (`Sharding.spec`).
ROLES = {"q": "q", "k": "kv", "v": "kv", "q_ids": "q_ids", "kv_ids": "kv_ids", "sinks": "sinks"}
ROLES.update(out="q", lse="lse", d_out="q")


def table_role(axes: tuple[str, ...]) -> str:
    """The role of a program's table split along `axes` (`Program.table_axes`)."""
    return "head_tables" if "heads" in axes else "tables"


def _axes(entry) -> tuple:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The mesh and the q/k/v partition spec of a call, checked against its shapes; equal for the
    same mesh object and spec. Crosses the custom ops as `text()`."""

    mesh: object  # torch_xla.distributed.spmd.Mesh (compared by identity)
    batch: object  # mesh axis name(s) for dim 0, or None
    heads: object  # mesh axis name(s) for dim 1, or None
    seq: object = None  # mesh axis name(s) for dim 2 of q, or None
    layout: str = "contiguous"  # of the query sequence over its shards: "contiguous" or "balanced"
    # "all_gather": k and v reach every device of the sequence axis whole; "ring": they are sharded
    # like q (in its layout) and passed around the sequence axis (torch_splash._ring).
    context_parallel: str = "all_gather"

    @property
    def ring(self) -> bool:
        return self.context_parallel == "ring"

    @property
    def q_shards(self) -> int:
        return self.shards(self.seq)

    def shards(self, entry) -> int:
        names = list(self.mesh.axis_names) if self.mesh.axis_names else []
        size = 1
        for axis in _axes(entry):
            index = names.index(axis) if isinstance(axis, str) else axis
            size *= self.mesh.mesh_shape[index]
        return size

    def text(self) -> str:
        """The sharding as text (`from_text` reads it back), the mesh as its device ids, shape and axis names."""
        names = None if self.mesh.axis_names is None else tuple(self.mesh.axis_names)
        mesh = tuple(int(i) for i in np.asarray(self.mesh.device_ids).reshape(-1)), tuple(self.mesh.mesh_shape), names
        return repr((mesh, self.batch, self.heads, self.seq, self.layout, self.context_parallel))

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

    def spec(self, role: str, ndim: int = 0) -> tuple:
        """Partition spec of a tensor by role: q (B, Hq, Lq, D), kv (B, Hkv, Lkv, D), lse (B, Hq,
        Lq), q_ids (B, Lq), kv_ids (B, Lkv), sinks (Hq,), tables (S, ...) (one slice per sequence
        shard), head_tables (S, Hq, ...) (per-head block tables: one slice per sequence shard and
        head shard); and the partial sums, given a leading axis of one on each device so that the
        shards' sums line up along it: d_sinks (over batch and sequence shards), dkv (over
        sequence shards)."""
        if role == "tables":
            return (self.seq,) + (None,) * (ndim - 1)
        if role == "head_tables":
            return (self.seq, self.heads) + (None,) * (ndim - 2)
        kv_seq = self.seq if self.ring else None
        return {
            "q": (self.batch, self.heads, self.seq, None),
            "kv": (self.batch, self.heads, kv_seq, None),
            "lse": (self.batch, self.heads, self.seq),
            "q_ids": (self.batch, self.seq),
            "kv_ids": (self.batch, kv_seq),
            "sinks": (self.heads,),
            "d_sinks": (_joined(self.batch, self.seq), self.heads),
            "dkv": (self.seq, self.batch, self.heads, None, None),
        }[role]

    def run(self, fn, tensors, in_roles, out_roles, platform: str) -> list[torch.Tensor]:
        """fn on each device's shard of `tensors`, in torch_xla's lazy graph; outputs are global."""
        outs = _transport.run(fn, self.enter(tensors, in_roles), "graph", platform)
        return self.leave(outs, out_roles)

    def placed(self, table: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """A program's table (`Program.table_axes`) sharded as its role says, each device holding
        its own slice from the start."""
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(table, self.mesh, self.spec(table_role(axes), table.dim()))
        return table

    def enter(self, tensors, roles) -> list[torch.Tensor]:
        """Each device's shard of `tensors` (by role), entering the manual-sharding region (in the
        sequence layout: `_relaid`)."""
        import torch_xla.distributed.spmd as xs

        # Fresh tensors: annotating is in place, and the caller's tensors may be sharded otherwise
        # (XLA then reshards the copy, as shard_map reshards to its in_specs). Not clone(): the
        # clone of a materialised tensor keeps its sharding, and annotating it anew fails.
        local = []
        for t, r in zip(tensors, roles):
            fresh = t | False if t.dtype == torch.bool else t + 0  # a mask's stored blocks stay bool
            local.append(xs.enable_manual_sharding(fresh, self.spec(r, t.dim()), mesh=self.mesh).global_tensor)
        return self._relaid(local, roles, to_balanced=True)

    def leave(self, outs, roles) -> list[torch.Tensor]:
        """Devices' outputs (by role) as global tensors, leaving the manual-sharding region (in the
        caller's sequence order)."""
        outs = self._relaid(list(outs), roles, to_balanced=False)
        return [self._global(o, r) for o, r in zip(outs, roles)]

    def _relaid(self, local: list[torch.Tensor], roles, to_balanced: bool) -> list[torch.Tensor]:
        """In the balanced layout, the shards of sequence-sharded tensors exchanged between the
        devices of the sequence axis, from the caller's order into the balanced one or back. The
        caller's tensors stay in order: only the manual region sees the balanced layout. Halves
        move by explicit permutes, since XLA's SPMD partitioner, left to reorder global tensors,
        starts many small permutes at once and holds them all. Tensors entering move one after
        another, since all of them exist before the exchange and moving them at once keeps each
        alive twice; tensors leaving move as each is ready (measurements: docs/design.md, SPMD)."""
        if self.layout != "balanced":
            return local
        # the sequence's dim in each tensor whose rows are sequence rows, as `spec` shards it (kv
        # and kv_ids only in a ring); tables hold one slice per device and stay as they are
        dims = {
            i: self.spec(r).index(self.seq)
            for i, r in enumerate(roles)
            if r in ("q", "lse", "q_ids", "kv", "kv_ids") and self.seq in self.spec(r)
        }
        if not dims:
            return local
        args = tuple((tuple(local[i].shape), str(local[i].dtype).removeprefix("torch.")) for i in dims)
        fn = _exchange_function(args, tuple(dims.values()), self._balancing_moves(to_balanced), in_turn=to_balanced)
        for i, t in zip(dims, fn([local[i] for i in dims])):
            local[i] = t
        return local

    def _balancing_moves(self, to_balanced: bool) -> tuple:
        """`transport.exchange_module`'s moves between the caller's order (device d holds chunks 2d
        and 2d+1 of the sequence's 2S) and the balanced layout (`balanced_chunk_order`, which
        keeps each chunk in its half), on every ring of the mesh: for each half, one move from the
        devices at even places of the sequence axis and one from those at odd places. Neither is
        a cycle of devices; measured with the TPU compiler, moving a half by one permutation of
        all the devices instead made libtpu reserve memory beyond its buffers (the 256K-token step
        of bench_context_parallel.py over v5e:2x2: 3.37 GiB per chip, against 3.12 this way)."""
        order = torch_splash_jax.balanced_chunk_order(self.q_shards)
        balanced = {c: place // 2 for place, c in enumerate(order)}
        moves: dict[tuple[int, int], list] = {}
        for ring in self._rings():
            for c in order:
                source, target = (c // 2, balanced[c]) if to_balanced else (balanced[c], c // 2)
                moves.setdefault((c % 2, source % 2), []).append((int(ring[source]), int(ring[target])))
        return tuple((half, tuple(pairs)) for (half, _), pairs in sorted(moves.items()))

    def _rings(self) -> np.ndarray:
        """(rings, S) device ids: the devices of the sequence axis in shard order, one row for each
        combination of the other axes' indices."""
        names = list(self.mesh.axis_names) if self.mesh.axis_names else []
        seq = [names.index(a) if isinstance(a, str) else a for a in _axes(self.seq)]
        ids = np.asarray(self.mesh.device_ids).reshape(self.mesh.mesh_shape)
        others = [i for i in range(ids.ndim) if i not in seq]
        return ids.transpose(others + seq).reshape(-1, self.q_shards)  # shard order: row-major over seq axes

    def ring_pairs(self) -> tuple[tuple[int, int], ...]:
        """(source, target) device ids that pass a shard one place onwards along the sequence
        axis, on every ring of the mesh."""
        return tuple((int(r[i]), int(r[(i + 1) % len(r)])) for r in self._rings() for i in range(len(r)))

    def _global(self, local: torch.Tensor, role: str) -> torch.Tensor:
        """A device's output back as the global tensor. Gradients that sum over rows other devices
        hold (the sinks' over the batch and the sequence, dk and dv over the query sequence) are
        each device's partial sums: they leave the manual region along a new leading axis and are
        added up outside it, where XLA can all-reduce them."""
        import torch_xla.distributed.spmd as xs

        if role == "kv" and self.seq is not None and not self.ring:
            role = "dkv"
        partial = role in ("d_sinks", "dkv")
        if partial:
            local = local[None]
        spec = self.spec(role)
        out = xs.disable_manual_sharding(local, spec, self._full_shape(local, spec), mesh=self.mesh).global_tensor
        return out.sum(0) if partial else out

    def _full_shape(self, t: torch.Tensor, spec) -> torch.Size:
        return torch.Size(d * self.shards(entry) for d, entry in zip(t.shape, spec))


# One in-graph function per shapes and devices: torch_xla then sees the same graph every step.
@functools.lru_cache(maxsize=policy.IN_GRAPH)
def _exchange_function(args: tuple, dims: tuple, moves: tuple, in_turn: bool):
    return _compat.in_graph_function("sequence_exchange", jax_transport.exchange_module(args, dims, moves, in_turn))


@functools.lru_cache(maxsize=policy.SHARDINGS)
def from_text(text: str) -> Sharding:
    """The sharding `Sharding.text` wrote; one object per text while it is cached."""
    import torch_xla.distributed.spmd as xs

    (ids, shape, names), *spec = ast.literal_eval(text)
    return Sharding(xs.Mesh(np.array(ids), shape, names), *spec)


def _joined(*entries):
    axes = sum((_axes(e) for e in entries), ())
    return None if not axes else axes[0] if len(axes) == 1 else axes


def check(
    partition_spec, mesh, call, transport: str | None, sequence_layout: str | None = None, context_parallel=None
) -> Sharding | None:
    """The Sharding of a checked call, or None; SplashConstraintError for what cannot be sharded."""
    torch_splash_jax.check_sequence_layout(sequence_layout)
    torch_splash_jax.check_context_parallel(context_parallel)
    if partition_spec is None:
        _check_unsharded(mesh, sequence_layout, context_parallel)
        return None
    spec, mesh = _spec_and_mesh(partition_spec, mesh, call, transport)
    sharding = Sharding(
        mesh, spec[0], spec[1], spec[2], sequence_layout or "contiguous", context_parallel or "all_gather"
    )
    if sequence_layout == "balanced" and spec[2] is None:
        raise SplashConstraintError(
            f"sequence_layout='balanced' with partition_spec={partition_spec!r}, which does not shard the query "
            "sequence: name a mesh axis for dim 2, or leave sequence_layout unset."
        )
    where = (
        "leaves the query sequence whole" if spec[2] is None else f"shards the sequence over {spec[2]!r}, of 1 device"
    )
    torch_splash_jax.check_context_parallel(
        context_parallel, sharding.q_shards, f"with partition_spec={partition_spec!r}, which {where}"
    )
    _check_shards_divide(sharding, call)
    if spec[2] is None:
        _check_kv_sequence_whole(call, partition_spec)
    return sharding


def _check_unsharded(mesh, sequence_layout: str | None, context_parallel: str | None) -> None:
    """The options that need a partition_spec, refused without one."""
    if context_parallel == "ring":
        raise SplashConstraintError(
            "context_parallel='ring' passes k and v around the devices the query sequence is sharded over: pass "
            "a partition_spec that shards it, e.g. (None, None, 'seq', None), and its mesh."
        )
    if mesh is not None:
        raise SplashConstraintError("mesh= was given without partition_spec=: pass both (or neither).")
    if sequence_layout == "balanced":
        raise SplashConstraintError(
            "sequence_layout='balanced' lays the query sequence out over its shards: pass a partition_spec "
            "that shards it, e.g. (None, None, 'seq', None)."
        )


def _spec_and_mesh(partition_spec, mesh, call, transport: str | None) -> tuple[tuple, object]:
    """partition_spec as a hashable 4-tuple, and the mesh it names (the global one by default), once
    they, the tensors and the transport are known to make an SPMD call."""
    spec = tuple(tuple(e) if isinstance(e, list) else e for e in partition_spec)  # hashable
    if call.unbatched or len(spec) != 4:
        raise SplashConstraintError(
            f"partition_spec={partition_spec!r}: give one entry per dimension of batched 4-D q, k, v "
            "(batch, heads, seq_len, head_dim)."
        )
    if spec[3] is not None:
        raise SplashConstraintError(
            f"partition_spec={partition_spec!r} shards head_dim, which the kernels contract over: shard batch, "
            "heads and the query sequence, e.g. ('data', 'model', 'seq', None)."
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
    for axis in _axes(spec[0]) + _axes(spec[1]) + _axes(spec[2]):
        if isinstance(axis, str) and axis not in names:
            raise SplashConstraintError(f"partition_spec names mesh axis {axis!r}; the mesh has axes {names}.")
    return spec, mesh


def _check_shards_divide(sharding: Sharding, call) -> None:
    """Batch and both head counts split evenly over their shards (a single kv head is copied)."""
    batch, q_heads, kv_heads = call.q.shape[0], call.q.shape[1], call.k.shape[1]
    b, h = sharding.shards(sharding.batch), sharding.shards(sharding.heads)
    if batch % b:
        raise SplashConstraintError(f"batch size {batch} does not split over {b} batch shards ({sharding.batch!r}).")
    if q_heads % h:
        raise SplashConstraintError(f"{q_heads} query heads do not split over {h} head shards ({sharding.heads!r}).")
    if kv_heads % h and kv_heads != 1:
        raise SplashConstraintError(
            f"{kv_heads} kv heads do not split over {h} head shards ({sharding.heads!r}): with GQA both head counts "
            "must be multiples of the head shards (a single kv head is copied to each). Valid head shard counts: "
            f"{_checks.common_divisors(q_heads, kv_heads)}."
        )


def _check_kv_sequence_whole(call, partition_spec) -> None:
    """With the query sequence whole, k and v must not be sharded along theirs: refused, not gathered."""
    for name, t in (("k", call.k), ("v", call.v)):
        tiles = _sequence_tiles(t)
        if tiles > 1:
            raise SplashConstraintError(
                f"{name} is sharded along its sequence ({tiles} ways) but partition_spec={partition_spec!r} "
                "leaves the query sequence whole: splash cannot shard the kv sequence alone (each query row "
                "needs every key). Shard the query sequence too (name a mesh axis for dim 2, and k and v are "
                f"gathered), or replicate {name}'s sequence before the call."
            )


def _sequence_tiles(t: torch.Tensor) -> int:
    """How many ways torch_xla's sharding annotation of a 4-D tensor splits dim 2, its sequence (1
    when it has none: a tensor computed in the pending graph has none until it runs)."""
    found = re.search(r"devices=\[([\d,]+)\]", _compat.sharding_spec(t))
    return int(found.group(1).split(",")[2]) if found else 1
