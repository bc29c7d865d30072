"""Memory per distinct shape is bounded with default settings: a process that keeps meeting new
shapes (a server, a data pipeline with varied lengths) stops growing once the program cache has
turned over, without clearing JAX's caches (the caller's own).

Through the splash module's long-lived jitted kernel, JAX's tracing caches keep about 25 live
jaxprs and 0.5 MB of RSS per new shape, released only at JAX's own bounds (thousands of entries):
the kernel is traced into each program's own jitted functions instead
(torch_splash_jax.compat.call_splash_kernel), whose cache entries die with the program."""

import os
import textwrap

import pytest
from helpers import run_python

CACHE_SIZE = 16
SHAPES = 160

SCRIPT = f"""
import gc, json, os
import jax, jax.numpy as jnp
import torch, torch_splash

traces = []  # the process's own jitted function: traced once, and never again if its cache is kept
own = jax.jit(lambda x: traces.append(1) or x * 2)
own(jnp.ones(3))

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

samples = []
with torch.no_grad():
    for i in range({SHAPES}):
        q = torch.randn(1, 1, 8 + i, 8)  # a new shape every call: a new plan and program
        torch_splash.attention(q, q, q, "causal")
        if i % {CACHE_SIZE // 2} == {CACHE_SIZE // 2 - 1}:
            gc.collect()
            jaxprs = sum(1 for o in gc.get_objects() if type(o).__name__ == "Jaxpr")
            samples.append((i + 1, rss_mb(), jaxprs))
own(jnp.ones(3))
print(json.dumps(dict(samples=samples, own_traces=len(traces))))
"""


def _run(env: dict) -> dict:
    return run_python("-c", textwrap.dedent(SCRIPT), env=env, timeout=900)[-1]


@pytest.mark.slow  # 160 shapes in a process of their own: a minute on 2 cores
def test_memory_stops_growing_over_new_shapes_with_default_settings():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SPLASH_CLEAR_JAX_CACHES"}
    result = _run({**env, "TORCH_SPLASH_PROGRAM_CACHE_SIZE": str(CACHE_SIZE)})
    assert result["own_traces"] == 1  # the process's own jax.jit cache was left alone
    samples = result["samples"]
    by_shapes = {shapes: (rss, jaxprs) for shapes, rss, jaxprs in samples}

    def per_shape(first: int, last: int, index: int) -> float:
        return (by_shapes[last][index] - by_shapes[first][index]) / (last - first)

    # Live jaxprs are counted exactly: a program holds about 25 while the cache fills (shapes 8 to
    # 16); from the second turnover on (shapes 96 to 160) a new shape may leave at most a fifth of
    # that alive (about 2 to 3.3 remain in JAX's own caches keyed on shapes, bounded by their sizes;
    # through the kernel's module-level jax.jit all 25 stayed).
    filling_jaxprs, late_jaxprs = per_shape(CACHE_SIZE // 2, CACHE_SIZE, 1), per_shape(96, SHAPES, 1)
    assert filling_jaxprs >= 15, samples  # the measure sees a program's jaxprs at all
    assert late_jaxprs <= 0.2 * filling_jaxprs, (late_jaxprs, filling_jaxprs, samples)
    # RSS is the allocator's: while the cache fills, a program's cost ranged from 0.2 to 2.5 MB
    # between runs (freed memory is reused), too noisy to divide by. After the turnover a new shape
    # measured 0.09 to 0.13 MB on the two tested sets; through the kernel's own jax.jit 0.54 MB
    # (./dev.sh bench-memory measures both in one run). Half of that is the bound.
    assert per_shape(96, SHAPES, 0) <= 0.27, samples


def test_clearing_jax_s_caches_is_opt_in(monkeypatch):
    """jax.clear_caches() also clears the process's own JAX caches: the program cache calls it at a
    turnover only with TORCH_SPLASH_CLEAR_JAX_CACHES=1 (torch_splash_jax.policy)."""
    from torch_splash_jax import CausalMask, plan, policy, program_cache

    cleared = []
    monkeypatch.setattr(program_cache, "release_jax_caches", lambda: cleared.append(1))
    plans = [plan(q_len=length, head_dim=8, mask=CausalMask(0)) for length in (8, 9, 10, 11)]
    for opt_in in (False, True):
        monkeypatch.setattr(policy, "CLEAR_JAX_CACHES", opt_in)
        cache, cleared[:] = program_cache.ProgramCache(1), []
        for p in plans:  # each new plan evicts the last one: a turnover at each eviction (size 1)
            cache(p)
        assert len(cleared) == (3 if opt_in else 0), opt_in
