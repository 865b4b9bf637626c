"""Where a rank's tensors go and how they get there.

With CUDA, each rank's tensors go to the rank's own GPU: cuda:LOCAL_RANK (torchrun sets it), or
the only visible device when each process sees one (CUDA_VISIBLE_DEVICES per process). The
client receives into pinned host memory on a background thread; that thread selects the rank's
device before it touches CUDA (a new thread does not inherit `torch.cuda.set_device`, so it
would otherwise create a context on cuda:0 and copy every rank's batch there), and copies on a
side stream of its own. The consuming thread's stream then waits for that copy before it uses
the tensors, and the tensors are recorded as used on it, so the caching allocator never hands
their memory out while the trainer still reads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from batchplane.client.errors import InvalidRequestError

AUTO = "auto"


def resolve_device(
    device: str | torch.device | None,
    *,
    environ: Mapping[str, str] | None = None,
    cuda_available: bool | None = None,
    device_count: int | None = None,
) -> torch.device | None:
    """The device a rank's tensors go to; None keeps them on the CPU.

    Args:
        device: "auto": the rank's GPU when CUDA is available, else the CPU; "cuda" (no index):
            the rank's GPU; "cuda:i" or a torch.device: that device; None or "cpu": the CPU.
        environ, cuda_available, device_count: what to read instead of os.environ and
            torch.cuda (tests).

    The rank's GPU is cuda:LOCAL_RANK, or cuda:0 when exactly one device is visible.

    Raises:
        InvalidRequestError: CUDA asked for but not available, LOCAL_RANK not an integer, or
            no device for LOCAL_RANK among the visible ones.
    """
    env = os.environ if environ is None else environ
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if device is None:
        return None
    if isinstance(device, str) and device == AUTO:
        if not available:
            return None
        device = "cuda"
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return None
    if resolved.type != "cuda" or resolved.index is not None:
        if resolved.type == "cuda" and not available:
            raise InvalidRequestError(f"device={str(device)!r} but CUDA is not available")
        return resolved
    if not available:
        raise InvalidRequestError(f"device={str(device)!r} but CUDA is not available")
    count = torch.cuda.device_count() if device_count is None else device_count
    text = env.get("LOCAL_RANK", "")
    if not text:
        return torch.device("cuda", 0 if count == 1 else torch.cuda.current_device())
    if not text.isdigit():
        raise InvalidRequestError(f"LOCAL_RANK={text!r} is not an integer")
    local = int(text)
    if local < count:
        return torch.device("cuda", local)
    if count == 1:  # one device visible per process (CUDA_VISIBLE_DEVICES): it is this rank's
        return torch.device("cuda", 0)
    raise InvalidRequestError(f"LOCAL_RANK={local} but only {count} CUDA devices are visible; pass device= explicitly")


class DeviceCopier:
    """Copies batches to one CUDA device from a background thread (see the module docstring).

    Args:
        device: The CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: torch.cuda.Stream | None = None

    def bind_thread(self) -> None:
        """Selects the device on the calling (background) thread; run before it touches CUDA."""
        torch.cuda.set_device(self.device)

    def copy(self, tensors: Iterable[Mapping[str, torch.Tensor]]) -> tuple[list[dict[str, torch.Tensor]], Any]:
        """The tensors of each mapping copied to the device on the side stream (non-blocking,
        from pinned memory), and the event that marks the copies' end."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side):
            out = [{k: v.to(self.device, non_blocking=True) for k, v in group.items()} for group in tensors]
            done = torch.cuda.Event()
            done.record(self._side)
        return out, done

    def hand_over(self, tensors: Iterable[Mapping[str, torch.Tensor]], done: Any) -> None:
        """On the consuming thread: its current stream waits for the copies, and the tensors are
        recorded as used on it."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        for group in tensors:
            for t in group.values():
                t.record_stream(stream)
