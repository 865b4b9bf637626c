"""The Constructor service of a journal consumer (`consume`): what each call answers, from the
journal the consumer reads.

- GetInfo: the JobInfo the producer stored (`info.pb`), its mesh made this job's mesh.
- GetBatch: the logical step, read once for all the pod's ranks into a small step buffer
  (`JournalConsumer`) and dropped once every pulling rank asked for a later step; decoded with
  `journal_slices` and streamed over gRPC exactly as `service.ConstructorServicer` streams it, so
  a client sees byte-identical batches to streaming delivery. Past the end marker, the
  end-of-data header. No shared memory in v1: the gRPC stream only.
- GetLength: in logical steps (mapped as the end marker is, see `consume`): from the length object a
  producer stored from the planner's count (`length.json`), else from the end marker once
  written, else unknown; waits up to the request's `wait_ms` for either. Each producer's end
  marker is at or past the true end (exact once the producer of the last step wrote its own),
  so a marker above the stored count is no contradiction; one below it wins (the data ended
  sooner: a warning is logged once). A length object that cannot be read is refused
  (FAILED_PRECONDITION) while no end marker is written. An infinite job (epochs: infinite)
  answers so at once.
- MarkCheckpoint: the pod's checkpoint mark (see `consume`'s Marks).
- Report: refused (FAILED_PRECONDITION): a producer runs ahead of training, so training losses
  cannot steer it (configuration refuses adaptive mixtures with journal delivery).
- NoteWait, and the measure each GetBatch carries: the ranks' waits for data, as for stream
  delivery (`service.note_data_wait`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from batchplane.constructor.bounds import check_batch_request, check_checkpoint_request
from batchplane.constructor.consume import POLL_S, JournalConsumer
from batchplane.constructor.mark_recorder import MarkRecorder
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.produce import load_info
from batchplane.constructor.service import DEFAULT_WAIT_MS, end_of_data, note_data_wait
from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.rpc import add_servicer, stream_payload, wait_seconds
from batchplane.core.storage import Storage
from batchplane.journal.slices import SliceCursor
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc

log = logging.getLogger(__name__)


class JournalConstructorServicer(constructor_pb2_grpc.ConstructorServicer):
    """The Constructor service of a consumer (see the module docstring)."""

    def __init__(
        self,
        job: JobSettings,
        consumer: JournalConsumer,
        metrics: ConstructorMetrics,
        *,
        storage: Storage,
        prefix: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._job = job
        self._consumer = consumer
        self._metrics = metrics
        self._storage = storage
        self._prefix = prefix
        self._clock = clock
        self._info: common_pb2.JobInfo | None = None

    def info(self, timeout_s: float) -> common_pb2.JobInfo:
        """The job's info from the journal, its mesh this job's, waiting up to `timeout_s`.

        Raises:
            Unavailable: no producer stored it in time.
        """
        if self._info is not None:
            return self._info
        deadline = self._clock() + timeout_s
        said = False
        while True:
            info = load_info(self._storage, prefix=self._prefix)
            if info is not None:
                break
            if not said:
                said = True
                log.info("waiting for the producer to store the job's info (info.pb) in the journal at %s", self._storage.describe())
            if self._clock() >= deadline:
                raise Unavailable(f"no producer has stored the job's info in the journal at {self._storage.describe()} yet")
            time.sleep(POLL_S)
        m = self._job.mesh
        info.mesh.dp, info.mesh.cp, info.mesh.tp, info.mesh.pp = m.dp, m.cp, m.tp, m.pp
        info.mesh.order, info.mesh.cp_slicing = m.order, self._job.constructors.cp_slicing
        self._info = info
        return info

    def GetInfo(self, request: constructor_pb2.GetInfoRequest, context: grpc.ServicerContext) -> constructor_pb2.GetInfoResponse:
        remaining = context.time_remaining()
        timeout_s = DEFAULT_WAIT_MS / 1000 if remaining is None else max(min(remaining - 0.5, 3600.0), 0.0)
        return constructor_pb2.GetInfoResponse(job=self.info(timeout_s), ranks=self._consumer.ranks)

    def Report(self, request: common_pb2.ReportRequest, context: grpc.ServicerContext) -> common_pb2.ReportResponse:
        raise FailedPrecondition(
            "journal delivery takes no training reports: the producer runs ahead of training, so losses cannot steer "
            "the mixture (use stream delivery for an adaptive mixture)"
        )

    def GetLength(self, request: constructor_pb2.GetLengthRequest, context: grpc.ServicerContext) -> constructor_pb2.GetLengthResponse:
        return constructor_pb2.GetLengthResponse(length=self._consumer.length(timeout_s=wait_seconds(request.wait_ms, context)))

    def GetBatch(self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        check_batch_request(
            rank=request.rank, step=request.step, world=self._consumer.mesh.world, resume=request.resume, max_steps=request.max_steps
        )  # one step per call here (GetInfoResponse.max_batch_steps 0)
        if request.HasField("data_wait"):
            note_data_wait(self._metrics, self._consumer.ranks, request.rank, request.data_wait)
        got = self._consumer.batch(
            request.rank,
            request.step,
            timeout_s=wait_seconds(request.wait_ms, context, default_ms=DEFAULT_WAIT_MS),
            restart=request.restart,
            cursor=_requested_cursor(request),
        )
        self._mark_recorder.handed(request.rank, request.step, restart=request.restart)
        if got is None:
            yield end_of_data(request.rank, request.step)
            return
        header, payload = got
        yield from stream_payload(constructor_pb2.GetBatchResponse, header, payload, serialized=True)
        self._metrics.batches_sent.inc()
        self._metrics.sent_bytes.inc(header.payload_bytes)

    def NoteWait(self, request: constructor_pb2.NoteWaitRequest, context: grpc.ServicerContext) -> constructor_pb2.NoteWaitResponse:
        note_data_wait(self._metrics, self._consumer.ranks, request.rank, request.wait)
        return constructor_pb2.NoteWaitResponse()

    # ---- checkpoint marks (`checkpoint_marks`, `mark_recorder`) ------------------------------

    def MarkCheckpoint(
        self, request: constructor_pb2.MarkCheckpointRequest, context: grpc.ServicerContext
    ) -> constructor_pb2.MarkCheckpointResponse:
        """Records rank `request.rank`'s checkpoint at `request.step` in the pod's checkpoint mark
        (`mark_recorder.MarkRecorder`), answering once the mark is committed."""
        check_checkpoint_request(rank=request.rank, step=request.step, world=self._consumer.mesh.world)
        self._metrics.checkpoint_marks.inc()
        mark = self._mark_recorder.checkpointed(request.rank, request.step)
        if mark is None:
            return constructor_pb2.MarkCheckpointResponse(accepted=True, mark_step=-1)
        return constructor_pb2.MarkCheckpointResponse(accepted=True, mark_step=mark.step, checkpointed=mark.checkpointed)

    @functools.cached_property
    def _mark_recorder(self) -> MarkRecorder:
        consumer = self._consumer
        return MarkRecorder(
            self._storage,
            prefix=self._prefix,
            pod=consumer.mark,
            ranks=consumer.ranks,
            holding=consumer._pulling,
            position=self._journal_position,
        )

    def _journal_position(self, step: int) -> SliceCursor:
        """Where logical step `step` starts in the written steps (same DP: step itself)."""
        written = self._consumer._written
        return SliceCursor(step) if written is None else self._consumer._cursor(step, written)


def _requested_cursor(request: constructor_pb2.GetBatchRequest) -> SliceCursor | None:
    """The request's journal cursor; None when it has none.

    Raises:
        InvalidArgument: a negative field (`slices.TopologyError` names it).
    """
    if not request.HasField("journal_cursor"):
        return None
    cursor = request.journal_cursor
    if cursor.manifest_version < 0:
        raise InvalidArgument(f"journal_cursor.manifest_version: must be >= 0, got {cursor.manifest_version}")
    return SliceCursor(cursor.step, cursor.offset)


def add_consumer_to_server(servicer: JournalConstructorServicer, server: grpc.Server) -> None:
    """Registers `servicer` as the Constructor service (GetBatch's chunks serialized once)."""
    add_servicer(server, servicer, constructor_pb2.DESCRIPTOR.services_by_name["Constructor"])
