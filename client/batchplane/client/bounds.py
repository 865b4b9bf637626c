"""What a client accepts from its constructor before it allocates: a batch header's payload size
must be what its tensors lay out, and at most `MAX_BATCH_BYTES`. Pure: no grpc, no torch.

A constructor lays a rank's batch out as its microbatches' tensors, then its secondary graphs'
tensors, each at an offset that is a multiple of 64 and each padded to one; so the payload is
exactly the end of the last tensor rounded up to 64 bytes. A header that announces another size,
a tensor outside the payload or of a dtype the client does not know, or a batch past the
maximum, is a protocol error of that call: nothing is allocated from its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from batchplane.client.errors import ProtocolError

#: The largest batch payload a client receives (one rank's batch of one step; a batch of a
#: million tokens takes about 50 MB).
MAX_BATCH_BYTES = 16 << 30
#: Bytes per element of every dtype a batch may carry.
ITEM_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8}
ALIGNMENT = 64


def check_batch_header(header: Any, *, address: str, max_bytes: int = MAX_BATCH_BYTES) -> int:
    """The payload size a BatchHeader announces, once checked against its tensors.

    Args:
        header: The BatchHeader (payload_bytes, microbatches[].tensors, subbatches[].tensors).
        address: The constructor's address, for the error.
        max_bytes: The largest payload accepted.
    Returns:
        header.payload_bytes.
    Raises:
        ProtocolError: a size other than what the tensors lay out, a tensor of an unknown dtype,
            a negative extent or an offset that is not a multiple of 64, or more than `max_bytes`.
    """
    specs: Iterable[Any] = [t for mb in header.microbatches for t in mb.tensors] + [t for sub in header.subbatches for t in sub.tensors]
    end = 0
    for spec in specs:
        if spec.dtype not in ITEM_BYTES:
            raise ProtocolError(f"constructor at {address}: tensor {spec.name!r} has unknown dtype {spec.dtype!r}")
        if spec.offset < 0 or spec.offset % ALIGNMENT or any(d < 0 for d in spec.shape):
            raise ProtocolError(f"constructor at {address}: tensor {spec.name!r} at offset {spec.offset} with shape {list(spec.shape)}")
        end = max(end, spec.offset + math.prod(spec.shape) * ITEM_BYTES[spec.dtype])
    laid_out = -(-end // ALIGNMENT) * ALIGNMENT
    if not end <= header.payload_bytes <= laid_out:
        raise ProtocolError(
            f"constructor at {address}: the header announces {header.payload_bytes} payload bytes, its tensors lay out {laid_out}"
        )
    if header.payload_bytes > max_bytes:
        raise ProtocolError(f"constructor at {address}: a batch of {header.payload_bytes} bytes, more than the client's {max_bytes}")
    return header.payload_bytes


def check_placement(placement: Any, *, slab_bytes: int, payload_bytes: int, where: str) -> None:
    """Checks a BatchHeader's `shm` placement against the slab it names.

    Args:
        placement: The ShmPlacement (slab, offset, length).
        slab_bytes: The slab's size (its memfd's, sealed).
        payload_bytes: The header's payload_bytes.
        where: The slab socket, for the error.
    Raises:
        ProtocolError: a length other than the payload's, an offset that is negative or not a
            multiple of 64, or bytes past the slab's end.
    """
    if (
        placement.length != payload_bytes
        or placement.offset < 0
        or placement.offset % ALIGNMENT
        or placement.offset + placement.length > slab_bytes
    ):
        raise ProtocolError(
            f"slab socket {where}: payload of {payload_bytes} bytes placed at [{placement.offset}, "
            f"{placement.offset + placement.length}) of slab {placement.slab} of {slab_bytes} bytes"
        )
