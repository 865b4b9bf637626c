"""Turning a received batch payload into torch tensors without copying it.

The payload is received straight into one buffer: pinned memory when CUDA is available (so the
copy to the GPU can run asynchronously), a bytearray otherwise (wrapped with torch.frombuffer).
Each tensor is a typed view of its slice of that buffer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


def allocate(nbytes: int, *, pin: bool) -> tuple[torch.Tensor, memoryview]:
    """A uint8 tensor of `nbytes` and a writable view of the same memory to receive into."""
    if pin:
        storage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return storage, memoryview(storage.numpy())
    buffer = bytearray(nbytes)
    storage = torch.frombuffer(buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return storage, memoryview(buffer)


def unpack(storage: torch.Tensor, specs: Iterable[Any]) -> dict[str, torch.Tensor]:
    """The tensors `specs` (name, dtype, shape, offset) lay out in `storage`, as views."""
    out = {}
    for spec in specs:
        dtype = TORCH_DTYPES[spec.dtype]
        shape = tuple(spec.shape)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        out[spec.name] = storage[spec.offset : spec.offset + nbytes].view(dtype).view(shape)
    return out
