"""The planner's plan sequence (`planner.planning`, with the request rules of `planner.progress`)
driven as `book.PlanBook` drives it, with no threads, sockets or processes: the restart, rejoin
and rewind cases that only process-level tests covered (tests/integration/test_restarts.py,
test_rewind.py, test_resume_changes.py, test_chaos.py), each test naming the case it
reproduces. A plan stands for itself by its step: the plan sequence is a function of the
configuration, the seed and the ledger (I4), so a step planned again is the same plan. Pure."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st
from plan_stub import Plan

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import FailedPrecondition
from batchplane.planner.mixture import MixtureState
from batchplane.planner.planning import (
    AwaitRejoin,
    EndOfData,
    Failed,
    Halt,
    PlanNext,
    Planning,
    Rewind,
    StartAt,
    Stopping,
    job_planning,
    next_window,
    reads_floor,
    where_to_start,
)
from batchplane.planner.progress import Ahead, PlanProgress, Replan, Serve, Start
from batchplane.planner.strategy import job_mesh
from batchplane.planner.window import Resume, Window


@dataclasses.dataclass(frozen=True)
class Allocation:
    end_of_data: bool


def before(step: int) -> MixtureState:
    """The mixture's state before `step`: one sample a step, so its cursor is the step."""
    return MixtureState(step=step, cursors=(step,))


class OneSamplePerStep:
    """A mixture that takes one sample a step; its data ends before step `end`."""

    def __init__(self, end: int) -> None:
        self.end = end

    def allocate(self, state: MixtureState) -> tuple[Allocation, MixtureState]:
        if state.step >= self.end:
            return Allocation(True), state
        return Allocation(False), before(state.step + 1)


class Ledger:
    """The durable ledger as a planner reads it (`journal.LedgerReader`): generations, each from
    its first step with the records it wrote (per step, the `delivered_below` the record holds);
    a step's record that counts is the newest generation's that started at or before it."""

    def __init__(self) -> None:
        self.generations: list[tuple[int, dict[int, int]]] = []

    def open(self, step: int) -> None:
        """A new generation plans from `step` on (`restore.new_generation`)."""
        self.generations.append((step, {}))

    def write(self, step: int, delivered_below: int) -> None:
        self.generations[-1][1][step] = delivered_below

    def record(self, step: int) -> int | None:
        for start, records in reversed(self.generations):
            if start <= step:
                return records.get(step)
        return None

    def floor(self) -> int | None:
        """`restore.delivered_floor`: what the record of the latest step that counts says."""
        steps = sorted({s for _, records in self.generations for s in records}, reverse=True)
        last = next((s for s in steps if self.record(s) is not None), None)
        return None if last is None else self.record(last)

    def recorded_below(self) -> int:
        """The step after the latest one any generation recorded (`LedgerReader.last_recorded`)."""
        return max((s + 1 for _, records in self.generations for s in records), default=0)

    def horizon(self, step: int) -> int:
        """`restore.rewind_horizon`."""
        return min([*(start for start, _ in self.generations), step])


class Planner:
    """One planner process: `Planning` driven as `PlanBook` drives it, synchronously. A request
    lets the planning thread run until it waits; `plan(pause=True)` leaves the thread in the
    middle of a window (the lock released while it plans), so that requests interleave.

    Args:
        rejoined: `Membership.rejoined()`: the constructors that registered again with this
            (restarted) planner, and the step each needs next.
    """

    def __init__(
        self, constructors: int, *, ledger: Ledger, end: int, lead: int = 4, window: int = 1, rejoined: dict[int, int] | None = None
    ) -> None:
        self.planning = Planning(PlanProgress(range(constructors), lead=lead))
        self.constructors = constructors
        self.ledger = ledger
        self.mixture = OneSamplePerStep(end)
        self.window = window
        self.rejoined = dict(rejoined or {})
        self.paused: PlanNext | None = None
        self.rewinds = 0
        self.unrecorded: list[tuple[int, int]] = []  # (step, delivered_below when planned), not written yet
        self.unrecorded_epoch = 0

    def ask(self, c: int, step: int, *, delivered_below: int, rewind: bool = False, resume: bool = False) -> object:
        """`PlanBook.plan_for`: the plan, EndOfData, or None where it says UNAVAILABLE (retry)."""
        p = self.planning
        decision = p.ask(c, step, delivered_below=delivered_below, rewind=rewind)
        if isinstance(decision, Start):
            if self.rejoined:  # a restarted planner: asking says where it stands too
                self.rejoined.setdefault(c, min(step, delivered_below))
            if not self.start(step, resume=resume):
                return None
            decision = p.ask(c, step, delivered_below=delivered_below, rewind=rewind)
        if isinstance(decision, Ahead):  # wait while the planning thread plans what the window allows
            self.plan()
            if isinstance(p.ask(c, step, delivered_below=delivered_below, rewind=rewind, again=True), Ahead):
                return None
        self.plan()
        return self.take(c, step, delivered_below=delivered_below, rewind=rewind)

    def take(self, c: int, step: int, *, delivered_below: int, rewind: bool = False) -> object:
        """`PlanBook.plan_for` once its request is decided: waits for the plan, asking again
        while it was dropped before the request took it."""
        p = self.planning
        while p.dropped(step):
            assert not isinstance(p.ask(c, step, delivered_below=delivered_below, rewind=rewind), Ahead)
            self.plan()
        answer = p.answer(step)
        assert answer is not None, f"the plan of step {step} is never built"
        if isinstance(answer, Plan):
            assert self.ledger.record(step) is not None, f"step {step} is served before its ledger record is written"
            for plan in p.following(range(step + 1, step + 8)):
                assert self.ledger.record(plan.step) is not None, f"step {plan.step} is handed along before its record is written"
        return answer

    def start(self, step: int, *, resume: bool) -> bool:
        """`PlanBook._start`; False while it waits for constructors to rejoin."""
        floor = self.ledger.floor() if reads_floor(step, resume=resume, rejoined=self.rejoined) else None
        where = where_to_start(step, resume=resume, floor=floor, rejoined=self.rejoined, constructors=self.constructors)
        if isinstance(where, AwaitRejoin):
            return False
        horizon, recorded_below = self.ledger.horizon(where.step), self.ledger.recorded_below()
        self.ledger.open(where.step)
        self.planning.started(where, state=before(where.step), resume=None, horizon=horizon, recorded_below=recorded_below)
        return True

    def plan(self, *, pause: bool = False) -> None:
        """The planning thread, until it waits for an event."""
        while True:
            if self.paused is not None:
                action, self.paused = self.paused, None
                self._plan_window(action)
                continue
            action = self.planning.next_action()
            if isinstance(action, Halt):
                return
            if self.planning.record_due():
                self._record()
                continue
            if action is None:
                return
            if isinstance(action, Rewind):  # PlanBook._rewind: the state before the step from the ledger
                self._record()  # what the old epoch planned, written before the new generation opens
                self.planning.rewinding()
                self.ledger.open(action.step)
                self.planning.rewound(action.step, state=before(action.step), resume=None)
                self.rewinds += 1
            elif pause:
                self.paused = action
                return
            else:
                self._plan_window(action)

    def _record(self) -> None:
        """`PlanBook._record_planned`: writes what was planned and not written yet."""
        below = self.planning.progress.consumed_below
        for step, _ in self.unrecorded:
            self.ledger.write(step, below)
        self.planning.recorded(self.unrecorded_epoch, [step for step, _ in self.unrecorded], delivered_below=below)
        self.unrecorded = []

    def _plan_window(self, action: PlanNext) -> None:
        """`PlanBook._plan_next`: keeps the window's plans unless a rewind came in; their records
        are written when `Planning.record_due` says, before they are served."""
        p = self.planning
        planned = next_window(self.mixture, action.state, resume=p.take_resume(), steps=self.window)
        if planned is None:
            p.ended(action.state.step)
            return
        w = planned.window
        plans = [Plan(s) for s in range(max(w.first, planned.keep_from), w.first + w.steps)]
        below = p.progress.consumed_below
        if p.planned(action.epoch, plans, before=w.before, end=w.end):
            self.unrecorded += [(plan.step, below) for plan in plans]
            self.unrecorded_epoch = action.epoch


class Plane:
    """Trainers and their constructors around a planner, one rank per constructor or `ranks`:
    each rank asks for its next step; what it receives is logged. Kills and rewinds as the
    integration tests make them."""

    def __init__(self, constructors: int = 2, *, ranks: int = 1, end: int = 30, lead: int = 4, window: int = 1, first: int = 0) -> None:
        self.ledger = Ledger()
        self.end, self.lead, self.window = end, lead, window
        self.constructors, self.ranks = constructors, ranks
        self.planner = Planner(constructors, ledger=self.ledger, end=end, lead=lead, window=window)
        self.pos = {r: first for r in range(constructors * ranks)}  # rank -> the next step it needs
        self.resuming = set(self.pos) if first else set()  # ranks resumed from a checkpoint at `first`, in a new run folder
        self.rewinding: set[int] = set()  # ranks whose next request says `rewind`
        self.received: dict[int, list[int]] = {r: [] for r in self.pos}
        self.done: set[int] = set()
        self.unasked: set[int] = set()  # constructors restarted that have not asked for a step since
        self.building: set[int] = set()  # constructors one of whose ranks asked (`ConstructorProgress.start`)
        self.rewound_to: dict[int, list[int]] = {}  # rank -> the steps its trainer rewound to

    def constructor(self, rank: int) -> int:
        return rank // self.ranks

    def delivered_below(self, c: int) -> int:
        """Every step below it reached all of constructor `c`'s ranks."""
        return min(self.pos[r] for r in range(c * self.ranks, (c + 1) * self.ranks))

    def step(self, rank: int) -> bool:
        """Rank `rank` asks for its next step; returns whether it got it (or the end of data)."""
        if rank in self.done:
            return False
        c, step = self.constructor(rank), self.pos[rank]
        self.unasked.discard(c)
        self.building.add(c)
        try:
            below = min(step, self.delivered_below(c))
            got = self.planner.ask(c, step, delivered_below=below, rewind=rank in self.rewinding, resume=rank in self.resuming)
        except FailedPrecondition as exc:  # a rewind before the horizon (the trainer gives up on that checkpoint)
            assert rank in self.rewinding
            horizon = self.planner.planning.progress.horizon
            assert step < horizon and f"the oldest step the planner's ledger can re-plan is {horizon}" in str(exc)
            self.pos[rank] = self.received[rank][-1] + 1 if self.received[rank] else horizon
            self.rewinding.discard(rank)
            return False
        if got is None:
            return False
        self.resuming.discard(rank)
        if rank in self.rewinding:
            self.rewinding.discard(rank)
            self.rewound_to.setdefault(rank, []).append(step)
        if isinstance(got, EndOfData):
            assert step == self.end, f"rank {rank}: the data ended at step {step}"
            self.done.add(rank)
            return True
        assert got == Plan(step), f"rank {rank} asked for step {step} and got {got}"
        self.received[rank].append(step)
        self.pos[rank] = step + 1
        return True

    def prefetch(self, c: int, ahead: int) -> None:
        """Constructor `c` builds ahead of its slowest rank (`constructors.prefetch_steps`), once
        one of its ranks asked: where a rank's first request starts it (`ConstructorProgress.to_build`),
        so that a resumed rank's request, which says it resumes, comes first."""
        below = self.delivered_below(c)
        if (
            c in self.building
            and below + ahead <= self.end
            and not any(r in self.rewinding for r in range(c * self.ranks, (c + 1) * self.ranks))
        ):
            self.planner.ask(c, below + ahead, delivered_below=below)

    def heartbeat(self, c: int) -> None:
        """`PlanBook.constructor_delivered`: constructor `c` registers again."""
        self.planner.planning.delivered(c, self.delivered_below(c))

    def kill_constructor(self, c: int) -> int:
        """`PlanBook.constructor_restarted`: returns the step it starts at, as the planner says."""
        self.unasked.add(c)
        self.building.discard(c)
        return self.planner.planning.progress.restarted(c)

    def kill_planner(self) -> None:
        """A new planner on the same ledger; the constructors register again with the step they
        need next (those restarted since their last request, as fresh ones: they say it with
        their first request)."""
        rejoined = {c: self.delivered_below(c) for c in range(self.constructors) if c not in self.unasked}
        self.unasked.clear()
        self.planner = Planner(self.constructors, ledger=self.ledger, end=self.end, lead=self.lead, window=self.window, rejoined=rejoined)

    def rewind(self, rank: int, back: int) -> None:
        """Rank `rank`'s trainer restarts from a checkpoint `back` steps before its next step."""
        if rank not in self.done and self.received[rank]:
            self.pos[rank] = max(self.pos[rank] - back, 1)  # (a checkpoint at step 0 is a fresh start)
            self.rewinding.add(rank)

    def check_restore_point(self) -> None:
        """A restarted loader holds again what a constructor may still fetch: the restore point
        is at or before the oldest step a rank still needs (test_restarts: loader)."""
        point = self.planner.planning.restore_point()
        waiting = [self.pos[r] for r in self.pos if r not in self.done | self.rewinding]
        if point is not None and waiting and not self.planner.planning.interrupted:
            assert point[0] <= min(waiting), (point, self.pos)

    def finish(self) -> None:
        """Every rank runs to the end of data; nothing hangs. Only the constructors whose ranks
        are all done send heartbeats (they ask for nothing more): the others' requests alone
        move the planning window (chaos seed 210)."""
        for _ in range(4 * (self.end + self.lead + 2)):
            if len(self.done) == len(self.pos):
                break
            for r in sorted(self.pos, key=self.pos.get):
                self.step(r)
            for c in range(self.constructors):
                if all(r in self.done for r in range(c * self.ranks, (c + 1) * self.ranks)):
                    self.heartbeat(c)
        assert len(self.done) == len(self.pos), f"stuck at {self.pos}"
        for c in range(self.constructors):
            self.heartbeat(c)
        assert self.planner.planning.finished

    def assert_undisturbed(self) -> None:
        """Each rank received every step in order, going back only where its trainer rewound."""
        for rank, steps in self.received.items():
            for a, b in zip(steps, steps[1:]):
                assert b == a + 1 or (b <= a and b in self.rewound_to.get(rank, [])), (rank, steps)
            assert steps[-1] == self.end - 1


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(0, 3)),
        st.tuples(st.just("prefetch"), st.integers(0, 1), st.integers(1, 5)),
        st.tuples(st.just("heartbeat"), st.integers(0, 1)),
        st.tuples(st.just("plan"), st.just(0)),
        st.tuples(st.just("kill constructor"), st.integers(0, 1)),
        st.tuples(st.just("kill planner"), st.just(0)),
        st.tuples(st.just("rewind"), st.integers(0, 3), st.integers(0, 25)),
    ),
    max_size=80,
)


def disturb(plane: Plane, events: list, *, restore_point: bool = False) -> None:
    """Runs `events` on the plane; `restore_point`: checks it after each."""
    for event in events:
        kind = event[0]
        if kind == "step":
            plane.step(event[1] % len(plane.pos))
        elif kind == "prefetch":
            plane.prefetch(event[1], event[2])
        elif kind == "heartbeat":
            plane.heartbeat(event[1])
        elif kind == "plan":
            plane.planner.plan(pause=True)
        elif kind == "kill constructor":
            plane.kill_constructor(event[1])
        elif kind == "kill planner":
            # (Not after the end, and not while a rewind is in flight: no integration test does
            # that, and the ledger's floor then says nothing of the rewound ranks.)
            if len(plane.done) < len(plane.pos) and not plane.rewinding:
                plane.kill_planner()
        else:
            plane.rewind(event[1] % len(plane.pos), event[2])
        if restore_point:
            plane.check_restore_point()


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, ranks=st.sampled_from([1, 2]), window=st.sampled_from([1, 3]), first=st.sampled_from([0, 6]))
def test_killing_any_part_and_rewinding_at_random_changes_nothing_the_trainers_receive(
    events: list, ranks: int, window: int, first: int
) -> None:
    """test_chaos (a seeded killer SIGKILLs the planner and constructors at random steps),
    test_restarts (a planner, a constructor killed mid-job: the restarted planner resumes from
    its ledger's floor and the rejoined constructors' positions; the restarted constructor's
    lagging ranks find their steps) and test_rewind (ranks rewinding to different steps at
    different moments; a rewind before the horizon of a job resumed at step `first` in a new
    run folder), interleaved at random, with the planning thread caught mid-window: every rank
    receives every step's plan in order (going back only where its trainer rewound), a rewind
    before the horizon is refused naming it, no request waits for a plan that is never built,
    and the job finishes."""
    plane = Plane(ranks=ranks, window=window, first=first)
    disturb(plane, events)
    plane.finish()
    plane.assert_undisturbed()


@settings(max_examples=200, deadline=None)
@given(events=EVENTS, ranks=st.sampled_from([1, 2]), window=st.sampled_from([1, 3]))
def test_a_restarted_loader_holds_again_what_any_constructor_may_still_fetch(events: list, ranks: int, window: int) -> None:
    """test_restarts (loader) under test_chaos's kills: after every event, the restore point the
    planner gives a restarted loader is at or before the oldest step a rank still needs, so the
    loader reads again, at once, every window a constructor may still fetch. (Rewinds are left
    out: a rank that rewinds is re-planned, and its loaders read again from the rewind.)"""
    plane = Plane(ranks=ranks, window=window)
    disturb(plane, [e for e in events if e[0] != "rewind"], restore_point=True)
    plane.finish()
    plane.assert_undisturbed()


@settings(max_examples=200, deadline=None)
@given(
    positions=st.lists(st.integers(0, 20), min_size=2, max_size=2),
    asked=st.integers(0, 30),
    restarted=st.lists(st.booleans(), min_size=2, max_size=2),
)
def test_a_restarted_planner_starts_where_no_rank_misses_a_step(positions: list[int], asked: int, restarted: list[bool]) -> None:
    """test_restarts (planner) and chaos seed 210: the planner is killed while its ranks are at
    `positions`; the ledger's latest record says every rank was handed the steps below the
    slowest. Whichever constructor asks first and for what (a prefetch far ahead), the job
    resumes at or before every rank's step, and each rank then gets its own steps."""
    plane = Plane()
    plane.finish()  # a first run wrote the ledger up to the end
    floor = min(positions)
    plane.ledger.open(0)
    for s in range(floor + 1):
        plane.ledger.write(s, min(s, floor))
    plane.pos = {r: p for r, p in enumerate(positions)}
    plane.done.clear()
    plane.received = {r: [] for r in plane.pos}
    for c, again in enumerate(restarted):  # constructors killed too do not rejoin: they ask
        if again:
            plane.kill_constructor(c)
    plane.kill_planner()
    first = min(plane.pos[0] + asked % 6, plane.end - 1)  # its first request may be a prefetch
    plane.planner.ask(0, first, delivered_below=min(first, plane.pos[0]))
    if plane.planner.planning.progress.start is not None:
        assert plane.planner.planning.progress.start <= floor
    plane.finish()
    for rank, p in enumerate(positions):
        assert plane.received[rank] == list(range(p, plane.end))


def test_constructors_that_only_ask_ahead_of_a_restarted_planner_move_its_window() -> None:
    """Chaos seed 210: the planner was killed while its ranks were at steps 113 and 112 (their
    constructors had prefetched the plans up to there) and one constructor restarted too; the
    ledger's latest record said every rank had been handed the steps below 107, more than the
    window (lead 4) behind both. The restarted planner starts at 107; the ranks' own requests,
    all ahead of its window, move it on: both are served by their second request, with no
    heartbeat, and go on to the end."""
    plane = Plane(lead=4, end=130)
    plane.ledger.open(0)
    for s in range(5, 113):
        plane.ledger.write(s, min(s - 5, 107))
    plane.pos = {0: 113, 1: 112}
    plane.received = {0: [112], 1: [111]}
    plane.kill_constructor(0)
    plane.kill_planner()
    assert [plane.step(r) for r in plane.pos] == [False, False]  # ahead of the window
    assert plane.planner.planning.progress.start == 107
    assert [plane.step(r) for r in plane.pos] == [True, True]
    plane.finish()
    plane.assert_undisturbed()


def test_a_restarted_planner_whose_ledger_does_not_say_waits_for_every_constructor() -> None:
    """test_restarts (planner), a ledger without `delivered_below`: the restarted planner starts
    where the slowest constructor is, once every one has rejoined."""
    assert where_to_start(9, resume=False, floor=None, rejoined={1: 7}, constructors=2) == AwaitRejoin((0,))
    start = where_to_start(9, resume=False, floor=None, rejoined={1: 7, 0: 5}, constructors=2)
    assert isinstance(start, StartAt) and start.step == 5 and start.positions == {1: 7, 0: 5}
    assert "resuming at step 5" in start.note
    floor = where_to_start(9, resume=False, floor=6, rejoined={1: 7}, constructors=2)
    assert isinstance(floor, StartAt) and floor.step == 6 and "resuming at step 6" in floor.note
    lagging = where_to_start(9, resume=False, floor=6, rejoined={1: 4}, constructors=2)
    assert isinstance(lagging, StartAt) and lagging.step == 4, "a rejoined constructor below the floor lowers the start"
    assert reads_floor(0, resume=False, rejoined={1: 7}) and reads_floor(3, resume=False, rejoined={})
    assert not reads_floor(3, resume=True, rejoined={}) and not reads_floor(0, resume=False, rejoined={})


def test_a_resume_starts_at_its_checkpoint_and_a_fresh_job_at_0() -> None:
    """test_resume_changes (a job checkpointed at step k resumes there, across a change of the
    mixture and the mesh) and the first caller of a fresh job, which does not choose its start."""
    assert where_to_start(12, resume=True, floor=None, rejoined={}, constructors=4) == StartAt(12, {})
    fresh = where_to_start(12, resume=False, floor=None, rejoined={}, constructors=4)
    assert isinstance(fresh, StartAt) and fresh.step == 0 and "resumes from no checkpoint" in fresh.note
    plane = Plane(constructors=4)
    for r in plane.pos:
        assert plane.planner.ask(r, 12, delivered_below=12, resume=True) == Plan(12)
        plane.received[r], plane.pos[r] = [12], 13
    assert plane.planner.planning.progress.start == 12 == plane.planner.planning.progress.horizon
    plane.finish()
    assert all(got == list(range(12, plane.end)) for got in plane.received.values())


def test_a_rewind_before_the_horizon_of_a_new_run_folder_is_refused_and_the_horizon_is_served() -> None:
    """test_rewind: a job resumed at step 12 in a new run folder (its ledger starts there); a
    rank rewinding to step 5 is refused naming 12, also through a restarted constructor; a
    rank rewinding to 12 gets step 12's plan."""
    plane = Plane(lead=2)
    plane.pos = {r: 12 for r in plane.pos}
    for r in plane.pos:
        assert plane.planner.ask(r, 12, delivered_below=12, resume=True) == Plan(12)
        plane.pos[r] = 13
    for _ in range(3):
        for r in plane.pos:
            assert plane.step(r)
    plane.heartbeat(0)
    plane.heartbeat(1)
    for restart in (False, True):
        if restart:
            plane.kill_constructor(0)
        with pytest.raises(FailedPrecondition, match="cannot rewind to step 5: the oldest step the planner's ledger can re-plan is 12"):
            plane.planner.ask(0, 5, delivered_below=5, rewind=True)
    assert plane.planner.ask(0, 12, delivered_below=12, rewind=True) == Plan(12)


def test_ranks_rewinding_to_different_steps_at_different_moments_get_an_undisturbed_runs_plans() -> None:
    """test_rewind: both ranks trained to step 30 (the planner keeps no plan below it); rank 0
    rewinds to step 10 (re-planned from the ledger), and once it has three steps rank 1 rewinds,
    less far, to 20: served in the new sequence, not re-planned again. Each then gets the
    undisturbed run's plans to the end."""
    plane = Plane(end=50, lead=4)
    while min(plane.pos.values()) < 31:
        for r in plane.pos:
            plane.step(r)
        plane.heartbeat(0)
        plane.heartbeat(1)
    assert not plane.planner.planning.progress.kept(20)
    plane.rewind(0, plane.pos[0] - 10)
    for _ in range(3):
        assert plane.step(0)
    assert plane.planner.rewinds == 1 and plane.received[0][-3:] == [10, 11, 12]
    plane.rewind(1, plane.pos[1] - 20)
    while not plane.step(1):  # ahead of the window until rank 0 moves on
        assert plane.step(0)
    assert plane.received[1][-1] == 20
    assert plane.planner.rewinds == 1, "the second rank's rewind is served from the new sequence"
    plane.finish()
    assert plane.rewound_to == {0: [10], 1: [20]}
    plane.assert_undisturbed()


def test_a_plan_dropped_before_its_waiting_request_takes_it_is_planned_again() -> None:
    """test_hostile_planner (CI, one run): both constructors claimed delivery far ahead, then a
    request for constructor 1 asked for an earlier step, re-planned; before the request took
    the plan, constructor 1's heartbeat (its ranks are past the step) dropped it again. The
    request waited for a plan nothing would build, until its deadline; it asks again."""
    plane = Plane(end=48, lead=18)
    for _ in range(4):
        for r in plane.pos:
            plane.step(r)
    for _ in range(12):  # rank 1 runs on; rank 0 waits at step 4
        plane.step(1)
    plane.heartbeat(1)
    p = plane.planner.planning
    for c in (0, 1):  # far claims: believed up to the planning cursor
        assert plane.planner.ask(c, 10**9, delivered_below=10**9) is None
    assert p.progress.consumed_below > 6
    assert p.ask(1, 6, delivered_below=6) == Replan(6)
    plane.planner.plan()  # re-planned from 6 and recorded; the request has not taken it yet
    assert p.answer(6) == Plan(6) and not p.dropped(6)
    plane.heartbeat(1)  # its ranks are at 16: the plans below are dropped
    p.forget_consumed()
    plane.planner.plan()
    assert p.answer(6) is None and p.next_action() is None, "nothing would plan step 6 again"
    assert p.dropped(6)
    assert plane.planner.take(1, 6, delivered_below=6) == Plan(6)
    plane.finish()
    assert plane.received[0] == list(range(48))


def test_a_window_planned_across_a_rewind_is_not_kept() -> None:
    """test_rewind with the planning thread mid-window when the rewind comes in: what it planned
    then belongs to the old sequence (its epoch is stale); the sequence goes back."""
    plane = Plane(window=3)
    for _ in range(6):
        for r in plane.pos:
            plane.step(r)
        plane.heartbeat(0)
        plane.heartbeat(1)
    planning = plane.planner.planning
    step = plane.pos[0]
    ahead = planning.progress.next_to_plan  # a prefetch of the next step to plan: the thread plans on
    assert not isinstance(planning.ask(0, ahead, delivered_below=step), Ahead)
    plane.planner.plan(pause=True)
    in_flight = plane.planner.paused
    assert isinstance(in_flight, PlanNext)
    plane.planner.paused = None
    plane.rewind(0, 5)
    assert planning.ask(0, step - 5, delivered_below=step - 5, rewind=True) == Replan(step - 5)
    planning.take_resume()
    kept = planning.planned(
        in_flight.epoch, [Plan(s) for s in range(in_flight.state.step, in_flight.state.step + 3)], before=before(0), end=before(3)
    )
    assert not kept and planning.plans == {} and planning.next_action() == Rewind(step - 5)
    plane.finish()
    assert plane.rewound_to == {0: [step - 5]}
    plane.assert_undisturbed()


def test_a_resume_inside_a_window_plans_it_again_and_keeps_it_from_the_resume_step() -> None:
    """test_restarts (planner, token budgets planned 5 steps at a time): the restarted planner
    resumes inside a window and plans the window again from its start, keeping its steps from
    the resume step on; what a resume across a change left of a window is planned as it was
    allocated."""
    mixture = OneSamplePerStep(30)
    window = Window(first=5, steps=5, before=before(5), end=before(10))
    again = next_window(mixture, before(7), resume=Resume(window, 7), steps=5)
    assert again is not None and again.window == window and again.keep_from == 7 and len(again.allocations) == 5
    assert again.afters[-1] == before(10)
    left = dataclasses.replace(window, first=7, steps=3, leftover=True)
    rest = next_window(mixture, before(7), resume=Resume(left, 7), steps=5)
    assert rest is not None and rest.allocations == [None] * 3 and rest.afters == [before(10)] * 3
    assert next_window(mixture, before(28), resume=None, steps=5).window.steps == 2
    assert next_window(mixture, before(30), resume=None, steps=5) is None


def test_a_stopped_or_failed_planner_answers_every_waiting_request_and_its_thread_halts() -> None:
    planning = Planning(PlanProgress(range(2), lead=2))
    planning.started(StartAt(0, {}), state=before(0), resume=None, horizon=0)
    assert isinstance(planning.ask(0, 9, delivered_below=9), Ahead) and planning.answer(0) is None
    planning.fail("step 0: negative costs")
    assert planning.answer(0) == Failed("step 0: negative costs") and planning.next_action() == Halt()
    assert not isinstance(planning.ask(0, 9, delivered_below=9), Ahead), "a failed planner answers at once"
    planning.stop()
    assert planning.answer(0) == Stopping()
    planning.ended(0)
    assert planning.answer(0) == EndOfData()


@pytest.mark.parametrize(
    ("settings", "pulling", "lead"),
    [
        ({"mesh": {"pp": 3}}, {0, 1, 2}, 25),
        ({"mesh": {"pp": 3}, "constructors": {"pulling_ranks": "megatron", "prefetch_steps": 5}}, {0, 2}, 28),
        ({"mesh": {"pp": 3}, "constructors": {"prefetch_steps": 5, "fetch_steps": 1}}, {0, 1, 2}, 14),
        ({"mesh": {"pp": 3}, "constructors": {"prefetch_steps": 5, "fetch_steps": 1, "batch_steps": 1}}, {0, 1, 2}, 7),
        ({"batch": {"delivery": "journal"}, "journal": {"producers": 2}}, {0, 1}, 36),
    ],
)
def test_a_jobs_planning_waits_for_the_constructors_that_pull_and_leads_by_their_prefetch(settings: dict, pulling: set, lead: int) -> None:
    """`job_planning`, as `PlanBook` starts it: plans are kept until every constructor with a
    rank that asks for batches was handed them (a middle pipeline stage under `megatron` asks for
    none), and a request may ask `prefetch_steps + 2 * fetch_steps + batch_steps - 1` steps
    ahead (default 2, 8 and 8; batch_steps is 1 with journal delivery), times the journal
    producers (each prefetches its own steps, every `producers`-th)."""
    job = job_from_mapping({"job": "t", "sources": [{"name": "a", "path": "a"}], **settings})
    planning = job_planning(job, mesh=job_mesh(job), axis="DP", adaptive=None)
    planning.started(StartAt(0, {}), state=before(0), resume=None, horizon=0)
    assert planning.ask(0, lead + 1, delivered_below=0) == Ahead(lead)
    assert planning.ask(0, lead, delivered_below=0) == Serve()
    assert planning.planned(planning.epoch, [Plan(s) for s in range(3)], before=before(0), end=before(3))
    for c in range(job.constructor_count):
        assert planning.progress.consumed_below == (0 if pulling - set(range(c)) else 3)
        planning.delivered(c, 3)
    assert planning.progress.consumed_below == 3 and not planning.progress.kept(2)
