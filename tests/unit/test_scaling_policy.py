"""The operator's scaling policy (batchplane.operator.policy): bounds, K consecutive intervals,
cooldown, hysteresis under noise, a weight step up and down, scaling ahead of a declared
schedule change, determinism, and the formulas themselves."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import ConfigError
from batchplane.operator.policy import (
    Decision,
    GroupSpec,
    GroupState,
    Observation,
    ScalingSettings,
    decide,
    estimate,
    initial_state,
)

#: One interval of a run: (weight of source a, throughput in samples/s, seconds since the last).
Interval = tuple[float, float, float]


def spec_of(scaling: ScalingSettings | None = None, *, cost_s: float = 0.05, min_replicas: int = 1, max_replicas: int = 8) -> GroupSpec:
    return GroupSpec("a", ("a",), {"a": cost_s}, min_replicas=min_replicas, max_replicas=max_replicas, scaling=scaling or ScalingSettings())


def run(state: GroupState, intervals: list[Interval], *, t0: float = 0.0) -> list[tuple[float, Decision]]:
    """Feeds the intervals one by one; returns (time, decision) per interval."""
    out, now = [], t0
    for weight, throughput, dt in intervals:
        now += dt
        decision = decide(state, Observation({"a": weight, "b": 1 - weight}, throughput), now)
        state = decision.state
        out.append((now, decision))
    return out


def changes(decisions: list[tuple[float, Decision]]) -> list[tuple[float, int, int]]:
    return [(t, d.previous, d.replicas) for t, d in decisions if d.changed]


scalings = st.builds(
    ScalingSettings,
    window_intervals=st.integers(1, 5),
    consecutive_intervals=st.integers(1, 5),
    up_threshold=st.floats(0, 0.5),
    down_threshold=st.floats(0, 0.5),
    cooldown_s=st.floats(0, 120),
    headroom=st.floats(0, 1),
)
intervals = st.lists(st.tuples(st.floats(0, 1), st.floats(0, 2000), st.floats(0.5, 60)), min_size=1, max_size=60)


@st.composite
def specs(draw: st.DrawFn) -> GroupSpec:
    low = draw(st.integers(0, 5))
    return spec_of(draw(scalings), cost_s=draw(st.floats(0, 0.2)), min_replicas=low, max_replicas=draw(st.integers(max(low, 1), 12)))


# ---- the formulas ---------------------------------------------------------------------------


def test_demand_and_need_follow_the_documented_formulas() -> None:
    scaling = ScalingSettings(window_intervals=2, headroom=0.25)
    spec = GroupSpec("g", ("a", "c"), {"a": 0.1, "c": 0.3}, capacity=2.0, max_replicas=20, scaling=scaling)
    history = ((0.2, 0.1), (0.4, 0.3))  # w̄ = (0.3, 0.2)
    est = estimate(spec, history, Observation({"a": 0.4, "c": 0.3}, throughput=100.0))
    assert est.average == pytest.approx((0.3, 0.2))
    assert est.ahead is None
    assert est.demand == pytest.approx(0.3 * 100 * 0.1 + 0.2 * 100 * 0.3)  # 9 worker-seconds/s
    assert est.need == pytest.approx(9 * 1.25 / 2.0)  # 5.625 replicas
    assert est.target == 6


def test_measured_costs_replace_the_profile() -> None:
    spec = spec_of(ScalingSettings(headroom=0.0), cost_s=0.05)
    est = estimate(spec, ((0.5,),), Observation({"a": 0.5}, 100.0, cost_s={"a": 0.1}))
    assert est.demand == pytest.approx(5.0)


def test_only_the_last_m_intervals_are_averaged() -> None:
    spec = spec_of(ScalingSettings(window_intervals=2, headroom=0.0), cost_s=0.1)
    state = initial_state(spec, 1)
    for w in (1.0, 0.0, 0.0):
        decision = decide(state, Observation({"a": w}, 10.0), 0.0)
        state = decision.state
    assert state.history == ((0.0,), (0.0,))
    assert decision.estimate.average == (0.0,)


# ---- bounds, K, cooldown --------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(spec=specs(), start=st.integers(0, 15), run_=intervals)
def test_replicas_never_leave_the_bounds(spec: GroupSpec, start: int, run_: list[Interval]) -> None:
    for _, decision in run(initial_state(spec, start), run_):
        assert spec.min_replicas <= decision.replicas <= spec.max_replicas
        assert decision.state.replicas == decision.replicas


def test_replicas_outside_the_bounds_are_clamped_at_once() -> None:
    spec = spec_of(ScalingSettings(consecutive_intervals=5, cooldown_s=1e9), min_replicas=2, max_replicas=4)
    low = decide(dataclasses.replace(initial_state(spec, 0), last_change_s=0.0), Observation({"a": 0.5}, 0.0), 1.0)
    high = decide(initial_state(spec, 9), Observation({}, float("nan")), 1.0)  # even without data
    assert (low.replicas, high.replicas) == (2, 4)
    assert low.reason.startswith("bounds 0 -> 2") and high.reason.startswith("bounds 9 -> 4")


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 6), high=st.floats(0.6, 1.0), dt=st.floats(0.5, 30))
def test_no_change_before_k_consecutive_intervals(k: int, high: float, dt: float) -> None:
    spec = spec_of(ScalingSettings(window_intervals=1, consecutive_intervals=k, cooldown_s=0), cost_s=0.1, max_replicas=50)
    state = initial_state(spec, 1)  # need = high * 200 * 0.1 * 1.2 >= 14.4 replicas
    decisions = run(state, [(high, 200.0, dt)] * k)
    assert [d.replicas for _, d in decisions[:-1]] == [1] * (k - 1)
    assert decisions[-1][1].replicas == math.ceil(high * 200 * 0.1 * 1.2 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(2, 6), cut=st.integers(1, 5))
def test_an_interval_in_the_band_restarts_the_count(k: int, cut: int) -> None:
    cut = min(cut, k - 1)
    spec = spec_of(ScalingSettings(window_intervals=1, consecutive_intervals=k, cooldown_s=0), cost_s=0.1, max_replicas=50)
    # 1 replica: need 0.6 is in the band, need 14.4 asks to scale up.
    decisions = run(initial_state(spec, 1), [(0.6, 200.0, 1.0)] * cut + [(0.05, 100.0, 1.0)] + [(0.6, 200.0, 1.0)] * (k - 1))
    assert all(d.replicas == 1 for _, d in decisions)
    assert decisions[-1][1].state.up_intervals == k - 1


@settings(max_examples=300, deadline=None)
@given(spec=specs(), run_=intervals)
def test_changes_are_at_least_a_cooldown_apart(spec: GroupSpec, run_: list[Interval]) -> None:
    start = spec.clamp(3)  # within the bounds: only the policy's own changes count
    times = [t for t, _, _ in changes(run(initial_state(spec, start), run_))]
    assert all(b - a >= spec.scaling.cooldown_s for a, b in zip(times, times[1:]))


def test_a_change_waits_out_the_cooldown_and_comes_right_after() -> None:
    spec = spec_of(ScalingSettings(window_intervals=1, consecutive_intervals=1, cooldown_s=10), cost_s=0.1, max_replicas=50)
    state = dataclasses.replace(initial_state(spec, 1), last_change_s=0.0)
    decisions = run(state, [(0.5, 100.0, 3.0)] * 4)  # need 6 at t = 3, 6, 9, 12
    assert [d.replicas for _, d in decisions] == [1, 1, 1, 6]
    assert "cooldown, 1.0 s left" in decisions[2][1].reason


def test_no_data_holds_and_restarts_the_count() -> None:
    spec = spec_of(ScalingSettings(window_intervals=1, consecutive_intervals=2, cooldown_s=0), cost_s=0.1)
    state = initial_state(spec, 1)
    first = decide(state, Observation({"a": 0.5}, 100.0), 1.0)
    gap = decide(first.state, Observation({"other": 1.0}, 100.0), 2.0)
    second = decide(gap.state, Observation({"a": 0.5}, 100.0), 3.0)
    assert (first.state.up_intervals, gap.state.up_intervals, second.state.up_intervals) == (1, 0, 1)
    assert gap.replicas == second.replicas == 1 and gap.estimate is None and "no data" in gap.reason
    assert gap.state.history == first.state.history


# ---- hysteresis -----------------------------------------------------------------------------


def noisy(level: float, amplitude: float, n: int, seed: int) -> list[Interval]:
    """A stationary weight whose throughput wobbles by up to ±amplitude (relative)."""
    rng = random.Random(seed)
    return [(level, 100.0 * (1 + rng.uniform(-amplitude, amplitude)), 5.0) for _ in range(n)]


@settings(max_examples=200, deadline=None)
@given(
    boundary=st.integers(2, 7),
    offset=st.floats(-0.04, 0.04),
    amplitude=st.floats(0.005, 0.02),
    start=st.integers(1, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_noise_around_a_boundary_changes_replicas_at_most_once(
    boundary: int, offset: float, amplitude: float, start: int, seed: int
) -> None:
    # need = w * T * c * 1.2 / 1 with T = 100 (1 ± amplitude): level w puts need at boundary * (1 + offset)
    scaling = ScalingSettings(window_intervals=2, consecutive_intervals=2, up_threshold=0.05, down_threshold=0.15, cooldown_s=0)
    spec = spec_of(scaling, cost_s=0.1, max_replicas=10)
    level = boundary * (1 + offset) / (100 * 0.1 * 1.2)
    assert 0 < level <= 1
    decisions = run(initial_state(spec, start), noisy(level, amplitude, 80, seed))
    assert len(changes(decisions)) <= 1, changes(decisions)


def test_without_hysteresis_the_same_noise_flaps() -> None:
    """The input of the test above does cross a boundary: a policy with no band, K = 1 and no
    cooldown changes replicas again and again on it."""
    loose = ScalingSettings(window_intervals=1, consecutive_intervals=1, up_threshold=0, down_threshold=0, cooldown_s=0)
    level = 3 / (100 * 0.1 * 1.2)
    decisions = run(initial_state(spec_of(loose, cost_s=0.1, max_replicas=10), 3), noisy(level, 0.02, 80, seed=1))
    assert len(changes(decisions)) > 10


# ---- a weight step, up and down -------------------------------------------------------------


@pytest.mark.parametrize("k, m", [(1, 1), (2, 3), (3, 2), (3, 4)])
def test_a_weight_step_raises_replicas_within_k_intervals_and_they_return_when_it_falls(k: int, m: int) -> None:
    scaling = ScalingSettings(window_intervals=m, consecutive_intervals=k, cooldown_s=0)
    a, b = spec_of(scaling, cost_s=0.04), GroupSpec("b", ("b",), {"b": 0.04}, scaling=scaling)
    weights = [0.5] * 10 + [0.8] * 10 + [0.5] * 12  # T = 120: need 2.88 (3 replicas), then 4.61 (5)
    states = {"a": initial_state(a, 3), "b": initial_state(b, 3)}
    replicas: dict[str, list[int]] = {"a": [], "b": []}
    for i, w in enumerate(weights):
        for name in states:
            decision = decide(states[name], Observation({"a": w, "b": 1 - w}, 120.0), float(i))
            states[name] = decision.state
            replicas[name].append(decision.replicas)
    ra, rb = replicas["a"], replicas["b"]
    assert ra[:10] == [3] * 10
    assert ra[10 : 10 + k - 1] == [3] * (k - 1) and ra[10 + k - 1] > 3  # K intervals after the rise, not before
    assert ra[10 + k - 1 + m : 20] == [5] * (10 - k + 1 - m)  # at most M - 1 more steps up while the average rises
    fall = next(i for i in range(20, 32) if ra[i] < 5)
    assert 20 + k - 1 <= fall <= 20 + (m - 1) + (k - 1)  # the average takes up to M - 1 intervals to cross
    assert ra[fall:] == [3] * (32 - fall)  # straight back to where it was
    assert rb[:10] == [3] * 10 and rb[19] == 2 and rb[31] == 3  # b falls with a's rise and comes back


# ---- scaling ahead of a declared change ----------------------------------------------------


def staged(change: int, before: float, after: float):
    return lambda step: {"a": before, "b": 1 - before} if step < change else {"a": after, "b": 1 - after}


def scheduled_run(lead_s: float, *, change: int, before: float, after: float, start: int) -> list[tuple[int, int]]:
    """(step, replicas of a) per interval of a job at 10 steps/s whose weights follow the schedule;
    one interval per second."""
    scaling = ScalingSettings(window_intervals=2, consecutive_intervals=2, cooldown_s=0, lead_s=lead_s)
    state = initial_state(spec_of(scaling, cost_s=0.04), start)
    schedule = staged(change, before, after)
    out = []
    for second in range(30):
        step = 10 * second
        observation = Observation(schedule(step), 120.0, step=step, step_rate=10.0, schedule=schedule)
        state = decide(state, observation, float(second)).state
        out.append((step, state.replicas))
    return out


def test_scaling_ahead_raises_replicas_before_the_declared_rise() -> None:
    plain = scheduled_run(0.0, change=150, before=0.5, after=0.8, start=3)
    ahead = scheduled_run(5.0, change=150, before=0.5, after=0.8, start=3)
    first_plain = next(step for step, r in plain if r == 5)
    first_ahead = next(step for step, r in ahead if r == 5)
    assert first_plain >= 150  # without the schedule: only after the change
    assert first_ahead < 150 - 10 * 2  # ahead: at least two intervals before it
    assert ahead[-1][1] == plain[-1][1] == 5


def test_scaling_ahead_lowers_nothing_before_a_declared_fall() -> None:
    plain = scheduled_run(0.0, change=150, before=0.8, after=0.5, start=5)
    ahead = scheduled_run(5.0, change=150, before=0.8, after=0.5, start=5)
    assert all(r == 5 for step, r in ahead if step < 150)
    assert ahead == plain  # the fall is followed as without a schedule
    assert plain[-1][1] == 3


# ---- determinism and validation -------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(spec=specs(), start=st.integers(0, 12), run_=intervals)
def test_decisions_are_a_function_of_their_inputs(spec: GroupSpec, start: int, run_: list[Interval]) -> None:
    first = run(initial_state(spec, start), run_)
    second = run(initial_state(spec, start), run_)
    assert first == second
    assert all(isinstance(d.reason, str) and d.reason for _, d in first)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: ScalingSettings(consecutive_intervals=0), "scaling.consecutive_intervals"),
        (lambda: ScalingSettings(window_intervals=1.5), "scaling.window_intervals"),
        (lambda: ScalingSettings(down_threshold=1.0), "scaling.down_threshold"),
        (lambda: ScalingSettings(cooldown_s=-1), "scaling.cooldown_s"),
        (lambda: ScalingSettings(headroom=float("nan")), "scaling.headroom"),
        (lambda: GroupSpec("g", ()), "groups.g.sources"),
        (lambda: GroupSpec("g", ("a", "a")), "groups.g.sources"),
        (lambda: GroupSpec("g", ("a",), {"a": -0.1}), "groups.g.cost_s.a"),
        (lambda: GroupSpec("g", ("a",), capacity=0), "groups.g.capacity"),
        (lambda: GroupSpec("g", ("a",), min_replicas=3, max_replicas=2), "groups.g.max_replicas"),
    ],
)
def test_bad_settings_name_the_field(build, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.field == field
