"""Context parallelism, all-gather vs ring: HBM per chip of a training step, from the TPU compiler.

The attention-block training step of bench_tpu_memory.py (B=1, 16 query heads, 8 kv heads,
head_dim 128, bf16, causal, balanced layout) with its sequence sharded over the chips of a slice,
once with `context_parallel="all_gather"` (k and v gathered whole on every chip) and once with
`"ring"` (k and v passed around the chips), compiled for that slice by libtpu without a TPU. Next to
them the same step on one chip (the compiler's figure, also when it does not fit), the 1/N
reference. The input activations are computed inside the step from their positions (so that a
10M-token step needs no 40 GiB host buffer); the compiler counts them as temporaries instead of
arguments.

    ./dev.sh bench-context-parallel            # 256K, 1M, 4M over v5e:2x2 and v5e:4x4 (and the longest
                                               # ring there); 10M over v5p:4x4x4
    ./dev.sh bench-context-parallel --slices v5e:4x4   # one slice again, the others' rows kept
    ./dev.sh bench-context-parallel --quick    # 32K over v5e:2x2, both strategies, and the ring at
                                               # 128K over v5e:4x4 (the test suite runs this)

Writes benchmarks/results/context_parallel.json (or context_parallel_quick.json); each slice's rows
are printed as they are measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import report  # benchmarks/report.py: results files and their tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
K, M = 1024, 1024 * 1024


def measure(slice_name: str, chips: int, steps: list[tuple[str, int]]) -> list[dict]:
    """Per-chip HBM of each (strategy, L) step over `chips` chips of `slice_name`, in a process of
    its own (torch_xla SPMD over as many CPU devices, libtpu loaded)."""
    from torch_splash_jax.tpu_time import aot

    env = aot.environment(os.environ.get("TORCH_SPLASH_LIBTPU_DIR", str(ROOT / ".venv" / "libtpu")))
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(chips))
    args = [sys.executable, __file__, "--worker", slice_name, str(chips), *(f"{s}:{n}" for s, n in steps)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=4 * 3600, cwd=ROOT)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode and len(rows) < len(steps):  # the measuring process died: say at which step
        last = (done.stderr.strip().splitlines() or [f"killed by signal {-done.returncode} (host memory?)"])[-1]
        strategy, length = steps[len(rows)]
        rows.append(dict(slice=slice_name, chips=chips, strategy=strategy, L=length, fits=False, error=last[:300]))
    return rows


def longer_rings(slice_name: str, chips: int, start: int, coarse: int = M, fine: int = 256 * K) -> list[dict]:
    """Ring rows at lengths past `start` (whose ring fits): up in `coarse` steps until one does not
    fit, then up in `fine` steps from the last that did, until one does not fit again. The longest
    ring that fits is the longest of these rows that does (or `start`)."""
    rows, length, step = [], start, coarse
    while True:
        row = measure(slice_name, chips, [("ring", length + step)])[0]
        print(json.dumps(row), flush=True)
        rows.append(row)
        if row["fits"]:
            length += step
        elif step == fine:
            return rows
        else:
            step = fine


def ring_overlap(scheduled: str, chips: int) -> dict:
    """From the compiled program's schedule: how many of the ring's collective permutes (those
    that pass a shard one device onwards) have a Mosaic kernel, or a conditional holding kernels,
    scheduled between their start and their done (asynchronous with that kernel), and in schedule
    order one mark per permute: "+" overlapping a kernel, "." not (the forward's k and v come first,
    then the backward's k, v, dk and dv)."""
    entry = scheduled[scheduled.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}\n")]
    ring = "source_target_pairs={" + ",".join(f"{{{i},{(i + 1) % chips}}}" for i in range(chips)) + "}"
    started, marks = {}, []
    for line in (line.strip() for line in entry.splitlines()[1:]):
        name = re.match(r"(?:ROOT )?%?([\w.\-]+) = ", line)
        if name is None:
            continue
        if " conditional(" in line or 'custom_call_target="tpu_custom_call"' in line:
            for start in started:
                started[start] = True
        if "collective-permute-start(" in line and ring in line:
            started[name.group(1)] = False
            marks.append(name.group(1))
        done = re.search(r"collective-permute-done\(%?([\w.\-]+)\)", line)
        if done and done.group(1) in started:
            marks[marks.index(done.group(1))] = "+" if started.pop(done.group(1)) else "."
    order = "".join(m if m in "+." else "?" for m in marks)
    return dict(ring_permutes=len(order), overlapping_a_kernel=order.count("+"), permute_order=order)


def _worker(slice_name: str, chips: int, steps: list[str]) -> None:
    from torch_splash.fit import planned_for_tpu

    with planned_for_tpu():  # plan and lower the kernels for TPU
        if chips > 1:
            import torch_xla.runtime as xr

            xr.use_spmd()
        import bench_tpu_memory

        for strategy, length in (step.split(":") for step in steps):
            start = time.perf_counter()
            row = bench_tpu_memory.measure(
                int(length),
                True,
                slice_name,
                chips,
                "balanced" if chips > 1 else None,
                context_parallel=None if chips == 1 else strategy,
                generated_input=True,
                schedule=functools.partial(ring_overlap, chips=chips) if strategy == "ring" else None,
            )
            seconds = round(time.perf_counter() - start, 1)
            print(
                json.dumps(
                    dict(slice=slice_name, chips=chips, strategy=strategy, L=int(length), seconds=seconds, **row)
                )
            )
            sys.stdout.flush()


def run(quick: bool, saved=lambda results: None, only: list[str] | None = None, keep: list | None = None) -> dict:
    """Every slice's rows (or those of the slices named in `only`, added to the rows `keep` holds
    for the others); `saved` gets the results so far after each slice (a full run took 11 minutes
    on 2 cores, most of it the 64-chip program, which unrolls one step per chip)."""
    if quick:  # and the ring over 16 chips at the same shard (8K tokens per chip)
        plans = [("v5e:2x2", 4, [("all_gather", 32 * K), ("ring", 32 * K)]), ("v5e:4x4", 16, [("ring", 128 * K)])]
    else:
        lengths = [256 * K, 1 * M, 4 * M]
        both = [(strategy, n) for n in lengths for strategy in ("all_gather", "ring")]
        plans = [
            ("v5e:4x4", 16, both),
            ("v5p:4x4x4", 64, [("ring", 10 * M)]),
            ("v5e:2x2", 4, both),
            ("v5e", 1, [("one_chip", n) for n in lengths]),
        ]
    from torch_splash_jax import mosaic

    results = dict(
        shape=dict(batch=1, heads=16, kv_heads=8, head_dim=128, dtype="bfloat16", mask="causal", layout="balanced"),
        libtpu=mosaic.PINNED_LIBTPU,
        rows=[row for row in keep or [] if row["slice"] not in (only or [])],
    )
    for slice_name, chips, steps in plans:
        if only and slice_name not in only:
            continue
        rows = measure(slice_name, chips, steps)
        for row in rows:
            print(json.dumps(row), flush=True)
        if slice_name == "v5e:4x4" and not quick:  # and the longest ring that fits there (the report finds it)
            rings = [row["L"] for row in rows if row["strategy"] == "ring" and row["fits"]]
            rows += longer_rings(slice_name, chips, max(rings)) if rings else []
        results["rows"] += rows
        saved(results)
    return results


def main():
    if sys.argv[1:2] == ["--worker"]:
        return _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (the test suite runs it)")
    parser.add_argument("--slices", nargs="+", help="measure these slices again, keeping the others' rows")
    args = parser.parse_args()
    command = "./dev.sh bench-context-parallel"
    kept = report.RESULTS / "context_parallel.json"
    keep = json.loads(kept.read_text())["rows"] if args.slices and kept.exists() else None
    run(args.quick, lambda results: report.save("context_parallel", results, args.quick, command), args.slices, keep)


if __name__ == "__main__":
    main()
