"""`ComputeExecutor.run_timed` (adapters/compute.py): a train task's parts, as the runtime's ``task-done`` line
carries them and bench/window.py reports them (``train_parts``)."""

import time

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends.numpy.tensors import to_safetensors
from peerloom.backends.registry import build_workload
from peerloom.core.tasks import EvaluateTask, TrainTask
from tests.engine_cluster import N_SHARDS, SEED
from tests.helpers import make_revision

WAIT_S = 0.2


def test_a_train_task_times_its_start_training_and_store_and_other_tasks_name_no_parts(tmp_path, monkeypatch):
    workload, shards = build_workload("digits-numpy", SEED, N_SHARDS)
    params = workload.initial_params(SEED)
    rev = make_revision(schema=tuple((k, "float32", v.shape) for k, v in params.items()))
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 16), rev.manifest, workload, shards)
    params_ref = ex.store.put(to_safetensors(params))
    train = workload.train

    def slow(*args, **kwargs):  # the workload's training takes at least WAIT_S
        time.sleep(WAIT_S)
        return train(*args, **kwargs)

    monkeypatch.setattr(workload, "train", slow)
    began = time.perf_counter()
    result, parts = ex.run_timed(TrainTask(params=params_ref, shards=(1,), seed=1, inner_steps=0))
    took = time.perf_counter() - began
    assert set(parts) == {"start", "training", "store"}
    assert parts["training"] >= WAIT_S and all(v >= 0.0 for v in parts.values())
    assert sum(parts.values()) <= took and ex.store.has(result.delta.digest)
    # the parts are the last task's: an evaluate task names none
    metrics, none = ex.run_timed(EvaluateTask(params=params_ref))
    assert none == {} and metrics.metrics
