"""Stored tensors read and written block by block (backends/numpy/stored.py): the kernels give the
same bytes on file tensors as on arrays, the writer produces the library's safetensors bytes and the tensor
digest, and malformed files are refused with DecodeError."""

import tracemalloc
from contextlib import ExitStack

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerloom.adapters.compute import ComputeExecutor
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends._robust import BLOCK, RULES
from peerloom.backends.numpy.aggregate import aggregate, outer_step, screening_stats
from peerloom.backends.numpy.screening import READ_BLOCK, screen_stored
from peerloom.backends.numpy.stored import (
    FileTensor,
    TensorFileWriter,
    all_finite,
    open_stored,
    stored_digest,
)
from peerloom.backends.numpy.tensors import safetensors_views, schema_of, tensor_digest, to_safetensors
from peerloom.core.errors import DecodeError
from peerloom.core.objects import make_artifact_ref
from peerloom.core.tasks import ReduceTask
from tests.helpers import make_revision


def _file(tmp_path, tensors, name="t.safetensors"):
    path = tmp_path / name
    path.write_bytes(to_safetensors(tensors))
    return path


def _cohort(rng, n, sizes):
    return [{f"t{j}": rng.standard_normal(size).astype(np.float32) for j, size in enumerate(sizes)}
            for _ in range(n)]


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 7, BLOCK - 1, BLOCK + 3]), min_size=1, max_size=3),
       start=st.integers(0, 2 * BLOCK), length=st.integers(0, 2 * BLOCK))
def test_file_tensors_read_what_the_views_hold(tmp_path_factory, sizes, start, length):
    tensors = _cohort(np.random.default_rng(len(sizes)), 1, sizes)[0]
    path = _file(tmp_path_factory.mktemp("s"), tensors)
    views = safetensors_views(path.read_bytes())
    with open_stored(path) as stored:
        assert set(stored) == set(views)
        for name, view in views.items():
            flat = stored[name].reshape(-1)
            assert stored[name].shape == view.shape and stored[name].dtype == view.dtype
            assert np.array_equal(flat[start:start + length], view.reshape(-1)[start:start + length])
        assert stored_digest(stored) == tensor_digest(tensors)
        assert all(all_finite(t) for t in stored.values())


def test_a_file_tensor_is_never_loaded_whole_by_accident(tmp_path):
    with open_stored(_file(tmp_path, {"w": np.ones(10, np.float32)})) as stored:
        with pytest.raises(TypeError):
            np.asarray(stored["w"])
        with pytest.raises(TypeError):
            stored["w"].reshape(-1)[::2]


def test_non_finite_stored_values_are_found(tmp_path):
    w = np.ones(3 * BLOCK, np.float32)
    w[2 * BLOCK + 5] = np.nan
    with open_stored(_file(tmp_path, {"w": w})) as stored:
        assert not all_finite(stored["w"])
        assert screening_stats(stored)["finite"] is False


@pytest.mark.parametrize("sizes", [[0, 7], [BLOCK + 3], [READ_BLOCK + BLOCK + 5, 3],
                                   [2 * READ_BLOCK + 7, 5, READ_BLOCK + 1]])
def test_one_read_screen_gives_the_statistics_digest_and_update_applied(tmp_path, sizes):
    """`screen_stored`: what `screening_stats`, `stored_digest` and ``base - delta`` give, from one read."""
    rng = np.random.default_rng(len(sizes))
    delta, base = _cohort(rng, 2, sizes)
    with open_stored(_file(tmp_path, delta)) as stored:
        applied = {n: np.full_like(b, np.nan) for n, b in base.items()}
        stats, digest = screen_stored(stored, base=base, applied=applied)
        assert digest == stored_digest(stored) == tensor_digest(delta)
        expected = screening_stats(stored)
        assert stats == {"finite": True, "global_norm": expected["global_norm"]}
        assert stats["global_norm"] == screening_stats(delta)["global_norm"]
        for name in delta:
            assert np.array_equal(applied[name], np.subtract(base[name], delta[name], dtype=np.float32))
        assert screen_stored(stored) == (stats, digest)
    first = next(n for n in sorted(delta) if delta[n].size)
    delta[first].reshape(-1)[-1:] = np.nan  # the last element of a tensor (read last in its block)
    with open_stored(_file(tmp_path, delta, "nan.safetensors")) as stored:
        stats, digest = screen_stored(stored)
        assert stats["finite"] is False and stats["global_norm"] != stats["global_norm"]
        assert digest == tensor_digest(delta)
    delta[first].reshape(-1)[-1:] = np.float32(1.0)
    last = max(sorted(delta), key=lambda n: delta[n].size)
    for bad in (np.inf, -np.inf):  # finiteness is read off the squared norm: an infinity must show there too
        delta[last].reshape(-1)[delta[last].size // 2] = bad
        with open_stored(_file(tmp_path, delta, "inf.safetensors")) as stored:
            stats, digest = screen_stored(stored)
            assert stats["finite"] is False and stats["global_norm"] != stats["global_norm"]
            assert screening_stats(stored)["finite"] is False and digest == tensor_digest(delta)


def test_every_rule_and_outer_step_give_the_same_bytes_on_files(tmp_path):
    rng = np.random.default_rng(3)
    cohort = _cohort(rng, 5, [2 * BLOCK + 11, 5])
    cohort[4] = {k: v * 40 for k, v in cohort[4].items()}  # an outlier, so clipping and trimming bite
    weights = [3, 1, 2, 2, 1]
    stored = [open_stored(_file(tmp_path, m, f"m{i}")) for i, m in enumerate(cohort)]
    try:
        for rule in RULES:
            assert to_safetensors(aggregate(rule, stored, weights)) == \
                to_safetensors(aggregate(rule, cohort, weights)), rule
        params, state = cohort[0], {k: v * 0.1 for k, v in cohort[1].items()}
        grad = aggregate("mean", cohort, weights)
        expected_params, expected_state = outer_step("diloco", params, grad, state)
        files = {"p": open_stored(_file(tmp_path, params, "p")), "s": open_stored(_file(tmp_path, state, "s"))}
        schema = schema_of(params)
        written = {"p": bytearray(), "s": bytearray()}
        writers = {k: TensorFileWriter(schema, written[k].extend) for k in written}
        outer_step("diloco", files["p"], grad, files["s"], out=writers["p"].tensors, out_state=writers["s"].tensors)
        assert writers["p"].finish() == tensor_digest(expected_params)
        assert writers["s"].finish() == tensor_digest(expected_state)
        assert bytes(written["p"]) == to_safetensors(expected_params)
        assert bytes(written["s"]) == to_safetensors(expected_state)
        assert screening_stats(stored[4], reference=files["p"]) == screening_stats(cohort[4], reference=params)
    finally:
        for f in stored:
            f.close()


def test_the_writer_refuses_gaps_steps_back_and_short_output():
    schema = (("a", "float32", (10,)), ("b", "float32", (4,)))
    writer = TensorFileWriter(schema, lambda data: None)
    with pytest.raises(ValueError, match="out of order"):
        writer.tensors["b"].reshape(-1)[0:4]
    writer.tensors["a"].reshape(-1)[0:5][:] = 1
    with pytest.raises(ValueError, match="out of order"):
        writer.tensors["a"].reshape(-1)[6:10]
    with pytest.raises(ValueError, match="not written whole"):
        TensorFileWriter(schema, lambda data: None).finish()
    with pytest.raises(ValueError, match="several dtypes"):
        TensorFileWriter((("a", "float32", (1,)), ("b", "int64", (1,))), lambda data: None)


@pytest.mark.parametrize("damage", ["truncated", "short-prefix", "huge-header", "bad-json", "gap"])
def test_malformed_stored_files_are_refused(tmp_path, damage):
    data = to_safetensors({"a": np.ones(8, np.float32), "b": np.ones(4, np.float32)})
    header_len = int.from_bytes(data[:8], "little")
    match damage:
        case "truncated":
            data = data[:-4]
        case "short-prefix":
            data = data[:5]
        case "huge-header":
            data = (1 << 40).to_bytes(8, "little") + data[8:]
        case "bad-json":
            data = data[:8] + b"{" * header_len + data[8 + header_len:]
        case "gap":
            data = data + b"\0" * 4
    path = tmp_path / "bad"
    path.write_bytes(data)
    with pytest.raises(DecodeError):
        open_stored(path)


def test_a_streamed_diloco_reduce_holds_about_one_model_size(tmp_path):
    """The executor's reduce on the numpy backend reads its inputs and writes its outputs block by block:
    the Python-visible peak (tracemalloc, which numpy reports to) is about the aggregate alone, where loading
    params, state and deltas whole and building new params and state in memory took about 5x the model. Beside
    it, a few MiB that do not grow with the model: the kernel threads' workspaces and read buffers, and the
    span (`SPAN` elements) that each of the two streamed outputs is written from."""
    size = 1 << 22  # 16 MiB of float32 (the kernels' reused buffers, a few MiB, are small beside it)
    schema = (("w", "float32", (size,)),)
    manifest = attrs.evolve(make_revision(schema=schema).manifest, aggregation="centered_clip",
                            outer_optimizer="diloco")
    ex = ComputeExecutor(ArtifactStore(tmp_path, chunk_size=1 << 16), manifest, None, [])
    rng = np.random.default_rng(0)
    params = ex.save({"w": rng.standard_normal(size).astype(np.float32)})[0]
    state = ex.save({"w": rng.standard_normal(size).astype(np.float32)})[0]
    deltas = [ex.save({"w": rng.standard_normal(size).astype(np.float32)})[0] for _ in range(3)]
    task = ReduceTask(params=params, deltas=tuple(deltas), weights=(1, 1, 1), rule="centered_clip",
                      outer_optimizer="diloco", outer_lr=0.7, outer_momentum=0.9, outer_state=state,
                      norm_ratio=3.0, min_cosine=-1.0)
    tracemalloc.start()
    try:
        result = ex.run(task)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    model = 4 * size
    fixed = 8 << 20
    assert peak < 1.6 * model + fixed, (peak - fixed) / model
    # and the artifacts it streamed are the ones the in-memory path computes
    loaded = {k: ex.load(v) for k, v in (("p", params), ("s", state))}
    centre = aggregate("centered_clip", [ex.load(d) for d in deltas], [1, 1, 1])
    new, new_state = outer_step("diloco", loaded["p"], centre, loaded["s"], lr=0.7, momentum=0.9)
    assert result.params_digest == tensor_digest(new)
    assert result.outer_state_digest == tensor_digest(new_state)
    assert ex.store.get(result.params.digest) == to_safetensors(new)
    assert make_artifact_ref(ex.store.get(result.outer_state.digest), 1 << 16) == result.outer_state
    with ExitStack() as stack:
        assert isinstance(ex.open(params, stack)["w"], FileTensor)


def test_the_writer_thread_writes_in_order_never_from_a_refilled_buffer_and_reports_errors():
    """Blocks are hashed and written on the writer's thread; a slow `write` must still see every block in
    order with the bytes the kernel wrote (each sink alternates two buffers), and its error reaches `finish`."""
    import time

    from peerloom.backends._robust import SPAN

    rng = np.random.default_rng(4)
    params = {"a": rng.standard_normal(3 * SPAN + 7).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    grad = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    expected = outer_step("fedavg", params, grad, None, lr=0.5)[0]
    written = bytearray()

    def slow(data):
        time.sleep(0.01)  # the kernels run ahead and ask for the next blocks meanwhile
        written.extend(data)

    writer = TensorFileWriter(schema_of(params), slow)
    outer_step("fedavg", params, grad, None, lr=0.5, out=writer.tensors, threads=2)
    assert writer.finish() == tensor_digest(expected) and bytes(written) == to_safetensors(expected)

    calls = []

    def failing(data):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(28, "No space left on device")

    writer = TensorFileWriter(schema_of(params), failing)
    with pytest.raises(OSError, match="No space left"):
        outer_step("fedavg", params, grad, None, lr=0.5, out=writer.tensors)
        writer.finish()
    writer.close()
