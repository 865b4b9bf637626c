"""The operator's leader election as a pure state machine (batchplane.operator.election), on a
fake clock: who may write what after reading the Lease, when a leader stops leading, and that two
candidates sharing one Lease (an in-memory store that checks resourceVersion as the API server
does) never lead at the same time, whatever the interleaving, failures and timing."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.operator import election
from batchplane.operator.election import Create, ElectionSettings, LeaseRecord, Update, Wait

TIMING = ElectionSettings(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)


def wall(t: float) -> str:
    return f"t={t:g}"


def test_the_first_candidate_creates_the_lease_and_leads_once_written() -> None:
    state = election.initial_state("op-a", TIMING)
    state, step = election.attempt(state, None, now=0.0, wall=wall(0))
    assert step == Create(LeaseRecord(holder="op-a", lease_duration_s=15, acquire_time="t=0", renew_time="t=0", transitions=0))
    assert not election.leading(state, now=0.0)  # not before the write succeeded
    state = election.written(state, dataclasses.replace(step.record, resource_version="1"), now=0.5)
    assert election.leading(state, now=0.5) and election.leading(state, now=10.4)
    assert not election.leading(state, now=10.5)  # the renew deadline (10 s) since its last renewal


def test_a_leader_renews_with_the_version_it_read_as_precondition() -> None:
    state = election.written(election.initial_state("op-a", TIMING), LeaseRecord("op-a", 15, "t=0", "t=0", 0, "7"), now=0.0)
    read = LeaseRecord("op-a", 15, "t=0", "t=0", 0, "7")
    state, step = election.attempt(state, read, now=2.0, wall=wall(2))
    assert step == Update(LeaseRecord("op-a", 15, acquire_time="t=0", renew_time="t=2", transitions=0, resource_version="7"), "renew")
    assert election.lease_update(step.record) == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"holderIdentity": "op-a", "leaseDurationSeconds": 15, "acquireTime": "t=0", "renewTime": "t=2", "leaseTransitions": 0},
    }
    state = election.written(state, dataclasses.replace(step.record, resource_version="8"), now=2.1)
    assert election.leading(state, now=12.0)


def test_a_valid_lease_of_another_is_waited_for_then_taken_over_after_its_duration_unchanged() -> None:
    held = LeaseRecord("op-a", 15, "t=0", "t=0", 3, "41")
    state = election.initial_state("op-b", TIMING)
    state, step = election.attempt(state, held, now=100.0, wall=wall(100))
    assert step == Wait("op-a", 15.0)
    state, step = election.attempt(state, held, now=110.0, wall=wall(110))
    assert step == Wait("op-a", 5.0) and not election.leading(state, now=110.0)
    # Expiry counts from when this candidate saw the record change, not from renewTime (which
    # another pod's clock wrote): 15 s after first seeing version 41.
    state, step = election.attempt(state, held, now=115.0, wall=wall(115))
    assert step == Update(
        LeaseRecord("op-b", 15, acquire_time="t=115", renew_time="t=115", transitions=4, resource_version="41"), "acquire"
    )


def test_a_renewal_by_the_holder_restarts_the_wait() -> None:
    state = election.initial_state("op-b", TIMING)
    state, _ = election.attempt(state, LeaseRecord("op-a", 15, "t=0", "t=0", 0, "1"), now=0.0, wall=wall(0))
    state, step = election.attempt(state, LeaseRecord("op-a", 15, "t=0", "t=12", 0, "2"), now=12.0, wall=wall(12))
    assert step == Wait("op-a", 15.0)
    state, step = election.attempt(state, LeaseRecord("op-a", 15, "t=0", "t=12", 0, "2"), now=20.0, wall=wall(20))
    assert step == Wait("op-a", 7.0)  # 15 s after 12, not after 0


def test_a_released_lease_is_taken_at_once() -> None:
    leader = election.written(election.initial_state("op-a", TIMING), LeaseRecord("op-a", 15, "t=0", "t=4", 0, "5"), now=4.0)
    release = election.release(leader, now=5.0, wall=wall(5))
    assert release == Update(LeaseRecord("", 1, acquire_time="t=0", renew_time="t=5", transitions=0, resource_version="5"), "release")
    assert not election.leading(election.stopped(leader), now=5.0)
    standby = election.initial_state("op-b", TIMING)
    _, step = election.attempt(standby, dataclasses.replace(release.record, resource_version="6"), now=5.1, wall=wall(5.1))
    assert isinstance(step, Update) and step.why == "acquire" and step.record.holder == "op-b" and step.record.transitions == 1
    assert election.release(standby, now=6.0, wall=wall(6)) is None  # nothing to release


def test_a_leader_that_cannot_renew_steps_down_at_the_renew_deadline() -> None:
    state = election.written(election.initial_state("op-a", TIMING), LeaseRecord("op-a", 15, "t=0", "t=0", 0, "1"), now=0.0)
    for t in (2.0, 4.0, 6.0, 8.0):
        state = election.failed(state, now=t)  # a conflict, a timeout, an unreachable API
        assert election.leading(state, now=t)
    state = election.failed(state, now=10.0)
    assert not election.leading(state, now=10.0) and state.renewed_at is None


def test_a_leader_that_reads_another_holder_stops_leading_at_once() -> None:
    state = election.written(election.initial_state("op-a", TIMING), LeaseRecord("op-a", 15, "t=0", "t=0", 0, "1"), now=0.0)
    state, step = election.attempt(state, LeaseRecord("op-b", 15, "t=1", "t=1", 1, "2"), now=1.0, wall=wall(1))
    assert isinstance(step, Wait) and not election.leading(state, now=1.0)


def test_the_lease_object_round_trips() -> None:
    record = LeaseRecord("op-a", 15, "2025-01-01T00:00:00.000000Z", "2025-01-01T00:00:02.000000Z", 2, "99")
    body = election.new_lease(record, namespace="training", name="bp-operator", labels={"app": "x"})
    assert body["metadata"] == {"name": "bp-operator", "namespace": "training", "labels": {"app": "x"}}
    assert election.record_of({**body, "metadata": {**body["metadata"], "resourceVersion": "99"}}) == record
    assert election.record_of(None) is None
    assert election.record_of({"metadata": {}, "spec": {}}) == LeaseRecord()


@pytest.mark.parametrize(
    ("duration", "deadline", "retry", "problem"),
    [
        (10, 10, 2, "lease_duration_s: must be > renew_deadline_s"),
        (15, 2, 2, "renew_deadline_s: must be > retry_period_s"),
        (15, 10, 0, "retry_period_s: must be a number > 0"),
        (float("inf"), 10, 2, "lease_duration_s: must be a number > 0"),
    ],
)
def test_bad_timing_is_refused(duration: float, deadline: float, retry: float, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ElectionSettings(duration, deadline, retry)


def test_an_empty_identity_is_refused() -> None:
    with pytest.raises(ValueError, match="identity"):
        election.initial_state("")


# ---- two candidates, one Lease --------------------------------------------------------------------


class Store:
    """The API server's part: one Lease, a resourceVersion per write, stale writes refused."""

    def __init__(self) -> None:
        self.lease: LeaseRecord | None = None
        self.version = 0

    def write(self, step: Create | Update) -> LeaseRecord | None:
        """Applies the write; None when refused (exists already, or stale resourceVersion)."""
        if isinstance(step, Create):
            if self.lease is not None:
                return None
        elif self.lease is None or step.record.resource_version != self.lease.resource_version:
            return None
        self.version += 1
        self.lease = dataclasses.replace(step.record, resource_version=str(self.version))
        return self.lease


def try_once(store: Store, state: election.ElectionState, now: float, *, reachable: bool = True) -> election.ElectionState:
    """One attempt of a candidate, as the driver makes it."""
    if not reachable:
        return election.failed(state, now=now)
    state, step = election.attempt(state, store.lease, now=now, wall=wall(now))
    if isinstance(step, Wait):
        return state
    written = store.write(step)
    return election.written(state, written, now=now) if written is not None else election.failed(state, now=now)


ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("advance"), st.one_of(st.floats(min_value=0.01, max_value=9.0), st.sampled_from([0.5, 1.0, 2.0, 5.0, 10.0, 15.0]))
        ),
        st.tuples(st.just("try"), st.sampled_from("ab"), st.booleans()),  # candidate, API reachable
        st.tuples(st.just("release"), st.sampled_from("ab"), st.booleans()),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ACTIONS)
def test_two_candidates_never_lead_at_once(actions: list[tuple]) -> None:
    store, now = Store(), 0.0
    states = {"a": election.initial_state("op-a", TIMING), "b": election.initial_state("op-b", TIMING)}
    for action in actions:
        if action[0] == "advance":
            now += action[1]
        elif action[0] == "try":
            states[action[1]] = try_once(store, states[action[1]], now, reachable=action[2])
        else:
            who, reachable = action[1], action[2]
            step = election.release(states[who], now=now, wall=wall(now))
            if step is not None and reachable:
                store.write(step)
            states[who] = election.stopped(states[who])
        leaders = [who for who, s in states.items() if election.leading(s, now=now)]
        assert len(leaders) <= 1, (leaders, now, store.lease)
        for who in leaders:  # a leader is the holder the store names
            assert store.lease is not None and store.lease.holder == states[who].identity


def test_a_leader_stops_before_a_standby_that_saw_its_last_renewal_at_once_may_take_over() -> None:
    store = Store()
    a = try_once(store, election.initial_state("op-a", TIMING), 0.0)
    b = try_once(store, election.initial_state("op-b", TIMING), 0.0)  # sees a's write the same instant
    for now in (9.99, 10.0, 14.99, 15.0):
        b = try_once(store, b, now)
        assert not (election.leading(a, now=now) and election.leading(b, now=now)), now
    assert election.leading(b, now=15.0) and not election.leading(a, now=10.0)


def test_a_standby_takes_over_from_a_silent_leader_within_a_lease_duration_and_a_retry() -> None:
    store, now = Store(), 0.0
    a, b = election.initial_state("op-a", TIMING), election.initial_state("op-b", TIMING)
    a = try_once(store, a, now)
    b = try_once(store, b, now)
    assert election.leading(a, now=now) and not election.leading(b, now=now)
    took_over = None
    while now < 60 and took_over is None:  # a is cut off from the API from t=0 on
        now += TIMING.retry_period_s
        a = try_once(store, a, now, reachable=False)
        b = try_once(store, b, now)
        if election.leading(b, now=now):
            took_over = now
    assert not election.leading(a, now=now)
    assert took_over is not None and TIMING.lease_duration_s <= took_over <= TIMING.lease_duration_s + TIMING.retry_period_s
    assert store.lease is not None and (store.lease.holder, store.lease.transitions) == ("op-b", 1)
