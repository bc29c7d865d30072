"""Every mask form against SDPA with the equivalent dense bool mask: outputs and all three grads."""

import pytest
import torch
from helpers import assert_matches_reference, make_qkv, mask_oracle

import torch_splash
from torch_splash.masks import (
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    MultiHeadMask,
    from_mask_mod,
    from_tensor,
)
from torch_splash_jax import serialization

STRUCTURED = [
    ("local-left", LocalMask(40)),
    ("local-both", LocalMask(17, 9)),
    ("local-offset", LocalMask(None, 0, offset=30)),
    ("chunked", ChunkedCausalMask(64)),
    ("and", CausalMask(0) & LocalMask(50, None)),
    ("or", LocalMask(10, 10) | CausalMask(-100)),
    ("sink-or-window", LocalMask(31, 0) | (LocalMask(None, 3, offset=-1000) & FullMask())),
]


@pytest.mark.parametrize("name,mask", STRUCTURED, ids=[n for n, _ in STRUCTURED])
def test_structured_masks(name, mask):
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, 64, torch.float32)
    assert_matches_reference(q, k, v, mask)


def test_local_mask_cross_attention_odd_lengths_bf16():
    q, k, v = make_qkv(1, 4, 1, 77, 333, 64, 64, torch.bfloat16)
    assert_matches_reference(q, k, v, LocalMask(63, 0, offset=333 - 77))


def test_masks_compose_with_segment_ids():
    q, k, v = make_qkv(2, 2, 2, 260, 260, 64, 64, torch.float32)
    ids = torch.zeros(2, 260, dtype=torch.int32)
    ids[:, 90:] = 1
    ids[1, 200:] = 2
    assert_matches_reference(q, k, v, CausalMask(0) & LocalMask(32), segment_ids=ids)


def test_per_head_masks_list_and_multihead():
    q, k, v = make_qkv(2, 4, 2, 200, 200, 64, 64, torch.float32)
    per_head = [CausalMask(0), LocalMask(16), FullMask(), ChunkedCausalMask(50)]
    assert_matches_reference(q, k, v, per_head)
    assert_matches_reference(q, k, v, MultiHeadMask(tuple(per_head)))


def test_per_head_masks_with_mqa():
    q, k, v = make_qkv(1, 3, 1, 130, 130, 64, 64, torch.float32)
    assert_matches_reference(q, k, v, [CausalMask(0), LocalMask(5), CausalMask(-3)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_masks(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(2, 4, 2, 150, 190, 64, 64, dtype)
    dense = torch.rand(150, 190, generator=g) > 0.7
    dense[:5] = False  # rows with no visible key
    assert_matches_reference(q, k, v, from_tensor(dense))
    assert_matches_reference(q, k, v, dense)  # a bool tensor is accepted directly
    per_head = torch.rand(4, 150, 190, generator=g) > 0.5
    assert_matches_reference(q, k, v, per_head)


def test_mask_mod_flex_attention_convention():
    q, k, v = make_qkv(2, 4, 4, 200, 200, 64, 64, torch.float32)
    documents = torch.arange(200) // 70

    def document_causal(b, h, q_idx, kv_idx):
        return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

    def head_dependent(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 8 * (h + 1)) & (q_idx >= kv_idx)

    mask = from_mask_mod(document_causal)
    expected = (documents[:, None] == documents[None, :]) & torch.ones(200, 200, dtype=torch.bool).tril()
    out = torch_splash.attention(q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=expected)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_matches_reference(
        q,
        k,
        v,
        from_tensor(
            head_dependent(
                0, torch.arange(4)[:, None, None], torch.arange(200)[None, :, None], torch.arange(200)[None, None, :]
            )
        ),
    )
    out = torch_splash.attention(q, k, v, from_mask_mod(head_dependent))
    h = torch.arange(4)[:, None, None]
    dense = head_dependent(0, h, torch.arange(200)[None, :, None], torch.arange(200)[None, None, :])
    torch.testing.assert_close(
        out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=2e-5, rtol=1e-5
    )


def test_a_mask_mod_follows_what_it_captured():
    """A mask_mod's mask is that of its captured tensors and scalars at the call, not at the first call."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    documents = torch.arange(64) // 32
    width = 40

    def document_mask(b, h, q_idx, kv_idx):
        return (documents[q_idx] == documents[kv_idx]) & (q_idx - kv_idx < width)

    mask = from_mask_mod(document_mask)
    for change in ("none", "tensor in place", "captured scalar"):
        if change == "tensor in place":
            documents[:] = torch.arange(64) // 16
        elif change == "captured scalar":
            width = 5
        i, j = torch.arange(64)[:, None], torch.arange(64)[None, :]
        dense = (documents[i] == documents[j]) & (i - j < (40 if change != "captured scalar" else 5))
        out = torch_splash.attention(q, k, v, mask)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5, msg=change)


def test_padding_never_leaks_for_odd_lengths():
    """Padded keys get no weight and padded query rows never reach the output, for every family."""
    for mask in (FullMask(), LocalMask(None, None), ChunkedCausalMask(3), CausalMask(500)):
        q, k, v = make_qkv(1, 2, 2, 5, 131, 64, 64, torch.float32, seed=7)
        assert_matches_reference(q, k, v, mask)


@pytest.mark.parametrize(
    "mask",
    [CausalMask(-1000), LocalMask(0, 0, offset=5000), torch.zeros(40, 60, dtype=torch.bool)],
    ids=["causal", "local", "tensor"],
)
def test_mask_with_no_allowed_pair_gives_zeros(mask):
    q, k, v = make_qkv(1, 2, 2, 40, 60, 64, 64, torch.float32)
    out = torch_splash.attention(q, k, v, mask)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))
    assert_matches_reference(q, k, v, mask)


# Every kind of mask composes with every other under & and |. Each kind with its meaning as a
# (H, Lq, Lkv) bool tensor written from its definition, not from torch_splash's own dense().
H, LQ, LKV = 2, 40, 56
_rng = torch.Generator().manual_seed(7)
_DENSE_2D = torch.rand(LQ, LKV, generator=_rng) > 0.4
_DENSE_3D = torch.rand(H, LQ, LKV, generator=_rng) > 0.4
_q, _kv = torch.arange(LQ).view(1, LQ, 1), torch.arange(LKV).view(1, 1, LKV)
KINDS = {
    "causal": (CausalMask(3), (_q + 3 >= _kv).expand(H, LQ, LKV)),
    "local": (LocalMask(9, 2, offset=-4), ((_kv >= _q - 4 - 9) & (_kv <= _q - 4 + 2)).expand(H, LQ, LKV)),
    "chunked": (torch_splash.masks.ChunkedCausalMask(7), ((_q // 7 == _kv // 7) & (_kv <= _q)).expand(H, LQ, LKV)),
    "prefix": (torch_splash.masks.PrefixMask(10), (_kv < 10).expand(H, LQ, LKV)),
    "per-head": (MultiHeadMask((CausalMask(0), LocalMask(4))), torch.cat([_q >= _kv, (_kv >= _q - 4) & (_kv <= _q)])),
    "tensor-2d": (from_tensor(_DENSE_2D), _DENSE_2D.expand(H, LQ, LKV)),
    "tensor-per-head": (from_tensor(_DENSE_3D), _DENSE_3D),
    "mask-mod": (
        from_mask_mod(lambda b, h, q, kv: (kv % 3 == 0) | (h == 1)),
        ((_kv % 3 == 0) | (torch.arange(H).view(H, 1, 1) == 1)).expand(H, LQ, LKV),
    ),
}
_NAMES = list(KINDS)
PAIRS = [(a, b, "&" if (i + j) % 2 else "|") for i, a in enumerate(_NAMES) for j, b in enumerate(_NAMES) if i <= j]


def test_the_oracle_is_the_definitions_written_out():
    """tests/helpers.py's mask_oracle, which every reference here uses, agrees with each kind's
    meaning written out above (neither is torch_splash's own `allows()` or `dense()`)."""
    for name, (mask, expected) in KINDS.items():
        got = mask_oracle(mask, LQ, LKV, heads=H).expand(H, LQ, LKV)
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("left,right,op", PAIRS, ids=[f"{a}{op}{b}" for a, b, op in PAIRS])
def test_every_mask_kind_composes_with_every_other(left, right, op):
    (mask_a, dense_a), (mask_b, dense_b) = KINDS[left], KINDS[right]
    mask = mask_a & mask_b if op == "&" else mask_a | mask_b
    expected = dense_a & dense_b if op == "&" else dense_a | dense_b
    q, k, v = (t.detach() for t in make_qkv(1, H, H, LQ, LKV, 64, 64, torch.float32))
    out = torch_splash.attention(q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=expected[None])
    torch.testing.assert_close(out, ref.nan_to_num(0.0), atol=2e-5, rtol=1e-5)


def test_prefix_lm_stays_structured_and_skips_blocks():
    from torch_splash_jax import tables

    mask = CausalMask(0) | torch_splash.masks.PrefixMask(700)
    assert serialization.mask_source(mask) == "Or(CausalMask(0), PrefixMask(700))"  # crosses torch.compile
    table = tables.block_mask_table(mask, 2048, 2048, 2048, 512, 512)
    # 512-blocks: above the diagonal only block (0, 1) holds prefix keys (512..699); the other 5 are skipped
    assert table[0, 1] == 1 and (table == 0).sum() == 5
    q, k, v = make_qkv(1, 2, 2, 700, 700, 64, 64, torch.float32)
    assert_matches_reference(q, k, v, mask)


def test_what_cannot_combine_is_a_splash_error():
    with pytest.raises(torch_splash.SplashDtypeError, match="cannot combine a mask with int"):
        CausalMask() & 3
    with pytest.raises(torch_splash.SplashDtypeError, match="cannot combine a mask with int"):
        from_mask_mod(lambda b, h, q, kv: q >= kv) | 3
    with pytest.raises(torch_splash.SplashConstraintError, match="per-head masks of 2 and 3 heads"):
        MultiHeadMask((FullMask(), FullMask())) & MultiHeadMask((FullMask(),) * 3)
    with pytest.raises(torch_splash.SplashDtypeError, match="from_tensor takes a bool torch.Tensor"):
        from_tensor([1])


def test_floor_division_inside_the_kernel_equals_numpy_s_for_every_sign():
    """The chunked mask's `//` in the kernel avoids jnp.floor_divide (its TPU lowering needs the
    chip's generation on jax 0.12): the replacement must floor exactly as NumPy does, negatives too."""
    import jax.numpy as jnp
    import numpy as np

    from torch_splash_jax.structured_masks import _floor_div

    x = np.arange(-600, 600, dtype=np.int32)
    for divisor in (1, 3, 7, 128, 4096):
        assert np.array_equal(np.asarray(_floor_div(jnp.asarray(x), divisor)), x // divisor), divisor


def test_a_wrong_allows_fails_against_the_oracle(monkeypatch):
    """The references are the masks' definitions, not their code: a ChunkedCausalMask whose
    `allows()` forgot causality inside each chunk (the kernel's and the host's mask function) gives
    outputs the reference rejects. A mask and shape of this test's own, dropped from the caches after."""
    import torch_splash_jax
    from torch_splash_jax import tables

    monkeypatch.setattr(torch_splash_jax.ChunkedCausalMask, "allows", lambda self, q, kv: q // 19 == kv // 19)
    q, k, v = make_qkv(1, 1, 1, 77, 77, 32, 32, torch.float32)
    try:
        with pytest.raises(AssertionError):
            assert_matches_reference(q, k, v, torch_splash.masks.ChunkedCausalMask(19))
    finally:
        torch_splash_jax.program.cache_clear()
        tables.mask_info.cache_clear()
