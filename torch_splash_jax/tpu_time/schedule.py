"""The TPU compiler's final schedule of a Mosaic kernel, read from libtpu's dump files.

With `--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true` a deviceless compile writes, for every
Mosaic kernel and XLA fusion, the final VLIW program (`...-final_bundles.txt`, one bundle a line)
and each bundle's use of every unit (`...final_hlo-static-per-bundle-utilization.txt`). One
bundle issues per cycle: a bundle count is a cycle count, except where the program waits on a DMA
or a semaphore, which the schedule shows as one bundle whatever the wait.

A kernel's program is a prologue, the grid loop (one iteration per grid step, ended by a backward
branch) and an epilogue. Inside the loop, each `pl.when` becomes a forward branch over a region:
the step runs the region's bundles only when its condition holds. `Schedule.regions` lists those
regions in program order with their bundles and unit use; which steps run which region is the
caller's knowledge of the kernel (`torch_splash_jax.tpu_time`).

Also a compiled program's other ops: XLA's own estimate of them (`rest_cycles`: their
`estimated_cycles`) and the HBM bytes they move (`rest_bytes`).
Pure Python and NumPy: nothing here needs JAX or libtpu.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import numpy as np

from ..errors import SplashConstraintError


class ScheduleError(SplashConstraintError):
    """A dump the estimator cannot read: no schedule written, or a kernel of an unknown shape."""


_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:?\s*>?\s*\{(.*)$")
# libtpu 0.0.52 names the target region ("target = $region12"), 0.0.21 its bundle ("target bundleno = 268")
_BRANCH = re.compile(r"sbr\.rel\s*\(([^)]*)\)\s*target (?:= \$region(\d+)|bundleno = (\d+))")
_REGION_START = re.compile(r"Start (?:/End empty )?region (\d+)|Start/End empty region (\d+)")
_MATMUL = re.compile(r"\bvmatmul\.")


@dataclasses.dataclass(frozen=True)
class Region:
    """Bundles [start, end) of the program, skipped when the branch at start - 1 is taken."""

    start: int
    end: int
    units: tuple  # slots used per unit, summed over the region's bundles (Schedule.unit_names)
    matmuls: int  # vmatmul instructions in the region
    children: tuple = ()

    @property
    def bundles(self) -> int:
        return self.end - self.start

    @property
    def own_bundles(self) -> int:
        return self.bundles - sum(child.bundles for child in self.children)

    @property
    def own_units(self) -> tuple:
        return tuple(total - sum(child.units[i] for child in self.children) for i, total in enumerate(self.units))

    @property
    def own_matmuls(self) -> int:
        return self.matmuls - sum(child.matmuls for child in self.children)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One Mosaic kernel's final schedule."""

    name: str
    bundles: int  # in the whole program
    loop_start: int  # the grid loop's first and one-past-last bundle
    loop_end: int
    regions: tuple  # the loop body's top-level conditional regions, in program order
    unit_names: tuple
    capacity: tuple  # slots of each unit per bundle
    loop_units: tuple  # slots used per unit, summed over the loop body
    megacore: bool  # the kernel reads its core id: its grid is split over a chip's two cores
    grid_loop: bool = True  # False: no loop, the program is one grid step (see `kernel_time`)

    # the MXU's unit: "MATMUL" in libtpu 0.0.52's utilization dumps, "MXU" in 0.0.21's
    @property
    def mxu_unit(self) -> str | None:
        return next((name for name in ("MATMUL", "MXU") if name in self.unit_names), None)

    @property
    def loop_bundles(self) -> int:
        return self.loop_end - self.loop_start

    @property
    def outside_loop(self) -> int:
        return self.bundles - self.loop_bundles

    @property
    def base_bundles(self) -> int:
        """Bundles of the loop body that every grid step runs."""
        return self.loop_bundles - sum(region.bundles for region in self.regions)

    def unit(self, name: str) -> int:
        return self.unit_names.index(name)


_KERNEL_OP = re.compile(r"\(100\.00%\): %(\S+) = [^\n]*custom_call_target=\"tpu_custom_call\"")


def find_kernels(dump_dir: str | pathlib.Path) -> dict[str, tuple[pathlib.Path, pathlib.Path | None]]:
    """{kernel name: (final bundles file, utilization file or None)} for the Mosaic kernels in a dump.

    Files are named `<program id>-<name, cut to fit>-...-<pass>.txt`; the id groups one program's
    files, and the kernel's own name is read from its schedule analysis (a kernel's program is all
    one custom call; the top-level program merely calls it)."""
    dump = pathlib.Path(dump_dir)
    found = {}
    for analysis in sorted(dump.glob("*-schedule-analysis_final_bundles.txt")):
        kernel = _KERNEL_OP.search(analysis.read_text(errors="replace"))
        if kernel is None:
            continue
        program = analysis.name.split("-", 1)[0]
        bundles = [p for p in dump.glob(f"{program}-*final_bundles.txt") if "schedule-analysis" not in p.name]
        utilization = sorted(dump.glob(f"{program}-*final_hlo-static-per-bundle-utilization.txt"))
        if bundles:
            found[kernel[1]] = (bundles[0], utilization[0] if utilization else None)
    return found


def read(bundles_path: str | pathlib.Path, utilization_path: str | pathlib.Path | None = None) -> Schedule:
    """The schedule in a `...-final_bundles.txt` file (and its per-bundle utilization, if given)."""
    path = pathlib.Path(bundles_path)
    numbers, texts = [], []
    for line in path.read_text(errors="replace").splitlines():
        match = _BUNDLE.match(line)
        if match:
            numbers.append(int(match[1], 16) if match[1].startswith("0x") else int(match[1]))
            texts.append(match[3])
    if not numbers or numbers != list(range(len(numbers))):
        raise ScheduleError(f"{path.name}: no bundle sequence found (is it a final_bundles dump?)")
    count = len(numbers)
    starts = {}
    for index, text in enumerate(texts):
        for found in _REGION_START.finditer(text):
            starts.setdefault(int(found[1] or found[2]), index)
    branches = []  # (bundle, target bundle)
    for index, text in enumerate(texts):
        for found in _BRANCH.finditer(text):
            if found[3] is not None:
                branches.append((index, int(found[3])))
                continue
            target = starts.get(int(found[2]))
            if target is None:  # an empty label region: it starts where the next region in order does
                later = [start for region, start in starts.items() if region > int(found[2]) and start > index]
                target = min(later) if later else None
            if target is None:
                raise ScheduleError(f"{path.name}: bundle {index:#x} branches to region {found[2]}, never started")
            branches.append((index, target))
    backward = [(index, target) for index, target in branches if target <= index]
    if len(backward) > 1:
        raise ScheduleError(
            f"{path.name}: {len(backward)} loops; the estimator reads kernels whose only loop is the grid "
            "(inner loops unrolled, as the splash kernels' are)"
        )
    if backward:  # the grid loop: the backward branch
        (loop_branch, loop_start), grid_loop = backward[0], True
        loop_end = loop_branch + 1
    else:  # a grid of one step (per core) compiles to straight-line code: the whole program is it
        loop_start, loop_end, grid_loop = 0, count, False
    names, capacity, used = _utilization(utilization_path, count)
    matmuls = np.array([len(_MATMUL.findall(text)) for text in texts])
    skips = sorted((index + 1, target) for index, target in branches if loop_start <= index < target <= loop_end)

    def regions_in(lo: int, hi: int) -> tuple:
        out, cursor = [], lo
        for start, end in skips:
            if start < cursor or start < lo or end > hi or (start, end) == (lo, hi):
                continue
            inner = regions_in(start, end)
            out.append(
                Region(start, end, tuple(int(x) for x in used[start:end].sum(0)), int(matmuls[start:end].sum()), inner)
            )
            cursor = end
        return tuple(out)

    return Schedule(
        name=path.name,
        bundles=count,
        loop_start=loop_start,
        loop_end=loop_end,
        regions=regions_in(loop_start, loop_end),
        unit_names=names,
        capacity=capacity,
        loop_units=tuple(int(x) for x in used[loop_start:loop_end].sum(0)),
        megacore=any("megacore core id" in text for text in texts[:64]),
        grid_loop=grid_loop,
    )


def _utilization(path, count: int) -> tuple[tuple, tuple, np.ndarray]:
    if path is None:
        return (), (), np.zeros((count, 0), np.int64)
    lines = pathlib.Path(path).read_text().splitlines()
    try:
        head = lines.index("== UTILIZATION:")
        names = tuple(name.strip() for name in re.split(r"[,|]", lines[head - 2]))  # 0.0.52: ",", 0.0.21: "|"
        capacity = tuple(int(x) for x in lines[head - 1].split())
        used = np.array([line.split() for line in lines[head + 1 : head + 1 + count]], dtype=np.int64)
    except (ValueError, IndexError) as error:
        raise ScheduleError(f"{pathlib.Path(path).name}: not a per-bundle utilization dump ({error})") from None
    if used.shape != (count, len(names)):
        raise ScheduleError(f"{pathlib.Path(path).name}: {used.shape[0]} rows for {count} bundles")
    return names, capacity, used


# XLA's own ops in a compiled program (HLO text), and XLA's own estimate of them

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_ARRAY = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|u16|f32|s32|u32)\[([\d,]*)\]")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


def array_bytes(text: str) -> int:
    return sum(
        _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in _ARRAY.findall(text)
    )


def _entry(hlo_text: str) -> str:
    """The entry computation's header and instructions, one a line: an instruction's attributes
    may span lines (a kernel's metadata string holds newlines and lines that begin with "}")."""
    entry = hlo_text[hlo_text.find("\nENTRY ") + 1 :]
    entry = entry[: re.search(r"^}\s*$", entry, re.M).start()]
    return re.sub(r"\n(?!\s*(?:ROOT )?%)", " ", entry)


# Ops that move no HBM data of their own: views, constants, tuples, and the async copies between
# memory spaces and SparseCore calls' first halves (a SparseCore call is counted at its end).
_MOVES_NOTHING = {
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple", "copy-start", "copy-done",
    "custom-call-start", "custom-call-update", "iota", "after-all", "partition-id",
}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(?:,|$)")


def rest_bytes(hlo_text: str) -> int:
    """The HBM bytes the entry computation's ops other than the Mosaic kernels read and write
    (each op's operands and results; an async SparseCore call reads and writes its result's size)."""
    sizes, total = {}, 0
    for line in _entry(hlo_text).splitlines()[1:]:
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        name, shape, op, operands = found.groups()
        sizes[name] = array_bytes(shape)
        if op in _MOVES_NOTHING or "tpu_custom_call" in line:
            continue
        if op == "custom-call-done":
            total += 2 * sizes[name]
        else:
            total += sizes[name] + sum(sizes.get(o.strip().lstrip("%"), 0) for o in operands.split(",") if o.strip())
    return total


def rest_cycles(hlo_text: str) -> int:
    """XLA's own estimate (`estimated_cycles` in each op's backend config) of the entry
    computation's ops other than the Mosaic kernels, in cycles."""
    total = 0
    for line in _entry(hlo_text).splitlines()[1:]:
        if "tpu_custom_call" in line:
            continue
        found = _CYCLES.search(line)
        total += int(found[1]) if found else 0
    return total
