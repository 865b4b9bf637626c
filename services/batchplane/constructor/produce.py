"""The producer of journal delivery (`batch.delivery: journal`, `--produce`): a constructor that
builds every rank's batch of every step with the normal `StepPipeline` and, instead of serving
trainers, commits each whole step to the journal (`batchplane.journal.writer.JournalWriter`) as
one TGB whose (dp, cp) slices `journal_slices` lays out.

The loop, on a thread of its own: `writer.resume()` says the step after the last committed one;
for each step, wait for room (`journal.max_lag_steps` past the slowest pod's mark), take every
rank's delivery from the pipeline (all ranks take, so the pipeline moves on; the first step
after a start or a restart asks with restart=True: the planner serves or re-plans it), write
the step; at the end of data, commit what is pending and write the end marker (`end/<producer id>.json`).
Before its first write it stores the JobInfo the planner gave at registration as `info.pb`
(put-if-absent; a different one is refused), which consumers serve as GetInfo. Before each step,
until it is settled, it asks the planner for the job's length (GetJob, as the streaming
constructor's GetLength does: unknown until the loaders registered) and once it is finite stores
it as `length.json` (`writer.claim_length`, put-if-absent), which consumers serve as GetLength
before the end marker is written; a journal holding another length keeps it (an error is
logged), an infinite job stores none. Failing to learn or store it only logs: the next step
tries again.

A failure of the storage or of the pipeline restarts the loop from `writer.resume()` (a new
fencing epoch; what was not committed is built again); a producer fenced by a newer process of
its id stops. Decides nothing itself: the pipeline, the writer and its policies do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from batchplane.constructor.checkpoint_marks import counts_for_lag
from batchplane.constructor.journal_slices import encode_step, slice_meta
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.build import Delivery
from batchplane.constructor.reclaim_loop import ReclaimLoop
from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition, NotFound, Unavailable
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.storage import Storage
from batchplane.journal.manifest import Fenced
from batchplane.journal.retention import RetentionPolicy
from batchplane.journal.slices import DataMesh
from batchplane.journal.writer import JournalMismatch, JournalWriter, WriterStats, claim_length, length_key
from batchplane.v1 import common_pb2

log = logging.getLogger(__name__)

#: The object holding the JobInfo the planner gave the producer, under the journal's prefix.
INFO_KEY = "info.pb"


def producer_id(index: int) -> str:
    """Producer `index`'s id in the journal (`journal.writer`'s id rules): "p<index>"."""
    return f"p{index}"


#: How long one ask of the pipeline waits before asking again (and looking at `stop`), in seconds.
TAKE_WAIT_S = 5.0
#: Pause before the loop starts again after a failure, in seconds.
RETRY_PAUSE_S = 1.0


class BatchSource(Protocol):
    """What the producer needs of a `StepPipeline` (a fake in tests)."""

    ranks: tuple[int, ...]
    mesh: ClientPlaceTree

    def batch(
        self, rank: int, step: int, *, timeout_s: float, resume: dict[str, str] | None = None, restart: bool = False
    ) -> Delivery | None: ...

    def job_length(self, *, wait_ms: int) -> common_pb2.JobLength: ...


def data_mesh(job: JobSettings) -> DataMesh:
    """The job's data mesh, as the journal records it."""
    return DataMesh(dp=job.mesh.dp, cp=job.mesh.cp, cp_mode=job.constructors.cp_slicing)


def store_info(storage: Storage, info: common_pb2.JobInfo, *, prefix: str = "") -> None:
    """Stores the job's info as `info.pb`, or checks the one there is the same job's.

    Raises:
        FailedPrecondition: The journal holds another JobInfo.
    """
    key = f"{prefix}{INFO_KEY}"
    if storage.put_if_absent(key, info.SerializeToString(deterministic=True)):
        return
    found = common_pb2.JobInfo()
    found.ParseFromString(storage.get(key))
    if found != info:
        raise FailedPrecondition(
            f"the journal at {prefix or '/'} in {storage.describe()} holds the info of job {found.job_id!r} "
            f"(fingerprint {found.fingerprint}), the planner describes job {info.job_id!r} (fingerprint {info.fingerprint}): "
            "a journal holds one job; use another journal.location"
        )


def load_info(storage: Storage, *, prefix: str = "") -> common_pb2.JobInfo | None:
    """The job's info a producer stored, or None while none has.

    Raises:
        FailedPrecondition: `info.pb` is not a JobInfo.
    """
    key = f"{prefix}{INFO_KEY}"
    try:
        data = storage.get(key)
    except NotFound:
        return None
    info = common_pb2.JobInfo()
    try:
        info.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or worse on hostile bytes
        raise FailedPrecondition(f"{key!r} in {storage.describe()} is not a JobInfo ({exc})") from None
    return info


class JournalProducer:
    """Commits every step the pipeline builds to the journal (see the module docstring).

    Args:
        job: The job's settings.
        pipeline: Builds every rank's batches (`StepPipeline` over all ranks).
        storage: The journal (`journal.location.open_journal_storage`).
        info: The JobInfo the planner returned at registration.
        metrics: The constructor's metrics (the journal_* ones are fed here).
        make_writer: Builds the writer (tests inject clocks); None: `JournalWriter` from the job.
        index: Which producer it is: it builds the steps s with s % journal.producers == index.
    """

    def __init__(
        self,
        job: JobSettings,
        *,
        pipeline: BatchSource,
        storage: Storage,
        info: common_pb2.JobInfo,
        metrics: ConstructorMetrics,
        make_writer: Callable[[threading.Event], JournalWriter] | None = None,
        index: int = 0,
    ) -> None:
        self._job = job
        self._index = index
        self._id = producer_id(index)
        self._stride = job.build_stride
        self._pipeline = pipeline
        self._storage = storage
        self._info = info
        self._metrics = metrics
        self._stop = threading.Event()
        self._make_writer = make_writer or self._writer
        self._counted = WriterStats()
        self._thread: threading.Thread | None = None
        #: The step the data ends at, once written (None before).
        self.end_step: int | None = None
        #: Set when the loop ended for good (end of data, fenced, or stopped).
        self.done = threading.Event()
        #: The reclaimer's loop, once started (`journal.reclaim`, producer 0).
        self.reclaim_loop: ReclaimLoop | None = None
        #: The job's length is in the journal, or will never be stored by this producer
        #: (infinite, refused, or the journal holds another one).
        self.length_settled = False

    def start(self) -> JournalProducer:
        """Starts the loop on a thread of its own, and the reclaimer's (`journal.reclaim`, on
        producer 0 only) on another."""
        self._thread = threading.Thread(target=self.run, name="produce", daemon=True)
        self._thread.start()
        if self._job.journal.reclaim and self._index == 0:
            self.reclaim_loop = ReclaimLoop(self._storage, min_age_s=self._job.journal.min_age_s).start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the loop (what is pending stays uncommitted: a restart builds it again) and the
        reclaimer's."""
        self._stop.set()
        if self.reclaim_loop is not None:
            self.reclaim_loop.stop(timeout_s=timeout_s)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def run(self) -> None:
        """The loop: runs until the end of data, a fence, or `stop`; failures start it again."""
        try:
            while not self._stop.is_set():
                try:
                    if self._produce():
                        return
                except Fenced as exc:
                    log.error("producer %s is fenced (a newer process of its id runs): stopping: %s", self._id, exc)
                    return
                except JournalMismatch as exc:  # e.g. trainers resumed at another DP over this journal: they read it remapped
                    log.error("producer %s cannot write this journal: %s; producing nothing", self._id, exc)
                    return
                except Exception as exc:  # noqa: BLE001 - storage, planner or loaders: resume from the journal
                    if self._stop.is_set():
                        return
                    log.warning(
                        "producing failed (%s); resuming after the last committed step", exc, exc_info=not isinstance(exc, Unavailable)
                    )
                    self._stop.wait(RETRY_PAUSE_S)
        finally:
            self.done.set()

    def _writer(self, stop: threading.Event) -> JournalWriter:
        return JournalWriter(
            self._storage,
            producer_id=self._id,
            mesh=data_mesh(self._job),
            policy=self._job.journal.policy,
            job=self._job.fingerprint,
            retention=RetentionPolicy(max_lag=self._job.journal.max_lag_steps),
            stop=stop,
            lag_marks=counts_for_lag,
        )

    def _produce(self) -> bool:
        """One run of the loop from `writer.resume()`; True at the end of data, False when stopped."""
        writer = self._make_writer(self._stop)
        self._counted = WriterStats()
        step = writer.resume()
        step += (self._index - step) % self._stride  # its own steps only: s % producers == index
        store_info(self._storage, self._info, prefix=writer.prefix)
        log.info("producing from step %d (epoch %d)", step, writer.epoch)
        restart = True
        while not self._stop.is_set():
            if not self.length_settled:
                self._store_length(writer.prefix)
            if not writer.wait_for_room(step):
                break
            self._count(writer.stats)
            deliveries = self._take(step, restart=restart)
            if deliveries is None:
                return False
            restart = False
            if any(d is None for d in deliveries.values()):
                writer.finish(step)
                self._count(writer.stats)
                self.end_step = step
                return True
            delivered = {r: d for r, d in deliveries.items() if d is not None}
            writer.write(step, encode_step(delivered, self._pipeline.mesh), slice_meta(delivered, self._pipeline.mesh))
            self._count(writer.stats)
            step += self._stride
        return False

    def _store_length(self, prefix: str) -> None:
        """Stores the job's length in the journal once the planner knows it is finite (see the
        module docstring); sets `length_settled` when nothing is left to do. Never raises: a
        failure is logged and the next step asks again."""
        try:
            length = self._pipeline.job_length(wait_ms=0)
        except Exception as exc:  # noqa: BLE001 - the planner is away: ask again next step
            log.warning("could not ask the planner for the job's length (%s); asking again before the next step", exc)
            return
        if length.infinite:
            self.length_settled = True
            return
        if length.unknown:
            log.debug("the job's length is not known yet: %s", length.unknown)
            return
        steps = length.num_steps
        if steps < 0:
            log.error("the planner says the job has %d steps: not storing a length in the journal", steps)
            self.length_settled = True
            return
        key = length_key(prefix)
        try:
            found = claim_length(self._storage, prefix, num_steps=steps)
        except FailedPrecondition as exc:  # a length object it cannot read: left as it is
            log.error("the journal holds a length object producer %s cannot read (%s); not overwriting it", self._id, exc)
            self.length_settled = True
            return
        except Exception as exc:  # noqa: BLE001 - the storage failed: try again next step
            log.warning("could not store the job's length (%d steps) as %r (%s); trying again", steps, key, exc)
            return
        self.length_settled = True
        if found != steps:
            log.error(
                "the journal's length object %r in %s says %d steps, the planner says %d: a journal's length never changes; "
                "keeping %d (is this journal another job's?)",
                key,
                self._storage.describe(),
                found,
                steps,
                found,
            )
        else:
            log.info("the job's length (%d steps) is in the journal as %r", steps, key)

    def _take(self, step: int, *, restart: bool) -> dict[int, Delivery | None] | None:
        """Every rank's delivery of `step` (None for a rank past the end of data); None if stopped.

        Every rank asks for `step` before any waits for it: the pipeline builds only so far
        ahead of its slowest rank, and a rank that has not asked yet counts as being at the
        pipeline's start. Waiting on rank 0 before rank 1 had asked deadlocked a restart whose
        start (the planner's oldest undelivered step) lay more than the prefetch depth behind
        the journal's next step: rank 0's step was never built, and rank 1 never asked."""
        out: dict[int, Delivery | None] = {}
        waiting = list(self._pipeline.ranks)
        wait_s = 0.0  # the first round only asks
        while waiting:
            for rank in list(waiting):
                if self._stop.is_set():
                    return None
                try:
                    out[rank] = self._pipeline.batch(rank, step, timeout_s=wait_s, restart=restart)
                    waiting.remove(rank)
                except Unavailable as exc:
                    if wait_s:
                        log.info("waiting for step %d of rank %d: %s", step, rank, exc)
            wait_s = TAKE_WAIT_S
        return out

    def _count(self, stats: WriterStats) -> None:
        """Adds what the writer did since the last call to the metrics."""
        seen = self._counted
        self._metrics.journal_steps_written.inc(stats.steps_written - seen.steps_written)
        self._metrics.journal_written_bytes.inc(stats.bytes_written - seen.bytes_written)
        self._metrics.journal_commits.inc(stats.commits - seen.commits)
        self._metrics.journal_conflicts.inc(stats.conflicts - seen.conflicts)
        self._metrics.journal_backpressure.inc(max(stats.backpressure_s - seen.backpressure_s, 0.0))
        self._counted = WriterStats(**vars(stats))
