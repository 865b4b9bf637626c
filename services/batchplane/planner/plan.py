"""The plan of one step: which samples each data-parallel rank trains on, microbatch by
microbatch. Pure; no I/O.

`build_step_plan` takes the samples the mixture allocated to the step (with their lengths from
the loaders' summaries), leaves out the bad ones (length 0: they are consumed, never
delivered), balances the rest over ranks and then over each rank's microbatches by cost. Every
rank gets exactly `microbatches` microbatches (I2); a microbatch left without samples (only when
a step has fewer good samples than microbatches in all, as in a finite job's last step) is a
filler the constructor pads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from batchplane.planner.balance import partition
from batchplane.planner.cost import CostFn


_COLUMNS = (("source", np.int32), ("seq", np.int64), ("row", np.int64), ("length", np.int32), ("epoch", np.int32))


@dataclasses.dataclass(frozen=True)
class SampleTable:
    """Samples as parallel arrays: source index (int32), seq (int64), row (int64), length
    (int32, 0 for a bad sample), epoch (int32), and per-sample features by name (float64)."""

    source: np.ndarray
    seq: np.ndarray
    row: np.ndarray
    length: np.ndarray
    epoch: np.ndarray
    features: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def empty(cls) -> SampleTable:
        return cls(**{name: np.zeros(0, dtype) for name, dtype in _COLUMNS})

    @classmethod
    def concat(cls, tables: Sequence[SampleTable]) -> SampleTable:
        """The tables one after another; a feature missing from a table is 0 for its samples."""
        if not tables:
            return cls.empty()
        names = sorted({name for t in tables for name in t.features})
        return cls(
            **{name: np.concatenate([getattr(t, name) for t in tables]) for name, _ in _COLUMNS},
            features={
                name: np.concatenate([t.features.get(name, np.zeros(len(t))) for t in tables]) for name in names
            },
        )

    def take(self, index: np.ndarray) -> SampleTable:
        return SampleTable(
            **{name: getattr(self, name)[index] for name, _ in _COLUMNS},
            features={name: values[index] for name, values in self.features.items()},
        )

    def __len__(self) -> int:
        return len(self.seq)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every rank trains on in one step.

    Attributes:
        step: The step.
        samples: The step's good samples in (source, seq) order.
        microbatches: microbatches[rank][m] = indices into `samples`, ascending.
        bad_samples: Samples of the step's allocation left out as bad.
        costs: Cost of each sample in `samples` under the job's cost model.
    """

    step: int
    samples: SampleTable
    microbatches: tuple[tuple[np.ndarray, ...], ...]
    bad_samples: int
    costs: np.ndarray

    @property
    def dp(self) -> int:
        return len(self.microbatches)

    def rank_samples(self, rank: int) -> tuple[SampleTable, np.ndarray]:
        """The samples of `rank` microbatch after microbatch, and the int64 microbatch offsets
        (len = microbatches + 1)."""
        parts = self.microbatches[rank]
        index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        offsets = np.zeros(len(parts) + 1, np.int64)
        offsets[1:] = np.cumsum([len(p) for p in parts])
        return self.samples.take(index), offsets

    def rank_costs(self) -> np.ndarray:
        """Total cost of each rank (float64 [dp])."""
        return np.array([sum(float(self.costs[mb].sum()) for mb in rank) for rank in self.microbatches])

    @property
    def loss_tokens(self) -> int:
        """Tokens carrying a loss over the whole step: length - 1 per sample."""
        return int(np.sum(self.samples.length.astype(np.int64) - 1))


def fill_short_groups(groups: list[np.ndarray], costs: np.ndarray, *, minimum: int) -> list[np.ndarray]:
    """Moves samples so every group holds at least `minimum` of them, where the total allows.

    Cost balancing leaves a sample heavier than a fair share alone in its group; a rank with
    fewer samples than microbatches would then train on a filler although the step has data.
    Repeatedly, a group short of `minimum` takes the cheapest sample (ties: lowest index) held
    by a group with more than `minimum`, which adds the least cost to it.

    Args:
        groups: Index arrays, one per group.
        costs: Cost of each index.
        minimum: Wanted samples per group.
    Returns:
        The groups, each sorted; unchanged when none is short.
    """
    groups = [g.copy() for g in groups]
    while True:
        short = [i for i, g in enumerate(groups) if len(g) < minimum]
        donors = [i for i, g in enumerate(groups) if len(g) > minimum]
        if not short or not donors:
            return groups
        donor, item = min(
            ((d, int(j)) for d in donors for j in groups[d]), key=lambda di: (costs[di[1]], di[1])
        )
        groups[donor] = groups[donor][groups[donor] != item]
        groups[short[0]] = np.sort(np.append(groups[short[0]], item))


def build_step_plan(
    step: int,
    allocated: SampleTable,
    *,
    dp: int,
    microbatches: int,
    method: str,
    cost_fn: CostFn,
) -> StepPlan:
    """Balances one step's allocated samples over `dp` ranks x `microbatches` microbatches.

    Args:
        step: The step.
        allocated: The samples the mixture allocated to the step, bad ones included.
        dp: Data-parallel ranks.
        microbatches: Microbatches per rank.
        method: Balancing method (see `batchplane.planner.balance.METHODS`).
        cost_fn: Per-sample cost from int64 lengths and the samples' features.
    Returns:
        The plan; a function of its arguments only (I4).
    """
    good = allocated.length > 0
    order = np.lexsort((allocated.seq[good], allocated.source[good]))
    samples = allocated.take(np.flatnonzero(good)[order])
    costs = np.asarray(cost_fn(samples.length.astype(np.int64), samples.features), dtype=np.float64)
    ranks = []
    for rank_index in fill_short_groups(partition(costs, dp, method), costs, minimum=microbatches):
        parts = partition(costs[rank_index], microbatches, method)
        ranks.append(tuple(rank_index[p] for p in parts))
    return StepPlan(
        step=step,
        samples=samples,
        microbatches=tuple(ranks),
        bad_samples=int(np.count_nonzero(~good)),
        costs=costs,
    )
