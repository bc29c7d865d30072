"""The ring's step programs, device by device on one CPU: S devices each hold one shard of q, k, v
(and their segment ids) in the sequence layout; at step s device d attends to the keys of shard
(d - s) mod S with its slice of step s's tables, merging by logsumexp; the backward sends dk and dv
around with their keys. Output, dq, dk, dv and d_sinks equal the unsharded call's within 1e-5
(float32) for every mask family, both layouts, with segment ids crossing the shards.
(tests/test_spmd.py runs the ring through torch_xla SPMD on 4 devices, collective permutes
included.)"""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SEQUENCE_DATA_MASKS as DATA_MASKS
from helpers import SEQUENCE_MASKS as MASKS
from helpers import sharded_plans

import torch_splash_jax
from torch_splash_jax import SplashConstraintError
from torch_splash_jax import masks as M
from torch_splash_jax.tpu_check.ring import device_by_device

_BLOCKS = torch_splash_jax.BlockSizes(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128)
# The ring on each kernel: JAX's at the blocks above, or the active kernels (planned: the tests
# that take them also take the `small_active_blocks` fixture, so that lists have several blocks).
KERNELS = {"splash": _BLOCKS, "active": None}


def ring_reproduces_the_unsharded_call(
    mask, length, shards, layout, kv_heads=2, ids=False, sinks=False, kernels="splash"
):
    """Runs the unsharded program, then the ring device by device, and compares."""
    options = dict(kv_heads=kv_heads, has_segment_ids=ids, has_sinks=sinks, block_sizes=KERNELS[kernels])
    full, plan = sharded_plans(mask, length, shards, layout, context_parallel="ring", **options)
    rng = np.random.default_rng(0)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in [(2, 4, length, 32), (2, kv_heads, length, 32), (2, kv_heads, length, 32), (2, 4, length, 32)]
    )
    doc = jnp.asarray(np.stack([np.arange(length) // 300, np.arange(length) // 170]), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
    extra = ([doc, doc] if ids else []) + ([] if sink is None else [sink])
    assert plan.forward_kernel == plan.backward_kernel == kernels
    whole = torch_splash_jax.program(full)
    tables = whole.tables()  # a mask read from stored blocks: its tables and blocks
    out, lse = whole.forward(q, k, v, *extra, *tables)
    grads = whole.backward(q, k, v, *extra, *tables, out, lse, d_out)
    got = ring_device_by_device(plan, q, k, v, d_out, doc if ids else None, sink)
    for mine, theirs in zip(got, [out, *grads], strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    return torch_splash_jax.program(plan)


def ring_device_by_device(plan, q, k, v, d_out, ids=None, sink=None) -> list[np.ndarray]:
    """The ring's output, dq, dk, dv (and d_sinks) for whole-sequence inputs, its step programs run
    device by device (`tpu_check.ring.device_by_device`, as the chip runs them)."""
    ring = torch_splash_jax.program(plan)
    keys = ring.steps[0].plan.ring_kv_positions()[:, : plan.kv_len]  # device d's own keys at step 0
    assert sorted(keys.reshape(-1).tolist()) == list(range(keys.size))  # every key on one device
    return device_by_device(ring, q, k, v, d_out, ids, sink)[0]


# Every family in both layouts on JAX's kernels, which a ring runs by default for masks read from
# stored blocks: the default run takes a tensor mask (tests/test_spmd.py's default ring cases run
# per-head masks), -m slow the rest; structured masks run on the active kernels below.
_DEFAULT = {("tensor", "contiguous")}
_CASES = [
    pytest.param(mask, layout, marks=[] if (mask, layout) in _DEFAULT else [pytest.mark.slow])
    for mask in list(MASKS) + list(DATA_MASKS)
    for layout in ("contiguous", "balanced")
]


@pytest.mark.parametrize("mask,layout", _CASES)
def test_ring_reproduces_the_unsharded_call(mask, layout):
    spec = {**MASKS, **DATA_MASKS}[mask]
    ring_reproduces_the_unsharded_call(
        spec,
        1040,
        4,
        layout,
        kv_heads=1 if mask in ("prefix-lm", "tensor") else 2,  # MQA
        ids=mask in ("causal", "local", "chunked", "tensor"),  # packed documents crossing shard boundaries
        sinks=mask in ("chunked", "per-head"),
    )


# The active kernels in a ring (structured masks: the kernel evaluates them at each device's
# positions): by default causal in the balanced layout with segment ids and sinks (every step with
# work, several blocks a list), a window over contiguous shards (steps and devices without work),
# and a prefix-LM over MQA; -m slow every other family.
_ACTIVE_DEFAULT = {("causal", "balanced"), ("local", "contiguous"), ("prefix-lm", "balanced")}
_ACTIVE_CASES = [
    pytest.param(mask, layout, marks=[] if (mask, layout) in _ACTIVE_DEFAULT else [pytest.mark.slow])
    for mask in MASKS
    for layout in ("contiguous", "balanced")
]


@pytest.mark.parametrize("mask,layout", _ACTIVE_CASES)
def test_ring_on_the_active_kernels_reproduces_the_unsharded_call(mask, layout, small_active_blocks):
    ring = ring_reproduces_the_unsharded_call(
        MASKS[mask],
        2976,  # 744 rows a device, padded to 768: three 256-row blocks, chunks of the balanced layout across them
        4,
        layout,
        kv_heads=1 if mask == "prefix-lm" else 2,
        ids=mask != "prefix-lm",
        sinks=mask in ("causal", "prefix-lm"),
        kernels="active",
    )
    assert max(step.active.entries for step in ring.steps) > 1


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_bfloat16_ring_gradients_against_float64(kernels, request):
    """In bf16 each step's kernels round their results, and dk and dv travel the ring as bf16 sums
    (as the all-gather strategy's partial sums are added; the active kernels add each step's into
    them in place, in float32 before rounding): measured against a float64 reference, the ring's
    output and dq (summed in float32) are as close as one device's, dk and dv within 3x (about 2x
    over 8 devices here, 2.8x over 16 at L=4096)."""
    if kernels == "active":
        request.getfixturevalue("small_active_blocks")
    length, heads, kv_heads, dim = 2048, 4, 2, 64
    common = dict(batch=1, q_len=length, kv_len=length, head_dim=dim, dtype="bfloat16", mask=M.CausalMask())
    common |= dict(scale=dim**-0.5, num_q_heads=heads, num_kv_heads=kv_heads, block_sizes=KERNELS[kernels])
    full = torch_splash_jax.plan(**common)
    plan = torch_splash_jax.plan(q_shards=8, sequence_layout="balanced", context_parallel="ring", **common)
    assert plan.forward_kernel == plan.backward_kernel == kernels
    rng = np.random.default_rng(0)
    shapes = [(1, heads, length, dim), (1, kv_heads, length, dim), (1, kv_heads, length, dim), (1, heads, length, dim)]
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in shapes)
    reference = _float64_causal_attention(*(np.asarray(x, np.float64) for x in (q, k, v, d_out)), dim**-0.5)
    whole = torch_splash_jax.program(full)
    out, lse = whole.forward(q, k, v, *whole.tables())
    one_device = [out, *whole.backward(q, k, v, *whole.tables(), out, lse, d_out)[:3]]
    ring = ring_device_by_device(plan, q, k, v, d_out)

    def error(x, r):  # relative RMS error
        return float(np.sqrt(np.mean((np.asarray(x, np.float64) - r) ** 2) / np.mean(r**2)))

    ratios = [error(x, r) / error(y, r) for x, y, r in zip(ring, one_device, reference)]
    assert ratios[0] < 1.5 and ratios[1] < 1.5, ratios  # out, dq
    assert ratios[2] < 3 and ratios[3] < 3, ratios  # dk, dv


def _float64_causal_attention(q, k, v, d_out, scale):
    """Output, dq, dk, dv of causal attention (GQA) in float64."""
    group = q.shape[1] // k.shape[1]
    k_, v_ = np.repeat(k, group, 1), np.repeat(v, group, 1)
    logits = np.einsum("bhqd,bhkd->bhqk", q, k_) * scale
    logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v_
    ds = p * (d_out @ v_.transpose(0, 1, 3, 2) - (d_out * out).sum(-1, keepdims=True))
    dk = (ds.transpose(0, 1, 3, 2) @ q * scale).reshape(k.shape[0], k.shape[1], group, *k.shape[2:]).sum(2)
    dv = (p.transpose(0, 1, 3, 2) @ d_out).reshape(v.shape[0], v.shape[1], group, *v.shape[2:]).sum(2)
    return [out, ds @ k_ * scale, dk, dv]


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(q_shards=1), "context_parallel='ring' over 1 query-sequence shard: a ring needs"),
        (dict(q_shards=4, kv_len=1030), "Lkv=1030 does not split into the ring's 4 shards: .* a multiple of 4"),
        (dict(q_shards=4, kv_len=1028, sequence_layout="balanced"), "of two mirrored chunks each: .* a multiple of 8"),
        (dict(q_shards=4, context_parallel="ulysses"), "context_parallel='ulysses': expected 'all_gather'"),
    ],
)
def test_what_the_ring_cannot_serve_is_refused_when_planned(options, match):
    options = dict(q_len=1024, kv_len=1024, context_parallel="ring", mask=M.CausalMask()) | options
    with pytest.raises(SplashConstraintError, match=match):
        torch_splash_jax.plan(**options)


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_ring_steps_without_work_skip_their_kernels(kernels):
    # causal over contiguous shards: at step s only the devices from s on see earlier keys; the
    # others' tables (lists) are empty, which the step's lax.cond reads to skip the kernels there
    blocks = KERNELS[kernels]
    _, plan = sharded_plans(M.CausalMask(), 4096, 4, "contiguous", context_parallel="ring", block_sizes=blocks)
    assert plan.forward_kernel == kernels
    ring = torch_splash_jax.program(plan)
    assert [ring.steps[s].devices_with_work() for s in range(4)] == [[d >= s for d in range(4)] for s in range(4)]
    tables = [jnp.asarray(t) for t in ring.steps[1].device_tables(0)]
    assert not ring.steps[1].has_work(tables)  # traced: the conditional decides on the device
    # balanced: every device has work at every step, so the steps have no conditional at all
    _, balanced = sharded_plans(M.CausalMask(), 4096, 4, "balanced", context_parallel="ring", block_sizes=blocks)
    ring = torch_splash_jax.program(balanced)
    assert all(ring.steps[s].has_work([]) is True for s in range(4))


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(context_parallel="ring"), "context_parallel='ring' passes k and v around the devices"),
        (dict(context_parallel="striped"), "context_parallel='striped': expected 'all_gather'"),
    ],
)
def test_ring_options_are_checked_before_any_kernel_work(options, match):
    import torch

    import torch_splash

    q = torch.zeros(2, 4, 16, 32)
    with pytest.raises(torch_splash.SplashConstraintError, match=match):
        torch_splash.attention(q, q, q, "causal", **options)
