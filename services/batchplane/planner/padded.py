"""Padded microbatches: what a microbatch costs as the constructor builds it, the length-aware
grouping of a bucket's samples into microbatches, and the rebalancing of buckets by that cost.
Pure numpy; no I/O, no clocks, no randomness.

Without packing the constructor pads every row of a microbatch to its longest row
(`batchplane.constructor.assemble`): a microbatch of R rows padded to W tokens runs the cost
model on R sequences of length W, not on its samples' own lengths. `MicrobatchCost` costs a
sample's row (each chunk of a split sample is a row of its own) padded to W as its own cost plus
what the cost model adds from the row's length to W with no features:

    row cost = cost(l, features) + cost(W) - cost(l)

so for a cost model of the length alone ("quadratic", "linear", a FLOPs model) a microbatch costs
exactly R x cost(W), and what features add (an image encoder's image tokens) is never padded.
With packing (`padded=False`) there is no padding: a microbatch costs the sum of its samples'
costs.

`group` cuts one bucket's samples, sorted by row width, into consecutive microbatches of least
total padded cost (so similar lengths share a microbatch); `rebalance` moves and swaps samples
between buckets, from the one of highest padded cost, while that lowers it. Both are functions
of their arguments only (I4): ties go to the lower index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from batchplane.core import lengths as sample_lengths

#: `group` considers every cut between a bucket's sorted samples up to this many samples; more
#: are cut only at this many evenly spaced positions (bounding planning time on huge buckets).
MAX_CUTS = 128
#: `rebalance` tries the samples of the most expensive bucket against this many of the cheapest.
PARTNERS = 8
#: `rebalance` evaluates at most this many of a bucket's samples as move or swap candidates.
CANDIDATES = 64
#: `rebalance` stops after this many accepted moves per bucket, and at most `MAX_ROUNDS` in all
#: (bounding planning time on huge meshes; `group_size` rebalances each group on its own).
ROUNDS_PER_BUCKET = 4
MAX_ROUNDS = 128


@dataclasses.dataclass(frozen=True)
class Rows:
    """The per-sample quantities padded costs need, for the samples of one step.

    Attributes:
        costs: float64 [n]: each sample's own cost (`plan.sample_costs`).
        width: int64 [n]: the sample's longest row (its length, or max_length when split).
        rows: int64 [n]: rows the sample is laid out as (1, or its chunks when split).
        extra: float64 [n]: what the sample's features add to its cost (cost minus the cost of
            its rows' lengths alone); never padded.
        unit: Cost of one row of length w with no features, as a function (see `row_cost`).
        padded: False under packing: a microbatch costs the sum of its samples' costs.
    """

    costs: np.ndarray
    width: np.ndarray
    rows: np.ndarray
    extra: np.ndarray
    padded: bool
    _widths: np.ndarray
    _row_costs: np.ndarray

    def row_cost(self, width: np.ndarray) -> np.ndarray:
        """float64: the cost of one featureless row of each given width (one of the step's
        sample widths)."""
        return self._row_costs[np.searchsorted(self._widths, width)]

    def microbatch_cost(self, index: np.ndarray) -> float:
        """The cost of one microbatch holding samples `index` as built (0 for a filler)."""
        index = np.asarray(index, dtype=np.int64)
        if not index.size:
            return 0.0
        if not self.padded:
            return float(self.costs[index].sum())
        widest = int(self.width[index].max())
        return float(self.extra[index].sum() + self.rows[index].sum() * self.row_cost(np.array([widest]))[0])

    def bucket_costs(self, microbatches: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
        """float64 [buckets]: each bucket's total cost of its microbatches as built."""
        return np.array([sum(self.microbatch_cost(mb) for mb in bucket) for bucket in microbatches], dtype=np.float64)


def rows_of(
    cost_fn,
    lengths: np.ndarray,
    features: Mapping[str, np.ndarray],
    costs: np.ndarray,
    *,
    padded: bool = True,
    max_length: int | None = None,
    length_policy: str = "split",
) -> Rows:
    """The `Rows` of a step's samples.

    Args:
        cost_fn: The graph's cost model, `cost_fn(lengths, features)`.
        lengths: int64 [n] lengths (the graph's metadata).
        features: The samples' features {name: float64 [n]}.
        costs: float64 [n]: the samples' costs under `cost_fn` (`plan.sample_costs`).
        padded: False under packing (no padding).
        max_length, length_policy: How the constructor lays out samples over max_length.
    Returns:
        The rows.
    Raises:
        ValueError: the cost model returned other than one finite cost >= 0 per length.
    """
    from batchplane.planner.plan import sample_costs  # plan imports this module

    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    limit = {"max_length": max_length, "policy": length_policy}
    width = sample_lengths.longest_chunks(lengths, **limit).astype(np.int64)
    rows = sample_lengths.chunk_counts(lengths, **limit).astype(np.int64)
    zero = {name: np.zeros(len(lengths)) for name in features}
    base = np.asarray(sample_costs(cost_fn, lengths, zero, max_length=max_length, length_policy=length_policy), dtype=np.float64)
    widths = np.unique(width)
    row_costs = np.asarray(cost_fn(widths, {name: np.zeros(len(widths)) for name in features}), dtype=np.float64)
    if row_costs.shape != widths.shape or not np.all(np.isfinite(row_costs)) or np.any(row_costs < 0):
        raise ValueError("the cost model must return one finite cost >= 0 per length")
    return Rows(
        costs=costs, width=width, rows=rows, extra=np.maximum(costs - base, 0.0), padded=padded, _widths=widths, _row_costs=row_costs,
    )


def group(index: np.ndarray, parts: int, rows: Rows) -> list[np.ndarray]:
    """Cuts one bucket's samples into `parts` microbatches of similar lengths.

    The samples are sorted by width (ties: lower index first) and cut into consecutive groups
    minimizing the sum of their padded costs (dynamic programming over the cuts; over
    `MAX_CUTS` samples, over `MAX_CUTS` evenly spaced cuts). Every group is non-empty when
    len(index) >= parts; else the samples are one per group and the surplus groups are empty.

    Args:
        index: The bucket's sample indices (into the step's samples).
        parts: Microbatches, >= 1.
        rows: The step's rows.
    Returns:
        `parts` ascending int64 arrays of sample indices, in descending order of cost (ties:
        the group of shorter samples last), empty ones last.
    """
    index = np.asarray(index, dtype=np.int64)
    n = len(index)
    if n <= parts:
        singles = [np.array([i], dtype=np.int64) for i in index[np.lexsort((index, -rows.width[index]))]]
        return singles + [np.zeros(0, np.int64) for _ in range(parts - n)]
    order = index[np.lexsort((index, rows.width[index]))]
    cuts = _cuts(order, parts, rows)
    groups = [np.sort(order[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]
    costs = [rows.microbatch_cost(g) for g in groups]
    ranked = sorted(range(parts), key=lambda g: (-costs[g], -g))
    return [groups[g] for g in ranked]


def _cuts(order: np.ndarray, parts: int, rows: Rows) -> list[int]:
    """Cut positions 0 = c0 < c1 < ... < c_parts = n of samples sorted by width, minimizing the
    sum over groups of rows x row_cost(widest); the features' part is the same for any cut."""
    n = len(order)
    if n > MAX_CUTS:
        points = np.unique(np.linspace(0, n, MAX_CUTS + 1).round().astype(np.int64))
    else:
        points = np.arange(n + 1, dtype=np.int64)
    if len(points) - 1 < parts:  # too few candidate cuts: every position
        points = np.arange(n + 1, dtype=np.int64)
    k = len(points)
    cum_rows = np.concatenate([[0], np.cumsum(rows.rows[order])])[points].astype(np.float64)
    # The cost of group (points[i], points[j]) for i < j: its rows padded to the width of its
    # last (widest) sample.
    unit = np.zeros(k)
    unit[1:] = rows.row_cost(rows.width[order[points[1:] - 1]])
    span = cum_rows[None, :] - cum_rows[:, None]
    valid = np.triu(np.ones((k, k), bool), 1)
    seg = np.where(valid, span * unit[None, :], np.inf)
    best = seg[0].copy()  # best[j]: one group over (0, points[j])
    back = []
    for _ in range(1, parts):
        total = best[:, None] + seg
        arg = np.argmin(total, axis=0)  # first minimum: the lowest previous cut
        back.append(arg)
        best = total[arg, np.arange(k)]
    cuts = [k - 1]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    cuts.append(0)
    return [int(points[c]) for c in reversed(cuts)]


def bucket_cost(index: np.ndarray, parts: int, rows: Rows) -> float:
    """The padded cost of a bucket's samples grouped by `group`."""
    return float(sum(rows.microbatch_cost(g) for g in group(index, parts, rows)))


def rebalance(buckets: list[np.ndarray], parts: int, rows: Rows, *, minimum: int) -> list[np.ndarray]:
    """Moves and swaps samples between buckets to lower the highest padded bucket cost.

    Repeatedly the most expensive bucket (ties: lower index) gives one sample to, or swaps one
    with, one of the `PARTNERS` cheapest buckets: candidates are ranked by an upper bound of
    the two buckets' new costs under their current microbatches, and the best is taken when
    their regrouped costs (`group`) are both below the expensive bucket's. It stops when no
    candidate lowers it, or after `ROUNDS_PER_BUCKET` x buckets (at most `MAX_ROUNDS`) accepted
    changes. A bucket
    keeps at least `minimum` samples when it had more.

    Args:
        buckets: Sample indices per bucket.
        parts: Microbatches per bucket.
        rows: The step's rows.
        minimum: Samples a giving bucket keeps.
    Returns:
        The buckets, each sorted ascending.
    """
    buckets = [np.sort(np.asarray(b, dtype=np.int64)) for b in buckets]
    k = len(buckets)
    if k < 2 or not rows.padded:
        return buckets
    groups = [group(b, parts, rows) for b in buckets]
    totals = np.array([sum(rows.microbatch_cost(g) for g in gs) for gs in groups])
    for _ in range(min(ROUNDS_PER_BUCKET * k, MAX_ROUNDS)):
        a = int(np.argmax(totals))
        partners = [int(b) for b in np.argsort(totals, kind="stable") if b != a][:PARTNERS]
        best = None
        for b in partners:
            found = _best_exchange(buckets[a], groups[a], totals[a], buckets[b], groups[b], totals[b], rows, minimum=minimum)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], b, found[1], found[2])
        if best is None:
            break
        _, b, give, take = best
        new_a = buckets[a][buckets[a] != give] if give >= 0 else buckets[a]
        new_b = buckets[b][buckets[b] != take] if take >= 0 else buckets[b]
        if take >= 0:
            new_a = np.sort(np.append(new_a, take))
        if give >= 0:
            new_b = np.sort(np.append(new_b, give))
        groups_a, groups_b = group(new_a, parts, rows), group(new_b, parts, rows)
        cost_a = sum(rows.microbatch_cost(g) for g in groups_a)
        cost_b = sum(rows.microbatch_cost(g) for g in groups_b)
        if max(cost_a, cost_b) >= totals[a] * (1 - 1e-12):
            break
        buckets[a], buckets[b], groups[a], groups[b] = new_a, new_b, groups_a, groups_b
        totals[a], totals[b] = cost_a, cost_b
    return buckets


def _best_exchange(
    index_a: np.ndarray, groups_a: list[np.ndarray], total_a: float, index_b: np.ndarray, groups_b: list[np.ndarray], total_b: float, rows: Rows, *, minimum: int,
) -> tuple[float, int, int] | None:
    """The move (a sample of A to B) or swap (one of A for one of B) whose bound of max(new A,
    new B) is lowest and below A's cost: (bound, sample given by A, sample taken from B, -1
    for a move); None when none is.
    """
    cand_a = _candidates(index_a)
    cand_b = _candidates(index_b)
    rem_a, add_b = _removal(cand_a, groups_a, rows), _addition(cand_a, groups_b, rows)
    rem_b, add_a = _removal(cand_b, groups_b, rows), _addition(cand_b, groups_a, rows)
    options = []
    if len(index_a) > minimum:  # moves a -> B
        bound = np.maximum(total_a - rem_a, total_b + add_b)
        j = int(np.argmin(bound))
        options.append((float(bound[j]), int(cand_a[j]), -1))
    if len(cand_b):  # swaps
        new_a = total_a - rem_a[:, None] + add_a[None, :]
        new_b = total_b - rem_b[None, :] + add_b[:, None]
        bound = np.maximum(new_a, new_b)
        flat = int(np.argmin(bound))
        i, j = divmod(flat, len(cand_b))
        options.append((float(bound[i, j]), int(cand_a[i]), int(cand_b[j])))
    options = [o for o in options if o[0] < total_a * (1 - 1e-9)]
    return min(options) if options else None


def _candidates(index: np.ndarray) -> np.ndarray:
    """At most `CANDIDATES` of a bucket's samples, evenly spaced in index order."""
    if len(index) <= CANDIDATES:
        return index
    return index[np.unique(np.linspace(0, len(index) - 1, CANDIDATES).round().astype(np.int64))]


def _removal(samples: np.ndarray, groups: list[np.ndarray], rows: Rows) -> np.ndarray:
    """What leaving its bucket saves at least, per sample, its group keeping its width: its
    rows padded to the group's widest and its features' part."""
    width_of = np.zeros(0)
    owner = {}
    widest = []
    for g, members in enumerate(groups):
        widest.append(int(rows.width[members].max()) if members.size else 0)
        for i in members.tolist():
            owner[i] = g
    width_of = np.array([widest[owner[int(i)]] for i in samples], dtype=np.int64)
    return rows.rows[samples] * rows.row_cost(width_of) + rows.extra[samples]


def _addition(samples: np.ndarray, groups: list[np.ndarray], rows: Rows) -> np.ndarray:
    """What joining a bucket costs at most, per sample: joining its cheapest microbatch for it
    (the microbatch widened to the sample when it is wider)."""
    if not groups:
        return np.full(len(samples), np.inf)
    w = rows.width[samples]
    own = rows.row_cost(w)
    best = np.full(len(samples), np.inf)
    for members in groups:
        if not members.size:
            best = np.minimum(best, rows.rows[samples] * own)
            continue
        widest = int(rows.width[members].max())
        unit = rows.row_cost(np.array([widest]))[0]
        group_rows = float(rows.rows[members].sum())
        wider = w > widest
        cost = np.where(wider, rows.rows[samples] * own + group_rows * (own - unit), rows.rows[samples] * unit)
        best = np.minimum(best, cost)
    return best + rows.extra[samples]
