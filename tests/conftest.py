"""pytest hooks and fixtures; the shared test helpers (references, inputs) are in helpers.py."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest


def pytest_configure(config):
    # Start torch_xla's runtime before any CPU backward: a CPU backward first leaves autograd
    # without a ready queue for the XLA device, and a later XLA backward then fails (docs/design.md).
    import torch_xla

    torch_xla.device()


@pytest.fixture
def xla_device():
    import torch_xla

    return torch_xla.device()
