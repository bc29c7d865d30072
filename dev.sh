#!/usr/bin/env bash
# The two set-up commands of the README:
#   ./dev.sh demo          installs what is missing, runs examples/quickstart.py (CPU, no download)
#   ./dev.sh test [args]   installs what is missing, runs the test suite on both tested sets (extra args
#                          go to pytest; -m EXPR selects within each set, never the other set's tests):
#                          test-xla, then test-current
# and the rest:
#   ./dev.sh test-xla [args]       the torch_xla set (Python 3.11, torch 2.9, torch_xla 2.9, jax 0.7.1), in .venv:
#                          every test but TorchTPU's (-m torchtpu)
#   ./dev.sh test-current [args]   the current set (Python 3.12, torch 2.15, jax 0.12, TorchTPU), in
#                          .venv-current: every test but torch_xla's (-m xla: its transport, SPMD,
#                          sequence sharding, the ring)
#   ./dev.sh bench         runs benchmarks/bench_bridge.py (a few minutes)
#   ./dev.sh bench-masks   runs benchmarks/bench_masks.py (block tables, sliding window scaling)
#   ./dev.sh bench-memory  runs benchmarks/bench_memory.py (RSS per new shape before and after the program cache fills)
#   ./dev.sh bench-hf      runs benchmarks/bench_hf.py (HF training step, splash vs sdpa, L 512-4096)
#   ./dev.sh bench-transports   runs benchmarks/bench_transports.py (torch_xla step: in-graph vs DLPack)
#   ./dev.sh bench-tpu-memory   runs benchmarks/bench_tpu_memory.py (HBM per step from the TPU compiler)
#   ./dev.sh bench-flex         runs benchmarks/bench_flex.py (FlexAttention: HBM of a document-masked step, host cost)
#   ./dev.sh bench-sequence     runs benchmarks/bench_sequence.py (the query sequence sharded: blocks, HBM, time)
#   ./dev.sh bench-context-parallel  runs benchmarks/bench_context_parallel.py (all-gather vs ring: HBM per chip)
#   ./dev.sh bench-tpu-time     runs benchmarks/bench_tpu_time.py in the current set (TPU kernel time estimated
#                          from the compiler's schedule, against tokamax's measured times)
#   ./dev.sh bench-decode       runs benchmarks/bench_decode.py in the current set (decode steps and chunked
#                          prefill: the decode kernel against splash, dense attention and the HBM floor, estimated)
#   ./dev.sh bench-active-kernels  runs benchmarks/bench_active_kernels.py in the current set (the active-block
#                          forward against JAX's splash forward per generation, estimated; v5e's error against the chip)
#   ./dev.sh bench-hf-decode    runs benchmarks/bench_hf_decode.py (one HF Llama layer's decode step, splash vs
#                          sdpa, through torch_splash.fit: estimated time and HBM per generation)
# Every bench-* command takes --quick (a smoke run; the test suite runs each one that way).
#   ./dev.sh bench-report  rewrites docs/benchmarks.md from benchmarks/results/*.json (--check: compare only)
#   ./dev.sh lint          ruff check and ruff format --check (CI runs it before the tests)
#   ./dev.sh hf-finetune   runs examples/hf_finetune.py (tiny Llama, splash vs sdpa loss curves + plot)
#   ./dev.sh fit-llama     runs examples/fit_llama.py (does an HF Llama step fit on a v5e chip? --quick too)
#   ./dev.sh tpu-check     python -m torch_splash_jax.tpu_check: the real-chip check on a TPU host (JAX only;
#                          --quick: a smoke run on the CPU)
#   ./dev.sh lock          re-resolves locks/*.txt from pyproject.toml and locks/*.in (needs the registry)
# Each set installs exactly from its lock file (locks/), into its own venv, rebuilt only when the
# lock or pyproject.toml changes: .venv (the torch_xla set, Python 3.11), .venv-current (Python 3.12).
set -euo pipefail
cd "$(dirname "$0")"
UV_VERSION=0.13.9

python_for() {  # an interpreter of Python $1: on PATH, or one pyenv installed
  local found
  for found in "$(command -v "python$1" || true)" /root/.pyenv/versions/"$1".*/bin/"python$1"; do
    if [ -n "$found" ] && [ -x "$found" ] && "$found" -c pass 2>/dev/null; then echo "$found"; return; fi
  done
  echo "[dev.sh] no Python $1 found: install one (e.g. apt-get install python$1-venv)" >&2; exit 1
}

# install VENV PYTHON_VERSION LOCK: the exact set of LOCK, then torch_splash itself (editable, no deps).
install() {
  local venv=$1 version=$2 lock=$3 stamp
  stamp="$venv/.installed-$(cat "$lock" pyproject.toml | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && return
  echo "[dev.sh] installing $lock into $venv (first run: a few minutes, torch is large)" >&2
  # each set is about 8 GB installed (7.6 and 7.2 GB measured): say so before uv runs out of space midway
  local free_gb
  free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free_gb" -lt 8 ]; then
    echo "[dev.sh] $venv needs about 8 GB of disk and $free_gb GB is free here: free some space first" >&2; exit 1
  fi
  [ -x "$venv/bin/python" ] || "$(python_for "$version")" -m venv "$venv"
  # uv, not pip, installs the set: pip holds every downloaded wheel until it has installed them
  # all (12.2 GB of disk at its peak for a 7.9 GB venv; CI once ran out of space there), where uv
  # unpacks wheels as they stream into its cache and hard-links them into the venv (peak 7.9 GB).
  # The cache lives inside the venv so that the hard links never cross file systems.
  "$venv/bin/python" -m pip install -q "uv==$UV_VERSION"
  export UV_CACHE_DIR="$PWD/$venv/uv-cache" UV_LINK_MODE=hardlink
  "$venv/bin/python" -m uv pip install -q --python "$venv/bin/python" -r "$lock"
  "$venv/bin/python" -m uv pip install -q --python "$venv/bin/python" --no-deps -e .
  rm -f "$venv"/.installed-* && touch "$stamp"
}

# libtpu, for the TPU compile checks only (tests/test_tpu_compile.py, benchmarks/bench_tpu_memory.py):
# the release torch_xla's `tpu` extra pins (torch_splash_jax/mosaic.py), in a folder of its own that only
# those checks' own processes put on their path, so JAX never takes it for a backend elsewhere.
install_libtpu() {
  local release
  release=$(.venv/bin/python -c 'import runpy; print(runpy.run_path("torch_splash_jax/mosaic.py")["PINNED_LIBTPU"])')
  if [ ! -f ".venv/libtpu/.installed-$release" ]; then
    echo "[dev.sh] installing libtpu==$release into .venv/libtpu (for the TPU compile checks)" >&2
    rm -rf .venv/libtpu
    .venv/bin/python -m pip install -q --no-deps --target .venv/libtpu "libtpu==$release"
    touch ".venv/libtpu/.installed-$release"
  fi
  export TORCH_SPLASH_LIBTPU_DIR="$PWD/.venv/libtpu"
  # the TPU time estimator reads the schedules of the libtpu it was calibrated with (the current set's)
  release=$(sed -n 's/^ESTIMATOR_LIBTPU = "\(.*\)"$/\1/p' torch_splash_jax/tpu_time/libtpu.py)
  if [ ! -f ".venv/libtpu-estimator/.installed-$release" ]; then
    echo "[dev.sh] installing libtpu==$release into .venv/libtpu-estimator (for the TPU time estimates)" >&2
    rm -rf .venv/libtpu-estimator
    .venv/bin/python -m pip install -q --no-deps --target .venv/libtpu-estimator "libtpu==$release"
    touch ".venv/libtpu-estimator/.installed-$release"
  fi
  export TORCH_SPLASH_ESTIMATOR_LIBTPU_DIR="$PWD/.venv/libtpu-estimator"
}
cmd="${1:-}"; shift || true
case "$cmd" in
  test-current|bench-tpu-time|bench-decode|bench-active-kernels) install .venv-current 3.12 locks/current-py312.txt ;;
  tpu-check) ;;  # needs only JAX: see below
  test) install .venv 3.11 locks/xla-py311.txt; install .venv-current 3.12 locks/current-py312.txt ;;
  *) install .venv 3.11 locks/xla-py311.txt ;;
esac
workers="${TORCH_SPLASH_TEST_WORKERS:-2}"
# markers OTHER_SET_MARKER [pytest args]: sets MARKERS to the -m expression for one set and ARGS to the
# other arguments. A set never runs the other set's tests ("not OTHER_SET_MARKER"); by default it also
# skips the slow sweeps ("not slow"), and a caller's -m EXPR takes that place: "(EXPR) and not
# OTHER_SET_MARKER", so `-m slow` runs the slow sweeps each set can run, and nothing of the other's.
markers() {
  local other=$1 expr=""
  shift
  ARGS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      -m) [ $# -ge 2 ] || { echo "[dev.sh] -m needs a marker expression" >&2; exit 2; }
        expr=$2; shift 2 ;;
      -m*) expr=${1#-m}; expr=${expr#=}; shift ;;
      *) ARGS+=("$1"); shift ;;
    esac
  done
  if [ -n "$expr" ]; then MARKERS="($expr) and not $other"; else MARKERS="not slow and not $other"; fi
}
# The torch_xla set; TorchTPU's tests are deselected (their package and libtpu are the current set's).
test_xla() {
  install_libtpu
  markers torchtpu "$@"
  .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -m "$MARKERS" ${ARGS[@]+"${ARGS[@]}"}
}
# The current set. TorchTPU's libtpu (in the venv, where TorchTPU installs it) serves the TPU compile
# checks; torch_splash keeps JAX on the CPU where TorchTPU is installed, and the test processes are told so too.
test_current() {
  markers xla "$@"
  TORCH_SPLASH_LIBTPU_DIR=$(.venv-current/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    JAX_PLATFORMS=cpu .venv-current/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder \
    -m "$MARKERS" ${ARGS[@]+"${ARGS[@]}"}
}
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
case "$cmd" in
  demo) exec .venv/bin/python examples/quickstart.py "$@" ;;
  # Two pytest workers (pytest-xdist), a test file each at a time (module fixtures run once): on 2
  # cores the suite's subprocesses and JAX compiles leave a single pytest process idle for long
  # stretches. Files go out longest first (tests/conftest.py). TORCH_SPLASH_TEST_WORKERS=0 (or -n 0)
  # runs everything in one process.
  # -m EXPR selects within each set: "(EXPR) and not <the other set's marker>" (`-m slow`: the slow
  # sweeps each set can run; see `markers`).
  # Both sets, each in full; the run fails when either does. With pytest arguments that select
  # only one set's tests, the other collects none (pytest's exit 5), which is not a failure.
  test) status=0
    echo "[dev.sh] the torch_xla set (locks/xla-py311.txt)" >&2
    test_xla "$@" || { rc=$?; [ $rc -eq 5 ] && [ $# -gt 0 ] || status=$rc; }
    echo "[dev.sh] the current set (locks/current-py312.txt)" >&2
    test_current "$@" || { rc=$?; [ $rc -eq 5 ] && [ $# -gt 0 ] || status=$rc; }
    exit $status ;;
  test-xla) test_xla "$@" ;;
  test-current) test_current "$@" ;;
  lock) uv=(.venv/bin/python -m uv pip compile -q pyproject.toml --extra test)
    "${uv[@]}" --extra xla -c locks/xla.in --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o locks/xla-py311.txt
    "${uv[@]}" --extra torchtpu --extra calibrate -c locks/current.in --python-version 3.12 --python-platform x86_64-manylinux_2_31 \
      -o locks/current-py312.txt ;;
  bench) exec .venv/bin/python benchmarks/bench_bridge.py "$@" ;;
  bench-masks) exec .venv/bin/python benchmarks/bench_masks.py "$@" ;;
  bench-memory) exec .venv/bin/python benchmarks/bench_memory.py "$@" ;;
  bench-hf) exec .venv/bin/python benchmarks/bench_hf.py "$@" ;;
  bench-transports) exec .venv/bin/python benchmarks/bench_transports.py "$@" ;;
  bench-tpu-memory) install_libtpu; exec .venv/bin/python benchmarks/bench_tpu_memory.py "$@" ;;
  bench-flex) install_libtpu; exec .venv/bin/python benchmarks/bench_flex.py "$@" ;;
  bench-sequence) install_libtpu; exec .venv/bin/python benchmarks/bench_sequence.py "$@" ;;
  bench-context-parallel) install_libtpu; exec .venv/bin/python benchmarks/bench_context_parallel.py "$@" ;;
  bench-tpu-time) TORCH_SPLASH_LIBTPU_DIR=$(.venv-current/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    JAX_PLATFORMS=cpu exec .venv-current/bin/python benchmarks/bench_tpu_time.py "$@" ;;
  bench-decode) TORCH_SPLASH_LIBTPU_DIR=$(.venv-current/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    JAX_PLATFORMS=cpu exec .venv-current/bin/python benchmarks/bench_decode.py "$@" ;;
  bench-active-kernels) TORCH_SPLASH_LIBTPU_DIR=$(.venv-current/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    JAX_PLATFORMS=cpu exec .venv-current/bin/python benchmarks/bench_active_kernels.py "$@" ;;
  bench-hf-decode) install_libtpu; exec .venv/bin/python benchmarks/bench_hf_decode.py "$@" ;;
  bench-report) exec .venv/bin/python benchmarks/report.py "$@" ;;
  lint) .venv/bin/ruff check . && exec .venv/bin/ruff format --check . ;;
  hf-finetune) exec .venv/bin/python examples/hf_finetune.py "$@" ;;
  # The real-chip check needs only JAX: the machine's own Python where it has JAX (a TPU VM), else
  # the torch_xla set's venv (a machine without a TPU: --quick, or --parts estimates). torch_splash
  # goes at the end of the path, so that the machine's JAX stays first.
  tpu-check) py=python3
    if ! python3 -c "import jax" 2>/dev/null; then install .venv 3.11 locks/xla-py311.txt; install_libtpu; py=.venv/bin/python; fi
    PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" exec "$py" -m torch_splash_jax.tpu_check "$@" ;;
  fit-llama) install_libtpu; exec .venv/bin/python examples/fit_llama.py "$@" ;;
  *) echo "usage: ./dev.sh demo | test [pytest args] | test-xla [pytest args] | test-current [pytest args] | bench | bench-masks | bench-memory | bench-hf |" \
          "bench-transports | bench-tpu-memory | bench-flex | bench-sequence | bench-context-parallel | bench-tpu-time | bench-decode | bench-active-kernels |" \
          "bench-hf-decode | tpu-check |" \
          "bench-report | lint |" \
          "hf-finetune | fit-llama | lock" >&2; exit 2 ;;
esac
