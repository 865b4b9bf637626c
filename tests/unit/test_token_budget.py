"""Tests of batchplane.planner.token_budget: the invariants of `token_budget` as properties
(identity, alignment, non-empty microbatches, the budget, determinism), example tables, rank
balance against a naive baseline, error cases, and `loss_weights`."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.planner.balance import spread
from batchplane.planner.token_budget import loss_weights, token_budget

_settings = settings(max_examples=150, deadline=None)

# Lengths with a long tail: mostly short, some far above small budgets.
_length = st.one_of(st.integers(1, 64), st.integers(1, 600), st.sampled_from([1, 8, 100, 2048, 5000]))
lengths_st = st.lists(_length, max_size=120).map(lambda xs: np.array(xs, dtype=np.int64))
ranks_st = st.integers(1, 8)
min_mb_st = st.integers(1, 4)
# (kind, budget): "padded" / "packed" token budgets, or a cost budget.
budget_st = st.one_of(
    st.tuples(st.sampled_from(["padded", "packed"]), st.integers(1, 4096)),
    st.tuples(st.just("cost"), st.floats(min_value=1e-3, max_value=1e6)),
)
cost_model_st = st.sampled_from(["square", "random", "zeros"])


def _costs(lengths: np.ndarray, model: str, seed: int = 0) -> np.ndarray:
    if model == "square":
        return lengths.astype(np.float64) ** 2
    if model == "zeros":
        return np.zeros(len(lengths))
    rng = np.random.default_rng(seed)
    c = rng.exponential(1000.0, len(lengths))
    c[rng.random(len(lengths)) < 0.1] = 0.0
    return c


def _call(lengths: np.ndarray, costs: np.ndarray, budget: tuple[str, float], ranks: int, min_mb: int):
    kind, value = budget
    if kind == "cost":
        return token_budget(lengths, costs, ranks=ranks, max_cost=value, min_microbatches=min_mb)
    return token_budget(lengths, costs, ranks=ranks, max_tokens=value, padded=kind == "padded", min_microbatches=min_mb)


def _fits(b: np.ndarray, lengths: np.ndarray, costs: np.ndarray, budget: tuple[str, float]) -> bool:
    kind, value = budget
    if kind == "padded":
        return len(b) * int(lengths[b].max()) <= value
    if kind == "packed":
        return int(lengths[b].sum()) <= value
    return math.fsum(costs[b].tolist()) <= value


# --- properties ------------------------------------------------------------------------------


@_settings
@given(lengths=lengths_st, ranks=ranks_st, min_mb=min_mb_st, budget=budget_st, model=cost_model_st)
def test_identity_alignment_and_shape(lengths, ranks, min_mb, budget, model) -> None:
    costs = _costs(lengths, model)
    plan = _call(lengths, costs, budget, ranks, min_mb)
    assert isinstance(plan, list) and len(plan) == ranks
    m = len(plan[0])
    assert all(len(rank) == m for rank in plan)  # I2
    assert min_mb <= m <= max(min_mb, -(-len(lengths) // ranks))
    for rank in plan:
        for b in rank:
            assert isinstance(b, np.ndarray) and b.dtype == np.int64 and b.ndim == 1
            assert np.all(np.diff(b) > 0)
    flat = np.concatenate([b for rank in plan for b in rank])
    assert np.array_equal(np.sort(flat), np.arange(len(lengths)))  # I1


@_settings
@given(lengths=lengths_st, ranks=ranks_st, min_mb=min_mb_st, budget=budget_st, model=cost_model_st)
def test_empty_microbatches_only_when_unavoidable_and_last(lengths, ranks, min_mb, budget, model) -> None:
    n = len(lengths)
    plan = _call(lengths, _costs(lengths, model), budget, ranks, min_mb)
    m = len(plan[0])
    empties = sum(len(b) == 0 for rank in plan for b in rank)
    assert empties == max(0, ranks * m - n)
    if n >= ranks * min_mb and n % ranks == 0:
        assert empties == 0
    if empties:  # a budget kept every sample apart: all non-empty microbatches are singletons
        assert all(len(b) <= 1 for rank in plan for b in rank)
    for rank in plan:
        sizes = [len(b) for b in rank]
        first_empty = sizes.index(0) if 0 in sizes else len(sizes)
        assert all(s == 0 for s in sizes[first_empty:])
    # The first `ranks` groups go to distinct ranks: no rank is idle while the step has data.
    assert sum(len(rank[0]) > 0 for rank in plan) == min(ranks, n)


@_settings
@given(lengths=lengths_st, ranks=ranks_st, min_mb=min_mb_st, budget=budget_st, model=cost_model_st)
def test_budget_never_exceeded_except_by_a_single_sample(lengths, ranks, min_mb, budget, model) -> None:
    costs = _costs(lengths, model)
    for rank in _call(lengths, costs, budget, ranks, min_mb):
        for b in rank:
            if len(b) >= 2:
                assert _fits(b, lengths, costs, budget)


@_settings
@given(lengths=lengths_st, ranks=ranks_st, min_mb=min_mb_st, budget=budget_st, model=cost_model_st)
def test_deterministic_and_input_not_modified(lengths, ranks, min_mb, budget, model) -> None:
    costs = _costs(lengths, model)
    before = (lengths.copy(), costs.copy())
    first = _call(lengths, costs, budget, ranks, min_mb)
    assert np.array_equal(lengths, before[0]) and np.array_equal(costs, before[1])
    again = _call(lengths.astype(np.int32), costs.copy(), budget, ranks, min_mb)
    as_lists = _call(lengths.tolist(), costs.tolist(), budget, ranks, min_mb)
    for other in (again, as_lists):
        assert [[b.tolist() for b in rank] for rank in first] == [[b.tolist() for b in rank] for rank in other]


@_settings
@given(
    lengths=lengths_st,
    ranks=ranks_st,
    min_mb=min_mb_st,
    budget=st.integers(1, 4096),
    max_length=st.integers(1, 700),
    policy=st.sampled_from(["split", "truncate", "reject"]),
)
def test_split_samples_count_as_their_chunk_rows_under_a_padded_budget(lengths, ranks, min_mb, budget, max_length, policy) -> None:
    """Under "split" a microbatch of two or more samples fits rows * widest row <= max_tokens,
    rows counting each split sample's ceil(l / max_length) chunks; other policies (whose
    samples the loader already limited) and samples within the limit plan as without one."""
    costs = lengths.astype(np.float64) ** 2
    plan = token_budget(
        lengths, costs, ranks=ranks, max_tokens=budget, min_microbatches=min_mb, max_length=max_length, length_policy=policy
    )
    flat = np.concatenate([b for rank in plan for b in rank])
    assert np.array_equal(np.sort(flat), np.arange(len(lengths)))  # I1
    assert len({len(rank) for rank in plan}) == 1  # I2
    split = policy == "split"
    rows = np.array([-(-int(n) // max_length) if split else 1 for n in lengths], np.int64)
    widths = np.minimum(lengths, max_length) if split else lengths
    for rank in plan:
        for b in rank:
            if len(b) >= 2:
                assert int(rows[b].sum()) * int(widths[b].max()) <= budget
    if not split or (lengths <= max_length).all():
        plain = token_budget(lengths, costs, ranks=ranks, max_tokens=budget, min_microbatches=min_mb)
        assert [[b.tolist() for b in rank] for rank in plan] == [[b.tolist() for b in rank] for rank in plain]


def test_a_split_sample_fills_a_padded_budget_with_its_chunks() -> None:
    # 10 tokens at max_length 4: 3 rows of width 4 = 12 padded tokens; with a budget of 16 one
    # more row of width <= 4 fits beside it, not two.
    lengths = np.array([10, 4, 3])
    plan = token_budget(lengths, np.ones(3), ranks=1, max_tokens=16, max_length=4)
    assert sorted(b.tolist() for b in plan[0]) == [[0, 1], [2]]
    unsplit = token_budget(lengths, np.ones(3), ranks=1, max_tokens=16)
    assert sorted(b.tolist() for b in unsplit[0]) == [[0], [1, 2]]


@_settings
@given(lengths=lengths_st, ranks=ranks_st, budget=st.integers(1, 4096))
def test_microbatch_count_is_the_fewest_the_padded_grouping_allows(lengths, ranks, budget) -> None:
    """M = ceil(G / ranks) for the next-fit grouping's G (ODB's B(l) rule on the group's
    longest sample), recomputed here independently."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups, cap, size = 0, 0, 0
    for i in order:
        if size and size < cap:
            size += 1
        else:
            groups, cap, size = groups + 1, max(budget // int(lengths[i]), 1), 1
    plan = token_budget(lengths, np.ones(len(lengths)), ranks=ranks, max_tokens=budget)
    assert len(plan[0]) == max(1, -(-groups // ranks))


@_settings
@given(tokens=st.lists(st.lists(st.one_of(st.integers(0, 10), st.integers(0, 10**9)), max_size=12), min_size=1, max_size=8))
def test_loss_weights_are_exact_ratios_summing_to_one(tokens) -> None:
    weights = loss_weights(tokens)
    assert [len(w) for w in weights] == [len(t) for t in tokens]
    total = sum(sum(t) for t in tokens)
    flat_w = [w for row in weights for w in row]
    flat_t = [t for row in tokens for t in row]
    if total == 0:
        assert all(w == 0.0 for w in flat_w)
        return
    assert all(w == float(Fraction(t, total)) for w, t in zip(flat_w, flat_t))
    assert math.isclose(math.fsum(flat_w), 1.0, rel_tol=1e-12)


# --- examples --------------------------------------------------------------------------------

# (lengths, costs, kwargs, expected per rank per microbatch)
EXAMPLES = [
    # ODB Appendix D's lengths; groups [800] [500, 200] [100] (B(800)=1, B(500)=2, B(100)=10).
    ([100, 200, 500, 800], "square", dict(ranks=1, max_tokens=1000), [[[3], [1, 2], [0]]]),
    # Two ranks: the 2-sample group is split to reach 4 groups; 800 and 100 share rank 0.
    ([100, 200, 500, 800], "square", dict(ranks=2, max_tokens=1000), [[[3], [0]], [[2], [1]]]),
    # Three groups on three ranks: nothing to split.
    ([100, 200, 500, 800], "square", dict(ranks=3, max_tokens=1000), [[[3]], [[1, 2]], [[0]]]),
    # Packed: 800 alone (800 + 500 > 1000), then 500 + 200 + 100 = 800.
    ([100, 200, 500, 800], "square", dict(ranks=1, max_tokens=1000, padded=False), [[[3], [0, 1, 2]]]),
    # Cost budget 8e5: 800**2 + 500**2 > 8e5; 500**2 + 200**2 + 100**2 = 3e5.
    ([100, 200, 500, 800], "square", dict(ranks=1, max_cost=8.0e5), [[[3], [0, 1, 2]]]),
    # Budgets are inclusive: a padded area, a token sum or a cost sum equal to the budget fits.
    ([50, 50, 1], "square", dict(ranks=1, max_tokens=100), [[[0, 1], [2]]]),
    ([50, 50, 1], "square", dict(ranks=1, max_tokens=100, padded=False), [[[0, 1], [2]]]),
    ([50, 50, 1], "square", dict(ranks=1, max_cost=5000.0), [[[0, 1], [2]]]),
    # min_microbatches: one group of 8 split into halves, then the largest half again.
    ([10] * 8, "square", dict(ranks=1, max_tokens=100, min_microbatches=3), [[[4, 5, 6, 7], [0, 1], [2, 3]]]),
    # Every sample above the budget: 5 singletons need M = 2 on 4 ranks, 3 slots stay empty.
    ([5000] * 5, "ones", dict(ranks=4, max_tokens=1000), [[[0], [4]], [[1], []], [[2], []], [[3], []]]),
    # Fewer samples than ranks * min_microbatches.
    ([7, 7, 7], "ones", dict(ranks=2, max_tokens=100, min_microbatches=2), [[[0], [2]], [[1], []]]),
    # No samples at all.
    ([], "ones", dict(ranks=2, max_tokens=100), [[[]], [[]]]),
    # A single sample over the budget stays alone; the rest fill B(40) = 2 and B(30) = 3.
    ([40, 3000, 30, 40, 30, 30], "square", dict(ranks=1, max_tokens=100), [[[1], [0, 3], [2, 4, 5]]]),
]


@pytest.mark.parametrize(("lengths", "costs", "kwargs", "expected"), EXAMPLES)
def test_examples(lengths, costs, kwargs, expected) -> None:
    lens = np.array(lengths, dtype=np.int64)
    c = lens.astype(np.float64) ** 2 if costs == "square" else np.ones(len(lens))
    plan = token_budget(lens, c, **kwargs)
    assert [[b.tolist() for b in rank] for rank in plan] == expected


def test_rank_balance_beats_a_naive_baseline_on_many_small_samples() -> None:
    rng = np.random.default_rng(7)
    lengths = rng.integers(32, 513, 2000)
    costs = lengths.astype(np.float64) ** 2
    ranks = 8
    plan = token_budget(lengths, costs, ranks=ranks, max_tokens=4096)
    ours = np.array([math.fsum(costs[b].sum() for b in rank) for rank in plan])
    # Naive: the same microbatches dealt round-robin in length order.
    groups = sorted((b for rank in plan for b in rank), key=lambda b: (-int(lengths[b].max()), int(b[0])))
    naive = np.zeros(ranks)
    for j, b in enumerate(groups):
        naive[j % ranks] += costs[b].sum()
    ours_max_mean, naive_max_mean = spread(ours)[1], spread(naive)[1]
    assert ours_max_mean < 1.01
    assert ours_max_mean < naive_max_mean


def test_microbatch_order_within_a_rank_is_by_descending_cost() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 2000, 300)
    costs = lengths.astype(np.float64) ** 2
    for rank in token_budget(lengths, costs, ranks=4, max_tokens=4096):
        totals = [math.fsum(costs[b].tolist()) for b in rank]
        assert totals == sorted(totals, reverse=True)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("budgets", [{}, {"max_tokens": 10, "max_cost": 1.0}])
def test_exactly_one_budget(budgets) -> None:
    with pytest.raises(ValueError, match="max_tokens.*max_cost"):
        token_budget(np.array([1, 2]), np.ones(2), ranks=1, **budgets)


@pytest.mark.parametrize(
    ("lengths", "costs", "kwargs", "match"),
    [
        ([1, 0], [1.0, 1.0], dict(ranks=1, max_tokens=4), "lengths must be > 0"),
        ([1.5, 2.0], [1.0, 1.0], dict(ranks=1, max_tokens=4), "lengths must be integers"),
        ([[1, 2]], [1.0, 1.0], dict(ranks=1, max_tokens=4), "lengths must be one-dimensional"),
        ([1, 2], [1.0], dict(ranks=1, max_tokens=4), "costs must be one-dimensional of length 2"),
        ([1, 2], [1.0, -1.0], dict(ranks=1, max_tokens=4), "costs must be finite and >= 0"),
        ([1, 2], [1.0, math.nan], dict(ranks=1, max_tokens=4), "costs must be finite and >= 0"),
        ([1, 2], [1.0, 1.0], dict(ranks=0, max_tokens=4), "ranks must be >= 1"),
        ([1, 2], [1.0, 1.0], dict(ranks=1, max_tokens=0), "max_tokens must be >= 1"),
        ([1, 2], [1.0, 1.0], dict(ranks=1, max_cost=0.0), "max_cost must be finite and > 0"),
        ([1, 2], [1.0, 1.0], dict(ranks=1, max_cost=math.inf), "max_cost must be finite and > 0"),
        ([1, 2], [1.0, 1.0], dict(ranks=1, max_tokens=4, min_microbatches=0), "min_microbatches must be >= 1"),
    ],
)
def test_invalid_arguments(lengths, costs, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        token_budget(np.array(lengths), np.array(costs), **kwargs)


@pytest.mark.parametrize("kwargs", [dict(ranks=1.5, max_tokens=4), dict(ranks=True, max_tokens=4), dict(ranks=1, max_tokens=4.0)])
def test_non_integer_counts(kwargs) -> None:
    with pytest.raises(TypeError):
        token_budget(np.array([1, 2]), np.ones(2), **kwargs)


def test_loss_weights_errors_and_example() -> None:
    assert loss_weights([[3, 4], [0, 3]]) == [[0.3, 0.4], [0.0, 0.3]]
    assert loss_weights([[0], []]) == [[0.0], []]
    assert loss_weights([]) == []
    with pytest.raises(ValueError, match=r"loss_tokens\[1\]\[0\] must be >= 0"):
        loss_weights([[1], [-1]])
    with pytest.raises(TypeError):
        loss_weights([[1.5]])
