"""The TPU compiler without a TPU: libtpu compiles ahead of time ("deviceless", as MaxText's
`train_compile.py` does) for a named topology, and reports the HBM a program needs.

libtpu must be importable and JAX kept on the CPU; `environment(libtpu_dir)` is the environment a
process needs for that. torch_splash.fit (users' own steps), the test suite and the benchmarks run
it in processes of their own, so JAX never takes libtpu for a backend in ordinary runs. Any HLO
module compiles the same way: torch_splash's programs as the in-graph transport hands them to
torch_xla, whole torch_xla training steps (their serialized module, with the buffer donors torch_xla
declares at a step boundary), and the StableHLO modules TorchTPU's `jax_op` exports (`compile_stablehlo`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import re
import sys

from .. import compat
from . import schedule

# Without these, libtpu looks for a TPU VM's metadata server and its worker host names, and a
# second process loading libtpu at the same time (two checks, or a benchmark beside the tests)
# fails on libtpu's lockfile, which only guards a TPU that is not here.
_LIBTPU_SETTINGS = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "JAX_PLATFORMS": "cpu",
}
# One host's chips: libtpu refuses a topology smaller than a host (v5e:1x1).
# "v7x": libtpu 0.0.52 knows it by this name (0.0.21 knows no v7x).
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1", "v4": "v4:2x2x1", "v7x": "tpu7x:2x2x1"}
GiB = 1 << 30


def environment(libtpu_dir: str, base: dict | None = None) -> dict:
    """The environment of a process that compiles for TPU with the libtpu in `libtpu_dir`."""
    env = dict(os.environ if base is None else base)
    env.update(_LIBTPU_SETTINGS)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (libtpu_dir, env.get("PYTHONPATH", "")) if p)
    library = pathlib.Path(libtpu_dir) / "libtpu" / "libtpu.so" if libtpu_dir else None
    if library is not None and library.is_file():  # JAX 0.7.1 finds a newer libtpu (v7x's) only so
        env["TPU_LIBRARY_PATH"] = str(library)
    return env


@functools.cache
def devices(target: str) -> tuple:
    """TPU devices for compiling only: one host's chips of a generation ("v5e", "v6e", ...), or
    every chip of a named topology (e.g. "v5e:4x4", a 16-chip slice of four hosts)."""
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES.get(target, target)).devices)


@dataclasses.dataclass(frozen=True)
class Memory:
    """The TPU compiler's memory analysis of one executable, per device, in bytes."""

    arguments: int
    outputs: int
    temp: int
    aliased: int
    code: int
    # The compiled program's HLO as scheduled (its text; made on demand: megabytes for a big step).
    scheduled: object = dataclasses.field(default=None, repr=False, compare=False)

    def schedule(self) -> str:
        return self.scheduled() if self.scheduled else ""

    @property
    def total(self) -> int:
        """HBM the step needs: arguments, outputs (less what they alias) and temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temp


class OutOfMemory(Exception):
    """The compiler refused the program for HBM: `used` of `capacity` bytes."""

    def __init__(self, message: str, used: float, capacity: float, lower_bound: bool = False):
        super().__init__(message)
        self.used, self.capacity, self.lower_bound = used, capacity, lower_bound


_OOM = re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm")
# one buffer larger than HBM: the compiler stops there, so its size is a lower bound of the need
_OOM_BUFFER = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")
# newer libtpu (0.0.52): "the total memory required for HLO temporaries (1.00T) exceeds available
# HBM (94.74G)": the temporaries alone, so a lower bound too
_OOM_TEMPORARIES = re.compile(
    r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def compile_hlo(proto: bytes, generation: str, partitions: int = 1, donors: tuple[int, ...] = ()) -> Memory:
    """Compile a serialized HLO module for `partitions` devices of `generation`, a generation or a
    topology name as `devices` takes (SPMD-partitioned by its sharding annotations when more than
    one), with the parameters numbered in `donors` as buffer donors (their buffers reusable for
    outputs of their shape: `Memory.aliased`). Raises OutOfMemory when it does not fit in HBM, and
    the compiler's own error for anything else it refuses."""
    compile_for = functools.partial(compat.compile_hlo_for, donors=tuple(donors))
    return _compiled(compile_for, proto, devices(generation), partitions)


def compile_stablehlo(module, generation: str, partitions: int = 1) -> Memory:
    """The same for a StableHLO module (text or bytecode): what `jax.export` produces, as
    TorchTPU's `jax_op` hands it to TorchTPU's runtime."""
    return _compiled(compat.compile_stablehlo_for, module, devices(generation), partitions)


def _compiled(compile_for, module, targets: tuple, partitions: int) -> Memory:
    try:
        executable = compile_for(module, targets, partitions)
    except Exception as error:  # the compiler's XlaRuntimeError
        message = str(error).split("\n")[0]
        used, buffer = _OOM.search(message), _OOM_BUFFER.search(message)
        if used is not None:
            raise OutOfMemory(message, float(used[1]) * _UNITS[used[2]], float(used[3]) * _UNITS[used[4]]) from None
        if buffer is not None:
            raise OutOfMemory(message, float(buffer[1]), float(buffer[2]), lower_bound=True) from None
        temporaries = _OOM_TEMPORARIES.search(str(error))
        if temporaries is not None:
            needed, capacity = (float(temporaries[i]) * _UNITS[temporaries[i + 1]] for i in (1, 3))
            raise OutOfMemory(message, needed, capacity, lower_bound=True) from None
        raise
    stats = executable.get_compiled_memory_stats()
    return Memory(
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.temp_size_in_bytes,
        stats.alias_size_in_bytes,
        stats.generated_code_size_in_bytes,
        lambda: executable.hlo_modules()[0].to_string(),
    )


def hlo_text_to_proto(text: str) -> bytes:
    """HLO text (what torch_xla prints for a pending graph) as a serialized module."""
    return compat.hlo_module_from_text(text)


def report(
    path: str, topology: str, partitions: int = 1, donors: tuple[int, ...] = (), parameters: int | None = None
) -> dict:
    """What the compiler says of the HLO module in `path` (serialized, or text when the name ends
    in .hlo) for `partitions` chips of `topology`, with these buffer donors: fits (with the memory
    analysis), or does not (with the HBM it asked for, or its own error). With `parameters`, a
    module whose entry takes another number of parameters is refused: the donors would be others."""
    data = pathlib.Path(path).read_bytes()
    try:
        proto = hlo_text_to_proto(data.decode()) if path.endswith(".hlo") else data
        if parameters is not None and compat.entry_parameter_count(proto) != parameters:
            raise ValueError(
                f"the step's module takes {compat.entry_parameter_count(proto)} parameters where "
                f"{parameters} were expected: its buffer donors cannot be placed"
            )
        memory = compile_hlo(proto, topology, partitions, donors)
    except OutOfMemory as oom:
        return dict(
            chips=partitions,
            fits=False,
            needed=int(oom.used),
            needed_is_lower_bound=oom.lower_bound,
            capacity=int(oom.capacity),
        )
    except Exception as error:  # another refusal: its first lines, not swallowed
        return dict(chips=partitions, fits=False, error="\n".join(str(error).splitlines()[:8]))
    return dict(
        chips=partitions,
        fits=True,
        # XLA's own estimate (its ops' `estimated_cycles`) of the step's ops other than the kernels
        xla_estimated_cycles=schedule.rest_cycles(memory.schedule()),
        arguments=memory.arguments,
        outputs=memory.outputs,
        temporaries=memory.temp,
        donated=memory.aliased,
        code=memory.code,
        total=memory.total,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m torch_splash_jax.tpu_time.aot STEP.pb --topology v5e:2x2 [--partitions N] [--donate 0,3]`, in
    a process with `environment(...)`: prints `report(...)` as one JSON line (torch_splash.fit runs it)."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_splash_jax.tpu_time.aot",
        description="Compile an HLO module for TPU without one; report its HBM.",
    )
    parser.add_argument("hlo", help="a serialized HLO module, or HLO text in a file named *.hlo")
    parser.add_argument("--topology", required=True, help="a topology name, e.g. v5e:2x2")
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--donate", default="", help="parameter numbers whose buffers are donated, e.g. 0,3,4")
    parser.add_argument("--parameters", type=int, default=None, help="the number of parameters the module takes")
    options = parser.parse_args(argv)
    donors = tuple(int(n) for n in options.donate.split(",") if n)
    fields = report(options.hlo, options.topology, options.partitions, donors, options.parameters)
    print(json.dumps(fields), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
