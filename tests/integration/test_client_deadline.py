"""The client's calls to its constructor end within its `timeout_s`: retries with backoff while
the constructor is unavailable, a per-attempt deadline when it does not answer, then
DataPlaneUnavailable naming the constructor's address and carrying what the constructor said."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from batchplane.client.errors import DataPlaneUnavailable
from batchplane.client.transport import ConstructorConnection
from batchplane.v1 import constructor_pb2, constructor_pb2_grpc

GONE = "batch of step 3 for rank 0 not ready after 0.8 s: FetchSamples(step 3) from loader at 10.0.0.9:5005: gave up"


class Unavailable(constructor_pb2_grpc.ConstructorServicer):
    """Answers every GetBatch with UNAVAILABLE, as a constructor whose loader is gone does."""

    def __init__(self) -> None:
        self.attempts: list[tuple[float, float]] = []  # (wait asked for, time left before the deadline), seconds

    def GetBatch(
        self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext
    ) -> Iterator[constructor_pb2.GetBatchResponse]:
        self.attempts.append((request.wait_ms / 1000, context.time_remaining()))
        context.abort(grpc.StatusCode.UNAVAILABLE, GONE)
        yield from ()


class Silent(constructor_pb2_grpc.ConstructorServicer):
    """Never answers GetBatch until released, as a hung constructor."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def GetBatch(
        self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext
    ) -> Iterator[constructor_pb2.GetBatchResponse]:
        self.release.wait(60)
        yield from ()


def _serve(servicer: constructor_pb2_grpc.ConstructorServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    constructor_pb2_grpc.add_ConstructorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _batch(address: str, *, timeout_s: float) -> tuple[DataPlaneUnavailable, float]:
    connection = ConstructorConnection(address, timeout_s=timeout_s)
    begin = time.monotonic()
    try:
        with pytest.raises(DataPlaneUnavailable) as raised:
            connection.batch(0, 3, pin=False)
    finally:
        connection.close()
    return raised.value, time.monotonic() - begin


def test_an_unavailable_constructor_is_retried_then_named_with_what_it_said() -> None:
    servicer = Unavailable()
    server, address = _serve(servicer)
    try:
        error, elapsed = _batch(address, timeout_s=1.0)
    finally:
        server.stop(0)
    assert elapsed < 10, "a sanity bound, not a speed measurement"
    assert len(servicer.attempts) > 1, "the client did not retry"
    assert f"constructor {address}" in str(error)
    assert GONE in str(error), "the constructor's message did not reach the trainer"
    assert all(wait < left for wait, left in servicer.attempts), "the constructor was asked to wait past the call's deadline"


def test_a_constructor_that_does_not_answer_ends_in_the_deadline() -> None:
    servicer = Silent()
    server, address = _serve(servicer)
    try:
        error, elapsed = _batch(address, timeout_s=1.0)
    finally:
        servicer.release.set()
        server.stop(0)
    assert elapsed < 10, "a sanity bound, not a speed measurement"
    assert f"constructor {address}" in str(error)


def test_nothing_listening_at_the_address_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    error, elapsed = _batch(address, timeout_s=1.0)
    assert elapsed < 10, "a sanity bound, not a speed measurement"
    assert f"constructor {address}" in str(error)
    assert "UNAVAILABLE" in str(error)


class StoppingOnce(constructor_pb2_grpc.ConstructorServicer):
    """The first GetBatch is cut as a constructor that stops gracefully cuts the calls in flight
    (CANCELLED); later ones are answered."""

    def __init__(self) -> None:
        self.attempts = 0

    def GetBatch(
        self, request: constructor_pb2.GetBatchRequest, context: grpc.ServicerContext
    ) -> Iterator[constructor_pb2.GetBatchResponse]:
        self.attempts += 1
        if self.attempts == 1:
            context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
        yield constructor_pb2.GetBatchResponse(header=constructor_pb2.BatchHeader(step=request.step, rank=request.rank, end_of_data=True))


def test_a_call_cut_by_a_constructor_stopping_is_retried() -> None:
    servicer = StoppingOnce()
    server, address = _serve(servicer)
    connection = ConstructorConnection(address, timeout_s=10.0)
    try:
        header, _ = connection.batch(0, 3, pin=False)
    finally:
        connection.close()
        server.stop(0)
    assert servicer.attempts == 2 and header.end_of_data and header.step == 3
