"""Block tables for long context, and the cost of a sliding window as L grows, in one run.

1. Building the block tables (MaskInfo) a call needs (forward and dkv, 512 blocks, one mask shared
   by the heads): `torch_splash_jax.tables` vs JAX's own `_process_mask` on the same mask and blocks.
   Targets: 128K causal and 128K sliding-window (4096) tables under 1 s each; >= 20x faster than
   JAX at 32K. Then the same for a per-head mask (4 heads: causal, local 1024, causal, chunked
   4096), whose partial blocks are stored: target >= 20x faster than JAX at 32K, 128K under 10 s.
2. Forward time of a 1024-token sliding window (`LocalMask(1023)`) from L=2K to 16K: splash (no
   grad, interpret mode) next to torch SDPA with the equivalent dense bool mask. B=1, H=2, D=64.

Run: ./dev.sh bench-masks   (or: .venv/bin/python benchmarks/bench_masks.py [--quick])
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_bridge.py

import sys
import time

import numpy as np
import report  # benchmarks/report.py: results files and their tables
import torch
import torch.nn.functional as F
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jax_masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as jax_info

import torch_splash
from torch_splash_jax import masks, tables

BLOCK = 512


def forward_and_dkv_seconds(build) -> float:
    """Seconds to build the forward and the dkv tables: build(block_shape, is_dkv)."""
    start = time.perf_counter()
    for is_dkv in (False, True):
        build((BLOCK, BLOCK), is_dkv)
    return time.perf_counter() - start


def ours(spec, length):
    return forward_and_dkv_seconds(
        lambda shape, is_dkv: tables.mask_info.__wrapped__(spec, length, length, length, shape, is_dkv, True, True)
    )


def jax_builder(bound):
    """JAX's own builder on a bound jax MultiHeadMask."""
    return forward_and_dkv_seconds(
        lambda shape, is_dkv: jax_info._process_mask.__wrapped__(bound, shape, is_dkv, shrink_grid=True)
    )


def tables_benchmark(quick):
    rows = []
    for name, spec in (("causal", masks.CausalMask(0)), ("sliding window 4096", masks.LocalMask(4095, 0))):
        for length in (8192,) if quick else (8192, 16384, 32768, 65536, 131072, 1048576):
            row = {"mask": name, "L": length, "ours_s": ours(spec, length)}
            if length <= 65536:
                row["jax_s"] = jax_builder(masks.bind(spec, 1, length, length, length))
                row["speedup"] = row["jax_s"] / row["ours_s"]
            rows.append(row)
            print(row, flush=True)
    return rows


PER_HEAD = (masks.CausalMask(), masks.LocalMask(1024, 0), masks.CausalMask(), masks.ChunkedCausalMask(4096))


def ours_per_head(length):
    positions = np.arange(length)[None]
    return forward_and_dkv_seconds(
        lambda shape, is_dkv: tables.partial_mask_info(PER_HEAD, positions, length, length, length, shape, is_dkv, True)
    )


def per_head_benchmark(quick):
    rows = []
    for length in (8192,) if quick else (8192, 16384, 32768, 131072, 262144):
        row = {"L": length, "ours_s": ours_per_head(length)}
        if length <= 32768:
            bound = jax_masks.MultiHeadMask([masks.bind(m, 1, length, length, length).masks[0] for m in PER_HEAD])
            row["jax_s"] = jax_builder(bound)
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
    results = {
        "tables": tables_benchmark(quick),
        "per_head_tables": per_head_benchmark(quick),
        "window_1024": window_benchmark(quick),
    }
    report.save("masks", results, quick, "./dev.sh bench-masks")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
