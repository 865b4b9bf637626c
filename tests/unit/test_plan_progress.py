"""The planner's request rules (`planner.progress`): start, serve, consumed, rewinds served from
the kept plans or re-planned, the ledger's horizon, and constructors that never pull. Pure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.errors import FailedPrecondition
from batchplane.planner.progress import PlanProgress, Replan, Serve, Start, start_step


def plan_through(p: PlanProgress, last: int) -> None:
    """The planning thread plans in sequence up to `last`."""
    while p.next_to_plan <= last:
        p.planned(p.next_to_plan)


def started(constructors: int = 2, *, at: int = 0, horizon: int = 0, pulling: tuple[int, ...] | None = None) -> PlanProgress:
    p = PlanProgress(range(constructors), pulling=pulling)
    assert isinstance(p.ask(0, at), Start)
    p.started(at, horizon=horizon)
    return p


def test_start_step_of_a_fresh_job_a_resume_and_a_restarted_planner() -> None:
    assert start_step(0, floor=None, rejoined={}) == 0
    assert start_step(40, floor=None, rejoined={}) == 40
    assert start_step(40, floor=35, rejoined={1: 33}) == 33


def test_requests_in_order_are_served_and_earlier_ones_refused() -> None:
    p = started(at=5)
    assert isinstance(p.ask(0, 5), Serve)
    assert isinstance(p.ask(0, 6, delivered_below=6), Serve)
    with pytest.raises(FailedPrecondition, match="already consumed"):
        p.ask(0, 5)
    with pytest.raises(FailedPrecondition, match="before step 5, where this job started"):
        p.ask(1, 4)


def test_plans_are_kept_until_every_constructor_handed_them() -> None:
    p = started()
    plan_through(p, 9)
    p.ask(0, 8, delivered_below=8)
    assert list(p.forget_consumed()) == []  # constructor 1 has handed nothing yet
    p.delivered(1, 4)
    assert list(p.forget_consumed()) == [0, 1, 2, 3]
    assert not p.kept(3) and p.kept(4) and p.consumed_below == 4


def test_a_rewind_to_a_kept_plan_is_served() -> None:
    p = started()
    plan_through(p, 9)
    p.ask(0, 8, delivered_below=8)
    assert isinstance(p.ask(0, 3, delivered_below=3, rewind=True), Serve)
    assert p.consumed_below == 0


def test_a_rewind_to_a_dropped_plan_replans_once_and_the_next_rank_is_served() -> None:
    p = started()
    plan_through(p, 20)
    for c in (0, 1):
        p.ask(c, 18, delivered_below=18)
    p.forget_consumed()
    assert not p.kept(10)
    assert p.ask(0, 10, delivered_below=10, rewind=True) == Replan(10)
    assert p.next_to_plan == 10 and p.consumed_below == 10
    assert isinstance(p.ask(1, 10, delivered_below=10, rewind=True), Serve)  # converges: no second re-plan
    with pytest.raises(FailedPrecondition, match="already consumed"):
        p.ask(1, 9)  # without rewind


def test_a_rewind_before_the_horizon_is_refused_naming_it_and_changes_nothing() -> None:
    p = started(at=50, horizon=40)
    plan_through(p, 60)
    for c in (0, 1):
        p.ask(c, 58, delivered_below=58)
    p.forget_consumed()
    with pytest.raises(FailedPrecondition, match="oldest step the planner's ledger can re-plan is 40"):
        p.ask(0, 39, rewind=True)
    assert p.consumed_below == 58 and p.next_to_plan == 61
    assert p.ask(0, 40, delivered_below=40, rewind=True) == Replan(40)
    assert p.start == 40


def test_constructors_that_never_pull_are_not_waited_for() -> None:
    p = started(3, pulling=(0,))
    plan_through(p, 9)
    p.ask(0, 7, delivered_below=7)
    assert list(p.forget_consumed()) == list(range(7))
    assert not p.finished(8)
    p.delivered(0, 8)
    assert p.finished(8)


def test_a_restarted_constructor_may_ask_again_from_what_its_ranks_were_handed() -> None:
    p = started()
    plan_through(p, 9)
    p.ask(1, 7, delivered_below=5)
    assert p.restarted(1) == 5
    assert isinstance(p.ask(1, 5, delivered_below=5), Serve)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["ask", "rewind", "plan", "heartbeat"]), st.integers(0, 2), st.integers(0, 30)), max_size=60
    )
)
def test_every_served_step_is_kept_or_still_to_be_planned(events: list) -> None:
    """Whatever constructors ask, a step the rules serve is kept or ahead of the planning cursor
    (so it will be planned), a re-plan moves the cursor to its step, and the kept plans never
    start above the slowest constructor's delivered step."""
    p = started(3, horizon=0)
    asked = {c: 0 for c in range(3)}
    for kind, c, step in events:
        if kind == "plan":
            plan_through(p, min(p.next_to_plan + step % 4, 40))
        elif kind == "heartbeat":
            p.delivered(c, min(step, asked[c]))
        else:
            rewind = kind == "rewind"
            if not rewind and step < asked[c]:
                with pytest.raises(FailedPrecondition):
                    p.ask(c, step)
                continue
            decision = p.ask(c, step, delivered_below=min(step, asked[c]) if rewind else step, rewind=rewind)
            asked[c] = step
            if isinstance(decision, Replan):
                assert decision.step == step and p.next_to_plan == step
            else:
                assert p.kept(step) or step >= p.next_to_plan
        p.forget_consumed()
        lo = min(s for s in range(0, 80) if p.kept(s) or s >= p.next_to_plan)
        assert lo <= p.consumed_below or lo == p.next_to_plan
