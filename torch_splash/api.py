"""`torch_splash.attention`: splash attention for torch tensors, with gradients.

A call takes one route (docs/design.md, "Data flow"): check the arguments (`_checks`), the SPMD
sharding (`_sharding`) and the transport request (`_transport.choose`); plan it
(`_planning`: the decode kernel's plan or the splash kernels', from `torch_splash_jax`); run it
through its custom op (`_ops.attend`), which reaches JAX through `_transport`, and whose backward
returns the gradients to torch.
"""

from __future__ import annotations

import torch

import torch_splash_jax
from torch_splash_jax import SplashConstraintError, serialization

from . import _checks, _compat, _compile_constants, _ops, _planning, _sharding, _transport

_compile_constants.register_options()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    scale: float | None = None,
    segment_ids=None,
    soft_cap: float | None = None,
    block_sizes: torch_splash_jax.BlockSizes | None = None,
    transport: str | None = None,
    partition_spec: tuple | None = None,
    mesh=None,
    sinks: torch.Tensor | None = None,
    sequence_layout: str | None = None,
    context_parallel: str | None = None,
    return_lse: bool = False,
    kernel: str | None = None,
):
    """Splash attention: softmax(scale * q k^T + mask) v, through the JAX Pallas splash kernels.

    Args:
        q: (B, Hq, Lq, D), or (Hq, Lq, D) unbatched; float32, bfloat16 or float16 (computed in
            float32), on the CPU, a torch_xla device or TorchTPU's "tpu" device.
        k: (B, Hkv, Lkv, D). Hq must be a multiple of Hkv: query head h uses kv head
            h // (Hq / Hkv), as SDPA's ``enable_gqa``; Hkv == 1 runs the MQA kernel.
        v: (B, Hkv, Lkv, Dv).
        mask: None; "causal" (SDPA's ``is_causal``, top-left aligned when Lq != Lkv); a
            ``torch_splash.masks`` mask; a bool tensor (Lq, Lkv) or (1 or Hq, Lq, Lkv), True =
            attend; or a list of one mask per query head.
        scale: the softmax scale; default 1 / sqrt(D).
        segment_ids: an integer tensor (B, L) when Lq == Lkv, or a pair (q_ids (B, Lq), kv_ids
            (B, Lkv)): a query sees only keys with its own id (packed documents).
        soft_cap: ``cap * tanh(logits / cap)`` on the scaled logits (Gemma 2).
        block_sizes: ``BlockSizes(...)``; fields left None are planned for the platform.
        transport: "dlpack", "graph" (torch_xla's lazy graph) or "torchtpu" (TorchTPU's
            ``torch.tpu.pallas.jax_op``, the only one for its tensors); default: the environment
            variable TORCH_SPLASH_TRANSPORT, else "torchtpu" for TorchTPU tensors, in-graph on
            torch_xla's TPU and whenever a torch_xla input is part of a pending lazy graph, DLPack
            otherwise.
        partition_spec: under torch_xla SPMD, the mesh axes q, k, v are sharded over, e.g.
            ("data", "model", "seq", None): batch, heads and the query sequence (k and v gathered
            whole, or passed around with ``context_parallel="ring"``); each device runs the kernels
            on its shard. torch_xla only.
        mesh: the torch_xla ``Mesh`` of ``partition_spec``; default: the global mesh.
        sequence_layout: with the query sequence sharded, "contiguous" (default: each device holds
            consecutive rows) or "balanced" (each device holds two mirrored chunks, so that causal
            work is even); applied and undone here, the caller's tensors stay in order.
        context_parallel: with the query sequence sharded, "all_gather" (default: k and v are
            gathered whole on every device; fastest where it fits) or "ring" (k and v are sharded
            like q and passed around the sequence axis step by step, merging by logsumexp, so
            that no device holds more than one shard of them: memory per device falls with the
            devices). The ring needs Lkv divisible like Lq.
        sinks: (Hq,) attention sinks (gpt-oss): one logit per query head that every row also
            normalises over, as if a key with that logit and a zero value were always visible.
        return_lse: also return the logsumexp of each row's scaled (and soft-capped) logits,
            (B, Hq, Lq) float32, natural log, -inf on rows that see no key (FlexAttention's
            convention). It carries no gradient. Unsharded calls without sinks only.
        kernel: None (default): decode-shaped calls (few query rows per kv head against more
            keys, no gradient needed) take the decode kernel, the others the splash kernels;
            "decode" or "splash" choose. The decode kernel reads k and v once per kv head in
            their own layout and skips the blocks past each batch element's keys (its segment
            ids, as data); it has no backward, so a call that needs gradients takes the splash
            kernels by default and is refused with kernel="decode".

    Returns:
        (B, Hq, Lq, Dv) (or (Hq, Lq, Dv)) in q's dtype, on q's device, and the logsumexp with
        return_lse. A query row that sees no key is 0, with zero gradients. Differentiable in q, k,
        v and sinks (one backward pass).

    Raises:
        SplashConstraintError: (a ValueError) shapes, lengths, heads, devices, block sizes, masks
            or options the kernels cannot serve.
        SplashDtypeError: (a TypeError) arguments of the wrong type, or unsupported dtypes.
        Both are raised before any JAX work; both are ``torch_splash.SplashError``.
    """
    # Dynamo refuses None as an argument of a nonstrict_trace function: pass on only what is set.
    # Under compile a structured mask crosses as its source text (see _compile_constants).
    source = None
    if torch.compiler.is_compiling():
        for t in (q, k, v):
            if isinstance(t, torch.Tensor):  # others are refused by name in the checks
                _checks.static_shape(t)
        scale, soft_cap = _checks.static_float(scale), _checks.static_float(soft_cap)
        source = serialization.mask_source(mask)
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
        sequence_layout=sequence_layout,
        context_parallel=context_parallel,
        return_lse=return_lse or None,
        kernel=kernel,
    )
    return _attention(q, k, v, **{name: value for name, value in options.items() if value is not None})


# Under torch.compile, Dynamo does not trace this body (checks and planning: plain Python on
# shapes): it runs on fake tensors while the graph is built and leaves only the custom ops in it.
@_compat.nonstrict_trace
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
    sequence_layout=None,
    context_parallel=None,
    return_lse=False,
    kernel=None,
):
    """`attention`'s work; with return_lse, (out, the kernels' logsumexp (B, Hq, Lq) float32 of the
    scaled logits, natural log, -inf on rows that see no key). Unsharded calls without sinks only."""
    if mask_source is not None:
        mask = serialization.mask_from_source(mask_source)
    call = _checks.check_call(q, k, v, mask, scale, segment_ids, soft_cap, sinks)
    sharding = _sharding.check(partition_spec, mesh, call, transport, sequence_layout, context_parallel)
    if return_lse and (sharding is not None or call.sinks is not None):
        raise SplashConstraintError(
            "return_lse=True: the logsumexp is returned for unsharded calls without sinks only: drop "
            f"{'partition_spec' if sharding is not None else 'sinks'}."
        )
    if sharding is not None:
        call = sharding.spread_single_kv_head(call)
    tensors = (call.q, call.k, call.v, *(call.segment_ids or ()))
    _transport.choose(list(tensors), transport)  # validates `transport` before any JAX work; the ops choose again
    differentiable = [call.q, call.k, call.v] + ([] if call.sinks is None else [call.sinks])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    plan = _planning.plan_call(call, kernel, block_sizes, sharding, needs_grad)
    out, lse = _ops.attend(call, plan, sharding, transport, needs_grad, return_lse)
    return _returned(call, out, lse)


def _returned(call: _checks.CheckedCall, out, lse):
    """What `attention` returns: out in the caller's dtype and batching, with lse when given."""
    if call.out_dtype is not None:
        out = out.to(call.out_dtype)
    out = out.squeeze(0) if call.unbatched else out
    if lse is None:
        return out
    return out, lse.squeeze(0) if call.unbatched else lse


def attention_backward(q, k, v, out, lse, d_out, mask, *, scale=None, soft_cap=None):
    """dq, dk, dv of ``attention(q, k, v, mask, scale=..., soft_cap=..., return_lse=True)`` from
    what it returned (out, lse) and out's gradient d_out: its backward, the dq/dkv kernels alone, for a
    caller that holds those instead of an autograd graph (a custom op's own backward)."""
    call = _checks.check_call(q, k, v, mask, scale, None, soft_cap)
    plan = _planning.splash_plan(call, None, call.platform, None)
    # the kernels' rows past Lq, and rows that saw no key (-inf here), take +inf: p = 0 there
    lse = torch.where(torch.isneginf(lse), torch.inf, lse)
    lse = torch.nn.functional.pad(lse, (0, plan.q_len_padded - plan.q_len), value=torch.inf)
    computed = call.q.dtype
    dq, dk, dv, _ = _ops.backward(
        call.q, call.k, call.v, None, None, None, out.to(computed), lse, d_out.to(computed),
        *_ops.op_arguments(plan, None), "",
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
