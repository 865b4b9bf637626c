"""The ledger of what each step consumed. Pure; no I/O (`journal` writes the records out).

Consumption is contiguous per source (see `mixture`), so a step's record is one seq range per
source plus the rank and microbatch of every sample, and the mixture state after the step (what
a resume restores), with what a restarted planner reads back beside it (`restore`): where the
ranks stood, the substitutions of bad samples and the adaptive mixing state. The ledger also
keeps running totals: the
realized mixture per source and, for the balancing figures, each step's per-rank cost spread
under the configured method and, on the same samples, under the other methods: the cost of the
microbatches as the constructor builds them, padding included (`StepPlan.built_rank_costs`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchplane.planner.adaptive import AdaptiveState, state_to_json as adaptive_to_json
from batchplane.planner.balance import METHODS, partition, spread
from batchplane.planner.digests import record_digests
from batchplane.planner.intervals import IntervalSet
from batchplane.planner.mixture import Allocation, MixtureState
from batchplane.planner.plan import Balancing, StepPlan, assign


@dataclasses.dataclass
class SourceTotals:
    """Realized consumption of one source."""

    samples: int = 0
    tokens: int = 0
    bad_samples: int = 0
    #: Sum over steps of the target share times the step's samples: what the schedule asked for.
    target_samples: float = 0.0
    #: Sum over steps of the configured share times the step's samples: what the schedule's
    #: weights ask for over every source they weigh, sources that have run out included (the
    #: target renormalizes over the others; this does not, so running out shows as drift).
    configured_samples: float = 0.0


@dataclasses.dataclass
class BalanceTotals:
    """Per-rank cost spread of one balancing method, summed over steps."""

    steps: int = 0
    sum_max_over_min: float = 0.0
    sum_max_over_mean: float = 0.0

    def add(self, rank_costs: np.ndarray) -> None:
        max_over_min, max_over_mean = spread(rank_costs)
        if math.isfinite(max_over_min):
            self.steps += 1
            self.sum_max_over_min += max_over_min
            self.sum_max_over_mean += max_over_mean

    @property
    def mean_max_over_min(self) -> float:
        return self.sum_max_over_min / self.steps if self.steps else float("nan")

    @property
    def mean_max_over_mean(self) -> float:
        return self.sum_max_over_mean / self.steps if self.steps else float("nan")


#: The other balancing methods are compared on every one of the first COMPARE_ALL steps, then on
#: every COMPARE_EVERY-th (each comparison plans the step again per method; their means are then
#: over that sample of the steps).
COMPARE_ALL = 32
COMPARE_EVERY = 8


def _compared(step_count: int) -> bool:
    """Whether the `step_count`-th recorded step (from 1) is compared with the other methods."""
    return step_count <= COMPARE_ALL or step_count % COMPARE_EVERY == 0


def _built_costs(plan: StepPlan, method: str) -> np.ndarray:
    """Per-bucket cost of the plan's samples balanced by `method` instead, into as many
    microbatches per bucket, as the constructor would build them (padding included unless the
    job packs); without the plan's `rows`, the sum of the samples' costs per bucket."""
    if plan.rows is None:
        return np.array([plan.costs[g].sum() for g in partition(plan.costs, plan.dp, method)])
    microbatches = assign(
        plan.costs,
        plan.samples.length.astype(np.int64),
        buckets=plan.dp,
        balancing=Balancing(method=method, microbatches=max(plan.num_microbatches, 1)),
        rows=plan.rows,
        max_length=plan.max_length,
        length_policy=plan.length_policy,
    )
    return plan.rows.bucket_costs(microbatches)


@dataclasses.dataclass(frozen=True)
class AdaptiveRecord:
    """Where adaptive mixing stood when a step was planned: a record's "adaptive" field, which
    a resume restores it from (`restore.restore_adaptive`).

    Attributes:
        applied: The (step, losses) of the reports applied before the step's window was
            planned (losses None: missing).
        applied_through: The last step whose report the state holds.
        state: The adaptive rule's state.
    """

    applied: Sequence[tuple[int, dict | None]]
    applied_through: int
    state: AdaptiveState

    def to_json(self) -> dict[str, Any]:
        applied = [[step, losses] for step, losses in self.applied]
        return {"applied": applied, "applied_through": self.applied_through, "state": adaptive_to_json(self.state)}


class Ledger:
    """Records steps in order and keeps the job's running totals.

    Args:
        source_names: Source names, in source order.
        method: The configured balancing method.
        compare: Also evaluate the other built-in partition methods on the recorded steps
            (`ledger.compare_methods`; see `COMPARE_ALL`).
    """

    def __init__(self, source_names: Sequence[str], *, method: str, compare: bool = False) -> None:
        self.source_names = tuple(source_names)
        self.method = method
        self.sources = [SourceTotals() for _ in source_names]
        self.compare = compare
        self.balance = {m: BalanceTotals() for m in (method, *([m for m in METHODS if m != method] if compare else []))}
        self.steps = 0
        #: Per source, the seqs every recorded step (and, after `restore`, every earlier
        #: generation) consumed.
        self.consumed = [IntervalSet.empty() for _ in source_names]

    def assume_consumed(self, cursors: Sequence[int]) -> None:
        """Continues from mixture cursors without a record (a fast-forward): each source's seqs
        below its cursor were consumed."""
        self.consumed = [IntervalSet([(0, c)]) for c in cursors]

    def restore(self, record: dict[str, Any]) -> None:
        """Continues from a recorded step (a resume): its consumption is the past's."""
        self.consumed = [IntervalSet.from_list(record["consumed"].get(name, [])) for name in self.source_names]

    def record(
        self,
        allocation: Allocation | None,
        plan: StepPlan,
        after: MixtureState,
        *,
        taken: Sequence[IntervalSet] | None = None,
        window: dict[str, Any] | None = None,
        substituted: list[dict] | None = None,
        delivered_below: int | None = None,
        adaptive: AdaptiveRecord | None = None,
    ) -> dict[str, Any]:
        """Adds one planned step; returns its record (JSON-ready):

        - step; shares: the target share of each source; take: {source: [first seq, count]}, what
          the mixture allocated to the step;
        - tokens: {source: tokens of its good samples}; bad: samples left out as bad;
        - ranks: per bucket, per microbatch, [source, row, epoch] of each sample;
        - digests: beside "ranks", each sample's digest as its loader summarized it (16 hex
          digits, `digests.record_digests`); absent when the samples carry none;
        - after: the mixture state after the step (`state_to_json`);
        - consumed: {source: [[first, end), ...]}: every seq consumed up to this step, across
          resumes (a snapshot: a resume restores it from the step before);
        - with a planning window (`batchplane.planner.window`): window, the window's
          `Window.to_json`, and samples: {source: [[first, end), ...]}, the seqs the step
          consumed (its samples may come from anywhere in the window's range);
        - substituted: the step's substitutions of bad samples, as given;
        - delivered_below: every rank had been handed every step below it (where a restarted
          planner may resume, `restore.delivered_floor`);
        - adaptive: `AdaptiveRecord.to_json`.

        Args:
            allocation: What the mixture allocated to the step; None for a step of a window
                that a resume across a settings change began (its samples were allocated to
                the window before): it then has no target of its own.
            plan: The step's plan.
            after: The mixture's state after the step.
            taken: Per source, the seqs the step consumes; default: the allocation's ranges.
            window: The step's window (`Window.to_json`), recorded as is.
            substituted: The ledger's substitution entries of the step (`substitute.entries`);
                None: none recorded.
            delivered_below: Where the ranks stood when the step was planned (the planner
                raises it to where they stand when it writes the record); None: not recorded.
            adaptive: Where adaptive mixing stood; None: the mixture does not adapt.
        Raises:
            ValueError: the step takes a seq already consumed (I1 guard), or has neither an
                allocation nor `taken`.
        """
        if allocation is not None and allocation.step != plan.step:
            raise ValueError(f"allocation of step {allocation.step} with plan of step {plan.step}")
        if taken is None:
            if allocation is None:
                raise ValueError(f"step {plan.step} has no allocation: the seqs it takes must be given")
            taken = [
                IntervalSet([(start, start + count)]) if count else IntervalSet.empty()
                for start, count in zip(allocation.starts, allocation.counts)
            ]
        for k, spans in enumerate(taken):
            again = spans.intersection(self.consumed[k])
            if not again.is_empty:
                raise ValueError(
                    f"step {plan.step} would take seqs {_shown(again)} of source {self.source_names[k]!r} again "
                    f"(consumed: {_shown(self.consumed[k])}); refusing to deliver a sample twice (I1)"
                )
        for k, spans in enumerate(taken):
            self.consumed[k] = self.consumed[k].union(spans)
        self.steps += 1
        tokens = np.bincount(plan.samples.source, weights=plan.samples.length, minlength=len(self.sources))
        good = np.bincount(plan.samples.source, minlength=len(self.sources))
        counts = [spans.count for spans in taken]
        total = sum(counts)
        for k, totals in enumerate(self.sources):
            totals.samples += counts[k]
            totals.tokens += int(tokens[k])
            totals.bad_samples += counts[k] - int(good[k])
            if allocation is None:  # no target of its own: it counts as on target
                totals.target_samples += counts[k]
                totals.configured_samples += counts[k]
                continue
            totals.target_samples += allocation.shares[k] * allocation.total if allocation.shares else 0.0
            configured = allocation.configured or allocation.shares
            totals.configured_samples += configured[k] * allocation.total if configured else 0.0
        if len(plan.samples) >= plan.dp:
            self.balance[self.method].add(plan.built_rank_costs())
            if self.compare and _compared(self.steps):
                for method, other in self.balance.items():
                    if method != self.method:
                        other.add(_built_costs(plan, method))
        shares = allocation.shares if allocation is not None else [c / total if total else 0.0 for c in counts]
        identities = np.stack([plan.samples.source, plan.samples.row, plan.samples.epoch], axis=1).astype(np.int64)  # [n, 3]
        record = {
            "step": plan.step,
            "shares": [round(float(x), 9) for x in shares],
            "take": {name: [start, count] for name, start, count in zip(self.source_names, allocation.starts, allocation.counts) if count}
            if allocation is not None
            else {},
            "tokens": {name: int(tokens[k]) for k, name in enumerate(self.source_names) if counts[k]},
            "bad": plan.bad_samples,
            "ranks": [[identities[np.asarray(mb, np.int64)].tolist() for mb in rank] for rank in plan.microbatches],
            "after": state_to_json(after),
            "consumed": {name: c.to_list() for name, c in zip(self.source_names, self.consumed) if not c.is_empty},
        }
        digests = record_digests(plan)
        if digests is not None:
            record["digests"] = digests
        if window is not None:
            record["window"] = window
            record["samples"] = {name: spans.to_list() for name, spans in zip(self.source_names, taken) if not spans.is_empty}
        if substituted is not None:
            record["substituted"] = substituted
        if delivered_below is not None:
            record["delivered_below"] = delivered_below
        if adaptive is not None:
            record["adaptive"] = adaptive.to_json()
        return record


#: Ranges of an interval set an error message shows before "... N ranges, M seqs in all".
SHOWN_RANGES = 3


def _shown(seqs: IntervalSet) -> str:
    """`seqs` for an error message: its first `SHOWN_RANGES` ranges [lo, hi), then how many there
    are in all, so a message stays a line whatever the set holds."""
    ranges = seqs.to_list()
    if len(ranges) <= SHOWN_RANGES:
        return str(ranges)
    head = ", ".join(str(r) for r in ranges[:SHOWN_RANGES])
    return f"[{head}, ... {len(ranges)} ranges, {seqs.count} seqs in all]"


def state_to_json(state: MixtureState) -> dict[str, Any]:
    """A mixture state as a record's "after" field."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(state).items()}


def state_from_json(data: dict[str, Any]) -> MixtureState:
    """The mixture state of a record's "after" field."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return MixtureState(**fields)
