"""Talking to the constructor: retries with backoff inside a deadline, and the one table that
turns gRPC status codes into the client's exceptions. A retry looks the constructor's address up
again (the endpoints file of a restarted data plane may name a new one). Batches come through
shared memory when the constructor's slab socket is there (`slabs`), else over the gRPC stream.

Closing is deterministic: `cancel` stops the call in flight on another thread (the client's fetch
thread) and refuses every later one, so that thread ends; `close` then closes the channel, with
no call left on it (a channel closed under a call still running on another thread, or left open
at interpreter exit, can abort the process in gRPC's C++ core)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import torch

from batchplane.client import errors
from batchplane.client.bounds import check_batch_header
from batchplane.client.endpoints import AddressBook
from batchplane.client.slabs import SlabChannel, slab_socket
from batchplane.client.tensors import ReceiveBuffers
from batchplane.local_transport import local_channel
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc
from batchplane.wire import PayloadReceiver, WireFormatError

T = TypeVar("T")
log = logging.getLogger(__name__)

#: gRPC status -> the client's exception. Anything not listed is a DataPlaneError.
ERROR_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: errors.InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.StepUnavailableError,
    grpc.StatusCode.OUT_OF_RANGE: errors.StepUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.MessageTooLargeError,
    grpc.StatusCode.UNAVAILABLE: errors.DataPlaneUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DataPlaneUnavailable,
    grpc.StatusCode.CANCELLED: errors.DataPlaneUnavailable,
}
#: Retried within the deadline: a constructor down or restarting (UNAVAILABLE), one that did not
#: answer in time (DEADLINE_EXCEEDED), and a call cut by a constructor stopping gracefully
#: (CANCELLED: a server's stop cancels the calls in flight; the client never cancels its own).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
MAX_MESSAGE_BYTES = 64 << 20
#: The longest pause between retries: a restarted constructor is reached within it.
MAX_BACKOFF_S = 0.25
#: How long a wait's note (`note_wait`) may take before it is given up.
NOTE_TIMEOUT_S = 2.0
#: How long after a failed connection to the slab socket the next try waits (unless a new
#: socket is bound there: a restarted constructor's).
SLAB_RETRY_S = 5.0


class ConstructorConnection:
    """A channel to one constructor.

    Args:
        addresses: Where the constructor listens: an address ("host:port", "unix:///path"), or
            an AddressBook, waited for (the endpoints file may not exist yet) and looked up
            again whenever a call has to retry.
        timeout_s: How long a call may keep retrying before DataPlaneUnavailable.
        shm: Use the constructor's shared memory when it offers it (`slabs.slab_socket`).
        pin_slabs: Map slabs shared and register them as pinned CUDA memory (device copies
            follow); else map them private (copy on write).
    Raises:
        DataPlaneUnavailable: no address appeared within `timeout_s`.
    """

    def __init__(self, addresses: AddressBook | str, *, timeout_s: float, shm: bool = True, pin_slabs: bool = False) -> None:
        self._addresses = AddressBook(addresses, rank=0) if isinstance(addresses, str) else addresses
        self.timeout_s = timeout_s
        self.address = ""
        self._channel: grpc.Channel | None = None
        self._shm = shm
        self._pin_slabs = pin_slabs
        self._slabs: SlabChannel | None = None
        self._slabs_retry_at = 0.0
        self._slabs_refused_inode: tuple[int, int] = (-1, -1)
        self._buffers = ReceiveBuffers()
        self._lock = threading.Lock()  # guards the two below
        self._closed = False
        self._active: Any = None  # the GetBatch stream being read, for `cancel`
        self._connect(self._addresses.wait(timeout_s=timeout_s))

    @property
    def shm_session(self) -> str:
        """The slab session's id; empty without one."""
        slabs = self._slabs
        return slabs.session if slabs is not None and slabs.alive else ""

    def slab_channel(self) -> SlabChannel | None:
        """The session on the constructor's slab socket, (re)connected when the socket is there
        and the last session ended (a restarted constructor); None: batches come over gRPC."""
        if not self._shm:
            return None
        if self._slabs is not None:
            self._slabs.poll()
            if self._slabs.alive:
                return self._slabs
            self._slabs = None  # its slabs unmap once the trainer drops their tensors
        path = slab_socket(self.address)
        if path is None:
            return None
        try:
            st = path.stat()
            inode = (st.st_ino, st.st_ctime_ns)  # inode numbers are reused at once on tmpfs
        except OSError:
            return None
        if inode == self._slabs_refused_inode and time.monotonic() < self._slabs_retry_at:
            return None  # the socket that refused: tried again when a new one is bound, or later
        try:
            self._slabs = SlabChannel(path, timeout_s=min(self.timeout_s, 10.0), pin=self._pin_slabs)
        except (OSError, errors.ProtocolError) as exc:
            log.info("the constructor's slab socket %s refused a session (%s): batches come over gRPC", path, exc)
            self._slabs_refused_inode = inode
            self._slabs_retry_at = time.monotonic() + SLAB_RETRY_S
            return None
        log.debug("slab session %s on %s", self._slabs.session, path)
        return self._slabs

    def _connect(self, address: str) -> None:
        if self._channel is not None:
            self._channel.close()
        self.address = address
        self._channel = local_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # GetBatch's stream is read on the fetch thread itself, not handed over message
                # by message from a "channel spin" thread that grpc starts whenever the channel
                # has no call in flight (a thread per batch, two thread switches per message).
                ("SingleThreadedUnaryStream", 1),
            ],
        )
        self._stub = constructor_pb2_grpc.ConstructorStub(self._channel)

    def _follow_address(self) -> None:
        """Reconnects when the constructor's address changed (a restarted data plane)."""
        if self._closed:
            return
        try:
            address, _ = self._addresses.lookup()
        except errors.InvalidRequestError:
            return  # a file being rewritten: the next retry looks again
        if address is not None and address != self.address:
            log.info("the constructor moved from %s to %s: reconnecting", self.address, address)
            self._connect(address)

    def info(self) -> constructor_pb2.GetInfoResponse:
        return self._call(lambda remaining: self._stub.GetInfo(constructor_pb2.GetInfoRequest(), timeout=remaining), "GetInfo")

    def batch(
        self,
        rank: int,
        step: int,
        *,
        pin: bool,
        resume: dict[str, str] | None = None,
        restart: bool = False,
        cursor: constructor_pb2.JournalCursor | None = None,
    ) -> tuple[constructor_pb2.BatchHeader, torch.Tensor]:
        """The header and payload of rank `rank`'s batch of `step` alone (`batches` with one
        step)."""
        (got,) = self.batches(rank, step, pin=pin, resume=resume, restart=restart, cursor=cursor)
        return got

    def batches(
        self,
        rank: int,
        step: int,
        *,
        max_steps: int = 1,
        pin: bool,
        resume: dict[str, str] | None = None,
        restart: bool = False,
        cursor: constructor_pb2.JournalCursor | None = None,
        data_wait: Callable[[], constructor_pb2.DataWait] | None = None,
    ) -> Iterator[tuple[constructor_pb2.BatchHeader, torch.Tensor]]:
        """The header and payload of rank `rank`'s batch of `step`, then of each following step
        one call carries (up to `max_steps` in all, `GetBatchRequest.max_steps`), each as it
        arrives. The call is retried until its first batch arrives; after that a stream that
        breaks or ends early just ends the iteration (the caller asks again from the step after
        the last one it got). `resume`: the fingerprints of the checkpoint the rank resumed from
        (first request); `restart`: the rank's trainer (re)starts at `step` (its first request);
        `cursor`: where `step` starts in the journal, from that checkpoint (journal delivery);
        `data_wait`: the trainer's waits for data so far, sent with each attempt (`waits`).

        Raises:
            ProtocolError: a malformed stream (a batch of another step than the next, a payload
                other than its header announces, more batches than asked for).
            DataPlaneUnavailable, StepUnavailableError, InvalidRequestError: as `_call` says, for
                the first batch; DataPlaneUnavailable also once the client is closed.
        """
        count = max(max_steps, 1)

        def attempt(remaining: float) -> tuple[Any, SlabChannel | None, tuple[constructor_pb2.BatchHeader, torch.Tensor]]:
            # The constructor answers before the call's deadline: a batch, or what it waits for.
            wait_ms = max(int(min(0.8 * remaining, 30.0) * 1000), 1)
            slabs = self.slab_channel()
            request = constructor_pb2.GetBatchRequest(
                rank=rank,
                step=step,
                wait_ms=wait_ms,
                resume=resume or {},
                restart=restart,
                journal_cursor=cursor,
                shm_session=slabs.session if slabs is not None else "",
                released_slabs=slabs.take_releases() if slabs is not None else (),  # sent once: the constructor applies them first
                max_steps=count if count > 1 else 0,
                data_wait=data_wait() if data_wait is not None else None,
            )
            stream = self._stub.GetBatch(request, timeout=remaining)
            with self._lock:
                if self._closed:
                    stream.cancel()
                self._active = stream
            try:
                first = self._receive(stream, slabs, step, pin=pin)
            except BaseException:
                with self._lock:
                    self._active = None
                raise
            if first is None:
                raise errors.ProtocolError(f"constructor at {self.address}: GetBatch stream did not start with a header")
            return stream, slabs, first

        stream, slabs, first = self._call(attempt, f"GetBatch(rank {rank}, step {step})")
        ended = False
        try:
            if first[0].end_of_data:
                ended = next(stream, None) is None
                yield first
                return
            yield first
            del first  # the trainer's tensors alone keep the batch's slab or buffer
            for following in range(step + 1, step + count):
                try:
                    got = self._receive(stream, slabs, following, pin=pin)
                except grpc.RpcError as exc:
                    # The error is the call itself, raised from within it: its traceback would
                    # keep this frame, the stream and the slab session in a cycle until a
                    # collection (a dead constructor's slabs mapped meanwhile).
                    exc.with_traceback(None)
                    if self._closed:
                        raise errors.DataPlaneUnavailable(f"GetBatch at constructor {self.address}: the client was closed") from None
                    log.debug("GetBatch(rank %d) ended before step %d: %s", rank, following, exc.code())
                    return  # asked again from `following`
                if got is None:
                    ended = True
                    return
                yield got
                del got
            try:
                ended = next(stream, None) is None
            except grpc.RpcError as exc:  # every batch arrived; the call's own end failed (e.g. the constructor stopping)
                ended = True
                log.debug("GetBatch(rank %d) ended with %s after its batches", rank, exc.code())
            if not ended:
                raise errors.ProtocolError(f"constructor at {self.address}: GetBatch sent more than the {count} batches asked for")
        finally:
            with self._lock:
                self._active = None
            if not ended:
                stream.cancel()  # the server stops sending what nobody reads

    def _receive(
        self, stream: Any, slabs: SlabChannel | None, step: int, *, pin: bool
    ) -> tuple[constructor_pb2.BatchHeader, torch.Tensor] | None:
        """The next batch on a GetBatch stream, which must be `step`'s; None at the stream's end."""
        first = next(stream, None)
        if first is None:
            return None
        if first.WhichOneof("part") != "header":
            raise errors.ProtocolError(f"constructor at {self.address}: GetBatch sent a chunk where the header of step {step} was due")
        header = first.header
        if header.step != step:
            raise errors.ProtocolError(f"constructor at {self.address}: GetBatch sent step {header.step} where step {step} was due")
        size = check_batch_header(header, address=self.address)
        if header.HasField("shm"):
            if slabs is None:
                raise errors.ProtocolError(f"constructor at {self.address}: a batch in shared memory without a session")
            return header, slabs.view(header.shm, size)
        storage, view = self._buffers.take(size, pin=pin)
        receiver = PayloadReceiver(view)
        try:
            while not receiver.complete:
                message = next(stream, None)
                if message is None:
                    break
                if message.WhichOneof("part") != "chunk":
                    raise errors.ProtocolError(f"constructor at {self.address}: step {step}'s payload ended before its {size} bytes")
                receiver.add(message.chunk.data)
            receiver.check_complete()
        except WireFormatError as exc:
            raise errors.ProtocolError(f"constructor at {self.address}: {exc}") from exc
        return header, storage

    def length(self) -> common_pb2.JobLength:
        """How many steps the job has (the constructor asks the planner, which may wait for its
        loaders to register)."""

        def attempt(remaining: float) -> common_pb2.JobLength:
            wait_ms = max(int(min(0.8 * remaining, 30.0) * 1000), 1)
            return self._stub.GetLength(constructor_pb2.GetLengthRequest(wait_ms=wait_ms), timeout=remaining).length

        return self._call(attempt, "GetLength")

    def report(self, step: int, losses: dict[str, float]) -> common_pb2.ReportResponse:
        """Sends the training report of `step` (through the constructor, to the planner)."""
        request = common_pb2.ReportRequest(step=step, losses=losses)
        return self._call(lambda remaining: self._stub.Report(request, timeout=remaining), f"Report(step {step})")

    def note_wait(self, rank: int, wait: constructor_pb2.DataWait) -> None:
        """Sends rank `rank`'s waits for data (`waits`) without waiting for the answer: a lost
        note only delays the metric until the next. A constructor that does not take notes
        (an older one) is no error either."""
        if self._closed:
            return
        try:
            future = self._stub.NoteWait.future(constructor_pb2.NoteWaitRequest(rank=rank, wait=wait), timeout=NOTE_TIMEOUT_S)
        except ValueError as exc:  # the fetch thread closed the channel this instant (the constructor moved)
            log.debug("NoteWait not sent: %s", exc)
            return
        future.add_done_callback(_log_note_failure)

    def mark_checkpoint(self, rank: int, step: int) -> constructor_pb2.MarkCheckpointResponse:
        """Tells the constructor rank `rank`'s checkpoint resumes at `step` (answered once kept)."""
        request = constructor_pb2.MarkCheckpointRequest(rank=rank, step=step)
        return self._call(
            lambda remaining: self._stub.MarkCheckpoint(request, timeout=remaining), f"MarkCheckpoint(rank {rank}, step {step})"
        )

    def _call(self, attempt: Callable[[float], T], what: str) -> T:
        """Runs `attempt(remaining seconds)` until it returns, retrying what RETRYABLE names
        within `timeout_s`. Giving up on a deadline, the error also carries the constructor's
        last answer: it says what the constructor waits for (e.g. a loader that is gone), while
        the last attempt, short by then, may have timed out before its answer came."""
        begin = time.monotonic()
        give_up = begin + self.timeout_s
        backoff = 0.05
        attempts = 0
        answered = ""  # the constructor's last retryable answer, as "CODE: details"
        while True:
            remaining = give_up - time.monotonic()
            attempts += 1
            if self._closed:
                raise errors.DataPlaneUnavailable(f"{what} at constructor {self.address}: the client was closed")
            try:
                return attempt(max(remaining, 0.1))
            except grpc.RpcError as exc:
                code = exc.code()
                if self._closed:
                    raise errors.DataPlaneUnavailable(f"{what} at constructor {self.address}: the client was closed") from None
                if code not in RETRYABLE or time.monotonic() + backoff >= give_up:
                    tried = f"gave up after {attempts} attempts in {time.monotonic() - begin:.1f} s: " if code in RETRYABLE else ""
                    last = f" (its last answer: {answered})" if code == grpc.StatusCode.DEADLINE_EXCEEDED and answered else ""
                    raise ERROR_OF.get(code, errors.DataPlaneError)(
                        f"{what} at constructor {self.address}: {tried}{code.name}: {exc.details()}{last}"
                    ) from None
                if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    answered = f"{code.name}: {exc.details()}"
            time.sleep(backoff * (0.5 + random.random() / 2))
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            self._follow_address()

    def cancel(self) -> None:
        """Cancels the GetBatch in flight (on any thread) and refuses every later call
        (DataPlaneUnavailable); idempotent. The channel stays open until `close`."""
        with self._lock:
            self._closed = True
            active = self._active
        if active is not None:
            active.cancel()

    def close(self) -> None:
        """Cancels (`cancel`), then closes the slab session and the channel. Call it once no
        other thread is inside a call any more (`Client.close` joins its fetch thread first)."""
        self.cancel()
        if self._slabs is not None:
            self._slabs.close()
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _log_note_failure(future: Any) -> None:
    exc = future.exception() if not future.cancelled() else None
    if exc is not None:
        log.debug("NoteWait failed: %s", exc)
