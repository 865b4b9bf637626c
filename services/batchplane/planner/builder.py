"""Builds the plans of one planning window (`planning.next_window`): waits for the summaries of
its samples in the summary store, holds samples planned before to the digests the ledger
recorded of them (`digests.held_to`, after a restart or a rewind), substitutes its bad samples
(`substitute`), and runs the job's strategy over them (see `dgraph`). What to plan, and what is kept, is `planning`'s; recording the
plans in the ledger is `book.PlanBook`'s. Waits on the store; holds no lock and no plan state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from batchplane.core.bad import reason_name
from batchplane.core.config import JobSettings
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.dgraph import Strategy
from batchplane.planner.digests import Identity, held_to
from batchplane.planner.intervals import IntervalSet
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.mixture import Allocation, MixtureState
from batchplane.planner.plan import SampleTable, StepPlan
from batchplane.planner.planning import WindowPlan
from batchplane.planner.substitute import check_policy, entries, substitute
from batchplane.planner.summaries import SummaryStore, wait_for_summary
from batchplane.planner.window import Window, home_steps, taken, without

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Built:
    """A window's plans.

    Attributes:
        window: The window (with its substitutes, if any).
        afters: Per step, the mixture's state after it.
        kept: (window step, plan, per source the seqs it consumes where the ledger records them,
            else None) of the steps to keep.
        substituted: The ledger's substitution entries by window step.
        recorded: The window as the ledger records it (None: a one-step window).
        waited_s: Seconds spent waiting for summaries.
        planned_s: Seconds spent planning.
    """

    window: Window
    afters: list[MixtureState]
    kept: list[tuple[int, StepPlan, list[IntervalSet] | None]]
    substituted: dict[int, list[dict]]
    recorded: dict | None
    waited_s: float
    planned_s: float


class WindowBuilder:
    """Builds windows' plans for one job.

    Args:
        job: The job's settings.
        store: Sample metadata pulled from the loaders.
        membership: Registered loaders (their sources' row counts).
        metrics: The planner's metrics (substitutions).
        strategy: The job's strategy.
        mesh: The job's mesh.
        interrupted: Whether to stop waiting (the planner stops, or a rewind came in).
        waiting: Told what the build waits for ("" once it waits no more).
        before_waiting: Called before the build waits for summaries (the planner records the
            steps it planned, whose delivery may be what frees the loaders to read on).
    """

    def __init__(
        self,
        job: JobSettings,
        *,
        store: SummaryStore,
        membership: Membership,
        metrics: PlannerMetrics,
        strategy: Strategy,
        mesh: ClientPlaceTree,
        interrupted: Callable[[], bool],
        waiting: Callable[[str], None],
        before_waiting: Callable[[], None] = lambda: None,
    ) -> None:
        self._job = job
        self._store = store
        self._membership = membership
        self._metrics = metrics
        self._strategy = strategy
        self._mesh = mesh
        self._interrupted = interrupted
        self._waiting = waiting
        self._before_waiting = before_waiting
        self._cost_fn = make_cost_fn(job.balance.cost.kind, linear=job.balance.cost.linear, quadratic=job.balance.cost.quadratic)
        #: The digests the ledger recorded of samples planned before this start or rewind
        #: (`restore.recorded_digests`), which they are planned with again.
        self.recorded: Mapping[Identity, int] = {}

    def build(self, planned: WindowPlan, *, stream_ends: Sequence[int | None]) -> Built | None:
        """The plans of `planned`'s window; None when stopped or rewound while waiting.

        Raises:
            FailedPrecondition: bad samples policy "fail" and more bad samples than it tolerates.
        """
        window, allocations, afters = planned.window, planned.allocations, list(planned.afters)
        begin = time.perf_counter()
        table = self._allocated_samples(window.ranges)
        if table is None:
            return None
        table = self._held_to_ledger(without(table, window.skip))
        home = np.zeros(len(table), np.int64) if window.leftover else home_steps(table, allocations)
        substituted: dict[int, list[dict]] = {}
        if not window.leftover and self._job.batch.bad_samples.policy != "skip":
            found = self._substitute(window, allocations[-1], table, home, stream_ends=stream_ends)
            if found is None:
                return None
            window, table, home, substituted = found
            afters[-1] = window.end
        waited = time.perf_counter() - begin
        plans = self._plan_window(window, table, home)
        recorded = window.to_json() if window.steps > 1 or window.leftover else None
        planned_s = time.perf_counter() - begin - waited
        sources = len(self._job.sources)
        kept = [
            (i, plan, taken(plan, table, home, i, sources) if recorded is not None or substituted else None)
            for i, plan in enumerate(plans)
            if plan.step >= planned.keep_from  # (those before: planned again only to plan the rest identically)
        ]
        return Built(window, afters, kept, substituted, recorded, waited, planned_s)

    def _held_to_ledger(self, table: SampleTable) -> SampleTable:
        """`table` with the digests the ledger recorded of its samples (`digests.held_to`); says
        where the loaders now summarize other ones."""
        table, changed = held_to(table, self.recorded)
        if len(changed):
            i = int(changed[0])
            log.warning(
                "%d sample(s) planned again are summarized with other digests than the ledger recorded when they were first planned "
                "(first: source %r position %d): planned with the recorded ones, so constructors refuse content that differs from it",
                len(changed),
                self._job.sources[int(table.source[i])].name,
                int(table.seq[i]),
            )
        return table

    def _substitute(
        self, window: Window, last: Allocation, table: SampleTable, home: np.ndarray, *, stream_ends: Sequence[int | None]
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

        done = substitute(window, last, table, home, stream_ends=stream_ends, fetch=fetch)
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
        limit = {
            "default_cost": self._cost_fn,
            "max_length": job.max_length,
            "length_policy": job.batch.length_policy,
            "packed": job.batch.packing,
        }
        if self._strategy.windowed:
            return self._strategy.run_window(window.first, table, home, self._mesh, steps=window.steps, **limit)
        # The rest of a window after a resume that also left token budgets: its samples in
        # (source, seq) order, cut into its steps.
        parts = np.array_split(np.lexsort((table.seq, table.source)), window.steps)
        return [self._strategy.run(window.first + i, table.take(np.sort(part)), self._mesh, **limit) for i, part in enumerate(parts)]

    def _allocated_samples(self, ranges: Sequence[tuple[int, int]]) -> SampleTable | None:
        """The samples of (first seq, count) of every source, once their summaries are known;
        None when stopped or rewound while waiting."""
        tables = []
        for k, (start, count) in enumerate(ranges):
            if not count:
                continue
            got = wait_for_summary(self._store, k, start, count, timeout_s=0)
            if got is None:
                self._before_waiting()
            while got is None and not self._interrupted():
                got = wait_for_summary(self._store, k, start, count, timeout_s=1.0)
                if got is None:
                    group = self._job.loader_of(k)
                    self._waiting(
                        f"waiting for summaries of source {self._job.sources[k].name!r} (positions {start}..{start + count - 1}) "
                        f"from loader {group} ({len(self._membership.replicas(group))} replicas)"
                    )
            if got is None:
                return None
            rows, lengths, features = got
            digests = self._store.digests(k, start, count)
            seq = np.arange(start, start + count, dtype=np.int64)
            tables.append(
                SampleTable(
                    source=np.full(count, k, np.int32),
                    seq=seq,
                    row=rows,
                    length=lengths,
                    epoch=(seq // self._membership.num_rows(k)).astype(np.int32),
                    features=features,
                    digest=np.zeros(0, np.int64) if digests is None else digests,
                )
            )
        self._waiting("")
        return SampleTable.concat(tables)
