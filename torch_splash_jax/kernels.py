"""The splash programs the bridge runs: one jitted forward and one jitted backward per plan.

forward(q, k, v[, q_ids, kv_ids][, sinks]) -> (out, logsumexp)
    scales k (the kernel applies no softmax scale), pads to the plan's lengths and runs the
    Pallas forward once, under `jax.vjp`. sinks (Hq,): one logit per query head that every row
    also normalises over (gpt-oss), when the plan has them.
infer(q, k, v[, q_ids, kv_ids][, sinks]) -> out
    the same without gradients: where no row can lack a visible key (no segment ids, a mask
    that keeps every row non-empty) it runs the forward kernel without residuals, which in
    interpret mode is about 10% faster than the one that also writes logsumexp.
backward(q, k, v[, q_ids, kv_ids][, sinks], out, logsumexp, d_out) -> (dq, dk, dv[, dsinks])
    rebuilds the vjp function and runs only the dq and dkv kernels.

The vjp function's residuals are the kernel's inputs, its output, its logsumexp and the block
tables. Only logsumexp is new: the caller already holds q, k, v and out, and the block tables are
constants of the program or inputs the caller holds too. So the caller carries two arrays from
forward to backward and nothing is stored twice; the backward re-derives the scaled, padded kernel
inputs (elementwise work, not the forward kernel) and rebuilds the residual tree from them.

Rows with no visible key: the kernel returns garbage there (NaN, or a uniform average over masked
logits). Their logsumexp is -inf or near the kernel's mask value, so we detect them from it and
return 0 with zero gradients, as SDPA does.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, policy
from . import masks as _masks
from . import tables as _tables
from .plan import Plan

_splash, _, _mask_info = compat.splash_modules()

# Instrumentation the tests read (a repeated call traces nothing): traces, not calls, of each
# program body. Not part of the package's names.
TRACES: collections.Counter = collections.Counter()

# A row whose logsumexp is at or below this saw only masked logits (DEFAULT_MASK_VALUE is about -2.4e38).
EMPTY_ROW_LSE = float(_splash.DEFAULT_MASK_VALUE / 2)


def row_has_keys(lse):
    """Whether each row saw an allowed key: a row without one has a logsumexp near the kernels'
    mask value, or -inf (a skipped q block, the ring's accumulators before any key)."""
    return lse > EMPTY_ROW_LSE


def scaled(x, scale: float):
    """x times the softmax scale, computed in float32, in x's dtype: the keys the kernels take
    (they apply no scale) and the gradient of the unscaled keys."""
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


class Program:
    """The jitted forward, infer and backward of one plan, and what they take.

    Each takes flat arrays in the order `signature(kind)` names them (the one place that order is
    written): q, k, v; q_ids, kv_ids when the plan has segment ids; sinks when it has them; the
    block tables of a sharded plan ("table0", ...: `tables()`, every device's, which the caller
    splits as `table_axes()` says) or of a mask read from stored blocks (its tables and partial
    blocks); and for the backward out, lse, d_out. `arguments(kind, ...)`
    puts named tensors (torch's or JAX's) in that order. The forward returns (out, lse), the
    infer out, the backward (dq, dk, dv[, d_sinks]).
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        # Plans sharded along the query sequence, or over heads with one mask per head, take
        # their block tables (and query positions) as inputs, one slice per device, since every
        # device runs this same program: `tables()` gives them, `table_axes()` their sharding.
        self.sharded = plan.q_shards > 1 or plan.head_shards > 1
        # An unsharded mask read from stored blocks (data, or one mask per head) takes its tables
        # and partial blocks as inputs too, in shapes rounded up (`tables.partial_mask_info`): a
        # mask with other contents in the same shapes (documents packed anew) runs the same jitted
        # functions, so neither JAX nor torch_xla compiles again.
        self.stored = not self.sharded and _masks.shared_structured_mask(plan.mask) is None
        self.takes_tables = self.sharded or self.stored
        self._infos = _table_infos(plan, rounded=self.stored) if self.takes_tables else None
        self._table_arrays = self._flat_tables() if self.takes_tables else []
        # A sharded plan's stored partial blocks are the same on every device: constants, made
        # outside any trace.
        self._partial_blocks = [
            None if info is None or info.partial_mask_blocks is None else jnp.asarray(info.partial_mask_blocks)
            for info in (self._infos[1] if self.sharded else ())
        ]
        # A mask with no allowed pair at all gets no kernel (JAX's table builder asserts on it,
        # and no output block would ever be written): the answer is 0 with zero gradients.
        self.no_pairs = not (self._infos[1][0].block_mask.any() if self.takes_tables else _has_allowed_pair(plan))
        # Rows with no visible key need zeroing; without segment ids, most masks cannot have any.
        # A ring step's rows may see none of the keys it holds, but its backward is given the
        # merged output and logsumexp: only rows that see no key in the whole call matter there
        # (guarding the others cost a d_out-sized copy alive through the ring's backward).
        self.call_rows_may_be_empty = plan.has_segment_ids or plan.mask.may_empty_rows()
        self.rows_may_be_empty = self.call_rows_may_be_empty or plan.ring
        self._kernel = None if self.no_pairs or self.takes_tables else _build_kernel(plan)
        self._layout = None  # _residual_layout
        self.forward = jax.jit(self.forward_body)
        self.backward = jax.jit(self.backward_body)
        self.infer = jax.jit(self.infer_body)
        if self.stored:  # the first program of these shapes has traced them: its functions serve this one
            shared = _SHARED.setdefault(self._shapes(), self)
            self.forward, self.backward, self.infer = shared.forward, shared.backward, shared.infer

    def _shapes(self) -> tuple:
        """What a stored-block program's jitted functions depend on: the plan but for its mask,
        what the mask decides about rows and pairs, and its tables' shapes and dtypes."""
        fields = tuple(getattr(self.plan, f.name) for f in dataclasses.fields(self.plan) if f.name != "mask")
        tables = tuple((t.shape, t.dtype.str) for t in self._table_arrays)
        return fields, self.call_rows_may_be_empty, self.no_pairs, tables

    @property
    def kernel(self):
        """The splash kernel with this plan's block tables as constants (what the TPU time
        estimate reads); None for a sharded plan, and without allowed pairs."""
        if self._kernel is None and self.stored and not self.no_pairs:
            self._kernel = _kernel(self.plan, [None if i is None else _only_shard(i) for i in self._infos[1]], None)
        return self._kernel

    def _pad(self, x, axis: int, length: int):
        extra = length - x.shape[axis]
        if not extra:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    def _kernel_inputs(self, q, k, v):
        # The kernel applies no softmax scale. Scaling k rather than q gives the same logits, and
        # the kernel's dq is then already the caller's; with GQA k is also the smaller tensor.
        p = self.plan
        k = scaled(k, p.scale)
        q = self._pad(q, 2, p.q_len_padded)
        if p.is_mqa:  # the MQA kernel takes k and v without a head axis
            k, v = k[:, 0], v[:, 0]
        k = self._pad(k, k.ndim - 2, p.kv_len_padded)
        v = self._pad(v, v.ndim - 2, p.kv_len_padded)
        return q, k, v

    def tables(self) -> list[np.ndarray]:
        """A sharded program's extra inputs, the tables of every device: the query positions
        (S, P) of a mask function, then each kernel's data_next, mask_next (when partial blocks
        are stored) and block_mask (S, H or 1, q blocks, width). S is the query-sequence shards,
        H all query heads (per-head tables only)."""
        return self._table_arrays

    def _flat_tables(self) -> list[np.ndarray]:
        positions, infos = self._infos
        tables = [] if positions is None else [positions]
        for info in infos:
            if info is not None:
                tables += _per_device(info)
                if self.stored and info.partial_mask_blocks is not None:
                    tables.append(info.partial_mask_blocks[None])  # the leading shard axis every table has
        return tables

    def table_axes(self) -> list[tuple[str, ...]]:
        """What each of `tables()` is split along, axis by axis from the first: ("seq",) or
        ("seq", "heads"); a device's slice keeps a leading axis of 1 (`device_tables`)."""
        if self.stored:  # one device's: every device holds them whole
            return [("seq",)] * len(self.tables())
        return [("seq", "heads") if t.ndim == 4 and t.shape[1] > 1 else ("seq",) for t in self.tables()]

    def device_tables(self, seq_shard: int, head_shard: int = 0) -> list[np.ndarray]:
        """The slice of `tables()` the device holding that sequence shard and head shard takes."""
        heads = slice(head_shard * self.plan.num_q_heads, (head_shard + 1) * self.plan.num_q_heads)
        return [
            t[seq_shard : seq_shard + 1, heads] if "heads" in axes else t[seq_shard : seq_shard + 1]
            for t, axes in zip(self.tables(), self.table_axes())
        ]

    def blocks_per_shard(self) -> list[int]:
        """For a sequence-sharded program: the forward kernel's blocks each shard computes (the
        non-empty entries of its block tables, every head's where heads have their own), the
        measure of how evenly causal work is spread."""
        masks = self._infos[1][0].block_mask
        return [int(n) for n in (masks != 0).reshape(self.plan.q_shards, -1).sum(axis=1)]

    def _kernel_for(self, tables):
        """The kernel, and the arrays of its block tables the vjp may keep: a sharded program's
        are this device's slice of its inputs (leading axis 1), as are a stored-block mask's (its
        partial blocks too); the others' are constants."""
        if not self.takes_tables:
            return self.kernel, []
        positions, infos = self._infos
        given = iter(tables)
        q_sequence = None if positions is None else next(given)[0]
        mine, kept = [], [] if q_sequence is None else [q_sequence]
        for info, partial_blocks in zip(infos, self._partial_blocks or [None] * len(infos)):
            if info is None:
                mine.append(None)
                continue
            data_next, *mask_next, block_mask = (next(given)[0] for _ in _per_device(info))
            kept += [data_next, *mask_next, block_mask]
            if self.stored and info.partial_mask_blocks is not None:
                partial_blocks = next(given)[0]
                kept.append(partial_blocks)
            mine.append(compat.mask_info(data_next, (mask_next or [None])[0], block_mask, partial_blocks, q_sequence))
        mask_function = None if positions is None else _sharded_bound_mask(self.plan).mask_function
        return _kernel(self.plan, mine, mask_function), kept

    def devices_with_work(self) -> list[bool]:
        """For a sharded program: whether each sequence shard's tables have a block to compute."""
        if self.no_pairs:
            return [False] * self.plan.q_shards
        block_mask = self._infos[1][0].block_mask
        return [bool(b) for b in (block_mask != 0).reshape(block_mask.shape[0], -1).any(axis=1)]

    def has_work(self, tables):
        """Whether this device's slice of a sharded program's tables has a block to compute: a
        traced bool, or True when every device has one (a ring step where a device has none skips
        its kernels there)."""
        if all(self.devices_with_work()):
            return True
        positions, (forward, *_) = self._infos
        block_mask = tables[(positions is not None) + len(_per_device(forward)) - 1]
        return jnp.any(block_mask != 0)

    def _attend(self, kernel, q, k, v, segment_ids, sinks=None):
        # vmapped over batch; sinks, closed over, are shared by every batch element
        return jax.vmap(lambda q, k, v, ids: compat.call_splash_kernel(kernel, q, k, v, ids, sinks))(
            q, k, v, segment_ids
        )

    def signature(self, kind: str) -> tuple[str, ...]:
        """The names of the arrays `kind` ("forward", "infer" or "backward") takes, in order."""
        p = self.plan
        names = [
            "q",
            "k",
            "v",
            *(("q_ids", "kv_ids") if p.has_segment_ids else ()),
            *(("sinks",) if p.has_sinks else ()),
        ]
        names += [f"table{i}" for i in range(len(self._table_arrays))]
        return tuple(names + (["out", "lse", "d_out"] if kind == "backward" else []))

    def arguments(self, kind: str, tables=(), **named) -> list:
        """The named arrays (q=..., k=..., ...; absent options may be given as None) and the block
        tables, in the order `kind` takes them."""
        named.update({f"table{i}": t for i, t in enumerate(tables)})
        return [named[name] for name in self.signature(kind)]

    def _named(self, kind: str, arrays) -> tuple:
        """(q, k, v, segment ids or None, sinks or None, tables, the rest by name) of `kind`'s arrays."""
        a = dict(zip(self.signature(kind), arrays, strict=True))
        ids = (a["q_ids"], a["kv_ids"]) if "q_ids" in a else None
        tables = [a[f"table{i}"] for i in range(len(self._table_arrays))]
        return a["q"], a["k"], a["v"], ids, a.get("sinks"), tables, a

    @staticmethod
    def _residual_sources(q, k, v, sinks, segment_ids) -> list:
        """The kernel inputs a vjp residual may be, in the order `_residual_layout` indexes them."""
        return [q, k, v, *(() if sinks is None else (sinks,)), *(segment_ids or ())]

    def _segment_ids(self, ids):
        if not ids:
            return None
        q_ids, kv_ids = ids
        return _splash.SegmentIds(
            q=self._pad(q_ids.astype(jnp.int32), 1, self.plan.q_len_padded),
            kv=self._pad(kv_ids.astype(jnp.int32), 1, self.plan.kv_len_padded),
        )

    def _vjp(self, q, k, v, ids, sinks, tables):
        """The kernel's output, logsumexp, vjp leaves and tree, and the kernel inputs."""
        q, k, v = self._kernel_inputs(q, k, v)
        segment_ids = self._segment_ids(ids)
        kernel, table_arrays = self._kernel_for(tables)
        primals = (q, k, v) if sinks is None else (q, k, v, sinks)
        out, vjp = jax.vjp(lambda q, k, v, *s: self._attend(kernel, q, k, v, segment_ids, *s), *primals)
        leaves, tree = jax.tree.flatten(vjp)
        lse = compat.logsumexp_residual(leaves, out)
        return out, lse, leaves, tree, self._residual_sources(q, k, v, sinks, segment_ids) + table_arrays

    def _finish(self, out, lse):
        """Rows with no visible key give 0; padded query rows are dropped."""
        if self.rows_may_be_empty:
            out = jnp.where(row_has_keys(lse)[..., None], out, 0).astype(out.dtype)
        return out[:, :, : self.plan.q_len]

    def _nothing_visible(self, q, v):
        p = self.plan
        out = jnp.zeros(q.shape[:2] + (p.q_len, v.shape[-1]), q.dtype)
        return out, jnp.full(q.shape[:2] + (p.q_len_padded,), -jnp.inf, jnp.float32)

    def forward_body(self, *arrays):
        """What `forward` jits (a ring traces it into its steps' programs)."""
        TRACES["forward"] += 1
        q, k, v, ids, sinks, tables, _ = self._named("forward", arrays)
        if self.no_pairs:
            return self._nothing_visible(q, v)
        out, lse, *_ = self._vjp(q, k, v, ids, sinks, tables)
        return self._finish(out, lse), lse

    def _residual_layout(self, forward_arrays) -> tuple[list, object]:
        """Where each of the kernel's vjp residuals comes from (a kernel input, the output, the
        logsumexp, or a constant block table, concrete), and the vjp's tree: learnt by tracing the
        forward abstractly, once (a plan fixes every shape)."""
        if self._layout is None:
            found = []

            def trace(*arrays):
                q, k, v, ids, sinks, tables, _ = self._named("forward", arrays)
                out, lse, leaves, tree, inputs = self._vjp(q, k, v, ids, sinks, tables)

                def source(leaf):
                    for i, x in enumerate(inputs):
                        if x is leaf:
                            return ("input", i)
                    return ("out", None) if leaf is out else ("lse", None) if leaf is lse else ("const", leaf)

                found.append(([source(leaf) for leaf in leaves], tree))
                return out

            jax.eval_shape(trace, *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in forward_arrays])
            (sources, tree), kinds = found[0], [kind for kind, _ in found[0][0]]
            assert kinds.count("out") == kinds.count("lse") == 1, kinds
            assert not any(kind == "const" and compat.is_tracer(value) for kind, value in sources), kinds
            self._layout = sources, tree
        return self._layout

    def infer_body(self, *arrays):
        TRACES["infer"] += 1
        q, k, v, ids, sinks, tables, _ = self._named("infer", arrays)
        if self.no_pairs:
            return self._nothing_visible(q, v)[0]
        if self.rows_may_be_empty:
            out, lse, *_ = self._vjp(q, k, v, ids, sinks, tables)
            return self._finish(out, lse)
        kernel, _ = self._kernel_for(tables)
        return self._attend(kernel, *self._kernel_inputs(q, k, v), None, sinks)[:, :, : self.plan.q_len]

    def backward_body(self, *arrays):
        """What `backward` jits (a ring traces it into its steps' programs)."""
        TRACES["backward"] += 1
        p = self.plan
        q, k, v, ids, sinks, tables, named = self._named("backward", arrays)
        out, lse, d_out = named["out"], named["lse"], named["d_out"]
        if self.no_pairs:
            zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
            return zeros if sinks is None else (*zeros, jnp.zeros_like(sinks))
        sources, tree = self._residual_layout(arrays[: len(self.signature("forward"))])
        q, k, v = self._kernel_inputs(q, k, v)
        segment_ids = self._segment_ids(ids)
        inputs = self._residual_sources(q, k, v, sinks, segment_ids) + self._kernel_for(tables)[1]
        # The caller's out is the kernel's, zeroed where a row sees no key; the kernel uses it only
        # in rowsum(out * d_out), and d_out is zeroed on those rows too.
        if self.call_rows_may_be_empty:
            # A row that saw no key has logsumexp -inf (its q block was skipped) or about the mask
            # value; the dq/dkv kernels recompute p = exp(logit - logsumexp) from it, which is inf
            # there, and inf * 0 is NaN whatever d_out is. With +inf, p is 0 on those rows.
            has_keys = row_has_keys(lse)[..., None]
            lse = jnp.where(has_keys[..., 0], lse, jnp.inf)
        found = {"out": self._pad(out, 2, p.q_len_padded), "lse": lse}
        leaves = [
            inputs[value] if kind == "input" else found[kind] if kind in found else value for kind, value in sources
        ]
        d_out = self._pad(d_out, 2, p.q_len_padded)
        if self.call_rows_may_be_empty:
            d_out = jnp.where(has_keys, d_out, 0).astype(d_out.dtype)
        dq, dk, dv, *d_sinks = jax.tree.unflatten(tree, leaves)(d_out)
        if self.call_rows_may_be_empty:
            dq = jnp.where(has_keys, dq, 0).astype(dq.dtype)
        dq = dq[:, :, : p.q_len]
        dk = scaled(dk[..., : p.kv_len, :], p.scale)
        dv = dv[..., : p.kv_len, :]
        if p.is_mqa:
            dk, dv = dk[:, None], dv[:, None]
        return (dq, dk, dv, *d_sinks)


# Stored-block programs by what their jitted functions depend on (`Program._shapes`): a program
# whose mask has other contents in the same shapes takes the functions of the first, which JAX
# has traced and compiled.
_SHARED = policy.Recent(policy.STORED_SHAPES)
forget_shared_programs = _SHARED.clear


def _jax_block_sizes(plan: Plan) -> _splash.BlockSizes:
    fields = plan.block_sizes()
    for layout in ("q_layout", "k_layout", "v_layout"):
        if layout in fields:
            fields[layout] = _splash.QKVLayout[fields[layout]]
    return _splash.BlockSizes(**fields)


def _build_kernel(plan: Plan) -> _splash.SplashAttentionKernel:
    """The kernel of an unsharded plan, its block tables constants of the program."""
    shared = _masks.shared_structured_mask(plan.mask)
    if shared is None:
        _, infos = _table_infos(plan)
        return _kernel(plan, [None if info is None else _only_shard(info) for info in infos], None)
    bound = _masks.bind(shared, 1, plan.q_len_padded, plan.kv_len_padded, plan.kv_len).masks[0]
    mask_function = getattr(bound, "mask_function", None)
    infos = [
        None
        if layout is None
        else jax.tree.map(
            jnp.array,
            _tables.mask_info(
                shared, plan.q_len_padded, plan.kv_len_padded, plan.kv_len, *layout, mask_function is not None
            ),
        )
        for layout in _kernel_tables(plan)
    ]
    return _kernel(plan, infos, mask_function)


def _has_allowed_pair(plan: Plan) -> bool:
    """Whether any head's mask allows a (query, key) pair: from block bounds for structured masks
    (a dense (H, Lq, Lkv) evaluation of per-head masks would need 50 GB at 112K tokens)."""
    blocks = plan.block_sizes()
    heads = plan.mask.masks if isinstance(plan.mask, _masks.MultiHeadMask) else (plan.mask,)
    for mask in heads:
        if not mask.blockwise:
            allowed = mask.dense(plan.q_len, plan.kv_len).any()
        else:
            allowed = _tables.block_mask_table(
                mask, plan.q_len_padded, plan.kv_len_padded, plan.kv_len, blocks["block_q"], blocks["block_kv"]
            ).any()
        if allowed:
            return True
    return False


def _kernel_tables(plan: Plan):
    """(block_shape, is_dkv, shrink_grid) of each kernel's tables, in the order the kernel takes
    them: forward, dq (None when fused into dkv), dkv."""
    b = _jax_block_sizes(plan)
    fused = b.use_fused_bwd_kernel
    return [
        ((b.block_q, b.block_kv), False, True),
        None if fused else ((b.block_q_dq, b.block_kv_dq), False, True),
        ((b.block_q_dkv, b.block_kv_dkv), True, not fused),
    ]


def _sharded_bound_mask(plan: Plan) -> _masks.BoundMask:
    return _masks.BoundMask(
        _masks.shared_structured_mask(plan.mask), plan.q_len_padded, plan.kv_len_padded, plan.kv_len
    )


def _table_infos(plan: Plan, rounded: bool = False) -> tuple[np.ndarray | None, list]:
    """Every device's block tables: (the query positions (S, P) when the kernel evaluates a shared
    structured mask from them, else None; the forward, dq and dkv MaskInfos (None for a dq fused
    into dkv), whose tables have a leading sequence-shard axis and then a head axis). rounded:
    stored tables in rounded shapes (`tables.partial_mask_info`)."""
    shared = _masks.shared_structured_mask(plan.mask)
    positions = plan.shard_positions()
    kv_len = plan.kv_len
    if shared is not None and not plan.ring:
        build = functools.partial(_tables.sharded_mask_info, shared, positions)
    else:  # stored blocks; a ring step's keys are not the ones the kernel counts, so it always has them
        heads = plan.mask.masks if isinstance(plan.mask, _masks.MultiHeadMask) else (plan.mask,)
        rows = np.where(np.arange(plan.q_len_padded) < plan.q_len, positions, -1)  # padding rows: hidden
        kv_len *= plan.q_shards if plan.ring else 1
        build = functools.partial(
            _tables.partial_mask_info,
            heads,
            rows,
            plan.q_len * plan.q_shards,
            head_shards=plan.head_shards,
            kv_positions=plan.ring_kv_positions() if plan.ring else None,
            rounded=rounded,
        )
        positions = None
    infos = [None if layout is None else build(plan.kv_len_padded, kv_len, *layout) for layout in _kernel_tables(plan)]
    return positions, infos


def _per_device(info: _mask_info.MaskInfo) -> list[np.ndarray]:
    """The tables of a MaskInfo that differ from device to device, in the order programs take them."""
    return [t for t in (info.data_next, info.mask_next, info.block_mask) if t is not None]


def _only_shard(info: _mask_info.MaskInfo) -> _mask_info.MaskInfo:
    """An unsharded plan's MaskInfo as constants: its one shard's tables, every head's."""
    tables = {name: getattr(info, name) for name in ("data_next", "mask_next", "block_mask")}
    return jax.tree.map(jnp.asarray, info._replace(**{k: t[0] for k, t in tables.items() if t is not None}))


def _kernel(plan: Plan, infos: list, mask_function) -> _splash.SplashAttentionKernel:
    """The kernel `make_splash_mha/mqa` would build, from the forward, dq and dkv MaskInfos."""
    return compat.splash_kernel(
        *infos,
        block_sizes=_jax_block_sizes(plan),
        is_mqa=plan.is_mqa,
        save_residuals=False,
        mask_value=_splash.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=plan.soft_cap,
        residual_checkpoint_name=None,
        mask_function=mask_function,
        interpret=plan.platform != "tpu",
    )
