"""Small builders shared by tests: identities, a manifest, a revision."""

from peerloom.core.identity import Identity
from peerloom.core.objects import Manifest, Revision, make_artifact_ref


def ident(n: int) -> Identity:
    return Identity(bytes([n]) * 32)


def make_revision(*, validators=None, quorum=1, trainers=(), shards=(10, 10, 10, 10), window_s=5.0,
                  min_updates=1, genesis=b"genesis params", schema=(("w", "float32", (2,)),),
                  authority=None, chunk_size=64 * 1024, params_digest=None) -> Revision:
    authority = authority or ident(200)
    validators = validators or (ident(1),)
    ref = make_artifact_ref(genesis, chunk_size)
    manifest = Manifest(
        experiment="test", workload="digits-mlp", workload_seed=0, schema=tuple(schema), shards=tuple(shards),
        validators=tuple(v.peer_id for v in validators), quorum=quorum, window_s=window_s,
        min_updates=min_updates, max_capacity=4, aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0,
        chunk_size=chunk_size, genesis_params=ref, genesis_params_digest=params_digest or ref.digest,
        roster=tuple(sorted((t.peer_id, 1) for t in trainers)))
    return Revision.verify(manifest.seal(authority), authority.peer_id)
