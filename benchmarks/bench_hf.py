"""Training-step time of tiny HF models on CPU: attn_implementation="splash" vs "sdpa", in one run.

Two models built from configs (2 layers, hidden 256, 4 query heads of 64, 2 kv heads, f32): a
Llama (causal) and a Mistral with a 256-token sliding window. One step = forward, loss, backward
(no optimizer: the attention is what differs). B=1, L = 512, 1024, 2048, 4096. Rounds alternate
splash and sdpa; the figure is the median of per-round ratios splash/sdpa.
Run: .venv/bin/python benchmarks/bench_hf.py [--rounds 3] [--lengths 512 1024 2048 4096]
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_bridge.py

import argparse
import statistics
import time

import report  # benchmarks/report.py: results files and their tables
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

import torch_splash.hf  # noqa: F401

COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
MODELS = {
    "llama (causal)": lambda: LlamaConfig(**COMMON),
    "mistral (sliding window 256)": lambda: MistralConfig(**COMMON, sliding_window=256),
}


def step_time(model, impl, ids):
    model.set_attn_implementation(impl)
    model.zero_grad()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--quick", action="store_true", help="one round at L=256 (a smoke run), to hf_quick.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.lengths = 1, [256]
    torch.set_num_threads(os.cpu_count())
    rows = []
    for name, config in MODELS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa")
        for length in args.lengths:
            ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
            step_time(model, "splash", ids)  # warm-up: plans and compiles the kernels for this shape
            step_time(model, "sdpa", ids)
            times = {"splash": [], "sdpa": []}
            for _ in range(args.rounds):
                for impl in times:
                    times[impl].append(step_time(model, impl, ids))
            ratio = statistics.median(a / b for a, b in zip(times["splash"], times["sdpa"]))
            row = {
                "model": name,
                "length": length,
                "splash_s": statistics.median(times["splash"]),
                "sdpa_s": statistics.median(times["sdpa"]),
                "ratio": ratio,
            }
            rows.append(row)
            print(
                f"{name:30s} L={length:5d}  splash {row['splash_s']:7.3f} s  sdpa {row['sdpa_s']:7.3f} s  "
                f"splash/sdpa {ratio:5.2f}x",
                flush=True,
            )
    report.save("hf", {"rounds": args.rounds, "rows": rows}, args.quick, "./dev.sh bench-hf")


if __name__ == "__main__":
    main()
