"""Backends: numpy ≡ torch reductions bit for bit, tensor digests, the safetensors decoder (spec/design.md §3-§5)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from peerloom.backends.numpy import aggregate as npa
from peerloom.backends.numpy import reduce as npr
from peerloom.backends.numpy.tensors import (
    MAX_HEADER_BYTES,
    from_safetensors,
    schema_of,
    tensor_digest,
    to_safetensors,
)
from peerloom.backends.torch import reduce as tr
from peerloom.core.errors import DecodeError

PARITY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- strategies

names = st.text(alphabet="abcdefgh._0123", min_size=1, max_size=6)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
schemas = st.dictionaries(names, shapes, min_size=1, max_size=4)
# Finite float32 values from subnormal to the largest normal, both signs (Hypothesis favours the edges).
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
weights_st = st.integers(min_value=1, max_value=2**40)


def f32_array(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, shape, elements=f32)


@st.composite
def cohorts(draw: st.DrawFn, min_size: int = 1, max_size: int = 9) -> tuple[list[dict], list[int]]:
    schema = draw(schemas)
    n = draw(st.integers(min_size, max_size))
    deltas = [{name: draw(f32_array(shape)) for name, shape in schema.items()} for _ in range(n)]
    return deltas, draw(st.lists(weights_st, min_size=n, max_size=n))


def to_torch(d: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in d.items()}


def raw(d: dict[str, np.ndarray]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return [(k, d[k].dtype.name, d[k].shape, d[k].tobytes()) for k in sorted(d)]


def raw_torch(d: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return raw({k: v.numpy() for k, v in d.items()})


def close(a: np.ndarray, b: np.ndarray, scale: np.ndarray, n: int) -> bool:
    """|a - b| within float64 accumulation error (n terms of magnitude `scale`) plus 2 float32 ulps."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(over="ignore"):  # the spacing at float32's largest value is inf
        ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float32)).astype(np.float64)
    return bool(np.all(np.abs(a64 - b64) <= 2 * ulp + 4 * n * 2.0**-52 * scale))


def abs_scale(deltas: list[dict], weights: list[int], name: str) -> np.ndarray:
    total = sum(weights)
    return sum(np.abs(d[name].astype(np.float64)) * (w / total) for d, w in zip(deltas, weights, strict=True))


# ---------------------------------------------------------------- numpy ≡ torch


@PARITY
@given(cohorts())
def test_weighted_mean_numpy_equals_torch_bytes(cohort: tuple[list[dict], list[int]]) -> None:
    deltas, weights = cohort
    ref = npr.weighted_mean(deltas, weights)
    got = tr.weighted_mean([to_torch(d) for d in deltas], weights)
    assert raw(ref) == raw_torch(got)
    assert schema_of(ref) == schema_of(deltas[0])


@PARITY
@given(cohorts(), st.data())
def test_outer_sgd_step_numpy_equals_torch_bytes(cohort: tuple[list[dict], list[int]], data: st.DataObject) -> None:
    deltas, _ = cohort
    params, grad = deltas[0], deltas[-1]
    lr = data.draw(st.one_of(st.just(1.0), st.just(0.7), st.floats(1e-4, 10.0)))
    ref = npr.outer_sgd_step(params, grad, lr)
    got = tr.outer_sgd_step(to_torch(params), to_torch(grad), lr)
    assert raw(ref) == raw_torch(got)


@FAST
@given(cohorts(min_size=2, max_size=2))
def test_outer_sgd_step_lr1_is_float32_difference(cohort: tuple[list[dict], list[int]]) -> None:
    # float64 then one rounding equals float32 subtraction exactly (double rounding is innocuous here).
    (params, grad), _ = cohort
    got = npr.outer_sgd_step(params, grad, 1.0)
    with np.errstate(over="ignore"):
        expected = {k: params[k] - grad[k] for k in params}
    assert raw(got) == raw(expected)


@pytest.mark.parametrize("seed", range(3))
def test_large_tensors_numpy_equals_torch(seed: int) -> None:
    # Sizes that exercise the vectorized loops and their remainders; magnitudes spread over 2^±60.
    rng = np.random.default_rng(seed)

    def tensor(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 2.0 ** rng.integers(-60, 60, shape)).astype(np.float32)

    deltas = [{"a": tensor(257, 129), "b": tensor(1031)} for _ in range(7)]
    weights = [int(w) for w in rng.integers(1, 10_000, 7)]
    assert raw(npr.weighted_mean(deltas, weights)) == raw_torch(
        tr.weighted_mean([to_torch(d) for d in deltas], weights)
    )
    assert raw(npr.outer_sgd_step(deltas[0], deltas[1], 0.7)) == raw_torch(
        tr.outer_sgd_step(to_torch(deltas[0]), to_torch(deltas[1]), 0.7)
    )


def test_float64_inputs_match_too() -> None:
    rng = np.random.default_rng(1)
    deltas = [{"w": rng.standard_normal((3, 4))} for _ in range(3)]
    ref = npr.weighted_mean(deltas, [3, 1, 2])
    got = tr.weighted_mean([to_torch(d) for d in deltas], [3, 1, 2])
    assert ref["w"].dtype == np.float64
    assert raw(ref) == raw_torch(got)


# ---------------------------------------------------------------- semantics


@FAST
@given(cohorts(min_size=2), st.randoms(use_true_random=False))
def test_permuted_cohort_is_close_not_necessarily_identical(cohort, rnd) -> None:
    # Float addition is not associative: another member order may differ in the last bits. That is why the
    # protocol reduces a cohort in one canonical order; here we only bound the difference.
    deltas, weights = cohort
    order = list(range(len(deltas)))
    rnd.shuffle(order)
    a = npr.weighted_mean(deltas, weights)
    b = npr.weighted_mean([deltas[i] for i in order], [weights[i] for i in order])
    for name in a:
        assert close(a[name], b[name], abs_scale(deltas, weights, name), len(deltas))


@FAST
@given(cohorts(), st.integers(1, 1000))
def test_equal_weights_is_plain_mean(cohort, w) -> None:
    deltas, _ = cohort
    got = npr.weighted_mean(deltas, [w] * len(deltas))
    for name in got:
        stack = np.stack([d[name].astype(np.float64) for d in deltas])
        mean = stack.mean(axis=0).astype(np.float32)
        scale = np.abs(stack).mean(axis=0)
        assert close(got[name], mean, scale, len(deltas))


def test_weights_are_sample_counts() -> None:
    a = {"w": np.array([0.0, 4.0], dtype=np.float32)}
    b = {"w": np.array([4.0, 0.0], dtype=np.float32)}
    assert npr.weighted_mean([a, b], [3, 1])["w"].tolist() == [1.0, 3.0]
    assert tr.weighted_mean([to_torch(a), to_torch(b)], [3, 1])["w"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("weights", "message"),
    [([1, 0], "positive"), ([2, -1], "positive"), ([1, True], "bool"), ([1, 1.5], "integers"), ([1], "weights")],
)
def test_bad_weights_rejected(backend: str, weights: list, message: str) -> None:
    d = {"w": np.ones(3, dtype=np.float32)}
    deltas = [d, d] if backend == "numpy" else [to_torch(d), to_torch(d)]
    mod = npr if backend == "numpy" else tr
    with pytest.raises(ValueError, match=message):
        mod.weighted_mean(deltas, weights)


@pytest.mark.parametrize("mod", [npr, tr])
def test_empty_and_mismatched_cohorts_rejected(mod) -> None:
    conv = (lambda d: d) if mod is npr else to_torch
    with pytest.raises(ValueError, match="empty"):
        mod.weighted_mean([], [])
    base = {"w": np.ones((2, 3), dtype=np.float32)}
    for other in (
        {"w": np.ones((3, 2), dtype=np.float32)},
        {"v": np.ones((2, 3), dtype=np.float32)},
        {"w": np.ones((2, 3), dtype=np.float64)},
        {"w": np.ones((2, 3), dtype=np.float32), "b": np.ones(1, dtype=np.float32)},
    ):
        with pytest.raises(ValueError, match="schema"):
            mod.weighted_mean([conv(base), conv(other)], [1, 1])
        with pytest.raises(ValueError, match="schema"):
            mod.outer_sgd_step(conv(base), conv(other), 1.0)
    ints = {"w": np.ones(3, dtype=np.int64)}
    with pytest.raises(ValueError, match="dtype"):
        mod.weighted_mean([conv(ints)], [1])


def test_reductions_reuse_the_thread_workspace_across_schemas_and_write_out() -> None:
    rng = np.random.default_rng(0)
    a = [{"x": rng.standard_normal((4, 5)).astype(np.float32)} for _ in range(3)]
    b = [{"y": rng.standard_normal(7).astype(np.float32), "z": rng.standard_normal(2).astype(np.float32)}]
    first = npr.weighted_mean(a, [1, 2, 3])
    acc = npa.workspace()._bufs["acc", "float64"]
    again = npr.weighted_mean(a, [1, 2, 3])
    assert npa.workspace()._bufs["acc", "float64"] is acc  # buffers reused, not reallocated
    assert raw(first) == raw(again)
    assert raw(npr.weighted_mean(b, [5])) == raw(b[0])  # another schema in the same buffers
    out = {"x": np.empty((4, 5), dtype=np.float32)}
    assert npr.weighted_mean(a, [1, 2, 3], out=out) is out
    assert raw(out) == raw(first)
    with pytest.raises(ValueError, match="out has schema"):
        npr.weighted_mean(a, [1, 2, 3], out={"x": np.empty(3, dtype=np.float32)})
    tout = {"x": torch.empty(4, 5)}
    assert tr.weighted_mean([to_torch(d) for d in a], [1, 2, 3], out=tout) is tout
    assert raw_torch(tout) == raw(first)
    pout = {"x": np.empty((4, 5), dtype=np.float32)}
    assert raw(npr.outer_sgd_step(a[0], a[1], 0.7, out=pout)) == raw(npr.outer_sgd_step(a[0], a[1], 0.7))


# ---------------------------------------------------------------- tensor digest and safetensors

any_dtype = st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_])
st_names = names.filter(lambda s: s != "__metadata__")


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, np.ndarray]:
    schema = draw(st.dictionaries(st_names, st.tuples(shapes, any_dtype), min_size=0, max_size=4))
    return {n: draw(hnp.arrays(dt, shape)) for n, (shape, dt) in schema.items()}


@FAST
@given(tensor_dicts())
def test_safetensors_round_trip_preserves_digest(tensors: dict[str, np.ndarray]) -> None:
    data = to_safetensors(tensors)
    back = from_safetensors(data)
    assert tensor_digest(back) == tensor_digest(tensors)
    assert schema_of(back) == schema_of(tensors)
    assert to_safetensors(back) == data
    digest = tensor_digest(tensors)
    assert len(digest) == 34 and digest[:2] == b"\x12\x20"


def test_digest_ignores_layout_byte_order_and_dict_order() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = tensor_digest({"a": x, "b": np.ones(2, np.int64)})
    assert tensor_digest({"b": np.ones(2, np.int64), "a": x}) == base
    fortran = np.asfortranarray(x)
    assert tensor_digest({"a": fortran, "b": np.ones(2, np.int64)}) == base
    big = x.astype(">f4")
    assert tensor_digest({"a": big, "b": np.ones(2, ">i8")}) == base
    assert to_safetensors({"a": fortran}) == to_safetensors({"a": x}) == to_safetensors({"a": big})


@FAST
@given(tensor_dicts(), st.data())
def test_digest_changes_with_any_field(tensors: dict[str, np.ndarray], data: st.DataObject) -> None:
    assume(tensors)
    base = tensor_digest(tensors)
    name = data.draw(st.sampled_from(sorted(tensors)))
    arr = tensors[name]
    # name
    new_name = data.draw(st_names.filter(lambda s: s not in tensors))
    renamed = {(new_name if k == name else k): v for k, v in tensors.items()}
    assert tensor_digest(renamed) != base
    # shape (same bytes)
    reshaped = dict(tensors, **{name: arr.reshape((*arr.shape, 1))})
    assert tensor_digest(reshaped) != base
    # dtype (same bytes where the itemsize allows)
    if arr.dtype == np.float32:
        other = arr.view(np.int32)
    elif arr.dtype == np.uint8:
        other = arr.view(np.int8)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            other = arr.astype(np.float32 if arr.dtype != np.float32 else np.float64)
    assert tensor_digest(dict(tensors, **{name: other})) != base
    # one byte
    if arr.nbytes:
        flat = bytearray(arr.tobytes())
        i = data.draw(st.integers(0, len(flat) - 1))
        flat[i] ^= 1 << data.draw(st.integers(0, 7))
        mutated = np.frombuffer(bytes(flat), dtype=arr.dtype).reshape(arr.shape)
        assert tensor_digest(dict(tensors, **{name: mutated})) != base


def _sample_bytes() -> bytes:
    return to_safetensors({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.int64)})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_from_safetensors_fuzz_random_bytes(data: bytes) -> None:
    _decodes_or_is_bad_safetensors(data)


def _decodes_or_is_bad_safetensors(blob: bytes) -> None:
    try:
        out = from_safetensors(blob)
    except DecodeError as exc:
        assert exc.reason == "bad-safetensors"
    else:
        assert isinstance(out, dict)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_from_safetensors_fuzz_truncated_and_mutated(data: st.DataObject) -> None:
    good = bytearray(_sample_bytes())
    kind = data.draw(st.sampled_from(["truncate", "flip", "splice"]))
    if kind == "truncate":
        blob = bytes(good[: data.draw(st.integers(0, len(good) - 1))])
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(good) - 1))
            good[i] = data.draw(st.integers(0, 255))
        blob = bytes(good)
    else:
        i = data.draw(st.integers(0, len(good)))
        blob = bytes(good[:i]) + data.draw(st.binary(max_size=20)) + bytes(good[i:])
    _decodes_or_is_bad_safetensors(blob)


def _with_header(header: object, body: bytes = b"", raw_header: bytes | None = None) -> bytes:
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 100) + b"{}",  # header longer than the data
        struct.pack("<Q", 2**64 - 1) + b"{}",
        _with_header([1, 2]),  # not an object
        _with_header(None, raw_header=b"\xff\xfe"),  # not UTF-8
        _with_header(None, raw_header=b"{" * 100_000),  # deep nesting
        _with_header(None, raw_header=b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": 1}'),
        _with_header({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, b"\x00\x00"),
        _with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 4),
        _with_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 8),
        _with_header({"__metadata__": {"x": 1}}),
    ],
)
def test_from_safetensors_rejects(blob: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        from_safetensors(blob)
    assert info.value.reason == "bad-safetensors"


def test_from_safetensors_limits() -> None:
    many = to_safetensors({f"t{i}": np.zeros(1, np.float32) for i in range(5)})
    assert len(from_safetensors(many, max_tensors=5)) == 5
    with pytest.raises(DecodeError, match="tensors"):
        from_safetensors(many, max_tensors=4)
    huge = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b" " * (MAX_HEADER_BYTES + 1)
    with pytest.raises(DecodeError, match="header length"):
        from_safetensors(huge)


def test_from_safetensors_never_unpickles() -> None:
    import pickle

    with pytest.raises(DecodeError):
        from_safetensors(pickle.dumps({"w": np.zeros(2)}))
