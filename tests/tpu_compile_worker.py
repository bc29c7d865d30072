"""Run by tests/test_tpu_compile.py in processes of its own, with libtpu importable
(`torch_splash_jax.tpu_time.aot.environment`): the real TPU compiler, deviceless, on what torch_splash hands
torch_xla. Prints one JSON line per result.

    programs GEN[,GEN...]   one JSON case per line on stdin: each case's forward, backward and
                            infer programs, lowered once as the in-graph transport lowers them,
                            compiled for one chip of each generation, then a line {"done": name}.
                            A case may name "mosaic_version".
    torchtpu GEN[,GEN...]   the same, each program exported as TorchTPU's jax_op exports it
                            (`_export_as_torchtpu`, as torch.tpu.pallas.jax_op) and compiled from that
                            StableHLO module, the bytes TorchTPU's runtime would compile.
    step                    the HLO of a torch_xla training step of a small transformer (forward,
                            loss, backward, SGD update) with the kernels planned for TPU, compiled
                            for one v5e chip, next to the same step with torch's SDPA.
    spmd-step               the same step over a (2, 2) mesh, batch and heads sharded, compiled
                            for the 4 chips of v5e:2x2 with its sharding.
"""

import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")


def _emit(**fields):
    print(json.dumps(fields), flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def program_args(plan, kind: str, tables=()) -> tuple:
    """(shape, dtype) of a program's arguments, in the order the bridge passes them; `tables`: the
    program's `tables()` (a mask read from stored blocks)."""
    b, hq, hkv, dt = plan.batch, plan.num_q_heads, plan.num_kv_heads, plan.dtype
    args = [
        ((b, hq, plan.q_len, plan.head_dim), dt),
        ((b, hkv, plan.kv_len, plan.head_dim), dt),
        ((b, hkv, plan.kv_len, plan.head_dim_v), dt),
    ]
    if plan.has_segment_ids:
        args += [((b, plan.q_len), "int32"), ((b, plan.kv_len), "int32")]
    if plan.has_sinks:
        args += [((hq,), "float32")]
    args += [(t.shape, t.dtype.name) for t in tables]
    if kind == "backward":
        out = ((b, hq, plan.q_len, plan.head_dim_v), dt)
        args += [out, ((b, hq, plan.q_len_padded), "float32"), out]
    return tuple(args)


def case_plan(case: dict, generation: str | None = None):
    import numpy as np

    import torch_splash_jax
    from torch_splash_jax import masks

    mask = case["mask"]
    if mask == "dense":
        rng = np.random.default_rng(0)
        mask = torch_splash_jax.DenseMask(rng.random((case["q_len"], case["kv_len"])) > 0.3)
    elif mask == "documents":
        mask = documents_mask(case["q_len"])
    else:
        mask = eval(mask, vars(masks))  # a constructor call such as "CausalMask(0) & LocalMask(255)"
    fields = dict(
        batch=case.get("batch", 1),
        num_q_heads=case["hq"],
        num_kv_heads=case["hkv"],
        q_len=case["q_len"],
        kv_len=case["kv_len"],
        head_dim=case["d"],
        head_dim_v=case.get("dv", case["d"]),
        dtype=case["dtype"],
        mask=mask,
        scale=case.get("scale", case["d"] ** -0.5),
        soft_cap=case.get("soft_cap"),
        has_segment_ids=case.get("segment_ids", False),
        has_sinks=case.get("sinks", False),
        platform="tpu",
    )
    if case.get("kernel") == "decode":  # the decode kernel's plan (torch_splash_jax.decode)
        return torch_splash_jax.decode.decode_plan(**fields)
    blocks = case.get("blocks")
    sharding = {name: case[name] for name in ("q_shards", "sequence_layout", "context_parallel") if name in case}
    plan = torch_splash_jax.plan(
        **fields,
        block_sizes=None if blocks is None else torch_splash_jax.BlockSizes(**blocks),
        generation=generation,
        **sharding,
    )
    return dataclasses.replace(plan, **case.get("plan", {}))  # a choice the case makes for itself


def program_call(program, plan, kind: str, case: dict):
    """(the function, its (shape, dtype name) arguments) of one device's `kind` program: a
    sequence-sharded program's with its first device's slice of the tables; a ring's at the
    case's `ring_step` (default 1: a middle step, with the sums the step before hands on)."""
    if not getattr(plan, "ring", False):
        sharded = getattr(program, "sharded", False)
        return getattr(program, kind), program_args(
            plan, kind, program.device_tables(0) if sharded else _tables(program)
        )
    step = case.get("ring_step", 1)
    kernel_args = list(program_args(plan, "forward")[: 5 if plan.has_segment_ids else 3])  # the steps see no sinks
    tables = [(t.shape, t.dtype.name) for t in program.steps[step].device_tables(0)]
    sums = [(a.shape, a.dtype.name) for a in program.accumulators(kind, step)]
    if kind == "backward":
        out = ((plan.batch, plan.num_q_heads, plan.q_len, plan.head_dim_v), plan.dtype)
        kernel_args += tables + [out, ((plan.batch, plan.num_q_heads, plan.q_len_padded), "float32"), out]
        return program.backward[step], tuple(kernel_args + sums)
    return program.forward[step], tuple(kernel_args + tables + sums)


def documents_mask(length: int, block: int = 128):
    """The BlockSparseMask torch_splash.flex_attention makes of a document-causal BlockMask over
    packed documents of 256 to 4095 tokens (blocks of 128, as create_block_mask's), built here in
    NumPy: this process has no torch."""
    import numpy as np

    import torch_splash_jax

    rng, lengths = np.random.default_rng(0), []
    while sum(lengths) < length:
        lengths.append(min(int(rng.integers(256, 4096)), length - sum(lengths)))
    doc = np.repeat(np.arange(len(lengths)), lengths)
    n = -(-length // block)
    padded = np.concatenate([doc, np.full(n * block - length, -1)]).reshape(n, block)
    first, last = padded[:, 0], np.where(padded[:, -1] < 0, doc[-1], padded[:, -1])
    rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]
    some = (cols <= rows) & (np.maximum(first[:, None], first[None, :]) <= np.minimum(last[:, None], last[None, :]))
    whole = (padded >= 0).all(axis=1)
    full = (cols < rows) & (first == last)[:, None] & (first == last)[None, :] & (first[:, None] == first[None, :])
    full &= whole[:, None] & whole[None, :]
    kinds = np.where(full, 2, np.where(some, 1, 0)).astype(np.int8)
    index = np.full(kinds.shape, -1, np.int32)
    blocks = []
    for r, c in np.argwhere(kinds == 1):
        q, kv = r * block + np.arange(block), c * block + np.arange(block)
        inside = (q[:, None] < length) & (kv[None, :] < length)
        ids_q, ids_kv = padded[r][:, None], padded[c][None, :]
        blocks.append((ids_q == ids_kv) & (q[:, None] >= kv[None, :]) & inside)
        index[r, c] = len(blocks) - 1
    return torch_splash_jax.BlockSparseMask(kinds, index, np.stack(blocks), (length, length), (block, block))


def programs(generations: list[str], lines, torchtpu: bool = False) -> None:
    for line in lines:
        if line.strip():
            case = json.loads(line)
            compile_case(case, generations, torchtpu)
            _emit(done=case["name"])


def _in_graph_module(fn, args, version):
    """The HLO module the in-graph transport hands torch_xla, and how it compiles. Without torch_xla
    (the current set) the same lowering compiles from its StableHLO: jaxlib 0.12's HLO-to-StableHLO
    conversion writes custom calls that libtpu 0.0.52's StableHLO 1.16.3 cannot read, which only
    matters to a torch_xla that set does not have."""
    import importlib.util

    from torch_splash_jax.tpu_time import aot
    from torch_splash_jax.transport import hlo_module, lowered

    if importlib.util.find_spec("torch_xla") is None:
        text = lowered(fn, args, "tpu", version).as_text()
        return text, text.count("tpu_custom_call"), aot.compile_stablehlo
    proto = hlo_module(fn, args, "tpu", version)
    return proto, proto.count(b"tpu_custom_call"), aot.compile_hlo


def _export_as_torchtpu(fn, args: tuple, mosaic_version: int):
    """`fn` at these (shape, dtype name) arguments exported exactly as TorchTPU's `jax_op` exports
    `numbered_program` (jax.export for TPU, custom calls allowed) at this Mosaic IR version."""
    import jax
    import jax.export
    import jax.numpy as jnp

    from torch_splash_jax import compat
    from torch_splash_jax.transport import numbered_program, program_number

    structs = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in args]
    exporter = jax.export.export(
        jax.jit(numbered_program, static_argnums=(1,), keep_unused=True),
        platforms=["tpu"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ALL")],
    )
    with compat.export_ignoring_forward_compatibility(), compat.mosaic_ir_version(mosaic_version):
        return exporter(structs, program_number(fn))


def _torchtpu_module(fn, args, version):
    """The StableHLO module TorchTPU's jax_op registers with its runtime, and how it compiles."""
    from torch_splash_jax import compat, mosaic
    from torch_splash_jax.tpu_time import aot

    exported = _export_as_torchtpu(fn, args, mosaic.ir_version() if version is None else version)
    module = compat.portable_artifact_module(exported.mlir_module_serialized)
    return module, exported.mlir_module().count("tpu_custom_call"), aot.compile_stablehlo


def _tables(program) -> list:
    """A splash program's table inputs; a decode program takes none."""
    return program.tables() if hasattr(program, "tables") else []


def _blocks(plan) -> dict:
    if isinstance(plan, __import__("torch_splash_jax").DecodePlan):
        return dict(heads=plan.block_heads, rows=plan.block_rows, kv=plan.block_kv, splits=plan.splits)
    return dict(plan.blocks)


def compile_case(case: dict, generations: list[str], torchtpu: bool = False) -> None:
    """Each of the case's programs compiled for each generation; a case with `planned_for_each`
    is planned for each generation it compiles for (`Plan.generation`), the others for none."""
    generations = case.get("generations", generations)  # a case may name its own
    if case.get("planned_for_each"):
        for generation in generations:
            _compile_plan(case, [generation], torchtpu, generation)
    else:
        _compile_plan(case, generations, torchtpu, None)


def _compile_plan(case: dict, generations: list[str], torchtpu: bool, planned_for: str | None) -> None:
    import torch_splash_jax

    try:
        plan = case_plan(case, planned_for)
    except Exception as exc:  # a refusal before any JAX work (the planner's own rules)
        _emit(case=case["name"], kind="plan", generation=None, error=_error(exc))
        return
    program = torch_splash_jax.program(plan)
    kinds = ("forward",) if isinstance(plan, torch_splash_jax.DecodePlan) else ("forward", "backward", "infer")
    kinds = [kind for kind in kinds if kind in case.get("kinds", kinds)]  # a case may name its own
    for kind in kinds:
        start = time.perf_counter()
        try:
            build = _torchtpu_module if torchtpu else _in_graph_module
            fn, args = program_call(program, plan, kind, case)
            module, mosaic_calls, compile_module = build(fn, args, case.get("mosaic_version"))
        except Exception as exc:
            _emit(case=case["name"], kind=kind, generation=None, error=_error(exc))
            continue
        lowered = time.perf_counter() - start
        for generation in generations:
            start = time.perf_counter()
            try:
                memory = compile_module(module, generation)
                _emit(
                    case=case["name"],
                    kind=kind,
                    generation=generation,
                    bytes=memory.total,
                    temp=memory.temp,
                    lower_s=round(lowered, 2),
                    compile_s=round(time.perf_counter() - start, 2),
                    mosaic_calls=mosaic_calls,
                    blocks=_blocks(plan),
                    backward_kernel=getattr(plan, "backward_kernel", None),
                    planned_for=getattr(plan, "generation", None),
                    row_sums=getattr(plan, "row_sums", None),
                    forward_logits=getattr(plan, "forward_logits", None),
                    scheduler=getattr(plan, "scheduler", None),
                    active_block_kv=getattr(plan, "active_block_kv", None),
                    active_block_q=getattr(plan, "active_block_q", None),
                )
            except Exception as exc:
                _emit(case=case["name"], kind=kind, generation=generation, error=_error(exc))


def _tiny_model_step(device, attention):
    """One training step of a 2-layer GQA transformer on `device`, left pending in the lazy graph:
    the tensors the step updates (the parameters)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    dim, heads, kv_heads, layers, vocab, length, batch = 256, 4, 2, 2, 128, 512, 4
    head_dim = dim // heads
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(vocab, dim),
            "qkv": nn.ModuleList(nn.Linear(dim, (heads + 2 * kv_heads) * head_dim) for _ in range(layers)),
            "proj": nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers)),
            "head": nn.Linear(dim, vocab),
        }
    ).to(device)
    tokens = torch.randint(0, vocab, (batch, length + 1)).to(device)
    x = model["embed"](tokens[:, :-1])
    for qkv, proj in zip(model["qkv"], model["proj"]):
        q, k, v = qkv(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = (t.view(batch, length, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        x = x + proj(attention(q, k, v).transpose(1, 2).reshape(batch, length, dim))
    loss = F.cross_entropy(model["head"](x).flatten(0, 1), tokens[:, 1:].flatten())
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    loss.backward()
    opt.step()
    return params + [loss]


def step(spmd: bool) -> None:
    import torch.nn.functional as F
    import torch_xla

    import torch_splash
    from torch_splash import _compat
    from torch_splash.fit import planned_for_tpu
    from torch_splash_jax.tpu_time import aot

    with planned_for_tpu():  # plan and lower the kernels for TPU
        device = torch_xla.device()
        mesh, spec = None, None
        if spmd:
            import numpy as np
            import torch_xla.distributed.spmd as xs

            mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
            spec = ("data", "model", None, None)

        def splash(q, k, v):
            return torch_splash.attention(q, k, v, "causal", partition_spec=spec, mesh=mesh)

        def sdpa(q, k, v):
            if spmd:
                import torch_xla.distributed.spmd as xs

                for t in (q, k, v):
                    xs.mark_sharding(t, mesh, spec)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        variants = [("splash", splash), ("sdpa", sdpa)]
        for name, attention in variants:
            tensors = _tiny_model_step(device, attention)
            text = _compat.pending_hlo_text(tensors)
            try:
                memory = aot.compile_hlo(aot.hlo_text_to_proto(text), "v5e", partitions=4 if spmd else 1)
                _emit(
                    step=name,
                    spmd=spmd,
                    bytes=memory.total,
                    temp=memory.temp,
                    mosaic_calls=text.count('custom_call_target="tpu_custom_call"'),
                    active_kernels=[name in text for name in ("active_forward", "active_backward")],
                    sharded=text.count("sharding={devices=["),
                )
            except Exception as exc:
                _emit(step=name, spmd=spmd, error=_error(exc))
            del tensors  # never executed: a Mosaic call cannot run on the CPU


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode in ("programs", "torchtpu"):
        programs(sys.argv[2].split(","), sys.stdin, torchtpu=mode == "torchtpu")
    elif mode == "step":
        step(spmd=False)
    elif mode == "spmd-step":
        os.environ["CPU_NUM_DEVICES"] = "4"
        import torch_xla.runtime as xr

        xr.use_spmd()
        step(spmd=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
