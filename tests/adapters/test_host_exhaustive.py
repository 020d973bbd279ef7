"""A missing effect case fails type checking (adapters/host.py, spec/design.md §2), shown with mypy itself.

adapters/host.py (the `Driver`) is copied three times: as it is, without the `Log` case of `Driver._notify`
(notifications) and without the `DropArtifacts` case of `Driver._execute` (commands). mypy checks them against the
real `peerloom.core`: the intact copy is clean, and each copy missing a case is an error at `assert_never`,
naming the effect it forgot. (`make typecheck` checks host.py
itself.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "adapters" / "host.py"


def dispatch_copy(drop: str | None = None, method: str = "_notify") -> str:
    """Source of host.py without the case for effect `drop` in `Driver.<method>`."""
    tree = ast.parse(HOST.read_text())
    driver = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Driver")
    dispatch = next(n for n in driver.body if isinstance(n, ast.FunctionDef) and n.name == method)
    match = next(n for n in ast.walk(dispatch) if isinstance(n, ast.Match))
    cases = [c for c in match.cases if not (isinstance(c.pattern, ast.MatchClass)
                                             and ast.unparse(c.pattern.cls) == f"fx.{drop}")]
    assert len(cases) == len(match.cases) - (drop is not None), f"Driver.{method} has no case fx.{drop}"
    match.cases = cases
    return ast.unparse(tree) + "\n"


def test_dispatch_without_a_case_fails_mypy(tmp_path: Path) -> None:
    # mypy cannot read package-dir (pyproject.toml), so `peerloom.core` is a link to core/ (as in `make typecheck`);
    # an empty peerloom/__init__.py keeps the rest of the package out of this check.
    (tmp_path / "peerloom").mkdir()
    (tmp_path / "peerloom" / "__init__.py").write_text("")
    (tmp_path / "peerloom" / "core").symlink_to(ROOT / "core", target_is_directory=True)
    (tmp_path / "intact.py").write_text(dispatch_copy())
    (tmp_path / "missing.py").write_text(dispatch_copy(drop="Log"))
    (tmp_path / "missing_command.py").write_text(dispatch_copy(drop="DropArtifacts", method="_execute"))
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
         "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
         "intact.py", "missing.py", "missing_command.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert run.returncode == 1, run.stdout + run.stderr
    assert len(errors) == 2, run.stdout
    [notification] = [e for e in errors if e.startswith("missing.py:")]
    [command] = [e for e in errors if e.startswith("missing_command.py:")]
    assert '"assert_never" has incompatible type "Log"' in notification, notification
    assert '"assert_never" has incompatible type "DropArtifacts"' in command, command
