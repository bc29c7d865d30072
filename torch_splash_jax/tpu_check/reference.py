"""The fidelity reference: dense attention in float32 at `highest` matmul precision, with the
same mask, segment ids, soft cap and sinks conventions as torch_splash (SDPA's: a row that sees no
key gives 0), and its gradients by `jax.vjp`. Also the inputs a case runs on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .cases import Call


def inputs(call: Call, seed: int = 0) -> dict:
    """Random q, k, v (and segment ids, sinks, the output's cotangent) of a call, as named arrays
    in the call's dtype (ids int32, sinks float32)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(call.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)

    b = call.batch
    named = dict(
        q=normal(b, call.q_heads, call.q_len, call.head_dim),
        k=normal(b, call.kv_heads, call.kv_len, call.head_dim),
        v=normal(b, call.kv_heads, call.kv_len, call.dv),
        d_out=normal(b, call.q_heads, call.q_len, call.dv),
    )
    if call.segment_ids:
        named["q_ids"], named["kv_ids"] = (jnp.asarray(ids) for ids in _segment_ids(call, rng))
    if call.sinks:
        named["sinks"] = jnp.asarray(rng.standard_normal(call.q_heads, np.float32))
    return named


def _segment_ids(call: Call, rng) -> tuple[np.ndarray, np.ndarray]:
    """Decode calls: every query of sequence b sees that sequence's first kv_len - 37 b keys (a
    cache of ragged lengths, padding after). Others: packed documents of 200 to 700 tokens, the
    query sequence aligned with the keys' end (cross lengths)."""
    b, lq, lkv = call.batch, call.q_len, call.kv_len
    if call.kernel == "decode":
        lengths = np.maximum(lkv - 37 * np.arange(b), 1)
        kv = (np.arange(lkv)[None, :] < lengths[:, None]).astype(np.int32)
        return np.ones((b, lq), np.int32), kv
    docs = np.cumsum(rng.integers(200, 700, size=(b, lkv // 200 + 1)), axis=1)
    kv = (np.arange(lkv)[None, :, None] >= docs[:, None, :]).sum(axis=2).astype(np.int32)
    return kv[:, lkv - lq :], kv


def allowed(call: Call, named: dict) -> jax.Array:
    """(B, Hq or 1, Lq, Lkv) bool: which keys each query may see."""
    dense = np.asarray(call.mask_object().dense(call.q_len, call.kv_len))
    mask = jnp.asarray(dense if dense.ndim == 3 else dense[None])[None]
    if call.segment_ids:
        mask = mask & (named["q_ids"][:, None, :, None] == named["kv_ids"][:, None, None, :])
    return mask


def attention(call: Call, q, k, v, sinks, mask) -> jax.Array:
    """Dense attention in float32 at highest precision: softmax(scale q k^T, soft-capped, masked,
    normalised over the sinks too) v, 0 on rows that see no key."""
    group = call.q_heads // call.kv_heads
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) * call.head_dim**-0.5
    if call.soft_cap is not None:
        s = call.soft_cap * jnp.tanh(s / call.soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    top = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = jnp.maximum(top, sinks[None, :, None, None])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks[None, :, None, None] - top)
    out = jnp.einsum("bhqk,bhkd->bhqd", p, v, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


def reference(call: Call, named: dict, gradients: bool = True) -> dict:
    """{"out", and with gradients "dq", "dk", "dv" (and "d_sinks")} of the reference, float32."""
    mask = allowed(call, named)
    sinks = named.get("sinks")
    primals = [named["q"], named["k"], named["v"]] + ([sinks] if sinks is not None else [])

    def fn(q, k, v, *s):
        return attention(call, q, k, v, s[0] if s else None, mask)

    upcast = [x.astype(jnp.float32) for x in primals]
    if not gradients:
        return dict(out=jax.jit(fn)(*upcast))
    out, vjp = jax.vjp(fn, *upcast)
    grads = vjp(named["d_out"].astype(jnp.float32))
    names = ["dq", "dk", "dv", "d_sinks"][: len(grads)]
    return dict(out=out, **dict(zip(names, grads)))


def relative_error(found, expected) -> float:
    """max |found - expected| / max |expected|, in float32 (0 when both are all zeros)."""
    found, expected = np.asarray(found, np.float32), np.asarray(expected, np.float32)
    scale = float(np.abs(expected).max())
    error = float(np.abs(found - expected).max())
    return error / scale if scale else error
