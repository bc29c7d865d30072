"""The bridge's cost over calling the same jitted JAX splash kernel directly, in one run.

1. B=2, Hq=8, L=2048, D=128, causal, f32: forward (no grad: vs the jitted kernel), forward with
   inputs that require grad (vs the jitted `jax.vjp` forward, which also keeps residuals) and
   forward+backward (vs one jitted `jax.vjp` forward and backward), all through
   `torch_splash.attention` vs the same vmapped splash kernel (same planned block sizes, same
   data, as jax arrays). Target: ratio <= 1.05.
2. Fixed cost per call at B=1, H=1, L=128, D=64: microseconds per call for the bridge, the direct
   JAX call and torch SDPA on the same CPU, and the bridge/SDPA ratio.

Rounds alternate between the contenders so that machine noise hits both; we report medians.
Run: ./dev.sh bench   (or: PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_bridge.py)
"""

from __future__ import annotations

import os

# torch's OpenMP threads otherwise spin after each torch op (SDPA, grad accumulation) and steal
# one of the two cores from whichever JAX run comes next.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import statistics
import sys
import time

import jax
import report  # benchmarks/report.py: results files and their tables
import torch
import torch.nn.functional as F

import torch_splash
import torch_splash_jax
from torch_splash import _transport


def timed(fn, rounds):
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def contenders(batch, heads, length, dim):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g) for _ in range(3))
    do = torch.randn(batch, heads, length, dim, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    plan = torch_splash_jax.plan(
        batch=batch, num_q_heads=heads, q_len=length, head_dim=dim, mask=torch_splash_jax.CausalMask(0)
    )
    splash = torch_splash_jax.program(plan).kernel  # the splash kernel the bridge runs, vmapped over batch as it does

    def kernel(q, k, v):
        return jax.vmap(splash)(q, k, v)

    jq, jk, jv, jdo = _transport.to_jax([q, k * dim**-0.5, v, do])  # the bridge pre-scales k too
    jax_fwd = jax.jit(kernel)
    jax_fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(kernel, q, k, v)[1](do))
    jax_fwd_train = jax.jit(lambda q, k, v: jax.vjp(kernel, q, k, v))

    def bridge_fwd():
        torch_splash.attention(q, k, v, "causal")

    def bridge_fwd_train():
        torch_splash.attention(qg, kg, vg, "causal")

    def clear_grads():  # so that backward assigns .grad, as JAX returns fresh gradients
        for t in (qg, kg, vg):
            t.grad = None

    def bridge_fwd_bwd():
        clear_grads()
        torch_splash.attention(qg, kg, vg, "causal").backward(do)

    def direct_fwd():
        jax.block_until_ready(jax_fwd(jq, jk, jv))

    def direct_fwd_train():
        jax.block_until_ready(jax_fwd_train(jq, jk, jv))

    def direct_fwd_bwd():
        jax.block_until_ready(jax_fwd_bwd(jq, jk, jv, jdo))

    def sdpa_fwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_fwd_bwd():
        clear_grads()
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

    return dict(
        bridge_fwd=bridge_fwd,
        direct_fwd=direct_fwd,
        sdpa_fwd=sdpa_fwd,
        bridge_fwd_train=bridge_fwd_train,
        direct_fwd_train=direct_fwd_train,
        bridge_fwd_bwd=bridge_fwd_bwd,
        direct_fwd_bwd=direct_fwd_bwd,
        sdpa_fwd_bwd=sdpa_fwd_bwd,
    )


def measure(fns, rounds, per_round):
    """Median time of each contender, and the median over rounds of each bridge/direct ratio taken
    within one round (adjacent runs), which cancels the slow drift of a shared 2-core machine."""
    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    samples = {name: [] for name in fns}
    for i in range(rounds):
        # Reverse the order every other round so neither contender always runs first.
        for name, fn in list(fns.items())[:: 1 if i % 2 else -1]:
            samples[name].append(statistics.median(timed(fn, per_round)))
    result = {name: statistics.median(s) for name, s in samples.items()}
    for name in [n for n in fns if n.startswith("bridge_")]:
        what = name.removeprefix("bridge_")
        ratios = [b / d for b, d in zip(samples[name], samples["direct_" + what])]
        result["ratio_" + what] = statistics.median(ratios)
    return result


def measure_all(fns, rounds, per_round):
    # SDPA runs in its own phase: torch's OpenMP threads keep spinning for a while after a call
    # and would slow whichever JAX run came next.
    jax_side = {n: f for n, f in fns.items() if not n.startswith("sdpa_")}
    torch_side = {n: f for n, f in fns.items() if n.startswith("sdpa_")}
    return {**measure(jax_side, rounds, per_round), **measure(torch_side, rounds, per_round)}


def main(quick: bool = False):
    """quick: a smoke run at small sizes (the test suite runs it), written to bridge_quick.json."""
    large = (1, 2, 512, 64) if quick else (2, 8, 2048, 128)
    big = measure_all(contenders(*large), rounds=2 if quick else 15, per_round=1)
    small = measure_all(contenders(1, 1, 128, 64), rounds=2 if quick else 10, per_round=5 if quick else 100)
    results = {
        "large": {"shape": "B={} H={} L={} D={} causal f32".format(*large), **big},
        "small": {
            "shape": "B=1 H=1 L=128 D=64 causal f32",
            **small,
            "bridge_overhead_fwd_us": (small["bridge_fwd"] - small["direct_fwd"]) * 1e6,
            "bridge_overhead_fwd_bwd_us": (small["bridge_fwd_bwd"] - small["direct_fwd_bwd"]) * 1e6,
            "ratio_to_sdpa_fwd": small["bridge_fwd"] / small["sdpa_fwd"],
            "ratio_to_sdpa_fwd_bwd": small["bridge_fwd_bwd"] / small["sdpa_fwd_bwd"],
        },
    }
    report.save("bridge", results, quick, "./dev.sh bench")
    return results


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
