"""Codecs (spec/design.md §5): numpy == torch bytes, round-trip bounds, error feedback, hostile decoding."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from peerloom.backends import _codecs
from peerloom.backends.numpy import codecs as nc
from peerloom.backends.numpy.tensors import from_safetensors, to_safetensors
from peerloom.backends.torch import codecs as tc
from peerloom.core.errors import DecodeError

CODECS = nc.CODECS


def to_torch(d: dict) -> dict:
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in d.items()}


def same_bytes(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    for k in a:
        tb = b[k].numpy() if isinstance(b[k], torch.Tensor) else b[k]
        if np.asarray(a[k]).dtype != tb.dtype or a[k].shape != tb.shape or a[k].tobytes() != tb.tobytes():
            return False
    return True


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, np.ndarray]:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
        kind = draw(st.sampled_from(["normal", "ties", "tiny", "wide"]))
        if kind == "normal":
            t = rng.standard_normal(shape).astype(np.float32)
        elif kind == "ties":  # many equal magnitudes: top-k tie-breaking must agree
            t = rng.integers(-3, 4, shape).astype(np.float32)
        elif kind == "tiny":  # subnormal range
            t = (rng.standard_normal(shape) * 1e-39).astype(np.float32)
        else:
            t = (rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 8, shape)).astype(np.float32)
        out[f"layer{i}.w/x"] = np.asarray(t, dtype=np.float32)
    return out


@given(tensor_dicts(), st.sampled_from(CODECS), st.sampled_from([0.01, 0.1, 0.5, 1.0]), st.booleans())
def test_numpy_and_torch_encode_and_decode_the_same_bytes(x, codec, fraction, feedback) -> None:
    state = nc.zeros_state(x) if feedback else None
    tstate = tc.zeros_state(to_torch(x)) if feedback else None
    for _ in range(2):  # a second window exercises a non-zero residual
        enc, state = nc.encode(codec, x, state, fraction=fraction)
        tenc, tstate = tc.encode(codec, to_torch(x), tstate, fraction=fraction)
        assert same_bytes(enc, tenc)
        if feedback:
            assert same_bytes(state.residual, tstate.residual)
        dec = nc.decode(codec, enc)
        tdec = tc.decode(codec, to_torch(enc))
        assert same_bytes(dec, tdec)
        assert {k: v.shape for k, v in dec.items()} == {k: v.shape for k, v in x.items()}
        # the encoded form survives safetensors unchanged
        assert same_bytes(from_safetensors(to_safetensors(enc)), enc)


@given(tensor_dicts())
def test_round_trip_error_bounds(x) -> None:
    for codec in CODECS:
        enc, _ = nc.encode(codec, x, fraction=0.1)
        dec = nc.decode(codec, enc)
        for name, t in x.items():
            d = dec[name].astype(np.float64)
            v = t.astype(np.float64)
            err = np.abs(d - v)
            if codec == "none":
                assert np.array_equal(d, v)
            elif codec == "fp16":  # half: 11-bit significand; subnormal spacing 2^-24; saturates at 65504
                big = np.abs(v) > 65504
                assert np.all(err[~big] <= 2.0**-11 * np.abs(v[~big]) + 2.0**-25)
                assert np.array_equal(d[big], np.sign(v[big]) * 65504)
            elif codec == "bf16":  # 8-bit significand, float32's exponent range
                assert np.all(err <= 2.0**-8 * np.abs(v) + 2.0**-134)
            elif codec == "int8":
                flat_err = np.zeros(enc[f"{name}/scale"].size * _codecs.INT8_BLOCK)
                flat_err[: t.size] = err.reshape(-1)
                scale = enc[f"{name}/scale"].astype(np.float64)
                # Half a step, plus float32 rounding twice: x / scale (relative 2^-24 of |q| <= 127 steps
                # may tip the rounding to the next integer) and q * scale on decode (2^-24 of |q| * scale),
                # so up to 254 * 2^-24 of a step. A subnormal scale is rounded to a multiple of 2^-149 (off by
                # up to 2^-150, or to 0), and q up to 127 multiplies that: up to 127 * 2^-149 < 2^-142.
                bound = scale * (0.5 + 254 * 2.0**-24) + 2.0**-142
                assert np.all(flat_err.reshape(-1, _codecs.INT8_BLOCK) <= bound[:, None])
            elif codec == "topk":
                k = _codecs.topk_count(t.size, 0.1)
                idx = enc[f"{name}/indices"].astype(np.int64)
                assert idx.size == k
                kept = np.zeros(t.size, bool)
                kept[idx] = True
                assert np.array_equal(d.reshape(-1)[kept], v.reshape(-1)[kept])
                assert np.all(d.reshape(-1)[~kept] == 0)
                if k < t.size:  # every dropped magnitude is at most every kept one
                    assert np.abs(v.reshape(-1)[~kept]).max() <= np.abs(v.reshape(-1)[kept]).min()
            else:  # sign: +-mean|x|, the L2-optimal scale for the signs
                s = float(enc[f"{name}/scale"][0])
                if t.size:
                    assert s == pytest.approx(float(np.abs(v).mean()), rel=1e-6, abs=1e-45)
                    assert np.array_equal(d, np.where(v < 0, -s, s))
                    assert np.sum(err**2) <= np.sum(v**2) * (1 + 1e-6) + 1e-30


def test_topk_error_feedback_conserves_the_residual() -> None:
    rng = np.random.default_rng(7)
    shapes = {"a": (64, 33), "b": (500,)}
    state = nc.zeros_state({k: np.zeros(s, np.float32) for k, s in shapes.items()})
    total_in = {k: np.zeros(s) for k, s in shapes.items()}
    total_out = {k: np.zeros(s) for k, s in shapes.items()}
    for _ in range(20):
        x = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        old = state.residual
        enc, state = nc.encode("topk", x, state, fraction=0.01)
        dec = nc.decode("topk", enc)
        for k in shapes:
            # per window, exactly: decoded + new residual == x + old residual (float32 add)
            assert np.array_equal(dec[k] + state.residual[k], x[k] + old[k])
            total_in[k] += x[k]
            total_out[k] += dec[k]
    for k in shapes:  # over windows: everything sent plus what is still owed equals everything produced
        np.testing.assert_allclose(total_out[k] + state.residual[k], total_in[k], rtol=0, atol=1e-4)
        assert np.abs(state.residual[k]).max() > 0  # the test is not vacuous


@pytest.mark.parametrize("codec", ["int8", "sign", "bf16"])
def test_error_feedback_for_other_codecs_tracks_what_was_lost(codec) -> None:
    rng = np.random.default_rng(3)
    x = {"w": rng.standard_normal(1000).astype(np.float32)}
    state = nc.zeros_state(x)
    enc, state = nc.encode(codec, x, state)
    dec = nc.decode(codec, enc)
    np.testing.assert_allclose(dec["w"] + state.residual["w"], x["w"], rtol=0, atol=1e-6)


def test_topk_indices_are_exact_beyond_float32_integers() -> None:
    n = (1 << 24) + 3  # float32 cannot hold 2^24 + 1: positions stored as float would be corrupted
    x = np.zeros(n, np.float32)
    x[n - 1] = 5.0
    x[(1 << 24) + 1] = -7.0
    enc, _ = nc.encode("topk", {"w": x}, fraction=1e-7)
    assert enc["w/indices"].dtype == np.uint32
    assert enc["w/indices"].tolist() == [(1 << 24) + 1, n - 1]
    assert np.array_equal(nc.decode("topk", enc)["w"], x)
    assert np.array_equal(tc.decode("topk", to_torch(enc))["w"].numpy(), x)
    assert _codecs.index_dtype(1 << 32) == "uint32" and _codecs.index_dtype((1 << 32) + 1) == "int64"


def test_compression_ratios() -> None:
    x = {"w": np.random.default_rng(0).standard_normal(100_000).astype(np.float32)}
    size = {c: sum(v.nbytes for v in nc.encode(c, x)[0].values()) for c in CODECS}
    assert size["none"] == 400_000
    assert size["fp16"] == size["bf16"] == 200_000
    assert size["int8"] == 100_000 + 4 * -(-100_000 // 256)
    assert size["topk"] == 8 * 1000 + 8
    assert size["sign"] == 12_500 + 4 + 8


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        nc.encode("zstd", {"w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError):
        nc.encode("fp16", {"w": np.zeros(3, np.float64)})
    with pytest.raises(ValueError):
        nc.encode("int8", {"w": np.array([1.0, np.nan], np.float32)})
    with pytest.raises(ValueError):
        tc.encode("topk", {"w": torch.tensor([np.inf])})
    with pytest.raises(ValueError):
        nc.encode("topk", {"w": np.zeros(3, np.float32)}, nc.zeros_state({"v": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError):
        nc.encode("topk", {"w": np.zeros(3, np.float32)}, fraction=0.0)


# ---------------------------------------------------------------- hostile encoded input


def valid(codec: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    x = {"a.w": rng.standard_normal((5, 70)).astype(np.float32), "b": rng.standard_normal(9).astype(np.float32)}
    return nc.encode(codec, x, fraction=0.1)[0]


def decode_both(codec: str, enc: dict, **kw) -> tuple[object, object]:
    """Each backend's outcome: the decoded bytes or "DecodeError"; anything else propagates (a failure)."""
    outcomes = []
    for backend, arg in ((nc, enc), (tc, to_torch(enc) if all(isinstance(v, np.ndarray) for v in enc.values())
                                     else enc)):
        try:
            d = backend.decode(codec, arg, **kw)
            outcomes.append({k: (v.numpy() if isinstance(v, torch.Tensor) else v).tobytes() for k, v in d.items()})
        except DecodeError:
            outcomes.append("DecodeError")
    return outcomes[0], outcomes[1]


MUTATIONS = ("drop", "extra", "dtype", "shape", "bytes", "rename")


@given(st.sampled_from(CODECS), st.sampled_from(MUTATIONS), st.data())
def test_mutated_encodings_raise_only_decode_error_and_backends_agree(codec, mutation, data) -> None:
    enc = {k: np.array(v, copy=True) for k, v in valid(codec).items()}
    key = data.draw(st.sampled_from(sorted(enc)))
    if mutation == "drop":
        del enc[key]
    elif mutation == "extra":
        enc[key + data.draw(st.sampled_from(["x", "/x", "/values"]))] = np.zeros(3, np.float32)
    elif mutation == "dtype":
        dt = data.draw(st.sampled_from(["float32", "float16", "int64", "uint32", "uint16", "int8", "uint8",
                                        "float64", "int32"]))
        enc[key] = enc[key].astype(dt) if enc[key].dtype.kind == "f" or dt[0] != "f" else enc[key].view(np.uint8)
    elif mutation == "shape":
        flat = enc[key].reshape(-1)
        cut = data.draw(st.integers(0, flat.size))
        enc[key] = flat[:cut] if data.draw(st.booleans()) else np.concatenate([flat, flat[:1].repeat(3)])
    elif mutation == "bytes":
        raw = bytearray(enc[key].tobytes())
        if raw:
            for _ in range(data.draw(st.integers(1, 4))):
                i = data.draw(st.integers(0, len(raw) - 1))
                raw[i] = data.draw(st.integers(0, 255))
        enc[key] = np.frombuffer(bytes(raw), dtype=enc[key].dtype).reshape(enc[key].shape).copy()
    else:
        enc["zz/" + key.rsplit("/", 1)[-1]] = enc.pop(key)
    a, b = decode_both(codec, enc)
    assert a == b


@pytest.mark.parametrize(
    ("codec", "key", "value"),
    [
        ("topk", "b/indices", np.array([3, 3], np.uint32)),  # duplicate
        ("topk", "b/indices", np.array([4, 2], np.uint32)),  # unsorted
        ("topk", "b/indices", np.array([2, 9], np.uint32)),  # out of range (n = 9)
        ("topk", "b/indices", np.array([2, 4], np.int64)),  # int64 where uint32 is canonical
        ("topk", "b/shape", np.array([-9], np.int64)),
        ("topk", "b/shape", np.array([1 << 40], np.int64)),  # allocation bomb
        ("topk", "b/values", np.array([1.0, np.nan], np.float32)),
        ("int8", "b/q", np.full(9, -128, np.int8)),
        ("int8", "b/scale", np.array([-1.0], np.float32)),
        ("int8", "b/scale", np.array([np.inf], np.float32)),
        ("int8", "b/scale", np.array([3e38], np.float32)),  # decodes to inf
        ("sign", "b/signs", np.array([0, 0xFF], np.uint8)),  # padding bits set
        ("sign", "b/scale", np.array([np.nan], np.float32)),
        ("fp16", "b/values", np.full(9, np.inf, np.float16)),
        ("bf16", "b/values", np.full(9, 0x7FC0, np.uint16)),  # NaN
        ("none", "b", np.full(9, np.nan, np.float32)),
    ],
)
def test_specific_hostile_values_are_rejected_by_both(codec, key, value) -> None:
    enc = valid(codec)
    enc[key] = value
    if codec == "topk" and key == "b/indices":
        enc["b/values"] = np.ones(value.size, np.float32)
    assert decode_both(codec, enc) == ("DecodeError", "DecodeError")


def test_schema_pins_names_and_shapes() -> None:
    enc = valid("topk")
    schema = (("a.w", "float32", (5, 70)), ("b", "float32", (9,)))
    assert decode_both("topk", enc, schema=schema)[0] != "DecodeError"
    assert decode_both("topk", enc, schema=(("a.w", "float32", (5, 70)), ("b", "float32", (3, 3)))) == (
        "DecodeError", "DecodeError")
    assert decode_both("int8", valid("int8"), max_elements=100) == ("DecodeError", "DecodeError")


@given(st.dictionaries(st.text(max_size=8), st.sampled_from(
    [np.zeros(3, np.float32), np.zeros(2, np.int64), np.ones(1, np.uint8), np.zeros((2, 2), np.float16), 5]),
    max_size=4), st.sampled_from([*CODECS, "bogus"]))
def test_arbitrary_dicts_raise_only_decode_error(enc, codec) -> None:
    for backend in (nc, tc):
        arg = {k: (torch.from_numpy(v.copy()) if backend is tc and isinstance(v, np.ndarray) else v)
               for k, v in enc.items()}
        with contextlib.suppress(DecodeError):  # anything else fails the test
            backend.decode(codec, arg)


@given(st.sampled_from(CODECS), st.binary(max_size=6), st.integers(0, 10_000))
def test_corrupted_safetensors_bytes_raise_only_decode_error(codec, junk, pos) -> None:
    raw = bytearray(to_safetensors(valid(codec)))
    pos %= len(raw)
    raw[pos : pos + len(junk)] = junk
    try:
        enc = from_safetensors(bytes(raw))
    except DecodeError:
        return
    a, b = decode_both(codec, {k: np.array(v) for k, v in enc.items()})
    assert a == b


@pytest.mark.parametrize("codec", CODECS)
def test_torch_encoded_form_round_trips_through_safetensors(codec) -> None:
    import safetensors.torch

    x = {"a.w": torch.randn(7, 300, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(0)}
    enc, _ = tc.encode(codec, x)
    loaded = safetensors.torch.load(safetensors.torch.save(enc))
    assert same_bytes({k: v.numpy() for k, v in loaded.items()}, enc)
    # and the numpy backend decodes the very same bytes to the same tensors
    from_np = nc.decode(codec, from_safetensors(safetensors.torch.save(enc)))
    assert same_bytes(from_np, tc.decode(codec, loaded))
