"""spec/design.md §1 layer rules, checked on the source with the ast module.

(import-linter cannot resolve our `package-dir` mapping of top-level folders into `peerloom.*`, so this
test is the "equivalent test" spec/design.md §1 allows.) Purity of core/ beyond imports — no clocks, OS
randomness or module-level `random` functions — is checked by scanning the source too.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)

# folder -> (allowed third-party top-level modules, allowed peerloom layers, stdlib modules refused)
RULES = {
    "core": ({"attrs", "cbor2", "nacl"}, {"core"},
             {"socket", "asyncio", "threading", "multiprocessing", "secrets", "subprocess", "selectors"}),
    # opacus (the [dp] extra): DP-SGD and its accountant, imported inside the functions that use it.
    "backends": ({"numpy", "torch", "safetensors", "sklearn", "attrs", "opacus"}, {"core", "backends"},
                 {"socket", "asyncio"}),
    # Adapters talk to the outside world through well-kept libraries: cryptography's ChaCha20-Poly1305 for
    # Noise, aiohttp for the HTTP edge, prometheus-client for metrics, zeroconf for LAN discovery, PyJWT for
    # the auth service's ID-token validation.
    "adapters": ({"trio", "aiohttp", "zeroconf", "numpy", "attrs", "nacl", "cbor2", "torch", "cryptography",
                  "prometheus_client", "jwt"},
                 {"core", "backends", "adapters"}, set()),
    "sim": ({"numpy", "attrs", "torch", "matplotlib"}, {"core", "backends", "adapters", "sim"}, set()),
}
# Adapters carry out what the engine decides (spec/design.md §6): they may import the engine's interface (events,
# effects, the records a `Persist` carries and the compute tasks a `RunTask` carries) and the protocol's objects,
# and two pure functions every peer computes alike (a light trainer needs them for itself): its leases
# (core.leases) and its training seed (core.audit). Not the modules that decide protocol outcomes
# (roles, agreement, screening, quarantine, ...), whatever new ones core grows.
ADAPTER_CORE_MODULES = {"engine", "events", "effects", "records", "tasks", "messages", "objects", "identity",
                        "envelope", "encoding", "errors", "chain", "leases", "audit"}
# ... nor read decisions out of log lines, rejection reasons or counters: those arrive as typed effects
# (`Rejected`, `Ban`, `SubmitReply`), carried out by `adapters/host.py`.
ADAPTER_FORBIDDEN_SOURCE = [
    r"\.event\s*(==|!=|\bin\b)",
    r"Log\(\s*event\s*=",  # matching any log event by name (a metric included)
    r"==\s*[\"']reject[\"']",
    r"penalty-limit",
    r"rejected_by_reason",
]
CORE_FORBIDDEN_CALLS = [
    r"\btime\.(time|monotonic|perf_counter|sleep)\(",
    r"\bos\.urandom\(",
    r"\bdatetime\.now\(",
    r"\brandom\.(random|randint|randrange|choice|shuffle|getrandbits|seed|uniform)\(",
]


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_layer_imports_follow_design_table():
    problems = []
    for folder, (third_party, layers, refused_stdlib) in RULES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imported_modules(path):
                top = module.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                if top == "peerloom":
                    parts = module.split(".")
                    if len(parts) < 2 or parts[1] not in layers:
                        problems.append(where)
                elif top in STDLIB:
                    if top in refused_stdlib:
                        problems.append(where)
                elif top not in third_party:
                    problems.append(where)
    assert not problems, "\n".join(problems)


def test_core_reads_no_clock_and_no_os_randomness():
    hits = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in CORE_FORBIDDEN_CALLS):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_layer_check_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy\nfrom peerloom.adapters import tcp\n")
    assert [m for _, m in imported_modules(bad)] == ["numpy", "peerloom.adapters"]


def test_importing_core_loads_no_io_or_numeric_library():
    code = ("import sys, peerloom.core.engine, peerloom.core.chain; "
            "bad = [m for m in ('trio', 'numpy', 'torch', 'socket', 'asyncio', 'safetensors') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"core pulled in: {out}"


def core_modules_imported(path: Path):
    """(line, core module) for every `peerloom.core.X` an adapter imports, `from peerloom.core import X` included
    when X is a module of core (re-exported names from `peerloom.core` are the package's public surface)."""
    modules = {p.stem for p in (ROOT / "core").glob("*.py")}
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found = {parts[2] for parts in (name.split(".") for name in names)
                 if parts[:2] == ["peerloom", "core"] and len(parts) > 2 and parts[2] in modules}
        for module in sorted(found):
            yield node.lineno, module


def test_adapters_import_nothing_that_decides_protocol_outcomes():
    problems = [f"{path.relative_to(ROOT)}:{line} imports peerloom.core.{module}"
                for path in sorted((ROOT / "adapters").rglob("*.py"))
                for line, module in core_modules_imported(path) if module not in ADAPTER_CORE_MODULES]
    assert not problems, "\n".join(problems)


def test_no_adapter_decides_from_log_lines_reasons_or_counters():
    hits = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in ADAPTER_FORBIDDEN_SOURCE):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_adapter_checks_catch_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from peerloom.core import validator\nimport peerloom.core.agreement\n"
                   "from peerloom.core.collector import screen\nfrom peerloom.core import Engine, effects\n")
    assert sorted(m for _, m in core_modules_imported(bad)) == ["agreement", "collector", "effects", "validator"]
    for line in ('if effect.event == "reject":', 'case fx.Log(event="reject"):', 'case fx.Log(event="vote"):',
                 'if e.reason == "penalty-limit":',
                 "before = dict(engine.rejected_by_reason)"):
        assert any(re.search(p, line) for p in ADAPTER_FORBIDDEN_SOURCE), line


MAX_CORE_MODULE_LINES = 600


def core_import_graph(folder: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports: at module level, under `if TYPE_CHECKING:` and
    inside functions alike (ast.walk sees them all), relative (`from .x import`, `from . import x`) or
    absolute (`peerloom.core.x`)."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
                elif node.level == 0 and node.module and node.module.split(".")[:2] == ["peerloom", "core"]:
                    parts = node.module.split(".")
                    found.update(parts[2:3] if len(parts) > 2 else [a.name for a in node.names])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names
                             if a.name.split(".")[:2] == ["peerloom", "core"] and a.name.count(".") >= 2)
        graph[path.stem] = (found & modules) - {path.stem}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_core_import_graph_has_no_cycle():
    """Roles reach the engine through narrow interfaces (each role's and part's `*Services` Protocol, the
    engine's parts' host Protocols), never by
    importing engine.py; no import hides a cycle inside a function or under TYPE_CHECKING (spec/design.md §2)."""
    cycle = import_cycle(core_import_graph(ROOT / "core"))
    assert cycle is None, " -> ".join(cycle or [])


def test_no_core_module_is_over_600_lines():
    long = {p.name: n for p in sorted((ROOT / "core").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_CORE_MODULE_LINES}
    assert not long, long


def test_the_cycle_check_catches_hidden_cycles(tmp_path):
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from peerloom.core import c\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    (tmp_path / "d.py").write_text("from .a import A\n")
    graph = core_import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert import_cycle(graph) is None


def services_problems(folder: Path) -> list[str]:
    """What breaks the rule that each role, part of one and part of the engine sees only the engine members
    it uses: a `Services` class or import (the one protocol of every member, gone), an `engine` parameter
    not typed by a `*Services` or `*Host` Protocol, and a member such a Protocol declares itself that no
    module taking a parameter of its type (or of an heir's) reads."""
    trees = {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(folder.glob("*.py"))}
    problems: list[str] = []
    declared: dict[str, tuple[str, list[str]]] = {}  # protocol -> (module, the members it declares itself)
    users: dict[str, set[str]] = {}  # type -> modules with a parameter of that type
    read: dict[str, set[str]] = {}  # module -> attribute names read in it
    heirs: dict[str, set[str]] = {}  # protocol -> the protocols inheriting it
    for module, tree in trees.items():
        read[module] = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Services":
                problems.append(f"{module}: class Services")
            elif isinstance(node, ast.ImportFrom) and any(a.name == "Services" for a in node.names):
                problems.append(f"{module}: imports Services")
            elif (isinstance(node, ast.ClassDef) and node.name.endswith(("Services", "Host"))
                  and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)):
                members = [n.name for n in node.body if isinstance(n, ast.FunctionDef)]
                members += [n.target.id for n in node.body
                            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
                declared[node.name] = (module, members)
                for base in node.bases:
                    heirs.setdefault(ast.unparse(base), set()).add(node.name)
            elif isinstance(node, ast.arg) and node.annotation is not None:
                name = ast.unparse(node.annotation)
                if node.arg == "engine" and (name == "Services" or not name.endswith(("Services", "Host"))):
                    problems.append(f"{module}: engine: {name}")
                users.setdefault(name, set()).add(module)

    def family(protocol: str) -> set[str]:
        return {protocol}.union(*(family(heir) for heir in heirs.get(protocol, ())))

    for protocol, (module, members) in sorted(declared.items()):
        seen = set().union(*(read[m] for p in family(protocol) for m in users.get(p, ())))
        problems += [f"{module}: {protocol}.{member} unused" for member in members if member not in seen]
    return problems


def test_roles_and_their_parts_see_only_the_engine_members_they_use():
    """No role or part is typed against one protocol of every engine member (`Services`): each
    names the members it uses (spec/design.md §2), so what a role may touch cannot quietly grow back."""
    assert services_problems(ROOT / "core") == []


def test_the_services_check_catches_a_wide_protocol(tmp_path):
    (tmp_path / "roles.py").write_text("from typing import Protocol\nclass Services(Protocol):\n    now: float\n")
    (tmp_path / "a.py").write_text(
        "from typing import Protocol\nfrom .roles import Services\n"
        "class AServices(Protocol):\n    def log(self) -> None: ...\n    def send(self) -> None: ...\n"
        "class A:\n    def __init__(self, engine: AServices) -> None:\n        engine.log()\n"
        "class B:\n    def __init__(self, engine: Services) -> None:\n        pass\n")
    assert services_problems(tmp_path) == ["a: imports Services", "a: engine: Services",
                                           "roles: class Services", "a: AServices.send unused"]


def stated_test_homes(readme: Path) -> dict[str, list[str]]:
    """The rows `| core/x.py | tests/a.py, tests/b.py |` of tests/README.md: module -> its test files."""
    rows = re.findall(r"^\| (core/\w+\.py) \| ([^|]+) \|$", readme.read_text(), re.MULTILINE)
    return {module: [f.strip() for f in files.split(",")] for module, files in rows}


def modules_without_tests(root: Path) -> list[str]:
    """Every core/*.py with neither tests/core/test_<module>.py nor a row of tests/README.md, and every row
    that names a module or a test file that does not exist."""
    homes = stated_test_homes(root / "tests" / "README.md")
    missing = [f"core/{p.name}" for p in sorted((root / "core").glob("*.py"))
               if not (root / "tests" / "core" / f"test_{p.stem}.py").exists() and f"core/{p.name}" not in homes]
    stale = [f"{module}: {f}" for module, files in homes.items() for f in [module, *files] if not (root / f).exists()]
    return missing + stale


def test_every_core_module_has_a_test_file_or_a_stated_home():
    """A reader finds a core module's tests by its name, or in the table of tests/README.md."""
    assert modules_without_tests(ROOT) == []


def test_the_test_home_check_catches_a_module_without_tests(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "tests" / "core").mkdir(parents=True)
    for name in ("a", "b", "c"):
        (tmp_path / "core" / f"{name}.py").write_text("")
    (tmp_path / "tests" / "core" / "test_a.py").write_text("")
    (tmp_path / "tests" / "README.md").write_text("| module | tests |\n| --- | --- |\n"
                                                  "| core/b.py | tests/core/test_a.py |\n"
                                                  "| core/gone.py | tests/core/test_gone.py |\n")
    assert modules_without_tests(tmp_path) == ["core/c.py", "core/gone.py: core/gone.py",
                                               "core/gone.py: tests/core/test_gone.py"]
