"""Tests of batchplane.wire: Array encoding and decoding, chunking and reassembly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchplane.v1 import common_pb2
from batchplane.wire import (
    ALIGNMENT,
    CHUNK_BYTES,
    DTYPES,
    PayloadReceiver,
    WireFormatError,
    align,
    decode_array,
    encode_array,
    iter_chunks,
)

ALL_DTYPES = sorted(DTYPES)
SHAPES = [(), (0,), (1,), (5,), (2, 3), (0, 4), (3, 0), (2, 0, 3), (1, 1, 1, 1), (2, 3, 4)]


def _over_the_wire(message: common_pb2.Array) -> common_pb2.Array:
    return common_pb2.Array.FromString(message.SerializeToString())


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_of_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape, dtype=np.int64))
    array = (np.arange(n) % 7 - 3).astype(dtype).reshape(shape)
    message = encode_array(array)
    assert message.dtype == dtype
    assert tuple(message.shape) == shape
    assert len(message.data) == array.nbytes
    decoded = decode_array(_over_the_wire(message), field="x", dtype=dtype, ndim=len(shape))
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.shape == shape
    assert np.array_equal(decoded, array)


@settings(max_examples=150, deadline=None)
@given(
    array=hnp.arrays(
        dtype=st.sampled_from(ALL_DTYPES).map(np.dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    )
)
def test_round_trip_is_bit_exact(array: np.ndarray) -> None:
    decoded = decode_array(_over_the_wire(encode_array(array)), field="x")
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    assert decoded.tobytes() == array.tobytes()  # bit-exact, NaN payloads and -0.0 included


def test_non_contiguous_arrays_travel_in_c_order() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    for array in (base.T, base[:, ::2], base[::-1]):
        assert not array.flags.c_contiguous
        decoded = decode_array(encode_array(array), field="x")
        assert np.array_equal(decoded, array)


def test_scalars_and_python_values_are_accepted() -> None:
    decoded = decode_array(encode_array(np.int64(-5)), field="x", ndim=0)
    assert decoded.shape == () and int(decoded) == -5
    decoded = decode_array(encode_array(True), field="x", dtype="bool")
    assert bool(decoded) is True


def test_big_endian_arrays_travel_as_little_endian() -> None:
    # The wire format is "raw little-endian bytes"; an array in big-endian byte order (whose
    # dtype name is still "int32") must arrive with its values intact.
    array = np.array([1, 2, 3], dtype=">i4")
    message = encode_array(array)
    assert message.data == np.array([1, 2, 3], dtype="<i4").tobytes()
    assert decode_array(message, field="x").tolist() == [1, 2, 3]


def test_decoded_arrays_are_read_only_views() -> None:
    decoded = decode_array(encode_array(np.arange(4, dtype=np.int64)), field="x")
    assert not decoded.flags.writeable
    with pytest.raises(ValueError):
        decoded[0] = 1


@pytest.mark.parametrize("array", [np.array([1], np.uint32), np.array(["a"]), np.array([1j]), np.array([1], np.uint64)])
def test_encode_rejects_dtypes_that_cannot_travel(array: np.ndarray) -> None:
    with pytest.raises(WireFormatError, match=rf"dtype '{array.dtype.name}' cannot travel"):
        encode_array(array)


@pytest.mark.parametrize(
    ("message", "kwargs", "problem"),
    [
        (common_pb2.Array(dtype="complex64", shape=[1], data=b"\0" * 8), {}, r"unknown dtype 'complex64'"),
        (common_pb2.Array(dtype="", shape=[0], data=b""), {}, r"unknown dtype ''"),
        (common_pb2.Array(dtype="int32", shape=[2], data=b"\0" * 8), {"dtype": "int64"}, r"dtype must be int64, got int32"),
        (common_pb2.Array(dtype="int64", shape=[2, 1], data=b"\0" * 16), {"ndim": 1}, r"must have 1 dimension\(s\), got shape \(2, 1\)"),
        (common_pb2.Array(dtype="int64", shape=[], data=b"\0" * 8), {"ndim": 1}, r"must have 1 dimension\(s\), got shape \(\)"),
        (common_pb2.Array(dtype="int64", shape=[3], data=b"\0" * 23), {}, r"shape \(3,\) needs 24 bytes, got 23"),
        (common_pb2.Array(dtype="int16", shape=[2, 2], data=b"\0" * 10), {}, r"shape \(2, 2\) needs 8 bytes, got 10"),
        (common_pb2.Array(dtype="float32", shape=[], data=b""), {}, r"shape \(\) needs 4 bytes, got 0"),
        (common_pb2.Array(dtype="int8", shape=[-1, -2], data=b"\0\0"), {}, r"negative extent in shape \(-1, -2\)"),
    ],
    ids=[
        "unknown-dtype",
        "empty-dtype",
        "wrong-dtype",
        "wrong-ndim",
        "scalar-for-vector",
        "short",
        "long",
        "scalar-empty",
        "negative-extent",
    ],
)
def test_decode_errors_name_the_field(message: common_pb2.Array, kwargs: dict, problem: str) -> None:
    with pytest.raises(WireFormatError, match=rf"^samples\.seq: {problem}") as info:
        decode_array(message, field="samples.seq", **kwargs)
    assert isinstance(info.value, ValueError)


def test_align() -> None:
    assert ALIGNMENT == 64
    assert [align(n) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 64, 64, 64, 128, 128, 192]


# ---- chunks ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=3000), chunk=st.integers(1, 700))
def test_iter_chunks_covers_the_payload_exactly(payload: bytes, chunk: int) -> None:
    for source in (payload, bytearray(payload), memoryview(payload)):
        pieces = list(iter_chunks(source, chunk))
        assert all(isinstance(p, bytes) for p in pieces)
        assert all(1 <= len(p) <= chunk for p in pieces)
        assert all(len(p) == chunk for p in pieces[:-1])
        assert len(pieces) == -(-len(payload) // chunk)
        assert b"".join(pieces) == payload


def test_iter_chunks_of_a_typed_buffer_counts_bytes() -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    pieces = list(iter_chunks(memoryview(array), 10))
    assert [len(p) for p in pieces] == [10, 10, 10, 10, 8]
    assert b"".join(pieces) == array.tobytes()


def test_iter_chunks_default_size() -> None:
    payload = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 1)
    pieces = list(iter_chunks(payload))
    assert [len(p) for p in pieces] == [CHUNK_BYTES, CHUNK_BYTES, 256]
    assert b"".join(pieces) == payload


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(max_size=3000), chunk=st.integers(1, 700))
def test_receiver_reassembles_in_place(payload: bytes, chunk: int) -> None:
    buffer = bytearray(len(payload))
    receiver = PayloadReceiver(buffer)
    assert receiver.complete == (len(payload) == 0)
    for piece in iter_chunks(payload, chunk):
        receiver.add(piece)
    assert receiver.complete
    receiver.check_complete()
    assert bytes(buffer) == payload


def test_receiver_writes_into_typed_memory() -> None:
    source = np.arange(10, dtype=np.int64)
    target = np.zeros(10, dtype=np.int64)
    receiver = PayloadReceiver(memoryview(target))
    for piece in iter_chunks(memoryview(source), 7):
        receiver.add(piece)
    receiver.check_complete()
    assert target.tolist() == list(range(10))


def test_receiver_detects_overflow() -> None:
    buffer = bytearray(10)
    receiver = PayloadReceiver(buffer)
    receiver.add(b"a" * 6)
    with pytest.raises(WireFormatError, match=r"payload overflows: 12 bytes received, 10 announced"):
        receiver.add(b"b" * 6)
    assert bytes(buffer) == b"a" * 6 + b"\0" * 4  # nothing of the bad chunk was written
    assert not receiver.complete
    receiver.add(b"c" * 4)
    assert receiver.complete and bytes(buffer) == b"a" * 6 + b"c" * 4
    with pytest.raises(WireFormatError, match=r"payload overflows: 11 bytes received, 10 announced"):
        receiver.add(b"d")


def test_receiver_detects_truncation() -> None:
    receiver = PayloadReceiver(bytearray(10))
    receiver.add(b"x" * 5)
    assert not receiver.complete
    with pytest.raises(WireFormatError, match=r"payload truncated: 5 of 10 bytes received"):
        receiver.check_complete()
    empty = PayloadReceiver(bytearray(3))
    with pytest.raises(WireFormatError, match=r"payload truncated: 0 of 3 bytes received"):
        empty.check_complete()


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 2**62], [2**40, 2**40, 2**40]], ids=str)
def test_decode_rejects_shapes_whose_size_overflows(shape: list[int]) -> None:
    # prod(shape) * itemsize computed in int64 wraps around to 0 for these shapes, so an empty
    # `data` must still be reported as a byte count mismatch naming the field.
    message = common_pb2.Array(dtype="int8", shape=shape, data=b"")
    with pytest.raises(WireFormatError, match=r"^samples\.row: "):
        decode_array(message, field="samples.row")
