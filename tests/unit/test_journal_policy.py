"""Commit-cadence policies of the journal (batchplane.journal.policy): DAC's gap is the smallest
that meets both budgets (checked against a brute-force search), and the baselines follow the
paper's definitions."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import ConfigError
from batchplane.journal.policy import (
    POLICIES,
    AimdPolicy,
    DacPolicy,
    DacSettings,
    FixedPolicy,
    IncrPolicy,
    NaivePolicy,
    conflict_probability,
    duty,
    is_due,
    make_policy,
    smallest_feasible_gap_s,
)


def feasible(g: float, w: float, n: int, eps_c: float, eps_d: float) -> bool:
    return conflict_probability(g, w, n) <= eps_c * (1 + 1e-9) and duty(g, w) <= eps_d * (1 + 1e-9)


@settings(max_examples=80, deadline=None)
@given(
    w=st.floats(1e-4, 5.0),
    n=st.integers(1, 128),
    eps_c=st.floats(0.005, 0.5),
    eps_d=st.floats(0.01, 1.0),
)
def test_dac_gap_meets_both_budgets_and_is_the_smallest_that_does(w: float, n: int, eps_c: float, eps_d: float) -> None:
    g = smallest_feasible_gap_s(w, n, conflict_budget=eps_c, duty_budget=eps_d)
    assert g >= 0 and feasible(g, w, n, eps_c, eps_d)
    # Brute force: the first feasible point of a grid over [0, 2 g + w], in steps of 1/2000 of it.
    top = 2 * g + w
    grid = [top * i / 2000 for i in range(2001)]
    first = next(x for x in grid if feasible(x, w, n, eps_c, eps_d))
    assert g <= first + 1e-12
    assert g > first - top / 2000 - 1e-12  # nothing feasible a grid step below
    if g > 0:
        assert not feasible(g * (1 - 1e-6) - 1e-12, w, n, eps_c * (1 - 1e-6), eps_d * (1 - 1e-6))


@settings(max_examples=40, deadline=None)
@given(
    windows=st.lists(st.floats(1e-4, 2.0), min_size=1, max_size=12),
    n=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
)
def test_dac_policy_uses_the_moving_average_and_its_jitter_only_lengthens_the_gap(windows, n, seed) -> None:
    s = DacSettings(conflict_budget=0.05, duty_budget=0.2, ema_alpha=0.3, window_deviations=1.5, jitter=0.25, max_gap_s=1e9)
    policy = DacPolicy(s, random=random.Random(seed).random)
    assert policy.gap_s() == 0.0 and policy.min_steps() == 1  # the first attempt goes at once
    seen: list[float] = []
    for w in windows:
        policy.on_attempt(success=True, fragile_window_s=w, producers=n)
        seen.append(w)
        # the exponentially weighted mean and variance, from their definitions
        weights = [0.3 * 0.7 ** (len(seen) - 1 - i) for i in range(len(seen))]
        weights[0] = 0.7 ** (len(seen) - 1)  # the first window starts the average
        ema = sum(wt * x for wt, x in zip(weights, seen))
        var = sum(wt * (x - ema) ** 2 for wt, x in zip(weights, seen))
        assert policy.fragile_window_s == pytest.approx(ema)
        estimate = policy.window_estimate_s
        assert estimate == pytest.approx(ema + 1.5 * math.sqrt(var), rel=1e-6, abs=1e-9)
        optimal = smallest_feasible_gap_s(estimate, n, conflict_budget=0.05, duty_budget=0.2)
        assert policy.optimal_gap_s == pytest.approx(optimal)
        assert optimal <= policy.gap_s() <= optimal * 1.25 + 1e-12
        assert feasible(policy.gap_s(), estimate, n, 0.05, 0.2) and feasible(policy.gap_s(), ema, n, 0.05, 0.2)


def test_dac_with_no_deviations_is_the_papers_moving_average() -> None:
    policy = DacPolicy(DacSettings(window_deviations=0.0, ema_alpha=0.5, jitter=0.0), random=lambda: 0.0)
    for w in (0.01, 0.05, 0.02):
        policy.on_attempt(success=True, fragile_window_s=w, producers=16)
    assert policy.window_estimate_s == policy.fragile_window_s == pytest.approx(0.5 * 0.02 + 0.25 * 0.05 + 0.25 * 0.01)


def test_the_margin_keeps_the_average_conflict_rate_within_the_budget_when_windows_are_noisy() -> None:
    """Many producers, each with a few heavy-tailed windows (20 ms x lognormal, sigma 1): under
    the paper's average alone the conflict probability at each producer's gap, against the
    windows' true mean, averages above the budget; with one deviation of margin it stays within."""
    rng = random.Random(7)
    true_mean = 0.02 * math.exp(0.5)  # of 0.02 x lognormal(0, 1)

    def average_conflict(deviations: float) -> float:
        total = 0.0
        for producer in range(2000):
            policy = DacPolicy(DacSettings(window_deviations=deviations, jitter=0.0), random=lambda: 0.0)
            for _ in range(6):
                policy.on_attempt(success=True, fragile_window_s=0.02 * rng.lognormvariate(0.0, 1.0), producers=32)
            total += conflict_probability(policy.gap_s(), true_mean, 32)
        return total / 2000

    assert average_conflict(0.0) > 0.05 * 1.2  # 6.4 %
    assert average_conflict(1.0) <= 0.05  # 3.8 %


@settings(max_examples=60, deadline=None)
@given(
    outcomes=st.lists(st.tuples(st.booleans(), st.floats(1e-4, 2.0), st.integers(1, 128)), min_size=1, max_size=12),
    eps_c=st.floats(0.005, 0.5),
    eps_d=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_dac_gap_meets_both_budgets_after_any_outcomes_and_a_conflict_spreads_the_retry_over_a_cycle(
    outcomes: list[tuple[bool, float, int]], eps_c: float, eps_d: float, seed: int
) -> None:
    s = DacSettings(conflict_budget=eps_c, duty_budget=eps_d, jitter=0.2, conflict_jitter=1.0, max_gap_s=1e9)
    policy = DacPolicy(s, random=random.Random(seed).random)
    for success, w, n in outcomes:
        policy.on_attempt(success=success, fragile_window_s=w, producers=n)
        ema = policy.window_estimate_s
        assert ema is not None
        optimal = smallest_feasible_gap_s(ema, n, conflict_budget=eps_c, duty_budget=eps_d)
        assert feasible(policy.gap_s(), ema, n, eps_c, eps_d)  # both budgets, whatever the jitter
        assert optimal <= policy.gap_s() <= optimal * (1.2 if success else 2.0) + 1e-12


def test_dac_retries_a_conflict_anywhere_in_a_whole_cycle() -> None:
    gaps = []
    for seed in range(200):
        policy = DacPolicy(DacSettings(jitter=0.2, conflict_jitter=1.0), random=random.Random(seed).random)
        policy.on_attempt(success=False, fragile_window_s=0.01, producers=32)
        gaps.append(policy.gap_s() / policy.optimal_gap_s - 1)
    assert min(gaps) < 0.1 and max(gaps) > 0.9  # spread over [g*, 2 g*], not within 20 % of g*
    policy = DacPolicy(DacSettings(jitter=0.2, conflict_jitter=1.0), random=lambda: 0.99)
    policy.on_attempt(success=True, fragile_window_s=0.01, producers=32)
    assert policy.gap_s() == pytest.approx(policy.optimal_gap_s * 1.198)


def test_dac_defers_a_caught_up_attempt_by_the_gap_for_the_producers_that_were_preparing_with_it() -> None:
    """64 producers, W 0.1 s: g* is about two minutes. A producer that caught up after a 2 s
    preparation races only the others that were preparing then, about 63 * 2 / (g* + 2.1) of
    them, so its deferral is Eq. 9 for those, seconds; when preparing takes most of a cycle,
    every other producer was, and the deferral is g* itself."""
    s = DacSettings(window_deviations=0.0, jitter=0.0, conflict_jitter=1.0)
    policy = DacPolicy(s, random=lambda: 0.5)
    assert not policy.on_caught_up(producers=64, prepare_s=2.0)  # nothing measured yet: no deferral
    policy.on_attempt(success=True, fragile_window_s=0.1, producers=64)
    g = policy.optimal_gap_s
    assert g == pytest.approx(smallest_feasible_gap_s(0.1, 64, conflict_budget=0.05, duty_budget=0.25))
    assert policy.on_caught_up(producers=64, prepare_s=2.0)
    others = max(1.0, 63 * 2.0 / (g + 2.0 + 0.1))
    want = smallest_feasible_gap_s(0.1, 1 + others, conflict_budget=0.05, duty_budget=0.25)
    assert policy.gap_s() == pytest.approx(want * 1.5)  # spread as after a conflict
    assert policy.gap_s() < g / 20
    assert policy.optimal_gap_s == g  # the cycle's gap is unchanged
    assert policy.on_caught_up(producers=64, prepare_s=1e6)
    assert policy.gap_s() == pytest.approx(g * 1.5, rel=1e-3)


def test_dac_gap_grows_with_producers_and_with_the_fragile_window() -> None:
    gaps = [smallest_feasible_gap_s(0.1, n, conflict_budget=0.05, duty_budget=0.5) for n in (1, 8, 32, 64)]
    assert gaps[0] == pytest.approx(0.1)  # alone: only the duty budget binds
    assert gaps == sorted(gaps) and gaps[-1] > gaps[1] > gaps[0]
    assert smallest_feasible_gap_s(0.2, 32, conflict_budget=0.05, duty_budget=0.5) == pytest.approx(2 * gaps[2])
    # The conflict model: at the chosen gap with 32 producers, the probability is the budget.
    assert conflict_probability(gaps[2], 0.1, 32) == pytest.approx(0.05)


def test_dac_caps_the_gap() -> None:
    policy = DacPolicy(DacSettings(max_gap_s=1.0), random=lambda: 0.99)
    policy.on_attempt(success=False, fragile_window_s=10.0, producers=100)
    assert policy.gap_s() == 1.0


def test_baselines_follow_the_paper() -> None:
    naive = NaivePolicy()
    assert is_due(naive, pending_steps=1, since_attempt_s=0.0)
    assert not is_due(naive, pending_steps=0, since_attempt_s=math.inf)

    fixed = FixedPolicy(10)
    assert not is_due(fixed, pending_steps=9, since_attempt_s=math.inf)
    fixed.on_attempt(success=False, fragile_window_s=1.0, producers=8)
    assert is_due(fixed, pending_steps=10, since_attempt_s=0.0)  # a conflict retries at once

    incr = IncrPolicy()
    assert incr.min_steps() == 10
    for _ in range(3):
        incr.on_attempt(success=False, fragile_window_s=1.0, producers=8)
    incr.on_attempt(success=True, fragile_window_s=1.0, producers=8)
    assert incr.min_steps() == 13

    aimd = AimdPolicy(start=10)
    aimd.on_attempt(success=False, fragile_window_s=1.0, producers=8)
    assert aimd.min_steps() == 20
    aimd.on_attempt(success=True, fragile_window_s=1.0, producers=8)
    assert aimd.min_steps() == 19
    for _ in range(50):
        aimd.on_attempt(success=True, fragile_window_s=1.0, producers=8)
    assert aimd.min_steps() == 1


def test_the_registry_names_every_policy_of_the_benchmark() -> None:
    assert set(POLICIES) == {"naive", "fixed10", "fixed100", "incr", "aimd", "dac"}
    for name in POLICIES:
        policy = make_policy(name, random=random.Random(0).random)
        assert policy.name == name
    with pytest.raises(ConfigError, match="commit_policy"):
        make_policy("fixed7")
    with pytest.raises(ConfigError, match="random"):
        make_policy("dac")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("conflict_budget", 0.0),
        ("conflict_budget", 1.0),
        ("duty_budget", 0.0),
        ("duty_budget", 1.5),
        ("ema_alpha", 0.0),
        ("window_deviations", -1.0),
        ("window_deviations", math.inf),
        ("jitter", -0.1),
        ("conflict_jitter", math.nan),
        ("max_gap_s", 0.0),
        ("max_gap_s", math.inf),
    ],
)
def test_dac_settings_out_of_range_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        DacPolicy(DacSettings(**{field: value}), random=lambda: 0.0)
    assert info.value.field == f"dac.{field}"
