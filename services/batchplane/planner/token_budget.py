"""Token-budget batching, done centrally by the planner: splits one step's samples into
variable-size microbatches that each fit a memory budget, with the same number of microbatches
on every data-parallel rank, and computes the token-level loss weights of such a step.

This is the Online Dynamic Batching rule (ODB, Li et al. 2026, §2.2-2.3) moved from each rank's
DataLoader into the planner, which sees every rank's samples at once: groups of near-constant
padded token area instead of a fixed batch size, then cross-rank alignment (the "Distributed
Group Alignment Problem") by splitting groups, never by dropping or repeating samples. Because
the planner decides for all ranks together, alignment needs no all_gather and never overflows
groups back into a buffer.

Pure and deterministic: numpy only, no I/O, no clocks, no randomness, and no dependence on
hashing or dict/set iteration order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import SupportsIndex

import numpy as np

from batchplane.core.lengths import chunk_counts, longest_chunks

# Float sums of costs are trusted when this far (relative) from the budget; closer ones are
# decided by the exactly rounded math.fsum. The error of a running float64 sum of k >= 0 terms
# is below k * 2**-53 of the sum, far below this for any realistic group.
_SAFE_MARGIN = 1e-6


def token_budget(
    lengths: np.ndarray,
    costs: np.ndarray,
    *,
    ranks: int,
    max_tokens: int | None = None,
    max_cost: float | None = None,
    padded: bool = True,
    min_microbatches: int = 1,
    max_length: int | None = None,
    length_policy: str = "split",
) -> list[list[np.ndarray]]:
    """Splits one step's samples into budget-bounded microbatches, M of them on every rank.

    Algorithm:
        1. Grouping (ODB §2.2). Samples sorted by length descending (ties: lower index first)
           are filled greedily into groups (next fit): a sample joins the current group if the
           group still fits the budget with it, otherwise it starts a new group. For a padded
           token budget the first sample of a group is its longest, so the group holds at most
           B(l0) = max(floor(max_tokens / l0), 1) samples, l0 its first length. A sample the
           constructor splits (`length_policy` "split", longer than `max_length`) counts as its
           ceil(l / max_length) rows of width max_length: the group then holds at most
           B(w0) rows, w0 = min(l0, max_length) its widest row.
        2. Alignment (ODB §2.3, split direction only). Let G be the group count and
           M = max(min_microbatches, ceil(G / ranks)). While G < ranks * M and some group holds
           two or more samples, the group with the most samples (ties: the lower position in
           length order) is split into two halves in place (its first floor(k/2) samples, which
           are the longer ones, then the rest). A half of a group fits any budget the group fits.
           The loop ends with G == ranks * M, or with every group a single sample, which
           happens only when n < ranks * M: a budget that keeps samples apart forces more
           microbatch slots than samples. Groups are never merged, so M is the smallest count
           the grouping of step 1 and `min_microbatches` allow.
        3. Assignment. Groups in descending total cost (ties: the one holding the smaller
           sample index first) each go to the rank with the least running total cost among
           ranks holding fewer than M groups (ties: fewer groups, then lower rank). With
           G == ranks * M every rank gets exactly M groups; otherwise (n < ranks * M, all
           groups single samples) the first `ranks` groups go to distinct ranks and each rank
           gets at most M.
        4. Ordering. A rank's groups are ordered by descending total cost (ties: smaller
           lowest sample index), so the m-th microbatches of all ranks are of similar cost;
           then empty microbatches fill the rank up to M, last.

    Guarantees: every index 0..n-1 appears in exactly one microbatch (I1); every rank has the
    same number M >= min_microbatches of microbatches (I2); no microbatch is empty when
    n >= ranks * M, and otherwise exactly ranks * M - n are empty, all of them after the
    non-empty ones of their rank (the planner fills them). In particular none is empty when
    n >= ranks * min_microbatches and n is a multiple of `ranks`. A microbatch b holding two
    or more samples fits the budget: rows(b) * max(width[b]) <= max_tokens (padded; rows(b) is
    len(b) and width the lengths unless samples are split: then their rows and min(lengths,
    max_length)), sum(lengths[b]) <= max_tokens (not padded) or math.fsum(costs[b]) <=
    max_cost; a single sample may exceed it alone.

    Args:
        lengths: Length in tokens of each sample, a one-dimensional integer array, all > 0.
        costs: Cost of each sample, a one-dimensional array of finite numbers >= 0, as long
            as `lengths`.
        ranks: Data-parallel ranks, >= 1.
        max_tokens: Token budget of a microbatch, >= 1. Exactly one of `max_tokens` and
            `max_cost` is given.
        max_cost: Cost budget of a microbatch (the sum of its samples' costs), finite and > 0.
        padded: With `max_tokens`: True when the constructor pads every sample of a microbatch
            to its longest (the budget bounds len(b) * max length), False when it packs them
            (the budget bounds the sum of lengths). Ignored with `max_cost`.
        min_microbatches: Fewest microbatches per rank, >= 1.
        max_length: The job's `batch.max_length`; None: no limit.
        length_policy: The job's `batch.length_policy`; under "split" a padded token budget
            counts a sample longer than max_length as its rows (see step 1).
    Returns:
        For each of `ranks` ranks, a list of M int64 arrays of sample indices, each sorted
        ascending. A function of the arguments' values only.
    Raises:
        ValueError: Both or neither of max_tokens and max_cost; a budget, `ranks` or
            `min_microbatches` out of range; lengths or costs not one-dimensional, of
            different sizes, lengths not integers > 0, costs negative or not finite.
        TypeError: ranks, min_microbatches or max_tokens not an integer.
    """
    return token_budget_steps(
        lengths,
        costs,
        ranks=ranks,
        steps=1,
        max_tokens=max_tokens,
        max_cost=max_cost,
        padded=padded,
        min_microbatches=min_microbatches,
        max_length=max_length,
        length_policy=length_policy,
    )[0]


def token_budget_steps(
    lengths: np.ndarray,
    costs: np.ndarray,
    *,
    ranks: int,
    steps: int,
    max_tokens: int | None = None,
    max_cost: float | None = None,
    padded: bool = True,
    min_microbatches: int = 1,
    max_length: int | None = None,
    length_policy: str = "split",
    sources: np.ndarray | None = None,
    targets: np.ndarray | None = None,
) -> list[list[list[np.ndarray]]]:
    """Token-budget batching over a planning window of `steps` steps: the samples of all of
    them grouped at once, then cut into steps with the same number of microbatches on every
    rank of a step (`token_budget` is the window of one step).

    Grouping over many steps' samples lets similar lengths from anywhere in the window share a
    microbatch, which is what brings padding and the step count down to those of an offline
    global grouping (ODB groups within each rank's buffer; the planner sees every rank's window
    at once).

    Algorithm:
        1. Grouping as in `token_budget` (step 1), over the whole window.
        2. Alignment: T = max(steps * min_microbatches, ceil(G / ranks)) microbatch slots per
           rank over the window; groups are split as in `token_budget` (step 2) until
           G == ranks * T, or every group is a single sample.
        3. Rounds: groups in descending total cost (ties: the one holding the smaller sample
           index first) are cut into rounds of `ranks` consecutive groups and dealt to the
           steps in passes of `steps` rounds, one per step and pass, each round to the step
           holding the fewest samples so far; the r rounds of fewest samples go last, one each
           to r steps; then the steps are ordered so that every source's running count stays
           closest to an even spread over the window (`_deal_rounds`). Every step thus holds q
           or q + 1 rounds (T = q * steps + r) and a cross-section of the window's lengths.
        4. Per step, its groups are assigned and ordered as in `token_budget` (steps 3 and 4)
           with M_s per rank: every rank of step s has exactly M_s >= min_microbatches
           microbatches.

    Guarantees (per step, as `token_budget`'s per call): every index 0..n-1 appears in exactly
    one microbatch of exactly one step (I1); every rank of a step has the same number of
    microbatches (I2); a microbatch of two or more samples fits the budget. Empty
    microbatches occur only when n < ranks * T (a window with fewer samples than microbatch
    slots), always after the non-empty ones of their rank.

    Args:
        lengths, costs, ranks, max_tokens, max_cost, padded, min_microbatches, max_length,
            length_policy: As for `token_budget`.
        steps: Steps of the window, >= 1.
        sources: Each sample's source (integers >= 0), whose running counts step 3 keeps close
            to `targets`; None: one source.
        targets: [steps, sources]: the samples of each source the mixture allocated to each
            step; None: an even spread.
    Returns:
        result[step][rank] = list of that step's M_s int64 arrays of sample indices, each sorted
        ascending. A function of the arguments' values only.
    Raises:
        ValueError, TypeError: As `token_budget`; `steps` not an integer >= 1.
    """
    steps = _positive_int(steps, "steps")
    if (max_tokens is None) == (max_cost is None):
        raise ValueError(f"exactly one of max_tokens and max_cost must be given, got max_tokens={max_tokens!r} and max_cost={max_cost!r}")
    ranks = _positive_int(ranks, "ranks")
    min_microbatches = _positive_int(min_microbatches, "min_microbatches")
    lens, c = _check_samples(lengths, costs)
    if max_cost is None:  # then max_tokens is given
        max_tokens = _positive_int(max_tokens, "max_tokens")
        lens_array = np.asarray(lens, dtype=np.int64)
        rows = chunk_counts(lens_array, max_length=max_length, policy=length_policy).tolist()
        widths = longest_chunks(lens_array, max_length=max_length, policy=length_policy).tolist()
        groups = _group_tokens(lens, max_tokens, padded=padded, rows=rows, widths=widths)
    else:
        budget = float(max_cost)
        if not (math.isfinite(budget) and budget > 0):
            raise ValueError(f"max_cost must be finite and > 0, got {max_cost!r}")
        groups = _group_costs(lens, c.tolist(), budget)
    slots = max(steps * min_microbatches, -(-len(groups) // ranks))
    _split_until(groups, ranks * slots)
    values = c.tolist()
    totals = [math.fsum(values[i] for i in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda j: (-totals[j], min(groups[j])))
    labels = np.zeros(len(lens), np.int64) if sources is None else _labels(sources, len(lens))
    width = int(labels.max(initial=0)) + 1
    if targets is not None:
        targets = np.asarray(targets, np.float64)
        if targets.ndim != 2 or targets.shape[0] != steps or targets.shape[1] < width:
            raise ValueError(f"targets must have shape ({steps}, sources) with a column for every source, got {targets.shape}")
        width = targets.shape[1]
    counts = np.zeros((slots, width), np.int64)
    for r in range(slots):
        for j in order[r * ranks : (r + 1) * ranks]:
            np.add.at(counts[r], labels[groups[j]], 1)
    out = []
    for rounds in _deal_rounds(counts, steps, targets):
        mine = [groups[j] for r in rounds for j in order[r * ranks : (r + 1) * ranks]]
        per_rank = _assign(mine, values, ranks=ranks, per_rank=len(rounds))
        out.append([_ordered(rank_groups, values, len(rounds)) for rank_groups in per_rank])
    return out


def _deal_rounds(counts: np.ndarray, steps: int, targets: np.ndarray | None = None) -> list[list[int]]:
    """Step 3 of `token_budget_steps`: which rounds (0 = costliest) each step takes.

    With T = q * steps + r rounds, the r rounds holding the fewest samples (ties: the costlier)
    are set aside as extras. The others go out in passes of `steps` consecutive rounds in cost
    order, one round per step and pass, the round of the pass holding the most samples to the
    step holding the fewest so far (ties: the costlier round, the lower step); then the extras
    the same way. Every step thus takes a cross-section of the window's cost order and about
    the same number of samples. Finally the steps are put in the order that keeps every
    source's running count closest to the targets': position by position, the step that
    leaves the smallest sum of squared relative leads and lags (ties: the lower step).

    Args:
        counts: int64 [T, labels]: samples of each label (source) in each round, rounds in
            cost order.
        steps: Steps.
        targets: [steps, labels]: the samples of each label each step should hold (the
            mixture's allocation); None: an even spread.
    Returns:
        Per step, its rounds ascending: q or q + 1 of them.
    """
    sizes = counts.sum(axis=1).tolist()
    r = len(sizes) % steps
    extras = sorted(sorted(range(len(sizes)), key=lambda j: (sizes[j], j))[:r])
    rest = [j for j in range(len(sizes)) if j not in set(extras)]
    bags: list[list[int]] = [[] for _ in range(steps)]
    held = [0] * steps
    for rounds in [rest[lo : lo + steps] for lo in range(0, len(rest), steps)] + [extras]:
        takers = sorted(range(steps), key=lambda s: (held[s], s))
        for j, s in zip(sorted(rounds, key=lambda j: (-sizes[j], j)), takers):
            bags[s].append(j)
            held[s] += sizes[j]
    per_bag = np.array([counts[b].sum(axis=0) if b else np.zeros(counts.shape[1], np.int64) for b in bags])
    total = np.maximum(per_bag.sum(axis=0), 1)
    if targets is None:
        targets = np.tile(per_bag.sum(axis=0) / steps, (steps, 1))
    wanted = np.cumsum(targets, axis=0)
    order, running, left = [], np.zeros(counts.shape[1]), list(range(steps))
    for position in range(steps):
        worst = [float(np.sum(((running + per_bag[b] - wanted[position]) / total) ** 2)) for b in left]
        b = left.pop(min(range(len(left)), key=lambda i: (worst[i], left[i])))
        order.append(b)
        running += per_bag[b]
    return [sorted(bags[b]) for b in order]


def loss_weights(loss_tokens: Sequence[Sequence[int]]) -> list[list[float]]:
    """Token-level loss weights of one step (ODB Appendix B): w = t / T.

    A microbatch carrying t loss tokens, of a step carrying T in all, weighs t / T, so that
    sum over microbatches of w * (mean loss of the microbatch) is the per-token mean loss of the
    whole step, whatever the ranks' token counts. Each weight is the float nearest to the exact
    ratio t / T (integer true division is correctly rounded), so the weights sum to 1 up to one
    rounding per microbatch.

    Args:
        loss_tokens: loss_tokens[rank][m] = loss-carrying tokens of microbatch m of `rank`,
            integers >= 0 (ranks may hold different numbers of microbatches).
    Returns:
        The weights in the same shape; all 0.0 when the step carries no loss token.
    Raises:
        ValueError: A negative token count.
        TypeError: A token count that is not an integer.
    """
    counts = []
    for r, rank in enumerate(loss_tokens):
        row = []
        for m, t in enumerate(rank):
            t = operator.index(t)
            if t < 0:
                raise ValueError(f"loss_tokens[{r}][{m}] must be >= 0, got {t}")
            row.append(t)
        counts.append(row)
    total = sum(sum(row) for row in counts)
    if total == 0:
        return [[0.0] * len(row) for row in counts]
    return [[t / total for t in row] for row in counts]


def _labels(sources: np.ndarray, n: int) -> np.ndarray:
    """Validated per-sample source labels as int64.

    Raises:
        ValueError: Not n integers >= 0.
    """
    labels = np.asarray(sources)
    if labels.shape != (n,) or (n and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0)):
        raise ValueError(f"sources must be {n} integers >= 0, one per sample, got dtype {labels.dtype} shape {labels.shape}")
    return labels.astype(np.int64)


def _positive_int(value: object, what: str) -> int:
    """Validates an integer >= 1.

    Args:
        value: The value.
        what: Its name, for error messages.
    Returns:
        The value as an int.
    Raises:
        TypeError: Not an integer (bools included).
        ValueError: Below 1.
    """
    try:
        if isinstance(value, bool) or not isinstance(value, SupportsIndex):
            raise TypeError
        v = operator.index(value)  # TypeError for an array of more than one element, too
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{what} must be >= 1, got {v}")
    return v


def _check_samples(lengths: np.ndarray, costs: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Validates the samples' lengths and costs.

    Args:
        lengths: Array-like of lengths.
        costs: Array-like of costs.
    Returns:
        The lengths as Python ints and the costs as float64.
    Raises:
        ValueError: See `token_budget`.
    """
    lens = np.asarray(lengths)
    if lens.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {lens.shape}")
    if lens.size and not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {lens.dtype}")
    if lens.size and lens.min() <= 0:
        i = int(np.flatnonzero(lens <= 0)[0])
        raise ValueError(f"lengths must be > 0, got {int(lens[i])} at index {i}")
    try:
        c = np.asarray(costs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"costs must be numeric: {exc}") from exc
    if c.ndim != 1 or len(c) != len(lens):
        raise ValueError(f"costs must be one-dimensional of length {len(lens)} like lengths, got shape {c.shape}")
    bad = ~np.isfinite(c) | (c < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"costs must be finite and >= 0, got {float(c[i])!r} at index {i}")
    return [int(x) for x in lens.tolist()], c


def _length_order(lens: list[int]) -> list[int]:
    """Sample indices by length descending, ties by lower index first."""
    return sorted(range(len(lens)), key=lambda i: (-lens[i], i))


def _group_tokens(lens: list[int], max_tokens: int, *, padded: bool, rows: list[int], widths: list[int]) -> list[list[int]]:
    """Step 1 under a token budget: next-fit grouping in descending length order.

    Args:
        lens: Lengths.
        max_tokens: Budget.
        padded: Whether the budget bounds the padded area (rows * widest row) or the sum.
        rows: Rows each sample is laid out as (1 unless split).
        widths: Each sample's widest row (its length unless split); non-increasing in
            length order, like the lengths.
    Returns:
        Groups of sample indices, each in descending length order, in order of creation.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0  # padded: the group's rows; packed: its token sum
    capacity = 0  # padded: the group's capacity in rows
    for i in _length_order(lens):
        if padded:
            fits = bool(current) and used + rows[i] <= capacity
        else:
            fits = bool(current) and used + lens[i] <= max_tokens
        if fits:
            current.append(i)
            used += rows[i] if padded else lens[i]
            continue
        if current:
            groups.append(current)
        current = [i]
        capacity = max(max_tokens // widths[i], 1)
        used = rows[i] if padded else lens[i]
    if current:
        groups.append(current)
    return groups


def _group_costs(lens: list[int], values: list[float], max_cost: float) -> list[list[int]]:
    """Step 1 under a cost budget: next-fit grouping in descending length order, a group's
    total decided exactly (math.fsum) when its float running sum is near the budget.

    Args:
        lens: Lengths.
        values: Costs as Python floats.
        max_cost: Budget.
    Returns:
        Groups of sample indices, each in descending length order, in order of creation.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0.0
    for i in _length_order(lens):
        if current:
            t = total + values[i]
            if t <= max_cost * (1 - _SAFE_MARGIN):
                fits = True
            elif t > max_cost * (1 + _SAFE_MARGIN):
                fits = False
            else:
                fits = math.fsum([values[j] for j in current] + [values[i]]) <= max_cost
            if fits:
                current.append(i)
                total = t
                continue
            groups.append(current)
        current = [i]
        total = values[i]
    if current:
        groups.append(current)
    return groups


def _split_until(groups: list[list[int]], target: int) -> None:
    """Step 2: splits groups in place until there are `target` or no group can be split.

    Args:
        groups: Groups in length order; modified.
        target: Wanted group count, >= len(groups).
    """
    while len(groups) < target:
        p = max(range(len(groups)), key=lambda j: (len(groups[j]), -j), default=None)
        if p is None or len(groups[p]) < 2:
            return
        g = groups[p]
        half = len(g) // 2
        groups[p : p + 1] = [g[:half], g[half:]]


def _assign(groups: list[list[int]], values: list[float], *, ranks: int, per_rank: int) -> list[list[list[int]]]:
    """Step 3: groups to ranks, at most `per_rank` each, balancing the ranks' total cost.

    Args:
        groups: Groups of sample indices (non-empty).
        values: Costs as Python floats.
        ranks: Ranks.
        per_rank: Most groups per rank.
    Returns:
        Per rank, its groups in assignment order.
    """
    totals = [math.fsum(values[i] for i in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda j: (-totals[j], min(groups[j])))
    load = [0.0] * ranks
    out: list[list[list[int]]] = [[] for _ in range(ranks)]
    for j in order:
        r = min((r for r in range(ranks) if len(out[r]) < per_rank), key=lambda r: (load[r], len(out[r]), r))
        out[r].append(groups[j])
        load[r] += totals[j]
    return out


def _ordered(rank_groups: list[list[int]], values: list[float], m: int) -> list[np.ndarray]:
    """Step 4: a rank's microbatches as sorted int64 arrays, by descending exact total cost
    (ties: smaller lowest index), padded with empty ones up to `m`.

    Args:
        rank_groups: The rank's groups.
        values: Costs as Python floats.
        m: Microbatches per rank.
    Returns:
        Exactly `m` arrays.
    """
    keyed = sorted(rank_groups, key=lambda g: (-math.fsum(values[i] for i in g), min(g)))
    out = [np.array(sorted(g), dtype=np.int64) for g in keyed]
    out.extend(np.zeros(0, dtype=np.int64) for _ in range(m - len(out)))
    return out
