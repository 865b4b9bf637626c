"""When a reported loader replica is fenced (`planner.fence_votes.FenceVotes`): at the second distinct
constructor's report, or the first when the job has one; a constructor repeating its own report
never makes the quorum alone; what hostile constructors name is tracked within a bound. Pure."""

from __future__ import annotations

from hypothesis import given, strategies as st

from batchplane.planner.fence_votes import FENCE_QUORUM, MAX_TRACKED, FenceVotes


def test_one_constructor_alone_cannot_fence_but_a_second_one_agreeing_does() -> None:
    votes = FenceVotes(constructors=8)
    assert not any(votes.report(0, "10.0.0.5:50052", constructor=3) for _ in range(50))  # every plan request repeats it
    assert votes.report(0, "10.0.0.5:50052", constructor=5)
    assert not votes.report(0, "10.0.0.6:50052", constructor=3)  # another replica: its own votes


def test_a_job_with_one_constructor_fences_at_its_report() -> None:
    assert FenceVotes(constructors=1).report(1, "10.0.0.7:50052", constructor=0)


@given(reports=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 15)), max_size=80), constructors=st.integers(1, 16))
def test_the_quorum_is_reached_exactly_when_enough_distinct_constructors_reported(reports, constructors) -> None:
    votes = FenceVotes(constructors)
    seen: dict[int, set[int]] = {}
    for group, constructor in reports:
        seen.setdefault(group, set()).add(constructor)
        assert votes.report(group, "a", constructor) == (len(seen[group]) >= min(FENCE_QUORUM, constructors))


def test_what_hostile_constructors_name_is_kept_within_a_bound() -> None:
    votes = FenceVotes(constructors=4)
    for i in range(MAX_TRACKED + 500):
        votes.report(0, f"10.1.{i // 256}.{i % 256}:1", constructor=0)
    assert votes.reporters(0, "10.1.0.0:1") == 0  # the oldest went
    assert votes.reporters(0, f"10.1.{(MAX_TRACKED + 499) // 256}.{(MAX_TRACKED + 499) % 256}:1") == 1
