"""The estimator held to a real chip: `tpu_check`'s measured rows beside the estimates made of the
same programs (by the estimator's own libtpu), and the clock factor they fit.

tokamax measured no attention kernel on v5e, so v5e's clock factor (`chips.CLOCK_FACTOR`) comes
from here: the real v5e's training forwards (benchmarks/results/tpu_check_v5e.json, its run and
the earlier runs it keeps), each a splash forward kernel and little else, as
`calibration.factor_of` fits tokamax's entries on the other generations (at the shared row stall).
Steps (forward and backward, with the XLA ops around the kernels) and decode calls are reported
beside them, not fitted: a step's time also holds the
XLA ops, which XLA's own estimate counts (`Estimate.rest_seconds`), and a decode call is bound by
HBM, where the estimate's sum of schedule and HBM time (estimate.py) leaves out their overlap.
"""

from __future__ import annotations

import dataclasses

from .calibration import errors_of, factor_of
from .chips import ROW_STALL
from .estimate import estimate_from_json
from .libtpu import ESTIMATOR_LIBTPU


@dataclasses.dataclass(frozen=True)
class Measured:
    """One program the chip measured, in the estimate's parts (seconds)."""

    name: str
    program: str  # "forward" (a training row's forward), "step" or "decode"
    schedule: float  # the kernels' schedule time at the published clock, no clock factor
    hbm: float
    rows: int
    rest: float  # XLA's own estimate of the ops around the kernels
    measured: float

    def estimate(self, factor: float, with_rest: bool = False) -> float:
        return self.schedule * factor + self.hbm + self.rows * ROW_STALL + (self.rest if with_rest else 0.0)


def all_measured_rows(results: dict, libtpu: str = ESTIMATOR_LIBTPU) -> list[Measured]:
    """`measured_rows` of a results file's run and of the earlier runs it keeps ("earlier_runs":
    the same chip's, each with its timing and estimates): what the clock factor is fitted to."""
    return [row for run in (results, *results.get("earlier_runs", [])) for row in measured_rows(run, libtpu)]


def measured_rows(results: dict, libtpu: str = ESTIMATOR_LIBTPU) -> list[Measured]:
    """The timed programs of a tpu_check run that `libtpu`'s estimate covers."""
    rows = []
    for row in results.get("timing", []):
        estimate = next((e for e in row.get("estimates", []) if e.get("libtpu") == libtpu), None)
        plan = row.get("variants", {}).get("plan", {})
        if estimate is None or "forward_ms" not in plan:
            continue
        for job, programs in (("step", ("forward", "step")), ("decode", ("decode",))):
            if job not in estimate or "error" in estimate[job]:
                continue
            parsed = estimate_from_json(estimate[job])
            for program in programs:
                kernels = [k for k in parsed.kernels if program != "forward" or k.kind == "forward"]
                measured = plan["step_ms" if program == "step" else "forward_ms"] * 1e-3
                rest = parsed.rest_seconds if program != "forward" else 0.0
                rows.append(
                    Measured(
                        row["name"],
                        program,
                        sum(k.schedule_seconds for k in kernels),
                        sum(k.hbm_seconds for k in kernels),
                        sum(k.rows for k in kernels),
                        rest,
                        measured,
                    )
                )
    return rows


def fitted_factor(rows: list[Measured]) -> float:
    """The clock factor the training forwards fit, at the shared row stall."""
    forwards = [(r.schedule, r.hbm, r.rows, r.measured) for r in rows if r.program == "forward"]
    return factor_of(forwards, ROW_STALL)


def errors(rows: list[Measured], factor: float, program: str, with_rest: bool = False) -> list[float]:
    """estimate / measured - 1 of the rows of one program kind."""
    chosen = [r for r in rows if r.program == program]
    if with_rest:
        return [r.estimate(factor, True) / r.measured - 1 for r in chosen]
    return errors_of([(r.schedule, r.hbm, r.rows, r.measured) for r in chosen], factor, ROW_STALL)
