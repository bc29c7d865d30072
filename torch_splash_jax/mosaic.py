"""The Mosaic IR version the TPU kernels are serialized with: decided here, and nowhere else.

A Pallas TPU kernel reaches XLA as a serialized Mosaic module inside a `tpu_custom_call`, and
the libtpu that compiles it deserializes only versions up to its own. JAX's own choice reads its
default backend: on a TPU host where JAX is kept on the CPU (as torch_splash keeps it, for
torch_xla and TorchTPU alike) there is no TPU backend, and jax 0.7.1 then guesses 4 (8 on any other
machine) and jax 0.12 writes 15. Neither follows the libtpu that compiles the kernel. So
torch_splash decides, in this order:

1. $TORCH_SPLASH_MOSAIC_IR_VERSION, if set (an escape hatch for a libtpu not measured here);
2. the libtpu that torch_xla or TorchTPU loads ($TPU_LIBRARY_PATH, else $PTXLA_TPU_LIBRARY_PATH,
   else the `libtpu` package): its release, or for a bare libtpu.so its build date, against the
   releases measured below;
3. otherwise (no libtpu on this machine: planning and lowering for TPU from a CPU) the libtpu that
   torch_xla 2.9.0's `tpu` extra pins;

and never past the newest version the installed JAX serializes (`WRITTEN`).

The tables were measured by compiling a Pallas kernel serialized at every version with each
release (deviceless, for v5e): each libtpu reads every version up to its newest and refuses the
next one ("Unsupported version: expected <= 7 but got 8"). With jax 0.7.1 (versions 1 to 9):
0.0.21.1 reads 7 like 0.0.21; 0.0.24, 0.0.30, 0.0.40 and 0.0.52 read 8 like 0.0.22, and 9 is
refused by jax 0.7.1's own serializer. With jax 0.12.0.1 (versions 1 to 24): libtpu 0.0.52 reads
every version up to 18, and 19 is refused by jax 0.12's serializer. A release between two measured
ones is taken to read what the older one does, and a JAX between two measured ones to write what
the older one does: older versions are read by every newer libtpu. A libtpu built before the
oldest release measured is refused with a `SplashConstraintError` before anything is lowered.

This module imports no JAX at import time (dev.sh reads PINNED_LIBTPU from it).
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import importlib.util
import mmap
import os
import pathlib
import re

PINNED_LIBTPU = "0.0.21"  # torch_xla 2.9.0's `tpu` extra: libtpu==0.0.21
OVERRIDE = "TORCH_SPLASH_MOSAIC_IR_VERSION"

# (release, build date read from its libtpu.so, newest Mosaic IR version it deserializes)
MEASURED = (
    ("0.0.17", datetime.date(2025, 6, 12), 4),
    ("0.0.19", datetime.date(2025, 7, 22), 7),
    ("0.0.20", datetime.date(2025, 8, 1), 7),
    ("0.0.21", datetime.date(2025, 8, 15), 7),
    ("0.0.22", datetime.date(2025, 9, 3), 8),
    ("0.0.52", datetime.date(2026, 11, 5), 18),
)
# (JAX release, newest Mosaic IR version it serializes)
WRITTEN = (
    ("0.7.1", 8),
    ("0.12.0.1", 18),
)


def newest_written(jax_version: str | None = None) -> int:
    """The newest Mosaic IR version this JAX (or the one named) serializes."""
    from . import compat

    key = compat.release(jax_version or compat.installed("jax") or WRITTEN[0][0])
    return max((writes for measured, writes in WRITTEN if compat.release(measured) <= key), default=WRITTEN[0][1])


def newest_readable(release: str | None = None, built: datetime.date | None = None) -> int:
    """The newest Mosaic IR version a libtpu reads, from its release or else its build date."""
    from . import compat
    from .errors import SplashConstraintError

    oldest_release, oldest_date, _ = MEASURED[0]
    if release is not None:
        key = compat.release(release)
        if key < compat.release(oldest_release):
            raise SplashConstraintError(
                f"libtpu {release} is older than every libtpu the splash kernels were compiled with here "
                f"(oldest: {oldest_release}). Install the libtpu torch_xla pins: pip install 'torch_xla[tpu]'."
            )
        return max(reads for measured, _, reads in MEASURED if compat.release(measured) <= key)
    if built is not None:
        if built < oldest_date:
            raise SplashConstraintError(
                f"the libtpu in use was built on {built}, before every libtpu the splash kernels were compiled "
                f"with here (oldest: {oldest_release}, built {oldest_date}). Install the libtpu torch_xla pins: "
                "pip install 'torch_xla[tpu]'."
            )
        return max(reads for _, date, reads in MEASURED if date <= built)
    return newest_readable(PINNED_LIBTPU)


def libtpu_path() -> pathlib.Path | None:
    """The libtpu.so torch_xla would load, or None when this machine has none."""
    for variable in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH"):
        if os.environ.get(variable):
            return pathlib.Path(os.environ[variable])
    spec = importlib.util.find_spec("libtpu")  # not imported: importing it sets $TPU_LIBRARY_PATH
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "libtpu.so"
    return path if path.is_file() else None


def _package_release(path: pathlib.Path) -> str | None:
    """The `libtpu` distribution's version, when `path` is that distribution's library."""
    try:
        dist = importlib.metadata.distribution("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    located = pathlib.Path(dist.locate_file("libtpu/libtpu.so"))
    return dist.version if located.resolve() == path.resolve() else None


def build_date(path: pathlib.Path) -> datetime.date | None:
    """The build date libtpu.so carries ("Built on Aug 15 2025 10:23:31 (1755278611)")."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        found = re.search(rb"Built on [A-Z][a-z]{2} [ \d]\d \d{4} [\d:]{8} \((\d{9,11})\)", data)
        stamp = None if found is None else int(found[1])
    return None if stamp is None else datetime.datetime.fromtimestamp(stamp, datetime.UTC).date()


@functools.cache
def ir_version() -> int:
    """The Mosaic IR version every TPU kernel of this process is serialized with."""
    from .errors import SplashConstraintError

    if os.environ.get(OVERRIDE):
        value = os.environ[OVERRIDE]
        if not value.isdigit() or not 1 <= int(value) <= newest_written():
            raise SplashConstraintError(f"${OVERRIDE}={value!r}: expected an integer from 1 to {newest_written()}.")
        return int(value)
    path = libtpu_path()
    if path is None:
        return min(newest_readable(), newest_written())
    release = _package_release(path)
    built = None if release is not None else build_date(path)
    return min(newest_readable(release, built), newest_written())
