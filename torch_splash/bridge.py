"""`torch_splash.attention`: splash attention for torch tensors, with gradients."""

from __future__ import annotations

import itertools

import torch

import jax_core
from jax_core import SplashConstraintError

from . import _checks, _sharding, _transport
from . import masks as _masks

# Splash as torch.library custom ops, so torch.compile / AOTAutograd trace through them: eager
# calls run the JAX programs; fake (meta) implementations give torch the output shapes. A call's
# plan (and SPMD sharding, if any) reaches the ops as an index into _CALLS (ops take ints, not
# objects); each op looks its program up in jax_core's cache. `chosen` is the transport
# attention() picked for these tensors; `requested` is the caller's request ("" for automatic),
# decided afresh for the backward's tensors.
_CALLS: dict[int, tuple[jax_core.Plan, _sharding.Sharding | None]] = {}  # least recently used first
_CALL_INDEX: dict[tuple, int] = {}
_MAX_CALLS = 1024  # plans can hold dense masks: keep the registry bounded, like jax_core's caches
_NEXT_INDEX = itertools.count()


def _call_index(plan: jax_core.Plan, sharding: _sharding.Sharding | None = None) -> int:
    key = (plan, sharding)
    index = _CALL_INDEX.get(key)
    if index is not None:
        _CALLS[index] = _CALLS.pop(index)  # now the most recently used
        return index
    while len(_CALLS) >= _MAX_CALLS:
        oldest = next(iter(_CALLS))
        del _CALL_INDEX[_CALLS.pop(oldest)]
    index = _CALL_INDEX[key] = next(_NEXT_INDEX)
    _CALLS[index] = key
    return index


def _entry(index: int) -> tuple[jax_core.Plan, _sharding.Sharding | None]:
    try:
        return _CALLS[index]
    except KeyError:
        raise RuntimeError(
            f"torch_splash: attention call #{index} is no longer registered: more than {_MAX_CALLS} other "
            "attention configurations were used since it was traced. Call torch._dynamo.reset() to recompile."
        ) from None


def _run(index: int, kernel: str, inputs: list, transport: str, out_roles: tuple) -> list[torch.Tensor]:
    """The program's `kernel` on `inputs`, (role, tensor) pairs (the tensor None for absent segment
    ids); roles (_sharding.Sharding.spec) say how each tensor is sharded under SPMD."""
    plan, sharding = _entry(index)
    fn = getattr(jax_core.program(plan), kernel)
    roles, tensors = zip(*[(role, t) for role, t in inputs if t is not None])
    if sharding is None:
        return _transport.run(fn, list(tensors), transport, plan.platform)
    return sharding.run(fn, tensors, roles, out_roles, plan.platform)


def _inputs(q, k, v, q_ids, kv_ids, sinks) -> list:
    return [("q", q), ("kv", k), ("kv", v), ("ids", q_ids), ("ids", kv_ids), ("sinks", sinks)]


@torch.library.custom_op("torch_splash::forward", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    call: int,
    chosen: str,
    requested: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and logsumexp (the one residual torch does not already hold)."""
    out, lse = _run(call, "forward", _inputs(q, k, v, q_ids, kv_ids, sinks), chosen, ("q", "lse"))
    return out, lse


@_forward.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, call, chosen, requested):
    lse_len = _entry(call)[0].q_len_padded
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:2] + (lse_len,), dtype=torch.float32)


@torch.library.custom_op("torch_splash::infer", mutates_args=())
def _infer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    call: int,
    chosen: str,
) -> torch.Tensor:
    """The forward without residuals, where no gradient is needed."""
    (out,) = _run(call, "infer", _inputs(q, k, v, q_ids, kv_ids, sinks), chosen, ("q",))
    return out


@_infer.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, call, chosen):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("torch_splash::backward", mutates_args=())
def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    call: int,
    requested: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (and d_sinks; empty without sinks) from the dq/dkv kernels alone, on the
    forward's residuals."""
    inputs = _inputs(q, k, v, q_ids, kv_ids, sinks) + [("q", out), ("lse", lse), ("q", d_out)]
    transport = _transport.choose([t for _, t in inputs if t is not None], requested or None)
    grads = _run(call, "backward", inputs, transport, ("q", "kv", "kv", "d_sinks"))
    dq, dk, dv, d_sinks = (*grads, q.new_empty(0)) if sinks is None else grads
    return dq, dk, dv, d_sinks


@_backward.register_fake
def _(q, k, v, q_ids, kv_ids, sinks, out, lse, d_out, call, requested):
    d_sinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_sinks  # contiguous, as the real ones


def _save_residuals(ctx, inputs, output):
    q, k, v, q_ids, kv_ids, sinks, call, _, requested = inputs
    ctx.entry, ctx.requested = _entry(call), requested  # the entry, not the index: it may be evicted
    ctx.save_for_backward(q, k, v, q_ids, kv_ids, sinks, *output)
    ctx.mark_non_differentiable(output[1])


def _differentiate(ctx, d_out, _):
    if torch.is_grad_enabled():  # create_graph=True
        raise SplashConstraintError(
            "torch_splash.attention supports one backward pass, not double backward "
            "(create_graph=True): the splash dq/dkv kernels have no derivative of their own."
        )
    q, k, v, q_ids, kv_ids, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv, d_sinks = _backward(
        q, k, v, q_ids, kv_ids, sinks, out, lse, d_out, _call_index(*ctx.entry), ctx.requested
    )
    return dq, dk, dv, None, None, None if sinks is None else d_sinks, None, None, None


_forward.register_autograd(_differentiate, setup_context=_save_residuals)

# The options attention() takes cross into torch.compile's nonstrict_trace region as constants:
# Dynamo guards on their equality and recompiles when one changes.
for _option in (jax_core.BlockSizes, *_masks.TYPES):
    torch.utils._pytree.register_constant(_option)


def _plan(call: _checks.Call, block_sizes, platform: str, sharding: _sharding.Sharding | None) -> jax_core.Plan:
    """The plan of a checked call: at the shapes each device sees when sharded."""
    batch, q_heads, q_len, head_dim = call.q.shape
    kv_heads = call.k.shape[1]
    if sharding is not None:
        batch, q_heads, kv_heads = sharding.local(batch, q_heads, kv_heads)
    return jax_core.plan(
        batch=batch,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        q_len=q_len,
        kv_len=call.k.shape[2],
        head_dim=head_dim,
        head_dim_v=call.v.shape[-1],
        dtype=_checks.dtype_name(call.q),
        mask=call.mask,
        scale=call.scale,
        soft_cap=call.soft_cap,
        has_segment_ids=call.segment_ids is not None,
        block_sizes=block_sizes,
        platform=platform,
        has_sinks=call.sinks is not None,
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    scale: float | None = None,
    segment_ids=None,
    soft_cap: float | None = None,
    block_sizes: jax_core.BlockSizes | None = None,
    transport: str | None = None,
    partition_spec: tuple | None = None,
    mesh=None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Splash attention: softmax(scale * q k^T, masked) v, through the JAX Pallas kernels.

    q (B, Hq, Lq, D), k (B, Hkv, Lkv, D), v (B, Hkv, Lkv, Dv), or the same without B. Hq must be a
    multiple of Hkv (GQA groups consecutive query heads, like SDPA's enable_gqa; Hkv == 1 uses the
    MQA kernel). Returns (B, Hq, Lq, Dv) with q's dtype and device (float16 is computed in float32).

    mask: None, "causal" (SDPA's is_causal, top-left aligned) or a `torch_splash.masks` mask.
    scale: defaults to 1/sqrt(D). soft_cap: tanh capping of the scaled logits (Gemma 2).
    segment_ids: int (B, L) when Lq == Lkv, or a pair (q_ids (B, Lq), kv_ids (B, Lkv)); a query
    sees only keys with its id. block_sizes: `BlockSizes(...)`; fields left None are planned.
    transport: "dlpack" or "graph" (torch_xla's lazy graph; torch_xla tensors only); default: the
    environment variable TORCH_SPLASH_TRANSPORT, else automatic (in-graph on TPU and whenever a
    torch_xla input is part of a pending lazy graph, DLPack otherwise).
    partition_spec, mesh: under torch_xla SPMD, how q, k, v are sharded over a mesh (default: the
    global mesh), e.g. ("data", "model", None, None): batch and heads only; each device runs the
    kernels on its own shard (see torch_splash/_sharding.py).
    sinks: (Hq,) attention sinks (gpt-oss): one learned logit per query head that every row also
    normalises over, as if a key with that logit and a zero value were always visible.

    Raises SplashConstraintError (a ValueError) or SplashDtypeError (a TypeError) before any JAX
    work when an input or option breaks a kernel constraint. Rows with no visible key return 0.
    """
    # Dynamo refuses None as an argument of a nonstrict_trace function: pass on only what is set.
    # Under compile a structured mask crosses as its source text (see masks.to_source).
    source = _masks.to_source(mask) if torch.compiler.is_compiling() else None
    options = dict(
        mask=mask if source is None else None,
        mask_source=source,
        scale=scale,
        segment_ids=segment_ids,
        soft_cap=soft_cap,
        block_sizes=block_sizes,
        transport=transport,
        partition_spec=partition_spec,
        mesh=mesh,
        sinks=sinks,
    )
    return _attention(q, k, v, **{name: value for name, value in options.items() if value is not None})


# Under torch.compile, Dynamo does not trace this body (checks and planning: plain Python on
# shapes): it runs on fake tensors while the graph is built and leaves only the custom ops in it.
@torch._dynamo.nonstrict_trace
def _attention(
    q,
    k,
    v,
    mask=None,
    *,
    mask_source=None,
    scale=None,
    segment_ids=None,
    soft_cap=None,
    block_sizes=None,
    transport=None,
    partition_spec=None,
    mesh=None,
    sinks=None,
) -> torch.Tensor:
    if mask_source is not None:
        mask = _masks.from_source(mask_source)
    call = _checks.check_call(q, k, v, mask, scale, segment_ids, soft_cap, sinks)
    sharding = _sharding.check(partition_spec, mesh, call, transport)
    if sharding is not None:
        call = sharding.spread_single_kv_head(call)
    tensors = (call.q, call.k, call.v, *(call.segment_ids or ()))
    chosen = _transport.choose(list(tensors), transport)  # before any JAX work: it validates `transport`
    plan = _plan(call, block_sizes, call.platform, sharding)
    index, q_ids, kv_ids = _call_index(plan, sharding), *(call.segment_ids or (None, None))
    differentiable = [call.q, call.k, call.v] + ([] if call.sinks is None else [call.sinks])
    if torch.is_grad_enabled() and any(t.requires_grad for t in differentiable):
        out, _ = _forward(call.q, call.k, call.v, q_ids, kv_ids, call.sinks, index, chosen, transport or "")
    else:  # no autograd graph to build: the cheaper forward, and no residuals
        out = _infer(call.q, call.k, call.v, q_ids, kv_ids, call.sinks, index, chosen)
    if call.out_dtype is not None:
        out = out.to(call.out_dtype)
    return out.squeeze(0) if call.unbatched else out
