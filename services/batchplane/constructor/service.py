"""The Constructor gRPC servicer: parses requests, asks the pipeline for batches, streams them.
No logic of its own."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from batchplane.constructor.assemble import TensorLayout
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import Delivery, StepPipeline
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.errors import InvalidArgument
from batchplane.core.rpc import MAX_WAIT_MS, stream_payload
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc

DEFAULT_WAIT_MS = 30_000


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
                tensors=_specs(mb.tensors), num_tokens=mb.num_tokens, loss_tokens=mb.loss_tokens, filler=mb.filler, loss_weight=mb.loss_weight
            )
            for mb in batch.microbatches
        ],
        subbatches=[constructor_pb2.SubBatchSpec(name=s.name, metadata=s.metadata, tensors=_specs(s.tensors)) for s in delivery.subbatches],
    )


class ConstructorServicer(constructor_pb2_grpc.ConstructorServicer):
    def __init__(self, job: common_pb2.JobInfo, pipeline: StepPipeline, metrics: ConstructorMetrics) -> None:
        self._job = job
        self._pipeline = pipeline
        self._metrics = metrics

    def GetInfo(self, request: constructor_pb2.GetInfoRequest, context: grpc.ServicerContext) -> constructor_pb2.GetInfoResponse:
        return constructor_pb2.GetInfoResponse(job=self._job, ranks=self._pipeline.ranks)

    def Report(self, request: common_pb2.ReportRequest, context: grpc.ServicerContext) -> common_pb2.ReportResponse:
        return self._pipeline.report(request)

    def GetLength(self, request: constructor_pb2.GetLengthRequest, context: grpc.ServicerContext) -> constructor_pb2.GetLengthResponse:
        if request.wait_ms < 0:
            raise InvalidArgument(f"wait_ms must be >= 0, got {request.wait_ms}")
        return constructor_pb2.GetLengthResponse(length=self._pipeline.job_length(wait_ms=min(request.wait_ms, MAX_WAIT_MS)))

    def GetBatch(self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext) -> Iterator[constructor_pb2.GetBatchResponse]:
        if request.step < 0:
            raise InvalidArgument(f"step must be >= 0, got {request.step}")
        wait_ms = min(request.wait_ms, MAX_WAIT_MS) if request.wait_ms > 0 else DEFAULT_WAIT_MS
        delivery = self._pipeline.batch(
            request.rank, request.step, timeout_s=wait_ms / 1000, resume=dict(request.resume), restart=request.restart
        )
        if delivery is None:
            yield constructor_pb2.GetBatchResponse(
                header=constructor_pb2.BatchHeader(step=request.step, rank=request.rank, end_of_data=True)
            )
            return
        header = batch_header(delivery, self._pipeline.mesh)
        yield from stream_payload(constructor_pb2.GetBatchResponse, header, memoryview(delivery.batch.payload), delivery.extra)
        self._metrics.batches_sent.inc()
        self._metrics.sent_bytes.inc(delivery.payload_bytes)
