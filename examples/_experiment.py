"""The experiment the three ``embed_engine_*`` examples share (not an example of its own).

It plays the experiment authority once: identities, the initial parameters of the bundled digits model
(pure numpy), the signed revision manifest with one validator (quorum 1) and two rostered trainers, and the
genesis params in the validator's store. Each example can then stay on what it shows: driving the engine.
"""

import tempfile
from pathlib import Path

from peerloom.adapters.keys import generate_identity
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.objects import Manifest, Revision, make_artifact_ref

NAMES = ("validator", "trainer-1", "trainer-2")


def digits_experiment(name: str):
    """``(root, revision, identities, workload, shards)``: a fresh directory for the nodes' stores, the
    verified revision, an identity per name in `NAMES`, and the workload with its 4 shards."""
    root = Path(tempfile.mkdtemp(prefix=f"peerloom-{name}-"))
    workload, shards = build_workload("digits-numpy", 0, 4)
    params = workload.initial_params(0)
    genesis = to_safetensors(params)
    ids = {n: generate_identity() for n in (*NAMES, "authority")}
    manifest = Manifest(
        experiment=name, workload="digits-numpy", workload_seed=0, schema=schema_of(params),
        shards=tuple(len(s) for s in shards), validators=(ids["validator"].peer_id,), quorum=1, window_s=2.0,
        min_updates=1, max_capacity=4, aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0,
        chunk_size=1 << 16, genesis_params=make_artifact_ref(genesis, 1 << 16),
        genesis_params_digest=tensor_digest(params),
        roster=tuple(sorted((ids[t].peer_id, 1) for t in NAMES[1:])))
    revision = Revision.verify(manifest.seal(ids["authority"]), ids["authority"].peer_id)
    ArtifactStore(root / "validator", chunk_size=manifest.chunk_size).put(genesis)  # before its engine starts
    return root, revision, ids, workload, shards
