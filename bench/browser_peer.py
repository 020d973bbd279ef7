"""Throughput of the browser peer's training kernel (web/src/mlp.ts, under node's V8, the engine of Chromium)
against the native numpy trainer on the same workload: the digits MLP 64-128-10, Adam, batch 32, over the
whole training split (1347 samples), 3 epochs. Prints one JSON line. Needs node and the `make web` build.

    python -m bench.browser_peer
"""

from __future__ import annotations

import json
import time

import numpy as np


def main() -> None:
    from peerloom.backends.numpy.workload import make_digits_numpy_workload
    from tests.web.webbuild import node_driver

    epochs = 3
    workload = make_digits_numpy_workload(seed=0, local_epochs=epochs)
    x, y = workload.x_train, workload.y_train
    params = workload.initial_params(0)
    start = time.perf_counter()
    workload.train(params, list(range(len(x))), 1)
    native = len(x) * epochs / (time.perf_counter() - start)
    browser = node_driver({"op": "bench", "sizes": [64, 128, 10], "rows": len(x), "epochs": epochs, "batch_size": 32,
                           "x": np.ascontiguousarray(x, dtype="<f4").tobytes().hex(),
                           "y": y.astype(np.uint8).tobytes().hex()}, timeout=600)
    print(json.dumps({"workload": "digits 64-128-10, batch 32, Adam", "samples": len(x), "epochs": epochs,
                      "native_numpy_samples_per_s": round(native), "browser_kernel_samples_per_s":
                      round(browser["samples_per_s"]), "ratio": round(browser["samples_per_s"] / native, 3)}))


if __name__ == "__main__":
    main()
