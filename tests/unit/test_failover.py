"""The failure detector and the promotion of shadows (pure logic): a replica is declared failed
after exactly `failures` consecutive failed observations, once per run of failures, and a success
resets it; promotion hands a replica's id to its shadow, and the replica's process, back again,
becomes the shadow."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.config import JobSettings, SourceSettings, LoaderSettings
from batchplane.planner.failover import CONFIRM_S, FailureDetector, probe_due
from batchplane.planner.membership import Membership, SourceFacts


@settings(max_examples=300, deadline=None)
@given(threshold=st.integers(1, 6), observations=st.lists(st.booleans(), max_size=60))
def test_declared_failed_exactly_when_a_run_of_failures_reaches_the_threshold(threshold: int, observations: list[bool]) -> None:
    detector = FailureDetector(failures=threshold)
    run = 0
    for t, ok in enumerate(observations):
        if ok:
            detector.ok("r")
            run = 0
            assert detector.failing_since("r") is None
            continue
        run += 1
        assert detector.failed("r", float(t)) == (run == threshold)
        assert detector.failing_since("r") == float(t - run + 1)


def test_keys_are_independent_and_forgotten_keys_start_afresh() -> None:
    detector = FailureDetector(failures=2)
    assert not detector.failed("a", 0.0)
    assert not detector.failed("b", 0.0)
    assert detector.failed("a", 1.0)
    assert not detector.failed("a", 2.0), "declared once per run of failures"
    detector.forget("a")
    assert not detector.failed("a", 3.0)
    assert detector.failed("a", 4.0)


def test_a_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="failures must be >= 1"):
        FailureDetector(failures=0)


def _membership() -> Membership:
    job = JobSettings(job="j", sources=(SourceSettings(name="a", path="a"),), loaders=LoaderSettings(shadow=True))
    return Membership(job)


FACTS = [SourceFacts("a", 100, (50, 50))]
SMALL_GROUPS = [SourceFacts("a", 100, (10,) * 10)]  # windows of 4 row groups: 40 rows


def test_a_shadow_serves_nothing_until_promoted_then_the_old_replica_is_its_shadow() -> None:
    m = _membership()
    assert m.register_loader(0, "host:shadow", FACTS, shadow_of="0").shadow  # before its replica: kept
    assert not m.register_loader(0, "host:primary", FACTS, incarnation="p1").shadow
    assert m.summary_target(0, 0).address == "host:primary"
    assert m.summary_target(0, 0).shadow == "host:shadow"
    assert m.holders(0, [0]) == ["host:primary"]
    assert m.shadowed() == [((0, "0"), "host:primary", "host:shadow")]

    assert m.promote(0, "0") == "host:shadow"
    assert m.holders(0, [0, 60]) == ["host:shadow", "host:shadow"]
    assert m.summary_target(0, 50).shadow == ""
    assert m.promote(0, "0") is None, "no shadow left"
    # The promoted shadow's heartbeats keep it the replica.
    assert not m.register_loader(0, "host:shadow", FACTS, shadow_of="0").shadow
    # The failed process, restarted, comes back as the shadow.
    back = m.register_loader(0, "host:primary", FACTS, incarnation="p2")
    assert back.shadow and back.restarted
    assert m.shadowed() == [((0, "0"), "host:shadow", "host:primary")]
    assert m.promote(0, "0") == "host:primary"
    assert m.holders(0, [0]) == ["host:primary"]


def test_a_replica_without_a_shadow_that_moves_keeps_its_id() -> None:
    m = _membership()
    m.register_loader(0, "host:1", FACTS, incarnation="x")
    again = m.register_loader(0, "host:2", FACTS, incarnation="y")  # e.g. a pod restarted with a new IP
    assert not again.shadow and again.restarted
    assert m.holders(0, [0]) == ["host:2"]


def test_a_failed_replica_without_a_shadow_is_adopted_by_a_live_one() -> None:
    m = _membership()
    m.register_loader(0, "host:a", SMALL_GROUPS, replica="a")
    m.register_loader(0, "host:b", SMALL_GROUPS, replica="b")
    # Windows of 40 rows, routed over a and b; windows 0 and 1 asked about.
    assert [m.summary_target(0, seq).address for seq in (0, 40)] == ["host:a", "host:b"]
    assert m.holders(0, [0, 40]) == ["host:a", "host:b"]
    assert m.adopt(0, "a") == "b"
    assert m.holders(0, [0, 40]) == ["host:b", "host:b"], "b serves a's windows too"
    assert m.summary_target(0, 80).address == "host:b", "new windows go to the live replica"
    assert [owner for owner, _ in m.watched()] == [(0, "b")]
    assert m.adopt(0, "a") is None, "already failed"
    # b fails too: nobody is live; a replacement joining under a new name adopts both.
    assert m.adopt(0, "b") is None
    m.register_loader(0, "host:c", SMALL_GROUPS, replica="c")
    assert m.holders(0, [0, 40]) == ["host:c", "host:c"]
    # a comes back under its id (a local restart): it serves its windows again.
    m.register_loader(0, "host:a2", SMALL_GROUPS, replica="a", incarnation="again")
    assert m.holders(0, [0]) == ["host:a2"]
    assert sorted(owner for owner, _ in m.watched()) == [(0, "a"), (0, "c")]


def test_a_lone_failed_replica_keeps_its_address_until_it_restarts() -> None:
    m = _membership()
    m.register_loader(0, "host:a", SMALL_GROUPS)
    assert m.adopt(0, "0") is None
    assert m.holders(0, [0]) == ["host:a"], "constructors retry it: it restarts on its address"
    m.register_loader(0, "host:a", SMALL_GROUPS, incarnation="restarted")
    assert m.watched() == [((0, "0"), "host:a")]


def _watch(m: Membership):
    from prometheus_client import CollectorRegistry

    from batchplane.core.config import FailoverSettings
    from batchplane.planner.metrics import PlannerMetrics
    from batchplane.planner.watch import ReplicaWatch

    metrics = PlannerMetrics(CollectorRegistry(), source_names=["a"], target_weights=[1.0])
    return ReplicaWatch(
        m, FailoverSettings(probe_interval_s=3600, failures=3), metrics, connect=grpc.insecure_channel
    ), metrics  # no probe runs


def test_late_failures_of_a_replaced_process_do_not_fail_its_successor() -> None:
    m = _membership()
    m.register_loader(0, "host:p", FACTS, incarnation="p")
    m.register_loader(0, "host:s", FACTS, shadow_of="0", incarnation="s")
    watch, metrics = _watch(m)
    try:
        for _ in range(2):
            watch.observe((0, "0"), "host:p", False)
        assert m.serving(0, "0") == "host:p", "two failures are not enough"
        watch.observe((0, "0"), "host:p", False)
        assert m.serving(0, "0") == "host:s"
        for _ in range(5):  # answers of requests that were in flight to the dead one
            watch.observe((0, "0"), "host:p", False)
        assert m.serving(0, "0") == "host:s"
        m.register_loader(0, "host:p", FACTS, incarnation="p2")  # back, as the shadow
        watch.observe((0, "0"), "host:s", False)
        watch.observe((0, "0"), "host:s", True)  # a success resets the count
        for _ in range(2):
            watch.observe((0, "0"), "host:s", False)
        assert m.serving(0, "0") == "host:s"
        watch.observe((0, "0"), "host:s", False)
        assert m.serving(0, "0") == "host:p"
        assert metrics.promotions.labels("0")._value.get() == 2
    finally:
        watch.stop()


def test_a_shadow_whose_replica_never_comes_back_can_be_promoted() -> None:
    m = _membership()
    m.register_loader(0, "host:s", FACTS, shadow_of="0")  # e.g. after a planner restart
    assert m.lone_shadows() == [(0, "0")]
    assert m.summary_target(0, 0) is None, "nothing serves the group yet"
    assert m.promote(0, "0") == "host:s"
    assert m.lone_shadows() == []
    assert m.summary_target(0, 0).address == "host:s"


def test_with_shadows_on_a_replica_running_without_one_is_warned_about_once(caplog) -> None:
    from batchplane.planner import watch as watch_module

    m = _membership()
    m.register_loader(0, "host:p", FACTS)
    watch, _ = _watch(m)
    watch._shadows = True
    try:
        watch._warn_unshadowed([(0, "0")], 0.0)
        watch._warn_unshadowed([(0, "0")], watch_module.UNSHADOWED_WARN_S - 1)
        assert "has had no shadow" not in caplog.text
        watch._warn_unshadowed([(0, "0")], watch_module.UNSHADOWED_WARN_S)
        watch._warn_unshadowed([(0, "0")], watch_module.UNSHADOWED_WARN_S + 5)
        assert caplog.text.count("has had no shadow") == 1
        assert "--shadow-of 0" in caplog.text
    finally:
        watch.stop()


@given(
    connected=st.booleans(),
    answered_ago=st.one_of(st.none(), st.floats(min_value=0, max_value=10)),
    confirm_s=st.floats(min_value=0.01, max_value=5),
)
def test_a_replica_is_probed_every_interval_unless_its_connection_is_up_and_it_answered_lately(connected, answered_ago, confirm_s) -> None:
    now = 100.0
    answered_at = None if answered_ago is None else now - answered_ago
    due = probe_due(connected=connected, answered_at=answered_at, now=now, confirm_s=confirm_s)
    # Skipped only for a live connection whose last answer (since its last failure) is recent.
    assert due == (not connected or answered_at is None or now - answered_at >= confirm_s)
    if connected and answered_ago is not None and not due:
        assert answered_ago < confirm_s + 1e-9


def test_a_healthy_replica_is_probed_once_a_confirm_interval_and_a_failure_brings_back_every_interval() -> None:
    answered, probes = None, []
    for now in range(40):  # the watch's loop, in probe intervals; a confirm interval is ten
        if probe_due(connected=True, answered_at=answered, now=now, confirm_s=10):
            probes.append(now)
            answered = None if 20 <= now < 23 else now  # hung for a moment
    assert probes == [0, 10, 20, 21, 22, 23, 33]


class _Health(health_pb2_grpc.HealthServicer):
    """A replica's health service on a real gRPC server that counts its probes and can hang (a
    stopped process: its connection stays up, nothing answers)."""

    def __init__(self) -> None:
        self.probes = 0
        self.hung = threading.Event()

    def Check(self, request, context):  # noqa: N802 - grpc's name
        self.probes += 1
        if self.hung.is_set():
            time.sleep(2)  # past the probe's deadline
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _replica_server() -> tuple[grpc.Server, _Health, str]:
    health = _Health()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, health, f"127.0.0.1:{port}"


@pytest.mark.parametrize("fault", ["hung", "dead"])
def test_the_watch_probes_a_healthy_replica_rarely_and_replaces_a_hung_or_dead_one(fault: str) -> None:
    from prometheus_client import CollectorRegistry

    from batchplane.core.config import FailoverSettings
    from batchplane.planner.metrics import PlannerMetrics
    from batchplane.planner.watch import ReplicaWatch

    server, health, address = _replica_server()
    m = _membership()
    m.register_loader(0, address, FACTS, incarnation="p")
    m.register_loader(0, "127.0.0.1:1", FACTS, shadow_of="0", incarnation="s")
    metrics = PlannerMetrics(CollectorRegistry(), source_names=["a"], target_weights=[1.0])
    watch = ReplicaWatch(m, FailoverSettings(probe_interval_s=0.02, failures=3), metrics, connect=grpc.insecure_channel)
    try:
        give_up = time.monotonic() + 10
        while health.probes < 2 and time.monotonic() < give_up:  # connected, and answered
            time.sleep(0.01)
        before, began = health.probes, time.monotonic()
        time.sleep(0.5)
        # Its connection is up and it answers: probed once a CONFIRM_S, not every 20 ms.
        assert health.probes - before <= 1 + (time.monotonic() - began) / CONFIRM_S, health.probes - before
        assert m.serving(0, "0") == address
        if fault == "hung":
            health.hung.set()
        else:
            server.stop(grace=None)
        give_up = time.monotonic() + 15
        while m.serving(0, "0") == address and time.monotonic() < give_up:
            time.sleep(0.02)
        assert m.serving(0, "0") == "127.0.0.1:1", f"the {fault} replica was not replaced"
        assert metrics.promotions.labels("0")._value.get() == 1
    finally:
        watch.stop()
        server.stop(grace=None)
