"""The TPU-time tooling: TPU kernel time and HBM estimated without a TPU, from libtpu's deviceless
compilation. Nothing on the attention path imports this package (tests/test_layering.py): the
runtime needs no libtpu, no dumps and no tokamax.

- aot.py: the TPU compiler without a TPU (compile an HLO module for a topology, its HBM;
  `python -m torch_splash_jax.tpu_time.aot`, the fit check's engine);
- schedule.py: libtpu's final schedule of a Mosaic kernel, read from its dumps;
- chips.py, work.py, libtpu.py, estimate.py: the kernel time estimate (estimate.py says how);
- calibration.py: the estimate of tokamax's kernel against tokamax's measured times (needs tokamax,
  the current set's `calibrate` extra);
- __main__.py: `python -m torch_splash_jax.tpu_time estimate | calibrate`.

The estimate's names are re-exported here.
"""

from .chips import CHIPS, CLOCK_FACTOR, ROW_STALL, Chip, chip
from .estimate import (
    Estimate,
    KernelTime,
    estimate_from_json,
    estimate_in_subprocess,
    estimate_json,
    kernel_kind,
    kernel_output_bytes,
    kernel_time,
    program_estimate,
    roles,
    splash_estimate,
    splash_works,
)
from .libtpu import DUMP_FLAGS, ESTIMATOR_LIBTPU, compile_schedules, dump_dir, environment, libtpu_release
from .work import (
    Work,
    active_backward_work,
    active_work,
    block_classes,
    causal,
    dkv_work,
    forward_work,
    full_mask,
    tables_work,
)

__all__ = [
    "CHIPS",
    "CLOCK_FACTOR",
    "DUMP_FLAGS",
    "ESTIMATOR_LIBTPU",
    "ROW_STALL",
    "Chip",
    "Estimate",
    "KernelTime",
    "Work",
    "block_classes",
    "causal",
    "chip",
    "compile_schedules",
    "dkv_work",
    "dump_dir",
    "environment",
    "estimate_from_json",
    "estimate_in_subprocess",
    "estimate_json",
    "forward_work",
    "full_mask",
    "kernel_kind",
    "kernel_output_bytes",
    "kernel_time",
    "libtpu_release",
    "program_estimate",
    "roles",
    "splash_estimate",
    "splash_works",
    "tables_work",
    "active_backward_work",
    "active_work",
]
