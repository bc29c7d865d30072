"""What the plan is timed against, each as JAX users run it: JAX's splash kernel (`make_splash_mha`
with its own masks, vmapped over the batch, at MaxText's blocks), XLA's dense attention, and for
decode JAX's paged attention and ragged paged attention (their entry points: `compat`). Each
builder returns (forward, step or None), jittable functions of the call's q, k, v (and segment
ids; the step also takes the output's cotangent), or for the paged kernels (kernel, prepare): the
cache paged once by `prepare`, outside the time; or raises `Unavailable` with the reason a
baseline does not serve a call."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import compat
from .cases import Call


class Unavailable(Exception):
    """A baseline that cannot serve this call (its reason is the message)."""


def _splash_mask(call: Call):
    """JAX's own mask for the call's, for the masks MaxText uses (causal, full, a causal window)."""
    _, masks, _ = compat.splash_modules()
    shape = (call.q_len, call.kv_len)
    one = {
        "CausalMask(0)": lambda: masks.CausalMask(shape),
        "FullMask()": lambda: masks.FullMask(shape),
    }.get(call.mask)
    if one is None and call.mask.startswith("LocalMask(") and call.mask.endswith(", 0)"):
        left = int(call.mask[len("LocalMask(") : -len(", 0)")])
        one = lambda: masks.LocalMask(shape, window_size=(left, 0), offset=0)  # noqa: E731
    if one is None:
        raise Unavailable(f"no JAX splash mask written for {call.mask}")
    return masks.MultiHeadMask([one() for _ in range(call.q_heads)])


def jax_splash(call: Call, blocks: dict, interpret: bool = False):
    """JAX's splash kernel as MaxText calls it: `make_splash_mha`, q pre-scaled, vmapped over the batch."""
    if call.soft_cap is not None or call.sinks or call.kernel == "decode" or call.dtype == "float16":
        raise Unavailable("the rows JAX's splash is timed on are plain causal, full and window calls")
    kernel_module, _, _ = compat.splash_modules()
    lengths = dict(q=call.q_len, kv=call.kv_len)  # blocks no longer than the sequence they tile
    sizes = kernel_module.BlockSizes(**{
        k: v if k == "use_fused_bwd_kernel" else min(v, lengths[k.split("_")[1]])
        for k, v in blocks.items() if not k.endswith("_layout")
    })  # fmt: skip
    make = kernel_module.make_splash_mqa if call.kv_heads == 1 else kernel_module.make_splash_mha
    kernel = make(_splash_mask(call), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    scale = call.head_dim**-0.5

    def forward(q, k, v, q_ids=None, kv_ids=None):
        if call.kv_heads == 1:
            k, v = k[:, 0], v[:, 0]
        if q_ids is None:
            return jax.vmap(kernel)(q * scale, k, v)
        ids = kernel_module.SegmentIds(q=q_ids, kv=kv_ids)
        return jax.vmap(lambda q, k, v, i: kernel(q, k, v, segment_ids=i))(q * scale, k, v, ids)

    return forward, _step(forward)


def xla_dense(call: Call, platform: str = "tpu"):
    """Dense attention as XLA compiles it: the (B, H, Lq, Lkv) logits in float32, softmax, in the
    inputs' dtype for the matmuls (float32 on the CPU, whose dot has no bfloat16 x bfloat16 ->
    float32)."""
    from .cases import DENSE_MAX_LOGIT_BYTES

    logit_bytes = 4 * call.batch * call.q_heads * call.q_len * call.kv_len
    if logit_bytes > DENSE_MAX_LOGIT_BYTES:
        raise Unavailable(f"its float32 logits would take {logit_bytes / 2**30:.0f} GiB")
    from .reference import allowed

    if call.mask == "per-head":
        raise Unavailable("dense attention is timed with one mask for all heads")
    group = call.q_heads // call.kv_heads
    dense_mask = None if call.segment_ids else allowed(call, {})

    def forward(q, k, v, q_ids=None, kv_ids=None):
        mask = dense_mask if q_ids is None else allowed(call, dict(q_ids=q_ids, kv_ids=kv_ids))
        dtype = q.dtype
        if platform != "tpu":
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        b, _, lq, d = q.shape
        qg = q.reshape(b, call.kv_heads, group, lq, d)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k, preferred_element_type=jnp.float32) * call.head_dim**-0.5
        s = jnp.where(mask[:, :, None], s, -jnp.inf)  # (B or 1, 1, 1, Lq, Lkv)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(jnp.isnan(p), 0.0, p).astype(q.dtype)
        out = jnp.einsum("bhgqk,bhkd->bhgqd", p, v, preferred_element_type=jnp.float32)
        return out.reshape(b, call.q_heads, lq, -1).astype(dtype)

    return forward, _step(forward) if call.kernel != "decode" else None


def _step(forward):
    def step(q, k, v, d_out, *ids):
        out, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, *ids), q, k, v)
        return vjp(d_out)

    return step


PAGE_SIZE = 128


def _pages(call: Call, k, v):
    """k, v (B, Hkv, L, D) as a paged cache: each sequence's pages in order, PAGE_SIZE tokens a page."""
    b, hkv, length, d = k.shape
    pages = length // PAGE_SIZE
    k_pages = k.reshape(b, hkv, pages, PAGE_SIZE, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * pages, PAGE_SIZE, d)
    v_pages = v.reshape(b, hkv, pages, PAGE_SIZE, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * pages, PAGE_SIZE, d)
    indices = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    return k_pages, v_pages, indices


def _decode_only(call: Call) -> None:
    if call.kernel != "decode" or call.q_len != 1 or call.kv_len % PAGE_SIZE or call.soft_cap or call.sinks:
        raise Unavailable("paged attention is timed on one-token decode steps over whole pages")


def paged_attention(call: Call, pages_per_block: int = 32):
    """JAX's paged attention (decode, one query token), q pre-scaled; each sequence's length from
    its segment ids (its keys with id 1)."""
    _decode_only(call)
    paged = compat.paged_attention()
    block = min(pages_per_block, call.kv_len // PAGE_SIZE)

    def prepare(q, k, v, q_ids=None, kv_ids=None):
        lengths = jnp.full((call.batch,), call.kv_len, jnp.int32) if kv_ids is None else kv_ids.sum(axis=1)
        return (q[:, :, 0] * call.head_dim**-0.5, *_pages(call, k, v), lengths.astype(jnp.int32))

    def kernel(q, k_pages, v_pages, indices, lengths):
        return paged(q, k_pages, v_pages, lengths, indices, pages_per_compute_block=block)

    return kernel, prepare


def ragged_paged_attention(call: Call, pages_per_block: int = 16, vmem_limit: int = 64 << 20):
    """JAX's ragged paged attention (vLLM's TPU kernel) on the same decode step: k and v pages
    interleaved along their heads, as it takes them."""
    _decode_only(call)
    ragged = compat.ragged_paged_attention()
    block = min(pages_per_block, call.kv_len // PAGE_SIZE)

    def prepare(q, k, v, q_ids=None, kv_ids=None):
        b, hkv, length, d = k.shape
        pages = length // PAGE_SIZE
        combined = jnp.stack([k, v], axis=2).reshape(b, 2 * hkv, pages, PAGE_SIZE, d)
        kv_pages = combined.transpose(0, 2, 3, 1, 4).reshape(b * pages, PAGE_SIZE, 2 * hkv, d)
        lengths = jnp.full((b,), length, jnp.int32) if kv_ids is None else kv_ids.sum(axis=1).astype(jnp.int32)
        indices = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32)
        return q[:, :, 0], kv_pages, lengths, indices, cu_q_lens, jnp.asarray([b], jnp.int32)

    def kernel(*prepared):
        return ragged(
            *prepared,
            sm_scale=call.head_dim**-0.5,
            num_kv_pages_per_block=block,
            num_queries_per_block=8,
            vmem_limit_bytes=vmem_limit,
        )

    return kernel, prepare
