"""HBM per training step on TPU, from the TPU compiler itself (libtpu, deviceless: no TPU needed).

One training step of an attention block (x -> q, k, v projections -> causal attention -> output
projection -> loss -> backward -> SGD update; B=1, 16 query heads, 8 kv heads, head_dim 128,
bf16) is built in torch_xla's lazy graph on its CPU device, with torch_splash (kernels planned
and lowered for TPU) and with torch's SDPA as torch_xla runs it without torch_splash. The step is
taken as torch_splash.fit takes it (its serialized module, with the buffer donors torch_xla
declares at a step boundary: the weights updated in place) and compiled for one chip of each
generation; the compiler's memory analysis gives arguments + outputs - donated + temporaries per
chip. A step over the chip's HBM does not fit: refused by the compiler with the HBM it would
need, or compiled with a total over the chip (fit's verdict). Then the largest L (a multiple of
1024) each fits in one chip.

    ./dev.sh bench-tpu-memory            # L = 2K, 8K, 32K, 128K on v5e and v6e, and the largest L
    ./dev.sh bench-tpu-memory --quick    # L = 2K on v5e only (the test suite runs this)

Writes benchmarks/results/tpu_memory.json (or tpu_memory_quick.json).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import report  # benchmarks/report.py: results files and their tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
GiB = 1 << 30


def _libtpu_dir() -> str:
    return os.environ.get("TORCH_SPLASH_LIBTPU_DIR", str(ROOT / ".venv" / "libtpu"))


def in_a_libtpu_process(script: str) -> None:
    """Unless this process can load libtpu (deviceless), run `script` with this command line in one
    that can, and exit with its status."""
    if os.environ.get("TPU_SKIP_MDS_QUERY") is None:
        from torch_splash_jax.tpu_time import aot

        env = aot.environment(_libtpu_dir())
        env["PJRT_DEVICE"] = "CPU"
        sys.exit(subprocess.call([sys.executable, script, *sys.argv[1:]], env=env))


def per_head_mask():
    """Half the heads causal, half a causal 4096-token sliding window: a per-head mask, whose
    partial blocks the kernel reads from storage."""
    import torch_splash

    window = torch_splash.masks.LocalMask(4095, 0)
    return [torch_splash.masks.CausalMask() if h % 2 == 0 else window for h in range(HEADS)]


def step(
    length: int,
    use_splash: bool,
    shards: int = 1,
    layout: str | None = None,
    mask: str = "causal",
    context_parallel: str | None = None,
    generated_input: bool = False,
):
    """One training step at sequence length `length`, left unexecuted in torch_xla's graph, as
    torch_splash.fit takes it at the step's boundary (a `torch_splash._fit_graph.Step`: the module
    and the parameters torch_xla donates, here the two weights updated in place).
    shards > 1: the sequence split over that many devices (torch_xla SPMD, which the process must
    have enabled with as many devices): activations along the sequence, attention with the query
    sequence sharded in `layout`, by `context_parallel` ("all_gather" or "ring"). mask: "causal",
    or "per-head" (`per_head_mask`, splash only). generated_input: the input activations computed
    in the step from their positions (a temporary, each device computing its shard; XLA would
    generate random numbers whole on every device) instead of an argument, which would be a host
    buffer of the whole sequence first."""
    import torch
    import torch.nn.functional as F
    import torch_xla

    import torch_splash
    from torch_splash._fit_graph import pending_step

    device = torch_xla.device()
    dim = HEADS * HEAD_DIM
    torch.manual_seed(0)
    w_qkv = torch.randn(dim, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16).to(device).requires_grad_()
    w_out = torch.randn(dim, dim, dtype=torch.bfloat16).to(device).requires_grad_()
    if generated_input:  # a function of positions and a small parameter, which SPMD computes shard by shard
        positions = torch.arange(length, device=device, dtype=torch.float32)[None, :, None]
        x = torch.sin(positions * torch.randn(dim).to(device)[None, None, :]).to(torch.bfloat16)
    else:
        x = torch.randn(1, length, dim, dtype=torch.bfloat16).to(device)
    options = {}
    if shards > 1:
        import numpy as np
        import torch_xla.distributed.spmd as xs

        mesh = xs.Mesh(np.arange(shards), (shards,), ("seq",))
        xs.mark_sharding(x, mesh, (None, "seq", None))
        options = dict(
            partition_spec=(None, None, "seq", None),
            mesh=mesh,
            sequence_layout=layout,
            context_parallel=context_parallel,
        )
    q, k, v = (x @ w_qkv).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q, k, v = (t.view(1, length, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    if use_splash:
        out = torch_splash.attention(q, k, v, per_head_mask() if mask == "per-head" else "causal", **options)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    loss = (out.transpose(1, 2).reshape(1, length, dim) @ w_out).float().square().mean()
    loss.backward()
    with torch.no_grad():
        for w in (w_qkv, w_out):
            w -= 0.1 * w.grad
            w.grad = None  # as optimizer.zero_grad() leaves it: the gradients are the step's temporaries
    return pending_step([w_qkv, w_out, loss])


def measure(
    length: int,
    use_splash: bool,
    generation: str,
    shards: int = 1,
    layout: str | None = None,
    mask: str = "causal",
    context_parallel: str | None = None,
    generated_input: bool = False,
    schedule=None,
) -> dict:
    """The compiler's HBM figure for one step (per device), or why it does not fit. `generation`
    names the chips (a generation for one chip, a topology such as "v5e:4x4" for shards > 1).
    schedule: a function of the compiled program's scheduled HLO text, whose dict joins the row."""
    from torch_splash_jax import SplashConstraintError

    try:
        taken = step(length, use_splash, shards, layout, mask, context_parallel, generated_input)
    except SplashConstraintError as refused:  # torch_splash's own refusal, before any JAX work
        return dict(fits=False, refused=str(refused))
    return compiled(taken, generation, shards, schedule)


def compiled(taken, generation: str, shards: int = 1, schedule=None) -> dict:
    """The compiler's HBM figure (per device) for a step: a `Step` (`step`), compiled with its
    buffer donors as torch_splash.fit compiles it, or HLO text, donating nothing; or why it does
    not fit. A total over the chip's HBM does not fit, as fit says, though the compiler compiled it."""
    from torch_splash._fit_report import CAPACITY_GIB, over_capacity, parse_topology
    from torch_splash_jax.tpu_time import aot

    if isinstance(taken, str):
        proto, donors = aot.hlo_text_to_proto(taken), ()
    else:
        proto, donors = taken.proto, taken.donors
    try:
        memory = aot.compile_hlo(proto, generation, partitions=shards, donors=donors)
        capacity = int(CAPACITY_GIB[parse_topology(generation)[0]] * GiB)
        verdict = over_capacity(dict(fits=True, total=memory.total, capacity=capacity))
        row = dict(fits=verdict["fits"], bytes=memory.total, temp=memory.temp, donated=memory.aliased)
        if not verdict["fits"]:
            row["capacity"] = capacity
        return row | (schedule(memory.schedule()) if schedule else {})
    except aot.OutOfMemory as oom:
        return dict(fits=False, bytes=oom.used, capacity=oom.capacity, lower_bound=oom.lower_bound)
    except Exception as error:  # anything else the compiler refuses (a kernel's scoped VMEM, say): its first line
        return dict(fits=False, compiler_error=str(error).split("\n")[0][:300])


def largest_fitting(use_splash: bool, generation: str, start: int, limit: int) -> int:
    """The largest multiple of 1024 up to `limit` whose step fits (doubling, then bisection)."""
    low, high = 0, None
    length = start
    while high is None and length <= limit:
        if measure(length, use_splash, generation)["fits"]:
            low, length = length, length * 2
        else:
            high = length
    high = high or limit + 1024
    while high - low > 1024:
        middle = (low + high) // 2 // 1024 * 1024
        if measure(middle, use_splash, generation)["fits"]:
            low = middle
        else:
            high = middle
    return low


def run(quick: bool) -> dict:
    from torch_splash.fit import planned_for_tpu
    from torch_splash_jax import mosaic
    from torch_splash_jax.tpu_time import aot

    with planned_for_tpu():  # plan and lower the kernels for TPU
        generations = ["v5e"] if quick else ["v5e", "v6e"]
        lengths = [2048] if quick else [2048, 8192, 32768, 131072]
        rows = []
        for generation in generations:
            for length in lengths:
                for name in ("splash", "sdpa"):
                    start = time.perf_counter()
                    result = measure(length, name == "splash", generation)
                    rows.append(
                        dict(
                            generation=generation,
                            L=length,
                            impl=name,
                            **result,
                            seconds=round(time.perf_counter() - start, 1),
                        )
                    )
                    print(json.dumps(rows[-1]), flush=True)
        largest = {}
        if not quick:
            for generation in generations:
                for name in ("splash", "sdpa"):
                    largest[f"{generation}/{name}"] = largest_fitting(name == "splash", generation, 8192, 1 << 20)
                    print(generation, name, "largest L:", largest[f"{generation}/{name}"], flush=True)
        return dict(
            shape=dict(batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", mask="causal"),
            libtpu=mosaic.PINNED_LIBTPU,
            mosaic_ir_version=mosaic.ir_version(),
            topologies=aot.TOPOLOGIES,
            donated=True,  # the steps compiled with torch_xla's buffer donors (older results: without)
            rows=rows,
            largest=largest,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=2K on v5e only")
    args = parser.parse_args()
    in_a_libtpu_process(__file__)
    result = run(args.quick)
    report.save("tpu_memory", result, args.quick, "./dev.sh bench-tpu-memory")


if __name__ == "__main__":
    main()
