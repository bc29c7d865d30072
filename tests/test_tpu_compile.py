"""The real TPU compiler (libtpu, deviceless) on every kind of program torch_splash hands torch_xla,
and on whole training steps. Lowering only proves that Mosaic calls are emitted; this proves that
the TPU's own compiler accepts them (Mosaic deserialization, tiling, VMEM, HBM).

libtpu is installed by ./dev.sh into .venv/libtpu (or $TORCH_SPLASH_LIBTPU_DIR) and used only by
tests/tpu_compile_worker.py, in processes of their own: JAX never takes it for a backend here. The
torch_xla set compiles with the libtpu torch_xla pins (0.0.21); the current set with the one
TorchTPU requires (0.0.52, from its own venv), which also knows v7x.
"""

import importlib.util
import itertools
import json
import os
import pathlib
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import pytest
import tpu_sweep
from helpers import run_python

from torch_splash_jax import mosaic
from torch_splash_jax.tpu_time import aot

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "tpu_compile_worker.py"
LIBTPU = pathlib.Path(os.environ.get("TORCH_SPLASH_LIBTPU_DIR", ROOT / ".venv" / "libtpu"))
LIBTPU_RELEASE = next(
    (p.name.removesuffix(".dist-info").split("-")[1] for p in LIBTPU.glob("libtpu-*.dist-info")), None
)
GENERATIONS = ["v5e", "v6e"]
# libtpu 0.0.21 knows no v7x topology; 0.0.52 does.
NEWEST_GENERATIONS = GENERATIONS + (["v7x"] if LIBTPU_RELEASE and mosaic.newest_readable(LIBTPU_RELEASE) >= 18 else [])
KINDS = ["forward", "backward", "infer"]


ACTIVE = {"forward_kernel": "active"}
TRANSPOSED = {"forward_logits": "transposed"}  # a Plan field the case sets (tpu_compile_worker.case_plan)
IDS_CAP_SINKS = dict(segment_ids=True, soft_cap=30.0, sinks=True)
RING_16 = dict(q_shards=16, sequence_layout="balanced", context_parallel="ring")  # a ring over 16 devices
SPLASH = {"forward_kernel": "splash"}  # JAX's kernels, where a case is about them


def _case(name, hq, hkv, q_len, kv_len, d, dtype, mask, **options):
    return dict(name=name, hq=hq, hkv=hkv, q_len=q_len, kv_len=kv_len, d=d, dtype=dtype, mask=mask, **options)


# The default set: every head layout, head dim, dtype, mask family and option at least once, and
# lengths from 1 to 32K. The full product is under -m slow (FULL below).
DEFAULT = [
    _case("mha-causal-d128-bf16-2k", 8, 8, 2048, 2048, 128, "bfloat16", "CausalMask(0)", batch=2),
    _case("gqa-causal-d64-f32-1000-ids", 8, 2, 1000, 1000, 64, "float32", "CausalMask(0)", segment_ids=True),
    _case("mqa-local-d256-bf16-129", 4, 1, 129, 129, 256, "bfloat16", "LocalMask(63, 0)"),
    _case("gqa-chunked-d128-bf16-4k", 4, 2, 4096, 4096, 128, "bfloat16", "ChunkedCausalMask(512)"),
    _case(
        "and-or-d128-f32-2000",
        4,
        2,
        2000,
        2000,
        128,
        "float32",
        "(CausalMask(0) & LocalMask(255)) | (LocalMask(64, 64) & CausalMask(-1000))",
        segment_ids=True,
    ),
    _case(
        "per-head-d64-bf16-1024",
        4,
        2,
        1024,
        1024,
        64,
        "bfloat16",
        "MultiHeadMask((CausalMask(0), LocalMask(128), FullMask(), CausalMask(5)))",
    ),
    _case("dense-d64-f32-300", 2, 2, 300, 300, 64, "float32", "dense"),
    _case("decode-offset-d128-bf16-1x1000", 4, 1, 1, 1000, 128, "bfloat16", "CausalMask(999)"),
    _case("offset-7x300-ids", 2, 2, 7, 300, 128, "bfloat16", "CausalMask(293)", segment_ids=True),
    _case("softcap-sinks-gqa-bf16-1024", 8, 2, 1024, 1024, 128, "bfloat16", "CausalMask(0)", soft_cap=30.0, sinks=True),
    _case("length-1", 2, 2, 1, 1, 64, "float32", "FullMask()"),
    _case("head-dims-80-96", 4, 2, 512, 640, 80, "bfloat16", "CausalMask(128)", dv=96),
    # flex_attention's gradient through the logsumexp runs the backward on value with one more
    # column (_flex_ops.gradients): head_dim_v 129, off the 128-lane tiling
    _case("flex-lse-grad-dv129", 8, 2, 1024, 1024, 128, "bfloat16", "documents", dv=129),
    _case("long-32k-causal", 2, 1, 32768, 32768, 128, "bfloat16", "CausalMask(0)"),
    # the longest causal sequence one chip takes (at 768K the forward's tables outgrow SMEM: refused)
    _case("long-640k-causal", 2, 1, 655360, 655360, 128, "bfloat16", "CausalMask(0)"),
    # with small explicit q blocks the forward's tables outgrow SMEM: the planner grows its kv block
    _case("long-384k-smem-growth", 2, 1, 393216, 393216, 128, "bfloat16", "CausalMask(0)", blocks=dict(block_q=256)),
    # a mask read from stored blocks at 128K: its dq kernel keeps to half the VMEM budget
    _case(
        "per-head-128k",
        4,
        2,
        131072,
        131072,
        128,
        "bfloat16",
        "MultiHeadMask((CausalMask(0), LocalMask(4095, 0), CausalMask(0), LocalMask(4095, 0)))",
    ),
    # torch_splash.flex_attention's document-causal BlockMask over packed sequences: stored blocks
    _case("flex-documents-32k", 16, 8, 32768, 32768, 128, "bfloat16", "documents"),
    # JAX's fused backward planned at head_dim 256 (the active kernels, the default here, pinned
    # off): its compute block halved to fit VMEM
    _case("fused-d256-4k", 4, 2, 4096, 4096, 256, "bfloat16", "CausalMask(0)", blocks=SPLASH),
    # and at 16K, B=8, traded to 512 x 2048 to keep its dq buffer to 8 q's (16 would be 4 GiB),
    # compute block halved again
    _case("fused-d256-16k", 4, 2, 16384, 16384, 256, "bfloat16", "CausalMask(0)", batch=8, blocks=SPLASH),
    _case("fused-backward", 4, 2, 1024, 1024, 128, "float32", "CausalMask(0)", blocks=dict(use_fused_bwd_kernel=True)),
    _case(
        "explicit-blocks-1024",
        4,
        2,
        2048,
        2048,
        256,
        "float32",
        "CausalMask(0)",
        blocks=dict(
            block_q=1024,
            block_kv=1024,
            block_kv_compute=1024,
            block_q_dkv=1024,
            block_kv_dkv=1024,
            block_kv_dkv_compute=1024,
            block_q_dq=1024,
            block_kv_dq=1024,
        ),
    ),
    # the VMEM rule's edge (torch_splash_jax/plan.py): block_q x block_kv x max(head_dim, 128) == 2**28
    _case(
        "explicit-blocks-2048x1024",
        4,
        2,
        4096,
        4096,
        128,
        "bfloat16",
        "CausalMask(0)",
        blocks=dict(
            block_q=2048, block_kv=1024, block_q_dq=1024, block_kv_dq=2048, block_q_dkv=1024, block_kv_dkv=2048
        ),
    ),
    _case("head-dim-512-planned", 2, 1, 1024, 1024, 512, "float32", "CausalMask(0)"),
    # The shard-local programs of the SPMD path: a (2, 2) mesh over batch and heads, B=4, GQA 8/2
    # with a window and segment ids, as tests/spmd_worker.py shards it: each device runs B=2, 4/1,
    # through the active kernels (every device runs the same lists)
    _case("spmd-shard-local", 4, 1, 1024, 1024, 128, "bfloat16", "LocalMask(40)", batch=2, segment_ids=True),
    # Sequence-sharded calls on the active kernels (each device's list and positions its inputs): a
    # window with segment ids over 4 devices, every key on each (all-gather); a ring's middle step at
    # 256K over 16 devices (16K each; the sums of dq, dk and dv added into in place); and 6M over 16
    # (384K each), past the 4.25M where JAX's tables outgrew SMEM: the active lists fit there
    _case(
        "seq4-window-ids-all-gather",
        8,
        2,
        8192,
        8192,
        128,
        "bfloat16",
        "LocalMask(1023, 0)",
        segment_ids=True,
        q_shards=4,
    ),
    _case("ring-256k-16-balanced-causal", 16, 8, 262144, 262144, 128, "bfloat16", "CausalMask(0)", **RING_16),
    _case("ring-6m-16-balanced-causal", 16, 8, 6291456, 6291456, 128, "bfloat16", "CausalMask(0)", **RING_16),
    # The active-block kernels (BlockSizes(forward_kernel="active"), forward and backward): their 2048 x
    # 2048 and 1024 x 2048 blocks and 512 x 512 tiles with the batch in its heads; segment ids, soft cap
    # and sinks in float32 off the 128 grid at head_dim 64 (dq's buffer padded to the lanes); MQA at
    # head_dim 256 on a length shorter than one lane block.
    _case(
        "active-causal-d128-bf16-b4-4k", 16, 16, 4096, 4096, 128, "bfloat16", "CausalMask(0)", batch=4, blocks=ACTIVE
    ),
    _case(
        "active-window-ids-cap-sinks-f32-1000",
        8,
        2,
        1000,
        1000,
        64,
        "float32",
        "LocalMask(255, 0)",
        segment_ids=True,
        soft_cap=30.0,
        sinks=True,
        blocks=ACTIVE,
    ),
    _case("active-mqa-d256-bf16-129", 4, 1, 129, 129, 256, "bfloat16", "CausalMask(0)", blocks=ACTIVE),
    # the longest causal call their SMEM tables hold (the forward's list of 2048 x 2048 blocks; the
    # backward's grown from 1024 to 2048 rows there)
    _case("active-long-641k-causal", 2, 1, 641024, 641024, 128, "bfloat16", "CausalMask(0)", blocks=ACTIVE),
    # masks they read from stored blocks (an int8 block a partial entry): FlexAttention's packed
    # documents (2048 x 2048 blocks, GQA), one structured mask per head (a list per head, the
    # backward's dk and dv summed over a group) and a bool tensor off the 128 grid in float32
    _case("active-documents-8k", 16, 8, 8192, 8192, 128, "bfloat16", "documents", blocks=ACTIVE),
    _case(
        "active-per-head-d64-bf16-1024",
        4,
        2,
        1024,
        1024,
        64,
        "bfloat16",
        "MultiHeadMask((CausalMask(0), LocalMask(100, 0), ChunkedCausalMask(256), FullMask()))",
        blocks=ACTIVE,
    ),
    _case("active-dense-f32-300", 2, 2, 300, 300, 64, "float32", "dense", segment_ids=True, blocks=ACTIVE),
    # the forward with its logits transposed (Plan.forward_logits; v7x's plan takes it) on every
    # generation: causal at head_dim 128, segment ids, sinks and soft cap at 64, a bool tensor
    *(
        _case(name, hq, hkv, length, length, d, dtype, mask, blocks=ACTIVE, plan=TRANSPOSED, kinds=["forward"], **more)
        for name, hq, hkv, length, d, dtype, mask, more in (
            ("active-transposed-causal-bf16-4k", 8, 8, 4096, 128, "bfloat16", "CausalMask(0)", {}),
            ("active-transposed-ids-d64-f32-1000", 8, 2, 1000, 64, "float32", "LocalMask(255, 0)", IDS_CAP_SINKS),
            ("active-transposed-dense-bf16-2k", 4, 2, 2048, 128, "bfloat16", "dense", {}),
        )
    ),
    # planned for the generation it compiles for (Plan.generation): on v6e its forward sums its rows
    # in the MXU (Plan.row_sums, block_planning.SUMS_ON_MXU), on v7x it lays its logits out transposed
    # (Plan.forward_logits, block_planning.TRANSPOSED_LOGITS) and its kernels ask for the LP
    # scheduler (Plan.scheduler, block_planning.LP_SCHEDULER); on v6e the forward takes one 4096-row
    # q block (Plan.active_block_q, block_planning.LONG_BLOCK_Q), and at head_dim 256 the
    # kernels 2048-key blocks (Plan.active_block_kv, block_planning.WIDE_HEADS_BLOCK_KV)
    _case(
        "active-planned-for-each-generation", 8, 8, 4096, 4096, 128, "bfloat16", "CausalMask(0)", planned_for_each=True
    ),
    _case(
        "active-planned-for-each-generation-d256",
        8,
        8,
        4096,
        4096,
        256,
        "bfloat16",
        "CausalMask(0)",
        planned_for_each=True,
    ),
]

# v6e differs from v5e in VMEM and MXU: the default set compiles these for it too (the head dims,
# block and SMEM edges, and stored mask blocks); -m slow compiles the full matrix for both. Where
# two cases run the same kernels (the active ones, the default), one of them is here: a per-head
# mask, a dense mask, soft cap with sinks (each active-* case's); of the two rings, whose programs
# differ in their lengths only, the longer (the other compiles for v5e).
ALSO_V6E = {
    "long-640k-causal",
    "fused-d256-4k",
    "fused-d256-16k",
    "explicit-blocks-2048x1024",
    "head-dim-512-planned",
    "flex-lse-grad-dv129",
    "active-causal-d128-bf16-b4-4k",
    "active-window-ids-cap-sinks-f32-1000",
    "active-mqa-d256-bf16-129",
    "active-documents-8k",
    "active-per-head-d64-bf16-1024",
    "active-dense-f32-300",
    "active-planned-for-each-generation",
    "active-planned-for-each-generation-d256",
    "seq4-window-ids-all-gather",
    "ring-6m-16-balanced-causal",
}
# Cases at a limit of the chip's (VMEM, SMEM, stored mask blocks) or planned for the generation
# they compile for. The infer program is the forward's kernel without the logsumexp output, so its
# blocks take less VMEM than the forward's: compiled by default for these (the full matrix under
# -m slow compiles it for each of its cases). The current set exports these for v5e and v6e too.
AT_A_LIMIT = {
    "long-640k-causal",
    "fused-d256-16k",
    "explicit-blocks-2048x1024",
    "head-dim-512-planned",
    "active-causal-d128-bf16-b4-4k",
    "active-documents-8k",
    "active-planned-for-each-generation",
}
assert AT_A_LIMIT <= ALSO_V6E
DEFAULT = [
    dict(
        case,
        generations=GENERATIONS if case["name"] in ALSO_V6E else ["v5e"],
        kinds=KINDS if case["name"] in AT_A_LIMIT else KINDS[:2],
    )
    for case in DEFAULT
]
COMPILED = [
    (case, generation, kind) for case in DEFAULT for generation in case["generations"] for kind in case["kinds"]
]


def _ids(triples) -> list[str]:
    return [f"{c['name']}-{g}-{k}" for c, g, k in triples]


COMPILED_IDS = _ids(COMPILED)

MASKS = [
    "CausalMask(0)",
    "CausalMask(-100)",
    "LocalMask(255, 0)",
    "ChunkedCausalMask(256)",
    "CausalMask(0) & LocalMask(511)",
    "LocalMask(64, 64) | CausalMask(-500)",
    "MultiHeadMask((CausalMask(0), LocalMask(128), FullMask(), CausalMask(5)))",
    "dense",
]
FULL = [
    _case(f"{layout}-d{d}-{dtype}-{mask}", hq, hkv, length, length, d, dtype, mask, segment_ids=length == 1000)
    for (layout, hq, hkv), d, (dtype, length), mask in itertools.product(
        [("mha", 4, 4), ("gqa", 4, 2), ("mqa", 4, 1)], [64, 128, 256], [("bfloat16", 1000), ("float32", 2048)], MASKS
    )
]


def _environment() -> dict:
    if not (LIBTPU / "libtpu" / "libtpu.so").is_file():
        pytest.fail(
            f"libtpu is not installed in {LIBTPU}: ./dev.sh test installs libtpu=={mosaic.PINNED_LIBTPU} there "
            "(or set TORCH_SPLASH_LIBTPU_DIR to a folder holding it)."
        )
    env = aot.environment(str(LIBTPU))
    env["PYTHONPATH"] = os.pathsep.join([str(LIBTPU), str(ROOT), str(ROOT / "tests")])
    return env


def _worker(*args, stdin=None, timeout=1800) -> list[dict]:
    return run_python(str(WORKER), *args, stdin=stdin, timeout=timeout, env=_environment())


def _lines(cases) -> str:
    return "\n".join(json.dumps(case) for case in cases) + "\n"


def _by_key(results):
    return {(r["case"], r["kind"], r["generation"]): r for r in results if "case" in r}


@pytest.fixture(scope="module")
def default_results():
    newest = 8 if LIBTPU_RELEASE == mosaic.PINNED_LIBTPU else mosaic.newest_written()
    cases = (
        DEFAULT
        + tpu_sweep.SLICE
        + [
            dict(
                DEFAULT[0],
                name="jax-default-version-8",
                scale=0.1,
                mosaic_version=newest,
                generations=GENERATIONS,
                kinds=["forward"],
            )
        ]
    )
    return _by_key(_worker("programs", ",".join(GENERATIONS), stdin=_lines(cases)))


def _expected_mosaic_calls(result, kind, case):
    """forward and infer: one kernel; backward: dkv, and dq unless the plan fused it into dkv or
    the active backward (one kernel) runs in their place."""
    one = result.get("backward_kernel") == "active" or result["blocks"]["use_fused_bwd_kernel"]
    return {"forward": 1, "infer": 1, "backward": 1 if one else 2}[kind]


def _step_mosaic_calls() -> int:
    """The training step's kernels (tpu_compile_worker._tiny_model_step: 2 layers, B=4, 512 tokens,
    4/2 heads, head_dim 64, causal) as the TPU plan has them: per layer the forward, then the
    active backward, the fused dkv, or dkv and dq."""
    import torch_splash_jax

    plan = torch_splash_jax.plan(
        q_len=512, num_q_heads=4, num_kv_heads=2, head_dim=64, batch=4, mask=torch_splash_jax.CausalMask(),
        platform="tpu",
    )  # fmt: skip
    one = plan.backward_kernel == "active" or plan.block_sizes()["use_fused_bwd_kernel"]
    return 2 * (2 if one else 3)


def _assert_compiled(results, case, kind, generation):
    result = (
        results.get((case["name"], kind, generation))
        or results.get((case["name"], kind, None))
        or results.get((case["name"], "plan", None))
    )
    assert result is not None, f"no result for {case['name']} {kind} {generation}"
    assert "error" not in result, result["error"]
    assert result["mosaic_calls"] == _expected_mosaic_calls(result, kind, case)
    assert result["bytes"] > 0


# The in-graph modules are what torch_xla's graph transport runs: the torch_xla set compiles them.
# The current set compiles the same programs as TorchTPU's jax_op exports them (below).
@pytest.mark.xla
@pytest.mark.parametrize("case,generation,kind", COMPILED, ids=COMPILED_IDS)
def test_program_compiles_for_tpu(default_results, case, kind, generation):
    _assert_compiled(default_results, case, kind, generation)


def _assert_planned_for_each(results, generations, wide_generations):
    for generation in generations:
        result = results[("active-planned-for-each-generation", "forward", generation)]
        assert result.get("planned_for") == generation, result
        assert result.get("row_sums") == ("mxu" if generation == "v6e" else "vector"), result
        assert result.get("forward_logits") == ("transposed" if generation == "v7x" else "rows"), result
        assert result.get("scheduler") == ("lp" if generation == "v7x" else "default"), result
        assert result.get("active_block_kv") == 2048, result
        assert result.get("active_block_q") == (4096 if generation == "v6e" else 2048), result
    for generation in wide_generations:  # head_dim 256
        wide = results[("active-planned-for-each-generation-d256", "backward", generation)]
        assert wide.get("planned_for") == generation and wide.get("row_sums") == "vector", wide
        assert wide.get("active_block_kv") == (2048 if generation in ("v6e", "v7x") else 1024), wide


@pytest.mark.xla
def test_a_case_planned_for_each_generation_is_planned_for_the_one_it_compiles_for(default_results):
    _assert_planned_for_each(default_results, GENERATIONS, GENERATIONS)


@pytest.mark.torchtpu
def test_an_export_planned_for_each_generation_is_planned_for_the_one_it_compiles_for(torchtpu_results):
    # the cases of ALSO_V6E not at a limit are exported for v7x alone (`torchtpu_results`)
    _assert_planned_for_each(torchtpu_results, NEWEST_GENERATIONS, ["v7x"])


@pytest.mark.xla
def test_a_mosaic_version_past_the_libtpu_s_is_refused(default_results):
    """Why torch_splash decides the Mosaic version: what jax 0.7.1 writes by default on a machine
    without a TPU (8) is refused by the libtpu torch_xla 2.9.0 pins, which reads up to 7. With
    a newer libtpu in $TORCH_SPLASH_LIBTPU_DIR, every version the JAX in use writes compiles, so the
    case is the newest one, and it must compile (the current set's TorchTPU exports check that)."""
    for generation in GENERATIONS:
        result = default_results[("jax-default-version-8", "forward", generation)]
        if LIBTPU_RELEASE == mosaic.PINNED_LIBTPU:
            assert "Unsupported version: expected <= 7 but got 8" in result.get("error", ""), result
        else:
            assert "error" not in result and result["mosaic_calls"] == 1, result


# The current set exports the edge cases (ALSO_V6E) for v7x by default: no other test compiles for
# it. For v5e and v6e, whose programs the torch_xla set has compiled (every case for v5e, the edge
# cases for v6e too) with libtpu 0.0.21, it exports by default those at a limit (AT_A_LIMIT), which
# the newer libtpu may judge otherwise; every other export runs under -m slow.
EDGE_COMPILED = [t for t in COMPILED if t[0]["name"] in AT_A_LIMIT]
OTHER_COMPILED = [t for t in COMPILED if t[0]["name"] not in AT_A_LIMIT]


@pytest.mark.torchtpu
@pytest.mark.parametrize("case,generation,kind", EDGE_COMPILED, ids=_ids(EDGE_COMPILED))
def test_program_exported_for_torchtpu_compiles_for_tpu(torchtpu_results, case, kind, generation):
    """What the TorchTPU transport hands TorchTPU: each program exported as TorchTPU's jax_op exports
    it, compiled from that module by the libtpu TorchTPU requires."""
    _assert_compiled(torchtpu_results, case, kind, generation)


@pytest.mark.torchtpu
@pytest.mark.slow
@pytest.mark.parametrize("case,generation,kind", OTHER_COMPILED, ids=_ids(OTHER_COMPILED))
def test_every_program_exported_for_torchtpu_compiles_for_tpu(torchtpu_other_results, case, kind, generation):
    _assert_compiled(torchtpu_other_results, case, kind, generation)


V7X_COMPILED = [(case, "v7x", kind) for case in DEFAULT if case["name"] in ALSO_V6E for kind in case["kinds"]]


@pytest.mark.torchtpu
@pytest.mark.parametrize("case,generation,kind", V7X_COMPILED, ids=_ids(V7X_COMPILED))
def test_program_exported_for_torchtpu_compiles_for_v7x(torchtpu_results, case, generation, kind):
    assert "v7x" in NEWEST_GENERATIONS, f"libtpu {LIBTPU_RELEASE} in {LIBTPU} knows no v7x topology"
    _assert_compiled(torchtpu_results, case, kind, "v7x")


def _exported(cases) -> dict:
    return _by_key(_worker("torchtpu", ",".join(NEWEST_GENERATIONS), stdin=_lines(cases)))


@pytest.fixture(scope="module")
def torchtpu_results():
    edges = [dict(c, generations=c["generations"] + ["v7x"]) for c in DEFAULT if c["name"] in AT_A_LIMIT]
    return _exported(edges + [dict(c, generations=["v7x"]) for c in DEFAULT if c["name"] in ALSO_V6E - AT_A_LIMIT])


@pytest.fixture(scope="module")
def torchtpu_other_results():
    return _exported([c for c in DEFAULT if c["name"] not in AT_A_LIMIT])


# The decode kernel's programs (torch_splash_jax.decode: forward only): decode steps of every kind it
# serves, chunked prefill (row blocks), several splits, head_dim 64 to 256, each dtype.
DECODE = [
    _case("decode-gqa-bf16-32k", 32, 8, 1, 32768, 128, "bfloat16", "CausalMask(32767)", batch=8, kernel="decode",
          segment_ids=True),
    _case("decode-mqa-f32-ids", 8, 1, 1, 1000, 64, "float32", "FullMask()", segment_ids=True, kernel="decode"),
    _case("decode-window-softcap-sinks", 8, 2, 4, 3000, 256, "bfloat16", "LocalMask(1023, 0, 2996)", kernel="decode",
          soft_cap=30.0, sinks=True, segment_ids=True),
    _case("decode-chunked-mha", 4, 4, 2, 2048, 128, "bfloat16", "ChunkedCausalMask(512)", kernel="decode"),
    _case("decode-split-b1", 8, 8, 1, 4096, 128, "bfloat16", "CausalMask(4095)", kernel="decode", batch=1, dv=64),
    _case("decode-prefill-rows", 32, 8, 128, 8192, 128, "bfloat16", "CausalMask(8064)", kernel="decode"),
]  # fmt: skip


@pytest.fixture(scope="module")
def decode_results():
    generations = NEWEST_GENERATIONS if "v7x" in NEWEST_GENERATIONS else GENERATIONS
    torchtpu = "torchtpu" if importlib.util.find_spec("torch_xla") is None else "programs"
    return _by_key(_worker(torchtpu, ",".join(generations), stdin=_lines(DECODE)))


@pytest.mark.parametrize("case", DECODE, ids=[c["name"] for c in DECODE])
def test_decode_program_compiles_for_tpu(decode_results, case):
    """Each decode program as the set's transport hands it on (torch_xla's graph: its HLO module;
    TorchTPU: its jax_op export), compiled for v5e and v6e, and v7x where the libtpu knows it."""
    generations = NEWEST_GENERATIONS if "v7x" in NEWEST_GENERATIONS else GENERATIONS
    for generation in generations:
        result = decode_results.get((case["name"], "forward", generation)) or decode_results.get(
            (case["name"], "forward", None)
        )
        assert result is not None and "error" not in result, result
        assert result["mosaic_calls"] == 1 and result["bytes"] > 0, result


@pytest.mark.xla
def test_training_step_compiles_for_one_chip():
    """A torch_xla training step (2 layers, forward, loss, backward, SGD) with the kernels planned
    for TPU, the active-block kernels (a forward and a backward call a layer): its HLO compiles
    for one v5e chip; so does the same step with torch's SDPA."""
    results = {r["step"]: r for r in _worker("step")}
    assert "error" not in results["splash"], results["splash"]
    assert results["splash"]["mosaic_calls"] == _step_mosaic_calls() == 2 * 2
    assert results["splash"]["active_kernels"] == [True, True]
    assert "error" not in results["sdpa"], results["sdpa"]
    assert results["sdpa"]["mosaic_calls"] == 0


@pytest.mark.xla
def test_spmd_training_step_compiles_for_a_4_chip_mesh():
    """The same step under SPMD on a (2, 2) mesh (batch and heads), compiled with its sharding
    for the 4 chips of v5e:2x2: the shard-local kernels inside the manual-sharding region, the
    active-block kernels (sharded over heads with one mask, every device runs the same lists)."""
    results = {r["step"]: r for r in _worker("spmd-step")}
    assert "error" not in results["splash"], results["splash"]
    assert results["splash"]["mosaic_calls"] == _step_mosaic_calls()
    assert results["splash"]["active_kernels"] == [True, True]
    assert results["splash"]["sharded"] > 0
    assert "error" not in results["sdpa"], results["sdpa"]


@pytest.fixture(scope="module")
def full_results():
    return _by_key(_worker("programs", ",".join(GENERATIONS), stdin=_lines(FULL), timeout=5400))


@pytest.mark.slow
@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", FULL, ids=[c["name"] for c in FULL])
def test_full_matrix_compiles_for_tpu(full_results, case, kind, generation):
    _assert_compiled(full_results, case, kind, generation)


def _assert_compiled_or_refused(results, case, kind, generation):
    """The sweep's rule: every program the planner makes compiles, or the call is refused at
    planning, before any compiling, with a SplashConstraintError."""
    refused = results.get((case["name"], "plan", None))
    if refused is not None:
        assert refused["error"].startswith("SplashConstraintError"), refused
        return
    result = results.get((case["name"], kind, generation)) or results.get((case["name"], kind, None))
    assert result is not None, f"no result for {case['name']} {kind} {generation}"
    assert "error" not in result, result["error"]
    assert result["mosaic_calls"] >= 1 and result["bytes"] > 0, result


def _sweep_triples(cases, generations=None) -> list:
    return [
        (case, generation, kind)
        for case in cases
        for generation in (generations or case["generations"])
        for kind in case.get("kinds", ["forward"] if case.get("kernel") == "decode" else KINDS)
    ]


SLICE_COMPILED = _sweep_triples(tpu_sweep.SLICE)


@pytest.mark.xla
@pytest.mark.parametrize("case,generation,kind", SLICE_COMPILED, ids=_ids(SLICE_COMPILED))
def test_the_sweep_s_slice_compiles_for_tpu(default_results, case, kind, generation):
    """The representative slice of the shape sweep (tests/tpu_sweep.py) as torch_xla's graph
    transport hands it over, compiled by the default cases' worker: batches of 16 and 32, segment
    ids, head_dim 64 to 256, float16, a decode step; the whole sweep is under -m slow."""
    _assert_compiled_or_refused(default_results, case, kind, generation)


@pytest.fixture(scope="module")
def full_sweep_results():
    cases = [dict(c, generations=GENERATIONS) for c in tpu_sweep.FULL]
    return _by_key(_worker("programs", ",".join(GENERATIONS), stdin=_lines(cases), timeout=6 * 3600))


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("case", tpu_sweep.FULL, ids=[c["name"] for c in tpu_sweep.FULL])
def test_the_whole_sweep_compiles_for_tpu(full_sweep_results, case):
    """Every family, mask, dtype, batch and length of tests/tpu_sweep.py, each of its programs for
    v5e and v6e (hours on 2 cores)."""
    for case_, generation, kind in _sweep_triples([case], GENERATIONS):
        _assert_compiled_or_refused(full_sweep_results, case_, kind, generation)


SLICE_EXPORTED = _sweep_triples(tpu_sweep.SLICE, NEWEST_GENERATIONS)


@pytest.fixture(scope="module")
def slice_exported_results():
    return _exported([dict(c, generations=NEWEST_GENERATIONS) for c in tpu_sweep.SLICE])


@pytest.mark.torchtpu
@pytest.mark.slow
@pytest.mark.parametrize("case,generation,kind", SLICE_EXPORTED, ids=_ids(SLICE_EXPORTED))
def test_the_sweep_s_slice_exported_for_torchtpu_compiles_for_tpu(slice_exported_results, case, kind, generation):
    """The slice as TorchTPU's jax_op exports it, for v5e, v6e and v7x (the current set's libtpu)."""
    _assert_compiled_or_refused(slice_exported_results, case, kind, generation)


V7X_SLICE = [(c, "v7x", k) for c, g, k in SLICE_EXPORTED if g == "v7x" and c["name"] in tpu_sweep.V7X_DEFAULT]


@pytest.fixture(scope="module")
def v7x_slice_results():
    cases = [dict(c, generations=["v7x"]) for c in tpu_sweep.SLICE if c["name"] in tpu_sweep.V7X_DEFAULT]
    return _exported(cases)


@pytest.mark.torchtpu
@pytest.mark.parametrize("case,generation,kind", V7X_SLICE, ids=_ids(V7X_SLICE))
def test_the_sweep_s_slice_exported_for_torchtpu_compiles_for_v7x(v7x_slice_results, case, kind, generation):
    """Part of the slice for v7x by default (the torch_xla set has compiled all of it for v5e and v6e)."""
    assert "v7x" in NEWEST_GENERATIONS, f"libtpu {LIBTPU_RELEASE} in {LIBTPU} knows no v7x topology"
    _assert_compiled_or_refused(v7x_slice_results, case, kind, generation)


@pytest.fixture(scope="module")
def compile_one():
    """A worker that compiles one case at a time for v5e, for hypothesis to drive."""
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), "programs", "v5e"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_environment(),
    )

    def compile_case(case: dict) -> list[dict]:
        worker.stdin.write(json.dumps(case) + "\n")
        worker.stdin.flush()
        results = []
        for line in worker.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                if result.get("done") == case["name"]:
                    return results
                results.append(result)
        raise AssertionError(f"the compile worker stopped during {case['name']} (exit {worker.wait()})")

    yield compile_case
    worker.stdin.close()
    worker.wait(timeout=60)


@pytest.mark.slow
@hypothesis.settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    heads=st.sampled_from([(4, 4), (8, 2), (4, 1)]),
    q_len=st.integers(1, 9000),
    kv_len=st.integers(1, 9000),
    d=st.sampled_from([64, 80, 96, 128, 192, 256]),
    dtype=st.sampled_from(["bfloat16", "float32"]),
    mask=st.sampled_from(["FullMask()", "CausalMask(0)", "LocalMask(300, 0)", "ChunkedCausalMask(1000)"]),
    segment_ids=st.booleans(),
)
def test_the_planner_s_choices_always_compile(compile_one, heads, q_len, kv_len, d, dtype, mask, segment_ids):
    case = _case(
        f"hyp-{heads}-{q_len}x{kv_len}-d{d}-{dtype}-{mask}-{segment_ids}",
        *heads,
        q_len,
        kv_len,
        d,
        dtype,
        mask,
        segment_ids=segment_ids,
    )
    results = compile_one(case)
    assert len(results) == 3 and not [r for r in results if "error" in r], results


def test_the_jax_side_plans_builds_tables_and_compiles_for_tpu_without_torch():
    """torch_splash_jax never imports torch (nor torch_xla, TorchTPU or transformers): with torch,
    TorchTPU and transformers made unimportable (torch_xla cannot import without torch), the worker
    plans a call, builds its block tables and programs, and the TPU compiler compiles the forward,
    backward and inference programs."""
    # torch_xla stays findable (the worker then hands the in-graph transport's HLO module to the
    # compiler, as on the torch_xla set) but cannot be imported without torch.
    blocked, torch_world = ("torch", "torch_tpu", "transformers"), ("torch", "torch_xla", "torch_tpu", "transformers")
    script = (
        "import runpy, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # `import name` raises ImportError\n"
        f"sys.argv = [{str(WORKER)!r}, 'programs', 'v5e']\n"
        f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{torch_world!r} and sys.modules[m] is not None)\n"
        "print('{\"loaded\": %s}' % str(loaded).replace(\"'\", '\"'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=_lines([dict(DEFAULT[1], kinds=KINDS)]),
        capture_output=True,
        text=True,
        timeout=900,
        env=_environment(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert results[-1] == {"loaded": []}, results[-1]
    compiled = {r["kind"]: r for r in results if "case" in r}
    assert set(compiled) == set(KINDS), results
    assert all("error" not in r and r["bytes"] > 0 and r["mosaic_calls"] >= 1 for r in compiled.values()), results
