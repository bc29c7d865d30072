"""The shape sweep of the TPU compile tests: the calls people train and serve with, as cases for
tests/tpu_compile_worker.py. Every program the planner makes for them must compile for TPU, or the
call must be refused before compiling (a SplashConstraintError at planning).

Head shapes of common HF families, each with the mask its models use most, lengths from 128 to 32K
and the longest a chip holds, batches from 1 to 32 with at most `MAX_TOKENS` tokens a call,
bfloat16, float32 and float16, causal, full, window and document (segment ids) masks; and the
decode kernel's programs at every batch and cache length.

`FULL` is the whole sweep (-m slow); `SLICE` a representative part of it, by name (the default
suite), chosen to hold every family, mask, dtype and kernel kind once, the largest batches, and
the lengths where the planner's blocks change.
"""

from __future__ import annotations

import itertools

# (query heads, kv heads, head_dim) of common HF families' attention layers.
FAMILIES = {
    "llama3": (32, 8, 128),  # Llama 3 8B, Mistral 7B
    "qwen2.5": (28, 4, 128),  # Qwen 2.5 7B
    "gemma2": (16, 8, 256),  # Gemma 2 9B
    "qwen2.5-small": (14, 2, 64),  # Qwen 2.5 0.5B
    "gpt2": (12, 12, 64),  # GPT-2, BERT
}
MASKS = {
    "causal": "CausalMask(0)",
    "full": "FullMask()",
    "window": "LocalMask(4095, 0)",  # Mistral's and Gemma 2's sliding window of 4096
    "documents": "CausalMask(0)",  # packed documents: causal with segment ids
}
DTYPES = ("bfloat16", "float32", "float16")
BATCHES = (1, 2, 4, 8, 16, 32)
LENGTHS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
MAX_TOKENS = 1 << 16  # per call: batch x length
# Long sequences at batch 1: 128K for every family, mask and dtype but float32 (a training step of
# Llama 3's 32 heads at 128K needs about 6 GiB of v5e's 15.75), and the longest causal call each
# family's backward program holds in v5e's HBM without a step's buffer donation (about 40 KiB of
# its tensors a token for Llama 3: 256K; 12 KiB for GPT-2: 512K).
LONGEST = 131072
LONGEST_CAUSAL = {"llama3": 262144, "qwen2.5": 262144, "gemma2": 262144, "qwen2.5-small": 524288, "gpt2": 524288}


def case(family: str, mask: str, dtype: str, batch: int, length: int, **options) -> dict:
    hq, hkv, d = FAMILIES[family]
    return dict(
        name=f"{family}-{mask}-{dtype}-b{batch}-{length}" + "".join(f"-{k}" for k in sorted(options)),
        hq=hq,
        hkv=hkv,
        q_len=length,
        kv_len=length,
        d=d,
        dtype=dtype,
        mask=MASKS[mask],
        batch=batch,
        segment_ids=mask == "documents",
        **({"soft_cap": 50.0} if family == "gemma2" else {}),
        **options,
    )


def decode_case(family: str, dtype: str, batch: int, cache: int) -> dict:
    """One decode step (one query token) against a cache of `cache` tokens, each sequence's length
    as segment ids, as HF generation hands it over."""
    hq, hkv, d = FAMILIES[family]
    return dict(
        name=f"decode-{family}-{dtype}-b{batch}-{cache}",
        hq=hq,
        hkv=hkv,
        q_len=1,
        kv_len=cache,
        d=d,
        dtype=dtype,
        mask=f"CausalMask({cache - 1})",
        batch=batch,
        segment_ids=True,
        kernel="decode",
    )


def _largest_batch(length: int) -> int:
    return max(b for b in BATCHES if b * length <= MAX_TOKENS)


def full() -> list[dict]:
    """Every family x mask x dtype x length at the largest batch the token cap allows, and at
    batch 1 the longest; every batch x length for the most common call (Llama 3, causal and
    documents, bfloat16); decode steps at every batch and cache length."""
    cases = []
    for family, mask, dtype in itertools.product(FAMILIES, MASKS, DTYPES):
        for length in LENGTHS:
            cases.append(case(family, mask, dtype, _largest_batch(length), length))
        if dtype != "float32":  # float32's long programs hold twice the bytes: 64K at batch 1 above
            cases.append(case(family, mask, dtype, 1, LONGEST))
    cases += [case(family, "causal", "bfloat16", 1, length) for family, length in LONGEST_CAUSAL.items()]
    for mask, length, batch in itertools.product(("causal", "documents"), LENGTHS, BATCHES):
        if batch * length <= MAX_TOKENS and batch != _largest_batch(length):
            cases.append(case("llama3", mask, "bfloat16", batch, length))
    for family, batch, cache in itertools.product(FAMILIES, BATCHES, (1024, 8192, 32768)):
        cases.append(decode_case(family, "bfloat16", batch, cache))
    # float32 caches at B=8: at B=32, 32K tokens Gemma 2's alone would take 16 GiB, more than a v5e holds
    cases += [decode_case(family, dtype, 8, 32768) for family in FAMILIES for dtype in ("float32", "float16")]
    return cases


FULL = full()
_BY_NAME = {c["name"]: c for c in FULL}
# The default suite's part: the largest batches, segment ids (a call per batch element), head_dim 64
# with ids at 128K and head_dim 256 with a soft cap (where the VMEM rule was tightened), float16
# (computed in float32), and a decode step at B=32, 32K.
SLICE = [
    dict(_BY_NAME[name], kinds=kinds, generations=generations)
    for name, kinds, generations in (
        ("llama3-causal-bfloat16-b16-4096", ["forward", "backward"], ["v5e"]),
        ("llama3-documents-bfloat16-b32-2048", ["backward"], ["v5e", "v6e"]),
        ("gemma2-causal-float16-b8-8192", ["backward"], ["v5e"]),
        ("qwen2.5-small-documents-bfloat16-b1-131072", ["forward"], ["v5e"]),
        ("decode-llama3-bfloat16-b32-32768", ["forward"], ["v5e"]),
    )
]
# The slice's cases the current set compiles for v7x by default (the rest, and v5e and v6e, under -m slow).
V7X_DEFAULT = ("llama3-causal-bfloat16-b16-4096", "decode-llama3-bfloat16-b32-32768")
