"""The compiled programs of the most recently used plans: a `splash_program.Program`, a `ring.RingProgram`
for a plan whose kv sequence travels a ring, or a `decode.DecodeProgram` (torch_splash_jax.policy
sizes the cache)."""

from __future__ import annotations

import collections
import ctypes
import gc
import threading

import jax

from . import policy
from .decode import DecodePlan, DecodeProgram
from .plan import Plan
from .ring import RingProgram
from .splash_program import Program, forget_shared_programs


class ProgramCache:
    """The programs of the most recently used plans. With $TORCH_SPLASH_CLEAR_JAX_CACHES=1, each
    time the cache has turned over, JAX's caches are cleared and the freed heap returned to the OS
    (torch_splash_jax.policy says why it is opt-in). The live programs then recompile on their
    next call: at most once per turnover, and never for a workload whose shapes fit."""

    def __init__(self, size: int):
        self.size = size
        self._programs: collections.OrderedDict[Plan | DecodePlan, Program] = collections.OrderedDict()
        self._evicted = 0
        self._lock = threading.Lock()

    def __call__(self, plan: Plan | DecodePlan):
        """The compiled program for a plan; a second call with an equal plan traces nothing."""
        with self._lock:
            found = self._programs.get(plan)
            if found is not None:
                self._programs.move_to_end(plan)
                return found
        # outside the lock: tables can take seconds
        built = (
            DecodeProgram(plan) if isinstance(plan, DecodePlan) else RingProgram(plan) if plan.ring else Program(plan)
        )
        with self._lock:
            found = self._programs.setdefault(plan, built)
            self._programs.move_to_end(plan)
            while len(self._programs) > self.size:
                self._programs.popitem(last=False)
                self._evicted += 1
            turned_over = self._evicted >= self.size
            if turned_over:
                self._evicted = 0
        if turned_over and policy.CLEAR_JAX_CACHES:
            release_jax_caches()
        return found

    def __len__(self) -> int:
        return len(self._programs)

    def cache_clear(self) -> None:
        """Every program dropped, those whose jitted functions others of their shapes share too."""
        with self._lock:
            self._programs.clear()
            self._evicted = 0
        forget_shared_programs()


def release_jax_caches() -> None:
    jax.clear_caches()
    gc.collect()  # a Program and its jitted functions form a cycle
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap for reuse otherwise
    except (OSError, AttributeError):  # not glibc: the freed memory is reused, just not returned
        pass


# TORCH_SPLASH_PROGRAM_CACHE_SIZE: how many plans keep their compiled programs (default 128).
program = ProgramCache(policy.PROGRAMS)
