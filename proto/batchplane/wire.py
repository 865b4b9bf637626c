"""How arrays and bulk payloads travel on the wire; shared by the services and the client.

Arrays travel as `batchplane.v1.Array` (dtype name, shape, raw little-endian bytes). Bulk
payloads travel as a header naming their size followed by `Chunk`s of about 1 MiB, which the
receiver writes into one preallocated buffer. Imports only numpy and protobuf.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import numpy as np

from batchplane.v1 import common_pb2

CHUNK_BYTES = 1 << 20
ALIGNMENT = 64
DTYPES = frozenset({"bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"})

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("batchplane's wire format assumes a little-endian host")


class WireFormatError(ValueError):
    """A message does not follow the wire format; the text names the field."""


def encode_array(array: np.ndarray) -> common_pb2.Array:
    """The wire form of `array` (copied into the message as C-ordered bytes)."""
    array = np.asarray(array)
    if array.dtype.name not in DTYPES:
        raise WireFormatError(f"dtype {array.dtype.name!r} cannot travel; use one of {sorted(DTYPES)}")
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return common_pb2.Array(dtype=array.dtype.name, shape=array.shape, data=little.tobytes())


def decode_array(
    message: common_pb2.Array, *, field: str, dtype: str | None = None, ndim: int | None = None
) -> np.ndarray:
    """The array a message carries, as a read-only view of its bytes (no copy).

    Args:
        message: The Array message.
        field: Name used in error messages, e.g. "samples.seq".
        dtype: Required dtype name, if any.
        ndim: Required number of dimensions, if any.
    Raises:
        WireFormatError: unknown or unexpected dtype, wrong rank, or a byte count that does not
            match the shape.
    """
    if message.dtype not in DTYPES:
        raise WireFormatError(f"{field}: unknown dtype {message.dtype!r}")
    if dtype is not None and message.dtype != dtype:
        raise WireFormatError(f"{field}: dtype must be {dtype}, got {message.dtype}")
    shape = tuple(message.shape)
    if ndim is not None and len(shape) != ndim:
        raise WireFormatError(f"{field}: must have {ndim} dimension(s), got shape {shape}")
    if any(d < 0 for d in shape):
        raise WireFormatError(f"{field}: negative extent in shape {shape}")
    itemsize = np.dtype(message.dtype).itemsize
    expected = math.prod(shape) * itemsize  # Python ints: no overflow
    if len(message.data) != expected:
        raise WireFormatError(f"{field}: shape {shape} needs {expected} bytes, got {len(message.data)}")
    return np.frombuffer(message.data, dtype=message.dtype).reshape(shape)


def align(nbytes: int) -> int:
    """`nbytes` rounded up to the payload alignment (64 bytes)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def iter_chunks(payload: memoryview | bytes | bytearray, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`payload` cut into pieces of at most `chunk_bytes` (each copied once into bytes, which
    is what the protobuf runtime accepts). Raises ValueError when chunk_bytes < 1."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    view = memoryview(payload).cast("B")
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


class PayloadReceiver:
    """Reassembles a chunked payload into one buffer allocated up front.

    Args:
        buffer: Writable buffer of exactly the payload's size (a bytearray, or the memory of a
            pinned tensor); the chunks are copied into it in order.
    """

    def __init__(self, buffer: memoryview | bytearray) -> None:
        self._view = memoryview(buffer).cast("B")
        self._filled = 0

    def add(self, chunk: bytes) -> None:
        """Appends the next chunk. Raises WireFormatError when it overflows the payload."""
        end = self._filled + len(chunk)
        if end > len(self._view):
            raise WireFormatError(f"payload overflows: {end} bytes received, {len(self._view)} announced")
        self._view[self._filled : end] = chunk
        self._filled = end

    @property
    def complete(self) -> bool:
        return self._filled == len(self._view)

    def check_complete(self) -> None:
        """Raises WireFormatError when the stream ended before the announced size."""
        if not self.complete:
            raise WireFormatError(f"payload truncated: {self._filled} of {len(self._view)} bytes received")
