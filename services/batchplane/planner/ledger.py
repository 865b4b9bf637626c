"""The ledger of what each step consumed. Pure; no I/O (the planner writes its lines out).

Consumption is contiguous per source (see `mixture`), so a step's record is one seq range per
source plus the rank and microbatch of every sample. The ledger also keeps running totals: the
realized mixture per source and, for the balancing figures, each step's per-rank cost spread
under the configured method and, on the same samples, under the other methods.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import numpy as np

from batchplane.planner.balance import METHODS, partition, spread
from batchplane.planner.mixture import Allocation
from batchplane.planner.plan import StepPlan


@dataclasses.dataclass
class SourceTotals:
    """Realized consumption of one source."""

    samples: int = 0
    tokens: int = 0
    bad_samples: int = 0


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


class Ledger:
    """Records steps in order and keeps the job's running totals.

    Args:
        source_names: Source names, in source order.
        method: The configured balancing method; the others are evaluated for comparison.
    """

    def __init__(self, source_names: Sequence[str], *, method: str) -> None:
        self.source_names = tuple(source_names)
        self.method = method
        self.sources = [SourceTotals() for _ in source_names]
        self.balance = {m: BalanceTotals() for m in (method, *[m for m in METHODS if m != method])}
        self.steps = 0

    def record(self, allocation: Allocation, plan: StepPlan) -> str:
        """Adds one planned step; returns its ledger line (JSON, no trailing newline)."""
        if allocation.step != plan.step:
            raise ValueError(f"allocation of step {allocation.step} with plan of step {plan.step}")
        self.steps += 1
        tokens = np.bincount(plan.samples.source, weights=plan.samples.length, minlength=len(self.sources))
        good = np.bincount(plan.samples.source, minlength=len(self.sources))
        for k, totals in enumerate(self.sources):
            totals.samples += allocation.counts[k]
            totals.tokens += int(tokens[k])
            totals.bad_samples += allocation.counts[k] - int(good[k])
        if len(plan.samples) >= plan.dp:
            self.balance[self.method].add(plan.rank_costs())
            for method, totals in self.balance.items():
                if method != self.method:
                    totals.add(np.array([plan.costs[g].sum() for g in partition(plan.costs, plan.dp, method)]))
        return json.dumps(
            {
                "step": plan.step,
                "take": {
                    name: [start, count]
                    for name, start, count in zip(self.source_names, allocation.starts, allocation.counts)
                    if count
                },
                "bad": plan.bad_samples,
                "ranks": [
                    [
                        [[int(plan.samples.source[i]), int(plan.samples.row[i]), int(plan.samples.epoch[i])] for i in mb]
                        for mb in rank
                    ]
                    for rank in plan.microbatches
                ],
            },
            separators=(",", ":"),
        )
