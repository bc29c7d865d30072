"""Ring context parallelism: the programs of each step of a ring over the query-sequence shards.

Each device holds its shard of q, k, v (and their segment ids) in the plan's sequence layout. At
step s a device attends its queries to the keys of the shard s places before its own (the caller
passes k, v and the kv segment ids one shard onwards between steps, a collective permute), with
that step's block tables; a step whose tables are empty on a device skips its kernels there
(`lax.cond`). Nothing whole-sequence is ever held: every buffer is one shard's.

forward[s](step inputs[, out_acc, lse_acc]) -> (out_acc, lse_acc)
    the step's splash forward, merged into the running output by logsumexp (float32).
finish(out_acc, lse_acc[, sinks]) -> (out, lse)
    the output in q's dtype, normalised over the sinks when there are any, rows that see no key
    0; and the logsumexp the backward reads (padded to the kernels' rows).
backward[s](step inputs, out, lse, d_out[, dq_acc, dk_acc, dv_acc]) -> (dq_acc, dk_acc, dv_acc)
    the step's dq and dkv kernels on the whole output and logsumexp, which gives exactly this
    step's share of each gradient; dq accumulates here, dk and dv travel with the keys they belong
    to (the caller passes them on with k and v, and once more at the end, home). The last step's
    are cast to the inputs' dtypes.
sinks_grad(out, lse, d_out, sinks) -> d_sinks
    this device's share of the sinks' gradient (the caller sums the devices').

scaled_keys(k) -> k times the softmax scale (and LOG2E, where the steps run the active kernels)
    what k travels as: the steps' kernels take their keys scaled (they apply no softmax scale),
    and scaling them once, not at every step, keeps a scaled copy of the held keys out of every
    step (the last step's dk is scaled back).

Sinks enter only in `finish` and `sinks_grad`: a sink is one logit per row, not a key of any shard.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .active_kernels import LOG2E
from .plan import Plan, ring_steps
from .splash_program import Program, row_has_keys, scaled


def _accumulator_dtype(name: str, dtype):
    """dq sums over the steps in float32 on its own device; dk and dv travel around the ring in
    the inputs' dtype (as the all-gather strategy's partial dk, dv are summed). Measured with the
    TPU compiler (the bf16 step of bench_context_parallel.py at 1M tokens over v5e:4x4): 2.82 GiB
    per chip this way, 3.63 with float32 dk and dv, 2.88 with bfloat16 dq too. Against a float64
    reference (tests/test_ring.py, bf16, 8 devices) dq stays as close as one device's, dk and dv
    are about twice as far."""
    return jnp.float32 if name == "dq_acc" else dtype


class RingProgram:
    """The step programs of a ring plan, and what they take (the `Program` conventions: flat
    arrays in `signature(kind, step)` order, put there by `arguments`)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        # The steps' kernels never see the sinks, which `finish` and `sinks_grad` apply, nor the
        # softmax scale, which `scaled_keys` applies once; on the active kernels (both passes) with
        # LOG2E, which each step would otherwise apply to a copy of the keys it holds (0.75 GiB at 6M
        # tokens over 16 v5e chips).
        steps = ring_steps(dataclasses.replace(plan, has_sinks=False, scale=1.0))
        self.keys_in_base_2 = plan.forward_kernel == plan.backward_kernel == "active"
        self.steps = [Program(p, keys_in_base_2=self.keys_in_base_2) for p in steps]
        self.scaled_keys = jax.jit(self._scaled_keys)
        self.forward = [jax.jit(functools.partial(self._forward, s)) for s in range(len(self.steps))]
        self.backward = [jax.jit(functools.partial(self._backward, s)) for s in range(len(self.steps))]
        self.finish = jax.jit(self._finish)
        self.sinks_grad = jax.jit(self._sinks_grad)

    def tables(self, step: int) -> list:
        """Step `step`'s block tables, every device's (`Program.tables`)."""
        return self.steps[step].tables()

    def table_axes(self, step: int) -> list[tuple[str, ...]]:
        return self.steps[step].table_axes()

    def signature(self, kind: str, step: int = 0) -> tuple[str, ...]:
        """The names of the arrays `kind` ("forward", "finish", "backward", "sinks_grad") takes."""
        if kind == "finish":
            return ("out_acc", "lse_acc") + (("sinks",) if self.plan.has_sinks else ())
        if kind == "sinks_grad":
            return ("out", "lse", "d_out", "sinks")
        accumulators = {"forward": ("out_acc", "lse_acc"), "backward": ("dq_acc", "dk_acc", "dv_acc")}[kind]
        return self.steps[step].signature(kind) + (accumulators if step else ())

    def accumulators(self, kind: str, step: int) -> list[jax.ShapeDtypeStruct]:
        """The shapes and dtypes of the accumulators `kind` ("forward" or "backward") takes at
        `step` (none at the first), as the step before returns them."""
        if not step:
            return []
        p = self.plan
        rows = (p.batch, p.num_q_heads, p.q_len)
        if kind == "forward":
            return [jax.ShapeDtypeStruct(rows + (p.head_dim_v,), jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32)]
        q, k, v = (
            jax.ShapeDtypeStruct((p.batch, heads, length, dim), jnp.dtype(p.dtype))
            for heads, length, dim in (
                (p.num_q_heads, p.q_len, p.head_dim),
                (p.num_kv_heads, p.kv_len, p.head_dim),
                (p.num_kv_heads, p.kv_len, p.head_dim_v),
            )
        )
        if self.steps[step].active_backward is not None:
            return list(jax.eval_shape(self.steps[step].gradient_sums, q, k, v))
        names = ("dq_acc", "dk_acc", "dv_acc")
        return [jax.ShapeDtypeStruct(x.shape, _accumulator_dtype(n, x.dtype)) for n, x in zip(names, (q, k, v))]

    def arguments(self, kind: str, step: int = 0, tables=(), **named) -> list:
        named.update({f"table{i}": t for i, t in enumerate(tables)})
        return [named[name] for name in self.signature(kind, step)]

    def _split(self, kind: str, step: int, arrays) -> tuple[list, list, dict]:
        """(the step program's arrays, its tables, every array by name)."""
        named = dict(zip(self.signature(kind, step), arrays, strict=True))
        program = self.steps[step]
        tables = [named[n] for n in program.signature(kind) if n.startswith("table")]
        return [named[n] for n in program.signature(kind)], tables, named

    def _forward(self, step: int, *arrays):
        program = self.steps[step]
        inputs, tables, named = self._split("forward", step, arrays)
        q_len, dv = self.plan.q_len, self.plan.head_dim_v

        def attend():
            out, lse = program.forward_body(*inputs)
            lse = lse[..., :q_len]
            has_keys = row_has_keys(lse)
            out, lse = jnp.where(has_keys[..., None], out, 0).astype(jnp.float32), jnp.where(has_keys, lse, -jnp.inf)
            return _merge(named["out_acc"], named["lse_acc"], out, lse) if step else (out, lse)

        # The branch without work passes the accumulators on rather than making zeros: XLA
        # hoists a branch's constants out of it, and every step's zeros would then be alive at once.
        if step:
            skip = lambda: (named["out_acc"], named["lse_acc"])  # noqa: E731
        else:
            shape = named["q"].shape[:2] + (q_len,)
            skip = lambda: (jnp.zeros(shape + (dv,), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))  # noqa: E731
        return _where_work(program.has_work(tables), attend, skip)

    def _finish(self, *arrays):
        named = dict(zip(self.signature("finish"), arrays, strict=True))
        out, lse = named["out_acc"], named["lse_acc"]
        if self.plan.has_sinks:
            sinks = named["sinks"].astype(jnp.float32)[None, :, None]
            total = jnp.logaddexp(lse, sinks)
            out = out * jnp.exp(lse - total)[..., None]
            lse = total
        out = jnp.where(row_has_keys(lse)[..., None], out, 0).astype(self.plan.dtype)
        # Padded rows: +inf, so the backward kernels give them no weight.
        pad = self.plan.q_len_padded - self.plan.q_len
        return out, jnp.pad(lse, [(0, 0), (0, 0), (0, pad)], constant_values=jnp.inf)

    def _backward(self, step: int, *arrays):
        program = self.steps[step]
        inputs, tables, named = self._split("backward", step, arrays)
        if program.active_backward is not None:
            return self._active_backward(step, tables, named)
        primals = (named["q"], named["k"], named["v"])
        has_work = program.has_work(tables)

        # Without work the branch returns q, k, v in place of the gradients (same shapes and
        # dtypes) and the select below drops them: zeros made in a branch are hoisted out of it by
        # XLA, and every step's would be alive at once. The sums happen outside the branch, so
        # that it need not wait for the dk and dv that arrive from the previous device.
        grads = _where_work(has_work, lambda: tuple(program.backward_body(*inputs)[:3]), lambda: primals)
        names = ("dq_acc", "dk_acc", "dv_acc")
        dtypes = [_accumulator_dtype(name, x.dtype) for name, x in zip(names, primals)]
        accumulated = [named[n] for n in names] if step else [jnp.zeros((), d) for d in dtypes]
        grads = tuple(
            jnp.where(has_work, (a.astype(jnp.float32) + g.astype(jnp.float32)).astype(d), a)
            for a, g, d in zip(accumulated, grads, dtypes)
        )
        if step == len(self.steps) - 1:
            dq, dk, dv = grads
            grads = tuple(g.astype(x.dtype) for g, x in zip((dq, scaled(dk, self.plan.scale), dv), primals))
        return grads

    def _active_backward(self, step: int, tables, named):
        """`_backward` through the active kernels: the sums dq, dk and dv are the kernel's own
        (padded, dq in float32 rows, `Program.gradient_sums`), given to each step's kernel, which
        adds into them in place: no step's gradients exist beside the sums. The last step's are
        finished to the inputs' shapes and dtypes."""
        program = self.steps[step]
        q, k, v = named["q"], named["k"], named["v"]
        ids = (named["q_ids"], named["kv_ids"]) if self.plan.has_segment_ids else None
        sums = tuple(named[n] for n in ("dq_acc", "dk_acc", "dv_acc")) if step else program.gradient_sums(q, k, v)

        def work():
            grads, _ = program.active_kernel_gradients(
                q, k, v, ids, tables, named["out"], named["lse"], named["d_out"], sums
            )
            return tuple(grads)

        grads = _where_work(program.has_work(tables), work, lambda: sums)
        if step == len(self.steps) - 1:
            dq, dk, dv = program.finished_gradients(q, k, v, *grads)
            grads = (dq, scaled(dk, self.plan.scale).astype(k.dtype), dv)
        return grads

    def _scaled_keys(self, k):
        return scaled(k, self.plan.scale * (LOG2E if self.keys_in_base_2 else 1.0))

    def _sinks_grad(self, out, lse, d_out, sinks):
        # d out / d sink = -p_sink * out per row, with p_sink = exp(sink - lse)
        lse = lse[..., : self.plan.q_len]
        p_sink = jnp.where(row_has_keys(lse), jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse), 0)
        rows = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
        return (-(p_sink * rows).sum(axis=(0, 2))).astype(sinks.dtype)


def _where_work(has_work, work, skip):
    """work() where this device has blocks to compute at this step, else skip(): a `lax.cond`,
    unless every device has work (the balanced layout with a causal mask, say), where the
    conditional would cost HBM and save nothing (measured: 1.76 against 1.53 GiB of temporaries
    for the step of bench_context_parallel.py at 128K tokens over v5e:2x2)."""
    return work() if has_work is True else jax.lax.cond(has_work, work, skip)


def _merge(out, lse, step_out, step_lse):
    """The running output and logsumexp with one more step's (float32; -inf: no key yet)."""
    top = jnp.maximum(lse, step_lse)
    top = jnp.where(jnp.isfinite(top), top, 0)
    weight, step_weight = jnp.exp(lse - top), jnp.exp(step_lse - top)
    total = weight + step_weight
    merged = (out * weight[..., None] + step_out * step_weight[..., None]) / jnp.where(total > 0, total, 1)[..., None]
    return merged, top + jnp.log(total)
