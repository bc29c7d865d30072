"""Memory of a process that keeps meeting new shapes, with default settings (CPU).

torch_splash.attention (no grad, causal, B=1, H=1, D=8) over distinct lengths, one new plan and
program each, in a fresh process with a program cache of CACHE programs: RSS and live jaxprs per
new shape while the cache fills, and after it has turned over twice. Named baseline, in the same
run: the kernel called through its own module-level `jax.jit` (SplashAttentionKernel.__call__),
as torch_splash called it before torch_splash_jax.compat.call_splash_kernel. Target: after the
cache has turned over, RSS per new shape under 10% of a program's while the cache fills.

Run: ./dev.sh bench-memory   (or: .venv/bin/python benchmarks/bench_memory.py [--quick])
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import report  # benchmarks/report.py: results files and their tables

SCRIPT = """
import gc, json, os, sys
import torch, torch_splash
from torch_splash_jax import compat

cache, shapes, baseline = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "baseline"
if baseline:  # the kernel's own __call__: through its module-level jax.jit
    compat.call_splash_kernel = lambda kernel, *args: kernel(*args)

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

samples = []
with torch.no_grad():
    for i in range(shapes):
        q = torch.randn(1, 1, 8 + i, 8)
        torch_splash.attention(q, q, q, "causal")
        if (i + 1) % (cache // 2) == 0:
            gc.collect()
            samples.append((i + 1, rss_mb(), sum(1 for o in gc.get_objects() if type(o).__name__ == "Jaxpr")))
print(json.dumps(samples))
"""


def measure(cache: int, shapes: int, baseline: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SPLASH_CLEAR_JAX_CACHES"}
    env["TORCH_SPLASH_PROGRAM_CACHE_SIZE"] = str(cache)
    args = [str(cache), str(shapes), "baseline" if baseline else "programs"]
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), *args], capture_output=True, text=True, env=env, check=True
    )
    samples = json.loads(done.stdout.strip().splitlines()[-1])
    at = {n: (rss, jaxprs) for n, rss, jaxprs in samples}
    half, turned = cache // 2, 2 * cache  # filling: shapes half..cache; after: from two turnovers on

    def per_shape(first: int, last: int, index: int) -> float:
        return (at[last][index] - at[first][index]) / (last - first)

    return dict(
        samples=samples,
        filling_mb=per_shape(half, cache, 0),
        after_mb=per_shape(turned, shapes, 0),
        filling_jaxprs=per_shape(half, cache, 1),
        after_jaxprs=per_shape(turned, shapes, 1),
    )


def main() -> None:
    quick = "--quick" in sys.argv
    cache, shapes = (4, 24) if quick else (32, 160)
    results = dict(cache=cache, shapes=shapes)
    for name, baseline in (("programs", False), ("baseline", True)):
        results[name] = measure(cache, shapes, baseline)
        print(name, {k: v for k, v in results[name].items() if k != "samples"}, flush=True)
    report.save("memory", results, quick, "./dev.sh bench-memory")


if __name__ == "__main__":
    main()
