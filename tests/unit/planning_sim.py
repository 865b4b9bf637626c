"""A pure simulation of the planner over synthetic sources: the loaders' order, the mixture and
the plan builder composed exactly as the services compose them, without processes or files.
Used by the invariant tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from batchplane.core.order import SampleOrder
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.core.schedule import Static
from batchplane.planner.plan import SampleTable, StepPlan, build_step_plan


@dataclasses.dataclass(frozen=True)
class SimSource:
    """A synthetic source: row lengths (0 marks a bad row) cut into row groups."""

    name: str
    lengths: np.ndarray
    row_group_size: int


@dataclasses.dataclass(frozen=True)
class SimJob:
    sources: tuple[SimSource, ...]
    weights: tuple[float, ...]
    global_batch_size: int
    dp: int
    microbatches: int
    method: str = "karmarkar_karp"
    epochs: int | None = 1
    seed: int = 0
    window_row_groups: int = 2
    #: Per source, passes per epoch (SourceSettings.repeat); None: 1 for every source.
    repeats: tuple[int, ...] | None = None

    def repeat(self, k: int) -> int:
        return 1 if self.repeats is None else self.repeats[k]

    def orders(self) -> list[SampleOrder]:
        return [
            SampleOrder(
                _row_groups(len(s.lengths), s.row_group_size),
                seed=self.seed,
                source_name=s.name,
                window_row_groups=self.window_row_groups,
            )
            for s in self.sources
        ]

    def mixture(self) -> Mixture:
        ends = [None if self.epochs is None else self.epochs * self.repeat(k) * len(s.lengths) for k, s in enumerate(self.sources)]
        return Mixture(Static(self.weights), global_batch_size=self.global_batch_size, stream_ends=ends)


def _row_groups(num_rows: int, size: int) -> list[int]:
    full, rest = divmod(num_rows, size)
    return [size] * full + ([rest] if rest else [])


def rows_at(order: SampleOrder, seqs: np.ndarray, windows: dict[tuple[int, int], np.ndarray] | None = None) -> np.ndarray:
    """The source row at each seq, as a loader would read it (a window's rows made once, kept in
    `windows` by (epoch, window index) across calls, as a loader keeps the window it reads)."""
    windows = {} if windows is None else windows
    out = np.empty(len(seqs), np.int64)
    for i, seq in enumerate(seqs.tolist()):
        epoch, position = divmod(seq, order.num_rows)
        window = order.window_at(epoch, position)
        if (epoch, window.index) not in windows:
            windows[epoch, window.index] = order.window_rows(epoch, window)
        out[i] = windows[epoch, window.index][position - window.start]
    return out


def simulate(job: SimJob, *, start_step: int = 0, max_steps: int = 10_000) -> list[StepPlan]:
    """Plans from `start_step` until the data ends (or `max_steps` plans)."""
    orders = job.orders()
    windows: list[dict[tuple[int, int], np.ndarray]] = [{} for _ in orders]
    mixture = job.mixture()
    cost_fn = make_cost_fn("quadratic")
    state = mixture.fast_forward(MixtureState.initial(len(job.sources)), start_step)
    plans = []
    while len(plans) < max_steps:
        allocation, after = mixture.allocate(state)
        if allocation.end_of_data:
            break
        tables = []
        for k, (start, count) in enumerate(zip(allocation.starts, allocation.counts)):
            seq = np.arange(start, start + count, dtype=np.int64)
            rows = rows_at(orders[k], seq, windows[k])
            tables.append(
                SampleTable(
                    source=np.full(count, k, np.int32),
                    seq=seq,
                    row=rows,
                    length=job.sources[k].lengths[rows].astype(np.int32),
                    epoch=(seq // orders[k].num_rows).astype(np.int32),
                )
            )
        plans.append(
            build_step_plan(
                state.step,
                SampleTable.concat(tables),
                dp=job.dp,
                microbatches=job.microbatches,
                method=job.method,
                cost_fn=cost_fn,
            )
        )
        state = after
    return plans


def delivered(plans: list[StepPlan]) -> list[tuple[int, int, int]]:
    """(source, row, epoch) of every delivered sample, in plan order."""
    out = []
    for plan in plans:
        for rank in range(plan.dp):
            table, _ = plan.rank_samples(rank)
            out += list(zip(table.source.tolist(), table.row.tolist(), table.epoch.tolist()))
    return out


def fingerprint(plan: StepPlan) -> tuple:
    """Everything a trainer observes of a plan: per rank, per microbatch, the samples."""
    return tuple(
        tuple(tuple(zip(plan.samples.source[mb].tolist(), plan.samples.row[mb].tolist())) for mb in rank) for rank in plan.microbatches
    )
