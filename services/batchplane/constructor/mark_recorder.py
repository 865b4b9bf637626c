"""Records one pod's checkpoint marks in the journal's manifest: the I/O driver of
`checkpoint_marks`. The journal consumer's servicer tells it each step a rank was handed and
each checkpoint a trainer recorded (MarkCheckpoint); whenever the pod's mark changes it commits
it (`journal.reader.Watermarks`): `ckpt-<pod>` once every holding rank checkpointed, and then
releases the start hold `start-<pod>`; before that `start-<pod>` at the lowest start. The
checkpoint mark goes first, so the pod is never without one while it moves.

A checkpoint is answered only once its mark is committed (a failure raises, and the trainer's
client retries); a start hold that fails to commit is logged and tried again at the next step
handed out. Thread-safe (one lock; the manifest I/O runs under it: marks are rare).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from batchplane.constructor.checkpoint_marks import CheckpointMarks, PodMark, checkpoint_mark, start_mark
from batchplane.core.storage import Storage
from batchplane.journal.commit import ManifestStore
from batchplane.journal.reader import ReaderCursor, Watermarks
from batchplane.journal.slices import SliceCursor

log = logging.getLogger(__name__)


class MarkRecorder:
    """Keeps pod `pod`'s checkpoint mark in the manifest (see the module docstring).

    Args:
        storage: The journal.
        prefix: Its folder.
        pod: The consumer group's id ("pod-I"); the marks are "ckpt-pod-I" and "start-pod-I".
        ranks: The ranks served here.
        holding: The ranks whose checkpoints hold the mark (those that pull batches).
        position: Where logical step s starts in the written steps (the journal's cursor).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        pod: str,
        ranks: Iterable[int],
        holding: Iterable[int],
        position: Callable[[int], SliceCursor],
    ) -> None:
        self.marks = CheckpointMarks(ranks, holding=holding)
        self.checkpoint_id = checkpoint_mark(pod)
        self.start_id = start_mark(pod)
        self._storage = storage
        self._prefix = prefix
        self._position = position
        self._lock = threading.Lock()
        self._recorded: PodMark | None = None
        self._watermarks: Watermarks | None = None
        self._store: ManifestStore | None = None

    def handed(self, rank: int, step: int, *, restart: bool = False) -> None:
        """Rank `rank` was handed logical step `step`; records a changed start hold (a failure
        is logged: the next step handed out tries again)."""
        with self._lock:
            self.marks.handed(rank, step, restart=restart)
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001 - a start hold is retried at the next step
                log.warning("could not record the mark of %s: %s", self.start_id, exc)

    def checkpointed(self, rank: int, step: int) -> PodMark | None:
        """Rank `rank`'s trainer saved a checkpoint resuming at logical step `step`; returns the
        pod's mark once it is committed (None while a holding rank has not started: nothing
        to record yet).

        Raises:
            InvalidArgument, FailedPrecondition: As `CheckpointMarks.checkpointed`; a step the
                journal already reclaimed (CommitRefused).
            Unavailable: The manifest could not be written (retry).
        """
        with self._lock:
            self.marks.checkpointed(rank, step)
            return self._sync()

    def _sync(self) -> PodMark | None:
        mark = self.marks.mark()
        if mark is None or mark == self._recorded:
            return mark
        cursor = ReaderCursor(self._version(), self._position(mark.step))
        watermarks = self._marks()
        if mark.checkpointed:
            watermarks.record(self.checkpoint_id, cursor)
            if self._recorded is None or not self._recorded.checkpointed:
                watermarks.release(self.start_id)
            log.info("%s at step %d (journal step %d)", self.checkpoint_id, mark.step, cursor.step)
        else:
            watermarks.record(self.start_id, cursor)
            log.info("%s holds step %d (journal step %d) until every rank checkpointed", self.start_id, mark.step, cursor.step)
        self._recorded = mark
        return mark

    def _version(self) -> int:
        if self._store is None:
            self._store = ManifestStore(self._storage, prefix=self._prefix, check_writes=False)
        return self._store.latest().version

    def _marks(self) -> Watermarks:
        if self._watermarks is None:
            self._watermarks = Watermarks(self._storage, prefix=self._prefix)
        return self._watermarks
