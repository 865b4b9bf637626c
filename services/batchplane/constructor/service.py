"""The Constructor gRPC servicer: parses requests, checks them against the job (`bounds`), asks
the pipeline for batches, and serves them: placed in a shared-memory slab for a client with a
slab session (`slabs`), else streamed in chunks serialized once (`wire.chunk_messages`). No
logic of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from batchplane.constructor.assemble import TensorLayout
from batchplane.constructor.bounds import check_batch_request, check_checkpoint_request, check_released_slabs, check_report
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.build import Delivery
from batchplane.constructor.pipeline import StepPipeline
from batchplane.constructor.slabs import SESSION_LOST, UNKNOWN_SESSION, Placement, SlabServer
from batchplane.core.errors import InvalidArgument
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.rpc import add_servicer, stream_payload, wait_seconds
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc

DEFAULT_WAIT_MS = 30_000
#: MarkCheckpoint's reason with stream delivery.
STREAM_KEEPS_NOTHING = (
    "stream delivery keeps no journal: nothing is retained for a checkpoint (the planner's ledger re-plans the steps it keeps)"
)


def _specs(tensors: tuple[TensorLayout, ...]) -> list[constructor_pb2.TensorSpec]:
    return [constructor_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset) for t in tensors]


def batch_header(delivery: Delivery, mesh: ClientPlaceTree) -> constructor_pb2.BatchHeader:
    batch = delivery.batch
    coords = mesh.coords(delivery.rank)
    return constructor_pb2.BatchHeader(
        step=batch.step,
        dp_rank=coords.dp,
        rank=delivery.rank,
        pp_rank=coords.pp,
        cp_rank=coords.cp,
        tp_rank=coords.tp,
        payload_bytes=delivery.payload_bytes,
        global_loss_tokens=batch.global_loss_tokens,
        microbatches=[
            constructor_pb2.MicrobatchSpec(
                tensors=_specs(mb.tensors),
                num_tokens=mb.num_tokens,
                loss_tokens=mb.loss_tokens,
                filler=mb.filler,
                loss_weight=mb.loss_weight,
            )
            for mb in batch.microbatches
        ],
        subbatches=[constructor_pb2.SubBatchSpec(name=s.name, metadata=s.metadata, tensors=_specs(s.tensors)) for s in delivery.subbatches],
    )


def end_of_data(rank: int, step: int) -> constructor_pb2.GetBatchResponse:
    """The answer for a step past the end of the data."""
    return constructor_pb2.GetBatchResponse(header=constructor_pb2.BatchHeader(step=step, rank=rank, end_of_data=True))


def note_data_wait(metrics: ConstructorMetrics, ranks: Sequence[int], rank: int, wait: constructor_pb2.DataWait) -> None:
    """Counts what rank `rank`'s client measured of its waits for data (`waits.RankWaits`).

    Raises:
        InvalidArgument: a rank not among `ranks` (those served here), or a measure out of bounds.
    """
    if rank not in ranks:
        raise InvalidArgument(f"rank {rank} is not served here: this constructor serves ranks {list(ranks)}")
    metrics.waits.note(rank, client=wait.client, total_s=wait.total_s, waiting_s=wait.waiting_s, now=time.monotonic())


def add_to_server(servicer: ConstructorServicer, server: grpc.Server) -> None:
    """Registers `servicer`; GetBatch's chunks travel serialized already (one copy each)."""
    add_servicer(server, servicer, constructor_pb2.DESCRIPTOR.services_by_name["Constructor"])


class ConstructorServicer(constructor_pb2_grpc.ConstructorServicer):
    def __init__(
        self, job: common_pb2.JobInfo, pipeline: StepPipeline, metrics: ConstructorMetrics, slabs: SlabServer | None = None
    ) -> None:
        self._job = job
        self._pipeline = pipeline
        self._metrics = metrics
        self._slabs = slabs

    def GetInfo(self, request: constructor_pb2.GetInfoRequest, context: grpc.ServicerContext) -> constructor_pb2.GetInfoResponse:
        return constructor_pb2.GetInfoResponse(job=self._job, ranks=self._pipeline.ranks, max_batch_steps=self._pipeline.batch_steps)

    def Report(self, request: common_pb2.ReportRequest, context: grpc.ServicerContext) -> common_pb2.ReportResponse:
        check_report(step=request.step, losses=request.losses, sources=self._job.sources)
        return self._pipeline.report(request)

    def GetLength(self, request: constructor_pb2.GetLengthRequest, context: grpc.ServicerContext) -> constructor_pb2.GetLengthResponse:
        wait_ms = round(wait_seconds(request.wait_ms, context) * 1000)
        return constructor_pb2.GetLengthResponse(length=self._pipeline.job_length(wait_ms=wait_ms))

    def GetBatch(self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        """The batch of `request.step`, then (`max_steps`) those of the following steps as they
        are built: one call's overhead carries several small batches."""
        check_batch_request(
            rank=request.rank,
            step=request.step,
            world=self._pipeline.mesh.world,
            resume=request.resume,
            max_steps=request.max_steps,
            batch_steps=self._pipeline.batch_steps,
        )
        pool = self._slabs.pool if self._slabs is not None else None
        session = pool.session(request.shm_session) if pool is not None and request.shm_session else None
        check_released_slabs(
            request.released_slabs, session=request.shm_session, holds=None if session is None else lambda slab: pool.holds(session, slab)
        )
        if session is not None and request.released_slabs:
            pool.release(session, request.released_slabs)  # before waiting: a retry never sends them again
        if request.HasField("data_wait"):
            note_data_wait(self._metrics, self._pipeline.ranks, request.rank, request.data_wait)
        wait_s = wait_seconds(request.wait_ms, context, default_ms=DEFAULT_WAIT_MS)
        give_up = time.monotonic() + wait_s
        delivery = self._pipeline.batch(request.rank, request.step, timeout_s=wait_s, resume=dict(request.resume), restart=request.restart)
        if delivery is None:
            yield end_of_data(request.rank, request.step)
            return
        yield from self._send(request.shm_session, delivery)
        for step in range(request.step + 1, request.step + request.max_steps):
            delivery = self._pipeline.following(request.rank, step, asked=request.step, timeout_s=max(give_up - time.monotonic(), 0.0))
            if delivery is None:  # the client asks again from this step, unless the data ends there
                end = self._pipeline.end_step()
                if end is not None and step >= end:
                    yield end_of_data(request.rank, step)  # in this call: the data plane may stop before another
                return
            yield from self._send(request.shm_session, delivery)

    def _send(self, shm_session: str, delivery: Delivery) -> Iterator[Any]:
        """One batch's messages: its header, placed in a slab of `shm_session` when it has one,
        else followed by its payload in chunks."""
        header = batch_header(delivery, self._pipeline.mesh)
        header.end_step = self._pipeline.told_end(delivery.rank, delivery.batch.step)  # the client asks for nothing past it
        placement = self._place(shm_session, delivery) if shm_session and delivery.payload_bytes else None
        if placement is not None:
            header.shm.slab, header.shm.offset, header.shm.length = placement.slab, placement.offset, placement.length
            yield constructor_pb2.GetBatchResponse(header=header)
        else:
            yield from stream_payload(
                constructor_pb2.GetBatchResponse, header, memoryview(delivery.batch.payload), delivery.extra, serialized=True
            )
        self._metrics.batches_sent.inc()
        self._metrics.sent_bytes.inc(delivery.payload_bytes)

    def _place(self, session_id: str, delivery: Delivery) -> Placement | None:
        """The slab `delivery` lies in for session `session_id`, its fd sent; None: gRPC (counted)."""
        if self._slabs is None:
            return None
        pool = self._slabs.pool
        session = pool.session(session_id)
        if session is None:
            pool.count_fallback(UNKNOWN_SESSION)
            return None
        placement = pool.place(delivery.batch, delivery.extra, session)
        if isinstance(placement, str):
            return None
        try:
            self._slabs.send_slab(session, placement.slab)
        except OSError:
            pool.release(session, [placement.slab])
            pool.count_fallback(SESSION_LOST)
            return None
        return placement

    def NoteWait(self, request: constructor_pb2.NoteWaitRequest, context: grpc.ServicerContext) -> constructor_pb2.NoteWaitResponse:
        note_data_wait(self._metrics, self._pipeline.ranks, request.rank, request.wait)
        return constructor_pb2.NoteWaitResponse()

    def MarkCheckpoint(
        self, request: constructor_pb2.MarkCheckpointRequest, context: grpc.ServicerContext
    ) -> constructor_pb2.MarkCheckpointResponse:
        """Counts a trainer's checkpoint; stream delivery keeps no journal, so nothing is kept
        (the planner's ledger re-plans any step it still holds)."""
        check_checkpoint_request(rank=request.rank, step=request.step, world=self._pipeline.mesh.world)
        if request.rank not in self._pipeline.ranks:
            raise InvalidArgument(f"rank {request.rank} is not served here: this constructor serves ranks {list(self._pipeline.ranks)}")
        self._metrics.checkpoint_marks.inc()
        return constructor_pb2.MarkCheckpointResponse(accepted=False, reason=STREAM_KEEPS_NOTHING, mark_step=-1)
