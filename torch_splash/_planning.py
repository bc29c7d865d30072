"""The plan of a checked call: the decode kernel's (`torch_splash_jax.decode`) where the call takes
it, else the splash kernels' (`torch_splash_jax.plan`), at the shapes each device sees when sharded.

Plans made for TPU are also handed to `recording_plans` (torch_splash.fit estimates a step's kernel
time from them).
"""

from __future__ import annotations

import contextlib
import threading

import torch_splash_jax
from torch_splash_jax import SplashConstraintError, decode

from . import _checks, _platform, _sharding

_RECORDING = threading.local()


def plan_call(call: _checks.CheckedCall, kernel, block_sizes, sharding: _sharding.Sharding | None, backward: bool):
    """The call's plan: a `DecodePlan` when it takes the decode kernel (`kernel`, or by default),
    else a splash `Plan`. `backward`: whether the call needs gradients."""
    plan = decode_plan(call, kernel, block_sizes, sharding, backward)
    if plan is not None:
        backward = False
    else:
        plan = splash_plan(call, block_sizes, call.platform, sharding)
    plans = getattr(_RECORDING, "plans", None)
    if plans is not None and plan.platform == "tpu":
        plans.append((plan, backward))
    return plan


@contextlib.contextmanager
def recording_plans():
    """Within it, every attention call planned for TPU appends (plan, with a backward) to the list
    it yields: what torch_splash.fit estimates the kernel time of."""
    before = getattr(_RECORDING, "plans", None)
    _RECORDING.plans = []
    try:
        yield _RECORDING.plans
    finally:
        _RECORDING.plans = before


def plan_fields(call: _checks.CheckedCall) -> dict:
    """What every plan of a checked call is made of: its sizes (ints: under torch.compile these are
    fake tensors' sizes, specialised by `_checks.static_shape`), dtype, mask and options."""
    batch, q_heads, q_len, head_dim = (int(n) for n in call.q.shape)
    return dict(
        batch=batch,
        num_q_heads=q_heads,
        num_kv_heads=int(call.k.shape[1]),
        q_len=q_len,
        kv_len=int(call.k.shape[2]),
        head_dim=head_dim,
        head_dim_v=int(call.v.shape[-1]),
        dtype=_checks.dtype_name(call.q),
        mask=call.mask,
        scale=call.scale,
        soft_cap=call.soft_cap,
        has_segment_ids=call.segment_ids is not None,
        has_sinks=call.sinks is not None,
        platform=call.platform,
    )


def splash_plan(
    call: _checks.CheckedCall, block_sizes, platform: str, sharding: _sharding.Sharding | None
) -> torch_splash_jax.Plan:
    """The plan of a checked call: at the shapes each device sees when sharded."""
    fields = dict(plan_fields(call), platform=platform, block_sizes=block_sizes)
    if platform == "tpu":
        fields["generation"] = _platform.generation_of(call.q.device)
    if sharding is not None:
        local = sharding.local(fields["batch"], fields["num_q_heads"], fields["num_kv_heads"])
        fields.update(zip(("batch", "num_q_heads", "num_kv_heads"), local))
        fields.update(
            q_shards=sharding.q_shards,
            sequence_layout=sharding.layout,
            head_shards=sharding.shards(sharding.heads),
            context_parallel=sharding.context_parallel,
        )
    return torch_splash_jax.plan(**fields)


def decode_plan(call: _checks.CheckedCall, kernel, block_sizes, sharding, backward: bool):
    """The decode kernel's plan when this call takes it (by `kernel`, or by default where
    torch_splash_jax.decode's rule says so), else None."""
    if kernel not in (None, "splash", "decode"):
        raise SplashConstraintError(
            f"kernel={kernel!r}: expected 'splash', 'decode' or None (chosen by the call's shape)."
        )
    if kernel == "splash":
        return None
    fields = plan_fields(call)
    reason = decode.refusal(call.mask, sharded=sharding is not None, block_sizes=block_sizes, dtype=fields["dtype"])
    if reason is None and backward:
        reason = "it has no backward, and this call needs gradients (the splash kernels have one)"
    if kernel == "decode":
        if reason is not None:
            raise decode.explicit_refusal(reason)
    elif reason is not None or not decode.takes_by_default(
        fields["num_q_heads"], fields["num_kv_heads"], fields["q_len"], fields["kv_len"]
    ):
        return None
    return decode.decode_plan(**fields)
