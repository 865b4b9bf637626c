"""What retries say (issue 40, point 5): `call_with_retry`'s error names the last status, the
attempts made (singular and plural) and why they stopped, without "gave up" where its caller
goes on; the constructor's line for a step it cannot build yet says what it tries again and
until when."""

from __future__ import annotations

import logging
import re
import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from batchplane.constructor.blocked import FIRST_WAIT_S, MOST_WAIT_S, Blocked
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import StepPipeline
from batchplane.core.config import job_from_mapping
from batchplane.core.errors import Unavailable
from batchplane.core.rpc import call_with_retry

from rpc_fakes import Channel, Failed


DEADLINE = Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _failing(counter: list[int]):
    def call():
        counter.append(1)
        raise DEADLINE

    return call


def test_one_attempt_past_the_deadline_is_one_attempt() -> None:
    calls: list[int] = []
    with pytest.raises(Unavailable) as caught:
        call_with_retry(_failing(calls), what="GetPlan(step 12) from planner at p:1", deadline_s=0)
    assert calls == [1]
    assert re.fullmatch(
        r"GetPlan\(step 12\) from planner at p:1: DEADLINE_EXCEEDED \(Deadline Exceeded\) after 1 attempt in \d+\.\d s "
        r"\(a call is retried for up to 0 s\)",
        str(caught.value),
    ), str(caught.value)
    assert "gave up" not in str(caught.value)


def test_attempts_stopped_by_the_caller_are_counted_and_say_so() -> None:
    calls: list[int] = []
    with pytest.raises(Unavailable) as caught:
        call_with_retry(
            _failing(calls),
            what="FetchSamples(step 3) from loader at l:1",
            deadline_s=3600,
            should_stop=lambda: len(calls) >= 3,
            initial_backoff_s=0,
        )
    assert calls == [1, 1, 1]
    assert re.fullmatch(
        r"FetchSamples\(step 3\) from loader at l:1: DEADLINE_EXCEEDED \(Deadline Exceeded\) after 3 attempts in \d+\.\d s "
        r"\(retries stopped: no longer needed\)",
        str(caught.value),
    ), str(caught.value)


def test_a_status_without_details_is_named_alone() -> None:
    with pytest.raises(Unavailable, match=r"^x: UNAVAILABLE after 1 attempt in "):
        call_with_retry(lambda: (_ for _ in ()).throw(Failed(grpc.StatusCode.UNAVAILABLE, "")), what="x", deadline_s=0)


# ---- the constructor's line ---------------------------------------------------------------------


class _SilentPlanner:
    """A planner whose every GetPlan runs past its deadline."""

    def GetPlan(self, request, timeout):  # noqa: N802 - the stub's method name
        raise DEADLINE


class _Lines(logging.Handler):
    """Collects the pipeline's warnings; `seen` is set at the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.seen.set()


def test_a_step_the_planner_does_not_answer_is_built_again_and_the_line_says_until_when() -> None:
    job = job_from_mapping(
        {
            "job": "j",
            "sources": [{"name": "a", "path": "unused"}],
            "mesh": {"dp": 1},
            "batch": {"global_batch_size": 2, "microbatches": 1},
            "network": {"rpc_timeout_s": 0.05},
        }
    )
    lines = _Lines()
    logger = logging.getLogger("batchplane.constructor.pipeline")
    logger.addHandler(lines)
    pipeline = StepPipeline(
        job, index=0, ranks=(0,), planner="planner:1", metrics=ConstructorMetrics(CollectorRegistry()), connect=lambda a, p: Channel()
    )
    pipeline._planner = _SilentPlanner()
    try:
        with pytest.raises(Unavailable, match="batch of step 0 for rank 0 not ready"):
            pipeline.batch(0, 0, timeout_s=0.01)  # a rank asks for step 0: building it starts
        assert lines.seen.wait(timeout=60), "the build thread logged nothing"
    finally:
        pipeline.stop()
        logger.removeHandler(lines)
    line = lines.lines[0]
    assert line.startswith(
        "step 0 is not built yet: GetPlan(step 0) from planner at planner:1: DEADLINE_EXCEEDED (Deadline Exceeded) after "
    ), line
    assert "(a call is retried for up to 0.05 s); trying again (every 0.5 s at most) until the planner answers, " in line
    assert re.search(
        r"a rank restarts at another step or the constructor stops; blocked for \d+\.\d s so far \(said again every 30 s while it lasts\)$",
        line,
    ), line
    assert "gave up" not in line and "retrying" not in line
    assert len(lines.lines) == 1, "one line while it lasts (the next in 30 s), not one per try"


# ---- the pace of a blocked build (`constructor.blocked`) -----------------------------------------


def test_a_blocked_build_waits_longer_each_time_and_says_so_every_so_often() -> None:
    blocked = Blocked()
    retries = [blocked.failed(7, "INTERNAL: boom\nsecond line", peer="planner", began=100.0, now=100.0 + t) for t in range(40)]
    assert [r.first for r in retries] == [True] + [False] * 39, "one peer failure per run of failures"
    waits = [r.wait_s for r in retries]
    assert waits[:4] == [FIRST_WAIT_S, 2 * FIRST_WAIT_S, 4 * FIRST_WAIT_S, 8 * FIRST_WAIT_S] and max(waits) == MOST_WAIT_S
    said = [t for t, r in enumerate(retries) if r.say]
    assert said == [0, 30] and "INTERNAL: boom second line" in retries[0].say and "blocked for 30.0 s so far" in retries[30].say
    assert blocked.why(140.0) == ": the constructor has been retrying for 40.0 s: INTERNAL: boom second line"
    assert blocked.built(141.0) == 41.0 and blocked.built(142.0) is None and blocked.why(142.0) == ""
    again = blocked.failed(8, "x", peer="loader", began=150.0, now=150.0)
    assert again.first and again.say and again.wait_s == FIRST_WAIT_S, "a new run starts over"
