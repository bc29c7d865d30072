"""Runtime policy: every cache torch_splash keeps, its bound and why, and what it releases when.

Each bound below is read where its cache is made; nothing else in the package sizes a cache.
TorchTPU's numbered programs (torch_splash_jax.transport) are held weakly: an evicted program is freed.

JAX's own caches. Each Program's jitted functions trace the splash kernel into themselves
(compat.call_splash_kernel), so what JAX caches for them dies with the Program: a process that
keeps meeting new shapes grows 0.09 MB per shape once the program cache is full, against about
2.5 MB per program while it fills (tests/test_memory.py). JAX offers no way to release one entry
of its caches (jax 0.7.1's weakref caches can only be cleared whole), so what remains (about 3
jaxprs per shape in JAX's own caches keyed on shapes and shardings) is bounded by their own sizes. Clearing them all
stays opt-in, since `jax.clear_caches()` clears the caller's own JAX caches too: with
$TORCH_SPLASH_CLEAR_JAX_CACHES=1, each time the program cache has turned over (evicted as many
programs as it holds) it calls `jax.clear_caches()` and returns the freed heap to the OS.
"""

from __future__ import annotations

import collections
import os
import threading

# torch_splash_jax.program_cache.program: a plan's jitted forward, infer and backward with their block tables.
# Compiled executables are the costly entries (MBs each at long L); $TORCH_SPLASH_PROGRAM_CACHE_SIZE.
PROGRAMS = int(os.environ.get("TORCH_SPLASH_PROGRAM_CACHE_SIZE", "128"))
# torch_splash_jax.splash_program: the first program of each shape of stored-block tables, whose jitted
# functions the programs of masks with other contents in those shapes run. Each holds its compiled
# executables and its own mask's tables.
STORED_SHAPES = 32
# See the module docstring.
CLEAR_JAX_CACHES = os.environ.get("TORCH_SPLASH_CLEAR_JAX_CACHES", "0") == "1"
# torch_splash_jax.block_planning.plan_blocks: block sizes per (lengths, dims, mask kind); small tuples.
PLANS = 1024
# torch_splash_jax.tables.mask_info: NumPy block tables of one structured mask, O(blocks) each, rebuilt in
# milliseconds.
MASK_TABLES = 64
# torch_splash_jax.serialization: the plans of the texts the custom ops took last. Plans can hold dense masks;
# a text read after its plan was evicted is rebuilt from the text and the arrays beside it. Also
# torch_splash._flex_ops._read_call: a FlexAttention op's call text read back; small dicts.
PLAN_TEXTS = 256
# torch_splash._sharding.from_text: SPMD shardings read back from the custom ops' text; tiny.
SHARDINGS = 64
# torch_splash._ops._table_tensors and _ring_tables: a plan's block tables as device tensors (the
# ring's: every step's, each device's own slice).
TABLE_TENSORS = 64
# torch_splash._transport._in_graph, _ring._permute_function, _sharding._exchange_function: one
# torch_xla computation per program (or exchange) and shapes, so torch_xla sees the same computation
# every step and compiles it once.
IN_GRAPH = 512
# torch_splash_jax.serialization.mask_from_source: structured masks rebuilt from their source text; tiny.
MASK_SOURCES = 256
# torch_splash._flex_masks._CONVERTED and _flex_ops._GRAPH_MASKS: the masks of the BlockMasks converted
# last (a model's layers share one), each holding the partial blocks its mask_mod evaluated: keep few.
FLEX_MASKS = 8
# torch_splash._compat.function_calls: route_flex's trampoline codes, one per free-variable count of
# the function it patches (torch's own: none; TorchTPU's: four); tiny.
TRAMPOLINES = 8
# torch_splash.masks._RESOLVED: a FlexAttention mask_mod evaluated densely, (H, Lq, Lkv)
# bools each: keep few.
MASK_MODS = 32


class Recent:
    """The `size` entries used last (a bound above), the least recently used dropped first; safe
    across threads."""

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def setdefault(self, key, value):
        """The entry of `key`, `value` if it had none; either way now the most recently used."""
        with self._lock:
            found = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
            return found

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
