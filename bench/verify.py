"""Verification cost per update, as a fraction of that update's training (spec/protocol.md §6, §6.1-6.3).

Real training through the real executor tasks (`peerloom.adapters.compute.ComputeExecutor.run`, an on-disk
`ArtifactStore`, as a node runs them), at two model sizes of the numpy MLP on digits (and the torch digits
MLP when `TorchWorkload.train` takes ``checkpoints=``), with a deployment's settings: DiLoCo inner steps
H, batch 32, one shard per lease, segment audits with S segments, audit rate p, a loss check on k samples.
Per repetition, on fresh seeds (so no artifact is deduplicated by the store):

- ``workload_train``: `workload.train` alone (no executor, no store), for reference;
- ``train``: the plain train task (no segments); ``train_segments``: with ``segments = S`` (the trainer
  stores S whole training states and a trajectory: its extra cost of committing);
- ``audit_full``: the ``audit`` task replaying the whole training (today's inline audit, and §6.2's
  sampled audit without segments); per auditor 1.0 of training by construction, measured as a check;
- ``screen`` without and with ``loss_check`` (§6.1); the loss check's cost is their difference;
- ``segment_audit``: ``audit-plan`` plus the ``audit`` task with a ``segment`` (§6.3), the segment picked
  by `audit_segment` from a per-repetition head id, as a validator picks it;
- ``segment_replay``: `workload.resume` of that segment alone (the replay the audit cannot avoid, about
  1/S of training; the rest of ``segment_audit`` is reading and checking checkpoints and comparing).

Figures are medians over `--repeats` repetitions after one warm-up repetition. The headline clock is
``time.process_time`` (CPU seconds of this process: steadier than wall time on a loaded shared machine);
the same fractions from ``time.perf_counter`` (wall, which also counts fsync waits) are under ``wall``.
BLAS and torch run one thread (``--threads``), so CPU time is compute, not spinning pool threads.

Fractions (of ``train_s``; per auditor unless named ``fleet``):
``full_replay`` = audit_full / train; ``loss_check`` = (screen with it - screen) / train;
``segment_audit`` = per audited update; ``segment_audit_expected`` = p x segment_audit;
``new_scheme`` = loss_check + p x segment_audit (target <= 0.10, ``met``); ``segment_replay`` and
``new_scheme_replay_only`` (loss_check + p x segment_replay): the floor without the audit's overheads;
``sampled_full_replay`` = p x full_replay. ``auditors`` = validators + reducers: today every one of them
replays every update (``inline_per_update`` = auditors x full_replay, fleet-wide); under the new scheme
every auditor runs the loss check and only validators audit (``fleet_new``).

Prints progress to stderr and one JSON object on its last stdout line. ``--quick``: a tiny configuration
for the test suite (tests/e2e/test_bench_verify.py).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

TARGET = 0.10


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, CPU seconds, wall seconds) of one call."""
    c, w = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - w


def fractions(t: dict[str, float], p: float, auditors: int, validators: int) -> dict[str, float]:
    """The report's fractions from median task seconds `t` (one clock)."""
    train = t["train"]
    full = t["audit_full"] / train
    loss = (t["screen_loss_check"] - t["screen"]) / train
    segment = t["segment_audit"] / train
    return {
        "commit_overhead": t["train_segments"] / train - 1.0,
        "full_replay": full,
        "inline_per_update": auditors * full,
        "loss_check": loss,
        "segment_audit": segment,
        "segment_audit_expected": p * segment,
        "new_scheme": loss + p * segment,
        "segment_replay": t["segment_replay"] / train,
        "new_scheme_replay_only": loss + p * t["segment_replay"] / train,
        "sampled_full_replay": p * full,
        "fleet_new": auditors * loss + validators * p * segment,
    }


def measure(name: str, backend: str, workload: Any, shards: list[list[int]], args: argparse.Namespace,
            repeats: int) -> dict[str, Any]:
    """Time every task of one update's life on `workload`; the per-size result dict."""
    import attrs

    from peerloom.adapters.compute import ComputeExecutor
    from peerloom.adapters.storage import ArtifactStore
    from peerloom.core.audit import audit_segment, loss_batch_seed, segment_bounds, train_seed
    from peerloom.core.identity import Identity
    from peerloom.core.objects import Manifest, make_artifact_ref
    from peerloom.core.tasks import (
        AuditPlanTask,
        AuditTask,
        LossCheck,
        Recomputation,
        ScreenTask,
        SegmentAudit,
        TrainTask,
    )

    validators = [Identity((1_000_000 + i).to_bytes(4, "big") * 8) for i in range(args.validators)]
    author = Identity((7).to_bytes(4, "big") * 8).peer_id
    params = workload.initial_params(args.seed)
    schema = tuple((n, "float32", tuple(t.shape)) for n, t in sorted(params.items()))
    genesis = make_artifact_ref(b"bench-verify genesis", 1 << 20)
    manifest = Manifest(
        experiment="bench-verify", workload="digits-numpy", workload_seed=args.seed, schema=schema,
        shards=tuple(len(s) for s in shards), validators=tuple(v.peer_id for v in validators),
        quorum=len(validators) // 3 * 2 + 1, window_s=30.0, min_updates=1, max_capacity=4, aggregation="mean",
        outer_optimizer="diloco", outer_lr=0.7, chunk_size=1 << 20, genesis_params=genesis,
        genesis_params_digest=genesis.digest, roster=((author, 1),))
    manifest = attrs.evolve(manifest, inner_steps=args.inner_steps, audit=True, audit_rate=args.audit_rate,
                            audit_segments=args.segments, loss_check_samples=args.loss_samples)
    bounds = segment_bounds(args.inner_steps, args.segments)
    n_params = sum(int(t.size) for t in params.values())
    lease = (0,)
    times: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        ex = ComputeExecutor(ArtifactStore(tmp, chunk_size=1 << 20), manifest, workload, shards)
        params_ref = ex.save(params)[0]

        def repetition(r: int) -> None:  # repetition 0 warms up
            def run(key: str, fn: Callable[[], Any]) -> Any:
                out, cpu, wall = timed(fn)
                if r:
                    times.setdefault(key, []).append((cpu, wall))
                return out

            base = hashlib.sha256(b"bench-verify/base" + r.to_bytes(4, "big")).digest()
            seed_plain = train_seed(base, 1, lease, author)
            seed = train_seed(base, 2, lease, author)
            indices = [i for s in lease for i in shards[s]]
            run("workload_train", lambda: workload.train(params, indices, seed_plain, inner_steps=args.inner_steps))
            plain = run("train", lambda: ex.run(TrainTask(params=params_ref, shards=lease, seed=seed_plain,
                                                          inner_steps=args.inner_steps, author=author)))
            out = run("train_segments", lambda: ex.run(TrainTask(
                params=params_ref, shards=lease, seed=seed, inner_steps=args.inner_steps,
                segments=args.segments, author=author)))
            screen = ScreenTask(delta=out.delta, delta_digest=out.delta_digest)
            check = LossCheck(params=params_ref, shards=lease, seed=loss_batch_seed(base + out.delta.digest),
                              samples=args.loss_samples, min_drop=0.0)
            screened = run("screen", lambda: ex.run(screen))
            checked = run("screen_loss_check", lambda: ex.run(attrs.evolve(screen, loss_check=check)))
            audit = Recomputation(params=params_ref, shards=lease, seed=seed, inner_steps=args.inner_steps,
                                  min_cosine=0.99)
            full = run("audit_full", lambda: ex.run(AuditTask(delta=out.delta, audit=audit)))
            j = audit_segment(base, out.delta.digest, args.segments)

            def segment_audit() -> Any:
                planned = ex.run(AuditPlanTask(trajectory=out.trajectory, segment=j, segments=args.segments))
                if planned.plan is None:
                    return planned
                return ex.run(AuditTask(delta=out.delta, audit=audit, segment=SegmentAudit(
                    plan=planned.plan, from_step=bounds[j], to_step=bounds[j + 1])))

            seg = run("segment_audit", segment_audit)
            plan = ex.run(AuditPlanTask(trajectory=out.trajectory, segment=j, segments=args.segments)).plan
            start_state = params if plan.start is None else ex.load(plan.start)
            run("segment_replay", lambda: workload.resume(dict(start_state), indices, seed,
                                                          inner_steps=args.inner_steps, start=bounds[j],
                                                          stop=bounds[j + 1]))
            verdicts = {"screen": screened.ok, "loss_check": checked.ok, "audit_full": full.ok,
                        "segment_audit": seg.ok}
            if not all(verdicts.values()):
                raise SystemExit(f"{name}: an honest update failed a check: {verdicts} {checked} {full} {seg}")
            ex.store.remove([plain.delta.digest, *out.committed, out.delta.digest])
            if r:
                log(f"  {name} rep {r}/{repeats}: " + ", ".join(
                    f"{k} {v[-1][0] * 1e3:.1f}" for k, v in times.items()) + " ms CPU (segment "
                    f"{j}, steps {bounds[j]}..{bounds[j + 1]})")

        for r in range(repeats + 1):
            repetition(r)
    cpu = {k: statistics.median(c for c, _ in v) for k, v in times.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in times.items()}
    auditors = args.validators + args.reducers
    result: dict[str, Any] = {
        "name": name, "backend": backend, "params": n_params,
        "workload_train_s": cpu["workload_train"], "train_s": cpu["train"],
        "train_segments_s": cpu["train_segments"], "audit_full_s": cpu["audit_full"],
        "screen_s": cpu["screen"], "screen_loss_check_s": cpu["screen_loss_check"],
        "loss_check_s": cpu["screen_loss_check"] - cpu["screen"], "segment_audit_s": cpu["segment_audit"],
        "segment_replay_s": cpu["segment_replay"],
        "auditors": auditors,
    }
    result.update(fractions(cpu, args.audit_rate, auditors, args.validators))
    result["met"] = result["new_scheme"] <= TARGET
    result["wall"] = {**{f"{k}_s": v for k, v in wall.items()},
                      **fractions(wall, args.audit_rate, auditors, args.validators)}
    result["wall"]["met"] = result["wall"]["new_scheme"] <= TARGET
    result["spread_cpu_s"] = {k: [min(c for c, _ in v), max(c for c, _ in v)] for k, v in times.items()}
    return result


def torch_support() -> str | None:
    """None when `TorchWorkload` can commit and replay segments (train takes checkpoints=, resume, loss);
    else why not."""
    try:
        from peerloom.backends.torch.workload import TorchWorkload
    except ImportError as e:
        return f"torch not importable: {e}"
    if "checkpoints" not in inspect.signature(TorchWorkload.train).parameters:
        return "TorchWorkload.train takes no checkpoints= yet"
    missing = [m for m in ("resume", "loss") if not hasattr(TorchWorkload, m)]
    return f"TorchWorkload has no {', '.join(missing)}" if missing else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny configuration (for tests)")
    parser.add_argument("--hidden", default="1024,1024;2048,2048",
                        help="numpy MLP hidden widths per size, sizes separated by ';' (default "
                             "'1024,1024;2048,2048': 1.1M and 4.3M parameters)")
    parser.add_argument("--inner-steps", type=int, default=64, help="DiLoCo H (default 64)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--segments", type=int, default=16, help="audit_segments S (default 16)")
    parser.add_argument("--audit-rate", type=float, default=0.5, help="audit_rate p (default 0.5)")
    parser.add_argument("--loss-samples", type=int, default=64, help="loss_check_samples k (default 64)")
    parser.add_argument("--shards", type=int, default=8, help="shards of digits' 1347 samples; a lease is one")
    parser.add_argument("--validators", type=int, default=4)
    parser.add_argument("--reducers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per size (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS / torch threads (default 1)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch digits MLP")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.inner_steps, args.segments, args.repeats = "16;32,32", 4, 2, 1
        args.loss_samples, args.no_torch = 16, True
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # read when numpy's BLAS loads: numpy is imported below
    start = time.perf_counter()
    load_before = os.getloadavg()

    from peerloom.backends.datasets import shard_indices
    from peerloom.backends.numpy.workload import make_digits_numpy_workload

    sizes = [tuple(int(h) for h in s.split(",")) for s in args.hidden.split(";") if s]
    configs: list[tuple[str, str, Callable[[], Any]]] = []
    for hidden in sizes:
        def make(hidden: tuple[int, ...] = hidden) -> Any:
            from peerloom.backends.numpy.workload import NumpyWorkload
            w = make_digits_numpy_workload(args.seed, batch_size=args.batch)
            return NumpyWorkload((w.x_train, w.y_train), (w.x_eval, w.y_eval), sizes=(64, *hidden, 10),
                                 batch_size=args.batch)
        configs.append((f"numpy digits 64-{'-'.join(map(str, hidden))}-10", "numpy", make))
    torch_skipped = "--no-torch" if args.no_torch else torch_support()
    if torch_skipped is None:
        def make_torch() -> Any:
            from peerloom.backends.torch.models import make_digits_workload
            return make_digits_workload(args.seed, batch_size=args.batch, hidden=128, num_threads=args.threads)
        configs.append(("torch digits 64-128-10", "torch", make_torch))
    else:
        log(f"torch digits MLP skipped: {torch_skipped}")
    results = []
    for name, backend, make in configs:
        workload = make()
        shards = shard_indices(workload.num_train, args.shards, args.seed)
        log(f"{name}: H={args.inner_steps} batch={args.batch} S={args.segments} p={args.audit_rate} "
            f"k={args.loss_samples}, lease {len(shards[0])} samples, {args.repeats} repetitions")
        r = measure(name, backend, workload, shards, args, args.repeats)
        log(f"{name} ({r['params']:,} params): train {r['train_s'] * 1e3:.1f} ms CPU, with segments "
            f"{r['train_segments_s'] * 1e3:.1f} ms (+{r['commit_overhead']:.1%}); full replay {r['full_replay']:.3f}, "
            f"loss check {r['loss_check']:.4f}, segment audit {r['segment_audit']:.4f} (x p = "
            f"{r['segment_audit_expected']:.4f}; replay alone {r['segment_replay']:.4f}); "
            f"new scheme {r['new_scheme']:.4f} "
            f"({'met' if r['met'] else 'NOT met'}, target <= {TARGET}); sampled whole replay "
            f"{r['sampled_full_replay']:.3f}; inline today {r['inline_per_update']:.2f} (x{r['auditors']} auditors)")
        results.append(r)
    report = {
        "clock": "process_time",
        "settings": {"inner_steps": args.inner_steps, "batch": args.batch, "segments": args.segments,
                     "audit_rate": args.audit_rate, "loss_check_samples": args.loss_samples,
                     "shards": args.shards, "validators": args.validators, "reducers": args.reducers,
                     "repeats": args.repeats, "threads": args.threads},
        "target": TARGET,
        "results": results,
        "torch_skipped": torch_skipped,
        "met": all(r["met"] for r in results),
        "load_avg": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "wall_s": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
