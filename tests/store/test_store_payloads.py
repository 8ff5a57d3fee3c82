"""Contract: binary payloads (stored atomically with events) and the array encoding."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from storetest_helpers import make_batch

from rolloutlog.eventstore import (
    AppendConflictError,
    CorruptPayloadError,
    EpochFencedError,
    EventStore,
    PayloadNotFoundError,
    PayloadPut,
    decode_arrays,
    encode_arrays,
)

# ---------------------------------------------------------------- the store's payload table


def test_put_get_round_trip(store: EventStore) -> None:
    store.create_run("r1")
    blobs = {
        "empty": b"",
        "small": b"\x00\x01\xff",
        "big": bytes(range(256)) * 4096,  # 1 MiB, every byte value
    }
    for pid, data in blobs.items():
        store.put_payload("r1", pid, "tokens", data)
    for pid, data in blobs.items():
        got = store.get_payload("r1", pid)
        assert isinstance(got, bytes)
        assert got == data


def test_put_is_idempotent_and_first_write_wins(store: EventStore) -> None:
    store.create_run("r1")
    store.put_payload("r1", "p", "tokens", b"first")
    store.put_payload("r1", "p", "tokens", b"first")
    assert store.get_payload("r1", "p") == b"first"
    # Same id again, even with other bytes: ignored (ids name content), no error.
    store.put_payload("r1", "p", "tokens", b"second")
    assert store.get_payload("r1", "p") == b"first"
    # Also inside an append.
    store.append(
        "r1", make_batch(1, 1), expected_seq=1, epoch=1, payload_puts=[PayloadPut("p", "t", b"x")]
    )
    assert store.get_payload("r1", "p") == b"first"
    assert store.last_seq("r1") == 1


def test_payloads_are_per_run(store: EventStore) -> None:
    store.create_run("a")
    store.create_run("b")
    store.put_payload("a", "p", "tokens", b"from a")
    store.put_payload("b", "p", "tokens", b"from b")
    assert store.get_payload("a", "p") == b"from a"
    assert store.get_payload("b", "p") == b"from b"


def test_missing_payload(store: EventStore) -> None:
    store.create_run("r1")
    with pytest.raises(PayloadNotFoundError, match="'nope'"):
        store.get_payload("r1", "nope")
    store.put_payload("r1", "yes", "tokens", b"1")
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("other-run", "yes")
    with pytest.raises(KeyError):  # also a KeyError, for dict-like callers
        store.get_payload("r1", "nope")


def test_payload_puts_commit_with_their_batch(store: EventStore) -> None:
    store.create_run("r1")
    data = encode_arrays({"tokens": [1, 2, 3], "logprobs": [-0.5, -1.25, -3.0]})
    puts = [PayloadPut("a", "tokens", data), PayloadPut("b", "tokens", b"\x00" * 10)]
    assert store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1, payload_puts=puts) == 2
    assert store.get_payload("r1", "a") == data
    assert store.get_payload("r1", "b") == b"\x00" * 10
    # Payload-only put through append (fenced, but no events).
    assert (
        store.append("r1", [], expected_seq=3, epoch=1, payload_puts=[PayloadPut("c", "k", b"c")])
        == 2
    )
    assert store.get_payload("r1", "c") == b"c"
    assert store.last_seq("r1") == 2


def test_conflicting_append_writes_no_payload(store: EventStore) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 3), expected_seq=1, epoch=1)
    puts = [PayloadPut(f"p{i}", "tokens", bytes([i]) * 100) for i in range(5)]
    with pytest.raises(AppendConflictError):
        store.append("r1", make_batch(4, 2), expected_seq=2, epoch=1, payload_puts=puts)
    for p in puts:
        with pytest.raises(PayloadNotFoundError):
            store.get_payload("r1", p.payload_id)
    assert store.last_seq("r1") == 3
    assert [e.seq for e in store.read("r1")] == [1, 2, 3]


def test_fenced_append_writes_no_payload(store: EventStore) -> None:
    store.create_run("r1")
    store.open_epoch("r1")
    with pytest.raises(EpochFencedError):
        store.append(
            "r1",
            make_batch(1, 2),
            expected_seq=1,
            epoch=1,
            payload_puts=[PayloadPut("p", "tokens", b"zz")],
        )
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("r1", "p")
    assert store.last_seq("r1") == 0


# ---------------------------------------------------------------- array encoding


def test_encode_decode_int_and_float_arrays() -> None:
    arrays = {
        "tokens": [0, 1, 2, 151_643, 2**31 - 1, -(2**31)],
        "logprobs": np.array([-0.0, -1.5, -1e-30, float("-inf")], dtype=np.float32),
        "values": np.array([1.0, np.pi, -2.5e300], dtype=np.float64),
        "big": np.array([2**40, -(2**63), 2**63 - 1], dtype=np.int64),
        "empty": [],
        "ünïcode name": np.array([7], dtype=np.int16),
    }
    blob = encode_arrays(arrays)
    assert isinstance(blob, bytes)
    assert blob[:4] == b"RLA1"
    out = decode_arrays(blob)
    assert list(out) == list(arrays)
    assert out["tokens"].dtype == np.dtype("<i4")
    assert out["tokens"].tolist() == arrays["tokens"]
    assert out["logprobs"].dtype == np.dtype("<f4")
    np.testing.assert_array_equal(out["logprobs"], arrays["logprobs"])
    assert out["values"].dtype == np.dtype("<f8")
    np.testing.assert_array_equal(out["values"], arrays["values"])
    assert out["big"].dtype == np.dtype("<i8")
    assert out["big"].tolist() == arrays["big"].tolist()
    assert out["empty"].size == 0
    assert out["ünïcode name"].tolist() == [7]
    assert decode_arrays(encode_arrays({})) == {}


def test_nan_survives() -> None:
    out = decode_arrays(encode_arrays({"x": np.array([np.nan, 1.0], dtype=np.float32)}))
    assert np.isnan(out["x"][0]) and out["x"][1] == 1.0


def test_encoded_arrays_survive_the_store(store: EventStore) -> None:
    store.create_run("r1")
    tokens = np.arange(0, 50_000, 7, dtype=np.int64)
    logprobs = -np.linspace(0, 5, tokens.size).astype(np.float32)
    blob = encode_arrays({"tokens": tokens, "logprobs": logprobs})
    store.append(
        "r1", make_batch(1, 1), expected_seq=1, epoch=1, payload_puts=[PayloadPut("s", "s", blob)]
    )
    out = decode_arrays(store.get_payload("r1", "s"))
    assert out["tokens"].tolist() == tokens.tolist()
    np.testing.assert_array_equal(out["logprobs"], logprobs)


@settings(max_examples=60, deadline=None)
@given(
    ints=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30),
    floats=st.lists(st.floats(width=64, allow_nan=False), max_size=30),
    floats32=st.lists(st.floats(width=32, allow_nan=False), max_size=30),
)
def test_array_round_trip_property(
    ints: list[int], floats: list[float], floats32: list[float]
) -> None:
    out = decode_arrays(
        encode_arrays(
            {
                "i": np.array(ints, dtype=np.int64),
                "d": np.array(floats, dtype=np.float64),
                "f": np.array(floats32, dtype=np.float32),
            }
        )
    )
    assert out["i"].tolist() == ints
    assert out["d"].tolist() == floats
    assert out["f"].tolist() == floats32


@settings(max_examples=60, deadline=None)
@given(
    ints=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30),
    floats=st.lists(st.floats(width=64), max_size=30),
)
def test_python_lists_encode_as_numpy_makes_them(ints: list[int], floats: list[float]) -> None:
    """Plain int and float lists take a stdlib fast path: the same bytes as numpy's
    (int32, int64 when a value needs it; float64), tuples too."""
    for values in (ints, floats, tuple(ints)):
        arr = np.asarray(values)
        if arr.dtype.kind == "i":
            small = not arr.size or (arr.min() >= -(2**31) and arr.max() < 2**31)
            arr = arr.astype("<i4" if small else "<i8")
        assert encode_arrays({"x": values}) == encode_arrays({"x": arr})


@pytest.mark.parametrize(
    ("values", "message"),
    [([2**63], "int64"), ([-(2**63) - 1], "dtype object"), ([True, False], "dtype bool")],
)
def test_python_lists_numpy_refuses_are_refused(values: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_arrays({"x": values})


@pytest.mark.parametrize(
    "values",
    [
        np.array([2**63], dtype=np.uint64),
        np.array([0, 2**64 - 1], dtype=np.uint64),
    ],
)
def test_unsigned_values_beyond_int64_are_refused_not_wrapped(values: np.ndarray) -> None:
    with pytest.raises(ValueError, match="int64"):
        encode_arrays({"u": values})


def test_unsigned_values_within_int64_round_trip() -> None:
    values = np.array([0, 2**32 - 1, 2**63 - 1], dtype=np.uint64)
    assert decode_arrays(encode_arrays({"u": values}))["u"].tolist() == values.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 2)),  # not 1-D
        np.array(["a", "b"]),  # strings
        np.array([True, False]),  # booleans
    ],
)
def test_encode_refuses_unsupported_arrays(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        encode_arrays({"x": bad})


def _one_array(name: bytes, code: bytes, count: int) -> bytes:
    """A hand-made blob holding one array header (and no elements)."""
    header = struct.pack("<I", 1) + struct.pack("<H", len(name)) + name + code
    return b"RLA1" + header + struct.pack("<Q", count)


def _valid_blob() -> bytes:
    return encode_arrays({"tokens": [1, 2, 3, 4], "logprobs": [-0.1, -0.2, -0.3, -0.4]})


def test_every_truncation_is_corrupt() -> None:
    blob = _valid_blob()
    for cut in range(len(blob)):
        with pytest.raises(CorruptPayloadError):
            decode_arrays(blob[:cut])


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "magic"),
        (b"\x80\x04\x95pickle!", "magic"),
        (b"RLA2" + b"\x00" * 4, "magic"),
        (_valid_blob() + b"\x00", "trailing"),
        (_one_array(b"x", b"Z", 0), "dtype"),  # unknown dtype code
        (_one_array(b"x", b"i", 2**60), "truncated"),  # claims more elements than there are
        (_one_array(b"\xff\xfe", b"i", 0), "malformed"),  # name is not UTF-8
        (b"RLA1" + struct.pack("<I", 5), "truncated"),  # five arrays announced, none there
    ],
)
def test_corrupt_blobs(blob: bytes, message: str) -> None:
    with pytest.raises(CorruptPayloadError, match=message):
        decode_arrays(blob)
