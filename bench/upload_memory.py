"""Upload memory benchmark (spec/transport.md §5): N concurrent maximum-size uploads to an HTTP edge, and the
edge process's peak RSS increase against the bound the edge documents; print one JSON object on the last
line.

    python bench/upload_memory.py [--uploads 6] [--upload-bytes 67108864] [--max-concurrent 4]
                                  [--budget-bytes B] [--seed 1] [--quick]

The edge (`adapters.http_edge.EdgeServer` over an `InMemoryEdgeView` whose artifacts live in a temporary
directory) runs in a child process of its own, so the RSS figures are the server's alone. Its limits:
``max_upload_bytes`` = --upload-bytes, ``max_concurrent_uploads`` = --max-concurrent and
``upload_memory_bytes`` = --budget-bytes (default: max-concurrent x upload-bytes, the edge's own default
ratio). The client builds one validly signed update from a leaseholder whose request body is exactly
--upload-bytes long (the largest the edge takes), warms the edge up with one small upload, and then sends
it from --uploads threads at once; an upload answered 503 (no upload slot or no room in the memory budget)
is sent again after its Retry-After, so every upload ends stored. The child samples its VmRSS every 2 ms
and also reads VmHWM, reset just before the uploads start through /proc/self/clear_refs where the kernel
allows it.

Output keys: uploads, upload_bytes (the body of each), accepted (202 answers), refused_503 (503 answers,
each retried), stored (updates the view recorded), bound_bytes (the edge's documented bound on what
uploads hold in memory: `EdgeLimits.upload_memory_bytes` plus `UPLOAD_BUFFER_BYTES` for each upload being
received), budget_bytes, baseline_rss_bytes (the child's RSS just before the uploads),
peak_rss_increase_bytes (peak RSS during the uploads minus that baseline), ratio (increase / bound;
at most 1 is the target) and seconds (wall time of the uploads). `--quick`: 6 uploads of 8 MiB.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from peerloom.core.encoding import content_id, encode
from peerloom.core.identity import Identity
from peerloom.core.objects import Manifest, Revision, UpdateAnnouncement, make_artifact_ref, seal

HOST = "127.0.0.1"
MiB = 1 << 20
GENESIS = b"genesis params of the upload benchmark"


def _identity(seed: int, n: int) -> Identity:
    return Identity(random.Random(seed * 1000 + n).randbytes(32))


def _revision(seed: int) -> tuple[Revision, Identity]:
    """A one-validator revision whose one trainer leases every shard of window 1."""
    authority, validator, trainer = (_identity(seed, n) for n in (1, 2, 3))
    ref = make_artifact_ref(GENESIS, 64 * 1024)
    manifest = Manifest(
        experiment="upload-memory", workload="digits-mlp", workload_seed=0, schema=(("w", "float32", (2,)),),
        shards=(10, 10), validators=(validator.peer_id,), quorum=1, window_s=5.0, min_updates=1, max_capacity=4,
        aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0, chunk_size=64 * 1024, genesis_params=ref,
        genesis_params_digest=ref.digest, roster=((trainer.peer_id, 1),))
    return Revision.verify(manifest.seal(authority), authority.peer_id), trainer


def _status(name: str) -> int:
    """A `/proc/self/status` figure in bytes (VmRSS, VmHWM); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _server(seed: int, limits_kw: dict, conn) -> None:
    """Child process: serve the edge, report its port, then measure RSS between "start" and "stop"."""
    from prometheus_client import CollectorRegistry

    from peerloom.adapters.http_edge import EdgeLimits, EdgeServer
    from peerloom.testing import InMemoryEdgeView

    revision, _ = _revision(seed)
    with tempfile.TemporaryDirectory(prefix="peerloom-upload-bench-") as tmp:
        view = InMemoryEdgeView(identity_peer=revision.manifest.validators[0], revision=revision,
                                registry=CollectorRegistry(), artifacts_dir=Path(tmp) / "artifacts")
        view.put_artifact(GENESIS)
        limits = EdgeLimits(rate=100_000, burst=100_000, **limits_kw)
        with EdgeServer(view, limits=limits) as server:
            conn.send(server.port)
            assert conn.recv() == "start"
            baseline = _status("VmRSS")
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
                hwm_reset = True
            except OSError:
                hwm_reset = False
            peak = [baseline]
            done = threading.Event()

            def sample() -> None:
                while not done.wait(0.002):
                    peak[0] = max(peak[0], _status("VmRSS"))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            conn.send("measuring")
            assert conn.recv() == "stop"
            done.set()
            sampler.join()
            top = max(peak[0], _status("VmHWM") if hwm_reset else 0)
            conn.send({"baseline": baseline, "peak": top, "stored": len(view.updates),
                       "bound": limits.memory_bound_bytes, "budget": limits.upload_memory_bytes})


def _get_json(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise SystemExit(f"GET {path}: {resp.status} {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def _body(port: int, trainer: Identity, size: int, seed: int) -> bytes:
    """A signed update of the leaseholder whose request body is exactly `size` bytes."""
    lease = _get_json(port, f"/v1/leases/{trainer.peer_id.to_text()}")
    if not lease["shards"]:
        raise SystemExit(f"the trainer holds no lease: {lease}")
    revision_id = bytes.fromhex(_get_json(port, "/v1/manifest")["revision"])
    artifact_size = max(0, size - 1024)
    for _ in range(6):  # the envelope's size hardly moves with the artifact's: this converges in two rounds
        artifact = random.Random(seed).randbytes(artifact_size)
        ann = UpdateAnnouncement(revision=revision_id, window=lease["window"], base=bytes.fromhex(lease["base"]),
                                 shards=tuple(lease["shards"]), delta=make_artifact_ref(artifact, 64 * 1024),
                                 delta_digest=content_id(artifact), train_loss=0.5)
        body = encode({"envelope": seal(trainer, ann).to_bytes(), "artifact": artifact})
        if len(body) == size:
            return body
        artifact_size = max(0, artifact_size + size - len(body))
    raise SystemExit(f"could not build a body of exactly {size} bytes")


def _upload(port: int, body: memoryview, deadline: float) -> tuple[int, int]:
    """POST `body` until it is not answered 503 (waiting each Retry-After); (final status, 503 answers)."""
    refused = 0
    while True:
        conn = http.client.HTTPConnection(HOST, port, timeout=120)
        try:
            conn.request("POST", "/v1/updates", body=body, headers={"Content-Type": "application/cbor"})
            resp = conn.getresponse()
            resp.read()
            status, retry = resp.status, resp.getheader("Retry-After", "1")
        finally:
            conn.close()
        if status != 503 or time.monotonic() > deadline:
            return status, refused
        refused += 1
        time.sleep(float(retry) if retry.isdigit() else 1.0)


def run(uploads: int, upload_bytes: int, max_concurrent: int, budget_bytes: int, seed: int) -> dict:
    limits_kw = {"max_upload_bytes": upload_bytes, "max_concurrent_uploads": max_concurrent,
                 "upload_memory_bytes": budget_bytes}
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(seed, limits_kw, child))
    proc.start()
    try:
        port = parent.recv()
        _, trainer = _revision(seed)
        # One small upload first, so that the figure leaves out what the first request costs once (imports,
        # the executor's first thread) and the allocator's mmap threshold stays below the measured bodies.
        warm = _body(port, trainer, min(upload_bytes, 64 * 1024), seed)
        if _upload(port, memoryview(warm), time.monotonic() + 60)[0] != 202:
            raise SystemExit("the warm-up upload was not accepted")
        body = memoryview(_body(port, trainer, upload_bytes, seed))
        parent.send("start")
        assert parent.recv() == "measuring"
        results: list[tuple[int, int]] = []
        barrier = threading.Barrier(uploads)
        deadline = time.monotonic() + 300

        def one() -> None:
            barrier.wait()
            results.append(_upload(port, body, deadline))

        threads = [threading.Thread(target=one) for _ in range(uploads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        parent.send("stop")
        report = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    increase = max(0, report["peak"] - report["baseline"])
    return {"uploads": uploads, "upload_bytes": upload_bytes, "accepted": sum(s == 202 for s, _ in results),
            "refused_503": sum(r for _, r in results), "stored": report["stored"] - 1,
            "bound_bytes": report["bound"], "budget_bytes": report["budget"],
            "baseline_rss_bytes": report["baseline"], "peak_rss_increase_bytes": increase,
            "ratio": round(increase / report["bound"], 4), "seconds": round(seconds, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploads", type=int, default=6, help="concurrent uploads")
    parser.add_argument("--upload-bytes", type=int, default=64 * MiB,
                        help="request body of each upload, also the edge's max_upload_bytes")
    parser.add_argument("--max-concurrent", type=int, default=4, help="the edge's max_concurrent_uploads")
    parser.add_argument("--budget-bytes", type=int, default=None,
                        help="the edge's upload_memory_bytes (default: max-concurrent x upload-bytes)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="6 uploads of 8 MiB")
    args = parser.parse_args(argv)
    if args.quick:
        args.uploads, args.upload_bytes = 6, 8 * MiB
    if args.uploads < 1 or args.max_concurrent < 1 or args.upload_bytes < 64 * 1024:
        parser.error("--uploads and --max-concurrent must be at least 1, --upload-bytes at least 65536")
    budget = args.budget_bytes if args.budget_bytes is not None else args.max_concurrent * args.upload_bytes
    if budget < args.upload_bytes:
        parser.error("--budget-bytes must hold at least one upload")
    report = run(args.uploads, args.upload_bytes, args.max_concurrent, budget, args.seed)
    print(f"{report['accepted']}/{args.uploads} uploads of {args.upload_bytes} bytes accepted "
          f"({report['refused_503']} answers 503, retried); peak RSS +{report['peak_rss_increase_bytes'] / MiB:.1f}"
          f" MiB against a bound of {report['bound_bytes'] / MiB:.1f} MiB", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
