"""Every splash constraint is checked before any JAX work, with an error in the caller's terms."""

import pytest
import torch
from helpers import assert_matches_reference, make_qkv

import torch_splash
import torch_splash_jax
from torch_splash import BlockSizes, SplashConstraintError, SplashDtypeError


@pytest.fixture(autouse=True)
def no_jax_work(monkeypatch):
    """Fail if a bad call reaches the kernel builder: checks must come first."""
    import torch_splash._ops as ops

    def refuse(plan):
        raise AssertionError("JAX work started before the error")

    monkeypatch.setattr(ops.torch_splash_jax, "program", refuse)


def qkv(hq=4, hkv=2, q_len=16, kv_len=16, d=64, dv=64, dtype=torch.float32, batch=2):
    return make_qkv(batch, hq, hkv, q_len, kv_len, d, dv, dtype)


def raises(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        torch_splash.attention(*args, **kwargs)


def test_error_types_are_documented_subclasses():
    assert issubclass(SplashConstraintError, ValueError)
    assert issubclass(SplashDtypeError, TypeError)


_WRONG_TYPES = {
    "q as a list": lambda q: torch_splash.attention(q.tolist(), q, q),
    "mask=1.0": lambda q: torch_splash.attention(q, q, q, mask=1.0),
    "a float mask": lambda q: torch_splash.attention(q, q, q, mask=torch.zeros(16, 16)),
    "scale='0.1'": lambda q: torch_splash.attention(q, q, q, scale="0.1"),
    "soft_cap=[1.0]": lambda q: torch_splash.attention(q, q, q, soft_cap=[1.0]),
    "block_sizes as a dict": lambda q: torch_splash.attention(q, q, q, block_sizes={"block_kv": 128}),
    "block_q=16.0": lambda q: torch_splash.attention(q, q, q, block_sizes=BlockSizes(block_q=16.0)),
    "use_fused_bwd_kernel=1": lambda q: torch_splash.attention(q, q, q, block_sizes=BlockSizes(use_fused_bwd_kernel=1)),
    "attn_mask as a list": lambda q: torch_splash.scaled_dot_product_attention(q, q, q, attn_mask=[[True]]),
    "CausalMask(1.5)": lambda q: torch_splash.masks.CausalMask(offset=1.5),
    "LocalMask('8')": lambda q: torch_splash.masks.LocalMask("8"),
    "from_tensor(list)": lambda q: torch_splash.masks.from_tensor([[True]]),
    "from_mask_mod(str)": lambda q: torch_splash.masks.from_mask_mod("causal"),
    "mask | int": lambda q: torch_splash.masks.CausalMask() | 1,
    "MultiHeadMask of str": lambda q: torch_splash.masks.MultiHeadMask(("causal",)),
    "hf.patch(object)": lambda q: torch_splash.hf.patch(object()),
}


@pytest.mark.parametrize("call", _WRONG_TYPES.values(), ids=_WRONG_TYPES.keys())
def test_a_wrong_type_is_a_dtype_error_wherever_it_is_passed(call):
    """README: SplashDtypeError for types and dtypes, SplashConstraintError for values."""
    import torch_splash.hf  # noqa: F401  (hf.patch)

    q, _, _ = qkv(hkv=4)
    with pytest.raises(SplashDtypeError):
        call(q)


# --- The three seeds ------------------------------------------------------------------------


def test_seed_block_kv_not_multiple_of_lanes_names_128():
    # The seed's report claims NUM_LANES is 8; it is 128, and we say so.
    raises(
        SplashConstraintError,
        r"block_sizes\.block_kv=8 is not a multiple of 128.*Use 128",
        *qkv(),
        block_sizes=BlockSizes(block_kv=8),
    )
    raises(
        SplashConstraintError,
        r"block_sizes\.block_kv_dq=100 is not a multiple of 128.*Use 128",
        *qkv(),
        block_sizes=BlockSizes(block_kv_dq=100),
    )
    raises(
        SplashConstraintError,
        r"block_kv_compute=200 .*Use 128 or 256",
        *qkv(),
        block_sizes=BlockSizes(block_kv_compute=200),
    )


def test_seed_kv_segment_ids_of_wrong_length_name_the_fix():
    q, k, v = qkv(q_len=16, kv_len=40)
    q_ids = torch.zeros(2, 16, dtype=torch.int32)
    padded_cache_ids = torch.zeros(2, 64, dtype=torch.int32)
    raises(
        SplashConstraintError,
        r"segment_ids\[1\] \(kv ids\) has shape \(2, 64\) but must be \(2, 40\).*"
        r"Lkv=40.*\[\.\.\., :40\]",
        q,
        k,
        v,
        segment_ids=(q_ids, padded_cache_ids),
    )
    raises(
        SplashConstraintError,
        r"segment_ids\[0\] \(q ids\) has shape \(2, 15\) but must be \(2, 16\)",
        q,
        k,
        v,
        segment_ids=(q_ids[:, :15], padded_cache_ids[:, :40]),
    )
    raises(SplashConstraintError, r"single tensor but Lq=16 != Lkv=40", q, k, v, segment_ids=q_ids)


# --- Shapes, dtypes, devices ------------------------------------------------------------------


def test_head_divisibility():
    raises(SplashConstraintError, r"q has 6 heads and k, v have 4.*\[1, 2, 3, 6\]", *qkv(hq=6, hkv=4))


def test_k_v_leading_dims():
    q, k, v = qkv()
    raises(
        SplashConstraintError,
        r"k \(2, 2, 16, 64\) and v \(2, 2, 17, 64\) must share",
        q,
        k,
        v[:, :, :15].repeat(1, 1, 2, 1)[:, :, :17],
    )
    raises(SplashConstraintError, r"batch sizes 2, 2, 1", q, k, v[:1])


def test_head_dim_mismatch():
    q, k, v = qkv()
    raises(SplashConstraintError, r"q has head_dim 64 but k has 32", q, k[..., :32], v)


def test_rank():
    q, k, v = qkv()
    raises(SplashConstraintError, r"expected all 4-D", q[0, 0], k[0, 0], v[0, 0])
    raises(SplashConstraintError, r"expected all 4-D", q, k[0], v[0])


def test_dtypes():
    q, k, v = qkv()
    raises(
        SplashDtypeError, r"dtypes torch.float32, torch.bfloat16, torch.float32: they must match", q, k.bfloat16(), v
    )
    raises(SplashDtypeError, r"q has dtype torch.int64", q.long(), k.long(), v.long())
    raises(
        SplashDtypeError,
        r"dtype torch.float64: the splash kernels compute in float32 at most",
        q.double(),
        k.double(),
        v.double(),
    )
    raises(SplashDtypeError, r"segment ids are integers", q, k, v, segment_ids=torch.zeros(2, 16))


def test_empty_tensors():
    q, k, v = qkv()
    raises(
        SplashConstraintError, r"k has shape \(2, 2, 0, 64\) with a zero-sized dimension", q, k[:, :, :0], v[:, :, :0]
    )


def test_not_tensors():
    q, k, v = qkv()
    raises(SplashDtypeError, r"k must be a torch.Tensor", q, k.tolist(), v)


def test_different_devices(xla_device):
    q, k, v = qkv()
    raises(SplashConstraintError, r"devices cpu, xla:0, cpu: move them to one device", q, k.detach().to(xla_device), v)


# --- Options ----------------------------------------------------------------------------------


def test_block_size_rules():
    q, k, v = qkv()
    raises(
        SplashConstraintError,
        r"block_q=12 is not a multiple of 8.*Use 8 or 16",
        q,
        k,
        v,
        block_sizes=BlockSizes(block_q=12),
    )
    raises(
        SplashConstraintError,
        r"block_q_dkv=64 is not a multiple of 128",
        q,
        k,
        v,
        block_sizes=BlockSizes(block_q_dkv=64),
    )
    raises(
        SplashConstraintError,
        r"block_kv=512 is not a multiple of block_sizes.block_kv_compute=384",
        q,
        k,
        v,
        block_sizes=BlockSizes(block_kv=512, block_kv_compute=384),
    )
    raises(
        SplashConstraintError,
        r"fused backward computes dq inside the dkv kernel",
        q,
        k,
        v,
        block_sizes=BlockSizes(use_fused_bwd_kernel=True, block_q_dq=128),
    )
    raises(
        SplashConstraintError, r"block_kv=0: block sizes are positive ints", q, k, v, block_sizes=BlockSizes(block_kv=0)
    )
    raises(SplashDtypeError, r"pass torch_splash.BlockSizes", q, k, v, block_sizes={"block_kv": 128})
    raises(
        SplashConstraintError,
        r"q_layout='SEQ_MINOR'.*multiple of 128",
        q,
        k,
        v,
        block_sizes=BlockSizes(block_q=8, q_layout="SEQ_MINOR"),
    )


def test_mask_scale_soft_cap():
    q, k, v = qkv()
    raises(SplashConstraintError, r"mask='upper'.*'causal'", q, k, v, mask="upper")
    raises(SplashDtypeError, r"mask of type float", q, k, v, mask=1.0)
    raises(
        SplashConstraintError,
        r"mask has shape \(16, 17\) but the call has \(Lq, Lkv\) = \(16, 16\)",
        q,
        k,
        v,
        mask=torch.ones(16, 17, dtype=torch.bool),
    )
    raises(SplashConstraintError, r"per-head mask has 3 heads but q has 4", q, k, v, mask=["causal"] * 3)
    raises(SplashDtypeError, r"mask has dtype torch.float32: pass a bool mask", q, k, v, mask=torch.zeros(16, 16))
    raises(
        SplashConstraintError,
        r"depends on the batch index b",
        q,
        k,
        v,
        mask=torch_splash.masks.from_mask_mod(lambda b, h, qi, ki: (qi >= ki) | (b > 0)),
    )
    with pytest.raises(SplashConstraintError, match=r"window_left=-1 must be >= 0"):
        torch_splash.masks.LocalMask(-1)
    with pytest.raises(SplashConstraintError, match=r"chunk_size=0 must be >= 1"):
        torch_splash.masks.ChunkedCausalMask(0)
    raises(SplashConstraintError, r"soft_cap=0.0: must be > 0", q, k, v, soft_cap=0.0)
    raises(SplashConstraintError, r"scale=nan", q, k, v, scale=float("nan"))
    raises(SplashDtypeError, r"scale='0.1': expected a finite float", q, k, v, scale="0.1")
    raises(SplashConstraintError, r"transport='nccl': expected one of", q, k, v, transport="nccl")
    with pytest.raises(SplashDtypeError, match=r"offset=1.5 must be an int"):
        torch_splash.masks.CausalMask(1.5)


# --- Seed: a block larger than the sequence is clamped, not an error ----------------------------


def test_seed_block_larger_than_sequence_is_clamped(monkeypatch):
    monkeypatch.undo()  # this one runs the kernels
    q, k, v = make_qkv(1, 2, 2, 100, 512, 64, 64, torch.float32)
    blocks = BlockSizes(
        block_q=1024, block_kv=1024, block_q_dq=1024, block_kv_dq=1024, block_q_dkv=2048, block_kv_dkv=2048
    )
    assert_matches_reference(q, k, v, "causal", block_sizes=blocks)
    plan = torch_splash_jax.plan(num_q_heads=2, q_len=100, kv_len=512, head_dim=64, block_sizes=blocks)
    assert plan.block_sizes()["block_kv"] == plan.block_sizes()["block_kv_dq"] == 512
    assert plan.block_sizes()["block_q"] == 128 and plan.q_len_padded == 128


def test_unsupported_devices_are_a_splash_error_before_anything_else():
    """A meta tensor is refused by name, before segment ids are touched (reading meta ids raised
    torch's "Cannot copy out of meta tensor"); a cuda device is refused the same way."""
    q = torch.empty(1, 2, 16, 64, device="meta")
    with pytest.raises(SplashConstraintError, match=r"q is on meta"):
        torch_splash.attention(q, q, q, segment_ids=torch.zeros(1, 16, dtype=torch.int64, device="meta"))
    with pytest.raises(SplashConstraintError, match=r"q is on cuda"):
        torch_splash._platform.platform_of(torch.device("cuda"))


def test_every_public_error_is_a_splash_error():
    """One refusal of each kind a user can meet, through every public entry point: each is one of
    torch_splash's errors (catch SplashError for all), ValueError or TypeError by kind, before any
    JAX work."""
    import torch_splash.hf
    from torch_splash import masks

    assert issubclass(SplashConstraintError, torch_splash.SplashError) and issubclass(SplashConstraintError, ValueError)
    assert issubclass(SplashDtypeError, torch_splash.SplashError) and issubclass(SplashDtypeError, TypeError)
    q = torch.randn(1, 2, 16, 8)
    refusals = {
        "q not a tensor": lambda: torch_splash.attention(q.tolist(), q, q),
        "3 dims and 4": lambda: torch_splash.attention(q[0], q, q),
        "integer dtype": lambda: torch_splash.attention(*(q.int(),) * 3),
        "float64": lambda: torch_splash.attention(*(q.double(),) * 3),
        "meta device": lambda: torch_splash.attention(*(q.to("meta"),) * 3),
        "unknown string mask": lambda: torch_splash.attention(q, q, q, "nonsense"),
        "mask of another type": lambda: torch_splash.attention(q, q, q, 5),
        "mask & int": lambda: masks.CausalMask() & 3,
        "from_tensor of a list": lambda: masks.from_tensor([1]),
        "from_mask_mod of a non-callable": lambda: masks.from_mask_mod(3),
        "negative window": lambda: masks.LocalMask(-3),
        "offset beyond int32": lambda: masks.CausalMask(offset=2**40),
        "per-head mask, wrong head count": lambda: torch_splash.attention(
            q, q, q, masks.MultiHeadMask([masks.CausalMask()] * 3)
        ),
        "segment ids of floats": lambda: torch_splash.attention(q, q, q, segment_ids=torch.zeros(1, 16)),
        "segment ids of a list": lambda: torch_splash.attention(q, q, q, segment_ids=[0] * 16),
        "segment ids, wrong length": lambda: torch_splash.attention(
            q, q, q, segment_ids=torch.zeros(1, 15, dtype=torch.int32)
        ),
        "block_sizes of an int": lambda: torch_splash.attention(q, q, q, block_sizes=3),
        "block_kv not a multiple of 128": lambda: torch_splash.attention(
            q, q, q, block_sizes=torch_splash.BlockSizes(block_kv=100)
        ),
        "unknown transport": lambda: torch_splash.attention(q, q, q, transport="x"),
        "scale of a string": lambda: torch_splash.attention(q, q, q, scale="a"),
        "negative soft cap": lambda: torch_splash.attention(q, q, q, soft_cap=-1.0),
        "sinks, wrong shape": lambda: torch_splash.attention(q, q, q, sinks=torch.zeros(3)),
        "sinks of a list": lambda: torch_splash.attention(q, q, q, sinks=[0.0, 0.0]),
        "partition_spec on CPU tensors": lambda: torch_splash.attention(
            q, q, q, partition_spec=("a", None, None, None)
        ),
        "drop-in: dropout": lambda: torch_splash.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
        "drop-in: float bias": lambda: torch_splash.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.randn(16, 16)
        ),
        "hf.patch of a non-model": lambda: torch_splash.hf.patch(3),
    }
    for name, refused in refusals.items():
        with pytest.raises(torch_splash.SplashError) as raised:
            refused()
        assert isinstance(raised.value, (ValueError, TypeError)), name


def test_meta_segment_ids_with_real_q_are_refused_before_any_copy():
    """Meta ids have shapes but no values: moving them to q's device raised torch's
    NotImplementedError from inside the library."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, 8, torch.float32)
    ids = torch.zeros(1, 16, dtype=torch.int32, device="meta")
    raises(SplashConstraintError, r"segment_ids is a meta tensor .* q is on cpu", q, k, v, segment_ids=ids)
