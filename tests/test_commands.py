"""Every command the README shows runs, as a user runs it (through ./dev.sh), in its quick mode:
so that no example or benchmark can rot unnoticed. (`./dev.sh hf-finetune` is run by test_hf.py.)"""

import json
import os
import pathlib
import subprocess
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The quick runs' results: a folder of this run's own, not the tracked benchmarks/results/.
RESULTS = pathlib.Path(tempfile.mkdtemp(prefix="torch-splash-quick-results-"))


def dev(*args, timeout=900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_SKIP_MDS_QUERY", "CPU_NUM_DEVICES")}
    env["TORCH_SPLASH_QUICK_RESULTS"] = str(RESULTS)
    done = subprocess.run(
        [str(ROOT / "dev.sh"), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_demo():
    assert "OK: torch_splash trains the model like SDPA does." in dev("demo")


# The quick runs that take minutes each on 2 cores (measured with --durations: 3 to 10 minutes
# under load) are slow tests, with the assertions on their results; so are the CPU benchmarks' (15
# to 50 s each), whose code paths the other tests run: `./dev.sh test -m slow` runs them, and a
# change to what they run is checked that way before it lands.
@pytest.mark.parametrize(
    "command,result,key",
    [
        pytest.param("bench", "bridge_quick.json", "large", marks=pytest.mark.slow),
        pytest.param("bench-masks", "masks_quick.json", "tables", marks=pytest.mark.slow),
        pytest.param("bench-memory", "memory_quick.json", "programs", marks=pytest.mark.slow),
        pytest.param("bench-hf", "hf_quick.json", "rows", marks=pytest.mark.slow),
        pytest.param("bench-transports", "transports_quick.json", "graph", marks=pytest.mark.slow),
        ("bench-tpu-memory", "tpu_memory_quick.json", "rows"),
        pytest.param("bench-flex", "flex_quick.json", "rows", marks=pytest.mark.slow),
        pytest.param("bench-sequence", "sequence_quick.json", "blocks", marks=pytest.mark.slow),
        pytest.param("bench-context-parallel", "context_parallel_quick.json", "rows", marks=pytest.mark.slow),
        pytest.param("fit-llama", "fit_quick.json", "rows", marks=pytest.mark.slow),
        pytest.param("bench-tpu-time", "tpu_time_quick.json", "calibration", marks=pytest.mark.slow),
        ("bench-decode", "decode_quick.json", "steps"),
        ("bench-active-kernels", "active_kernels_quick.json", "rows"),
        ("bench-hf-decode", "hf_decode_quick.json", "rows"),
    ],
)
def test_benchmark_quick_mode(command, result, key):
    (RESULTS / result).unlink(missing_ok=True)
    dev(command, "--quick")
    assert json.loads((RESULTS / result).read_text())[key]
    assert json.loads((RESULTS / result).read_text())["machine"]


@pytest.mark.slow
def test_flex_attention_s_step_needs_a_tenth_of_the_dense_bias_s_hbm():
    """From bench-flex --quick: the TPU compiler's HBM for a document-masked training step at 8K
    tokens on one v5e chip, torch_splash.flex_attention against the dense -inf bias plus SDPA that
    TorchTPU's patch runs (measured: 0.40 GiB against 8.24 GiB)."""
    path = RESULTS / "flex_quick.json"
    if not path.exists():
        dev("bench-flex", "--quick")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["splash"]["fits"] and row["splash"]["bytes"] * 10 < row["dense"]["bytes"], row


def test_tpu_memory_steps_are_compiled_with_their_weights_donated():
    """From bench-tpu-memory --quick: each step is compiled as torch_splash.fit compiles it, with
    torch_xla's buffer donors, so the two weights it updates in place (2048 x 4096 and 2048 x 2048,
    bf16: 24 MiB) are donated and counted once, by torch_splash's step and by SDPA's."""
    path = RESULTS / "tpu_memory_quick.json"
    if not path.exists():
        dev("bench-tpu-memory", "--quick")
    r = json.loads(path.read_text())
    weights = (2048 * 4096 + 2048 * 2048) * 2
    assert r["donated"] and {row["impl"] for row in r["rows"]} == {"splash", "sdpa"}, r
    assert all(row["fits"] and row["donated"] == weights for row in r["rows"]), r["rows"]


@pytest.mark.slow
def test_tpu_time_estimates_one_of_tokamax_s_measured_entries():
    """From bench-tpu-time --quick: the estimate of tokamax's kernel at one of its measured entries
    (v5p, 2K tokens) is within 25% of tokamax's measured time, with the estimator's fitted numbers;
    and the plan search estimated every candidate it ran."""
    path = RESULTS / "tpu_time_quick.json"
    if not path.exists():
        dev("bench-tpu-time", "--quick")
    r = json.loads(path.read_text())
    (entry,) = r["calibration"]["v5p/forward"]
    estimate = (
        entry["schedule_ms"] * r["clock_factor"]["v5p"] + entry["hbm_ms"] + entry["rows"] * r["row_stall_us"] * 1e-3
    )
    assert abs(estimate / entry["measured_ms"] - 1) <= 0.25, (estimate, entry)
    (row,) = r["search"]
    assert all(isinstance(ms, float) and ms > 0 for ms in row["ms"].values()), row


def test_benchmark_docs_match_the_results_files():
    """docs/benchmarks.md is generated from benchmarks/results/*.json; a hand edit or a run whose
    tables were not regenerated fails here."""
    dev("bench-report", "--check")


def test_dev_sh_m_selects_within_each_set():
    """`./dev.sh test -m EXPR` combines EXPR with each set's own filter: a set never runs the other
    set's tests (`-m slow` once ran the ring's slow torch_xla cases in the current set)."""
    script = (
        f'source <(sed -n "/^markers() {{/,/^}}/p" "{ROOT / "dev.sh"}")\n'
        'markers xla -q -m slow -k "a or b"; echo "$MARKERS|${ARGS[*]}"\n'
        'markers torchtpu -m"not hf"; echo "$MARKERS"\n'
        'markers xla tests/test_ring.py; echo "$MARKERS|${ARGS[*]}"\n'
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "(slow) and not xla|-q -k a or b",
        "(not hf) and not torchtpu",
        "not slow and not xla|tests/test_ring.py",
    ]


def test_lint():
    """`./dev.sh lint` (ruff check and ruff format --check), as CI runs it."""
    dev("lint")


@pytest.mark.slow
def test_sequence_sharding_balances_causal_work_and_fits_in_less_hbm_per_chip():
    """From bench-sequence --quick (run above; run it if missing): the balanced layout gives every
    device the same causal blocks, the same total as contiguous shards; the TPU compiler's HBM per
    chip for the step sharded over 4 chips is below the unsharded step's on one; the sharded step
    with a per-head mask compiles."""
    path = RESULTS / "sequence_quick.json"
    if not path.exists():
        dev("bench-sequence", "--quick")
    result = json.loads(path.read_text())
    by = {(r["L"], r["devices"], r["layout"]): r["blocks"] for r in result["blocks"]}
    for (length, devices, layout), blocks in by.items():
        if layout == "balanced":
            contiguous = by[(length, devices, "contiguous")]
            assert len(set(blocks)) == 1 and sum(blocks) == sum(contiguous), (blocks, contiguous)
            assert max(contiguous) > 1.5 * blocks[0]  # the last contiguous shard's causal load
    memory = {(r["mask"], r["chips"], r["L"]): r for r in result["tpu_memory"]}
    one, four = memory[("causal", 1, 8192)], memory[("causal", 4, 8192)]
    assert one["fits"] and four["fits"] and four["bytes"] < one["bytes"], (one, four)
    # a per-head mask (stored partial blocks, per-head tables split along the sequence) compiles too
    assert memory[("per-head", 4, 8192)]["fits"], memory


@pytest.mark.slow
def test_the_ring_compiles_for_tpu_beside_the_all_gather():
    """From bench-context-parallel --quick: the TPU compiler compiles the ring's training step (every
    step's Mosaic kernels, the collective permutes between them) for v5e:2x2, as it does the
    all-gather's, and for v5e:4x4."""
    path = RESULTS / "context_parallel_quick.json"
    if not path.exists():
        dev("bench-context-parallel", "--quick")
    rows = {(r["strategy"], r["chips"]): r for r in json.loads(path.read_text())["rows"]}
    ring, all_gather, ring16 = rows[("ring", 4)], rows[("all_gather", 4)], rows[("ring", 16)]
    assert ring["fits"] and all_gather["fits"] and ring16["fits"], rows
    # Over 4 chips the gathered k and v are only four shards, yet the ring holds less (measured
    # 0.32 against 0.41 GiB). With each step's keys sent on before that step's kernels (not after)
    # the ring needed 0.39.
    assert ring["bytes"] < 0.85 * all_gather["bytes"], rows
    # Every ring permute is its own: the forward's and the backward's sends of k and v (2 per step
    # but the last), dk and dv (2 per step, the last send home). When the backward's first sends
    # computed the same as the forward's, XLA merged them and kept that shard alive in between.
    for row in (ring, ring16):
        assert row["ring_permutes"] == 6 * row["chips"] - 4, row
    # HBM per chip at a fixed shard (8K tokens) does not grow with the ring: 16 chips within 1.25x
    # of 4 (the step tables grow with the chips; measured 0.39 and 0.32 GiB). Reordering the global
    # tensors for the balanced layout instead took 0.93 GiB over 16 chips.
    assert ring16["bytes"] < 1.25 * ring["bytes"], rows


def test_a_decode_step_is_estimated_near_the_hbm_floor_and_far_below_splash():
    """From bench-decode --quick: one decode step (v5e, 4K cache, B=8, 32/8 heads, head_dim 128), the
    decode kernel's program against the splash forward's, both estimated from the TPU compiler's
    schedule (estimated at this commit: 1.35x and 11.6x the HBM floor)."""
    path = RESULTS / "decode_quick.json"
    if not path.exists():
        dev("bench-decode", "--quick")
    (step,) = json.loads(path.read_text())["steps"]
    assert step["decode"]["seconds"] < 1.5 * step["floor"], step
    assert step["splash"]["seconds"] > 5 * step["decode"]["seconds"], step


def test_an_hf_decode_step_with_splash_is_estimated_faster_than_with_sdpa():
    """From bench-hf-decode --quick: one Llama layer's decode step (hidden 4096, 32/8 heads of 128,
    bf16, B=8, a 4K StaticCache, v5e) checked by torch_splash.fit with each attention: splash's
    step (its decode kernel's estimate plus XLA's estimate of the rest) is estimated faster than
    sdpa's (XLA's estimate of all of it), both count the donated cache once, and splash's attention
    kernel is within 1.5x of reading the cache once (estimated at this commit: 2.33 ms against
    2.83 ms, the kernel 1.26x the floor)."""
    path = RESULTS / "hf_decode_quick.json"
    if not path.exists():
        dev("bench-hf-decode", "--quick")
    (row,) = json.loads(path.read_text())["rows"]
    sdpa, splash = row["sdpa"], row["splash"]
    assert splash["seconds"] < sdpa["seconds"], row
    assert splash["calls"] == 1 and splash["attention"] < 1.5 * row["floor"], row
    cache = 2 * 8 * 8 * 4096 * 128 * 2
    assert sdpa["donated"] >= cache and splash["donated"] >= cache, row


@pytest.mark.slow
def test_tpu_check_runs_a_user_s_call_on_the_cpu():
    """`./dev.sh tpu-check` (the real-chip check, JAX only) on a machine without a TPU: the user's
    call alone (--shape/--mask, --only), its fidelity against the float32 reference with gradients,
    its timing beside JAX's splash and XLA's dense attention, and (the torch_xla set has it) the
    same call through torch_splash.attention on torch_xla's CPU device (a minute on 2 cores; the
    real chip runs the whole check: docs/benchmarks.md)."""
    out = RESULTS / "tpu_check_quick.json"
    dev("tpu-check", "--quick", "--only", "--shape", "2,4,2,256,64", "--mask", "window:64",
        "--parts", "limits,fidelity,timing,bridge", "--out", str(out))  # fmt: skip
    results = json.loads(out.read_text())
    assert results["chip"]["platform"] == "cpu" and results["limits"]["matmul_tflop_s"] > 0
    (fidelity,) = results["fidelity"]
    assert fidelity["passed"] and set(fidelity["errors"]) == {"out", "dq", "dk", "dv"}, fidelity
    (row,) = results["timing"]
    assert {"plan", "plan, a call per batch element", "JAX splash, MaxText blocks", "XLA dense"} <= set(row["variants"])
    assert all("step_ms" in row["variants"][v] for v in ("plan", "XLA dense")), row
    assert results.get("bridge_skipped") or results["bridge"][0]["passed"], results.get("bridge")


@pytest.mark.slow
def test_tpu_check_quick_mode():
    """The whole check at small sizes (its own cases, every part but the estimates): minutes on 2 cores."""
    out = RESULTS / "tpu_check_all_quick.json"
    dev("tpu-check", "--quick", "--parts", "limits,fidelity,timing,ring,bridge", "--out", str(out))
    results = json.loads(out.read_text())
    assert results["fidelity"] and all(f["passed"] for f in results["fidelity"]), results["fidelity"]
    # the ring's steps device after device, on both kernels, against the unsharded call
    assert [r["kernels"] for r in results["ring"]] == ["active", "splash"], results["ring"]
    assert all(r["passed"] and r["forward_kernel"] == r["kernels"] for r in results["ring"]), results["ring"]
    assert all("error" not in r for r in results["timing"]), results["timing"]
