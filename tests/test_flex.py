"""torch_splash.flex_attention against torch's own flex_attention on the CPU: outputs, logsumexp
and gradients, for the masks FlexAttention code uses, and what it refuses."""

import functools
import math
import sys
import types

import numpy as np
import pytest
import torch
from helpers import TOL, flex_reference, make_qkv
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    and_masks,
    create_block_mask,
    or_masks,
)
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import torch_splash
from torch_splash import SplashConstraintError, SplashDtypeError
from torch_splash._flex_masks import block_mask_masks
from torch_splash_jax import BlockSparseMask, MultiHeadMask
from torch_splash_jax import tables as jax_tables


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(width):
    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < width

    return and_masks(causal, window)


def prefix_lm(prefix):
    return or_masks(causal, lambda b, h, q_idx, kv_idx: kv_idx < prefix)


def documents(lengths_per_batch, length):
    """Document ids (B, L) from each batch element's document lengths, as packed sequences have."""
    doc = torch.stack(
        [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls))[:length] for ls in lengths_per_batch]
    )

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return and_masks(causal, same_document)


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 32 * (h + 1))


# name: (mask_mod, B of the BlockMask, H of the BlockMask, (Hq, Hkv), Lq, Lkv, score_mod)
CASES = {
    "causal": (causal, None, None, (4, 4), 300, 300, None),
    "sliding-window": (sliding_window(48), None, None, (4, 4), 300, 300, None),
    "prefix-lm": (prefix_lm(70), None, None, (4, 4), 257, 257, None),
    "documents-per-batch": (documents([[100, 60, 140], [37, 263]], 300), 2, None, (4, 2), 300, 300, None),
    "per-head": (per_head_window, None, 4, (4, 4), 300, 300, None),
    "gqa-soft-cap": (causal, None, None, (8, 2), 200, 200, torch_splash.soft_cap(5.0)),
    "cross-lq-ne-lkv": (lambda b, h, q, kv: kv <= q + 90, None, None, (4, 2), 150, 240, None),
    "no-block-mask": (None, None, None, (2, 2), 130, 130, None),
}


def _block_mask(case):
    mask_mod, b, h, _, q_len, kv_len, _ = case
    return None if mask_mod is None else create_block_mask(mask_mod, b, h, q_len, kv_len, device="cpu")


def _splash(q, k, v, block_mask, score_mod, d_out, flex=torch_splash.flex_attention):
    out, aux = flex(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    return out.detach(), aux.lse.detach(), torch.autograd.grad(out, (q, k, v), d_out)


def _reference(q, k, v, block_mask, score_mod, d_out):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = flex_reference(q, k, v, block_mask, score_mod)
    return out.detach(), lse.detach(), torch.autograd.grad(out, (q, k, v), d_out.double())


def _torch_forward(q, k, v, block_mask, score_mod):
    """torch's own flex_attention: output and logsumexp (its forward runs on the CPU in every set)."""
    q, k, v = (t.detach() for t in (q, k, v))  # torch 2.15 refuses inputs that require grad on the CPU
    with torch.no_grad():
        out, aux = torch_flex(
            q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
    return out, aux.lse


def _assert_close_to_exact(got, exact, lse=True):
    """(out, lse, grads) against the float64 reference's, within the float32 tolerances attention's
    tests use (the logsumexp as exact as the output)."""
    (oa, orr), (ga, gr) = TOL[torch.float32]["out"], TOL[torch.float32]["grad"]
    torch.testing.assert_close(got[0], exact[0].float(), atol=oa, rtol=orr)
    if lse:
        torch.testing.assert_close(got[1], exact[1].float(), atol=oa, rtol=orr)
    for name, mine, ref in zip("qkv", got[2], exact[2]):
        torch.testing.assert_close(mine, ref.float(), atol=ga, rtol=gr, msg=lambda m, n=name: f"d{n}: {m}")


def _compiled_flex(backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(torch_splash.flex_attention, fullgraph=True, backend=backend)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fullgraph"])
@pytest.mark.parametrize("name", CASES)
def test_outputs_logsumexp_and_gradients_match_torch_flex_attention(name, compiled):
    """float32: output and logsumexp against torch's flex_attention and a float64 reference;
    gradients against the reference. fullgraph: under torch.compile(fullgraph=True), where the
    BlockMask is converted inside the graph (Dynamo traces its mask_mod)."""
    case = CASES[name]
    (hq, hkv), q_len, kv_len = case[3], case[4], case[5]
    q, k, v = make_qkv(2, hq, hkv, q_len, kv_len, 32, 32, torch.float32)
    block_mask, d_out = _block_mask(case), torch.randn(2, hq, q_len, 32)
    got = _splash(q, k, v, block_mask, case[6], d_out, **(dict(flex=_compiled_flex()) if compiled else {}))
    _assert_close_to_exact(got, _reference(q, k, v, block_mask, case[6], d_out))
    theirs = _torch_forward(q, k, v, block_mask, case[6])
    (oa, orr) = TOL[torch.float32]["out"]
    torch.testing.assert_close(got[0], theirs[0], atol=oa, rtol=orr)
    torch.testing.assert_close(got[1], theirs[1], atol=oa, rtol=orr)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] is not None])
def test_the_graph_s_conversion_gives_the_masks_the_eager_one_gives(name):
    """The compiled path's conversion (tensors in the graph, masks where its op runs) and the eager
    one give equal masks, per batch element and head."""
    from torch_splash import _flex_ops

    case = CASES[name]
    (hq, _), q_len, kv_len = case[3], case[4], case[5]
    block_mask = _block_mask(case)
    table, where, blocks, assign, _ = _flex_ops.graph_tables(block_mask, 2, hq)
    in_graph = _flex_ops.graph_masks(table, where, blocks, assign, (q_len, kv_len), tuple(block_mask.BLOCK_SIZE))
    assert in_graph == block_mask_masks(block_mask, 2, hq, q_len, kv_len)


def test_torch_compile_fullgraph_with_inductor():
    case = CASES["documents-per-batch"]
    q, k, v = make_qkv(2, 4, 2, 300, 300, 32, 32, torch.float32)
    block_mask, d_out = _block_mask(case), torch.randn(2, 4, 300, 32)
    got = _splash(q, k, v, block_mask, None, d_out, flex=_compiled_flex("inductor"))
    exact = _reference(q, k, v, block_mask, None, d_out)
    _assert_close_to_exact(got, exact)


def test_under_torch_compile_documents_packed_anew_reuse_the_graph():
    """New packings are new data for one compiled graph: Dynamo compiles once, and each step's
    outputs and gradients are its own mask's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    flex = torch.compile(torch_splash.flex_attention, fullgraph=True, backend=counter)
    q, k, v = make_qkv(2, 4, 2, 300, 300, 32, 32, torch.float32)
    d_out = torch.randn(2, 4, 300, 32)
    for lengths in ([[100, 60, 140], [37, 263]], [[300], [150, 150]], [[10, 290], [299, 1]]):
        block_mask = create_block_mask(documents(lengths, 300), 2, None, 300, 300, device="cpu")
        got = _splash(q, k, v, block_mask, None, d_out, flex=flex)
        _assert_close_to_exact(got, _reference(q, k, v, block_mask, None, d_out))
    assert counter.frame_count == 1


def test_under_torch_compile_each_sequence_length_compiles_its_own_graph():
    """Automatic dynamic shapes make the sizes symbolic from the second length on: they are
    specialised, so each length compiles its own graph, with its own BlockMask's outputs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    flex = torch.compile(torch_splash.flex_attention, fullgraph=True, backend=counter)
    for length in (200, 260, 330):
        q, k, v = make_qkv(1, 2, 2, length, length, 32, 32, torch.float32)
        block_mask = create_block_mask(sliding_window(48), None, None, length, length, device="cpu")
        d_out = torch.randn(1, 2, length, 32)
        got = _splash(q, k, v, block_mask, None, d_out, flex=flex)
        _assert_close_to_exact(got, _reference(q, k, v, block_mask, None, d_out))
    assert counter.frame_count == 3


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_under_torch_compile_the_layers_passing_one_block_mask_build_its_masks_once(backend, monkeypatch):
    """Every layer passing one BlockMask, and the backward, gives the ops equal tensors: the masks
    are built once a step, and a new packing builds anew. Two layers' outputs and gradients against
    the float64 reference."""
    from torch_splash import _flex_ops

    built, build = [], _flex_ops._built_masks
    monkeypatch.setattr(_flex_ops, "_built_masks", lambda *args: built.append(1) or build(*args))
    monkeypatch.setattr(_flex_ops, "_GRAPH_MASKS", _flex_ops.policy.Recent(_flex_ops.policy.FLEX_MASKS))

    def two_layers(attend, q, k, v, block_mask):
        return attend(attend(q, k, v, block_mask=block_mask), k, v, block_mask=block_mask)

    torch._dynamo.reset()
    compiled = torch.compile(
        functools.partial(two_layers, torch_splash.flex_attention), fullgraph=True, backend=backend
    )
    q, k, v = make_qkv(1, 2, 2, 300, 300, 32, 32, torch.float32)
    for lengths in ([[100, 60, 140]], [[37, 263]]):
        block_mask = create_block_mask(documents(lengths, 300), 1, None, 300, 300, device="cpu")
        built.clear()
        out = compiled(q, k, v, block_mask)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert len(built) == 1
        exact_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        exact = two_layers(lambda *a, block_mask: flex_reference(*a, block_mask)[0], *exact_inputs, block_mask)
        exact_grads = torch.autograd.grad(exact.sum(), exact_inputs)
        _assert_close_to_exact((out, None, grads), (exact, None, exact_grads), lse=False)


def test_under_torch_compile_another_block_size_scale_or_cap_is_another_graph():
    """A BlockMask of another BLOCK_SIZE over the same lengths (tables of the same shapes), and
    another scale or soft cap: Dynamo makes the changed numbers symbolic, and they are specialised,
    so each gives its own graph and its own result, never a stale one."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 250, 250, 32, 32, torch.float32))
    flex = _compiled_flex()
    for block_size, scale, cap in (
        (128, 0.1, 2.0),
        (200, 0.1, 2.0),
        (200, 0.2, 2.0),
        (200, 0.2, 3.0),
        (128, 0.1, None),
    ):
        block_mask = create_block_mask(sliding_window(30), None, None, 250, 250, device="cpu", BLOCK_SIZE=block_size)
        score_mod = None if cap is None else torch_splash.soft_cap(cap)
        got = flex(q, k, v, block_mask=block_mask, scale=scale, score_mod=score_mod)
        want = torch_splash.flex_attention(q, k, v, block_mask=block_mask, scale=scale, score_mod=score_mod)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_under_fullgraph_a_refused_call_stops_the_trace_naming_the_error():
    """Dynamo reports a SplashError raised while it traces as `Unsupported` with the error's
    message (without fullgraph the call runs eagerly and raises the SplashError itself)."""
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 130, 130, 32, 32, torch.float32))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="SplashConstraintError.*enable_gqa"):
        _compiled_flex()(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(SplashConstraintError, match="enable_gqa"):
        torch.compile(torch_splash.flex_attention, backend="aot_eager")(q, k, v)


@pytest.mark.parametrize("block_size", [64, (128, 256), 200], ids=["64", "128x256", "200"])
def test_any_block_size_of_the_block_mask(block_size):
    """torch's BLOCK_SIZE need not be the kernel's: a random per-(b, h) mask (a captured tensor
    read at b, h, q_idx, kv_idx) over lengths that no block size divides."""
    allowed = torch.rand(2, 2, 230, 270, generator=torch.Generator().manual_seed(3)) < 0.3

    def random_mask(b, h, q_idx, kv_idx):
        return allowed[b, h, q_idx, kv_idx]

    block_mask = create_block_mask(random_mask, 2, 2, 230, 270, device="cpu", BLOCK_SIZE=block_size)
    q, k, v = make_qkv(2, 2, 2, 230, 270, 32, 32, torch.float32)
    d_out = torch.randn(2, 2, 230, 32)
    got = _splash(q, k, v, block_mask, None, d_out)
    exact = _reference(q, k, v, block_mask, None, d_out)
    _assert_close_to_exact(got, exact)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fullgraph"])
def test_bf16_is_as_close_to_a_float64_reference_as_torch_s_own(compiled):
    """bf16: splash's output and logsumexp, and torch's flex_attention's, against the float64
    reference on the same (bf16-rounded) inputs: splash's error at most twice torch's, or within
    bf16's tolerance; splash's gradients within bf16's tolerance of the reference's. fullgraph:
    splash under torch.compile(fullgraph=True)."""
    mask_mod = documents([[100, 60, 140], [37, 263]], 300)
    block_mask = create_block_mask(mask_mod, 2, None, 300, 300, device="cpu")
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, 64, torch.bfloat16)
    d_out = torch.randn(2, 4, 300, 64).to(torch.bfloat16)
    exact = _reference(q, k, v, block_mask, None, d_out)
    ours = _splash(q, k, v, block_mask, None, d_out, **(dict(flex=_compiled_flex()) if compiled else {}))
    theirs = _torch_forward(q, k, v, block_mask, None)
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.float32

    def error(got, want):
        return (got.double() - want).abs().max().item()

    for i, what in enumerate(["out", "lse"]):
        mine, torch_s = error(ours[i], exact[i]), error(theirs[i], exact[i])
        assert mine <= max(2 * torch_s, TOL[torch.bfloat16]["out"][0]), (what, mine, torch_s)
    for name_, mine, ref in zip("qkv", ours[2], exact[2]):
        torch.testing.assert_close(mine.double(), ref, atol=TOL[torch.bfloat16]["grad"][0], rtol=0.05, msg=name_)


def test_a_mask_that_differs_across_the_batch_runs_each_element_with_its_own_tables():
    block_mask = create_block_mask(documents([[100, 60, 140], [37, 263]], 300), 2, None, 300, 300, device="cpu")
    first, second = block_mask_masks(block_mask, 2, 4, 300, 300)
    assert isinstance(first, BlockSparseMask) and first != second  # one mask for all heads of each element
    per_head = block_mask_masks(create_block_mask(per_head_window, None, 4, 300, 300, device="cpu"), 2, 4, 300, 300)
    assert per_head[0] is per_head[1] and isinstance(per_head[0], MultiHeadMask)


def test_layers_that_share_a_block_mask_convert_it_once_yet_see_every_change(monkeypatch):
    """A model's layers pass one BlockMask: its masks are kept while its tables, the tensors its
    mask_mod reads and the numbers it captured are unchanged, and converted again after an in-place
    change, a new tensor or a new number."""
    from torch_splash import _flex_masks

    doc, reach = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 60, 140]))[None], 1000

    def same_document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx - kv_idx < reach)

    block_mask = create_block_mask(and_masks(causal, same_document), 1, None, 300, 300, device="cpu")
    converted, convert = [], _flex_masks._convert
    monkeypatch.setattr(_flex_masks, "_convert", lambda *args: converted.append(args) or convert(*args))
    first = block_mask_masks(block_mask, 1, 2, 300, 300)
    assert block_mask_masks(block_mask, 1, 2, 300, 300) is first and len(converted) == 1
    assert block_mask_masks(block_mask, 1, 4, 300, 300) is not first and len(converted) == 2  # another call shape
    doc[0, 150:] = 5  # in place: the documents now split at 150, not 160
    moved = block_mask_masks(block_mask, 1, 2, 300, 300)
    assert len(converted) == 3 and moved[0] != first[0]
    _flex_masks._CONVERTED.clear()
    assert block_mask_masks(block_mask, 1, 2, 300, 300)[0] == moved[0]  # what a first conversion gives
    doc = torch.zeros_like(doc)  # the mask_mod now reads another tensor: one document
    one = block_mask_masks(block_mask, 1, 2, 300, 300)
    assert len(converted) == 5 and one[0] != moved[0]
    reach = 20  # and another number: a window inside the one document
    window = block_mask_masks(block_mask, 1, 2, 300, 300)
    assert len(converted) == 6 and window[0] != one[0]
    assert block_mask_masks(block_mask, 1, 2, 300, 300) is window and len(converted) == 6


def test_skipped_blocks_are_never_computed_and_nothing_l_by_l_is_built():
    """A document-causal mask at 4096 tokens: the forward kernel's tables visit exactly the kernel
    blocks that hold an allowed pair, and the mask stores only the elements of torch's 128 x 128
    blocks that are neither empty nor full, under 1/8 of an (Lq, Lkv) array here."""
    length, block = 4096, 512
    lengths = [700, 1500, 300, 1596]
    mask = block_mask_masks(
        create_block_mask(documents([lengths], length), 1, None, length, length, device="cpu"), 1, 2, length, length
    )[0]
    doc = np.repeat(np.arange(len(lengths)), lengths)
    allowed = np.tril(doc[:, None] == doc[None, :])
    per_128 = allowed.reshape(length // 128, 128, length // 128, 128)
    mixed = per_128.any(axis=(1, 3)) & ~per_128.all(axis=(1, 3))
    assert mask.partial_blocks.shape[0] == mixed.sum()
    assert mask.kinds.size + mask.partial_index.size + mask.partial_blocks.size < length * length / 8
    info = jax_tables.partial_mask_info(
        (mask,), np.arange(length)[None], length, length, length, (block, block), is_dkv=False, shrink_grid=False
    )
    visited = allowed.reshape(length // block, block, length // block, block).any(axis=(1, 3))
    np.testing.assert_array_equal(info.block_mask[0, 0] > 0, visited)
    assert visited.sum() < visited.size / 2


def test_documents_packed_anew_run_the_program_already_compiled():
    """A training loop packs other documents into each batch. A BlockMask with new contents whose
    tables round to the same shapes (`tables.bucket`) runs the jitted functions of the first:
    JAX traces nothing again (torch_xla then sees the same computation), and the outputs and
    gradients are the new mask's, as torch's flex_attention gives them."""
    import torch_splash_jax

    length = 2048
    q, k, v = make_qkv(1, 4, 2, length, length, 64, 64, torch.float32)
    d_out = torch.randn(1, 4, length, 64, generator=torch.Generator().manual_seed(1))
    traces = []
    for lengths in ([700, 1000, 348], [300, 1100, 648]):
        block_mask = create_block_mask(documents([lengths], length), 1, None, length, length, device="cpu")
        before = sum(torch_splash_jax.splash_program.TRACES.values())
        got = _splash(q, k, v, block_mask, None, d_out)
        traces.append(sum(torch_splash_jax.splash_program.TRACES.values()) - before)
        _assert_close_to_exact(got, _reference(q, k, v, block_mask, None, d_out))
        (oa, orr) = TOL[torch.float32]["out"]
        torch.testing.assert_close(got[0], _torch_forward(q, k, v, block_mask, None)[0], atol=oa, rtol=orr)
    assert traces[1] == 0, traces


def test_a_block_sparse_mask_must_name_a_stored_block_for_each_partial_one():
    kinds = np.array([[1, 0], [2, 1]], np.int8)
    blocks = np.ones((1, 128, 128), bool)
    with pytest.raises(SplashConstraintError, match="partial_index"):
        BlockSparseMask(kinds, np.array([[0, -1], [-1, -1]], np.int32), blocks, (256, 200), (128, 128))
    mask = BlockSparseMask(kinds, np.array([[0, -1], [-1, 0]], np.int32), blocks, (256, 200), (128, 128))
    assert mask.dense(256, 200).sum() == 128 * 128 + 128 * 128 + 128 * 72


def test_the_logsumexp_is_minus_infinity_and_the_output_zero_on_rows_that_see_no_key():
    q, k, v = make_qkv(1, 2, 2, 200, 200, 32, 32, torch.float32)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < q_idx - 150, None, None, 200, 200, device="cpu")
    out, aux = torch_splash.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    want, want_lse = _torch_forward(q, k, v, block_mask, None)
    assert torch.isneginf(aux.lse[..., :151]).all() and (out[..., :151, :] == 0).all()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(aux.lse, want_lse)


def test_the_soft_cap_helper_is_a_score_mod_for_torch_too():
    cap = torch_splash.soft_cap(2.0)
    scores = torch.tensor([-100.0, 0.5, 100.0])
    torch.testing.assert_close(cap(scores, 0, 0, 0, 0), 2.0 * torch.tanh(scores / 2.0))
    assert math.isclose(cap.cap, 2.0)


def test_options_that_tune_torch_s_own_kernels_are_accepted_and_change_nothing():
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 130, 130, 32, 32, torch.float32))
    tuned = torch_splash.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64, "fwd_num_warps": 4, "USE_TMA": True})
    torch.testing.assert_close(tuned, torch_splash.flex_attention(q, k, v), atol=0, rtol=0)


def _refusals():
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 130, 130, 32, 32, torch.float32))
    other_length = create_block_mask(causal, None, None, 256, 256, device="cpu")
    return {
        "another score_mod": (
            SplashConstraintError,
            "relative_bias",
            lambda: torch_splash.flex_attention(q, k, v, score_mod=_relative_bias, enable_gqa=True),
        ),
        "a BlockMask for other lengths": (
            SplashConstraintError,
            "256",
            lambda: torch_splash.flex_attention(q, k, v, block_mask=other_length, enable_gqa=True),
        ),
        "GQA without enable_gqa": (SplashConstraintError, "enable_gqa", lambda: torch_splash.flex_attention(q, k, v)),
        "an unknown kernel option": (
            SplashConstraintError,
            "FORCE_USE_FLEX_ATTENTION",
            lambda: torch_splash.flex_attention(
                q, k, v, enable_gqa=True, kernel_options={"FORCE_USE_FLEX_ATTENTION": 1}
            ),
        ),
        "max_scores": (
            SplashConstraintError,
            "max_scores",
            lambda: torch_splash.flex_attention(q, k, v, enable_gqa=True, return_aux=AuxRequest(max_scores=True)),
        ),
        "a mask that is not a BlockMask": (
            SplashDtypeError,
            "BlockMask",
            lambda: torch_splash.flex_attention(q, k, v, block_mask=causal, enable_gqa=True),
        ),
        "a mask_mod returning ints": (
            SplashDtypeError,
            "bool",
            lambda: torch_splash.flex_attention(
                q,
                k,
                v,
                enable_gqa=True,
                block_mask=BlockMask.from_kv_blocks(
                    torch.ones(1, 1, 2, dtype=torch.int32),
                    torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32),
                    mask_mod=_int_mask,
                    seq_lengths=(130, 130),
                ),
            ),
        ),
        "a non-positive cap": (SplashConstraintError, "positive", lambda: torch_splash.soft_cap(0.0)),
    }


def _relative_bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def _int_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx).int()


@pytest.mark.parametrize("case", list(_refusals()))
def test_what_splash_cannot_serve_is_refused_by_name_before_any_kernel_work(case, monkeypatch):
    error, words, call = _refusals()[case]
    monkeypatch.setattr(torch_splash.api._ops, "forward", None)  # any kernel work would fail otherwise
    monkeypatch.setattr(torch_splash.api._ops, "infer", None)
    with pytest.raises(error, match=words):
        call()


MODEL_SOURCE = """
import torch
from torch.nn.attention.flex_attention import flex_attention


def attend(q, k, v, block_mask, score_mod=None):
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
"""


@pytest.fixture
def model_module():
    """A module written for FlexAttention: torch's flex_attention imported by name at its top."""
    module = types.ModuleType("flex_model_for_tests")
    sys.modules[module.__name__] = module
    exec(MODEL_SOURCE, vars(module))
    yield module
    del sys.modules[module.__name__]


@pytest.mark.parametrize("scope", ["every module", "one module"])
def test_route_flex_serves_unedited_code_and_restores_torch_s_function(model_module, scope):
    q, k, v = make_qkv(1, 2, 2, 200, 200, 32, 32, torch.float32)
    block_mask = create_block_mask(causal, None, None, 200, 200, device="cpu")
    with torch.no_grad():
        want = torch_flex(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
    modules = () if scope == "every module" else (model_module,)
    with torch_splash.route_flex(*modules):
        got = model_module.attend(q, k, v, block_mask)
        with pytest.raises(SplashConstraintError, match="relative_bias"):  # splash, not torch, served it
            model_module.attend(q, k, v, block_mask, score_mod=_relative_bias)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert model_module.flex_attention is torch_flex
    assert torch.nn.attention.flex_attention.flex_attention is torch_flex
    with torch.no_grad():
        model_module.attend(q.detach(), k.detach(), v.detach(), block_mask, score_mod=_relative_bias)  # torch's again


def test_route_flex_serves_a_model_wrapped_in_torch_compile(model_module):
    q, k, v = make_qkv(1, 2, 2, 200, 200, 32, 32, torch.float32)
    block_mask = create_block_mask(sliding_window(40), None, None, 200, 200, device="cpu")
    with torch.no_grad():
        want = torch_flex(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
    torch._dynamo.reset()
    compiled = torch.compile(model_module.attend, fullgraph=True, backend="aot_eager")
    with torch_splash.route_flex():
        got = compiled(q, k, v, block_mask)
        got.sum().backward()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="relative_bias"):
            compiled(q, k, v, block_mask, score_mod=_relative_bias)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert q.grad is not None


WRAPPER_SOURCE = """
import torch
from torch.nn.attention.flex_attention import flex_attention


class FlexAttentionWrapper(torch.nn.Module):
    # as torchtitan holds it: torch's function compiled once, when the class is defined
    compiled = torch.compile(flex_attention, fullgraph=True, backend="aot_eager")

    def forward(self, *args, **kwargs):
        return FlexAttentionWrapper.compiled(*args, **kwargs)
"""


@pytest.mark.parametrize("scope", ["every module", "one module"])
def test_route_flex_serves_torch_compile_of_flex_attention_made_before_it(scope):
    """torchtitan's pattern: torch.compile(flex_attention) held by a class, made at import. Routed
    by default (torch's function itself runs splash's call, however it is reached), torch's again
    after the block; a routing scoped to modules leaves it torch's."""
    module = types.ModuleType("flex_wrapper_for_tests")
    exec(WRAPPER_SOURCE, vars(module))
    attend = module.FlexAttentionWrapper()
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 200, 200, 32, 32, torch.float32))
    block_mask = create_block_mask(sliding_window(40), None, None, 200, 200, device="cpu")
    exact = flex_reference(q.double(), k.double(), v.double(), block_mask)[0].float()
    torch._dynamo.reset()
    with torch.no_grad():
        with torch_splash.route_flex(*(() if scope == "every module" else (module,))):
            got = attend(q, k, v, block_mask=block_mask)
            if scope == "every module":  # splash, not torch, served it: it refuses this score_mod
                with pytest.raises(torch._dynamo.exc.Unsupported, match="relative_bias"):
                    attend(q, k, v, block_mask=block_mask, score_mod=_relative_bias)
            else:
                attend(q, k, v, block_mask=block_mask, score_mod=_relative_bias)  # torch's
        torch.testing.assert_close(got, exact, atol=2e-5, rtol=1e-5)
        attend(q, k, v, block_mask=block_mask, score_mod=_relative_bias)  # torch's again
    assert torch.nn.attention.flex_attention.flex_attention is torch_flex
    assert torch_flex(q, k, v, block_mask=block_mask).shape == q.shape  # its own code is back


class PackedDocumentModel(torch.nn.Module):
    """A model written for FlexAttention: one attention layer over packed documents, calling torch's
    flex_attention by the name its module imported."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, block_mask, attend=None):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], -1)
        q, k, v = (t.view(b, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if attend is None:
            out = torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        else:
            out = attend(q, k, v, block_mask)
        return self.out(out.transpose(1, 2).reshape(b, length, -1))


def train_packed_documents(device, steps=3, attend=None, compiled=False):
    """Losses and final weights of a few SGD steps of PackedDocumentModel on `device`, with a
    document-causal BlockMask built on the CPU (torch's create_block_mask fails on torch_xla's
    device: "Cannot concatenate arrays with different element types: S64 vs S32"). attend: what
    the model calls instead of torch's flex_attention (the reference). compiled: the model runs
    under torch.compile(fullgraph=True)."""
    torch.manual_seed(0)
    model = PackedDocumentModel().to(device)
    call = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(2, 300, 64).to(device)
    doc = torch.tensor([[0] * 100 + [1] * 60 + [2] * 140, [0] * 37 + [1] * 263])

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, 2, None, 300, 300, device="cpu")
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = call(x, block_mask, attend).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()]


def train_with_the_reference():
    """train_packed_documents on the CPU with `reference` for flex_attention, which torch 2.15
    cannot differentiate on the CPU."""
    return train_packed_documents("cpu", attend=lambda q, k, v, block_mask: flex_reference(q, k, v, block_mask)[0])


def assert_trains_like_torch(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    for mine, ref in zip(got[1], want[1]):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "transport, compiled", [("graph", False), ("dlpack", False), ("graph", True)], ids=["graph", "dlpack", "fullgraph"]
)
def test_a_model_written_for_flex_attention_trains_on_torch_xla_s_device_as_with_torch(
    xla_device, transport, compiled, monkeypatch
):
    """fullgraph: the model under torch.compile(fullgraph=True) with the aot_eager backend, whose
    graph torch_xla then runs lazily (torch_xla's own openxla backend is not served: see docs)."""
    monkeypatch.setenv("TORCH_SPLASH_TRANSPORT", transport)
    want = train_with_the_reference()
    torch._dynamo.reset()
    with torch_splash.route_flex():
        got = train_packed_documents(xla_device, compiled=compiled)
    assert_trains_like_torch(got, want)


def test_a_model_written_for_flex_attention_trains_under_torch_compile_fullgraph_as_with_torch():
    want = train_with_the_reference()
    with torch_splash.route_flex():
        got = train_packed_documents("cpu", compiled=True)
    assert_trains_like_torch(got, want)


@pytest.mark.parametrize("op", ["partial_blocks", "flex_forward", "flex_backward"])
def test_opcheck_of_the_compiled_path_s_ops(op, monkeypatch):
    """torch.library.opcheck (schema, fake vs real, autograd registration) on the arguments the
    traced conversion gives them for a document mask."""
    from torch_splash import _flex_ops

    q, k, v = (t.detach() for t in make_qkv(2, 4, 2, 300, 300, 32, 32, torch.float32))
    block_mask = _block_mask(CASES["documents-per-batch"])
    given = []
    monkeypatch.setattr(_flex_ops, "flex_forward", lambda *args: given.append(args))
    _flex_ops.traced(q, k, v, block_mask, None, None)
    (args,) = given
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    if op == "partial_blocks":
        where = torch.ops.torch_splash.partial_blocks.default(args[3])
        assert where.shape[0] == int((args[3] == 1).sum()) + 1 and where[-1].eq(0).all()  # then the stand-in
        args = (args[3],)
    if op == "flex_backward":
        out, lse = torch.ops.torch_splash.flex_forward.default(*args)
        args = (q, k, v, out, lse, torch.randn_like(out), None, *args[3:])
    torch.library.opcheck(getattr(torch.ops.torch_splash, op).default, args, test_utils=tests)


def test_route_flex_from_threads_exiting_out_of_order_and_nested_restores_torch_s_function():
    """Thread A enters, B enters, A leaves while B is still inside (torch's function stays routed
    for B), then B leaves: torch's function runs its own code again. Nested blocks likewise."""
    import threading

    original = torch.nn.attention.flex_attention.flex_attention
    own = original.__code__
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with torch_splash.route_flex():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second():
        a_in.wait(10)
        with torch_splash.route_flex():
            b_in.set()
            a_out.wait(10)
            seen["routed after A left"] = original.__code__ is not own

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"routed after A left": True}
    assert original.__code__ is own and torch.nn.attention.flex_attention.flex_attention is original
    with torch_splash.route_flex():
        with torch_splash.route_flex():
            assert original.__code__ is not own
        assert original.__code__ is not own
    assert original.__code__ is own
