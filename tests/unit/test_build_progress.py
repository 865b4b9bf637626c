"""The constructor's build rules (`constructor.progress.BuildProgress`): start, serve, rewind,
prefetch, ranks that never ask, builds that finish across a rewind, what plan requests say, and
rejoining a restarted planner. Pure: milliseconds. The last cases replay, as unit cases, the
restart and rewind runs of tests/integration/test_restarts.py and test_rewind.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from batchplane.constructor.progress import BuildProgress
from batchplane.core.errors import FailedPrecondition, NotFound, Unavailable


def build_all(p: BuildProgress, *, end: int | None = None) -> list[int]:
    """Builds every step the rules allow now (instantly); returns them."""
    built = []
    while (step := p.to_build()) is not None:
        if end is not None and step >= end:
            p.ended(step, epoch=p.epoch)
        else:
            p.built(step, p.ranks, epoch=p.epoch)
            built.append(step)
    return built


def test_the_first_ask_starts_building_and_prefetch_runs_ahead_of_the_slowest_rank() -> None:
    p = BuildProgress((0, 1), prefetch_steps=2)
    assert p.to_build() is None
    asked = p.ask(0, 5)
    assert asked.started and p.start == 5
    assert build_all(p) == [5, 6, 7]  # rank 1 has not asked: it stands at the start
    p.ask(1, 5)
    p.ask(0, 6)
    assert build_all(p) == []  # rank 1 is still at 5
    p.ask(1, 7)
    assert build_all(p) == [8]  # rank 0 is at 6


def test_a_restarted_constructor_starts_at_the_oldest_step_its_ranks_may_ask_for() -> None:
    p = BuildProgress((0, 1), prefetch_steps=1, resume_step=3)
    p.ask(1, 8)
    assert p.start == 3 and build_all(p) == [3, 4]
    p.ask(0, 8)
    assert build_all(p) == [8, 9]  # steps below the slowest rank are skipped


def test_asking_for_an_earlier_step_is_refused_unless_the_trainer_restarted() -> None:
    p = BuildProgress((0,), prefetch_steps=1)
    p.ask(0, 0)
    build_all(p)
    p.ask(0, 1)
    with pytest.raises(FailedPrecondition, match="already consumed"):
        p.ask(0, 0)
    asked = p.ask(0, 0, restart=True)
    assert asked.rewound and p.next == 0 and not p.is_ready(0, 0)
    assert build_all(p)[:1] == [0]
    assert p.is_ready(0, 0)


def test_a_rewind_to_a_held_batch_builds_again_from_the_first_missing_step() -> None:
    p = BuildProgress((0, 1), prefetch_steps=3)
    p.ask(0, 0, restart=True)
    p.ask(1, 0, restart=True)
    build_all(p)  # 0..3
    p.ask(1, 2)  # rank 1 drops 0 and 1
    asked = p.ask(1, 1, restart=True)
    assert asked.rewound and p.next == 1
    asked = p.ask(0, 0, restart=True)  # rank 0 still holds 0..3
    assert p.is_ready(0, 0) and p.next == 1


def test_plan_requests_are_rewinds_up_to_what_the_planner_served_before_the_restart() -> None:
    p = BuildProgress((0,), prefetch_steps=2)
    p.ask(0, 0, restart=True)
    assert p.plan_request(p.to_build()).rewind  # the restart's own step
    p.built(0, (0,), epoch=p.epoch)
    assert not p.plan_request(p.to_build()).rewind
    p.built(1, (0,), epoch=p.epoch)
    assert not p.plan_request(p.to_build()).rewind
    p.built(2, (0,), epoch=p.epoch)
    p.ask(0, 2)
    p.ask(0, 1, restart=True)
    assert [p.plan_request(s).rewind for s in (1, 2, 3, 4)] == [True, True, False, False]


def test_a_rewind_before_the_oldest_step_the_planner_can_replan_is_refused_and_changes_nothing() -> None:
    p = BuildProgress((0,), prefetch_steps=1)
    p.ask(0, 50, restart=True)
    build_all(p)
    p.oldest = 40
    with pytest.raises(FailedPrecondition, match="oldest step the planner's ledger can re-plan is 40"):
        p.ask(0, 30, restart=True)
    assert p.next == 52 and p.is_ready(0, 50)


def test_a_build_finished_across_a_rewind_keeps_its_batches_but_does_not_move_building_on() -> None:
    p = BuildProgress((0,), prefetch_steps=3)
    p.ask(0, 0, restart=True)
    for _ in range(3):
        step = p.to_build()
        p.built(step, (0,), epoch=p.epoch)
    slow_step, slow_epoch = p.to_build(), p.epoch  # step 3, in flight
    p.ask(0, 2)
    p.ask(0, 1, restart=True)  # back to 1
    assert p.next == 1 and p.epoch == slow_epoch + 1
    p.built(slow_step, (0,), epoch=slow_epoch)
    assert p.next == 1 and p.is_ready(0, 3)


def test_ranks_that_never_ask_are_not_waited_for_and_their_batches_are_dropped() -> None:
    p = BuildProgress((0, 1, 2, 3), pulling=(0,), prefetch_steps=1)  # megatron: only rank 0 asks
    p.ask(0, 0)
    assert build_all(p) == [0, 1]
    for step in range(1, 6):
        p.ask(0, step)
        build_all(p)
    held = {(r, s) for r in range(4) for s in range(8) if p.is_ready(r, s)}
    assert {s for _, s in held} <= {5, 6}, held  # nothing of steps rank 0 moved past
    assert p.slowest() == 5


def test_the_end_of_data_stops_building_and_a_rewind_builds_again() -> None:
    p = BuildProgress((0,), prefetch_steps=5)
    p.ask(0, 0)
    assert build_all(p, end=3) == [0, 1, 2]
    assert p.past_end(3) and p.to_build() is None
    for step in (1, 2, 3):
        p.ask(0, step)
    p.ask(0, 0, restart=True)
    assert build_all(p, end=3) == [0, 1, 2] and p.past_end(3)


def test_finished_once_every_pulling_rank_asked_for_the_end_and_again_after_a_rewind() -> None:
    p = BuildProgress((0, 1, 2), pulling=(0, 1), prefetch_steps=5)
    p.ask(0, 0)
    assert build_all(p, end=2) == [0, 1]
    assert not p.finished()  # the end is known, but no rank has been handed it
    p.ask(0, 2)
    assert not p.finished()  # rank 1 has not
    p.ask(1, 1)
    p.ask(1, 2)  # rank 2 never asks (it does not pull): not waited for
    assert p.finished() and not p.finished()  # said once
    p.ask(1, 0, restart=True)  # a rewind: the loaders may be asked again
    assert not p.finished()
    build_all(p, end=2)
    p.ask(1, 2)
    assert p.finished()


@settings(max_examples=150, deadline=None)
@given(
    ranks=st.integers(1, 3),
    prefetch=st.integers(1, 3),
    end=st.integers(1, 12),
    actions=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["next", "restart", "build", "slow", "finish"]), st.integers(0, 12)), max_size=80
    ),
    stride=st.sampled_from([1, 1, 2, 3]),
    offset_seed=st.integers(0, 2),
)
def test_every_rank_gets_every_step_it_asks_for_whatever_the_rewinds(
    ranks: int, prefetch: int, end: int, actions: list, stride: int, offset_seed: int
) -> None:
    """A driver that builds what `to_build` says, with slow builds finishing late and trainers
    restarting anywhere: no rank ever waits forever, and what it is served is what it asked.
    With a stride (a journal producer building every stride-th step from `offset`) its ranks
    ask only for its own steps, and it builds only those."""
    offset = offset_seed % stride
    p = BuildProgress(range(ranks), prefetch_steps=prefetch, stride=stride, offset=offset)
    at = {r: None for r in range(ranks)}  # rank -> step it waits for
    in_flight: list[tuple[int, int]] = []

    def own_at_or_below(step: int) -> int:
        return max(step - (step - offset) % stride, offset)

    def finish(step: int, epoch: int) -> None:
        assert step % stride == offset, f"built step {step}, another producer's"
        if step >= end:
            p.ended(step, epoch=epoch)
        else:
            p.built(step, range(ranks), epoch=epoch)

    for rank, action, value in actions:
        rank %= ranks
        if action == "next":
            if at[rank] is None:
                at[rank] = offset
                p.ask(rank, offset, restart=True)
            elif p.is_ready(rank, at[rank]) or p.past_end(at[rank]):
                if not p.past_end(at[rank]):
                    at[rank] += stride
                    p.ask(rank, at[rank])
        elif action == "restart":  # anywhere the data plane has reached (further is refused: see below)
            at[rank] = own_at_or_below(min(value, end, p.furthest_step() if p.start is not None else value))
            p.ask(rank, at[rank], restart=True)
        elif action == "build" and (step := p.to_build()) is not None:
            finish(step, p.epoch)
        elif action == "slow" and (step := p.to_build()) is not None:
            in_flight.append((step, p.epoch))
        elif action == "finish" and in_flight:
            finish(*in_flight.pop(0))
    for step, epoch in in_flight:  # slow builds finish late
        finish(step, epoch)
    # Then every trainer runs to the end: the job must complete (no rank waits forever), and
    # every rank is served every step from where it last (re)started.
    for rank in range(ranks):
        if at[rank] is None:
            at[rank] = offset
            p.ask(rank, offset, restart=True)
    for _ in range(4 * (end + 2) * ranks):
        build_all(p, end=end)
        for rank in range(ranks):
            if not p.past_end(at[rank]):
                assert p.is_ready(rank, at[rank]) or p.slowest() < at[rank], (rank, at[rank], p.next, p.slowest())
                if p.is_ready(rank, at[rank]):
                    at[rank] += stride
                    p.ask(rank, at[rank])
        if all(p.past_end(step) for step in at.values()):
            break
    assert all(p.past_end(step) for step in at.values()), (at, p.next, p.end)


def test_a_step_ahead_of_what_the_ranks_reached_is_refused_and_changes_nothing() -> None:
    """A rank asking (or restarting at) a step far past every step asked here would make the
    constructor skip steps and ask the planner for steps the job has not reached."""
    p = BuildProgress((0, 1), prefetch_steps=1)
    p.ask(0, 4, restart=True)  # the first request sets the start
    p.ask(1, 4, restart=True)
    for step, restart in ((10**9, False), (10**15, True), (7, True)):
        with pytest.raises(FailedPrecondition, match="ahead of every step asked here"):
            p.ask(0, step, restart=restart)
    assert p.slowest() == 4 and p.to_build() == 4
    p.ask(0, 5)  # one step on
    build_all(p)
    assert p.furthest_step() == 6
    p.ask(1, 6)  # a prefetched step may be asked for directly


def test_reports_are_forwarded_only_for_steps_built_here() -> None:
    p = BuildProgress((0,), prefetch_steps=1)
    with pytest.raises(FailedPrecondition, match="no rank here has been given"):
        p.reportable(0)  # nothing built yet
    p.ask(0, 3, restart=True)
    p.plan_request(p.to_build())
    p.built(3, (0,), epoch=p.epoch)
    assert p.reportable(3) == ""
    with pytest.raises(FailedPrecondition):
        p.reportable(4)
    with pytest.raises(FailedPrecondition):
        p.reportable(10**12)
    p.oldest = 2
    assert p.reportable(2) == "" and "oldest step the planner's ledger keeps" in p.reportable(1)


def test_a_producer_builds_only_its_own_steps_and_refuses_anothers() -> None:
    """Journal producer 1 of 3: steps 1, 4, 7, ...; prefetch counts its own steps."""
    p = BuildProgress((0, 1), prefetch_steps=2, stride=3, offset=1, resume_step=3)
    with pytest.raises(FailedPrecondition, match="built by producer 0 of 3"):
        p.ask(0, 3)
    assert p.start is None, "a refused request starts nothing"
    p.ask(0, 4, restart=True)
    p.ask(1, 4, restart=True)
    assert p.start == 4  # resume_step 3 is producer 0's: the first own step from it
    assert build_all(p) == [4, 7, 10]
    p.ask(0, 7)
    p.ask(1, 7)
    assert build_all(p) == [13]
    assert p.furthest_step() == 16


def plan_all(p: BuildProgress, requests: list, *, end: int | None = None) -> None:
    """As `build_all`, asking the planner for each step first (the requests go to `requests`)."""
    while (step := p.to_build()) is not None:
        requests.append(p.plan_request(step))
        p.planned(0)
        if end is not None and step >= end:
            p.ended(step, epoch=p.epoch)
        else:
            p.built(step, p.ranks, epoch=p.epoch)


def test_a_plan_request_carries_the_starting_ranks_fingerprints_only_for_the_start_step() -> None:
    p = BuildProgress((0, 1), prefetch_steps=2)
    p.ask(1, 4, restart=True, resume={"data": "f1"})
    p.ask(0, 4, restart=True, resume={"data": "other"})  # building has started: not used
    requests: list = []
    plan_all(p, requests)
    assert [(r.step, dict(r.resume)) for r in requests] == [(4, {"data": "f1"}), (5, {}), (6, {})]
    assert [r.delivered_below for r in requests] == [4, 4, 4]
    p.ask(0, 5)
    p.ask(1, 6)
    plan_all(p, requests)
    assert [(r.step, r.delivered_below) for r in requests[3:]] == [(7, 5)]  # rank 0 has not been handed step 5 yet
    assert p.prefetched() == 2  # steps 6 and 7 past rank 0's step 5


def test_a_restarted_constructor_whose_ranks_lag_each_other_serves_both() -> None:
    """test_restarts.test_a_restarted_constructor_serves_ranks_that_lag_each_other: killed while
    rank 0 wanted step 8 and rank 1 step 6 (held), restarted with the oldest step either may ask
    for (6, the planner says); rank 0 reaches it first."""
    p = BuildProgress((0, 1), prefetch_steps=3, resume_step=6)
    assert p.rejoin_step() is None  # not planned for yet: nothing to tell a restarted planner
    asked = p.ask(0, 8, restart=True)
    assert asked.started and p.start == 6
    requests: list = []
    plan_all(p, requests)
    assert [r.step for r in requests] == [6, 7, 8, 9]  # rank 1 has not asked: it stands at the start
    assert all(r.delivered_below == 6 for r in requests)  # loaders keep step 6 and later for rank 1
    assert p.is_ready(0, 8) and p.rejoin_step() == 6
    p.ask(1, 6)  # the held rank goes on: its step is there
    assert p.is_ready(1, 6)
    for step in (7, 8):
        p.ask(1, step)
        plan_all(p, requests)
        assert p.is_ready(1, step)
    assert p.rejoin_step() == 8 and requests[-1].delivered_below == 8


def test_a_restarted_planner_is_rejoined_on_its_not_found_code_from_the_slowest_ranks_step() -> None:
    """test_restarts, part "planner": the planner restarted and answers NotFound (its status
    code) to a plan request; the constructor registers again from the step its slowest rank
    waits for. Any other error, whatever its text, is retried or raised, never a rejoin."""
    p = BuildProgress((0, 1), prefetch_steps=2)
    p.ask(0, 3, restart=True)
    p.ask(1, 3, restart=True)
    plan_all(p, [])
    p.ask(0, 4)
    p.ask(0, 5)
    assert p.rejoin_after(NotFound("constructor 0 has not registered")) == 3  # rank 1 is at 3
    assert p.rejoin_after(NotFound("")) == 3
    assert p.rejoin_after(Unavailable("constructor 0 has not registered")) is None
    assert p.rejoin_after(FailedPrecondition("constructor 0 has not registered")) is None
    p.ask(1, 5)
    assert p.rejoin_after(NotFound("x")) == 5


def test_ranks_rewinding_to_different_steps_at_different_moments_get_every_step_again() -> None:
    """test_rewind.test_ranks_rewinding_to_different_steps_at_different_moments_...: both ranks
    run to step 30; rank 0 restarts from its checkpoint at 10, rank 1 a little later from 20.
    Each is served every step from its checkpoint on; the plan requests of steps the planner
    served before are rewinds, those past them are not; loaders may release only below the
    slowest rank's step."""
    p = BuildProgress((0, 1), prefetch_steps=2)
    requests: list = []
    for step in range(31):
        for rank in (0, 1):
            p.ask(rank, step, restart=step == 0)
            plan_all(p, requests)
            assert p.is_ready(rank, step)
    furthest = max(r.step for r in requests)
    assert furthest == 32 and not any(r.rewind for r in requests[1:])
    served: dict[int, list[int]] = {0: [], 1: []}
    mark = len(requests)
    asked = p.ask(0, 10, restart=True)
    assert asked.rewound and p.next == 10
    for step in range(10, 13):  # rank 0 trains three steps before rank 1 restarts
        if step > 10:
            p.ask(0, step)
        plan_all(p, requests)
        assert p.is_ready(0, step)
        served[0].append(step)
    p.ask(1, 20, restart=True)
    at = {0: 12, 1: 20}
    while min(at.values()) < 40:
        for rank in (0, 1):
            if at[rank] < 40 and p.is_ready(rank, at[rank]):
                if not served[rank] or served[rank][-1] != at[rank]:
                    served[rank].append(at[rank])
                at[rank] += 1
                p.ask(rank, at[rank])
        plan_all(p, requests)
    assert served[0] == list(range(10, 40)) and served[1] == list(range(20, 40))
    again = requests[mark:]
    assert [r.step for r in again] == list(range(10, 43))  # built again from step 10 on, each once
    assert all(r.rewind == (r.step <= furthest) for r in again), [(r.step, r.rewind) for r in again]
    assert again[0].delivered_below == 10  # rank 0 went back to step 10: the loaders keep it again


@settings(max_examples=150, deadline=None)
@given(
    ranks=st.integers(1, 3),
    prefetch=st.integers(0, 3),
    actions=st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 10)), max_size=60),
)
def test_a_step_planned_before_is_asked_again_only_as_a_rewind_and_releases_never_pass_a_rank(
    ranks: int, prefetch: int, actions: list
) -> None:
    """Ranks moving on or restarting anywhere they reached: the planner, which drops a
    constructor's plans once it moved past them, is asked for a step again only with `rewind`;
    `delivered_below` is never past a rank's step (loaders would free its samples); the
    fingerprints go with the start step only."""
    p = BuildProgress(range(ranks), prefetch_steps=prefetch)
    at: dict[int, int] = {}
    requests: list = []
    for rank, restart, back in actions:
        rank %= ranks
        if rank in at and not restart:
            if not p.is_ready(rank, at[rank]):
                continue
            at[rank] += 1
        else:
            at[rank] = max(min(at.get(rank, 0), p.furthest_step() if p.start is not None else 0) - back, 0)
        p.ask(rank, at[rank], restart=restart or len(at) == 1, resume={"r": str(rank)})
        planned = len(requests)
        plan_all(p, requests)
        for i in range(planned, len(requests)):
            r = requests[i]
            if any(q.step >= r.step for q in requests[:i]):
                assert r.rewind, (r.step, [q.step for q in requests[:i]])
            assert r.delivered_below <= min(at.values(), default=r.step) or len(at) < ranks
            assert bool(r.resume) == (r.step == p.start)


def test_a_call_is_handed_the_following_steps_and_building_runs_ahead_of_them() -> None:
    """`GetBatchRequest.max_steps`: the steps after the asked one are handed as they are built,
    building runs `prefetch_steps` past the last one handed, and nothing is dropped before the
    rank asks again (a retry may ask for any of them)."""
    p = BuildProgress((0,), prefetch_steps=2)
    p.ask(0, 0, restart=True)
    assert build_all(p) == [0, 1, 2]
    p.hand(0, 1)
    assert build_all(p) == [3]
    p.hand(0, 2)
    p.hand(0, 3)
    assert build_all(p) == [4, 5]
    assert all(p.is_ready(0, s) for s in range(6))  # handed, not done with
    asked = p.ask(0, 2)  # the call broke after step 1: the retry asks for step 2
    assert not asked.rewound and asked.drop == ((0, 0), (0, 1))
    assert build_all(p) == []  # a new call: building runs past the asked step again
    with pytest.raises(FailedPrecondition, match="not past step 2"):
        p.hand(0, 2)


def test_building_waits_for_the_slowest_rank_whatever_the_others_were_handed() -> None:
    p = BuildProgress((0, 1), prefetch_steps=1)
    p.ask(0, 0, restart=True)
    p.ask(1, 0, restart=True)
    assert build_all(p) == [0, 1]
    p.hand(0, 1)
    assert build_all(p) == []  # rank 1 was handed nothing past step 0
    p.hand(1, 1)
    assert build_all(p) == [2]


def test_a_trainer_may_resume_one_step_past_what_its_call_was_handed() -> None:
    """A rank handed through step 3 checkpoints after it and restarts at step 4, while a rewind
    of another rank took building back: step 4 is one the data plane has reached."""
    p = BuildProgress((0, 1), prefetch_steps=3)
    p.ask(0, 0, restart=True)
    p.ask(1, 0, restart=True)
    build_all(p)
    for step in (1, 2, 3):
        p.hand(0, step)
        p.hand(1, step)
    p.ask(1, 0, restart=True)  # rank 1 rewinds
    p.ask(1, 1)
    p.ask(0, 4, restart=True)
    assert p.furthest_step() >= 5


@settings(max_examples=150, deadline=None)
@given(
    ranks=st.integers(1, 3),
    prefetch=st.integers(1, 3),
    end=st.integers(1, 14),
    calls=st.integers(1, 5),
    actions=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["take", "retry", "build", "restart"]), st.integers(0, 20)), max_size=60),
)
def test_calls_carrying_several_steps_get_every_step_in_order(ranks: int, prefetch: int, end: int, calls: int, actions: list) -> None:
    """Trainers whose calls carry up to `calls` steps (taking each following step once built,
    retrying from any step of a broken call, restarting anywhere reached): every step a rank
    takes is held for it, and the job completes."""
    p = BuildProgress(range(ranks), prefetch_steps=prefetch)
    asked: dict[int, int] = {}  # rank -> the step its current call asked for
    took: dict[int, int] = {}  # rank -> the last step it took (asked or handed) in the call

    def take(rank: int) -> None:
        """The rank's next step: handed within its call, or a new call once it took `calls`."""
        step = took[rank] + 1
        if p.past_end(step) or not p.is_ready(rank, took[rank]):
            return
        if step - asked[rank] < calls:
            if p.is_ready(rank, step):
                p.hand(rank, step)
                took[rank] = step
        else:
            p.ask(rank, step)
            asked[rank] = took[rank] = step

    for rank in range(ranks):
        p.ask(rank, 0, restart=True)
        asked[rank] = took[rank] = 0
    for rank, action, value in actions:
        rank %= ranks
        if action == "take":
            take(rank)
        elif action == "retry":  # the call broke: ask again from a step it carried
            step = asked[rank] + value % (took[rank] - asked[rank] + 1)
            if not p.past_end(step):
                p.ask(rank, step)
                asked[rank] = took[rank] = step
        elif action == "restart":
            step = min(value, end, p.furthest_step())
            p.ask(rank, step, restart=True)
            asked[rank] = took[rank] = step
        elif action == "build" and (step := p.to_build()) is not None:
            if step >= end:
                p.ended(step, epoch=p.epoch)
            else:
                p.built(step, range(ranks), epoch=p.epoch)
    for _ in range(4 * (end + 2) * ranks * calls):
        build_all(p, end=end)
        for rank in range(ranks):
            if not p.past_end(took[rank]):
                assert p.is_ready(rank, took[rank]) or p.slowest() < took[rank], (rank, took[rank], asked[rank], p.next)
                take(rank)
        if all(p.past_end(took[r]) or (p.end == took[r] + 1 and p.is_ready(r, took[r])) for r in range(ranks)):
            break
    assert all(p.past_end(took[r] + 1) for r in range(ranks)), (took, p.next, p.end)


@settings(max_examples=200, deadline=None)
@given(end=st.integers(1, 8), asked=st.integers(0, 7), extra=st.integers(0, 7), known_before=st.booleans())
def test_a_rank_told_its_last_step_has_reached_the_end_even_if_its_call_closes_there(
    end: int, asked: int, extra: int, known_before: bool
) -> None:
    """The header of a rank's batch says where the data ends, and the client asks for nothing
    past it: it may close its call before the call reaches the end step. Told with its last
    step (the asked one or one the call carries), the rank counts as having reached the end and
    the constructor as finished; told with an earlier step, it does not."""
    asked = min(asked, end - 1)
    told = min(asked + extra, end - 1)
    p = BuildProgress((0,), prefetch_steps=8)
    p.ask(0, asked, restart=True)
    if known_before:
        build_all(p, end=end)
    if told > asked:
        p.hand(0, told)
    if not known_before:
        assert p.told_end(0, told) == 0  # not known yet: the client asks for the next step
        build_all(p, end=end)
    assert p.told_end(0, told) == end
    last = told == end - 1
    assert p.slowest() == (end if last else asked)
    assert p.finished() == last


def test_a_call_that_reaches_the_end_of_data_counts_as_asking_for_it_and_keeps_its_batches() -> None:
    """A trainer that stops at the job's length never asks for the end step: the call that was
    handed the last step and reached the end says every step was handed (the loaders release
    everything), and a retry of the last steps is still served."""
    p = BuildProgress((0,), prefetch_steps=4)
    p.ask(0, 0, restart=True)
    assert build_all(p, end=3) == [0, 1, 2]
    p.hand(0, 1)
    p.hand(0, 2)
    assert p.slowest() == 0 and not p.finished()
    p.hand(0, 3)  # the end
    assert p.slowest() == 3 and p.finished()
    assert all(p.is_ready(0, s) for s in (0, 1, 2))
    p.ask(0, 2)  # a retry
    assert p.is_ready(0, 2)
