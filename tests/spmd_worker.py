"""Run by tests/test_spmd.py in its own process: torch_xla SPMD over 4 CPU devices must be set up
before torch_xla's runtime starts, which the main test process has already done.

For each case, attention over q/k/v sharded on a (2, 2) mesh ("data", "model") against the same
call on unsharded CPU tensors; prints one JSON line per case.
"""

import json
import os
import sys

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "4"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import torch_splash  # noqa: E402
import torch_splash_jax  # noqa: E402
from torch_splash import _compat, _ops, _planning  # noqa: E402

CASES = {
    # name: (partition_spec, Hq, Hkv, mask, segment ids, sinks)
    "batch": (("data", None, None, None), 4, 2, "causal", False, False),
    "heads-gqa": ((None, "model", None, None), 4, 2, "causal", True, False),
    "batch-and-heads-mqa": (("data", "model", None, None), 4, 1, "causal", False, False),
    "inputs-not-marked": (("data", "model", None, None), 4, 2, "causal", False, False),
    "batch-and-heads-gqa-sinks": (("data", "model", None, None), 8, 2, torch_splash.masks.LocalMask(40), True, True),
    "all-devices-on-batch-sinks": ((("data", "model"), None, None, None), 2, 2, None, True, True),
    # the query sequence sharded: 4 ways, and batch x sequence 2 x 2
    "seq4-causal": ((None, None, ("data", "model"), None), 4, 2, "causal", False, False),
    "seq4-causal-balanced": ((None, None, ("data", "model"), None), 4, 2, "causal", False, False),
    "seq4-chunked-mqa-ids": (
        (None, None, ("data", "model"), None),
        4,
        1,
        torch_splash.masks.ChunkedCausalMask(24),
        True,
        False,
    ),
    "batch-seq-window-ids": (("data", None, "model", None), 4, 2, torch_splash.masks.LocalMask(40), True, False),
    "batch-seq-causal-ids-balanced": (("data", None, "model", None), 4, 2, "causal", True, False),
    "heads-seq-sinks-balanced": ((None, "data", "model", None), 8, 2, "causal", True, True),
    # masks the kernel reads from stored partial blocks: per-head masks and tensor masks, their
    # block tables split along the sequence and, per head, over the head shards
    "seq4-per-head-ids": ((None, None, ("data", "model"), None), 4, 2, "per-head", True, False),
    "seq4-tensor-balanced": ((None, None, ("data", "model"), None), 4, 2, "tensor", False, False),
    "heads-per-head-tensor": ((None, ("data", "model"), None, None), 4, 4, "per-head-tensor", True, False),
    "heads-seq-per-head-sinks-balanced": ((None, "data", "model", None), 4, 2, "per-head", True, True),
    # context_parallel="ring": k and v sharded like q and passed around the sequence shards
    "ring-seq4-causal-ids-sinks": ((None, None, ("data", "model"), None), 4, 2, "causal", True, True),
    "ring-seq4-causal-ids-balanced": ((None, None, ("data", "model"), None), 4, 2, "causal", True, False),
    "ring-seq4-window-mqa-ids-balanced": (
        (None, None, ("data", "model"), None),
        4,
        1,
        torch_splash.masks.LocalMask(40),
        True,
        False,
    ),
    "ring-seq4-chunked-ids": (
        (None, None, ("data", "model"), None),
        4,
        2,
        torch_splash.masks.ChunkedCausalMask(24),
        True,
        False,
    ),
    "ring-seq4-full-ids": ((None, None, ("data", "model"), None), 4, 2, None, True, False),
    "ring-batch-seq-window-ids": (("data", None, "model", None), 4, 2, torch_splash.masks.LocalMask(40), True, False),
    "ring-heads-seq-per-head-sinks-balanced": ((None, "data", "model", None), 4, 2, "per-head", True, True),
    "ring-seq4-tensor-balanced": ((None, None, ("data", "model"), None), 4, 2, "tensor", False, False),
}
BALANCED = {
    "seq4-causal-balanced",
    "batch-seq-causal-ids-balanced",
    "heads-seq-sinks-balanced",
    "seq4-tensor-balanced",
    "heads-seq-per-head-sinks-balanced",
    "ring-seq4-causal-ids-balanced",
    "ring-seq4-window-mqa-ids-balanced",
    "ring-heads-seq-per-head-sinks-balanced",
    "ring-seq4-tensor-balanced",
}


def _mask(name, length: int = 200):
    """A case's mask argument: a per-head list of structured masks, or a bool tensor (Lq, Lkv) or
    (Hq, Lq, Lkv) with holes, so that its partial blocks differ."""
    M = torch_splash.masks
    if name == "per-head":
        return [M.CausalMask(), M.LocalMask(40), M.ChunkedCausalMask(24), M.CausalMask(offset=-10)]
    g = torch.Generator().manual_seed(1)
    if name in ("tensor", "per-head-tensor"):
        heads = 1 if name == "tensor" else 4
        tensor = torch.tril(torch.ones(length, length, dtype=torch.bool)) & (
            torch.rand(heads, length, length, generator=g) < 0.9
        )
        return tensor[0] if name == "tensor" else tensor
    return name


RAN = []  # the (plan, sharding) of every kernel run, recorded around _ops._run
_run = _ops._run


def _recording_run(plan, sharding, *args):
    RAN.append((plan, sharding))
    return _run(plan, sharding, *args)


_ops._run = _recording_run


def ring_mosaic_calls(program, args):
    import jax
    import jax.export
    import jax.numpy as jnp

    p, step = program.plan, 1
    tables = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.steps[step].device_tables(0)]
    kernel_args = args[: 5 if p.has_segment_ids else 3]  # the steps see no sinks
    rows = (p.batch, p.num_q_heads, p.q_len)
    f32 = jnp.float32
    accumulators = program.accumulators("forward", step)
    forward = jax.export.export(program.forward[step], platforms=["tpu"])(*kernel_args, *tables, *accumulators)
    out = jax.ShapeDtypeStruct(rows + (p.head_dim_v,), f32)
    lse = jax.ShapeDtypeStruct(rows[:2] + (p.q_len_padded,), f32)
    backward = jax.export.export(program.backward[step], platforms=["tpu"])(
        *kernel_args, *tables, out, lse, out, *program.accumulators("backward", step)
    )
    return [exported.mlir_module().count("custom_call @tpu_custom_call") for exported in (forward, backward)]


def mosaic_calls_on_tpu(xla_in, mask, ids, sinks, spec, mesh, layout, ring=False, blocks=None):
    """What attention() would hand to torch_xla on a TPU with this mesh and spec: the program of the
    shard-local plan, lowered for TPU at the local shapes. Mosaic calls in its forward and backward,
    and whether the plan fuses dq into the dkv kernel."""
    import jax
    import jax.export
    import jax.numpy as jnp

    from torch_splash import _checks, _sharding

    device = xla_in[0].device
    call = _checks.check_call(
        *xla_in, mask, None, None if ids is None else ids.to(device), None, None if sinks is None else sinks.to(device)
    )
    sharding = _sharding.check(spec, mesh, call, None, layout, "ring" if ring else None)
    call = sharding.spread_single_kv_head(call)
    plan = _planning.splash_plan(call, blocks, "tpu", sharding)
    program = torch_splash_jax.program(plan)
    shapes = [
        (plan.batch, h, length, d)
        for h, length, d in (
            (plan.num_q_heads, plan.q_len, plan.head_dim),
            (plan.num_kv_heads, plan.kv_len, plan.head_dim),
            (plan.num_kv_heads, plan.kv_len, plan.head_dim_v),
        )
    ]
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    if ids is not None:
        args += [jax.ShapeDtypeStruct((plan.batch, n), jnp.int32) for n in (plan.q_len, plan.kv_len)]
    if sinks is not None:
        args += [jax.ShapeDtypeStruct((plan.num_q_heads,), jnp.float32)]
    fused = plan.block_sizes()["use_fused_bwd_kernel"]
    if plan.ring:  # a middle step of the ring: its kernels, inside the branch for devices with work
        return ring_mosaic_calls(program, args), fused
    args += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.device_tables(0)]  # one device's slice
    forward = jax.export.export(program.forward, platforms=["tpu"])(*args)
    out, lse = jax.eval_shape(program.forward, *args)
    backward = jax.export.export(program.backward, platforms=["tpu"])(*args, out, lse, out)
    return [exported.mlir_module().count("custom_call @tpu_custom_call") for exported in (forward, backward)], fused


ERRORS = {
    # name: (partition_spec, batch, Hq, Hkv, transport)
    "unknown-axis": (("batch", None, None, None), 4, 4, 2, None),
    "batch-does-not-split": (("data", None, None, None), 3, 4, 2, None),
    "kv-heads-do-not-split": ((None, ("data", "model"), None, None), 2, 8, 2, None),
    "dlpack-cannot-carry-shards": (("data", None, None, None), 4, 4, 2, "dlpack"),
    "sequence-does-not-split": ((None, None, ("data", "model"), None), 2, 4, 2, None, 18),
    "balanced-chunks-do-not-split": ((None, None, ("data", "model"), None), 2, 4, 2, None, 20, "balanced"),
    "balanced-without-sequence-shards": (("data", None, None, None), 2, 4, 2, None, 16, "balanced"),
    "kv-sequence-sharded-alone": (("data", None, None, None), 2, 4, 2, None, 16, None, "kv-seq"),
    "ring-without-sequence-shards": (("data", None, None, None), 2, 4, 2, None, 16, None, None, "ring"),
    "ring-over-one-device": ((None, None, "one", None), 2, 4, 2, None, 16, None, None, "ring"),
    "ring-sequence-does-not-split": (
        (None, None, ("data", "model"), None),
        2,
        4,
        2,
        None,
        20,
        "balanced",
        None,
        "ring",
    ),
}


def errors(mesh, device):
    """The SplashConstraintError message for each bad sharded call (raised before any kernel work)."""
    one = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4, 1), ("data", "one"))
    for name, (spec, b, hq, hkv, transport, *more) in ERRORS.items():
        length, layout, mask, strategy = more + [16, None, None, None][len(more) :]
        q, k, v = (torch.zeros(b, h, length, 32, device=device) for h in (hq, hkv, hkv))
        if mask == "kv-seq":  # k, v sharded along their sequence by the caller, q's sequence whole
            mask = None
            for t in (k, v):
                xs.mark_sharding(t, mesh, (None, None, "model", None))
        try:
            torch_splash.attention(
                q,
                k,
                v,
                mask,
                partition_spec=spec,
                mesh=one if "one" in spec else mesh,
                transport=transport,
                sequence_layout=layout,
                context_parallel=strategy,
            )
            message = None
        except torch_splash.SplashConstraintError as err:
            message = str(err)
        print(json.dumps({"error": name, "message": message}), flush=True)


def main(names):
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (2, 2), ("data", "model"))
    device = torch_xla.device()
    errors(mesh, device)
    for name in names:
        spec, hq, hkv, mask, with_ids, with_sinks = CASES[name]
        mask = _mask(mask)
        layout = "balanced" if name in BALANCED else None
        ring = name.startswith("ring-")
        g = torch.Generator().manual_seed(0)
        b, length, d = 4, 200, 32
        cpu = [torch.randn(b, h, length, d, generator=g) for h in (hq, hkv, hkv)]
        cotangent = torch.randn(b, hq, length, d, generator=g)
        ids = (torch.arange(length)[None] >= torch.tensor([[120], [200], [60], [0]])).int() if with_ids else None
        sinks = torch.randn(hq, generator=g) if with_sinks else None

        ref_in = [t.clone().requires_grad_() for t in cpu]
        ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
        ref = torch_splash.attention(*ref_in, mask, segment_ids=ids, sinks=ref_sinks)
        (ref * cotangent).sum().backward()
        RAN.clear()

        xla_in = [t.to(device).requires_grad_() for t in cpu]
        xla_sinks = None if sinks is None else sinks.to(device).requires_grad_()
        kv_spec = spec if hkv > 1 else (spec[0], None, spec[2] if ring else None, None)
        for t, s in zip(xla_in, (spec, kv_spec, kv_spec)):
            if name != "inputs-not-marked":  # otherwise XLA reshards them to partition_spec
                xs.mark_sharding(t, mesh, s)
        out = torch_splash.attention(
            *xla_in,
            mask,
            segment_ids=None if ids is None else ids.to(device),
            sinks=xla_sinks,
            partition_spec=spec,
            mesh=mesh,
            sequence_layout=layout,
            context_parallel="ring" if ring else None,
        )
        (out * cotangent.to(device)).sum().backward()
        torch_xla.sync()
        local = {plan for plan, sharding in RAN if sharding is not None}
        ring_steps = [len(torch_splash_jax.program(plan).steps) for plan in local if plan.ring]
        assert len(local) == 1, local
        local = local.pop()
        RAN.clear()
        tpu_calls, tpu_fused = mosaic_calls_on_tpu(xla_in, mask, ids, sinks, spec, mesh, layout, ring)
        separate = torch_splash.BlockSizes(use_fused_bwd_kernel=False)  # the plan's choice past 16K keys
        tpu_separate, _ = mosaic_calls_on_tpu(xla_in, mask, ids, sinks, spec, mesh, layout, ring, separate)
        if sinks is not None:
            xla_in, ref_in = xla_in + [xla_sinks], ref_in + [ref_sinks]
        print(
            json.dumps(
                {
                    "case": name,
                    "out": (out.cpu() - ref).abs().max().item(),
                    # relative to the gradient's size where that exceeds 1 (d_sinks sums over B*Hq*L terms)
                    "grads": [
                        ((x.grad.cpu() - r.grad).abs().max() / r.grad.abs().max().clamp(min=1)).item()
                        for x, r in zip(xla_in, ref_in)
                    ],
                    "out_sharding": _compat.sharding_spec(out),
                    "local_plan": [local.batch, local.num_q_heads, local.num_kv_heads, local.q_len],
                    "kernels": [local.forward_kernel, local.backward_kernel],
                    "tpu_custom_calls": tpu_calls,
                    "tpu_fused": tpu_fused,
                    "tpu_separate_custom_calls": tpu_separate,
                    "ring_steps": ring_steps,
                    "kv_sharding": _compat.sharding_spec(xla_in[1].grad),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
