"""DESIGN §1 layer rules, checked on the source with the ast module.

(import-linter cannot resolve our `package-dir` mapping of top-level folders into `peerloom.*`, so this
test is the "equivalent test" DESIGN §1 allows.) Purity of core/ beyond imports — no clocks, OS
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
    "backends": ({"numpy", "torch", "safetensors", "sklearn", "attrs"}, {"core", "backends"},
                 {"socket", "asyncio"}),
    # Adapters talk to the outside world through well-kept libraries: cryptography's ChaCha20-Poly1305 for
    # Noise, aiohttp for the HTTP edge, prometheus-client for metrics, zeroconf for LAN discovery.
    "adapters": ({"trio", "aiohttp", "zeroconf", "numpy", "attrs", "nacl", "cbor2", "torch", "cryptography",
                  "prometheus_client"},
                 {"core", "backends", "adapters"}, set()),
    "sim": ({"numpy", "attrs", "torch", "matplotlib"}, {"core", "backends", "adapters", "sim"}, set()),
}
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
