import torch
from conftest import reference

import torch_splash

TOL = {
    # f32: the kernel accumulates in f32 like SDPA; measured errors are about 1e-6 (out) and 1e-5 (grads).
    torch.float32: dict(out=(2e-5, 1e-5), grad=(1e-4, 1e-4)),
    # bf16: one bf16 rounding of values of size ~1 is 4e-3; the kernel's bf16 matmul operands and
    # outputs add a few of those.
    torch.bfloat16: dict(out=(2e-2, 2e-2), grad=(5e-2, 2e-2)),
}


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
