"""What the HTTP edge serves a browser peer besides the protocol (spec/browser.md §2, §5): the training split
of a workload that can run in a browser, in shard order, so a lease is one range request per run of
consecutive shards, and the page's bundle (`web/dist`, built by `make web`).

A workload declares that it can run in a browser with a true ``browser`` attribute: `NumpyWorkload` (the
bundled digits and mnist1d workloads) does when the page's kernel implements its training (its docstring
says when), and it exposes ``sizes``, ``lr``, ``batch_size``, ``local_epochs``, ``inner_steps`` and its
training arrays. Anything else has no `BrowserData`, and the edge answers 404 (``not-browser-trainable``) to
`/train` and the data routes, saying why.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from peerloom.backends.workload import BrowserTrainable, has

WEB_DIST = Path(__file__).resolve().parents[1] / "web" / "dist"
"""Where `make web` writes the bundle (a source checkout); a wheel built after `make web` carries it under the
same relative path."""

BUNDLE_FILES = {"index.html": "text/html", "train.js": "text/javascript"}


class BrowserData:
    """The training split of `workload` as fixed-size records (float32 features little-endian, then the label
    as one byte), shard after shard in the order `shards` lists their samples; `index()` says where each
    shard starts and the hyper-parameters the page trains with."""

    def __init__(self, workload: Any, shards: Sequence[Sequence[int]], name: str) -> None:
        x = np.ascontiguousarray(workload.x_train, dtype="<f4")
        y = np.asarray(workload.y_train)
        if x.ndim != 2 or len(y) != len(x) or (len(y) and (y.min() < 0 or y.max() > 255)):
            raise ValueError("browser data needs x [n, d] and labels in 0..255")
        self.dim = int(x.shape[1])
        self.record_bytes = 4 * self.dim + 1
        order = np.asarray([i for shard in shards for i in shard], dtype=np.int64)
        records = np.zeros((len(order), self.record_bytes), dtype=np.uint8)
        records[:, : 4 * self.dim] = x[order].view(np.uint8).reshape(len(order), 4 * self.dim)
        records[:, -1] = y[order].astype(np.uint8)
        self.blob = records.tobytes()
        starts = np.cumsum([0, *(len(s) for s in shards)])
        self._index = {
            "workload": name, "dim": self.dim, "record_bytes": self.record_bytes,
            "shards": [[int(starts[i]), len(s)] for i, s in enumerate(shards)],
            "sizes": [int(s) for s in workload.sizes], "lr": float(workload.lr),
            "batch_size": int(workload.batch_size), "local_epochs": int(workload.local_epochs),
            "inner_steps": int(workload.inner_steps or 0),
        }

    def index(self) -> dict[str, Any]:
        return self._index

    @classmethod
    def of(cls, workload: Any, shards: Sequence[Sequence[int]], name: str) -> BrowserData | None:
        """The browser data of `workload`, or None when it does not declare that it can run in a browser."""
        if not has(workload, BrowserTrainable) or workload.browser is not True:
            return None
        try:
            return cls(workload, shards, name)
        except (ValueError, TypeError):
            return None
