"""The active-block kernels against the plan's JAX splash kernels, per TPU generation, estimated from
the TPU compiler's schedule (libtpu 0.0.52, deviceless): the training calls of `tpu_check`'s table
(B=1 at 16K and 32K tokens, batches of 4 and 8 at 1K to 4K) on v5e, v5p, v6e and v7x, each a
training step's program (forward, then backward) of the plan, and of the plan with
`BlockSizes(forward_kernel="active")` (the active forward and backward), each planned for the
generation (`Plan.generation`); on every generation also the active kernels scheduled by the TPU
compiler's other scheduler ("other scheduler", `Plan.scheduler`: its default or LP, of which
`block_planning.LP_SCHEDULER` chooses) and with the forward's logits laid out the other way ("other
logits", `Plan.forward_logits`: by rows or transposed, transposed with its rows summed on the vector
unit; of which `block_planning.TRANSPOSED_LOGITS` chooses), on v6e and v7x with their forward's rows
summed the other way ("other sums", `Plan.row_sums`: in the MXU or on the vector unit, of which
`block_planning.SUMS_ON_MXU` chooses), and at head_dim above 128 with the other longest key block
("other key blocks", `Plan.active_block_kv`: 1024 or 2048, of which
`block_planning.WIDE_HEADS_BLOCK_KV` chooses), and with the forward's other longest q block ("other
q blocks", `Plan.active_block_q`: 2048 or 4096, of which `block_planning.LONG_BLOCK_Q` chooses;
where the forward's blocks differ: a mask read from stored blocks keeps blocks of 1024, and longer
blocks whose partial blocks would need a branch a tile fall back to 2048). A choice must keep every
kernel's code in one instruction overlay (`tpu_time.KernelTime.fits_overlay`). Every figure is an
estimate (torch_splash_jax.tpu_time says what it leaves out); on v5e the same calls were also
measured (docs/benchmarks.md, "The real chip"), which gives the estimate's error for both. For
segment ids the estimate counts the host's block kinds, an upper bound on the full blocks the
kernels find on the device.

    ./dev.sh bench-active-kernels            # 13 calls, 4 generations, 4 to 7 programs: about 40 minutes on 2 cores
    ./dev.sh bench-active-kernels --quick    # one call on v6e

Writes benchmarks/results/active_kernels.json (or active_kernels_quick.json). Runs in the current set
(libtpu 0.0.52 knows v7x).
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import sys

import report  # benchmarks/report.py: results files and their tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GENERATIONS = ("v5e", "v5p", "v6e", "v7x")
QUICK_GENERATIONS = ("v6e",)
QUICK_CALLS = ("B=4 causal 1K 16/16 D128",)


def _libtpu_dir() -> str:
    import sysconfig

    return os.environ.get("TORCH_SPLASH_LIBTPU_DIR") or sysconfig.get_paths()["purelib"]


def _calls(quick: bool) -> list:
    from torch_splash_jax.tpu_check.cases import TRAINING

    calls = list(TRAINING)
    return [c for c in calls if c.name in QUICK_CALLS] if quick else calls


def _kernels(kernels, generation: str) -> dict:
    from torch_splash_jax.tpu_time import chip

    seconds = sum(k.seconds for k in kernels)
    return dict(
        seconds=seconds,
        schedule=sum(k.schedule_seconds for k in kernels),
        hbm=sum(k.hbm_seconds for k in kernels),
        mxu=sum(k.flops for k in kernels) / seconds / chip(generation).peak_flops if seconds else 0.0,
        binding_unit=max(kernels, key=lambda k: k.seconds).binding_unit,
        flops=sum(k.flops for k in kernels),
        fits_overlay=all(k.fits_overlay for k in kernels),
        program_bundles=max(k.program_bundles for k in kernels),
    )


VARIANTS = ("plan", "active", "other scheduler", "other sums", "other key blocks", "other logits", "other q blocks")
OTHER_BLOCK_KV = {1024: 2048, 2048: 1024}  # at head_dim above 128 (`block_planning.active_block_kv`)


def _variants(generation: str, call) -> tuple:
    import dataclasses

    from torch_splash_jax.block_planning import LANES, mxu_columns_left_idle
    from torch_splash_jax.plan import with_kernels
    from torch_splash_jax.tpu_check.chip import other_q_blocks

    sums = mxu_columns_left_idle(generation, call.dv)
    wide = max(call.head_dim, call.dv) > LANES
    plan = dataclasses.replace(call, generation=generation).plan("tpu")
    long = other_q_blocks(with_kernels(plan, "active")) is not None  # where the forward's blocks differ
    return (
        VARIANTS[:3]
        + ("other sums",) * sums
        + ("other key blocks",) * wide
        + ("other logits",)
        + ("other q blocks",) * long
    )


def _estimate(call, generation: str, variant: str) -> dict:
    """The step's forward kernel and backward kernels, estimated, of the call's plan for
    `generation`, of that plan with the active-block kernels, or of those with one choice made the
    other way (the variants of the module's docstring)."""
    import dataclasses

    from torch_splash_jax import tpu_time
    from torch_splash_jax.block_planning import OTHER_BLOCK_Q, OTHER_LOGITS, OTHER_SCHEDULER
    from torch_splash_jax.plan import with_forward_logits, with_kernels

    plan = dataclasses.replace(call, generation=generation).plan("tpu")
    if variant != "plan":
        plan = with_kernels(plan, "active")
    if variant == "other sums":
        plan = dataclasses.replace(plan, row_sums="vector" if plan.row_sums == "mxu" else "mxu")
    if variant == "other scheduler":
        plan = dataclasses.replace(plan, scheduler=OTHER_SCHEDULER[plan.scheduler])
    if variant == "other key blocks":
        plan = dataclasses.replace(plan, active_block_kv=OTHER_BLOCK_KV[plan.active_block_kv])
    if variant == "other logits":
        plan = with_forward_logits(plan, OTHER_LOGITS[plan.forward_logits])
    if variant == "other q blocks":
        plan = dataclasses.replace(plan, active_block_q=OTHER_BLOCK_Q[plan.active_block_q])
    try:
        estimate = tpu_time.estimate_in_subprocess(plan, generation, backward=True, libtpu_dir=_libtpu_dir())
    except Exception as error:  # noqa: BLE001  (a refusal is a result: the row says it)
        return dict(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300])
    forward = [k for k in estimate.kernels if k.kind == "forward"]
    backward = [k for k in estimate.kernels if k.kind != "forward"]
    choices = {}
    if variant != "plan":
        choices = dict(
            row_sums=plan.row_sums,
            forward_logits=plan.forward_logits,
            scheduler=plan.scheduler,
            active_block_kv=plan.active_block_kv,
            active_block_q=plan.active_block_q,
        )
    return dict(forward=_kernels(forward, generation), backward=_kernels(backward, generation), **choices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    options = parser.parse_args()
    generations = QUICK_GENERATIONS if options.quick else GENERATIONS
    jobs = [(call, g, v) for call in _calls(options.quick) for g in generations for v in _variants(g, call)]
    with concurrent.futures.ThreadPoolExecutor(options.workers) as pool:
        found = list(pool.map(lambda job: _estimate(*job), jobs))
    rows = {}
    for (call, generation, variant), result in zip(jobs, found):
        row = rows.setdefault((call.name, generation), dict(name=call.name, generation=generation))
        row[variant] = result
        print(json.dumps(dict(name=call.name, generation=generation, variant=variant, **result)), flush=True)
    from torch_splash_jax import tpu_time

    results = dict(rows=list(rows.values()), libtpu=tpu_time.ESTIMATOR_LIBTPU)
    report.save("active_kernels", results, options.quick, "./dev.sh bench-active-kernels")


if __name__ == "__main__":
    main()
