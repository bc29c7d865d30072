"""`python -m torch_splash._bridge_check`: tpu_check's fidelity cases through `torch_splash.attention`,
the whole bridge (torch tensors on torch_xla's device or TorchTPU's, the custom ops, the transport,
the gradients back in torch), against the same float32 reference the JAX side's check uses.

Run by `python -m torch_splash_jax.tpu_check` where torch_xla or TorchTPU is installed, after the
chip is free; the cases come in $TORCH_SPLASH_TPU_CHECK_CALLS. Prints {"bridge": row} per case:
its relative errors, whether they are within the tolerance, and the wall time of one step (forward
and backward, to the gradients' arrival in torch) after a first one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


def _device():
    """(torch device, its name): torch_xla's, opened before JAX is imported (torch_xla issue 8793),
    else TorchTPU's "tpu"; (None, why) where neither has a device here."""
    if importlib.util.find_spec("torch_xla") is not None:
        import torch_xla

        return torch_xla.device(), "torch_xla"
    import torch

    try:
        torch.empty(1, device="tpu")
    except Exception as error:  # TorchTPU installed on a machine without a TPU
        return None, f"TorchTPU has no tpu device here ({type(error).__name__})"
    return torch.device("tpu"), "torchtpu"


def _sync(name: str) -> None:
    if name == "torch_xla":
        import torch_xla

        torch_xla.sync()


def _check(call, device, runtime: str) -> dict:
    """One case through torch_splash.attention: its errors against the reference, and a step's time."""
    import numpy as np
    import torch

    import torch_splash
    from torch_splash_jax.tpu_check.cases import TOLERANCE
    from torch_splash_jax.tpu_check.reference import inputs, reference, relative_error

    row = dict(name=call.name, kernel=call.kernel, dtype=call.dtype, runtime=runtime, tolerance=TOLERANCE)
    named = inputs(call)
    gradients = call.kernel != "decode"
    expected = {k: np.asarray(v) for k, v in reference(call, named, gradients).items()}

    def tensor(name, dtype=None, grad=gradients):
        array = np.asarray(named[name].astype("float32"))
        return torch.from_numpy(array).to(dtype or getattr(torch, call.dtype)).to(device).requires_grad_(grad)

    q, k, v = tensor("q"), tensor("k"), tensor("v")
    ids = (
        tuple(torch.from_numpy(np.asarray(named[n])).to(device) for n in ("q_ids", "kv_ids"))
        if call.segment_ids
        else None
    )
    sinks = tensor("sinks", torch.float32) if call.sinks else None
    d_out = tensor("d_out", grad=False)
    leaves = [t for t in (q, k, v, sinks) if t is not None]

    def step():
        for t in leaves:
            t.grad = None
        out = torch_splash.attention(
            q, k, v, call.mask_object(), segment_ids=ids, soft_cap=call.soft_cap, sinks=sinks, kernel=call.kernel
        )
        if gradients:
            (out.float() * d_out.float()).sum().backward()
        _sync(runtime)
        return out

    step()  # the first step compiles
    start = time.perf_counter()
    out = step()
    found = dict(out=out.detach().float().cpu().numpy())
    if gradients:
        names = ["dq", "dk", "dv", "d_sinks"][: len(leaves)]
        found.update({n: t.grad.float().cpu().numpy() for n, t in zip(names, leaves)})
    row["step_ms"] = 1e3 * (time.perf_counter() - start)
    errors = {name: relative_error(found[name], expected[name]) for name in expected}
    return dict(row, errors=errors, passed=all(e <= TOLERANCE for e in errors.values()))


def main() -> int:
    device, runtime = _device()
    if device is None:
        print(json.dumps(dict(bridge_skipped=runtime)), flush=True)
        return 0
    from torch_splash_jax.tpu_check import __main__ as check

    for call in check.decode_calls(os.environ["TORCH_SPLASH_TPU_CHECK_CALLS"]):
        try:
            row = _check(call, device, runtime)
        except Exception as error:
            text = str(error).strip().splitlines()
            row = dict(name=call.name, runtime=runtime, passed=False)
            row["error"] = f"{type(error).__name__}: {text[0] if text else ''}"[:600]
        print(json.dumps(dict(bridge=row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
