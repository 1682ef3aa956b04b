"""privfl messages as bytes and as Flower records: every dtype and shape comes back bit for bit, and a tampered,
truncated or extended message is refused with CorruptMessage, never decoded to a wrong value.

The envelope needs no flwr and runs everywhere; the record tests skip where flwr is not installed.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from privfl.flower.records import CorruptMessage, MessageError, UnsupportedValue, from_bytes, from_record, to_bytes, \
    to_record

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
          "float64", "complex64", "complex128", ">f8", ">i4", "<u8", ">c16"]
SHAPES = [(), (0,), (1,), (7,), (2, 3), (3, 0, 2), (2, 3, 4, 1)]


def _random_array(dtype: str, shape, rng) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, infinities, negative zeros, extreme integers included)."""
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        return (raw[: int(np.prod(shape, dtype=np.int64))] % 2).astype(bool).reshape(shape)
    return raw.view(dt).reshape(shape)


def _same(a, b) -> bool:
    """Identical type, dtype, shape and bits (or equal Python values, NaN and the sign of zero included)."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a.hex() == b.hex() if not math.isnan(a) else math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def _message(rng) -> dict:
    return {
        "arrays": {f"{d}{s}": _random_array(d, s, rng) for d in DTYPES for s in SHAPES},
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
        "strided": rng.standard_normal((6, 5))[::2, 1::2],
        "extremes": np.array([0, 1, 2 ** 64 - 1], dtype=np.uint64),
        "ints": [0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 200, -(3 ** 99)],
        "floats": [0.0, -0.0, 1e-310, -math.inf, math.inf, 0.1, 1 / 3, 2.0 ** -1074],
        "nan": math.nan,
        "flags": (True, False),
        "text": "Gaußian ε=1.0 \u2603 'quoted' \"double\"",
        "blob": bytes(range(256)),
        "empty": {},
        "nothing": None,
        "nested": {"round": 3, "metrics": {"accuracy": 0.75, "loss": 1.25}, "ids": ["0", "1", "2"]},
    }


def test_envelope_round_trip_is_exact():
    msg = _message(np.random.default_rng(0))
    assert _same(from_bytes(to_bytes(msg, "test"), "test"), msg)


def test_fortran_and_strided_arrays_keep_values_and_shape():
    rng = np.random.default_rng(1)
    a = np.asfortranarray(rng.standard_normal((3, 4)))
    b = rng.standard_normal((6, 5))[::2, 1::2]
    got = from_bytes(to_bytes({"a": a, "b": b}, "k"), "k")
    assert np.array_equal(got["a"], a) and got["a"].shape == a.shape
    assert np.array_equal(got["b"], b) and got["b"].shape == b.shape


def test_numpy_scalars_come_back_as_the_python_value_they_equal():
    got = from_bytes(to_bytes({"i": np.int64(-5), "u": np.uint64(2 ** 64 - 1), "f": np.float32(0.1),
                               "b": np.bool_(True)}, "k"), "k")
    assert got == {"i": -5, "u": 2 ** 64 - 1, "f": float(np.float32(0.1)), "b": True}
    assert type(got["b"]) is bool and type(got["i"]) is int


def test_decoded_arrays_are_writable_copies():
    data = to_bytes({"a": np.arange(4.0)}, "k")
    got = from_bytes(data, "k")["a"]
    got[0] = 99.0  # a read-only view of the message bytes would raise
    assert from_bytes(data, "k")["a"][0] == 0.0


def test_every_single_bit_flip_is_refused():
    data = to_bytes({"w": np.arange(3, dtype=np.float32), "round": 2, "note": "x"}, "k")
    for i in range(len(data)):
        for bit in (0, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptMessage):
                from_bytes(bytes(bad), "k")


def test_every_truncation_and_an_extension_are_refused():
    data = to_bytes({"w": np.arange(5, dtype=np.int64), "s": "abc"}, "k")
    for n in range(len(data)):
        with pytest.raises(CorruptMessage):
            from_bytes(data[:n], "k")
    with pytest.raises(CorruptMessage, match="length"):
        from_bytes(data + b"\x00", "k")


def test_a_message_of_another_kind_is_refused():
    with pytest.raises(CorruptMessage, match="expected a 'release' message"):
        from_bytes(to_bytes({"a": 1}, "broadcast"), "release")


def test_a_forged_digest_over_a_malformed_body_is_refused():
    """Someone who recomputes the digest still cannot make an inconsistent body decode."""
    import hashlib
    import json
    import struct

    header = json.dumps({"kind": "k", "tree": {"t": "dict", "v": [["a", {"t": "array", "dtype": "<f8",
                                                                       "shape": [4], "offset": 0, "nbytes": 8}]]}},
                        separators=(",", ":")).encode()
    body = struct.pack(">Q", len(header)) + header + b"\x00" * 8
    head = b"PRIVFLMSG" + struct.pack(">HQ", 1, len(body))
    with pytest.raises(CorruptMessage, match="shape"):
        from_bytes(head + body + hashlib.sha256(head + body).digest(), "k")


@pytest.mark.parametrize("value", [np.array([object()], dtype=object), {1: "non-string key"}, {"s": {1, 2}},
                                   np.zeros(2, dtype=[("a", "f8")]), np.array(["text"]), object()])
def test_unsupported_values_are_refused_before_anything_is_encoded(value):
    with pytest.raises(UnsupportedValue):
        to_bytes({"v": value}, "k")


def test_errors_are_privfl_message_errors():
    assert issubclass(CorruptMessage, MessageError) and issubclass(UnsupportedValue, MessageError)
    assert issubclass(MessageError, ValueError)


def test_privfl_flower_imports_without_flwr():
    code = ("import sys; import privfl.flower, privfl.flower.app, privfl.flower.local; "
            "assert 'flwr' not in sys.modules, 'flwr was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- Flower records -----------------------------------------------------------------------------------------------

@pytest.fixture
def flwr_app():
    return pytest.importorskip("flwr.app")


def test_record_round_trip_is_exact(flwr_app):
    msg = _message(np.random.default_rng(2))
    record = to_record(msg, "test")
    assert isinstance(record, flwr_app.RecordDict)
    assert _same(from_record(record, "test"), msg)


def test_record_survives_flower_serialisation(flwr_app):
    """What a SuperLink stores and forwards: the RecordDict deflated to bytes and inflated again."""
    msg = _message(np.random.default_rng(3))
    record = to_record(msg, "test")
    again = _reinflate(record)
    assert _same(from_record(again, "test"), msg)


def _reinflate(record):
    """Deflate ``record`` and every descendant to bytes, then inflate it, as Flower's transport does."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    objects = get_all_nested_objects(record)
    contents = {obj_id: obj.deflate() for obj_id, obj in objects.items()}
    return inflate_object_from_contents(record.object_id, contents, keep_object_contents=False)


def _tampered(record, what):
    import flwr.app as fa

    arrays = fa.ArrayRecord({k: v for k, v in record["privfl.arrays"].items()})
    meta = fa.ConfigRecord(dict(record["privfl.header"].items()))
    if what == "segment":
        key = next(iter(arrays))
        data = bytearray(arrays[key].numpy().tobytes())
        data[0] ^= 1
        arrays[key] = fa.Array(np.frombuffer(bytes(data), dtype=np.uint8))
    elif what == "short-segment":
        key = next(iter(arrays))
        arrays[key] = fa.Array(arrays[key].numpy()[:-1].copy())
    elif what == "dropped-segment":
        del arrays[str(len(arrays) - 1)]
    elif what == "header":
        meta["header"] = meta["header"].replace('"v":7', '"v":8')
    elif what == "digest":
        meta["digest"] = bytes(32)
    elif what == "version":
        meta["version"] = 2
    elif what == "extra-record":
        return fa.RecordDict({"privfl.arrays": arrays, "privfl.header": meta, "other": fa.ConfigRecord({"a": 1})})
    return fa.RecordDict({"privfl.arrays": arrays, "privfl.header": meta})


@pytest.mark.parametrize("what", ["segment", "short-segment", "dropped-segment", "header", "digest", "version",
                                  "extra-record"])
def test_tampered_records_are_refused(flwr_app, what):
    record = to_record({"w": np.arange(4, dtype=np.float64), "round": 7, "b": b"abc"}, "k")
    assert from_record(_tampered(record, "none"), "k")["round"] == 7  # the copy itself is intact
    with pytest.raises(CorruptMessage):
        from_record(_tampered(record, what), "k")
