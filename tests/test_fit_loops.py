"""torch_splash.fit on the loops people write (issue #53): a first boundary that only moves data
onto the device is not a step, a loop that logs an index of what its boundary computed is checked
as torch_xla runs it, and a decode loop whose first step creates its cache is checked in its steady
state, the cache counted once. The scripts run unmodified; fit compiles the step with libtpu
(deviceless), as in test_fit.py. Then why a plain compile of a 32K-token training step's HLO is a
gigabyte under fit's figure, which is that of torch_xla's own module."""

import os
import re
import textwrap

import pytest
import torch

import torch_splash
from torch_splash import _compat, fit

pytestmark = pytest.mark.xla

UPLOAD_FIRST = """
import torch, torch_xla

device = torch_xla.device()
torch.manual_seed(0)
linear = torch.nn.Linear(256, 256, bias=False).to(device).to(torch.bfloat16)  # cast on the device
opt = torch.optim.SGD(linear.parameters(), lr=0.1)
x = torch.randn(8, 256, dtype=torch.bfloat16).to(device)
scale = torch.ones(256, device=device)  # made on the device
torch_xla.sync()  # the state on the device before the loop
for step in range(3):
    (linear(x).float() * scale).square().mean().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
"""


def _script(tmp_path, text: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_first_boundary_that_only_moves_data_is_not_a_step(tmp_path):
    """The script's boundary 1 uploads the weight, casts it to bf16 on the device and makes a
    tensor of ones there: no step. Step 1 is the script's boundary 2, checked with the weight
    updated in place and donated (counted once: nothing but temporaries on top of the arguments),
    and `step=2` counts steps the same way (the script's boundary 3)."""
    script = _script(tmp_path, UPLOAD_FIRST)
    report = fit.run_script(script, [], "v5e")
    weight = 256 * 256 * 2
    assert report.fits and report.step == "step 1", report
    assert report.donated == weight and report.total == report.arguments + report.temporaries, report
    assert "step 1 is the script's boundary 2: boundary 1 before it only moved data onto the device" in str(report)
    second = fit.run_script(script, [], "v5e", step=2)
    assert second.step == "step 2" and "step 2 is the script's boundary 3: boundary 1" in str(second), second
    assert second.donated == weight, second


def test_a_script_that_only_moves_data_has_no_step(tmp_path):
    script = _script(tmp_path, "import torch, torch_xla\nx = torch.ones(4).to(torch_xla.device())\ntorch_xla.sync()\n")
    with pytest.raises(torch_splash.SplashConstraintError, match="ended without a step boundary .* only moves data"):
        fit.run_script(script, [], "v5e")


def test_reading_what_a_boundary_computed_is_not_the_step_reading_its_own_work_is():
    """After a boundary, an index or a slice of what it computed (`w[0, :2].cpu()`, `.item()` of
    one element, `print` of a row) executes only that index, as torch_xla runs it: the step that
    follows is checked. An index of the step's own pending work executes part of the step before
    its boundary, and is refused with its line, as a read of a whole pending tensor is."""
    import torch_xla

    w = torch.randn(64, 128).to(torch_xla.device())  # TPU tiles of (8, 128): no padding
    _compat.materialize([w])  # as after a boundary

    def logged():
        print(w[0, :2].cpu(), w[1, 1].item(), w[2])  # a loop's log
        w.mul_(0.5)

    report = fit.check(logged, topology="v5e")
    assert report.fits and report.donated == w.numel() * 4, report

    def reads_its_own_work():
        w.mul_(0.5)
        w[0, 0].item()  # the step's own update, read before its boundary

    with pytest.raises(fit.EarlyExecution, match=r"test_fit_loops.py:\d+: w\[0, 0\]\.item\(\)"):
        fit.check(reads_its_own_work, topology="v5e")


DECODE_LOOP = """
import sys
import torch, torch_xla
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
import torch_splash.hf  # noqa: F401  (attn_implementation="splash")

prompt = int(sys.argv[1])  # the first step's tokens: 1 to decode from the start, more for a prefill
device = torch_xla.device()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
model = LlamaForCausalLM(config).eval().to(device)
model.set_attn_implementation("splash")
cache = StaticCache(config=config, max_cache_len=512)  # its tensors are made by the first step
ids = torch.randint(0, 128, (4, prompt)).to(device)
position = torch.arange(prompt).to(device)
with torch.no_grad():
    for step in range(3):
        logits = model(input_ids=ids, past_key_values=cache, cache_position=position, use_cache=True).logits
        ids = logits[:, -1:].argmax(-1)
        position = torch.tensor([prompt + step], device=device)
        torch_xla.sync()
        print(f"step {step}: token {ids[0, 0].item()}")  # a generate loop's log
"""
CACHE = 2 * 4 * 2 * 512 * 32 * 4  # one layer's k and v: B=4, 2 kv heads, 512 positions, head_dim 32, float32


def test_a_decode_loop_is_checked_in_its_steady_state_with_its_cache_counted_once(tmp_path):
    """The first step of a generate loop from one token makes HF's StaticCache (zeros, filled in
    place): by default fit runs it on the CPU (its log after the boundary included) and checks the
    second, where the cache is an argument updated in place and donated. Beyond its arguments and
    temporaries the step adds only its logits and token (under 1/16 of the 1 MiB cache), where
    step 1 counts the cache as a new output."""
    script = _script(tmp_path, DECODE_LOOP)
    report = fit.run_script(script, ["1"], "v5e")
    assert report.fits and report.step == "steady state (step 2)", report
    # the cache, and HF's count of its tokens (a scalar, one 512-byte TPU buffer)
    assert CACHE <= report.donated < CACHE + 4096, report
    assert report.total < report.arguments + report.temporaries + CACHE // 16, report
    assert "step 1 creates state that the steps after it update in place (1.0 MiB)" in str(report), report
    first = fit.run_script(script, ["1"], "v5e", step=1)
    assert first.donated < 4096 and first.outputs >= CACHE and first.arguments + CACHE <= report.arguments, first


def test_a_prefill_first_step_is_checked_itself(tmp_path):
    """A first step that prefills 16 tokens also makes the cache, but step 2 (one token) is
    another step: fit checks step 1 and says how to check step 2."""
    report = fit.run_script(_script(tmp_path, DECODE_LOOP), ["16"], "v5e")
    assert report.fits and report.step == "step 1", report
    assert "step 2 is another step" in str(report) and "--step 2 checks it" in str(report), report


def test_steady_state_is_the_first_step_with_its_new_state_as_arguments():
    """The decision behind the default: step 2 is step 1's steady state when it computes the same
    outputs from step 1's inputs and the state step 1 created, which step 2 updates in place."""
    from torch_splash._fit_graph import Step, steady_state_of

    cache, token, weight = ((4, 512, 32), "torch.float32"), ((4, 1), "torch.int64"), ((64, 64), "torch.float32")
    prompt = ((4, 16), "torch.int64")

    def step(outputs, inputs, updates, fresh=()):
        return Step(b"", (), 0, 0, outputs=outputs, inputs=tuple(sorted(inputs)), updates=updates, fresh=fresh)

    first = step((None, token, cache), [weight, token], (), fresh=(2,))
    decode = step((None, token, cache), [weight, token, cache], (2,))
    assert steady_state_of(first, decode)
    prefill = step((None, token, cache), [weight, prompt], (), fresh=(2,))
    assert not steady_state_of(prefill, decode)  # another input: a prefill
    assert not steady_state_of(first, step((None, token), [weight, token, cache], ()))  # other outputs
    assert not steady_state_of(step((None, token, cache), [weight, token, cache], (2,)), decode)  # nothing fresh


LLAMA_32K = """
import json, sys
import torch, torch_xla
from transformers import LlamaConfig, LlamaForCausalLM
import torch_splash.hf  # noqa: F401  (attn_implementation="splash")
from torch_splash import _compat, fit

clone = sys.argv[1:] == ["clone"]
device = torch_xla.device()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768)
model = LlamaForCausalLM(config).to(torch.bfloat16).to(device)
model.set_attn_implementation("splash")
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
ids = torch.randint(0, 512, (1, 32768)).to(device)
kept = []  # the loss, kept to print after the boundary, as a training loop does

def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    kept.append(loss.clone() if clone else loss)  # a clone is made after the updates: last in torch_xla's order

figures = lambda report: dict(total=report.total, temporaries=report.temporaries, donated=report.donated)
out = dict(fit=figures(fit.check(step, topology="v5e")))
if not clone:  # the plain compile: the HLO text of the step's parameters and loss, no donors
    out["plain"] = figures(fit.compile_step_hlo(_compat.pending_hlo_text([*model.parameters(), kept[0]]), "v5e"))
print(json.dumps(out), flush=True)
if not clone:  # torch_xla compiles the same step: XLA dumps it, then the CPU compiler fails on its TPU
    torch_xla.sync()  # kernels (the process dies there) or the test stops it
"""


@pytest.mark.slow  # 441 s on 2 (shared) cores: five TPU compiles of a 32K-token step
def test_a_32k_llama_step_is_torch_xla_s_module_and_a_loss_kept_first_costs_temporaries(tmp_path):
    """docs/tpu.md, "A plain compile of the step": an HF Llama training step (2 layers, hidden
    2048, 16/8 heads, SGD, splash) at 32K tokens whose loss is kept past the boundary. fit's
    figures are those of the module torch_xla dumps for that step, compiled with the donors it
    declares. A plain compile of the step's parameters and loss (HLO text, no donors) is a
    gigabyte less: XLA pairs donors with outputs by size alone, and with the loss first in
    torch_xla's order most weights' updates are paired with another weight's buffer, which costs
    temporaries. Kept as a clone made after the updates (last in that order), the loss leaves the
    pairing each weight's own, and the temporaries are the plain compile's."""
    import json

    from helpers import run_python
    from test_fit import _dumped_then_stopped, _hlo_module_of

    from torch_splash._fit_compiler import compiler_libtpu_dir
    from torch_splash_jax.tpu_time import aot

    script, dump = tmp_path / "llama32k.py", tmp_path / "dump"
    script.write_text(textwrap.dedent(LLAMA_32K))
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_proto --xla_dump_hlo_as_text"
    printed = _dumped_then_stopped(script, {**env, "XLA_FLAGS": flags}, dump, tmp_path).splitlines()
    ours = json.loads([line for line in printed if line.startswith("{")][-1])
    text = next(dump.glob("module_*.SyncTensorsGraph.*.before_optimizations.txt"))
    header = text.read_text().splitlines()[0]
    donors = re.findall(r"\((\d+), \{\}\)", re.search(r"buffer_donor=\{([^}]*\})*[^}]*\}", header)[0])
    proto = tmp_path / "step.pb"
    proto.write_bytes(_hlo_module_of(text.with_name(text.name.replace(".txt", ".hlo.pb")).read_bytes()))
    aot_env = aot.environment(str(compiler_libtpu_dir("v5e")))
    aot_env["PYTHONPATH"] = os.pathsep.join([aot_env["PYTHONPATH"], os.getcwd()])
    command = ["-m", "torch_splash_jax.tpu_time.aot", str(proto), "--topology", "v5e:2x2", "--donate", ",".join(donors)]
    theirs = run_python(*command, env=aot_env, timeout=1800)[-1]
    cloned = run_python(str(script), "clone", env=env, timeout=1800)[-1]["fit"]
    fitted, plain, gib = ours["fit"], ours["plain"], 1 << 30
    assert fitted["donated"] == theirs["donated"] > 0, (fitted, theirs)
    assert fitted["total"] == pytest.approx(theirs["total"], rel=0.01), (fitted, theirs)
    assert fitted["total"] - plain["total"] > 0.9 * gib, (fitted, plain)  # measured: 5.56 against 4.54 GiB
    assert fitted["temporaries"] - cloned["temporaries"] > gib, (fitted, cloned)  # measured: 5.38 against 4.19
    assert cloned["temporaries"] == pytest.approx(plain["temporaries"], rel=0.01), (cloned, plain)
