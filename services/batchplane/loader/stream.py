"""One source's sample stream inside a loader: a reader thread fills a bounded buffer of
windows in stream order; the planner reads summaries of it; constructors fetch planned samples
from it and release them.

Memory: a window (a few row groups, transformed and shuffled) is the unit read and freed. The
reader reads ahead of the planner's cursor up to `read_ahead_samples` while the loader's
buffered bytes stay under `buffer_bytes`; it always reads when the planner waits for data, so
the planner never deadlocks on a full buffer. A fetch reads only positions the planner may have
planned from this replica, and a window it misses goes into the buffer only while the buffer is
under budget; over it, the fetch reads the window itself and keeps nothing (`bounds`). A loader
group may run as several replicas: each reads only the windows the planner routes to it
(`core.routing`; the routes come with every summary request) and drops windows it read ahead
that a new route gave to another replica.

A window is freed once every position in it is planned and either every good sample in it has
been released by the constructors that fetched it, or every constructor has handed its ranks
every step that planned from it (`delivered_below`, which the planner passes on with each
summary request). The second rule frees what the first cannot count: windows read again after a
restart, whose samples were partly fetched from the loader's earlier life.

Nothing a loader has dropped is lost: its positions are a pure function of the seed and the
files (`core.order`), so any window the planner or a constructor asks for and the loader does not
hold is read again on demand. That is how a loader that restarts, and a replica the planner's
restart routed other windows to, rebuild their exact state; a restarted loader also reads at once
the windows the planner says are still needed (`restore`), so constructors seldom wait.

Reading a window (Parquet, the transform, bad samples) is `reading`'s; which windows are held,
read next and freed is the pure `windows.WindowBook`'s; this module runs the reader thread and
the waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from batchplane.core.errors import NotFound, Unavailable
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing, window_span
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.reading import BufferedWindow, Summary, WindowReader, summary_of
from batchplane.loader.source import ParquetSource
from batchplane.loader.transforms import BoundTransform
from batchplane.loader.windows import HeldWindow, Progress, WindowBook

log = logging.getLogger(__name__)


class ByteBudget:
    """Buffered payload bytes of one loader, shared by its sources; `direct` serializes the
    loader's reads that fetches make outside the buffer (over budget: `bounds.plan_fetch_reads`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self.direct = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes

    @property
    def used(self) -> int:
        return self._used

    @property
    def exceeded(self) -> bool:
        return self._used >= self.limit


class SourceStream:
    """The buffered stream of one source: a reader thread, the Parquet reads and transforms, and
    the waits; which windows it holds, reads next and frees is its `windows.WindowBook`'s.

    Args:
        index: The source's index in the job.
        source: Its open files.
        order: Its consumption order.
        transform: Its sample transform.
        epochs: Passes over the source in the whole job (epochs x its repeat; None: endless).
        read_ahead_samples: How far to read past the planner's cursor.
        budget: The loader's buffered-bytes budget.
        metrics: The loader's metrics.
        replica: This loader replica's id in its group (what routes name).
    """

    def __init__(
        self,
        index: int,
        source: ParquetSource,
        order: SampleOrder,
        transform: BoundTransform,
        *,
        epochs: int | None,
        read_ahead_samples: int,
        budget: ByteBudget,
        metrics: LoaderMetrics,
        replica: str = "",
    ) -> None:
        self.index = index
        self.replica = replica
        self.source = source
        self.order = order
        self.transform = transform
        self.num_rows = order.num_rows
        self.end_seq = None if epochs is None else epochs * self.num_rows
        self._budget = budget
        self._metrics = metrics
        self._reader = WindowReader(source, order, transform, metrics)
        self._cond = threading.Condition()
        #: The buffered windows and the rules that read and free them (under `_cond`).
        self._windows: WindowBook[BufferedWindow] = WindowBook(
            order, replica=replica, end_seq=self.end_seq, read_ahead_samples=read_ahead_samples
        )
        self._closed = False
        self._thread = threading.Thread(target=self._read_loop, name=f"read-{source.name}", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def budget(self) -> ByteBudget:
        """The loader's buffered-bytes budget (shared by its streams)."""
        return self._budget

    # ---- planner side --------------------------------------------------------------------

    def summary(
        self,
        *,
        from_seq: int,
        planned_seq: int,
        max_samples: int,
        wait_s: float,
        routes: Routing | None = None,
        planned_steps: int = 0,
        delivered_below: int = 0,
    ) -> Summary:
        """Rows, lengths, bad reasons, features and digests of positions from `from_seq` on, as
        far as read. A window not held (never read, or dropped) is read now.

        Args:
            routes: The source's current routes (None: keep the last ones); `from_seq` lies in
                a window routed to this replica.
            planned_steps: Steps planned so far: every position below `planned_seq` belongs to
                an earlier one.
            delivered_below: Every rank was handed every step below it.
        Returns:
            The summary (`reading.Summary`) of n positions; n may be 0 after waiting `wait_s`
            for the reader.
        """
        progress = Progress(planned_seq, planned_steps, delivered_below)
        with self._cond:
            if self._windows.start_seq is None:
                self._log_start(from_seq)
            self._removed(self._windows.summary_asked(from_seq, routes=routes, progress=progress))
            self._cond.notify_all()  # the planner's cursor moved, or it waits: read
            self._cond.wait_for(lambda: self._windows.holds(from_seq) or self._windows.is_end(from_seq) or self._closed, timeout=wait_s)
            pieces, seq = self._windows.summarize(from_seq, max_samples)
            names = self._reader.feature_names or ()
            self._cond.notify_all()  # the planner has seen these windows
        return summary_of(pieces, names, end_of_stream=self._windows.is_end(seq))

    def follow(
        self, *, from_seq: int, count: int, planned_seq: int, planned_steps: int, delivered_below: int, routes: Routing | None
    ) -> None:
        """A shadow's part of a summary request its replica answered with `count` samples from
        `from_seq`: reads that window (without waiting for it) and takes the progress, so it
        holds what the replica holds."""
        with self._cond:
            if self._windows.start_seq is None:
                self._log_start(from_seq)
            progress = Progress(planned_seq, planned_steps, delivered_below)
            self._removed(self._windows.followed(from_seq, count=count, routes=routes, progress=progress))
            self._cond.notify_all()

    def restore(
        self, *, from_seq: int, through_seq: int, routes: Routing | None, planned_seq: int, planned_steps: int, delivered_below: int
    ) -> int:
        """Rebuilds a restarted replica's position: reads at once its windows of positions
        [from_seq, through_seq), those the planner has asked about and constructors may still
        fetch (the planner's replay of its ledger: `from_seq` is its cursor at the oldest step a
        rank has not been handed). Returns the samples to read again."""
        with self._cond:
            self._log_start(from_seq)
            progress = Progress(planned_seq, planned_steps, delivered_below)
            replay, removed = self._windows.restore(from_seq, through_seq=through_seq, routes=routes, progress=progress)
            self._removed(removed)
            self._cond.notify_all()
            return replay

    def asked_through(self, through_seq: int) -> None:
        """The planner has asked this replica's group about every window before `through_seq`
        (`SourceRestore.through_seq`, e.g. of a heartbeat's answer): fetches may reach there."""
        with self._cond:
            self._windows.frontier.restored(through_seq)

    def drained(self, below: int) -> bool:
        """Whether every window of this replica below position `below` has been served: read,
        asked about by the planner and released by the constructors."""
        with self._cond:
            return self._windows.drained(below)

    def _log_start(self, seq: int) -> None:
        if seq and not self._windows.is_end(seq):
            log.info("source %r: starting at position %d (epoch %d)", self.name, seq, seq // self.num_rows)

    # ---- constructor side ----------------------------------------------------------------

    def locate(self, seqs: np.ndarray, *, wait_s: float) -> Iterator[tuple[BufferedWindow, np.ndarray, np.ndarray]]:
        """The windows holding positions `seqs`, one after another: (window, which of `seqs` it
        holds as a mask, their indices in it). Windows not held are read now, waiting up to
        `wait_s`: into the buffer while it is under its budget, else by this call, one window
        at a time for the whole loader, kept only while the caller takes from it
        (`bounds.plan_fetch_reads`).

        Raises:
            NotFound: a position past the end of the stream (no plan holds it).
            NotPlanned: a position the planner cannot have planned from this replica (nothing
                is read; `bounds.FetchFrontier`).
            Unavailable: windows still being read after `wait_s`, or the loader is stopping (retry).
        """
        give_up = time.monotonic() + wait_s
        direct: tuple[int, ...] = ()
        with self._cond:
            self._windows.check_fetch(seqs, source=self.name)
            while True:  # windows held before may be freed while others are read: check them all again
                held = self._windows.held(seqs)
                missing = seqs[~held]
                if not len(missing):
                    break
                if self._closed or time.monotonic() >= give_up:
                    raise Unavailable(f"source {self.name!r}: positions {missing[:5].tolist()} are being read again; retry")
                reads = self._windows.plan_fetch(missing, used=self._budget.used, limit=self._budget.limit)
                if not reads.waits:
                    direct = reads.direct
                    break
                self._cond.notify_all()
                self._cond.wait(timeout=give_up - time.monotonic())
            found = self._windows.located(seqs, held)
        yield from found
        for number in direct:
            with self._budget.direct:
                span = window_span(self.order, number)
                try:
                    window = self._reader.read(span.start, start_seq=self._windows.start_seq)
                    window.transient = True
                except Exception as exc:  # noqa: BLE001 - like the reader's: the fetch is retried
                    log.exception("source %r: reading at position %d for a fetch failed", self.name, span.start)
                    raise Unavailable(f"source {self.name!r}: reading position {span.start} failed; retry") from exc
                self._metrics.samples_replayed.labels(self.name).inc(len(window.rows))
                mine = ~held & (seqs >= span.start) & (seqs < span.end)
                yield window, mine, seqs[mine] - span.start
                del window
                pa.default_memory_pool().release_unused()

    def check_good(self, window: BufferedWindow, index: np.ndarray) -> None:
        """Raises NotFound when one of samples `index` of `window` is a bad sample."""
        if (window.lengths[index] == 0).any():
            raise NotFound(f"source {self.name!r}: a requested sample is a bad sample, which is never delivered")

    def release(self, window: BufferedWindow, count: int) -> None:
        """`count` good samples of `window` are no longer needed (a window dropped since, or read
        again, is not affected)."""
        with self._cond:
            if self._removed(self._windows.release(window, count)):  # only a freed window changes what the reader and fetches wait for
                self._cond.notify_all()

    # ---- buffer --------------------------------------------------------------------------

    def _removed(self, windows: list[HeldWindow[BufferedWindow]]) -> int:
        """Takes `windows`, dropped or freed, off the budget and updates the buffer's metrics
        (lock held); returns how many there were."""
        self._budget.add(-sum(w.nbytes for w in windows))
        self._metrics.buffer_samples.labels(self.name).set(self._windows.samples)
        self._metrics.buffer_bytes.set(self._budget.used)
        return len(windows)

    def _read_loop(self) -> None:
        while True:
            span = None
            with self._cond:
                while span is None:
                    if self._closed:
                        return
                    span = self._windows.next_read(over_budget=self._budget.exceeded)
                    if span is None:
                        self._cond.wait()
            begin = time.perf_counter()
            try:
                window = self._reader.read(span.start, start_seq=self._windows.start_seq)
            except Exception:  # noqa: BLE001 - a reader must not die silently
                log.exception("source %r: reading at %d failed; again in 1 s, until it reads or the loader stops", self.name, span.start)
                with self._cond:
                    self._cond.wait(timeout=1.0)
                continue
            self._metrics.read_seconds.labels(self.name).inc(time.perf_counter() - begin)
            with self._cond:
                stored = self._windows.stored(span, window, nbytes=window.nbytes, unreleased=window.unreleased)
                if stored.kept is not None:
                    self._budget.add(window.nbytes)
                if stored.replayed:
                    self._metrics.samples_replayed.labels(self.name).inc(len(window.rows))
                self._removed(stored.removed)
                self._cond.notify_all()
            del window, stored
            # Decoding leaves freed buffers in Arrow's pool; hand them back to the OS so resident
            # memory tracks what is buffered (measured: 171 -> 126 MiB on the demo's loader).
            pa.default_memory_pool().release_unused()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
