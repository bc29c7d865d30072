"""The part of `tpu_check` that holds the chip: one process, every measurement, a JSON line each.

`run(parts, calls...)` prints {"chip": ...} first (the device, JAX, the generation), then
{"limits": ...} (the chip's own HBM read rate and bf16 matmul rate), {"fidelity": ...} per case,
{"timing": ...} per row and {"ring": ...} per kernel (`ring`). Programs are compiled ahead of time
in threads (the host's cores compile while nothing runs on the chip), then run one at a time.

Times are wall clock over back-to-back calls of one compiled program (dispatch is asynchronous, so
for calls of 100 us or more this is device time), the minimum over `REPEATS` repetitions after a
warm-up call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import platform as platform_module
import time
import traceback

import jax
import jax.numpy as jnp

from .. import compat
from ..block_planning import OTHER_BLOCK_Q, OTHER_LOGITS, OTHER_SCHEDULER
from ..errors import SplashConstraintError
from ..kernel_limits import DEVICE_KINDS
from ..masks import shared_structured_mask
from ..plan import Plan, with_forward_logits, with_kernels
from ..program_cache import program as cached_program
from ..splash_program import Program
from . import baselines, ring
from .cases import MAXTEXT_BLOCKS, TOLERANCE, Call
from .reference import inputs, reference, relative_error

REPEATS = 5
# Each repetition runs the program back to back for at least this long.
REPETITION_SECONDS = 0.05
# Device kinds JAX reports, as the estimator's generations (a v4 named too, for its results file).
KINDS = {**DEVICE_KINDS, "TPU v4": "v4"}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def generation(device) -> str | None:
    """The estimator's name of a device's generation ("v5e", ...), None for a CPU."""
    return KINDS.get(device.device_kind) if device.platform == "tpu" else None


def _error(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:600]


def timed(compiled, *args) -> float:
    """Seconds per call of a compiled program (see the module's docstring)."""
    jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    once = time.perf_counter() - start
    count = max(1, min(1000, int(REPETITION_SECONDS / max(once, 1e-6))))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(count):
            out = compiled(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / count)
    return best


def limits(quick: bool) -> dict:
    """The chip's own HBM read rate (the sum of a 1 GiB bfloat16 array) and bfloat16 matmul rate
    (8192^3, float32 accumulation)."""
    elements, n = (1 << 24, 1024) if quick else (1 << 29, 8192)
    x = jnp.ones((elements,), jnp.bfloat16)
    read = timed(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)).lower(x).compile(), x)
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)).lower(a, a).compile()
    seconds = timed(matmul, a, a)
    return dict(hbm_read_gb_s=2 * elements / read / 1e9, matmul_tflop_s=2 * n**3 / seconds / 1e12)


def _named_arrays(call: Call, program, named: dict, kind: str) -> list:
    """A program's arguments in its order (`Program.arguments` / `DecodeProgram.arguments`). A
    program's tables go to the chip here, once, as torch_splash keeps them on the device: passed as
    NumPy arrays they crossed to the chip at every timed call (a stored mask's blocks at 16K, 1.7 ms)."""
    given = {k: named.get(k) for k in ("q", "k", "v", "q_ids", "kv_ids", "sinks")}
    if isinstance(program, Program):
        return program.arguments(kind, tables=[jnp.asarray(t) for t in program.tables()], **given)
    return program.arguments(**given)


def _structs(arrays) -> list:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


class _Compiler:
    """Programs compiled ahead of time in a thread pool: `submit(key, fn, args)` then `get(key)`
    (the compiled program, or the exception compiling raised)."""

    def __init__(self, workers: int):
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self._futures: dict = {}

    def submit(self, key, fn, args) -> None:
        structs = _structs(args)
        self._futures[key] = self._pool.submit(lambda: jax.jit(fn).lower(*structs).compile())

    def get(self, key):
        return self._futures.pop(key).result()

    def wait(self) -> None:
        """Until every program submitted is compiled: a compiling thread holds the host (and the
        GIL) that dispatches the timed calls, which measured a 1.5 ms decode call at 2.3 ms."""
        concurrent.futures.wait(list(self._futures.values()))


def _step(program: Program):
    """forward then backward, as torch_splash's custom ops run them in a training step."""

    def step(*arrays):
        *inputs_, d_out = arrays
        out, lse = program.forward(*inputs_)
        return program.backward(*inputs_, out, lse, d_out)

    return step


def fidelity(calls: list[Call], platform: str, compiler: _Compiler) -> None:
    prepared = []
    for call in calls:
        try:
            plan = call.plan(platform)
            named = inputs(call)
            gradients = call.kernel != "decode"
            for name, kernel, program in _programs(call, plan):
                args = _named_arrays(call, program, named, "forward")
                if gradients:
                    compiler.submit((name, "kernel"), _step(program), [*args, named["d_out"]])
                    compiler.submit((name, "forward"), program.forward, args)
                else:
                    compiler.submit((name, "kernel"), program.forward, args)
                prepared.append((call, name, kernel, named, args, gradients))
        except Exception as error:  # a refusal (SplashError) or anything else: the case fails
            emit(fidelity=dict(name=call.name, kernel=call.kernel, dtype=call.dtype, error=_error(error), passed=False))
    for call, name, kernel, named, args, gradients in prepared:
        row = dict(name=name, kernel=kernel, dtype=call.dtype, tolerance=TOLERANCE)
        try:
            expected = reference(call, named, gradients)
            if gradients:
                out = compiler.get((name, "forward"))(*args)[0]
                grads = compiler.get((name, "kernel"))(*args, named["d_out"])
                found = dict(out=out, **dict(zip(["dq", "dk", "dv", "d_sinks"], grads)))
            else:
                found = dict(out=compiler.get((name, "kernel"))(*args)[0])
            errors = {name: relative_error(found[name], expected[name]) for name in expected}
            row.update(errors=errors, passed=all(e <= TOLERANCE for e in errors.values()))
        except Exception as error:
            row.update(error=_error(error), passed=False)
        emit(fidelity=row)


def _programs(call: Call, plan) -> list:
    """(row name, kernel, program) of a fidelity case: its plan's, and for a splash call the
    active-block kernels' where they serve the call, their forward's logits laid out both ways."""
    programs = [(call.name, call.kernel, cached_program(plan))]
    active = _active(plan) if call.kernel != "decode" else None
    if active is not None:
        programs.append((f"{call.name}, active kernels", "active", cached_program(active)))
        programs.append((f"{call.name}, active kernels, other logits", "active", cached_program(other_logits(active))))
    return programs


def other_logits(plan):
    """The plan with its active forward's logits laid out the other way (`Plan.forward_logits`)."""
    return with_forward_logits(plan, OTHER_LOGITS[plan.forward_logits])


def other_q_blocks(plan):
    """The plan with its active forward's other longest q block (`Plan.active_block_q`), None where
    the forward's blocks come out the same (short queries, a mask read from stored blocks, longer
    blocks that fall back: `splash_program`)."""
    if shared_structured_mask(plan.mask) is None:  # stored blocks: at most 1024 a side, no program built
        return None
    other = dataclasses.replace(plan, active_block_q=OTHER_BLOCK_Q[plan.active_block_q])
    return other if cached_program(other).active.blocks != cached_program(plan).active.blocks else None


def _active(plan, backward: str = "active"):
    """The plan with the active-block forward and the given backward, None where they do not serve
    it (refused at planning, or when its program is built: a block list past SMEM)."""
    try:
        active = with_kernels(plan, "active", backward)
        cached_program(active)
        return active
    except SplashConstraintError:
        return None


OTHER_SCHEDULER_VARIANT = "plan, active kernels, other scheduler"
OTHER_LOGITS_VARIANT = "plan, active kernels, other logits"
OTHER_Q_BLOCKS_VARIANT = "plan, active kernels, other q blocks"


def _variants(call: Call, platform: str) -> dict:
    """{name: (forward fn, step fn or None, argument builder)} of a timing row: the plan, and the
    baselines that serve the call (each builder maps the named inputs to that variant's arguments)."""
    interpret = platform != "tpu"
    plan = call.plan(platform)
    variants = {}
    if call.kernel == "decode":
        decode = cached_program(plan)
        variants["plan"] = (decode.forward, None, lambda n: _named_arrays(call, decode, n, "forward"))
        splash_call = _as_splash(call)
        splash = cached_program(splash_call.plan(platform))
        variants["splash forward"] = (splash.infer, None, lambda n: _named_arrays(splash_call, splash, n, "infer"))
        for name, build in (("paged attention", baselines.paged_attention),
                            ("ragged paged attention", baselines.ragged_paged_attention)):  # fmt: skip
            if interpret:
                continue  # TPU kernels without an interpret mode
            try:
                kernel, prepare = build(call)
                variants[name] = (kernel, None, lambda n, prepare=prepare: list(jax.jit(prepare)(*_qkv_ids(n))))
            except baselines.Unavailable:
                pass
    else:
        program = cached_program(plan)
        variants["plan"] = (program.forward, _step(program), lambda n: _named_arrays(call, program, n, "forward"))
        active = _active(plan)
        kernels = [("plan, active forward", _active(plan, "splash")), ("plan, active kernels", active)]
        if active is not None and not interpret:  # the chip's verdict on the generation's scheduler
            other = OTHER_SCHEDULER[active.scheduler]  # (block_planning.LP_SCHEDULER; interpret mode has none)
            kernels.append((OTHER_SCHEDULER_VARIANT, dataclasses.replace(active, scheduler=other)))
            kernels.append((OTHER_LOGITS_VARIANT, other_logits(active)))  # (block_planning.TRANSPOSED_LOGITS)
            kernels.append((OTHER_Q_BLOCKS_VARIANT, other_q_blocks(active)))  # (block_planning.LONG_BLOCK_Q)
        for name, fast_plan in kernels:
            if fast_plan is not None:
                fast = cached_program(fast_plan)
                variants[name] = (
                    fast.forward,
                    _step(fast),
                    lambda n, fast=fast: _named_arrays(call, fast, n, "forward"),
                )
        if plan.batch > 1 and plan.batch_in_heads and plan.num_kv_heads > 1:
            loop = Program(plan, batch_in_heads=False)
            variants["plan, a call per batch element"] = (
                loop.forward,
                _step(loop),
                lambda n: _named_arrays(call, loop, n, "forward"),
            )
        for name, blocks in (("JAX splash, MaxText blocks", MAXTEXT_BLOCKS), ("JAX splash, the plan's blocks",
                                                                              dict(plan.blocks))):  # fmt: skip
            variants[name] = _baseline(lambda blocks=blocks: baselines.jax_splash(call, blocks, interpret))
    variants["XLA dense"] = _baseline(lambda: baselines.xla_dense(call, platform))
    return {name: variant for name, variant in variants.items() if variant is not None}


def _baseline(build):
    """A baseline's variant: None where it does not serve the call, its error where building it failed."""
    try:
        forward, step = build()
    except baselines.Unavailable:
        return None
    except Exception as error:
        return error
    return forward, step, _qkv_ids


def _qkv_ids(named: dict) -> list:
    return [named[k] for k in ("q", "k", "v", "q_ids", "kv_ids") if k in named]


def _as_splash(call: Call) -> Call:
    import dataclasses

    return dataclasses.replace(call, kernel="splash")


def timing(calls: list[Call], platform: str, compiler: _Compiler) -> None:
    queued = []
    for call in calls:
        try:
            variants = _variants(call, platform)
            named = inputs(call)
        except Exception as error:
            emit(timing=dict(name=call.name, error=_error(error)))
            continue
        for name, variant in variants.items():
            if isinstance(variant, Exception):
                continue
            forward, step, arguments = variant
            try:
                args = arguments(named)
                compiler.submit((call.name, name, "forward"), forward, args)
                if step is not None:
                    compiler.submit((call.name, name, "step"), step, _step_args(name, args, named))
            except Exception as error:
                variants[name] = error
        queued.append((call, variants))
        del named
    compiler.wait()
    for call, variants in queued:
        named = inputs(call)
        row = dict(name=call.name, kernel=call.kernel, blocks=_blocks(call.plan(platform)), variants={})
        for name, variant in variants.items():
            if isinstance(variant, Exception):
                row["variants"][name] = dict(error=_error(variant))
                continue
            forward, step, arguments = variant
            measured = {}
            try:
                args = arguments(named)
                measured["forward_ms"] = 1e3 * timed(compiler.get((call.name, name, "forward")), *args)
                if step is not None:
                    compiled = compiler.get((call.name, name, "step"))
                    measured["step_ms"] = 1e3 * timed(compiled, *_step_args(name, args, named))
            except Exception as error:
                measured["error"] = _error(error)
            row["variants"][name] = measured
        emit(timing=row)


def _step_args(name: str, args: list, named: dict) -> list:
    """A step's arguments: the plan's take the output's cotangent last; the baselines' after q, k, v."""
    if name.startswith("plan"):
        return [*args, named["d_out"]]
    return [*args[:3], named["d_out"], *args[3:]]


def _blocks(plan) -> dict:
    if isinstance(plan, Plan):
        return dict(plan.blocks)
    return dict(heads=plan.block_heads, rows=plan.block_rows, kv=plan.block_kv, splits=plan.splits)


def run(parts: list[str], fidelity_calls: list[Call], timing_calls: list[Call], quick: bool, workers: int) -> int:
    device = jax.devices()[0]
    platform = "tpu" if device.platform == "tpu" else "cpu"
    emit(
        chip=dict(
            platform=device.platform,
            device_kind=device.device_kind,
            generation=generation(device),
            python=platform_module.python_version(),
            jax=compat.installed("jax"),
            jaxlib=compat.installed("jaxlib"),
            libtpu=compat.installed("libtpu") or compat.installed("libtpu-nightly"),
        )
    )
    compiler = _Compiler(workers)
    # the kernels built for this chip's generation (a v4's: as for every generation)
    planned = DEVICE_KINDS.get(device.device_kind) if device.platform == "tpu" else None
    fidelity_calls = [dataclasses.replace(call, generation=planned) for call in fidelity_calls]
    timing_calls = [dataclasses.replace(call, generation=planned) for call in timing_calls]
    try:
        if "limits" in parts:
            emit(limits=limits(quick))
        if "fidelity" in parts:
            fidelity(fidelity_calls, platform, compiler)
        if "timing" in parts:
            timing(timing_calls, platform, compiler)
        if "ring" in parts:
            for row in ring.rows(platform, quick, timed):
                emit(ring=row)
    except Exception:
        traceback.print_exc()
        return 1
    return 0
