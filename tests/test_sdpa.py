"""torch_splash.scaled_dot_product_attention against torch's own SDPA on the same arguments."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import make_qkv

import torch_splash
import torch_splash_jax
from torch_splash import SplashConstraintError

SDPA = F.scaled_dot_product_attention


def both(q, k, v, **kwargs):
    """Outputs and grads of splash's drop-in and torch's SDPA on identical arguments."""
    g = torch.Generator().manual_seed(2)
    cot = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=g)
    results = []
    for fn in (torch_splash.scaled_dot_product_attention, SDPA):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, **kwargs)
        (out * cot).sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in (q, k, v)]))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_no_mask_and_is_causal():
    q, k, v = make_qkv(2, 4, 4, 100, 100, 64, 64, torch.float32)
    both(q, k, v)
    both(q, k, v, is_causal=True)
    both(q, k, v, is_causal=True, scale=0.2)


def test_enable_gqa():
    q, k, v = make_qkv(2, 8, 2, 70, 90, 64, 64, torch.float32)
    both(q, k, v, is_causal=True, enable_gqa=True)


def test_bool_and_float_masks():
    g = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(2, 4, 4, 60, 80, 64, 64, torch.float32)
    bool_mask = torch.rand(60, 80, generator=g) > 0.3
    both(q, k, v, attn_mask=bool_mask)
    float_mask = torch.zeros(60, 80).masked_fill(~bool_mask, float("-inf"))
    both(q, k, v, attn_mask=float_mask)
    hf_style = torch.zeros(60, 80).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    out = torch_splash.scaled_dot_product_attention(q, k, v, attn_mask=hf_style)
    torch.testing.assert_close(out, SDPA(q, k, v, attn_mask=bool_mask), atol=2e-5, rtol=1e-5)
    per_head = torch.rand(1, 4, 60, 80, generator=g) > 0.3
    both(q, k, v, attn_mask=per_head)


def test_causal_patterns_become_structured_masks():
    q, k, v = make_qkv(1, 2, 2, 50, 80, 64, 64, torch.float32)
    bottom_right = torch.ones(50, 80, dtype=torch.bool).tril(30)
    seen = []
    original = torch_splash.sdpa.attention

    def spy(*args, **kwargs):
        seen.append(args[3])
        return original(*args, **kwargs)

    torch_splash.sdpa.attention = spy
    try:
        both(q, k, v, attn_mask=bottom_right)
        both(q, k, v, attn_mask=torch.ones(50, 80, dtype=torch.bool))
    finally:
        torch_splash.sdpa.attention = original
    assert seen[0] == torch_splash_jax.CausalMask(30) and seen[1] == torch_splash_jax.FullMask()


def test_batch_varying_key_padding_is_served_with_segment_ids(monkeypatch):
    q, k, v = make_qkv(3, 4, 2, 64, 64, 64, 64, torch.float32)
    lengths = torch.tensor([64, 40, 7])
    valid = torch.arange(64)[None, :] < lengths[:, None]  # right padding
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    mask = causal[None, None] & valid[:, None, None, :]  # HF's 4-D (B, 1, Lq, Lkv)
    calls = []
    original = torch_splash.sdpa.attention
    monkeypatch.setattr(torch_splash.sdpa, "attention", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    out = torch_splash.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert len(calls) == 1 and calls[0]["segment_ids"] is not None
    monkeypatch.undo()
    ref = SDPA(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref.nan_to_num(0.0), atol=2e-5, rtol=1e-5)
    both(q, k, v, attn_mask=valid[:, None, None, :], enable_gqa=True)  # key padding only


def test_arbitrary_batch_varying_mask_is_served_per_batch():
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(2, 2, 2, 40, 40, 64, 64, torch.float32)
    mask = torch.rand(2, 1, 40, 40, generator=g) > 0.5
    mask[..., 0] = True
    both(q, k, v, attn_mask=mask)


def test_what_splash_cannot_serve_is_a_clear_error():
    q, k, v = make_qkv(1, 4, 2, 16, 16, 64, 64, torch.float32)
    with pytest.raises(SplashConstraintError, match="no attention dropout"):
        torch_splash.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(SplashConstraintError, match="additive bias"):
        torch_splash.scaled_dot_product_attention(q, k, v, attn_mask=torch.randn(16, 16), enable_gqa=True)
    with pytest.raises(torch_splash.SplashDtypeError, match="float64"):
        torch_splash.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), enable_gqa=True)


def _rejected_by_sdpa():
    """One case per kind of input torch's SDPA rejects: (q, k, v, kwargs)."""
    r = torch.randn
    qkv = (r(1, 4, 16, 8), r(1, 4, 16, 8), r(1, 4, 16, 8))
    return {
        "1-D inputs": ((r(8), r(8), r(8)), {}),
        "mixed dtypes": ((qkv[0], qkv[1].bfloat16(), qkv[2]), {}),
        "integer inputs": (tuple(t.int() for t in qkv), {}),
        "head dims differ": ((qkv[0], r(1, 4, 16, 16), qkv[2]), {}),
        "heads differ without enable_gqa": ((qkv[0], r(1, 2, 16, 8), r(1, 2, 16, 8)), {}),
        "heads not a multiple, enable_gqa": ((r(1, 3, 16, 8), r(1, 2, 16, 8), r(1, 2, 16, 8)), {"enable_gqa": True}),
        "batch does not broadcast": ((r(2, 4, 16, 8), r(3, 4, 16, 8), r(3, 4, 16, 8)), {}),
        "mask shape does not broadcast": (qkv, {"attn_mask": torch.ones(3, 16, 16, dtype=torch.bool)}),
        "mask dtype neither bool nor query's": (qkv, {"attn_mask": torch.ones(16, 16, dtype=torch.int32)}),
        "float mask of another dtype": (qkv, {"attn_mask": torch.zeros(16, 16, dtype=torch.float64)}),
    }


@pytest.mark.parametrize("case", list(_rejected_by_sdpa()))
def test_inputs_sdpa_rejects_raise_sdpa_s_runtime_error(case):
    """Code written for SDPA catches RuntimeError: the drop-in raises it where SDPA does, before any
    JAX work, and not one of splash's own errors."""
    args, kwargs = _rejected_by_sdpa()[case]
    with pytest.raises(RuntimeError):
        SDPA(*args, **kwargs)
    with pytest.raises(RuntimeError) as raised:
        torch_splash.scaled_dot_product_attention(*args, **kwargs)
    assert not isinstance(raised.value, torch_splash.SplashError), raised.value


def test_attn_mask_with_is_causal_is_sdpa_s_documented_runtime_error():
    """torch documents an error for attn_mask with is_causal=True (its CPU math path computes
    something instead, equal to neither mask)."""
    q, k, v = make_qkv(1, 4, 4, 16, 16, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match="should not be set when is_causal=True"):
        torch_splash.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), is_causal=True
        )


def test_any_batch_layout_sdpa_serves():
    """No batch (L, D), several batch dimensions, and broadcast batches, as SDPA serves them."""
    g = torch.Generator().manual_seed(3)

    def make(*shapes):
        return [torch.randn(s, generator=g).requires_grad_() for s in shapes]

    both(*make((20, 8), (30, 8), (30, 8)), is_causal=True)
    both(*make((20, 8), (30, 8), (30, 8)), attn_mask=torch.rand(20, 30, generator=g) > 0.3)
    both(
        *make((3, 2, 4, 20, 8), (3, 2, 2, 30, 8), (3, 2, 2, 30, 8)),
        enable_gqa=True,
        attn_mask=torch.rand(2, 1, 20, 30, generator=g) > 0.3,
    )
    both(*make((2, 2, 20, 8), (1, 2, 30, 8), (1, 2, 30, 8)), is_causal=True)
    both(*make((2, 20, 8), (3, 2, 30, 8), (3, 2, 30, 8)), is_causal=True)  # unbatched q, batched k and v


class TinyAttentionModel(nn.Module):
    """A model written against F.scaled_dot_product_attention, never edited for splash."""

    def __init__(self, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, length, d = x.shape
        q, k, v = (t.view(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, length, d))


def test_route_sdpa_runs_an_unedited_model_through_splash(monkeypatch):
    calls = []
    original = torch_splash.sdpa.attention
    monkeypatch.setattr(torch_splash.sdpa, "attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    torch.manual_seed(0)
    model = TinyAttentionModel()
    x = torch.randn(2, 96, 64)
    ref = model(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch_splash.route_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error")  # every call is served: no fallback warning
        out = model(x)
        out.sum().backward()
    assert len(calls) == 1  # the model's one attention call ran through splash
    assert F.scaled_dot_product_attention is SDPA  # restored
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for a, b in zip([p.grad for p in model.parameters()], ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_route_sdpa_falls_back_with_one_warning():
    model = TinyAttentionModel(dropout=0.1).train()
    x = torch.randn(2, 32, 64)
    with torch_splash.route_sdpa():
        with pytest.warns(UserWarning, match="falling back to torch SDPA.*dropout") as record:
            model(x)
            model(x)
    assert sum("falling back" in str(w.message) for w in record) == 1


@pytest.mark.parametrize("q_len,kv_len", [(23, 56), (1024, 3072), (2048, 2048)])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_objects_are_served_as_causal_masks(q_len, kv_len, variant):
    """torch's CausalBias has uninitialised storage: read as a mask it is garbage (or, at 2048 x 2048,
    zero pages: no mask at all). Through the drop-in and through route_sdpa it is the causal mask
    it names, matching torch's SDPA, which recognises the object."""
    from torch.nn.attention import bias

    make = getattr(bias, f"causal_{variant}")
    q, k, v = make_qkv(1, 2, 2, q_len, kv_len, 64, 64, torch.float32)
    both(q, k, v, attn_mask=make(q_len, kv_len))
    with torch.no_grad():
        ref = SDPA(q, k, v, attn_mask=make(q_len, kv_len))
        with torch_splash.route_sdpa(), warnings.catch_warnings():
            warnings.simplefilter("error")  # served by splash: no fallback
            routed = F.scaled_dot_product_attention(q, k, v, attn_mask=make(q_len, kv_len))
    torch.testing.assert_close(routed, ref, atol=2e-5, rtol=1e-5)


def test_a_causal_bias_of_other_lengths_and_other_tensor_subclasses_are_refused():
    from torch.nn.attention.bias import causal_upper_left

    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, 64, torch.float32)
    with pytest.raises(SplashConstraintError, match=r"CausalBias for \(Lq, Lkv\) = \(16, 32\)"):
        torch_splash.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(16, 32))

    class Bias(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    subclass = torch.zeros(16, 16).as_subclass(Bias)
    with pytest.raises(SplashConstraintError, match="a tensor subclass that overrides torch functions"):
        torch_splash.scaled_dot_product_attention(q, k, v, attn_mask=subclass)


def test_route_sdpa_falls_back_to_torch_s_own_sdpa_exactly():
    """What splash refuses runs torch's function with route_sdpa out of the way: a float bias,
    dropout (same random stream), and a CausalBias with dropout (torch's CausalBias dispatch,
    which matches SDPA by identity)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = make_qkv(1, 2, 2, 24, 40, 64, 64, torch.float32)
    bias = torch.randn(24, 40)
    cases = [dict(attn_mask=bias), dict(dropout_p=0.3), dict(attn_mask=causal_lower_right(24, 40), dropout_p=0.3)]
    with torch.no_grad():
        for kwargs in cases:
            torch.manual_seed(5)
            ref = SDPA(q, k, v, **kwargs)
            torch.manual_seed(5)
            with torch_splash.route_sdpa(), pytest.warns(UserWarning, match="falling back"):
                routed = F.scaled_dot_product_attention(q, k, v, **kwargs)
            assert torch.isfinite(routed).all()
            torch.testing.assert_close(routed, ref, atol=0, rtol=0)


def test_causal_bias_with_is_causal_is_sdpa_s_value_error():
    """torch's SDPA refuses a CausalBias together with is_causal=True (PyTorch's own
    test_is_causal_and_mask_fails): so does the drop-in, with torch's error."""
    from torch.nn.attention.bias import causal_upper_left

    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, 8, torch.float32)
    for fn in (SDPA, torch_splash.scaled_dot_product_attention):
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            fn(q, k, v, attn_mask=causal_upper_left(16, 16), is_causal=True)


def test_the_drop_in_assigned_over_torch_s_sdpa_works(monkeypatch):
    """Installed the common way, `F.scaled_dot_product_attention = torch_splash.scaled_dot_product_attention`
    (monkeypatch restores torch's function even when the test fails). The drop-in reaches torch's
    own SDPA for its input checks without that name, so calls through the name (a user's model,
    torch's own nn.MultiheadAttention, CausalBias masks) run splash and match torch's SDPA, SDPA's
    rejections keep their types, and route_sdpa still serves calls inside it. The references are
    computed before the assignment: torch's own CausalBias dispatch calls SDPA by that name."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    calls = []
    original = torch_splash.sdpa.attention
    monkeypatch.setattr(torch_splash.sdpa, "attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    torch.manual_seed(0)
    # Shapes shared with the cases below, so that few programs are compiled.
    model, mha = TinyAttentionModel(), nn.MultiheadAttention(64, 4, batch_first=True)
    x, y = torch.randn(2, 24, 64), torch.randn(2, 24, 64)
    causal = torch.ones(24, 24, dtype=torch.bool).triu(1)  # MHA's masks: True hides

    def models():
        return [model(x), mha(y, y, y, attn_mask=causal, need_weights=False)[0]]

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=g) for _ in range(3))
    k_gqa, v_gqa = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    mask = torch.rand(1, 4, 24, 24, generator=g) > 0.4  # one call: the same for every batch element
    mask[..., 0] = True
    cases = [
        ((q, k, v), {}),
        ((q, k, v), {"is_causal": True}),
        ((q, k, v), {"attn_mask": mask}),
        ((q, k, v), {"attn_mask": torch.zeros(24, 24).masked_fill(~mask[0, 0], float("-inf"))}),
        ((q, k, v), {"attn_mask": causal_upper_left(24, 24)}),
        ((q, k_gqa, v_gqa), {"attn_mask": causal_lower_right(24, 40), "enable_gqa": True}),
    ]
    with torch.no_grad():
        refs = models() + [SDPA(*args, **kwargs) for args, kwargs in cases]

    monkeypatch.setattr(F, "scaled_dot_product_attention", torch_splash.scaled_dot_product_attention)
    assert torch.nn.functional.scaled_dot_product_attention is torch_splash.scaled_dot_product_attention
    with torch.no_grad():
        outs = models() + [F.scaled_dot_product_attention(*args, **kwargs) for args, kwargs in cases]
    assert len(calls) == len(outs)  # each went through splash, none recursed
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for case, (args, kwargs) in _rejected_by_sdpa().items():
        with pytest.raises(RuntimeError) as raised:
            F.scaled_dot_product_attention(*args, **kwargs)
        assert not isinstance(raised.value, torch_splash.SplashError), case
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(24, 24), is_causal=True)
    calls.clear()
    with torch_splash.route_sdpa(), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # served, no fallback
        torch.testing.assert_close(model(x), refs[0], atol=2e-5, rtol=1e-5)
    assert len(calls) == 1
