"""Tests of batchplane.planner.balance: partition properties, reference implementations, the
balancing-quality acceptance test, error cases and `spread`."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.planner.balance import METHODS, partition, spread

BALANCING = ("karmarkar_karp", "greedy")

# Costs with many ties and zeros: a few fixed values mixed with arbitrary finite ones.
_cost_value = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 3.0, 7.5, 1e6]),
    st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False),
)
costs_st = st.lists(_cost_value, max_size=90).map(lambda xs: np.array(xs, dtype=np.float64))
positive_costs_st = st.lists(st.one_of(st.sampled_from([1.0, 2.0, 5.0]), st.floats(min_value=1e-6, max_value=1e9)), max_size=90).map(
    lambda xs: np.array(xs, dtype=np.float64)
)
parts_st = st.integers(min_value=1, max_value=40)
method_st = st.sampled_from(METHODS)

_settings = settings(max_examples=150, deadline=None)


def _totals(costs: np.ndarray, groups: list[np.ndarray]) -> list[float]:
    return [math.fsum(costs[g].tolist()) for g in groups]


# --- properties ------------------------------------------------------------------------------


@_settings
@given(costs=costs_st, parts=parts_st, method=method_st)
def test_every_index_in_exactly_one_sorted_group(costs: np.ndarray, parts: int, method: str) -> None:
    groups = partition(costs, parts, method)
    assert isinstance(groups, list)
    assert len(groups) == parts
    for g in groups:
        assert isinstance(g, np.ndarray)
        assert g.dtype == np.int64
        assert g.ndim == 1
        assert np.all(np.diff(g) > 0)
    flat = np.concatenate(groups)
    assert np.array_equal(np.sort(flat), np.arange(len(costs)))


@_settings
@given(costs=positive_costs_st, parts=parts_st, method=method_st)
def test_no_empty_group_when_enough_positive_items(costs: np.ndarray, parts: int, method: str) -> None:
    groups = partition(costs, parts, method)
    if len(costs) >= parts:
        assert all(len(g) > 0 for g in groups)


@_settings
@given(costs=costs_st, parts=parts_st, method=method_st)
def test_no_empty_group_when_enough_items_zeros_included(costs: np.ndarray, parts: int, method: str) -> None:
    groups = partition(costs, parts, method)
    sizes = [len(g) for g in groups]
    if len(costs) >= parts:
        assert min(sizes) > 0
    else:  # the surplus groups are empty and every item is alone
        assert sizes.count(0) == parts - len(costs)
        assert all(s in (0, 1) for s in sizes)


@_settings
@given(costs=costs_st, parts=parts_st, method=method_st)
def test_deterministic_and_independent_of_representation(costs: np.ndarray, parts: int, method: str) -> None:
    before = costs.copy()
    first = partition(costs, parts, method)
    assert np.array_equal(costs, before)  # the input is not modified
    padded = np.zeros(2 * len(costs))
    padded[::2] = costs  # a non-contiguous view with the same values
    for again in (partition(costs, parts, method), partition(costs.tolist(), parts, method), partition(padded[::2], parts, method)):
        assert len(again) == len(first)
        for a, b in zip(first, again):
            assert np.array_equal(a, b)


@_settings
@given(costs=costs_st, parts=parts_st)
def test_round_robin_is_index_modulo_parts(costs: np.ndarray, parts: int) -> None:
    groups = partition(costs, parts, "round_robin")
    for g, members in enumerate(groups):
        assert np.array_equal(members, np.flatnonzero(np.arange(len(costs)) % parts == g))


@_settings
@given(costs=costs_st, parts=parts_st, method=st.sampled_from(BALANCING))
def test_groups_ordered_by_descending_total_then_lowest_index(costs: np.ndarray, parts: int, method: str) -> None:
    groups = partition(costs, parts, method)
    keys = [(-t, int(g[0]) if len(g) else len(costs)) for t, g in zip(_totals(costs, groups), groups)]
    assert keys == sorted(keys)


@_settings
@given(costs=costs_st, parts=parts_st, method=method_st)
def test_max_group_at_least_the_lower_bound(costs: np.ndarray, parts: int, method: str) -> None:
    if len(costs) == 0:
        return
    totals = _totals(costs, partition(costs, parts, method))
    bound = max(math.fsum(costs.tolist()) / parts, float(costs.max()))
    assert max(totals) >= bound * (1 - 1e-12)


@_settings
@given(costs=costs_st, parts=parts_st, method=st.sampled_from(BALANCING))
def test_max_minus_min_at_most_the_largest_cost(costs: np.ndarray, parts: int, method: str) -> None:
    # Greedy: the last item put on the fullest group went to the then least loaded group.
    # Karmarkar-Karp: combining tuples with ranges dA, dB gives a range <= max(dA, dB), and a
    # single item's tuple has range = its cost.
    if len(costs) == 0:
        return
    totals = _totals(costs, partition(costs, parts, method))
    tol = 1e-9 * math.fsum(costs.tolist())
    assert max(totals) - min(totals) <= float(costs.max()) + tol


@_settings
@given(costs=costs_st, parts=parts_st)
def test_greedy_within_list_scheduling_bound(costs: np.ndarray, parts: int) -> None:
    if len(costs) == 0:
        return
    total = math.fsum(costs.tolist())
    greedy_max = max(_totals(costs, partition(costs, parts, "greedy")))
    assert greedy_max <= total / parts + float(costs.max()) * (1 - 1 / parts) + 1e-9 * total


def _greedy_reference(costs: np.ndarray, parts: int) -> list[list[int]]:
    """LPT by the documented rules, O(n * parts)."""
    loads = [0.0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(parts), key=lambda g: (loads[g], len(members[g]), g))
        loads[g] += float(costs[i])
        members[g].append(i)
    return members


@_settings
@given(costs=costs_st, parts=parts_st)
def test_greedy_matches_reference(costs: np.ndarray, parts: int) -> None:
    got = sorted(g.tolist() for g in partition(costs, parts, "greedy"))
    assert got == sorted(sorted(g) for g in _greedy_reference(costs, parts))


def _karmarkar_karp_reference(costs: list[float], parts: int) -> list[list[int]]:
    """Dense multiway largest differencing: every tuple holds all `parts` subsets."""
    heap = []
    for i, v in enumerate(costs):
        subsets = [(v, [i])] + [(0.0, []) for _ in range(parts - 1)]
        heap.append((-(v - subsets[-1][0]), i, subsets))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, ia, a = heapq.heappop(heap)
        _, ib, b = heapq.heappop(heap)
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, reversed(b))]
        merged.sort(key=lambda s: (s[0], len(s[1]) > 0), reverse=True)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(ia, ib), merged))
    return [s[1] for s in heap[0][2]]


@pytest.mark.parametrize("seed", range(40))
def test_karmarkar_karp_matches_dense_reference(seed: int) -> None:
    # Continuous random costs, so no two sums tie and the tie rules do not matter.
    rng = np.random.default_rng(seed)
    for _ in range(5):
        n = int(rng.integers(1, 70))
        parts = int(rng.integers(1, 20))
        costs = rng.random(n) ** int(rng.integers(1, 5)) * 1000
        got = sorted(g.tolist() for g in partition(costs, parts, "karmarkar_karp"))
        assert got == sorted(sorted(g) for g in _karmarkar_karp_reference(costs.tolist(), parts))


# --- edge cases ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("parts", [1, 3])
def test_no_items_gives_empty_groups(method: str, parts: int) -> None:
    groups = partition(np.zeros(0), parts, method)
    assert len(groups) == parts
    assert all(g.dtype == np.int64 and len(g) == 0 for g in groups)


@pytest.mark.parametrize("method", METHODS)
def test_one_part_holds_everything(method: str) -> None:
    groups = partition(np.array([5.0, 0.0, 3.0, 3.0]), 1, method)
    assert len(groups) == 1
    assert groups[0].tolist() == [0, 1, 2, 3]


def test_small_examples() -> None:
    costs = np.array([4.0, 5.0, 6.0, 7.0, 8.0])
    # LPT: 8 -> g0, 7 -> g1, 6 -> g1 (13), 5 -> g0 (13), 4 -> g0 (tie at 13 and 2 items each:
    # the lower group). Totals 17 and 13.
    assert [g.tolist() for g in partition(costs, 2, "greedy")] == [[0, 1, 4], [2, 3]]
    # KK: (8|7) -> (8,7); (6|5) -> (6,5); 4 with (6,5) (range tie broken by lower index) ->
    # (4+5, 6) = (9,6); (9,6) with (8,7) -> (9+7, 6+8) = (16, 14).
    assert [g.tolist() for g in partition(costs, 2, "karmarkar_karp")] == [[0, 1, 3], [2, 4]]
    assert [g.tolist() for g in partition(costs, 2, "round_robin")] == [[0, 2, 4], [1, 3]]


@pytest.mark.parametrize("method", METHODS)
def test_large_input_is_a_partition(method: str) -> None:
    costs = np.random.default_rng(7).lognormal(0.0, 1.0, 4096)
    groups = partition(costs, 64, method)
    assert np.array_equal(np.sort(np.concatenate(groups)), np.arange(4096))
    assert all(len(g) > 0 for g in groups)


# --- balancing quality: the project's acceptance test ----------------------------------------


def _skewed_lengths(rng: np.random.Generator, tail: str, n: int) -> np.ndarray:
    """98% of lengths uniform in [8, 64], 2% from a long tail (capped at 4096)."""
    body = rng.integers(8, 65, n)
    if tail == "uniform":
        long = rng.integers(65, 4097, n)
    else:
        long = np.minimum(4096, 64 + np.round(64 * rng.lognormal(0.0, 1.0, n))).astype(np.int64)
    return np.where(rng.random(n) < 0.02, long, body).astype(np.int64)


# Measured on seeds 0..255 (64 samples into 8 parts, cost l**2), mean max/min over all draws:
#   uniform tail:   karmarkar_karp 343.4704, greedy 343.4709, round_robin 774.57 (2.26x greedy)
#   lognormal tail: karmarkar_karp   5.1362, greedy   5.1369, round_robin  11.56 (2.25x greedy)
# A single tail sample often costs more than a fair share (total / 8); then no method can do
# better than giving it a group of its own, KK and greedy both do, and those draws dominate the
# means (hence the 1.5x margin rather than 3x). Over the draws where the largest cost is at
# most total / 8 (66 resp. 133 of 256), mean max/min is
#   uniform tail:   karmarkar_karp 1.0050, greedy 1.0068, round_robin 2.34
#   lognormal tail: karmarkar_karp 1.0054, greedy 1.0067, round_robin 2.62
# and mean max/mean over all draws is 4.962 / 4.962 / 5.235 resp. 1.862 / 1.863 / 2.401.
# The draws are seeded, so these figures are fixed, not sampled anew on each run.
@pytest.mark.parametrize("tail", ["uniform", "lognormal"])
def test_balancing_quality_on_skewed_lengths(tail: str) -> None:
    draws, samples, parts = 256, 64, 8
    ratios = {m: np.empty((draws, 2)) for m in METHODS}
    balanceable = np.empty(draws, dtype=bool)
    for seed in range(draws):
        lengths = _skewed_lengths(np.random.default_rng(seed), tail, samples)
        costs = lengths.astype(np.float64) ** 2
        balanceable[seed] = costs.max() <= costs.sum() / parts
        for m in METHODS:
            ratios[m][seed] = spread(np.array(_totals(costs, partition(costs, parts, m))))
    assert np.isfinite(ratios["round_robin"]).all()  # 64 samples into 8 groups: none empty
    kk, greedy, rr = (ratios[m][:, 0].mean() for m in METHODS)
    assert kk <= greedy
    assert rr >= 1.5 * greedy
    kk_b, greedy_b, rr_b = (ratios[m][balanceable, 0].mean() for m in METHODS)
    assert balanceable.sum() >= 50
    assert kk_b <= greedy_b <= 1.02
    assert rr_b >= 1.8
    assert rr_b - 1 >= 50 * (greedy_b - 1)
    kk_mean, greedy_mean, rr_mean = (ratios[m][:, 1].mean() for m in METHODS)
    assert kk_mean <= greedy_mean < rr_mean


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("costs", "parts", "method", "match"),
    [
        (np.ones(4), 2, "lpt", r"'lpt'.*karmarkar_karp, greedy, round_robin"),
        (np.ones(4), 0, "greedy", "parts must be >= 1"),
        (np.ones(4), -3, "karmarkar_karp", "parts must be >= 1"),
        (np.array([1.0, -1.0]), 2, "greedy", ">= 0.*-1.0.*index 1"),
        (np.array([1.0, np.nan]), 2, "karmarkar_karp", "finite.*nan"),
        (np.array([np.inf, 1.0]), 2, "round_robin", "finite.*inf"),
        (np.ones((2, 3)), 2, "greedy", r"one-dimensional.*\(2, 3\)"),
        (np.float64(3.0), 2, "greedy", "one-dimensional"),
        (np.array(["a", "b"]), 2, "greedy", "numeric"),
    ],
)
def test_invalid_arguments_raise_value_error(costs: np.ndarray, parts: int, method: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(costs, parts, method)


def test_non_integer_parts_raises_type_error() -> None:
    with pytest.raises(TypeError):
        partition(np.ones(3), 2.5, "greedy")  # type: ignore[arg-type]


# --- spread ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        ([1.0, 2.0, 3.0], (3.0, 1.5)),
        ([4.0, 4.0], (1.0, 1.0)),
        ([0.0, 2.0], (math.inf, 2.0)),
        ([0.0, 0.0, 0.0], (1.0, 1.0)),
        ([5.0], (1.0, 1.0)),
    ],
)
def test_spread(totals: list[float], expected: tuple[float, float]) -> None:
    assert spread(np.array(totals)) == pytest.approx(expected)


@pytest.mark.parametrize("totals", [np.zeros(0), np.ones((2, 2)), np.array([1.0, -1.0]), np.array([np.nan])])
def test_spread_rejects_bad_input(totals: np.ndarray) -> None:
    with pytest.raises(ValueError):
        spread(totals)
