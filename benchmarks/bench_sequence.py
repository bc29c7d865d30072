"""The query sequence sharded over devices (context parallelism): contiguous vs balanced, in one run.

1. Blocks per device: the forward kernel's non-empty block-table entries on each device, causal,
   planned for TPU (B=1, 16 query heads, 8 kv heads, D=128, bf16), L = 32K and 128K over 4 and 16
   devices. With contiguous shards the last device does almost all the causal work; with the
   balanced layout (each device two mirrored chunks) the work is even.
2. HBM per device from the TPU compiler (libtpu, deviceless): the attention-block training step of
   bench_tpu_memory.py with its sequence sharded (balanced) over the 4 chips of v5e:2x2 and the 16
   of a v5e:4x4 slice, at L = 32K, 128K and 256K, next to the unsharded step on one v5e chip; and
   the same step with a per-head mask (half the heads causal, half a 4096 window) at 32K and 128K.
3. Step time on 4 CPU devices (torch_xla SPMD, interpret-mode kernels): forward + backward of
   causal attention with the query sequence sharded 4 ways, contiguous vs balanced.

    ./dev.sh bench-sequence            # all of it (about 15 minutes here)
    ./dev.sh bench-sequence --quick    # L = 32K blocks, 8K compiles (1 chip; 4 chips, also per-head), a small CPU step
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_bridge.py

import report  # benchmarks/report.py: results files and their tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def blocks_per_device(length: int, shards: int, layout: str) -> list[int]:
    import torch_splash_jax

    plan = torch_splash_jax.plan(
        batch=1,
        num_q_heads=HEADS,
        num_kv_heads=KV_HEADS,
        q_len=length,
        kv_len=length,
        head_dim=HEAD_DIM,
        head_dim_v=HEAD_DIM,
        dtype="bfloat16",
        mask=torch_splash_jax.CausalMask(),
        scale=HEAD_DIM**-0.5,
        platform="tpu",
        q_shards=shards,
        sequence_layout=layout,
    )
    return torch_splash_jax.Program(plan).blocks_per_shard()


def _worker(args: list[str], env: dict) -> list[dict]:
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def tpu_memory(chips: int, steps: list[tuple[str, int]]) -> list[dict]:
    """Per-device HBM of each (mask, L) step, in a process with `chips` SPMD devices and libtpu loaded."""
    from torch_splash_jax.tpu_time import aot

    env = aot.environment(os.environ.get("TORCH_SPLASH_LIBTPU_DIR", str(ROOT / ".venv" / "libtpu")))
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(chips))
    return _worker(["--tpu-worker", str(chips), *(f"{mask}:{length}" for mask, length in steps)], env)


def _tpu_worker(chips: int, steps: list[str]) -> None:
    from torch_splash.fit import planned_for_tpu

    with planned_for_tpu():  # plan and lower the kernels for TPU
        if chips > 1:
            import torch_xla.runtime as xr

            xr.use_spmd()
        import bench_tpu_memory

        target = {1: "v5e", 4: "v5e:2x2", 16: "v5e:4x4"}[chips]
        for mask, length in (step.split(":") for step in steps):
            length = int(length)
            start = time.perf_counter()
            row = bench_tpu_memory.measure(length, True, target, chips, "balanced" if chips > 1 else None, mask)
            seconds = round(time.perf_counter() - start, 1)
            print(json.dumps(dict(mask=mask, chips=chips, L=length, seconds=seconds, **row)), flush=True)


def cpu_step_time(length: int, rounds: int) -> list[dict]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    return _worker(["--cpu-worker", str(length), str(rounds)], env)


def _cpu_worker(length: int, rounds: int) -> None:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import torch_splash

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(4), (4,), ("seq",))
    device = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    cpu = [torch.randn(1, h, length, 64, generator=g) for h in (4, 2, 2)]

    inputs = [t.to(device) for t in cpu]
    torch_xla.sync(wait=True)

    def step(layout):
        start = time.perf_counter()
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        out = torch_splash.attention(
            q, k, v, "causal", partition_spec=(None, None, "seq", None), mesh=mesh, sequence_layout=layout
        )
        out.square().sum().backward()
        torch_xla.sync(wait=True)
        for grad in (q.grad, k.grad, v.grad):
            grad.cpu()  # the step's results, fetched: the execution has finished
        return time.perf_counter() - start

    times = {"contiguous": [], "balanced": []}
    for layout in times:
        step(layout)  # compile
    for _ in range(rounds):
        for layout in times:
            times[layout].append(step(layout))
    for layout, samples in times.items():
        print(json.dumps(dict(layout=layout, L=length, step_s=statistics.median(samples))), flush=True)


def run(quick: bool) -> dict:
    lengths = [32768] if quick else [32768, 131072]
    blocks = [
        dict(L=length, devices=shards, layout=layout, blocks=blocks_per_device(length, shards, layout))
        for length in lengths
        for shards in (4, 16)
        for layout in ("contiguous", "balanced")
    ]
    for row in blocks:
        print(json.dumps(row), flush=True)
    memory = []
    if quick:  # the step unsharded, and over 4 chips causal and with a per-head mask
        plans = {1: [("causal", 8192)], 4: [("causal", 8192), ("per-head", 8192)]}
    else:
        causal = [("causal", length) for length in (32768, 131072, 262144)]
        plans = {chips: causal + [("per-head", 32768), ("per-head", 131072)] for chips in (1, 4, 16)}
    for chips, steps in plans.items():
        memory += tpu_memory(chips, steps)
        print(json.dumps(memory[-1]), flush=True)
    cpu = cpu_step_time(1024 if quick else 4096, 1 if quick else 5)
    return dict(
        shape=dict(batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", mask="causal"),
        blocks=blocks,
        tpu_memory=memory,
        cpu_step=dict(batch=1, heads=4, kv_heads=2, head_dim=64, dtype="float32", devices=4, rows=cpu),
    )


def main():
    if sys.argv[1:2] == ["--tpu-worker"]:
        return _tpu_worker(int(sys.argv[2]), sys.argv[3:])
    if sys.argv[1:2] == ["--cpu-worker"]:
        return _cpu_worker(int(sys.argv[2]), int(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (the test suite runs it)")
    args = parser.parse_args()
    report.save("sequence", run(args.quick), args.quick, "./dev.sh bench-sequence")


if __name__ == "__main__":
    main()
