"""FlexAttention through splash: HBM of a training step on TPU, the host's cost of a BlockMask, and
CPU time against torch's own flex_attention.

1. HBM per chip (the TPU compiler's own figure, libtpu deviceless, one v5e chip) of a torch_xla
   training step of an attention block (B=1, 16 query heads, 8 kv heads, head_dim 128, bf16) with
   a document-causal mask over packed sequences, for (a) the dense -inf bias plus SDPA that
   TorchTPU's flex_attention patch runs (`create_mask` of the BlockMask's mask_mod) and (b)
   `torch_splash.flex_attention` with the BlockMask.
2. Documents packed anew: the training steps of other packings, and how many of them are graphs
   torch_xla has not seen (and would compile).
3. On the host, per length: `create_block_mask` itself (torch.compile'd, as torch advises at long
   lengths; the second call, so its compile is not counted), turning its BlockMask into splash
   masks (`torch_splash._flex_masks.block_mask_masks`), building the TPU plan's block tables
   (`torch_splash_jax.program`, tables only: its functions are jitted on first call), both again
   for the next layer, which passes the same BlockMask, and what the first and the next layer
   under torch.compile convert (`graph_tables` run eagerly, as the aot_eager backend runs them, in
   every layer; then `graph_masks`, which the next layer finds kept, and the tables).
4. CPU time of a forward and backward: torch's flex_attention eager and compiled, and
   torch_splash.flex_attention (interpret-mode kernels) eager and under
   torch.compile(fullgraph=True), as ratios to torch's eager.

    ./dev.sh bench-flex            # 1 to 3 at L = 8K to 128K, 4 at L = 1K and 2K
    ./dev.sh bench-flex --quick    # 8K only (2 new packings), 4 at L = 256 (the test suite runs this)

Writes benchmarks/results/flex.json (or flex_quick.json).
"""

import argparse
import json
import time

import bench_tpu_memory  # its libtpu process and compile step
import report  # benchmarks/report.py: results files and their tables

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def document_ids(length: int, seed: int = 0):
    """(1, L) document ids of packed sequences: documents of 256 to 4095 tokens, in order."""
    import torch

    generator, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < length:
        lengths.append(min(int(torch.randint(256, 4096, (1,), generator=generator)), length - sum(lengths)))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def document_causal(doc):
    from torch.nn.attention.flex_attention import and_masks

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return and_masks(causal, same_document)


def block_mask(length: int, compiled: bool = True, seed: int = 0):
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = document_causal(document_ids(length, seed))
    return create_block_mask(mask_mod, 1, None, length, length, device="cpu", _compile=compiled)


def step_hlo(length: int, impl: str, seed: int = 0) -> str:
    """The HLO of one training step, left unexecuted in torch_xla's graph. impl: "splash"
    (torch_splash.flex_attention with the BlockMask) or "dense" (TorchTPU's patch: the mask_mod as
    a dense -inf bias, and SDPA). seed: the documents' packing."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    from torch.nn.attention.flex_attention import create_mask

    import torch_splash
    from torch_splash import _compat

    device = torch_xla.device()
    dim = HEADS * HEAD_DIM
    torch.manual_seed(0)
    w_qkv = torch.randn(dim, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16).to(device).requires_grad_()
    w_out = torch.randn(dim, dim, dtype=torch.bfloat16).to(device).requires_grad_()
    x = torch.randn(1, length, dim, dtype=torch.bfloat16).to(device)
    q, k, v = (x @ w_qkv).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q, k, v = (t.view(1, length, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    if impl == "splash":
        out = torch_splash.flex_attention(q, k, v, block_mask=block_mask(length, seed=seed), enable_gqa=True)
    else:
        doc = document_ids(length, seed).to(device)
        allowed = create_mask(document_causal(doc), 1, 1, length, length, device=device)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=device).masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    loss = (out.transpose(1, 2).reshape(1, length, dim) @ w_out).float().square().mean()
    loss.backward()
    with torch.no_grad():
        for w in (w_qkv, w_out):
            w -= 0.1 * w.grad
    return _compat.pending_hlo_text([w_qkv, w_out, loss])


def hbm(length: int, impl: str, generation: str = "v5e") -> dict:
    return bench_tpu_memory.compiled(step_hlo(length, impl), generation)


def packed_anew(length: int, packings: int = 4) -> dict:
    """Training steps over documents packed anew (seeds 1, 2, ...) against the first packing's: how
    many of them torch_xla sees as a graph it has not compiled (their HLO differs from every one
    before), and the median seconds to build a new packing's step on the host (BlockMask, splash
    masks, tables, the graph; a repeat of a packing takes the masks from the cache)."""
    import statistics

    seen, new, seconds = {step_hlo(length, "splash", seed=0)}, 0, []
    for seed in range(1, packings + 1):
        start = time.perf_counter()
        text = step_hlo(length, "splash", seed=seed)
        seconds.append(time.perf_counter() - start)
        new += text not in seen
        seen.add(text)
    return dict(packings=packings, new_graphs=new, build_s=round(statistics.median(seconds), 2))


def host_cost(length: int) -> dict:
    """Seconds of create_block_mask, of turning its BlockMask into splash masks, of the TPU plan's
    block tables, and of both again for the next layer that passes the same BlockMask."""
    import torch_splash_jax
    from torch_splash._flex_masks import block_mask_masks
    from torch_splash._flex_ops import graph_masks, graph_tables
    from torch_splash_jax.plan import plan

    block_mask(length)  # create_block_mask compiles for this length first
    start = time.perf_counter()
    mask = block_mask(length)
    create = time.perf_counter() - start
    start = time.perf_counter()
    (spec,) = block_mask_masks(mask, 1, HEADS, length, length)
    convert = time.perf_counter() - start

    def tables_of(spec):
        planned = plan(
            batch=1,
            num_q_heads=HEADS,
            num_kv_heads=KV_HEADS,
            q_len=length,
            kv_len=length,
            head_dim=HEAD_DIM,
            dtype="bfloat16",
            mask=spec,
            platform="tpu",
        )
        return torch_splash_jax.program(planned)

    start = time.perf_counter()
    tables_of(spec)
    tables = time.perf_counter() - start
    start = time.perf_counter()
    tables_of(*block_mask_masks(mask, 1, HEADS, length, length))
    next_layer = time.perf_counter() - start

    def compiled_layer() -> float:
        start = time.perf_counter()
        table, where, blocks, assign, _ = graph_tables(mask, 1, HEADS)
        tables_of(*graph_masks(table, where, blocks, assign, (length, length), tuple(mask.BLOCK_SIZE)))
        return time.perf_counter() - start

    compiled_first, compiled_next = compiled_layer(), compiled_layer()
    return dict(
        create_block_mask_s=round(create, 3),
        to_masks_s=round(convert, 3),
        tables_s=round(tables, 3),
        next_layer_s=round(next_layer, 4),
        compiled_layer_s=round(compiled_first, 3),
        compiled_next_layer_s=round(compiled_next, 3),
        partial_blocks=int((spec.kinds == 1).sum()),
        full_blocks=int((spec.kinds == 2).sum()),
        blocks=int(spec.kinds.size),
    )


def cpu_time(length: int, repeats: int) -> dict:
    """Median seconds of a forward, and of a forward and backward (B=1, 4/2 heads, head_dim 64, f32,
    document-causal). torch's compiled flex_attention runs forward only on the CPU: torch 2.9's
    inductor fails on its backward there, and torch 2.15 refuses it ("does not support backward on
    CPU")."""
    import statistics

    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    import torch_splash

    mask = create_block_mask(document_causal(document_ids(length)), 1, None, length, length, device="cpu")
    compiled = torch.compile(torch_flex)
    shapes = [(1, 4, length, 64), (1, 2, length, 64), (1, 2, length, 64)]
    q, k, v = (torch.randn(s).requires_grad_() for s in shapes)

    def median_seconds(fn, backward: bool) -> float:
        samples = []
        for _ in range(repeats + 1):  # the first call compiles: not counted
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                out = fn(q, k, v, block_mask=mask, enable_gqa=True)
                if backward:
                    out.sum().backward()
            samples.append(time.perf_counter() - start)
        return round(statistics.median(samples[1:]), 4)

    implementations = {
        "torch_eager": torch_flex,
        "torch_compiled": compiled,
        "splash": torch_splash.flex_attention,
        "splash_compiled": torch.compile(torch_splash.flex_attention, fullgraph=True),
    }
    times = {f"forward_{name}": median_seconds(fn, False) for name, fn in implementations.items()}
    trained = ("torch_eager", "splash", "splash_compiled")
    times |= {f"training_{name}": median_seconds(implementations[name], True) for name in trained}
    return times


def run(quick: bool) -> dict:
    from torch_splash.fit import planned_for_tpu
    from torch_splash_jax import mosaic

    lengths = [8192] if quick else [8192, 16384, 32768, 65536, 131072]
    rows = []
    for length in lengths:
        row = dict(L=length, **host_cost(length))
        with planned_for_tpu():
            for impl in ("splash", "dense"):
                row[impl] = hbm(length, impl)
            row["packed_anew"] = packed_anew(length, 2 if quick else 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    cpu = [dict(L=length, **cpu_time(length, 1 if quick else 3)) for length in ([256] if quick else [1024, 2048])]
    print(json.dumps(cpu), flush=True)
    return dict(
        shape=dict(batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16"),
        mask="document-causal, documents of 256 to 4095 tokens",
        libtpu=mosaic.PINNED_LIBTPU,
        rows=rows,
        cpu=cpu,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8K only; CPU time at 256 tokens")
    args = parser.parse_args()
    bench_tpu_memory.in_a_libtpu_process(__file__)
    report.save("flex", run(args.quick), args.quick, "./dev.sh bench-flex")


if __name__ == "__main__":
    main()
