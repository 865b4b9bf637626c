"""The write serialization of the S3 endpoint the tests and benchmarks run
(`batchplane.bench.moto_server.serialized_writes`): moto checks a conditional write's condition
and then writes, so without it two racing writes of one key could both pass; S3 decides each
atomically."""

from __future__ import annotations

import threading
import time

from batchplane.bench.moto_server import WRITES, serialized_writes


def _overlap(method: str, threads: int = 6, *, meet: bool = False) -> int:
    """The most requests of `method` inside the application at once, `threads` racing; each
    stays inside 20 ms, or with `meet` until all are inside together (at most 10 s)."""
    inside, most, lock = 0, 0, threading.Lock()
    together = threading.Barrier(threads, timeout=10)

    def app(environ: dict, start_response) -> list[bytes]:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        if meet:
            together.wait()  # BrokenBarrierError unless they are all inside at once
        else:
            time.sleep(0.02)  # the time a write takes: room for another to come in
        with lock:
            inside -= 1
        return [b""]

    serve = serialized_writes(app)
    barrier = threading.Barrier(threads)

    def request() -> None:
        barrier.wait()
        serve({"REQUEST_METHOD": method}, lambda *a: None)

    workers = [threading.Thread(target=request) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return most


def test_writes_run_one_at_a_time_and_reads_together() -> None:
    assert WRITES == {"PUT", "POST", "DELETE"}
    for method in sorted(WRITES):
        assert _overlap(method) == 1, method
    assert _overlap("GET", meet=True) == 6
    assert _overlap("HEAD", meet=True) == 6
