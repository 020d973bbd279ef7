"""The wheel installs into a fresh virtual environment once per extra (base, torch, node, demo, dp), at the
lock's versions, and each extra's commands work there; a command whose extra is missing names it in one
line with exit status 2."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_WHEELS = Path("/opt/wheels")  # where this machine keeps the CPU wheel of torch the lock names

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    work = tmp_path_factory.mktemp("build")
    # Build from a copy so that build/ and *.egg-info never land in the checkout. The top-level dist/ (old
    # wheels) stays out; web/dist, the browser peer's bundle, goes in the wheel (pyproject package-data).
    src = work / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                  ".hypothesis", "peerloom-demo", "peerloom-sim", "node_modules", ".typecheck")
    shutil.copytree(ROOT, src, ignore=lambda d, names: skip(d, names) | ({"dist"} & set(names)
                                                                          if Path(d) == ROOT else set()))
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
                   check=True, capture_output=True, timeout=300)
    (found,) = out.glob("peerloom-*.whl")
    return found


@pytest.fixture(scope="module")
def constraints(tmp_path_factory) -> Path:
    """requirements/dev.lock without its hashes: the same versions, as constraints for one extra's install."""
    pins = re.findall(r"^([A-Za-z0-9_.\-]+==[^\s\\]+)", (ROOT / "requirements" / "dev.lock").read_text(), re.M)
    path = tmp_path_factory.mktemp("lock") / "constraints.txt"
    path.write_text("\n".join(pins) + "\n")
    return path


def _venv(tmp: Path, wheel: Path, constraints: Path, extra: str) -> Path:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv is in requirements/dev.lock"
    env_dir = tmp / f"venv-{extra or 'base'}"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(env_dir)], check=True, timeout=120)
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    links = ["--find-links", str(LOCAL_WHEELS)] if LOCAL_WHEELS.is_dir() else []
    subprocess.run([uv, "pip", "install", "--quiet", "--python", str(env_dir / "bin" / "python"), target,
                    "-c", str(constraints), *links], check=True, timeout=600)
    return env_dir / "bin"


def _clean_env() -> dict[str, str]:
    """This environment without what would make the fresh venv import another checkout of peerloom."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _peerloom(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "peerloom"), *args], capture_output=True, text=True, cwd=cwd,
                          env=_clean_env(), timeout=300)


def _names_extra(out: subprocess.CompletedProcess[str], extra: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'peerloom[{extra}]'" in lines[0], out.stderr


def _common(bin_dir: Path, cwd: Path) -> None:
    """What every install must do: help, a shipped simulation by name, and verify the chain it wrote."""
    for args in (["--help"], ["node", "--help"], ["sim", "--help"], ["verify", "--help"], ["inspect", "--help"]):
        out = _peerloom(bin_dir, cwd, *args)
        assert out.returncode == 0 and "usage: peerloom" in out.stdout, (args, out.stderr)
    sim = _peerloom(bin_dir, cwd, "sim", "happy", "--seed", "1", "--out", "sim-out", "--quiet")
    assert sim.returncode == 0 and sim.stdout.startswith("happy seed 1: 5 windows certified"), sim.stderr
    verify = _peerloom(bin_dir, cwd, "verify", "sim-out/chain")
    assert verify.returncode == 0 and "OK: 5 certified heads verified from genesis" in verify.stdout, verify.stdout
    (cwd / "node.toml").write_text('name = "n"\n')


DP_CHECK = """
from peerloom.privacy import DP, epsilon
from peerloom.workloads import torch_workload
import torch
eps = epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=100, delta=1e-5)
assert 1.0 < eps < 1.5, eps
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
w = torch_workload(model=lambda: torch.nn.Linear(4, 2), loss=torch.nn.functional.cross_entropy,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), train_data=(x, y), eval_data=(x, y),
                   batch_size=16, inner_steps=2,
                   privacy=DP(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, sample_rate=0.25))
delta, metrics = w.train(w.initial_params(0), list(range(64)), seed=1)
assert metrics["privacy_steps"] == 2
"""


BUNDLE = ("index.html", "train.js")
BUILT = all((ROOT / "web" / "dist" / f).is_file() for f in BUNDLE)


@pytest.mark.skipif(not BUILT, reason="the browser peer is not built here (make web): the wheel carries no bundle")
def test_the_wheel_carries_the_browser_peer_bundle(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"peerloom/web/dist/{f}" for f in BUNDLE} <= names
    assert not any(n.startswith("peerloom/web/") and n.endswith((".ts", ".mjs", ".json")) for n in names)


@pytest.mark.parametrize("extra", ["", "torch", "node", "demo", "dp"])
def test_each_extra_installs_alone_and_its_commands_work(tmp_path, wheel, constraints, extra):
    bin_dir = _venv(tmp_path, wheel, constraints, extra)
    _common(bin_dir, tmp_path)
    python = str(bin_dir / "python")
    has_plots = extra == "demo"
    assert (tmp_path / "sim-out" / "plots" / "loss.png").exists() == has_plots
    if extra in ("", "torch"):
        _names_extra(_peerloom(bin_dir, tmp_path, "node", "--config", "node.toml"), "node")
    if extra != "demo":
        _names_extra(_peerloom(bin_dir, tmp_path, "demo", "--out", "demo-out"), "demo")
    if extra == "torch":
        subprocess.run([python, "-c", "import peerloom.backends.torch.aggregate"], check=True, cwd=tmp_path,
                       env=_clean_env())
    if extra == "dp":  # the accountant and a DP-SGD step, with nothing but the [dp] extra
        subprocess.run([python, "-c", DP_CHECK], check=True, cwd=tmp_path, env=_clean_env())
    if extra == "":  # without it, the accountant says which extra to install, in one line
        out = subprocess.run([python, "-c", "from peerloom.privacy import epsilon\n"
                              "epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=1, delta=1e-5)"],
                             capture_output=True, text=True, cwd=tmp_path, env=_clean_env())
        assert out.returncode != 0 and "PrivacyUnavailable: differential privacy needs opacus: pip install " \
            "'peerloom[dp]'" in out.stderr.strip().splitlines()[-1], out.stderr
    if extra == "node" and BUILT:  # the installed edge finds the bundle it serves at /train
        subprocess.run([python, "-c", "from peerloom.adapters.edge_data import BUNDLE_FILES, WEB_DIST\n"
                        "assert all((WEB_DIST / f).is_file() for f in BUNDLE_FILES), WEB_DIST"],
                       check=True, cwd=tmp_path, env=_clean_env())
    if extra in ("node", "demo"):
        # the node extra gets past imports to the config check
        out = _peerloom(bin_dir, tmp_path, "node", "--config", "node.toml")
        assert out.returncode == 2 and "missing roles, key, manifest, authority, store" in out.stderr, out.stderr
    if extra == "demo":
        subprocess.run([python, "-c", "import peerloom.demo, sklearn, matplotlib, torch, trio"], check=True,
                       cwd=tmp_path, env=_clean_env())
        assert _peerloom(bin_dir, tmp_path, "demo", "--help").returncode == 0
