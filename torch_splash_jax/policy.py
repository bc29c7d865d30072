"""Runtime policy: every cache torch_splash keeps, its bound and why, and what it releases when.

Each bound below is read where its cache is made; nothing else in the package sizes a cache.
TorchTPU's numbered programs (torch_splash_jax.transport) are held weakly: an evicted program is freed.

JAX's own caches. A Program's jitted functions die with it, but JAX's tracing caches keep about
0.6 MB per distinct shape keyed on the splash kernel's long-lived jitted function, and release it
only at their own bounds (thousands of entries; 1.7 GB after 1,100 shapes, measured). Clearing
only the splash kernel's own jit cache does not release them (measured with tests/test_memory.py:
926 live jaxprs against 714), and `jax.clear_caches()` clears the caller's own JAX caches too. So
clearing is opt-in: with $TORCH_SPLASH_CLEAR_JAX_CACHES=1, each time the program cache has turned
over (evicted as many programs as it holds) it calls `jax.clear_caches()` and returns the freed
heap to the OS, which bounds a process that keeps meeting new shapes (a server, varied lengths).
A workload whose shapes fit in the cache evicts nothing and never clears either way.
"""

from __future__ import annotations

import os

# torch_splash_jax.kernels.program: a plan's jitted forward, infer and backward with their block tables.
# Compiled executables are the costly entries (MBs each at long L); $TORCH_SPLASH_PROGRAM_CACHE_SIZE.
PROGRAMS = int(os.environ.get("TORCH_SPLASH_PROGRAM_CACHE_SIZE", "128"))
# See the module docstring.
CLEAR_JAX_CACHES = os.environ.get("TORCH_SPLASH_CLEAR_JAX_CACHES", "0") == "1"
# torch_splash_jax.plan.plan_blocks: block sizes per (lengths, dims, mask kind); small tuples.
PLANS = 1024
# torch_splash_jax.tables.mask_info: NumPy block tables of one structured mask, O(blocks) each, rebuilt in
# milliseconds.
MASK_TABLES = 64
# torch_splash._ops: plan <-> the number the custom ops take. Plans can hold dense masks; a number
# a compiled graph holds is never evicted (the graph may run again after any number of others).
PLAN_REGISTRY = 1024
# torch_splash._ops._table_tensors: a sharded plan's block tables as device tensors.
TABLE_TENSORS = 64
# torch_splash._transport._in_graph: one torch_xla computation per program and shapes, so torch_xla
# sees the same computation every step and compiles it once.
IN_GRAPH = 512
# torch_splash._compile.from_source: masks rebuilt from their torch.compile source text; tiny.
MASK_SOURCES = 256
# torch_splash.masks._resolve_mask_mod: a FlexAttention mask_mod evaluated densely, (H, Lq, Lkv)
# bools each: keep few.
MASK_MODS = 32
