"""The trainer's side of shared-memory delivery: the constructor's slab socket, the slabs it maps,
and tensors that are views of them (no copy).

When the constructor's address is `unix://<path>` and `<path>.slabs` exists (and the environment
variable BATCHPLANE_SHM is not "0"), the client connects there and gets a session id, which each
GetBatch request names. The constructor may then place a batch in a slab: it sends the slab's
file descriptor on this socket once, before the first header that names it, and the header says
where the payload lies (`BatchHeader.shm`). Each slab is mapped once and reused for later batches.

Mapping. Without device copies the mapping is private and writable (MAP_PRIVATE: copy on
write): the trainer may write into its tensors in place, as with the gRPC path, and its writes
never reach the slab, which TP peers of the pod read at the same time; and torch gets a
writable buffer (no non-writable-buffer warning). When the slab is released, the pages the
trainer wrote are dropped (MADV_DONTNEED), so the next batch placed there is read from the slab.
With device copies (CUDA) the mapping is shared (MAP_SHARED) and registered once as pinned
memory (`cudaHostRegister`), so the copy to the GPU needs no staging copy; only the copies
reach the trainer. That path is guarded and untested on a GPU here.

Release rule. A slab is released once every tensor of the step that used it has been dropped
by the trainer (CPython reference counting: every tensor of a step is a view of one numpy
exporter whose finalizer marks the slab free), and with device copies once the copy to the
device has completed (the fetch thread waits for it before it drops the host views). Releases
are reported in the next GetBatch request; until then the constructor never writes into the
slab (if it has no free slab, that batch comes over gRPC). A trainer that keeps a step's
tensors keeps that step's slab.

A constructor that restarted no longer knows the session: the client sees EOF here, connects
again and gets a new session; slabs of the old one are unmapped once their tensors are gone.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import mmap
import os
import pathlib
import socket
import stat
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from batchplane.client import errors
from batchplane.client.bounds import MAX_BATCH_BYTES, check_placement
from batchplane.wire import SLAB_FD, SLAB_HELLO, SLAB_MESSAGE, SLAB_RETIRE, SlabMessage, WireFormatError

log = logging.getLogger(__name__)

#: Slab ids one request releases at most (the constructor's bound; the rest wait for the next).
MAX_RELEASES = 64
#: The largest slab accepted: the largest batch, rounded up to a power of two.
MAX_SLAB_BYTES = 1 << (MAX_BATCH_BYTES - 1).bit_length()
#: Slabs mapped at once from one session (the constructor's cap makes far fewer).
MAX_SLABS = 4096
#: Seals a slab must carry: its size cannot shrink under the mapping (no SIGBUS).
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def slab_socket(address: str) -> pathlib.Path | None:
    """The slab socket beside a constructor's address, when shared memory can be used: a
    `unix://` address whose `<path>.slabs` is a socket, and BATCHPLANE_SHM is not "0"."""
    if os.environ.get("BATCHPLANE_SHM", "1") == "0" or not address.startswith("unix:"):
        return None
    path = pathlib.Path(address.removeprefix("unix://").removeprefix("unix:") + ".slabs")
    try:
        return path if stat.S_ISSOCK(path.stat().st_mode) else None
    except OSError:
        return None


@dataclasses.dataclass
class _Mapped:
    slab: int
    size: int
    map: mmap.mmap
    shared: bool
    registered: int = 0  # the address registered with CUDA, 0 when not
    views: int = 0
    retired: bool = False


class SlabChannel:
    """One session on a constructor's slab socket (see the module docstring).

    Args:
        path: The slab socket (`slab_socket`).
        timeout_s: How long to wait for the session id, and for a slab's fd a header names.
        pin: Map shared and register each slab with CUDA (device copies follow); else private.
    Raises:
        OSError: the socket cannot be reached.
        ProtocolError: the first message is not a session id.
    """

    def __init__(self, path: pathlib.Path, *, timeout_s: float = 10.0, pin: bool = False) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.pin = pin
        self.alive = True
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(path))
            hello = self._receive(block=True)
        except BaseException:
            self._sock.close()
            raise
        if hello is None or hello[0].kind != SLAB_HELLO:
            self._sock.close()
            raise errors.ProtocolError(f"slab socket {path}: the first message is not a session id")
        self.session = hello[0].session
        #: Guards the slabs and their views: the trainer drops tensors (finalizers, `_on_drop`)
        #: on its own thread while the fetch thread maps, releases or finds the session dead.
        #: Reentrant: a finalizer may run on a thread that holds it (a collection it triggers).
        self._lock = threading.RLock()
        self._slabs: dict[int, _Mapped] = {}
        #: Slabs whose views were dropped while the session lives (appended by finalizers).
        self._dropped: collections.deque[_Mapped] = collections.deque()
        self._releases: list[int] = []

    # ---- the socket ----------------------------------------------------------------------

    def _receive(self, *, block: bool) -> tuple[SlabMessage, int | None] | None:
        """The next message and its fd; None when none is waiting (not `block`). Raises
        ConnectionError at EOF, ProtocolError for a malformed message."""
        if not block:
            self._sock.setblocking(False)
        try:
            data, fds, flags, _ = socket.recv_fds(self._sock, SLAB_MESSAGE.size + 1, 1)
        except BlockingIOError:
            return None
        finally:
            if not block:
                self._sock.settimeout(self.timeout_s)
        fd = fds[0] if fds else None
        try:
            if not data:
                raise ConnectionError("the constructor closed the slab socket")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise errors.ProtocolError(f"slab socket {self.path}: an oversized message")
            message = SlabMessage.decode(data)
            if (fd is not None) != (message.kind == SLAB_FD):
                raise errors.ProtocolError(
                    f"slab socket {self.path}: a message of kind {message.kind} with{'' if fd is not None else 'out'} an fd"
                )
        except WireFormatError as exc:
            if fd is not None:
                os.close(fd)
            raise errors.ProtocolError(f"slab socket {self.path}: {exc}") from None
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return message, fd

    def _handle(self, message: SlabMessage, fd: int | None) -> None:
        if message.kind == SLAB_RETIRE:
            mapped = self._slabs.get(message.slab)
            if mapped is not None:
                mapped.retired = True
                if not mapped.views:
                    self._unmap(mapped)
            return
        if message.kind != SLAB_FD or fd is None:
            raise errors.ProtocolError(f"slab socket {self.path}: unexpected message of kind {message.kind}")
        try:
            if message.slab in self._slabs or len(self._slabs) >= MAX_SLABS:
                raise errors.ProtocolError(f"slab socket {self.path}: slab {message.slab} sent twice, or past {MAX_SLABS} slabs")
            if not 0 < message.size <= MAX_SLAB_BYTES or os.fstat(fd).st_size != message.size:
                raise errors.ProtocolError(f"slab socket {self.path}: slab {message.slab} of {message.size} bytes does not match its memfd")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS != REQUIRED_SEALS:
                raise errors.ProtocolError(f"slab socket {self.path}: slab {message.slab} is not sealed against shrinking")
            if self.pin:
                m = mmap.mmap(fd, message.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                m = mmap.mmap(fd, message.size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)  # the mapping keeps the memory
        mapped = _Mapped(message.slab, message.size, m, shared=self.pin)
        if self.pin:
            mapped.registered = _register(m)
        self._slabs[message.slab] = mapped

    def poll(self) -> None:
        """Handles what the constructor sent meanwhile and the views the trainer dropped (on the
        fetch thread, before each request). EOF marks the session dead (`alive`)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        while self.alive:
            try:
                received = self._receive(block=False)
            except (ConnectionError, OSError):
                self._die()
                break
            if received is None:
                break
            self._handle(*received)
        while self._dropped:
            mapped = self._dropped.popleft()
            mapped.views -= 1
            if mapped.views:
                continue
            if not self.alive or mapped.retired:
                self._unmap(mapped)
                continue
            if not mapped.shared:
                try:
                    mapped.map.madvise(mmap.MADV_DONTNEED)  # the trainer's private writes go
                except (OSError, ValueError):  # pragma: no cover - a kernel without it
                    pass
            self._releases.append(mapped.slab)

    def take_releases(self) -> list[int]:
        """Slabs to report released in the next request (at most MAX_RELEASES); once taken they
        are not reported again."""
        with self._lock:
            taken, self._releases = self._releases[:MAX_RELEASES], self._releases[MAX_RELEASES:]
        return taken

    # ---- views ---------------------------------------------------------------------------

    def view(self, placement: Any, payload_bytes: int) -> torch.Tensor:
        """The payload a header places in shared memory, as a uint8 tensor viewing the slab.

        Raises:
            ProtocolError: a slab that never arrives within `timeout_s`, or a placement outside it.
            DataPlaneUnavailable: the socket closed first (the constructor is gone).
        """
        give_up = time.monotonic() + self.timeout_s
        while placement.slab not in self._slabs:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise errors.ProtocolError(f"slab socket {self.path}: slab {placement.slab} never arrived")
            self._sock.settimeout(remaining)
            try:
                received = self._receive(block=True)
            except (ConnectionError, OSError) as exc:
                self._die()
                if isinstance(exc, socket.timeout):
                    raise errors.ProtocolError(f"slab socket {self.path}: slab {placement.slab} never arrived") from None
                raise errors.DataPlaneUnavailable(f"slab socket {self.path}: {exc}") from None
            if received is not None:
                with self._lock:
                    self._handle(*received)
        with self._lock:
            mapped = self._slabs[placement.slab]
            check_placement(placement, slab_bytes=mapped.size, payload_bytes=payload_bytes, where=str(self.path))
            exporter = np.frombuffer(mapped.map, np.uint8, count=placement.length, offset=placement.offset)
            mapped.views += 1
        weakref.finalize(exporter, self._on_drop, mapped).atexit = False
        return torch.from_numpy(exporter)

    def _on_drop(self, mapped: _Mapped) -> None:
        """A step's views are gone (a finalizer: any thread, the buffer still exported)."""
        with self._lock:
            if self.alive:
                self._dropped.append(mapped)  # the fetch thread releases it (`poll`)
                return
            mapped.views -= 1  # a dead session: forget the slab; it unmaps with its last reference
            if not mapped.views:
                if mapped.registered:
                    _unregister(mapped.registered)
                    mapped.registered = 0
                self._slabs.pop(mapped.slab, None)

    def mapped(self) -> int:
        """Slabs mapped now."""
        return len(self._slabs)

    # ---- lifetime ------------------------------------------------------------------------

    def _die(self) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            self._releases.clear()
            self._sock.close()
            while self._dropped:
                self._dropped.popleft().views -= 1
            for mapped in list(self._slabs.values()):
                if not mapped.views:
                    self._unmap(mapped)

    def _unmap(self, mapped: _Mapped) -> None:
        self._slabs.pop(mapped.slab, None)
        if mapped.registered:
            _unregister(mapped.registered)
            mapped.registered = 0
        try:
            mapped.map.close()
        except BufferError:  # a view is being torn down on another thread: it unmaps with the object
            pass

    def close(self) -> None:
        """Ends the session; slabs still viewed stay mapped until their tensors are gone."""
        self._die()


def _register(m: mmap.mmap) -> int:
    """Registers a mapping as pinned memory with CUDA; its address, or 0 (not registered).
    Untested on a GPU in this repository's CI."""
    if not torch.cuda.is_available():
        return 0
    probe = np.frombuffer(m, np.uint8)
    address, nbytes = int(probe.ctypes.data), probe.nbytes
    del probe
    try:
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    except Exception as exc:  # noqa: BLE001 - pragma: no cover - an optimization only; needs a GPU
        log.warning("cannot register a slab as pinned memory: %s; host-to-device copies stage", exc)
        return 0
    if int(getattr(err, "value", err)) != 0:  # pragma: no cover - needs a GPU
        log.warning("cudaHostRegister failed (%s); host-to-device copies stage", err)
        return 0
    return address


def _unregister(address: int) -> None:  # pragma: no cover - needs a GPU
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - the mapping goes anyway
        pass
