"""Datasets that ship with the install (spec/design.md §8): scikit-learn's bundled 8x8 digits, no network.

Digits: 1797 grey-scale 8x8 images of the digits 0-9 (the UCI "Optical Recognition of Handwritten
Digits" test set, bundled with scikit-learn as ``sklearn.datasets.load_digits``).

Importing scikit-learn (and the SciPy it pulls in) takes about a second, which every node process of a fleet
would pay at start-up for one small split. So `load_digits_split` keeps each split it computes in a cache
directory (`cache_dir`), keyed by its arguments and the installed scikit-learn and numpy versions, and later
processes read it back without importing scikit-learn. A cache file that does not check out (its digest, its
arrays' names, dtypes and shapes) is recomputed and rewritten, never trusted; a cache that cannot be written
only makes the next process slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

import numpy as np

from .sharding import shards_for

CACHE_DIR_ENV = "PEERLOOM_CACHE_DIR"
_SPLIT_NAMES = ("x_train", "y_train", "x_test", "y_test")

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def cache_dir() -> Path:
    """Where peerloom caches what it derives from installed data: ``$PEERLOOM_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/peerloom``, else ``~/.cache/peerloom``. Deleting it is always safe."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "peerloom"


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> Split:
    """``(x_train, y_train, x_test, y_test)`` from the bundled digits, split stratified by label.

    x: float32 ``[n, 64]``, pixel values scaled from 0..16 to 0..1; y: int64 ``[n]``, labels 0..9. The
    split is a pure function of (`seed`, `test_fraction`); with the defaults it is 1347 train / 450 test.
    Read from the cache (`cache_dir`) when an earlier call computed it with the same scikit-learn and numpy;
    the arrays are the same bytes either way.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    # Only plain ints and floats are keyed: another type (a numpy scalar, None) reaches scikit-learn as it is.
    if type(seed) is not int or type(test_fraction) is not float:
        return _compute_digits_split(seed, test_fraction)
    key = _cache_key(seed, test_fraction)
    if key is None:
        return _compute_digits_split(seed, test_fraction)
    path = cache_dir() / f"digits-split-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"
    cached = _read_split(path, key)
    if cached is not None:
        return cached
    split = _compute_digits_split(seed, test_fraction)
    _write_split(path, key, split)
    return split


def _compute_digits_split(seed: int, test_fraction: float) -> Split:
    """The split itself, from scikit-learn (imported here: it is the slow part)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y, shuffle=True
    )
    return (
        np.ascontiguousarray(x_train),
        np.ascontiguousarray(y_train),
        np.ascontiguousarray(x_test),
        np.ascontiguousarray(y_test),
    )


def _cache_key(seed: int, test_fraction: float) -> str | None:
    """What the split depends on, as text: the arguments and the installed versions (read from the package
    metadata, without importing scikit-learn); None when scikit-learn's version cannot be read."""
    try:
        versions = importlib.metadata.version("scikit-learn"), importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return None
    return f"digits-split v1 seed={seed} test_fraction={test_fraction!r} scikit-learn={versions[0]} numpy={versions[1]}"


def _digest(key: str, arrays: Split) -> str:
    h = hashlib.sha256(key.encode())
    for name, a in zip(_SPLIT_NAMES, arrays, strict=True):
        h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _read_split(path: Path, key: str) -> Split | None:
    """The split cached at `path` for `key`, or None when there is none or it does not check out."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if sorted(npz.files) != sorted((*_SPLIT_NAMES, "digest")):
                return None
            x_train, y_train, x_test, y_test = (npz[name] for name in _SPLIT_NAMES)
            digest = str(npz["digest"])
    except Exception:  # missing, torn (zipfile's CRC check), not an npz, pickled: alike
        return None
    split = (x_train, y_train, x_test, y_test)
    for x, y in ((x_train, y_train), (x_test, y_test)):
        if x.dtype != np.float32 or y.dtype != np.int64 or x.ndim != 2 or y.shape != x.shape[:1]:
            return None
    if not all(a.flags.c_contiguous for a in split) or digest != _digest(key, split):
        return None
    return split


def _write_split(path: Path, key: str, split: Split) -> None:
    """Store `split` at `path` atomically (a temporary file in the same directory, then a rename), so a
    concurrent reader sees no file or a whole one; an error (read-only or full disk) leaves no cache."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            x_train, y_train, x_test, y_test = split
            np.savez(fh, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                     digest=np.array(_digest(key, split)))
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass  # the next process computes the split again
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def shard_indices(n: int, num_shards: int, seed: int) -> list[list[int]]:
    """A seeded permutation of ``range(n)`` cut into `num_shards` contiguous, near-equal shards: the same
    function as `peerloom.backends.sharding.shards_for` (which documents it; kept under this name for the
    bundled workloads). Raises ValueError unless ``1 <= num_shards <= n``.
    """
    return shards_for(n, num_shards, seed)
