"""The tests' one home for references and inputs: the dense mask a torch_splash mask means (an
oracle written from the masks' definitions), the SDPA / float64 reference, input factories and the
comparison against the reference."""

import json
import subprocess
import sys

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


def mask_oracle(mask, q_len, kv_len, heads=1) -> torch.Tensor:
    """The bool (H or 1, Lq, Lkv) mask that a torch_splash mask means, written from each family's
    definition in the README's mask table, never from the mask's own `allows()` or `dense()`: the
    tests' reference is independent of the code under test (a wrong `allows()` fails them)."""
    from torch_splash import masks
    from torch_splash_jax import masks as jax_masks

    i = torch.arange(q_len).view(1, q_len, 1)  # query row
    j = torch.arange(kv_len).view(1, 1, kv_len)  # key column
    everywhere = torch.ones(1, q_len, kv_len, dtype=torch.bool)
    if mask is None or isinstance(mask, masks.FullMask):
        return everywhere
    if isinstance(mask, str):
        assert mask == "causal", mask
        return (j <= i).expand(1, q_len, kv_len)  # SDPA's is_causal
    if isinstance(mask, masks.CausalMask):  # row i sees keys j <= i + offset
        return (j <= i + mask.offset).expand(1, q_len, kv_len)
    if isinstance(mask, masks.LocalMask):  # i + offset - left <= j <= i + offset + right; None: unbounded
        allowed = everywhere
        if mask.window_left is not None:
            allowed = allowed & (j >= i + mask.offset - mask.window_left)
        if mask.window_right is not None:
            allowed = allowed & (j <= i + mask.offset + mask.window_right)
        return allowed
    if isinstance(mask, masks.ChunkedCausalMask):  # causal within consecutive chunks of chunk_size
        return ((i // mask.chunk_size == j // mask.chunk_size) & (j <= i)).expand(1, q_len, kv_len)
    if isinstance(mask, masks.PrefixMask):  # every query sees the first n keys
        return (j < mask.length).expand(1, q_len, kv_len)
    if isinstance(mask, (jax_masks.And, masks.Composed)):
        op = "and" if isinstance(mask, jax_masks.And) else mask.op
        left, right = (mask_oracle(m, q_len, kv_len, heads) for m in (mask.left, mask.right))
        return left & right if op == "and" else left | right
    if isinstance(mask, jax_masks.Or):
        return mask_oracle(mask.left, q_len, kv_len, heads) | mask_oracle(mask.right, q_len, kv_len, heads)
    if isinstance(mask, (list, tuple, masks.MultiHeadMask)):  # one mask per query head
        per_head = mask.masks if isinstance(mask, masks.MultiHeadMask) else mask
        return torch.cat([mask_oracle(m, q_len, kv_len).expand(1, q_len, kv_len) for m in per_head])
    if isinstance(mask, torch.Tensor):  # (Lq, Lkv), (1 or H, Lq, Lkv) or (1, 1 or H, Lq, Lkv): True attends
        allowed = mask.cpu()
        return allowed.reshape(-1, q_len, kv_len) if allowed.dim() > 2 else allowed[None]
    if isinstance(mask, jax_masks.DenseMask):  # from_tensor: the array it was given
        return torch.from_numpy(mask.array.copy())[None]
    if isinstance(mask, masks.MaskMod):  # mask_mod(b, h, q_idx, kv_idx), read at b = 0 (one mask a batch)
        allowed = mask.fn(torch.tensor(0), torch.arange(heads).view(heads, 1, 1), i, j)
        return torch.broadcast_to(allowed, (allowed.shape[0] if allowed.dim() == 3 else 1, q_len, kv_len))
    raise TypeError(f"no oracle for {type(mask).__name__}: write one from its definition")


def dense_mask(mask, q_len, kv_len, segment_ids=None, heads=1):
    """The bool (B or 1, H or 1, Lq, Lkv) mask that a torch_splash mask and segment ids mean (the
    mask from `mask_oracle`)."""
    allowed = mask_oracle(mask, q_len, kv_len, heads)[None]
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


def flex_reference(q, k, v, block_mask=None, score_mod=None):
    """(out, logsumexp): FlexAttention's definition in plain torch ops, in q's dtype (float64 here): the dense mask
    torch's create_mask makes of the BlockMask's mask_mod, and the logsumexp, differentiable.
    torch 2.15's flex_attention has no backward on the CPU, so gradients are checked against this."""
    from torch.nn.attention.flex_attention import create_mask

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if score_mod is not None:
        scores = score_mod(scores, None, None, None, None)
    if block_mask is not None:
        b, h = block_mask.kv_num_blocks.shape[:2]
        allowed = create_mask(block_mask.mask_mod, b, h, q.shape[2], k.shape[2], device="cpu")
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (scores - lse[..., None]).exp().nan_to_num(0.0) @ v, lse


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
    from torch_splash_jax import BlockSizes
    from torch_splash_jax.block_planning import plan_blocks

    return 1 + backward_kernels(dict(plan_blocks(q_len, kv_len, BlockSizes(), "tpu", head_dim)[2]))


def run_python(*args, env=None, timeout=900, stdin=None, cwd=None) -> list[dict]:
    """`python ARGS` (["-c", script] or [worker.py, ...]) in a process of its own, with this
    interpreter: asserts it exited 0 (else shows its stderr's tail) and returns the JSON objects it
    printed, one a line, in order."""
    done = subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def sharded_plans(mask, length, shards, layout, head_shards=1, *, kv_heads=2, **options):
    """(the unsharded plan, the plan of one device of `shards` sequence shards and `head_shards`
    head shards: its heads, and the mask of every head) for B=2, 4 query heads, L=`length`, D=32.
    `context_parallel="ring"` among the options makes the second a ring's."""
    import torch_splash_jax

    ring = {"context_parallel": options.pop("context_parallel")} if "context_parallel" in options else {}
    common = dict(
        batch=2, kv_len=length, q_len=length, head_dim=32, head_dim_v=32, dtype="float32", mask=mask, scale=0.2
    )
    full = torch_splash_jax.plan(num_q_heads=4, num_kv_heads=kv_heads, **common, **options)
    sharded = torch_splash_jax.plan(
        num_q_heads=4 // head_shards,
        num_kv_heads=max(kv_heads // head_shards, 1),
        q_shards=shards,
        sequence_layout=layout,
        head_shards=head_shards,
        **common,
        **options,
        **ring,
    )
    return full, sharded


def _sequence_masks():
    """The structured masks and the masks that are data the sequence-sharding and ring tests run."""
    import numpy as np

    from torch_splash_jax import masks as M

    structured = {
        "causal": M.CausalMask(),
        "causal-offset": M.CausalMask(offset=-40),
        "local": M.LocalMask(100, 0),
        "local-two-sided": M.LocalMask(30, 50),
        "chunked": M.ChunkedCausalMask(96),
        "prefix-lm": M.CausalMask() | M.PrefixMask(70),
        "window-and-causal": M.CausalMask() & M.LocalMask(64),
        "full": M.FullMask(),
    }
    rng = np.random.default_rng(7)
    holes = [rng.random((1040, 1040)) < 0.97 for _ in range(3)]  # causal with holes: partial blocks everywhere
    data = {  # the kernel reads these from stored partial blocks, not a mask function
        "per-head": M.MultiHeadMask([M.CausalMask(), M.LocalMask(100, 0), M.ChunkedCausalMask(96), M.CausalMask(-40)]),
        "tensor": M.DenseMask(np.tril(holes[0])),
        "per-head-tensor-and-structured": M.MultiHeadMask(
            [M.DenseMask(np.tril(h)) for h in holes[1:]] + [M.CausalMask() & M.DenseMask(holes[0]), M.LocalMask(64, 64)]
        ),
    }
    return structured, data


SEQUENCE_MASKS, SEQUENCE_DATA_MASKS = _sequence_masks()
