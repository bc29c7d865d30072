"""Supported ranges, not pins: what pyproject.toml declares is what torch_splash checks at import,
and a Python, package or transport outside them is refused by name before any work."""

import importlib.util
import pathlib
import tomllib

import pytest
import torch

from torch_splash import SplashConstraintError, SplashError, SplashVersionError, _transport
from torch_splash_jax import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _range(requirement: str) -> tuple[str, str]:
    low, high = requirement.split(">=")[1].split(",<")
    return low.strip(), high.strip().strip('"')


def test_the_checked_ranges_are_the_declared_ones():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {"python": _range(project["requires-python"])}
    for requirement in project["dependencies"]:
        name = requirement.split(">=")[0]
        declared[name] = _range(requirement)
    assert declared == compat.SUPPORTED


def test_the_installed_set_is_inside_the_ranges():
    compat.check_versions(("python", "torch", "jax", "jaxlib", "numpy"))


@pytest.mark.parametrize(
    "name,found", [("jax", "0.13.0"), ("jax", "0.6.2"), ("torch", "2.15.0"), ("numpy", "1.26.4"), ("python", "3.14.0")]
)
def test_a_version_outside_the_ranges_is_refused_naming_both(monkeypatch, name, found):
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    if name == "python":
        monkeypatch.setattr(compat, "python_version", lambda: found)
    else:
        monkeypatch.setattr(compat, "installed", lambda package: found if package == name else "1")
    low, high = compat.SUPPORTED[name]
    with pytest.raises(SplashVersionError, match=rf"{name} {found} is outside .* \({name} >={low},<{high}\)") as raised:
        compat.check_versions((name,))
    assert isinstance(raised.value, ImportError) and isinstance(raised.value, SplashError)
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match=f"{name} {found} is outside"):
        compat.check_versions((name,))


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
