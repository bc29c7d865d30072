"""Training-step time on torch_xla's CPU device: in-graph transport vs DLPack, in one run.

A 2-layer attention model (B=2, L=512, dim 128, 4 query heads, 2 kv heads, causal) trained with
SGD; each step is forward, backward, update and `torch_xla.sync()`. Reports the median step time
and the XLA executions per step for `transport="graph"`, `transport="dlpack"` and, for reference,
torch SDPA on the same device.
Run: ./dev.sh bench-transports [--quick]   (--quick: 3 steps, a smoke run, to transports_quick.json)
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_bridge.py

import statistics
import sys
import time

import report  # benchmarks/report.py: results files and their tables
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met

import torch_splash
from torch_splash import _compat

DIM, HEADS, KV_HEADS, LENGTH, BATCH, STEPS = 128, 4, 2, 512, 2, 6


class Model(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn, self.head_dim = attn, DIM // HEADS
        self.embed = nn.Embedding(100, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * self.head_dim) for _ in range(2))
        self.out = nn.Linear(DIM, 100)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, length, _ = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).split([HEADS * self.head_dim, KV_HEADS * self.head_dim, KV_HEADS * self.head_dim], -1)
            q, k, v = (t.view(b, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
            x = x + self.attn(q, k, v).transpose(1, 2).reshape(b, length, DIM)
        return self.out(x)


def executions():
    data = met.metric_data("ExecuteTime")
    return 0 if data is None else data[0]


def run(attn, steps=STEPS):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = Model(attn).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 100, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(1)).to(device)
    times, counts = [], []
    for _ in range(steps):
        before, start = executions(), time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        _compat.wait_device_ops()
        times.append(time.perf_counter() - start)
        counts.append(executions() - before)
    return {"step_s": statistics.median(times[2:]), "executions_per_step": counts[-1], "loss": loss.item()}


def main(quick=False):
    steps = 3 if quick else STEPS
    results = {
        "graph": run(lambda q, k, v: torch_splash.attention(q, k, v, "causal", transport="graph"), steps),
        "dlpack": run(lambda q, k, v: torch_splash.attention(q, k, v, "causal", transport="dlpack"), steps),
        "sdpa": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), steps),
    }
    results["setting"] = f"B={BATCH} L={LENGTH}, 2 layers, torch_xla CPU device"
    report.save("transports", results, quick, "./dev.sh bench-transports")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
