"""`python -m torch_splash_jax.tpu_check`: torch_splash's JAX side checked on the TPU this runs on.

    python -m torch_splash_jax.tpu_check [--quick] [--shape B,Hq,Hkv,Lq,Lkv,D --mask M --dtype T [--only]]
        [--parts limits,fidelity,timing,ring,estimates,bridge] [--out FILE] [--workers N] [--generation G]

Three processes, so that none holds the chip while another needs it: this one plans and writes the
results; `chip` (a child) holds the chip and measures; the estimates (`torch_splash_jax.tpu_time`,
children of their own) compile deviceless for the chip's generation while it measures; and where
torch_xla or TorchTPU is installed, `torch_splash._bridge_check` (a child, after the chip is free)
runs the fidelity cases through `torch_splash.attention`, the whole bridge.

Results: benchmarks/results/tpu_check_<generation>.json (`--quick`: a smoke run at small sizes,
`tpu_check_<platform>_quick.json`); `./dev.sh bench-report` writes docs/benchmarks.md's real-chip
section from it. Exit status 1 when a fidelity case fails or the chip's process fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

from . import cases as cases_lib
from .cases import Call

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARTS = ("limits", "fidelity", "timing", "ring", "estimates", "bridge")
CHIP_PARTS = ("limits", "fidelity", "timing", "ring")  # what the chip's own process measures


def _calls(options) -> tuple[list[Call], list[Call]]:
    fidelity = list(cases_lib.FIDELITY)
    timing = list(cases_lib.TRAINING + cases_lib.DECODE)
    if options.quick:  # the CPU's smoke run: a few features, rows shrunk
        fidelity = [c.scaled(8) for c in fidelity if c.name in QUICK_FIDELITY]
        timing = [c.scaled(64) for c in timing if c.name in QUICK_TIMING]
    if options.shape:
        user = cases_lib.parse_call(options.shape, options.mask, options.dtype)
        if options.only:
            fidelity, timing = [], []
        fidelity.append(user)
        timing.append(user)
    return fidelity, timing


# --quick: the batch as heads, a call per batch element (segment ids), and the decode kernel
QUICK_FIDELITY = {"gqa", "batch-4-loop-ids-window", "decode"}
QUICK_TIMING = {"B=4 causal 4K 16/16 D128", "decode B=8 4K 32/8 D128"}


def encode_calls(calls: list[Call]) -> str:
    return json.dumps([dataclasses.asdict(c) for c in calls])


def decode_calls(text: str) -> list[Call]:
    return [Call(**dict(c, blocks=tuple(tuple(pair) for pair in c["blocks"]))) for c in json.loads(text)]


def _chip_process(options, fidelity, timing) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch_splash_jax.tpu_check", "--chip-phase", "--workers", str(options.workers)]
    command += ["--parts", ",".join(options.parts)] + (["--quick"] if options.quick else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env["TORCH_SPLASH_TPU_CHECK_CALLS"] = json.dumps([encode_calls(fidelity), encode_calls(timing)])
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def _estimates(timing: list[Call], generation: str, workers: int) -> dict:
    """{row name: {"generation", "libtpu", and per program estimated, its Estimate as JSON}} by the
    estimator (`torch_splash_jax.tpu_time`), each in a deviceless compiler process of its own,
    `workers` at a time: a training row's step ("step": its forward and backward kernels and the
    XLA ops around them), a decode row's decode program ("decode") and splash forward ("splash")."""
    import dataclasses as dc

    from ..kernel_limits import GENERATIONS
    from ..tpu_time import estimate_in_subprocess, estimate_json

    jobs = {}
    for call in timing:
        call = dc.replace(call, generation=generation if generation in GENERATIONS else None)
        if call.kernel == "decode":
            jobs[(call.name, "decode")] = (call.plan("tpu"), False)
            jobs[(call.name, "splash")] = (dc.replace(call, kernel="splash").plan("tpu"), False)
        else:
            jobs[(call.name, "step")] = (call.plan("tpu"), True)
    found: dict = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {
            pool.submit(estimate_in_subprocess, plan, generation, backward): key
            for key, (plan, backward) in jobs.items()
        }
        for future in concurrent.futures.as_completed(futures):
            name, job = futures[future]
            row = found.setdefault(name, dict(generation=generation))
            try:
                estimate = future.result()
            except Exception as error:
                row[job] = dict(error=f"{type(error).__name__}: {str(error).strip()[:300]}")
                continue
            row["libtpu"] = estimate.libtpu
            row[job] = estimate_json(estimate)
    return found


def estimated_ms(row_estimate: dict, job: str, kind: str | None = None) -> float | None:
    """An estimate's milliseconds: of its kernels of `kind` ("forward", ...) alone, or (None) of
    the whole program, kernels and the XLA ops around them at XLA's own estimate."""
    from ..tpu_time import estimate_from_json

    data = row_estimate.get(job)
    if not data or "error" in data:
        return None
    estimate = estimate_from_json(data)
    if kind is None:
        return 1e3 * estimate.seconds
    return 1e3 * sum(k.seconds for k in estimate.kernels if k.kind == kind)


def _bridge(fidelity: list[Call]) -> list[dict] | str:
    """The fidelity cases through torch_splash.attention, in a process of its own (torch side); or
    why it could not run them (TorchTPU without a TPU)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env["TORCH_SPLASH_TPU_CHECK_CALLS"] = encode_calls(fidelity)
    done = subprocess.run([sys.executable, "-m", "torch_splash._bridge_check"], env=env, capture_output=True, text=True)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bridge')]
    skipped = [line["bridge_skipped"] for line in lines if "bridge_skipped" in line]
    if skipped:
        return skipped[0]
    rows = [line["bridge"] for line in lines if "bridge" in line]
    if done.returncode and not rows:
        rows = [dict(error=f"the bridge's process failed ({done.returncode}): {done.stderr.strip()[-600:]}")]
    return rows


def _bridge_available() -> str | None:
    for name in ("torch_xla", "torch_tpu"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_splash_jax.tpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run at small sizes (the CPU's, in the tests)")
    parser.add_argument("--shape", help="your call: B,Hq,Hkv,Lq,Lkv,D (or B,Hq,Hkv,L,D)")
    parser.add_argument("--mask", default="causal", help="causal, full, window:W, chunked:C or a mask expression")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--only", action="store_true", help="with --shape: your call alone, not the check's own")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--out", help="results file (default benchmarks/results/tpu_check_<generation>.json)")
    parser.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 2)))
    parser.add_argument(
        "--generation", help="with --parts estimates alone: the chip generation whose results file to add them to"
    )
    parser.add_argument("--chip-phase", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.parts = [p for p in options.parts.split(",") if p]
    unknown = sorted(set(options.parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; expected a subset of {list(PARTS)}")
    if options.chip_phase:
        from . import chip

        fidelity, timing = (decode_calls(t) for t in json.loads(os.environ["TORCH_SPLASH_TPU_CHECK_CALLS"]))
        return chip.run(options.parts, fidelity, timing, options.quick, options.workers)
    return _orchestrate(options)


def _orchestrate(options) -> int:
    from ..errors import SplashError

    try:
        fidelity, timing = _calls(options)
    except SplashError as error:
        print(f"tpu_check: {error}", file=sys.stderr)
        return 2
    on_chip = [p for p in options.parts if p in CHIP_PARTS]
    path = _results_path(options)
    if not on_chip:  # estimates (or the bridge) for a chip measured before: its results file
        if path is None or not path.is_file():
            print("tpu_check: without limits, fidelity or timing, give --generation G (or --out FILE) of a "
                  "results file a run on the chip wrote", file=sys.stderr)  # fmt: skip
            return 2
        results = json.loads(path.read_text())
    else:
        results = dict(
            command="python -m torch_splash_jax.tpu_check " + " ".join(sys.argv[1:]),
            date=datetime.date.today().isoformat(),
            tolerance=cases_lib.TOLERANCE,
            fidelity=[],
            timing=[],
            ring=[],
        )
    status = 0
    estimates = None
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        if on_chip:
            chip = _chip_process(options, fidelity, timing)
            for line in chip.stdout:
                if not line.startswith("{"):
                    continue
                ((kind, value),) = json.loads(line).items()
                if kind == "chip":
                    results["chip"] = value
                    if "estimates" in options.parts and value.get("generation") and timing:
                        # half the workers: the chip's process keeps cores of its own to dispatch from
                        workers = max(1, options.workers // 2)
                        estimates = background.submit(_estimates, timing, value["generation"], workers)
                elif kind == "limits":
                    results["limits"] = value
                else:
                    results[kind].append(value)
                _progress(kind, value)
                path = _write(results, options)  # as it goes: a run cut short keeps what it measured
            status = chip.wait()
        elif "estimates" in options.parts:
            generation = options.generation or results.get("chip", {}).get("generation")
            names = {row["name"] for row in results.get("timing", [])}
            estimates = background.submit(
                _estimates, [c for c in timing if c.name in names], generation, options.workers
            )
        if estimates is not None:
            found = estimates.result()
            for row in results["timing"]:
                if row["name"] not in found:
                    continue
                mine = found[row["name"]]
                # one estimate per libtpu that made one (the chip host's, the estimator's own)
                kept = [e for e in row.get("estimates", []) if e.get("libtpu") != mine.get("libtpu")]
                row["estimates"] = kept + [mine]
                _progress("estimate", dict(name=row["name"], **mine))
    if "bridge" in options.parts and _bridge_available():
        bridge = _bridge(fidelity)
        if isinstance(bridge, str):
            results["bridge_skipped"] = bridge
        else:
            results["bridge"] = bridge
            for row in bridge:
                _progress("bridge", row)
    elif "bridge" in options.parts:
        results["bridge_skipped"] = "neither torch_xla nor TorchTPU is installed here"
    _write(results, options)
    failed = [row["name"] for row in results["fidelity"] + results.get("bridge", []) if not row.get("passed")]
    failed += [f"ring ({row['kernels']})" for row in results.get("ring", []) if not row.get("passed")]
    if failed:
        print(f"tpu_check: fidelity failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if status or failed or "chip" not in results else 0


def _progress(kind: str, value: dict) -> None:
    if kind == "fidelity":
        errors = value.get("errors") or {}
        worst = max(errors.values(), default=float("nan"))
        state = "ok" if value.get("passed") else "FAILED"
        print(f"fidelity {value['name']:<28} {state:<6} worst {worst:.2e} {value.get('error', '')}", flush=True)
    elif kind == "timing":
        parts = []
        for name, measured in value.get("variants", {}).items():
            times = "/".join(f"{measured[k]:.3f}" for k in ("forward_ms", "step_ms") if k in measured)
            parts.append(f"{name}: {times or measured.get('error', '')[:60]}")
        print(f"timing {value['name']}: " + "; ".join(parts), flush=True)
    elif kind == "ring":
        worst = max((value.get("errors") or {}).values(), default=float("nan"))
        state = "ok" if value.get("passed") else "FAILED"
        print(
            f"ring {value['kernels']:<7} {state:<6} worst {worst:.2e}, device 0's steps {value['device0_ms']} ms",
            flush=True,
        )
    elif kind == "estimate":
        fields = {
            "forward kernel": estimated_ms(value, "step", "forward"),
            "step": estimated_ms(value, "step"),
            "decode": estimated_ms(value, "decode"),
            "splash forward": estimated_ms(value, "splash"),
        }
        shown = ", ".join(f"{k} {v:.3f}" for k, v in fields.items() if v is not None)
        errors = [
            f"{job}: {value[job]['error']}" for job in ("step", "decode", "splash") if "error" in value.get(job, {})
        ]
        print(f"estimate {value['name']} (libtpu {value.get('libtpu')}): {shown} {' '.join(errors)}", flush=True)
    elif kind == "bridge":
        worst = max((value.get("errors") or {}).values(), default=float("nan"))
        state = "ok" if value.get("passed") else "FAILED"
        print(f"bridge {value.get('name', '')}: {state} worst {worst:.2e} {value.get('error', '')}", flush=True)
    else:
        print(f"{kind}: {json.dumps(value)}", flush=True)


def _results_path(options, results: dict | None = None) -> pathlib.Path | None:
    if options.out:
        return pathlib.Path(options.out)
    chip = (results or {}).get("chip", {})
    name = chip.get("generation") or chip.get("platform") or options.generation
    if name is None:
        return None
    return ROOT / "benchmarks" / "results" / f"tpu_check_{name}{'_quick' if options.quick else ''}.json"


def _write(results: dict, options) -> pathlib.Path:
    chip = results.get("chip")
    if chip:  # what docs/benchmarks.md names a run by (benchmarks/report.py)
        results["machine"] = f"one {chip['device_kind']} chip" + (
            f" ({chip['generation']})" if chip["generation"] else ""
        )
        # the chip's process's Python (an estimates-only run adds to a file another machine wrote)
        python = chip.get("python") or results.get("stack", "").partition(",")[0].removeprefix("Python ")
        results["stack"] = f"Python {python or sys.version.split()[0]}, jax {chip['jax']}, libtpu {chip['libtpu']}"
    path = _results_path(options, results) or ROOT / "benchmarks" / "results" / "tpu_check_unknown.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
