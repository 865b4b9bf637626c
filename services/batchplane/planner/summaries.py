"""The planner's view of the loaders' buffers: per source, the rows, lengths and bad samples'
reasons and digests (`core.digest`) of the samples from the planner's cursor on, pulled window by window from the replica
each window is routed to.

`SummaryStore` holds what is known (no I/O). `SummaryPuller` keeps it filled a look-ahead past
the cursor, one thread per source calling GetSummary of the replica that owns the next window;
each call also tells the replica the cursor and the source's routes, which is what lets it read
its next windows ahead. The call, once answered, is passed on to the replica's shadow, if it has
one (`follow`), so the shadow holds the same windows; every call's outcome is an observation of
the replica's health for the failure detector. An answer that is not what was asked
(`bounds.check_summary`) is refused: it counts as a failed observation (logged with the
replica's address, counted by the watch's metric) and the request is retried with backoff; no
error ends a source's pulling.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import numpy as np

from batchplane.core import bad
from batchplane.core.digest import DTYPE as DIGEST_DTYPE
from batchplane.core.routing import Routing
from batchplane.planner.bounds import MAX_NAME_CHARS, MalformedSummary, check_summary
from batchplane.planner.membership import SummaryTarget
from batchplane.v1 import common_pb2, loader_pb2, loader_pb2_grpc
from batchplane.wire import WireFormatError, decode_array

log = logging.getLogger(__name__)

#: One pull asks for up to this many look-aheads of samples: it is made once the known samples
#: fall below one look-ahead past the cursor, and takes what the replica has read past them, so
#: a loader that reads ahead answers many steps' worth in one call (a call costs about 1 ms of
#: CPU on each side; pulling one look-ahead at a time made it a call every few steps).
PULL_LOOKAHEADS = 4


@dataclasses.dataclass
class _Known:
    base: int = 0  # seq of rows[0]
    rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    lengths: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    reasons: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bad.DTYPE))  # core.bad codes
    digests: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, DIGEST_DTYPE))  # core.digest, 0: bad or unknown
    features: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    end: int | None = None  # the stream ends here, once known
    cursor: int = 0  # the planner's next seq

    @property
    def known_through(self) -> int:
        return self.base + len(self.rows)


class SummaryStore:
    """Known sample metadata per source, from the planner's cursor on.

    Args:
        num_sources: Sources in the job.
        lookahead: Samples past the cursor worth knowing in advance: a pull is wanted below it.
    """

    def __init__(self, num_sources: int, *, lookahead: int) -> None:
        self.lookahead = lookahead
        #: The most samples one pull asks for (`PULL_LOOKAHEADS`).
        self.pull_samples = lookahead * PULL_LOOKAHEADS
        self._known = [_Known() for _ in range(num_sources)]
        self._started = False
        #: Steps planned so far: every position below a cursor belongs to an earlier step.
        self.planned_steps = 0
        #: Every rank has been handed every step below it.
        self.delivered_below = 0
        self.cond = threading.Condition()

    def start(self, cursors: tuple[int, ...], *, step: int = 0) -> None:
        """Sets the cursors the job starts (or resumes) at, before step `step`; pulling begins."""
        with self.cond:
            for known, cursor in zip(self._known, cursors):
                known.base = known.cursor = cursor
            self.planned_steps = self.delivered_below = step
            self._started = True
            self.cond.notify_all()

    def rewind(self, cursors: tuple[int, ...], *, step: int, delivered_below: int) -> None:
        """Goes back to `cursors`, before step `step` (a rewind): forgets what is known and pulls
        again from there; `delivered_below`: every rank has been handed every step below it."""
        with self.cond:
            for known, cursor in zip(self._known, cursors):
                known.base = known.cursor = cursor
                known.rows = known.rows[:0]
                known.lengths = known.lengths[:0]
                known.reasons = known.reasons[:0]
                known.digests = known.digests[:0]
                known.features = {}
            self.planned_steps = step
            self.delivered_below = delivered_below
            self.cond.notify_all()

    def delivered(self, below: int) -> None:
        """Every rank has been handed every step below `below` (the loaders learn it with the
        next pull and free what only those steps planned from)."""
        with self.cond:
            self.delivered_below = max(self.delivered_below, below)

    def cursor(self, source: int) -> int:
        """The planner's cursor of `source`: every position below it belongs to a planned step."""
        with self.cond:
            return self._known[source].cursor

    def advance(self, cursors: tuple[int, ...], *, steps: int | None = None) -> None:
        """Moves the cursors after a step is planned (`steps` planned so far) and forgets what
        lies before them."""
        with self.cond:
            if steps is not None:
                self.planned_steps = steps
            idle = [self.wanted(k) is None for k in range(len(self._known))]
            for known, cursor in zip(self._known, cursors):
                drop = min(cursor - known.base, len(known.rows))
                if drop > 0:
                    known.rows, known.lengths, known.reasons = known.rows[drop:], known.lengths[drop:], known.reasons[drop:]
                    known.digests = known.digests[drop:]
                    known.features = {name: values[drop:] for name, values in known.features.items()}
                    known.base += drop
                known.cursor = cursor
            # Only a source that now wants a pull has a puller to wake (its summary request
            # carries the new cursor); nothing else waits for the cursors, and a puller busy
            # with a request reads them when it next asks.
            if any(was and self.wanted(k) is not None for k, was in enumerate(idle)):
                self.cond.notify_all()

    def add(
        self,
        source: int,
        start_seq: int,
        rows: np.ndarray,
        lengths: np.ndarray,
        end_of_stream: bool,
        features: dict[str, np.ndarray] | None = None,
        reasons: np.ndarray | None = None,
        digests: np.ndarray | None = None,
    ) -> None:
        """Appends what a loader reported; entries that are already known or stale are ignored.
        A feature missing from one report is 0 for its samples; so are `reasons` (uint8 `core.bad`
        codes, one per sample) and `digests` (int64 `core.digest`) when None or empty."""
        with self.cond:
            known = self._known[source]
            skip = known.known_through - start_seq
            if skip < 0:
                log.warning("source %d: summary from %d leaves a gap after %d; ignored", source, start_seq, known.known_through)
                return
            if skip < len(rows):
                features = features or {}
                for name in set(features) - set(known.features):
                    known.features[name] = np.zeros(len(known.rows))
                for name, values in known.features.items():
                    new = features[name][skip:] if name in features else np.zeros(len(rows) - skip)
                    known.features[name] = np.concatenate([values, new])
                known.rows = np.concatenate([known.rows, rows[skip:]])
                known.lengths = np.concatenate([known.lengths, lengths[skip:]])
                new_reasons = reasons[skip:] if reasons is not None and len(reasons) else np.zeros(len(rows) - skip, bad.DTYPE)
                known.reasons = np.concatenate([known.reasons, new_reasons.astype(bad.DTYPE, copy=False)])
                new_digests = digests[skip:] if digests is not None and len(digests) else np.zeros(len(rows) - skip, DIGEST_DTYPE)
                known.digests = np.concatenate([known.digests, new_digests.astype(DIGEST_DTYPE, copy=False)])
            if end_of_stream:
                known.end = start_seq + len(rows)
            self.cond.notify_all()

    def wanted(self, source: int) -> tuple[int, int] | None:
        """(from_seq, planned_seq) of the next pull for `source`, or None when nothing is wanted
        (not started, look-ahead satisfied, or the stream ended). Call with `cond` held."""
        known = self._known[source]
        if not self._started or (known.end is not None and known.known_through >= known.end):
            return None
        if known.known_through >= known.cursor + self.lookahead:
            return None
        return known.known_through, known.cursor

    def get(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None:
        """Rows, lengths and features of seqs [start, start + count), or None while not all known."""
        with self.cond:
            known, lo = self._at(source, start, count)
            if known is None:
                return None
            features = {name: values[lo : lo + count] for name, values in known.features.items()}
            return known.rows[lo : lo + count], known.lengths[lo : lo + count], features

    def reasons(self, source: int, start: int, count: int) -> np.ndarray | None:
        """uint8 [count]: the `core.bad` reason codes of seqs [start, start + count) (0 for a good
        sample, and for a bad one whose loader did not say why), or None while not all known.

        Raises:
            ValueError: `start` lies before what the store keeps (as `get`).
        """
        with self.cond:
            known, lo = self._at(source, start, count)
            return None if known is None else known.reasons[lo : lo + count]

    def digests(self, source: int, start: int, count: int) -> np.ndarray | None:
        """int64 [count]: the `core.digest` digests of seqs [start, start + count) (0 for a bad
        sample), or None while not all known.

        Raises:
            ValueError: `start` lies before what the store keeps (as `get`).
        """
        with self.cond:
            known, lo = self._at(source, start, count)
            return None if known is None else known.digests[lo : lo + count]

    def _at(self, source: int, start: int, count: int) -> tuple[_Known | None, int]:
        """The source's known metadata and the index of seq `start` in it; (None, 0) while seqs
        [start, start + count) are not all known (lock held).

        Raises:
            ValueError: `start` lies before what the store keeps.
        """
        known = self._known[source]
        lo = start - known.base
        if lo < 0:
            raise ValueError(f"source {source}: seq {start} is before the store's base {known.base}")
        return (known, lo) if known.known_through >= start + count else (None, 0)


def parse_summary(
    response: loader_pb2.GetSummaryResponse, request: loader_pb2.GetSummaryRequest, target: SummaryTarget
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A loader's summary answer as (rows, lengths, features, bad reasons, digests), views of
    its bytes (no copy), once it is what `request` asked of `target`. The reasons are uint8
    `core.bad` codes, one per sample; zeros (unknown) when the loader sent none (an older
    loader). The digests are int64 `core.digest` digests, one per sample (0: a bad one).

    Raises:
        MalformedSummary, WireFormatError: it is not (the message says why).
    """
    rows = decode_array(response.row, field="row", dtype="int64", ndim=1)
    lengths = decode_array(response.length, field="length", dtype="int32", ndim=1)
    if any(len(name) > MAX_NAME_CHARS for name in response.features):
        raise MalformedSummary(f"a feature name longer than {MAX_NAME_CHARS} characters")
    features = {name: decode_array(array, field=f"features[{name}]", dtype="float64", ndim=1) for name, array in response.features.items()}
    reasons = (
        decode_array(response.bad_reason, field="bad_reason", dtype=np.dtype(bad.DTYPE).name, ndim=1)
        if response.HasField("bad_reason")
        else None
    )
    digests = (
        decode_array(response.digest, field="digest", dtype=np.dtype(DIGEST_DTYPE).name, ndim=1) if response.HasField("digest") else None
    )
    check_summary(
        rows,
        lengths,
        features,
        start_seq=response.start_seq,
        end_of_stream=response.end_of_stream,
        from_seq=request.from_seq,
        max_samples=request.max_samples,
        num_rows=target.num_rows,
        stream_end=target.stream_end,
        reasons=reasons,
        digests=digests,
    )
    if reasons is None or len(reasons) != len(rows):
        reasons = np.zeros(len(rows), bad.DTYPE)
    return rows, lengths, features, reasons, np.zeros(0, DIGEST_DTYPE) if digests is None else digests


def route_messages(routing: Routing) -> list[common_pb2.Route]:
    """A source's routes as messages."""
    return [common_pb2.Route(from_window=r.from_window, replicas=r.replicas) for r in routing.routes]


#: Summary requests queued for one shadow at most.
MAX_FOLLOW_QUEUE = 64


class SummaryPuller:
    """One thread per source pulling summaries from its loader into the store.

    Args:
        store: The store to fill.
        target: (source, from_seq) -> where to ask (`membership.SummaryTarget`), or None before
            the source has a loader.
        connect: Opens a channel to a loader at an address (with the job's message limits and security).
        wait_ms: How long a loader may wait for data before answering empty.
    """

    def __init__(
        self,
        store: SummaryStore,
        *,
        num_sources: int,
        target: Callable[[int, int], SummaryTarget | None],
        connect: Callable[[str], grpc.Channel],
        wait_ms: int = 1000,
        observe: Callable[..., None] | None = None,
    ) -> None:
        self._store = store
        self._target = target
        self._observe = observe or (lambda owner, address, ok, **_: None)
        self._followers: dict[str, futures.ThreadPoolExecutor] = {}  # shadow address -> its own ordered queue
        self._following: dict[str, int] = {}  # shadow address -> requests queued
        self._follow_lock = threading.Lock()
        self._connect = connect
        self._wait_ms = wait_ms
        self._stopped = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._pull_loop, args=(k,), name=f"summary-{k}", daemon=True) for k in range(num_sources)]
        for t in self._threads:
            t.start()

    def _stub(self, address: str) -> loader_pb2_grpc.LoaderStub:
        with self._channels_lock:
            if address not in self._channels:
                self._channels[address] = self._connect(address)
            return loader_pb2_grpc.LoaderStub(self._channels[address])

    def _pull_loop(self, source: int) -> None:
        backoff = 0.05
        while not self._stopped.is_set():
            try:
                backoff = self._pull(source, backoff)
            except Exception:  # noqa: BLE001 - nothing a peer sends, and no bug, ends this source's pulling
                log.exception(
                    "source %d: pulling summaries failed; trying again in 1 s, and every second while it fails, until the planner stops",
                    source,
                )
                self._stopped.wait(1.0)

    def _pull(self, source: int, backoff: float) -> float:
        """One summary request for `source`, if one is wanted; returns the next backoff."""
        with self._store.cond:
            self._store.cond.wait_for(lambda: self._stopped.is_set() or self._store.wanted(source) is not None, timeout=1.0)
            want = self._store.wanted(source)
            planned_steps, delivered_below = self._store.planned_steps, self._store.delivered_below
        if self._stopped.is_set() or want is None:
            return backoff
        from_seq, planned_seq = want
        try:
            target = self._target(source, from_seq)
        except Exception:  # noqa: BLE001 - a bug here must not silently end this source's pulling
            log.exception(
                "source %d: cannot route the summary request from %d; trying again in 1 s, and every second while it fails, "
                "until the planner stops",
                source,
                from_seq,
            )
            self._stopped.wait(1.0)
            return backoff
        if target is None or not target.address:  # no loader yet, or a replica that has not registered again
            self._stopped.wait(0.05)
            return backoff
        request = loader_pb2.GetSummaryRequest(
            source=source,
            from_seq=from_seq,
            planned_seq=planned_seq,
            max_samples=min(self._store.pull_samples, target.window_end - from_seq),
            wait_ms=self._wait_ms,
            routes=route_messages(target.routing),
            planned_steps=planned_steps,
            delivered_below=delivered_below,
        )
        try:
            response = self._stub(target.address).GetSummary(request, timeout=self._wait_ms / 1000 + 10)
        except grpc.RpcError as exc:
            log.warning(
                "GetSummary(source %d from %d) at loader %s: %s: %s", source, from_seq, target.address, exc.code().name, exc.details()
            )
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._observe(target.owner, target.address, False)
            self._stopped.wait(backoff)
            return min(backoff * 2, 0.5 if target.shadow else 2.0)
        try:
            rows, lengths, features, reasons, digests = parse_summary(response, request, target)
        except (MalformedSummary, WireFormatError) as exc:  # refused: the replica answered, but not what was asked
            log.warning(
                "GetSummary(source %d from %d) at loader %s: a malformed answer, refused: %s", source, from_seq, target.address, exc
            )
            self._observe(target.owner, target.address, False, malformed=True)
            self._stopped.wait(backoff)
            return min(backoff * 2, 2.0)
        self._observe(target.owner, target.address, True)
        self._store.add(source, response.start_seq, rows, lengths, response.end_of_stream, features, reasons=reasons, digests=digests)
        if target.shadow and len(rows):
            request.follow, request.max_samples, request.wait_ms = True, len(rows), 0
            self._pass_on(target.shadow, request)
        return 0.05

    def _pass_on(self, address: str, request: loader_pb2.GetSummaryRequest) -> None:
        """Queues an answered summary request for the replica's shadow, in order; a shadow that
        falls MAX_FOLLOW_QUEUE requests behind misses some (it reads them on demand if promoted)."""
        with self._follow_lock:
            if self._stopped.is_set() or self._following.get(address, 0) >= MAX_FOLLOW_QUEUE:
                return
            queue = self._followers.get(address)
            if queue is None:
                queue = self._followers[address] = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="follow")
            self._following[address] = self._following.get(address, 0) + 1
            queue.submit(self._follow, address, request)

    def _follow(self, address: str, request: loader_pb2.GetSummaryRequest) -> None:
        try:
            self._stub(address).GetSummary(request, timeout=5)
        except (grpc.RpcError, ValueError) as exc:  # ValueError: a channel closed by stop()
            log.debug("shadow at %s did not follow: %s", address, exc)
        finally:
            with self._follow_lock:
                self._following[address] -= 1

    def stop(self) -> None:
        self._stopped.set()
        with self._store.cond:
            self._store.cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        with self._follow_lock:
            for queue in self._followers.values():
                queue.shutdown(wait=False, cancel_futures=True)
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()


def wait_for_summary(
    store: SummaryStore, source: int, start: int, count: int, *, timeout_s: float
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None:
    """`store.get`, waiting up to `timeout_s` for the metadata to arrive."""
    give_up = time.monotonic() + timeout_s
    with store.cond:
        while True:
            got = store.get(source, start, count)
            remaining = give_up - time.monotonic()
            if got is not None or remaining <= 0:
                return got
            store.cond.wait(timeout=remaining)
