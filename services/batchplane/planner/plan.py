"""The plan of one step: which samples each bucket (a data-parallel rank, a DP x CP consumer,
or any rank of the world) trains on, microbatch by microbatch. Pure; no I/O.

`build_step_plan` takes the samples the mixture allocated to the step (with their lengths from
the loaders' summaries), leaves out the bad ones (length 0: they are consumed, never
delivered), and `assign` balances the rest over buckets and then over each bucket's microbatches
by cost, or forms token-budget microbatches. Every bucket gets the same number of microbatches
(I2); a microbatch left without samples (only when a step has fewer good samples than
microbatches in all, as in a finite job's last step) is a filler the constructor pads.

Lengths are the delivered ones: under `batch.length_policy` "truncate" and "reject" the loaders
already applied `batch.max_length`. Under "split" a sample keeps its full length here, and the
constructor lays it out as ceil(length / max_length) chunks, each its own sequence
(`batchplane.core.lengths`): its cost is the sum of its chunks' costs (`cost.sample_costs`), a
padded token budget counts its chunks as rows of at most max_length tokens, and its loss tokens
are length - chunks (`StepPlan.loss_tokens`), exactly as the constructor counts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from batchplane.core import lengths as sample_lengths
from batchplane.core.digest import DTYPE as DIGEST_DTYPE
from batchplane.planner.balance import partition
from batchplane.planner.cost import CostFn, sample_costs
from batchplane.planner.padded import Rows, group, rebalance, rows_of
from batchplane.planner.token_budget import token_budget


_COLUMNS = (("source", np.int32), ("seq", np.int64), ("row", np.int64), ("length", np.int32), ("epoch", np.int32), ("digest", DIGEST_DTYPE))


class LengthLimit(TypedDict):
    """How the constructor lays samples out, passed on as keyword arguments (`**limit`): the
    job's `batch.max_length` (None: no limit) and `batch.length_policy`."""

    max_length: int | None
    length_policy: str


@dataclasses.dataclass(frozen=True)
class SampleTable:
    """Samples as parallel arrays: source index (int32), seq (int64), row (int64), length
    (int32, 0 for a bad sample), epoch (int32), per-sample features by name (float64) and digest
    (int64, `core.digest`, as the loader summarized the sample; 0 for a bad one, and for all
    where none is given)."""

    source: np.ndarray
    seq: np.ndarray
    row: np.ndarray
    length: np.ndarray
    epoch: np.ndarray
    features: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    digest: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, DIGEST_DTYPE))

    def __post_init__(self) -> None:
        if not len(self.digest) and len(self.seq):
            object.__setattr__(self, "digest", np.zeros(len(self.seq), DIGEST_DTYPE))

    @classmethod
    def empty(cls) -> SampleTable:
        columns: dict[str, Any] = {name: np.zeros(0, dtype) for name, dtype in _COLUMNS}
        return cls(**columns)

    @classmethod
    def concat(cls, tables: Sequence[SampleTable]) -> SampleTable:
        """The tables one after another; a feature missing from a table is 0 for its samples."""
        if not tables:
            return cls.empty()
        names = sorted({name for t in tables for name in t.features})
        return cls(
            **{name: np.concatenate([getattr(t, name) for t in tables]) for name, _ in _COLUMNS},
            features={name: np.concatenate([t.features.get(name, np.zeros(len(t))) for t in tables]) for name in names},
        )

    def take(self, index: np.ndarray) -> SampleTable:
        return SampleTable(
            **{name: getattr(self, name)[index] for name, _ in _COLUMNS},
            features={name: values[index] for name, values in self.features.items()},
        )

    def __len__(self) -> int:
        return len(self.seq)


@dataclasses.dataclass(frozen=True)
class Balancing:
    """How a graph's samples are spread over buckets and microbatches (see `assign`).

    Attributes:
        method: "karmarkar_karp", "greedy", "round_robin", "token_budget", or a callable
            `method(costs, parts) -> list of index arrays` (a user balancing method, e.g.
            zig-zag), used like the built-in ones.
        microbatches: Microbatches per bucket (the minimum for "token_budget").
        intra: Balance within a bucket's microbatches; False keeps each bucket's samples in
            (source, seq) order and cuts them into consecutive microbatches.
        group_size: Balance within groups of this many buckets (samples are first spread over
            the groups), bounding planning cost on very large meshes; None: all buckets at once.
        max_tokens: "token_budget": padded tokens (or real tokens when `padded` is False) per
            microbatch.
        max_cost: "token_budget": cost per microbatch, instead of max_tokens.
        padded: "token_budget": microbatches are padded to their longest sample (False: packed).
    """

    method: object = "karmarkar_karp"
    microbatches: int = 1
    intra: bool = True
    group_size: int | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    padded: bool = True


@dataclasses.dataclass(frozen=True)
class SubPlan:
    """A secondary graph's assignment (e.g. images balanced over WORLD for a vision encoder).

    Attributes:
        name: The graph's name.
        axis: "DP", "CP" or "WORLD".
        metadata: The per-sample quantity it balances ("image_tokens", ...).
        buckets: buckets[b] = indices into the step's `samples`, ascending.
        costs: Cost of each sample of the step under this graph's model (0 outside it).
        values: int64 `metadata` of each sample of the step (0 where a sample lacks it).
        columns: Payload columns delivered with the assignment (`DGraph.deliver`).
    """

    name: str
    axis: str
    metadata: str
    buckets: tuple[np.ndarray, ...]
    costs: np.ndarray
    values: np.ndarray
    columns: tuple[str, ...] = ()

    def bucket_costs(self) -> np.ndarray:
        return np.array([float(self.costs[b].sum()) for b in self.buckets])


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every bucket trains on in one step.

    Attributes:
        step: The step.
        samples: The step's good samples in (source, seq) order.
        microbatches: microbatches[bucket][m] = indices into `samples`, ascending. Every bucket
            has the same number of microbatches.
        bad_samples: Samples of the step's allocation left out as bad.
        costs: Cost of each sample in `samples` under the primary graph's model.
        axis: The buckets' axis: "DP" (one per data-parallel replica) or "CP" (DP x CP).
        subplans: Secondary graphs' assignments.
        rows: What the primary graph's microbatches cost as the constructor builds them
            (padding included; see `batchplane.planner.padded`); None: the sum of `costs`.
        max_length, length_policy: The job's `batch.max_length` (None: no limit) and
            `batch.length_policy`, which decide how the constructor lays the samples out.
    """

    step: int
    samples: SampleTable
    microbatches: tuple[tuple[np.ndarray, ...], ...]
    bad_samples: int
    costs: np.ndarray
    axis: str = "DP"
    subplans: tuple[SubPlan, ...] = ()
    max_length: int | None = None
    length_policy: str = "split"
    rows: Rows | None = None

    @property
    def dp(self) -> int:
        """Number of buckets."""
        return len(self.microbatches)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0]) if self.microbatches else 0

    def bucket_index(self, bucket: int) -> np.ndarray:
        """Indices into `samples` of bucket `bucket`'s samples, microbatch after microbatch."""
        parts = self.microbatches[bucket]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def rank_samples(self, rank: int) -> tuple[SampleTable, np.ndarray]:
        """The samples of bucket `rank` microbatch after microbatch, and the int64 microbatch
        offsets (len = microbatches + 1)."""
        parts = self.microbatches[rank]
        index = self.bucket_index(rank)
        offsets = np.zeros(len(parts) + 1, np.int64)
        offsets[1:] = np.cumsum([len(p) for p in parts])
        return self.samples.take(index), offsets

    def rank_costs(self) -> np.ndarray:
        """Total cost of each bucket (float64 [buckets]): the sum of its samples' costs."""
        return np.array([sum(float(self.costs[mb].sum()) for mb in rank) for rank in self.microbatches])

    def built_rank_costs(self) -> np.ndarray:
        """Cost of each bucket's microbatches as the constructor builds them (float64
        [buckets]): padding included unless the job packs; `rank_costs` without `rows`.
        Computed once per plan (the ledger and the metrics both ask); a copy each time."""
        costs = self.__dict__.get("_built_rank_costs")
        if costs is None:
            costs = self.rank_costs() if self.rows is None else self.rows.bucket_costs(self.microbatches)
            self.__dict__["_built_rank_costs"] = costs  # a cache, not a field: frozen, eq and replace ignore it
        return costs.copy()

    @property
    def loss_tokens(self) -> int:
        """Tokens carrying a loss over the whole step: length - 1 per sample, or length -
        ceil(length / max_length) per split sample (`batchplane.core.lengths.loss_tokens`)."""
        return sample_lengths.loss_tokens(self.samples.length, max_length=self.max_length, policy=self.length_policy)


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
        donor, item = min(((d, int(j)) for d in donors for j in groups[d]), key=lambda di: (costs[di[1]], di[1]))
        groups[donor] = groups[donor][groups[donor] != item]
        groups[short[0]] = np.sort(np.append(groups[short[0]], item))


def split(costs: np.ndarray, parts: int, method: object) -> list[np.ndarray]:
    """`partition` for a built-in method name, or a user callable checked to return a
    partition of the indices into `parts` groups.

    Raises:
        ValueError: the callable's result is not a partition (names what is wrong).
    """
    if isinstance(method, str):
        return partition(costs, parts, method)
    if not callable(method):
        raise TypeError(f"balancing method {method!r} is neither a method name nor a callable")
    groups = [np.sort(np.asarray(g, dtype=np.int64)) for g in method(costs, parts)]
    name = getattr(method, "__name__", repr(method))
    if len(groups) != parts:
        raise ValueError(f"balancing method {name} returned {len(groups)} groups, expected {parts}")
    seen = np.concatenate(groups) if groups else np.zeros(0, np.int64)
    if len(seen) != len(costs) or not np.array_equal(np.sort(seen), np.arange(len(costs))):
        raise ValueError(f"balancing method {name} must place every one of {len(costs)} items in exactly one group")
    return groups


def assign(
    costs: np.ndarray,
    lengths: np.ndarray,
    *,
    buckets: int,
    balancing: Balancing,
    max_length: int | None = None,
    length_policy: str = "split",
    rows: Rows | None = None,
) -> tuple[tuple[np.ndarray, ...], ...]:
    """Spreads items over `buckets` buckets and each bucket's microbatches.

    With `rows` of padded microbatches (no packing) and the built-in "karmarkar_karp" or
    "greedy" with `intra`, the cost balanced is that of the microbatches as built: after the
    buckets are balanced by the items' own costs, each bucket's items are sorted by length and
    cut into the microbatches of least padded cost (`padded.group`), and items are moved between
    buckets while that lowers the highest bucket's padded cost (`padded.rebalance`). Other
    methods, `intra=False`, packing and token budgets are unchanged.

    Args:
        costs: float64 cost of each item.
        lengths: int64 length of each item (token budgets count these).
        buckets: Number of buckets.
        balancing: How.
        max_length, length_policy: How the constructor lays out items longer than max_length
            (token budgets count the rows of split items); None: no limit.
        rows: What microbatches of the items cost as built (`padded.rows_of`); None: the
            sum of `costs`.
    Returns:
        result[bucket][m] = ascending item indices; the same number of microbatches per bucket.
    """
    b = balancing
    aware = rows is not None and rows.padded and b.intra and b.method in ("karmarkar_karp", "greedy")
    if b.method == "token_budget":
        per_rank = token_budget(
            lengths,
            costs,
            ranks=buckets,
            max_tokens=b.max_tokens,
            max_cost=b.max_cost,
            padded=b.padded,
            min_microbatches=b.microbatches,
            max_length=max_length,
            length_policy=length_policy,
        )
        return tuple(tuple(np.asarray(mb, dtype=np.int64) for mb in rank) for rank in per_rank)
    if b.group_size and b.group_size < buckets:
        if buckets % b.group_size:
            raise ValueError(f"group_size {b.group_size} must divide the {buckets} buckets")
        groups = buckets // b.group_size
        ranks: list[np.ndarray] = []
        for members in split(costs, groups, b.method):
            ranks += [members[r] for r in split(costs[members], b.group_size, b.method)]
    else:
        ranks = split(costs, buckets, b.method)
    ranks = fill_short_groups(ranks, costs, minimum=b.microbatches)
    if aware and rows is not None:
        size = b.group_size if b.group_size and b.group_size < buckets else buckets
        ranks = [
            r for lo in range(0, buckets, size) for r in rebalance(ranks[lo : lo + size], b.microbatches, rows, minimum=b.microbatches)
        ]
        return tuple(tuple(group(rank_index, b.microbatches, rows)) for rank_index in ranks)
    result: list[tuple[np.ndarray, ...]] = []
    for rank_index in ranks:
        if b.microbatches == 1:  # the bucket is its one microbatch: nothing to split
            result.append((np.sort(rank_index),))
        elif b.intra:
            parts = split(costs[rank_index], b.microbatches, b.method)
            result.append(tuple(rank_index[p] for p in parts))
        else:
            result.append(tuple(np.array_split(rank_index, b.microbatches)))
    return tuple(result)


def good_samples(allocated: SampleTable) -> tuple[SampleTable, int]:
    """The allocation's good samples in (source, seq) order, and how many were bad."""
    good = allocated.length > 0
    order = np.lexsort((allocated.seq[good], allocated.source[good]))
    return allocated.take(np.flatnonzero(good)[order]), int(np.count_nonzero(~good))


def build_step_plan(
    step: int,
    allocated: SampleTable,
    *,
    dp: int,
    microbatches: int,
    method: object,
    cost_fn: CostFn,
    max_length: int | None = None,
    length_policy: str = "split",
    packed: bool = False,
) -> StepPlan:
    """Balances one step's allocated samples over `dp` buckets x `microbatches` microbatches
    (the single-graph strategy; see `batchplane.planner.dgraph` for the general one).

    Args:
        step: The step.
        allocated: The samples the mixture allocated to the step, bad ones included.
        dp: Buckets (data-parallel ranks).
        microbatches: Microbatches per bucket.
        method: Balancing method (see `Balancing.method`).
        cost_fn: Per-sample cost from int64 lengths and the samples' features.
        max_length, length_policy: The job's `batch.max_length` (None: no limit) and
            `batch.length_policy`.
        packed: The job packs microbatches (`batch.packing`): no padding to balance.
    Returns:
        The plan; a function of its arguments only (I4).
    """
    samples, bad = good_samples(allocated)
    limit: LengthLimit = {"max_length": max_length, "length_policy": length_policy}
    lengths = samples.length.astype(np.int64)
    costs = np.asarray(sample_costs(cost_fn, lengths, samples.features, **limit), dtype=np.float64)
    rows = rows_of(cost_fn, lengths, samples.features, costs, padded=not packed, **limit)
    return StepPlan(
        step=step,
        samples=samples,
        microbatches=assign(costs, lengths, buckets=dp, balancing=Balancing(method=method, microbatches=microbatches), rows=rows, **limit),
        bad_samples=bad,
        costs=costs,
        rows=rows,
        **limit,
    )
