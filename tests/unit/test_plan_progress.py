"""The planner's request rules (`planner.progress`): start, serve, consumed, rewinds served from
the kept plans or re-planned, the ledger's horizon, constructors that never pull, and the bounds
on what a (hostile) request may move: the planning window and the delivered steps. Pure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.errors import FailedPrecondition
from batchplane.planner.progress import Ahead, PlanProgress, Replan, Serve, Start, start_step


def plan_through(p: PlanProgress, last: int) -> None:
    """The planning thread plans in sequence up to `last`."""
    while p.next_to_plan <= last:
        p.planned(p.next_to_plan)


def served_through(p: PlanProgress, last: int) -> None:
    """The planner plans up to `last` and hands every plan up to it to a constructor (answers a
    request for it, or sends it along with one's answer)."""
    plan_through(p, last)
    for step in range(p.start or 0, last + 1):
        p.served(step)


def started(
    constructors: int = 2,
    *,
    at: int = 0,
    horizon: int = 0,
    pulling: tuple[int, ...] | None = None,
    lead: int | None = None,
    recorded_below: int = 0,
) -> PlanProgress:
    p = PlanProgress(range(constructors), pulling=pulling, lead=lead)
    assert isinstance(p.ask(0, at), Start)
    p.started(at, horizon=horizon, recorded_below=recorded_below)
    return p


def test_start_step_of_a_fresh_job_a_resume_and_a_restarted_planner() -> None:
    assert start_step(0, floor=None, rejoined={}) == 0
    assert start_step(40, floor=None, rejoined={}, resume=True) == 40
    assert start_step(40, floor=35, rejoined={1: 33}) == 33


def test_the_first_caller_does_not_choose_where_a_fresh_job_starts() -> None:
    """Attack c: the first request of a fresh job asked for step 100 and steps 0-99 were
    skipped. Without a checkpoint to resume from (or a ledger), a fresh job starts at 0."""
    assert start_step(100, floor=None, rejoined={}) == 0
    assert start_step(10**15, floor=None, rejoined={}) == 0
    assert start_step(10**9, floor=35, rejoined={}) == 35, "a restarted planner starts where its ledger says"
    assert start_step(10**9, floor=35, rejoined={0: 10**9}) == 35, "a rejoining constructor cannot raise the start"


def test_requests_are_served_in_any_order_while_kept_and_replanned_once_dropped() -> None:
    p = started(at=5)
    assert isinstance(p.ask(0, 5), Serve)
    assert isinstance(p.ask(0, 6, delivered_below=6), Serve)
    assert isinstance(p.ask(0, 5), Serve), "retrying a kept step returns the same plan"
    with pytest.raises(FailedPrecondition, match="before step 5, where this job started"):
        p.ask(1, 4)
    plan_through(p, 8)
    for c in (0, 1):
        p.ask(c, 7, delivered_below=7)
    p.forget_consumed()
    assert not p.kept(5)
    assert p.ask(0, 5, delivered_below=5) == Replan(5), "a dropped step is planned again from the ledger, never refused"
    assert p.consumed_below == 5


def test_a_request_for_another_constructor_cannot_make_its_own_requests_fail() -> None:
    """Attack d: a GetPlan naming constructor 1 with a later step made constructor 1's own next
    request "already consumed", and its trainer died. A kept step is served whoever asked what."""
    p = started(lead=4)
    plan_through(p, 4)
    assert isinstance(p.ask(1, 4, delivered_below=4), Serve)  # the hostile request, within the window
    for step in range(0, 4):
        assert isinstance(p.ask(1, step, delivered_below=step), Serve)
    assert p.consumed_below == 0, "constructor 0 handed nothing: no plan is dropped"


def test_a_step_past_the_window_is_told_to_wait_and_moves_nothing_past_the_served_frontier() -> None:
    """Attacks a and c: GetPlan{step: 1e9, delivered_below: 1e9} ended the job at step 28, and
    step 1e15 kept the planner planning. A step more than `lead` past what every constructor
    handed is told to wait; what the request says its ranks were handed is believed only up to
    the served frontier, as for any request, so the window moves at most that far."""
    p = started(lead=4)
    served_through(p, 2)
    assert p.ask(0, 10**9, delivered_below=10**9) == Ahead(4)  # constructor 1 still holds the window
    assert p.ask(0, 5, delivered_below=5) == Ahead(4)
    assert p.consumed_below == 0 and p.limit == 4 and not p.finished(3)
    assert p.ask(1, 10**9, delivered_below=10**9) == Ahead(7)
    assert p.consumed_below == 3 == p.served_below  # never past what was served
    assert p.restarted(0) == 3
    assert isinstance(p.ask(1, 7, delivered_below=0), Serve), "the window's last step is served"


def test_how_far_the_planning_thread_ran_ahead_does_not_change_what_a_claim_moves() -> None:
    """tests/unit/test_planner_request_bounds.py failed two runs in three beside three busy
    loops: a far claim was believed up to the planning cursor, and how far the planning thread
    had run ahead of the requests depends on how busy the machine is. Planned but never served,
    a step cannot have been handed."""
    slow, fast = started(lead=4), started(lead=4)
    served_through(slow, 2)
    served_through(fast, 2)
    plan_through(fast, 4)  # the planning thread ran ahead, up to one step past the window
    for p in (slow, fast):
        for c in (0, 1):
            p.ask(c, 10**9, delivered_below=10**9)
    assert slow.consumed_below == fast.consumed_below == 3
    assert slow.limit == fast.limit == 7


def test_constructors_that_only_ask_ahead_still_move_the_window() -> None:
    """Chaos seed 210: the planner restarted at step 107 and a constructor restarted too; its
    rank asked for step 113, the other constructor's for 112, both past the window of the
    restarted planner (107 + lead). Their requests say their ranks were handed everything below
    those steps: once the planner has planned up to its window, the window moves and both are
    served, without a heartbeat."""
    p = started(at=107, lead=4, recorded_below=114)  # the planner before served up to step 113
    assert p.ask(1, 112, delivered_below=112) == Ahead(111)
    assert p.ask(0, 113, delivered_below=113) == Ahead(111)
    plan_through(p, 111)  # the planning thread plans what the window allows
    assert p.ask(1, 112, delivered_below=112) == Ahead(111)  # constructor 0's claim still stops at the old cursor
    assert isinstance(p.ask(0, 113, delivered_below=113), Serve)  # its retry: the window moves
    assert isinstance(p.ask(1, 112, delivered_below=112), Serve)
    assert p.consumed_below == 112


def test_delivered_steps_are_believed_up_to_the_served_frontier() -> None:
    """Attacks a and b: delivered_below or a rejoining constructor's next_step of 1e9 dropped the
    kept plans and declared the job finished. No rank can have been handed a step never served,
    and a constructor that asks for a step its false claim dropped gets it planned again."""
    p = started(lead=4)
    served_through(p, 2)  # steps 0..2 planned and handed to constructors
    p.ask(0, 3, delivered_below=3)
    p.delivered(1, 10**9)  # a heartbeat: RegisterConstructor{rejoin, next_step: 1e9}
    assert p.consumed_below == 3 and p.restarted(1) == 3
    assert not p.finished(4)
    assert list(p.forget_consumed()) == [0, 1, 2]
    assert p.ask(1, 1, delivered_below=1) == Replan(1), "constructor 1's own trainer still gets step 1"
    assert p.consumed_below == 1


def test_the_window_moves_with_the_slowest_constructor() -> None:
    p = started(lead=2)
    assert p.ask(0, 3) == Ahead(2)
    served_through(p, 3)
    p.ask(1, 1, delivered_below=1)
    assert p.ask(0, 3, delivered_below=0) == Ahead(2), "constructor 0 handed nothing yet"
    p.delivered(0, 1)  # a heartbeat says it has handed step 0
    assert isinstance(p.ask(0, 3, delivered_below=0), Serve)
    assert p.limit == 3


def test_plans_are_kept_until_every_constructor_handed_them() -> None:
    p = started()
    served_through(p, 9)
    p.ask(0, 8, delivered_below=8)
    assert list(p.forget_consumed()) == []  # constructor 1 has handed nothing yet
    p.delivered(1, 4)
    assert list(p.forget_consumed()) == [0, 1, 2, 3]
    assert not p.kept(3) and p.kept(4) and p.consumed_below == 4


def test_a_rewind_to_a_kept_plan_is_served() -> None:
    p = started()
    served_through(p, 9)
    p.ask(0, 8, delivered_below=8)
    assert isinstance(p.ask(0, 3, delivered_below=3, rewind=True), Serve)
    assert p.consumed_below == 0


def test_a_rewind_to_a_dropped_plan_replans_once_and_the_next_rank_is_served() -> None:
    p = started()
    served_through(p, 20)
    for c in (0, 1):
        p.ask(c, 18, delivered_below=18)
    p.forget_consumed()
    assert not p.kept(10)
    assert p.ask(0, 10, delivered_below=10, rewind=True) == Replan(10)
    assert p.next_to_plan == 10 and p.consumed_below == 10
    assert isinstance(p.ask(1, 10, delivered_below=10, rewind=True), Serve)  # converges: no second re-plan
    assert p.ask(1, 9) == Replan(9), "a stale request for a dropped step costs a re-plan"


def test_a_rewind_before_the_horizon_is_refused_naming_it_and_changes_nothing() -> None:
    p = started(at=50, horizon=40)
    served_through(p, 60)
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
    served_through(p, 9)
    p.ask(0, 7, delivered_below=7)
    assert list(p.forget_consumed()) == list(range(7))
    assert not p.finished(8)
    p.delivered(0, 8)
    assert p.finished(8)


def test_a_restarted_constructor_may_ask_again_from_what_its_ranks_were_handed() -> None:
    p = started()
    served_through(p, 9)
    p.ask(1, 7, delivered_below=5)
    assert p.restarted(1) == 5
    assert isinstance(p.ask(1, 5, delivered_below=5), Serve)


def test_a_rewind_through_a_restarted_constructor_lowers_what_it_handed() -> None:
    """A trainer restarts from an older checkpoint through a constructor that restarted too
    (a whole pod): its first request is a rewind the planner has no earlier request to compare
    with. The plans from the restore point must stay kept, not be dropped for a claim of
    delivery made before the restart."""
    p = started()
    served_through(p, 9)
    p.ask(0, 8, delivered_below=8)
    p.ask(1, 5, delivered_below=5)
    assert p.restarted(0) == 8
    assert isinstance(p.ask(0, 6, delivered_below=6, rewind=True), Serve)
    p.ask(1, 8, delivered_below=8)
    assert p.consumed_below == 6, "the rewound ranks still need steps 6 and 7"
    assert list(p.forget_consumed()) == list(range(6))
    assert isinstance(p.ask(0, 7, delivered_below=7), Serve), "served from the kept plan, not re-planned"


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from(["ask", "rewind", "plan", "heartbeat"]), st.integers(0, 2), st.integers(0, 30)), max_size=60)
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
            decision = p.ask(c, step, delivered_below=min(step, asked[c]) if rewind else step, rewind=rewind)
            asked[c] = step if rewind else max(asked[c], step)
            if isinstance(decision, Replan):
                assert decision.step == step and p.next_to_plan == step
            else:
                assert p.kept(step) or step >= p.next_to_plan
        p.forget_consumed()
        lo = min(s for s in range(0, 80) if p.kept(s) or s >= p.next_to_plan)
        assert lo <= p.consumed_below or lo == p.next_to_plan


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["ask", "rewind", "plan", "heartbeat"]), st.integers(0, 2), st.integers(0, 10**12)), max_size=60
    )
)
def test_whatever_is_asked_the_window_and_the_delivered_steps_stay_bounded(events: list) -> None:
    """Hostile values everywhere: a request past the window plans nothing; what a constructor
    is believed to have handed (by a request, answered or told to wait, or a heartbeat) never
    passes the planning cursor nor the served frontier; so the planner never plans, keeps or frees past `lead` steps
    beyond what every constructor was handed."""
    lead = 3
    p = started(3, lead=lead)
    for kind, c, step in events:
        if kind == "plan":
            limit = p.limit
            if p.next_to_plan <= limit + 1:  # the planner plans up to one past the window's limit
                p.planned(p.next_to_plan)
        elif kind == "heartbeat":
            p.delivered(c, step)
        else:
            before = (p.consumed_below, p.limit, p.next_to_plan)
            try:
                decision = p.ask(c, step, delivered_below=step, rewind=kind == "rewind")
            except FailedPrecondition:
                continue
            if isinstance(decision, Ahead):
                assert step > decision.limit == p.limit and p.next_to_plan == before[2]
                assert before[0] <= p.consumed_below <= p.next_to_plan
        p.forget_consumed()
        assert p.consumed_below <= min(p.next_to_plan, p.served_below)
        assert p.next_to_plan <= p.consumed_below + lead + 2


def test_a_request_told_to_wait_moves_the_window_once_however_long_it_waits() -> None:
    """The planner re-asks a waiting request as its planning goes on (`again`): the request's
    claim counted when first asked, so a far claim moves the window by one window per request,
    never on to the end of the job while one request waits."""
    p = started(lead=4)
    served_through(p, 2)
    assert p.ask(0, 10**9, delivered_below=10**9) == Ahead(0 + 4)  # constructor 1 handed nothing yet
    assert p.ask(1, 10**9, delivered_below=10**9) == Ahead(3 + 4)  # both believed up to the served frontier
    for _ in range(5):  # the planning thread plans what the window allows; the request waits on
        plan_through(p, p.limit + 1)
        assert p.ask(0, 10**9, delivered_below=10**9, again=True) == Ahead(7)
    assert p.consumed_below == 3


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["ask", "far", "rewind", "plan", "heartbeat"]), st.integers(0, 2), st.integers(0, 30)), max_size=60
    )
)
def test_a_served_step_survives_the_drop_of_consumed_plans_whatever_was_claimed_before(events: list) -> None:
    """The driver drops the plans below `consumed_below` right after each decision. A claim of
    delivery recorded earlier by a request told to wait (a far step, as attack a sends) may have
    moved `consumed_below` past a step nobody asked for since: a request for that step must then
    be re-planned, not served from a plan about to be dropped (the planner waited for it for
    ever: tests/unit/test_planner_request_bounds.py, one run in four)."""
    p = started(3, horizon=0, lead=4)
    asked = {c: 0 for c in range(3)}
    for kind, c, step in events:
        if kind == "plan":
            plan_through(p, min(p.next_to_plan + step % 4, max(p.limit or 0, 0)))
        elif kind == "heartbeat":
            p.delivered(c, min(step, asked[c]))
        else:
            if kind == "far":
                step = 10**9
            rewind = kind == "rewind"
            decision = p.ask(c, step, delivered_below=min(step, asked[c]) if rewind else step, rewind=rewind)
            if isinstance(decision, Ahead):
                continue  # the driver gives up on it without dropping anything (Unavailable)
            asked[c] = step if rewind else max(asked[c], step)
            p.forget_consumed()
            if isinstance(decision, Replan):
                assert decision.step == step and p.next_to_plan == step
            else:
                assert p.kept(step) or step >= p.next_to_plan, (step, p.consumed_below, p.next_to_plan)
