"""The Loader gRPC servicer: parses requests, calls the streams and the fetch book, builds
responses. No logic of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import grpc

from batchplane.core.routing import Route, Routing
from batchplane.core.errors import InvalidArgument, Unavailable
from batchplane.core.rpc import stream_payload
from batchplane.loader.fetch import FetchBook, encode_payload
from batchplane.loader.hooks import HookError, LoaderPlan, apply_loader_hook
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.stream import SourceStream
from batchplane.v1 import common_pb2, loader_pb2, loader_pb2_grpc
from batchplane.wire import decode_array, encode_array

MAX_SUMMARY_SAMPLES = 65536
JOIN_WAIT_S = 30.0

log = logging.getLogger(__name__)


def routing_of(routes: Sequence[common_pb2.Route]) -> Routing | None:
    """The routes of a request; None when it names none."""
    return Routing(tuple(Route(r.from_window, tuple(r.replicas)) for r in routes)) if routes else None


class LoaderServicer(loader_pb2_grpc.LoaderServicer):
    """Serves summaries and samples of the loader's streams."""

    def __init__(self, streams: Mapping[int, SourceStream], book: FetchBook, metrics: LoaderMetrics) -> None:
        self._streams = streams
        self._book = book
        self._metrics = metrics
        self._joined = threading.Event()
        self._hook: Callable | None = None
        self._source_names: tuple[str, ...] = ()

    def join(self, *, sources: tuple[str, ...], hook: Callable | None) -> None:
        """Starts serving fetches, for the job the planner described: its source names and
        the strategy's loader_do_plan hook (None for none)."""
        self._source_names, self._hook = sources, hook
        self._joined.set()

    def GetSummary(self, request: loader_pb2.GetSummaryRequest, context: grpc.ServicerContext) -> loader_pb2.GetSummaryResponse:
        stream = self._streams.get(request.source)
        if stream is None:
            raise InvalidArgument(f"source: this loader serves sources {sorted(self._streams)}, not {request.source}")
        if request.from_seq < 0 or request.planned_seq < 0 or request.max_samples < 0:
            raise InvalidArgument("from_seq, planned_seq and max_samples must be >= 0")
        if not self._joined.wait(JOIN_WAIT_S):  # a restarted loader first rebuilds its position
            raise Unavailable("this loader has not joined the planner's job yet")
        if request.follow:
            stream.follow(
                from_seq=request.from_seq, count=request.max_samples, planned_seq=request.planned_seq,
                planned_steps=request.planned_steps, delivered_below=request.delivered_below, routes=routing_of(request.routes),
            )
            return loader_pb2.GetSummaryResponse(start_seq=request.from_seq)
        rows, lengths, features, end = stream.summary(
            from_seq=request.from_seq,
            planned_seq=request.planned_seq,
            max_samples=min(request.max_samples or MAX_SUMMARY_SAMPLES, MAX_SUMMARY_SAMPLES),
            wait_s=max(request.wait_ms, 0) / 1000,
            routes=routing_of(request.routes),
            planned_steps=request.planned_steps,
            delivered_below=request.delivered_below,
        )
        return loader_pb2.GetSummaryResponse(
            start_seq=request.from_seq,
            row=encode_array(rows),
            length=encode_array(lengths),
            end_of_stream=end,
            features={name: encode_array(values) for name, values in features.items()},
        )

    def FetchSamples(self, request: loader_pb2.FetchSamplesRequest, context: grpc.ServicerContext) -> Iterator[loader_pb2.FetchSamplesResponse]:
        sources = decode_array(request.samples.source, field="samples.source", dtype="int32", ndim=1)
        seqs = decode_array(request.samples.seq, field="samples.seq", dtype="int64", ndim=1)
        self._book.release(constructor=request.constructor_index, below_step=request.release_below_step)
        copies = decode_array(request.copies, field="copies", dtype="int32", ndim=1) if request.HasField("copies") else None
        if not self._joined.wait(JOIN_WAIT_S):
            raise Unavailable("this loader has not joined the planner's job yet")
        batch = self._book.fetch(constructor=request.constructor_index, step=request.step, sources=sources, seqs=seqs, copies=copies)
        if self._hook is not None and batch.num_rows:
            try:
                batch = apply_loader_hook(self._hook, batch, LoaderPlan(request.step, request.constructor_index, self._source_names))
            except HookError:
                self._metrics.hook_failures.inc()
                log.exception("fetch of step %d by constructor %d refused", request.step, request.constructor_index)
                raise
        payload = encode_payload(batch)
        for source in set(sources.tolist()):
            self._metrics.samples_sent.labels(self._streams[source].name).inc(int((sources == source).sum()))
        self._metrics.bytes_sent.inc(payload.size)
        header = loader_pb2.FetchHeader(num_samples=batch.num_rows, payload_bytes=payload.size)
        yield from stream_payload(loader_pb2.FetchSamplesResponse, header, memoryview(payload))
