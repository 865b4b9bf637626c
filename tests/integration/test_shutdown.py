"""Stopping a service wakes the requests waiting inside it, so the process exits at once instead
of waiting out their deadlines (found as 10 s stalls: handler threads blocked interpreter exit)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import StepPipeline
from batchplane.core.config import job_from_mapping
from batchplane.core.errors import Unavailable
from batchplane.planner.book import PlanBook
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.summaries import SummaryStore

pytestmark = pytest.mark.integration

JOB = job_from_mapping({"job": "j", "sources": [{"name": "a", "path": "unused"}], "mesh": {"dp": 2}, "batch": {"global_batch_size": 4}})


def _stop_while_waiting(wait, stop) -> tuple[BaseException | None, float]:
    """Runs `wait` in a thread, calls `stop` once it is waiting, returns (error, seconds to return)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            wait()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=0.5)  # let it reach its wait (it waits 60 s otherwise)
    assert thread.is_alive()
    began = time.monotonic()
    stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    return outcome[0], time.monotonic() - began


def test_stopping_the_constructor_pipeline_fails_waiting_requests_promptly() -> None:
    # No planner listens at this address: the batch can never be built.
    pipeline = StepPipeline(
        JOB,
        index=0,
        ranks=(0,),
        planner="127.0.0.1:9",
        metrics=ConstructorMetrics(CollectorRegistry()),
        connect=lambda address, _peer: grpc.insecure_channel(address),
    )
    error, seconds = _stop_while_waiting(lambda: pipeline.batch(0, 0, timeout_s=60), pipeline.stop)
    assert isinstance(error, Unavailable) and "stopping" in str(error)
    assert seconds < 6


def test_stopping_the_plan_book_fails_waiting_requests_promptly() -> None:
    store = SummaryStore(1, lookahead=8)
    book = PlanBook(
        JOB,
        membership=Membership(JOB),  # no loader ever registers
        store=store,
        metrics=PlannerMetrics(CollectorRegistry(), source_names=["a"], target_weights=[1.0]),
    )
    error, seconds = _stop_while_waiting(lambda: book.plan_for((0,), 0, timeout_s=60), book.stop)
    assert isinstance(error, Unavailable) and "stopping" in str(error)
    assert seconds < 6
