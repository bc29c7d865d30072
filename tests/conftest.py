"""pytest hooks and fixtures; the shared test helpers (references, inputs) are in helpers.py."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
# Where TorchTPU is installed (the current set), `import torch` loads it and the first backward asks
# it for its device count, which starts libtpu and takes libtpu's lockfile: two test processes
# doing so at once (both workers, or a worker and the subprocess of a test) abort one of them.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest


def pytest_configure(config):
    # Start torch_xla's runtime before any CPU backward: a CPU backward first leaves autograd
    # without a ready queue for the XLA device, and a later XLA backward then fails (docs/design.md,
    # "Constraints that bind").
    # Where torch_xla is not installed (the current set: dev.sh runs it with -m "not xla"), its
    # tests are deselected.
    try:
        import torch_xla
    except ImportError:
        return
    torch_xla.device()


# The files that take longest (summed --durations on 2 cores, the larger of the two sets' sums),
# longest first, but for the torch_xla set's README commands and SPMD worker, which start first
# there: with its compile fixture first, the other files ran beside it and slower (torch_xla set
# 13:04 against 12:32). Workers take whole files in collection order (dev.sh passes
# --no-loadscope-reorder): sent last, one of these keeps a worker busy after the other has finished.
LONGEST_FILES = (
    "test_commands.py",
    "test_spmd.py",
    "test_tpu_compile.py",
    "test_fit.py",
    "test_active_kernels.py",
    "test_flex.py",
    "test_docs.py",
    "test_tpu_time.py",
    "test_hf.py",
    "test_sequence_sharding.py",
    "test_attention.py",
    "test_ring.py",
    "test_sdpa.py",
    "test_torchtpu.py",
    "test_masks.py",
    "test_fit_loops.py",
)


# Files that need torch_xla throughout (the torch_xla set runs them; the current set has no
# torch_xla). test_commands runs the README's commands, which install and use the torch_xla set.
# test_sequence_sharding and test_ring run JAX alone, but what they test (partition_spec and mesh:
# sequence shards, the ring) only torch_xla's SPMD serves, whose JAX is 0.7 (pyproject's xla
# extra): under the current set's JAX no supported install reaches those programs.
XLA_FILES = (
    "test_commands.py",
    "test_spmd.py",
    "test_import_order.py",
    "test_graph_transport.py",
    "test_xla_device.py",
    "test_sequence_sharding.py",
    "test_ring.py",
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in XLA_FILES or "xla_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xla)

    def rank(item):
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: the order inside each file is kept


@pytest.fixture
def planned_for_tpu():
    """The test's torch_xla CPU-device tensors get kernels planned and lowered for TPU."""
    from torch_splash.fit import planned_for_tpu

    with planned_for_tpu():
        yield


@pytest.fixture
def xla_device():
    import torch_xla

    return torch_xla.device()


@pytest.fixture
def small_active_blocks(monkeypatch):
    """The active kernels planned with 256 x 256 blocks in 128 x 128 tiles: lists of several blocks
    (and tiles) at the short lengths interpret mode runs in seconds. The programs built meanwhile
    are dropped before and after (the blocks are not part of the plan the cache is keyed on)."""
    import torch_splash_jax
    from torch_splash_jax import block_planning

    for name in ("ACTIVE_BLOCK_Q", "ACTIVE_BLOCK_KV", "ACTIVE_BLOCK_KV_WIDE_HEADS", "ACTIVE_BACKWARD_BLOCK_Q"):
        monkeypatch.setattr(block_planning, name, 256)
    for name in ("ACTIVE_CHUNK", "ACTIVE_TILE_ROWS"):
        monkeypatch.setattr(block_planning, name, 128)
    torch_splash_jax.program.cache_clear()
    yield
    torch_splash_jax.program.cache_clear()
