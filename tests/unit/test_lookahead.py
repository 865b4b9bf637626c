"""What a constructor keeps of the steps after the one it builds (`constructor.lookahead`): the
plans that came with a plan and the samples fetched with a step's, each used once in its turn,
dropped on a rewind, a failure or moving on. Pure: milliseconds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor.lookahead import Lookahead


def test_following_plans_are_taken_in_their_turn_and_their_samples_fetched_with_the_first() -> None:
    la: Lookahead[str, str] = Lookahead(4)
    assert la.plan(10, epoch=0, plain=True) is None  # nothing kept: ask the planner
    la.keep_plans({11: "p11", 12: "p12", 13: "p13", 14: "p14"}, epoch=0)
    assert la.following(10, epoch=0) == [(11, "p11"), (12, "p12"), (13, "p13")]  # 4 steps in all
    la.keep_fetched({11: "s11", 12: "s12"}, epoch=0)  # the loaders served a prefix
    assert la.plan(11, epoch=0, plain=True) == "p11" and la.fetched(11, epoch=0) == "s11"
    assert la.plan(12, epoch=0, plain=True) == "p12" and la.fetched(12, epoch=0) == "s12"
    assert la.plan(13, epoch=0, plain=True) == "p13" and la.fetched(13, epoch=0) is None
    assert la.following(13, epoch=0) == [(14, "p14")]
    assert la.kept == ([14], [])


def test_a_request_the_planner_must_hear_asks_it_and_drops_what_is_kept() -> None:
    """A rewind flag or resume fingerprints go to the planner: the kept plan is not used."""
    la: Lookahead[str, str] = Lookahead(3)
    la.keep_plans({1: "p1", 2: "p2"}, epoch=0)
    la.keep_fetched({1: "s1"}, epoch=0)
    assert la.plan(1, epoch=0, plain=False) is None
    assert la.kept == ([], [])


def test_a_rewind_drops_everything_and_what_comes_from_before_it_is_not_kept() -> None:
    la: Lookahead[str, str] = Lookahead(3)
    la.keep_plans({5: "p5", 6: "p6"}, epoch=0)
    la.keep_fetched({5: "s5"}, epoch=0)
    assert la.fetched(5, epoch=1) is None and la.kept == ([], [])  # building went back: epoch 1
    la.keep_plans({3: "late"}, epoch=0)  # an answer to a request from before the rewind
    la.keep_fetched({3: "late"}, epoch=0)
    assert la.plan(3, epoch=1, plain=True) is None and la.fetched(3, epoch=1) is None


def test_steps_below_the_one_built_are_dropped() -> None:
    la: Lookahead[str, str] = Lookahead(4)
    la.keep_plans({1: "p1", 2: "p2", 3: "p3"}, epoch=0)
    la.keep_fetched({1: "s1", 2: "s2"}, epoch=0)
    assert la.plan(3, epoch=0, plain=True) == "p3"  # its ranks skipped steps 1 and 2
    assert la.kept == ([], [])


def test_after_a_failure_fetches_take_one_step_until_one_succeeds() -> None:
    la: Lookahead[str, str] = Lookahead(4)
    la.keep_plans({1: "p1", 2: "p2"}, epoch=0)
    la.failed()
    assert la.kept == ([], [])
    la.keep_plans({1: "p1", 2: "p2"}, epoch=0)  # the plan asked again brings them again
    assert la.following(0, epoch=0) == []
    la.keep_fetched({}, epoch=0)  # the one-step fetch succeeded
    assert la.following(0, epoch=0) == [(1, "p1"), (2, "p2")]


def test_one_step_per_fetch_keeps_nothing_to_fetch_with_it() -> None:
    la: Lookahead[str, str] = Lookahead(1)
    la.keep_plans({1: "p1"}, epoch=0)
    assert la.following(0, epoch=0) == []
    with pytest.raises(ValueError, match="steps must be >= 1"):
        Lookahead(0)


BUILD = st.tuples(st.just("build"), st.integers(0, 5), st.integers(0, 5), st.booleans())
EVENTS = st.lists(st.one_of(BUILD, BUILD, BUILD, st.tuples(st.just("rewind"), st.integers(0, 6)), st.tuples(st.just("fail"))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 5), events=EVENTS)
def test_every_step_is_built_from_its_own_plan_and_samples_each_fetched_once_between_failures(k, events) -> None:
    """A build thread over random following plans (what the planner had planned), loaders
    serving random prefixes, requests the planner must hear, rewinds and failures: each step
    is built from the plan and samples of that very step got in the current epoch; a fetch
    takes at most k steps, rising from the one built; no step's samples are fetched twice in
    an epoch without a failure or a request the planner must hear between (both drop what is
    kept); what is kept never exceeds k - 1 steps each."""
    la: Lookahead[tuple, tuple] = Lookahead(k)
    epoch, step = 0, 0
    fetched_once: set[tuple[int, int]] = set()
    for event in events:
        if event[0] == "rewind":
            epoch, step = epoch + 1, max(step - event[1], 0)
            continue
        if event[0] == "fail":
            la.failed()
            fetched_once.clear()
            continue
        _, planned_ahead, served, plain = event
        plan = la.plan(step, epoch=epoch, plain=plain)
        if not plain:
            fetched_once.clear()
        if plan is None:  # the planner answers with the plans it has of the next steps
            plan = ("plan", step, epoch)
            la.keep_plans({t: ("plan", t, epoch) for t in range(step + 1, step + 1 + min(planned_ahead, k - 1))}, epoch=epoch)
        assert plan == ("plan", step, epoch)
        samples = la.fetched(step, epoch=epoch)
        if samples is None:
            following = la.following(step, epoch=epoch)
            steps = [step] + [t for t, _ in following]
            assert len(steps) <= k and steps == sorted(set(steps))
            assert all(p == ("plan", t, epoch) for t, p in following)
            for t in steps[: 1 + served]:
                assert (t, epoch) not in fetched_once
                fetched_once.add((t, epoch))
            la.keep_fetched({t: ("samples", t, epoch) for t in steps[1 : 1 + served]}, epoch=epoch)
            samples = ("samples", step, epoch)
        assert samples == ("samples", step, epoch)
        plans, kept = la.kept
        assert len(plans) <= k - 1 and len(kept) <= k - 1 and all(t > step for t in plans + kept)
        step += 1
