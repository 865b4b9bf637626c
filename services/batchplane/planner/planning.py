"""The course of a job's plan sequence: where the job starts, what the planning thread does next,
which planned plans are kept, where the data ends, what a plan request is answered, and which
training reports wait to be applied. Pure: no threads, clocks, I/O or grpc; `book.PlanBook`
feeds it events under its lock (a request, a start, a planned window, the end of data, a rewind
carried out, a report, a heartbeat, a constructor restart, a stop or a failure) and does what it
decides (start the job, plan the next window, re-plan from a step, wait).

It holds the request rules' `progress.PlanProgress` and adds what the planning thread decides:
- Where a job starts (`where_to_start`): a fresh job at 0, a resume where its checkpoint says, a
  restarted planner where its ledger's floor and its rejoined constructors say, or, when the
  ledger does not say, where the slowest constructor is once every one has rejoined.
- What comes next (`next_action`): stop, carry out a rewind (`Rewind`: a request was told to
  re-plan a step no longer kept), plan the next window (`PlanNext`) while a request wants a step
  the sequence has not reached and the data has not ended, or wait.
- A window planned across a rewind (its `epoch` is stale) is not kept: the sequence went back.
- The next window (`next_window`): a resume or rewind inside a window plans that window again
  (the same plans, kept from the resume step on) or what it left (settings changed), else the
  mixture's allocations of the next `steps` steps; none left is the end of data.
- A request is answered (`answer`) past the end of data with END_OF_DATA, while stopped or after
  a permanent failure with those, else with the kept plan once it is planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from batchplane.core.config import JobSettings
from batchplane.core.delivery import DeliveryRules
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner.adaptive import AdaptiveRule, AdaptiveState, update
from batchplane.planner.bounds import ReportRefusal, plan_lead, report_refusal
from batchplane.planner.mixture import Allocation, Mixture, MixtureState
from batchplane.planner.plan import StepPlan
from batchplane.planner.progress import Ahead, Decision, PlanProgress, Replan, Serve, Start, start_step
from batchplane.planner.window import Resume, Window, allocate


@dataclasses.dataclass(frozen=True)
class StartAt:
    """Start the job at `step`.

    Attributes:
        step: Where it starts.
        positions: The steps the rejoined constructors (of a restarted planner) asked for last.
        note: What to log about the choice ("" when the first request chose it).
    """

    step: int
    positions: Mapping[int, int]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class AwaitRejoin:
    """A restarted planner whose ledger does not say where ranks stand: wait for `waiting` (the
    constructors that have not rejoined yet) and decide again."""

    waiting: tuple[int, ...]


def reads_floor(asked: int, *, resume: bool, rejoined: Mapping[int, int]) -> bool:
    """Whether the ledger's floor (`restore.delivered_floor`) counts for a start: for a restarted
    planner (constructors rejoined it), or a first request past step 0 with no checkpoint."""
    return bool(rejoined) or (asked > 0 and not resume)


def where_to_start(asked: int, *, resume: bool, floor: int | None, rejoined: Mapping[int, int], constructors: int) -> StartAt | AwaitRejoin:
    """Where a job starts whose first plan request asks for `asked`.

    Args:
        resume: The request carries the fingerprints of the checkpoint a trainer resumes from.
        floor: The ledger's floor, where `reads_floor` says it counts (else None).
        rejoined: The oldest step each constructor that rejoined a restarted planner may ask for.
        constructors: The job's constructor count.
    """
    if floor is not None:  # a restarted planner: no rank needs a step below the ledger's floor
        step = start_step(asked, floor=floor, rejoined=rejoined)
        return StartAt(
            step,
            dict(rejoined),
            f"restarted: every rank had been handed the steps below {floor} (the ledger), the constructors that rejoined need "
            f"{dict(rejoined)}; resuming at step {step}",
        )
    if rejoined:  # restarted, but the ledger does not say: start where the slowest constructor is
        waiting = tuple(sorted(set(range(constructors)) - set(rejoined)))
        if waiting:
            return AwaitRejoin(waiting)
        step = min(rejoined.values())
        return StartAt(step, dict(rejoined), f"restarted: the constructors need steps {dict(rejoined)}; resuming at step {step}")
    step = start_step(asked, floor=None, rejoined={}, resume=resume)
    note = "" if step == asked else f"a fresh job starts at step 0: the first request, for step {asked}, resumes from no checkpoint"
    return StartAt(step, {}, note)


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The next window to plan.

    Attributes:
        window: Its steps and the mixture states around them.
        keep_from: Its first step to keep (a resume inside it planned the ones before already).
        allocations: Per step, the mixture's allocation (None: what a resume across a change left
            of a window, planned as it comes).
        afters: Per step, the mixture's state after it.
    """

    window: Window
    keep_from: int
    allocations: list[Allocation | None]
    afters: list[MixtureState]


def next_window(mixture: Mixture, state: MixtureState, *, resume: Resume | None, steps: int) -> WindowPlan | None:
    """The window planned after `state` (see the module docstring); None: the data ended."""
    if resume is not None:  # a resume or rewind inside a window: plan it again, keep it from resume.step on
        window = resume.window
        if window.leftover:
            return WindowPlan(window, resume.step, [None] * window.steps, [window.end] * window.steps)
        allocated, afters = allocate(mixture, window.before, window.steps)
        return WindowPlan(window, resume.step, list(allocated), afters)
    allocated, afters = allocate(mixture, state, steps)
    if not allocated:
        return None
    return WindowPlan(Window(first=state.step, steps=len(allocated), before=state, end=afters[-1]), state.step, list(allocated), afters)


@dataclasses.dataclass(frozen=True)
class Halt:
    """The planning thread stops: the planner stops, or planning failed for good."""


@dataclasses.dataclass(frozen=True)
class Rewind:
    """Re-plan from `step`: restore the state before it from the ledger, then plan on."""

    step: int


@dataclasses.dataclass(frozen=True)
class PlanNext:
    """Plan the window after `state`; it is kept only if no rewind came in meanwhile (`epoch`)."""

    state: MixtureState
    epoch: int


Action = Halt | Rewind | PlanNext


@dataclasses.dataclass(frozen=True)
class EndOfData:
    """The job's data ended before the step."""


@dataclasses.dataclass(frozen=True)
class Stopping:
    """The planner is stopping."""


@dataclasses.dataclass(frozen=True)
class Failed:
    """Planning failed for good, for `reason`."""

    reason: str


Answer = StepPlan | EndOfData | Stopping | Failed


#: Steps planned in one go whose ledger records are written together, at most.
RECORD_STEPS = 32


class Planning:
    """The state of one job's plan sequence.

    Args:
        progress: The request rules (where constructors stand, which plans are kept).
        adaptive: The mixture's adaptive rule; None: the mixture does not adapt.
        ahead: How far past the furthest step asked for to plan (1: the next step; a
            constructor that takes several steps' plans at once wants more, `job_planning`).
    """

    def __init__(self, progress: PlanProgress, *, adaptive: AdaptiveRule | None = None, ahead: int = 1) -> None:
        self.progress = progress
        self._rule = adaptive
        self._ahead = ahead
        self.plans: dict[int, StepPlan] = {}
        self._cursors_before: dict[int, tuple[int, ...]] = {}  # step -> cursors before it, for kept plans
        #: The state after the last planned step (None before the job starts).
        self.state: MixtureState | None = None
        #: The first step past the job's data (None while unknown).
        self.end_step: int | None = None
        self.wanted = -1  # plan up to this step
        self.replan_to: int | None = None  # a rewind the planning thread must carry out
        self.epoch = 0  # counts rewinds: a step planned across one is not kept
        self._resume: Resume | None = None  # a resume inside a window, for the planning thread
        self.stopped = False
        self.failure: str | None = None
        #: The adaptive rule's state, and the last step whose report it holds.
        self.adaptive_state: AdaptiveState | None = None
        self.applied_through = -1
        self._reports: dict[int, dict | None] = {}  # step -> losses not applied yet (None: never reported)
        self._unrecorded: list[int] = []  # planned steps whose ledger records are not written yet, in order
        self._asked = -1  # the furthest step a request asked for
        self._floor_recorded = -1  # the `delivered_below` of the records written last

    # ---- requests ------------------------------------------------------------------------

    def ask(self, constructor: int, step: int, *, delivered_below: int = 0, rewind: bool = False, again: bool = False) -> Decision:
        """A plan request (see `PlanProgress.ask`): `Start` the job and ask again; `Ahead`: wait
        for the window (planning up to its limit meanwhile) and ask `again`; else the request
        waits for its `answer` (a `Replan` sets a rewind for the planning thread and drops the
        kept plans; the plans every constructor handed are dropped).

        Raises:
            FailedPrecondition: see `PlanProgress.ask`.
        """
        decision = self.progress.ask(constructor, step, delivered_below=delivered_below, rewind=rewind, again=again)
        if isinstance(decision, Start):
            return decision
        self._asked = max(self._asked, step)
        if isinstance(decision, Ahead):
            if not self._past_end(step) and not self.stopped and self.failure is None:
                self.wanted = max(self.wanted, decision.limit + 1)  # plan what the window allows meanwhile
                return decision
            self.forget_consumed()
            return Serve()  # answered at once: past the end, stopping or failed
        if isinstance(decision, Replan):
            self.replan_to = decision.step if self.replan_to is None else min(self.replan_to, decision.step)
            self.epoch += 1
            self.plans.clear()
            self._cursors_before.clear()
            self._unrecorded.clear()  # never served: the rewind plans them again
        self.forget_consumed()
        self.wanted = max(self.wanted, step + self._ahead)  # plan ahead of the fastest rank
        return decision

    def answer(self, step: int) -> Answer | None:
        """What a request for `step` is answered now; None: not yet (its plan is to come)."""
        if self._past_end(step):
            return EndOfData()
        if self.stopped:
            return Stopping()
        if self.failure is not None:
            return Failed(self.failure)
        if step in self._unrecorded:
            return None  # served once its record is durable
        return self.plans.get(step)

    def dropped(self, step: int) -> bool:
        """Whether a request waiting for `step` must ask again: its plan was dropped after it was
        decided (a constructor's claim of delivery moved `consumed_below` past the step before
        the request took the plan), so it never comes unless the step is planned again."""
        return self.answer(step) is None and self.progress.start is not None and step < self.progress.kept_from

    def following(self, steps: Sequence[int]) -> list[StepPlan]:
        """The plans of `steps` (a constructor's steps after one it was answered) that are
        planned already, up to the first that is not. They are served as a request for each
        would be: a constructor that uses them asks for the step after them next, which a
        request may (it names no earlier step), and its rewinds and deliveries are told as
        before, with its requests and heartbeats."""
        plans = []
        for step in steps:
            plan = self.answer(step)
            if not isinstance(plan, StepPlan):
                break
            self.progress.served(step)
            plans.append(plan)
        return plans

    def delivered(self, constructor: int, below: int) -> bool:
        """A heartbeat: every rank of `constructor` was handed every step below `below`; the plans
        every constructor handed are dropped. Returns whether the job has started (else it is
        not counted)."""
        if self.progress.start is None:
            return False
        self.progress.delivered(constructor, below)
        self.forget_consumed()
        return True

    def forget_consumed(self) -> None:
        """Drops the plans every rank has moved past."""
        for s in self.progress.forget_consumed():
            self.plans.pop(s, None)
            self._cursors_before.pop(s, None)

    def restore_point(self) -> tuple[int, ...] | None:
        """Per source, the cursor before the oldest step not yet handed to every rank (None
        before the job starts)."""
        if self.state is None:
            return None
        kept = [s for s in self._cursors_before if s >= self.progress.consumed_below]
        return self._cursors_before[min(kept)] if kept else self.state.cursors

    @property
    def finished(self) -> bool:
        """Every rank has been handed every step and asked for the end-of-data step."""
        return self.progress.finished(self.end_step)

    # ---- the planning thread -------------------------------------------------------------

    def started(self, where: StartAt, *, state: MixtureState, resume: Resume | None, horizon: int, recorded_below: int = 0) -> None:
        """The job starts where `where_to_start` said, from `state` (see `PlanProgress.started`
        for `horizon` and `recorded_below`); `resume`: it starts inside a planning window."""
        self.progress.started(where.step, horizon=horizon, positions=where.positions, recorded_below=recorded_below)
        self.state, self._resume = state, resume
        self.wanted = where.step

    def next_action(self) -> Action | None:
        """What the planning thread does next; None: wait for an event."""
        if self.stopped or self.failure is not None:
            return Halt()
        if self.replan_to is not None:
            return Rewind(self.replan_to)
        if self.state is not None and not self._past_end(self.state.step) and self.state.step <= self.wanted:
            return PlanNext(self.state, self.epoch)
        return None

    @property
    def interrupted(self) -> bool:
        """Planning must stop waiting: the planner stops, or a rewind came in."""
        return self.stopped or self.replan_to is not None

    def take_resume(self) -> Resume | None:
        """The resume inside a window the next window plans, once."""
        resume, self._resume = self._resume, None
        return resume

    def put_back(self, resume: Resume | None) -> None:
        """The window of `take_resume` was not planned (interrupted): the next one plans it."""
        self._resume = resume

    def ended(self, step: int) -> None:
        """The data ends before `step`."""
        self.end_step = step

    def planned(self, epoch: int, plans: Sequence[StepPlan], *, before: MixtureState, end: MixtureState) -> bool:
        """A window planned from `before` to `end` in `epoch`; its `plans` (those from the step
        to keep from) are kept unless a rewind came in meanwhile. Returns whether they are."""
        if epoch != self.epoch:  # a rewind came in while it was planned: the sequence goes back
            return False
        for plan in plans:
            self.progress.planned(plan.step)
            self.plans[plan.step] = plan
            self._cursors_before[plan.step] = before.cursors
            self._unrecorded.append(plan.step)
        self.state = end
        return True

    def record_due(self) -> bool:
        """Whether the planning thread writes the ledger records of the steps planned since it
        last did (`unrecorded`) now, so that they may be served. It groups the steps it plans in
        one go (up to the step a request wants planned, `ask`) into one write: it writes once a
        request asks for one of them, once it has planned all that is wanted (or the data
        ended), once `RECORD_STEPS` wait, once the ranks have moved on since the last write (so
        the ledger's floor, where a restarted planner resumes, follows them as closely as when
        every step was written on its own), and (the book's `before_waiting`) before it waits
        for anything. With an adaptive mixture every step at once: the reports that the next
        step waits for come from training on the ones before."""
        if not self._unrecorded or self.stopped or self.failure is not None or self.replan_to is not None:
            return False
        return (
            self._rule is not None
            or len(self._unrecorded) >= RECORD_STEPS
            or self._unrecorded[0] <= self._asked
            or self.progress.consumed_below > self._floor_recorded
            or self.next_action() is None
        )

    @property
    def unrecorded(self) -> tuple[int, ...]:
        """The planned steps whose records are not written yet, in order."""
        return tuple(self._unrecorded)

    def recorded(self, epoch: int, steps: Sequence[int], *, delivered_below: int) -> None:
        """The records of `steps` (planned in `epoch`), which say that every rank had been
        handed the steps below `delivered_below`, are durable: their plans may be served."""
        self._floor_recorded = max(self._floor_recorded, delivered_below)
        if epoch == self.epoch:
            done = set(steps)
            self._unrecorded = [s for s in self._unrecorded if s not in done]

    def rewinding(self) -> None:
        """A rewind begins: the reports not applied yet are read again from the ledger."""
        self._reports.clear()

    def rewound(self, step: int, *, state: MixtureState, resume: Resume | None) -> None:
        """The rewind to `step` is carried out: the sequence goes on from `state` (`resume`:
        inside a planning window)."""
        self.state, self._resume = state, resume
        self.wanted = max(self.wanted, step)
        if self.replan_to == step:  # else a rewind further back came in meanwhile: next round
            self.replan_to = None

    def stop(self) -> None:
        self.stopped = True

    def fail(self, reason: str) -> None:
        """Planning failed for good (every waiting request is told why)."""
        self.failure = reason

    # ---- training reports (adaptive mixing) ----------------------------------------------

    def adaptive_restored(self, state: AdaptiveState, *, applied_through: int, reports: Mapping[int, dict | None]) -> None:
        """The adaptive state restored before a start or rewind, with the reports stored since."""
        self.adaptive_state, self.applied_through = state, applied_through
        self._reports.update(reports)

    def report_refusal(self, step: int) -> ReportRefusal | None:
        """Why the report of `step` is not taken now (see `bounds.report_refusal`), or None."""
        start = self.progress.start
        assert start is not None, "the job has started"
        return report_refusal(step, start=start, applied_through=self.applied_through, handed_below=self.progress.handed_below)

    def reported(self, step: int, losses: dict) -> None:
        """The report of `step` stands (stored durably); it waits to be applied unless past."""
        if step > self.applied_through:
            self._reports.setdefault(step, losses)

    def report_due(self, step: int) -> int | None:
        """The next step whose report must be applied before `step` is planned; None: none."""
        assert self._rule is not None
        return self.applied_through + 1 if self.applied_through < step - self._rule.delay_steps else None

    def report_in(self, step: int) -> bool:
        """Whether the report of `step` (or its absence, after a restore) is known."""
        return step in self._reports

    def apply_report(self, step: int) -> dict | None:
        """Applies the report of `step` (`report_due`, `report_in`) to the adaptive state; returns
        its losses (None: missing)."""
        assert self._rule is not None and self.adaptive_state is not None
        losses = self._reports.pop(step)
        if losses is not None:
            self.adaptive_state = update(self._rule, self.adaptive_state, losses)
        self.applied_through = step
        return losses

    def _past_end(self, step: int) -> bool:
        return self.end_step is not None and step >= self.end_step


def job_planning(job: JobSettings, *, mesh: ClientPlaceTree, axis: str, adaptive: AdaptiveRule | None) -> Planning:
    """The plan sequence of `job`, not started: request rules over the job's constructors, of
    which those with a rank that asks for batches are waited for (`DeliveryRules.pulling`), with
    the planning window's lead (`bounds.plan_lead`) in steps of the sequence: a journal producer
    prefetches its own steps, every `build_stride`-th. With `constructors.fetch_steps` k it
    plans 2k - 1 of a constructor's steps past the one asked for: the k - 1 that come with its
    answer and the k after them, which the constructor asks for next.

    Args:
        job: The job's settings.
        mesh: The job's mesh.
        axis: The axis the strategy's primary graph balances over.
        adaptive: The mixture's adaptive rule; None: the mixture does not adapt.
    """
    rules = DeliveryRules(mesh, axis=axis, pulling_ranks=job.constructors.pulling_ranks)
    pulling = rules.pulling([job.constructor_ranks(c) for c in range(job.constructor_count)])
    stride, fetch_steps = job.build_stride, job.constructors.fetch_steps
    lead = plan_lead(job.constructors.prefetch_steps, fetch_steps, job.batch_steps) * stride
    ahead = (2 * fetch_steps - 1) * stride if fetch_steps > 1 else 1
    return Planning(PlanProgress(range(job.constructor_count), pulling=pulling, lead=lead), adaptive=adaptive, ahead=ahead)
