"""The TPU generations the estimator knows: each one's published figures (`Chip`), and the two
numbers fitted to tokamax's measured times (`CLOCK_FACTOR`, `ROW_STALL`; calibration.py fits them)."""

from __future__ import annotations

import dataclasses

from ..errors import SplashConstraintError
from ..kernel_limits import GENERATIONS


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a TPU generation (Google Cloud's published figures, per device)."""

    name: str
    topology: str  # the smallest topology libtpu compiles for (one host)
    peak_flops: float  # bf16, per JAX device
    hbm_bandwidth: float  # bytes per second, per JAX device
    cores: int  # TensorCores behind one JAX device (a megacore chip runs one kernel on two)
    macs_per_bundle: int  # MXU multiply-adds one bundle issues at full MATMUL occupancy, per core
    overlay_bundles: int  # the compiler's largest instruction overlay ("jumbo"), in bundles (below)

    @property
    def clock(self) -> float:
        """Bundles per second: the published peak over the MXU work of a fully occupied bundle."""
        return self.peak_flops / (2 * self.cores * self.macs_per_bundle)


# macs_per_bundle: four 128 x 128 MXUs on v5e and v5p; on v6e and v7x, two MATMUL slots whose
# fully occupied bundles carry 2**18 multiply-adds at head_dim 256 and half that at 128 (a contraction
# of 128 fills half of a 256 x 256 MXU). tests/test_tpu_time.py reads both from tokamax's MXU-bound
# forward (2048 x 2048 blocks): multiply-adds over the MATMUL slots its steps use.
#
# overlay_bundles: a TensorCore runs its program from an instruction memory that holds part of it;
# the compiler cuts a longer program into overlays, loaded from HBM as control reaches them. A
# kernel whose code fits one "jumbo" overlay runs its grid loop from instruction memory; a longer
# one reloads overlays at every grid step (`KernelTime.fits_overlay`). The sizes are libtpu
# 0.0.52's (the estimator's), from its log (`TPU_VMODULE=overlay_partitioner=1`, "regular/jumbo/hlo
# overlay size"; tests/test_tpu_time.py reads them again); the v5e's libtpu 0.0.42.1 logs the same.
CHIPS = {
    "v5e": Chip("v5e", "v5e:2x2", 197e12, 819e9, 1, 4 * 128 * 128, 65232),
    "v5p": Chip("v5p", "v5p:2x2x1", 459e12, 2765e9, 2, 4 * 128 * 128, 65176),
    "v6e": Chip("v6e", "v6e:2x2", 918e12, 1638e9, 1, 1 << 18, 65168),
    # two TensorCores per chip, each its own JAX device with half the chip's peak and bandwidth
    "v7x": Chip("v7x", "tpu7x:2x2x1", 2307e12 / 2, 7380e9 / 2, 1, 1 << 18, 65056),
}
assert tuple(CHIPS) == GENERATIONS  # the planner's generations (Plan.generation) are the estimator's
# The only fitted numbers: per generation, the clock under load, as a factor on the schedule's time
# at the clock `Chip.clock` derives from the published peak, fitted to tokamax's measured times
# (`./dev.sh bench-tpu-time`, docs/benchmarks.md) and for v5e, where tokamax measured no attention,
# to the real v5e's training forwards (real_chip.py, benchmarks/results/tpu_check_v5e.json); and one
# stall at the end of every row of a kernel's grid, where its output is written back, the same on
# every generation.
CLOCK_FACTOR = {"v5e": 0.9810, "v5p": 1.0063, "v6e": 0.9993, "v7x": 1.1613}
ROW_STALL = 0.75e-6


def chip(generation: str) -> Chip:
    if generation not in CHIPS:
        raise SplashConstraintError(f"generation={generation!r}: expected one of {sorted(CHIPS)}.")
    return CHIPS[generation]
