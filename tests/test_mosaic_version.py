"""The Mosaic IR version rule (jax_core/mosaic.py): decided from the libtpu torch_xla loads, never
from JAX's guess about its own backend. What each libtpu reads was measured by compiling; the
compile check (test_tpu_compile.py) proves the pinned libtpu accepts the chosen version."""

import datetime

import pytest

from jax_core import mosaic
from torch_splash import SplashConstraintError


@pytest.fixture(autouse=True)
def fresh_decision(monkeypatch):
    for variable in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH", mosaic.OVERRIDE):
        monkeypatch.delenv(variable, raising=False)
    mosaic.ir_version.cache_clear()
    yield
    mosaic.ir_version.cache_clear()


@pytest.mark.parametrize(
    "release,reads",
    [
        ("0.0.17", 4),
        ("0.0.18", 4),
        ("0.0.19", 7),
        ("0.0.21", 7),
        ("0.0.21.1", 7),
        ("0.0.22", 8),
        ("0.0.52", 8),
    ],
)
def test_release_table(release, reads):
    # a release between two measured ones reads what the older one does (0.0.18: 4)
    assert mosaic.newest_readable(release) == reads


def test_build_date_table():
    assert mosaic.newest_readable(built=datetime.date(2025, 8, 15)) == 7
    assert mosaic.newest_readable(built=datetime.date(2025, 8, 20)) == 7
    assert mosaic.newest_readable(built=datetime.date(2026, 1, 1)) == 8


def test_a_libtpu_older_than_any_measured_is_refused():
    with pytest.raises(SplashConstraintError, match=r"libtpu 0.0.16 is older than every libtpu .* 0.0.17"):
        mosaic.newest_readable("0.0.16")
    with pytest.raises(SplashConstraintError, match="built on 2025-01-02, before every libtpu"):
        mosaic.newest_readable(built=datetime.date(2025, 1, 2))


def test_without_libtpu_the_pinned_release_decides():
    # this machine has no libtpu importable in the test process (dev.sh keeps it in its own folder)
    assert mosaic.libtpu_path() is None
    assert mosaic.ir_version() == mosaic.newest_readable(mosaic.PINNED_LIBTPU) == 7


def _fake_libtpu(tmp_path, stamp: bytes):
    path = tmp_path / "libtpu.so"
    path.write_bytes(b"\0ELF padding " * 100 + stamp + b"\0 more" * 100)
    return path


def test_a_bare_libtpu_is_read_by_its_build_date(tmp_path, monkeypatch):
    old = _fake_libtpu(tmp_path, b"Built on Jun 12 2025 16:39:57 (1749771597) cl/1")
    assert mosaic.build_date(old) == datetime.date(2025, 6, 12)
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(old))
    assert mosaic.ir_version() == 4


def test_torch_xla_s_own_library_variable_is_read(tmp_path, monkeypatch):
    new = _fake_libtpu(tmp_path, b"Built on Sep  3 2025 14:50:51 (1756936251)")
    monkeypatch.setenv("PTXLA_TPU_LIBRARY_PATH", str(new))
    assert mosaic.ir_version() == 8


def test_override(monkeypatch):
    monkeypatch.setenv(mosaic.OVERRIDE, "5")
    assert mosaic.ir_version() == 5
    mosaic.ir_version.cache_clear()
    monkeypatch.setenv(mosaic.OVERRIDE, "9")
    with pytest.raises(
        SplashConstraintError, match="TORCH_SPLASH_MOSAIC_IR_VERSION='9': expected an integer from 1 to 8"
    ):
        mosaic.ir_version()
