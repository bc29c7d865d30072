"""torch_splash.fit's verdict (`Report`) and the topologies it knows: their HBM per chip and the
libtpu release that compiles for each."""

from __future__ import annotations

import dataclasses
import re

from torch_splash_jax import SplashConstraintError, mosaic
from torch_splash_jax.tpu_time import aot

# HBM per device, as the compiler states it when a step does not fit (libtpu 0.0.21, measured: v5e
# "Used 49.17G of 15.75G hbm"; the others in "Allocation ... would exceed memory (size=...)";
# v7x, libtpu 0.0.52: "exceeds available HBM (94.74G)", one of a chip's two TensorCores, which
# libtpu's topology lists as devices of their own). A refusal's own figure replaces it.
CAPACITY_GIB = {"v4": 32.0, "v5e": 15.75, "v5p": 96.0, "v6e": 31.5, "v7x": 94.74}
_TOPOLOGY = re.compile(rf"^({'|'.join(CAPACITY_GIB)})(?::(\d+(?:x\d+){{1,2}}))?$")


def libtpu_release(generation: str) -> str:
    """The libtpu that compiles a step for `generation`: the release torch_xla pins, which predates
    v7x; for v7x the TPU time estimator's (torch_splash_jax.tpu_time.ESTIMATOR_LIBTPU), the oldest
    this project knows to compile for it."""
    if generation == "v7x":
        from torch_splash_jax import tpu_time

        return tpu_time.ESTIMATOR_LIBTPU
    return mosaic.PINNED_LIBTPU


def parse_topology(topology: str) -> tuple[str, str]:
    """(generation, libtpu topology name): "v5e" -> one host of v5e ("v5e:2x2"), "v5e:4x4" as
    given, "v7x" -> "tpu7x:2x2x1" (libtpu's name for it)."""
    found = _TOPOLOGY.match(topology or "")
    if found is None:
        known = ", ".join(f"{g}[:{aot.TOPOLOGIES[g].split(':')[1]}]" for g in CAPACITY_GIB)
        raise SplashConstraintError(
            f"topology={topology!r} is not one torch_splash.fit knows: use one of {known} (e.g. v5e:2x2, v5e:4x4)."
        )
    generation, shape = found.group(1), found.group(2)
    prefix = aot.TOPOLOGIES[generation].split(":")[0]
    return generation, aot.TOPOLOGIES[generation] if shape is None else f"{prefix}:{shape}"


def over_capacity(fields: dict) -> dict:
    """The compiler's figures (`aot.report`'s fields) with the verdict of HBM: a step the compiler
    compiled does not fit when its arguments + outputs - donated + temporaries exceed `capacity`.
    The compiler refuses a step whose temporaries alone do not fit, but compiles one whose
    arguments and outputs (buffers the runtime holds, not the compiler) take the chip's HBM
    (measured, libtpu 0.0.21: 18 GiB of arguments and outputs on a 15.75 GiB v5e compiled)."""
    if fields.get("fits") and fields.get("total", 0) > fields["capacity"]:
        return {**fields, "fits": False, "needed": fields["total"]}
    return fields


@dataclasses.dataclass(frozen=True)
class Report:
    """The TPU compiler's verdict on one step, per chip, in bytes."""

    topology: str
    chips: int
    fits: bool
    capacity: int
    arguments: int = 0
    outputs: int = 0
    temporaries: int = 0
    # Buffers of arguments the step's outputs reuse: the tensors it updates in place, which
    # torch_xla donates at a step boundary (counted in arguments and in outputs, once in total)
    donated: int = 0
    code: int = 0
    total: int = 0  # arguments + outputs - donated + temporaries
    needed: int | None = None  # the compiler's figure when it does not fit
    needed_is_lower_bound: bool = False
    error: str | None = None  # a refusal other than memory, its first lines
    xla_estimated_cycles: int | None = None  # XLA's own estimate of the step's ops but the kernels
    # With check(..., estimate_time=True): the attention kernels' estimated time per chip
    # (torch_splash_jax.tpu_time, docs/tpu_time.md), seconds, over `attention_calls` calls
    attention_seconds: float | None = None
    attention_calls: int = 0
    rest_seconds: float | None = None  # xla_estimated_cycles at the estimator's clock
    # of those calls' kernels, the ones whose code outgrows one instruction overlay (`Estimate.outgrown`)
    attention_outgrown: int = 0
    # From a script (run_script, the command): the step checked ("step 1", "steady state (step 2)")
    # and how it was chosen
    step: str | None = None
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        gib = 1 << 30
        which = f", {self.step}" if self.step else ""
        head = f"{self.topology}, {self.chips} chip{'s' if self.chips > 1 else ''}{which}:"
        notes = "".join(f"\n  {note}" for note in self.notes)
        if self.error is not None:
            return f"{head} the TPU compiler refused the step:\n{self.error}{notes}"
        figures = (
            f"(arguments {self.arguments / gib:.2f}, outputs {self.outputs / gib:.2f}, of which "
            f"{self.donated / gib:.2f} updated in place in donated arguments, "
            f"temporaries {self.temporaries / gib:.2f}, generated code {self.code / gib:.3f} GiB)"
        )
        if not self.fits:
            at_least = "at least " if self.needed_is_lower_bound else ""
            text = (
                f"{head} does NOT fit: needs {at_least}{self.needed / gib:.2f} GiB of {self.capacity / gib:.2f} GiB HBM"
            )
            # compiled, but over the chip: the compiler's figures say what takes it
            return (f"{text} per chip {figures}" if self.total else text) + notes
        text = f"{head} fits: {self.total / gib:.2f} GiB of {self.capacity / gib:.2f} GiB HBM per chip {figures}"
        if self.attention_seconds is not None:
            text += (
                f"\n  attention kernels, {self.attention_calls} call{'s' if self.attention_calls != 1 else ''}: "
                f"{self.attention_seconds * 1e3:.3f} ms per chip, estimated from the TPU compiler's schedule"
            )
            if self.rest_seconds is not None:
                text += f"; the rest of the step, XLA's own estimate: {self.rest_seconds * 1e3:.3f} ms"
            if self.attention_outgrown:
                text += (
                    f"\n  {self.attention_outgrown} of their kernels' code outgrows one instruction overlay: "
                    "the chip reloads it at every grid step and may take 1.5x to 3x the estimate there "
                    "(docs/tpu_time.md, 'Instruction overlays'); other block sizes may fit"
                )
        return text + notes
