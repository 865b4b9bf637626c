"""When the planner writes the ledger records of what it planned (`Planning.record_due`), and
that no plan is served or handed along before its record is written (`Planning.answer`,
`Planning.following`). Pure: the planning thread is driven step by step, as `PlanBook` drives
it, so each test can look between two of its steps."""

from __future__ import annotations


import pytest
from hypothesis import given, settings, strategies as st
from plan_stub import Plan

from batchplane.planner.adaptive import AdaptiveRule
from batchplane.planner.mixture import MixtureState
from batchplane.planner.planning import RECORD_STEPS, PlanNext, Planning, StartAt
from batchplane.planner.progress import PlanProgress, Replan


def state(step: int) -> MixtureState:
    return MixtureState(step=step, cursors=(step,))


def started(*, ahead: int, lead: int = 40, adaptive: AdaptiveRule | None = None) -> Planning:
    planning = Planning(PlanProgress(range(1), lead=lead), ahead=ahead, adaptive=adaptive)
    planning.started(StartAt(0, {}), state=state(0), resume=None, horizon=0)
    return planning


def step_0_served(*, ahead: int = 15, lead: int = 40, adaptive: AdaptiveRule | None = None) -> Planning:
    """A started job whose constructor asked for step 0, planned and written."""
    planning = started(ahead=ahead, lead=lead, adaptive=adaptive)
    planning.ask(0, 0)
    plan_one(planning)
    record(planning)
    return planning


def plan_one(planning: Planning) -> int:
    """The planning thread plans the next step (one-step windows); returns it."""
    action = planning.next_action()
    assert isinstance(action, PlanNext)
    step = action.state.step
    assert planning.planned(action.epoch, [Plan(step)], before=state(step), end=state(step + 1))
    return step


def record(planning: Planning) -> list[int]:
    """The planning thread writes what `record_due` asks for; returns the steps written."""
    steps = list(planning.unrecorded)
    planning.recorded(planning.epoch, steps, delivered_below=planning.progress.consumed_below)
    return steps


def test_a_step_is_served_only_once_recorded_and_a_burst_is_recorded_in_one_write() -> None:
    planning = started(ahead=15)  # a constructor that takes 8 steps' plans at once
    planning.ask(0, 0)
    assert plan_one(planning) == 0
    assert planning.record_due(), "a request waits for step 0: its record is written at once"
    assert planning.answer(0) is None
    assert record(planning) == [0]
    assert planning.answer(0) == Plan(0)
    for step in range(1, 16):  # the rest of what the request wants planned, in one go
        assert plan_one(planning) == step
        assert planning.answer(step) is None and planning.following([step]) == []
        assert planning.record_due() == (step == 15), step
    assert planning.following(range(1, 8)) == []
    assert record(planning) == list(range(1, 16))
    assert planning.following(range(1, 8)) == [Plan(s) for s in range(1, 8)]


def test_a_request_for_an_unrecorded_step_has_it_written_at_once() -> None:
    planning = step_0_served()
    for _ in range(3):
        plan_one(planning)
    assert not planning.record_due()
    planning.ask(0, 2)
    assert planning.record_due()
    assert planning.following(range(1, 8)) == []


def test_groups_hold_at_most_record_steps() -> None:
    planning = step_0_served(ahead=3 * RECORD_STEPS, lead=4 * RECORD_STEPS)
    for step in range(1, RECORD_STEPS + 1):
        plan_one(planning)
        assert planning.record_due() == (step == RECORD_STEPS)


def test_an_adaptive_mixture_records_every_step_at_once() -> None:
    """The next step waits for the reports of training on the ones before: none may wait for
    its record."""
    planning = step_0_served(adaptive=AdaptiveRule(source_names=("a", "b"), initial=(1.0, 1.0), delay_steps=1))
    plan_one(planning)
    assert planning.record_due()


def test_a_rewind_serves_none_of_the_old_epochs_unwritten_plans_even_once_written() -> None:
    planning = step_0_served()
    for _ in range(5):
        plan_one(planning)
    old_epoch, old = planning.epoch, list(planning.unrecorded)
    planning.delivered(0, 3)
    assert isinstance(planning.ask(0, 0, rewind=True, delivered_below=0), Replan)
    assert planning.unrecorded == () and not planning.record_due()
    planning.recorded(old_epoch, old, delivered_below=3)  # PlanBook._rewind writes them to the old generation
    assert all(planning.answer(s) is None for s in old)


def test_stopping_drops_what_is_unrecorded() -> None:
    planning = started(ahead=15)
    planning.ask(0, 0)
    plan_one(planning)
    planning.stop()
    assert not planning.record_due()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ask", "plan", "record"]), st.integers(0, 40)), max_size=60), st.integers(1, 16))
def test_no_plan_is_served_or_handed_along_unrecorded_and_waiting_always_ends(script: list[tuple[str, int]], ahead: int) -> None:
    """Over random interleavings of requests, planning and writes: every plan that `answer` or
    `following` gives is of a step whose record was written, and when the planning thread has
    nothing left to plan, whatever it planned is due to be written (no request waits forever)."""
    planning = started(ahead=ahead)
    written: set[int] = set()
    asked = 0
    for what, n in script:
        if what == "ask":
            asked = max(asked, n)  # a constructor asks for rising steps
            planning.ask(0, asked)
        elif what == "plan" and isinstance(planning.next_action(), PlanNext):
            plan_one(planning)
        elif what == "record" and planning.record_due():
            written.update(record(planning))
        for step in range(0, 60):
            got = planning.answer(step)
            if isinstance(got, Plan):
                assert step in written, f"step {step} served before its record"
        for got in planning.following(range(asked + 1, asked + 8)):
            assert got.step in written, f"step {got.step} handed along before its record"
        if planning.next_action() is None and planning.unrecorded:
            assert planning.record_due(), "caught up with unrecorded steps that nothing will write"


@pytest.mark.parametrize("ahead", [1, 15])
def test_one_step_fetching_records_as_before_one_step_a_write(ahead: int) -> None:
    """A constructor asking for every step (fetch_steps 1, ahead 1) has every step written on
    its own, as before grouping; with ahead 15 the steps a request wants are grouped."""
    planning = started(ahead=ahead)
    writes = []
    for step in range(30):
        planning.ask(0, step)
        while True:
            if planning.record_due():
                writes.append(record(planning))
            elif isinstance(planning.next_action(), PlanNext):
                plan_one(planning)
            else:
                break
        assert planning.answer(step) == Plan(step)
        planning.delivered(0, step + 1)
    if ahead == 1:
        assert all(len(w) <= 2 for w in writes[1:]), writes
    else:
        assert max(len(w) for w in writes) >= 15, writes


def test_the_ranks_moving_on_has_the_next_step_written_at_once() -> None:
    """The ledger's floor (where a restarted planner resumes) follows the ranks: a step planned
    after they moved on is written at once, the rest of its burst together."""
    planning = step_0_served()
    for _ in range(15):
        plan_one(planning)
    record(planning)
    planning.ask(0, 8, delivered_below=8)  # the constructor handed 0..7 and asks for 8
    plan_one(planning)
    assert planning.record_due() and record(planning) == [16]
    for step in range(17, 24):
        plan_one(planning)
        assert planning.record_due() == (step == 23), step
