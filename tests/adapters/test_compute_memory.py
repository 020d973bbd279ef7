"""What a `ComputeExecutor` (adapters/compute.py) keeps between tasks (spec/design.md §5, Memory): the params
`load_params` mapped stay for the next task of the same head and go as soon as an eager start is computed
(it takes their place); an evaluation keeps nothing; a loss check keeps no start."""

import numpy as np

from bench.window import FlatWorkload
from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.numpy.tensors import to_safetensors
from peerloom.core.tasks import EagerStart, EvaluateTask
from tests.helpers import make_revision


def test_kept_params_go_when_a_start_is_computed(tmp_path):
    rng = np.random.default_rng(3)
    head, newer, prior = ({"w": rng.standard_normal(1000).astype(np.float32)} for _ in range(3))
    rev = make_revision(schema=(("w", "float32", (1000,)),))
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 12), rev.manifest, FlatWorkload(1000, 4), [])
    head_ref, newer_ref, prior_ref = (ex.store.put(to_safetensors(t)) for t in (head, newer, prior))
    start = EagerStart(prior=prior_ref, outer_state=None, scale=0.0)
    evaluated = ex.run(EvaluateTask(params=head_ref))  # a head's evaluation maps its params for itself only
    assert evaluated.metrics["loss"] == float(np.dot(head["w"], head["w"])) / 1000 and ex._params is None

    assert np.array_equal(ex.load_params(head_ref)["w"], head["w"])
    kept = ex._params
    assert kept is not None and kept[0] == head_ref.digest
    assert ex.run(EvaluateTask(params=head_ref)) == evaluated and ex._params is kept  # kept ones are used
    same = ex.start_params(head_ref, start)  # the same head's: let go of all the same (the start replaces them)
    assert ex._params is None and np.array_equal(same["w"], head["w"] - prior["w"])
    ex.load_params(head_ref)
    other = ex.start_params(newer_ref, start)  # another head: the kept ones are let go (a model size of RSS)
    assert ex._params is None
    assert np.array_equal(other["w"], (newer["w"].astype(np.float64) - prior["w"]).astype(np.float32))


def test_a_streamed_loss_check_holds_no_start_and_gives_the_whole_starts_verdict_and_bytes(tmp_path, monkeypatch):
    """A screen's loss check of an overlapped update (spec/protocol.md §6.1, §5.2) on a store that streams reads
    its base block by block (`loss_base`: `StartTensor` over the head's params, momentum and the prior), so the
    executor keeps no model-size start; the losses, the verdict and the update applied are the bytes of the
    start computed whole (`start_params`)."""
    from peerloom.adapters.compute import StartTensor, eager_start
    from peerloom.backends.numpy.tensors import tensor_digest
    from peerloom.core.tasks import LossCheck, ScreenTask

    size = (1 << 20) + 77  # more than one read block
    rng = np.random.default_rng(11)
    params, state, prior = ({"w": (rng.standard_normal(size) * s).astype(np.float32)} for s in (1.0, 0.01, 0.01))
    rev = make_revision(schema=(("w", "float32", (size,)),))
    store = ArtifactStore(tmp_path, chunk_size=1 << 16)
    shards = [[i] for i in range(4)]
    streamed, whole = (ComputeExecutor(store, rev.manifest, FlatWorkload(size, 4), shards) for _ in range(2))
    monkeypatch.setattr(whole, "_streams", lambda: False)
    params_ref, state_ref, prior_ref = (store.put(to_safetensors(t)) for t in (params, state, prior))
    start = EagerStart(prior=prior_ref, outer_state=state_ref, scale=0.9)
    expected_start = eager_start(params, state, prior, 0.9)
    delta = {"w": (expected_start["w"] * np.float32(0.01)).astype(np.float32)}  # downhill for the flat loss
    task = ScreenTask(delta=store.put(to_safetensors(delta)), delta_digest=tensor_digest(delta),
                      loss_check=LossCheck(params=params_ref, shards=(1,), seed=5, samples=1, min_drop=0.0,
                                           start=start))

    results = [ex.run(task) for ex in (streamed, whole)]
    assert results[0] == results[1] and results[0].ok and "applied" in results[0].detail
    assert streamed._start is None and whole._start is not None  # only the whole path kept a start
    assert streamed._scratch is not None and whole._scratch is not None
    assert streamed._scratch["w"].tobytes() == whole._scratch["w"].tobytes()  # the opposite side, same bytes

    with __import__("contextlib").ExitStack() as stack:
        blocks = streamed.loss_base(task.loss_check, stack)["w"]
        assert isinstance(blocks, StartTensor) and blocks.shape == (size,)
        pieces = [blocks.reshape(-1)[i:i + 300_001].copy() for i in range(0, size, 300_001)]
        assert np.concatenate(pieces).tobytes() == expected_start["w"].tobytes()
