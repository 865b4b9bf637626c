"""A consumer of journal delivery (`batch.delivery: journal`, `--consume`): the sidecar
constructor of trainer pod I serves the Constructor service (GetInfo, GetBatch, GetLength,
Report) to the ranks of that pod (`job.pod_ranks(I)`) from the journal the producer commits
(`produce`), reading only the slices of its ranks' (dp, cp) coordinates. It never talks to the
planner or to loaders.

The service itself is `journal_service.JournalConstructorServicer`, which says what each call
answers; this module reads the journal for it.

Logical steps and the journal cursor. The journal holds the written mesh's steps; the consumer
numbers logical steps from an anchor: logical step s0 starts at journal position c0 (a
`SliceCursor`), and step s >= s0 starts at `slices.cursor_for(s, origin_step=s0, origin=c0, ...)`
(`slices`' rule: DP grown reads consecutive written steps' slices as one step, DP shrunk
alternating slices). Every batch header carries the cursor of the next step
(`BatchHeader.journal_cursor`), which the client keeps in its state_dict and sends back with its
restart (`GetBatchRequest.journal_cursor`): a restart with a cursor anchors the mapping there
(again whenever it disagrees with the current mapping: a rollback, or a second resume after a
DP change, DP 2 -> 4 -> 2, where logical and written steps differ). Without one (a fresh start,
or a checkpoint of stream delivery) the first step asked for, s0, is taken to start at written
step s0; with an anchor at its own written step and the same DP, logical step s is written step
s, before the anchor too. Otherwise a restart without a cursor before s0 cannot be mapped and is
refused. A CP change is refused (FAILED_PRECONDITION naming both meshes): the slices are opaque
headers and payloads, which cannot be re-cut. Every header carries its logical step's
`global_loss_tokens` and loss weights: the loss tokens of every slice the logical step reads, on
all pods, summed from the TGB footers' slice meta (`JournalStep.totals`; under a DP change the
reader reads the footers of written steps its own ranks do not read for it). A journal written
before slices carried the figure keeps the written step's.

Marks: the consumer records the progress mark `pod-I` (`JournalReader.record_watermark`) at
the step below which all its ranks took every step, every `MARK_EVERY` steps, so
`journal.max_lag_steps` bounds how far the producer runs ahead of the slowest pod even when no
trainer checkpoints. MarkCheckpoint (the trainer's `Client.checkpointed`, after a checkpoint
was saved) keeps the checkpoint marks: `ckpt-pod-I` at the lowest step the pod's ranks' latest
checkpoints resume from, `start-pod-I` at the ranks' start until each of them checkpointed
(`checkpoint_marks`, recorded by `mark_recorder`). The reclaimer keeps everything from the
lowest mark of all on, so progress marks (never below what the ranks were handed) never let it
reclaim what a checkpoint or a start needs; producers count every mark but start holds for
max_lag, so a trainer that never checkpoints is paced by its progress marks, not stalled.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence


from batchplane.constructor.journal_slices import LOSS_TOKENS, decode_slice, with_global_loss_tokens
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.produce import data_mesh
from batchplane.core.config import JobSettings
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.storage import Storage
from batchplane.journal.reader import JournalReader, JournalStep, ReaderCursor
from batchplane.journal.slices import DataMesh, SliceCursor, cursor_for, flat_index, logical_steps
from batchplane.journal.writer import length_key, read_end, read_header, read_length
from batchplane.v1 import common_pb2, constructor_pb2

log = logging.getLogger(__name__)

#: A consumer records its mark once its slowest rank moved this many steps past the last one.
MARK_EVERY = 8
#: Seconds between looks at the journal while waiting for its header, info or a step.
POLL_S = 0.05
#: Log again while waiting for the producer every this many seconds.
STALL_LOG_S = 30.0
#: Seconds between looks at the journal while GetLength waits for its length or end marker.
LENGTH_POLL_S = 0.1


class JournalConsumer:
    """The step buffer of one pod's ranks over a `JournalReader` (see the module docstring).

    Args:
        job: The job's settings (its mesh is the reader's).
        storage: The journal.
        index: The pod's index (its mark is `pod-<index>`).
        ranks: The global ranks it serves.
        metrics: The constructor's metrics.
        prefix: The journal's folder in `storage`.
        mark_every: Steps between marks (0: never record one).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        job: JobSettings,
        *,
        storage: Storage,
        index: int,
        ranks: Sequence[int],
        metrics: ConstructorMetrics,
        prefix: str = "",
        mark_every: int = MARK_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        m = job.mesh
        self.mesh = ClientPlaceTree(pp=m.pp, dp=m.dp, cp=m.cp, tp=m.tp, order=m.order)
        self.ranks = tuple(ranks)
        self.mark = f"pod-{index}"
        self._job = job
        self._storage = storage
        self._prefix = prefix
        self._metrics = metrics
        self._mark_every = mark_every
        self._clock = clock
        self._reader_mesh = data_mesh(job)
        self._coords = sorted({(c.dp, c.cp) for c in map(self.mesh.coords, self.ranks)})
        rules = DeliveryRules(self.mesh, pulling_ranks=job.constructors.pulling_ranks)
        self._pulling = [r for r in self.ranks if rules.pulls(r)] or list(self.ranks)
        self._cond = threading.Condition()
        self._written: DataMesh | None = None
        self._anchor: tuple[int, SliceCursor] | None = None  # logical step s0 starts at journal position c0
        self._reader: JournalReader | None = None
        self._reader_start = 0  # the logical step the reader started at
        self._read_next = 0  # the logical step the reader hands out next (past what it dropped)
        self._reading = False  # a request thread is reading the journal (outside the lock)
        self._buffer: dict[int, JournalStep] = {}
        self._progress: dict[int, int] = {}  # rank -> the last step it asked for
        self._released_cursor: ReaderCursor | None = None  # where the slowest rank's next step starts
        self._marked = -1
        self._end: int | None = None  # the logical end step, once the end marker is read
        self._read_bytes = 0
        self._stopped = False
        self._stored_length: int | None = None  # the length object's written steps, once read
        self._length_checked = False  # the length object was compared with the end marker

    # ---- requests ----------------------------------------------------------------------------

    def batch(
        self, rank: int, step: int, *, timeout_s: float, restart: bool = False, cursor: SliceCursor | None = None
    ) -> tuple[constructor_pb2.BatchHeader, memoryview] | None:
        """Rank `rank`'s header and payload of logical step `step`, the header carrying the next
        step's journal cursor; None past the end of data. `cursor` (with `restart`): where
        `step` starts in the journal, from the trainer's checkpoint.

        Raises:
            InvalidArgument: a rank not served here; a cursor the journal's written mesh has no
                such position in.
            FailedPrecondition: without `restart`, a step the rank moved past; a step too far
                ahead of the pod's slowest rank; a mesh the journal cannot be read with.
            Unavailable: not committed in time; retry.
        """
        if rank not in self.ranks:
            raise InvalidArgument(
                f"rank {rank} is not served here: this consumer serves ranks {list(self.ranks)} of a mesh of "
                f"{self.mesh.world} ranks ({self.mesh.describe()})"
            )
        deadline = self._clock() + timeout_s
        with self._cond:
            self._ask(rank, step, restart=restart, cursor=cursor if restart else None)
            item = self._wait_for(step, deadline)
        mark = self._mark_due()
        if mark is not None:
            self._record(mark)
        if item is None:
            return None
        coords = self.mesh.coords(rank)
        header, payload = decode_slice(item.batches[(coords.dp, coords.cp)], rank=rank, step=step, mesh=self.mesh)
        if LOSS_TOKENS in item.totals:
            with_global_loss_tokens(header, item.totals[LOSS_TOKENS])
        after = item.cursor
        header.journal_cursor.manifest_version = after.manifest_version
        header.journal_cursor.step, header.journal_cursor.offset = after.position.step, after.position.offset
        return header, payload

    def length(self, *, timeout_s: float = 0.0) -> common_pb2.JobLength:
        """The job's length in logical steps: from the end marker once written, else from the
        length object a producer stored; waits up to `timeout_s` for either. Infinite for a job
        whose data never ends.

        Raises:
            FailedPrecondition: An end marker that cannot be read; without one, a length object
                that cannot be read (naming its key and field).
        """
        if self._job.epochs is None:
            return common_pb2.JobLength(infinite=True)
        deadline = self._clock() + timeout_s
        while True:
            steps = self._known_length()
            if steps is not None:
                return common_pb2.JobLength(num_steps=steps)
            remaining = deadline - self._clock()
            with self._cond:
                if self._stopped or remaining <= 0:
                    break
                self._cond.wait(min(remaining, LENGTH_POLL_S))
        return common_pb2.JobLength(
            unknown=f"journal delivery: waiting for a producer to store the job's length ({length_key(self._prefix)!r}, "
            "once the planner's loaders registered) or to reach the end of the data (its end marker) in the journal at "
            f"{self._prefix or '/'} in {self._storage.describe()}"
        )

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            reader, self._reader = self._reader, None
            self._cond.notify_all()
        if reader is not None:
            reader.close()

    # ---- the buffer (under the lock) ---------------------------------------------------------

    def _ask(self, rank: int, step: int, *, restart: bool, cursor: SliceCursor | None) -> None:
        latest = self._progress.get(rank)
        if latest is not None and step < latest and not restart:
            raise FailedPrecondition(f"step {step} was already consumed: rank {rank} asked for step {latest} since")
        slowest = self._slowest()
        if slowest is not None and step > slowest + self._job.journal.max_lag_steps and not restart:
            raise FailedPrecondition(
                f"step {step} is more than journal.max_lag_steps ({self._job.journal.max_lag_steps}) ahead of the slowest "
                f"rank of this pod (step {slowest})"
            )
        if self._written is not None and cursor is not None:
            flat_index(cursor, written=self._written)  # an offset the written DP has (TopologyError otherwise)
        self._progress[rank] = step
        if self._anchor is None or cursor is not None and self._anchor != (step, cursor) and self._maps(step) != cursor:
            self._anchor = (step, SliceCursor(step) if cursor is None else cursor)
            self._end = None  # in logical steps of the old anchor
            log.info("ranks %s start at step %d (journal step %d, slice %d)", list(self.ranks), step, *dataclasses.astuple(self._anchor[1]))
            self._reposition(step)
        elif step not in self._buffer and (self._reader is None or step < self._reader_start or restart and step < self._next_read()):
            self._reposition(step)
        self._release()

    def _next_read(self) -> int:
        # Not max(buffer) + 1: once the ranks moved on, the buffer is empty but the reader is past it.
        return self._read_next

    def _reposition(self, step: int) -> None:
        """The reader starts again at `step` (the first request, or a restart before what is buffered)."""
        if self._reader is not None:
            reader = self._reader
            threading.Thread(target=reader.close, name="journal-reader-close", daemon=True).start()
        self._reader = None
        self._reader_start = self._read_next = step
        self._buffer.clear()
        self._cond.notify_all()

    def _slowest(self) -> int | None:
        asked = [self._progress[r] for r in self._pulling if r in self._progress]
        return min(asked) if len(asked) == len(self._pulling) else None

    def _release(self) -> None:
        slowest = self._slowest()
        if slowest is None:
            return
        for step in sorted(s for s in self._buffer if s < slowest):
            self._released_cursor = self._buffer.pop(step).cursor

    def _wait_for(self, step: int, deadline: float) -> JournalStep | None:
        while True:
            if self._stopped:
                raise Unavailable("the constructor is stopping")
            if step in self._buffer:
                return self._buffer[step]
            if self._end is not None and step >= self._end:
                return None
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise Unavailable(self._not_committed(step))
            if self._reading:
                self._cond.wait(min(remaining, 1.0))
                continue
            self._reading = True
            try:
                self._cond.release()
                try:
                    self._read_one(min(remaining, 0.25))
                finally:
                    self._cond.acquire()
            finally:
                self._reading = False
                self._cond.notify_all()

    def _not_committed(self, step: int) -> str:
        """Why logical step `step` is not served yet: the journal and its last committed step."""
        last = self._reader.visible_through if self._reader is not None else None
        remapped = self._written is not None and not self._identity(self._written)
        committed = (
            "the manifest was not read yet"
            if last is None
            else ("no step is committed yet" if last < 0 else f"last committed {'written ' if remapped else ''}step {last}")
        )
        where = f"the journal at {self._prefix or '/'} in {self._storage.describe()}"
        return f"step {step} is not in {where} yet: no producer has committed it ({committed}); it is served once a producer commits it"

    # ---- reading (one request thread at a time, outside the lock) ----------------------------

    def _read_one(self, timeout_s: float) -> None:
        """Reads the next logical step into the buffer, or looks at the end marker if none came."""
        written = self._written_mesh(timeout_s)
        if written is None:
            return
        with self._cond:
            reader, start = self._reader, self._reader_start
            if reader is None:
                reader = self._reader = self._open(start, written)
        try:
            got = reader.next(timeout_s=timeout_s)
        except Unavailable:
            self._look_at_end(written)
            return
        with self._cond:
            if reader is not self._reader:
                return  # repositioned meanwhile
            self._buffer[got.step] = got
            self._read_next = got.step + 1
            self._release()
            self._metrics.journal_steps_read.inc()
            self._metrics.journal_read_bytes.inc(reader.stats.bytes_read - self._read_bytes)
            self._read_bytes = reader.stats.bytes_read

    def _open(self, start: int, written: DataMesh) -> JournalReader:
        """A reader of the pod's coordinates from logical step `start` (under the lock)."""
        reader = JournalReader(
            self._storage,
            prefix=self._prefix,
            mesh=self._reader_mesh,
            coords=self._coords,
            cursor=self._cursor(start, written),
            start_step=start,
            depth=self._job.journal.prefetch_steps,
            poll_s=POLL_S,
            stall_log_s=STALL_LOG_S,
            expect_job=None,
            consumer_id=self.mark,
        )
        self._read_bytes = 0
        reader.start()
        return reader

    def _identity(self, written: DataMesh) -> bool:
        """Logical steps are written steps: the same DP, anchored at its own written step."""
        return written.dp == self._reader_mesh.dp and (self._anchor is None or self._anchor[1] == SliceCursor(self._anchor[0]))

    def _maps(self, step: int) -> SliceCursor | None:
        """Where logical step `step` starts by the current anchor; None when the written mesh is
        not known yet or the step lies before an anchor it cannot be mapped from (under the lock)."""
        if self._written is None:
            return None
        try:
            return self._cursor(step, self._written)
        except FailedPrecondition:
            return None

    def _cursor(self, step: int, written: DataMesh) -> SliceCursor:
        if self._identity(written):
            return SliceCursor(step)
        origin, position = self._anchor if self._anchor is not None else (step, SliceCursor(step))
        if step < origin:
            raise FailedPrecondition(
                f"step {step} is before step {origin}, where this consumer's ranks started reading a journal written for "
                f"dp={written.dp} with dp={self._reader_mesh.dp} (at journal step {position.step}, slice {position.offset}): "
                "that cannot be mapped without the journal cursor of a checkpoint; restart from one (its state_dict holds it)"
            )
        return cursor_for(step, origin_step=origin, origin=position, written=written, reader=self._reader_mesh)

    def _written_mesh(self, timeout_s: float) -> DataMesh | None:
        """The journal's written mesh (checked against this job's); None while no producer opened it."""
        if self._written is not None:
            return self._written
        try:
            header = read_header(self._storage, self._prefix)
        except NotFound:
            log.info("waiting for the producer to open the journal in %s", self._storage.describe())
            time.sleep(min(timeout_s, 0.5))
            return None
        mine = self._reader_mesh
        w = header.mesh
        if w.cp != mine.cp or (w.cp > 1 and w.cp_mode != mine.cp_mode):
            raise FailedPrecondition(
                f"the journal was written for dp={w.dp} cp={w.cp} ({w.cp_mode}), this job's mesh is dp={mine.dp} cp={mine.cp} "
                f"({mine.cp_mode}): journal delivery remaps DP only (its slices are whole headers and payloads); keep CP"
            )
        if header.job != self._job.fingerprint and w.dp == mine.dp:
            log.warning("the journal holds job fingerprint %s, this job's is %s", header.job, self._job.fingerprint)
        self._written = w
        return w

    def _look_at_end(self, written: DataMesh) -> None:
        end = read_end(self._storage, self._prefix)
        if end is None:
            return
        with self._cond:
            self._end = self._to_logical(end, written)

    def _to_logical(self, end: int, written: DataMesh) -> int:
        if self._identity(written):
            return end
        origin, position = self._anchor if self._anchor is not None else (0, SliceCursor(0))
        return origin + logical_steps(position, end, written=written, reader=self._reader_mesh)

    def _known_length(self) -> int | None:
        """The job's length in logical steps: the end marker's, else the length object's; None
        while neither (or the journal's header) is written."""
        end = read_end(self._storage, self._prefix)
        if end is not None:
            # Each producer's marker is at or past the true end (the least one is exact once the
            # producer of the last step wrote it): the planner's count, when stored, is exact
            # before that; a marker below it says the data ended sooner.
            stored = self._check_length(end)
            return self._logical(end if stored is None else min(stored, end))
        if self._stored_length is None:
            self._stored_length = read_length(self._storage, self._prefix)
        return None if self._stored_length is None else self._logical(self._stored_length)

    def _check_length(self, end: int) -> int | None:
        """The length object's written steps beside end marker `end` (None: none, or one that
        cannot be read, warned once); warns once when the marker lies below it."""
        if self._length_checked:
            return self._stored_length
        self._length_checked = True
        key = length_key(self._prefix)
        try:
            stored = self._stored_length if self._stored_length is not None else read_length(self._storage, self._prefix)
        except FailedPrecondition as exc:
            log.warning("%s; answering the length from the end marker (written step %d)", exc, end)
            return None
        self._stored_length = stored
        if stored is not None and end < stored:
            log.warning(
                "the journal's length object %r says %d steps, its end marker says the data ends at step %d: answering the end marker's",
                key,
                stored,
                end,
            )
        return stored

    def _logical(self, written_step: int) -> int | None:
        """Written step `written_step` in logical steps (`_to_logical`); None while the journal
        has no header."""
        try:
            written = self._written or read_header(self._storage, self._prefix).mesh
        except NotFound:
            return None
        with self._cond:
            return self._to_logical(written_step, written)

    # ---- marks -------------------------------------------------------------------------------

    def _mark_due(self) -> ReaderCursor | None:
        if not self._mark_every:
            return None
        with self._cond:
            cursor = self._released_cursor
            slowest = self._slowest()
            if cursor is None or slowest is None or slowest - self._marked < self._mark_every:
                return None
            self._marked = slowest
            return cursor

    def _record(self, cursor: ReaderCursor) -> None:
        with self._cond:
            reader = self._reader
        if reader is None:
            return
        try:
            reader.record_watermark(cursor, mark=self.mark)
        except Exception as exc:  # noqa: BLE001 - a mark is advisory: the next one tries again
            log.warning("could not record the mark %s at journal step %d: %s", self.mark, cursor.step, exc)
