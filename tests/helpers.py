"""The tests' one home for references and inputs: the dense mask a torch_splash mask means, the
SDPA / float64 reference, input factories and the comparison against the reference."""

import torch
import torch.nn.functional as F

import torch_splash

TOL = {
    # f32: the kernel accumulates in f32 like SDPA; measured errors are about 1e-6 (out) and 1e-5 (grads).
    torch.float32: dict(out=(2e-5, 1e-5), grad=(1e-4, 1e-4)),
    # bf16: one bf16 rounding of values of size ~1 is 4e-3; the kernel's bf16 matmul operands and
    # outputs add a few of those.
    torch.bfloat16: dict(out=(2e-2, 2e-2), grad=(5e-2, 2e-2)),
}


def dense_mask(mask, q_len, kv_len, segment_ids=None, heads=1):
    """The bool (B or 1, H or 1, Lq, Lkv) mask that a torch_splash mask and segment ids mean."""
    import torch_splash

    if isinstance(mask, torch.Tensor):
        allowed = mask.cpu()
        while allowed.dim() < 4:
            allowed = allowed[None]
    else:
        spec = torch_splash.masks.normalize(mask, 1, heads, q_len, kv_len)
        allowed = torch.from_numpy(spec.dense(q_len, kv_len).copy())
        allowed = allowed[None] if allowed.dim() == 3 else allowed[None, None]
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        allowed = allowed & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    return allowed


def reference(q, k, v, mask=None, *, scale=None, segment_ids=None, soft_cap=None, sinks=None, dtype=torch.float32):
    """SDPA in `dtype` (float32, or float64 for the fuzz test) on the same (dtype-rounded) inputs; a
    plain softmax when soft-capped or with attention sinks (an extra, value-less key per head whose
    logit is the sink)."""
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    m = dense_mask(mask, q.shape[-2], k.shape[-2], segment_ids, heads=q.shape[-3])
    if q.dim() == 3:
        m = m[0]
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=m, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    kf, vf = kf.repeat_interleave(group, -3), vf.repeat_interleave(group, -3)
    logits = (qf @ kf.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    logits = logits.masked_fill(~m, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).view(-1, 1, 1).expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1] @ vf
    probs = torch.softmax(logits, -1).nan_to_num(0.0)  # rows with no visible key give 0
    return probs @ vf


def make_qkv(batch, hq, hkv, q_len, kv_len, d, dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, hq, q_len, d), (batch, hkv, kv_len, d), (batch, hkv, kv_len, dv)]
    return [torch.randn(s, generator=g).to(dtype).to(device).requires_grad_() for s in shapes]


def forward_backward(fn, q, k, v, cotangent, **kwargs):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, **kwargs)
    (out.float() * cotangent).sum().backward()
    return out.detach(), [t.grad.detach() for t in (q, k, v)]


def assert_matches_reference(q, k, v, mask=None, **kwargs):
    """Splash vs the float32 reference on the same inputs: output and all three gradients."""
    dtype, device = q.dtype, q.device
    g = torch.Generator().manual_seed(1)
    cot_shape = q.shape[:-1] + (v.shape[-1],)
    cotangent = torch.randn(cot_shape, generator=g).to(device)
    out, grads = forward_backward(torch_splash.attention, q, k, v, cotangent, mask=mask, **kwargs)
    assert out.dtype == dtype and out.device == device and out.shape == cot_shape
    assert all(gr.dtype == dtype and gr.shape == t.shape for gr, t in zip(grads, (q, k, v)))
    qr, kr, vr = (t.detach().cpu().float().requires_grad_() for t in (q, k, v))
    kwargs.pop("block_sizes", None)
    ids = kwargs.get("segment_ids")
    if ids is not None:
        kwargs["segment_ids"] = tuple(i.cpu() for i in ids) if isinstance(ids, tuple) else ids.cpu()
    ref_out, ref_grads = forward_backward(reference, qr, kr, vr, cotangent.cpu(), mask=mask, **kwargs)
    (oa, orr), (ga, gr) = TOL[dtype]["out"], TOL[dtype]["grad"]
    torch.testing.assert_close(out.cpu().float(), ref_out, atol=oa, rtol=orr)
    for name, mine, ref in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(mine.cpu().float(), ref, atol=ga, rtol=gr, msg=lambda m, name=name: f"d{name}: {m}")


def xla_metric_count(name: str) -> int:
    """How many samples torch_xla's metric `name` holds (ExecuteTime: graph executions,
    CompileTime: compilations)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return 0 if data is None else data[0]


def backward_kernels(blocks: dict) -> int:
    """The Mosaic calls of a backward with these blocks: dkv, and dq unless it is fused into dkv."""
    return 1 if blocks["use_fused_bwd_kernel"] else 2


def tpu_training_kernels(q_len: int, kv_len: int, head_dim: int) -> int:
    """The Mosaic calls of one attention call's forward and backward as the TPU plan has them
    (torch_splash_jax.plan)."""
    from torch_splash_jax.plan import BlockSizes, plan_blocks

    return 1 + backward_kernels(dict(plan_blocks(q_len, kv_len, BlockSizes(), "tpu", head_dim)[2]))
