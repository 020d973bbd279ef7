"""Every example under examples/ runs as a user would run it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# `_name.py` files are helpers the examples import (examples/_experiment.py), not examples of their own.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"property_test.py", "embed_engine_asyncio.py", "embed_engine_trio.py",
                                              "embed_engine_loop.py", "train_your_model.py", "hf_causal_lm.py",
                                              "own_loop.py"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example, tmp_path):
    if example.name == "hf_causal_lm.py":
        pytest.importorskip("transformers", reason="examples/hf_causal_lm.py needs the hf extra")
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_train_your_model_is_at_most_25_lines_of_user_code():
    import ast

    source = (ROOT / "examples" / "train_your_model.py").read_text()
    after_docstring = source.splitlines()[ast.parse(source).body[0].end_lineno:]
    code = [line for line in after_docstring if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 25, len(code)
