"""The consumer's I/O driver of the journal: `JournalReader` follows the manifest, waits for
each logical step's written steps to become visible, range-reads only the slices its ranks
need (remapped with `batchplane.journal.slices` when the mesh changed at resume), prefetches
ahead on a background thread, and hands out one `JournalStep` per logical step; `Watermarks`
records and releases the live checkpoints' marks in the manifest.

Reads per written step: the trailer and the footer of its TGB once (two range reads, the
footer then cached in a bounded LRU), then one range read per slice a served rank needs; never
the whole object. Every fetched byte is checked (`batchplane.journal.tgb`): a corrupt object is
refused with `CorruptTGB` naming the step and the key.

A reader's position is a `ReaderCursor`: the manifest version it had read and the
`slices.SliceCursor` of the next logical step. A checkpoint taken after training a step records
the step's `cursor` (where the next step starts) and, through `Watermarks.record`, the mark
that keeps the reclaimer off what a restore from it needs.

Decides nothing itself (the manifest's and `slices`' rules do); the prefetch thread is the
only thread, and it owns its own `ManifestStore` (not thread-safe). Memory is bounded by
`depth` logical steps plus one in the making, and `footer_cache` footers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from typing import NamedTuple, TypeVar

import numpy as np

from batchplane.core.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from batchplane.core.storage import Storage
from batchplane.journal.commit import ManifestSettings, ManifestStore
from batchplane.journal.manifest import CommittedStep, ManifestState, Mark, Unmark
from batchplane.journal.slices import DataMesh, SliceCursor, advance, assemble, dp_slices, reads_for, written_steps
from batchplane.journal.tgb import CorruptTGB, Footer, load_footer, load_slice
from batchplane.journal.writer import JournalHeader, read_end, read_header

log = logging.getLogger(__name__)

_PUT_TRIES = 100
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ReaderCursor:
    """A consumer's position in the journal (what a checkpoint records).

    Attributes:
        manifest_version: The manifest version the reader had read.
        position: Where the next logical step starts in the written stream.
    """

    manifest_version: int
    position: SliceCursor

    @property
    def step(self) -> int:
        """The first written step still needed: the cursor's retention watermark."""
        return self.position.step


class JournalStep(NamedTuple):
    """One logical step as the reader hands it out.

    Attributes:
        step: The logical step (the reader mesh's step number).
        cursor: Where the *next* logical step starts: what a checkpoint taken after training
            this step records.
        batches: (dp, cp) -> that rank's batch (column name -> array, read-only views of the
            fetched bytes where no CP remapping copied them), for every served coordinate.
        totals: Each slice meta figure (`tgb.SliceEntry.meta`) summed over every written slice
            the logical step reads, over all the reader mesh's ranks (not only the served ones;
            their footers are read for it): the names every one of those slices has.
    """

    step: int
    cursor: ReaderCursor
    batches: dict[tuple[int, int], dict[str, np.ndarray]]
    totals: dict[str, int]


class _Coord(NamedTuple):
    dp: int
    cp: int


@dataclasses.dataclass
class ReaderStats:
    """Counters of one reader, updated in place (by its prefetch thread).

    Attributes:
        steps: Logical steps assembled.
        slices_read: Slices range-read.
        bytes_read: Bytes range-read (trailers, footers and slices).
        footer_reads: Footers read (cache misses).
        waits: Times a step was not yet visible when wanted.
    """

    steps: int = 0
    slices_read: int = 0
    bytes_read: int = 0
    footer_reads: int = 0
    waits: int = 0


class Watermarks:
    """Records and releases live checkpoint marks in the manifest.

    Args:
        storage: Where the journal lies.
        prefix: Its folder.
        settings: The manifest's settings.
        check_writes: Prove first that the storage honours conditional puts.
        sleep: Sleeps between lost races.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        settings: ManifestSettings = ManifestSettings(),
        check_writes: bool = True,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._store = ManifestStore(storage, prefix=prefix, settings=settings, check_writes=check_writes)
        self._sleep = sleep

    def record(self, mark: str, cursor: ReaderCursor) -> ManifestState:
        """Records (or moves) the live checkpoint mark `mark` at `cursor`.

        Args:
            mark: The mark's id (a consumer group, or one checkpoint's name).
            cursor: The checkpoint's cursor (`JournalStep.cursor`).

        Returns:
            The manifest state that holds the mark.

        Raises:
            CommitRefused: The cursor's step was reclaimed already (MARK_RECLAIMED), or lies
                ahead of the manifest (MARK_AHEAD).
            Unavailable: Every attempt lost its race, or the storage failed.
        """
        change = Mark(mark, cursor.manifest_version, cursor.step)
        return self._put(lambda s: None if _same_mark(s, change) else change)

    def release(self, mark: str) -> ManifestState:
        """Removes the mark `mark` (its checkpoint was deleted); nothing if it is not there.

        Raises:
            Unavailable: Every attempt lost its race, or the storage failed.
        """
        return self._put(lambda s: Unmark(mark) if s.mark(mark) is not None else None)

    def _put(self, change_for: Callable[[ManifestState], Mark | Unmark | None]) -> ManifestState:
        for attempt in range(_PUT_TRIES):
            base = self._store.latest()
            change = change_for(base)
            if change is None:
                return base
            new = self._store.put(self._store.prepare(base, change))
            if new is not None:
                return new
            self._sleep(min(0.001 * 2**attempt, 0.1))
        raise Unavailable(f"could not commit a checkpoint mark: {_PUT_TRIES} attempts lost their race")


def _same_mark(state: ManifestState, change: Mark) -> bool:
    current = state.mark(change.mark)
    return current is not None and (current.manifest_version, current.step) == (change.manifest_version, change.step)


class JournalReader:
    """Reads logical steps for a set of ranks' (dp, cp) coordinates (see the module docstring).

    Use as a context manager (or call `start` and `close`); `next` hands out the logical steps
    in order, starting at `start_step` from `cursor`.

    Args:
        storage: Where the journal lies.
        prefix: Its folder ("" or ending in '/').
        mesh: The reader's data mesh (dp, cp, cp_mode).
        coords: The (dp, cp) coordinates it serves (TP and PP peers share theirs).
        cursor: Where `start_step` starts (a checkpoint's cursor, or the journal's start).
        start_step: The logical step number of the first step handed out.
        depth: Logical steps prefetched ahead on a background thread (0: read in `next`).
        footer_cache: Footers kept (one per written step).
        poll_s: Seconds between looks at the manifest while a step is not visible.
        stall_log_s: After waiting this long for a step, say so in the log (and again each time).
        expect_job: The job's fingerprint the journal must hold; None skips the check.
        consumer_id: The default mark id of `record_watermark` (one per consumer group).
        manifest_settings: The manifest's settings.
        clock: Monotonic seconds.

    Raises:
        ConfigError: A bad depth, cache size or coordinate.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        mesh: DataMesh,
        coords: Collection[tuple[int, int]],
        cursor: SliceCursor | ReaderCursor = SliceCursor(0),
        start_step: int = 0,
        depth: int = 2,
        footer_cache: int = 64,
        poll_s: float = 0.05,
        stall_log_s: float = 30.0,
        expect_job: str | None = None,
        consumer_id: str = "consumer",
        manifest_settings: ManifestSettings = ManifestSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError("journal.read_ahead_steps", "must be an integer >= 0", depth)
        if isinstance(footer_cache, bool) or not isinstance(footer_cache, int) or footer_cache < 1:
            raise ConfigError("journal.footer_cache", "must be an integer >= 1", footer_cache)
        served = sorted({(int(d), int(c)) for d, c in coords})
        bad = [c for c in served if not (0 <= c[0] < mesh.dp and 0 <= c[1] < mesh.cp)]
        if not served or bad:
            raise ConfigError("journal.coords", f"must be a non-empty set of (dp, cp) inside dp={mesh.dp} x cp={mesh.cp}", bad)
        self.storage = storage
        self.prefix = prefix
        self.mesh = mesh
        self.coords = tuple(served)
        self.depth = depth
        self.poll_s = poll_s
        self.stall_log_s = stall_log_s
        self.expect_job = expect_job
        self.consumer_id = consumer_id
        self.stats = ReaderStats()
        #: The last committed written step of the newest manifest read (-1: none committed;
        #: None: the manifest was not read yet), for messages while a step is not committed.
        self.visible_through: int | None = None
        self._settings = manifest_settings
        self._watermarks: Watermarks | None = None
        position = cursor.position if isinstance(cursor, ReaderCursor) else cursor
        self._next = (start_step, position)  # the next logical step to read, and its cursor
        self._store = ManifestStore(storage, prefix=prefix, settings=manifest_settings, check_writes=False, clock=clock)
        self._clock = clock
        self._footers: collections.OrderedDict[str, Footer] = collections.OrderedDict()
        self._footer_cache = footer_cache
        self._header: JournalHeader | None = None
        self._queue: queue.Queue[JournalStep | BaseException] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> JournalReader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def header(self) -> JournalHeader:
        """The journal's header (read once, waiting for the first writer to open the journal).

        Raises:
            FailedPrecondition: Another job's journal, or a header this code cannot read.
            Unavailable: `close` was called while waiting.
        """
        if self._header is None:
            self._header = self._wait_header()
        return self._header

    def start(self) -> None:
        """Starts prefetching (with depth > 0)."""
        if self.depth > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._prefetch, name="journal-reader", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stops prefetching and drops what was prefetched."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                _drain(self._queue)
                self._thread.join(timeout=0.05)
            self._thread = None
        _drain(self._queue)

    def next(self, *, timeout_s: float | None = None) -> JournalStep:
        """The next logical step, waiting for producers to commit it.

        Args:
            timeout_s: The longest wait, in seconds (None: no limit).

        Returns:
            The step, its cursor and the served ranks' batches.

        Raises:
            Unavailable: `timeout_s` passed first, or the reader was closed.
            CorruptTGB: A TGB object that is not valid; the message names the step and the key.
            FailedPrecondition: Another job's journal, a step that was reclaimed, a listed
                object that is gone, or a written mesh the reader cannot remap to.
        """
        if self._thread is None and self.depth > 0:
            self.start()
        if self._thread is None:
            deadline = None if timeout_s is None else self._clock() + timeout_s
            item = self._read(*self._next, deadline=deadline)
            self._next = (item.step + 1, item.cursor.position)
            return item
        try:
            got = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise Unavailable(f"journal step {self._next[0]} not read within {timeout_s} s") from None
        if isinstance(got, BaseException):
            self._queue.put(got)  # every later call fails alike
            raise got
        self._next = (got.step + 1, got.cursor.position)
        return got

    def read_end(self) -> int | None:
        """The written step the data ends at (the end marker, `JournalWriter.finish`), or None
        while the producers have not reached it.

        Raises:
            FailedPrecondition: An end marker this code cannot read.
        """
        return read_end(self.storage, self.prefix)

    def record_watermark(self, cursor: ReaderCursor, *, mark: str | None = None) -> ManifestState:
        """Records a checkpoint's cursor as a live mark (`Watermarks.record`), by default under
        `consumer_id` (the consumer group's newest checkpoint).

        Raises:
            As `Watermarks.record`.
        """
        return self._marks().record(mark or self.consumer_id, cursor)

    def release_watermark(self, *, mark: str | None = None) -> ManifestState:
        """Removes a live mark (`Watermarks.release`), by default `consumer_id`'s."""
        return self._marks().release(mark or self.consumer_id)

    def _marks(self) -> Watermarks:
        if self._watermarks is None:
            self._watermarks = Watermarks(self.storage, prefix=self.prefix, settings=self._settings)
        return self._watermarks

    # --- the prefetch thread ---------------------------------------------------------------

    def _prefetch(self) -> None:
        step, position = self._next
        while not self._stop.is_set():
            try:
                item: JournalStep | BaseException = self._read(step, position, deadline=None)
            except Unavailable as exc:
                if self._stop.is_set():
                    return
                item = exc
            except Exception as exc:  # handed to the caller of next()
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            step, position = item.step + 1, item.cursor.position

    # --- reading one logical step ----------------------------------------------------------

    def _read(self, step: int, position: SliceCursor, *, deadline: float | None) -> JournalStep:
        written = self.header.mesh
        need = written_steps(position, written=written, reader=self.mesh)
        state = self._wait_visible(need[-1], deadline=deadline)
        if need[0] < state.watermark:
            raise FailedPrecondition(
                f"journal step {need[0]} was reclaimed (the retention watermark is step {state.watermark}); "
                "resume from a checkpoint whose mark is still live"
            )
        plan = {c: reads_for(_Coord(*c), cursor=position, written=written, reader=self.mesh) for c in self.coords}
        fetched: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
        for reads in plan.values():
            for read in reads:
                if read.key not in fetched:
                    fetched[read.key] = self._load(state, read.step, read.dp, read.cp)
        batches = {c: assemble(reads, fetched, token_names=self.header.token_names) for c, reads in plan.items()}
        totals = self._totals(state, position)
        self.stats.steps += 1
        cursor = ReaderCursor(state.version, advance(position, written=written, reader=self.mesh))
        return JournalStep(step, cursor, batches, totals)

    def _totals(self, state: ManifestState, position: SliceCursor) -> dict[str, int]:
        """`JournalStep.totals` of the logical step starting at `position`."""
        written = self.header.mesh
        sums: dict[str, int] | None = None
        for step, dp in dp_slices(position, written=written, reader=self.mesh):
            footer = self._checked(state, step, functools.partial(self._footer_of, step))
            for cp in range(written.cp):
                meta = footer.slice(dp, cp).meta
                sums = dict(meta) if sums is None else {name: total + meta[name] for name, total in sums.items() if name in meta}
        return sums or {}

    def _wait_visible(self, written_step: int, *, deadline: float | None) -> ManifestState:
        """The manifest once `written_step` and every step before it are committed."""
        started = self._clock()
        said = started
        waited = False
        while True:
            state = self._store.latest()
            self.visible_through = state.visible_through
            if state.visible_through >= written_step:
                return state
            if not waited:
                waited = True
                self.stats.waits += 1
            now = self._clock()
            if now - said >= self.stall_log_s:
                said = now
                log.warning(
                    "no producer has committed step %d for %.0f s; last committed step %d (the journal at %s in %s)",
                    state.visible_through + 1,
                    now - started,
                    state.visible_through,
                    self.prefix or "/",
                    self.storage.describe(),
                )
            if deadline is not None and now >= deadline:
                raise Unavailable(f"journal step {written_step} is not committed yet (last committed step {state.visible_through})")
            if self._stop.wait(self.poll_s):
                raise Unavailable("the journal reader was closed")

    def _load(self, state: ManifestState, step: int, dp: int, cp: int) -> dict[str, np.ndarray]:
        batch = self._checked(
            state, step, lambda key, size, fetch: load_slice(fetch, self._footer_of(step, key, size, fetch), dp=dp, cp=cp)
        )
        self.stats.slices_read += 1
        return batch

    def _checked(self, state: ManifestState, step: int, read: Callable[[str, int, Callable[[int, int], bytes]], _T]) -> _T:
        """`read(key, size, fetch)` of written step `step`'s object as `state` lists it, its errors
        naming the step and the object."""
        committed = state.step(step)
        if committed is None:  # cannot happen below visible_through, above the watermark
            raise FailedPrecondition(f"journal step {step} is not listed in manifest version {state.version}")
        key, size = _the_object(committed)
        try:
            return read(key, size, functools.partial(self._get_range, key))
        except CorruptTGB as exc:
            raise CorruptTGB(exc.field, f"{exc.problem} (journal step {step}, object {key!r} in {self.storage.describe()})") from exc
        except NotFound as exc:
            raise FailedPrecondition(
                f"journal step {step}: its object {key!r} is gone from {self.storage.describe()} although manifest "
                f"version {state.version} lists it (deleted by hand, or a reclaimer that broke the rules)"
            ) from exc

    def _footer_of(self, step: int, key: str, size: int, fetch: Callable[[int, int], bytes]) -> Footer:
        """The footer of written step `step`'s object `key` of `size` bytes, checked against
        the written mesh."""
        footer = self._footer(step, key, size, fetch)
        written = self.header.mesh
        if (footer.dp, footer.cp) != (written.dp, written.cp):
            raise CorruptTGB(
                "footer.dp",
                f"the object holds dp={footer.dp} x cp={footer.cp} slices, the journal is written for dp={written.dp} x cp={written.cp}",
            )
        return footer

    def _footer(self, step: int, key: str, size: int, fetch: Callable[[int, int], bytes]) -> Footer:
        footer = self._footers.get(key)
        if footer is not None:
            self._footers.move_to_end(key)
            return footer
        footer = load_footer(fetch, object_size=size, step=step)
        self.stats.footer_reads += 1
        self._footers[key] = footer
        while len(self._footers) > self._footer_cache:
            self._footers.popitem(last=False)
        return footer

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.storage.get_range(key, start, end)
        self.stats.bytes_read += len(data)
        return data

    def _wait_header(self) -> JournalHeader:
        said = started = self._clock()
        while True:
            try:
                header = read_header(self.storage, self.prefix)
                break
            except NotFound:
                now = self._clock()
                if now - said >= self.stall_log_s:
                    said = now
                    log.warning(
                        "no producer has opened the journal at %s in %s for %.0f s",
                        self.prefix or "/",
                        self.storage.describe(),
                        now - started,
                    )
                if self._stop.wait(self.poll_s):
                    raise Unavailable("the journal reader was closed") from None
        if self.expect_job is not None and header.job != self.expect_job:
            raise FailedPrecondition(
                f"the journal at {self.prefix or '/'} in {self.storage.describe()} holds job {header.job!r}, "
                f"this reader expects {self.expect_job!r}"
            )
        return header


def _the_object(committed: CommittedStep) -> tuple[str, int]:
    objects = committed.entry.objects
    if len(objects) != 1:
        raise InvalidArgument(f"journal step {committed.step} lists {len(objects)} objects; this reader reads one TGB object per step")
    return objects[0].key, objects[0].size


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
