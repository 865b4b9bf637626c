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

Bad data is skipped, never silently: a row group that cannot be read or decoded, or whose
transform fails, becomes a run of bad samples (length 0); so do null or empty token lists. Bad
samples keep their positions (the plan does not depend on them, I4), carry the reason in the
summaries (`core.bad`: the ledger records it), are counted in metrics and logged with file, row
group and rows. So is a sample longer than `batch.max_length` under
`batch.length_policy` "reject" (reason too_long); under "truncate" it is cut to its first
max_length tokens before anyone sees it, counted and logged once per row group.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from batchplane.core import bad
from batchplane.core.errors import NotFound, Unavailable
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing, WindowSpan, window_of, window_span
from batchplane.loader.bounds import FetchFrontier, plan_fetch_reads
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.reporting import SampleReport
from batchplane.loader.rows import shuffle
from batchplane.loader.source import ParquetSource
from batchplane.loader.transforms import BoundTransform, TransformError, TransformOutput, lengths_of

log = logging.getLogger(__name__)

TOKEN_TYPE = pa.list_(pa.int32())


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


@dataclasses.dataclass
class BufferedWindow:
    """A window read, transformed and shuffled: position seq_start + j holds ids[j] and row j of
    each declared payload column."""

    seq_start: int
    ids: pa.ListArray
    rows: np.ndarray
    lengths: np.ndarray
    #: uint8 [n]: why each bad sample (length 0) is bad (`core.bad` codes); 0 for good ones.
    reasons: np.ndarray
    features: dict[str, np.ndarray]
    nbytes: int
    #: Good samples at or after the stream's start that are not yet released.
    unreleased: int
    #: Whether the planner has seen it (then it is this replica's for good).
    summarized: bool = False
    #: The last step that can plan from it, once every position in it is planned.
    last_step: int | None = None
    #: The job's declared payload columns (`batch.payload`) by name, normalized, shuffled like
    #: `ids`; a bad sample's are their empty values.
    columns: dict[str, pa.Array] = dataclasses.field(default_factory=dict)
    #: Read by a fetch outside the buffer (`locate`): dropped once the fetch has taken from it.
    transient: bool = False

    @property
    def seq_end(self) -> int:
        return self.seq_start + len(self.rows)


class SourceStream:
    """The buffered stream of one source.

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
        self.read_ahead_samples = read_ahead_samples
        self._budget = budget
        self._metrics = metrics
        self._report = SampleReport(source.name, source, transform, metrics)
        self._cond = threading.Condition()
        self._windows: list[BufferedWindow] = []  # in seq order
        self._start_seq: int | None = None  # set by the first summary request
        self._routes: Routing | None = None  # None: every window is this replica's
        self._planned_seq = 0
        self._planned_steps = 0  # every position below _planned_seq is planned by an earlier step
        self._delivered_below = 0  # every rank was handed every step below it
        self._urgent: dict[int, bool] = {}  # window number -> replay: windows someone waits for
        self._feature_names: tuple[str, ...] | None = None  # set by the first good row group
        self._frontier = FetchFrontier(order, replica, self.end_seq)  # how far fetches may reach
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
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray], bool]:
        """Rows, lengths, bad reasons and features of positions from `from_seq` on, as far as
        read. A window not held (never read, or dropped) is read now.

        Args:
            routes: The source's current routes (None: keep the last ones); `from_seq` lies in
                a window routed to this replica.
            planned_steps: Steps planned so far: every position below `planned_seq` belongs to
                an earlier one.
            delivered_below: Every rank was handed every step below it.
        Returns:
            (rows int64 [n], lengths int32 [n], reasons uint8 [n] (`core.bad` codes, 0 for good
            samples), features {name: float64 [n]}, end_of_stream after them); n may be 0 after
            waiting `wait_s` for the reader.
        """
        with self._cond:
            self._frontier.asked(from_seq)
            if self._start_seq is None:
                self._seek(from_seq)
            elif from_seq < self._start_seq:
                self._start_seq = from_seq  # a restarted planner resumes behind this stream
            if routes is not None and routes != self._routes:
                self._reroute(routes)
            self._follow(planned_seq, planned_steps, delivered_below)
            if not self._is_end(from_seq) and not self._holds(from_seq):
                self._want(window_of(self.order, from_seq).number, replay=False)
                self._cond.wait_for(lambda: self._holds(from_seq) or self._closed, timeout=wait_s)
            rows, lengths, reasons = [], [], []
            names = self._feature_names or ()
            features: dict[str, list[np.ndarray]] = {name: [] for name in names}
            count = 0
            i = self._window_index(from_seq) if self._holds(from_seq) else len(self._windows)
            seq = from_seq
            while i < len(self._windows) and count < max_samples and self._windows[i].seq_start <= seq:
                w = self._windows[i]
                w.summarized = True
                lo = seq - w.seq_start
                hi = min(len(w.rows), lo + max_samples - count)
                rows.append(w.rows[lo:hi])
                lengths.append(w.lengths[lo:hi])
                reasons.append(w.reasons[lo:hi])
                for name in names:
                    features[name].append(w.features[name][lo:hi] if name in w.features else np.zeros(hi - lo))
                count += hi - lo
                seq = w.seq_start + hi
                i += 1
            self._cond.notify_all()  # the planner's cursor moved: read ahead
        rows_out = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        lengths_out = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
        reasons_out = np.concatenate(reasons) if reasons else np.zeros(0, bad.DTYPE)
        features_out = {name: np.concatenate(parts) if parts else np.zeros(0) for name, parts in features.items()}
        return rows_out, lengths_out, reasons_out, features_out, self._is_end(seq)

    def follow(
        self, *, from_seq: int, count: int, planned_seq: int, planned_steps: int, delivered_below: int, routes: Routing | None
    ) -> None:
        """A shadow's part of a summary request its replica answered with `count` samples from
        `from_seq`: reads that window (without waiting for it) and takes the progress, so it
        holds what the replica holds."""
        with self._cond:
            self._frontier.asked(from_seq)
            if self._start_seq is None:
                self._seek(from_seq)
            if routes is not None and routes != self._routes:
                self._reroute(routes)
            self._follow(planned_seq, planned_steps, delivered_below)
            if count and not self._is_end(from_seq) and not self._holds(from_seq):
                self._want(window_of(self.order, from_seq).number, replay=False)

    def restore(
        self, *, from_seq: int, through_seq: int, routes: Routing | None, planned_seq: int, planned_steps: int, delivered_below: int
    ) -> int:
        """Rebuilds a restarted replica's position: reads at once its windows of positions
        [from_seq, through_seq), those the planner has asked about and constructors may still
        fetch (the planner's replay of its ledger: `from_seq` is its cursor at the oldest step a
        rank has not been handed). Returns the samples to read again."""
        with self._cond:
            self._frontier.restored(through_seq)
            self._seek(from_seq)
            self._routes = routes
            self._follow(planned_seq, planned_steps, delivered_below)
            replay = 0
            span = window_of(self.order, from_seq)
            while span.start < through_seq and not self._is_end(span.start):
                if self._owns(span.number):
                    self._want(span.number, replay=True)
                    replay += span.end - span.start
                span = window_span(self.order, span.number + 1)
            return replay

    def asked_through(self, through_seq: int) -> None:
        """The planner has asked this replica's group about every window before `through_seq`
        (`SourceRestore.through_seq`, e.g. of a heartbeat's answer): fetches may reach there."""
        with self._cond:
            self._frontier.restored(through_seq)

    def _follow(self, planned_seq: int, planned_steps: int, delivered_below: int) -> None:
        """Takes the planner's progress and frees what it makes unneeded (lock held)."""
        self._planned_seq = max(self._planned_seq, planned_seq)
        self._planned_steps = max(self._planned_steps, planned_steps)
        self._delivered_below = max(self._delivered_below, delivered_below)
        for w in self._windows:
            if w.last_step is None and w.seq_end <= self._planned_seq:
                w.last_step = self._planned_steps - 1
        self._evict()

    def _want(self, number: int, *, replay: bool) -> None:
        """Asks the reader for window `number` before anything else (lock held)."""
        self._urgent.setdefault(number, replay)
        self._cond.notify_all()

    def _is_end(self, seq: int) -> bool:
        return self.end_seq is not None and seq >= self.end_seq

    def _seek(self, seq: int) -> None:
        """Starts the stream at `seq` (a resumed job starts mid-stream)."""
        self._start_seq = seq
        self._planned_seq = seq
        if seq and not self._is_end(seq):
            log.info("source %r: starting at position %d (epoch %d)", self.name, seq, seq // self.num_rows)

    def _holds(self, seq: int) -> bool:
        """Whether a buffered window holds position `seq` (lock held)."""
        return bool(self._held(np.array([seq], np.int64))[0])

    def _owns(self, window: int) -> bool:
        return self._routes is None or self._routes.owner(window) == self.replica

    def _reroute(self, routes: Routing) -> None:
        """Takes new routes; frees windows read ahead that are now another replica's (lock held)."""
        self._routes = routes
        kept = []
        for w in self._windows:
            if w.summarized or self._owns(window_of(self.order, w.seq_start).number):
                kept.append(w)
            else:
                self._budget.add(-w.nbytes)
        self._windows = kept

    def drained(self, below: int) -> bool:
        """Whether every window of this replica below position `below` has been served: read,
        asked about by the planner and released by the constructors."""
        with self._cond:
            if self._start_seq is None:
                return True  # never asked about anything: it holds nothing the planner counts on
            if any((w.unreleased > 0 or not w.summarized) and w.seq_start < below for w in self._windows):
                return False
            return next(self._unread(until=below), None) is None  # one not read yet: the planner will ask

    def _next_window(self) -> WindowSpan | None:
        """The next window to read: one somebody waits for, else the first window of this
        replica not read yet that starts within the read-ahead of the planner's cursor, while
        the byte budget allows (lock held)."""
        if self._closed:
            return None
        for number in sorted(self._urgent):
            span = window_span(self.order, number)
            if not self._holds(span.start):
                return span
            del self._urgent[number]
        if self._start_seq is None or self._budget.exceeded:
            return None
        horizon = self._planned_seq + self.read_ahead_samples
        return next(self._unread(until=horizon), None)

    def _unread(self, *, until: int) -> Iterator[WindowSpan]:
        """This replica's windows not read yet, from the planner's cursor to position `until`, in
        order (lock held)."""
        seq = max(self._planned_seq, self._start_seq)
        if self._is_end(seq):
            return
        starts = {w.seq_start for w in self._windows}
        span = window_of(self.order, seq)
        while span.start < until and not self._is_end(span.start):
            if self._owns(span.number) and span.start not in starts:
                yield span
            span = window_span(self.order, span.number + 1)

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
            beyond = seqs[seqs >= self.end_seq] if self.end_seq is not None else seqs[:0]
            if len(beyond):
                raise NotFound(f"source {self.name!r}: positions {beyond[:5].tolist()} lie past the end of the stream at {self.end_seq}")
            self._frontier.check(seqs, routing=self._routes, source=self.name)
            while True:  # windows held before may be freed while others are read: check them all again
                held = self._held(seqs)
                missing = seqs[~held]
                if not len(missing):
                    break
                if self._closed or time.monotonic() >= give_up:
                    raise Unavailable(f"source {self.name!r}: positions {missing[:5].tolist()} are being read again; retry")
                windows = sorted({window_of(self.order, int(s)).number for s in missing})
                reads = plan_fetch_reads(windows, queued=self._urgent, used=self._budget.used, limit=self._budget.limit)
                if not reads.waits:
                    direct = reads.direct
                    break
                if reads.want is not None:
                    self._want(reads.want, replay=True)
                self._cond.wait(timeout=give_up - time.monotonic())
            starts = np.array([w.seq_start for w in self._windows], np.int64)
            slot = np.where(held, np.searchsorted(starts, seqs, side="right") - 1, -1)
            found = [(self._windows[i], slot == i, seqs[slot == i] - starts[i]) for i in np.unique(slot[held]).tolist()]
        yield from found
        for number in direct:
            with self._budget.direct:
                span = window_span(self.order, number)
                try:
                    window = self._read_window(span.start)
                    window.transient = True
                except Exception as exc:  # noqa: BLE001 - like the reader's: the fetch is retried
                    log.exception("source %r: reading at position %d for a fetch failed", self.name, span.start)
                    raise Unavailable(f"source {self.name!r}: reading position {span.start} failed; retry") from exc
                self._metrics.samples_replayed.labels(self.name).inc(len(window.rows))
                mine = ~held & (seqs >= span.start) & (seqs < span.end)
                yield window, mine, seqs[mine] - span.start
                del window
                pa.default_memory_pool().release_unused()

    def _held(self, seqs: np.ndarray) -> np.ndarray:
        """bool [n]: whether a buffered window holds each position (lock held)."""
        if not self._windows:
            return np.zeros(len(seqs), bool)
        starts = np.array([w.seq_start for w in self._windows], np.int64)
        ends = np.array([w.seq_end for w in self._windows], np.int64)
        slot = np.searchsorted(starts, seqs, side="right") - 1
        return (slot >= 0) & (seqs < ends[np.maximum(slot, 0)])

    def check_good(self, window: BufferedWindow, index: np.ndarray) -> None:
        """Raises NotFound when one of samples `index` of `window` is a bad sample."""
        if (window.lengths[index] == 0).any():
            raise NotFound(f"source {self.name!r}: a requested sample is a bad sample, which is never delivered")

    def release(self, window: BufferedWindow, count: int) -> None:
        """`count` good samples of `window` are no longer needed (a window dropped since, or read
        again, is not affected)."""
        with self._cond:
            window.unreleased -= count
            if self._evict():  # only a freed window changes what the reader and fetches wait for
                self._cond.notify_all()

    # ---- buffer --------------------------------------------------------------------------

    def _window_index(self, seq: int) -> int:
        i = bisect.bisect_right([w.seq_start for w in self._windows], seq) - 1
        if i < 0 or seq >= self._windows[i].seq_end:
            raise NotFound(f"source {self.name!r}: position {seq} is not buffered")
        return i

    def _evict(self) -> int:
        """Frees the windows that are fully planned and either fully released or planned only by
        steps every rank has been handed (lock held); returns how many it freed."""
        kept = []
        for w in self._windows:
            if w.last_step is not None and (w.unreleased <= 0 or w.last_step < self._delivered_below):
                self._budget.add(-w.nbytes)
            else:
                kept.append(w)
        freed = len(self._windows) - len(kept)
        self._windows = kept
        self._metrics.buffer_samples.labels(self.name).set(sum(len(w.rows) for w in self._windows))
        self._metrics.buffer_bytes.set(self._budget.used)
        return freed

    def _read_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._next_window() is not None or self._closed)
                if self._closed:
                    return
                span = self._next_window()
            begin = time.perf_counter()
            try:
                window = self._read_window(span.start)
            except Exception:  # noqa: BLE001 - a reader must not die silently
                log.exception("source %r: reading at position %d failed; retrying in 1 s", self.name, span.start)
                with self._cond:
                    self._cond.wait(timeout=1.0)
                continue
            self._metrics.read_seconds.labels(self.name).inc(time.perf_counter() - begin)
            with self._cond:
                replay = self._urgent.pop(span.number, None)
                if (replay is not None or self._owns(span.number)) and not self._holds(span.start):  # still ours after a reroute
                    window.summarized = replay is not None  # somebody waits for it: keep it whatever the routes say
                    if replay is None and window.seq_end <= self._planned_seq:
                        window.last_step = self._planned_steps - 1  # (one waited for: at the next summary, once taken)
                    bisect.insort(self._windows, window, key=lambda w: w.seq_start)
                    self._budget.add(window.nbytes)
                    if replay:
                        self._metrics.samples_replayed.labels(self.name).inc(len(window.rows))
                self._evict()
                self._cond.notify_all()
            # Decoding leaves freed buffers in Arrow's pool; hand them back to the OS so resident
            # memory tracks what is buffered (measured: 171 -> 126 MiB on the demo's loader).
            pa.default_memory_pool().release_unused()

    def _read_window(self, seq: int) -> BufferedWindow:
        epoch, position = divmod(seq, self.num_rows)
        window = self.order.window_at(epoch, position)
        parts: list[TransformOutput] = []
        reason_parts, failed = [], set()
        for g in window.row_groups:
            got = self._read_row_group(g)
            n = self.source.row_groups[g].num_rows
            if isinstance(got, int):  # a reason code: the row group is a run of bad samples
                failed.add(g)
                reason_parts.append(np.full(n, got, bad.DTYPE))
                got = self.transform.failed(n)
            else:
                reason_parts.append(np.zeros(n, bad.DTYPE))
            parts.append(got)
        perm = self.order.permutation(epoch, window)
        ids = shuffle([p.ids for p in parts], perm)
        columns = {c.name: shuffle([p.columns[c.name] for p in parts], perm) for c in self.transform.payload}
        reasons = np.concatenate(reason_parts)[perm] if reason_parts else np.zeros(0, bad.DTYPE)
        features = {
            name: np.concatenate([p.features.get(name, np.zeros(len(p.ids))) for p in parts])[perm]
            for name in self._feature_names or ()
        }
        rows = self.order.window_rows(epoch, window)
        self._report.bad(window, failed, ids, rows)
        reasons = _bad_reasons(ids, reasons)
        ids, over = self.transform.limit(ids)  # batch.max_length: truncate or reject
        self._report.over_length(window, rows, over)
        lengths = lengths_of(ids)
        columns = self.transform.limit_columns(columns, over=over, lengths=lengths)
        reasons[over & (lengths == 0) & (reasons == 0)] = bad.TOO_LONG  # rejected by limit (a cut one keeps tokens)
        seq_start = epoch * self.num_rows + window.start
        # Positions before the stream's start were consumed before it (a resumed job): never
        # fetched, so not counted; a window wholly before it is one read again for a fetch.
        start = self._start_seq or 0
        first_counted = max(0, start - seq_start) if start < seq_start + len(rows) else 0
        self._metrics.samples_read.labels(self.name).inc(len(rows))
        return BufferedWindow(
            seq_start=seq_start,
            ids=ids,
            rows=rows,
            lengths=lengths,
            reasons=reasons,
            features=features,
            nbytes=ids.nbytes + rows.nbytes + lengths.nbytes + reasons.nbytes + sum(f.nbytes for f in features.values())
            + sum(c.nbytes for c in columns.values()),
            unreleased=int(np.count_nonzero(lengths[first_counted:] > 0)),
            columns=columns,
        )

    def _read_row_group(self, g: int) -> TransformOutput | int:
        """The transformed token lists, features and payload columns of row group g; when it cannot be read or
        transformed, the reason code of its samples instead (`bad.UNREADABLE`, `bad.TRANSFORM`;
        logged and counted here)."""
        row_group = self.source.row_groups[g]
        where = self.source.describe(row_group)
        try:
            table = self.source.read(row_group, self.transform.columns)
        except (OSError, pa.ArrowException) as exc:
            log.error("source %r: %s is unreadable, skipping its %d rows: %s", self.name, where, row_group.num_rows, exc)
            self._metrics.corrupt_row_groups.labels(self.name).inc()
            self._metrics.bad_samples.labels(self.name, "unreadable").inc(row_group.num_rows)
            return bad.UNREADABLE
        try:
            out = self.transform.apply(table)
            out = dataclasses.replace(out, ids=out.ids.cast(TOKEN_TYPE))
            features = out.features
            if self._feature_names is None:
                self._feature_names = tuple(sorted(features))
            elif set(features) != set(self._feature_names):
                raise TransformError(f"returned features {sorted(features)}, earlier row groups {list(self._feature_names)}")
        except Exception as exc:  # noqa: BLE001 - user code: any failure skips the row group
            log.error("source %r: transform failed on %s, skipping its %d rows: %s", self.name, where, row_group.num_rows, exc)
            self._metrics.bad_samples.labels(self.name, "transform").inc(row_group.num_rows)
            return bad.TRANSFORM
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


def _bad_reasons(ids: pa.ListArray, groups: np.ndarray) -> np.ndarray:
    """uint8 [n]: the `core.bad` reason of each sample of transformed token lists `ids`:
    `groups`' code where it has one (a row group that could not be read or transformed), else
    REJECTED for a null list, EMPTY for an empty one, 0 for the others."""
    valid = ids.is_valid().to_numpy(zero_copy_only=False)
    reasons = groups.astype(bad.DTYPE, copy=True)
    free = reasons == 0
    reasons[free & ~valid] = bad.REJECTED
    reasons[free & valid & (lengths_of(ids) == 0)] = bad.EMPTY
    return reasons
