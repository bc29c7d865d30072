"""Splash as torch.library custom ops with autograd: what `attention` runs once a call is checked
and planned (`attend`).

Four ops, so that torch.compile / AOTAutograd trace through them: `forward` (output and the
logsumexp residual), `infer` (output only, where no gradient is needed), `backward` (dq, dk,
dv, d_sinks from the dq/dkv kernels on the forward's residuals) and `decode` (the decode kernel's
output and logsumexp; no gradient). Eager calls run the JAX programs; fake (meta)
implementations give torch the output shapes.
"""

from __future__ import annotations

import functools
import warnings

import torch

import torch_splash_jax
from torch_splash_jax import SplashConstraintError, policy, serialization

from . import _ring, _sharding, _transport

# Ops take tensors, ints and strings, not objects. A call's plan crosses as its text
# (torch_splash_jax.serialization), any mask data it holds as CPU tensors beside it (`mask_data`: read only
# when the text is not among the plans read last), its SPMD sharding as text ("" unsharded), and
# `transport` is the caller's request ("" for automatic): each op decides it for the tensors it is
# given (the backward's may be pending where the forward's were not).


def op_arguments(
    plan: torch_splash_jax.Plan, sharding: _sharding.Sharding | None
) -> tuple[list[torch.Tensor], str, str]:
    """What the ops take for a plan and sharding: the mask data, the plan's text, the sharding's."""
    text, arrays = serialization.plan_text(plan)
    with warnings.catch_warnings():  # the arrays are read-only, and so are these tensors
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        data = [torch.from_numpy(a) for a in arrays]
    return data, text, "" if sharding is None else sharding.text()


def _read(mask_data: list[torch.Tensor], plan: str, sharding: str):
    arrays = [t.numpy() for t in mask_data]
    return serialization.plan_from_text(plan, arrays), _sharding.from_text(sharding) if sharding else None


def _run(plan, sharding, kernel: str, named: dict, requested: str, out_roles: tuple) -> list[torch.Tensor]:
    """The program's `kernel` on the `named` tensors (q=..., k=..., ...; None for absent options),
    through the transport the caller requested ("" for automatic) for these tensors."""
    transport = _transport.choose([t for t in named.values() if t is not None], requested or None)
    program = torch_splash_jax.program(plan)
    if plan.ring:
        return _ring.run(program, sharding, kernel, named, _ring_tables(plan, sharding, named["q"].device))
    fn = getattr(program, kernel)
    # a sharded program takes every device's block tables (and query positions), split along the
    # sequence and the heads; an unsharded one whose mask is read from stored blocks takes its own
    tables = _table_tensors(plan, named["q"].device) if program.takes_tables else []
    tensors = program.arguments(kernel, tables, **named)
    if sharding is None:
        return _transport.run(fn, tensors, transport, plan.platform)
    names = program.signature(kernel)
    # the names ROLES does not know are the tables, in the order table_axes() describes them
    table_roles = iter(_sharding.table_role(axes) for axes in program.table_axes())
    roles = [_sharding.ROLES[name] if name in _sharding.ROLES else next(table_roles) for name in names]
    return sharding.run(fn, tensors, roles, out_roles, plan.platform)


@functools.lru_cache(maxsize=policy.TABLE_TENSORS)
def _table_tensors(plan: torch_splash_jax.Plan, device: torch.device) -> list[torch.Tensor]:
    # copied, so that the CPU's are aligned as JAX's DLPack import needs (NumPy's are not always)
    return [torch.from_numpy(a).to(device, copy=True) for a in torch_splash_jax.program(plan).tables()]


@functools.lru_cache(maxsize=policy.TABLE_TENSORS)
def _ring_tables(plan: torch_splash_jax.Plan, sharding: _sharding.Sharding, device) -> list[list[torch.Tensor]]:
    """Every step's tables, each device holding only its own slice: the devices' tables of all
    steps together are as large as the whole sequence's (one entry per q block x kv block)."""
    program = torch_splash_jax.program(plan)
    return [
        [
            sharding.placed(torch.from_numpy(a).to(device), axes)
            for a, axes in zip(program.tables(s), program.table_axes(s))
        ]
        for s in range(plan.q_shards)
    ]


def _inputs(q, k, v, q_ids, kv_ids, sinks) -> dict:
    return dict(q=q, k=k, v=v, q_ids=q_ids, kv_ids=kv_ids, sinks=sinks)


@torch.library.custom_op("torch_splash::forward", mutates_args=())
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    mask_data: list[torch.Tensor],
    plan: str,
    sharding: str,
    transport: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and logsumexp (the one residual torch does not already hold)."""
    out, lse = _run(
        *_read(mask_data, plan, sharding), "forward", _inputs(q, k, v, q_ids, kv_ids, sinks), transport, ("q", "lse")
    )
    return out, lse


@forward.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, mask_data, plan, sharding, transport):
    fields = serialization.plan_fields(plan)  # shapes only: the mask's data is not read
    lse_len = fields["q_len_padded"] * fields["q_shards"]
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:2] + (lse_len,), dtype=torch.float32)


@torch.library.custom_op("torch_splash::infer", mutates_args=())
def infer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    mask_data: list[torch.Tensor],
    plan: str,
    sharding: str,
    transport: str,
) -> torch.Tensor:
    """The forward without residuals, where no gradient is needed."""
    (out,) = _run(*_read(mask_data, plan, sharding), "infer", _inputs(q, k, v, q_ids, kv_ids, sinks), transport, ("q",))
    return out


@infer.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, mask_data, plan, sharding, transport):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("torch_splash::backward", mutates_args=())
def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    mask_data: list[torch.Tensor],
    plan: str,
    sharding: str,
    transport: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (and d_sinks; empty without sinks) from the dq/dkv kernels alone, on the
    forward's residuals."""
    inputs = dict(_inputs(q, k, v, q_ids, kv_ids, sinks), out=out, lse=lse, d_out=d_out)
    grads = _run(*_read(mask_data, plan, sharding), "backward", inputs, transport, ("q", "kv", "kv", "d_sinks"))
    dq, dk, dv, d_sinks = (*grads, q.new_empty(0)) if sinks is None else grads
    return dq, dk, dv, d_sinks


@backward.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, out, lse, d_out, mask_data, plan, sharding, transport):
    d_sinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_sinks  # contiguous, as the real ones


@torch.library.custom_op("torch_splash::decode", mutates_args=())
def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    plan: str,
    transport: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel (torch_splash_jax.decode): output and logsumexp (B, Hq, Lq) float32, -inf on
    rows that see no key. No gradient: calls that need one take the splash ops."""
    program = torch_splash_jax.program(serialization.plan_from_text(plan))
    named = _inputs(q, k, v, q_ids, kv_ids, sinks)
    tensors = program.arguments(**named)
    chosen = _transport.choose(tensors, transport or None)
    out, lse = _transport.run(program.forward, tensors, chosen, program.plan.platform)
    return out, lse


@decode.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, plan, transport):
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=torch.float32)


def attend(call, plan, sharding, transport: str | None, needs_grad: bool, return_lse: bool):
    """A checked, planned call (`_checks.CheckedCall`, its `Plan` or `DecodePlan`) through its op:
    (out, the logsumexp (B, Hq, Lq) with -inf on rows that see no key, or None without return_lse).
    Without gradients the infer op runs: no autograd graph, no residuals."""
    q_ids, kv_ids = call.segment_ids or (None, None)
    tensors = (call.q, call.k, call.v, q_ids, kv_ids, call.sinks)
    if isinstance(plan, torch_splash_jax.DecodePlan):
        out, lse = decode(*tensors, serialization.plan_text(plan)[0], transport or "")
        return out, lse if return_lse else None
    called = (*op_arguments(plan, sharding), transport or "")
    if not (needs_grad or return_lse):
        return infer(*tensors, *called), None
    out, lse = forward(*tensors, *called)
    if not return_lse:
        return out, None
    lse = lse[..., : plan.q_len]
    return out, torch.where(lse > torch_splash_jax.EMPTY_ROW_LSE, lse, float("-inf"))


def _save_residuals(ctx, inputs, output):
    q, k, v, q_ids, kv_ids, sinks, mask_data, plan, sharding, transport = inputs
    ctx.plan, ctx.sharding, ctx.transport = plan, sharding, transport
    ctx.save_for_backward(q, k, v, q_ids, kv_ids, sinks, *output, *mask_data)
    ctx.mark_non_differentiable(output[1])


def _differentiate(ctx, d_out, _):
    if torch.is_grad_enabled():  # create_graph=True
        raise SplashConstraintError(
            "torch_splash.attention supports one backward pass, not double backward "
            "(create_graph=True): the splash dq/dkv kernels have no derivative of their own."
        )
    q, k, v, q_ids, kv_ids, sinks, out, lse, *mask_data = ctx.saved_tensors
    dq, dk, dv, d_sinks = backward(
        q, k, v, q_ids, kv_ids, sinks, out, lse, d_out, mask_data, ctx.plan, ctx.sharding, ctx.transport
    )
    no_grads = [None] * len(mask_data)  # one per tensor of the list: autograd matches the inputs' structure
    return dq, dk, dv, None, None, None if sinks is None else d_sinks, no_grads, None, None, None


forward.register_autograd(_differentiate, setup_context=_save_residuals)
