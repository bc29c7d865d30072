"""TPU kernel time without a TPU: estimates from the TPU compiler's own schedule (libtpu 0.0.52,
deviceless), checked against tokamax's measured TPU times, and torch_splash's plans side by side
with JAX's splash and tokamax. Every figure is an estimate (torch_splash_jax.tpu_time says what it
leaves out); only tokamax's "measured" column was measured, on real chips, by tokamax.

1. Calibration: `torch_splash_jax.calibration` at every measured entry of tokamax's caches,
   forward on v5p, v6e and v7x and backward (fused dkv) on v7x: the error without and with the
   one number fitted per generation (the stall per row).
2. Comparison, forward and forward+backward per call, one device: (a) torch_splash as planned
   before the TPU plan was chosen by these estimates (512 blocks, separate dq and dkv kernels:
   MaxText's defaults for JAX's splash, so also (b) JAX's splash called with them), (c) tokamax at
   its cached winning configuration where its cache measured the shape (forward), and (d)
   torch_splash as it plans now.

    ./dev.sh bench-tpu-time            # the calibration (about 270 compiles) and the comparison
    ./dev.sh bench-tpu-time --quick    # two calibration entries on v5p and one comparison row

Writes benchmarks/results/tpu_time.json (or tpu_time_quick.json). Runs in the current set
(tokamax and libtpu 0.0.52 live there).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import report  # benchmarks/report.py: results files and their tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALIBRATIONS = [("v5p", "forward"), ("v6e", "forward"), ("v7x", "forward"), ("v7x", "backward")]
# (generation, mask, L, q heads, kv heads, head_dim): B=1, bf16
COMPARISON = [
    (generation, mask, length, heads, kv_heads, dim)
    for generation in ("v5e", "v5p", "v6e", "v7x")
    for mask, length, heads, kv_heads, dim in (
        ("causal", 8192, 16, 16, 128),
        ("causal", 32768, 16, 16, 128),
        ("causal", 16384, 32, 8, 128),
        ("causal", 16384, 8, 8, 256),
        ("full", 16384, 16, 16, 128),
        ("window 4096", 32768, 16, 16, 128),
        ("documents of 4096", 32768, 16, 16, 128),
    )
]
QUICK_COMPARISON = [("v5p", "causal", 4096, 8, 8, 128)]
BEFORE = dict(
    block_q=512,
    block_kv=512,
    block_kv_compute=512,
    block_q_dkv=512,
    block_kv_dkv=512,
    block_kv_dkv_compute=512,
    block_q_dq=512,
    block_kv_dq=512,
    use_fused_bwd_kernel=False,
)


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
    if name.startswith("window"):
        return tsj.CausalMask() & tsj.LocalMask(int(name.split()[1]) - 1, 0), False
    return tsj.CausalMask(), True  # documents: segment ids; the tables cannot know where they change


def _comparison_row(case: tuple) -> dict:
    import torch_splash_jax as tsj
    from torch_splash_jax import tpu_time

    generation, mask_name, length, heads, kv_heads, dim = case
    mask, segment_ids = _mask(mask_name, length)
    row = dict(generation=generation, mask=mask_name, L=length, heads=heads, kv_heads=kv_heads, head_dim=dim)
    for name, blocks in (("before", tsj.BlockSizes(**BEFORE)), ("planned", None)):
        plan = tsj.plan(
            q_len=length,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            dtype="bfloat16",
            mask=mask,
            has_segment_ids=segment_ids,
            platform="tpu",
            block_sizes=blocks,
        )
        row[name] = dict(blocks=plan.block_sizes())
        for direction, backward in (("forward", False), ("step", True)):
            try:
                estimate = tpu_time.splash_estimate(plan, generation, backward=backward)
            except Exception as error:  # a refusal is a result
                row[name][direction] = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            row[name][direction] = dict(
                kernel_ms=estimate.kernel_seconds * 1e3,
                rest_ms=estimate.rest_seconds * 1e3,
                mxu=estimate.mxu_utilization,
                binding=estimate.binding_unit,
                kernels={k.kind: round(k.seconds * 1e3, 4) for k in estimate.kernels},
                libtpu=estimate.libtpu,
            )
    row["tokamax"] = _tokamax_row(case)
    return row


def _tokamax_row(case: tuple) -> dict | None:
    """tokamax's kernel at its cached winning configuration for this shape, if its cache measured it."""
    from torch_splash_jax import calibration, tpu_time

    generation, mask_name, length, heads, kv_heads, dim = case
    if generation not in calibration.TOKAMAX_CHIPS or mask_name not in ("causal", "full"):
        return None
    for entry in calibration.tokamax_entries(generation):
        same = entry.q == (1, length, heads, dim) and entry.k == (1, length, kv_heads, dim)
        if same and (entry.causal is not None) == (mask_name == "causal") and not entry.residuals:
            fn, args, works = calibration._tokamax_program(entry)
            schedules, hlo = tpu_time.compile_schedules(fn, args, generation)
            result = calibration.Calibrated(entry, tpu_time.program_estimate(schedules, works, hlo, generation))
            blocks = "/".join(str(entry.config[k]) for k in ("block_q", "block_kv", "block_kv_compute"))
            estimate = result.seconds(tpu_time.CLOCK_FACTOR.get(generation, 1.0), tpu_time.ROW_STALL)
            return dict(blocks=blocks, forward_ms=estimate * 1e3, measured_ms=entry.measured_ms)
    return None


# The TPU plan's candidates (each within the VMEM budget the planner enforces on every generation)
CANDIDATES = {
    "512 separate": BEFORE,
    "512 fused": dict(block_q=512, block_kv=512, block_q_dkv=512, block_kv_dkv=512, use_fused_bwd_kernel=True),
    "1024/512 fused": dict(
        block_q=1024,
        block_kv=1024,
        block_kv_compute=512,
        block_q_dkv=1024,
        block_kv_dkv=1024,
        block_kv_dkv_compute=512,
        use_fused_bwd_kernel=True,
    ),  # fmt: skip
    "1024 fused": dict(
        block_q=1024,
        block_kv=1024,
        block_kv_compute=1024,
        block_q_dkv=1024,
        block_kv_dkv=1024,
        block_kv_dkv_compute=1024,
        use_fused_bwd_kernel=True,
    ),  # fmt: skip
    "1024 separate": dict(
        block_q=1024,
        block_kv=1024,
        block_kv_compute=1024,
        block_q_dkv=1024,
        block_kv_dkv=1024,
        block_kv_dkv_compute=1024,
        block_q_dq=1024,
        block_kv_dq=1024,
        use_fused_bwd_kernel=False,
    ),  # fmt: skip
    "2048x1024/512 fused": dict(
        block_q=2048,
        block_kv=1024,
        block_kv_compute=512,
        block_q_dkv=1024,
        block_kv_dkv=2048,
        block_kv_dkv_compute=512,
        use_fused_bwd_kernel=True,
    ),  # fmt: skip
}
SEARCH = [
    (g, length, dim) for g in ("v5e", "v5p", "v6e", "v7x") for length, dim in ((8192, 128), (32768, 128), (16384, 256))
]


def search(cases=SEARCH) -> list[dict]:
    """The estimated forward+backward kernel time of each candidate plan, causal, B=1, 16 heads."""
    import torch_splash_jax as tsj
    from torch_splash_jax import tpu_time

    rows = []
    for generation, length, dim in cases:
        row = dict(generation=generation, L=length, head_dim=dim, ms={})
        for name, blocks in CANDIDATES.items():
            try:
                plan = tsj.plan(q_len=length, num_q_heads=16, head_dim=dim, dtype="bfloat16", mask=tsj.CausalMask(),
                                platform="tpu", block_sizes=tsj.BlockSizes(**blocks))  # fmt: skip
                row["ms"][name] = tpu_time.splash_estimate(plan, generation, backward=True).kernel_seconds * 1e3
            except Exception as error:  # refused (VMEM, SMEM) or not compiled: not a candidate here
                row["ms"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def worker(quick: bool, calibration_dir: str | None) -> dict:
    """In a process started with libtpu's dump flags: everything this benchmark measures."""
    from torch_splash_jax import calibration, tpu_time

    results = dict(
        calibration={}, comparison=[], clock_factor=dict(tpu_time.CLOCK_FACTOR), row_stall_us=tpu_time.ROW_STALL * 1e6
    )
    for generation, direction in [("v5p", "forward")] if quick else CALIBRATIONS:
        saved = pathlib.Path(calibration_dir or "") / f"{generation}-{direction}.json"
        if calibration_dir and saved.is_file():
            entries = json.loads(saved.read_text())
        else:
            found = calibration.calibrate(generation, direction, limit=2 if quick else None)
            entries = [calibration.result_json(r) for r in found]
        results["calibration"][f"{generation}/{direction}"] = entries
    forward = {
        key.split("/")[0]: [(e["schedule_ms"] * 1e-3, e["hbm_ms"] * 1e-3, e["rows"], e["measured_ms"] * 1e-3)
                            for e in entries if e.get("schedule_ms") is not None]
        for key, entries in results["calibration"].items() if key.endswith("/forward")
    }  # fmt: skip
    stall, factors = calibration.fit(forward)
    results["fitted"] = dict(row_stall_us=stall * 1e6, clock_factor=factors)
    print(f"fitted: ROW_STALL = {stall:.3g}, CLOCK_FACTOR = {factors}", flush=True)
    for case in QUICK_COMPARISON if quick else COMPARISON:
        results["comparison"].append(_comparison_row(case))
        print(json.dumps(results["comparison"][-1]), flush=True)
    results["search"] = search(SEARCH[:1] if quick else SEARCH)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument(
        "--calibration-dir", help="take the calibration from `tpu_time calibrate --json` files G-DIRECTION.json here"
    )
    options = parser.parse_args()
    if options.worker:
        out = worker(options.quick, options.calibration_dir)
        pathlib.Path(options.worker).write_text(json.dumps(out))
        return
    from torch_splash_jax import tpu_time

    with tempfile.TemporaryDirectory(prefix="bench-tpu-time-") as directory:
        dumps = pathlib.Path(directory) / "dumps"
        dumps.mkdir()
        out = pathlib.Path(directory) / "results.json"
        env = tpu_time.environment(_libtpu_dir(), str(dumps))
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "benchmarks"), str(ROOT)])
        command = [sys.executable, __file__, "--worker", str(out)] + (["--quick"] if options.quick else [])
        if options.calibration_dir:
            command += ["--calibration-dir", str(pathlib.Path(options.calibration_dir).resolve())]
        subprocess.run(command, env=env, check=True)
        results = json.loads(out.read_text())
    results["libtpu"] = tpu_time.ESTIMATOR_LIBTPU
    report.save("tpu_time", results, options.quick, "./dev.sh bench-tpu-time")


if __name__ == "__main__":
    main()
