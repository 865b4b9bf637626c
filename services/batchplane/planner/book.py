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

This class is the thin driver: it holds the lock, runs the planning thread, reads and writes the
ledger and the summary store, and does what the pure cores decide: `planning.Planning` (where the
job starts, what the planning thread does next, what a request is answered, which reports wait),
the request rules it holds (`progress.PlanProgress`) and the report rules of `bounds`.
`restore.reopen` assembles where a start or a rewind continues from,
`builder.WindowBuilder` builds a window's plans and `ledger.Ledger` their records. A rewind (a
trainer restarted from an older checkpoint while the data plane runs) to a step whose plan is no
longer kept is carried out by the planning thread: it restores the state from the ledger's
record of the step before, exactly as a restarted planner does, opens a new ledger generation
there and plans the sequence again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from collections.abc import Mapping, Sequence

from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition, Unavailable
from batchplane.core.storage import MemoryStorage, Storage
from batchplane.planner.bounds import check_report_request, report_delay_warning, report_taken
from batchplane.planner.builder import WindowBuilder
from batchplane.planner.dgraph import Strategy
from batchplane.planner.journal import LedgerReader, LedgerWriter
from batchplane.planner.ledger import AdaptiveRecord, Ledger
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.mixture import Mixture
from batchplane.planner.plan import StepPlan
from batchplane.planner.planning import (
    EndOfData,
    Failed,
    Halt,
    PlanNext,
    Rewind,
    StartAt,
    Stopping,
    job_planning,
    next_window,
    reads_floor,
    where_to_start,
)
from batchplane.planner.progress import Ahead, Replan, Start
from batchplane.planner.restore import Reopened, delivered_floor, expected_sources, reopen, rewind_horizon
from batchplane.planner.length import JobLength, JobLengths
from batchplane.planner.strategy import JobSchedule, job_mesh, job_mixture, load_schedule, load_strategy
from batchplane.planner.summaries import SummaryStore
from batchplane.planner.window import window_steps

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
        self.strategy = strategy if strategy is not None else load_strategy(job)
        self.mesh = job_mesh(job)
        self.schedule = schedule if schedule is not None else load_schedule(job, self.strategy)
        #: The normalized weights the schedule gave the latest planned step.
        self.shares = self.schedule.initial_shares
        self._adaptive = self.schedule.adaptive
        late = report_delay_warning(self._adaptive, prefetch_steps=job.constructors.prefetch_steps, batch_steps=job.batch_steps)
        if late is not None:
            log.warning("%s", late)
        method = self.strategy.primary.balancing.method
        self.ledger = Ledger(job.source_names, method=method if isinstance(method, str) else "user", compare=job.ledger.compare_methods)
        self._cond = threading.Condition()
        self._planning = job_planning(job, mesh=self.mesh, axis=self.strategy.primary.axis, adaptive=self._adaptive)
        self._mixture: Mixture | None = None
        self._waiting_on = ""
        self._window_steps = window_steps(job, self.strategy, adaptive=self._adaptive is not None)
        self._builder = WindowBuilder(
            job,
            store=store,
            membership=membership,
            metrics=metrics,
            strategy=self.strategy,
            mesh=self.mesh,
            interrupted=lambda: self._planning.interrupted,
            waiting=self._waiting,
            before_waiting=self._record_planned,
        )
        self._lengths = JobLengths(self.schedule, epochs=job.epochs, bad_policy=job.batch.bad_samples.policy)
        self._length_lock = threading.Lock()
        self._compactor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-compaction")
        self._compacting: futures.Future | None = None
        self._unrecorded: list[dict] = []  # the ledger records of `Planning.unrecorded` (planning thread only)
        self._unrecorded_epoch = 0  # the planning epoch they were planned in
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
        planning = self._planning
        with self._cond:
            decision = planning.ask(constructor, step, delivered_below=delivered_below, rewind=rewind)
            if isinstance(decision, Start):
                if self._membership.rejoined():  # a restarted planner: asking says where it stands too
                    self._membership.rejoin_at(constructor, min(step, delivered_below))
                self._start(step, timeout_s=timeout_s, resume=resume or {})
                decision = planning.ask(constructor, step, delivered_below=delivered_below, rewind=rewind)
            give_up = time.monotonic() + timeout_s
            while isinstance(decision, Ahead):  # nothing is planned for it: wait for the window to reach it
                self._cond.notify_all()
                if not self._cond.wait(timeout=max(give_up - time.monotonic(), 0)) and time.monotonic() >= give_up:
                    raise Unavailable(
                        f"step {step} is ahead of the planning window (steps up to {decision.limit}: constructors.prefetch_steps + 2 "
                        f"past the step below which every constructor's ranks were handed every step); retry once they move on"
                    )
                decision = planning.ask(constructor, step, delivered_below=delivered_below, rewind=rewind, again=True)
            while not isinstance(decision, Ahead):
                if isinstance(decision, Replan):
                    log.info(
                        "constructor %d rewinds to step %d, whose plan is no longer kept: re-planning from the ledger's record of step %d",
                        constructor,
                        step,
                        step - 1,
                    )
                self._store.delivered(planning.progress.consumed_below)
                self._cond.notify_all()
                self._cond.wait_for(
                    lambda: planning.answer(step) is not None or planning.dropped(step), timeout=max(give_up - time.monotonic(), 0)
                )
                if not planning.dropped(step) or time.monotonic() >= give_up:
                    break
                # A claim of delivery dropped the plan before this request took it (e.g. its own
                # constructor's heartbeat saying its ranks are past the step): planned again.
                decision = planning.ask(constructor, step, delivered_below=delivered_below, rewind=rewind)
            answer = planning.answer(step)
        if isinstance(answer, Stopping):
            raise Unavailable("the planner is stopping")
        if isinstance(answer, Failed):  # permanent (e.g. a cost function that returns negative costs)
            raise FailedPrecondition(f"planning failed: {answer.reason}")
        if answer is None:
            raise Unavailable(f"plan of step {step} not ready after {timeout_s:.1f} s: {self._waiting_on}")
        return END_OF_DATA if isinstance(answer, EndOfData) else answer

    def following(self, steps: Sequence[int]) -> list[StepPlan]:
        """The plans of `steps`, a constructor's steps after one it was just answered, that are
        planned already, up to the first that is not (`Planning.following`); never waits."""
        with self._cond:
            return self._planning.following(steps)

    def _start(self, step: int, *, timeout_s: float, resume: Mapping[str, str]) -> None:
        """Starts the job where `planning.where_to_start` says: waits for every loader (and, for a
        restarted planner whose ledger does not say where ranks stand, every constructor),
        restores or fast-forwards the mixture, opens this run's generation of the ledger (lock
        held; `restore.reopen`, which also checks the sources against what the ledger recorded).

        Raises:
            FailedPrecondition: a resume the planner cannot make exact, or a changed source.
        """
        ready = self._cond.wait_for(lambda: self._membership.ready or self._planning.stopped, timeout=timeout_s)
        if self._planning.stopped:
            raise Unavailable("the planner is stopping")
        if not ready:
            raise Unavailable(f"waiting for loaders {self._membership.missing_loaders()} to register")
        if self.start_step is not None:  # another request started the job while we waited
            return
        reader = LedgerReader(self._ledger_storage)
        floor = delivered_floor(reader) if reads_floor(step, resume=bool(resume), rejoined=self._membership.rejoined()) else None
        give_up = time.monotonic() + timeout_s
        count = self._job.constructor_count
        while not isinstance(
            where := where_to_start(step, resume=bool(resume), floor=floor, rejoined=self._membership.rejoined(), constructors=count),
            StartAt,
        ):
            if time.monotonic() >= give_up:
                raise Unavailable(f"restarted: waiting for constructors {list(where.waiting)} to rejoin")
            self._cond.wait(timeout=give_up - time.monotonic())
            if self._planning.stopped:
                raise Unavailable("the planner is stopping")
            if self.start_step is not None:
                return
        if where.note:
            log.info("%s", where.note)
        self._mixture = self._make_mixture()
        log.info("mixture: %s", self._mixture.describe())
        opened = self._reopen(where.step, resume, reader)
        start, self._writer = opened.start, opened.writer
        horizon = rewind_horizon(reader, where.step, adaptive=self._adaptive is not None, restarted=bool(opened.restarted))
        self._planning.started(where, state=start.state, resume=start.inside, horizon=horizon, recorded_below=reader.recorded_below())
        self._metrics.start_step.set(where.step)
        self._store.start(start.state.cursors, step=where.step)
        self._cond.notify_all()

    def _reopen(self, step: int, resume: Mapping[str, str], reader: LedgerReader) -> Reopened:
        """Where planning continues from to reach `step`, and this run's generation of the ledger
        (`restore.reopen`, which continues `self.ledger` from the durable one); hands planning
        the adaptive state, and the builder the digests the steps planned again are held to."""
        job, ledger, sources = self._job, self.ledger, self._membership
        opened = reopen(
            step, job=job, mixture=self._mixture, reader=reader, resume=resume, rule=self._adaptive, ledger=ledger, sources=sources
        )
        self.resumed_across, adaptive, self._builder.recorded = opened.start.changed, opened.start.adaptive, opened.recorded
        if adaptive is not None:
            with self._cond:
                self._planning.adaptive_restored(adaptive.state, applied_through=adaptive.applied_through, reports=adaptive.reports)
        return opened

    def _make_mixture(self) -> Mixture:
        """The job's mixture allocator (every loader has registered: the stream ends are known)."""
        return job_mixture(self._job, self.schedule, num_rows=[self._membership.num_rows(k) for k in range(len(self._job.sources))])

    def length(self) -> JobLength:
        """How many steps the job has (`length.JobLengths`): known for a finite job once every
        loader has registered, tightened as bad samples are met, exact once its end is planned."""
        waiting = "" if self._membership.ready else f"waiting for loaders {self._membership.missing_loaders()} to register"
        with self._length_lock:
            begin, planning = time.perf_counter(), self._planning
            length, counted = self._lengths.now(self._make_mixture, waiting=waiting, planned=planning.state, end_step=planning.end_step)
        if counted:
            log.info("the job's length: %s (counted in %.3f s)", length, time.perf_counter() - begin)
        return length

    @property
    def oldest_step(self) -> int:
        """The oldest step a rewind can go back to (the ledger's horizon)."""
        return self._planning.progress.horizon

    @property
    def start_step(self) -> int | None:
        """The step the job started at (lowered by a rewind before it); None before it starts."""
        return self._planning.progress.start

    @property
    def end_step(self) -> int | None:
        """The first step past the job's data; None while unknown."""
        return self._planning.end_step

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
        checked = check_report_request(step, losses, rule=self._adaptive)
        with self._cond:
            writer = self._writer
            refusal = None if writer is None else self._planning.report_refusal(step)
        if writer is None:
            raise Unavailable("the job has not started: no constructor has asked for a step yet")
        if refusal is None:
            stored = writer.put_report(step, {"losses": checked})
        else:  # only a retry of a report that was applied is taken
            stored = writer.report(step) if refusal.applied else None
        accepted, reason = report_taken(step, checked, refusal=refusal, stored=stored)
        if accepted and refusal is None:
            with self._cond:
                self._planning.reported(step, checked)
                self._cond.notify_all()
        return accepted, reason

    def constructor_delivered(self, constructor: int, below: int) -> None:
        """Constructor `constructor` says (it registers again every heartbeat) that every rank it
        serves was handed every step below `below`."""
        with self._cond:
            if self._planning.delivered(constructor, below):
                self._store.delivered(self._planning.progress.consumed_below)
                self._cond.notify_all()

    def constructor_restarted(self, constructor: int) -> int:
        """A constructor registered anew (restarted): it may ask again for the steps from the
        last one its ranks were handed. Returns that step (-1 before the job starts)."""
        with self._cond:
            return self._planning.progress.restarted(constructor)

    def restore_point(self) -> tuple[int, ...] | None:
        """Per source, the cursor before the oldest step not yet handed to every rank: what a
        restarted loader must hold again starts there (None before the job starts)."""
        with self._cond:
            return self._planning.restore_point()

    def wait_ready(self, *, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for every source's loader to register; returns whether they have."""
        with self._cond:
            return self._cond.wait_for(lambda: self._membership.ready or self._planning.stopped, timeout=timeout_s)

    def notify_membership(self) -> None:
        """Wakes requests waiting for loaders to register."""
        with self._cond:
            self._cond.notify_all()

    # ---- planning thread -----------------------------------------------------------------

    def _waiting(self, what: str) -> None:
        """What planning waits for now ("" when nothing), for a request that times out."""
        self._waiting_on = what

    def _plan_loop(self) -> None:
        """Does what `Planning.next_action` says until it says halt, writing the records of what
        it planned when `Planning.record_due` says."""
        planning = self._planning
        while True:
            with self._cond:
                self._cond.wait_for(lambda: planning.next_action() is not None or planning.record_due())
                action, due = planning.next_action(), planning.record_due()
            if isinstance(action, Halt):
                return
            step = planning.unrecorded[0] if due else action.step if isinstance(action, Rewind) else action.state.step
            try:
                if due:
                    self._record_planned()
                elif isinstance(action, Rewind):
                    self._rewind(action.step)
                else:
                    self._plan_next(action)
            except Exception as exc:  # noqa: BLE001 - reported to every waiting request
                log.exception("planning step %d failed", step)
                with self._cond:
                    self._planning.fail(f"step {step}: {exc}")
                    self._cond.notify_all()

    def _rewind(self, step: int) -> None:
        """Goes back to `step` (a rewind): restores the state before it from the ledger as a
        restarted planner does, opens a new generation there, and pulls summaries from its
        cursors again (loaders read again what they freed). Running totals restart, as after a
        planner restart."""
        # What was planned before the rewind and not written yet is written (never served, and
        # superseded from `step` on by the new generation): the record of step - 1, which the
        # rewind restores from, may be among it (ranks that claimed to be past steps the planner
        # had not served yet have them forgotten, and may then rewind to them).
        self._record_planned()
        if self._compacting is not None:
            futures.wait([self._compacting])  # the new generation folds what the old one left
        reader = LedgerReader(self._ledger_storage)
        self.ledger = Ledger(self._job.source_names, method=self.ledger.method, compare=self.ledger.compare)
        with self._cond:
            self._planning.rewinding()
        opened = self._reopen(step, {}, reader)  # (a source that started over at `step` starts over again)
        start, writer = opened.start, opened.writer
        with self._cond:
            self._writer = writer
            self._planning.rewound(step, state=start.state, resume=start.inside)
            self._store.rewind(start.state.cursors, step=step, delivered_below=self._planning.progress.consumed_below)
            self._cond.notify_all()
        self._metrics.rewinds.inc()
        log.info(
            "rewound to step %d: planning again from the ledger's record of step %d (generation %d)", step, step - 1, writer.generation.gen
        )

    def _record_planned(self) -> None:
        """Writes the ledger records of the steps planned and not recorded yet, in one group
        (`LedgerWriter.append`), then lets their plans be served; starts a compaction."""
        if not self._unrecorded:
            return
        records, self._unrecorded = self._unrecorded, []
        with self._cond:
            below = self._planning.progress.consumed_below
        for record in records:  # where the ranks stand now (they only move on since the step was planned)
            record["delivered_below"] = max(record["delivered_below"], below)
        began = time.perf_counter()
        self._writer.append(records)
        self._metrics.ledger_write_seconds.observe(time.perf_counter() - began)
        self._metrics.ledger_write_steps.observe(len(records))
        with self._cond:
            self._planning.recorded(self._unrecorded_epoch, [r["step"] for r in records], delivered_below=below)
            self._cond.notify_all()
        if self._compacting is None or self._compacting.done():  # compaction never stalls planning
            self._compacting = self._compactor.submit(
                self._writer.compact,
                self._planning.progress.consumed_below,
                report_delay=self._adaptive.delay_steps if self._adaptive is not None else None,
            )
            self._compacting.add_done_callback(_log_failure)

    def _plan_next(self, action: PlanNext) -> None:
        """Plans the next window (`planning.next_window`; one step unless the job plans token
        budgets over several) and keeps its plans; their records wait for `_record_planned`."""
        applied = self._adapt(action.state.step) if self._adaptive is not None else []
        if applied is None:
            return  # stopped or rewound while waiting
        resume = self._planning.take_resume()
        planned = next_window(self._mixture, action.state, resume=resume, steps=self._window_steps)
        if planned is None:
            with self._cond:
                self._planning.ended(action.state.step)
                self._cond.notify_all()
            log.info("end of data: the last step is %d", action.state.step - 1)
            return
        built = self._builder.build(planned, stream_ends=self._mixture.stream_ends)
        if built is None:
            self._planning.put_back(resume)
            return  # stopped or rewound while waiting
        planning = self._planning
        adaptive = None if self._adaptive is None else AdaptiveRecord(applied, planning.applied_through, planning.adaptive_state)
        kept, records = [], []
        for i, plan, spans in built.kept:
            allocation = planned.allocations[i]
            records.append(
                self.ledger.record(
                    allocation,
                    plan,
                    built.afters[i],
                    taken=spans,
                    window=built.recorded,
                    substituted=built.substituted.get(i),
                    delivered_below=planning.progress.consumed_below,
                    adaptive=adaptive,
                )
            )
            kept.append((allocation, plan, None if spans is None else [x.count for x in spans]))
        with self._cond:
            window = built.window
            if not self._planning.planned(action.epoch, [plan for _, plan, _ in kept], before=window.before, end=window.end):
                return  # a rewind came in while it was planned: the sequence goes back
            self._unrecorded += records
            self._unrecorded_epoch = action.epoch
            self._store.advance(window.end.cursors, steps=window.end.step)
            if planned.allocations[-1] is not None:
                self.shares = planned.allocations[-1].shares
            self._cond.notify_all()
        for allocation, plan, counts in kept:
            self._metrics.observe_step(
                allocation, plan, self.ledger, counts=counts, waited_s=built.waited_s / len(kept), planned_s=built.planned_s / len(kept)
            )

    def _adapt(self, step: int) -> list[tuple[int, dict | None]] | None:
        """Applies the reports of the steps up to step - delay_steps (waiting for them) and sets
        step `step`'s weights; returns the (step, losses) applied, or None when stopped or rewound."""
        planning, applied = self._planning, []
        while (t := planning.report_due(step)) is not None:
            with self._cond:
                while not planning.report_in(t) and not planning.interrupted:
                    delay = self._adaptive.delay_steps
                    self._waiting(
                        f"waiting for the training report of step {t}: with mixture.schedule.adaptive.delay_steps = {delay}, "
                        f"step {step} is planned with the reports of steps up to {step - delay} (Client.report(step, losses))"
                    )
                    self._cond.wait(timeout=1.0)
                if planning.interrupted:
                    return None
                applied.append((t, planning.apply_report(t)))
                self._waiting("")
        self.schedule.schedule.set(step, planning.adaptive_state.weights)
        self.schedule.schedule.forget_before(step)
        return applied

    # ---- status --------------------------------------------------------------------------

    @property
    def steps_planned(self) -> int:
        return self.ledger.steps

    @property
    def finished(self) -> bool:
        """True once every rank has been handed every step and asked for the end-of-data step
        (its constructor says so with its requests and heartbeats)."""
        with self._cond:
            return self._planning.finished

    def stop(self) -> None:
        with self._cond:
            self._planning.stop()
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._compactor.shutdown(wait=True)


def _log_failure(done: futures.Future) -> None:
    """Logs a compaction that failed; the ledger stays whole (the steps stay as they were) and the
    next step tries again."""
    if not done.cancelled() and done.exception() is not None:
        log.error("compacting the ledger failed", exc_info=done.exception())
