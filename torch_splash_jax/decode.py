"""Decoding: a few query tokens against a long key/value cache, by the decode kernel (`decode_kernel`).

`decode_plan` decides whether a call takes the decode kernel and plans it; the rule that sends a
call there by default, and the estimates that set its threshold, are written beside it
(`AUTO_MAX_ROWS`). `DecodeProgram` runs a plan: the query heads that share a kv head and the
query tokens become the rows of one block, the per-batch key ranges come from the segment ids
on the device (so a position or length that changes every step is data, not a constant of the
program), and the splits' partial results are combined, with the attention sinks, into the
output and its logsumexp.

It serves the forward only (no gradients): a call that needs them takes the splash kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import decode_kernel
from . import masks as _masks
from .errors import SplashConstraintError
from .kernel_limits import compute_dtype, kernel_itemsize

# Rows (query heads per kv head x query tokens) up to which a call takes the decode kernel by
# default. Set by the estimator (docs/benchmarks.md, "Decoding", chunked prefill: `./dev.sh
# bench-decode`): against a 32K cache, 32/8 heads, the decode program is 5.5x to 6.0x faster than
# the splash forward at 64 rows, 1.6x to 1.7x at 512, and 0.67x to 0.73x at 2048, on v5e, v5p, v6e
# and v7x alike: every row block reads the cache again, where splash's large q blocks do not.
AUTO_MAX_ROWS = 512
# A grid step reads `block_heads` kv heads' blocks of `block_kv` keys. Each step costs a fixed
# overhead, and each unit of the grid (batch element x head block x row block x split) a stall
# where its output is written back (`tpu_time`), so blocks are as large as VMEM_BUDGET allows
# (`_vmem_bytes`): kv heads first, as many as leave each MIN_BLOCK_KV keys, then keys, at most
# MAX_BLOCK_KV (past it the steps are few and longer blocks only waste the cache's last one). At
# most MAX_BLOCK_ROWS rows. The kernel asks Mosaic for VMEM_LIMIT of scoped VMEM (the default is
# 16 MiB on v5e, 32 on v6e and v7x; v7x has 64 MiB in all), and the budget leaves Mosaic 8 MiB of
# it. Estimated (./dev.sh bench-decode, B=8, 32/8 heads, 32K cache), 8 heads x 4096 keys against
# the 8 x 1024 that 12 MiB allowed: 1.22x -> 1.17x the HBM floor on v5e, 1.36x -> 1.27x on v6e,
# 1.73x -> 1.56x on v7x; blocks past 48 MiB of scoped VMEM would crowd v7x.
MAX_BLOCK_ROWS = 256
VMEM_LIMIT = 48 << 20
VMEM_BUDGET = VMEM_LIMIT - (8 << 20)
MIN_BLOCK_KV = 1024
MAX_BLOCK_KV = 8192


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Everything that changes the compiled decode program."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    head_dim_v: int
    dtype: str
    mask: object
    scale: float
    soft_cap: float | None
    has_segment_ids: bool
    has_sinks: bool
    platform: str
    block_heads: int
    block_rows: int
    block_kv: int
    splits: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        return self.group * self.q_len

    @property
    def rows_padded(self) -> int:
        return -(-self.rows // self.block_rows) * self.block_rows

    @property
    def kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_kv)

    def row_ranges(self) -> np.ndarray:
        """(2 x row blocks,) int32: each row block's [first, end) kv blocks with a pair the mask
        allows, from its structure (`Mask.blocks`), or (0, 0) where it has none."""
        out = []
        starts = np.arange(self.kv_blocks) * self.block_kv
        ends = np.minimum(starts + self.block_kv, self.kv_len) - 1
        for first_row in range(0, self.rows_padded, self.block_rows):
            last_row = min(first_row + self.block_rows, self.rows) - 1
            if last_row < first_row:
                out += [0, 0]
                continue
            q0, q1 = first_row // self.group, last_row // self.group
            any_ = np.broadcast_to(self.mask.blocks(q0, q1, starts, ends)[0], starts.shape)
            found = np.flatnonzero(any_)
            out += [int(found[0]), int(found[-1]) + 1] if found.size else [0, 0]
        return np.asarray(out, np.int32)


def refusal(mask, *, sharded: bool, block_sizes, dtype: str) -> str | None:
    """Why the decode kernel cannot serve such a call, or None when it can."""
    if sharded:
        return "it runs unsharded calls only (no partition_spec)"
    if block_sizes is not None:
        return "block_sizes are the splash kernels' (the decode kernel plans its own)"
    if type(mask) not in _masks.STRUCTURED or isinstance(mask, _masks.MultiHeadMask) or not mask.computable:
        return (
            f"its mask is {type(mask).__name__}: it serves masks every query head shares, evaluated from positions "
            "(full, causal, local, chunked, prefix and their & and |), with segment ids for data"
        )
    if any(isinstance(leaf, _masks.MultiHeadMask) for leaf in _masks.leaves(mask)):
        return "its mask holds a per-head mask"
    if compute_dtype(dtype) not in ("float32", "bfloat16"):
        return f"dtype {dtype}"
    return None


def takes_by_default(num_q_heads: int, num_kv_heads: int, q_len: int, kv_len: int) -> bool:
    """The rule: decode-shaped calls (few rows, longer keys) take the decode kernel by default."""
    return (num_q_heads // num_kv_heads) * q_len <= AUTO_MAX_ROWS and kv_len > q_len


def decode_plan(
    *,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    head_dim_v: int,
    dtype: str,
    mask,
    scale: float,
    soft_cap: float | None,
    has_segment_ids: bool,
    has_sinks: bool,
    platform: str,
) -> DecodePlan:
    """The decode kernel's plan of a call (`refusal` must have said None)."""
    rows = (num_q_heads // num_kv_heads) * q_len
    block_rows = rows if rows <= MAX_BLOCK_ROWS else MAX_BLOCK_ROWS
    itemsize = kernel_itemsize(dtype)

    def keys_for(heads: int) -> int:  # the most keys per head within the budget, in whole lanes
        fits = [
            n
            for n in range(128, MAX_BLOCK_KV + 1, 128)
            if _vmem_bytes(heads, block_rows, n, head_dim, head_dim_v, itemsize) <= VMEM_BUDGET
        ]
        return fits[-1] if fits else 0

    block_heads = max(
        h for h in range(1, num_kv_heads + 1) if num_kv_heads % h == 0 and (h == 1 or keys_for(h) >= MIN_BLOCK_KV)
    )
    target = max(128, keys_for(block_heads))
    block_kv = kv_len if kv_len <= target else _dividing_block(kv_len, target)
    row_blocks = -(-rows // block_rows)
    units = batch * (num_kv_heads // block_heads) * row_blocks
    kv_blocks = -(-kv_len // block_kv)
    # A megacore chip (v5p) shares the parallel units between its two cores: an odd few leave one
    # idle for a unit's whole time, so those calls split their keys in two.
    splits = 2 if units % 2 and units < 8 and kv_blocks > 1 else 1
    mask.check(num_q_heads, q_len, kv_len)
    return DecodePlan(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        mask=mask,
        scale=float(scale),
        soft_cap=soft_cap,
        has_segment_ids=has_segment_ids,
        has_sinks=has_sinks,
        platform=platform,
        block_heads=block_heads,
        block_rows=block_rows,
        block_kv=block_kv,
        splits=splits,
    )


def _vmem_bytes(heads: int, rows: int, keys: int, head_dim: int, head_dim_v: int, itemsize: int) -> int:
    """VMEM a grid step holds: its blocks double-buffered (q; k and v; the float32 output, maxima and
    sums; the segment ids), and one head's float32 logits three times over (logits, their
    exponentials, a mask), rows and ids padded to whole vector registers."""
    rows8 = _round_up(rows, 8)
    blocks = heads * (rows8 * head_dim * itemsize + keys * (head_dim + head_dim_v) * itemsize)
    blocks += heads * rows8 * (_round_up(head_dim_v, 128) + 2 * decode_kernel.LANES) * 4
    blocks += rows8 * 128 * 4 + 8 * keys * 4
    return 2 * blocks + 3 * rows8 * keys * 4


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _dividing_block(kv_len: int, target: int) -> int:
    """A multiple of 128 up to `target`: one that divides kv_len if one of at least half the target
    does (no block reaches past the cache), else the target."""
    for block in range(target, target // 2 - 1, -128):
        if kv_len % block == 0:
            return block
    return target


def explicit_refusal(reason: str) -> SplashConstraintError:
    return SplashConstraintError(
        f"kernel='decode' cannot serve this call: {reason}. Use kernel='splash', or leave kernel unset to have "
        "it chosen."
    )


class DecodeProgram:
    """The jitted decode program of one plan: `forward(q, k, v[, q_ids, kv_ids][, sinks])` -> (out,
    logsumexp (B, Hq, Lq) float32, -inf on rows that see no key)."""

    def __init__(self, plan: DecodePlan):
        self.plan = plan
        self._row_ranges = plan.row_ranges()

        def splash_decode(*arrays):  # the name the compiled program's kernel carries (the estimator reads it)
            return self._run(*arrays)

        self.forward = jax.jit(splash_decode)

    def signature(self) -> tuple[str, ...]:
        p = self.plan
        return (
            "q",
            "k",
            "v",
            *(("q_ids", "kv_ids") if p.has_segment_ids else ()),
            *(("sinks",) if p.has_sinks else ()),
        )

    def arguments(self, **named) -> list:
        return [named[name] for name in self.signature()]

    def _rows(self, x):
        """(B, Hq, Lq, ...) -> (B, Hkv, rows padded, ...): token-major rows of each kv head's query heads."""
        p = self.plan
        b, _, lq, *rest = x.shape
        x = x.reshape(b, p.num_kv_heads, p.group, lq, *rest).swapaxes(2, 3).reshape(b, p.num_kv_heads, p.rows, *rest)
        return jnp.pad(x, [(0, 0), (0, 0), (0, p.rows_padded - p.rows)] + [(0, 0)] * len(rest))

    def _unrows(self, x):
        p = self.plan
        b, _, _, *rest = x.shape
        x = x[:, :, : p.rows].reshape(b, p.num_kv_heads, p.q_len, p.group, *rest).swapaxes(2, 3)
        return x.reshape(b, p.num_q_heads, p.q_len, *rest)

    def _batch_ranges(self, q_ids, kv_ids):
        """(2 x B,) int32 [first, end) kv blocks holding a key some query of the batch element may see."""
        p = self.plan
        if q_ids is None:
            return jnp.tile(jnp.asarray([0, p.kv_blocks], jnp.int32), p.batch)
        seen = (kv_ids[:, None, :] == q_ids[:, :, None]).any(axis=1)  # (B, Lkv)
        keys = jnp.arange(p.kv_len, dtype=jnp.int32)
        first = jnp.min(jnp.where(seen, keys, p.kv_len), axis=1) // p.block_kv
        end = (jnp.max(jnp.where(seen, keys + 1, 0), axis=1) + p.block_kv - 1) // p.block_kv
        return jnp.stack([first, end], axis=1).reshape(-1).astype(jnp.int32)

    def _run(self, *arrays):
        from .splash_program import TRACES

        TRACES["decode"] += 1
        p = self.plan
        named = dict(zip(self.signature(), arrays, strict=True))
        dtype = named["q"].dtype
        q, k, v = (named[n].astype(compute_dtype(p.dtype)) for n in ("q", "k", "v"))  # float16 runs in float32
        q_ids = kv_ids = None
        row_q_ids = row_kv_ids = None
        if p.has_segment_ids:
            q_ids, kv_ids = named["q_ids"].astype(jnp.int32), named["kv_ids"].astype(jnp.int32)
            token = jnp.arange(p.rows_padded) // p.group
            row_q_ids = jnp.where(token < p.q_len, q_ids[:, jnp.minimum(token, p.q_len - 1)], -1)[..., None]
            row_kv_ids = kv_ids[:, None, :]
        acc, maxima, sums = decode_kernel.decode_call(
            self._rows(q),
            k,
            v,
            jnp.asarray(self._row_ranges),
            self._batch_ranges(q_ids, kv_ids),
            row_q_ids,
            row_kv_ids,
            mask=p.mask,
            scale=p.scale,
            soft_cap=p.soft_cap,
            group=p.group,
            block_heads=p.block_heads,
            block_rows=p.block_rows,
            block_kv=p.block_kv,
            splits=p.splits,
            vmem_limit=VMEM_LIMIT,
            interpret=p.platform != "tpu",
        )
        maxima, sums = maxima[..., 0], sums[..., 0]  # (B, Hkv, S, R)
        top = maxima.max(axis=2)
        if p.has_sinks:
            sinks = named["sinks"].astype(jnp.float32).reshape(p.num_kv_heads, p.group)
            sink_rows = jnp.pad(jnp.tile(sinks, (1, p.q_len)), [(0, 0), (0, p.rows_padded - p.rows)])[None]
            top = jnp.maximum(top, sink_rows)
        top = jnp.where(jnp.isneginf(top), 0.0, top)  # rows no split saw: weights exp(-inf) = 0
        weights = jnp.exp(maxima - top[:, :, None])
        total = (weights * sums).sum(axis=2)
        out = (weights[..., None] * acc).sum(axis=2)
        seen = total > 0
        denominator = total + (jnp.exp(sink_rows - top) if p.has_sinks else 0.0)
        out = jnp.where(seen[..., None], out / jnp.where(seen, denominator, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
        return self._unrows(out).astype(dtype), self._unrows(lse)
