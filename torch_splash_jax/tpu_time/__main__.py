"""`python -m torch_splash_jax.tpu_time`: `estimate PLAN --generation G` estimates one pickled Plan
or DecodePlan (torch_splash.fit runs it); `calibrate --generation G [--limit N]` estimates tokamax's kernel at its
measured entries (tokamax: the current set's `calibrate` extra). Either re-runs itself in a process
whose libtpu dumps its schedules (libtpu.py)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from ..errors import SplashConstraintError
from .calibration import calibrate_arguments
from .chips import CHIPS, chip
from .estimate import estimate_json, splash_estimate
from .libtpu import DUMPS_VARIABLE, environment, estimator_libtpu_dir
from .schedule import ScheduleError


def _estimate(plan, generation: str, backward: bool):
    """A splash plan's estimate, or a decode plan's (forward only, at its whole cache: the lengths a
    decode call runs at are data the plan does not hold)."""
    from ..decode import DecodePlan

    if isinstance(plan, DecodePlan):
        from . import decode

        return decode.decode_estimate(decode.DecodeCall(plan), generation)
    return splash_estimate(plan, generation, backward=backward)


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
    command = ["torch_splash_jax.tpu_time.calibration", *argv[1:]] if options.command == "calibrate" else None
    if not os.environ.get(DUMPS_VARIABLE):
        with tempfile.TemporaryDirectory(prefix="torch-splash-schedules-") as directory:
            env = environment(estimator_libtpu_dir(), directory)
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
