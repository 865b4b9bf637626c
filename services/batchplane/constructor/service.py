"""The Constructor gRPC servicer: parses requests, checks them against the job (`bounds`), asks
the pipeline for batches, streams them. No logic of its own."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from batchplane.constructor.assemble import TensorLayout
from batchplane.constructor.bounds import check_batch_request, check_report
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import Delivery, StepPipeline
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.rpc import stream_payload, wait_seconds
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
        check_report(step=request.step, losses=request.losses, sources=self._job.sources)
        return self._pipeline.report(request)

    def GetLength(self, request: constructor_pb2.GetLengthRequest, context: grpc.ServicerContext) -> constructor_pb2.GetLengthResponse:
        wait_ms = round(wait_seconds(request.wait_ms, context) * 1000)
        return constructor_pb2.GetLengthResponse(length=self._pipeline.job_length(wait_ms=wait_ms))

    def GetBatch(self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext) -> Iterator[constructor_pb2.GetBatchResponse]:
        check_batch_request(rank=request.rank, step=request.step, world=self._pipeline.mesh.world, resume=request.resume)
        delivery = self._pipeline.batch(
            request.rank, request.step, timeout_s=wait_seconds(request.wait_ms, context, default_ms=DEFAULT_WAIT_MS),
            resume=dict(request.resume), restart=request.restart,
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
