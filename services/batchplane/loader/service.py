"""The Loader gRPC servicer: parses requests, checks them against the job (`bounds`), calls the
streams and the fetch book, builds responses. No logic of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import grpc

from batchplane.core.errors import ResourceExhausted, Unavailable
from batchplane.core.routing import Routing
from batchplane.core.rpc import stream_payload, wait_seconds
from batchplane.loader.bounds import FetchLimits, NotPlanned, check_fetch, check_summary, routing_from
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
    """The routes of a request; None when it names none.

    Raises:
        InvalidArgument: too many routes or replicas, or routes that are not well formed.
    """
    return routing_from([(r.from_window, tuple(r.replicas)) for r in routes])


class LoaderServicer(loader_pb2_grpc.LoaderServicer):
    """Serves summaries and samples of the loader's streams.

    Args:
        streams: The loader's streams by source index.
        book: What constructors fetched.
        metrics: The loader's metrics.
        limits: What the job allows a fetch (`FetchLimits.of(job)`; default: only what the
            streams know: their sources and buffer budget).
    """

    def __init__(
        self, streams: Mapping[int, SourceStream], book: FetchBook, metrics: LoaderMetrics, *, limits: FetchLimits | None = None
    ) -> None:
        self._streams = streams
        self._book = book
        self._metrics = metrics
        self._limits = limits or FetchLimits()
        self._joined = threading.Event()
        self._hook: Callable | None = None
        self._source_names: tuple[str, ...] = ()

    def join(self, *, sources: tuple[str, ...], hook: Callable | None) -> None:
        """Starts serving fetches, for the job the planner described: its source names and
        the strategy's loader_do_plan hook (None for none)."""
        self._source_names, self._hook = sources, hook
        self._joined.set()

    def GetSummary(self, request: loader_pb2.GetSummaryRequest, context: grpc.ServicerContext) -> loader_pb2.GetSummaryResponse:
        check_summary(
            source=request.source,
            served=self._streams,
            from_seq=request.from_seq,
            planned_seq=request.planned_seq,
            max_samples=request.max_samples,
            planned_steps=request.planned_steps,
            delivered_below=request.delivered_below,
        )
        routes = routing_of(request.routes)
        stream = self._streams[request.source]
        if not self._joined.wait(JOIN_WAIT_S):  # a restarted loader first rebuilds its position
            raise Unavailable("this loader has not joined the planner's job yet")
        if request.follow:
            stream.follow(
                from_seq=request.from_seq,
                count=request.max_samples,
                planned_seq=request.planned_seq,
                planned_steps=request.planned_steps,
                delivered_below=request.delivered_below,
                routes=routes,
            )
            return loader_pb2.GetSummaryResponse(start_seq=request.from_seq)
        rows, lengths, reasons, features, end = stream.summary(
            from_seq=request.from_seq,
            planned_seq=request.planned_seq,
            max_samples=min(request.max_samples or MAX_SUMMARY_SAMPLES, MAX_SUMMARY_SAMPLES),
            wait_s=wait_seconds(request.wait_ms, context),
            routes=routes,
            planned_steps=request.planned_steps,
            delivered_below=request.delivered_below,
        )
        return loader_pb2.GetSummaryResponse(
            start_seq=request.from_seq,
            row=encode_array(rows),
            length=encode_array(lengths),
            bad_reason=encode_array(reasons),
            end_of_stream=end,
            features={name: encode_array(values) for name, values in features.items()},
        )

    def FetchSamples(
        self, request: loader_pb2.FetchSamplesRequest, context: grpc.ServicerContext
    ) -> Iterator[loader_pb2.FetchSamplesResponse]:
        sources = decode_array(request.samples.source, field="samples.source", dtype="int32", ndim=1)
        seqs = decode_array(request.samples.seq, field="samples.seq", dtype="int64", ndim=1)
        copies = decode_array(request.copies, field="copies", dtype="int32", ndim=1) if request.HasField("copies") else None
        check_fetch(
            constructor=request.constructor_index,
            step=request.step,
            release_below_step=request.release_below_step,
            sources=sources,
            seqs=seqs,
            copies=copies,
            served=self._streams,
            limits=self._limits,
        )
        self._book.release(constructor=request.constructor_index, below_step=request.release_below_step)
        if not self._joined.wait(JOIN_WAIT_S):
            raise Unavailable("this loader has not joined the planner's job yet")
        try:
            batch = self._book.fetch(constructor=request.constructor_index, step=request.step, sources=sources, seqs=seqs, copies=copies)
        except NotPlanned:
            self._metrics.fetches_refused.labels("not_planned").inc()
            raise
        except ResourceExhausted:
            self._metrics.fetches_refused.labels("too_big").inc()
            raise
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
        yield from stream_payload(loader_pb2.FetchSamplesResponse, header, memoryview(payload), serialized=True)
