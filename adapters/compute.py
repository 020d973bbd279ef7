"""Executes the engine's `RunTask` effects with a backend workload and the artifact store.

Task kinds and their results are documented on `peerloom.core.effects.RunTask`. Tensors cross the store
as safetensors bytes (never pickle); results name the artifacts they stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from peerloom.backends.numpy import reduce as np_reduce
from peerloom.backends.numpy.aggregate import aggregate
from peerloom.backends.numpy.screening import screen_delta
from peerloom.backends.numpy.tensors import from_safetensors, tensor_digest, to_safetensors
from peerloom.core.errors import DecodeError
from peerloom.core.objects import ArtifactRef, Manifest

from .storage import ArtifactStore


class ComputeExecutor:
    """Runs train / screen / reduce / evaluate tasks synchronously (hosts put it on a worker thread)."""

    def __init__(self, store: ArtifactStore, manifest: Manifest, workload: Any,
                 shards: Sequence[Sequence[int]]) -> None:
        self.store = store
        self.manifest = manifest
        self.workload = workload
        self.shards = shards

    def load(self, ref: ArtifactRef) -> dict[str, np.ndarray]:
        return from_safetensors(self.store.get(ref.digest))

    def save(self, tensors: dict[str, np.ndarray]) -> tuple[ArtifactRef, bytes]:
        return self.store.put(to_safetensors(tensors)), tensor_digest(tensors)

    def run(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run one task; raises on failure (the host turns that into TaskFailed)."""
        match kind:
            case "train":
                params = self.load(args["params"])
                indices = [i for s in args["shards"] for i in self.shards[s]]
                delta, metrics = self.workload.train(params, indices, args["seed"])
                ref, digest = self.save(delta)
                return {"delta": ref, "delta_digest": digest, "train_loss": float(metrics["train_loss"])}
            case "screen":
                try:
                    delta = self.load(args["delta"])
                except DecodeError:
                    return {"ok": False, "reason": "undecodable", "norm": float("nan")}
                ok, reason, norm = screen_delta(delta, self.manifest.schema)
                if ok and tensor_digest(delta) != args["delta_digest"]:
                    ok, reason = False, "digest-mismatch"
                return {"ok": ok, "reason": reason, "norm": norm}
            case "reduce":
                if args["outer_optimizer"] != "fedavg":
                    # DiLoCo needs its momentum committed in the head (issue 4); refuse rather than guess.
                    raise ValueError(f"outer optimizer {args['outer_optimizer']!r} is not supported yet")
                params = self.load(args["params"])
                deltas = [self.load(ref) for ref in args["deltas"]]
                centre = aggregate(args["rule"], deltas, args["weights"])
                new = np_reduce.outer_sgd_step(params, centre, args["outer_lr"])
                ref, digest = self.save(new)
                return {"params": ref, "params_digest": digest}
            case "evaluate":
                metrics = self.workload.evaluate(self.load(args["params"]))
                return {"loss": float(metrics["loss"]), "accuracy": float(metrics["accuracy"])}
        raise ValueError(f"unknown task kind {kind!r}")
