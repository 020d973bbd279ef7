"""SHA-256 (hashlib) against BLAKE3 (the `blake3` package) for chunk digests and artifact ids
(bench/README.md "Hashing").

What the protocol hashes (spec/wire.md §5): every artifact in chunks of the revision's `chunk_size` (1 MiB
at scale), each chunk on receipt, and the artifact id over the chunk digests; the tensor digest is one more
pass over the whole artifact. Measured on one seeded random buffer of `--size` bytes:

* ``chunks``: each 1 MiB chunk hashed alone (a fresh hasher per chunk), as chunk digests are: SHA-256,
  BLAKE3 on one thread (``max_threads=1``), BLAKE3 multithreaded inside each chunk
  (``max_threads=blake3.AUTO``), and both hashers over a thread pool of `--threads` threads taking whole
  chunks (hashlib and blake3 release the GIL), the way a node could hash chunks arriving in parallel.
* ``whole``: the buffer as one message (a tensor digest; BLAKE3's own tree mode): SHA-256, BLAKE3 on one
  thread and BLAKE3 multithreaded.

The baseline is SHA-256 on one thread in the same run and mode; every figure is the median of
`--repeats` timed passes after one warm-up. Prints one JSON object on its last line:
``{"load": [1, 5, 15 min before, after], "cpu": {...}, "results": [{"mode", "hasher", "threads", "seconds",
"mb_per_s", "speedup"}]}`` (speedup: SHA-256's seconds / this one's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np

CHUNK = 1 << 20


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {flag: flag in flags for flag in ("sha_ni", "avx2", "avx512f")}


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=400_000_000, help="bytes hashed per pass (an artifact)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="thread pool over chunks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats = 8 * CHUNK + 5, 1
    before = loadavg()
    data = memoryview(np.random.default_rng(args.seed).bytes(args.size))
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]

    def sha256_chunk(chunk: memoryview) -> bytes:
        return hashlib.sha256(chunk).digest()

    def blake3_chunk(chunk: memoryview) -> bytes:
        return blake3.blake3(chunk, max_threads=1).digest()

    def blake3_chunk_auto(chunk: memoryview) -> bytes:
        return blake3.blake3(chunk, max_threads=blake3.blake3.AUTO).digest()

    pool = ThreadPoolExecutor(args.threads)
    cases: list[tuple[str, str, int, Callable[[], object]]] = [
        ("chunks", "sha256", 1, lambda: [sha256_chunk(c) for c in chunks]),
        ("chunks", "blake3", 1, lambda: [blake3_chunk(c) for c in chunks]),
        ("chunks", "blake3", 0, lambda: [blake3_chunk_auto(c) for c in chunks]),
        ("chunks", "sha256", args.threads, lambda: list(pool.map(sha256_chunk, chunks))),
        ("chunks", "blake3", args.threads, lambda: list(pool.map(blake3_chunk, chunks))),
        ("whole", "sha256", 1, lambda: hashlib.sha256(data).digest()),
        ("whole", "blake3", 1, lambda: blake3.blake3(data, max_threads=1).digest()),
        ("whole", "blake3", 0, lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()),
    ]
    results = []
    baseline: dict[str, float] = {}
    for mode, hasher, threads, fn in cases:
        seconds = timed(fn, args.repeats)
        if hasher == "sha256" and threads == 1:
            baseline[mode] = seconds
        row = {"mode": mode, "hasher": hasher, "threads": threads or "auto", "seconds": seconds,
               "mb_per_s": len(data) / seconds / 1e6, "speedup": baseline[mode] / seconds}
        results.append(row)
        print(f"{mode:6s} {hasher:6s} threads={row['threads']!s:4s} {seconds:8.3f} s {row['mb_per_s']:8.0f} MB/s "
              f"{row['speedup']:5.2f}x SHA-256", flush=True)
    pool.shutdown()
    report = {"size": len(data), "chunk": CHUNK, "repeats": args.repeats, "pool_threads": args.threads,
              "cpus": os.cpu_count(), "cpu": cpu_flags(), "blake3": blake3.__version__,
              "load": [before, loadavg()], "results": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
