"""On a TPU host (PJRT_DEVICE=TPU) importing torch_splash leaves the TPU to torch_xla: torch_xla's
guard runs before JAX is imported, and JAX is kept on the CPU, in either import order.

No TPU is reachable here, so each case runs in a fresh interpreter with torch_xla's guard replaced
by a recorder (the real one would open the TPU); what is asserted is what torch_splash tells JAX
and torch_xla, and in which order."""

import os
import textwrap

from helpers import run_python

PROLOGUE = """
import json, sys, warnings
import torch_xla._internal.jax_workarounds as workarounds
calls = []
workarounds.jax_import_guard = lambda: calls.append("jax" in sys.modules)
"""

EPILOGUE = """
import jax
print(json.dumps({"guard_saw_jax": calls, "platforms": jax.config.jax_platforms,
                  "devices": [d.platform for d in jax.devices()] if jax.config.jax_platforms == "cpu" else None,
                  "warnings": [str(w.message) for w in caught]}))
"""


def _run(body: str, **env) -> dict:
    script = PROLOGUE + textwrap.dedent(body) + EPILOGUE
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, "PJRT_DEVICE": "TPU", **env}
    return run_python("-c", script, env=env, timeout=300)[-1]


def test_torch_splash_first_guard_runs_before_jax_and_jax_stays_on_cpu():
    got = _run("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_splash
    """)
    assert got == {"guard_saw_jax": [False], "platforms": "cpu", "devices": ["cpu"], "warnings": []}


def test_jax_imported_first_is_kept_on_cpu_without_a_warning():
    got = _run("""
        import jax
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_splash
    """)
    # JAX had not opened a backend yet, so it can still be kept off the TPU; torch_xla's guard is
    # not run after JAX (it exists to run before it).
    assert got == {"guard_saw_jax": [], "platforms": "cpu", "devices": ["cpu"], "warnings": []}


def test_jax_already_on_the_tpu_warns():
    got = _run("""
        import types, jax
        from jax._src import xla_bridge
        jax.devices = lambda *a: [types.SimpleNamespace(platform="tpu")]  # as if JAX had opened a TPU
        xla_bridge.backends_are_initialized = lambda: True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_splash
    """)
    assert got["guard_saw_jax"] == []
    assert len(got["warnings"]) == 1 and "JAX opened the TPU before torch_splash" in got["warnings"][0]


def test_callers_jax_platforms_is_respected():
    got = _run(
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_splash
    """,
        JAX_PLATFORMS="tpu,cpu",
    )
    # JAX will open the TPU as asked, so torch_xla's guard has run first.
    assert got == {"guard_saw_jax": [False], "platforms": "tpu,cpu", "devices": None, "warnings": []}
