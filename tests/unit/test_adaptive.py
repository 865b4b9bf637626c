"""Adaptive (metric-driven) mixing: the projection, the update's guarantees (bounds, sum 1, largest
change, determinism, exact JSON resume), its direction, report and rule validation, the
configuration shape, and the schedule the Mixture reads. Pure: no processes, no files."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchplane.planner.adaptive import (
    FIELD,
    AdaptiveRule,
    AdaptiveSchedule,
    AdaptiveState,
    project,
    rule_from_mapping,
    state_from_json,
    state_to_json,
    update,
)
from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.core.schedule import ScheduleError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ("web", "code", "math")
NAN, INF = float("nan"), float("inf")


# ---- project ---------------------------------------------------------------------------------


def reference_projection(t: list[float], lo: list[float], hi: list[float]) -> list[float]:
    """x = clip(t - tau, lo, hi) with sum 1, tau by plain bisection."""
    a, b = min(x - h for x, h in zip(t, hi)) - 1, max(x - l for x, l in zip(t, lo)) + 1
    for _ in range(200):
        mid = (a + b) / 2
        a, b = (mid, b) if sum(min(h, max(l, x - mid)) for x, l, h in zip(t, lo, hi)) > 1 else (a, mid)
    return [min(h, max(l, x - a)) for x, l, h in zip(t, lo, hi)]


@st.composite
def boxes(draw: st.DrawFn) -> tuple[list[float], list[float], list[float]]:
    k = draw(st.integers(1, 6))
    t = draw(st.lists(st.floats(-2, 2), min_size=k, max_size=k))
    lo = draw(st.lists(st.floats(0, 0.4), min_size=k, max_size=k))
    hi = [lo_k + w for lo_k, w in zip(lo, draw(st.lists(st.floats(0, 1), min_size=k, max_size=k)))]
    assume(math.fsum(lo) <= 1 <= math.fsum(hi))
    return t, lo, hi


@SETTINGS
@given(boxes())
def test_project_is_the_nearest_point_within_the_bounds_summing_to_1(box: tuple[list[float], ...]) -> None:
    t, lo, hi = box
    x = project(t, lo, hi)
    assert all(l <= v <= h for v, l, h in zip(x, lo, hi))
    assert math.fsum(x) == pytest.approx(1, abs=1e-9)
    assert x == pytest.approx(reference_projection(t, lo, hi), abs=1e-9)
    # KKT: one tau with x_k = clip(t_k - tau, lo_k, hi_k), read off the coordinates strictly inside.
    free = [v - x_k for v, x_k, l, h in zip(t, x, lo, hi) if l + 1e-9 < x_k < h - 1e-9]
    assert max(free, default=0) - min(free, default=0) <= 1e-9


def test_project_of_a_point_already_inside_is_that_point() -> None:
    assert project([0.2, 0.3, 0.5], [0, 0, 0], [1, 1, 1]) == pytest.approx((0.2, 0.3, 0.5), abs=1e-15)
    assert project([1.0, 1.0], [0, 0], [0.7, 1]) == pytest.approx((0.5, 0.5))
    assert project([5.0, 0.0], [0, 0.1], [0.7, 1]) == pytest.approx((0.7, 0.3))


@pytest.mark.parametrize(
    ("lower", "upper"),
    [([0.6, 0.5], [1, 1]), ([0, 0], [0.4, 0.5]), ([0.5, 0], [0.4, 1]), ([0, NAN], [1, 1]), ([0], [1, 1])],
)
def test_project_refuses_an_empty_or_malformed_set(lower: list[float], upper: list[float]) -> None:
    with pytest.raises(ValueError):
        project([0.5, 0.5], lower, upper)


# ---- update: guarantees ----------------------------------------------------------------------


@st.composite
def rules(draw: st.DrawFn) -> AdaptiveRule:
    k = draw(st.integers(1, 4))
    names = tuple(f"s{i}" for i in range(k))
    initial = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10)), min_size=k, max_size=k))
    assume(sum(initial) > 0)
    shares = [w / math.fsum(initial) for w in initial]
    minimum = [s * draw(st.floats(0, 0.999)) for s in shares]
    maximum = [s + (1 - s) * draw(st.floats(0.001, 1)) for s in shares]
    return AdaptiveRule(
        names,
        tuple(initial),
        tuple(minimum),
        tuple(maximum),
        max_change=draw(st.floats(0.001, 1)),
        learning_rate=draw(st.floats(0.01, 100)),
        smoothing=draw(st.floats(0, 0.99)),
        delay_steps=draw(st.integers(1, 20)),
    )


def reports_for(names: tuple[str, ...]) -> st.SearchStrategy[list[dict[str, float]]]:
    report = st.dictionaries(st.sampled_from(names), st.one_of(st.just(0.0), st.floats(0, 20)))
    return st.lists(report, min_size=1, max_size=30)


def run(rule: AdaptiveRule, reports: list[dict[str, float]], state: AdaptiveState | None = None) -> list[AdaptiveState]:
    states = [AdaptiveState.initial(rule) if state is None else state]
    for report in reports:
        states.append(update(rule, states[-1], report))
    return states


@SETTINGS
@given(st.data())
def test_weights_stay_in_bounds_sum_to_1_and_move_at_most_max_change(data: st.DataObject) -> None:
    rule = data.draw(rules())
    states = run(rule, data.draw(reports_for(rule.source_names)))
    for before, after in zip(states, states[1:]):
        assert math.fsum(after.weights) == pytest.approx(1, abs=1e-9)
        assert all(lo <= w <= hi for w, lo, hi in zip(after.weights, rule.minimum, rule.maximum))
        assert max(abs(a - b) for a, b in zip(after.weights, before.weights)) <= rule.max_change + 1e-12
        assert after.reports == before.reports + 1


@SETTINGS
@given(st.data())
def test_the_same_reports_give_bit_identical_weights_also_across_a_json_resume(data: st.DataObject) -> None:
    rule = data.draw(rules())
    reports = data.draw(reports_for(rule.source_names))
    first, second = run(rule, reports), run(rule, reports)
    assert [repr(s) for s in first] == [repr(s) for s in second]
    cut = data.draw(st.integers(0, len(reports)))
    saved = json.loads(json.dumps(state_to_json(first[cut])))
    restored = state_from_json(saved)
    assert restored == first[cut]
    assert repr(run(rule, reports[cut:], restored)[-1]) == repr(first[-1])


# ---- update: direction and reports -----------------------------------------------------------


@pytest.mark.parametrize("constant", ["a", "b"])
def test_the_source_whose_loss_falls_slower_gains_weight_until_its_maximum(constant: str) -> None:
    other = "b" if constant == "a" else "a"
    rule = AdaptiveRule(("a", "b"), (1, 1), minimum=(0.1, 0.1), maximum=(0.8, 0.8), max_change=0.02)
    states = run(rule, [{constant: 2.0, other: 2.0 * 0.95**step} for step in range(60)])
    shares = [s.weights[rule.source_names.index(constant)] for s in states]
    assert shares[0] == shares[1] == 0.5  # the first report only starts the averages
    assert shares[2] == pytest.approx(0.52)
    assert all(b >= a for a, b in zip(shares, shares[1:]))
    assert shares[-1] == 0.8 and min(s.weights[rule.source_names.index(other)] for s in states) == pytest.approx(0.2)


def test_the_fastest_falling_source_loses_exactly_max_change_and_the_others_share_it() -> None:
    rule = AdaptiveRule(NAMES, (1, 1, 1), max_change=0.02)
    state = run(rule, [{"web": 1.0, "code": 1.0, "math": 0.5**i} for i in range(2)])[-1]
    assert state.weights == pytest.approx((1 / 3 + 0.01, 1 / 3 + 0.01, 1 / 3 - 0.02), abs=1e-12)


def test_equal_progress_leaves_the_weights_and_a_faster_rate_moves_them_further() -> None:
    reports = [{"a": 2.0 * 0.9**i, "b": 1.0 * 0.9**i} for i in range(5)]
    rule = AdaptiveRule(("a", "b"), (1, 3), max_change=1.0)
    assert run(rule, reports)[-1].weights == pytest.approx((0.25, 0.75), abs=1e-12)
    falling = [{"a": 1.0, "b": 0.8**i} for i in range(3)]
    slow, fast = (run(AdaptiveRule(("a", "b"), (1, 1), max_change=1.0, learning_rate=eta), falling)[-1] for eta in (0.1, 0.5))
    assert 0.5 < slow.weights[0] < fast.weights[0]


def test_a_source_missing_from_a_report_keeps_its_average_and_progress() -> None:
    rule = AdaptiveRule(("a", "b"), (1, 1))
    state = run(rule, [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 1.0}])[-1]
    after = update(rule, state, {"a": 3.0})
    assert after.ema == (pytest.approx(0.9 * 1.0 + 0.1 * 3.0), state.ema[1])
    assert after.progress[1] == state.progress[1] == pytest.approx(0.05)
    assert after.progress[0] == pytest.approx(-0.2)
    assert update(rule, AdaptiveState.initial(rule), {"b": 0.0}).ema == (None, 0.0)


@pytest.mark.parametrize(
    ("report", "name"),
    [
        ({"webb": 1.0}, "webb"),
        ({"web": -0.1}, "web"),
        ({"code": NAN}, "code"),
        ({"math": INF}, "math"),
        ({"web": "1"}, "web"),
        ({"code": True}, "code"),
    ],
)
def test_a_bad_report_is_refused_naming_the_source(report: dict[str, object], name: str) -> None:
    rule = AdaptiveRule(NAMES, (1, 1, 1))
    with pytest.raises(ScheduleError) as caught:
        update(rule, AdaptiveState.initial(rule), report)  # type: ignore[arg-type]
    assert caught.value.field == "mixture.adaptive report" and repr(name) in str(caught.value)


# ---- the rule and its configuration ----------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_change": 0}, "max_change"),
        ({"max_change": 1.5}, "max_change"),
        ({"max_change": NAN}, "max_change"),
        ({"max_change": "x"}, "max_change"),
        ({"learning_rate": 0}, "learning_rate"),
        ({"learning_rate": INF}, "learning_rate"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"smoothing": -0.1}, "smoothing"),
        ({"delay_steps": 0}, "delay_steps"),
        ({"delay_steps": 1.5}, "delay_steps"),
        ({"delay_steps": True}, "delay_steps"),
        ({"initial": (1, -1, 1)}, "initial.code"),
        ({"initial": (0, 0, 0)}, "initial"),
        ({"initial": (1, 1)}, "initial"),
        ({"minimum": (-0.1, 0, 0)}, "minimum.web"),
        ({"minimum": (0, 0, 1.5)}, "minimum.math"),
        ({"minimum": (0.5, 0, 0), "maximum": (0.4, 1, 1)}, "maximum.web"),
        ({"minimum": (0.3, 0.3, 0.5)}, "minimum"),
        ({"maximum": (0.3, 0.3, 0.3)}, "maximum"),
        ({"minimum": (0.4, 0, 0)}, "initial.web"),
        ({"maximum": (1, 0.2, 1)}, "initial.code"),
    ],
)
def test_a_bad_rule_names_its_field(changes: dict[str, object], field: str) -> None:
    kwargs: dict[str, object] = {"source_names": NAMES, "initial": (1, 1, 1), **changes}
    with pytest.raises(ScheduleError) as caught:
        AdaptiveRule(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == f"{FIELD}.{field}"


def test_a_rule_normalizes_initial_and_fills_default_bounds() -> None:
    rule = AdaptiveRule(NAMES, (2, 1, 1))
    assert (rule.initial, rule.minimum, rule.maximum) == ((0.5, 0.25, 0.25), (0.0,) * 3, (1.0,) * 3)
    assert AdaptiveState.initial(rule) == AdaptiveState((0.5, 0.25, 0.25), (None,) * 3, (None,) * 3, 0)
    with pytest.raises(ScheduleError, match="unique"):
        AdaptiveRule(("web", "web"), (1, 1))


def test_rule_from_mapping_reads_the_keys_and_defaults_the_rest() -> None:
    assert rule_from_mapping(None, NAMES) == rule_from_mapping({}, NAMES) == AdaptiveRule(NAMES, (1, 1, 1))
    rule = rule_from_mapping(
        {
            "initial": {"web": 2},
            "minimum": {"code": 0.1},
            "maximum": {"web": 0.6},
            "max_change": 0.05,
            "learning_rate": 2,
            "smoothing": 0.5,
            "delay_steps": 3,
        },
        NAMES,
    )
    assert rule == AdaptiveRule(
        NAMES, (2, 1, 1), (0, 0.1, 0), (0.6, 1, 1), max_change=0.05, learning_rate=2.0, smoothing=0.5, delay_steps=3
    )
    assert rule.initial == (0.5, 0.25, 0.25)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"rate": 1}, "rate"),
        ({"minimum": {"webb": 0.1}}, "minimum.webb"),
        ({"initial": [1, 1, 1]}, "initial"),
        ({"maximum": {"code": "1"}}, "maximum.code"),
        ({"max_change": "big"}, "max_change"),
        ({"delay_steps": "8"}, "delay_steps"),
        ({"initial": {"math": -1}}, "initial.math"),
    ],
)
def test_rule_from_mapping_names_the_bad_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        rule_from_mapping(data, NAMES)
    assert caught.value.field == f"{FIELD}.{field}"


def test_state_from_json_refuses_another_shape() -> None:
    good = state_to_json(AdaptiveState((0.5, 0.5), (1.0, None), (None, None), 1))
    for bad in ({**good, "reports": -1}, {**good, "ema": [1.0]}, {**good, "weights": [0.5, "x"]}, {"weights": []}):
        with pytest.raises(ScheduleError):
            state_from_json(bad)


# ---- the schedule ----------------------------------------------------------------------------


def test_the_schedule_returns_the_weights_set_for_the_step_and_refuses_unset_steps() -> None:
    schedule = AdaptiveSchedule(AdaptiveRule(NAMES, (1, 1, 1)))
    schedule.set(3, (0.2, 0.3, 0.5))
    schedule.set(4, (0.1, 0.1, 0.8))
    assert schedule.num_sources == 3 and schedule.source_names == NAMES
    assert {schedule.weights_at(t) for t in (3.0, 3.25, 3.999)} == {(0.2, 0.3, 0.5)}
    assert schedule.weights_at(4.0) == (0.1, 0.1, 0.8)
    for t in (2.999, 5.0, NAN):
        with pytest.raises(ScheduleError):
            schedule.weights_at(t)
    schedule.forget_before(4)
    with pytest.raises(ScheduleError, match="step 3"):
        schedule.weights_at(3.5)
    assert schedule.weights_at(4.5) == (0.1, 0.1, 0.8)
    for step, weights in ((-1, (1, 1, 1)), (5, (1, 1)), (5, (0, 0, 0)), (5, (1, NAN, 1))):
        with pytest.raises(ScheduleError):
            schedule.set(step, weights)
    assert schedule.describe().startswith("adaptive, initial web=0.333333 code=0.333333 math=0.333333;")
    assert "max_change 0.02, learning_rate 1, smoothing 0.9, delay_steps 8" in schedule.describe()


def test_a_mixture_follows_the_adapted_weights_with_the_delay() -> None:
    rule = AdaptiveRule(("a", "b"), (1, 1), max_change=0.1, delay_steps=2)
    schedule = AdaptiveSchedule(rule)
    mixture = Mixture(schedule, global_batch_size=100, stream_ends=[None, None])
    state, mix, counts = AdaptiveState.initial(rule), MixtureState.initial(2), []
    for step in range(8):
        if step >= rule.delay_steps:  # the report of step - D is in before step is planned
            state = update(rule, state, {"a": 1.0, "b": 0.5 ** (step - rule.delay_steps)})
        schedule.set(step, state.weights)
        allocation, mix = mixture.allocate(mix)
        counts.append(allocation.counts)
    # Step 2 applies step 0's report (it starts the averages); from step 3 on, `a` gains max_change a step.
    assert counts[:7] == [(50, 50)] * 3 + [(60, 40), (70, 30), (80, 20), (90, 10)] and counts[7][0] > 90
