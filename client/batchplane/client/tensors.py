"""Turning a received batch payload into torch tensors without copying it.

The payload is received straight into one buffer (`ReceiveBuffers`, reused across batches):
pinned memory when CUDA is available (so the copy to the GPU can run asynchronously), plain
memory otherwise. Each tensor is a typed view of its slice of that buffer.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

TORCH_DTYPES = {
    "bool": torch.bool,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
#: Bytes per element of each dtype.
_ITEM_BYTES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}


class ReceiveBuffers:
    """Buffers the gRPC path receives batches into, reused across batches (a fresh 40 MB buffer
    per batch costs its page faults every time).

    Rule, as for shared-memory slabs: a buffer is reused only once every tensor of the batch
    received into it has been dropped (CPython reference counting: the batch's tensors are
    views of one numpy exporter whose finalizer gives the buffer back), and with device copies
    once the copy has completed (the fetch thread waits for it before it drops the host views).
    A trainer that keeps a step's tensors keeps its buffer; at most `keep` free buffers are kept.
    Pinned buffers (CUDA) and plain ones are kept apart.
    """

    def __init__(self, *, keep: int = 4) -> None:
        self._keep = keep
        self._free: list[tuple[bool, int, np.ndarray]] = []  # (pinned, capacity, memory)
        self._lock = threading.Lock()

    def take(self, nbytes: int, *, pin: bool) -> tuple[torch.Tensor, memoryview]:
        """A uint8 tensor of `nbytes` and a writable view of the same memory to receive into:
        the smallest free buffer that fits (and wastes at most half of itself), else a new one."""
        with self._lock:
            fits = [i for i, (p, capacity, _) in enumerate(self._free) if p == pin and nbytes <= capacity <= 2 * max(nbytes, 1)]
            memory = self._free.pop(min(fits, key=lambda i: self._free[i][1]))[2] if fits else None
        if memory is None:
            memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy() if pin else np.empty(nbytes, np.uint8)
        exporter = memory[:nbytes]  # a view of its own: its finalizer says when the batch is gone
        weakref.finalize(exporter, self._give_back, pin, memory).atexit = False
        return torch.from_numpy(exporter), memoryview(exporter)  # type: ignore[arg-type]  # numpy types ndarray.__buffer__ on 3.12+ only

    def _give_back(self, pin: bool, memory: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append((pin, len(memory), memory))

    @property
    def free(self) -> int:
        """Free buffers kept."""
        with self._lock:
            return len(self._free)


def unpack(storage: torch.Tensor, specs: Iterable[Any]) -> dict[str, torch.Tensor]:
    """The tensors `specs` (name, dtype, shape, offset) lay out in `storage`, as views."""
    out = {}
    for spec in specs:
        shape = tuple(spec.shape)
        nbytes = math.prod(shape) * _ITEM_BYTES[spec.dtype]
        out[spec.name] = storage[spec.offset : spec.offset + nbytes].view(TORCH_DTYPES[spec.dtype]).view(shape)
    return out
