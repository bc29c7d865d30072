"""Estimated TPU device time of splash kernels, from the TPU compiler's own schedule, without a TPU.

An estimate, not a measurement. For each Mosaic kernel of a program compiled deviceless for a
generation, libtpu's final schedule (`torch_splash_jax.schedule`) gives the bundles of every
conditional region of the grid loop, and the kernel's block tables say how many grid steps run
each (the first and last step of a row, full and partial blocks, skipped ones). A kernel's time is

    schedule (bundles / clock) x CLOCK_FACTOR + HBM (bytes read and written / bandwidth)
    + rows x ROW_STALL

The sum, not the larger of schedule and HBM: tokamax's measured times fit it (docs/benchmarks.md
shows both). The fitted numbers (`torch_splash_jax.calibration`): one per generation, the clock
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

`python -m torch_splash_jax.tpu_time calibrate --generation G [--limit N]` estimates tokamax's
kernel at its measured entries (tokamax: the current set's `calibrate` extra);
`python -m torch_splash_jax.tpu_time estimate PLAN --generation G` one pickled Plan (torch_splash.fit).
"""

from __future__ import annotations

import argparse
import contextlib
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

from . import schedule as schedule_lib
from .errors import SplashConstraintError
from .schedule import Schedule, ScheduleError


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a TPU generation (Google Cloud's published figures, per device)."""

    name: str
    topology: str  # the smallest topology libtpu compiles for (one host)
    peak_flops: float  # bf16, per JAX device
    hbm_bandwidth: float  # bytes per second, per JAX device
    cores: int  # TensorCores behind one JAX device (a megacore chip runs one kernel on two)
    macs_per_bundle: int  # MXU multiply-adds one bundle issues at full MATMUL occupancy, per core

    @property
    def clock(self) -> float:
        """Bundles per second: the published peak over the MXU work of a fully occupied bundle."""
        return self.peak_flops / (2 * self.cores * self.macs_per_bundle)


# macs_per_bundle: four 128 x 128 MXUs on v5e and v5p; on v6e and v7x, two MATMUL slots whose
# fully occupied bundles carry 2**18 multiply-adds at head_dim 256 and half that at 128 (a contraction
# of 128 fills half of a 256 x 256 MXU). tests/test_tpu_time.py reads both from tokamax's MXU-bound
# forward (2048 x 2048 blocks): multiply-adds over the MATMUL slots its steps use.
CHIPS = {
    "v5e": Chip("v5e", "v5e:2x2", 197e12, 819e9, 1, 4 * 128 * 128),
    "v5p": Chip("v5p", "v5p:2x2x1", 459e12, 2765e9, 2, 4 * 128 * 128),
    "v6e": Chip("v6e", "v6e:2x2", 918e12, 1638e9, 1, 1 << 18),
    # two TensorCores per chip, each its own JAX device with half the chip's peak and bandwidth
    "v7x": Chip("v7x", "tpu7x:2x2x1", 2307e12 / 2, 7380e9 / 2, 1, 1 << 18),
}
# Fitted to tokamax's measured times (`./dev.sh bench-tpu-time`, docs/benchmarks.md), the only
# fitted numbers: per generation, the clock under load, as a factor on the schedule's time at the
# clock `Chip.clock` derives from the published peak (v5e: no measured attention entries, so 1);
# and one stall at the end of every row of a kernel's grid, where its output is written back, the
# same on every generation.
CLOCK_FACTOR = {"v5p": 1.0063, "v6e": 0.9993, "v7x": 1.1613}
ROW_STALL = 0.75e-6


def chip(generation: str) -> Chip:
    if generation not in CHIPS:
        raise SplashConstraintError(f"generation={generation!r}: expected one of {sorted(CHIPS)}.")
    return CHIPS[generation]


@dataclasses.dataclass(frozen=True)
class Work:
    """What one kernel call does, per parallel unit (the batch x heads a two-core chip splits).

    Grid steps per unit: `steps` in all; `first` and `last` along the reduction axis (kv for the
    forward and dq kernels, q for dkv); `full` and `partial` blocks (the rest are skipped).
    """

    kind: str  # "forward", "dq", "dkv"
    units: int
    steps: int
    first: int
    last: int
    full: int
    partial: int
    flops: float  # the useful MXU work of the whole call (blocks computed)
    read_bytes: float  # what the whole call reads from HBM (its writes are its outputs' bytes)

    @property
    def run(self) -> int:
        return self.full + self.partial


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


def roles(schedule: Schedule) -> list[tuple[schedule_lib.Region, str, int]]:
    """[(region, role, bundles counted)] of the grid loop's conditional regions.

    role: "always" (every step), "first" / "last" (the first and last step along the reduction
    axis), "run" (a block not skipped), or "full" and "partial" when the kernel has one region for
    each, in that order (tokamax's kernels; JAX's have one run region). A region that wraps the
    block's whole work counts its own bundles on every step. Nested regions inside a leaf are
    counted as taken.
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
        if not work or len(work) > 2:
            raise ScheduleError(
                f"{schedule.name}: {len(work)} regions with MXU work in the grid loop; the estimator reads "
                "kernels with one run region, or one for full and one for partial blocks"
            )
        names = ["run"] if len(work) == 1 else ["full", "partial"]
        first, last = regions.index(work[0]), regions.index(work[-1])
        for index, region in enumerate(regions):
            if region.matmuls:
                role = names[work.index(region)]
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
    counts = {
        "always": work.steps,
        "first": work.first,
        "last": work.last,
        "run": work.run,
        "full": work.full,
        "partial": work.partial,
    }
    per_unit = work.steps * schedule.base_bundles
    used = np.zeros(len(schedule.unit_names))
    for region, role, bundles in roles(schedule):
        per_unit += counts[role] * bundles
        if schedule.unit_names:
            used += counts[role] * np.array(region.units if bundles == region.bundles else region.own_units, float)
    bundles = schedule.outside_loop + units * per_unit
    schedule_seconds = bundles / target.clock
    hbm_seconds = (work.read_bytes + output_bytes) / target.hbm_bandwidth
    factor = CLOCK_FACTOR.get(generation, 1.0) if calibrated else 1.0
    stall_seconds = units * work.first * (ROW_STALL if calibrated else 0.0)
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


# ------------------------------------------------------------------------------------------------
# Work from block tables


def block_classes(mask_fn, q_len: int, kv_len: int, block_q: int, block_kv: int) -> np.ndarray:
    """(q blocks, kv blocks) int8: 0 skipped, 1 partial, 2 full, for a mask given as
    `mask_fn(q_positions, kv_positions) -> bool array` over a block's corners and edges.

    Exact for masks whose allowed set, along each row and each column, is one interval (causal,
    local windows, segment ids over sorted documents): a block is full when its edges are, and
    empty when its edges are and no interval can hide inside it."""
    nq, nk = q_len // block_q, kv_len // block_kv
    out = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        rows = np.arange(i * block_q, (i + 1) * block_q)
        for j in range(nk):
            cols = np.arange(j * block_kv, (j + 1) * block_kv)
            edges = np.concatenate(
                [
                    mask_fn(rows[:, None], cols[None, [0, -1]]).ravel(),
                    mask_fn(rows[[0, -1], None], cols[None, :]).ravel(),
                ]
            )
            out[i, j] = 2 if edges.all() else 1 if edges.any() else 0
    return out


def causal(offset: int = 0, window: int | None = None):
    """tokamax's causal_mask(offset, window_size): key k is seen by query q when
    k <= q + offset and, with a window, k > q + offset - window."""

    def allowed(q, k):
        seen = k <= q + offset
        return seen if window is None else seen & (k > q + offset - window)

    return allowed


def full_mask(q, k):
    return np.ones(np.broadcast_shapes(np.shape(q), np.shape(k)), bool)


def forward_work(
    classes: np.ndarray,
    *,
    units: int,
    block_q: int,
    block_kv: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    grid: str,
) -> Work:
    """The forward kernel's work over `classes` (q blocks, kv blocks), shared by the `units`.

    grid: "active" (tokamax: one step per non-skipped block) or "rows" (JAX's splash: every q row
    runs the same number of steps, the most non-skipped blocks of any row)."""
    run = classes > 0
    rows = int(run.any(axis=1).sum()) if grid == "active" else classes.shape[0]
    steps = int(run.sum()) if grid == "active" else classes.shape[0] * max(int(run.sum(axis=1).max()), 1)
    blocks = int(run.sum())
    flops = 2.0 * units * blocks * block_q * block_kv * (head_dim + head_dim_v)
    q_bytes = rows * block_q * head_dim * itemsize
    kv_bytes = blocks * block_kv * (head_dim + head_dim_v) * itemsize
    return Work(
        kind="forward",
        units=units,
        steps=steps,
        first=rows,
        last=rows,
        full=int((classes == 2).sum()),
        partial=int((classes == 1).sum()),
        flops=flops,
        read_bytes=float(units * (q_bytes + kv_bytes)),
    )


def dkv_work(
    classes: np.ndarray,
    *,
    units: int,
    block_q: int,
    block_kv: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    grid: str,
    fused: bool,
) -> Work:
    """The dkv kernel's work (dq too when `fused`): `classes` as for the forward (q blocks, kv
    blocks); the kernel walks q for each kv block."""
    transposed = np.ascontiguousarray(classes.T)
    run = transposed > 0
    cols = int(run.any(axis=1).sum()) if grid == "active" else transposed.shape[0]
    steps = int(run.sum()) if grid == "active" else transposed.shape[0] * max(int(run.sum(axis=1).max()), 1)
    blocks = int(run.sum())
    # s = q k^T, p v... : q k^T again, dp = do v^T, dv += p^T do, dk += ds^T q (+ dq = ds k)
    matmuls = 5 if fused else 4
    flops = 2.0 * units * blocks * block_q * block_kv * head_dim * matmuls
    kv_bytes = cols * block_kv * (head_dim + head_dim_v) * itemsize  # k, v
    per_block = block_q * (head_dim + head_dim_v) * itemsize + block_q * 4 * 2  # q, do; lse, di
    return Work(
        kind="dkv",
        units=units,
        steps=steps,
        first=cols,
        last=cols,
        full=int((transposed == 2).sum()),
        partial=int((transposed == 1).sum()),
        flops=flops,
        read_bytes=float(units * (kv_bytes + blocks * per_block)),
    )


# ------------------------------------------------------------------------------------------------
# Compiling with libtpu's schedule dumps

DUMP_FLAGS = (
    "--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles|utilization"
)
_IN_PROCESS = "TORCH_SPLASH_SCHEDULE_DUMPS"


def environment(libtpu_dir: str | None, dump_dir: str, base: dict | None = None) -> dict:
    """The environment of a process that compiles for TPU and dumps every schedule to `dump_dir`."""
    from . import aot

    env = aot.environment(libtpu_dir or "", base)
    library = _libtpu_library(libtpu_dir)
    if library is not None:
        env["TPU_LIBRARY_PATH"] = str(library)
    env["LIBTPU_INIT_ARGS"] = " ".join(
        p for p in (env.get("LIBTPU_INIT_ARGS", ""), DUMP_FLAGS.format(dir=dump_dir)) if p
    )
    env[_IN_PROCESS] = dump_dir
    return env


def _libtpu_library(libtpu_dir: str | None) -> pathlib.Path | None:
    if libtpu_dir:
        candidate = pathlib.Path(libtpu_dir) / "libtpu" / "libtpu.so"
        return candidate if candidate.is_file() else None
    from . import mosaic

    return mosaic.libtpu_path()


def libtpu_release() -> str | None:
    from . import compat, mosaic

    path = mosaic.libtpu_path()
    if path is None:
        return compat.installed("libtpu")
    for dist in pathlib.Path(path).parent.parent.glob("libtpu-*.dist-info"):
        return dist.name[len("libtpu-") : -len(".dist-info")]
    return compat.installed("libtpu")


def dump_dir() -> pathlib.Path:
    """This process's dump folder; SplashConstraintError unless it was started by `environment`."""
    value = os.environ.get(_IN_PROCESS)
    if not value:
        raise SplashConstraintError(
            "schedule estimates need a process started with torch_splash_jax.tpu_time.environment(...) "
            "(libtpu's dump flags are read once, when libtpu loads)."
        )
    return pathlib.Path(value)


@contextlib.contextmanager
def _new_files(directory: pathlib.Path):
    before = set(directory.iterdir()) if directory.exists() else set()
    new: list[pathlib.Path] = []
    yield new
    new.extend(sorted(set(directory.iterdir()) - before) if directory.exists() else [])


def compile_schedules(fn, args: tuple, generation: str) -> tuple[dict[str, Schedule], str]:
    """Compile `jax.jit(fn)` for one device of `generation` at `args` (ShapeDtypeStructs, placed
    there by this function) and read every Mosaic kernel's schedule: ({kernel name: Schedule},
    the compiled HLO text). ScheduleError when libtpu wrote no schedule."""
    import jax

    from . import aot

    chip(generation)
    device = aot.devices(chip(generation).topology)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), args)
    directory = dump_dir()
    # kernels that read the TPU's generation while traced (pltpu.get_tpu_info) see the target's
    with _new_files(directory) as files, jax.default_device(device):
        compiled = jax.jit(fn).trace(*placed).lower().compile()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="schedule-", dir=directory))
    for path in files:
        if path.is_file():
            path.rename(scratch / path.name)
    kernels = schedule_lib.find_kernels(scratch)
    hlo_text = compiled.as_text()
    if not kernels and "tpu_custom_call" in hlo_text:
        raise ScheduleError(
            f"libtpu {libtpu_release()} wrote no kernel schedule for {generation}: the estimator reads the dumps "
            f"of libtpu {ESTIMATOR_LIBTPU} (--xla_jf_dump_llo_text)."
        )
    schedules = {name: schedule_lib.read(*paths) for name, paths in kernels.items()}
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    return schedules, hlo_text


# The libtpu whose schedules the estimator reads and was calibrated with (the current set's).
ESTIMATOR_LIBTPU = "0.0.52"


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
    found = re.search(r"splash_(?:m[hq]a_(fwd|dq|dkv)|(decode))", name)  # traced: jvp_vmap_splash_mha_fwd...
    if found is None:
        raise ScheduleError(f"kernel {name}: not a splash forward, dq, dkv or decode kernel")
    kind = found[1] or found[2]
    return {"fwd": "forward"}.get(kind, kind)


def tables_work(
    block_mask,
    kind: str,
    *,
    units: int,
    block_q: int,
    block_kv: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    fused: bool = False,
) -> Work:
    """A JAX splash kernel's work from its own block table (MaskInfo.block_mask: (heads or 1,
    rows, grid width), 0 skipped, 1 partial, 2 full; rows are q blocks, kv blocks for dkv). Every
    row runs `grid width` steps."""
    table = np.asarray(block_mask)
    heads, rows, width = table.shape
    per_head = lambda x: int(round(x / heads))  # noqa: E731  (one unit's share of a per-head table)
    blocks = int((table > 0).sum())
    block_flops = 2.0 * block_q * block_kv * (head_dim + head_dim_v)
    if kind == "forward":
        flops, moved = block_flops, block_kv * (head_dim + head_dim_v) * itemsize
        row = block_q * head_dim * itemsize
    elif kind == "dq":  # q k^T, do v^T, ds k
        flops = 2.0 * block_q * block_kv * (2 * head_dim + head_dim_v)
        moved, row = (
            block_kv * (head_dim + head_dim_v) * itemsize,
            block_q * (head_dim + head_dim_v) * itemsize + block_q * 8,
        )
    else:  # dkv: q k^T, do v^T, dv, dk (+ dq)
        flops = 2.0 * block_q * block_kv * ((3 if fused else 2) * head_dim + 2 * head_dim_v)
        moved = block_q * (head_dim + head_dim_v) * itemsize + block_q * 8
        row = block_kv * (head_dim + head_dim_v) * itemsize
    return Work(
        kind=kind,
        units=units,
        steps=rows * width,
        first=rows,
        last=rows,
        full=per_head((table == 2).sum()),
        partial=per_head((table == 1).sum()),
        flops=units * per_head(blocks) * flops,
        read_bytes=float(units * (per_head(blocks) * moved + rows * row)),
    )


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def splash_works(program) -> dict[str, Work]:
    """The work of each kernel of a torch_splash Program (an unsharded plan for TPU)."""
    from . import compat

    p = program.plan
    if program.kernel is None:
        raise SplashConstraintError(
            "kernel estimates cover unsharded programs with a kernel (no sequence or head sharding)"
        )
    blocks = p.block_sizes()
    fused = bool(blocks.get("use_fused_bwd_kernel"))
    infos = compat.kernel_mask_infos(program.kernel)
    common = dict(
        units=p.batch * p.num_q_heads, head_dim=p.head_dim, head_dim_v=p.head_dim_v, itemsize=_itemsize(p.dtype)
    )
    works = {
        "forward": tables_work(
            infos["forward"].block_mask, "forward", block_q=blocks["block_q"], block_kv=blocks["block_kv"], **common
        )
    }
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

    from . import compat, kernels, mosaic

    program = kernels.Program(plan)
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


def _estimate(plan, generation: str, backward: bool) -> Estimate:
    """A splash plan's estimate, or a decode plan's (forward only, at its whole cache: the lengths
    a decode call runs at are data the plan does not hold)."""
    from .decode import DecodePlan

    if isinstance(plan, DecodePlan):
        from . import decode_time

        return decode_time.decode_estimate(decode_time.DecodeCall(plan), generation)
    return splash_estimate(plan, generation, backward=backward)


def _libtpu_dir() -> str | None:
    """The folder of the estimator's libtpu: $TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR, else
    $TORCH_SPLASH_LIBTPU_DIR, else None (the installed `libtpu` package, as in the current set)."""
    return os.environ.get("TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR") or os.environ.get("TORCH_SPLASH_LIBTPU_DIR") or None


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
        env = environment(libtpu_dir or _libtpu_dir(), str(dumps))
        root = str(pathlib.Path(__file__).resolve().parent.parent)  # this torch_splash_jax, installed or not
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


def calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The calibrate command's options (torch_splash_jax.calibration runs it)."""
    parser.add_argument("--generation", required=True, help="v5p, v6e or v7x (tokamax measured these)")
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward")
    parser.add_argument("--limit", type=int, default=None, help="at most N entries, spread over the cache")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_splash_jax.tpu_time",
        description="TPU kernel time estimated from the TPU compiler's schedule, calibrated against tokamax's times.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    calibrate_arguments(commands.add_parser("calibrate", help="estimate tokamax's kernel at its measured entries"))
    one = commands.add_parser(
        "estimate", help="estimate one pickled torch_splash_jax Plan or DecodePlan (torch_splash.fit runs it)"
    )
    one.add_argument("plan")
    one.add_argument("--generation", required=True, help=f"one of {sorted(CHIPS)}")
    one.add_argument("--forward-only", action="store_true")
    options = parser.parse_args(argv)
    chip(options.generation)
    argv = sys.argv[1:] if argv is None else argv
    # calibrate runs calibration's own entry point (calibration builds on this module)
    command = ["torch_splash_jax.calibration", *argv[1:]] if options.command == "calibrate" else None
    if not os.environ.get(_IN_PROCESS):
        with tempfile.TemporaryDirectory(prefix="torch-splash-schedules-") as directory:
            env = environment(_libtpu_dir(), directory)
            return subprocess.call([sys.executable, "-m", *(command or ["torch_splash_jax.tpu_time", *argv])], env=env)
    if command:
        return subprocess.call([sys.executable, "-m", *command])
    if options.command == "estimate":
        import pickle

        plan = pickle.loads(pathlib.Path(options.plan).read_bytes())
        try:
            result = estimate_json(_estimate(plan, options.generation, backward=not options.forward_only))
        except (SplashConstraintError, ScheduleError) as error:
            result = dict(error=str(error))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
