"""Estimated TPU time of the decode kernel (torch_splash_jax.decode_kernel), by this package's
estimator (estimate.py), and the figures it is judged by: the HBM floor, and XLA's own estimate of
dense attention.

The decode kernel's grid steps depend on data (each batch element's key range), so an estimate
is of one call at given kv lengths: `DecodeCall(plan, kv_lengths)`, each length the keys its
batch element's queries may see, counted from the first key. The estimate is estimate.py's model
(schedule x clock factor + HBM + row stalls) with the kernel's own regions: the init at a unit's
first step ("first") and the block's work ("run"), for the steps in range.

What it leaves out, beyond estimate.py's list: the ranges are computed by XLA ops before the
kernel (counted in `rest_seconds`, as XLA estimates them); a batch whose lengths differ is
estimated at their mean.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import compat, mosaic
from ..decode import DecodePlan, DecodeProgram
from . import schedule
from .chips import chip
from .estimate import Estimate, program_estimate
from .libtpu import compile_schedules
from .work import Work


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """A decode plan at given kv lengths (one per batch element; None: the whole cache)."""

    plan: DecodePlan
    kv_lengths: tuple[int, ...] | None = None

    def lengths(self) -> np.ndarray:
        p = self.plan
        return np.full(p.batch, p.kv_len) if self.kv_lengths is None else np.asarray(self.kv_lengths)


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def decode_work(call: DecodeCall) -> Work:
    """The decode kernel's work per parallel unit (batch x kv heads x row blocks x splits)."""
    p = call.plan
    row_ranges = p.row_ranges().reshape(-1, 2)
    blocks = []  # kv blocks each unit runs
    for length in call.lengths():
        data_end = -(-int(length) // p.block_kv)
        for first, end in row_ranges:
            count = max(min(end, data_end) - first, 0)
            share = -(-count // p.splits)
            blocks += [max(min(share, count - s * share), 0) for s in range(p.splits)]
    units = len(blocks) * (p.num_kv_heads // p.block_heads)
    steps = -(-p.kv_blocks // p.splits)
    run = sum(blocks) / len(blocks)
    item = _itemsize(p.dtype)
    per_block = p.block_heads * p.block_kv * (p.head_dim + p.head_dim_v) * item + (
        4 * p.block_kv if p.has_segment_ids else 0
    )
    # a unit reads its rows, the blocks it runs, and one block to start its pipeline even when it runs none
    read = units * (p.block_heads * p.block_rows * p.head_dim * item + max(run, 1) * per_block)
    useful_keys = float(np.minimum(call.lengths(), p.kv_len).sum())
    flops = 2.0 * p.num_kv_heads * p.rows * useful_keys * (p.head_dim + p.head_dim_v)
    return Work(
        kind="decode",
        units=units,
        steps=steps,
        first=1,
        last=1,
        full=0,
        partial=math.ceil(run),
        flops=flops,
        read_bytes=float(read),
    )


def arguments(plan: DecodePlan) -> list:
    """ShapeDtypeStructs of the program's arguments."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(plan.dtype)
    b, hq, hkv = plan.batch, plan.num_q_heads, plan.num_kv_heads
    named = dict(
        q=jax.ShapeDtypeStruct((b, hq, plan.q_len, plan.head_dim), dtype),
        k=jax.ShapeDtypeStruct((b, hkv, plan.kv_len, plan.head_dim), dtype),
        v=jax.ShapeDtypeStruct((b, hkv, plan.kv_len, plan.head_dim_v), dtype),
        q_ids=jax.ShapeDtypeStruct((b, plan.q_len), jnp.int32),
        kv_ids=jax.ShapeDtypeStruct((b, plan.kv_len), jnp.int32),
        sinks=jax.ShapeDtypeStruct((hq,), jnp.float32),
    )
    return DecodeProgram(plan).arguments(**named)


def decode_estimate(call: DecodeCall, generation: str) -> Estimate:
    """The decode program compiled for one device of `generation`, its
    kernel estimated at the call's kv lengths, the XLA ops around it at XLA's own estimate."""
    program = DecodeProgram(call.plan)
    with compat.mosaic_ir_version(mosaic.ir_version()):
        schedules, hlo = compile_schedules(program.forward, tuple(arguments(call.plan)), generation)
    return program_estimate(schedules, {"decode": decode_work(call)}, hlo, generation)


def hbm_floor_seconds(call: DecodeCall, generation: str) -> float:
    """Reading the keys and values the call may see once, at the chip's HBM bandwidth."""
    p = call.plan
    keys = float(np.minimum(call.lengths(), p.kv_len).sum())
    return keys * p.num_kv_heads * (p.head_dim + p.head_dim_v) * _itemsize(p.dtype) / chip(generation).hbm_bandwidth


def dense_attention_seconds(call: DecodeCall, generation: str) -> tuple[float, float]:
    """(XLA's own estimate of the cycles, over the clock; the bytes its ops move, over the HBM
    bandwidth) of dense attention over the whole cache in XLA ops (q k^T, masked softmax, p v, the
    query heads of a kv head batched together), what an SDPA call lowers to on torch_xla. Not a
    schedule's estimate: XLA's."""
    import jax
    import jax.numpy as jnp

    p = call.plan

    def dense(q, k, v, length):
        b, hq, lq, d = q.shape
        q = q.reshape(b, p.num_kv_heads, p.group, lq, d)
        logits = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=jnp.float32) * p.scale
        keys = jnp.arange(p.kv_len)
        logits = jnp.where(keys < length[:, None, None, None, None], logits, -jnp.inf)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("bhgqk,bhkd->bhgqd", weights, v).reshape(b, hq, lq, -1)

    args = (
        *arguments(dataclasses.replace(p, has_segment_ids=False, has_sinks=False)),
        jax.ShapeDtypeStruct((p.batch,), jnp.int32),
    )
    _, hlo = compile_schedules(dense, args, generation)
    target = chip(generation)
    return schedule.rest_cycles(hlo) / target.clock, schedule.rest_bytes(hlo) / target.hbm_bandwidth
