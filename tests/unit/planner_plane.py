"""An in-process planner for tests: the real servicer, plan book, membership and summary store,
with a thread standing in for the loaders (it answers the store's wants with rows and lengths
of its own) and the job's constructors registered. No sockets, no processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from prometheus_client import CollectorRegistry

from batchplane.core.storage import MemoryStorage
from batchplane.planner.book import PlanBook
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.server import summary_lookahead
from batchplane.planner.service import PlannerServicer
from batchplane.planner.strategy import load_schedule, load_strategy
from batchplane.planner.window import window_steps
from batchplane.planner.summaries import SummaryStore
from batchplane.v1 import common_pb2, planner_pb2
from batchplane.wire import decode_array

#: length(source, seqs) -> int32 lengths (0 marks a bad sample).
Lengths = Callable[[int, np.ndarray], np.ndarray]


def eight(source: int, seq: np.ndarray) -> np.ndarray:
    """Every sample 8 tokens long."""
    return np.full(len(seq), 8, np.int32)


class Plane:
    """A planner whose sources have `row_groups[k]` rows per row group, one constructor per DP
    rank registered by `join`.

    Args:
        job: The job; its sources in order.
        row_groups: Per source, the sizes of its row groups.
        lengths: Sample lengths by (source, seqs).
        ledger: The ledger's storage (a resume passes the one of an earlier plane).
        lookahead: Samples per source the store wants ahead of its cursor; default: what the
            planner service asks for (`summary_lookahead`), at least 16.
        files: Per source, the files its loader reports (`SourceInfo.files`); default: none.
    """

    def __init__(
        self,
        job,
        *,
        row_groups: Sequence[Sequence[int]],
        lengths: Lengths = eight,
        ledger: MemoryStorage | None = None,
        lookahead: int | None = None,
        files: Sequence[Sequence[common_pb2.SourceFile]] | None = None,
    ) -> None:
        self.job = job
        self.files = [list(f) for f in files] if files is not None else [[] for _ in row_groups]
        self.row_groups = [tuple(g) for g in row_groups]
        self.rows = [sum(g) for g in self.row_groups]
        self.lengths = lengths
        self.ledger = ledger if ledger is not None else MemoryStorage()
        self.membership = Membership(job)
        if lookahead is None:
            strategy = load_strategy(job)
            window = window_steps(job, strategy, adaptive=load_schedule(job, strategy).adaptive is not None)
            lookahead = max(16, summary_lookahead(job, window=window))
        self.store = SummaryStore(len(job.sources), lookahead=lookahead)
        metrics = PlannerMetrics(
            CollectorRegistry(), source_names=job.source_names, target_weights=[1.0 / len(job.sources)] * len(job.sources)
        )
        self.book = PlanBook(job, membership=self.membership, store=self.store, metrics=metrics, ledger=self.ledger)
        self.service = PlannerServicer(job, self.membership, self.book, self.store, metrics)
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, daemon=True)
        self._feeder.start()

    @property
    def constructors(self) -> range:
        return range(self.job.constructor_count)

    def join(self) -> None:
        """Registers the loader of every source and every constructor."""
        self.service.RegisterLoader(
            planner_pb2.RegisterLoaderRequest(
                loader_index=0,
                address="loader:0",
                incarnation="i0",
                sources=[
                    common_pb2.SourceInfo(name=name, num_rows=rows, row_group_sizes=groups, files=files)
                    for name, rows, groups, files in zip(self.job.source_names, self.rows, self.row_groups, self.files)
                ],
            ),
            None,
        )
        for c in self.constructors:
            ranks = self.job.constructor_ranks(c)
            self.service.RegisterConstructor(
                planner_pb2.RegisterConstructorRequest(constructor_index=c, address=f"c:{c}", ranks=ranks), None
            )

    def _feed(self) -> None:
        """The loaders: rows of seqs in order (seq modulo the rows), 16 at a time."""
        while not self._stop.is_set():
            with self.store.cond:
                self.store.cond.wait_for(
                    lambda: self._stop.is_set() or any(self.store.wanted(k) is not None for k in range(len(self.rows))), timeout=0.2
                )
                wants = [(k, self.store.wanted(k)) for k in range(len(self.rows))]
            for k, want in wants:
                if want is None:
                    continue
                end = None if self.job.epochs is None else self.job.stream_end(k, self.rows[k])
                start = want[0]
                stop = start + 16 if end is None else min(start + 16, end)
                seq = np.arange(start, stop, dtype=np.int64)
                self.store.add(k, start, seq % self.rows[k], self.lengths(k, seq), end is not None and stop == end)

    def plan(
        self, constructor: int, step: int, *, delivered_below: int | None = None, wait_ms: int = 30_000, **fields
    ) -> planner_pb2.GetPlanResponse:
        below = step if delivered_below is None else delivered_below
        request = planner_pb2.GetPlanRequest(constructor_index=constructor, step=step, delivered_below=below, wait_ms=wait_ms, **fields)
        return self.service.GetPlan(request, None)

    def run(
        self, first: int = 0, *, resume: Mapping[str, str] | None = None, until: int | None = None
    ) -> dict[int, list[planner_pb2.GetPlanResponse]]:
        """Every constructor takes every step from `first` to the end (or to `until`, excluded),
        in lockstep, as trainers do; returns per step each constructor's answer."""
        steps: dict[int, list[planner_pb2.GetPlanResponse]] = {}
        step = first
        while until is None or step < until:
            extra = {"resume": dict(resume)} if resume and step == first else {}
            got = [self.plan(c, step, **extra) for c in self.constructors]
            if any(r.end_of_data for r in got):
                assert all(r.end_of_data for r in got)
                break
            steps[step] = got
            step += 1
        return steps

    def stop(self) -> None:
        self._stop.set()
        self.book.stop()


def samples(rank: planner_pb2.RankPlan) -> Iterator[tuple[int, int]]:
    """(source, seq) of a rank plan's samples."""
    source = decode_array(rank.samples.source, field="source").tolist()
    seq = decode_array(rank.samples.seq, field="seq").tolist()
    return zip(source, seq)


def step_samples(answers: Sequence[planner_pb2.GetPlanResponse]) -> list[tuple[int, int]]:
    """(source, seq) of every sample of a step, over every constructor's answer."""
    return [pair for r in answers for rank in r.ranks for pair in samples(rank)]
