"""A loader's bounds on what its callers ask (`batchplane.loader.bounds`): every FetchSamples and
GetSummary field outside what the job has is refused, a fetch reaches only positions the planner
may have planned from the replica, and the reads a fetch makes stay within the buffer budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Route, Routing
from batchplane.loader.bounds import (
    MAX_ROUTES,
    FetchFrontier,
    FetchLimits,
    NotPlanned,
    check_distinct,
    check_fetch,
    check_fetch_steps,
    check_payload,
    check_summary,
    next_owned,
    plan_fetch_reads,
    routing_from,
)

LIMITS = FetchLimits(constructors=2, max_samples=12)


def test_a_fetch_of_several_steps_names_at_most_fetch_steps_rising_steps_and_no_sample_twice() -> None:
    limits = FetchLimits(constructors=2, max_samples=12, max_steps=3)
    check_fetch_steps(3, [4, 9], limits=limits)
    check_fetch_steps(3, [], limits=FetchLimits(max_steps=1))
    for following, names in (([4, 5, 6], "at most 2 steps"), ([4, 4], r"following\[1\].step must be in \(4, "), ([2], r"following\[0\]")):
        with pytest.raises(InvalidArgument, match=names):
            check_fetch_steps(3, following, limits=limits)
    with pytest.raises(InvalidArgument, match=r"following\[0\].step must be in \(3, 4611686018427387904\]"):
        check_fetch_steps(3, [2**62 + 1], limits=limits)
    check_distinct(np.array([0, 0, 1], np.int32), np.array([4, 5, 4], np.int64))
    with pytest.raises(InvalidArgument, match=r"name 1 \(source, seq\) pairs more than once"):
        check_distinct(np.array([0, 1, 0], np.int32), np.array([4, 4, 4], np.int64))


def fetch(**changes):
    request = {
        "constructor": 1,
        "step": 3,
        "release_below_step": 2,
        "sources": np.array([0, 0, 1], np.int32),
        "seqs": np.array([4, 5, 4], np.int64),
        "copies": None,
        "served": {0, 1},
        "limits": LIMITS,
    }
    request.update(changes)
    check_fetch(**request)


def test_a_well_formed_fetch_passes() -> None:
    fetch()
    fetch(copies=np.array([1, 2, 2], np.int32))
    fetch(sources=np.zeros(0, np.int32), seqs=np.zeros(0, np.int64))  # a release: nothing asked


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"constructor": 2}, "constructor_index must be in [0, 2)"),
        ({"constructor": -1}, "constructor_index"),
        ({"step": -1}, "step must be"),
        ({"step": 2**63 - 1}, "step must be"),
        ({"release_below_step": -5}, "release_below_step"),
        ({"sources": np.zeros(13, np.int32), "seqs": np.arange(13, dtype=np.int64)}, "at most 12 samples"),
        ({"seqs": np.array([4, -1, 4], np.int64)}, "samples.seq must be >= 0"),
        ({"sources": np.array([0, 7, 1], np.int32)}, "not [7]"),
        ({"seqs": np.array([4, 4, 4], np.int64)}, "more than once"),
        ({"sources": np.zeros(2, np.int32)}, "samples.source has 2 entries"),
        ({"copies": np.array([1, 3, 1], np.int32)}, "copies must lie in [1, 2]"),
        ({"copies": np.array([1, 0, 1], np.int32)}, "copies must lie"),
        ({"copies": np.array([1], np.int32)}, "one value per sample"),
    ],
)
def test_a_fetch_outside_what_the_job_has_is_invalid(changes, names) -> None:
    with pytest.raises(InvalidArgument) as info:
        fetch(**changes)
    assert names in str(info.value)


def test_without_the_jobs_limits_only_what_the_loader_knows_is_checked() -> None:
    fetch(limits=FetchLimits(), constructor=9, sources=np.zeros(100, np.int32), seqs=np.arange(100, dtype=np.int64))
    with pytest.raises(InvalidArgument, match="constructor_index"):
        fetch(limits=FetchLimits(), constructor=2**31 - 1)


def test_limits_come_from_the_job() -> None:
    from batchplane.core.config import JobSettings, SourceSettings

    job = JobSettings(job="j", sources=(SourceSettings(name="a", path="a"),))
    limits = FetchLimits.of(job)
    assert limits.constructors == job.constructor_count
    assert limits.max_samples == job.batch.global_batch_size


def summary(**changes) -> None:
    request = {"source": 0, "served": {0}, "from_seq": 40, "planned_seq": 30, "max_samples": 10, "planned_steps": 3, "delivered_below": 2}
    request.update(changes)
    check_summary(**request)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"source": 9}, "not 9"),
        ({"from_seq": -1}, "from_seq"),
        ({"planned_seq": -1}, "planned_seq"),
        ({"max_samples": -1}, "max_samples"),
        ({"planned_steps": -1}, "planned_steps"),
        ({"delivered_below": -1}, "delivered_below"),
        ({"from_seq": 2**63 - 1, "planned_seq": 0}, "from_seq"),
        ({"planned_seq": 41}, "never passes what it knows"),
    ],
)
def test_a_summary_request_outside_the_job_is_invalid(changes, names) -> None:
    summary()
    with pytest.raises(InvalidArgument) as info:
        summary(**changes)
    assert names in str(info.value)


def test_routes_are_checked_and_bounded() -> None:
    assert routing_from([]) is None
    assert routing_from([(0, ("b", "a")), (4, ("a",))]).routes == (Route(0, ("a", "b")), Route(4, ("a",)))
    for bad in ([(1, ("a",))], [(0, ("a", "a"))], [(0, ())], [(0, ("a",)), (0, ("b",))], [(0, ("a",)), (-1, ("b",))]):
        with pytest.raises(InvalidArgument, match="routes"):
            routing_from(bad)
    with pytest.raises(InvalidArgument, match=f"at most {MAX_ROUTES}"):
        routing_from([(i, ("a",)) for i in range(MAX_ROUTES + 1)])
    with pytest.raises(InvalidArgument, match="replicas a route"):
        routing_from([(0, tuple(str(i) for i in range(5000)))])


# ---- how far a fetch reaches -------------------------------------------------------------------


ORDER = SampleOrder([10] * 12, seed=1, source_name="a", window_row_groups=1)  # 12 windows of 10 an epoch


def test_next_owned_window() -> None:
    two = Routing.of(["r0", "r1"])
    assert next_owned(None, "r1", 5) == 5
    assert next_owned(two, "r1", 0) == 1
    assert next_owned(two, "r1", 1) == 1
    assert next_owned(two, "r1", 2) == 3
    assert next_owned(two, "r0", 3) == 4
    left = two.switch(6, ["r0"])  # r1 left from window 6
    assert next_owned(left, "r1", 5) == 5
    assert next_owned(left, "r1", 6) == 6  # nothing of it from there on
    assert next_owned(left, "r0", 5) == 6
    joined = Routing.of(["r0"]).switch(4, ["r0", "r1"])
    assert next_owned(joined, "r1", 0) == 0  # windows of a route that leaves it out are not its
    assert next_owned(joined, "r1", 4) == 5  # from where it joined: the first of the new route it owns
    assert next_owned(Routing.of(["r0"]), "r9", 3) == 3


def test_a_fetch_reaches_only_what_the_planner_asked_about() -> None:
    frontier = FetchFrontier(ORDER, "0", end_seq=120)
    with pytest.raises(NotPlanned):  # nothing asked about: nothing planned
        frontier.check(np.array([0]), routing=None, source="a")
    frontier.asked(0)
    frontier.asked(15)  # windows 0 and 1 asked about
    assert frontier.frontier(None) == 20
    frontier.check(np.array([0, 19, 7]), routing=None, source="a")
    with pytest.raises(NotPlanned, match=r"\[20\]"):
        frontier.check(np.array([3, 20]), routing=None, source="a")
    assert issubclass(NotPlanned, Unavailable)  # retryable: the replica may learn it with the planner's next request
    frontier.asked(10**6)  # past the end: everything
    assert frontier.frontier(None) == 120


def test_windows_of_other_replicas_before_its_next_own_window_may_be_fetched() -> None:
    """A replica asked about window 2 (r0's) may serve r1's window 3 (asked of r1, which failed and
    was adopted here) but not window 4: r0's own next window, which the planner has not asked it about."""
    two = Routing.of(["r0", "r1"])
    frontier = FetchFrontier(ORDER, "r0")
    frontier.asked(25)
    assert frontier.frontier(two) == 40
    frontier.check(np.array([39]), routing=two, source="a")
    with pytest.raises(NotPlanned):
        frontier.check(np.array([40]), routing=two, source="a")


def test_a_restored_replica_reaches_what_the_planner_asked_any_replica_about() -> None:
    frontier = FetchFrontier(ORDER, "r1")
    frontier.restored(60)  # the first window nobody was asked about is 6
    assert frontier.frontier(Routing.of(["r0", "r1"])) == 70  # 6 is r0's: r1's next is 7
    later = FetchFrontier(ORDER, "r1")
    later.restored(65)  # a cursor mid-window: its window was asked about
    assert later.asked_through == 7
    fresh = FetchFrontier(ORDER, "r1")
    fresh.restored(0)
    assert fresh.frontier(Routing.of(["r0", "r1"])) == 10


@settings(max_examples=200, deadline=None)
@given(
    asks=st.lists(st.integers(0, 20), min_size=1, max_size=8),
    replicas=st.integers(1, 3),
    me=st.integers(0, 2),
)
def test_the_frontier_covers_every_window_asked_about_and_none_of_its_own_unasked(asks, replicas, me) -> None:
    """Property: windows asked about (in order, of any replica) are always fetchable; the next
    window the replica owns and was not asked about never is."""
    names = [f"r{i}" for i in range(replicas)]
    mine = names[me % replicas]
    routing = Routing.of(names)
    frontier = FetchFrontier(ORDER, mine)
    asked_top = -1
    for window in sorted(asks):
        if routing.owner(window) == mine:
            frontier.asked(window * 10)
        asked_top = window  # the planner asked about every window up to it, in order
        reach = frontier.frontier(routing)
        own_asked = [w for w in range(asked_top + 1) if routing.owner(w) == mine and w in asks]
        if own_asked:
            assert reach >= (max(own_asked) + 1) * 10
        first_unasked_own = next(w for w in range(asked_top + 1, 10**6) if routing.owner(w) == mine)
        assert reach <= first_unasked_own * 10


# ---- reads a fetch makes -------------------------------------------------------------------------


def test_reads_for_a_fetch_go_into_the_buffer_one_at_a_time_while_under_budget() -> None:
    assert plan_fetch_reads([7, 3], queued=set(), used=10, limit=100).want == 3
    assert plan_fetch_reads([7, 3], queued=set(), used=10, limit=100).waits


def test_a_fetch_waits_for_windows_the_reader_was_asked_for() -> None:
    reads = plan_fetch_reads([3, 7], queued={3}, used=500, limit=100)
    assert reads.waits and reads.want is None


def test_over_budget_a_fetch_reads_what_it_needs_itself() -> None:
    reads = plan_fetch_reads([7, 3, 7], queued=set(), used=100, limit=100)
    assert not reads.waits and reads.direct == (3, 7) and reads.want is None


@settings(max_examples=200, deadline=None)
@given(
    window_bytes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    limit=st.integers(1, 200),
    start=st.integers(0, 200),
)
def test_the_buffer_never_passes_its_budget_by_more_than_one_window_for_fetches(window_bytes, limit, start) -> None:
    """Property: however many windows a fetch misses, following `plan_fetch_reads` (one reader,
    windows read into the buffer on its `want`) leaves the buffer at most one window over its
    budget, or where it was when the fetch came."""
    used = start
    missing = list(range(len(window_bytes)))
    queued: set[int] = set()
    while missing:
        reads = plan_fetch_reads(missing, queued=queued, used=used, limit=limit)
        if not reads.waits:
            assert used >= limit and reads.direct == tuple(sorted(missing))
            break  # read and dropped one by one by the fetch: the buffer does not grow
        assert reads.want is not None and not queued
        queued.add(reads.want)
        used += window_bytes[reads.want]  # the reader reads it into the buffer
        queued.discard(reads.want)
        missing.remove(reads.want)
        assert used <= max(limit, start) + max(window_bytes)


def test_a_payload_larger_than_the_budget_is_refused() -> None:
    check_payload(100, samples=3, limit=100)
    with pytest.raises(ResourceExhausted, match="more than loaders.buffer_bytes"):
        check_payload(101, samples=3, limit=100)
