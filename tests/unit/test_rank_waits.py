"""The ranks' waits for data as their clients measure them (`constructor.waits`): counted while a
wait lasts, never backwards, never faster than time passes, forgotten when a client stops. Pure,
with the metrics collector that exports them read as Prometheus would."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.waits import MAX_CLIENTS, MAX_TOTAL_S, SLACK_S, STALE_S, RankWaits, check_wait
from batchplane.core.errors import InvalidArgument


def only(waits: RankWaits, now: float):
    (wait,) = waits.snapshot(now)
    return wait


def test_a_stall_is_counted_while_it_lasts_and_its_start_is_kept() -> None:
    """A client reports once a second while its trainer waits: the count grows with each report
    (not once the wait ends), and the current wait is carried on to the scrape's time."""
    waits = RankWaits()
    waits.note(3, client="c", total_s=2.0, waiting_s=0.0, now=100.0)  # a GetBatch: 2 s waited before, none now
    assert only(waits, 100.0).counted_s == 0.0, "what came before this process heard of the client was counted elsewhere"
    for second in range(1, 6):
        waits.note(3, client="c", total_s=2.0 + second, waiting_s=float(second), now=100.0 + second)
        assert only(waits, 100.0 + second).counted_s == pytest.approx(second)
    wait = only(waits, 105.5)
    assert wait.waiting_s == pytest.approx(5.5) and wait.longest_s == pytest.approx(5.0)
    waits.note(3, client="c", total_s=7.25, waiting_s=0.0, now=105.25)  # the batch came: the wait is over
    wait = only(waits, 106.0)
    assert wait.counted_s == pytest.approx(5.25) and wait.waiting_s == 0.0


def test_a_wait_under_way_when_first_heard_of_counts_and_a_client_gone_stops_waiting() -> None:
    waits = RankWaits()
    waits.note(0, client="c", total_s=40.0, waiting_s=30.0, now=10.0)  # a constructor restarted into a stall
    assert only(waits, 10.0).counted_s == 30.0
    assert only(waits, 10.0 + STALE_S).waiting_s == pytest.approx(30.0 + STALE_S)
    assert only(waits, 10.0 + STALE_S + 0.1).waiting_s == 0.0, "no report for STALE_S: its client is gone"


def test_a_report_adds_no_more_than_the_time_since_the_last() -> None:
    """A hostile (or confused) client claims a day of waiting a second later: it adds a second."""
    waits = RankWaits()
    waits.note(1, client="c", total_s=0.0, waiting_s=0.0, now=0.0)
    waits.note(1, client="c", total_s=86_400.0, waiting_s=0.0, now=1.0)
    assert only(waits, 1.0).counted_s == pytest.approx(1.0 + SLACK_S)
    waits.note(1, client="c", total_s=86_400.0, waiting_s=0.0, now=50.0)
    assert only(waits, 50.0).counted_s == pytest.approx(1.0 + SLACK_S), "the same total again adds nothing"


def test_a_restarted_trainer_adds_up_and_forgetting_clients_loses_nothing() -> None:
    waits = RankWaits()
    now = 0.0
    for client in range(3 * MAX_CLIENTS):
        now += 1.0
        waits.note(2, client=f"c{client}", total_s=0.0, waiting_s=0.0, now=now)
        now += 1.0
        waits.note(2, client=f"c{client}", total_s=1.0, waiting_s=0.0, now=now)
    assert only(waits, now).counted_s == pytest.approx(3 * MAX_CLIENTS)


@pytest.mark.parametrize(
    ("client", "total_s", "waiting_s", "field"),
    [
        ("", 1.0, 0.0, "data_wait.client"),
        ("x" * 65, 1.0, 0.0, "data_wait.client"),
        ("c", -1.0, 0.0, "data_wait.total_s"),
        ("c", math.nan, 0.0, "data_wait.total_s"),
        ("c", math.inf, 0.0, "data_wait.total_s"),
        ("c", MAX_TOTAL_S * 2, 0.0, "data_wait.total_s"),
        ("c", 1.0, 2.0, "data_wait.waiting_s"),
        ("c", 1.0, -0.5, "data_wait.waiting_s"),
        ("c", 1.0, math.nan, "data_wait.waiting_s"),
    ],
)
def test_a_measure_out_of_bounds_is_refused_naming_its_field_and_changes_nothing(client, total_s, waiting_s, field) -> None:
    waits = RankWaits()
    waits.note(0, client="c", total_s=1.0, waiting_s=0.0, now=0.0)
    with pytest.raises(InvalidArgument, match=field):
        waits.note(0, client=client, total_s=total_s, waiting_s=waiting_s, now=0.5)
    with pytest.raises(InvalidArgument, match=field):
        check_wait(client=client, total_s=total_s, waiting_s=waiting_s)
    assert only(waits, 0.5).counted_s == 0.0 and only(waits, 0.5).waiting_s == 0.0


REPORT = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0, 1, allow_nan=False),
    st.floats(0, 30, allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(reports=st.lists(REPORT, max_size=40))
def test_whatever_clients_report_the_count_never_goes_back_nor_runs_ahead_of_time(reports) -> None:
    """Each report: the count never decreases, and it grows by at most the time since the
    client's previous report plus SLACK_S (a first report: by its current wait)."""
    waits = RankWaits()
    now, last_seen = 0.0, {}
    counted = 0.0
    for client, total_s, waiting_share, gap in reports:
        now += gap
        waiting_s = total_s * waiting_share
        waits.note(0, client=client, total_s=total_s, waiting_s=waiting_s, now=now)
        after = only(waits, now).counted_s
        bound = waiting_s if client not in last_seen else now - last_seen[client] + SLACK_S
        assert counted <= after <= counted + bound + 1e-6
        counted, last_seen[client] = after, now


def test_the_metrics_are_exported_as_prometheus_reads_them() -> None:
    registry = CollectorRegistry()
    metrics = ConstructorMetrics(registry)
    metrics.waits.note(5, client="c", total_s=3.0, waiting_s=3.0, now=time.monotonic())
    text = generate_latest(registry).decode()
    assert 'batchplane_constructor_rank_data_wait_seconds_total{rank="5"} 3.0' in text
    assert 'batchplane_constructor_rank_longest_data_wait_seconds{rank="5"} 3.0' in text
    since = next(line for line in text.splitlines() if line.startswith("batchplane_constructor_rank_waiting_since_timestamp_seconds{"))
    assert abs(float(since.split()[-1]) - (time.time() - 3.0)) < 5.0
