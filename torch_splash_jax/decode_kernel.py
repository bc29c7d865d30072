"""The decode kernel: a few query rows against a long key/value cache, in the cache's own layout.

One Pallas kernel on the grid (batch, kv heads, row blocks, splits, kv steps). Its rows are every
query token of every query head that shares one kv head, token-major (row r is token r // G of
query head r % G, G = query heads per kv head), so each k and v block is read once per kv head,
not once per query head. k and v stay (B, Hkv, Lkv, D) as the caller holds them: nothing is
copied, padded or rescaled (the softmax scale is applied to the query rows, in the kernel).

Which kv blocks run is data: two small int32 tables are prefetched into scalar memory before the
grid starts, each row block's block range (from the mask's structure, made on the host) and each
batch element's (from its segment ids, made on the device), both [first, end) in blocks. A step
outside their intersection is skipped: its index map repeats the last block in range, which the
pipeline does not fetch again, and its body does nothing. So one compiled program serves every
position of a static cache, and blocks past a sequence's length are neither read nor computed.

A split (flash-decoding) takes an equal share of each range; every split writes its unnormalised
output, its row maxima and its row sums (float32), which `decode.py` combines. Rows that see no
key end with sum 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .kernel_limits import LANES  # row statistics are kept lane-dense, (rows, LANES)

# Large and finite: exp(MASKED - m) is 0 for any real maximum m, and MASKED - MASKED is 0, not NaN.
MASKED = -0.7 * float(np.finfo(np.float32).max)


def block_range(row_ranges, batch_ranges, b, rb, s, splits: int):
    """(first, stop) kv blocks of split `s` of row block `rb` of batch element `b`: the
    intersection of the two prefetched ranges, cut into `splits` equal shares. Traced ints (index
    maps and kernel body alike)."""
    first = jnp.maximum(row_ranges[2 * rb], batch_ranges[2 * b])
    end = jnp.minimum(row_ranges[2 * rb + 1], batch_ranges[2 * b + 1])
    count = jnp.maximum(end - first, 0)
    # not `//`: see structured_masks._floor_div (counts are >= 0)
    share = lax.div(count + (splits - 1), np.int32(splits))
    start = first + s * share
    return start, jnp.minimum(start + share, end)


def _kv_block(b, rb, s, i, row_ranges, batch_ranges, *, splits: int, num_blocks: int):
    """The kv block step `i` reads: its own when in range, else the last one in range (the
    pipeline skips the fetch of a block it already holds)."""
    start, stop = block_range(row_ranges, batch_ranges, b, rb, s, splits)
    return jnp.clip(jnp.minimum(start + i, stop - 1), 0, num_blocks - 1)


def _and(a, b):
    return b if a is None else a & b


def _kernel(
    row_ranges,
    batch_ranges,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    mask,
    scale: float,
    soft_cap: float | None,
    group: int,
    block_heads: int,
    block_rows: int,
    block_kv: int,
    kv_len: int,
    splits: int,
    has_segment_ids: bool,
    compute_dtype,
):
    if has_segment_ids:
        q_ids_ref, kv_ids_ref, acc_ref, m_ref, l_ref = refs
    else:
        acc_ref, m_ref, l_ref = refs
    b, rb, s, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)

    start, stop = block_range(row_ranges, batch_ranges, b, rb, s, splits)
    block = start + i

    @pl.when(block < stop)
    def _step():
        # With fewer rows than a vector register's 8 sublanes, `pack` heads' rows share each
        # register through the softmax (stacked head after head), so its element-wise work runs
        # on full registers.
        pack = 8 // block_rows if block_rows < 8 and block_heads % (8 // block_rows) == 0 else 1
        # What is allowed depends on positions only: the same for every head of the block.
        # Positions as a column and a row: the mask broadcasts them, and the division by the
        # group runs on one column, not on every logit.
        local = lax.broadcasted_iota(jnp.int32, (pack * block_rows, 1), 0)
        rows = rb * block_rows + (lax.rem(local, np.int32(block_rows)) if pack > 1 else local)
        keys = block * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        allowed = mask.allows(lax.div(rows, np.int32(group)), keys)
        if kv_len % block_kv:  # the last block reaches past the cache
            allowed = _and(allowed, keys < kv_len)
        if has_segment_ids:
            q_ids = q_ids_ref[...]
            q_ids = jnp.concatenate([q_ids] * pack, axis=0) if pack > 1 else q_ids
            allowed = _and(allowed, q_ids == kv_ids_ref[...])
        if allowed is not None:
            allowed = jnp.broadcast_to(allowed, (pack * block_rows, block_kv))
        # One static step per group of heads, so that the TPU compiler's schedule shows all of
        # them. Group g + 1's logits are issued before group g's softmax and p v: the MXU runs its
        # matmuls in program order, so this lets the pushes of the next heads' keys overlap this
        # group's softmax; two groups' logits are live at a time, not all of them.
        head = functools.partial(
            _one_head_logits, q_ref, k_ref, scale=scale, soft_cap=soft_cap, compute_dtype=compute_dtype
        )

        def group_logits(g):
            logits = jnp.concatenate([head(g * pack + j) for j in range(pack)], axis=0) if pack > 1 else head(g)
            return logits if allowed is None else jnp.where(allowed, logits, MASKED)

        logits = group_logits(0)
        for g in range(block_heads // pack):
            following = group_logits(g + 1) if g + 1 < block_heads // pack else None
            _group_update(
                g,
                pack,
                block_rows,
                logits,
                v_ref,
                acc_ref,
                m_ref,
                l_ref,
                allowed,
                block,
                block_kv,
                kv_len,
                compute_dtype,
            )
            logits = following


def _one_head_logits(q_ref, k_ref, h, *, scale, soft_cap, compute_dtype):
    """Head h's logits over the block (soft-capped, not masked), float32."""
    q = (q_ref[h].astype(jnp.float32) * scale).astype(compute_dtype)
    k = k_ref[h].astype(compute_dtype)
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


def _group_update(g, pack, rows, logits, v_ref, acc_ref, m_ref, l_ref, allowed, block, block_kv, kv_len, compute_dtype):
    """The online softmax of heads g * pack ... (g + 1) * pack - 1 over one kv block, from their
    masked logits stacked head after head (`pack` x rows rows)."""
    heads = [g * pack + j for j in range(pack)]
    m_prev = jnp.concatenate([m_ref[h][:, :1] for h in heads], axis=0) if pack > 1 else m_ref[g][:, :1]
    l_prev = jnp.concatenate([l_ref[h][:, :1] for h in heads], axis=0) if pack > 1 else l_ref[g][:, :1]
    m_next = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
    p = jnp.exp(logits - m_next)
    if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_next = alpha * l_prev + p.sum(axis=1, keepdims=True)
    p = p.astype(compute_dtype)
    for j, h in enumerate(heads):
        v = v_ref[h].astype(compute_dtype)
        if kv_len % block_kv:  # past the cache v may hold NaN: p is 0 there, but 0 * NaN is not
            in_cache = block * block_kv + lax.broadcasted_iota(jnp.int32, v.shape, 0) < kv_len
            v = jnp.where(in_cache, v, jnp.zeros_like(v))
        own = slice(j * rows, (j + 1) * rows)
        pv = lax.dot_general(p[own], v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_ref[h] = alpha[own] * acc_ref[h] + pv
        m_ref[h] = jnp.broadcast_to(m_next[own], m_ref.shape[1:])
        l_ref[h] = jnp.broadcast_to(l_next[own], l_ref.shape[1:])


def decode_call(
    q,
    k,
    v,
    row_ranges,
    batch_ranges,
    q_ids=None,
    kv_ids=None,
    *,
    mask,
    scale: float,
    soft_cap: float | None,
    group: int,
    block_heads: int,
    block_rows: int,
    block_kv: int,
    splits: int,
    vmem_limit: int,
    interpret: bool,
):
    """The kernel on q (B, Hkv, R, D) (rows padded to a multiple of block_rows), k (B, Hkv, Lkv, D),
    v (B, Hkv, Lkv, Dv), the tables (2 x row blocks,) and (2 x B,) int32 [first, end) kv blocks, and
    with segment ids q_ids (B, R, 1) and kv_ids (B, 1, Lkv) int32. `mask` (a structured mask) is
    evaluated at (row // group, key): a row's query token. Returns per split the
    unnormalised output (B, Hkv, S, R, Dv), row maxima and row sums (B, Hkv, S, R, LANES), float32."""
    batch, kv_heads, rows, head_dim = q.shape
    kv_len, head_dim_v = k.shape[2], v.shape[3]
    num_blocks = -(-kv_len // block_kv)
    steps = -(-num_blocks // splits)
    row_blocks = rows // block_rows
    kv_block = functools.partial(_kv_block, splits=splits, num_blocks=num_blocks)

    def q_map(b, h, rb, s, i, *_):
        return b, h, rb, 0

    def kv_map(b, h, rb, s, i, row_ranges, batch_ranges):
        return b, h, kv_block(b, rb, s, i, row_ranges, batch_ranges), 0

    def out_map(b, h, rb, s, i, *_):
        return b, h, s, rb, 0

    squeezed = pl.squeezed
    in_specs = [
        pl.BlockSpec((squeezed, block_heads, block_rows, head_dim), q_map),
        pl.BlockSpec((squeezed, block_heads, block_kv, head_dim), kv_map),
        pl.BlockSpec((squeezed, block_heads, block_kv, head_dim_v), kv_map),
    ]
    inputs = [q, k, v]
    if q_ids is not None:

        def q_ids_map(b, h, rb, s, i, *_):
            return b, rb, 0

        def kv_ids_map(b, h, rb, s, i, row_ranges, batch_ranges):
            return b, 0, kv_block(b, rb, s, i, row_ranges, batch_ranges)

        in_specs += [
            pl.BlockSpec((squeezed, block_rows, 1), q_ids_map),
            pl.BlockSpec((squeezed, 1, block_kv), kv_ids_map),
        ]
        inputs += [q_ids, kv_ids]
    out_specs = [
        pl.BlockSpec((squeezed, block_heads, squeezed, block_rows, head_dim_v), out_map),
        pl.BlockSpec((squeezed, block_heads, squeezed, block_rows, LANES), out_map),
        pl.BlockSpec((squeezed, block_heads, squeezed, block_rows, LANES), out_map),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim_v), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, LANES), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, LANES), jnp.float32),
    ]
    body = functools.partial(
        _kernel,
        mask=mask,
        scale=scale,
        soft_cap=soft_cap,
        group=group,
        block_heads=block_heads,
        block_rows=block_rows,
        block_kv=block_kv,
        kv_len=kv_len,
        splits=splits,
        has_segment_ids=q_ids is not None,
        compute_dtype=jnp.float32 if k.dtype == jnp.float32 or k.dtype == jnp.float16 else k.dtype,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, kv_heads // block_heads, row_blocks, splits, steps),
        in_specs=in_specs,
        out_specs=out_specs,
    )
    return pl.pallas_call(
        body,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * 4 + ("arbitrary",), vmem_limit_bytes=vmem_limit
        ),
        interpret=interpret,
        name="splash_decode",
    )(row_ranges, batch_ranges, *inputs)
