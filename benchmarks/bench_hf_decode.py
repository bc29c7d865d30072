"""One HuggingFace decode step on TPU without a TPU: attn_implementation="splash" against "sdpa".

One LlamaForCausalLM layer (hidden 4096, MLP 14336, 32 query heads over 8 kv heads of 128, vocab
512, bf16) with a StaticCache allocated and filled beforehand (so the cache is an argument of the
step, updated in place, as in a generate loop's steady state), one decode step (one token per
sequence, the position as data: `cache_position`) built on torch_xla's CPU device and checked by
`torch_splash.fit.check(..., estimate_time=True)` for one device of each generation: the step's HBM
from the TPU compiler, the attention kernels' time estimated from its schedule, the rest of the
step at XLA's own estimate. With "sdpa" the whole step is XLA's estimate. Estimates, not
measurements: docs/tpu_time.md says what they leave out. The HBM floor is reading the layer's k and
v caches once.

    ./dev.sh bench-hf-decode           # v5e, v5p, v6e, v7x; caches of 4K, 8K and 32K tokens; B=8
    ./dev.sh bench-hf-decode --quick   # v5e, a 4K cache

Writes benchmarks/results/hf_decode.json (or hf_decode_quick.json). Runs in the torch_xla set; fit
compiles with libtpu 0.0.21 (0.0.52 for v7x) and estimates with 0.0.52 (dev.sh installs both).
"""

import argparse
import gc
import json

import report  # benchmarks/report.py: results files and their tables

GENERATIONS = ("v5e", "v5p", "v6e", "v7x")
CACHES = (4096, 8192, 32768)
BATCH = 8
LAYER = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=1,
    vocab_size=512,
)


def _step_report(model, impl: str, cache_len: int, generation: str):
    """fit's Report of one decode step at position cache_len // 2 of a filled cache."""
    import torch
    import torch_xla
    import transformers

    from torch_splash import fit

    device = torch_xla.device()
    model.set_attn_implementation(impl)
    # A new cache and token each time: a checked step is built, never executed, so the previous
    # check's step is still pending on the old ones (and would be compiled into this one).
    cache = transformers.StaticCache(config=model.config, max_cache_len=cache_len)
    cache.early_initialization(BATCH, LAYER["num_key_value_heads"], LAYER["head_dim"], torch.bfloat16, device)
    token = torch.zeros(BATCH, 1, dtype=torch.long, device=device)
    position = torch.tensor([cache_len // 2], device=device)
    torch_xla.sync()  # the cache and inputs are device data, as after a prefill

    def step():
        with torch.no_grad():
            out = model(token, past_key_values=cache, cache_position=position, use_cache=True)
        token.copy_(out.logits[:, -1:].argmax(-1))  # the next step's input: live, so the step computes it

    report = fit.check(step, topology=generation, estimate_time=True)
    print(json.dumps(dict(generation=generation, cache=cache_len, impl=impl)), flush=True)
    return report


def _row(generation: str, cache_len: int, reports: dict) -> dict:
    """One row of the results: {impl: Report} as figures."""
    from torch_splash_jax import tpu_time

    cache_bytes = 2 * BATCH * LAYER["num_key_value_heads"] * cache_len * LAYER["head_dim"] * 2
    row = dict(
        generation=generation,
        cache=cache_len,
        batch=BATCH,
        floor=cache_bytes / tpu_time.chip(generation).hbm_bandwidth,
    )
    for impl in ("sdpa", "splash"):
        r = reports[impl]
        if r.error is not None or not r.fits:
            row[impl] = dict(error=str(r).splitlines()[-1][:300])
            continue
        attention = r.attention_seconds or 0.0
        row[impl] = dict(
            attention=attention,
            rest=r.rest_seconds,
            seconds=attention + (r.rest_seconds or 0.0),
            calls=r.attention_calls,
            hbm=r.total,
            donated=r.donated,
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    import torch
    import torch_xla
    import transformers

    import torch_splash.hf  # noqa: F401  (attn_implementation="splash")

    generations, caches = (("v5e",), (4096,)) if options.quick else (GENERATIONS, CACHES)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LAYER, max_position_embeddings=max(caches))
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval().to(torch_xla.device())
    torch_xla.sync()
    rows = []
    for cache_len in caches:
        for generation in generations:
            reports = {impl: _step_report(model, impl, cache_len, generation) for impl in ("sdpa", "splash")}
            rows.append(_row(generation, cache_len, reports))
            gc.collect()  # the steps' caches
    report.save("hf_decode", dict(rows=rows, layer=LAYER), options.quick, "./dev.sh bench-hf-decode")


if __name__ == "__main__":
    main()
