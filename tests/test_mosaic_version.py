"""The Mosaic IR version rule (torch_splash_jax/mosaic.py): decided from the libtpu torch_xla loads, never
from JAX's guess about its own backend. What each libtpu reads was measured by compiling; the
compile check (test_tpu_compile.py) proves the pinned libtpu accepts the chosen version."""

import datetime

import pytest

from torch_splash import SplashConstraintError
from torch_splash_jax import compat, mosaic


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
        ("0.0.40", 8),
        ("0.0.52", 18),
    ],
)
def test_release_table(release, reads):
    # a release between two measured ones reads what the older one does (0.0.18: 4, 0.0.40: 8)
    assert mosaic.newest_readable(release) == reads


@pytest.mark.parametrize("jax_version,writes", [("0.7.1", 8), ("0.9.2", 8), ("0.12.0.1", 18), ("0.12.1", 18)])
def test_written_table(jax_version, writes):
    # a JAX between two measured ones writes what the older one does: every newer libtpu reads it
    assert mosaic.newest_written(jax_version) == writes


def test_build_date_table():
    assert mosaic.newest_readable(built=datetime.date(2025, 8, 15)) == 7
    assert mosaic.newest_readable(built=datetime.date(2025, 8, 20)) == 7
    assert mosaic.newest_readable(built=datetime.date(2026, 1, 1)) == 8


def test_a_libtpu_older_than_any_measured_is_refused():
    with pytest.raises(SplashConstraintError, match=r"libtpu 0.0.16 is older than every libtpu .* 0.0.17"):
        mosaic.newest_readable("0.0.16")
    with pytest.raises(SplashConstraintError, match="built on 2025-01-02, before every libtpu"):
        mosaic.newest_readable(built=datetime.date(2025, 1, 2))


def test_the_libtpu_found_or_else_the_pinned_release_decides():
    # the torch_xla set keeps libtpu out of the test process (dev.sh puts it in a folder of its own):
    # the release torch_xla pins decides; the current set has TorchTPU's libtpu installed, and it does
    path = mosaic.libtpu_path()
    if path is None:
        assert mosaic.ir_version() == mosaic.newest_readable(mosaic.PINNED_LIBTPU) == 7
    else:
        release = compat.installed("libtpu")
        assert mosaic.ir_version() == min(mosaic.newest_readable(release), mosaic.newest_written())
        assert (release, mosaic.ir_version()) == ("0.0.52", 18)  # the current set (locks/current-py312.txt)


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
    monkeypatch.setenv(mosaic.OVERRIDE, "99")
    newest = mosaic.newest_written()
    with pytest.raises(
        SplashConstraintError, match=f"TORCH_SPLASH_MOSAIC_IR_VERSION='99': expected an integer from 1 to {newest}"
    ):
        mosaic.ir_version()
