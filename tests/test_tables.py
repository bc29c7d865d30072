"""Our vectorised block tables are identical to JAX's own `_process_mask` on a sweep of masks."""

import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jax_masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as jax_info

from torch_splash_jax import masks, tables

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
    import torch_splash_jax
    from torch_splash_jax import kernel_tables

    def plan(*heads):
        return torch_splash_jax.plan(
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

    assert kernel_tables._has_allowed_pair(plan(masks.CausalMask(offset=-(2**21)), masks.LocalMask(4096, 0)))
    assert not kernel_tables._has_allowed_pair(
        plan(masks.CausalMask(offset=-(2**21)), masks.CausalMask(offset=-(2**21)))
    )


_RNG = np.random.default_rng(1)
_RANDOM = masks.DenseMask(_RNG.random((512, 512)) < 0.3)
_CAUSAL_HOLES = masks.DenseMask(np.tril(np.ones((512, 512), bool)) & (_RNG.random((512, 512)) < 0.9))
_PER_HEAD = [masks.CausalMask(), masks.LocalMask(100, 0), masks.ChunkedCausalMask(96), masks.CausalMask(-40)]
STORED = {
    # name: (one mask per head, kv_len_padded, block shape, query-sequence shards, head shards)
    "per-head structured": (_PER_HEAD, 512, (128, 128), 1, 1),
    "per-head, 2 sequence shards": (_PER_HEAD, 512, (128, 128), 2, 1),
    "per-head, 4 x 2 shards": (_PER_HEAD, 512, (64, 128), 4, 2),
    "one tensor for all heads (shrunk)": ([_RANDOM] * 4, 512, (128, 128), 1, 1),
    "tensors per head, 2 x 2 shards": ([_RANDOM, _CAUSAL_HOLES] * 2, 512, (128, 128), 2, 2),
    "structured & tensor, padded keys": (
        [masks.CausalMask() & _CAUSAL_HOLES, masks.LocalMask(30, 30) | _RANDOM],
        640,
        (128, 128),
        1,
        1,
    ),
}


@pytest.mark.parametrize("name", list(STORED))
def test_stored_block_tables_identical_to_jax(name):
    """Per-head masks and masks that are data: every shard's data_next, mask_next, block_mask and
    the partial blocks themselves, entry for entry as JAX's `_process_mask` lays them out with
    q_seq_shards and head_shards (its shards concatenated along the q blocks)."""
    heads, kv_pad, block_shape, seq_shards, head_shards = STORED[name]
    length, kv_len = 512, 512
    jax_mask = jax_masks.MultiHeadMask([masks.bind(h, 1, length, kv_pad, kv_len).masks[0] for h in heads])
    positions = np.arange(length).reshape(seq_shards, -1)
    for is_dkv in (False, True):
        for shrink in (False, True):
            want, _ = jax_info._process_mask(
                jax_mask, block_shape, is_dkv, head_shards=head_shards, q_seq_shards=seq_shards, shrink_grid=shrink
            )
            got = tables.partial_mask_info(
                tuple(heads), positions, length, kv_pad, kv_len, block_shape, is_dkv, shrink, head_shards
            )
            assert want.partial_mask_blocks is not None and want.q_sequence is None and got.q_sequence is None
            for field in ("block_mask", "data_next", "mask_next", "partial_mask_blocks"):
                w, g = getattr(want, field), getattr(got, field)
                if field != "partial_mask_blocks":
                    g = np.concatenate(list(g), axis=1)  # (S, H, q blocks / S, width) -> JAX's (H, q blocks, width)
                assert w.dtype == g.dtype and w.shape == g.shape and np.array_equal(w, g), (field, is_dkv, shrink)


def test_stored_block_tables_evaluate_non_consecutive_rows_exactly():
    """The balanced layout's rows: a block straddling two chunks holds positions far apart; its
    partial block is the mask at exactly those rows (hidden padding rows included)."""
    spec = masks.CausalMask() & _CAUSAL_HOLES
    rows = np.concatenate([np.arange(0, 96), np.arange(416, 512), np.full(64, -1)])[None]  # 2 chunks + padding
    info = tables.partial_mask_info((spec,), rows, 512, 512, 512, (128, 128), False, False)
    dense = spec.dense(512, 512)
    for q in range(2):
        for c in range(4):
            r = rows[0, q * 128 : (q + 1) * 128]
            want = np.where((r >= 0)[:, None], dense[np.clip(r, 0, None), c * 128 : (c + 1) * 128], False)
            kind = info.block_mask[0, 0, q, c]
            assert kind == (2 if want.all() else 1 if want.any() else 0)
            if kind == 1:
                assert np.array_equal(info.partial_mask_blocks[info.mask_next[0, 0, q, c]], want)


def test_rounded_table_shapes_are_few_and_at_most_a_quarter_larger():
    """`tables.bucket`: what a stored-block program's table shapes round to (documents packed anew
    then mostly share one program): four sizes per doubling, never more than 1/4 above the need,
    never past the grid's own extent, never below the need."""
    bucket = tables.bucket
    assert [bucket(n) for n in (1, 7, 8, 9, 16, 17, 33, 100)] == [1, 7, 8, 10, 16, 20, 40, 112]
    assert all(n <= bucket(n) <= n * 1.25 for n in range(1, 5000))
    assert {bucket(n) for n in range(1025, 2049)} == {1280, 1536, 1792, 2048}
    assert bucket(9, limit=9) == 9 and bucket(17, limit=18) == 18 and bucket(17, limit=5) == 17
