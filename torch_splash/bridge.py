"""`torch_splash.attention`: splash attention for torch tensors, with gradients."""

from __future__ import annotations

import torch

import jax_core

from . import _checks, _transport


class _SplashAttention(torch.autograd.Function):
    """Forward runs the Pallas forward once and keeps its residuals as tensors (the inputs, the
    output and the logsumexp); backward runs only the dq and dkv kernels on them."""

    @staticmethod
    def forward(ctx, program, transport, chosen, q, k, v, *segment_ids):
        # `transport` is the caller's request, re-decided for the backward's own inputs; `chosen`
        # is what attention() already decided for these.
        out, lse = _transport.run(program.forward, [q, k, v, *segment_ids], chosen)
        ctx.program = program
        ctx.transport = transport
        ctx.num_ids = len(segment_ids)
        ctx.save_for_backward(q, k, v, *segment_ids, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out):
        if torch.is_grad_enabled():  # create_graph=True: a graph of the backward was asked for
            raise NotImplementedError(
                "torch_splash.attention supports one backward pass, not double backward "
                "(create_graph=True): the splash dq/dkv kernels have no derivative of their own."
            )
        tensors = [*ctx.saved_tensors, d_out]
        dq, dk, dv = _transport.run(ctx.program.backward, tensors, _transport.choose(tensors, ctx.transport))
        return (None, None, None, dq, dk, dv) + (None,) * ctx.num_ids


# torch.compile cannot trace into JAX: Dynamo runs this function eagerly, with a graph break
# around it (fullgraph=True needs torch.library custom ops, not built yet).
@torch.compiler.disable
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
) -> torch.Tensor:
    """Splash attention: softmax(scale * q k^T, masked) v, through the JAX Pallas kernels.

    q (B, Hq, Lq, D), k (B, Hkv, Lkv, D), v (B, Hkv, Lkv, Dv), or the same without B. Hq must be a
    multiple of Hkv (GQA groups consecutive query heads, like SDPA's enable_gqa; Hkv == 1 uses the
    MQA kernel). Returns (B, Hq, Lq, Dv) with q's dtype and device.

    mask: None, "causal" (SDPA's is_causal, top-left aligned) or a `torch_splash.masks` mask.
    scale: defaults to 1/sqrt(D). soft_cap: tanh capping of the scaled logits (Gemma 2).
    segment_ids: int (B, L) when Lq == Lkv, or a pair (q_ids (B, Lq), kv_ids (B, Lkv)); a query
    sees only keys with its id. block_sizes: `BlockSizes(...)`; fields left None are planned.
    transport: "dlpack" or "graph" (torch_xla's lazy graph; torch_xla tensors only); default: the
    environment variable TORCH_SPLASH_TRANSPORT, else automatic (in-graph on TPU and whenever a
    torch_xla input is part of a pending lazy graph, DLPack otherwise).

    Raises SplashConstraintError (a ValueError) or SplashDtypeError (a TypeError) before any JAX
    work when an input or option breaks a kernel constraint. Rows with no visible key return 0.
    """
    call = _checks.check_call(q, k, v, mask, scale, segment_ids, soft_cap)
    tensors = (call.q, call.k, call.v, *(call.segment_ids or ()))
    chosen = _transport.choose(list(tensors), transport)  # before any JAX work: it validates `transport`
    platform = _transport.platform_of(call.q.device)
    batch, hq, q_len, head_dim = call.q.shape
    plan = jax_core.plan(
        batch=batch,
        num_q_heads=hq,
        num_kv_heads=call.k.shape[1],
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
    )
    program = jax_core.program(plan)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors[:3]):
        out = _SplashAttention.apply(program, transport, chosen, *tensors)
    else:  # no autograd graph to build: the cheaper forward, and no residuals
        (out,) = _transport.run(program.infer, list(tensors), chosen)
    return out.squeeze(0) if call.unbatched else out
