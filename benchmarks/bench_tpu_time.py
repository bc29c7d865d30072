"""TPU kernel time without a TPU: estimates from the TPU compiler's own schedule (libtpu 0.0.52,
deviceless), checked against tokamax's measured TPU times, and torch_splash's plans side by side
with JAX's splash and tokamax. Every figure is an estimate (torch_splash_jax.tpu_time says what it
leaves out); only tokamax's "measured" column was measured, on real chips, by tokamax.

1. Calibration: `torch_splash_jax.tpu_time.calibration` at every measured entry of tokamax's caches,
   forward on v5p, v6e and v7x and backward (fused dkv) on v7x: the error without and with the
   numbers fitted (a stall per row, and a clock factor per generation).
2. Comparison, one device, per call of a training step (the forward with residuals, then the
   backward): JAX's splash at MaxText's defaults (512 blocks, separate dq and dkv kernels; also
   torch_splash's TPU plan before the search below chose it), JAX's splash at torch_splash's
   planned blocks, torch_splash's own active-block kernels, and tokamax's
   forward at the configuration its cache measured (for other lengths: the one it measured for
   the nearest length), for causal, full, GQA, head_dim 256, document (causal with segment ids)
   and sliding-window masks, 4K to 128K tokens, on v5e, v5p, v6e and v7x.
3. Search: forward+backward of candidate TPU plans (blocks, compute blocks, fused or separate
   backward) and of the plan, causal, 16 heads, 8K and 32K tokens at head_dim 128 and 16K at 256:
   what torch_splash_jax.plan's TPU table was chosen from.

    ./dev.sh bench-tpu-time            # all three (about 270 + 90 + 90 compiles: hours on 2 cores)
    ./dev.sh bench-tpu-time --quick    # one calibration entry, one comparison row, one candidate searched
    ./dev.sh bench-tpu-time --parts search --saved DIR   # one part, saved in DIR for a later run

Writes benchmarks/results/tpu_time.json (or tpu_time_quick.json). Runs in the current set
(tokamax and libtpu 0.0.52 live there).
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import report  # benchmarks/report.py: results files and their tables

from torch_splash_jax.tpu_check.cases import MAXTEXT_BLOCKS

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALIBRATIONS = [("v5p", "forward"), ("v6e", "forward"), ("v7x", "forward"), ("v7x", "backward")]
GENERATIONS = ("v5e", "v5p", "v6e", "v7x")
# (generation, mask, L, q heads, kv heads, head_dim): B=1, bf16. tokamax measured the 16K rows of
# 16/16 and 8/8 heads (causal and full) on v5p, v6e and v7x; v5e has no tokamax cache.
COMPARISON = [
    (generation, mask, length, heads, kv_heads, dim)
    for generation in GENERATIONS
    for mask, length, heads, kv_heads, dim in (
        ("causal", 16384, 16, 16, 128),
        ("full", 16384, 16, 16, 128),
        ("causal", 16384, 8, 8, 256),
        ("causal", 16384, 32, 8, 128),
        ("document", 16384, 16, 16, 128),
        ("window 4096", 32768, 16, 16, 128),
    )
] + [(generation, "causal", length, 16, 16, 128) for generation in ("v5p", "v7x") for length in (4096, 131072)]
QUICK_COMPARISON = [("v5p", "causal", 4096, 8, 8, 128)]
QUICK_ENTRY = "fwd bf16[8,2048,16,128] kv[8,2048,16,128] causal blocks"  # one measured entry, quick to compile


def _libtpu_dir() -> str:
    return os.environ.get("TORCH_SPLASH_LIBTPU_DIR") or _site_packages()


def _site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def _mask(name: str, length: int):
    import torch_splash_jax as tsj

    if name == "causal":
        return tsj.CausalMask(), False
    if name == "full":
        return tsj.FullMask(), False
    if name == "document":  # packed documents: causal, with segment ids (data: no block is skipped for them)
        return tsj.CausalMask(), True
    return tsj.CausalMask() & tsj.LocalMask(int(name.split()[1]) - 1, 0), False


# Each comparison column's kernels: JAX's splash at MaxText's blocks, JAX's splash at the plan's
# blocks ("planned"), and the project's own active-block kernels (the default where they serve).
COLUMNS = {
    "maxtext": dict(MAXTEXT_BLOCKS),
    "planned": dict(forward_kernel="splash"),
    "active": dict(forward_kernel="active"),
}


def _comparison_row(case: tuple, names=tuple(COLUMNS)) -> dict:
    """One row: the training step's kernels (forward with residuals, then the backward) estimated
    for each of `names` (`COLUMNS`), and tokamax's forward."""
    import torch_splash_jax as tsj
    from torch_splash_jax import tpu_time

    generation, mask_name, length, heads, kv_heads, dim = case
    mask, segment_ids = _mask(mask_name, length)
    row = dict(generation=generation, mask=mask_name, L=length, heads=heads, kv_heads=kv_heads, head_dim=dim)
    for name in names:
        plan = tsj.plan(
            q_len=length,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            dtype="bfloat16",
            mask=mask,
            has_segment_ids=segment_ids,
            platform="tpu",
            block_sizes=tsj.BlockSizes(**COLUMNS[name]),
            generation=generation,
        )
        row[name] = dict(blocks=plan.block_sizes() if plan.forward_kernel == "splash" else None)
        try:
            estimate = tpu_time.splash_estimate(plan, generation, backward=True)
        except Exception as error:  # a refusal is a result
            row[name]["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        forward = [k for k in estimate.kernels if k.kind == "forward"]
        row[name].update(
            step_ms=estimate.kernel_seconds * 1e3,
            forward_ms=sum(k.seconds for k in forward) * 1e3,
            step_mxu=estimate.mxu_utilization,
            forward_mxu=forward[0].mxu_utilization,
            binding={k.kind: k.binding_unit for k in estimate.kernels},
            kernels={k.kind: round(k.seconds * 1e3, 4) for k in estimate.kernels},
            libtpu=estimate.libtpu,
        )
    row["tokamax"] = _tokamax_row(case)
    return row


# v5e has no tokamax cache: its rows take the configurations tokamax measured on v5p
CACHE_OF = {"v5e": "v5p"}


def _tokamax_row(case: tuple) -> dict | None:
    """tokamax's forward (with residuals, as a training step runs it) for this shape: at the
    configuration its cache measured for it, else at the one it measured nearest (the same
    head_dim and mask; the same heads and B=1 first, then the nearest length; no measured time
    then); on v5e, at v5p's. For masks tokamax's TPU op cannot take, what it does instead
    ("refused"); None where it cached nothing similar."""
    from torch_splash_jax import tpu_time
    from torch_splash_jax.tpu_time import calibration

    generation, mask_name, length, heads, kv_heads, dim = case
    if mask_name == "document":
        return dict(refused="no segment ids: its TPU op takes a document mask only as a dense (L, L) bool array")
    if mask_name.startswith("window"):
        return dict(refused=_tokamax_refusal(length, heads, kv_heads, dim, int(mask_name.split()[1])))
    cache = CACHE_OF.get(generation, generation)
    similar = [
        e
        for e in calibration.tokamax_entries(cache)
        if e.q[3] == dim and e.residuals
        and (e.causal is not None) == (mask_name == "causal") and e.q[1] == e.k[1]
        and not (e.causal or {}).get("window_size") and not (e.causal or {}).get("offset")
    ]  # fmt: skip
    if not similar:
        return None
    # the same heads first, then B=1 (GQA 32/8 was measured at B=32 only, and not on v6e), then the nearest length
    nearest = min(similar, key=lambda e: ((e.q[2], e.k[2]) != (heads, kv_heads), e.q[0] != 1,
                                          abs(math.log2(e.q[1] / length))))  # fmt: skip
    entry = dataclasses.replace(
        nearest,
        q=(1, length, heads, dim),
        k=(1, length, kv_heads, dim),
        v=(1, length, kv_heads, dim),
        measured_ms=nearest.measured_ms if (*nearest.q[:3], nearest.k[2]) == (1, length, heads, kv_heads) else None,
    )
    fn, args, works = calibration._tokamax_program(entry)
    schedules, hlo = tpu_time.compile_schedules(fn, args, generation)
    result = calibration.Calibrated(entry, tpu_time.program_estimate(schedules, works, hlo, generation))
    blocks = "/".join(str(entry.config[k]) for k in ("block_q", "block_kv", "block_kv_compute"))
    forward_ms = result.seconds(tpu_time.CLOCK_FACTOR.get(generation, 1.0), tpu_time.ROW_STALL) * 1e3
    measured = entry.measured_ms if cache == generation else None  # v5p's time is no v5e measurement
    vjp = _tokamax_vjp_ms(nearest, cache) if measured else None
    return dict(blocks=blocks, forward_ms=forward_ms, measured_ms=measured, cached_at=nearest.q[1], cache=cache,
                cached_batch=nearest.q[0], cached_heads=f"{nearest.q[2]}/{nearest.k[2]}",
                **({"vjp_measured_ms": vjp} if vjp else {}))  # fmt: skip


def _tokamax_vjp_ms(forward, generation: str) -> float | None:
    """The time tokamax's cache for `generation` measured for its vjp op (its backward: the fused dkv
    kernel and the XLA ops around it) at a measured forward's very shapes and mask, or None where it
    measured none."""
    from torch_splash_jax.errors import SplashConstraintError
    from torch_splash_jax.tpu_time import calibration

    try:
        entries = calibration.tokamax_entries(generation, "backward")
    except SplashConstraintError:  # no vjp measured on that chip
        return None
    same = [
        e
        for e in entries
        if (e.q, e.k, e.v, e.dtype, e.causal) == (forward.q, forward.k, forward.v, forward.dtype, forward.causal)
    ]
    return same[0].measured_ms if same else None


def _tokamax_refusal(length: int, heads: int, kv_heads: int, dim: int, window: int) -> str:
    """What tokamax's TPU op says, traced on shapes, when asked for a causal window."""
    import jax
    import jax.numpy as jnp

    from torch_splash_jax import compat
    from torch_splash_jax.tpu_time import calibration

    tk_fwd, _, _ = compat.tokamax_attention_modules()
    config = calibration.probe_config(length, length)
    op = tk_fwd.PallasMosaicTpuFlashAttention(config=config, bypass_device_check=True)
    q = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, length, kv_heads, dim), jnp.bfloat16)
    try:
        jax.eval_shape(lambda q, k, v: op(q, k, v, mask=compat.tokamax_causal_mask(window)), q, kv, kv)
    except Exception as error:  # its refusal is the result
        return f"refused: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return "accepted (not estimated: the estimator reads no windows for tokamax)"


def _blocks(forward: tuple, dkv: tuple, compute: int, dq: tuple | None = None) -> dict:
    """BlockSizes fields: forward and dkv (q, kv) blocks, their kv compute block, and the separate dq
    kernel's (q, kv) blocks, or None for dq fused into dkv."""
    fields = dict(block_q=forward[0], block_kv=forward[1], block_kv_compute=compute)
    fields.update(block_q_dkv=dkv[0], block_kv_dkv=dkv[1], block_kv_dkv_compute=compute)
    if dq is not None:
        fields.update(block_q_dq=dq[0], block_kv_dq=dq[1])
    return dict(fields, use_fused_bwd_kernel=dq is None)


# MaxText's defaults for JAX's splash (the real-chip check's baseline too), and torch_splash's TPU
# plan before the search chose it
MAXTEXT = MAXTEXT_BLOCKS
# The TPU plan's candidates (each within the VMEM budget the planner enforces on every generation);
# the plan (torch_splash_jax.block_planning._TARGETS) takes the fastest, its fused dq buffer kept to at most 8 q's
# or 2 GiB (torch_splash_jax.kernel_limits.FUSED_DQ_BUFFER_BYTES)
CANDIDATES = {
    "512 separate (MaxText)": MAXTEXT,
    "512 fused": _blocks((512, 512), (512, 512), 512),
    "1024/512 fused": _blocks((1024, 1024), (1024, 1024), 512),
    "1024/512 separate": _blocks((1024, 1024), (1024, 1024), 512, dq=(1024, 1024)),
    "2048x1024/512 fused": _blocks((2048, 1024), (1024, 2048), 512),
    "2048x1024/512 fused, dkv 512x4096": _blocks((2048, 1024), (512, 4096), 512),
    "2048x1024/512 separate": _blocks((2048, 1024), (1024, 2048), 512, dq=(1024, 2048)),
}
SEARCH = [(g, length, dim) for g in GENERATIONS for length, dim in ((8192, 128), (32768, 128), (16384, 256))]


def search(cases=SEARCH, candidates=None) -> list[dict]:
    """The estimated forward+backward kernel time (ms) of each candidate plan and of torch_splash's
    own ("planned"), causal, B=1, 16 heads; with each fused candidate's dq buffer in q's."""
    import torch_splash_jax as tsj
    from torch_splash_jax import tpu_time

    rows = []
    for generation, length, dim in cases:
        row = dict(generation=generation, L=length, head_dim=dim, calibrated=bool(tpu_time.CLOCK_FACTOR), ms={})
        row["dq_buffer"], row["planned_as"] = {}, None
        for name in [*(candidates or CANDIDATES), "planned"]:
            # JAX's splash kernels at the candidate's blocks, and at the plan's
            blocks = tsj.BlockSizes(**(CANDIDATES.get(name) or {}), forward_kernel="splash")
            try:
                plan = tsj.plan(q_len=length, num_q_heads=16, head_dim=dim, dtype="bfloat16", mask=tsj.CausalMask(),
                                platform="tpu", block_sizes=blocks)  # fmt: skip
            except Exception as error:  # refused by the planner (VMEM, SMEM): not a candidate here
                row["ms"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                continue
            planned = plan.block_sizes()
            if planned["use_fused_bwd_kernel"]:
                row["dq_buffer"][name] = plan.kv_len_padded // planned["block_kv_dkv"]
            same = [n for n in row["ms"] if n != name and row.get("blocks", {}).get(n) == planned]
            row.setdefault("blocks", {})[name] = planned
            if name == "planned" and same:  # the plan is one of the candidates: the same program
                row["planned_as"], row["ms"][name] = same[0], row["ms"][same[0]]
                continue
            try:
                row["ms"][name] = tpu_time.splash_estimate(plan, generation, backward=True).kernel_seconds * 1e3
            except Exception as error:  # not compiled (VMEM, HBM): not a candidate here
                row["ms"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "blocks"}), flush=True)
    return rows


def calibrations(quick: bool, saved: pathlib.Path | None) -> dict:
    from torch_splash_jax.tpu_time import calibration

    out = {}
    for generation, direction in [("v5p", "forward")] if quick else CALIBRATIONS:
        path = saved / f"{generation}-{direction}.json" if saved else None
        if path is not None and path.is_file():
            entries = json.loads(path.read_text())
        else:
            found = calibration.calibrate(generation, direction, only=QUICK_ENTRY if quick else None)
            entries = [calibration.result_json(r) for r in found]
            if path is not None:
                path.write_text(json.dumps(entries))
        out[f"{generation}/{direction}"] = entries
    return out


PARTS = ("calibration", "comparison", "search")


def _rows(cases, saved: pathlib.Path | None) -> list[dict]:
    """The comparison's rows, each kept in `saved` as it is made (a long run can be resumed)."""
    path = saved / "comparison-rows.json" if saved else None
    rows = json.loads(path.read_text()) if path is not None and path.is_file() else []
    for case in cases[len(rows) :]:
        rows.append(_comparison_row(case))
        print(json.dumps(rows[-1]), flush=True)
        if path is not None:
            path.write_text(json.dumps(rows))
    return rows


def worker(quick: bool, saved: pathlib.Path | None, parts=PARTS) -> dict:
    """In a process started with libtpu's dump flags: the parts this benchmark measures; each part
    found in `saved` (as a run of this benchmark left it there) is taken from it, each other part
    computed and saved there."""
    from torch_splash_jax import tpu_time
    from torch_splash_jax.tpu_time import calibration

    results = dict(clock_factor=dict(tpu_time.CLOCK_FACTOR), row_stall_us=tpu_time.ROW_STALL * 1e6)

    def part(name, compute):
        path = saved / f"{name}.json" if saved else None
        if path is not None and path.is_file():
            return json.loads(path.read_text())
        value = compute()
        if path is not None:
            path.write_text(json.dumps(value))
        return value

    if "calibration" in parts:
        results["calibration"] = calibrations(quick, saved)
        forward = {
            key.split("/")[0]: [(e["schedule_ms"] * 1e-3, e["hbm_ms"] * 1e-3, e["rows"], e["measured_ms"] * 1e-3)
                                for e in entries if e.get("schedule_ms") is not None]
            for key, entries in results["calibration"].items() if key.endswith("/forward")
        }  # fmt: skip
        stall, factors = calibration.fit(forward)
        results["fitted"] = dict(row_stall_us=stall * 1e6, clock_factor=factors)
        print(f"fitted: ROW_STALL = {stall:.4g}, CLOCK_FACTOR = {factors}", flush=True)
    if "comparison" in parts:
        if quick:  # the plan's JAX kernels and the active ones, and tokamax: the smoke run the tests make
            results["comparison"] = [_comparison_row(case, ("planned", "active")) for case in QUICK_COMPARISON]
        else:
            results["comparison"] = part("comparison", lambda: _rows(COMPARISON, saved))
    if "search" in parts:
        quick_search = lambda: search([("v5p", 4096, 128)], candidates=("2048x1024/512 fused",))  # noqa: E731
        results["search"] = part("search", quick_search if quick else search)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument(
        "--saved",
        metavar="DIR",
        help="take each part a run saved in DIR (calibration as G-DIRECTION.json, as `tpu_time calibrate --json` "
        "writes it; comparison.json; search.json) and save the others there",
    )
    options = parser.parse_args()
    parts = tuple(options.parts.split(","))
    saved = pathlib.Path(options.saved).resolve() if options.saved else None
    if saved:
        saved.mkdir(parents=True, exist_ok=True)
    if options.worker:
        out = worker(options.quick, saved, parts)
        pathlib.Path(options.worker).write_text(json.dumps(out))
        return
    from torch_splash_jax import tpu_time

    with tempfile.TemporaryDirectory(prefix="bench-tpu-time-") as directory:
        dumps = pathlib.Path(directory) / "dumps"
        dumps.mkdir()
        out = pathlib.Path(directory) / "results.json"
        env = tpu_time.environment(_libtpu_dir(), str(dumps))
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "benchmarks"), str(ROOT)])
        command = [sys.executable, __file__, "--worker", str(out), "--parts", ",".join(parts)]
        command += (["--quick"] if options.quick else []) + (["--saved", str(saved)] if saved else [])
        subprocess.run(command, env=env, check=True)
        results = json.loads(out.read_text())
    if set(parts) != set(PARTS):
        print(json.dumps({k: v for k, v in results.items() if k != "calibration"})[:4000])
        return  # a part alone is for --saved; the results file and its table need every part
    results["libtpu"] = tpu_time.ESTIMATOR_LIBTPU
    report.save("tpu_time", results, options.quick, "./dev.sh bench-tpu-time")


if __name__ == "__main__":
    main()
