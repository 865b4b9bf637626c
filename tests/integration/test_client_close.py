"""`Client.close` ends the client deterministically, against a constructor on 127.0.0.1 whose
GetBatch never answers (a step no producer committed): the call in flight on the fetch thread
is cancelled, that thread has ended when close returns, the trainer's iterator raises
DataPlaneUnavailable naming the close, and nothing is retried or reconnected afterwards. A
channel closed under a live call, or a fetch thread still inside gRPC at interpreter exit, is
what can abort a trainer process at exit in gRPC's C++ core."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from batchplane.client import Client
from batchplane.client.errors import DataPlaneUnavailable
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc

pytestmark = pytest.mark.integration


class _Stalled(constructor_pb2_grpc.ConstructorServicer):
    """A constructor of a one-rank job whose GetBatch waits until the caller goes away."""

    def __init__(self) -> None:
        self.calls = 0
        self.asked = threading.Event()
        self.ended = threading.Event()

    def GetInfo(self, request, context):
        job = common_pb2.JobInfo(job_id="stalled", mesh=common_pb2.Mesh(dp=1, cp=1, tp=1, pp=1))
        return constructor_pb2.GetInfoResponse(job=job, ranks=[0])

    def GetBatch(self, request, context):
        self.calls += 1
        self.asked.set()
        while context.is_active():
            threading.Event().wait(0.02)
        self.ended.set()
        return iter(())


@pytest.fixture
def stalled():
    servicer = _Stalled()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    constructor_pb2_grpc.add_ConstructorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("batchplane-fetch") and t.is_alive()]


def test_close_cancels_the_call_in_flight_and_waits_for_the_fetch_thread(stalled) -> None:
    servicer, address = stalled
    before = set(_fetch_threads())
    client = Client(address, rank=0, device=None, timeout_s=120)
    failure: list[BaseException] = []

    def train() -> None:
        try:
            next(iter(client))
        except BaseException as exc:  # noqa: BLE001 - checked below
            failure.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    assert servicer.asked.wait(30), "the client never asked for step 0"
    client.close()
    assert not set(_fetch_threads()) - before, "a fetch thread outlived close()"
    assert servicer.ended.wait(10), "the constructor never saw the call end"
    trainer.join(timeout=10)
    assert not trainer.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], DataPlaneUnavailable) and "closed" in str(failure[0]), failure
    assert servicer.calls == 1  # nothing retried after the close
    client.close()  # idempotent
