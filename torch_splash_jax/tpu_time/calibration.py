"""Calibration: the schedule estimate (`torch_splash_jax.tpu_time`) of tokamax's own splash kernel
at the shapes and configurations tokamax measured on real TPUs.

tokamax ships its autotuning caches (`tokamax/data/autotuning/<chip>/...flash_attention*.json`):
per call, the winning block configuration and five measured times. `calibrate` compiles tokamax's
op at each entry (deviceless, with the current set's JAX and libtpu), estimates its kernel, prints
one line per entry and a summary. `fit` fits the estimator's numbers over several generations'
results: a clock factor per generation (`chips.CLOCK_FACTOR`) and one stall per row for all
(`chips.ROW_STALL`); `./dev.sh bench-tpu-time` runs it.

    python -m torch_splash_jax.tpu_time calibrate --generation v5p [--limit N] [--json FILE]

tokamax is a calibration dependency (the current set's `calibrate` extra), never a runtime one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import re
import statistics
import sys

import numpy as np

from ..errors import SplashConstraintError
from .chips import CLOCK_FACTOR, ROW_STALL
from .estimate import Estimate, program_estimate
from .libtpu import compile_schedules
from .schedule import ScheduleError
from .work import block_classes, causal, dkv_work, forward_work, full_mask

TOKAMAX_CHIPS = {"v5p": "tpu_v5", "v6e": "tpu_v6_lite", "v7x": "tpu7x"}
_SHAPE = re.compile(r"(\w+)\[([\d,]+)\]")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One measured entry of tokamax's cache: a call, its winning config, its median time."""

    direction: str  # "forward" or "backward"
    q: tuple
    k: tuple
    v: tuple
    dtype: str
    causal: dict | None  # {"offset", "window_size"} or None (no mask)
    scale: float
    residuals: bool
    config: dict
    measured_ms: float

    def describe(self) -> str:
        mask = (
            "full"
            if self.causal is None
            else "causal" + (f"/w{self.causal['window_size']}" if self.causal.get("window_size") else "")
        )
        blocks = "/".join(str(self.config[k]) for k in self.config if k.startswith("block"))
        shape = lambda dims: ",".join(map(str, dims))  # noqa: E731
        return (
            f"{'fwd' if self.direction == 'forward' else 'bwd'} {self.dtype}[{shape(self.q)}] "
            f"kv[{shape(self.k)}] {mask}"
            f"{' +res' if self.residuals else ''} blocks {blocks}"
        )


def tokamax_entries(generation: str, direction: str = "forward") -> list[Entry]:
    """tokamax's measured entries (those with a winning config and times) for a generation."""
    import importlib.resources

    if generation not in TOKAMAX_CHIPS:
        raise SplashConstraintError(
            f"generation={generation!r}: tokamax's caches measure {sorted(TOKAMAX_CHIPS)} (v5e: none for attention)."
        )
    name = "pallas_mosaic_tpu_flash_attention" + ("_vjp" if direction == "backward" else "")
    path = importlib.resources.files("tokamax") / "data" / "autotuning" / TOKAMAX_CHIPS[generation] / f"{name}.json"
    if not path.is_file():
        raise SplashConstraintError(f"tokamax measured no {direction} attention on {generation}.")
    entries = []
    for key, configs in json.loads(path.read_text()).items():
        call = json.loads(key)
        if len(configs) != 1 or call.get("bias") or call.get("mask", {}).get("bool_mask"):
            continue
        ((config, result),) = configs.items()
        shapes = {name: _SHAPE.fullmatch(call[name]) for name in ("q", "k", "v")}
        entries.append(
            Entry(
                direction=direction,
                q=tuple(int(d) for d in shapes["q"][2].split(",")),
                k=tuple(int(d) for d in shapes["k"][2].split(",")),
                v=tuple(int(d) for d in shapes["v"][2].split(",")),
                dtype=shapes["q"][1],
                causal=call["mask"]["causal_mask"],
                scale=call["logits_scale"],
                residuals=bool(call.get("return_residuals")),
                config=json.loads(config),
                measured_ms=statistics.median(result["evaluation_times_ms"]),
            )
        )
    return entries


def probe_config(q_len: int, kv_len: int):
    """A valid configuration of tokamax's forward op, for traces that only read what the op passes
    on or refuses (no time is estimated at it)."""
    from .. import compat

    tk_fwd, _, tk_splash = compat.tokamax_attention_modules()
    layout = tk_splash.QKVLayout.HEAD_DIM_MINOR
    return tk_fwd.Config(
        block_q=min(1024, q_len),
        block_kv=min(1024, kv_len),
        block_kv_compute=min(512, kv_len),
        q_layout=layout,
        k_layout=layout,
        v_layout=layout,
        use_experimental_scheduler=False,
    )


def _tokamax_program(entry: Entry):
    """(fn, args, works) for one tokamax entry: its op at its config, and its kernels' work."""
    import jax
    import jax.numpy as jnp

    from .. import compat

    tk_fwd, tk_vjp, tk_splash = compat.tokamax_attention_modules()

    dtype = jnp.dtype({"bf16": "bfloat16", "f16": "float16", "f32": "float32"}.get(entry.dtype, entry.dtype))
    *batch, q_len, heads, head_dim = entry.q
    *_, kv_len, kv_heads, _ = entry.k
    head_dim_v = entry.v[-1]
    units = math.prod(batch) * heads
    allowed = (
        full_mask if entry.causal is None else causal(entry.causal.get("offset") or 0, entry.causal.get("window_size"))
    )
    layouts = {name: tk_splash.QKVLayout(value) for name, value in entry.config.items() if name.endswith("_layout")}
    args = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in (entry.q, entry.k, entry.v))
    kwargs = dict(is_causal=entry.causal is not None, logits_scale=entry.scale)
    if entry.causal is not None and (entry.causal.get("offset") or entry.causal.get("window_size")):
        raise ScheduleError(f"{entry.describe()}: causal offsets and windows are not read yet")

    def work(count, block_q, block_kv, **options):  # tokamax's grid: one step per block computed
        classes = block_classes(allowed, q_len, kv_len, block_q, block_kv)
        shape = dict(units=units, head_dim=head_dim, head_dim_v=head_dim_v, itemsize=dtype.itemsize, grid="active")
        return count(classes, block_q=block_q, block_kv=block_kv, **shape, **options)

    if entry.direction == "forward":
        config = tk_fwd.Config(**{**entry.config, **layouts})
        op = tk_fwd.PallasMosaicTpuFlashAttention(config=config, bypass_device_check=True)

        def fn(q, k, v):
            return op(q, k, v, return_residuals=entry.residuals, **kwargs)

        return fn, args, {"forward": work(forward_work, config.block_q, config.block_kv)}
    # tokamax measured its vjp op alone, on (residuals, out, dout, q, k, v): the same program here,
    # with the keyword arguments its forward op passes it, read from a shape-only trace
    vjp = tk_vjp.PallasMosaicTpuFlashAttentionVjp(config=tk_vjp.Config(**entry.config), bypass_device_check=True)
    passed = {}

    def record(residuals, out, dout, q, k, v, **kw):
        passed.update(kw)
        return {"q": q, "k": k, "v": v}

    recording = tk_fwd.PallasMosaicTpuFlashAttention(
        vjp=record, config=probe_config(q_len, kv_len), bypass_device_check=True
    )

    def probe(q, k, v):
        out, pullback = jax.vjp(lambda *qkv: recording(*qkv, **kwargs), q, k, v)
        return pullback(out)

    jax.eval_shape(probe, *args)
    residual = jax.ShapeDtypeStruct((*batch, heads, q_len), jnp.float32)
    out = jax.ShapeDtypeStruct((*batch, q_len, heads, head_dim_v), dtype)

    def fn(residuals, out, dout, q, k, v):
        return vjp(residuals, out, dout, q, k, v, **passed)

    return (
        fn,
        ((residual, residual), out, out, *args),
        {"dkv": work(dkv_work, vjp.config.block_q_dkv, vjp.config.block_kv_dkv, fused=True)},
    )


@dataclasses.dataclass(frozen=True)
class Calibrated:
    entry: Entry
    estimate: Estimate | None
    error: str | None = None

    def kernels(self) -> list:
        """The op's kernel: the forward kernel, or the backward's fused dkv kernel."""
        return list(self.estimate.kernels)

    def parts(self) -> tuple[float, float, int]:
        """(schedule seconds at the published-peak clock, HBM seconds, rows per core) of what
        tokamax's time covers. It timed each op with xprof (the device time of all its ops), yet its
        forward times fit the kernel alone: with the HBM traffic of the transposes around the kernel
        added, MXU-bound entries would leave their kernel less time than its bundles take (v5p,
        [2,8192,16,128], full: measured 2.86 ms, the kernel's bundles alone 2.74 ms at the clock the
        published peak implies, the ops around it 0.19 ms of HBM traffic).
        Its backward times do not: the vjp op's kernel alone came out under every measured time (5%
        to 43%), and with the HBM traffic of the ops around it (the transposes of q, k, v, out, dout
        and of the three gradients, the scaling, the output-gradient product) the median error is
        a few percent. So: the forward kernel alone; the backward's kernel and its XLA ops' traffic."""
        kernels = self.kernels()
        around = self.estimate.rest_hbm_seconds if self.entry.direction == "backward" else 0.0
        return (
            sum(k.schedule_seconds for k in kernels),
            sum(k.hbm_seconds for k in kernels) + around,
            sum(k.rows for k in kernels),
        )

    def seconds(self, factor: float = 1.0, stall: float = 0.0) -> float:
        """The estimate with a clock factor and a stall per row (by default, neither)."""
        schedule, hbm, rows = self.parts()
        return schedule * factor + hbm + rows * stall


def calibrate(
    generation: str,
    direction: str = "forward",
    limit: int | None = None,
    log=None,
    json_path: str | None = None,
    only: str | None = None,
) -> list[Calibrated]:
    """Estimate tokamax's kernel at each measured entry (at most `limit`, spread over the cache; or
    those whose description starts with `only`): one line per entry through `log` (and all results
    so far rewritten to `json_path` after each), then the summary."""
    log = log or functools.partial(print, flush=True)
    entries = tokamax_entries(generation, direction)
    if only:
        entries = [entry for entry in entries if entry.describe().startswith(only)]
    if limit:
        entries = _spread(entries, limit)
    results = []
    for entry in entries:
        try:
            fn, args, works = _tokamax_program(entry)
            schedules, hlo = compile_schedules(fn, args, generation)
            result = Calibrated(entry, program_estimate(schedules, works, hlo, generation))
        except Exception as error:  # one entry's failure is reported, not fatal
            result = Calibrated(entry, None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        results.append(result)
        log(calibration_line(result))
        if json_path:
            pathlib.Path(json_path).write_text(json.dumps([result_json(r) for r in results], indent=1))
    log(summary_line(generation, direction, results))
    return results


def _spread(entries: list, limit: int) -> list:
    """`limit` entries spread over the cache (it is sorted by shape)."""
    if limit >= len(entries):
        return entries
    picks = np.linspace(0, len(entries) - 1, limit).round().astype(int)
    return [entries[i] for i in sorted(set(picks))]


def _constants(generation: str) -> tuple[float, float]:
    return CLOCK_FACTOR.get(generation, 1.0), ROW_STALL


def calibration_line(result: Calibrated) -> str:
    entry = result.entry
    if result.estimate is None:
        return f"{entry.describe()}: measured {entry.measured_ms:.3f} ms, not estimated ({result.error})"
    from .chips import chip

    generation = result.estimate.generation
    estimate = result.seconds(*_constants(generation))
    mxu = sum(kernel.flops for kernel in result.kernels()) / (estimate * chip(generation).peak_flops)
    binding = result.kernels()[0].binding_unit if result.kernels() else "-"
    return (
        f"{entry.describe()}: estimate {estimate * 1e3:.3f} ms (without the fitted numbers "
        f"{result.seconds() * 1e3:.3f}), measured {entry.measured_ms:.3f} ms "
        f"({estimate * 1e3 / entry.measured_ms - 1:+.0%}), "
        f"MXU {mxu:.0%}, bound by {binding}, libtpu {result.estimate.libtpu}"
    )


def _rows(results: list[Calibrated]) -> list[tuple[float, float, int, float]]:
    return [(*r.parts(), r.entry.measured_ms * 1e-3) for r in results if r.estimate is not None]


def errors_of(rows, factor: float = 1.0, stall: float = 0.0) -> list[float]:
    """Estimate / measured - 1 of (schedule, HBM, rows, measured seconds) tuples."""
    return [(schedule * factor + hbm + n * stall) / measured - 1 for schedule, hbm, n, measured in rows]


def errors(results: list[Calibrated], factor: float = 1.0, stall: float = 0.0) -> list[float]:
    return errors_of(_rows(results), factor, stall)


def factor_of(rows, stall: float) -> float:
    """The clock factor these entries fit at `stall`: the median of (measured - HBM - stall) / schedule."""
    ratios = [(measured - hbm - n * stall) / schedule for schedule, hbm, n, measured in rows]
    return statistics.median(ratios) if ratios else 1.0


def fitted_factor(results: list[Calibrated], stall: float) -> float:
    return factor_of(_rows(results), stall)


STALLS = np.linspace(0, 2e-6, 81)  # the stalls `fit` tries, 25 ns apart


def fit(rows_by_generation: dict[str, list], stalls=STALLS) -> tuple[float, dict]:
    """(ROW_STALL, CLOCK_FACTOR) from {generation: [(schedule, HBM, rows, measured seconds)]}: the
    stall, shared by every generation, for which the clock factor each generation then fits puts
    the most entries within 25% of their measured time on the generation with the fewest (ties:
    the least mean median error)."""
    best = None
    for stall in stalls:
        factors = {g: factor_of(rows, stall) for g, rows in rows_by_generation.items()}
        errs = {g: [abs(e) for e in errors_of(rows, factors[g], stall)] for g, rows in rows_by_generation.items()}
        within = min(sum(e <= 0.25 for e in es) / len(es) for es in errs.values())
        score = (-within, statistics.mean(statistics.median(es) for es in errs.values()))
        if best is None or score < best[0]:
            best = (score, float(stall), factors)
    return best[1], best[2]


def stats(errs: list[float]) -> str:
    if not errs:
        return "no entries estimated"
    median = statistics.median(abs(e) for e in errs)
    return f"median error {median:.1%}, within 25%: {sum(abs(e) <= 0.25 for e in errs) / len(errs):.0%}"


def summary_line(generation: str, direction: str, results: list[Calibrated]) -> str:
    """`G: N entries, median error X%, within 25%: Y%` with the fitted numbers in the code, then
    the same without them, and the clock factor these entries fit at the code's stall."""
    estimated = [r for r in results if r.estimate is not None]
    factor, stall = _constants(generation)
    line = f"{generation} {direction}: {len(estimated)} entries, {stats(errors(results, factor, stall))}"
    line += f" (clock factor {factor:.3f}, stall {stall * 1e6:.2f} us per row); "
    line += f"without them: {stats(errors(results))}; "
    line += f"these entries fit a clock factor of {fitted_factor(results, stall):.3f}"
    if len(estimated) < len(results):
        line += f"; {len(results) - len(estimated)} not estimated"
    return line


def result_json(result: Calibrated) -> dict:
    entry = result.entry
    out = dict(entry=entry.describe(), measured_ms=entry.measured_ms, error=result.error)
    if result.estimate is not None:
        schedule, hbm, rows = result.parts()
        out.update(
            schedule_ms=schedule * 1e3,
            hbm_ms=hbm * 1e3,
            rows=rows,
            libtpu=result.estimate.libtpu,
            kernels=[dataclasses.asdict(kernel) for kernel in result.estimate.kernels],
            rest_ms=result.estimate.rest_seconds * 1e3,
            rest_hbm_ms=result.estimate.rest_hbm_seconds * 1e3,
        )
    return out


def calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The calibrate command's options (`python -m torch_splash_jax.tpu_time calibrate`)."""
    parser.add_argument("--generation", required=True, help="v5p, v6e or v7x (tokamax measured these)")
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward")
    parser.add_argument("--limit", type=int, default=None, help="at most N entries, spread over the cache")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m torch_splash_jax.tpu_time calibrate ...` runs this in a process that dumps schedules."""
    parser = calibrate_arguments(argparse.ArgumentParser(prog="python -m torch_splash_jax.tpu_time calibrate"))
    options = parser.parse_args(argv)
    results = calibrate(options.generation, options.direction, options.limit, json_path=options.json)
    return 0 if any(r.estimate is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
