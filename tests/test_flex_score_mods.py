"""torch_splash.flex_attention's score_mods (read from their traced graph), key and value shared
across the batch, and the gradient through the returned logsumexp, against torch's own
flex_attention on the CPU and a float64 reference written from FlexAttention's definition."""

import math

import pytest
import torch
from helpers import TOL, make_qkv
from test_flex import documents
from torch.nn.attention.flex_attention import AuxRequest, _identity, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import torch_splash
from torch_splash import SplashConstraintError, flex

INF = float("inf")
CAP = torch_splash.soft_cap(4.0)
HALF = 0.5
FACTOR = torch.tensor(0.75)


def _causal_where(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -INF)


def _noop(score, b, h, q_idx, kv_idx):
    return score


def _window_fill(score, b, h, q_idx, kv_idx):
    return score.masked_fill(q_idx - kv_idx >= 40, -math.inf) / 2  # a positive factor after the mask


def _scaled(score, b, h, q_idx, kv_idx):
    return score * HALF  # a captured Python number


def _captured_tensor(score, b, h, q_idx, kv_idx):
    return score * FACTOR


def _causal_soft_cap(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, CAP(score * 2.0, b, h, q_idx, kv_idx), -INF)


def _per_head(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx <= q_idx + 16 * h, score, -INF)


# name: (score_mod, mask_mod of the BlockMask or None, B of the BlockMask)
CASES = {
    "torch-identity": (_identity, None, None),
    "user-noop": (_noop, "causal", None),
    "where-mask": (_causal_where, None, None),
    "where-mask-and-block-mask": (_causal_where, "documents", 2),
    "masked-fill-then-divide": (_window_fill, None, None),
    "per-head-mask": (_per_head, None, None),
    "captured-number": (_scaled, "causal", None),
    "captured-tensor": (_captured_tensor, None, None),
    "soft-cap-helper": (CAP, None, None),
    "mask-of-scaled-soft-cap": (_causal_soft_cap, "documents", 2),
}
# The default run (each case costs its programs' compilation, seconds): the rest is `-m slow`.
COMPILED = ["mask-of-scaled-soft-cap"]
EAGER = ["torch-identity", "where-mask", "captured-tensor", "mask-of-scaled-soft-cap"]
SHAPE = dict(batch=2, hq=4, hkv=2, length=160, dim=16)


def _block_mask(case, length=SHAPE["length"]):
    _, mask, batch = case
    if mask is None:
        return None
    mask_mod = documents([[60, 100], [25, 135]], length) if mask == "documents" else (lambda b, h, q, kv: q >= kv)
    return create_block_mask(mask_mod, batch, None, length, length, device="cpu")


def reference(q, k, v, score_mod=None, block_mask=None):
    """Output and logsumexp by FlexAttention's definition: the score_mod at every (b, h, q_idx,
    kv_idx) of the scaled scores (broadcast index tensors), the BlockMask's mask_mod likewise."""
    batch, heads, q_len, dim = q.shape
    group = heads // k.shape[1]
    k, v = (
        k.repeat_interleave(group, 1).expand(batch, -1, -1, -1),
        v.repeat_interleave(group, 1).expand(batch, -1, -1, -1),
    )
    scores = (q @ k.transpose(-1, -2)) * dim**-0.5
    b, h, qi, ki = torch.meshgrid(
        torch.arange(batch), torch.arange(heads), torch.arange(q_len), torch.arange(k.shape[2]), indexing="ij"
    )
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    if block_mask is not None:
        allowed = block_mask.mask_mod(b if block_mask.kv_num_blocks.shape[0] > 1 else b * 0, h, qi, ki)
        scores = scores.masked_fill(~allowed, -INF)
    lse = torch.logsumexp(scores, -1)
    return (scores - lse[..., None]).exp().nan_to_num(0.0) @ v, lse


def _inputs(dtype=torch.float32, kv_batch=None):
    s = SHAPE
    q, k, v = make_qkv(s["batch"], s["hq"], s["hkv"], s["length"], s["length"], s["dim"], s["dim"], dtype)
    if kv_batch == 1:
        k, v = (t.detach()[:1].clone().requires_grad_() for t in (k, v))
    return q, k, v


def _loss_weights(q):
    g = torch.Generator().manual_seed(1)
    out_shape, lse_shape = q.shape, q.shape[:-1]
    return torch.randn(out_shape, generator=g), torch.randn(lse_shape, generator=g)


def _run(attend, q, k, v, score_mod, block_mask, with_lse=True):
    """Output, logsumexp and the gradients of a loss using both (the lse's term only if with_lse)."""
    out, aux = attend(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    d_out, d_lse = _loss_weights(q)
    loss = (out.float() * d_out).sum() + ((aux.lse.float() * d_lse).nan_to_num(0.0).sum() if with_lse else 0)
    return out.detach(), aux.lse.detach(), torch.autograd.grad(loss, (q, k, v))


def _exact(q, k, v, score_mod, block_mask, with_lse=True):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference(q, k, v, score_mod, block_mask)
    d_out, d_lse = _loss_weights(q)
    loss = (out * d_out.double()).sum() + ((lse * d_lse.double()).nan_to_num(0.0).sum() if with_lse else 0)
    return out.detach(), lse.detach(), torch.autograd.grad(loss, (q, k, v))


def _assert_close(got, exact, dtype=torch.float32):
    (oa, orr), (ga, gr) = TOL[dtype]["out"], TOL[dtype]["grad"]
    torch.testing.assert_close(got[0].float(), exact[0].float(), atol=oa, rtol=orr)
    torch.testing.assert_close(got[1].float(), exact[1].float(), atol=oa, rtol=orr)
    for name, mine, ref in zip("qkv", got[2], exact[2]):
        torch.testing.assert_close(mine.float(), ref.float(), atol=ga, rtol=gr, msg=lambda m, n=name: f"d{n}: {m}")


def _torch_forward(q, k, v, score_mod, block_mask):
    with torch.no_grad():
        out, aux = torch_flex(
            *(t.detach() for t in (q, k, v)),
            score_mod=score_mod,
            block_mask=block_mask,
            enable_gqa=True,
            return_aux=AuxRequest(lse=True),
        )
    return out, aux.lse


def _compiled():
    torch._dynamo.reset()
    return torch.compile(torch_splash.flex_attention, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize(
    "name, compiled",
    [(n, False) for n in EAGER]
    + [pytest.param(n, False, marks=pytest.mark.slow) for n in CASES if n not in EAGER]
    + [(n, True) for n in COMPILED]
    + [pytest.param(n, True, marks=pytest.mark.slow) for n in CASES if n not in COMPILED and n != "captured-tensor"],
)
def test_score_mods_match_torch_s_flex_attention(name, compiled):
    """float32: output and logsumexp against torch's flex_attention and the float64 reference;
    the gradients of a loss of both (through the logsumexp too) against the reference."""
    case = CASES[name]
    q, k, v = _inputs()
    block_mask = _block_mask(case)
    got = _run(_compiled() if compiled else torch_splash.flex_attention, q, k, v, case[0], block_mask)
    _assert_close(got, _exact(q, k, v, case[0], block_mask))
    theirs = _torch_forward(q, k, v, case[0], block_mask)
    (oa, orr) = TOL[torch.float32]["out"]
    torch.testing.assert_close(got[0], theirs[0], atol=oa, rtol=orr)
    torch.testing.assert_close(got[1], theirs[1], atol=oa, rtol=orr)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "fullgraph"])
def test_bf16_score_mods_are_as_close_to_float64_as_torch_s_own(compiled):
    """bfloat16: splash's and torch's flex_attention against the float64 reference; splash's
    output error at most twice torch's (or within attention's bf16 tolerance), gradients within
    attention's bf16 tolerance."""
    case = CASES["mask-of-scaled-soft-cap"]
    q, k, v = _inputs(torch.bfloat16)
    block_mask = _block_mask(case)
    got = _run(_compiled() if compiled else torch_splash.flex_attention, q, k, v, case[0], block_mask)
    exact = _exact(q, k, v, case[0], block_mask)
    theirs = _torch_forward(q, k, v, case[0], block_mask)
    (oa, _), (ga, gr) = TOL[torch.bfloat16]["out"], TOL[torch.bfloat16]["grad"]
    mine_err = (got[0].double() - exact[0]).abs().max().item()
    their_err = (theirs[0].double() - exact[0]).abs().max().item()
    assert mine_err <= max(2 * their_err, oa), (mine_err, their_err)
    torch.testing.assert_close(got[1].double(), exact[1], atol=oa, rtol=oa)
    for mine, ref in zip(got[2], exact[2]):
        torch.testing.assert_close(mine.double(), ref, atol=ga, rtol=gr)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "fullgraph"])
def test_key_and_value_of_batch_one_serve_every_batch_element_uncopied(compiled, monkeypatch):
    """k, v (1, Hkv, L, E) under q (2, Hq, L, E), with a mask that differs across the batch: as
    torch broadcasts them; the kernels get the very k and v (one call, no copy), and dk, dv sum
    over the batch."""
    case = CASES["where-mask-and-block-mask"]
    q, k, v = _inputs(kv_batch=1)
    block_mask = _block_mask(case)
    given, attend = [], flex.attention
    monkeypatch.setattr(
        flex, "attention", lambda q_, k_, v_, *a, **kw: given.append((k_, v_)) or attend(q_, k_, v_, *a, **kw)
    )
    got = _run(_compiled() if compiled else torch_splash.flex_attention, q, k, v, case[0], block_mask)
    _assert_close(got, _exact(q, k, v, case[0], block_mask))
    theirs = _torch_forward(q, k, v, case[0], block_mask)
    torch.testing.assert_close(got[0], theirs[0], atol=2e-5, rtol=1e-5)
    if not compiled:  # under compile the kernels run inside the graph's op, on its own tensors
        assert len(given) == 1 and given[0][0] is k and given[0][1] is v


def test_key_and_value_batch_must_be_query_s_or_one():
    q, k, v = (t.detach() for t in make_qkv(3, 2, 2, 64, 64, 16, 16, torch.float32))
    with pytest.raises(SplashConstraintError, match="batch sizes 3, 2, 2"):
        torch_splash.flex_attention(q, k[:2], v[:2])


def test_a_gradient_through_the_logsumexp_alone_with_empty_rows():
    """A loss of the logsumexp only (d_out = 0) over a mask with rows that see no key: the
    gradient is P * g, zero on those rows, as the float64 reference's."""
    q, k, v = make_qkv(1, 2, 2, 130, 130, 16, 16, torch.float32)
    block_mask = create_block_mask(lambda b, h, qi, ki: (ki < qi) & (qi > 20), None, None, 130, 130, device="cpu")
    _, lse = torch_splash.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    grads = torch.autograd.grad(lse.nan_to_num(0.0, neginf=0.0).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, want = reference(q64, k64, v64, None, block_mask)
    exact = torch.autograd.grad(want.nan_to_num(0.0, neginf=0.0).sum(), (q64, k64, v64), allow_unused=True)
    assert torch.isneginf(lse[..., :21]).all()
    (ga, gr) = TOL[torch.float32]["grad"]
    for mine, ref in zip(grads, exact):
        torch.testing.assert_close(mine, torch.zeros_like(mine) if ref is None else ref.float(), atol=ga, rtol=gr)


def _bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def _cap_after_mask(score, b, h, q_idx, kv_idx):
    return CAP(torch.where(q_idx >= kv_idx, score, -INF), b, h, q_idx, kv_idx)


def _negative_after_mask(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -INF) * -1.0


def _squared(score, b, h, q_idx, kv_idx):
    return score * score


def _index_factor(score, b, h, q_idx, kv_idx):
    return score * (h + 1)


REFUSED = {
    "a bias": (_bias, "_bias.*aten.add"),
    "a soft cap after the mask": (_cap_after_mask, "_cap_after_mask.*tanh.*after the mask"),
    "a negative factor after the mask": (_negative_after_mask, "-1.0 after the mask"),
    "the score squared": (_squared, "by itself"),
    "a factor of the indices": (_index_factor, "a tensor of \\(b, h, q_idx, kv_idx\\)"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_score_mods_splash_cannot_serve_are_refused_naming_the_operation(name, monkeypatch):
    score_mod, words = REFUSED[name]
    monkeypatch.setattr(flex, "attention", None)  # any kernel work would fail otherwise
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32))
    with pytest.raises(SplashConstraintError, match=words):
        torch_splash.flex_attention(q, k, v, score_mod=score_mod)


def test_under_fullgraph_a_captured_tensor_factor_is_refused_saying_why():
    """Folded into the scale, a constant of the graph, the tensor's next value would go unseen."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="fullgraph=True.*captured tensor.*scale=") as raised:
        _compiled()(q, k, v, score_mod=_captured_tensor)
    assert "Observed exception" not in str(raised.value)


def test_under_fullgraph_a_refusal_is_dynamo_s_error_saying_why_first():
    """A score_mod splash has no kernel for: under fullgraph, Dynamo's Unsupported error explains
    with splash's refusal (not "Observed exception"); without fullgraph, the SplashError itself."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32))
    with pytest.raises(Exception, match="cannot serve this call: score_mod '_bias'.*aten.add") as raised:
        _compiled()(q, k, v, score_mod=_bias)
    assert "Observed exception" not in str(raised.value)
    torch._dynamo.reset()
    with pytest.raises(SplashConstraintError, match="_bias.*aten.add"):
        torch.compile(torch_splash.flex_attention, backend="aot_eager")(q, k, v, score_mod=_bias)


def test_without_fullgraph_a_captured_tensor_factor_is_served_eagerly():
    """As torch's eager flex_attention (f32), at the tensor's value of each call."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32))
    torch._dynamo.reset()
    compiled = torch.compile(torch_splash.flex_attention, backend="aot_eager")
    (oa, orr) = TOL[torch.float32]["out"]
    for factor in (0.75, 2.0):
        FACTOR.fill_(factor)
        want = torch_flex(q, k, v, score_mod=_captured_tensor)
        torch.testing.assert_close(compiled(q, k, v, score_mod=_captured_tensor), want, atol=oa, rtol=orr)
    FACTOR.fill_(0.75)


class _ScaledByBuffer(torch.nn.Module):
    """A layer whose score_mod is a closure over its buffer, made in forward: inside the compiled
    code, where Dynamo holds it as a value of the trace, not as a function splash can read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.tensor(0.75))

    def forward(self, q, k, v):
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score * self.factor, -INF)

        return torch_splash.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True, return_lse=True)


def test_under_compile_a_score_mod_made_in_the_compiled_code_runs_eagerly():
    """Without fullgraph the call runs eagerly (the closure exists there): output, logsumexp and
    gradients as torch's eager flex_attention's (f32), the buffer's value read at each call."""
    layer = _ScaledByBuffer()
    q, k, v = _inputs()

    def theirs(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score * layer.factor, -INF)

    wanted = {}
    for factor in (0.75, 1.5):  # torch's answers first: its eager calls compile graphs of their own
        layer.factor.fill_(factor)
        try:
            out, lse = torch_flex(q, k, v, score_mod=theirs, enable_gqa=True, return_lse=True)
        except NotImplementedError as error:  # torch 2.15's flex_attention: no CPU backward
            pytest.skip(f"torch's flex_attention cannot be the reference here: {error}")
        wanted[factor] = (out, lse, torch.autograd.grad(out.sum() + lse.sum(), (q, k, v)))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    (oa, orr), (ga, gr) = TOL[torch.float32]["out"], TOL[torch.float32]["grad"]
    for factor, (want_out, want_lse, want) in wanted.items():  # a new value of the buffer is seen
        layer.factor.fill_(factor)
        out, lse = compiled(q, k, v)
        grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
        torch.testing.assert_close(out, want_out, atol=oa, rtol=orr)
        torch.testing.assert_close(lse, want_lse, atol=oa, rtol=orr)
        for mine, ref in zip(grads, want):
            torch.testing.assert_close(mine, ref, atol=ga, rtol=gr)


def test_under_fullgraph_a_score_mod_made_in_the_compiled_code_is_refused_saying_why():
    q, k, v = (t.detach() for t in _inputs())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="score_mod made inside the compiled code") as raised:
        torch.compile(_ScaledByBuffer(), fullgraph=True, backend="aot_eager")(q, k, v)
    assert "define the score_mod outside the compiled code" in str(raised.value).lower()


def test_the_logsumexp_s_gradient_on_torch_xla_s_graph_transport(xla_device, monkeypatch):
    """The kernels inside torch_xla's lazy graph: outputs and the gradients of a loss of the output
    and the logsumexp against the float64 reference."""
    monkeypatch.setenv("TORCH_SPLASH_TRANSPORT", "graph")
    case = (_causal_soft_cap, None, None)  # one call for the batch: the cheapest lazy graph
    q, k, v = _inputs()
    block_mask = _block_mask(case)
    on_device = [t.detach().to(xla_device).requires_grad_() for t in (q, k, v)]
    out, lse, grads = _run(torch_splash.flex_attention, *on_device, case[0], block_mask)
    got = (out.cpu(), lse.cpu(), [g.cpu() for g in grads])
    _assert_close(got, _exact(q, k, v, case[0], block_mask))
