"""torch_xla SPMD on 4 CPU devices (tests/spmd_worker.py in its own process): attention over q/k/v
sharded on batch, heads and the query sequence (contiguous and balanced), shard-local, against the
unsharded call; the shard-local programs lowered for TPU; and the errors for what cannot be
sharded."""

import os
import pathlib

import pytest
import torch
from helpers import run_python

import torch_splash

WORKER = pathlib.Path(__file__).with_name("spmd_worker.py")
# name: (output sharding, local (batch, Hq, Hkv) each device runs) on a (2, 2) mesh ("data", "model"), B=4
EXPECTED = {
    "batch": ("{devices=[2,1,1,1,2]0,1,2,3 last_tile_dim_replicate}", [2, 4, 2, 200]),
    "heads-gqa": ("{devices=[1,2,1,1,2]0,2,1,3 last_tile_dim_replicate}", [4, 2, 1, 200]),
    "batch-and-heads-mqa": ("{devices=[2,2,1,1]0,1,2,3}", [2, 2, 1, 200]),
    "inputs-not-marked": ("{devices=[2,2,1,1]0,1,2,3}", [2, 2, 1, 200]),
    # with sinks (one logit per query head), whose gradient sums over the batch shards
    "batch-and-heads-gqa-sinks": ("{devices=[2,2,1,1]0,1,2,3}", [2, 4, 1, 200]),
    "all-devices-on-batch-sinks": ("{devices=[4,1,1,1]0,1,2,3}", [1, 2, 2, 200]),
    # the query sequence sharded (L=200): each device attends its rows to every key
    "seq4-causal": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "seq4-causal-balanced": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "seq4-chunked-mqa-ids": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 1, 50]),
    "batch-seq-window-ids": ("{devices=[2,1,2,1]0,1,2,3}", [2, 4, 2, 100]),
    "batch-seq-causal-ids-balanced": ("{devices=[2,1,2,1]0,1,2,3}", [2, 4, 2, 100]),
    "heads-seq-sinks-balanced": ("{devices=[1,2,2,1]0,1,2,3}", [4, 4, 1, 100]),
    # per-head and tensor masks (stored partial blocks), their tables split like q
    "seq4-per-head-ids": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "seq4-tensor-balanced": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "heads-per-head-tensor": ("{devices=[1,4,1,1]0,1,2,3}", [4, 1, 1, 200]),
    "heads-seq-per-head-sinks-balanced": ("{devices=[1,2,2,1]0,1,2,3}", [4, 2, 1, 100]),
    # the ring: every device holds one shard of k and v too, and dk, dv come back sharded like them
    "ring-seq4-causal-ids-sinks": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "ring-seq4-causal-ids-balanced": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "ring-seq4-window-mqa-ids-balanced": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 1, 50]),
    "ring-seq4-chunked-ids": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "ring-seq4-full-ids": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
    "ring-batch-seq-window-ids": ("{devices=[2,1,2,1]0,1,2,3}", [2, 4, 2, 100]),
    "ring-heads-seq-per-head-sinks-balanced": ("{devices=[1,2,2,1]0,1,2,3}", [4, 2, 1, 100]),
    "ring-seq4-tensor-balanced": ("{devices=[1,1,4,1]0,1,2,3}", [4, 4, 2, 50]),
}
# Calls with a structured mask every head shares, sharded over batch, heads or the sequence (each
# device's list and positions its inputs), ring or not: the active-block kernels, as unsharded;
# masks read from stored blocks sharded along the sequence or with their heads: JAX's splash kernels.
ACTIVE = {
    "batch", "heads-gqa", "batch-and-heads-mqa", "inputs-not-marked", "batch-and-heads-gqa-sinks",
    "all-devices-on-batch-sinks", "seq4-causal", "seq4-causal-balanced", "seq4-chunked-mqa-ids",
    "batch-seq-window-ids", "batch-seq-causal-ids-balanced", "heads-seq-sinks-balanced",
    "ring-seq4-causal-ids-sinks", "ring-seq4-causal-ids-balanced", "ring-seq4-window-mqa-ids-balanced",
    "ring-seq4-chunked-ids", "ring-seq4-full-ids", "ring-batch-seq-window-ids",
}  # fmt: skip
ERRORS = {
    "unknown-axis": "mesh axis 'batch'; the mesh has axes ['data', 'model']",
    "batch-does-not-split": "batch size 3 does not split over 2 batch shards",
    "kv-heads-do-not-split": "2 kv heads do not split over 4 head shards",
    "dlpack-cannot-carry-shards": "transport='dlpack' cannot carry sharded tensors",
    "sequence-does-not-split": "Lq=18 does not split into 4 sequence shards: Lq must be a multiple of 4",
    "balanced-chunks-do-not-split": "Lq=20 does not split into 4 sequence shards of two mirrored chunks each",
    "balanced-without-sequence-shards": "which does not shard the query sequence",
    "kv-sequence-sharded-alone": "k is sharded along its sequence (2 ways) but partition_spec=",
    "ring-without-sequence-shards": "which leaves the query sequence whole: a ring needs the query sequence sharded",
    "ring-over-one-device": "shards the sequence over 'one', of 1 device: a ring needs",
    "ring-sequence-does-not-split": "Lq=20 does not split into 4 sequence shards of two mirrored chunks each",
}


# Cases whose layout and mask another default case already shards (the ring's masks are also
# reproduced by tests/test_ring.py): run under -m slow, by a worker of their own.
SLOW = {
    "all-devices-on-batch-sinks",
    "seq4-causal",
    "heads-seq-per-head-sinks-balanced",
    "ring-seq4-causal-ids-sinks",
    "seq4-chunked-mqa-ids",
    "heads-seq-sinks-balanced",
    "ring-seq4-window-mqa-ids-balanced",
    "ring-seq4-chunked-ids",
    "ring-seq4-full-ids",
    "ring-batch-seq-window-ids",
    "ring-seq4-tensor-balanced",
}
CASES = [pytest.param(case, marks=[pytest.mark.slow] if case in SLOW else []) for case in EXPECTED]


def _run_worker(*names) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    lines = run_python(str(WORKER), *names, env=env, timeout=1200)
    return {r.get("case", r.get("error")): r for r in lines}


@pytest.fixture(scope="module")
def default_results():
    return _run_worker(*(case for case in EXPECTED if case not in SLOW))


@pytest.fixture(scope="module")
def slow_results():
    return _run_worker(*SLOW)


@pytest.fixture
def worker_results(request, default_results):
    case = request.node.callspec.params.get("case")
    return request.getfixturevalue("slow_results") if case in SLOW else default_results


@pytest.mark.parametrize("case", CASES)
def test_sharded_matches_unsharded_forward_and_backward(worker_results, case):
    result = worker_results[case]
    out_sharding, local = EXPECTED[case]
    # f32, the same kernels on the same numbers: equal up to the order of the MQA and sinks
    # gradient sums (grads: max error relative to max(1, largest reference gradient)).
    assert result["out"] <= 1e-5 and max(result["grads"]) <= 1e-5, result
    assert len(result["grads"]) == (4 if "sinks" in case else 3)
    assert result["out_sharding"] == out_sharding  # the output stays sharded like q
    assert result["local_plan"] == local  # each device's kernels ran at its shard's shapes
    assert result["kernels"] == (["active"] * 2 if case in ACTIVE else ["splash"] * 2)
    if case.startswith("ring-"):  # one step per sequence shard; dk, dv sharded along the sequence as k
        sequence_shards = 4 if "seq4" in case else 2
        assert result["ring_steps"] == [sequence_shards]
        assert result["kv_sharding"] == out_sharding


@pytest.mark.parametrize("case", CASES)
def test_shard_local_programs_lower_for_tpu(worker_results, case):
    # jax.export(platforms=["tpu"]) of the programs attention() hands torch_xla for one shard:
    # one Mosaic kernel forward; backward, the active kernels' one, or JAX's dkv with dq fused into
    # it as the plan has it at these lengths, or dkv and dq; and with JAX's separate dq kernel.
    result = worker_results[case]
    assert result["tpu_custom_calls"] == [1, 1 if result["tpu_fused"] or case in ACTIVE else 2]
    assert result["tpu_separate_custom_calls"] == [1, 2]


@pytest.mark.parametrize("name", list(ERRORS))
def test_what_cannot_be_sharded_is_a_clear_error(worker_results, name):
    assert ERRORS[name] in (worker_results[name]["message"] or "no error raised")


@pytest.mark.parametrize(
    "spec,match",
    [
        (("data", None, None, "x"), "shards head_dim"),
        (("data", None, None), "one entry per dimension"),
        (("data", None, None, None), "torch_xla SPMD tensors; q is on cpu"),
    ],
)
def test_sharding_errors_before_any_device_work(spec, match):
    q = torch.zeros(2, 4, 16, 32)
    with pytest.raises(torch_splash.SplashConstraintError, match=match):
        torch_splash.attention(q, q, q, partition_spec=spec)


@pytest.mark.parametrize(
    "names,mesh_shape,seq",
    [
        (("seq",), (4,), "seq"),
        (("data", "seq"), (2, 8), "seq"),
        (("data", "seq", "model"), (2, 2, 4), ("seq", "model")),
    ],
)
def test_balanced_layout_moves_each_half_once_and_back(names, mesh_shape, seq):
    """The exchange between the caller's order and the balanced layout, on every ring of the mesh:
    each move is a partial permutation of the devices and no cycle, every half of every device
    arrives once, the chunks land where balanced_chunk_order puts them, and the way back brings
    each home."""
    import numpy as np

    import torch_splash_jax
    from torch_splash import _sharding

    mesh = type("Mesh", (), dict(axis_names=names, mesh_shape=mesh_shape, device_ids=np.arange(np.prod(mesh_shape))))
    sharding = _sharding.Sharding(mesh, None, None, seq, "balanced", "ring")
    shards, rings = sharding.q_shards, sharding._rings()
    order = torch_splash_jax.balanced_chunk_order(shards)
    in_order = {(int(ring[c // 2]), c % 2): (r, c) for r, ring in enumerate(rings) for c in range(2 * shards)}
    balanced = {(int(ring[p // 2]), p % 2): (r, c) for r, ring in enumerate(rings) for p, c in enumerate(order)}

    def moved(start: dict, to_balanced: bool) -> dict:
        arrived = {}
        for half, pairs in sharding._balancing_moves(to_balanced):
            targets = dict(pairs)
            assert len(targets) == len(set(targets.values())) == len(pairs)
            for source in targets:
                device = targets[source]
                while device in targets and device != source:
                    device = targets[device]
                assert device != source or targets[source] == source  # no cycle (a device may keep its half)
            for source, target in pairs:
                assert (target, half) not in arrived
                arrived[(target, half)] = start[(source, half)]
        return arrived

    assert moved(in_order, True) == balanced
    assert moved(balanced, False) == in_order
