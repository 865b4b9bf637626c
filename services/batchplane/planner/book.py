"""The plan book: builds plans in step order as constructors ask for them, keeps each plan until
every rank has moved past it, and knows where the job started and where its data ends.

The first step any constructor asks for is where the job starts: a fresh job asks for step 0,
a resumed one for the step after its checkpoint. A resume restores the mixture's cursors from the
durable ledger's record of the step before (see `journal`), so it continues the epoch with no
sample lost or repeated even when the mixture, the mesh, the loaders or the batching changed
since; the planner logs what changed. Without that record (a new run folder) it fast-forwards the
mixture without touching data, which is exact only if the mixture is unchanged: a resume whose
checkpoint says the mixture changed is then refused. Every step's record is written durably
before its plan is served. Each step is planned by the job's strategy (see `dgraph`) over the
job's ClientPlaceTree; token budgets are planned a window of several steps at a time (see
`window`, which also decides how a resume inside a window goes on).

What a request means (start, serve, rewind, refuse) and which plans are kept is decided by the
pure `progress.PlanProgress`; this class drives it. A rewind (a trainer restarted from an older
checkpoint while the data plane runs) to a step whose plan is no longer kept is carried out by
the planning thread: it restores the state from the ledger's record of the step before, exactly
as a restarted planner does, opens a new ledger generation there and plans the sequence again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from collections.abc import Mapping, Sequence

import numpy as np

from batchplane.core.config import JobSettings
from batchplane.core.bad import reason_name
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.storage import MemoryStorage, Storage
from batchplane.planner.adaptive import AdaptiveState, check_report, state_to_json as adaptive_to_json, update
from batchplane.planner.bounds import plan_lead, report_refusal
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.dgraph import Strategy
from batchplane.planner.journal import LedgerReader, LedgerWriter
from batchplane.planner.ledger import Ledger
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.mixture import Allocation, Mixture, MixtureState
from batchplane.planner.substitute import check_policy, entries, substitute
from batchplane.planner.plan import SampleTable, StepPlan
from batchplane.planner.progress import Ahead, PlanProgress, Replan, Start, start_step
from batchplane.planner.restore import delivered_floor, expected_sources, new_generation, restore_adaptive, restore_mixture, rewind_horizon
from batchplane.planner.length import JobLength, job_length
from batchplane.core.schedule import ScheduleError
from batchplane.planner.strategy import JobSchedule, job_mesh, load_schedule, load_strategy
from batchplane.planner.summaries import SummaryStore, wait_for_summary
from batchplane.planner.window import Resume, Window, allocate as allocate_window, home_steps, resume_inside, taken, window_steps, without

log = logging.getLogger(__name__)

#: Sentinel plan: the job's data ended before this step.
END_OF_DATA = None


class PlanBook:
    """Plans of one job, built on demand by a planning thread.

    Args:
        job: The job's settings.
        membership: Registered loaders and constructors.
        store: Sample metadata pulled from the loaders.
        metrics: The planner's metrics.
        ledger: Storage of the durable ledger; default: in memory (tests).
        strategy: The job's strategy; default: `load_strategy(job)`.
        schedule: The job's mixture schedule; default: `load_schedule(job, strategy)`.
    """

    def __init__(
        self,
        job: JobSettings,
        *,
        membership: Membership,
        store: SummaryStore,
        metrics: PlannerMetrics,
        ledger: Storage | None = None,
        strategy: Strategy | None = None,
        schedule: JobSchedule | None = None,
    ) -> None:
        self._job = job
        self._membership = membership
        self._store = store
        self._metrics = metrics
        self._ledger_storage = ledger if ledger is not None else MemoryStorage()
        membership.expect_sources(expected_sources(LedgerReader(self._ledger_storage), job=job))  # a restarted planner's loaders
        self._writer: LedgerWriter | None = None
        self.resumed_across: tuple[str, ...] = ()
        self._cost_fn = make_cost_fn(job.balance.cost.kind, linear=job.balance.cost.linear, quadratic=job.balance.cost.quadratic)
        self.strategy = strategy if strategy is not None else load_strategy(job)
        self.mesh = job_mesh(job)
        self.schedule = schedule if schedule is not None else load_schedule(job, self.strategy)
        #: The normalized weights the schedule gave the latest planned step.
        self.shares = self.schedule.initial_shares
        self._adaptive = self.schedule.adaptive
        self._adaptive_state: AdaptiveState | None = None
        self._reports: dict[int, dict | None] = {}  # step -> losses not applied yet (None: never reported)
        self._applied_through = -1  # the last step whose report the adaptive state holds
        if self._adaptive is not None and self._adaptive.delay_steps < job.constructors.prefetch_steps + 2:
            log.warning(
                "mixture.schedule.adaptive.delay_steps = %d is less than constructors.prefetch_steps + 2 = %d: planning will wait "
                "for training reports and the trainer for its batches", self._adaptive.delay_steps, job.constructors.prefetch_steps + 2,
            )
        method = self.strategy.primary.balancing.method
        self.ledger = Ledger(job.source_names, method=method if isinstance(method, str) else "user", compare=job.ledger.compare_methods)
        self._cond = threading.Condition()
        self._plans: dict[int, StepPlan] = {}
        self._cursors_before: dict[int, tuple[int, ...]] = {}  # step -> cursors before it, for kept plans
        rules = DeliveryRules(self.mesh, axis=self.strategy.primary.axis, pulling_ranks=job.constructors.pulling_ranks)
        pulling = rules.pulling([job.constructor_ranks(c) for c in range(job.constructor_count)])
        # A journal producer prefetches its own steps, every build_stride-th of the sequence.
        self._progress = PlanProgress(range(job.constructor_count), pulling=pulling, lead=plan_lead(job.constructors.prefetch_steps) * job.build_stride)
        self._mixture: Mixture | None = None
        self._state: MixtureState | None = None
        self.end_step: int | None = None
        self._wanted = -1
        self._waiting_on = ""
        self._replan_to: int | None = None  # a rewind the planning thread must carry out
        self._window_steps = window_steps(job, self.strategy, adaptive=self._adaptive is not None)
        self._resume: Resume | None = None  # a resume inside a window, for the planning thread
        self._epoch = 0  # counts rewinds: a step planned across one is not kept
        self._failure: str | None = None
        self._length: JobLength | None = None
        self._length_lock = threading.Lock()
        self._stopped = False
        self._compactor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-compaction")
        self._compacting: futures.Future | None = None
        self._thread = threading.Thread(target=self._plan_loop, name="planning", daemon=True)
        self._thread.start()

    # ---- requests ------------------------------------------------------------------------

    def plan_for(
        self,
        constructor: int,
        step: int,
        *,
        timeout_s: float,
        resume: Mapping[str, str] | None = None,
        delivered_below: int = 0,
        rewind: bool = False,
    ) -> StepPlan | None:
        """The plan of `step` for constructor `constructor`; None (END_OF_DATA) past the end.

        Args:
            resume: The settings fingerprints of the checkpoint a trainer resumes from, if any
                (what `_start` checks a resume without a ledger record against).
            delivered_below: Every step below it reached all of the constructor's ranks; plans
                are kept from the slowest constructor's on (a restarted one builds them again).
            rewind: A rank of the constructor restarted from an older checkpoint: an earlier
                step than it asked for before is served again (re-planned from the ledger).

        Raises:
            FailedPrecondition: the step is before the job's start, was consumed by the
                constructor (it already asked for a later step) without `rewind`, is before the
                oldest step the ledger can re-plan, or planning failed for good (the message
                says why, e.g. a cost function that returns negative costs).
            Unavailable: the plan is not ready within `timeout_s` (loaders not registered or
                slow), or the step stayed ahead of the planning window (`bounds.plan_lead`); retry.
        """
        with self._cond:
            decision = self._progress.ask(constructor, step, delivered_below=delivered_below, rewind=rewind)
            if isinstance(decision, Start):
                if self._membership.rejoined():  # a restarted planner: asking says where it stands too
                    self._membership.rejoin_at(constructor, min(step, delivered_below))
                self._start(step, timeout_s=timeout_s, resume=resume or {})
                decision = self._progress.ask(constructor, step, delivered_below=delivered_below, rewind=rewind)
            give_up = time.monotonic() + timeout_s
            while isinstance(decision, Ahead):  # nothing is planned for it: wait for the window to reach it
                if self.end_step is not None and step >= self.end_step:
                    return END_OF_DATA
                if self._stopped or self._failure:
                    break
                self._wanted = max(self._wanted, decision.limit + 1)  # plan what the window allows meanwhile
                self._cond.notify_all()
                if not self._cond.wait(timeout=max(give_up - time.monotonic(), 0)) and time.monotonic() >= give_up:
                    raise Unavailable(
                        f"step {step} is ahead of the planning window (steps up to {decision.limit}: constructors.prefetch_steps + 2 "
                        f"past the step below which every constructor's ranks were handed every step); retry once they move on"
                    )
                decision = self._progress.ask(constructor, step, delivered_below=delivered_below, rewind=rewind, again=True)
            if isinstance(decision, Replan):
                self._begin_replan(decision.step, constructor)
            self._forget_consumed()
            if self.end_step is not None and step >= self.end_step:
                return END_OF_DATA
            if not isinstance(decision, Ahead):  # (stopped or failed while it waited)
                self._wanted = max(self._wanted, step + 1)  # plan one step ahead of the fastest rank
            self._cond.notify_all()
            ready = self._cond.wait_for(
                lambda: step in self._plans or (self.end_step is not None and step >= self.end_step) or self._failure or self._stopped,
                timeout=max(give_up - time.monotonic(), 0),
            )
            if self._stopped:
                raise Unavailable("the planner is stopping")
            if self._failure:  # permanent (e.g. a cost function that returns negative costs)
                raise FailedPrecondition(f"planning failed: {self._failure}")
            if not ready:
                raise Unavailable(f"plan of step {step} not ready after {timeout_s:.1f} s: {self._waiting_on}")
            return self._plans.get(step, END_OF_DATA)

    def _start(self, step: int, *, timeout_s: float, resume: Mapping[str, str]) -> None:
        """Starts the job at `step`: waits for every loader, restores or fast-forwards the
        mixture, opens this run's generation of the ledger (lock held).

        Raises:
            FailedPrecondition: a resume the planner cannot make exact (see the module docstring).
        """
        ready = self._cond.wait_for(lambda: self._membership.ready or self._stopped, timeout=timeout_s)
        if self._stopped:
            raise Unavailable("the planner is stopping")
        if not ready:
            raise Unavailable(f"waiting for loaders {self._membership.missing_loaders()} to register")
        if self.start_step is not None:  # another request started the job while we waited
            return
        reader = LedgerReader(self._ledger_storage)
        floor = delivered_floor(reader) if self._membership.rejoined() or (step > 0 and not resume) else None
        positions: dict[int, int] = {}
        if floor is not None:  # a restarted planner: no rank needs a step below the ledger's floor
            rejoined = positions = self._membership.rejoined()
            step = start_step(step, floor=floor, rejoined=rejoined)
            log.info(
                "restarted: every rank had been handed the steps below %d (the ledger), the constructors that rejoined need %s; "
                "resuming at step %d", floor, rejoined, step,
            )
        elif self._membership.rejoined():  # restarted, but the ledger does not say: start where the slowest constructor is
            everyone = lambda: len(self._membership.rejoined()) == self._job.constructor_count or self._stopped  # noqa: E731
            if not self._cond.wait_for(everyone, timeout=timeout_s):
                waiting = sorted(set(range(self._job.constructor_count)) - set(self._membership.rejoined()))
                raise Unavailable(f"restarted: waiting for constructors {waiting} to rejoin")
            if self._stopped:
                raise Unavailable("the planner is stopping")
            if self.start_step is not None:
                return
            positions = self._membership.rejoined()
            step = min(positions.values())
            log.info("restarted: the constructors need steps %s; resuming at step %d", self._membership.rejoined(), step)
        elif step != start_step(step, floor=None, rejoined={}, resume=bool(resume)):
            log.info("a fresh job starts at step 0: the first request, for step %d, resumes from no checkpoint", step)
            step = 0
        self._mixture = self._make_mixture()
        log.info("mixture: %s", self._mixture.describe())
        self._state = self._restore(step, resume, reader)
        self._writer = new_generation(reader, step, job=self._job, source_facts=self._membership.commit_sources())
        self._progress.started(step, horizon=rewind_horizon(reader, step, adaptive=self._adaptive is not None), positions=positions)
        self._wanted = step
        self._store.start(self._state.cursors, step=step)
        self._cond.notify_all()

    def _restore(self, step: int, resume: Mapping[str, str], reader: LedgerReader) -> MixtureState:
        """The state before `step` from the ledger (see `restore`), with the ledger's consumption
        and the adaptive mixing state to continue from."""
        restored = restore_mixture(step, job=self._job, mixture=self._mixture, reader=reader, resume=resume, adaptive=self._adaptive is not None)
        self.resumed_across = restored.changed
        if restored.record is not None:
            self.ledger.restore(restored.record)
        elif step:
            self.ledger.assume_consumed(restored.state.cursors)
        self._resume = resume_inside(restored.record, step, changed=bool(restored.changed), source_names=self._job.source_names)
        if self._resume is not None:
            w = self._resume.window
            how = "its rest planned as a new window (settings changed)" if w.leftover else "planned again as it was"
            log.info("step %d lies inside the planning window of steps %d..%d: %s", step, w.first, w.first + w.steps - 1, how)
        if self._adaptive is not None:
            adaptive = restore_adaptive(step, rule=self._adaptive, reader=reader, changed=restored.changed)
            self._adaptive_state, self._applied_through = adaptive.state, adaptive.applied_through
            with self._cond:
                self._reports.update(adaptive.reports)
        return restored.state if self._resume is None else self._resume.window.before

    def _make_mixture(self) -> Mixture:
        """The job's mixture allocator (every loader has registered: the stream ends are known)."""
        ends = [
            self._job.stream_end(k, self._membership.num_rows(k))
            for k in range(len(self._job.sources))
        ]
        return Mixture(
            self.schedule.schedule,
            global_batch_size=self._job.batch.global_batch_size,
            stream_ends=ends,
            granularity=self.schedule.granularity,
            microbatches=self._job.batch.microbatches,
        )

    def length(self) -> JobLength:
        """How many steps the job has (see `length.job_length`): known for a finite job once every
        loader has registered. Computed once."""
        if self._job.epochs is None:
            return JobLength(infinite=True)
        if not self._membership.ready:
            return JobLength(unknown=f"waiting for loaders {self._membership.missing_loaders()} to register")
        with self._length_lock:
            if self._length is None:
                begin = time.perf_counter()
                self._length = job_length(self.schedule, self._make_mixture())
                log.info("the job's length: %s (counted in %.3f s)", self._length, time.perf_counter() - begin)
            return self._length

    @property
    def oldest_step(self) -> int:
        """The oldest step a rewind can go back to (the ledger's horizon)."""
        return self._progress.horizon

    @property
    def start_step(self) -> int | None:
        """The step the job started at (lowered by a rewind before it); None before it starts."""
        return self._progress.start

    def report(self, step: int, losses: Mapping[str, float]) -> tuple[bool, str]:
        """Records the training report of `step` (mean loss per source) for adaptive mixing,
        durably before it counts. Only for a step planned and not yet past
        (`bounds.report_refusal`): a future step's report is refused, so the reports stored are
        bounded by the planning window; a repeated report is taken when it equals the one that
        stands.

        Returns:
            (accepted, reason): not accepted when the mixture is not adaptive, the step precedes
            this run's start, is not planned yet, is past, or was already reported with other
            losses (the first report stands).
        Raises:
            InvalidArgument: a negative step, a name that is no source, or a loss that is not a
                finite number >= 0.
            Unavailable: the job has not started (no constructor asked for a step yet).
        """
        if self._adaptive is None:
            return False, "the job's mixture is not adaptive (mixture.schedule.kind), so reports are not used"
        if step < 0:
            raise InvalidArgument(f"report: step must be >= 0, got {step}")
        try:
            check_report(self._adaptive, losses)
        except ScheduleError as exc:
            raise InvalidArgument(f"report of step {step}: {exc.problem}, got {exc.value!r}") from exc
        with self._cond:
            writer = self._writer
            refusal = None if writer is None else report_refusal(
                step, start=self.start_step, applied_through=self._applied_through, handed_below=self._progress.handed_below
            )
        if writer is None:
            raise Unavailable("the job has not started: no constructor has asked for a step yet")
        losses = {name: float(loss) for name, loss in losses.items()}
        if refusal is not None:  # a retry of a report that was applied is still taken
            accepted = refusal.applied and writer.report(step) == {"losses": losses}
            return accepted, "" if accepted else refusal.reason
        stored = writer.put_report(step, {"losses": losses})["losses"]
        if stored != losses:
            return False, f"step {step} was already reported with other losses; the first report stands"
        with self._cond:
            if step > self._applied_through:
                self._reports.setdefault(step, stored)
                self._cond.notify_all()
        return True, ""

    def constructor_delivered(self, constructor: int, below: int) -> None:
        """Constructor `constructor` says (it registers again every heartbeat) that every rank it
        serves was handed every step below `below`."""
        with self._cond:
            if self.start_step is None:
                return
            self._progress.delivered(constructor, below)
            self._forget_consumed()
            self._cond.notify_all()

    def constructor_restarted(self, constructor: int) -> int:
        """A constructor registered anew (restarted): it may ask again for the steps from the
        last one its ranks were handed. Returns that step (-1 before the job starts)."""
        with self._cond:
            return self._progress.restarted(constructor)

    def _forget_consumed(self) -> None:
        """Drops the plans every rank has moved past (lock held)."""
        for s in self._progress.forget_consumed():
            self._plans.pop(s, None)
            self._cursors_before.pop(s, None)
        self._store.delivered(self._progress.consumed_below)

    def _begin_replan(self, step: int, constructor: int) -> None:
        """Has the planning thread re-plan from `step` (a rewind to a step whose plan is no longer
        kept); the plans it keeps are dropped: it builds them again (lock held)."""
        log.info("constructor %d rewinds to step %d, whose plan is no longer kept: re-planning from the ledger's record of step %d", constructor, step, step - 1)
        self._replan_to = step if self._replan_to is None else min(self._replan_to, step)
        self._epoch += 1
        self._plans.clear()
        self._cursors_before.clear()
        self._cond.notify_all()

    def restore_point(self) -> tuple[int, ...] | None:
        """Per source, the cursor before the oldest step not yet handed to every rank: what a
        restarted loader must hold again starts there (None before the job starts)."""
        with self._cond:
            if self._state is None:
                return None
            kept = [s for s in self._cursors_before if s >= self._progress.consumed_below]
            return self._cursors_before[min(kept)] if kept else self._state.cursors

    def wait_ready(self, *, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for every source's loader to register; returns whether they have."""
        with self._cond:
            return self._cond.wait_for(lambda: self._membership.ready or self._stopped, timeout=timeout_s)

    def notify_membership(self) -> None:
        """Wakes requests waiting for loaders to register."""
        with self._cond:
            self._cond.notify_all()

    # ---- planning thread -----------------------------------------------------------------

    def _plan_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._replan_to is not None or self._more_to_plan())
                if self._stopped:
                    return
                replan, epoch, state = self._replan_to, self._epoch, self._state
            step = state.step if replan is None else replan
            try:
                if replan is not None:
                    self._rewind(replan)
                else:
                    self._plan_next(state, epoch)
            except Exception as exc:  # noqa: BLE001 - reported to every waiting request
                log.exception("planning step %d failed", step)
                with self._cond:
                    self._failure = f"step {step}: {exc}"
                    self._cond.notify_all()
                return

    def _more_to_plan(self) -> bool:
        """Whether the next step is wanted and before the end of data (lock held)."""
        if self._state is None:
            return False
        return (self.end_step is None or self._state.step < self.end_step) and self._state.step <= self._wanted

    def _interrupted(self) -> bool:
        """Whether planning must stop waiting: the planner stops, or a rewind came in."""
        return self._stopped or self._replan_to is not None

    def _rewind(self, step: int) -> None:
        """Goes back to `step` (a rewind): restores the state before it from the ledger as a
        restarted planner does, opens a new generation there, and pulls summaries from its
        cursors again (loaders read again what they freed). Running totals restart, as after a
        planner restart."""
        if self._compacting is not None:
            futures.wait([self._compacting])  # the new generation folds what the old one left
        reader = LedgerReader(self._ledger_storage)
        self.ledger = Ledger(self._job.source_names, method=self.ledger.method, compare=self.ledger.compare)
        with self._cond:
            self._reports.clear()
        state = self._restore(step, {}, reader)
        writer = new_generation(reader, step, job=self._job, source_facts=self._membership.commit_sources())
        with self._cond:
            self._writer, self._state = writer, state
            self._wanted = max(self._wanted, step)
            self._store.rewind(state.cursors, step=step, delivered_below=self._progress.consumed_below)
            if self._replan_to == step:  # else a rewind further back came in meanwhile: next round
                self._replan_to = None
            self._cond.notify_all()
        self._metrics.rewinds.inc()
        log.info("rewound to step %d: planning again from the ledger's record of step %d (generation %d)", step, step - 1, writer.generation.gen)

    def _plan_next(self, state: MixtureState, epoch: int) -> None:
        """Plans the next window (`batchplane.planner.window`; one step unless the job plans
        token budgets over several): records its steps and keeps their plans."""
        applied = self._adapt(state.step) if self._adaptive is not None else []
        if applied is None:
            return  # stopped or rewound while waiting
        resume, self._resume = self._resume, None
        if resume is not None:  # a resume or rewind inside a window: plan it again, keep it from resume.step on
            window, keep_from = resume.window, resume.step
            if window.leftover:
                allocations, afters = [None] * window.steps, [window.end] * window.steps
            else:
                allocations, afters = allocate_window(self._mixture, window.before, window.steps)
        else:
            allocations, afters = allocate_window(self._mixture, state, self._window_steps)
            if not allocations:
                with self._cond:
                    self.end_step = state.step
                    self._cond.notify_all()
                log.info("end of data: the last step is %d", state.step - 1)
                return
            window, keep_from = Window(first=state.step, steps=len(allocations), before=state, end=afters[-1]), state.step
        begin = time.perf_counter()
        table = self._allocated_samples(window.ranges)
        if table is None:
            self._resume = resume
            return  # stopped or rewound while waiting
        table = without(table, window.skip)
        home = np.zeros(len(table), np.int64) if window.leftover else home_steps(table, allocations)
        substituted: dict[int, list[dict]] = {}
        if not window.leftover and self._job.batch.bad_samples.policy != "skip":
            found = self._substitute(window, allocations[-1], table, home)
            if found is None:
                self._resume = resume
                return  # stopped or rewound while waiting
            window, table, home, substituted = found
            afters[-1] = window.end
        waited = time.perf_counter() - begin
        plans = self._plan_window(window, table, home)
        recorded = window.to_json() if window.steps > 1 or window.leftover else None
        planned_s = time.perf_counter() - begin - waited
        kept = []
        for i, plan in enumerate(plans):
            if plan.step < keep_from:
                continue  # planned and consumed before the resume: planned again only to plan the rest identically
            spans = taken(plan, table, home, i, len(self._job.sources)) if recorded is not None or substituted else None
            record = self.ledger.record(allocations[i], plan, afters[i], taken=spans, window=recorded)
            if i in substituted:
                record["substituted"] = substituted[i]
            record["delivered_below"] = self._progress.consumed_below  # where a restarted planner may resume
            if self._adaptive is not None:
                record["adaptive"] = {"applied": applied, "applied_through": self._applied_through, "state": adaptive_to_json(self._adaptive_state)}
            self._writer.append(record)
            kept.append((allocations[i], plan, None if spans is None else [x.count for x in spans]))
        with self._cond:
            if epoch != self._epoch:  # a rewind came in while it was planned: the sequence goes back
                return
            self._store.advance(window.end.cursors, steps=window.end.step)
            for _, plan, _ in kept:
                self._progress.planned(plan.step)
                self._plans[plan.step] = plan
                self._cursors_before[plan.step] = window.before.cursors
            self._state = window.end
            if allocations[-1] is not None:
                self.shares = allocations[-1].shares
            self._cond.notify_all()
        for allocation, plan, counts in kept:
            self._metrics.observe_step(allocation, plan, self.ledger, counts=counts, waited_s=waited / len(kept), planned_s=planned_s / len(kept))
        if self._compacting is None or self._compacting.done():  # compaction never stalls planning
            self._compacting = self._compactor.submit(
                self._writer.compact, self._progress.consumed_below, report_delay=self._adaptive.delay_steps if self._adaptive is not None else None
            )
            self._compacting.add_done_callback(_log_failure)

    def _substitute(
        self, window: Window, last: Allocation, table: SampleTable, home: np.ndarray
    ) -> tuple[Window, SampleTable, np.ndarray, dict[int, list[dict]]] | None:
        """Substitutes the window's bad samples (`substitute.substitute`), waiting for the
        summaries after the window; counts them and returns the window, its samples and steps
        with the substitutes, and the ledger's entries by window step; None when stopped or
        rewound.

        Raises:
            FailedPrecondition: policy "fail" and more bad samples than it tolerates.
        """
        job = self._job

        def fetch(source: int, start: int, count: int) -> SampleTable | None:
            return self._allocated_samples([(start, count) if k == source else (0, 0) for k in range(len(job.sources))])

        done = substitute(window, last, table, home, stream_ends=self._mixture.stream_ends, fetch=fetch)
        if done is None:
            return None
        if not done.matches:
            return window, table, home, {}
        check_policy(job.batch.bad_samples, done, job.source_names)
        reasons = {k: self._bad_reasons(k, done.table) for k in done.matches}
        for k, m in done.matches.items():
            for bad_seq, sub, _ in m.pairs:
                if sub >= 0:
                    self._metrics.substitutions.labels(job.sources[k].name, reasons[k].get(bad_seq, "unknown")).inc()
        return done.window, done.table, done.home, entries(done.matches, done.table, reasons, job.source_names)

    def _bad_reasons(self, source: int, table: SampleTable) -> dict[int, str]:
        """Why each bad sample of `source` in the table is bad, as its loader said (by seq)."""
        seqs = np.sort(table.seq[(table.source == source) & (table.length <= 0)])
        if not len(seqs):
            return {}
        codes = self._store.reasons(source, int(seqs[0]), int(seqs[-1]) - int(seqs[0]) + 1)
        if codes is None:
            return {}
        return {int(s): reason_name(int(codes[s - seqs[0]])) for s in seqs}

    def _plan_window(self, window: Window, table: SampleTable, home: np.ndarray) -> list[StepPlan]:
        """The plans of a window's steps by the job's strategy."""
        job = self._job
        limit = {"default_cost": self._cost_fn, "max_length": job.max_length, "length_policy": job.batch.length_policy, "packed": job.batch.packing}
        if self.strategy.windowed:
            return self.strategy.run_window(window.first, table, home, self.mesh, steps=window.steps, **limit)
        # The rest of a window after a resume that also left token budgets: its samples in
        # (source, seq) order, cut into its steps.
        parts = np.array_split(np.lexsort((table.seq, table.source)), window.steps)
        return [self.strategy.run(window.first + i, table.take(np.sort(part)), self.mesh, **limit) for i, part in enumerate(parts)]

    def _adapt(self, step: int) -> list[tuple[int, dict | None]] | None:
        """Applies the reports of the steps up to step - delay_steps (waiting for them) and sets
        step `step`'s weights; returns the (step, losses) applied, or None when stopped or rewound."""
        rule = self._adaptive
        applied = []
        while self._applied_through < step - rule.delay_steps:
            t = self._applied_through + 1
            with self._cond:
                while t not in self._reports and not self._interrupted():
                    self._waiting_on = (
                        f"waiting for the training report of step {t}: with mixture.schedule.adaptive.delay_steps = {rule.delay_steps}, "
                        f"step {step} is planned with the reports of steps up to {step - rule.delay_steps} (Client.report(step, losses))"
                    )
                    self._cond.wait(timeout=1.0)
                if self._interrupted():
                    return None
                losses = self._reports.pop(t)
                self._waiting_on = ""
            if losses is not None:
                self._adaptive_state = update(rule, self._adaptive_state, losses)
            self._applied_through = t
            applied.append((t, losses))
        self.schedule.schedule.set(step, self._adaptive_state.weights)
        self.schedule.schedule.forget_before(step)
        return applied

    def _allocated_samples(self, ranges: Sequence[tuple[int, int]]) -> SampleTable | None:
        """The samples of (first seq, count) of every source, once their summaries are known;
        None when stopped or rewound while waiting."""
        tables = []
        for k, (start, count) in enumerate(ranges):
            if not count:
                continue
            while True:
                got = wait_for_summary(self._store, k, start, count, timeout_s=1.0)
                if got is not None:
                    break
                if self._interrupted():
                    return None
                group = self._job.loader_of(k)
                self._waiting_on = (
                    f"waiting for summaries of source {self._job.sources[k].name!r} "
                    f"(positions {start}..{start + count - 1}) from loader {group} ({len(self._membership.replicas(group))} replicas)"
                )
            rows, lengths, features = got
            seq = np.arange(start, start + count, dtype=np.int64)
            tables.append(
                SampleTable(
                    source=np.full(count, k, np.int32),
                    seq=seq,
                    row=rows,
                    length=lengths,
                    epoch=(seq // self._membership.num_rows(k)).astype(np.int32),
                    features=features,
                )
            )
        self._waiting_on = ""
        return SampleTable.concat(tables)

    # ---- status --------------------------------------------------------------------------

    @property
    def steps_planned(self) -> int:
        return self.ledger.steps

    @property
    def finished(self) -> bool:
        """True once every rank has been handed every step and asked for the end-of-data step
        (its constructor says so with its requests and heartbeats)."""
        with self._cond:
            return self._progress.finished(self.end_step)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._compactor.shutdown(wait=True)


def _log_failure(done: futures.Future) -> None:
    """Logs a compaction that failed; the ledger stays whole (the steps stay as they were) and the
    next step tries again."""
    if not done.cancelled() and done.exception() is not None:
        log.error("compacting the ledger failed", exc_info=done.exception())
