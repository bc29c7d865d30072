"""Memory per distinct shape is bounded with TORCH_SPLASH_CLEAR_JAX_CACHES=1: a process that keeps
meeting new shapes (a server, a data pipeline with varied lengths) stops growing once the program
cache has turned over.

What used to grow: JAX's tracing caches keyed on the splash module's long-lived jitted kernel, about
25 live jaxprs and 0.6 MB of RSS per new shape, released only at JAX's own bounds (thousands of
entries). torch_splash_jax's program cache clears them each time it has turned over."""

import json
import os
import subprocess
import sys
import textwrap

CACHE_SIZE = 16
SHAPES = 160

SCRIPT = f"""
import gc, json, os
import torch, torch_splash

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
print(json.dumps(samples))
"""


def test_memory_stops_growing_over_new_shapes():
    env = {**os.environ, "TORCH_SPLASH_PROGRAM_CACHE_SIZE": str(CACHE_SIZE), "TORCH_SPLASH_CLEAR_JAX_CACHES": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    samples = json.loads(done.stdout.strip().splitlines()[-1])
    # From the second turnover on (shapes 32 to 96, then 96 to 160): the later half must not hold
    # more than the earlier one. Growing, it would add about 64 x 25 jaxprs and 64 x 0.6 MB.
    early = [s for s in samples if 2 * CACHE_SIZE < s[0] <= 96]
    late = [s for s in samples if s[0] > 96]
    peak_rss, peak_jaxprs = max(s[1] for s in early), max(s[2] for s in early)
    assert max(s[2] for s in late) <= peak_jaxprs * 1.1, samples
    # RSS moves by a few MB with allocator noise; 20 MB is under the growth of 64 shapes (about 38 MB)
    assert max(s[1] for s in late) <= peak_rss + 20, samples


def test_clearing_jax_s_caches_is_opt_in(monkeypatch):
    """jax.clear_caches() also clears the process's own JAX caches: the program cache calls it at a
    turnover only with TORCH_SPLASH_CLEAR_JAX_CACHES=1 (torch_splash_jax.policy)."""
    from torch_splash_jax import CausalMask, kernels, plan, policy

    cleared = []
    monkeypatch.setattr(kernels, "_release_jax_caches", lambda: cleared.append(1))
    plans = [plan(q_len=length, head_dim=8, mask=CausalMask(0)) for length in (8, 9, 10, 11)]
    for opt_in in (False, True):
        monkeypatch.setattr(policy, "CLEAR_JAX_CACHES", opt_in)
        cache, cleared[:] = kernels._ProgramCache(1), []
        for p in plans:  # each new plan evicts the last one: a turnover at each eviction (size 1)
            cache(p)
        assert len(cleared) == (3 if opt_in else 0), opt_in
