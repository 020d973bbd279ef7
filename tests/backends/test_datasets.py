"""The digits split's cache (backends/datasets.py): a cached split is the computed one byte for byte, a cache
file that does not check out is recomputed and rewritten, and a process that finds the cache never imports
scikit-learn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from peerloom.backends import datasets
from peerloom.backends.datasets import load_digits_split

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(datasets.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def same_bytes(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    return len(a) == len(b) == 4 and all(
        x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous and x.tobytes() == y.tobytes()
        for x, y in zip(a, b, strict=True))


def cache_file(cache: Path) -> Path:
    (path,) = cache.glob("digits-split-*.npz")  # one split, one file, no temporary file left behind
    assert not list(cache.glob(".*"))
    return path


def no_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("recomputed a split the cache holds")

    monkeypatch.setattr(datasets, "_compute_digits_split", fail)


@pytest.mark.parametrize(("seed", "test_fraction"), [(0, 0.25), (3, 0.1)])
def test_the_cached_split_is_the_computed_split_byte_for_byte(cache, monkeypatch, seed, test_fraction):
    computed = datasets._compute_digits_split(seed, test_fraction)
    assert same_bytes(load_digits_split(seed, test_fraction), computed)  # computed, then written
    path = cache_file(cache)
    no_recompute(monkeypatch)
    assert same_bytes(load_digits_split(seed, test_fraction), computed)  # read back
    assert cache_file(cache) == path


def test_each_seed_and_fraction_has_its_own_entry(cache):
    a, b, c = load_digits_split(0), load_digits_split(1), load_digits_split(0, 0.5)
    assert len(list(cache.glob("digits-split-*.npz"))) == 3
    assert not np.array_equal(a[1], b[1]) and len(c[0]) != len(a[0])
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_split(0, 1.0)


def corrupt_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def corrupt_a_flipped_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside x_train's pixels
    path.write_bytes(bytes(data))


def corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"not a cache file")


def corrupt_other_values(path: Path) -> None:
    """A well-formed npz whose pixels differ: zipfile's CRC holds, only the digest catches it."""
    with np.load(path) as npz:
        arrays = {name: npz[name] for name in npz.files}
    arrays["x_train"] = arrays["x_train"].copy()
    arrays["x_train"][0, 0] += 0.5
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def corrupt_missing_array(path: Path) -> None:
    with np.load(path) as npz:
        arrays = {name: npz[name] for name in npz.files if name != "y_test"}
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def corrupt_other_dtype(path: Path) -> None:
    with np.load(path) as npz:
        arrays = {name: npz[name] for name in npz.files}
    arrays["x_train"] = arrays["x_train"].astype(np.float64)
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def corrupt_other_key(path: Path) -> None:
    """Another split's whole, valid file under this split's name: its digest names the other key."""
    key = datasets._cache_key(1, 0.25)
    assert key is not None
    datasets._write_split(path, key, datasets._compute_digits_split(1, 0.25))


@pytest.mark.parametrize("corrupt", [corrupt_truncated, corrupt_a_flipped_byte, corrupt_garbage,
                                     corrupt_other_values, corrupt_missing_array, corrupt_other_dtype,
                                     corrupt_other_key])
def test_a_corrupt_cache_file_is_recomputed_and_rewritten_not_trusted(cache, monkeypatch, corrupt):
    computed = datasets._compute_digits_split(0, 0.25)
    load_digits_split(0, 0.25)
    path = cache_file(cache)
    corrupt(path)
    calls = []
    real = datasets._compute_digits_split
    monkeypatch.setattr(datasets, "_compute_digits_split", lambda *a: calls.append(a) or real(*a))
    assert same_bytes(load_digits_split(0, 0.25), computed)
    assert calls == [(0, 0.25)]
    assert cache_file(cache) == path
    no_recompute(monkeypatch)  # the rewritten file is good again
    assert same_bytes(load_digits_split(0, 0.25), computed)


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    monkeypatch.setenv(datasets.CACHE_DIR_ENV, str(blocker / "cache"))  # its parent is a file
    assert same_bytes(load_digits_split(0), datasets._compute_digits_split(0, 0.25))


def test_other_argument_types_are_not_cached(cache):
    computed = datasets._compute_digits_split(0, 0.25)
    assert same_bytes(load_digits_split(np.int64(0), np.float64(0.25)), computed)
    assert not cache.exists()


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(datasets.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert datasets.cache_dir() == tmp_path / "xdg" / "peerloom"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert datasets.cache_dir() == Path.home() / ".cache" / "peerloom"
    monkeypatch.setenv(datasets.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert datasets.cache_dir() == tmp_path / "mine"


def test_a_process_that_finds_the_cache_does_not_import_scikit_learn(cache):
    """The point of the cache: every node process of a fleet needs the split, only the first pays the
    second or so of importing scikit-learn and SciPy."""
    expected = load_digits_split(0)
    code = ("import sys, numpy as np; from peerloom.backends.datasets import load_digits_split; "
            "s = load_digits_split(0); print(sorted({'sklearn', 'scipy'} & set(sys.modules))); "
            "np.savez(sys.argv[1], *s)")
    out = subprocess.run([sys.executable, "-c", code, str(cache.parent / "got.npz")], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120).stdout
    assert out.strip() == "[]"
    with np.load(cache.parent / "got.npz") as got:
        assert same_bytes(tuple(got[f"arr_{i}"] for i in range(4)), expected)

