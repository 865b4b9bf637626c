"""Shared-memory delivery from a constructor to the trainers of its pod: a pool of reusable memfd
slabs, and the slab socket that passes their file descriptors to the clients.

Three layers:

- `SlabBook`: the pure bookkeeping (size classes, the byte cap, free lists, who holds what). No
  I/O, no threads; tested in milliseconds.
- `SlabPool`: the slabs themselves. A slab is a memfd (`memfd_create("batchplane-slab")`) cut to
  its size class, sealed against shrinking and growing (a client trusts its size and never takes
  a SIGBUS), mapped once here. A batch is copied into a slab once, when it is first served; the
  ranks served the very same built batch with the same extra bytes (TP peers) share that slab.
  A slab returns to its free list when no session holds it and the built batch it holds is
  gone (garbage collected: the pipeline dropped the step); it is reused, never reallocated per
  batch. Above `constructors.shm_bytes` a placement fails and that batch goes over gRPC.
- `SlabServer`: a SOCK_SEQPACKET Unix socket beside the trainer's gRPC socket (`<path>.slabs`),
  served by one thread. A client that connects gets a session id; before a GetBatch header names
  a slab the session has not seen, its fd is sent once (SCM_RIGHTS). A session ends at EOF (the
  trainer exited or was killed): every slab it held is released. Nothing is ever named in the
  file system, so nothing is left behind in /dev/shm after a SIGKILL of either side.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import mmap
import os
import pathlib
import secrets
import selectors
import socket
import stat
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from batchplane.wire import SLAB_FD, SLAB_HELLO, SLAB_RETIRE, SlabMessage

log = logging.getLogger(__name__)

#: The smallest slab; sizes are powers of two from here.
MIN_SLAB_BYTES = 1 << 20
#: Sessions per served rank (a trainer reconnects after a constructor restart; a few spare).
SESSIONS_PER_RANK = 4
#: How long a send on a session's socket may block before the session is given up.
SEND_TIMEOUT_S = 5.0
#: Fallback reasons (the label of batchplane_constructor_shm_fallbacks_total).
FULL = "full"
TOO_LARGE = "too_large"
UNKNOWN_SESSION = "unknown_session"
SESSION_LOST = "session_lost"


def size_class(nbytes: int) -> int:
    """The slab size that holds `nbytes`: the next power of two, at least MIN_SLAB_BYTES."""
    return max(MIN_SLAB_BYTES, 1 << max(nbytes - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Acquired:
    """A slab given to a placement: reused from a free list (`new` False) or to be made, after
    destroying the free slabs `retire` to stay under the cap."""

    slab: int
    size: int
    new: bool
    retire: tuple[int, ...] = ()


@dataclasses.dataclass
class _Entry:
    size: int
    owned: bool = True
    holders: set[str] = dataclasses.field(default_factory=set)


class SlabBook:
    """Which slabs exist, which are free, who holds the others. Pure.

    A slab is busy from `acquire` until it is neither owned (its built batch is alive:
    `disown` ends that) nor held by a session (`hold` / `release` / `end_session`); then it is
    free, on the free list of its size class, and `acquire` reuses it (last freed first).

    Args:
        cap_bytes: The most bytes all slabs together may take.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._slabs: dict[int, _Entry] = {}
        self._free: dict[int, list[int]] = collections.defaultdict(list)
        self._next_id = 1
        self.allocated_bytes = 0

    @property
    def slabs(self) -> int:
        return len(self._slabs)

    def free_slabs(self) -> int:
        return sum(len(ids) for ids in self._free.values())

    def acquire(self, nbytes: int) -> Acquired | str:
        """A slab for `nbytes`, owned (by the caller's built batch) and held by nobody yet; or
        the reason there is none (TOO_LARGE: past the cap on its own; FULL: busy slabs fill it)."""
        size = size_class(nbytes)
        if size > self.cap_bytes:
            return TOO_LARGE
        if self._free[size]:
            slab = self._free[size].pop()
            self._slabs[slab] = _Entry(size)
            return Acquired(slab, size, new=False)
        retire: list[int] = []
        over = self.allocated_bytes + size - self.cap_bytes
        if over > 0:
            spare = sorted(((s, i) for s, ids in self._free.items() for i in ids), reverse=True)
            if sum(s for s, _ in spare) < over:
                return FULL
            for s, i in spare:
                if over <= 0:
                    break
                retire.append(i)
                over -= s
            for i in retire:
                entry = self._slabs.pop(i)
                self._free[entry.size].remove(i)
                self.allocated_bytes -= entry.size
        slab = self._next_id
        self._next_id += 1
        self._slabs[slab] = _Entry(size)
        self.allocated_bytes += size
        return Acquired(slab, size, new=True, retire=tuple(retire))

    def hold(self, slab: int, session: str) -> None:
        """`session` views `slab` (idempotent)."""
        self._slabs[slab].holders.add(session)

    def holds(self, slab: int, session: str) -> bool:
        entry = self._slabs.get(slab)
        return entry is not None and session in entry.holders

    def release(self, slab: int, session: str) -> bool:
        """`session` no longer views `slab`; True when that freed it."""
        entry = self._slabs[slab]
        entry.holders.discard(session)
        return self._maybe_free(slab, entry)

    def disown(self, slab: int) -> bool:
        """The built batch `slab` holds is gone; True when that freed it."""
        entry = self._slabs.get(slab)
        if entry is None:
            return False
        entry.owned = False
        return self._maybe_free(slab, entry)

    def end_session(self, session: str) -> list[int]:
        """Releases every slab `session` held; the slabs that freed."""
        freed = []
        for slab, entry in list(self._slabs.items()):
            if session in entry.holders:
                entry.holders.discard(session)
                if self._maybe_free(slab, entry):
                    freed.append(slab)
        return freed

    def _maybe_free(self, slab: int, entry: _Entry) -> bool:
        if entry.owned or entry.holders or slab in self._free[entry.size]:
            return False
        self._free[entry.size].append(slab)
        return True


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a served batch lies: bytes [offset, offset + length) of slab `slab`."""

    slab: int
    offset: int
    length: int


class _Slab:
    """A sealed memfd of `size` bytes, mapped here read-write."""

    def __init__(self, slab: int, size: int) -> None:
        self.id = slab
        self.size = size
        self.fd = os.memfd_create("batchplane-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(
                self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # pragma: no cover - a copy still running; the mapping goes with the object
            pass
        os.close(self.fd)


class Session:
    """One client's connection to the slab socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.id = secrets.token_hex(16)
        self.sock = sock
        #: Slabs whose fd this session was sent.
        self.sent: set[int] = set()
        self.lock = threading.Lock()
        self.closed = False

    def send(self, message: SlabMessage, fd: int | None = None) -> None:
        """Raises OSError when the client is gone or does not read."""
        with self.lock:
            if self.closed:
                raise BrokenPipeError("session ended")
            if fd is None:
                self.sock.sendall(message.encode())
            else:
                socket.send_fds(self.sock, [message.encode()], [fd])


class SlabPool:
    """The slabs of one constructor (see the module docstring). Thread-safe.

    Args:
        cap_bytes: `constructors.shm_bytes`.
        metrics: The constructor's metrics (ConstructorMetrics), or None.
    """

    def __init__(self, cap_bytes: int, metrics: Any = None) -> None:
        self._book = SlabBook(cap_bytes)
        self._slabs: dict[int, _Slab] = {}
        self._metrics = metrics
        self._lock = threading.Lock()
        #: Placements by id() of the built batch: [(weakref to it, extra, placement)].
        self._placed: dict[int, list[tuple[weakref.ref, bytes, Placement]]] = {}
        #: Slabs whose built batch died, waiting for the lock (appended by finalizers, which
        #: may run on any thread at any moment, so they never take the lock themselves).
        self._dead: collections.deque[tuple[int, int]] = collections.deque()
        self._sessions: dict[str, Session] = {}

    # ---- sessions ------------------------------------------------------------------------

    def open_session(self, session: Session) -> None:
        with self._lock:
            self._sessions[session.id] = session
            self._gauges()

    def session(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def end_session(self, session: Session) -> None:
        """The client is gone: every slab it held is released."""
        with session.lock:
            session.closed = True
        with self._lock:
            self._sessions.pop(session.id, None)
            self._book.end_session(session.id)
            self._collect()
            self._gauges()

    def holds(self, session: Session, slab: int) -> bool:
        with self._lock:
            return self._book.holds(slab, session.id)

    def release(self, session: Session, slabs: Iterable[int]) -> None:
        """`session` no longer views `slabs` (checked by the caller: each one it holds)."""
        with self._lock:
            for slab in slabs:
                if self._book.holds(slab, session.id):
                    self._book.release(slab, session.id)
            self._collect()

    # ---- placement -----------------------------------------------------------------------

    def place(self, batch: Any, extra: bytes | bytearray, session: Session) -> Placement | str:
        """Where `batch.payload` followed by `extra` lies in shared memory, held by `session`:
        the slab it was already copied into for another rank, or a slab it is copied into now.
        Returns the reason when it cannot be placed (FULL, TOO_LARGE)."""
        payload = memoryview(batch.payload).cast("B")
        length = len(payload) + len(extra)
        with self._lock:
            self._collect()
            for ref, their_extra, placement in self._placed.get(id(batch), ()):
                if ref() is batch and their_extra == extra:
                    self._book.hold(placement.slab, session.id)
                    return placement
            acquired = self._book.acquire(length)
            if isinstance(acquired, str):
                self._count_fallback(acquired)
                return acquired
            for slab in acquired.retire:
                self._retire(slab)
            if acquired.new:
                try:
                    self._slabs[acquired.slab] = _Slab(acquired.slab, acquired.size)
                except OSError as exc:
                    log.warning("cannot make a shared-memory slab of %d bytes: %s; serving over gRPC", acquired.size, exc)
                    self._book.disown(acquired.slab)
                    self._count_fallback(FULL)
                    return FULL
            self._book.hold(acquired.slab, session.id)
            slab = self._slabs[acquired.slab]
            self._gauges()
        # The copy runs without the lock: the slab is owned and held, so nobody else touches it.
        slab.map[: len(payload)] = payload
        slab.map[len(payload) : length] = extra
        placement = Placement(slab.id, 0, length)
        with self._lock:
            try:
                ref = weakref.ref(batch)
            except TypeError:  # an object without weak references: placed for this rank only
                self._book.disown(slab.id)
            else:
                self._placed.setdefault(id(batch), []).append((ref, extra, placement))
                finalizer = weakref.finalize(batch, self._dead.append, (id(batch), slab.id))
                finalizer.atexit = False
        if self._metrics is not None:
            self._metrics.shm_placements.inc()
        return placement

    def fd(self, slab: int) -> tuple[int, int]:
        """The fd and size of a slab a session holds."""
        with self._lock:
            s = self._slabs[slab]
            return s.fd, s.size

    def _collect(self) -> None:
        """Disowns the slabs whose built batch died (under the lock)."""
        while self._dead:
            key, slab = self._dead.popleft()
            entries = [e for e in self._placed.get(key, ()) if e[2].slab != slab]
            if entries:
                self._placed[key] = entries
            else:
                self._placed.pop(key, None)
            self._book.disown(slab)

    def _retire(self, slab: int) -> None:
        """Destroys a free slab (to make room under the cap); tells the sessions that mapped it."""
        s = self._slabs.pop(slab)
        for session in self._sessions.values():
            if slab in session.sent:
                session.sent.discard(slab)
                with session.lock:  # never blocks the pool: a full socket skips the message
                    try:
                        session.sock.setblocking(False)
                        session.sock.send(SlabMessage(SLAB_RETIRE, slab, s.size).encode())
                    except OSError:
                        pass  # a client that does not read keeps its mapping until its session ends
                    finally:
                        try:
                            session.sock.settimeout(SEND_TIMEOUT_S)
                        except OSError:
                            pass
        s.close()

    def _count_fallback(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.shm_fallbacks.labels(reason).inc()

    def count_fallback(self, reason: str) -> None:
        self._count_fallback(reason)

    def _gauges(self) -> None:
        if self._metrics is not None:
            self._metrics.shm_slabs.set(self._book.slabs)
            self._metrics.shm_mapped_bytes.set(self._book.allocated_bytes)
            self._metrics.shm_sessions.set(len(self._sessions))

    def close(self) -> None:
        with self._lock:
            for s in self._slabs.values():
                s.close()
            self._slabs.clear()


def slab_socket_path(listen: str) -> pathlib.Path:
    """The slab socket beside a trainer socket "unix://<path>": `<path>.slabs`."""
    return pathlib.Path(listen.removeprefix("unix://").removeprefix("unix:") + ".slabs")


class SlabServer:
    """Serves the slab socket on a thread of its own (see the module docstring).

    Args:
        path: The socket's path (`slab_socket_path`); its folder made by prepare_socket_folder,
            and the caller's umask keeps the socket owner-and-group only.
        pool: The slabs.
        max_sessions: Sessions open at once; a client past them is closed at once (it uses gRPC).
    """

    def __init__(self, path: pathlib.Path, pool: SlabPool, *, max_sessions: int) -> None:
        self.path = path
        self.pool = pool
        self.max_sessions = max_sessions
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # left by a constructor that was killed
        except FileNotFoundError:
            pass
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="slab-socket", daemon=True)

    def start(self) -> SlabServer:
        self._thread.start()
        return self

    def _run(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        while not self._stopped:
            for key, _ in self._selector.select():
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is not self._wake_r:
                    self._readable(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        if self.pool.sessions >= self.max_sessions:
            log.warning("slab socket: %d sessions open already; a client is refused (it uses gRPC)", self.max_sessions)
            sock.close()
            return
        sock.settimeout(SEND_TIMEOUT_S)
        session = Session(sock)
        self.pool.open_session(session)  # before the client learns its id and may name it
        try:
            session.send(SlabMessage(SLAB_HELLO, session=session.id))
        except OSError:
            self.pool.end_session(session)
            sock.close()
            return
        self._selector.register(sock, selectors.EVENT_READ, session)
        log.debug("slab session %s opened", session.id)

    def _readable(self, session: Session) -> None:
        """A client never sends: EOF ends its session, and so does anything else it sends."""
        try:
            data = session.sock.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            log.warning("slab socket: a client sent %d bytes; its session ends", len(data))
        log.debug("slab session %s ended", session.id)
        self._selector.unregister(session.sock)
        self.pool.end_session(session)
        session.sock.close()

    def send_slab(self, session: Session, slab: int) -> None:
        """Sends slab `slab`'s fd to `session` unless it has it. Raises OSError when the
        session is gone (it is then shut down; its thread ends it)."""
        if slab in session.sent:
            return
        fd, size = self.pool.fd(slab)
        try:
            session.send(SlabMessage(SLAB_FD, slab, size), fd)
        except OSError:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise
        session.sent.add(slab)

    def stop(self) -> None:
        self._stopped = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._listener.close()
        try:
            self.path.unlink()
        except OSError:
            pass
        self.pool.close()
