"""Compiling with libtpu's schedule dumps: the environment of a process whose libtpu writes every
kernel's final schedule (`environment`), and compiling a JAX function there (`compile_schedules`).
libtpu reads its dump flags once, when it loads, so this runs in a process of its own."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

from .. import compat, mosaic
from ..errors import SplashConstraintError
from . import aot
from . import schedule as schedule_lib
from .chips import chip
from .schedule import Schedule, ScheduleError

DUMP_FLAGS = (
    "--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles|utilization"
)
DUMPS_VARIABLE = "TORCH_SPLASH_SCHEDULE_DUMPS"


def environment(libtpu_dir: str | None, dump_dir: str, base: dict | None = None) -> dict:
    """The environment of a process that compiles for TPU and dumps every schedule to `dump_dir`."""
    env = aot.environment(libtpu_dir or "", base)
    library = _libtpu_library(libtpu_dir)
    if library is not None:
        env["TPU_LIBRARY_PATH"] = str(library)
    env["LIBTPU_INIT_ARGS"] = " ".join(
        p for p in (env.get("LIBTPU_INIT_ARGS", ""), DUMP_FLAGS.format(dir=dump_dir)) if p
    )
    env[DUMPS_VARIABLE] = dump_dir
    return env


def _libtpu_library(libtpu_dir: str | None) -> pathlib.Path | None:
    if libtpu_dir:
        candidate = pathlib.Path(libtpu_dir) / "libtpu" / "libtpu.so"
        return candidate if candidate.is_file() else None
    return mosaic.libtpu_path()


def libtpu_release() -> str | None:
    path = mosaic.libtpu_path()
    if path is None:
        return compat.installed("libtpu")
    for dist in pathlib.Path(path).parent.parent.glob("libtpu-*.dist-info"):
        return dist.name[len("libtpu-") : -len(".dist-info")]
    return compat.installed("libtpu")


def dump_dir() -> pathlib.Path:
    """This process's dump folder; SplashConstraintError unless it was started by `environment`."""
    value = os.environ.get(DUMPS_VARIABLE)
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


def estimator_libtpu_dir() -> str | None:
    """The folder of the estimator's libtpu: $TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR, else
    $TORCH_SPLASH_LIBTPU_DIR, else None (the installed `libtpu` package, as in the current set)."""
    return os.environ.get("TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR") or os.environ.get("TORCH_SPLASH_LIBTPU_DIR") or None
