import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest
import torch
import torch.nn.functional as F


def pytest_configure(config):
    # Start torch_xla's runtime before any CPU backward: a CPU backward first leaves autograd
    # without a ready queue for the XLA device, and a later XLA backward then fails (DESIGN.md).
    import torch_xla

    torch_xla.device()


@pytest.fixture
def xla_device():
    import torch_xla

    return torch_xla.device()


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
