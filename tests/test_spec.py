"""spec/ must stay true: generated diagrams match the code's tables."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(script: str):
    spec = importlib.util.spec_from_file_location(script, ROOT / "spec" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_state_diagrams_match_tables():
    committed = (ROOT / "spec" / "state-machines.md").read_text()
    assert committed == load("gen_diagrams").render(), "run: python spec/gen_diagrams.py"


def test_import_diagram_in_design_matches_the_source():
    module = load("gen_layers")
    assert module.committed() == module.render(), "run: python spec/gen_layers.py"


def test_import_diagram_sees_a_new_import(tmp_path, monkeypatch):
    """The scan is what makes the diagram stale: an import of sim from core would add an arrow."""
    module = load("gen_layers")
    for folder in module.PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "core" / "a.py").write_text("import attrs\nfrom peerloom.core import x\n")
    (tmp_path / "backends" / "b.py").write_text("from peerloom.core.engine import Engine\nimport os, numpy.linalg\n")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    edges, libraries = module.scan()
    assert edges == [("backends", "core")]
    assert libraries["backends"] == ["numpy"] and libraries["core"] == ["attrs"]
    (tmp_path / "core" / "c.py").write_text("def f():\n    from peerloom.sim import kernel\n")
    assert ("core", "sim") in module.scan()[0]


def test_relative_links_in_spec_resolve():
    """design.md and embedding.md point at examples and other spec files: those files exist."""
    broken = []
    for page in sorted((ROOT / "spec").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
