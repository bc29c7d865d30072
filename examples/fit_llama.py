"""Will a Llama training step fit on one v5e chip? torch_splash.fit answers without a TPU.

A HuggingFace LlamaForCausalLM (2 layers, hidden 2048, 16 query heads and 8 kv heads of 128, bf16,
a 512-token vocabulary so that the logits stay out of the way): one training step (forward, loss,
backward, SGD) on torch_xla's CPU device, with attn_implementation="splash" and "sdpa", compiled
by the TPU compiler for one v5e chip at several sequence lengths. Then the longest length that
fits with splash, found by bisection.

    ./dev.sh fit-llama            # 8K to 128K tokens (several minutes)
    ./dev.sh fit-llama --quick    # a tiny model at 1K tokens, then searched at 2K and 4K (the tests run this)
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import argparse
import pathlib
import sys

import torch
import torch_xla
from transformers import LlamaConfig, LlamaForCausalLM

import torch_splash.hf  # noqa: F401  (attn_implementation="splash")
from torch_splash import fit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import report  # noqa: E402  (benchmarks/report.py: results files and their tables)

FULL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
QUICK = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def make_step(config: LlamaConfig, attention: str, length: int):
    """(step_fn, args) of one training step at `length` tokens, on torch_xla's CPU device."""
    device = torch_xla.device()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).to(device)
    model.set_attn_implementation(attention)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (1, length)).to(device)

    def step(model, ids):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step, (model, ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--quick", action="store_true", help="a tiny model at 1K tokens, to fit_quick.json")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    lengths = [1024] if args.quick else args.lengths
    config = LlamaConfig(
        vocab_size=512, num_hidden_layers=2, max_position_embeddings=max(lengths), attention_dropout=0.0, **sizes
    )
    rows = []
    for attention in ("splash", "sdpa"):
        for length in lengths:
            result = fit.check(*_step_and_args(config, attention, length), topology=args.topology)
            print(f"{attention:6} L={length:7}: {result}")
            rows.append(dict(attention=attention, L=length, **_fields(result)))
            if not result.fits:
                break  # longer lengths need more
    best, searched = fit.largest_fitting(
        lambda length: make_step(config, "splash", length),
        [2 * lengths[-1], 4 * lengths[-1]] if args.quick else range(lengths[-1], 4 * lengths[-1] + 1, lengths[-1] // 2),
        topology=args.topology,
    )
    print(f"splash: the longest length searched that fits is {best}")
    results = dict(
        rows=rows,
        model=f"LlamaForCausalLM, 2 layers, {', '.join(f'{k} {v}' for k, v in sizes.items())}, bf16, vocab 512, B=1",
        topology=args.topology,
        largest_splash=best,
        searched=sorted(searched),
    )
    report.save("fit", results, args.quick, "./dev.sh fit-llama")


def _step_and_args(config, attention, length):
    step, step_args = make_step(config, attention, length)
    return (step, *step_args)


def _fields(result: fit.Report) -> dict:
    return dict(fits=result.fits, total=result.total, temporaries=result.temporaries, needed=result.needed,
                capacity=result.capacity, error=result.error)  # fmt: skip


if __name__ == "__main__":
    main()
