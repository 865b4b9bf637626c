"""Which Events the operator writes (batchplane.operator.events), on a fake clock: one Event per
repeated problem with its count kept up to date at most every repeat interval, new Events per
DataPlane rate-limited by a token bucket, and the core/v1 Event each becomes."""

from __future__ import annotations

import pytest

from batchplane.operator import events
from batchplane.operator.events import Drop, EventFilter, EventKey, EventSettings, Hold, New, ObjectRef, Repeat

DEMO = ObjectRef("batchplane.dev/v1alpha1", "DataPlane", "training", "demo", "uid-demo")
OTHER = ObjectRef("batchplane.dev/v1alpha1", "DataPlane", "training", "other", "uid-other")
SETTINGS = EventSettings(dedup_window_s=600, repeat_interval_s=60, burst=3, refill_s=60)


def key(message: str, ref: ObjectRef = DEMO, reason: str = "MetricsUnavailable") -> EventKey:
    return EventKey(ref, events.WARNING, reason, message)


def test_a_repeated_problem_is_one_event_whose_count_is_written_at_most_every_repeat_interval() -> None:
    f = EventFilter(SETTINGS)
    k = key("cannot observe the mixture")
    assert f.decide(k, 0.0) == New(k)
    f.written(k, "demo.1", 1, 0.0)
    assert [f.decide(k, t) for t in (30.0, 45.0)] == [Hold(k, 2), Hold(k, 3)]
    assert f.due(59.0) == []
    assert f.due(60.0) == [Repeat(k, "demo.1", 3)]  # held counts of a quiet series are written too
    assert f.decide(k, 61.0) == Repeat(k, "demo.1", 4)
    f.written(k, "demo.1", 4, 61.0)
    assert f.due(200.0) == []  # nothing new since
    assert f.decide(k, 90.0) == Hold(k, 5)


def test_different_messages_reasons_or_objects_are_different_events() -> None:
    f = EventFilter(SETTINGS)
    decisions = [f.decide(k, 0.0) for k in (key("a"), key("b"), key("a", reason="ApiError"), key("a", ref=OTHER))]
    assert all(isinstance(d, New) for d in decisions)


def test_new_events_are_rate_limited_per_object_and_refill() -> None:
    f = EventFilter(SETTINGS)
    got = [f.decide(key(f"problem {i}"), 0.0) for i in range(4)]
    assert [type(d) for d in got] == [New, New, New, Drop]
    assert isinstance(f.decide(key("x", ref=OTHER), 0.0), New)  # another DataPlane has its own bucket
    assert isinstance(f.decide(key("problem 4"), 30.0), Drop)  # half a token
    assert isinstance(f.decide(key("problem 5"), 60.0), New)  # one token refilled
    assert isinstance(f.decide(key("problem 6"), 61.0), Drop)


def test_a_problem_quiet_for_the_window_starts_a_new_event_and_a_lost_one_is_written_again() -> None:
    f = EventFilter(SETTINGS)
    k = key("cannot observe the mixture")
    f.decide(k, 0.0)
    f.written(k, "demo.1", 1, 0.0)
    assert f.decide(k, 601.0) == New(k)  # more than dedup_window_s since its last occurrence
    f.lost(k)  # its creation failed
    assert f.decide(k, 602.0) == New(k)
    f.written(k, "demo.2", 2, 602.0)
    assert f.decide(k, 700.0) == Repeat(k, "demo.2", 3)


def test_the_core_v1_event() -> None:
    k = EventKey(DEMO, events.NORMAL, "Scaled", "group text: up 1 -> 3" + "x" * 2000)
    body = events.event_body(k, name=events.event_name(DEMO, 0x1234ABC), time="2025-01-01T00:00:00Z", instance="op-0")
    assert body["metadata"] == {"name": "demo.1234abc", "namespace": "training"}
    assert body["involvedObject"] == {
        "apiVersion": "batchplane.dev/v1alpha1",
        "kind": "DataPlane",
        "namespace": "training",
        "name": "demo",
        "uid": "uid-demo",
    }
    assert (body["type"], body["reason"], body["count"], body["reportingInstance"]) == ("Normal", "Scaled", 1, "op-0")
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2025-01-01T00:00:00Z"
    assert len(body["message"]) == events.MAX_MESSAGE and body["message"].startswith("group text: up 1 -> 3")
    assert events.repeat_patch(4, time="2025-01-01T00:01:00Z") == {"count": 4, "lastTimestamp": "2025-01-01T00:01:00Z"}
    listed = {"metadata": {"name": "demo", "uid": "uid-demo"}}  # list items may lack apiVersion and kind
    assert events.dataplane_ref(listed, "training") == DEMO


@pytest.mark.parametrize(
    ("field", "value"),
    [("dedup_window_s", 0), ("repeat_interval_s", -1), ("refill_s", float("nan")), ("burst", 0)],
)
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EventSettings(**{field: value})
