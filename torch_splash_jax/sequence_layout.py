"""Sequence sharding's layouts and context-parallel strategies: which global positions each
shard's rows hold, and the lengths one device sees.

"contiguous" shards hold consecutive rows; "balanced" ones two mirrored chunks each (shard s:
chunks s and 2S-1-s, the even one first), so that causal work is even. With the ring, k and v are
split like q.
"""

from __future__ import annotations

import numpy as np

from .errors import SplashConstraintError
from .kernel_limits import round_up


def layout_positions(rows: int, shards: int, layout: str) -> np.ndarray:
    """(shards, rows) int32: the global position of each of a shard's `rows` in that layout."""
    if layout == "balanced":
        chunk = rows // 2
        order = np.array(balanced_chunk_order(shards))
        return (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(shards, rows).astype(np.int32)
    return (np.arange(shards)[:, None] * rows + np.arange(rows)[None, :]).astype(np.int32)


CONTEXT_PARALLEL = ("all_gather", "ring")


def check_context_parallel(strategy: str | None, q_shards: int | None = None, sharded: str | None = None) -> None:
    """SplashConstraintError unless `strategy` is a context-parallel strategy (or None), and, given
    the query-sequence shards, unless a ring has 2 or more. `sharded` says how the caller sharded
    the sequence, in the caller's terms."""
    if strategy not in (None, *CONTEXT_PARALLEL):
        raise SplashConstraintError(
            f"context_parallel={strategy!r}: expected 'all_gather' (k and v gathered whole on every device) or "
            "'ring' (k and v passed around the sequence shards)."
        )
    if strategy == "ring" and q_shards is not None and q_shards < 2:
        raise SplashConstraintError(
            f"context_parallel='ring' {sharded or f'over {q_shards} query-sequence shard'}: a ring needs the query "
            "sequence sharded over 2 or more devices. Name a mesh axis of size > 1 for dim 2 of partition_spec, "
            "or leave context_parallel unset."
        )


def check_sequence_layout(layout: str | None) -> None:
    """SplashConstraintError unless `layout` is a sequence layout (or None, for the default)."""
    if layout not in (None, "contiguous", "balanced"):
        raise SplashConstraintError(f"sequence_layout={layout!r}: expected 'contiguous' or 'balanced'.")


def balanced_chunk_order(shards: int) -> list[int]:
    """The balanced sequence layout: the sequence's 2S chunks in the order the S shards hold them,
    chunks s and 2S-1-s on shard s, so that every shard gets as much causal work. The even chunk
    comes first, as in the contiguous layout (shard d: chunks 2d, 2d+1), so that every chunk is in
    the same half of its shard in both layouts and the devices convert between them half by half."""
    return [c for s in range(shards) for c in sorted((s, 2 * shards - 1 - s), key=lambda c: c % 2)]


def device_lengths(q_len: int, kv_len: int, q_shards: int, layout: str, context_parallel: str) -> tuple[int, int]:
    """(Lq, Lkv) on one device: the query sequence split over its shards, and with the ring the kv
    sequence too; SplashConstraintError for a layout, strategy or split that cannot be."""
    check_sequence_layout(layout)
    if q_shards > 1 or layout == "balanced":
        q_len = _shard_length("Lq", q_len, q_shards, layout, f"{q_shards} sequence shards")
    check_context_parallel(context_parallel, q_shards)
    if context_parallel == "ring":
        why = "with context_parallel='ring' k and v are sharded like q, so "
        kv_len = _shard_length("Lkv", kv_len, q_shards, layout, f"the ring's {q_shards} shards", why)
    return q_len, kv_len


def _shard_length(name: str, length: int, shards: int, layout: str, shards_named: str, why: str = "") -> int:
    """One shard's part of a sequence of `length` split over `shards` in `layout` (in two mirrored
    chunks each when balanced); SplashConstraintError naming `name` when it does not split."""
    balanced = layout == "balanced"
    parts = shards * (2 if balanced else 1)
    if length % parts:
        raise SplashConstraintError(
            f"{name}={length} does not split into {shards_named}{' of two mirrored chunks each' if balanced else ''}: "
            f"{why}{name} must be a multiple of {parts} (pad the sequence, e.g. to {round_up(length, parts)}, or use "
            "another shard count)."
        )
    return length // shards
