"""The `ring` part of `tpu_check`: a ring's step programs on one chip, device after device.

A ring over S devices runs, on each, one program a step (`torch_splash_jax.ring`); one chip can run
every device's in turn, handing on what the ring's collectives would (the held keys, the sums of dk
and dv). So the chip measures what a slice would run but for the collectives: the whole ring's
output and gradients against the unsharded call on the same chip (`relative_error`, within
`TOLERANCE`), and the time of each of device 0's steps, forward and backward, for the active
kernels and for JAX's splash kernels, side by side.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from .. import masks
from ..block_sizes import BlockSizes
from ..plan import plan as make_plan
from ..program_cache import program as cached_program
from .cases import TOLERANCE
from .reference import relative_error

# (total tokens, devices, query heads, kv heads): 16K tokens a device, causal, balanced, D=128, bf16
# (each device's steps run at the shapes of 256K over 16 devices); quick: a CPU's moment
RING = (65536, 4, 16, 8)
QUICK_RING = (4096, 4, 2, 1)
KERNELS = {"active": None, "splash": BlockSizes(forward_kernel="splash")}


def rows(platform: str, quick: bool, timed) -> list[dict]:
    """A row for each kernel: the ring's errors against the unsharded call, device 0's step times."""
    length, shards, heads, kv_heads = QUICK_RING if quick else RING
    common = dict(q_len=length, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=128, dtype="bfloat16")
    common.update(mask=masks.CausalMask(), platform=platform)
    rng = np.random.default_rng(0)
    shapes = [(1, heads, length, 128), (1, kv_heads, length, 128), (1, kv_heads, length, 128), (1, heads, length, 128)]
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    whole = cached_program(make_plan(**common))
    out, lse = whole.forward(q, k, v)
    expected = [out, *whole.backward(q, k, v, out, lse, d_out)]
    found = []
    for kernels, blocks in KERNELS.items():
        plan = make_plan(
            **common, block_sizes=blocks, q_shards=shards, sequence_layout="balanced", context_parallel="ring"
        )
        start = time.perf_counter()
        got, forward_s, backward_s = device_by_device(cached_program(plan), q, k, v, d_out, timed=timed)
        errors = {name: relative_error(x, r) for name, x, r in zip(("out", "dq", "dk", "dv"), got, expected)}
        found.append(
            dict(
                kernels=kernels,
                forward_kernel=plan.forward_kernel,
                backward_kernel=plan.backward_kernel,
                tokens=length,
                devices=shards,
                heads=[heads, kv_heads],
                errors=errors,
                passed=max(errors.values()) <= TOLERANCE,
                device0_forward_ms=[round(s * 1e3, 3) for s in forward_s],
                device0_backward_ms=[round(s * 1e3, 3) for s in backward_s],
                device0_ms=round(1e3 * (sum(forward_s) + sum(backward_s)), 2),
                seconds=round(time.perf_counter() - start, 1),
            )
        )
    return found


def device_by_device(ring, q, k, v, d_out, ids=None, sink=None, timed=None):
    """The ring's output, dq, dk, dv (and, given `sink`, the sinks' gradient) for whole-sequence
    inputs, as float32 arrays, its step programs run device after device: each device's shards,
    every step's tables, dk and dv handed on with the keys they belong to; ids (B, L) segment ids.
    With `timed` (a function that times one call) also the seconds of each of device 0's forward
    and backward steps (else two empty lists)."""
    plan, shards = ring.plan, ring.plan.q_shards
    rows_of = plan.shard_positions()[:, : plan.q_len]
    keys_of = ring.steps[0].plan.ring_kv_positions()[:, : plan.kv_len]  # each device's own keys
    k = ring.scaled_keys(k)  # the keys travel scaled (each device scales its own shard once)
    tables = [[[jnp.asarray(t) for t in step.device_tables(d)] for d in range(shards)] for step in ring.steps]

    def held(s, d):
        keys = keys_of[(d - s) % shards]
        named = dict(q=q[:, :, rows_of[d]], k=k[:, :, keys], v=v[:, :, keys])
        if ids is not None:
            named.update(q_ids=ids[:, rows_of[d]], kv_ids=ids[:, keys])
        return named

    forward_s, backward_s = [], []
    sums = [{} for _ in range(shards)]
    for s in range(shards):
        for d in range(shards):
            args = ring.arguments("forward", s, tables[s][d], **held(s, d), **sums[d])
            if timed is not None and d == 0:
                forward_s.append(timed(ring.forward[s], *args))
            sums[d] = dict(zip(("out_acc", "lse_acc"), ring.forward[s](*args)))
    finished = [ring.finish(*ring.arguments("finish", sinks=sink, **sums[d])) for d in range(shards)]
    dq, dkv = [{} for _ in range(shards)], [{} for _ in range(shards)]
    for s in range(shards):
        for d in range(shards):
            out, lse = finished[d]
            mine = (d - s) % shards  # whose keys device d holds: their dk and dv travel with them
            args = ring.arguments(
                "backward", s, tables[s][d], **held(s, d), out=out, lse=lse, d_out=d_out[:, :, rows_of[d]],
                **dq[d], **dkv[mine],
            )  # fmt: skip
            if timed is not None and d == 0:
                backward_s.append(timed(ring.backward[s], *args))
            dq[d]["dq_acc"], dk, dv = ring.backward[s](*args)
            dkv[mine] = dict(dk_acc=dk, dv_acc=dv)
    got = [np.zeros(x.shape, np.float32) for x in (d_out, q, k, v)]
    for d in range(shards):
        got[0][:, :, rows_of[d]] = np.asarray(finished[d][0], np.float32)
        got[1][:, :, rows_of[d]] = np.asarray(dq[d]["dq_acc"], np.float32)
        got[2][:, :, keys_of[d]] = np.asarray(dkv[d]["dk_acc"], np.float32)
        got[3][:, :, keys_of[d]] = np.asarray(dkv[d]["dv_acc"], np.float32)
    if sink is not None:
        grads = [ring.sinks_grad(o, lse, d_out[:, :, rows_of[d]], sink) for d, (o, lse) in enumerate(finished)]
        got.append(sum(np.asarray(g, np.float32) for g in grads))
    return got, forward_s, backward_s
