"""The kernels on N threads give the bytes of one thread (spec/design.md §5 "Threads never change the bytes"):
every aggregation rule, both outer optimizers with their state, the screening statistics and the streamed
reduce, in memory and on stored files; and the partitions the threads use tile the work."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from itertools import pairwise

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peerloom.adapters.compute import ComputeExecutor, default_compute_threads
from peerloom.adapters.storage import ArtifactStore
from peerloom.backends import _robust
from peerloom.backends._robust import (
    BLOCK,
    CC_BLOCK,
    INLINE_WORK,
    MAX_THREADS,
    RULES,
    SPAN,
    Workspace,
    lane_stripe,
    span_part,
)
from peerloom.backends.numpy.aggregate import NUMPY_OPS, aggregate, outer_step, screening_stats
from peerloom.backends.numpy.reduce import outer_sgd_step, weighted_mean
from peerloom.backends.numpy.screening import screen_stored
from peerloom.backends.numpy.stored import TensorFileWriter, open_stored
from peerloom.backends.numpy.tensors import schema_of, tensor_digest, to_safetensors
from peerloom.backends.torch import aggregate as torch_aggregate
from peerloom.core.tasks import ReduceTask
from tests.helpers import make_revision

THREADS = (2, 3)
SIZES = [0, 1, 7, BLOCK - 1, BLOCK + 3, 2 * BLOCK + 11]


def raw(d: dict) -> list:
    return [(k, np.asarray(d[k]).dtype.name, np.asarray(d[k]).shape, np.asarray(d[k]).tobytes()) for k in sorted(d)]


def cohort(rng: np.random.Generator, n: int, sizes: list[int]) -> tuple[list[dict], list[int]]:
    """`n` members of float32 tensors of `sizes`, magnitudes spread over decades, the last an outlier (so
    clipping, trimming and Krum's selection bite), and a duplicate (Krum's exact fallback)."""
    members = [{f"t{j}": (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
                for j, size in enumerate(sizes)} for _ in range(n)]
    members[-1] = {k: v * 30 for k, v in members[-1].items()}
    if n > 3:
        members[1] = {k: v.copy() for k, v in members[0].items()}
    return members, [int(w) for w in rng.integers(1, 50, n)]


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=3), n=st.integers(1, 7),
       seed=st.integers(0, 2**32 - 1), threads=st.sampled_from(THREADS))
def test_every_rule_outer_step_and_statistic_gives_one_threads_bytes(sizes, n, seed, threads):
    members, weights = cohort(np.random.default_rng(seed), n, sizes)
    for rule in RULES:
        assert raw(aggregate(rule, members, weights, threads=threads)) == raw(aggregate(rule, members, weights)), rule
    params, grad, state = members[0], members[-1], members[(n - 1) // 2]
    for name in ("fedavg", "diloco"):
        for momentum, buf in ((0.0, None), (0.9, None), (0.9, state)):
            one = outer_step(name, params, grad, buf, momentum=momentum)
            many = outer_step(name, params, grad, buf, momentum=momentum, threads=threads)
            assert raw(one[0]) == raw(many[0]) and (one[1] is None) == (many[1] is None)
            assert one[1] is None or raw(one[1]) == raw(many[1])
    assert raw(weighted_mean(members, weights, threads=threads)) == raw(weighted_mean(members, weights))
    assert raw(outer_sgd_step(params, grad, 0.7, threads=threads)) == raw(outer_sgd_step(params, grad, 0.7))
    assert repr(screening_stats(params, reference=grad, centre=state, threads=threads)) == \
        repr(screening_stats(params, reference=grad, centre=state))


@pytest.mark.parametrize("n", [3, 16, 33])  # 33: order statistics by sorting instead of the network
def test_large_cohorts_span_several_parallel_steps(n):
    """Tensors longer than a span, so each thread gets several runs of blocks and Gram products to add."""
    size = SPAN + BLOCK + 5 if n < 33 else 2 * BLOCK + 3
    members, weights = cohort(np.random.default_rng(n), n, [size, 5])
    for rule in RULES:
        one = raw(aggregate(rule, members, weights))
        for threads in THREADS:
            assert raw(aggregate(rule, members, weights, threads=threads)) == one, (rule, threads)


def test_torch_runs_the_same_threaded_kernels_with_the_same_bytes():
    members, weights = cohort(np.random.default_rng(5), 5, [2 * BLOCK + 11, 3])
    tensors = [{k: torch.from_numpy(v.copy()) for k, v in m.items()} for m in members]
    for rule in RULES:
        expected = raw(aggregate(rule, members, weights))
        got = torch_aggregate.aggregate(rule, tensors, weights, threads=2)
        assert raw({k: v.numpy() for k, v in got.items()}) == expected, rule
    new, state = torch_aggregate.outer_step("diloco", tensors[0], tensors[1], tensors[2], threads=3)
    ref_new, ref_state = outer_step("diloco", members[0], members[1], members[2])
    assert raw({k: v.numpy() for k, v in new.items()}) == raw(ref_new)
    assert raw({k: v.numpy() for k, v in state.items()}) == raw(ref_state)


def _file(tmp_path, tensors, name):
    path = tmp_path / name
    path.write_bytes(to_safetensors(tensors))
    return path


def test_stored_inputs_and_streamed_outputs_give_the_same_bytes_on_any_thread_count(tmp_path):
    """Threads slice one stored tensor at their own offsets, and fill one streamed output's span in parts
    that are written, and hashed, in order."""
    members, weights = cohort(np.random.default_rng(9), 5, [SPAN + 3 * BLOCK + 7, 5])
    params, state = members[0], {k: v * 0.1 for k, v in members[2].items()}
    grad = aggregate("mean", members, weights)
    expected = outer_step("diloco", params, grad, state)
    with ExitStack() as stack:
        stored = [stack.enter_context(open_stored(_file(tmp_path, m, f"m{i}"))) for i, m in enumerate(members)]
        files = {k: stack.enter_context(open_stored(_file(tmp_path, t, k))) for k, t in (("p", params), ("s", state))}
        for threads in (1, *THREADS):
            for rule in RULES:
                assert raw(aggregate(rule, stored, weights, threads=threads)) == \
                    raw(aggregate(rule, members, weights)), (rule, threads)
            written = {"p": bytearray(), "s": bytearray()}
            writers = {k: TensorFileWriter(schema_of(params), written[k].extend) for k in written}
            outer_step("diloco", files["p"], grad, files["s"], out=writers["p"].tensors,
                       out_state=writers["s"].tensors, threads=threads)
            assert writers["p"].finish() == tensor_digest(expected[0])
            assert writers["s"].finish() == tensor_digest(expected[1])
            assert bytes(written["p"]) == to_safetensors(expected[0])
            assert bytes(written["s"]) == to_safetensors(expected[1])
            assert repr(screening_stats(stored[4], reference=files["p"], threads=threads)) == \
                repr(screening_stats(members[4], reference=params))
            applied = {k: np.empty_like(v) for k, v in params.items()}
            stats, digest = screen_stored(stored[3], base=params, applied=applied, threads=threads)
            assert digest == tensor_digest(members[3])
            assert stats["global_norm"] == screening_stats(members[3])["global_norm"]
            assert raw(applied) == raw({k: params[k] - members[3][k] for k in params})


def test_the_executor_reduces_to_the_same_artifacts_on_one_and_two_threads(tmp_path):
    size = SPAN + BLOCK + 3
    schema = (("w", "float32", (size,)),)
    manifest = attrs.evolve(make_revision(schema=schema).manifest, aggregation="centered_clip",
                            outer_optimizer="diloco")
    store = ArtifactStore(tmp_path, chunk_size=1 << 16)
    ex = {t: ComputeExecutor(store, manifest, None, [], compute_threads=t) for t in (1, 2)}
    assert ex[2].compute.threads == 2
    rng = np.random.default_rng(0)
    save = ex[1].save
    params, state = (save({"w": rng.standard_normal(size).astype(np.float32)})[0] for _ in range(2))
    deltas = [save({"w": rng.standard_normal(size).astype(np.float32)})[0] for _ in range(3)]
    args = {"params": params, "deltas": tuple(deltas), "weights": (1, 2, 1), "outer_optimizer": "diloco",
            "outer_lr": 0.7, "outer_momentum": 0.9, "outer_state": state, "norm_ratio": 3.0, "min_cosine": 0.0}
    for rule in ("centered_clip", "krum", "median"):
        one, two = (ex[t].run(ReduceTask(**args, rule=rule)) for t in (1, 2))
        assert one == two, rule
    assert 1 <= default_compute_threads() <= MAX_THREADS
    with pytest.raises(ValueError, match="compute threads must be in"):
        ComputeExecutor(store, manifest, None, [], compute_threads=0)


def test_lane_stripes_and_span_parts_tile_their_range():
    for threads in range(1, MAX_THREADS + 1):
        stripes = [lane_stripe(k, threads) for k in range(threads)]
        assert stripes[0][0] == 0 and stripes[-1][1] == BLOCK
        assert all(a[1] == b[0] for a, b in pairwise(stripes))
        assert all(lo % _robust.LANE_ALIGN == 0 and lo <= hi for lo, hi in stripes)
        for start, end, unit in ((0, SPAN, BLOCK), (SPAN, 2 * SPAN + 5, BLOCK), (7, 7, BLOCK), (0, 9, CC_BLOCK),
                                 (SPAN, SPAN + 3 * CC_BLOCK + 1, CC_BLOCK)):
            parts = [span_part(start, end, k, threads, unit) for k in range(threads)]
            assert parts[0][0] == start and parts[-1][1] == end
            assert all(a[1] == b[0] for a, b in pairwise(parts))
            assert all((a - start) % unit == 0 for a, _ in parts)


def test_a_failing_part_is_raised_after_every_part_finished():
    ws = Workspace(NUMPY_OPS, 3)
    finished: list[int] = []
    gate = threading.Event()

    def part(k: int, _: Workspace) -> int:
        if k == 0:
            raise RuntimeError("part 0 failed")
        gate.wait(timeout=5)  # the helpers are still running when part 0 fails
        finished.append(k)
        return k

    timer = threading.Timer(0.05, gate.set)
    timer.start()
    with pytest.raises(RuntimeError, match="part 0 failed"):
        ws.parallel(part, INLINE_WORK + 1)
    assert sorted(finished) == [1, 2]
    assert ws.parallel(lambda k, w: (k, w is ws), INLINE_WORK + 1) == [(0, True), (1, False), (2, False)]
    with pytest.raises(ValueError, match="threads must be in"):
        Workspace(NUMPY_OPS, MAX_THREADS + 1)


def test_a_small_step_runs_its_parts_in_order_on_the_calling_thread_with_their_own_workspaces():
    """Up to `INLINE_WORK` elements the parts run one after another on the caller's thread (a helper costs
    more than the work), each with the workspace it has on helpers; above it part k runs on helper k."""
    ws = Workspace(NUMPY_OPS, 3)
    here = threading.get_ident()

    def where(k: int, w: Workspace) -> tuple[int, bool, bool]:
        return k, threading.get_ident() == here, w is ws

    assert ws.parallel(where, INLINE_WORK) == [(0, True, True), (1, True, False), (2, True, False)]
    assert ws.parallel(where, INLINE_WORK + 1) == [(0, True, True), (1, False, False), (2, False, False)]
    helpers = ws.parallel(lambda k, w: w, INLINE_WORK)[1:]
    assert helpers == ws.parallel(lambda k, w: w, INLINE_WORK + 1)[1:]  # the same workspaces either way
    ran: list[int] = []

    def failing(k: int, _: Workspace) -> None:
        ran.append(k)
        if k == 1:
            raise RuntimeError("part 1 failed")

    with pytest.raises(RuntimeError, match="part 1 failed"):
        ws.parallel(failing, 8)
    assert ran == [0, 1]  # no part runs after a failed one


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_an_eager_start_gives_the_float64_rule_bytes_on_any_thread_count(dtype):
    """`eager_start` (spec/protocol.md §5.2): ``params - scale * state - prior`` per element in float64, rounded
    once; its blocks shared among threads, and the casts inside each ufunc, change no byte."""
    from peerloom.adapters.compute import eager_start

    rng = np.random.default_rng(7)
    n = (1 << 22) + 4099  # more than one block, the last one short
    params = {"w": rng.standard_normal(n).astype(dtype), "b": rng.standard_normal((3, 2)).astype(dtype)}
    state = {k: (1e3 * rng.standard_normal(v.shape)).astype(dtype) for k, v in params.items()}
    prior = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()}
    for moment in (state, None):
        want = {k: (v.astype(np.float64) - (0.0 if moment is None else 0.37 * moment[k].astype(np.float64))
                    - prior[k].astype(np.float64)).astype(dtype) for k, v in params.items()}
        for threads in (1, 2, 3):
            got = eager_start(params, moment, prior, 0.37, threads=threads)
            assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
