"""PyTorch's own FlexAttention tests, run through splash: an external check (docs/flex.md).

    python benchmarks/flex_pytorch_tests.py PATH/test_flex_attention.py [-k NAME ...] [--seq 512]
        [--backward] [--json OUT]

PATH is PyTorch's ``test/inductor/test_flex_attention.py`` (not shipped with torch's wheels, nor
with this project: fetch it from PyTorch's repository). Its tests run on the CPU with
``torch_splash.route_flex()`` around each, so that every call of torch's ``flex_attention`` (eager
and under ``torch.compile``) is splash's, except the tests' float64 reference computations, which
splash does not serve and which stay torch's. Each eager call splash serves is also recomputed by
torch's own implementation on the same inputs and compared (the "shadow" check), so a test whose
own check is loose still cannot hide a wrong answer.

The file is read as text and changed before it runs, only so that its tests can run here: the
device "cuda" becomes "cpu" and the CUDA-only skip decorator goes; the sequence length S (2048)
becomes --seq; with --backward the CPU's inference-only runs also check gradients.

Each selected test ends as one of: pass (through splash), torch-only (it passed, no call reached
splash), refused (a SplashError: the reason), wrong (an assertion about the numbers failed, or the
shadow check did), error (anything else: the test needs what this CPU lacks, such as a lowering
of torch's own) and skipped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
import types
import unittest

import torch

import torch_splash

# The shadow check's bound on |splash - torch| / max |torch|, per dtype: the kernels' own error in
# f32 is about 1e-6 (DESIGN.md); bf16 outputs carry about 2**-8 relative rounding each.
_SHADOW_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


# The selection docs/flex.md reports (without -k): every CPU-runnable family of tests, with the
# parametrisations thinned where they only repeat a case (the block sizes, batch sizes and dtypes).
SELECTION = (
    "test_builtin_score_mods_float32",
    "test_builtin_score_mods_bfloat16",
    "test_builtin_score_mods_different_seqlen",
    "test_builtin_score_mods_different_block_size_float32_score_mod0",
    "test_builtin_score_mods_different_block_size_float32_score_mod3",
    "test_kv_batch_broadcast_float32_batch_dims0",
    "test_kv_batch_broadcast_causal_mask_float32_batch_dims0_head_dims1",
    "test_GQA",
    "test_logsumexp_correctness",
    "test_non_equal_head_dims_score_mod0_",
    "test_non_equal_head_dims_score_mod3_",
    "test_function_composition",
    "test_skip_odd_keys",
    "test_captured_scale",
    "test_causal_block",
    "test_dependent_causal_bidirectional",
    "test_differentiable_logsumexp",
    "test_doc_mask_sparse",
    "test_index_multiple",
    "test_load_rel_bias",
    "test_mask_mod_combiners",
    "test_multiple_mask_calls",
    "test_multiple_score_mod_calls",
    "test_natten_2d",
    "test_padded_dense_causal",
    "test_seq_masking",
    "test_silu_on_score",
    "test_njt_causal",
)


def _adapted_source(path: str, seq: int, backward: bool) -> str:
    text = open(path).read()
    text = text.replace('"cuda"', '"cpu"').replace(".cuda()", "")
    text = re.sub(r"^\s*@supported_platform\s*$", "", text, flags=re.M)
    text = re.sub(r"^S = 2048$", f"S = {seq}", text, flags=re.M)
    if backward:
        text = text.replace("test_inference_only = True", "test_inference_only = False")
    return text


def _load(path: str, seq: int, backward: bool) -> types.ModuleType:
    module = types.ModuleType("pytorch_flex_attention_tests")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(_adapted_source(path, seq, backward), path, "exec"), module.__dict__)
    return module


def _torch_copy(fn):
    """A copy of torch's flex_attention with its own code, unaffected by route_flex's swap."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class _Dispatch:
    """What route_flex's calls reach: float64 goes to torch's own function, the rest to splash,
    with the eager calls shadowed by torch's answer."""

    def __init__(self, splash, torch_flex):
        self.splash, self.torch_flex = splash, torch_flex
        self.reset()

    def reset(self):
        self.splash_calls, self.shadow_errors = 0, []

    def __call__(self, query, key, value, *args, **kwargs):
        if query.dtype == torch.float64:
            return self.torch_flex(query, key, value, *args, **kwargs)
        self.splash_calls += 1
        out = self.splash(query, key, value, *args, **kwargs)
        if not torch.compiler.is_compiling():
            self._shadow(out, query, key, value, args, kwargs)
        return out

    def _shadow(self, out, query, key, value, args, kwargs):
        with torch.no_grad():
            want = self.torch_flex(query.detach(), key.detach(), value.detach(), *args, **kwargs)
        got = out
        if isinstance(want, tuple):
            want, got = want[0], got[0]
        bound = _SHADOW_TOLERANCE.get(want.dtype, 1e-2)
        scale = want.float().abs().max().clamp(min=1.0)
        error = float((got.detach().float() - want.float()).abs().max() / scale)
        if not error <= bound:
            self.shadow_errors.append(f"{tuple(query.shape)} {query.dtype}: {error:.2e} > {bound:.0e}")


def _run_one(case: unittest.TestCase, dispatch: _Dispatch) -> tuple[str, str]:
    dispatch.reset()
    result = unittest.TestResult()
    torch._dynamo.reset()
    with torch_splash.route_flex():
        case.run(result)
    if result.skipped:
        return "skipped", result.skipped[0][1]
    problems = result.errors + result.failures
    if not problems and dispatch.shadow_errors:
        return "wrong", "shadow check: " + "; ".join(dispatch.shadow_errors[:3])
    if not problems:
        return ("pass" if dispatch.splash_calls else "torch-only"), f"{dispatch.splash_calls} splash calls"
    _, trace = problems[0]
    if os.environ.get("FLEX_CHECK_TRACES"):
        print(trace, file=sys.stderr)
    lines = trace.strip().splitlines()
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Unsupported|Failure)\b", line)]
    last = (raised or lines)[-1]
    reason = _splash_reason_from_trace(trace)
    if reason:
        return "refused", reason
    if result.failures or last.startswith("AssertionError"):
        return "wrong", last
    return "error", last


def _splash_reason_from_trace(trace: str) -> str | None:
    # the exception's own line (a docstring quoted in the trace may name an error too)
    found = re.findall(r"^(?:[\w.]+\.)?(Splash\w*Error): (.*)$", trace, flags=re.M)
    return f"{found[-1][0]}: {found[-1][1]}" if found else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="PyTorch's test/inductor/test_flex_attention.py")
    parser.add_argument(
        "-k", action="append", default=[], help="run tests whose name contains this (repeatable; default: SELECTION)"
    )
    parser.add_argument("--seq", type=int, default=512, help="the tests' sequence length S (PyTorch's: 2048)")
    parser.add_argument("--backward", action="store_true", help="check gradients on the CPU too")
    parser.add_argument("--paged", action="store_true", help="also run the tests' paged-attention halves")
    parser.add_argument("--json", help="write each test's outcome here")
    args = parser.parse_args(argv)

    splash_module = sys.modules[torch_splash.route_flex.__module__]
    dispatch = _Dispatch(splash_module.flex_attention, _torch_copy(torch.nn.attention.flex_attention.flex_attention))
    module = _load(args.path, args.seq, args.backward)
    if not args.paged:  # the file's paged-attention helper must match torch's PagedAttention API
        module.TestFlexAttention.run_test_with_paged_attention = lambda self, *a, **k: None
    loader = unittest.TestLoader()
    wanted = args.k or SELECTION
    names = [n for n in loader.getTestCaseNames(module.TestFlexAttention) if any(k in n for k in wanted)]
    outcomes, counts = {}, collections.Counter()
    splash_module.flex_attention = dispatch
    try:
        for name in names:
            start = time.perf_counter()
            kind, detail = _run_one(module.TestFlexAttention(name), dispatch)
            outcomes[name] = dict(outcome=kind, detail=detail[:300], seconds=round(time.perf_counter() - start, 1))
            counts[kind] += 1
            print(f"{kind:10s} {name} ({outcomes[name]['seconds']} s): {detail[:200]}", flush=True)
    finally:
        splash_module.flex_attention = dispatch.splash
    print(f"torch {torch.__version__}: {len(names)} tests, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, seq=args.seq, outcomes=outcomes), f, indent=1)
    return 1 if counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
