"""The Constructor gRPC servicer: parses requests, asks the pipeline for batches, streams them.
No logic of its own."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from batchplane.constructor.assemble import BuiltBatch
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import StepPipeline
from batchplane.core.errors import InvalidArgument
from batchplane.core.rpc import stream_payload
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc

DEFAULT_WAIT_MS = 30_000


def batch_header(batch: BuiltBatch) -> constructor_pb2.BatchHeader:
    return constructor_pb2.BatchHeader(
        step=batch.step,
        dp_rank=batch.rank,
        payload_bytes=len(batch.payload),
        global_loss_tokens=batch.global_loss_tokens,
        microbatches=[
            constructor_pb2.MicrobatchSpec(
                tensors=[
                    constructor_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset)
                    for t in mb.tensors
                ],
                num_tokens=mb.num_tokens,
                loss_tokens=mb.loss_tokens,
                filler=mb.filler,
            )
            for mb in batch.microbatches
        ],
    )


class ConstructorServicer(constructor_pb2_grpc.ConstructorServicer):
    def __init__(self, job: common_pb2.JobInfo, pipeline: StepPipeline, metrics: ConstructorMetrics) -> None:
        self._job = job
        self._pipeline = pipeline
        self._metrics = metrics

    def GetInfo(self, request: constructor_pb2.GetInfoRequest, context: grpc.ServicerContext) -> constructor_pb2.GetInfoResponse:
        return constructor_pb2.GetInfoResponse(job=self._job, dp_ranks=self._pipeline.ranks)

    def GetBatch(self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext) -> Iterator[constructor_pb2.GetBatchResponse]:
        if request.step < 0:
            raise InvalidArgument(f"step must be >= 0, got {request.step}")
        wait_ms = request.wait_ms if request.wait_ms > 0 else DEFAULT_WAIT_MS
        batch = self._pipeline.batch(request.dp_rank, request.step, timeout_s=wait_ms / 1000)
        if batch is None:
            yield constructor_pb2.GetBatchResponse(
                header=constructor_pb2.BatchHeader(step=request.step, dp_rank=request.dp_rank, end_of_data=True)
            )
            return
        yield from stream_payload(constructor_pb2.GetBatchResponse, batch_header(batch), memoryview(batch.payload))
        self._metrics.batches_sent.inc()
        self._metrics.sent_bytes.inc(len(batch.payload))
