"""Tests of batchplane.planner.padded: the cost of microbatches as the constructor builds them
(padding included), length-aware grouping within a rank, and balancing ranks by padded cost;
and that the plan, the ledger's figures and the planner's imbalance gauge use it."""

from __future__ import annotations

import itertools

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batchplane.planner.cost import make_cost_fn
from batchplane.planner.ledger import Ledger
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.mixture import Allocation, MixtureState
from batchplane.planner.padded import group, rows_of
from batchplane.planner.plan import Balancing, SampleTable, assign, build_step_plan

QUADRATIC = make_cost_fn("quadratic")
LINEAR = make_cost_fn("linear")


def lognormal_lengths(n: int, *, seed: int, median: float = 300.0, sigma: float = 1.0, cap: int = 4096) -> np.ndarray:
    """Heavy-tailed lengths like a BPE chat/web corpus: lognormal, capped, at least 1."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), 1, cap).astype(np.int64)


def skewed_lengths(n: int, *, seed: int, long_share: float = 0.1, short: int = 48, long: int = 600) -> np.ndarray:
    """Mostly short samples with a long tail (as tests/integration/harness.py's)."""
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < long_share, rng.integers(short, long, n), rng.integers(2, short, n)).astype(np.int64)


def _table(lengths: np.ndarray) -> SampleTable:
    n = len(lengths)
    return SampleTable(
        source=np.zeros(n, np.int32),
        seq=np.arange(n, dtype=np.int64),
        row=np.arange(n, dtype=np.int64),
        length=np.asarray(lengths, np.int32),
        epoch=np.zeros(n, np.int32),
    )


def padded_cost(lengths: np.ndarray, microbatch: np.ndarray, cost=QUADRATIC) -> float:
    """The cost the GPU runs, by hand: rows x cost(longest)."""
    if not len(microbatch):
        return 0.0
    return len(microbatch) * float(cost(np.array([lengths[microbatch].max()]))[0])


def padded_spread(lengths: np.ndarray, microbatches, cost=QUADRATIC) -> float:
    """max / mean over ranks of the padded cost of each rank's microbatches."""
    totals = np.array([sum(padded_cost(lengths, mb, cost) for mb in rank) for rank in microbatches])
    return float(totals.max() / totals.mean())


# ---- the cost of a microbatch as built -----------------------------------------------------


@pytest.mark.parametrize("cost", [QUADRATIC, LINEAR, make_cost_fn("llama-12b")])
def test_a_padded_microbatch_costs_its_rows_times_the_cost_of_its_longest(cost) -> None:
    lengths = np.array([5, 300, 17, 1000, 2])
    rows = rows_of(cost, lengths, {}, cost(lengths))
    index = np.array([0, 1, 2])
    assert rows.microbatch_cost(index) == pytest.approx(3 * cost(np.array([300]))[0])
    assert rows.microbatch_cost(np.zeros(0, np.int64)) == 0.0


def test_a_packed_microbatch_costs_the_sum_of_its_samples() -> None:
    lengths = np.array([5, 300, 17])
    rows = rows_of(QUADRATIC, lengths, {}, QUADRATIC(lengths), padded=False)
    assert rows.microbatch_cost(np.arange(3)) == pytest.approx(25 + 300**2 + 17**2)


def test_split_samples_are_costed_as_rows_of_their_chunks() -> None:
    # max_length 100, split: 250 -> rows 100, 100, 50; the microbatch is 4 rows padded to 100.
    lengths = np.array([250, 30])
    rows = rows_of(QUADRATIC, lengths, {}, np.array([100**2 * 2 + 50**2, 900.0]), max_length=100, length_policy="split")
    assert rows.microbatch_cost(np.arange(2)) == pytest.approx(4 * 100**2)


def test_features_are_not_padded() -> None:
    def cost(lengths, features=None):
        lengths = np.asarray(lengths, np.float64)
        images = (features or {}).get("num_images", np.zeros(len(lengths)))
        return lengths**2 + 1000.0 * images

    lengths = np.array([10, 20])
    features = {"num_images": np.array([3.0, 0.0])}
    rows = rows_of(cost, lengths, features, cost(lengths, features))
    assert rows.microbatch_cost(np.arange(2)) == pytest.approx(2 * 400 + 3000)


# ---- length-aware grouping ---------------------------------------------------------------


def test_grouping_puts_similar_lengths_together() -> None:
    lengths = np.array([4000, 10, 3900, 12, 300, 11, 310, 9])
    rows = rows_of(QUADRATIC, lengths, {}, QUADRATIC(lengths))
    groups = group(np.arange(8), 4, rows)
    assert [sorted(lengths[g].tolist()) for g in groups] == [[4000], [3900], [300, 310], [9, 10, 11, 12]]


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 4)), min_size=3, max_size=14).map(sorted), st.integers(2, 4))
def test_the_cuts_are_those_of_least_padded_cost_the_lowest_on_ties(samples: list[tuple[int, int]], parts: int) -> None:
    """`_cuts` (with its one-cut shortcut for two groups) against every way to cut, on integer
    costs (exact sums, so ties are real): the least sum of rows x the widest's row cost, and of
    those the one the DP backtracks to: the lowest last cut, then the lowest cut before it, and
    so on."""
    from batchplane.planner.padded import _cuts

    hypothesis.assume(len(samples) > parts)
    unit = np.array([float(u) for u, _ in samples])  # sorted by width: row costs ascend
    rows = np.array([r for _, r in samples], np.int64)
    cum_rows = np.concatenate([[0], np.cumsum(rows)])
    n = len(samples)

    def cost(cuts: tuple[int, ...]) -> float:
        return sum(float(cum_rows[hi] - cum_rows[lo]) * unit[hi - 1] for lo, hi in zip(cuts, cuts[1:]))

    every = [(0, *inner, n) for inner in itertools.combinations(range(1, n), parts - 1)]
    least = min(cost(c) for c in every)
    got = tuple(_cuts(cum_rows, unit, parts).tolist())
    assert cost(got) == least
    assert got == min((c for c in every if cost(c) == least), key=lambda c: tuple(reversed(c)))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.lists(st.integers(1, 5000), min_size=0, max_size=60), st.integers(1, 6))
def test_grouping_is_a_partition_into_length_ranges(lengths: list[int], parts: int) -> None:
    lengths = np.array(lengths, np.int64)
    rows = rows_of(QUADRATIC, lengths, {}, QUADRATIC(lengths))
    groups = group(np.arange(len(lengths)), parts, rows)
    assert len(groups) == parts
    flat = np.concatenate(groups)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert all(len(g) for g in groups[: min(parts, len(lengths))])  # empty ones only when too few
    ranges = sorted((int(lengths[g].min()), int(lengths[g].max())) for g in groups if len(g))
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi <= lo  # consecutive in length: no microbatch pads a shorter one's neighbours


# ---- the plan ------------------------------------------------------------------------------


def _spreads(
    lengths_of, *, steps: int, method: str = "karmarkar_karp", dp: int = 8, batch: int = 256, microbatches: int = 4, packed: bool = False
):
    """Per step: max/mean of the padded cost per rank, and the lower bound no plan can beat
    (max(1, the costliest sample alone / the mean rank))."""
    spreads, bounds = [], []
    for step in range(steps):
        lengths = lengths_of(batch, seed=step)
        plan = build_step_plan(step, _table(lengths), dp=dp, microbatches=microbatches, method=method, cost_fn=QUADRATIC, packed=packed)
        lengths = plan.samples.length.astype(np.int64)
        spreads.append(padded_spread(lengths, plan.microbatches))
        totals = [sum(padded_cost(lengths, mb) for mb in rank) for rank in plan.microbatches]
        bounds.append(max(1.0, float(QUADRATIC(lengths).max()) / float(np.mean(totals))))
    return np.array(spreads), np.array(bounds)


# The stated bound: per step, max/mean of the padded cost per rank at most 1.10, or within 2 %
# of what the costliest sample alone forces (a rank holding it costs at least that much).
STEP_BOUND, INDIVISIBLE_SLACK, MEAN_BOUND = 1.10, 1.02, 1.03


def test_padded_cost_is_balanced_on_heavy_tailed_lengths() -> None:
    """Lognormal lengths (median 300, sigma 1, capped at 4096), dp 8, global batch 256, 4
    microbatches, seeds 0..39: max/mean of the padded cost per rank and step. Measured over
    seeds 0..199: 1.008 mean, 1.065 max (before, when only the sum of sample costs was
    balanced, as it still is with packing: 1.48 mean, 1.90 max)."""
    spreads, bounds = _spreads(lognormal_lengths, steps=40)
    assert spreads.mean() <= MEAN_BOUND
    assert np.all(spreads <= np.maximum(STEP_BOUND, bounds * INDIVISIBLE_SLACK))
    before, _ = _spreads(lognormal_lengths, steps=40, packed=True)  # today's assignment, costed padded
    assert before.mean() >= 1.3


def test_padded_cost_is_balanced_on_skewed_lengths() -> None:
    """harness.skewed_lengths (10 % of 48..600 tokens, the rest 2..47), same shape of job: a
    step may hold one sample costlier than a mean rank, which then bounds max/mean."""
    spreads, bounds = _spreads(skewed_lengths, steps=40)
    assert spreads.mean() <= MEAN_BOUND
    assert np.all(spreads <= np.maximum(STEP_BOUND, bounds * INDIVISIBLE_SLACK))
    before, _ = _spreads(skewed_lengths, steps=40, packed=True)
    assert before.mean() >= 1.3


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    st.integers(0, 10**6),
    st.integers(0, 200),
    st.integers(1, 6),
    st.integers(1, 5),
    st.sampled_from(["karmarkar_karp", "greedy"]),
)
def test_padded_plans_keep_identity_alignment_and_determinism(seed: int, n: int, dp: int, microbatches: int, method: str) -> None:
    lengths = skewed_lengths(n, seed=seed, long_share=0.2, long=4000)
    plan = build_step_plan(0, _table(lengths), dp=dp, microbatches=microbatches, method=method, cost_fn=QUADRATIC)
    assert {len(rank) for rank in plan.microbatches} == {microbatches}  # I2
    flat = np.concatenate([mb for rank in plan.microbatches for mb in rank])
    assert sorted(flat.tolist()) == list(range(n))  # I1: each sample exactly once
    if n >= dp * microbatches:  # fillers only when the step is short of samples
        assert all(len(mb) for rank in plan.microbatches for mb in rank)
    for rank in plan.microbatches:
        for mb in rank:
            assert np.array_equal(mb, np.sort(mb))
    again = build_step_plan(0, _table(lengths), dp=dp, microbatches=microbatches, method=method, cost_fn=QUADRATIC)
    assert [[mb.tolist() for mb in r] for r in plan.microbatches] == [[mb.tolist() for mb in r] for r in again.microbatches]  # I4
    np.testing.assert_allclose(plan.built_rank_costs(), [sum(padded_cost(lengths, mb) for mb in rank) for rank in plan.microbatches])


@pytest.mark.parametrize(
    "balancing",
    [
        Balancing(method="round_robin", microbatches=4),
        Balancing(method="token_budget", microbatches=1, max_tokens=4096),
        Balancing(method="karmarkar_karp", microbatches=4, intra=False),
    ],
)
def test_round_robin_token_budget_and_ordered_microbatches_are_unchanged(balancing: Balancing) -> None:
    lengths = lognormal_lengths(256, seed=3)
    costs = QUADRATIC(lengths)
    rows = rows_of(QUADRATIC, lengths, {}, costs)
    got = assign(costs, lengths, buckets=8, balancing=balancing, rows=rows)
    want = assign(costs, lengths, buckets=8, balancing=balancing)
    assert [[mb.tolist() for mb in r] for r in got] == [[mb.tolist() for mb in r] for r in want]


def test_packing_keeps_balancing_the_sum_of_sample_costs() -> None:
    lengths = lognormal_lengths(256, seed=4)
    costs = QUADRATIC(lengths)
    got = assign(costs, lengths, buckets=8, balancing=Balancing(microbatches=4), rows=rows_of(QUADRATIC, lengths, {}, costs, padded=False))
    want = assign(costs, lengths, buckets=8, balancing=Balancing(microbatches=4))
    assert [[mb.tolist() for mb in r] for r in got] == [[mb.tolist() for mb in r] for r in want]


# ---- what the planner reports --------------------------------------------------------------


def test_the_imbalance_gauge_reports_the_padded_cost() -> None:
    lengths = lognormal_lengths(64, seed=5)
    plan = build_step_plan(0, _table(lengths), dp=2, microbatches=2, method="karmarkar_karp", cost_fn=QUADRATIC)
    padded = [sum(padded_cost(lengths, mb) for mb in rank) for rank in plan.microbatches]
    assert not np.allclose(padded, plan.rank_costs())  # padding is not the sum of sample costs
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry, source_names=["a"], target_weights=[1.0])
    allocation = Allocation(0, (0,), (64,), shares=(1.0,))
    ledger = Ledger(["a"], method="karmarkar_karp")
    ledger.record(allocation, plan, MixtureState(step=1, cursors=(64,)))
    metrics.observe_step(allocation, plan, ledger, waited_s=0.0, planned_s=0.0)
    got = registry.get_sample_value("batchplane_planner_rank_cost_imbalance_ratio")
    assert got == pytest.approx(max(padded) / min(padded))
    assert ledger.balance["karmarkar_karp"].mean_max_over_min == pytest.approx(max(padded) / min(padded))


# ---- rebalancing's internals -----------------------------------------------------------------


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.integers(0, 10**6), st.integers(1, 4), st.integers(1, 12), st.integers(0, 12))
def test_least_swaps_are_the_least_bounds_over_the_partners_candidates(seed: int, partners: int, m: int, w: int) -> None:
    from batchplane.planner.padded import _least_swaps

    rng = np.random.default_rng(seed)
    # Few distinct values, so that ties and equal keys are common.
    kept = rng.integers(0, 6, m).astype(np.float64) + 10
    joins_b = rng.integers(0, 6, (partners, m)).astype(np.float64)
    joins_a = rng.integers(0, 6, (partners, w)).astype(np.float64)
    joins_a[rng.random((partners, w)) < 0.2] = np.inf  # partners with fewer candidates
    left_b = rng.integers(0, 6, (partners, w)).astype(np.float64) + 8
    brute = np.maximum(kept[None, :, None] + joins_a[:, None, :], left_b[:, None, :] + joins_b[:, :, None])
    want = brute.min(axis=2) if w else np.full((partners, m), np.inf)
    np.testing.assert_array_equal(_least_swaps(kept, joins_b, joins_a, left_b), want)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.integers(0, 10**6), st.integers(0, 80), st.integers(1, 5), st.integers(1, 5))
def test_a_layout_costs_exactly_what_its_microbatches_cost(seed: int, n: int, parts: int, split_at: int) -> None:
    from batchplane.planner.padded import _Layout, bucket_cost

    lengths = skewed_lengths(n, seed=seed, long_share=0.3, long=3000)
    rows = rows_of(QUADRATIC, lengths, {}, QUADRATIC(lengths), max_length=1000 * split_at)
    index = np.arange(n, dtype=np.int64)
    layout = _Layout.of(index, parts, rows, ascending=True)
    assert layout.total == bucket_cost(index, parts, rows)
    groups = group(index, parts, rows)
    assert [len(g) for g in groups] == [int(layout.cuts[g + 1] - layout.cuts[g]) for g in layout.ranked]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.integers(0, 10**6), st.integers(0, 160), st.integers(2, 12), st.integers(1, 4))
def test_rebalance_keeps_every_sample_once_and_the_minimum(seed: int, n: int, dp: int, microbatches: int) -> None:
    from batchplane.planner.padded import bucket_cost, rebalance

    lengths = lognormal_lengths(n, seed=seed)
    rows = rows_of(QUADRATIC, lengths, {}, QUADRATIC(lengths))
    start = [np.arange(n)[b::dp] for b in range(dp)]
    got = rebalance(start, microbatches, rows, minimum=microbatches)
    assert sorted(np.concatenate(got).tolist()) == list(range(n))
    for before, after in zip(start, got):
        assert np.array_equal(after, np.sort(after))
        assert len(after) >= min(len(before), microbatches)
    cost = lambda buckets: max(bucket_cost(b, microbatches, rows) for b in buckets)  # noqa: E731
    assert cost(got) <= cost(start)
    again = rebalance(start, microbatches, rows, minimum=microbatches)
    assert [b.tolist() for b in got] == [b.tolist() for b in again]  # I4
