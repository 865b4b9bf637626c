"""Which windows one source's stream in a loader holds, reads next and frees: a pure state
machine (events in, decisions out; no threads, clocks, I/O or Parquet) behind
`stream.SourceStream`, which reads the windows, waits and keeps the metrics.

Events: the planner's summary request (the position asked from, the routes, its progress:
`Progress`), a shadow's follow of one, a restarted replica's restore, the frontier a heartbeat
answers, a window read, a fetch looking for positions, a release of samples. Decisions: the
next window to read (None: wait), the windows removed (dropped by new routes or freed), what a
fetch that misses windows does (`bounds.plan_fetch_reads`), which held window serves what.

Rules (each a property in tests/unit/test_loader_windows.py):

- A window is freed once every position in it is planned (then `last_step`, the last step that
  can plan from it, is known) and either every good sample in it has been released or every
  rank was handed every step that planned from it (`delivered_below` past `last_step`).
- The reader reads first the windows somebody waits for (the planner, a fetch, a restore),
  whatever the budget; else the first window of this replica not held that starts within
  `read_ahead_samples` of the planner's cursor, and only while the loader's buffer is under its
  budget. So the buffer passes its budget only by windows somebody waits for.
- New routes drop the windows read ahead that are now another replica's, unless the planner
  has seen them (then they are this replica's for good); a window read for nobody that is no
  longer this replica's is not kept.
- A release counts down the good samples of the window read it names; a window freed or read
  again since is not affected, and no count goes below zero.
- A restore (`restore`) asks at once for this replica's windows the planner says constructors
  may still fetch.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from typing import Generic, TypeVar

import numpy as np

from batchplane.core.errors import NotFound
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing, WindowSpan, window_of, window_span
from batchplane.loader.bounds import FetchFrontier, FetchReads, plan_fetch_reads

#: What the driver keeps of a window read (its rows, tokens and payload columns).
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Progress:
    """The planner's progress as a summary request carries it.

    Attributes:
        planned_seq: Its cursor: every position below it is planned.
        planned_steps: Steps planned so far: every position below `planned_seq` belongs to an
            earlier one.
        delivered_below: Every rank was handed every step below it.
    """

    planned_seq: int = 0
    planned_steps: int = 0
    delivered_below: int = 0


@dataclasses.dataclass(eq=False)
class HeldWindow(Generic[T]):
    """A window in the buffer: its positions, what the driver read (`data`) and its accounts."""

    span: WindowSpan
    data: T
    nbytes: int
    #: Good samples at or after the stream's start not yet released.
    unreleased: int
    #: Whether the planner has seen it (then it is this replica's for good).
    summarized: bool = False
    #: The last step that can plan from it, once every position in it is planned.
    last_step: int | None = None

    @property
    def seq_start(self) -> int:
        return self.span.start

    @property
    def seq_end(self) -> int:
        return self.span.end


@dataclasses.dataclass(frozen=True)
class Stored(Generic[T]):
    """What became of a window read.

    Attributes:
        kept: The window, now held (None: not kept, another replica's or held already).
        replayed: Whether somebody waited for it to be read again (a fetch, a restore).
        removed: Windows freed since (the window kept among them when nothing needs it).
    """

    kept: HeldWindow[T] | None
    replayed: bool
    removed: list[HeldWindow[T]]


class WindowBook(Generic[T]):
    """The buffered windows of one source's stream and the rules that read and free them.

    Args:
        order: The source's order (its windows).
        replica: This loader replica's id in its group (what routes name).
        end_seq: Where the stream ends (None: never).
        read_ahead_samples: How far to read past the planner's cursor.
    """

    def __init__(self, order: SampleOrder, *, replica: str, end_seq: int | None, read_ahead_samples: int) -> None:
        self.order = order
        self.replica = replica
        self.end_seq = end_seq
        self.read_ahead_samples = read_ahead_samples
        #: How far fetches may reach (`bounds.FetchFrontier`).
        self.frontier = FetchFrontier(order, replica, end_seq)
        #: Where the stream starts (set by the first summary request or a restore).
        self.start_seq: int | None = None
        #: The current routes (None: every window is this replica's).
        self.routes: Routing | None = None
        self.planned_seq = 0
        self.planned_steps = 0
        self.delivered_below = 0
        self._held: list[HeldWindow[T]] = []  # in seq order
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None  # `_held`'s starts and ends, once asked
        self._urgent: dict[int, bool] = {}  # window number -> replay: windows somebody waits for

    def __iter__(self) -> Iterator[HeldWindow[T]]:
        """The held windows, in stream order."""
        return iter(list(self._held))

    @property
    def samples(self) -> int:
        """Positions held."""
        return sum(w.seq_end - w.seq_start for w in self._held)

    # ---- events --------------------------------------------------------------------------

    def summary_asked(self, from_seq: int, *, routes: Routing | None, progress: Progress) -> list[HeldWindow[T]]:
        """The planner asks for summaries from `from_seq` (`routes` None: keep the last ones).
        Asks for the window of `from_seq` when not held; returns the windows removed."""
        self.frontier.asked(from_seq)
        if self.start_seq is None:
            self._seek(from_seq)
        elif from_seq < self.start_seq:
            self.start_seq = from_seq  # a restarted planner resumes behind this stream
        removed = self._reroute(routes)
        removed += self._follow(progress)
        if not self.is_end(from_seq) and not self.holds(from_seq):
            self._want(window_of(self.order, from_seq).number, replay=False)
        return removed

    def followed(self, from_seq: int, *, count: int, routes: Routing | None, progress: Progress) -> list[HeldWindow[T]]:
        """A shadow's part of a summary request its replica answered with `count` samples from
        `from_seq`: asks for that window (nobody waits for it) and takes the progress, so the
        shadow holds what the replica holds. Returns the windows removed."""
        self.frontier.asked(from_seq + max(count - 1, 0))
        if self.start_seq is None:
            self._seek(from_seq)
        removed = self._reroute(routes)
        removed += self._follow(progress)
        if count and not self.is_end(from_seq) and not self.holds(from_seq):
            self._want(window_of(self.order, from_seq).number, replay=False)
        return removed

    def restore(self, from_seq: int, *, through_seq: int, routes: Routing | None, progress: Progress) -> tuple[int, list[HeldWindow[T]]]:
        """A restarted replica's position: asks at once for its windows of positions
        [from_seq, through_seq), which constructors may still fetch. Returns the samples to
        read again and the windows removed."""
        self.frontier.restored(through_seq)
        self._seek(from_seq)
        self.routes = routes
        removed = self._follow(progress)
        replay = 0
        span = window_of(self.order, from_seq)
        while span.start < through_seq and not self.is_end(span.start):
            if self.owns(span.number):
                self._want(span.number, replay=True)
                replay += span.end - span.start
            span = window_span(self.order, span.number + 1)
        return replay, removed

    def stored(self, span: WindowSpan, data: T, *, nbytes: int, unreleased: int) -> Stored[T]:
        """Window `span` was read (`nbytes` bytes, `unreleased` good samples to release)."""
        replay = self._urgent.pop(span.number, None)
        kept = None
        if (replay is not None or self.owns(span.number)) and not self.holds(span.start):  # still ours after a reroute
            kept = HeldWindow(span, data, nbytes, unreleased, summarized=replay is not None)  # waited for: kept whatever the routes say
            if replay is None and span.end <= self.planned_seq:
                kept.last_step = self.planned_steps - 1  # (one waited for: at the next summary, once taken)
            bisect.insort(self._held, kept, key=lambda w: w.seq_start)
            self._bounds = None
        return Stored(kept, kept is not None and bool(replay), self._evict())

    def release(self, data: T, count: int) -> list[HeldWindow[T]]:
        """`count` good samples of the window read as `data` are no longer needed (ignored when
        it is not held: freed or read again since). Returns the windows freed."""
        for w in self._held:
            if w.data is data:
                w.unreleased = max(0, w.unreleased - count)
        return self._evict()

    # ---- decisions -----------------------------------------------------------------------

    def next_read(self, *, over_budget: bool) -> WindowSpan | None:
        """The next window to read: one somebody waits for, else the first window of this
        replica not held that starts within the read-ahead of the planner's cursor, unless the
        loader is `over_budget`; None: nothing to read now."""
        for number in sorted(self._urgent):
            span = window_span(self.order, number)
            if not self.holds(span.start):
                return span
            del self._urgent[number]
        if self.start_seq is None or over_budget:
            return None
        return next(self._unread(until=self.planned_seq + self.read_ahead_samples), None)

    def summarize(self, from_seq: int, max_samples: int) -> tuple[list[tuple[T, int, int]], int]:
        """The held run of positions from `from_seq`, at most `max_samples`, as (window data,
        first index, end index) pieces, marking those windows seen by the planner (and asked
        about: a summary may run over several windows, and fetches may reach all it returned);
        and the position after them."""
        pieces: list[tuple[T, int, int]] = []
        i = int(np.searchsorted(self._held_bounds()[0], from_seq, side="right")) - 1 if self.holds(from_seq) else len(self._held)
        seq, count = from_seq, 0
        while i < len(self._held) and count < max_samples and self._held[i].seq_start <= seq:
            w = self._held[i]
            w.summarized = True
            lo = seq - w.seq_start
            hi = min(w.seq_end - w.seq_start, lo + max_samples - count)
            pieces.append((w.data, lo, hi))
            count += hi - lo
            seq = w.seq_start + hi
            i += 1
        if seq > from_seq:  # the planner has these positions now: fetches may reach them
            self.frontier.asked(seq - 1)
        return pieces, seq

    def check_fetch(self, seqs: np.ndarray, *, source: str) -> None:
        """Checks that a fetch may read positions `seqs`.

        Raises:
            NotFound: a position past the end of the stream.
            NotPlanned: a position at or past the frontier (`bounds.FetchFrontier`).
        """
        beyond = seqs[seqs >= self.end_seq] if self.end_seq is not None else seqs[:0]
        if len(beyond):
            raise NotFound(f"source {source!r}: positions {beyond[:5].tolist()} lie past the end of the stream at {self.end_seq}")
        self.frontier.check(seqs, routing=self.routes, source=source)

    def plan_fetch(self, missing: np.ndarray, *, used: int, limit: int) -> FetchReads:
        """What a fetch missing positions `missing` does, with `used` of `limit` buffered bytes
        (`bounds.plan_fetch_reads`); asks the reader for the window it says to read."""
        windows = sorted({window_of(self.order, int(s)).number for s in missing})
        reads = plan_fetch_reads(windows, queued=self._urgent, used=used, limit=limit)
        if reads.want is not None:
            self._want(reads.want, replay=True)
        return reads

    def located(self, seqs: np.ndarray, held: np.ndarray) -> list[tuple[T, np.ndarray, np.ndarray]]:
        """The held windows holding positions `seqs` where `held`: (window data, which of
        `seqs` it holds as a mask, their indices in it)."""
        starts, _ = self._held_bounds()
        slot = np.where(held, np.searchsorted(starts, seqs, side="right") - 1, -1)
        return [(self._held[i].data, slot == i, seqs[slot == i] - starts[i]) for i in np.unique(slot[held]).tolist()]

    def drained(self, below: int) -> bool:
        """Whether every window of this replica below position `below` has been served: read,
        seen by the planner and released."""
        if self.start_seq is None:
            return True  # never asked about anything: it holds nothing the planner counts on
        if any((w.unreleased > 0 or not w.summarized) and w.seq_start < below for w in self._held):
            return False
        return next(self._unread(until=below), None) is None  # one not read yet: the planner will ask

    def held(self, seqs: np.ndarray) -> np.ndarray:
        """bool [n]: whether a held window holds each position."""
        if not self._held:
            return np.zeros(len(seqs), bool)
        starts, ends = self._held_bounds()
        slot = np.searchsorted(starts, seqs, side="right") - 1
        return (slot >= 0) & (seqs < ends[np.maximum(slot, 0)])

    def holds(self, seq: int) -> bool:
        """Whether a held window holds position `seq`."""
        if not self._held:
            return False
        starts, ends = self._held_bounds()
        slot = int(np.searchsorted(starts, seq, side="right")) - 1
        return slot >= 0 and seq < int(ends[slot])

    def _held_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 arrays of the held windows' first positions and ends, in seq order (kept until
        `_held` changes: a fetch, a summary or a reader's wait asks many times in between)."""
        if self._bounds is None:
            self._bounds = (
                np.array([w.seq_start for w in self._held], np.int64),
                np.array([w.seq_end for w in self._held], np.int64),
            )
        return self._bounds

    def owns(self, window: int) -> bool:
        """Whether window `window` is this replica's under the current routes."""
        return self.routes is None or self.routes.owner(window) == self.replica

    def is_end(self, seq: int) -> bool:
        """Whether position `seq` lies past the end of the stream."""
        return self.end_seq is not None and seq >= self.end_seq

    # ---- rules ---------------------------------------------------------------------------

    def _seek(self, seq: int) -> None:
        """Starts the stream at `seq` (a resumed job starts mid-stream)."""
        self.start_seq = seq
        self.planned_seq = seq

    def _follow(self, progress: Progress) -> list[HeldWindow[T]]:
        """Takes the planner's progress; returns the windows it frees."""
        self.planned_seq = max(self.planned_seq, progress.planned_seq)
        self.planned_steps = max(self.planned_steps, progress.planned_steps)
        self.delivered_below = max(self.delivered_below, progress.delivered_below)
        for w in self._held:
            if w.last_step is None and w.seq_end <= self.planned_seq:
                w.last_step = self.planned_steps - 1
        return self._evict()

    def _want(self, number: int, *, replay: bool) -> None:
        """Asks the reader for window `number` before anything else."""
        self._urgent.setdefault(number, replay)

    def _reroute(self, routes: Routing | None) -> list[HeldWindow[T]]:
        """Takes new routes (None or the same: nothing changes); returns the windows read
        ahead that are now another replica's, dropped."""
        if routes is None or routes == self.routes:
            return []
        self.routes = routes
        dropped = [w for w in self._held if not (w.summarized or self.owns(w.span.number))]
        self._held = [w for w in self._held if w.summarized or self.owns(w.span.number)]
        self._bounds = None
        return dropped

    def _evict(self) -> list[HeldWindow[T]]:
        """Frees the windows fully planned and either fully released or planned only by steps
        every rank has been handed; returns them."""
        kept: list[HeldWindow[T]] = []
        freed: list[HeldWindow[T]] = []
        for w in self._held:
            done = w.last_step is not None and (w.unreleased <= 0 or w.last_step < self.delivered_below)
            (freed if done else kept).append(w)
        if freed:
            self._held = kept
            self._bounds = None
        return freed

    def _unread(self, *, until: int) -> Iterator[WindowSpan]:
        """This replica's windows not held, from the planner's cursor to position `until`, in
        order."""
        seq = max(self.planned_seq, self.start_seq or 0)
        if self.is_end(seq):
            return
        starts = {w.seq_start for w in self._held}
        span = window_of(self.order, seq)
        while span.start < until and not self.is_end(span.start):
            if self.owns(span.number) and span.start not in starts:
                yield span
            span = window_span(self.order, span.number + 1)
