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
import functools
from collections.abc import Mapping, Sequence

import numpy as np

from batchplane.core import lengths as sample_lengths
from batchplane.planner.cost import sample_costs

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
        costs: float64 [n]: each sample's own cost (`cost.sample_costs`).
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

    @functools.cached_property
    def single(self) -> bool:
        """Every sample is one row (nothing split): a run of samples' rows, cumulated, is a range."""
        return bool(np.all(self.rows == 1))

    @functools.cached_property
    def featured(self) -> bool:
        """Some sample's features add to its cost (`extra` is not all 0)."""
        return bool(self.extra.any())

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
        costs: float64 [n]: the samples' costs under `cost_fn` (`cost.sample_costs`).
        padded: False under packing (no padding).
        max_length, length_policy: How the constructor lays out samples over max_length.
    Returns:
        The rows.
    Raises:
        ValueError: the cost model returned other than one finite cost >= 0 per length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    width = sample_lengths.longest_chunks(lengths, max_length=max_length, policy=length_policy).astype(np.int64)
    rows = sample_lengths.chunk_counts(lengths, max_length=max_length, policy=length_policy).astype(np.int64)
    zero = {name: np.zeros(len(lengths)) for name in features}
    base = np.asarray(sample_costs(cost_fn, lengths, zero, max_length=max_length, length_policy=length_policy), dtype=np.float64)
    widths = np.unique(width)
    row_costs = np.asarray(cost_fn(widths, {name: np.zeros(len(widths)) for name in features}), dtype=np.float64)
    if row_costs.shape != widths.shape or not np.all(np.isfinite(row_costs)) or np.any(row_costs < 0):
        raise ValueError("the cost model must return one finite cost >= 0 per length")
    return Rows(
        costs=costs,
        width=width,
        rows=rows,
        extra=np.maximum(costs - base, 0.0),
        padded=padded,
        _widths=widths,
        _row_costs=row_costs,
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
    if len(index) <= parts:
        singles = [np.array([i], dtype=np.int64) for i in index[np.lexsort((index, -rows.width[index]))]]
        return singles + [np.zeros(0, np.int64) for _ in range(parts - len(index))]
    layout = _Layout.of(index, parts, rows)
    return [np.sort(layout.order[layout.cuts[g] : layout.cuts[g + 1]]) for g in layout.ranked]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A bucket's samples as `group` cuts them into microbatches, with what `rebalance` needs
    to bound the cost of a sample leaving or joining the bucket.

    Attributes:
        index: The bucket's samples.
        perm: int64 [n]: `group`'s order of the samples, as positions in `index` (by width;
            with at most `parts` samples by descending width, one per microbatch).
        order: int64 [n]: index[perm].
        cuts: int64 [parts + 1]: microbatch g is order[cuts[g]:cuts[g + 1]] (empty ones last).
        ranked: The microbatches in `group`'s output order.
        groups: float64 [3, parts]: each microbatch's widest row, the cost of one featureless
            row that wide, and its rows (all 0 for an empty one).
        empty: bool [parts]: the microbatch is a filler.
        total: The bucket's padded cost, summed as `bucket_cost` sums it.
    """

    index: np.ndarray
    perm: np.ndarray
    order: np.ndarray
    cuts: np.ndarray
    ranked: list[int]
    groups: np.ndarray
    empty: np.ndarray
    total: float

    @classmethod
    def of(cls, index: np.ndarray, parts: int, rows: Rows, *, ascending: bool = False, own: np.ndarray | None = None) -> _Layout:
        """The layout of samples `index` (int64; `ascending`: known to be sorted) in `parts`
        microbatches, as `group` cuts them (`own`: `rows.row_cost(rows.width)`, if known)."""
        n = len(index)
        width = rows.width[index]
        if n <= parts:
            perm = np.lexsort((index, -width))
        elif ascending:
            perm = np.argsort(width, kind="stable")
        else:
            perm = np.lexsort((index, width))
        order = index[perm]
        width = width[perm]
        if own is not None:
            unit = own[order]
        else:
            unit = rows.row_cost(width) if n else np.zeros(0)
        if rows.single:
            cum_rows = _range(n + 1)
        else:
            cum_rows = np.empty(n + 1, np.int64)
            cum_rows[0] = 0
            np.cumsum(rows.rows[order], out=cum_rows[1:])
        groups = np.zeros((3, parts))
        if n <= parts:
            cuts = np.minimum(np.arange(parts + 1, dtype=np.int64), n)
            last = np.arange(n)
        else:
            cuts = _cuts(cum_rows, unit, parts)
            last = cuts[1:] - 1
        counts = cum_rows[cuts[1:]] - cum_rows[cuts[:-1]]
        groups[0, : len(last)] = width[last]
        groups[1, : len(last)] = unit[last]
        groups[2] = counts
        # As `Rows.microbatch_cost` adds them up: features (summed over ascending indices),
        # plus rows x the row cost of the widest.
        costs = counts * groups[1]
        if rows.featured:
            costs = np.array([rows.extra[np.sort(order[lo:hi])].sum() for lo, hi in zip(cuts[:-1], cuts[1:])]) + costs
        costs = costs.tolist()
        if n <= parts:
            ranked = list(range(parts))
            empty = np.arange(parts) >= n
        else:
            ranked = sorted(range(parts), key=lambda g: (-costs[g], -g))
            empty = np.zeros(parts, bool)
        return cls(
            index=index,
            perm=perm,
            order=order,
            cuts=cuts,
            ranked=ranked,
            groups=groups,
            empty=empty,
            total=float(sum(costs[g] for g in ranked)),
        )


def _cuts(cum_rows: np.ndarray, unit: np.ndarray, parts: int) -> np.ndarray:
    """Cut positions 0 = c0 < c1 < ... < c_parts = n of n > parts samples sorted by width,
    minimizing the sum over groups of rows x row_cost(widest); the features' part is the same
    for any cut.

    Args:
        cum_rows: int64 [n + 1]: rows of the sorted samples, cumulated from 0.
        unit: float64 [n]: each sorted sample's featureless row cost.
        parts: Groups.
    Returns:
        int64 [parts + 1] cut positions; ties go to the lowest previous cut.
    """
    n = len(unit)
    points = _points(n, parts)
    k = len(points)
    every = k == n + 1  # every position is a candidate cut
    cum = (cum_rows if every else cum_rows[points]).astype(np.float64)
    # seg[j, i]: the cost of group (points[i], points[j]) for i < j (inf otherwise): its rows
    # padded to the width of its last (widest) sample.
    last = np.empty(k)
    last[0] = 0.0
    last[1:] = unit if every else unit[points[1:] - 1]
    if parts == 2:  # one cut: the k-vector of the table's last row, not the k x k table
        total = cum * last + (cum[k - 1] - cum) * last[k - 1]
        total[0] = total[k - 1] = np.inf  # the first group would be empty, or the second
        return points[np.array([0, int(np.argmin(total)), k - 1], dtype=np.int64)]
    seg = np.subtract.outer(cum, cum)
    seg *= last[:, None]
    seg += _not_after(k)
    best = seg[:, 0].copy()  # best[j]: one group over (0, points[j])
    back = []
    rows = np.arange(k)
    total = np.empty((k, k))
    for _ in range(2, parts):
        np.add(best, seg, out=total)
        arg = total.argmin(axis=1)  # first minimum: the lowest previous cut
        back.append(arg)
        best = total[rows, arg]
    cuts = [k - 1]
    if parts > 1:  # the last group ends at n: only that row
        cuts.append(int(np.argmin(best + seg[k - 1])))
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    cuts.append(0)
    return points[np.array(cuts[::-1], dtype=np.int64)]


@functools.lru_cache(maxsize=256)
def _points(n: int, parts: int) -> np.ndarray:
    """The candidate cut positions of n sorted samples (every one up to `MAX_CUTS` samples)."""
    if n > MAX_CUTS:
        points = np.unique(np.linspace(0, n, MAX_CUTS + 1).round().astype(np.int64))
    else:
        points = np.arange(n + 1, dtype=np.int64)
    if len(points) - 1 < parts:  # too few candidate cuts: every position
        points = np.arange(n + 1, dtype=np.int64)
    points.flags.writeable = False
    return points


@functools.lru_cache(maxsize=256)
def _range(n: int) -> np.ndarray:
    """int64 [n]: 0 .. n - 1, read-only."""
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=256)
def _not_after(k: int) -> np.ndarray:
    """float64 [k, k]: inf where i >= j (no group (points[i], points[j])), else 0."""
    mask = np.triu(np.full((k, k), np.inf))
    mask.flags.writeable = False
    return mask


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
    changes. A bucket keeps at least `minimum` samples when it had more.

    Each bucket's microbatches and the bounds of its candidates leaving it are kept, and
    recomputed only for the two buckets a change touches; all moves and swaps with the partners
    are bounded at once, as arrays (see `_Table.best_exchange`).

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
    table = _Table(k, parts, rows)
    for b, index in enumerate(buckets):
        table.set(b, _Layout.of(index, parts, rows, ascending=True, own=table.own))
    for _ in range(min(ROUNDS_PER_BUCKET * k, MAX_ROUNDS)):
        a = int(np.argmax(table.totals))
        partners = np.argsort(table.totals, kind="stable")
        partners = partners[partners != a][:PARTNERS]
        best = table.best_exchange(a, partners, minimum=minimum)
        if best is None:
            break
        _, b, give, take = best
        new_a, new_b = _without(buckets[a], give), buckets[b]
        if take >= 0:
            new_a, new_b = _with(new_a, take), _without(new_b, take)
        new_b = _with(new_b, give)
        layout_a = _Layout.of(new_a, parts, rows, ascending=True, own=table.own)
        layout_b = _Layout.of(new_b, parts, rows, ascending=True, own=table.own)
        if max(layout_a.total, layout_b.total) >= table.totals[a] * (1 - 1e-12):
            break
        buckets[a], buckets[b] = new_a, new_b
        table.set(a, layout_a)
        table.set(b, layout_b)
    return buckets


def _without(index: np.ndarray, sample: int) -> np.ndarray:
    """Ascending `index` less `sample` (which it holds)."""
    at = int(np.searchsorted(index, sample))
    return np.concatenate((index[:at], index[at + 1 :]))


def _with(index: np.ndarray, sample: int) -> np.ndarray:
    """Ascending `index` plus `sample` (which it lacks), ascending."""
    at = int(np.searchsorted(index, sample))
    return np.concatenate((index[:at], [sample], index[at:]))


# Rows of `_Table.features`: per candidate sample.
_WIDTH, _ROWS, _OWN, _PADDED, _EXTRA, _REMOVAL = range(6)


class _Table:
    """`rebalance`'s state, as arrays over the buckets (so that a bucket's partners are
    bounded at once): per bucket its cost, its microbatches (`_Layout.groups`), and its
    candidate samples (at most `CANDIDATES`, evenly spaced in index order) with their
    `features`: width, rows, cost of a featureless row as wide, rows x that, the features'
    part, and what leaving the bucket saves at least (its rows padded to its microbatch's
    widest, and its features' part)."""

    def __init__(self, k: int, parts: int, rows: Rows) -> None:
        self.rows = rows
        own = rows.row_cost(rows.width) if len(rows.width) else np.zeros(0)
        self.own = own
        self.per_sample = np.stack([rows.width, rows.rows, own, rows.rows * own, rows.extra]).astype(np.float64)
        # A row of width 0 costs row_cost(0) in an empty microbatch, not 0 x its unit.
        self.fillers = bool(np.any(rows.width <= 0))
        self.totals = np.zeros(k)
        self.sizes = np.zeros(k, np.int64)
        self.groups = np.zeros((3, parts, k))  # microbatches first, for `_joining`
        self.empty = np.zeros((parts, k), bool)
        self.count = np.zeros(k, np.int64)
        self.candidates = np.zeros((k, CANDIDATES), np.int64)
        self.features = np.zeros((k, 6, CANDIDATES))

    def set(self, b: int, layout: _Layout) -> None:
        """Records bucket b's layout."""
        n = len(layout.index)
        at = _candidate_positions(n)
        m = len(at)
        samples = layout.index[at]
        self.totals[b] = layout.total
        self.sizes[b] = n
        self.groups[:, :, b] = layout.groups
        self.empty[:, b] = layout.empty
        self.count[b] = m
        self.candidates[b, :m] = samples
        features = self.features[b]
        features[:_REMOVAL, :m] = self.per_sample[:, samples]
        features[:, m:] = 0.0
        position = np.empty(n, np.int64)
        position[layout.perm] = np.arange(n)
        owner = np.searchsorted(layout.cuts, position[at], side="right") - 1
        features[_REMOVAL, :m] = features[_ROWS, :m] * layout.groups[1, owner] + features[_EXTRA, :m]

    def _joining(self, of: np.ndarray, into: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """What joining a bucket costs at most, per sample: joining its cheapest microbatch for
        it (the microbatch widened to the sample when it is wider).

        Args:
            of: float64 [..., 6, m]: the samples' `features`.
            into: float64 [3, parts, ..., 1]: the buckets' `groups`, microbatches first (the
                axes between broadcast with the samples' leading axes).
            empty: bool [parts, ..., 1]: the buckets' fillers.
        Returns:
            float64 [..., m].
        """
        width, padded, own, r = of[..., _WIDTH, :], of[..., _PADDED, :], of[..., _OWN, :], of[..., _ROWS, :]
        widest, unit, group_rows = into[0], into[1], into[2]  # [parts, ..., 1]: microbatches first
        cost = np.where(width > widest, padded + group_rows * (own - unit), r * unit)
        if self.fillers:
            cost = np.where(empty, padded, cost)
        return cost.min(axis=0) + of[..., _EXTRA, :]

    def best_exchange(self, a: int, partners: np.ndarray, *, minimum: int) -> tuple[float, int, int, int] | None:
        """The move (a sample of A to a partner) or swap (one of A's for one of the partner's)
        whose bound of max(new A, new partner) is lowest and below A's cost: (bound, partner,
        sample given by A, sample taken from the partner or -1 for a move); None when none is.
        Ties: the earlier partner, then the lower sample given, a move before a swap, then the
        lower sample taken.

        The least bound of each (partner, A's candidate) over the partner's candidates comes
        from `_least_swaps`; the moves, and the swaps of the rows within a relative 1e-9 of the
        best, are then bounded exactly, so rounding never changes the choice.
        """
        m = int(self.count[a])
        p = len(partners)
        if not m or not p:
            return None
        total_a = self.totals[a]
        limit = total_a * (1 - 1e-9)
        of_a = self.features[a, :, :m]
        kept = total_a - of_a[_REMOVAL]  # A's cost after giving each candidate, at most
        total_b = self.totals[partners]
        joins_b = self._joining(of_a, self.groups[:, :, partners, None], self.empty[:, partners, None])  # [p, m]
        counts = self.count[partners]
        width = int(counts.max())
        best = np.inf
        moves = None
        if self.sizes[a] > minimum:
            moves = np.maximum(kept, total_b[:, None] + joins_b)  # [p, m]
            best = float(moves.min())
        if width:
            of_b = self.features[partners, :, :width]
            joins_a = self._joining(of_b, self.groups[:, :, a, None, None], self.empty[:, a, None, None])  # [p, width]
            if width > counts.min():
                joins_a[np.arange(width)[None, :] >= counts[:, None]] = np.inf
            left_b = total_b[:, None] - of_b[:, _REMOVAL]  # [p, width]
            least = _least_swaps(kept, joins_b, joins_a, left_b)  # [p, m]
            best = min(best, float(least.min()))
        if not best < limit:
            return None
        # The exact bounds: (bound, partner rank, give, take), least first.
        cand_a = self.candidates[a, :m]
        options: list[tuple[float, int, int, int]] = []
        if moves is not None:
            give = np.argmin(moves, axis=1)
            bound = moves[np.arange(p), give]
            options += zip(bound.tolist(), range(p), cand_a[give].tolist(), [-1] * p)
        if width:
            rank, give = np.nonzero(least <= best + 1e-9 * abs(best))
            bound = np.maximum(kept[give][:, None] + joins_a[rank], left_b[rank] + joins_b[rank, give][:, None])
            take = np.argmin(bound, axis=1)
            bound = bound[np.arange(len(take)), take]
            options += zip(bound.tolist(), rank.tolist(), cand_a[give].tolist(), self.candidates[partners[rank], take].tolist())
        least_bound, partner, given, taken = min(options)
        if not least_bound < limit:
            return None
        return least_bound, int(partners[partner]), given, taken


def _least_swaps(kept: np.ndarray, joins_b: np.ndarray, joins_a: np.ndarray, left_b: np.ndarray) -> np.ndarray:
    """float64 [p, m]: per partner and candidate i of A, the least over the partner's
    candidates j of the bound of swapping them, max(kept[i] + joins_a[p, j], left_b[p, j] +
    joins_b[p, i]) (up to rounding).

    The first term is the larger exactly when left_b[p, j] - joins_a[p, j] <= kept[i] -
    joins_b[p, i]: the least is that of joins_a over the j below that threshold (a prefix
    minimum over the j sorted by the difference) or of left_b over the j above it (a suffix
    minimum).

    Args:
        kept: float64 [m]: A's cost after giving each of its candidates.
        joins_b: float64 [p, m]: each partner's cost increase taking each of them.
        joins_a: float64 [p, w]: A's cost increase taking each partner's candidate (inf: none).
        left_b: float64 [p, w]: each partner's cost after giving each of its candidates.
    Returns:
        The least bounds (inf where the partner has no candidate).
    """
    p, w = joins_a.shape
    threshold = kept[None, :] - joins_b  # [p, m]
    diff = left_b - joins_a  # [p, w]
    rows = np.arange(p)[:, None]
    by_diff = np.argsort(diff, axis=1)
    ordered = diff[rows, by_diff]
    # count[p, i]: the partner's candidates j whose first term is the larger (a prefix of by_diff).
    count = np.empty(threshold.shape, np.int64)
    for q in range(p):
        count[q] = np.searchsorted(ordered[q], threshold[q], side="right")
    first = np.full((p, w + 1), np.inf)
    np.minimum.accumulate(joins_a[rows, by_diff], axis=1, out=first[:, 1:])
    second = np.full((p, w + 1), np.inf)
    second[:, :w] = np.minimum.accumulate(left_b[rows, by_diff[:, ::-1]], axis=1)[:, ::-1]
    return np.minimum(kept[None, :] + first[rows, count], joins_b + second[rows, count])


@functools.lru_cache(maxsize=256)
def _candidate_positions(n: int) -> np.ndarray:
    """At most `CANDIDATES` positions of a bucket's n samples, evenly spaced in index order."""
    if n <= CANDIDATES:
        at = np.arange(n, dtype=np.int64)
    else:
        at = np.unique(np.linspace(0, n - 1, CANDIDATES).round().astype(np.int64))
    at.flags.writeable = False
    return at
