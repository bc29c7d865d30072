"""Fine-tune a tiny HuggingFace Llama on CPU with attn_implementation="splash" and with "sdpa".

Both runs start from the same seed and see the same batches (right-padded, so padding goes through
the mask function as segment ids). The script prints both loss curves and their largest
difference, and saves a plot. No download: the model is built from a config.

    .venv/bin/python examples/hf_finetune.py [--steps 20] [--plot hf_finetune.png]
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import torch_splash.hf  # noqa: F401  registers attn_implementation="splash"

CONFIG = dict(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def batches(steps, batch_size=4, seq_len=128, vocab=CONFIG["vocab_size"]):
    """Counting sequences (random start, stride 1 or 3) of random lengths, right-padded: learnable
    in a few steps, and the stride has to be read from earlier tokens through attention."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch_size, 1), generator=g)
        stride = 1 + 2 * torch.randint(0, 2, (batch_size, 1), generator=g)
        ids = (start + stride * torch.arange(seq_len)) % vocab
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
        yield ids * mask, mask, ids.masked_fill(mask == 0, -100)


def finetune(attn_implementation, steps):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation=attn_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, start = [], time.perf_counter()
    for ids, mask, labels in batches(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plot", default="hf_finetune.png", help="where to save the loss plot ('' for none)")
    args = parser.parse_args()
    curves = {}
    for impl in ("splash", "sdpa"):
        curves[impl], seconds = finetune(impl, args.steps)
        print(f"{impl:>6}: {seconds:5.1f} s  loss " + " ".join(f"{x:.3f}" for x in curves[impl]))
    diff = max(abs(a - b) for a, b in zip(curves["splash"], curves["sdpa"]))
    print(f"largest loss difference over {args.steps} steps: {diff:.2e}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for impl, style in (("sdpa", "-"), ("splash", "--")):
            ax.plot(range(1, args.steps + 1), curves[impl], style, label=f'attn_implementation="{impl}"')
        ax.set(xlabel="step", ylabel="loss", title=f"tiny Llama fine-tune on CPU (max |diff| {diff:.1e})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    main()
