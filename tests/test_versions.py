"""Lower bounds, not pins: what pyproject.toml declares is what torch_splash checks at import; an
older Python or package is refused by name before any work, a newer one than the tested sets warns
once, and no upper bound is declared but where a break is known."""

import importlib.util
import pathlib
import re
import tomllib
import warnings

import pytest
import torch

from torch_splash import SplashConstraintError, SplashError, SplashVersionError, _transport
from torch_splash_jax import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_checked_bounds_are_the_declared_ones_and_nothing_is_capped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    hf_extra = project["optional-dependencies"]["hf"]
    requirements = [f"python{project['requires-python']}", *project["dependencies"], *hf_extra]
    declared = {}
    for requirement in requirements:
        name, low = re.fullmatch(r"([\w-]+)>=([\d.]+)", requirement).groups()
        declared[name] = low
    assert declared == compat.SUPPORTED
    # The extras that cap name their break in pyproject.toml: torch_xla 2.9's torch and JAX, the
    # tokamax release whose measured caches calibrate the estimator, and the linter's formatting.
    capped = [r for extra in project["optional-dependencies"].values() for r in extra if "<" in r or "==" in r]
    names = {re.split(r"[\[<>=;]", r)[0] for r in capped}
    assert names <= {"torch_xla", "torch", "jax", "jaxlib", "tokamax", "ruff"}, capped


def test_the_tested_releases_are_the_locked_ones():
    locked = {}
    for lock in (ROOT / "locks").glob("*.txt"):
        for name, version in re.findall(r"^(torch|jax|jaxlib|numpy|transformers)==([\d.]+)$", lock.read_text(), re.M):
            locked[name] = max(locked.get(name, version), version, key=compat.release)
    assert locked == {name: v for name, v in compat.TESTED.items() if name != "python"}


def test_the_installed_set_passes_the_check_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_versions(("python", "torch", "jax", "jaxlib", "numpy", "transformers"))


@pytest.mark.parametrize(
    "name,found",
    [("jax", "0.6.2"), ("torch", "2.8.0"), ("numpy", "1.26.4"), ("python", "3.10.4"), ("transformers", "4.57.1")],
)
def test_an_older_version_is_refused_naming_both(monkeypatch, name, found):
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    if name == "python":
        monkeypatch.setattr(compat, "python_version", lambda: found)
    else:
        monkeypatch.setattr(compat, "installed", lambda package: found if package == name else "1")
    low = compat.SUPPORTED[name]
    with pytest.raises(SplashVersionError, match=rf"{name} {found} is older .* \({name} >={low}\)") as raised:
        compat.check_versions((name,))
    assert isinstance(raised.value, ImportError) and isinstance(raised.value, SplashError)
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match=f"{name} {found} is older"):
        compat.check_versions((name,))


@pytest.mark.parametrize(
    "name,found",
    [("jax", "0.13.0"), ("torch", "2.16.0"), ("numpy", "3.0.0"), ("python", "3.14.0"), ("transformers", "5.25.0")],
)
def test_a_newer_version_than_the_tested_warns_once(monkeypatch, name, found):
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr(compat, "_WARNED_UNTESTED", set())
    if name == "python":
        monkeypatch.setattr(compat, "python_version", lambda: found)
    else:
        monkeypatch.setattr(compat, "installed", lambda package: found if package == name else "1")
    with pytest.warns(UserWarning, match=rf"{name} {found} is newer than the newest tested"):
        compat.check_versions((name,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_versions((name,))  # once per process


def test_torch_xla_beside_a_torch_it_was_not_built_for_is_refused(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    versions = {"torch_xla": "2.9.0", "torch": "2.14.1", "jax": "0.7.1"}
    monkeypatch.setattr(compat, "installed", versions.get)
    compat.check_torch_xla.cache_clear()
    try:
        with pytest.raises(
            SplashVersionError, match=r"torch_xla 2.9.0 works with torch >=2.9,<2.10.*torch_splash\[xla\]"
        ):
            compat.check_torch_xla()
    finally:
        compat.check_torch_xla.cache_clear()


@pytest.mark.parametrize(
    "transport,package,extra", [("graph", "torch_xla", "xla"), ("torchtpu", "torch_tpu", "torchtpu")]
)
def test_a_transport_whose_package_is_absent_names_the_install(monkeypatch, transport, package, extra):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    with pytest.raises(SplashConstraintError, match=rf"needs {package}, .* pip install 'torch_splash\[{extra}\]'"):
        _transport.choose([torch.zeros(1)], transport)


@pytest.mark.torchtpu
def test_torchtpu_transport_for_cpu_tensors_is_refused():
    with pytest.raises(SplashConstraintError, match="needs TorchTPU tensors"):
        _transport.choose([torch.zeros(1)], "torchtpu")
