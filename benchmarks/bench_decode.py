"""Decoding on TPU without a TPU: the decode kernel against the splash kernels, dense attention in XLA
ops, and the HBM floor, per attention call, from the TPU compiler's schedule (libtpu 0.0.52,
deviceless). Every figure is an estimate (torch_splash_jax.tpu_time and its decode module say what they
leave out); the dense column is XLA's own estimate of its ops, not a schedule's.

1. Decode steps: one query token per sequence against a full cache (the query at its last
   position), 32 query heads over 8 kv heads, head_dim 128, bf16, caches of 4K to 128K tokens,
   B = 1, 8, 32 and 64, on v5e, v5p, v6e and v7x: the decode kernel (its program: the key ranges,
   the kernel, the combination), the splash forward (torch_splash's plan for the same call: its
   kernel and the XLA ops around it), dense attention (q k^T, softmax, p v in XLA ops: what SDPA
   lowers to), and reading k and v once at the chip's HBM bandwidth.
2. Chunked prefill: 16 to 512 new tokens against a 32K cache, B = 1: decode kernel against the
   splash forward, which is where the default rule's threshold (torch_splash_jax.decode.AUTO_MAX_ROWS)
   comes from.

    ./dev.sh bench-decode            # both (about 250 compiles: about 20 minutes on 2 cores)
    ./dev.sh bench-decode --quick    # one decode step and one chunk, on v5e

Writes benchmarks/results/decode.json (or decode_quick.json). Runs in the current set (libtpu 0.0.52
knows v7x).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import report  # benchmarks/report.py: results files and their tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATIONS = ("v5e", "v5p", "v6e", "v7x")
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
STEPS = [(g, length, b) for g in GENERATIONS for length in (4096, 8192, 32768, 131072) for b in (1, 8, 32, 64)]
CHUNKS = [(g, 32768, n) for g in GENERATIONS for n in (16, 64, 128, 512)]
QUICK_STEPS, QUICK_CHUNKS = [("v5e", 4096, 8)], [("v5e", 4096, 64)]


def _libtpu_dir() -> str:
    import sysconfig

    return os.environ.get("TORCH_SPLASH_LIBTPU_DIR") or sysconfig.get_paths()["purelib"]


def _plans(batch: int, q_len: int, kv_len: int):
    """(decode plan, splash plan) of one call: the last q_len positions of a cache of kv_len keys."""
    import torch_splash_jax as tsj

    common = dict(
        batch=batch,
        num_q_heads=HEADS,
        num_kv_heads=KV_HEADS,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=HEAD_DIM,
        head_dim_v=HEAD_DIM,
        dtype="bfloat16",
        mask=tsj.CausalMask(kv_len - q_len),
        scale=HEAD_DIM**-0.5,
        soft_cap=None,
        has_segment_ids=False,
        has_sinks=False,
        platform="tpu",
    )
    # the baseline is JAX's splash forward
    return tsj.decode.decode_plan(**common), tsj.plan(**common, block_sizes=tsj.BlockSizes(forward_kernel="splash"))


def _estimate(estimate) -> dict:
    kernels = [
        dict(name=k.name, seconds=k.seconds, schedule=k.schedule_seconds, hbm=k.hbm_seconds) for k in estimate.kernels
    ]
    return dict(kernel=estimate.kernel_seconds, rest=estimate.rest_seconds, seconds=estimate.seconds, kernels=kernels)


def _attempt(compute) -> dict:
    """compute()'s result, or what refused it (the compiler's own words, first line)."""
    try:
        return compute()
    except Exception as error:  # noqa: BLE001  (a refusal is a result: the row says it)
        return dict(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300])


def _row(generation: str, kv_len: int, batch: int, q_len: int, dense: bool) -> dict:
    from torch_splash_jax import tpu_time
    from torch_splash_jax.tpu_time import decode as decode_time

    decode_plan, splash_plan = _plans(batch, q_len, kv_len)
    call = decode_time.DecodeCall(decode_plan)
    row = dict(
        generation=generation,
        kv_len=kv_len,
        batch=batch,
        q_len=q_len,
        floor=decode_time.hbm_floor_seconds(call, generation),
        blocks=dict(heads=decode_plan.block_heads, kv=decode_plan.block_kv, rows=decode_plan.block_rows),
        decode=_attempt(lambda: _estimate(decode_time.decode_estimate(call, generation))),
        splash=_attempt(lambda: _estimate(tpu_time.splash_estimate(splash_plan, generation, backward=False))),
    )
    if dense:
        row["dense"] = _attempt(
            lambda: dict(zip(("cycles", "bytes"), decode_time.dense_attention_seconds(call, generation)))
        )
    print(json.dumps({k: row[k] for k in ("generation", "kv_len", "batch", "q_len")}), flush=True)
    return row


def worker(quick: bool) -> dict:
    steps, chunks = (QUICK_STEPS, QUICK_CHUNKS) if quick else (STEPS, CHUNKS)
    return dict(
        steps=[_row(g, length, b, 1, dense=True) for g, length, b in steps],
        chunks=[_row(g, length, 1, n, dense=False) for g, length, n in chunks],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        pathlib.Path(options.worker).write_text(json.dumps(worker(options.quick)))
        return
    from torch_splash_jax import tpu_time

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as directory:
        dumps = pathlib.Path(directory) / "dumps"
        dumps.mkdir()
        out = pathlib.Path(directory) / "results.json"
        env = tpu_time.environment(_libtpu_dir(), str(dumps))
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "benchmarks"), str(ROOT)])
        command = [sys.executable, __file__, "--worker", str(out)] + (["--quick"] if options.quick else [])
        subprocess.run(command, env=env, check=True)
        results = json.loads(out.read_text())
    results["libtpu"] = tpu_time.ESTIMATOR_LIBTPU
    report.save("decode", results, options.quick, "./dev.sh bench-decode")


if __name__ == "__main__":
    main()
