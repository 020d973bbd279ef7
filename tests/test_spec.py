"""spec/ must stay true: generated diagrams match the code's tables."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_state_diagrams_match_tables():
    spec = importlib.util.spec_from_file_location("gen_diagrams", ROOT / "spec" / "gen_diagrams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "spec" / "state-machines.md").read_text()
    assert committed == module.render(), "run: python spec/gen_diagrams.py"
