"""Our vectorised block tables are identical to JAX's own `_process_mask` on a sweep of masks."""

import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jax_masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as jax_info

from jax_core import masks, tables

MASKS = [
    masks.FullMask(),
    masks.CausalMask(0),
    masks.CausalMask(300),
    masks.CausalMask(-200),
    masks.LocalMask(255, 0),
    masks.LocalMask(100, 37),
    masks.LocalMask(None, 0, offset=-50),
    masks.LocalMask(64, None, offset=700),
    masks.ChunkedCausalMask(128),
    masks.ChunkedCausalMask(200),
    masks.ChunkedCausalMask(1000),
]
GRIDS = [
    # (q_len_padded, kv_len_padded, kv_len, block_q, block_kv)
    (1024, 1024, 1024, 128, 128),
    (1024, 1536, 1400, 256, 512),
    (512, 2048, 1900, 512, 256),
    (2048, 512, 300, 128, 512),
]


@pytest.mark.parametrize("spec", MASKS, ids=repr)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_tables_identical_to_jax(spec, grid):
    q_pad, kv_pad, kv_len, bq, bkv = grid
    jax_mask = jax_masks.MultiHeadMask([masks.bind(spec, 1, q_pad, kv_pad, kv_len).masks[0]])
    has_fn = hasattr(jax_mask.masks[0], "mask_function")
    for is_dkv in (False, True):
        for shrink in (False, True):
            got = tables.mask_info(spec, q_pad, kv_pad, kv_len, (bq, bkv), is_dkv, shrink, has_fn)
            if shrink and not got.block_mask.any():  # JAX asserts on a mask with no allowed pair
                with pytest.raises(AssertionError):
                    jax_info._process_mask(jax_mask, (bq, bkv), is_dkv, shrink_grid=shrink)
                continue
            want, _ = jax_info._process_mask(jax_mask, (bq, bkv), is_dkv, shrink_grid=shrink)
            for field in ("block_mask", "data_next", "q_sequence", "mask_next", "partial_mask_blocks"):
                w, g = getattr(want, field), getattr(got, field)
                assert (w is None) == (g is None), field
                if w is not None:
                    assert w.dtype == g.dtype and w.shape == g.shape and np.array_equal(w, g), (field, is_dkv, shrink)


def test_compositions_never_skip_a_block_jax_would_compute():
    """For & and |, `any` may over-estimate and `all` under-estimate, never the reverse."""
    for spec in (
        masks.CausalMask(0) & masks.LocalMask(300),
        masks.LocalMask(50, 50) | masks.CausalMask(-500),
        masks.ChunkedCausalMask(300) | masks.LocalMask(0, 0),
    ):
        dense = spec.dense(1024, 1024).reshape(8, 128, 8, 128)
        table = tables.block_mask_table(spec, 1024, 1024, 1024, 128, 128)
        truly_any, truly_all = dense.any(axis=(1, 3)), dense.all(axis=(1, 3))
        assert ((table > 0) | ~truly_any).all()  # no non-empty block is skipped
        assert ((table < 2) | truly_all).all()  # no block is unmasked unless it is full


def test_empty_mask_check_reads_per_head_structured_masks_by_blocks():
    """Whether a per-head mask allows any pair is decided from block bounds: evaluated densely,
    4 heads at 1M tokens would need 4 TB (it used to be, and was OOM-killed at 112K)."""
    import jax_core
    from jax_core import kernels

    def plan(*heads):
        return jax_core.plan(
            batch=1,
            num_q_heads=len(heads),
            num_kv_heads=1,
            q_len=2**20,
            kv_len=2**20,
            head_dim=128,
            head_dim_v=128,
            dtype="bfloat16",
            mask=masks.MultiHeadMask(heads),
            scale=1.0,
            soft_cap=None,
            has_segment_ids=False,
            block_sizes=None,
            platform="cpu",
            has_sinks=False,
        )

    assert kernels._has_allowed_pair(plan(masks.CausalMask(offset=-(2**21)), masks.LocalMask(4096, 0)))
    assert not kernels._has_allowed_pair(plan(masks.CausalMask(offset=-(2**21)), masks.CausalMask(offset=-(2**21))))
