"""The Loader gRPC servicer: parses requests, checks them against the job (`bounds`), calls the
streams and the fetch book, builds responses. No logic of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import grpc
import numpy as np
import pyarrow as pa

from batchplane.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from batchplane.core.routing import Routing
from batchplane.core.rpc import stream_payload, wait_seconds
from batchplane.loader.bounds import (
    FetchLimits,
    NotPlanned,
    StepFetch,
    check_distinct,
    check_fetch,
    check_fetch_steps,
    check_summary,
    routing_from,
)
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
        summary = stream.summary(
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
            row=encode_array(summary.rows),
            length=encode_array(summary.lengths),
            bad_reason=encode_array(summary.reasons),
            end_of_stream=summary.end_of_stream,
            features={name: encode_array(values) for name, values in summary.features.items()},
            digest=encode_array(summary.digests),
        )

    def FetchSamples(
        self, request: loader_pb2.FetchSamplesRequest, context: grpc.ServicerContext
    ) -> Iterator[loader_pb2.FetchSamplesResponse]:
        constructor = request.constructor_index
        check_fetch_steps(request.step, [f.step for f in request.following], limits=self._limits)  # before decoding them
        first = self._wanted(request, constructor=constructor, release_below_step=request.release_below_step)
        following = [
            self._wanted(f, constructor=constructor, release_below_step=request.release_below_step, field=f"following[{i}].")
            for i, f in enumerate(request.following)
        ]
        if following:
            every = [first, *following]
            check_distinct(np.concatenate([w.sources for w in every]), np.concatenate([w.seqs for w in every]))
        self._book.release(constructor=constructor, below_step=request.release_below_step)
        if not self._joined.wait(JOIN_WAIT_S):
            raise Unavailable("this loader has not joined the planner's job yet")
        try:
            batches = [self._fetch(constructor, first)]
        except NotPlanned:
            self._metrics.fetches_refused.labels("not_planned").inc()
            raise
        except ResourceExhausted:
            self._metrics.fetches_refused.labels("too_big").inc()
            raise
        budget = self._book.max_payload_bytes - batches[0].nbytes
        for wanted in following:  # a prefix of them: the rest come in a later call
            try:
                batch = self._fetch(constructor, wanted, max_bytes=budget)
            except ResourceExhausted:
                self._metrics.following_cut.labels("too_big").inc()
                break
            except Unavailable:
                self._metrics.following_cut.labels("not_ready").inc()
                break
            budget -= batch.nbytes
            batches.append(batch)
        payload = encode_payload(batches)
        for wanted in [first, *following][: len(batches)]:
            for source in set(wanted.sources.tolist()):
                self._metrics.samples_sent.labels(self._streams[source].name).inc(int((wanted.sources == source).sum()))
        self._metrics.bytes_sent.inc(payload.size)
        self._metrics.fetch_steps.observe(len(batches))
        header = loader_pb2.FetchHeader(
            num_samples=sum(b.num_rows for b in batches), payload_bytes=payload.size, following_served=len(batches) - 1
        )
        yield from stream_payload(loader_pb2.FetchSamplesResponse, header, memoryview(payload), serialized=True)

    def _wanted(
        self,
        request: loader_pb2.FetchSamplesRequest | loader_pb2.StepSamples,
        *,
        constructor: int,
        release_below_step: int,
        field: str = "",
    ) -> StepFetch:
        """One step's samples of a FetchSamples request, decoded and checked (`check_fetch`).

        Raises:
            InvalidArgument: a field outside what the job has (named, after `field`).
        """
        try:
            sources = decode_array(request.samples.source, field="samples.source", dtype="int32", ndim=1)
            seqs = decode_array(request.samples.seq, field="samples.seq", dtype="int64", ndim=1)
            copies = decode_array(request.copies, field="copies", dtype="int32", ndim=1) if request.HasField("copies") else None
            check_fetch(
                constructor=constructor,
                step=request.step,
                release_below_step=release_below_step,
                sources=sources,
                seqs=seqs,
                copies=copies,
                served=self._streams,
                limits=self._limits,
            )
        except InvalidArgument as exc:
            if not field:
                raise
            raise InvalidArgument(f"{field}{exc}") from None
        return StepFetch(request.step, sources, seqs, copies)

    def _fetch(self, constructor: int, wanted: StepFetch, *, max_bytes: int | None = None) -> pa.RecordBatch:
        """One step's samples from the fetch book, through the strategy's loader hook."""
        batch = self._book.fetch(
            constructor=constructor, step=wanted.step, sources=wanted.sources, seqs=wanted.seqs, copies=wanted.copies, max_bytes=max_bytes
        )
        if self._hook is not None and batch.num_rows:
            try:
                batch = apply_loader_hook(self._hook, batch, LoaderPlan(wanted.step, constructor, self._source_names))
            except HookError:
                self._metrics.hook_failures.inc()
                log.exception("fetch of step %d by constructor %d refused", wanted.step, constructor)
                raise
        return batch
