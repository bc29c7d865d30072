"""attn_implementation="splash" in tiny HF models built from configs (no download), against "sdpa"
(or "eager" for Gemma 2 and gpt-oss, which transformers runs with eager: soft cap, sinks)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from helpers import dense_mask, tpu_training_kernels  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import torch_splash  # noqa: E402
import torch_splash.hf as hf  # noqa: E402
import torch_splash_jax  # noqa: E402

# f32 models: logits and gradients go through 2 layers of attention, MLP and norms; the attention
# itself matches to ~1e-6, measured model differences are ~1e-6 (logits) and ~1e-6 (grads).
ATOL = 1e-4
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attention_dropout=0.0,
)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(
        **{**SMALL, "num_key_value_heads": 1}, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL,
        head_dim=16,
        sliding_window=5,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    ),
    # attention sinks (s_aux), alternating sliding layers, a mixture of experts
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**SMALL, "intermediate_size": 64}, head_dim=16, sliding_window=5, num_local_experts=4, num_experts_per_tok=2
    ),
    # chunked attention (chunks of 3: not a multiple of the left padding of 4) on the first layer, full
    # on the second; a mixture of experts
    "llama4": lambda: transformers.Llama4TextConfig(
        **SMALL,
        head_dim=16,
        intermediate_size_mlp=96,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=3,
        no_rope_layer_interval=2,
    ),
}
# transformers runs Gemma 2 (soft cap) and gpt-oss (sinks) with "eager"
BASELINE = {
    "llama": "sdpa",
    "mistral": "sdpa",
    "qwen2": "sdpa",
    "gemma2": "eager",
    "gpt_oss": "eager",
    "llama4": "sdpa",
}
L = 12


def make_model(family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="splash")
    with torch.no_grad():  # gpt-oss initialises its sinks to 0; make them matter
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()
    return model.float()


def batch(layout):
    """input_ids, attention_mask (None for packed), position_ids (packed only), valid positions."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, L), generator=g)
    if layout == "packed":  # one row holding sequences of 5, 4 and 3 tokens, as padding-free collators make
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]] * 2)
        return ids, None, positions, torch.ones(2, L, dtype=torch.bool)
    mask = torch.ones(2, L, dtype=torch.long)
    if layout == "right":
        mask[1, -4:] = 0
    elif layout == "left":
        mask[1, :4] = 0
    return ids, mask, None, mask.bool()


def _labels(ids, valid):
    """Next-token labels without the tokens at padded positions or predicted from them."""
    predicted_from_valid = torch.cat([valid[:, :1], valid[:, :-1]], dim=1)
    return ids.masked_fill(~(valid & predicted_from_valid), -100)


def logits_and_grads(model, impl, ids, mask, positions, valid):
    model.set_attn_implementation(impl)
    model.zero_grad()
    # The loss skips tokens at padded positions and tokens predicted from padded positions: what a
    # fully masked (left-padded) query row returns differs by implementation (0 in sdpa and splash,
    # a uniform average in eager), and no real prediction comes from it.
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=_labels(ids, valid))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("layout", ["none", "right", "left", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_gradients_match(family, layout, monkeypatch):
    model = make_model(family)
    ids, mask, positions, valid = batch(layout)
    ref = logits_and_grads(model, BASELINE[family], ids, mask, positions, valid)
    with monkeypatch.context() as patched:  # the structured path, not the dense fallback, serves these layouts
        patched.setattr(mu, "sdpa_mask", lambda *a, **k: pytest.fail("dense mask built"))
        got = logits_and_grads(model, "splash", ids, mask, positions, valid)
    torch.testing.assert_close(got[0][valid], ref[0][valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=0)
    assert got[2].keys() == ref[2].keys() and len(got[2]) == len(list(model.parameters()))
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches(family):
    """Prefill, then decode with the default DynamicCache (Lq = 1 against a growing Lkv), left-padded;
    12 + 8 tokens run past the sliding window of 5."""
    model = make_model(family).eval()
    ids, mask, _, _ = batch("left")
    tokens = {}
    for impl in (BASELINE[family], "splash"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens["splash"], tokens[BASELINE[family]])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2"])
def test_right_padded_greedy_generation_matches_eager(family):
    """With right padding the next-token logits are read at a padded position, whose query row
    attends to the real keys in eager and sdpa: splash must give that row the same keys."""
    model = make_model(family).eval()
    ids, mask, _, _ = batch("right")
    tokens, scores = {}, {}
    for impl in ("eager", "splash"):
        model.set_attn_implementation(impl)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens[impl], scores[impl] = out.sequences, torch.stack(out.scores)
    assert torch.equal(tokens["splash"], tokens["eager"])
    torch.testing.assert_close(scores["splash"], scores["eager"], atol=ATOL, rtol=0)


def test_patch_switches_a_loaded_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    assert model.config._attn_implementation != "splash"
    ids = torch.randint(0, 128, (1, 9))
    expected = model(ids).logits
    assert hf.patch(model) is model and model.config._attn_implementation == "splash"
    torch.testing.assert_close(model(ids).logits, expected, atol=ATOL, rtol=0)


# The mask function: structured masks, segment ids, nothing (Lq, Lkv)-sized.


def test_mask_function_causal_prefill_and_chunked_prefill_offsets():
    assert hf.splash_mask(2, 7, 7) == hf.SplashMask(torch_splash.masks.CausalMask(0))
    # 3 more queries at positions 9..11 against 12 cached keys -> bottom-right causal
    assert hf.splash_mask(2, 3, 12, q_offset=9) == hf.SplashMask(torch_splash.masks.CausalMask(9))


def test_mask_function_sliding_window_is_a_local_mask():
    got = hf.splash_mask(1, 6, 6, mask_function=mu.sliding_window_causal_mask_function(3))
    assert got == hf.SplashMask(torch_splash.masks.LocalMask(2, 0, 0))
    # a sliding cache that kept keys from position 4 on, queried at positions 8 and 9
    got = hf.splash_mask(1, 2, 6, q_offset=8, kv_offset=4, mask_function=mu.sliding_window_causal_mask_function(3))
    assert got.mask == torch_splash.masks.LocalMask(2, 0, 4)


def test_decode_steps_are_kv_segment_ids_over_a_full_mask():
    """Lq = 1: the visible keys become kv ids and the keys pad to 128, so the compiled program only
    changes every 128 steps."""
    got = hf.splash_mask(2, 1, 10, q_offset=9)
    assert got.mask == torch_splash.masks.FullMask() and got.pad_keys_to == 128
    assert torch.equal(got.segment_ids[1], torch.ones(2, 10, dtype=torch.int32))
    # sliding window 3, cache keeping positions 4..9, query at 9: sees positions 7, 8, 9
    got = hf.splash_mask(1, 1, 6, q_offset=9, kv_offset=4, mask_function=mu.sliding_window_causal_mask_function(3))
    assert got.segment_ids[1].tolist() == [[0, 0, 0, 1, 1, 1]]
    # left padding: the first two keys are padding
    padding = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool)
    got = hf.splash_mask(1, 1, 5, q_offset=4, attention_mask=padding)
    assert got.segment_ids[0].tolist() == [[1]] and got.segment_ids[1].tolist() == [[0, 0, 1, 1, 1]]


def test_generation_compiles_once_per_128_cached_tokens():
    model = make_model("mistral").eval()
    ids, mask, _, _ = batch("left")
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # compile prefill and decode
    before = sum(torch_splash_jax.splash_program.TRACES.values())
    model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)  # 12 + 30 tokens < 128
    assert sum(torch_splash_jax.splash_program.TRACES.values()) == before


def _dense(splash_mask, q_len, kv_len):
    """(B or 1, Lq, Lkv): what an HF SplashMask (mask and segment ids) allows."""
    return dense_mask(splash_mask.mask, q_len, kv_len, splash_mask.segment_ids)[:, 0]


@pytest.mark.parametrize("window", [None, 3])
def test_mask_function_padding_matches_hf_on_valid_rows(window):
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    got = hf.splash_mask(3, 6, 6, mask_function=fn, attention_mask=padding)
    assert got.segment_ids[0].shape == (3, 6) and got.segment_ids[1].shape == (3, 6)
    expected = mu.sdpa_mask(3, 6, 6, mask_function=fn, attention_mask=padding, allow_is_causal_skip=False)[:, 0]
    # every row, padded query rows included: HF masks keys only, so a right-padded query row sees
    # the real keys before it (its logits are the next-token logits), a left-padded one sees none
    assert torch.equal(_dense(got, 6, 6), expected)


def test_mask_function_packed_sequences_are_segment_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    packed = mu.find_packed_sequence_indices(positions)
    fn = mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
        mu.packed_sequence_mask_function(packed),
    )
    got = hf.splash_mask(1, 6, 6, mask_function=fn)
    assert got.mask == torch_splash.masks.CausalMask(0)
    expected = mu.sdpa_mask(1, 6, 6, mask_function=fn, allow_is_causal_skip=False)[:, 0]
    assert torch.equal(_dense(got, 6, 6), expected)


def test_mask_function_chunks_are_segment_ids_shifted_by_left_padding():
    """Llama 4's chunked attention: chunks of 4 counted from each row's first real token."""
    padding = torch.tensor([[1] * 11, [0, 0, 0] + [1] * 8, [1] * 9 + [0, 0]], dtype=torch.bool)
    left_padding = (padding.long().cumsum(-1) == 0).sum(-1)  # as create_chunked_causal_mask counts it
    fn = mu.chunked_causal_mask_function(4, left_padding)
    got = hf.splash_mask(3, 11, 11, mask_function=fn, attention_mask=padding)
    assert got.mask == torch_splash.masks.CausalMask(0)
    expected = mu.sdpa_mask(3, 11, 11, mask_function=fn, attention_mask=padding, allow_is_causal_skip=False)[:, 0]
    assert torch.equal(_dense(got, 11, 11)[padding], expected[padding])
    # decoding: the query at position 11 sees its own chunk (positions from 3 + 8 = 11 for the left-padded row)
    padding = torch.cat([padding, torch.ones(3, 1, dtype=torch.bool)], dim=1)
    got = hf.splash_mask(3, 1, 12, q_offset=11, mask_function=fn, attention_mask=padding)
    expected = mu.sdpa_mask(
        3, 1, 12, q_offset=11, mask_function=fn, attention_mask=padding, allow_is_causal_skip=False
    )[:, 0]
    assert torch.equal(_dense(got, 1, 12), expected)


def test_mask_function_chunks_within_packed_sequences():
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0]])
    packed = mu.find_packed_sequence_indices(positions)
    fn = mu.and_masks(
        mu.remap_positions_for_packed_sequence(
            mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=int)), positions
        ),
        mu.packed_sequence_mask_function(packed),
    )
    got = hf.splash_mask(1, 10, 10, mask_function=fn)
    expected = mu.sdpa_mask(1, 10, 10, mask_function=fn, allow_is_causal_skip=False)[:, 0]
    assert torch.equal(_dense(got, 10, 10), expected)


def test_unrecognised_mask_function_falls_back_to_hf_dense_mask():
    def prefix_lm(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx < 2

    fn = mu.or_masks(mu.causal_mask_function, prefix_lm)
    got = hf.splash_mask(1, 5, 5, mask_function=fn, use_vmap=True)
    assert torch.equal(got, mu.sdpa_mask(1, 5, 5, mask_function=fn, allow_is_causal_skip=False, use_vmap=True))


def test_attention_function_serves_a_dense_4d_mask():
    """A user's own 4-D mask passes through transformers untouched: it is served by the dense path."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 16, generator=g) for h in (4, 2, 2))
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    mask[..., 0] = True
    out, weights = hf.splash_attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True)
    assert weights is None and out.is_contiguous() and out.shape == (2, 6, 4, 16)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=2e-5, rtol=0)


def test_a_renamed_closure_variable_of_transformers_is_a_version_error(monkeypatch):
    """The adapter reads masking_utils' closures by their captured names, which transformers does
    not document: a release that renames one (here a stand-in factory capturing `window`) is a
    SplashVersionError naming transformers and the name, not a KeyError."""
    from torch_splash import _compat

    def sliding_window_overlay(sliding_window):
        window = sliding_window

        def inner(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx > q_idx - window

        return inner

    monkeypatch.setattr(mu, "sliding_window_overlay", sliding_window_overlay)
    _compat._hf_factory_codes.cache_clear()
    try:
        with pytest.raises(torch_splash.SplashVersionError, match=r"transformers 5\..*\['sliding_window'\]"):
            hf.splash_mask(1, 6, 6, mask_function=mu.and_masks(mu.causal_mask_function, sliding_window_overlay(3)))
    finally:
        _compat._hf_factory_codes.cache_clear()
    monkeypatch.undo()
    assert hf.splash_mask(1, 6, 6, mask_function=mu.sliding_window_causal_mask_function(3)).mask == (
        torch_splash.masks.LocalMask(2, 0, 0)
    )


@pytest.mark.parametrize("removed", ["prepare_padding_mask", "chunked_overlay"])
def test_a_masking_utils_function_transformers_removed_is_a_version_error(removed, monkeypatch):
    """A function the adapter calls, or a factory whose closures it recognises, gone from
    masking_utils: a SplashVersionError naming transformers and the function, not an AttributeError."""
    from torch_splash import _compat

    monkeypatch.delattr(mu, removed)
    for cache in (_compat.hf_masking, _compat._hf_factory_codes):
        cache.cache_clear()
    try:
        with pytest.raises(torch_splash.SplashVersionError, match=rf"transformers 5\..*{removed}"):
            _compat.hf_masking()
            _compat.hf_mask_closure(mu.causal_mask_function)
    finally:
        monkeypatch.undo()
        for cache in (_compat.hf_masking, _compat._hf_factory_codes):
            cache.cache_clear()
    assert _compat.hf_masking().prepare_padding_mask is mu.prepare_padding_mask


def test_arguments_the_adapter_does_not_serve_warn_once_or_are_refused(monkeypatch):
    """As transformers' sdpa adapter: output_attentions warns once (the weights are None); an
    additive position_bias and a sliding window no mask function placed are refused, naming the
    argument and its value, rather than silently ignored."""
    monkeypatch.setattr(hf, "_WARNED", set())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 16, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    with pytest.warns(UserWarning, match="output_attentions=True returns None") as record:
        for _ in range(2):
            out, weights = hf.splash_attention_forward(module, q, k, v, None, output_attentions=True)
    assert weights is None and len(record) == 1
    with pytest.raises(torch_splash.SplashConstraintError, match="position_bias"):
        hf.splash_attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 6, 6))
    with pytest.raises(torch_splash.SplashConstraintError, match="sliding_window=3 with attention_mask=None over 6"):
        hf.splash_attention_forward(module, q, k, v, None, sliding_window=3)
    # a window no shorter than the keys changes nothing; with the mask function's mask it is served
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(hf.splash_attention_forward(module, q, k, v, None, sliding_window=6)[0], out)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=2e-5, rtol=0)
    mask = hf.splash_mask(1, 6, 6, mask_function=mu.sliding_window_causal_mask_function(3))
    hf.splash_attention_forward(module, q, k, v, mask, sliding_window=3)


def test_training_with_attention_dropout_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**SMALL, "attention_dropout": 0.1}), attn_implementation="splash"
    ).train()
    with pytest.raises(torch_splash.SplashConstraintError, match="attention_dropout"):
        model(torch.randint(0, 128, (1, 5)))
    model.eval()(torch.randint(0, 128, (1, 5)))  # dropout is 0 at eval: fine


@pytest.mark.xla  # in the set `./dev.sh hf-finetune` runs it with
def test_finetune_example_runs(tmp_path):
    """examples/hf_finetune.py as the README runs it, shortened: both curves, their difference, the plot."""
    import pathlib
    import re
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "examples" / "hf_finetune.py"
    plot = tmp_path / "curves.png"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--plot", str(plot)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    diff = float(re.search(r"largest loss difference over 3 steps: (\S+)", done.stdout).group(1))
    assert diff < 1e-4 and plot.stat().st_size > 0


@pytest.mark.parametrize("family,fullgraph", [("llama", True), ("mistral", False)])
def test_compiled_model_matches_eager(family, fullgraph):
    """torch.compile(model): for Llama with fullgraph=True (the mask function, the attention
    function and the kernels trace as one graph; any graph break raises); for Mistral, whose
    sliding-window mask closures transformers builds inside the compiled forward, with graph breaks.
    Left padding. Logits on real positions, the loss and every parameter gradient match eager."""
    model = make_model(family)
    ids, mask, _, valid = batch("left")
    _, ref_loss, ref_grads = logits_and_grads(model, "splash", ids, mask, None, valid)
    expected = model(input_ids=ids, attention_mask=mask).logits.detach()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    model.zero_grad()
    out = compiled(input_ids=ids, attention_mask=mask, labels=_labels(ids, valid))
    out.loss.backward()
    torch.testing.assert_close(out.logits.detach()[valid], expected[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss.detach(), ref_loss, atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=0, msg=name)


# On torch_xla's device, the TPU path: the model's step is one lazy graph with splash inside it.


def _xla_training_steps(impl, device, steps):
    """A tiny Llama trained with SGD on torch_xla's device; per step: (loss, gradients, XLA
    executions, compilations). Right padding, with the padded positions out of the loss."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from helpers import xla_metric_count as count

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SMALL), attn_implementation=impl
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, mask, _, valid = batch("right")
    labels = ids.masked_fill(~valid, -100)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    torch_xla.sync()
    xm.wait_device_ops()
    results = []
    for _ in range(steps):
        executed, compiled = count("ExecuteTime"), count("CompileTime")
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        xm.wait_device_ops()
        results.append(
            (
                loss.cpu(),
                {n: g.cpu() for n, g in grads.items()},
                count("ExecuteTime") - executed,
                count("CompileTime") - compiled,
            )
        )
    return results


def test_training_on_the_xla_device_matches_sdpa_and_compiles_once(xla_device):
    got, ref = (_xla_training_steps(impl, xla_device, steps=3) for impl in ("splash", "sdpa"))
    for (loss, grads, _, _), (ref_loss, ref_grads, _, _) in zip(got, ref):
        torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=ATOL, rtol=0, msg=name)
    # Step 1 compiles the graph; later steps reuse it. Each step executes as one graph holding
    # forward, backward, update and the splash kernels: no sync in the mask function or attention.
    assert [compiled for _, _, _, compiled in got[1:]] == [0, 0]
    assert [executed for _, _, executed, _ in got] == [1, 1, 1]


def test_training_step_on_tpu_would_hold_the_mosaic_kernels(xla_device, planned_for_tpu):
    """The HF step's graph, with the kernels planned and lowered for TPU (built on the CPU device,
    never executed): every attention layer adds its forward and backward Mosaic calls."""
    import gc

    from torch_splash import _compat

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SMALL), attn_implementation="splash"
    ).to(xla_device)
    ids, mask, _, _ = batch("right")
    loss = model(input_ids=ids.to(xla_device), attention_mask=mask.to(xla_device), labels=ids.to(xla_device)).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    hlo = _compat.pending_hlo_text(list(grads))
    per_layer = tpu_training_kernels(ids.shape[1], ids.shape[1], SMALL["hidden_size"] // SMALL["num_attention_heads"])
    assert hlo.count('custom_call_target="tpu_custom_call"') == per_layer * SMALL["num_hidden_layers"]
    del loss, grads, model  # never executed: nothing may sync these graphs on a CPU
    gc.collect()


def test_float16_model_parity_and_generation():
    """A float16 Llama (as HF users load models) through splash: against the same model in float64,
    its logits are no further off than sdpa's in float16; greedy generation gives sdpa's tokens."""
    model = make_model("llama").eval()
    ids, mask, _, valid = batch("right")
    with torch.no_grad():
        model.double().set_attn_implementation("sdpa")
        reference = model(input_ids=ids, attention_mask=mask).logits
        model.half()
        errors, tokens = {}, {}
        for impl in ("sdpa", "splash"):
            model.set_attn_implementation(impl)
            logits = model(input_ids=ids, attention_mask=mask).logits
            assert logits.dtype == torch.float16
            errors[impl] = float((logits.double() - reference)[valid].abs().max())
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert errors["splash"] <= errors["sdpa"] * 1.5 + 1e-3, errors
    assert torch.equal(tokens["splash"], tokens["sdpa"])


@pytest.mark.parametrize(
    "family", ["gpt_oss", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f != "gpt_oss")]
)
def test_static_cache_generation_takes_the_decode_kernel_and_matches(family, monkeypatch):
    """generate with a StaticCache: transformers makes each step's mask before the forward and hands
    it back as the model's attention_mask (a SplashMask). Greedy tokens equal the baseline's, and the
    decode steps run the decode kernel. gpt-oss by default: sinks, sliding and full layers, GQA."""
    from torch_splash import _ops

    calls, op = [], _ops.decode
    monkeypatch.setattr(_ops, "decode", lambda *a: calls.append(a) or op(*a))
    model = make_model(family).eval()
    ids, mask, _, _ = batch("left")
    tokens = {}
    for impl in (BASELINE[family], "splash"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static"
        )
    assert torch.equal(tokens["splash"], tokens[BASELINE[family]])
    assert len(calls) >= 5 * SMALL["num_hidden_layers"]  # every decode step's every layer


def test_dynamic_cache_decode_steps_take_the_decode_kernel(monkeypatch):
    from torch_splash import _ops

    calls, op = [], _ops.decode
    monkeypatch.setattr(_ops, "decode", lambda *a: calls.append(a) or op(*a))
    model = make_model("llama").eval()
    model.set_attn_implementation("splash")
    ids, mask, _, _ = batch("left")
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert len(calls) == 2 * SMALL["num_hidden_layers"]  # the steps after the prefill


def test_a_torch_xla_decode_loop_compiles_one_graph_for_every_step(xla_device):
    """A StaticCache decode loop on torch_xla's device, one step per sync, with the position as data
    (cache_position): after the first decode step no step compiles again, as with sdpa, and the
    greedy tokens are sdpa's."""
    import torch_xla
    from helpers import xla_metric_count

    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).eval()
    model = model.to(xla_device)
    ids, _, _, _ = batch("left")
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :4] = 0  # left padding, over the whole cache's length
    ids, mask = ids.to(xla_device), mask.to(xla_device)

    def decode_loop(impl, steps=3):
        model.set_attn_implementation(impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        tokens, compiled = [], []
        with torch.no_grad():
            out = model(
                ids, attention_mask=mask, past_key_values=cache, cache_position=torch.arange(L, device=xla_device)
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch_xla.sync()
            for step in range(steps):
                position = torch.tensor([L + step], device=xla_device)
                out = model(token, attention_mask=mask, past_key_values=cache, cache_position=position)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                torch_xla.sync()
                tokens.append(token.cpu())
                compiled.append(xla_metric_count("CompileTime"))
        return torch.cat(tokens, 1), compiled

    (ref, _), (got, compiled) = decode_loop("sdpa"), decode_loop("splash")
    assert torch.equal(got, ref)
    assert compiled[1:] == [compiled[0]] * (len(compiled) - 1), compiled
