"""A plan's splash program (`Program`): its jitted forward, infer and backward, what torch_splash's
custom ops run.

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

from . import active_kernels, compat, policy
from . import tables as _tables
from .block_planning import active_backward_blocks, active_backward_rows, active_block_q, active_forward_blocks
from .errors import SplashConstraintError
from .kernel_limits import active_table_entries, compute_dtype
from .kernel_tables import KernelTables
from .masks import MultiHeadMask, shared_structured_mask
from .plan import Plan

_splash = compat.splash_modules()[0]

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
    (they apply no scale) and the gradient of the unscaled keys; x itself where the scale is 1."""
    return x if scale == 1.0 else (x.astype(jnp.float32) * scale).astype(x.dtype)


class Program(KernelTables):
    """The jitted forward, infer and backward of one plan, and what they take.

    Each takes flat arrays in the order `signature(kind)` names them (the one place that order is
    written): q, k, v; q_ids, kv_ids when the plan has segment ids; sinks when it has them; the
    block tables of a sharded plan ("table0", ...: `tables()`, every device's, which the caller
    splits as `table_axes()` says) or of a mask read from stored blocks (its tables and partial
    blocks); and for the backward out, lse, d_out. `arguments(kind, ...)`
    puts named tensors (torch's or JAX's) in that order. The forward returns (out, lse), the
    infer out, the backward (dq, dk, dv[, d_sinks]).
    """

    def __init__(self, plan: Plan, batch_in_heads: bool | None = None, keys_in_base_2: bool = False):
        """batch_in_heads: the plan's choice (`Plan.batch_in_heads`) unless given, as the real-chip
        check gives it to time both ways; MQA plans keep theirs (their kernel depends on it).
        keys_in_base_2: the caller's keys already carry LOG2E beside the scale (a ring's, scaled
        once as they start around it), which the active kernels otherwise fold into a scaled copy."""
        super().__init__(plan)
        # the factor the active kernels' keys are scaled by
        self.active_key_scale = 1.0 if keys_in_base_2 else plan.scale * active_kernels.LOG2E
        self.batch_in_heads = plan.batch_in_heads if batch_in_heads is None else batch_in_heads
        if self.batch_in_heads != plan.batch_in_heads and plan.num_kv_heads == 1:
            raise ValueError("an MQA plan's kernel is built for its own batch layout")
        if self.batch_in_heads and not plan.batch_in_heads:
            raise ValueError("this plan's masks or segment ids differ between batch elements")
        # Rows with no visible key need zeroing; without segment ids, most masks cannot have any.
        # A ring step's rows may see none of the keys it holds, but its backward is given the
        # merged output and logsumexp: only rows that see no key in the whole call matter there
        # (guarding the others cost a d_out-sized copy alive through the ring's backward).
        self.call_rows_may_be_empty = plan.has_segment_ids or plan.mask.may_empty_rows()
        self.rows_may_be_empty = self.call_rows_may_be_empty or plan.ring
        self._layout = None  # _residual_layout
        # The active-block kernels (active_kernels), where the plan asks for them; None where JAX's run.
        # a stored mask's blocks, made once for both kernels where their blocks are the same
        made: dict = {}
        self.active = _ActiveForward(plan, made) if plan.forward_kernel == "active" and not self.no_pairs else None
        self.active_backward = (
            _ActiveBackward(plan, made) if plan.backward_kernel == "active" and not self.no_pairs else None
        )
        if self.sharded and self._infos is None:  # every device's lists say whether any has a pair
            self.no_pairs = not any(self.active_or_backward.devices_with_work())
        for active in (self.active, self.active_backward):  # their tables that are inputs, after JAX's
            if active is not None and active.inputs:
                active.tables = slice(len(self._table_arrays), len(self._table_arrays) + len(active.inputs))
                self._table_arrays = self._table_arrays + active.inputs
        self.forward = jax.jit(self.forward_body)
        self.backward = jax.jit(self.backward_body)
        self.infer = jax.jit(self.infer_body)
        if self.stored:  # the first program of these shapes has traced them: its functions serve this one
            shared = _SHARED.setdefault(self._shapes(), self)
            self.forward, self.backward, self.infer = shared.forward, shared.backward, shared.infer

    @property
    def active_or_backward(self):
        """The active forward, else the active backward (a plan runs one of them at least where
        JAX's kernels have no tables)."""
        return self.active if self.active is not None else self.active_backward

    def blocks_per_shard(self) -> list[int]:
        if self._infos is not None:
            return super().blocks_per_shard()
        return [int((k != 0).sum()) for k in self.active_or_backward.device_kinds]

    def devices_with_work(self) -> list[bool]:
        if self._infos is not None:
            return super().devices_with_work()
        return [False] * self.plan.q_shards if self.no_pairs else self.active_or_backward.devices_with_work()

    def has_work(self, tables):
        """As `KernelTables.has_work`, from the active kernels' lists where JAX's kernels have no tables."""
        if self._infos is not None or all(self.devices_with_work()):
            return super().has_work(tables)
        flags = tables[self.active_or_backward.tables][2]
        return jnp.any((flags & active_kernels.KIND) != active_kernels.SKIP)

    def _shapes(self) -> tuple:
        """What a stored-block program's jitted functions depend on: the plan but for its mask,
        what the mask decides about rows and pairs, and its tables' shapes and dtypes."""
        fields = tuple(getattr(self.plan, f.name) for f in dataclasses.fields(self.plan) if f.name != "mask")
        tables = tuple((t.shape, t.dtype.str) for t in self._table_arrays)
        return fields, self.call_rows_may_be_empty, self.no_pairs, tables, self.batch_in_heads

    def _pad(self, x, axis: int, length: int):
        extra = length - x.shape[axis]
        if not extra:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    def _kernel_inputs(self, q, k, v, ids, sinks, key_scale: float | None = None):
        """The kernel calls' inputs, ((q, k, v, segment ids), sinks): q, k, v scaled and padded, with
        a leading axis of calls (`_each_call`): one call of B * H heads where the plan puts the
        batch in its heads, else one call per batch element; the MQA kernel's k and v without a
        head axis; the sinks every call shares, one per head it sees."""
        # The kernel applies no softmax scale. Scaling k rather than q gives the same logits, and
        # the kernel's dq is then already the caller's; with GQA k is also the smaller tensor.
        p = self.plan
        calls = 1 if self.batch_in_heads else q.shape[0]
        q, k, v = (x.astype(compute_dtype(p.dtype)) for x in (q, k, v))  # float16 runs in float32
        k = scaled(k, p.scale if key_scale is None else key_scale)
        q = self._pad(q, 2, p.q_len_padded)
        k = self._pad(k, 2, p.kv_len_padded)
        v = self._pad(v, 2, p.kv_len_padded)
        q, k, v = (self._per_call(x, calls) for x in (q, k, v))
        if p.is_mqa:  # the MQA kernel takes k and v without a head axis
            k, v = k[:, 0], v[:, 0]
        if sinks is not None and self.batch_in_heads:
            sinks = jnp.tile(sinks, q.shape[1] // sinks.shape[0])
        return (q, k, v, self._segment_ids(ids)), sinks

    @staticmethod
    def _each_call(fn, per_call):
        """fn over the leading (calls) axis of the arrays in `per_call`, its results stacked along it:
        a single call directly, several in a loop (`lax.map`), never a vmap (`Plan.batch_in_heads`)."""
        if per_call[0].shape[0] == 1:
            return jax.tree.map(lambda y: y[None], fn(*jax.tree.map(lambda x: x[0], per_call)))
        return jax.lax.map(lambda xs: fn(*xs), per_call)

    @staticmethod
    def _per_call(x, calls: int):
        """(B, H, ...) as the kernel calls take it: (calls, heads a call sees, ...)."""
        return x.reshape((calls, -1) + x.shape[2:])

    @staticmethod
    def _per_batch(x, batch: int):
        """A result of the kernel calls, (calls, heads the call sees, ...), as (B, H, ...)."""
        return x.reshape((batch, -1) + x.shape[2:])

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

    def _call_vjp(self, kernel, table_arrays, sinks, q, k, v, segment_ids):
        """One kernel call's output, logsumexp, vjp leaves and tree, and the arrays its residuals may be."""
        primals = (q, k, v) if sinks is None else (q, k, v, sinks)
        out, vjp = jax.vjp(lambda q, k, v, *s: compat.call_splash_kernel(kernel, q, k, v, segment_ids, *s), *primals)
        leaves, tree = jax.tree.flatten(vjp)
        lse = compat.logsumexp_residual(leaves, out)
        return out, lse, leaves, tree, self._residual_sources(q, k, v, sinks, segment_ids) + table_arrays

    def _forward(self, q, k, v, ids, sinks, tables):
        """The kernels' output and logsumexp, (B, Hq, Lq padded[, Dv])."""
        if self.active is not None:
            per_call, sinks = self._kernel_inputs(q, k, v, ids, sinks, self.active_key_scale)
            out, lse = self._each_call(functools.partial(self.active, sinks, tables), per_call)
            return self._per_batch(out, q.shape[0]), self._per_batch(lse, q.shape[0])
        per_call, sinks = self._kernel_inputs(q, k, v, ids, sinks)
        kernel, table_arrays = self._kernel_for(tables)
        out, lse = self._each_call(lambda *a: self._call_vjp(kernel, table_arrays, sinks, *a)[:2], per_call)
        return self._per_batch(out, q.shape[0]), self._per_batch(lse, q.shape[0])

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
        out, lse = self._forward(q, k, v, ids, sinks, tables)
        return self._finish(out, lse).astype(q.dtype), lse

    def _residual_layout(self, forward_arrays) -> tuple[list, object]:
        """Where each of a kernel call's vjp residuals comes from (one of its inputs, its output,
        its logsumexp, or a constant block table, concrete), and the vjp's tree: learnt by tracing
        the first call abstractly, once (a plan fixes every shape, and every call's are the same)."""
        if self._layout is None:
            found = []

            def trace(*arrays):
                q, k, v, ids, sinks, tables, _ = self._named("forward", arrays)
                per_call, sinks = self._kernel_inputs(q, k, v, ids, sinks)
                kernel, table_arrays = self._kernel_for(tables)
                first = jax.tree.map(lambda x: x[0], per_call)
                out, lse, leaves, tree, inputs = self._call_vjp(kernel, table_arrays, sinks, *first)

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
        if self.rows_may_be_empty or self.active is not None:
            return self._finish(*self._forward(q, k, v, ids, sinks, tables)).astype(q.dtype)
        kernel, _ = self._kernel_for(tables)
        per_call, sinks = self._kernel_inputs(q, k, v, ids, sinks)
        out = self._each_call(lambda *a: compat.call_splash_kernel(kernel, *a, sinks), per_call)
        return self._per_batch(out, q.shape[0])[:, :, : self.plan.q_len].astype(q.dtype)

    def backward_body(self, *arrays):
        """What `backward` jits (a ring traces it into its steps' programs)."""
        TRACES["backward"] += 1
        p = self.plan
        q, k, v, ids, sinks, tables, named = self._named("backward", arrays)
        out, lse, d_out = named["out"], named["lse"], named["d_out"]
        if self.no_pairs:
            zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
            return zeros if sinks is None else (*zeros, jnp.zeros_like(sinks))
        if self.active_backward is not None:
            return self._active_gradients(q, k, v, ids, sinks, tables, out, lse, d_out)
        sources, tree = self._residual_layout(arrays[: len(self.signature("forward"))])
        per_call, call_sinks = self._kernel_inputs(q, k, v, ids, sinks)
        table_arrays = self._kernel_for(tables)[1]
        # The caller's out is the kernel's, zeroed where a row sees no key; the kernel uses it only
        # in rowsum(out * d_out), and d_out is zeroed on those rows too.
        if self.call_rows_may_be_empty:
            # A row that saw no key has logsumexp -inf (its q block was skipped) or about the mask
            # value; the dq/dkv kernels recompute p = exp(logit - logsumexp) from it, which is inf
            # there, and inf * 0 is NaN whatever d_out is. With +inf, p is 0 on those rows.
            has_keys = row_has_keys(lse)[..., None]
            lse = jnp.where(has_keys[..., 0], lse, jnp.inf)
        out, d_out = (x.astype(compute_dtype(p.dtype)) for x in (out, d_out))
        d_out = self._pad(d_out, 2, p.q_len_padded)
        if self.call_rows_may_be_empty:
            d_out = jnp.where(has_keys, d_out, 0).astype(d_out.dtype)
        calls = per_call[0].shape[0]
        out = self._pad(out, 2, p.q_len_padded)
        out, lse, d_out = (self._per_call(x, calls) for x in (out, lse, d_out))

        def one_call(q, k, v, segment_ids, out, lse, d_out):
            inputs = self._residual_sources(q, k, v, call_sinks, segment_ids) + table_arrays
            found = {"out": out, "lse": lse}
            leaves = [
                inputs[value] if kind == "input" else found[kind] if kind in found else value for kind, value in sources
            ]
            return jax.tree.unflatten(tree, leaves)(d_out)

        dq, dk, dv, *d_sinks = self._each_call(one_call, (*per_call, out, lse, d_out))
        batch = q.shape[0]
        dq = self._per_batch(dq, batch)
        dk, dv = (g.reshape((batch, -1) + g.shape[-2:]) for g in (dk, dv))  # the MQA kernel's have no head axis
        if self.call_rows_may_be_empty:
            dq = jnp.where(has_keys, dq, 0).astype(dq.dtype)
        dq = dq[:, :, : p.q_len].astype(q.dtype)
        dk = scaled(dk[..., : p.kv_len, :], p.scale).astype(k.dtype)
        dv = dv[..., : p.kv_len, :].astype(v.dtype)
        d_sinks = [d.reshape(-1, sinks.shape[0]).sum(axis=0) for d in d_sinks]  # every call's heads' share
        return (dq, dk, dv, *d_sinks)

    def _active_gradients(self, q, k, v, ids, sinks, tables, out, lse, d_out):
        """backward_body through the active-block backward: one kernel call per `_each_call` call,
        its dq added into a float32 buffer in place; the sinks' gradients from the logsumexp."""
        p = self.plan
        (dq, dk, dv), di = self.active_kernel_gradients(q, k, v, ids, tables, out, lse, d_out)
        batch = q.shape[0]
        dq = self._per_batch(dq, batch)[:, :, : p.q_len].astype(q.dtype)
        dk, dv = (g.reshape((batch, -1) + g.shape[-2:]) for g in (dk, dv))
        dk = dk[..., : p.kv_len, :].astype(k.dtype)  # the kernel scaled it (`_ActiveBackward`)
        dv = dv[..., : p.kv_len, :].astype(v.dtype)
        if sinks is None:
            return dq, dk, dv
        # A sink is a logit whose value vector is 0: its gradient is -sum over rows of p_sink * di
        # (rows with no key: none, as their lse is +inf there)
        lse = jnp.where(row_has_keys(lse), lse, jnp.inf)
        d_sinks = -jnp.sum(jnp.exp(sinks.astype(jnp.float32)[:, None] - lse) * di, axis=(0, 2))
        return dq, dk, dv, d_sinks.astype(sinks.dtype)

    def active_kernel_gradients(self, q, k, v, ids, tables, out, lse, d_out, sums=None):
        """The active backward's (dq, dk, dv) for every `_each_call` call, stacked along a leading
        axis of calls, as the kernel gives them (padded; dk scaled as `_ActiveBackward` says; dq
        float32); or, given sums (dq, dk, dv) in that form, those sums with
        the gradients added in place, dq in its sum's form (`gradient_sums` makes zeros of that form).
        And di, the rows' sums of out * d_out."""
        p = self.plan
        per_call, _ = self._kernel_inputs(q, k, v, ids, None, self.active_key_scale)
        has_keys = row_has_keys(lse)
        lse = jnp.where(has_keys, lse, jnp.inf)  # p = exp(logit - lse) is then 0 on rows with no key
        out, d_out = (self._pad(x.astype(compute_dtype(p.dtype)), 2, p.q_len_padded) for x in (out, d_out))
        if self.call_rows_may_be_empty:  # else every row has keys: no pass over d_out
            d_out = jnp.where(has_keys[..., None], d_out, 0).astype(d_out.dtype)
        di = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
        calls = per_call[0].shape[0]
        rows = [self._per_call(x, calls) for x in (d_out, lse, di)]
        call = functools.partial(self.active_backward, tables)
        return self._each_call(call, (*per_call, *rows, *(sums or ()))), di

    def gradient_sums(self, q, k, v):
        """Zeros in the form `active_kernel_gradients` sums (dq, dk, dv) in, for q, k, v (B, H, L, D)."""
        p = self.plan
        calls = 1 if self.batch_in_heads else q.shape[0]
        heads, kv_heads = (x.shape[0] * x.shape[1] // calls for x in (q, k))
        dq = jnp.zeros((calls, *active_kernels.dq_rows(heads, p.q_len_padded, q.shape[-1])), jnp.float32)
        kv = (calls,) + (() if p.is_mqa else (kv_heads,)) + (p.kv_len_padded,)
        return dq, *(jnp.zeros(kv + x.shape[-1:], compute_dtype(p.dtype)) for x in (k, v))

    def finished_gradients(self, q, k, v, dq, dk, dv):
        """(dq, dk, dv) in q's, k's and v's shapes and dtypes from the sums of
        `active_kernel_gradients` (dk as the kernel scaled it)."""
        p, batch = self.plan, q.shape[0]
        calls = dq.shape[0]
        dq = jax.vmap(active_kernels.finished_dq, in_axes=(0, None))(
            dq, (q.shape[0] * q.shape[1] // calls, p.q_len_padded, q.shape[-1])
        )
        dq = self._per_batch(dq, batch)[:, :, : p.q_len].astype(q.dtype)
        dk, dv = (g.reshape((batch, -1) + g.shape[-2:]) for g in (dk, dv))
        return dq, dk[..., : p.kv_len, :].astype(k.dtype), dv[..., : p.kv_len, :].astype(v.dtype)


class _ActiveForward:
    """The active-block forward (`active_kernels`) of a plan: its blocks, its block list and one
    kernel call on a call's q, k, v and segment ids. A structured mask every head shares is
    evaluated in the kernel, its list a constant of the program (made on the host); a mask read
    from stored blocks (data, one mask per head) has its list and blocks as program inputs in
    rounded shapes (`stored`), so that masks with other contents run the same compiled program.
    A plan sharded along the query sequence (all-gather or a ring step) has every device's list,
    padded to the longest, and the global positions of its rows and keys as inputs, one slice a
    device (`sharded`): the kernel evaluates the shared structured mask at those positions.
    `inputs` are the tables the program takes, which `Program` appends to its own."""

    backward = False

    def __init__(self, plan: Plan, made: dict | None = None):
        """made: a stored mask's blocks by block shape (`tables.stored_blocks`), shared with the
        other kernel of the program (each new mask's contents are evaluated once)."""
        self.plan, self._made = plan, {} if made is None else made
        self.mask = shared_structured_mask(plan.mask)
        self.sharded = plan.q_shards > 1
        lengths, head_dim = plan.active_block_lengths(), max(plan.head_dim, plan.head_dim_v)

        def blocks(most_q):
            return active_forward_blocks(
                *lengths, head_dim, stored=self.mask is None, most_kv=plan.active_block_kv, most_q=most_q
            )

        self._plan_list(blocks(plan.active_block_q))
        # q blocks longer than those of an unknown generation only where their partial blocks run
        # as straight-line code: a branch a tile outgrew one instruction overlay (a 4096 window at
        # 32K, 4096-row blocks: 1.12x and 1.15x the forward's time on v6e and v7x by the estimate;
        # the v5e ran such code 2x to 3x slower)
        if self.blocks["block_q"] > active_block_q(None) and self._branches_a_tile():
            self._plan_list(blocks(None))
        _check_entries(self, plan, "forward_kernel")

    def _branches_a_tile(self) -> bool:
        """Whether the list's partial blocks run a branch a tile: too many patterns of tiles for
        straight-line code (`active_kernels.tile_patterns`)."""
        b, has_ids = self.blocks, self.plan.has_segment_ids
        if self.stored is not None or not b["block_q_sub"] or not active_kernels.may_run_partial(self.grid, has_ids):
            return False
        tiles = (b["block_q"] // b["block_q_sub"]) * (b["block_kv"] // b["block_kv_compute"])
        return not active_kernels.tile_patterns(self.grid, has_ids, tiles)

    def _plan_list(self, b: dict) -> None:
        """The blocks b's list: `grid` (the tables, numpy) and, for a stored mask, `stored` (the
        tables, the block index and the blocks, rounded) with `tables` its slice of the program's."""
        self.blocks, self.stored, self.tables, self.inputs = b, None, None, []
        walk = active_kernels.column_grid if self.backward else active_kernels.active_grid
        rows, chunk = b["block_q_sub"] or b["block_q"], b["block_kv_compute"]
        if self.sharded:
            positions = self.plan.device_positions()
            kinds = _tables.device_block_kinds(self.mask, *positions, self.plan.kv_len, b["block_q"], b["block_kv"])
            tiled = self.backward or b["block_q_sub"]
            tiles = _tables.device_block_kinds(self.mask, *positions, self.plan.kv_len, rows, chunk) if tiled else None
            self.grid, self.device_kinds = walk(kinds, tiles), kinds
            count = (b["block_q"] // rows) * (b["block_kv"] // chunk) if tiled else 0
            self.patterns = active_kernels.tile_patterns(self.grid, self.plan.has_segment_ids, count) if count else ()
            self.inputs = [*self.grid, *self.plan.device_position_runs(positions)]
            return
        if self.mask is not None:
            if self.backward:
                tile_kinds = _backward_tile_kinds(self.mask, self.plan, rows, chunk)
            else:
                tile_kinds = _kinds(self.mask, self.plan, rows, chunk) if b["block_q_sub"] else None
            self.grid = walk(_kinds(self.mask, self.plan, b["block_q"], b["block_kv"]), tile_kinds)
            return
        p, shape = self.plan, (b["block_q"], b["block_kv"])
        if shape not in self._made:
            heads = p.mask.masks if isinstance(p.mask, MultiHeadMask) else (p.mask,)
            self._made[shape] = _tables.stored_blocks(heads, p.q_len, p.q_len_padded, p.kv_len_padded, p.kv_len, *shape)
        kinds, ids, blocks = self._made[shape]
        self.grid = walk(kinds, active_kernels.stored_tiles(kinds, ids, blocks, rows, chunk))
        index = active_kernels.block_index(self.grid, ids)
        # rounded like JAX's stored tables (`tables.partial_mask_info`): padding entries repeat
        # their list's last block and do nothing, padding blocks are never named
        width = _tables.bucket(self.grid[0].shape[1])
        padded = [np.pad(t, ((0, 0), (0, width - t.shape[1])), mode="edge") for t in (*self.grid, index)]
        padded[2][:, self.grid[0].shape[1] :] = 0  # flags
        count = _tables.bucket(max(len(blocks), _tables.MIN_PARTIAL_BLOCKS))
        blocks = np.pad(blocks, ((0, count - len(blocks)), (0, 0), (0, 0)))
        transposed = self.backward or self.plan.forward_logits == "transposed"  # as the kernel reads them
        self.stored = [*padded, blocks.transpose(0, 2, 1) if transposed else blocks]
        self.inputs = self.stored

    @property
    def entries(self) -> int:
        """The entries of every list one device runs, as its tables hold them in SMEM (a stored
        mask's rounded)."""
        if self.sharded:
            return self.grid[0].shape[1]
        return (self.grid if self.stored is None else self.stored)[0].size

    def devices_with_work(self) -> list[bool]:
        """For a sharded plan: whether each device's list has a block to compute."""
        return [bool(k.any()) for k in self.device_kinds]

    def _mask_arguments(self, tables) -> dict:
        """The kernel's grid and mask: a constant list and the shared mask, or the program's inputs."""
        if self.sharded:  # this device's slice of every device's tables
            q_block, kv_block, flags, sub, q_runs, kv_runs = tables[self.tables]
            p = self.plan
            positions = (
                positions_of_runs(q_runs[0], p.q_len, p.q_len_padded),
                positions_of_runs(kv_runs[0], p.kv_len, p.kv_len_padded, -1),
            )
            return dict(
                grid=(q_block, kv_block, flags, sub),
                mask=self.mask,
                positions=positions,
                straight_patterns=self.patterns,
            )
        if self.stored is None:
            return dict(grid=self.grid, mask=self.mask)
        q_block, kv_block, flags, sub, index, blocks = tables[self.tables]
        return dict(
            grid=(q_block, kv_block, flags, sub), mask=None, stored_mask=(index, blocks), straight_patterns=False
        )

    def __call__(self, sinks, tables, q, k, v, segment_ids):
        """(out (Hq, Lq, Dv), logsumexp (Hq, Lq)) of one kernel call; k scaled by scale x LOG2E."""
        p = self.plan
        if k.ndim == 2:  # the MQA layout `_kernel_inputs` gives
            k, v = k[None], v[None]
        return active_kernels.forward(
            q,
            k,
            v,
            **self._mask_arguments(tables),
            kv_len=p.kv_len,
            **self.blocks,
            soft_cap=None if p.soft_cap is None else p.soft_cap * active_kernels.LOG2E,
            segment_ids=None if segment_ids is None else (segment_ids.q, segment_ids.kv),
            sinks=None if sinks is None else sinks.astype(jnp.float32) * active_kernels.LOG2E,
            sums_on_mxu=p.row_sums == "mxu",
            transposed=p.forward_logits == "transposed",
            scheduler=p.scheduler,
            interpret=p.platform != "tpu",
        )


# Stored-block programs by what their jitted functions depend on (`Program._shapes`): a program
# whose mask has other contents in the same shapes takes the functions of the first, which JAX
# has traced and compiled.
_SHARED = policy.Recent(policy.STORED_SHAPES)
forget_shared_programs = _SHARED.clear


class _ActiveBackward(_ActiveForward):
    """The active-block backward (`active_kernels.backward`) of a plan: its blocks, its block list
    walked kv block after kv block (a stored mask's as `_ActiveForward`'s, its blocks transposed),
    and one kernel call's gradients."""

    backward = True

    def __init__(self, plan: Plan, made: dict | None = None):
        self.plan, self._made = plan, {} if made is None else made
        self.mask = shared_structured_mask(plan.mask)
        self.sharded = plan.q_shards > 1
        head_dim = max(plan.head_dim, plan.head_dim_v)
        stored = self.mask is None
        lengths = plan.active_block_lengths()
        for most_rows in active_backward_rows(stored):
            self._plan_list(active_backward_blocks(*lengths, head_dim, most_rows, stored, plan.active_block_kv))
            if self.entries <= active_table_entries(self.stored is not None):
                break
        _check_entries(self, plan, "backward_kernel")

    def __call__(self, tables, q, k, v, segment_ids, d_out, lse, di, dq=None, dk=None, dv=None):
        """(dq, dk, dv) of one kernel call: dq float32, dk the gradient of the caller's (unscaled) k;
        or, given sums dq (`active_kernels.dq_rows`), dk and dv (k's and v's shapes), those sums
        with this call's gradients added in place, dq in its sum's form."""
        p = self.plan
        mqa = k.ndim == 2  # the MQA layout `_kernel_inputs` gives
        if mqa:
            k, v = k[None], v[None]
            dk, dv = (None if g is None else g[None] for g in (dk, dv))
        dq, dk, dv = active_kernels.backward(
            q,
            k,
            v,
            d_out,
            lse,
            di,
            **self._mask_arguments(tables),
            kv_len=p.kv_len,
            **self.blocks,
            soft_cap=None if p.soft_cap is None else p.soft_cap * active_kernels.LOG2E,
            segment_ids=None if segment_ids is None else (segment_ids.q, segment_ids.kv),
            dq=dq,
            dkv=None if dk is None else (dk, dv),
            dk_scale=p.scale,
            scheduler=p.scheduler,
            interpret=p.platform != "tpu",
        )
        return (dq, dk[0], dv[0]) if mqa else (dq, dk, dv)


def positions_of_runs(starts, real: int, padded: int, pad_value: int | None = None):
    """(padded,) int32 positions from `Plan.device_position_runs`' starts of one device (runs of
    real // len(starts) consecutive positions); past `real`, the last real position again (as
    `Plan.shard_positions` pads) or pad_value."""
    run = real // starts.shape[0]
    index = jnp.arange(padded, dtype=jnp.int32)
    inside = jnp.minimum(index, real - 1)
    positions = starts[inside // run] + inside % run
    return positions if pad_value is None else jnp.where(index < real, positions, pad_value)


def _kinds(mask, plan: Plan, block_q: int, block_kv: int):
    """The kinds of the blocks (or tiles) of block_q x block_kv a structured mask gives the plan's
    padded lengths, (1, q blocks, kv blocks): one list every head shares."""
    return _tables.block_mask_table(mask, plan.q_len_padded, plan.kv_len_padded, plan.kv_len, block_q, block_kv)[None]


def _backward_tile_kinds(mask, plan: Plan, rows: int, chunk: int):
    """`_kinds` of the backward's tiles, causal-shaped partial tiles marked `tables.DIAGONAL` (it
    runs them strip by strip; the forward runs them whole: in 128-row strips its 16K causal call
    took 6.77 ms on the v5e against 6.74)."""
    kinds = _kinds(mask, plan, rows, chunk)[0]
    return _tables.diagonal_tiles(mask, kinds, rows, chunk, plan.kv_len, active_kernels.STRIP)[None]


def _check_entries(active: _ActiveForward, plan: Plan, option: str) -> None:
    """Refuse an active-block list longer than a TPU's SMEM holds, naming the option to change."""
    entries, most, blocks = active.entries, active_table_entries(active.stored is not None), active.blocks
    if entries > most:
        raise SplashConstraintError(
            f"block_sizes.{option}='active': {entries} active blocks of {blocks['block_q']} x "
            f"{blocks['block_kv']} at {plan.q_len_padded} x {plan.kv_len_padded} tokens overrun the "
            f"{most} a TPU's SMEM holds; use {option}='splash' for this call."
        )
