"""Every Python example in README.md and docs/*.md runs, extracted from the Markdown as it stands:
a renamed argument or a stale snippet fails here. A file's examples run in order in one fresh
interpreter, as a reader runs them one after another.

Two names stand in for what a reader brings, and only these: `name`, a model id, is a tiny Llama
saved to a local folder (no download), and `input_ids` a batch of its token ids. Examples that use
torch_xla run with 4 CPU devices (`PJRT_DEVICE=CPU CPU_NUM_DEVICES=4`), as docs/tpu.md's SPMD
examples need.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

READER = """
import torch, transformers
_config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
torch.manual_seed(0)
transformers.LlamaForCausalLM(_config).save_pretrained({folder!r})
name = {folder!r}
input_ids = torch.randint(0, 128, (2, 24))
"""


def examples(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, code) of each ```python block."""
    text = path.read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


def _marks(path: pathlib.Path) -> list:
    """Each file's examples run once, in the set whose stack they need: torch_xla's in the torch_xla
    set, the others in the current set (the newest torch and JAX, which a new user installs, and
    the libtpu the TPU time estimator was calibrated with)."""
    code = "".join(c for _, c in examples(path))
    return [pytest.mark.xla if "torch_xla" in code else pytest.mark.torchtpu]


CASES = [pytest.param(path, marks=_marks(path)) for path in DOCS if examples(path)]


def test_the_docs_have_examples_to_run():
    assert {p.values[0].name for p in CASES} >= {"README.md", "tpu.md"}


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_every_example_runs(path, tmp_path):
    script = READER.format(folder=str(tmp_path / "model"))
    for line, code in examples(path):
        script += f"\n# {path.name}:{line}\n" + textwrap.dedent(code)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, f"{path.name}:\n{done.stderr[-3000:]}"


def test_the_readme_stays_a_readme():
    """The README is the user's entry point, within 14 KB; the guides' detail belongs in docs/."""
    assert len((ROOT / "README.md").read_bytes()) <= 14 * 1024
