"""Estimated TPU device time of splash kernels, from the TPU compiler's own schedule, without a TPU.

An estimate, not a measurement. For each Mosaic kernel of a program compiled deviceless for a
generation, libtpu's final schedule (`schedule.py`) gives the bundles of every
conditional region of the grid loop, and the kernel's block tables say how many grid steps run
each (the first and last step of a row, full and partial blocks, skipped ones). A kernel's time is

    schedule (bundles / clock) x CLOCK_FACTOR + HBM (bytes read and written / bandwidth)
    + rows x ROW_STALL

The sum, not the larger of schedule and HBM: tokamax's measured times fit it (docs/benchmarks.md
shows both). The fitted numbers (calibration.py): one per generation, the clock
under load as a factor on the clock derived from the published peak; and one for all, a stall at
the end of each row of a kernel's grid, where the row's output is written back.

What it leaves out:
- what the schedule cannot show: a DMA or semaphore wait is one bundle whatever it waits for;
  the HBM term and the stall stand for those waits on average, not step by step;
- the clock, which no chip publishes: the bf16 peak over the MXU work one bundle issues at full
  occupancy (`Chip.clock`; a test reads that work from the schedule);
- on a chip of two cores (v5p), which core runs which step: the parallel units are split in halves;
- the XLA ops around the kernels (transposes, scaling): `Estimate.rest_seconds` is XLA's own
  estimate of them (`estimated_cycles`), not a schedule's.

The pieces: chips.py (the generations and the fitted numbers), work.py (grid steps and bytes from
block tables), schedule.py (libtpu's schedule read from its dumps), libtpu.py (a process that
dumps them), this module (the estimate), __main__.py (the command line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np

from ..errors import SplashConstraintError
from . import chips
from . import schedule as schedule_lib
from .chips import chip
from .libtpu import compile_schedules, environment, estimator_libtpu_dir, libtpu_release
from .schedule import Schedule, ScheduleError
from .work import Work, active_backward_work, active_work, tables_work

# A kernel whose code is longer than one instruction overlay reloads overlays from HBM at every
# grid step, which its schedule does not show. On the v5e (libtpu 0.0.42.1; B=1, 16K, bf16), kernels
# the compiler kept in one overlay ran at their estimate's pace (0.88x to 1.03x; up to 60.5K
# bundles: a D=256 forward with 2048-key blocks and 1024-row tiles), and every backward it split
# over overlays ran 1.53x to 1.86x as long (65.5K to 92.0K bundles), as had forwards of 80.5K to
# 113.3K (2.1x to 3.0x). The chip's libtpu compiled these kernels 4.7% shorter to 3.4% longer than
# the estimator's, so a kernel fits with 5% of the overlay to spare (docs/tpu_time.md,
# "Instruction overlays").
OVERLAY_SHARE = 0.95


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel call's estimate, in seconds."""

    name: str
    kind: str  # "forward", "dq" or "dkv"
    schedule_seconds: float  # the bundles its grid steps run, over the clock
    hbm_seconds: float  # the bytes it reads and writes, over the HBM bandwidth
    clock_factor: float  # CLOCK_FACTOR of the generation (1 where uncalibrated)
    stall_seconds: float  # rows x ROW_STALL
    bundles: int  # per core
    steps: int  # grid steps per core
    rows: int  # per core: rows along the reduction axis, each ending in an output write-back
    flops: float
    matmul_bundles: float  # per core: the MXU slots the steps use, in fully occupied bundles
    output_bytes: int  # its results, as the compiled program lays them out
    mxu_utilization: float  # flops over seconds x peak
    binding_unit: str  # the unit with the highest occupancy on the path the steps run
    program_bundles: int = 0  # the kernel's code (`Schedule.bundles`); 0: not read
    overlay_bundles: int = 0  # the generation's largest instruction overlay (`Chip.overlay_bundles`)

    @property
    def fits_overlay(self) -> bool:
        """Whether the kernel's code fits within OVERLAY_SHARE of one instruction overlay: where it
        does not, the estimate (a schedule's pace) does not hold."""
        return not self.overlay_bundles or self.program_bundles <= OVERLAY_SHARE * self.overlay_bundles

    @property
    def seconds(self) -> float:
        """The estimate: schedule x clock factor + HBM + stall."""
        return self.schedule_seconds * self.clock_factor + self.hbm_seconds + self.stall_seconds

    @property
    def uncorrected_seconds(self) -> float:
        """Without either fitted number: schedule + HBM."""
        return self.schedule_seconds + self.hbm_seconds


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A program's estimate: its kernels, and the rest of the program at XLA's own estimate."""

    generation: str
    kernels: tuple
    rest_seconds: float  # XLA's estimate of the other ops (their `estimated_cycles`), not a schedule's
    libtpu: str | None = None
    rest_hbm_seconds: float = 0.0  # the bytes the other ops read and write, over the HBM bandwidth

    @property
    def kernel_seconds(self) -> float:
        return sum(kernel.seconds for kernel in self.kernels)

    @property
    def seconds(self) -> float:
        return self.kernel_seconds + self.rest_seconds

    @property
    def mxu_utilization(self) -> float:
        """The kernels' useful flops over their time at the chip's peak."""
        seconds = self.kernel_seconds
        return sum(k.flops for k in self.kernels) / (seconds * chip(self.generation).peak_flops) if seconds else 0.0

    @property
    def binding_unit(self) -> str:
        return max(self.kernels, key=lambda kernel: kernel.seconds).binding_unit if self.kernels else "none"

    @property
    def outgrown(self) -> tuple:
        """The kernels whose code outgrows one instruction overlay (`KernelTime.fits_overlay`): their
        estimate does not hold."""
        return tuple(kernel for kernel in self.kernels if not kernel.fits_overlay)


def roles(schedule: Schedule) -> list[tuple[schedule_lib.Region, str, int]]:
    """[(region, role, bundles counted)] of the grid loop's conditional regions.

    role: "always" (every step), "first" / "last" (the first and last step along the reduction
    axis), "run" (a block not skipped), or "full" and "partial" when the kernel has one region for
    each, in that order (tokamax's kernels and the active kernels; JAX's have one run region), or
    "full" and "pattern0", "pattern1", ... when it has more (the active kernels' straight-line tile
    patterns, `Work.patterns` counts them). A region that wraps the block's whole work counts its
    own bundles on every step. A partial region whose own regions hold matmuls runs its blocks in
    tiles (the active kernels, a branch a tile): its children are "tile0", "tile1", ...
    (`Work.tiles` counts them). Other nested regions inside a leaf are counted as taken.
    """
    out = []

    def visit(regions: tuple) -> None:
        work = [region for region in regions if region.matmuls]
        if len(work) == 1 and any(child.matmuls for child in work[0].children):
            for region in regions:
                if region is work[0]:
                    out.append((region, "always", region.own_bundles))
                    visit(region.children)
                else:
                    out.append((region, "always", region.bundles))
            return
        if not work:
            raise ScheduleError(f"{schedule.name}: no region with MXU work in the grid loop")
        names = ["run"] if len(work) == 1 else ["full", "partial"] if len(work) == 2 else ["full"]
        names += [f"pattern{i}" for i in range(len(work) - len(names))]
        first, last = regions.index(work[0]), regions.index(work[-1])
        for index, region in enumerate(regions):
            if region.matmuls:
                role = names[work.index(region)]
                if role == "partial" and any(child.matmuls for child in region.children):
                    out.append((region, role, region.own_bundles))
                    out.extend((child, f"tile{i}", child.bundles) for i, child in enumerate(region.children))
                    continue
            else:
                role = "first" if index < first else "last" if index > last else "always"
            out.append((region, role, region.bundles))

    visit(schedule.regions)
    return out


def kernel_time(
    schedule: Schedule, work: Work, generation: str, output_bytes: int = 0, calibrated: bool = True
) -> KernelTime:
    """The estimated device time of one kernel call, with the fitted CLOCK_FACTOR and ROW_STALL
    (or, `calibrated=False`, without them)."""
    target = chip(generation)
    cores = 2 if schedule.megacore and target.cores == 2 else 1
    units = math.ceil(work.units / cores)  # per core
    if not schedule.grid_loop and units * work.steps != 1:
        raise ScheduleError(
            f"{schedule.name}: no grid loop (no backward branch), yet the call runs {units * work.steps} grid "
            "steps per core: a program without a loop is read as one step only"
        )
    counts = {
        "always": work.steps,
        "first": work.first,
        "last": work.last,
        "run": work.run,
        "full": work.full,
        "partial": work.partial,
        **{f"tile{i}": taken for i, taken in enumerate(work.tiles)},
        **{f"pattern{i}": taken for i, taken in enumerate(work.patterns)},
    }
    for kind, counted in (("tile", work.tiles), ("pattern", work.patterns if len(work.patterns) > 1 else ())):
        found = [role for _, role, _ in roles(schedule) if role.startswith(kind)]
        if len(found) != len(counted):
            raise ScheduleError(f"{schedule.name}: {len(found)} {kind} regions, and the work counts {len(counted)}")
    per_unit = work.steps * schedule.base_bundles
    used = np.zeros(len(schedule.unit_names))
    for region, role, bundles in roles(schedule):
        per_unit += counts[role] * bundles
        if schedule.unit_names:
            used += counts[role] * np.array(region.units if bundles == region.bundles else region.own_units, float)
    bundles = schedule.outside_loop + units * per_unit
    schedule_seconds = bundles / target.clock
    hbm_seconds = (work.read_bytes + output_bytes) / target.hbm_bandwidth
    factor = chips.CLOCK_FACTOR.get(generation, 1.0) if calibrated else 1.0
    stall_seconds = units * work.first * (chips.ROW_STALL if calibrated else 0.0)
    seconds = schedule_seconds * factor + hbm_seconds + stall_seconds
    return KernelTime(
        name=schedule.name,
        kind=work.kind,
        schedule_seconds=schedule_seconds,
        hbm_seconds=hbm_seconds,
        clock_factor=factor,
        stall_seconds=stall_seconds,
        bundles=int(bundles),
        steps=units * work.steps,
        rows=units * work.first,
        flops=work.flops,
        matmul_bundles=_matmul_bundles(schedule, used) * units,
        output_bytes=output_bytes,
        mxu_utilization=work.flops / (seconds * target.peak_flops) if seconds else 0.0,
        binding_unit=_busiest(schedule, used, work, per_unit),
        program_bundles=schedule.bundles,
        overlay_bundles=target.overlay_bundles,
    )


def _matmul_bundles(schedule: Schedule, used: np.ndarray) -> float:
    """One unit's MXU slot use on its regions' paths, in bundles at full MATMUL occupancy."""
    if schedule.mxu_unit is None:
        return 0.0
    index = schedule.unit(schedule.mxu_unit)
    return float(used[index]) / schedule.capacity[index]


def _busiest(schedule: Schedule, used: np.ndarray, work: Work, per_unit: int) -> str:
    if not schedule.unit_names:
        return "unknown"
    base = np.array(schedule.loop_units, dtype=np.float64)
    regions = sum((np.array(region.units, dtype=np.float64) for region in schedule.regions), np.zeros_like(base))
    total = used + (base - regions) * work.steps  # the unconditional part of the body
    occupancy = total / (np.array(schedule.capacity, dtype=np.float64) * max(per_unit, 1))
    names = {"MATMUL": "MXU", "MXU": "MXU", "VLOAD": "load", "LOAD": "load", "VSTORE": "store", "STORE": "store"}
    skip = {"MATPUSH", "VLOAD:FILL", "VSTORE:SPILL", "VPOP"}
    best = max((i for i, name in enumerate(schedule.unit_names) if name not in skip), key=lambda i: occupancy[i])
    return names.get(schedule.unit_names[best], schedule.unit_names[best])


def program_estimate(
    schedules: dict[str, Schedule], works: dict[str, Work], hlo_text: str, generation: str
) -> Estimate:
    """Each kernel's estimate with its work (`works`: {kernel kind: Work}, matched to the kernel
    names' fwd / dq / dkv), and the rest of the program at XLA's own estimate."""
    kernels = []
    for name, sched in sorted(schedules.items()):
        kind = kernel_kind(name)
        if kind not in works:
            raise ScheduleError(f"kernel {name}: no block tables given for a {kind} kernel")
        kernels.append(
            kernel_time(
                dataclasses.replace(sched, name=name), works[kind], generation, kernel_output_bytes(hlo_text, name)
            )
        )
    rest = schedule_lib.rest_cycles(hlo_text) / chip(generation).clock
    rest_hbm = schedule_lib.rest_bytes(hlo_text) / chip(generation).hbm_bandwidth
    return Estimate(generation, tuple(kernels), rest, libtpu_release(), rest_hbm)


def kernel_output_bytes(hlo_text: str, name: str) -> int:
    """The bytes of a kernel's results in the compiled HLO (a custom call named `name`)."""
    found = re.search(rf"\n\s*(?:ROOT )?%{re.escape(name)} = ([^\n]*?) custom-call\(", hlo_text)
    return 0 if found is None else schedule_lib.array_bytes(found[1])


def kernel_kind(name: str) -> str:
    """ "forward", "dq", "dkv" or "decode" from a kernel's name (splash_mha_fwd..., splash_mqa_dkv...,
    splash_decode)."""
    if re.search(r"(^|_)active_forward", name):  # the active-block forward (active_kernels)
        return "forward"
    if re.search(r"(^|_)active_backward", name):  # the active-block backward: dq, dk and dv in one
        return "dkv"
    found = re.search(r"splash_(?:m[hq]a_(fwd|dq|dkv)|(decode))", name)  # traced: jvp_vmap_splash_mha_fwd...
    if found is None:
        raise ScheduleError(f"kernel {name}: not a splash forward, dq, dkv or decode kernel")
    kind = found[1] or found[2]
    return {"fwd": "forward"}.get(kind, kind)


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _active_lists(active, shared_units: int, calls: int):
    """An active kernel's block lists as its program runs them, the units that run them, a stored
    mask's block index and the lists each unit walks: a shared list's units are the heads it serves
    in all (`shared_units`), one list each; with one list a query head, the units are the kernel's
    calls (`calls`: the batch, a call each), each walking every list (`Work.per_list` counts them
    as a unit a list, as a two-core chip splits them). A stored mask's lists are the rounded ones of
    its inputs."""
    if active.stored is None:
        return active.grid, shared_units, None, 1
    grid = active.stored[:4]
    lists = grid[0].shape[0]
    return grid, calls if lists > 1 else shared_units, active.stored[4], lists


def splash_works(program) -> dict[str, Work]:
    """The work of each kernel of a torch_splash Program (an unsharded plan for TPU)."""
    from .. import compat

    p = program.plan
    if program.kernel is None:
        raise SplashConstraintError(
            "kernel estimates cover unsharded programs with a kernel (no sequence or head sharding)"
        )
    blocks = p.block_sizes()
    fused = bool(blocks.get("use_fused_bwd_kernel"))
    infos = compat.kernel_mask_infos(program.kernel)
    ids = p.has_segment_ids
    common = dict(
        units=p.batch * p.num_q_heads, head_dim=p.head_dim, head_dim_v=p.head_dim_v, itemsize=_itemsize(p.dtype)
    )
    if program.active is not None:  # the active-block forward
        grid, units, index, lists = _active_lists(program.active, p.batch * p.num_q_heads, p.batch)
        works = {
            "forward": active_work(
                grid, program.active.blocks, **dict(common, units=units), has_segment_ids=ids, block_index=index
            ).per_list(lists)
        }
    else:
        works = {
            "forward": tables_work(
                infos["forward"].block_mask, "forward", block_q=blocks["block_q"], block_kv=blocks["block_kv"], **common
            )
        }
    if program.active_backward is not None:
        b = program.active_backward
        grid, units, index, lists = _active_lists(b, p.batch * p.num_kv_heads, p.batch)
        works["dkv"] = active_backward_work(
            grid,
            b.blocks,
            units=units,
            group=1 if lists > 1 else p.num_q_heads // p.num_kv_heads,
            block_index=index,
            head_dim=p.head_dim,
            head_dim_v=p.head_dim_v,
            itemsize=common["itemsize"],
            has_segment_ids=ids,
        ).per_list(lists)
        return works
    if infos.get("dq") is not None:
        works["dq"] = tables_work(
            infos["dq"].block_mask, "dq", block_q=blocks["block_q_dq"], block_kv=blocks["block_kv_dq"], **common
        )
    works["dkv"] = tables_work(
        infos["dkv"].block_mask,
        "dkv",
        block_q=blocks["block_q_dkv"],
        block_kv=blocks["block_kv_dkv"],
        fused=fused,
        **common,
    )
    return works


def splash_estimate(plan, generation: str, backward: bool = True) -> Estimate:
    """torch_splash's program for `plan` (planned for platform "tpu"), compiled for one device
    of `generation`: its forward kernel, and with `backward` the dq and dkv kernels of a training
    step (forward, then backward with d_out), with the XLA ops around them."""
    import jax
    import jax.numpy as jnp

    from .. import compat, mosaic, splash_program

    program = splash_program.Program(plan)
    dtype = jnp.dtype(plan.dtype)
    b, hq, hkv = plan.batch, plan.num_q_heads, plan.num_kv_heads
    args = [
        jax.ShapeDtypeStruct((b, hq, plan.q_len, plan.head_dim), dtype),
        jax.ShapeDtypeStruct((b, hkv, plan.kv_len, plan.head_dim), dtype),
        jax.ShapeDtypeStruct((b, hkv, plan.kv_len, plan.head_dim_v), dtype),
    ]
    if plan.has_segment_ids:
        args += [jax.ShapeDtypeStruct((b, plan.q_len), jnp.int32)] * 2
    if plan.has_sinks:
        args += [jax.ShapeDtypeStruct((hq,), jnp.float32)]
    args += [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in program.tables()]  # a stored-block mask's
    forward_arity = len(args)
    if backward:
        args.append(jax.ShapeDtypeStruct((b, hq, plan.q_len, plan.head_dim_v), dtype))

        def fn(*arrays):
            inputs, d_out = arrays[:forward_arity], arrays[forward_arity]
            out, lse = program.forward(*inputs)
            return out, program.backward(*inputs, out, lse, d_out)
    else:

        def fn(*arrays):
            return program.infer(*arrays)

    with compat.mosaic_ir_version(mosaic.ir_version()):
        schedules, hlo = compile_schedules(fn, tuple(args), generation)
    return program_estimate(schedules, splash_works(program), hlo, generation)


def estimate_json(estimate: Estimate) -> dict:
    """An Estimate as JSON (what `estimate` prints; `estimate_from_json` reads it back)."""
    return dict(
        generation=estimate.generation,
        libtpu=estimate.libtpu,
        rest_seconds=estimate.rest_seconds,
        rest_hbm_seconds=estimate.rest_hbm_seconds,
        kernels=[dataclasses.asdict(kernel) for kernel in estimate.kernels],
    )


def estimate_from_json(data: dict) -> Estimate:
    kernels = tuple(KernelTime(**kernel) for kernel in data["kernels"])
    return Estimate(data["generation"], kernels, data["rest_seconds"], data.get("libtpu"), data["rest_hbm_seconds"])


def estimate_in_subprocess(plan, generation: str, backward: bool = True, libtpu_dir: str | None = None) -> Estimate:
    """`splash_estimate` in a process of its own, started with libtpu's dump flags (they are read
    once, when libtpu loads, so the calling process keeps its own JAX state)."""
    import pickle

    chip(generation)
    with tempfile.TemporaryDirectory(prefix="torch-splash-schedules-") as directory:
        plan_file = pathlib.Path(directory) / "plan.pickle"
        try:
            plan_file.write_bytes(pickle.dumps(plan))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise SplashConstraintError(
                f"this plan's mask cannot be sent to the compiler's process ({error})"
            ) from None
        dumps = pathlib.Path(directory) / "dumps"
        dumps.mkdir()
        command = [
            sys.executable,
            "-m",
            "torch_splash_jax.tpu_time",
            "estimate",
            str(plan_file),
            "--generation",
            generation,
        ]
        env = environment(libtpu_dir or estimator_libtpu_dir(), str(dumps))
        root = str(pathlib.Path(__file__).resolve().parents[2])  # this torch_splash_jax, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
        done = subprocess.run(
            command + ([] if backward else ["--forward-only"]),
            env=env,
            capture_output=True,
            text=True,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ScheduleError(f"the estimate's compiler process failed ({done.returncode}):\n{tail}")
    data = json.loads(lines[-1])
    if "error" in data:
        raise ScheduleError(data["error"])
    return estimate_from_json(data)
