"""Every check on the caller's tensors and options, in SDPA's terms, before any JAX work."""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from torch_splash_jax import SplashConstraintError, SplashDtypeError

from . import _platform
from . import masks as _masks

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# float16 has no kernel of its own (TPUs compute in bfloat16 or float32): it is computed in
# float32, the more accurate of the two, and the output cast back; autograd casts the gradients.
_COMPUTED_AS = {torch.float16: torch.float32}


@dataclasses.dataclass
class CheckedCall:
    """A checked call, batched (B, H, L, D) whatever the caller passed."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    segment_ids: tuple[torch.Tensor, torch.Tensor] | None
    mask: object
    scale: float
    soft_cap: float | None
    unbatched: bool
    sinks: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None  # the caller's dtype, where the kernels compute in another
    platform: str = "cpu"  # where the kernels run: "cpu" (interpret mode) or "tpu"


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def _check_tensors(q, k, v) -> tuple[bool, str]:
    """(whether the inputs are unbatched, the kernels' platform)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise SplashDtypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise SplashConstraintError(
            f"q, k, v have shapes {_shape(q)}, {_shape(k)}, {_shape(v)}: expected all 4-D "
            "(batch, heads, seq_len, head_dim), or all 3-D (heads, seq_len, head_dim) for unbatched input."
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() == 0:
            raise SplashConstraintError(f"{name} has shape {_shape(t)} with a zero-sized dimension: nothing to attend.")
    if not (q.device == k.device == v.device):
        raise SplashConstraintError(
            f"q, k, v are on devices {q.device}, {k.device}, {v.device}: move them to one device."
        )
    platform = _platform.platform_of(q.device)  # a device the kernels cannot run on is refused here
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.dtype.is_floating_point:
            raise SplashDtypeError(f"{name} has dtype {t.dtype}: attention needs float32, bfloat16 or float16 inputs.")
    if not (q.dtype == k.dtype == v.dtype):
        raise SplashDtypeError(
            f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: they must match; cast them to one of "
            "torch.float32, torch.bfloat16 or torch.float16."
        )
    if q.dtype not in _DTYPES and q.dtype not in _COMPUTED_AS:
        raise SplashDtypeError(
            f"q, k, v have dtype {q.dtype}: the splash kernels compute in float32 at most (TPUs have no float64 "
            "units), so a float64 result would be a float32 one in disguise. Cast to torch.float32 explicitly "
            "(or torch.bfloat16 / torch.float16)."
        )
    unbatched = q.dim() == 3
    if not unbatched and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise SplashConstraintError(
            f"q, k, v have batch sizes {q.shape[0]}, {k.shape[0]}, {v.shape[0]}: they must be equal."
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise SplashConstraintError(
            f"k {_shape(k)} and v {_shape(v)} must share every dimension but the last (batch, heads, "
            "seq_len); only their head_dim may differ."
        )
    if q.shape[-1] != k.shape[-1]:
        raise SplashConstraintError(
            f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}: q and k must share head_dim (v may differ)."
        )
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq % hkv:
        nearest = common_divisors(hq)
        raise SplashConstraintError(
            f"q has {hq} heads and k, v have {hkv}: the number of query heads must be a multiple of "
            f"the number of key/value heads (MHA, GQA, MQA). Valid kv head counts for {hq} query "
            f"heads: {nearest}."
        )
    return unbatched, platform


def common_divisors(*counts: int) -> list[int]:
    """The head counts (or shard counts) that divide every one of `counts`: the one rule behind
    GQA grouping (kv heads must divide query heads) and head sharding (shards must divide both)."""
    return [d for d in range(1, min(counts) + 1) if all(c % d == 0 for c in counts)]


def _check_ids(name: str, ids, batch: int | None, length: int, length_name: str, device) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise SplashDtypeError(f"{name} must be an integer torch.Tensor, got {type(ids).__name__}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise SplashDtypeError(f"{name} has dtype {ids.dtype}: segment ids are integers (e.g. torch.int32).")
    expected = (length,) if batch is None else (batch, length)
    if tuple(ids.shape) != expected:
        hint = ""
        if ids.dim() == len(expected) and ids.shape[-1] > length:
            hint = (
                f" If the ids cover a preallocated cache longer than the keys, pass only the filled "
                f"part: {name}[..., :{length}]."
            )
        raise SplashConstraintError(
            f"{name} has shape {_shape(ids)} but must be {tuple(expected)}: one id per position of "
            f"{length_name}={length}.{hint}"
        )
    if ids.device.type == "meta" and torch.device(device).type != "meta":
        raise SplashConstraintError(
            f"{name} is a meta tensor (shapes only, no values) but q is on {device}: pass the ids themselves."
        )
    return ids.to(device=device)


def _as_int32(q_ids: torch.Tensor, kv_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int32 ids. Ids only matter for equality, so ids of a wider type are renumbered
    by rank (a sort, static shapes, no read of the values on the host) instead of truncated."""
    if q_ids.dtype.itemsize <= 4 and q_ids.dtype != torch.uint32 and kv_ids.dtype == q_ids.dtype:
        return q_ids.to(torch.int32), kv_ids.to(torch.int32)
    joint = torch.cat([q_ids.flatten().to(torch.int64), kv_ids.flatten().to(torch.int64)])
    ordered = joint.sort().values
    rank = torch.cat([ordered.new_zeros(1), (ordered[1:] != ordered[:-1]).cumsum(0)])
    renumbered = rank[torch.searchsorted(ordered, joint)].to(torch.int32)
    # clones: a slice at an odd offset is not aligned for DLPack, and JAX would copy it
    return (
        renumbered[: q_ids.numel()].view(q_ids.shape).clone(),
        renumbered[q_ids.numel() :].view(kv_ids.shape).clone(),
    )


def _check_segment_ids(segment_ids, batch, q_len, kv_len, device):
    if segment_ids is None:
        return None
    if isinstance(segment_ids, torch.Tensor):
        if q_len != kv_len:
            raise SplashConstraintError(
                f"segment_ids is a single tensor but Lq={q_len} != Lkv={kv_len}: pass a pair "
                "(q_ids, kv_ids) with shapes (B, Lq) and (B, Lkv)."
            )
        ids = _as_int32(*[_check_ids("segment_ids", segment_ids, batch, q_len, "Lq", device)] * 2)[0]
        return ids, ids
    if isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2:
        q_ids = _check_ids("segment_ids[0] (q ids)", segment_ids[0], batch, q_len, "Lq", device)
        kv_ids = _check_ids("segment_ids[1] (kv ids)", segment_ids[1], batch, kv_len, "Lkv", device)
        return _as_int32(q_ids, kv_ids)
    raise SplashDtypeError(
        f"segment_ids is a {type(segment_ids).__name__}: it must be an int tensor (B, L) when Lq == Lkv, "
        "or a pair (q_ids (B, Lq), kv_ids (B, Lkv))."
    )


def _check_number(name: str, value, positive: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SplashDtypeError(f"{name}={value!r}: expected a finite float or None.")
    if not math.isfinite(value):
        raise SplashConstraintError(f"{name}={value!r}: expected a finite float or None.")
    if positive and value <= 0:
        raise SplashConstraintError(f"{name}={value!r}: must be > 0 (or None to disable).")
    return float(value)


def _check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise SplashDtypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}.")
    if not sinks.dtype.is_floating_point:
        raise SplashDtypeError(f"sinks has dtype {sinks.dtype}: sinks are logits (a float dtype).")
    if tuple(sinks.shape) != (q.shape[-3],):
        raise SplashConstraintError(
            f"sinks has shape {_shape(sinks)} but must be ({q.shape[-3]},): one logit per query head."
        )
    if sinks.device != q.device:
        raise SplashConstraintError(f"sinks is on {sinks.device} but q is on {q.device}: move it to q's device.")
    return sinks


def check_call(q, k, v, mask, scale, segment_ids, soft_cap, sinks=None) -> CheckedCall:
    unbatched, platform = _check_tensors(q, k, v)
    if unbatched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    batch, _, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    ids = _check_segment_ids(segment_ids, None if unbatched else batch, q_len, kv_len, q.device)
    if ids is not None and unbatched:
        ids = (ids[0].unsqueeze(0), ids[1].unsqueeze(0))
    scale = _check_number("scale", scale, positive=False)
    sinks = _check_sinks(sinks, q)
    out_dtype = None
    if q.dtype in _COMPUTED_AS:
        out_dtype, computed = q.dtype, _COMPUTED_AS[q.dtype]
        q, k, v = q.to(computed), k.to(computed), v.to(computed)
        sinks = None if sinks is None else sinks.to(computed)
    return CheckedCall(
        q=q,
        k=k,
        v=v,
        segment_ids=ids,
        mask=_masks.normalize(mask, batch, q.shape[1], q_len, kv_len),
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        soft_cap=_check_number("soft_cap", soft_cap, positive=True),
        unbatched=unbatched,
        sinks=sinks,
        out_dtype=out_dtype,
        platform=platform,
    )


def dtype_name(t: torch.Tensor) -> str:
    return _DTYPES[t.dtype]


def static_ints(*values) -> tuple[int, ...]:
    """The values as ints. Under torch.compile a graph holds the plan of one shape (block sizes,
    padding and tables come from sizes), so a size Dynamo made symbolic (automatic dynamic shapes
    after a second shape, or dynamic=True; an int attribute that changed) is specialised here, with
    a guard: a graph is compiled for each value met, as with dynamic=False. Formatting a value is
    what makes Dynamo specialise it (int() leaves it symbolic)."""
    return tuple(int(f"{n}") for n in values)


def static_float(value):
    """A number option (scale, soft cap) as a float, specialised under torch.compile as
    `static_ints`; anything else as it is (None, or what the checks refuse by name)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(f"{value}")


def static_shape(t: torch.Tensor) -> tuple[int, ...]:
    """t's sizes as ints, specialised under torch.compile (`static_ints`)."""
    return static_ints(*t.shape)
