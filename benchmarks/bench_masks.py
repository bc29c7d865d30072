"""Block tables for long context, and the cost of a sliding window as L grows, in one run.

1. Building the block tables (MaskInfo) a call needs (forward and dkv, 512 blocks, one mask shared
   by the heads): `jax_core.tables` vs JAX's own `_process_mask` on the same mask and blocks.
   Targets: 128K causal and 128K sliding-window (4096) tables under 1 s each; >= 20x faster than
   JAX at 32K.
2. Forward time of a 1024-token sliding window (`LocalMask(1023)`) from L=2K to 16K: splash (no
   grad, interpret mode) next to torch SDPA with the equivalent dense bool mask. B=1, H=2, D=64.

Run: ./dev.sh bench-masks   (or: .venv/bin/python benchmarks/bench_masks.py [--quick])
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_bridge.py

import sys
import time

import report  # benchmarks/report.py: results files and their tables
import torch
import torch.nn.functional as F
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as jax_info

import torch_splash
from jax_core import masks, tables

BLOCK = 512


def ours(spec, length):
    start = time.perf_counter()
    for is_dkv in (False, True):
        tables.mask_info.__wrapped__(spec, length, length, length, (BLOCK, BLOCK), is_dkv, True, True)
    return time.perf_counter() - start


def jax_builder(spec, length):
    bound = masks.bind(spec, 1, length, length, length)
    start = time.perf_counter()
    for is_dkv in (False, True):
        jax_info._process_mask.__wrapped__(bound, (BLOCK, BLOCK), is_dkv, shrink_grid=True)
    return time.perf_counter() - start


def tables_benchmark(quick):
    rows = []
    for name, spec in (("causal", masks.CausalMask(0)), ("sliding window 4096", masks.LocalMask(4095, 0))):
        for length in (8192, 32768) if quick else (8192, 16384, 32768, 65536, 131072, 1048576):
            row = {"mask": name, "L": length, "ours_s": ours(spec, length)}
            if length <= (32768 if quick else 65536):
                row["jax_s"] = jax_builder(spec, length)
                row["speedup"] = row["jax_s"] / row["ours_s"]
            rows.append(row)
            print(row, flush=True)
    return rows


def window_benchmark(quick):
    rows = []
    mask = masks.LocalMask(1023, 0)
    for length in (2048,) if quick else (2048, 4096, 8192, 16384):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, length, 64, generator=g) for _ in range(3))
        torch_splash.attention(q, k, v, mask)  # compile
        start = time.perf_counter()
        torch_splash.attention(q, k, v, mask)
        splash_s = time.perf_counter() - start
        dense = torch.from_numpy(mask.dense(length, length))
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        sdpa_s = time.perf_counter() - start
        rows.append({"L": length, "splash_s": splash_s, "sdpa_dense_s": sdpa_s})
        print(rows[-1], flush=True)
    return rows


def main(quick=False):
    results = {"tables": tables_benchmark(quick), "window_1024": window_benchmark(quick)}
    report.save("masks", results, quick, "./dev.sh bench-masks")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
