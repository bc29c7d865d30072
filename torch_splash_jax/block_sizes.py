"""`BlockSizes`, the caller's explicit block sizes, and their checks against the kernels' rules.

A field left None is planned (`block_planning`); a field set is checked here before any planning,
with an error that names it and the nearest values that would do.
"""

from __future__ import annotations

import dataclasses
import math

from .errors import SplashConstraintError, SplashDtypeError
from .immutable import Immutable
from .kernel_limits import LANES, SUBLANES, round_up

_KV_FIELDS = ("block_kv", "block_kv_compute", "block_kv_dq", "block_kv_dkv", "block_kv_dkv_compute")
_Q_BWD_FIELDS = ("block_q_dq", "block_q_dkv")
_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
FORWARD_KERNELS = ("splash", "active")


@dataclasses.dataclass(unsafe_hash=True)
class BlockSizes(Immutable):
    """Explicit block sizes for the splash kernels: the JAX kernel's `BlockSizes` fields, each
    optional; fields left None are planned for the platform.

    Attributes:
        block_q, block_kv, block_kv_compute: the forward kernel's blocks.
        block_q_dkv, block_kv_dkv, block_kv_dkv_compute: the dkv kernel's (dq too when fused).
        block_q_dq, block_kv_dq: the separate dq kernel's; setting one selects it.
        use_fused_bwd_kernel: compute dq inside the dkv kernel.
        q_layout, k_layout, v_layout: "HEAD_DIM_MINOR" or "SEQ_MINOR".
        forward_kernel: "active" (the project's own, over each head's active blocks only,
            `torch_splash_jax.active_kernels`; its blocks are its own, planned from the padded
            lengths) or "splash" (JAX's kernel). "active" serves unsharded calls with any mask
            (masks that are data, and one mask per head, read from stored blocks); sharded and
            ring calls are refused. None: "active" where it serves the call and its lists surely
            fit a TPU's SMEM, unless the caller set one of JAX's forward blocks (block_q, block_kv,
            block_kv_compute) or a layout; else "splash".
        backward_kernel: the same choice for the backward (the project's one kernel whose dq, dk
            and dv accumulate in place, or JAX's dq and dkv kernels); None follows an explicit
            forward_kernel, else is chosen as forward_kernel's None is (JAX's backward blocks and
            use_fused_bwd_kernel asking for JAX's). Either backward takes either forward's output
            and logsumexp.

    A block longer than the padded sequence is clamped to it. Refused with SplashConstraintError
    (when planned, before any JAX work): a kv block or compute block not a multiple of 128, a
    forward block_q not a multiple of 8, a backward q block not a multiple of 128, and on TPU blocks
    that do not fit VMEM or tables that do not fit SMEM (docs/tpu.md).
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_kv_compute: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_kv_dkv_compute: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    use_fused_bwd_kernel: bool | None = None
    q_layout: str | None = None
    k_layout: str | None = None
    v_layout: str | None = None
    forward_kernel: str | None = None
    backward_kernel: str | None = None


def _nearest_multiples(value: int, multiple: int) -> str:
    lo = max(multiple, value // multiple * multiple)
    hi = max(multiple, round_up(value, multiple))
    return str(lo) if lo == hi else f"{lo} or {hi}"


def check_block_sizes(bs: BlockSizes) -> None:
    for field in dataclasses.fields(BlockSizes):
        value = getattr(bs, field.name)
        if value is None:
            continue
        where = f"block_sizes.{field.name}={value!r}"
        if field.name == "use_fused_bwd_kernel":
            if not isinstance(value, bool):
                raise SplashDtypeError(f"{where}: must be True, False or None (planned).")
            continue
        if field.name in ("forward_kernel", "backward_kernel"):
            if value not in FORWARD_KERNELS:
                raise SplashConstraintError(f"{where}: must be one of {FORWARD_KERNELS} or None (planned).")
            continue
        if field.name.endswith("_layout"):
            if value not in _LAYOUTS:
                raise SplashConstraintError(f"{where}: must be one of {_LAYOUTS} or None.")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise SplashDtypeError(f"{where}: block sizes are positive ints, or None to plan them.")
        if value <= 0:
            raise SplashConstraintError(f"{where}: block sizes are positive ints, or None to plan them.")
        if field.name in _KV_FIELDS and value % LANES:
            raise SplashConstraintError(
                f"{where} is not a multiple of {LANES}: kv blocks and their compute blocks are laid out "
                f"along the TPU's {LANES} vector lanes. Use {_nearest_multiples(value, LANES)}, or leave "
                "it None to have it planned."
            )
        if field.name in _Q_BWD_FIELDS and value % LANES:
            raise SplashConstraintError(
                f"{where} is not a multiple of {LANES}: the dq and dkv kernels put query blocks in the "
                f"TPU's lanes (and need it for segment ids). Use {_nearest_multiples(value, LANES)}, or "
                "leave it None."
            )
        if field.name == "block_q" and value % SUBLANES:
            raise SplashConstraintError(
                f"{where} is not a multiple of {SUBLANES} (the TPU sublane count that Mosaic tiles "
                f"query blocks by). Use {_nearest_multiples(value, SUBLANES)}, or leave it None."
            )
    if bs.q_layout == "SEQ_MINOR" and bs.block_q is not None and bs.block_q % LANES:
        raise SplashConstraintError(
            f"block_sizes.block_q={bs.block_q} with q_layout='SEQ_MINOR' puts the query sequence in "
            f"lanes, so it must be a multiple of {LANES}: use {_nearest_multiples(bs.block_q, LANES)}."
        )
    if bs.use_fused_bwd_kernel and (bs.block_q_dq is not None or bs.block_kv_dq is not None):
        raise SplashConstraintError(
            f"block_sizes.use_fused_bwd_kernel=True with block_q_dq={bs.block_q_dq}, "
            f"block_kv_dq={bs.block_kv_dq}: the fused backward computes dq inside the dkv kernel and "
            "has no dq blocks. Drop the dq blocks or set use_fused_bwd_kernel=False."
        )
    for block, compute in (("block_kv", "block_kv_compute"), ("block_kv_dkv", "block_kv_dkv_compute")):
        b, c = getattr(bs, block), getattr(bs, compute)
        if b is not None and c is not None and b % c:
            raise SplashConstraintError(
                f"block_sizes.{block}={b} is not a multiple of block_sizes.{compute}={c}: the kernel "
                f"walks each kv block in compute-sized steps. Use a {compute} that divides {b} "
                f"(e.g. {math.gcd(b, c)}), or leave it None."
            )
