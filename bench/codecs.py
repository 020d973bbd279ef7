"""Update codecs: compression ratio, encode/decode speed, and what they cost in accuracy (spec/design.md §5).

Speed: one float32 tensor of `--size` elements (standard normal, seeded), every codec on the numpy and
torch backends; GB/s = input float32 bytes / seconds, median of `--repeats` timed calls after a warm-up.
Compression ratio = input bytes / encoded bytes (sum of the encoded tensors' raw bytes; the safetensors
header adds ~100 bytes per tensor on the wire). The `none` codec (a copy) is the baseline measured in the
same run.

Accuracy: in-process FedAvg on the bundled digits (`make_digits_workload`, the numpy backend's codecs and
weighted mean): `--trainers` trainers on fixed shards, `--windows` windows; every window each trainer
trains from the global params, encodes its pseudo-gradient (top-k and sign with error feedback: the trainer
keeps its residual across windows), the reducer decodes every delta and takes the shard-size-weighted
mean, and the outer step is SGD lr 1 (FedAvg). Same seeds for every codec, so `none` is the baseline.

At scale (`--scale-params`, default 100M float32 = 400 MB): the update a trainer sends each
window under fp32 (`none`), `int8` and `topk` with error feedback (the trainer's residual carried in, as
the executor does it), on the numpy backend the nodes' executor uses: ``update_bytes`` (the safetensors
artifact's size, what crosses the wire once per fetcher of the update: the validators and the reducer),
``ratio`` (fp32 bytes / update bytes) and the median seconds of `--repeats` encodes (including the
safetensors serialization the executor does before storing) and decodes (from the stored bytes), and
``encode_vs_fp32`` / ``decode_vs_fp32``: those times over fp32's in the same run.

Prints one JSON object on its last line:
``{"size", "codecs": [{"codec", "ratio", "error_feedback", "encode_gbps": {"numpy", "torch"},
"decode_gbps": {...}, "accuracy", "curve": [[windows done, accuracy], ...]}], "baseline_accuracy",
"topk_within_2_points": bool, "scale": {"params", "codecs": [{"codec", "update_bytes", "ratio", "encode_s",
"decode_s", "encode_vs_fp32", "decode_vs_fp32"}]}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from aggregate import timed  # bench/aggregate.py, beside this script (run as `python bench/codecs.py`)

from peerloom.backends.datasets import shard_indices
from peerloom.backends.numpy import codecs as nc
from peerloom.backends.numpy.aggregate import aggregate
from peerloom.backends.numpy.tensors import from_safetensors, to_safetensors
from peerloom.backends.torch import codecs as tc
from peerloom.backends.torch.models import make_digits_workload

FEEDBACK = ("topk", "sign")
"""Codecs that keep an error-feedback residual in the accuracy run (biased compressors need it)."""


def speed(codec: str, x: np.ndarray, repeats: int, fraction: float) -> dict[str, Any]:
    gb = x.nbytes / 1e9
    tx = torch.from_numpy(x)
    enc, _ = nc.encode(codec, {"w": x}, fraction=fraction)
    tenc = {k: torch.from_numpy(v) for k, v in enc.items()}
    return {
        "ratio": x.nbytes / sum(v.nbytes for v in enc.values()),
        "encode_gbps": {
            "numpy": gb / timed(lambda: nc.encode(codec, {"w": x}, fraction=fraction), repeats),
            "torch": gb / timed(lambda: tc.encode(codec, {"w": tx}, fraction=fraction), repeats),
        },
        "decode_gbps": {
            "numpy": gb / timed(lambda: nc.decode(codec, enc), repeats),
            "torch": gb / timed(lambda: tc.decode(codec, tenc), repeats),
        },
    }


SCALE_CODECS = ("none", "int8", "topk")


def at_scale(params: int, repeats: int, fraction: float, seed: int) -> dict[str, Any]:
    """Update bytes and encode/decode seconds at `params` float32 parameters (module docstring)."""
    x = {"w": np.random.default_rng(seed).standard_normal(params, dtype=np.float32)}
    schema = (("w", "float32", (params,)),)
    rows = []
    for codec in SCALE_CODECS:
        state = nc.zeros_state(x) if codec in FEEDBACK else None
        encode_s, decode_s = [], []
        data = b""
        for _ in range(repeats):
            started = time.perf_counter()
            encoded, _ = nc.encode(codec, x, state, fraction=fraction) if codec != "none" else (x, None)
            data = to_safetensors(encoded)
            encode_s.append(time.perf_counter() - started)
            del encoded
            started = time.perf_counter()
            tensors = from_safetensors(data)
            if codec != "none":
                tensors = nc.decode(codec, tensors, schema=schema)
            decode_s.append(time.perf_counter() - started)
            del tensors
        rows.append({"codec": codec, "update_bytes": len(data), "ratio": round(4 * params / len(data), 2),
                     "encode_s": round(statistics.median(encode_s), 4),
                     "decode_s": round(statistics.median(decode_s), 4)})
        del data, state
    for row in rows:
        row["encode_vs_fp32"] = round(row["encode_s"] / rows[0]["encode_s"], 2)
        row["decode_vs_fp32"] = round(row["decode_s"] / rows[0]["decode_s"], 2)
    return {"params": params, "codecs": rows}


def fedavg_accuracy(
    codec: str, windows: int, trainers: int, fraction: float, seed: int
) -> tuple[float, list[tuple[int, float]]]:
    """Final test accuracy and the curve ``[(windows done, accuracy), ...]`` (8 points)."""
    workload = make_digits_workload(seed=seed, num_threads=1)
    shards = shard_indices(workload.num_train, trainers, seed)
    params = workload.initial_params(seed)
    feedback = codec in FEEDBACK
    states: list[Any] = [nc.zeros_state(params) if feedback else None for _ in range(trainers)]
    schema = tuple((n, "float32", p.shape) for n, p in sorted(params.items()))
    curve: list[tuple[int, float]] = []
    for window in range(windows):
        decoded = []
        for t, shard in enumerate(shards):
            delta, _ = workload.train(params, shard, seed * 1_000_003 + window * 1009 + t)
            enc, states[t] = nc.encode(codec, delta, states[t], fraction=fraction)
            decoded.append(nc.decode(codec, enc, schema=schema))
        mean = aggregate("mean", decoded, [len(s) for s in shards])
        params = {n: np.subtract(p, mean[n], dtype=np.float32) for n, p in params.items()}
        if (window + 1) % max(1, windows // 8) == 0 or window == windows - 1:
            curve.append((window + 1, float(workload.evaluate(params)["accuracy"])))
    return curve[-1][1], curve


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    parser.add_argument("--size", type=int, default=4_000_000, help="float32 elements of the speed tensor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--windows", type=int, default=80,
                        help="FedAvg windows (top-k 1%% + error feedback trails ~15 points after 10, ~3 after 20-40)")
    parser.add_argument("--trainers", type=int, default=6)
    parser.add_argument("--fraction", type=float, default=0.01, help="top-k kept share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale-params", type=int, default=100_000_000,
                        help="float32 parameters of the at-scale section (0: skip it)")
    parser.add_argument("--scale-only", action="store_true", help="run only the at-scale section")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats, args.windows, args.trainers = 50_000, 2, 2, 2
        args.scale_params = min(args.scale_params, 200_000)
    if args.scale_only:
        report = {"scale": at_scale(args.scale_params, args.repeats, args.fraction, args.seed)}
        print(json.dumps(report))
        return report
    torch.set_num_threads(1)
    x = np.random.default_rng(args.seed).standard_normal(args.size, dtype=np.float32)
    rows = []
    for codec in nc.CODECS:
        row = {"codec": codec, **speed(codec, x, args.repeats, args.fraction), "error_feedback": codec in FEEDBACK}
        row["accuracy"], row["curve"] = fedavg_accuracy(codec, args.windows, args.trainers, args.fraction, args.seed)
        rows.append(row)
        print(f"{codec:5s} ratio {row['ratio']:6.1f}  encode np {row['encode_gbps']['numpy']:6.2f} "
              f"torch {row['encode_gbps']['torch']:6.2f} GB/s  decode np {row['decode_gbps']['numpy']:6.2f} "
              f"torch {row['decode_gbps']['torch']:6.2f} GB/s  accuracy {row['accuracy']:.4f}", flush=True)
    base = rows[0]["accuracy"]
    topk = next(r for r in rows if r["codec"] == "topk")["accuracy"]
    report = {
        "size": args.size,
        "windows": args.windows,
        "trainers": args.trainers,
        "topk_fraction": args.fraction,
        "codecs": rows,
        "baseline_accuracy": base,
        "topk_within_2_points": bool(topk >= base - 0.02),
    }
    if args.scale_params:
        report["scale"] = at_scale(args.scale_params, args.repeats, args.fraction, args.seed)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
