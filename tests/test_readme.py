"""The README stays true: its Python snippets compile, import every name they use and those
imports resolve; every `peerloom ...` line of its shell snippets parses with the real command line; and
`peerloom --help` names every command. Running the snippets needs a fleet: tests/e2e/test_experiment.py
runs that path (init, up, export, load_head)."""

import ast
import builtins
import importlib
import re
import shlex
from pathlib import Path

import pytest

from peerloom.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _bound_names(tree: ast.AST) -> set[str]:
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
                bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound


@pytest.mark.parametrize("code", _blocks("python"))
def test_python_snippets_import_what_they_use(code):
    tree = ast.parse(code)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= _bound_names(tree), f"used but never imported or assigned: {used - _bound_names(tree)}"


def test_shell_snippets_are_real_commands():
    lines = [line.split(" #")[0].strip() for block in _blocks("sh") for line in block.splitlines()]
    commands = [line for line in lines if line.startswith("peerloom ") or " -m peerloom " in line]
    assert len(commands) > 10
    parser = build_parser()
    for line in commands:
        argv = shlex.split(line.split(" -m peerloom ", 1)[1] if " -m peerloom " in line else line)
        try:
            parser.parse_args(argv[1:] if argv[0] == "peerloom" else argv)
        except SystemExit:
            pytest.fail(f"README: `{line}` does not parse")


def test_help_names_every_command():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    description = parser.format_help().split("positional arguments")[0]
    missing = [c for c in commands if f"`{c}`" not in description]
    assert not missing, f"`peerloom --help`'s description leaves out {missing}"


def test_the_example_is_as_long_as_the_readme_says():
    claimed = int(re.search(r"train_your_model\.py` is the whole path in (\d+) lines of code", README).group(1))
    source = (Path(__file__).resolve().parents[1] / "examples" / "train_your_model.py").read_text()
    after_docstring = source.splitlines()[ast.parse(source).body[0].end_lineno:]
    assert claimed == len([line for line in after_docstring if line.strip() and not line.strip().startswith("#")])
