"""Cost balancing: splits a step's samples into groups (ranks, or one rank's microbatches) of
near-equal total cost.

`partition` assigns item indices 0..n-1 to a fixed number of groups by one of three methods:
"karmarkar_karp" (the multiway largest differencing method), "greedy" (longest processing time
first) and "round_robin" (no balancing, the baseline). `spread` measures how uneven the groups'
totals are. Everything here is deterministic and pure: no I/O, no clocks, no randomness, and no
dependence on hashing or dict/set iteration order.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from typing import Union

import numpy as np

from batchplane.core.methods import PARTITION_METHODS as METHODS

# Karmarkar-Karp: up to this many new subsets are inserted one by one, more are sorted in.
_INSERT_MAX = 8

# A merge tree of item indices: a leaf is an item index, an inner node joins two subtrees.
_Node = Union[int, tuple["_Node", "_Node"]]


def partition(costs: np.ndarray, parts: int, method: str) -> list[np.ndarray]:
    """Splits item indices 0..n-1 (n = len(costs)) into `parts` groups of balanced total cost.

    Methods:
        "round_robin": item i goes to group i % parts; groups are returned in group order.
        "greedy": longest processing time first: items in descending cost (ties: lower index
            first), each to the group with the least running total (ties: fewer items, then
            lower group index).
        "karmarkar_karp": the multiway largest differencing method: one k-tuple of subset sums
            per item; the two tuples with the largest difference max - min (ties: the tuple
            holding the lower item index) are combined by pairing the largest sums of one with
            the smallest of the other, until one tuple remains.

    For "greedy" and "karmarkar_karp" the groups are returned in descending order of total
    cost, the totals summed exactly rounded (`math.fsum`); ties go to the group holding the
    lowest item index, and empty groups come last.

    Every index appears in exactly one group. When n >= parts every group is non-empty for all
    three methods (zero costs included); when n < parts, parts - n groups are empty. For
    "greedy" and "karmarkar_karp" the largest and smallest group totals differ by at most the
    largest cost (up to float rounding). The result depends only on the values and order of
    `costs`, on `parts` and on `method`.

    Args:
        costs: Per-item cost, a one-dimensional array of finite numbers >= 0.
        parts: Number of groups, >= 1.
        method: One of `METHODS`.
    Returns:
        A list of exactly `parts` int64 arrays of item indices, each sorted ascending.
    Raises:
        ValueError: An unknown method, parts < 1, or costs that are not numeric, not
            one-dimensional or hold negative, NaN or infinite values.
        TypeError: parts is not an integer.
    """
    if method not in METHODS:
        raise ValueError(f"unknown balancing method {method!r}; valid methods: {', '.join(METHODS)}")
    parts = operator.index(parts)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    c = _check_costs(costs)
    n = len(c)
    if method == "round_robin":
        return [np.arange(g, n, parts, dtype=np.int64) for g in range(parts)]
    values = c.tolist()
    if method == "greedy":
        groups = _greedy(c, values, parts)
    else:
        groups = _karmarkar_karp(values, parts)
    return _ordered(groups, values)


def spread(group_costs: np.ndarray) -> tuple[float, float]:
    """Unevenness of per-group total costs.

    Args:
        group_costs: Total cost of each group, a non-empty one-dimensional array of finite
            numbers >= 0.
    Returns:
        (max / min, max / mean). max / min is `math.inf` when the minimum is 0 and the maximum
        is not; both are 1.0 when all totals are 0.
    Raises:
        ValueError: An empty or multi-dimensional array, or negative or non-finite values.
    """
    g = _check_costs(group_costs, what="group_costs")
    if g.size == 0:
        raise ValueError("group_costs must not be empty")
    hi, lo, mean = float(g.max()), float(g.min()), float(g.mean())
    if hi == 0.0:
        return 1.0, 1.0
    return (math.inf if lo == 0.0 else hi / lo), hi / mean


def _check_costs(costs: np.ndarray, *, what: str = "costs") -> np.ndarray:
    """Validates costs and returns them as a float64 array.

    Args:
        costs: Array-like of costs.
        what: Name used in error messages.
    Returns:
        The costs as float64.
    Raises:
        ValueError: Not numeric, not one-dimensional, negative or non-finite.
    """
    try:
        c = np.asarray(costs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be numeric: {exc}") from exc
    if c.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {c.shape}")
    bad = ~np.isfinite(c)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{what} must be finite, got {float(c[i])!r} at index {i}")
    neg = c < 0
    if neg.any():
        i = int(np.flatnonzero(neg)[0])
        raise ValueError(f"{what} must be >= 0, got {float(c[i])!r} at index {i}")
    return c


def _greedy(c: np.ndarray, values: list[float], parts: int) -> list[list[int]]:
    """Longest processing time first.

    Args:
        c: Validated float64 costs.
        values: The same costs as Python floats.
        parts: Number of groups.
    Returns:
        Per group (in group-index order), its item indices in assignment order.
    """
    order = np.argsort(-c, kind="stable").tolist()  # descending cost, ties by lower index
    members: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0.0, 0, g) for g in range(parts)]  # (total, items, group): already a heap
    for i in order:
        total, count, g = heap[0]
        members[g].append(i)
        heapq.heapreplace(heap, (total + values[i], count + 1, g))
    return members


def _karmarkar_karp(values: list[float], parts: int) -> list[list[int]]:
    """Multiway largest differencing (Karmarkar-Karp for k-way partitioning).

    A k-tuple is kept sparse: only its non-empty subsets, as parallel lists of sums and merge
    trees in ascending order of sum; the k - m empty subsets are implicit and sort below every
    non-empty one (zero-cost ones included). Combining tuples with a and b non-empty subsets
    gives min(k, a + b) non-empty subsets, so the final tuple has min(k, n) of them.

    Args:
        values: Validated costs as Python floats.
        parts: Number of groups (k).
    Returns:
        Per group, its item indices (unordered); surplus groups empty.
    """
    k = parts
    n = len(values)
    if n == 0:
        return [[] for _ in range(k)]
    if k == 1:
        return [list(range(n))]
    # Entries: (-difference, lowest item index, sums, trees). The lowest item index is unique
    # among live tuples, so comparison never reaches the lists. A tuple that is not full has
    # an empty subset, so its difference is its largest sum.
    heap: list[tuple[float, int, list[float], list[_Node]]] = [(-v, i, [v], [i]) for i, v in enumerate(values)]
    heapq.heapify(heap)
    pop, push, insort_at = heapq.heappop, heapq.heappush, bisect.bisect_right
    while len(heap) > 1:
        _, ia, sa, ta = pop(heap)
        _, ib, sb, tb = pop(heap)
        if len(sb) > len(sa):
            sa, ta, sb, tb = sb, tb, sa, ta
        if len(sb) == 1:  # the common case, done in place (the popped lists are ours)
            t: _Node
            if len(sa) == k:
                v, t = sa.pop(0) + sb[0], (ta.pop(0), tb[0])
            else:
                v, t = sb[0], tb[0]
            j = insort_at(sa, v)
            sa.insert(j, v)
            ta.insert(j, t)
            sums, trees = sa, ta
        else:
            sums, trees = _combine(sa, ta, sb, tb, k)
        diff = sums[-1] - sums[0] if len(sums) == k else sums[-1]
        push(heap, (-diff, ia if ia < ib else ib, sums, trees))
    _, _, _, trees = heap[0]
    groups = [_leaves(t) for t in trees]
    groups.extend([] for _ in range(k - len(groups)))
    return groups


def _combine(sa: list[float], ta: list[_Node], sb: list[float], tb: list[_Node], k: int) -> tuple[list[float], list[_Node]]:
    """Combines two sparse k-tuples, pairing the largest sums of A with the smallest of B.

    With m_a >= m_b non-empty subsets, the dense tuples overlap in ov = max(0, m_a + m_b - k)
    slots: A's ov smallest subsets join B's ov smallest in reverse order (A's smallest with
    B's ov-th smallest); A's other subsets and B's other subsets meet empty ones. So the
    result is A's largest m_a - ov subsets, untouched and still sorted, plus m_b new ones,
    which are inserted one by one when few and sorted in otherwise.

    Args:
        sa: Sums of A, ascending; len(sa) >= len(sb).
        ta: Merge trees of A, parallel to `sa`.
        sb: Sums of B, ascending.
        tb: Merge trees of B, parallel to `sb`.
        k: Tuple width.
    Returns:
        Sums (ascending, ties in a fixed order) and merge trees of the combined tuple.
    """
    ov = max(0, len(sa) + len(sb) - k)
    sums = sa[ov:]
    trees = ta[ov:]
    new_sums = [x + y for x, y in zip(sa[:ov], reversed(sb[:ov]))] + sb[ov:]
    new_trees: list[_Node] = [*zip(ta[:ov], reversed(tb[:ov])), *tb[ov:]]
    if len(new_sums) <= _INSERT_MAX:
        for v, t in zip(new_sums, new_trees):
            j = bisect.bisect_right(sums, v)
            sums.insert(j, v)
            trees.insert(j, t)
        return sums, trees
    sums += new_sums
    trees += new_trees
    order = sorted(range(len(sums)), key=sums.__getitem__)  # stable
    return [sums[j] for j in order], [trees[j] for j in order]


def _leaves(tree: _Node) -> list[int]:
    """The item indices of a merge tree, without recursion.

    Args:
        tree: A merge tree.
    Returns:
        Its leaves (item indices), unordered.
    """
    out: list[int] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return out


def _ordered(groups: list[list[int]], values: list[float]) -> list[np.ndarray]:
    """Sorts each group's indices and orders the groups by descending exact total cost (ties:
    the lower lowest index first; empty groups last).

    Args:
        groups: Item indices per group, unordered.
        values: Costs as Python floats.
    Returns:
        The groups as sorted int64 arrays, in that order.
    """
    arrays = [np.sort(np.array(g, dtype=np.int64)) for g in groups]
    keys = [(-math.fsum(values[i] for i in g), int(a[0]) if a.size else len(values)) for g, a in zip(groups, arrays)]
    order = sorted(range(len(arrays)), key=keys.__getitem__)
    return [arrays[j] for j in order]
