"""torch.compile(fullgraph=True) through torch_splash.attention: the torch.library custom ops, their
fake implementations and autograd, against eager."""

import pytest
import torch
import torch.nn as nn
from helpers import forward_backward, make_qkv

import torch_splash
import torch_splash_jax
from torch_splash import masks
from torch_splash.masks import CausalMask, ChunkedCausalMask, LocalMask, MultiHeadMask
from torch_splash_jax import policy, serialization

OPS = [
    torch.ops.torch_splash.forward.default,
    torch.ops.torch_splash.infer.default,
    torch.ops.torch_splash.backward.default,
    torch.ops.torch_splash.decode.default,
]


class TwoLayers(nn.Module):
    """Two attention layers, GQA 4 -> 2: causal with segment ids, then a sliding window held as an
    attribute."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.ModuleList(nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim) for _ in range(2))
        self.window = LocalMask(7)
        self.block_sizes = torch_splash.BlockSizes(block_q=128, block_kv=128)

    def forward(self, x, segment_ids):
        b, length, _ = x.shape
        for i, qkv in enumerate(self.qkv):
            q, k, v = qkv(x).split([self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2, dim=-1)
            q, k, v = (t.view(b, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
            if i == 0:
                out = torch_splash.attention(q, k, v, "causal", segment_ids=segment_ids)
            else:
                out = torch_splash.attention(q, k, v, self.window, block_sizes=self.block_sizes, soft_cap=20.0)
            x = x + out.transpose(1, 2).reshape(b, length, -1)
        return x


def run(model, x, ids):
    model.zero_grad()
    out = model(x, ids)
    out.square().mean().backward()
    return out.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_matches_eager(backend):
    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(2, 200, 64)
    ids = (torch.arange(200) >= torch.tensor([[120], [200]])).int()  # two segments, then one
    expected_out, expected_grads = run(model, x, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: any graph break raises
    for _ in range(2):  # the second step reuses the compiled graph
        out, grads = run(compiled, x, ids)
        torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=0)
        for name in expected_grads:
            torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-5, rtol=0, msg=name)


def test_graph_holds_the_custom_ops_only():
    """Dynamo leaves the planning out of the graph; AOTAutograd sees the forward and backward ops."""
    seen = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(graph_module, _):
            seen.extend(str(n.target) for n in graph_module.graph.nodes if n.op == "call_function")
            return graph_module

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    q, k, v = make_qkv(1, 4, 2, 96, 96, 32, 32, torch.float32)
    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: torch_splash.attention(q, k, v, "causal"), fullgraph=True, backend=backend)(
        q, k, v
    )
    out.sum().backward()
    assert seen.count("torch_splash.forward.default") == 1 and seen.count("torch_splash.backward.default") == 1
    assert q.grad is not None and k.grad.shape == k.shape


def test_a_changed_mask_recompiles():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, mask: torch_splash.attention(q, k, v, mask), fullgraph=True)
    with torch.no_grad():
        for mask in (CausalMask(0), LocalMask(3), CausalMask(0) & LocalMask(9)):
            torch.testing.assert_close(fn(q, k, v, mask), torch_splash.attention(q, k, v, mask), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_each_sequence_length_compiles_its_own_graph(dynamic):
    """A graph holds the plan of one shape: sizes Dynamo makes symbolic (from the second length
    on with automatic dynamic shapes, from the first with dynamic=True) are specialised with a
    guard, so each length compiles its own graph, and each gives SDPA's output and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q, k, v: torch_splash.attention(q, k, v, "causal"), fullgraph=True, backend=counter, dynamic=dynamic
    )
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for length in (40, 56, 72, 56):
        q, k, v = make_qkv(1, 2, 2, length, length, 32, 32, torch.float32)
        d_out = torch.randn(1, 2, length, 32)
        (out, grads), (want, want_grads) = forward_backward(fn, q, k, v, d_out), forward_backward(sdpa, q, k, v, d_out)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
        for mine, ref in zip(grads, want_grads):
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 3  # the repeated length runs its graph again


def test_a_scale_or_soft_cap_that_changes_between_calls():
    """Floats passed in become symbolic when they change (Dynamo): they are specialised, so each
    value gives its own graph and its own result, never a stale one."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32))
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q, k, v, s, c: torch_splash.attention(q, k, v, "causal", scale=s, soft_cap=c), fullgraph=True
    )
    for scale, cap in ((0.1, 2.0), (0.2, 2.0), (0.3, 3.0), (0.1, 2.0)):
        want = torch_splash.attention(q, k, v, "causal", scale=scale, soft_cap=cap)
        torch.testing.assert_close(fn(q, k, v, scale, cap), want, atol=1e-6, rtol=0)


def test_compiled_inference_matches_eager():
    q, k, v = (t.detach() for t in make_qkv(2, 4, 1, 50, 70, 32, 16, torch.float32))
    mask = CausalMask(20)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: torch_splash.attention(q, k, v, mask), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), torch_splash.attention(q, k, v, mask), atol=1e-6, rtol=0)


def test_options_passed_as_none_trace():
    """Callers (the SDPA drop-in, HF's adapter, user code forwarding optional arguments) pass
    None for options they do not set; Dynamo refuses None inputs to a nonstrict_trace function."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 40, 40, 32, 32, torch.float32))
    none = dict(scale=None, segment_ids=None, soft_cap=None, block_sizes=None, transport=None, sinks=None)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: torch_splash.attention(q, k, v, None, **none), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), torch_splash.attention(q, k, v), atol=1e-6, rtol=0)
    fn = torch.compile(
        lambda q, k, v: torch_splash.scaled_dot_product_attention(q, k, v, is_causal=True), fullgraph=True
    )
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(fn(q, k, v), expected, atol=2e-5, rtol=0)


BUILT_INSIDE = [
    lambda: CausalMask(2),
    lambda: LocalMask(3),
    lambda: CausalMask(0) & LocalMask(5, None, -1),
    lambda: MultiHeadMask((CausalMask(0), LocalMask(4, None))),
    lambda: ChunkedCausalMask(8) | CausalMask(-3),
]


@pytest.mark.parametrize("make", BUILT_INSIDE, ids=lambda make: type(make()).__name__)
def test_a_structured_mask_built_inside_the_compiled_function(make):
    """Dynamo only passes mask objects built outside the compiled region into the nonstrict_trace
    body; structured masks cross as their source text instead, so building one in forward works."""
    assert serialization.mask_from_source(serialization.mask_source(make())) == make()
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, 32, torch.float32)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: torch_splash.attention(q, k, v, make()), fullgraph=True)
    out = fn(q, k, v)
    out.sum().backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want, want_grads = forward_backward(
        lambda q, k, v: torch_splash.attention(q, k, v, make()), *eager, torch.ones_like(out)
    )
    for got, expected in zip((out, q.grad, k.grad, v.grad), (want, *want_grads)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_mask_field_that_changes_between_calls():
    """An int that reaches the mask from an argument: each value gives its own mask (Dynamo
    specialises it), never a stale one."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 40, 40, 32, 32, torch.float32))
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, w: torch_splash.attention(q, k, v, LocalMask(w)), fullgraph=True)
    for w in (3, 5, 7, 9):
        torch.testing.assert_close(fn(q, k, v, w), torch_splash.attention(q, k, v, LocalMask(w)), atol=1e-6, rtol=0)


def test_a_mask_mod_built_inside_the_compiled_function_is_dynamos_limit():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 32, 32, torch.float32)
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q, k, v: torch_splash.attention(q, k, v, masks.from_mask_mod(lambda b, h, i, j: j <= i)), fullgraph=True
    )
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Construct the object _outside_"):
        fn(q, k, v)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name())
def test_opcheck(op):
    """torch.library.opcheck: schema, fake implementation vs real outputs, autograd registration."""
    from torch_splash import _ops as ops

    q, k, v = (t.detach() for t in make_qkv(2, 4, 2, 40, 56, 32, 32, torch.float32))
    ids = (torch.ones(2, 40, dtype=torch.int32), (torch.arange(56) < 50).int().expand(2, 56).contiguous())
    plan = torch_splash_jax.plan(
        batch=2,
        num_q_heads=4,
        num_kv_heads=2,
        q_len=40,
        kv_len=56,
        head_dim=32,
        head_dim_v=32,
        dtype="float32",
        mask=CausalMask(16),
        scale=0.2,
        soft_cap=None,
        has_segment_ids=True,
        block_sizes=None,
        platform="cpu",
    )
    called = ops.op_arguments(plan, None)
    if op is torch.ops.torch_splash.decode.default:  # two query rows, as a decode step has few
        decode = torch_splash_jax.decode.decode_plan(
            **dict(batch=2, num_q_heads=4, num_kv_heads=2, q_len=2, kv_len=56, head_dim=32, head_dim_v=32),
            **dict(dtype="float32", mask=CausalMask(54), scale=0.2, soft_cap=None, has_segment_ids=True),
            has_sinks=False,
            platform="cpu",
        )
        args = (q[:, :, :2], k, v, ids[0][:, :2], ids[1], None, serialization.plan_text(decode)[0], "")
    elif op in OPS[:2]:
        args = (q, k, v, *ids, None, *called, "dlpack")
    else:
        out, lse = OPS[0](q, k, v, *ids, None, *called, "")
        args = (q, k, v, *ids, None, out, lse, torch.randn_like(out), *called, "")
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_a_compiled_graph_outlives_any_number_of_other_configurations():
    """A compiled graph holds its plan as text: it runs again after more other configurations
    than the memo of plans keeps, rebuilding the plan from the text."""
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 40, 40, 32, 32, torch.float32))
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: torch_splash.attention(q, k, v, "causal"), fullgraph=True)
    first = fn(q, k, v)
    for length in range(1, policy.PLAN_TEXTS + 10):  # plans only: writing a plan's text builds no program
        serialization.plan_text(torch_splash_jax.plan(q_len=length, head_dim=8, mask=torch_splash_jax.CausalMask(0)))
    torch.testing.assert_close(fn(q, k, v), first, atol=0, rtol=0)
