"""The TPU compiler's process for torch_splash.fit: the libtpu it loads, found but never installed
unless asked, and one step's module compiled there, deviceless, into a `Report`.

The compiler runs in a process of its own that imports JAX but not torch (torch_splash_jax.tpu_time.aot's
command line), so the caller keeps its JAX and torch_xla state, and libtpu is on that process's
path only: importing torch and torch_splash cost that process about 7 of its 15 seconds."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from torch_splash_jax import SplashConstraintError, compat
from torch_splash_jax.tpu_time import aot

from ._fit_graph import Step
from ._fit_report import CAPACITY_GIB, Report, libtpu_release, over_capacity, parse_topology

INSTALL_VARIABLE = "TORCH_SPLASH_INSTALL_LIBTPU"


def _install_allowed(install: bool | None) -> bool:
    if install is not None:
        return install
    return os.environ.get(INSTALL_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def libtpu_dir(
    release: str | None = None, variable: str = "TORCH_SPLASH_LIBTPU_DIR", *, install: bool | None = None
) -> pathlib.Path:
    """A folder holding libtpu `release` for a compiler's process: $`variable`, the release
    installed beside torch_splash (TorchTPU's), or ~/.cache/torch_splash/libtpu-<release> (never
    where JAX would take it for a backend). By default the release torch_xla pins, for HBM;
    `kernel_time` and v7x ask for the estimator's. Missing, it is installed there only when asked
    (`install=True`, `python -m torch_splash.fit --install-libtpu`, or $TORCH_SPLASH_INSTALL_LIBTPU=1);
    otherwise the error gives the command that installs it."""
    release = release or libtpu_release("v5e")
    given = os.environ.get(variable)
    if not given and compat.installed("libtpu") == release:
        return pathlib.Path(importlib.metadata.distribution("libtpu").locate_file(""))
    folder = pathlib.Path(given) if given else pathlib.Path.home() / ".cache" / "torch_splash" / f"libtpu-{release}"
    if (folder / "libtpu" / "libtpu.so").is_file():
        return folder
    if given:
        raise SplashConstraintError(f"${variable}={given} holds no libtpu/libtpu.so.")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), f"libtpu=={release}"]
    if not _install_allowed(install):
        raise SplashConstraintError(
            f"torch_splash.fit needs libtpu=={release} (the TPU compiler, about 300 MB), which is not in {folder}. "
            f"Install it with:\n  {' '.join(command)}\n"
            f"or let torch_splash.fit do it (--install-libtpu, or {INSTALL_VARIABLE}=1), "
            f"or point ${variable} at a folder that holds it."
        )
    print(f"torch_splash.fit: installing libtpu=={release} into {folder} (asked for)", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (folder / "libtpu" / "libtpu.so").is_file():
        raise SplashConstraintError(
            f"torch_splash.fit could not install libtpu=={release} ({done.stderr.strip()[-300:]}). "
            f"Install it yourself: pip install --no-deps --target DIR libtpu=={release}, then set {variable}=DIR."
        )
    return folder


def compiler_libtpu_dir(generation: str) -> pathlib.Path:
    """The libtpu folder that compiles a step for `generation`."""
    release = libtpu_release(generation)
    if release == libtpu_release("v5e"):
        return libtpu_dir(release)
    return libtpu_dir(release, "TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR")


def compile_step(step: Step, topology: str, partitions: int = 1) -> Report:
    """Compile one step's module for `partitions` chips of `topology`, its donors as buffer donors."""
    return _compile_file(step.proto, ".pb", topology, partitions, step.donors, step.parameters)


def compile_step_hlo(hlo_text: str, topology: str, partitions: int = 1) -> Report:
    """Compile HLO text for `partitions` chips of `topology`, donating nothing."""
    return _compile_file(hlo_text.encode(), ".hlo", topology, partitions, (), None)


def _compile_file(data: bytes, suffix: str, topology: str, partitions: int, donors, parameters) -> Report:
    generation, name = parse_topology(topology)
    env = aot.environment(str(compiler_libtpu_dir(generation)))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(pathlib.Path(__file__).resolve().parent.parent)])
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as f:
        f.write(data)
    command = [
        sys.executable,
        "-m",
        "torch_splash_jax.tpu_time.aot",
        f.name,
        "--topology",
        name,
        "--partitions",
        str(partitions),
    ]
    if donors:
        command += ["--donate", ",".join(map(str, donors))]
    if parameters is not None:
        command += ["--parameters", str(parameters)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"torch_splash.fit: the TPU compiler's process failed:\n{done.stderr[-3000:]}")
    fields = json.loads(lines[-1])
    fields.setdefault("capacity", int(CAPACITY_GIB[generation] * (1 << 30)))  # the compiler's own when it refused
    return Report(topology=topology, **over_capacity(fields))
