"""Weight schedules and the mixture they drive: each kind's weights, validation errors that name
the field, the configuration shape, and the allocator's guarantees under every kind and both
granularities: changes at the exact step, I5 fidelity bounds, I4 determinism and resume,
contiguous consumption, and a static schedule's allocations unchanged from before schedules.
Pure: no processes, no files."""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchplane.planner.mixture import Allocation, Mixture, MixtureState, drift_bound
from batchplane.core.schedule import (
    Curriculum,
    FromCallable,
    Schedule,
    ScheduleError,
    Staged,
    Static,
    schedule_from_mapping,
)

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ("web", "code", "math")
NAN, INF = float("nan"), float("inf")
EPS = 1e-6


# ---- the kinds -------------------------------------------------------------------------------


def test_static_weights_are_the_same_everywhere() -> None:
    schedule = Static((2, 1, 0), source_names=NAMES)
    assert {schedule.weights_at(t) for t in (-3.0, 0.0, 0.5, 1e9)} == {(2.0, 1.0, 0.0)}
    assert schedule.num_sources == 3
    assert schedule.describe() == "static web=2 code=1 math=0"


STAGED = Staged(((0, (1, 0)), (100, (1, 3)), (250, (0, 1))))


@pytest.mark.parametrize(
    ("t", "weights"),
    [
        (-1.0, (1, 0)),
        (0.0, (1, 0)),
        (99.0, (1, 0)),
        (99.999, (1, 0)),
        (100.0, (1, 3)),
        (100.25, (1, 3)),
        (249.75, (1, 3)),
        (250.0, (0, 1)),
        (1e12, (0, 1)),
    ],
)
def test_staged_weights_switch_exactly_at_each_start(t: float, weights: tuple[float, ...]) -> None:
    assert STAGED.weights_at(t) == weights


def test_staged_describes_its_stages() -> None:
    assert STAGED.describe() == "staged, 3 stages: from step 0: (1, 0); from step 100: (1, 3); from step 250: (0, 1)"


CURRICULUM = Curriculum(((10, (1, 0)), (20, (0, 2)), (40, (4, 2))))


@pytest.mark.parametrize(
    ("t", "weights"),
    [
        (0.0, (1, 0)),
        (10.0, (1, 0)),
        (12.5, (0.75, 0.5)),
        (15.0, (0.5, 1)),
        (20.0, (0, 2)),
        (30.0, (2, 2)),
        (39.5, (3.9, 2)),
        (40.0, (4, 2)),
        (1e9, (4, 2)),
    ],
)
def test_curriculum_is_linear_between_anchors_and_constant_outside(t: float, weights: tuple[float, ...]) -> None:
    assert CURRICULUM.weights_at(t) == pytest.approx(weights)


def test_curriculum_gives_each_anchor_its_weights_exactly() -> None:
    for step, weights in CURRICULUM.anchors:
        assert CURRICULUM.weights_at(float(step)) == weights
    assert Curriculum(((5, (1, 2)),)).weights_at(1e6) == (1.0, 2.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.floats(0, 1e6), min_size=3, max_size=3).filter(lambda w: sum(w) > 0), min_size=2, max_size=2),
    st.integers(1, 10**6),
    st.floats(0, 1),
)
def test_curriculum_stays_between_its_anchors_weights(weights, span, f) -> None:
    schedule = Curriculum(((0, tuple(weights[0])), (span, tuple(weights[1]))))
    got = schedule.weights_at(f * span)
    assert sum(got) > 0
    if sum(x * (1 - f) + y * f for x, y in zip(*weights)) > 0:
        tiny = math.ulp(0.0)  # a product of a subnormal weight may round to 0 or to the next subnormal
        for x, a, b in zip(got, *weights):
            assert min(a, b) * (1 - 1e-12) - tiny <= x <= max(a, b) * (1 + 1e-12) + tiny
    else:  # subnormal weights underflowed: the anchors' shares, interpolated
        shares = [[w / sum(ws) for w in ws] for ws in weights]
        for x, a, b in zip(got, *shares):
            assert min(a, b) - 1e-12 <= x <= max(a, b) + 1e-12


def test_a_callable_may_return_a_mapping_or_k_weights() -> None:
    by_name = FromCallable(lambda t: {"web": t + 1, "math": 2}, "m:by_name", NAMES)
    assert by_name.weights_at(3.0) == (4.0, 0.0, 2.0)  # code is not named: weight 0
    by_position = FromCallable(lambda t: [1, 2, t], "m:by_position", NAMES)
    assert by_position.weights_at(0.5) == (1.0, 2.0, 0.5)
    assert by_name.describe() == "callable 'm:by_name' over sources web, code, math"


@pytest.mark.parametrize(
    ("returned", "why"),
    [
        ({"webb": 1}, "'webb' names no source"),
        ({"web": -1}, "every weight must be a finite number >= 0, not -1"),
        ({"web": NAN}, "every weight must be a finite number >= 0, not nan"),
        ([1, INF, 0], "every weight must be a finite number >= 0, not inf"),
        ({"web": "1"}, "every weight must be a finite number >= 0, not '1'"),
        ({"web": 0, "code": 0.0}, "must give at least one source a weight > 0"),
        ([1, 2], "must have 3 weights, one per source, not 2"),
        ("web", "expected a mapping of source name to weight or K weights"),
        (None, "expected a mapping of source name to weight or K weights"),
    ],
)
def test_a_callable_returning_bad_weights_is_named_with_the_step(returned, why) -> None:
    schedule = FromCallable(lambda t: returned if t == 12.5 else [1, 1, 1], "m:f", NAMES)
    expected = f"mixture.schedule: callable 'm:f' returned {returned!r} at step 12.5: {why}"
    with pytest.raises(ScheduleError, match=f"^{re.escape(expected)}$"):
        schedule.weights_at(12.5)


def test_a_callable_that_raises_or_is_bad_at_step_0_fails_when_built() -> None:
    with pytest.raises(ScheduleError, match=r"^mixture\.schedule: callable 'm:f' returned \[0, 0, 0\] at step 0: "):
        FromCallable(lambda t: [0, 0, 0], "m:f", NAMES)
    schedule = FromCallable(lambda t: [1 / abs(t - 7)], "m:g", ("web",))
    with pytest.raises(ScheduleError, match=r"^mixture\.schedule: callable 'm:g' raised ZeroDivisionError\(.*\) at step 7$"):
        schedule.weights_at(7.0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Static((1, -1)), "mixture.weights[1]: must be a finite number >= 0, got -1"),
        (lambda: Static((1, -1), source_names=("web", "code")), "mixture.weights.code: must be a finite number >= 0, got -1"),
        (lambda: Static((NAN,)), "mixture.weights[0]: must be a finite number >= 0, got nan"),
        (lambda: Static((1, INF)), "mixture.weights[1]: must be a finite number >= 0, got inf"),
        (lambda: Static((True,)), "mixture.weights[0]: must be a finite number >= 0, got True"),
        (lambda: Static((0, 0.0)), "mixture.weights: must give at least one source a weight > 0, got (0, 0.0)"),
        (lambda: Static(()), "mixture.weights: must have at least one source, got ()"),
        (lambda: Static((1e308, 1e308)), "mixture.weights: must have a finite sum, got (1e+308, 1e+308)"),
        (lambda: Static((1,), source_names=("web", "code")), "mixture.weights: must have 2 weights, one per source, not 1, got (1,)"),
        (lambda: Static((1, 1), source_names=("web", "web")), "mixture.weights: source names must be unique, got ('web', 'web')"),
        (lambda: Staged(()), "mixture.schedule.stages: must have at least one (start, weights) pair, got ()"),
        (lambda: Staged(((5, (1,)),)), "mixture.schedule.stages[0].start: must be 0 (the first stage starts the job), got 5"),
        (lambda: Staged(((0, (1,)), (0, (2,)))), "mixture.schedule.stages[1].start: must be > 0 and increasing, got 0"),
        (lambda: Staged(((0, (1,)), (9, (2,)), (4, (1,)))), "mixture.schedule.stages[2].start: must be > 9 and increasing, got 4"),
        (lambda: Staged(((0, (1,)), (1.5, (1,)))), "mixture.schedule.stages[1].start: must be an integer, got 1.5"),
        (lambda: Staged(((0, (1,)), (3,))), "mixture.schedule.stages[1]: must be a (start, weights) pair, got (3,)"),
        (
            lambda: Staged(((0, (1, 1)), (10, (1,)))),
            "mixture.schedule.stages[1].weights: must have 2 weights like mixture.schedule.stages[0], got (1,)",
        ),
        (
            lambda: Staged(((0, (1, 0)), (10, (0, 0)))),
            "mixture.schedule.stages[1].weights: must give at least one source a weight > 0, got (0, 0)",
        ),
        (
            lambda: Staged(((0, (1, 1)), (10, (0, -2))), source_names=("web", "code")),
            "mixture.schedule.stages[1].weights.code: must be a finite number >= 0, got -2",
        ),
        (lambda: Curriculum(()), "mixture.schedule.anchors: must have at least one (step, weights) pair, got ()"),
        (lambda: Curriculum(((-1, (1,)),)), "mixture.schedule.anchors[0].step: must be >= 0, got -1"),
        (lambda: Curriculum(((0, (1,)), (10, (1,)), (10, (2,)))), "mixture.schedule.anchors[2].step: must be > 10 and increasing, got 10"),
        (lambda: Curriculum(((0, "ab"),)), "mixture.schedule.anchors[0].weights: must be a sequence of weights, one per source, got 'ab'"),
        (lambda: FromCallable(42, "m:x", NAMES), "mixture.schedule.callable: must name a callable, got 'm:x'"),
        (lambda: FromCallable(lambda t: [1], "m:x", ()), "mixture.schedule.callable: needs the source names, got ()"),
    ],
)
def test_invalid_schedules_are_refused_naming_the_field(build, message: str) -> None:
    with pytest.raises(ScheduleError, match=f"^{re.escape(message)}$") as info:
        build()
    assert isinstance(info.value, ValueError)
    assert message.startswith(info.value.field + ":")


# ---- from the configuration ------------------------------------------------------------------


def _resolver(table):
    def resolve(path: str):
        if path not in table:
            raise ImportError(f"no module named {path.split(':')[0]!r}")
        return table[path]

    return resolve


def test_weights_without_a_schedule_are_static_and_unnamed_sources_weigh_1() -> None:
    assert schedule_from_mapping({"weights": {"web": 2.5, "math": 0}}, NAMES) == (Static((2.5, 1.0, 0.0), source_names=NAMES), "step")
    assert schedule_from_mapping({}, NAMES) == (Static((1.0, 1.0, 1.0), source_names=NAMES), "step")
    assert schedule_from_mapping({"weights": None}, NAMES)[0].weights_at(0) == (1.0, 1.0, 1.0)


def test_every_kind_from_the_configuration() -> None:
    static = {"weights": {"web": 3}, "schedule": {"kind": "static", "granularity": "microbatch"}}
    assert schedule_from_mapping(static, NAMES) == (Static((3.0, 1.0, 1.0), source_names=NAMES), "microbatch")
    staged = {
        "schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {"web": 1, "code": 0}}, {"start": 1000, "weights": {"math": 4}}]}
    }
    schedule, granularity = schedule_from_mapping(staged, NAMES)
    assert schedule == Staged(((0, (1.0, 0.0, 1.0)), (1000, (1.0, 1.0, 4.0))), source_names=NAMES)
    assert granularity == "step"
    anchors = [{"step": 0, "weights": {"web": 0.9, "code": 0.1, "math": 0}}, {"step": 5000, "weights": {"web": 0.5}}]
    curriculum = {"weights": {}, "schedule": {"kind": "curriculum", "granularity": "step", "anchors": anchors}}
    schedule, _ = schedule_from_mapping(curriculum, NAMES)
    assert schedule == Curriculum(((0, (0.9, 0.1, 0.0)), (5000, (0.5, 1.0, 1.0))), source_names=NAMES)
    assert schedule.describe() == "curriculum, linear between 2 anchors: step 0: web=0.9 code=0.1 math=0; step 5000: web=0.5 code=1 math=1"

    def ramp(t: float) -> dict[str, float]:
        return {"web": 1.0, "code": min(t / 100, 1.0)}

    spec = {"schedule": {"kind": "callable", "callable": "recipes:ramp", "granularity": "microbatch"}}
    schedule, granularity = schedule_from_mapping(spec, NAMES, resolve_callable=_resolver({"recipes:ramp": ramp}))
    assert isinstance(schedule, FromCallable) and granularity == "microbatch"
    assert schedule.weights_at(50.0) == (1.0, 0.5, 0.0)


def _staged(*stages) -> dict:
    return {"schedule": {"kind": "staged", "stages": list(stages)}}


def _anchors(*anchors) -> dict:
    return {"schedule": {"kind": "curriculum", "anchors": list(anchors)}}


def _callable(path) -> dict:
    return {"schedule": {"kind": "callable", "callable": path}}


GOOD = {"start": 0, "weights": {}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "mixture: must be a mapping"),
        ({"wieghts": {"web": 1}}, "mixture.wieghts: unknown key; known keys: weights, schedule"),
        ({"weights": {"webb": 1}}, "mixture.weights.webb: names no source; sources are web, code, math"),
        ({"weights": {"web": "1"}}, "mixture.weights.web: must be a finite number >= 0, got '1'"),
        ({"weights": {"web": True}}, "mixture.weights.web: must be a finite number >= 0, got True"),
        ({"weights": {"web": -1.0}}, "mixture.weights.web: must be a finite number >= 0, got -1.0"),
        ({"weights": {"web": 0, "code": 0, "math": 0}}, "mixture.weights: must give at least one source a weight > 0"),
        ({"weights": [1, 2, 3]}, "mixture.weights: must be a mapping of source name to weight"),
        ({"schedule": "staged"}, "mixture.schedule: must be a mapping"),
        ({"schedule": {}}, "mixture.schedule.kind: must be one of static, staged, curriculum, callable, adaptive, got None"),
        ({"schedule": {"kind": "cosine"}}, "mixture.schedule.kind: must be one of static, staged, curriculum, callable"),
        ({"schedule": {"kind": "static", "granularity": "sample"}}, "mixture.schedule.granularity: must be one of step, microbatch"),
        ({"schedule": {"kind": "static", "every": 2}}, "mixture.schedule.every: unknown key"),
        ({"schedule": {"kind": "staged"}}, "mixture.schedule.stages: is required by kind 'staged'"),
        ({"schedule": {"kind": "static", "stages": [GOOD]}}, "mixture.schedule.stages: is not used by kind 'static'"),
        ({"schedule": {"kind": "staged", "stages": [GOOD], "anchors": []}}, "mixture.schedule.anchors: is not used by kind 'staged'"),
        ({"weights": {"web": 1}, **_staged(GOOD)}, "mixture.weights: cannot be combined with a staged schedule"),
        (
            {"schedule": {"kind": "staged", "stages": GOOD}},
            "mixture.schedule.stages: must be a non-empty list of {start, weights} mappings",
        ),
        (_staged(), "mixture.schedule.stages: must be a non-empty list"),
        (_staged(5), "mixture.schedule.stages[0]: must be a mapping, got 5"),
        (_staged({"weights": {}}), "mixture.schedule.stages[0].start: is required"),
        (_staged({"begin": 0, "start": 0}), "mixture.schedule.stages[0].begin: unknown key; known keys: start, weights"),
        (_staged({"start": "0", "weights": {}}), "mixture.schedule.stages[0].start: must be an integer, got '0'"),
        (_staged(GOOD, {"start": 0, "weights": {}}), "mixture.schedule.stages[1].start: must be > 0 and increasing, got 0"),
        (_staged(GOOD, {"start": 10, "weights": "web"}), "mixture.schedule.stages[1].weights: must be a mapping of source name to weight"),
        (
            _anchors({"step": 0, "weights": {}}, {"step": 5, "weights": {}}, {"step": 9, "weights": {"webb": 1}}),
            "mixture.schedule.anchors[2].weights.webb: names no source",
        ),
        (
            _anchors({"step": 0, "weights": {"web": 0, "code": 0, "math": 0}}),
            "mixture.schedule.anchors[0].weights: must give at least one source a weight > 0",
        ),
        (
            _anchors({"step": 3, "weights": {}}, {"step": 2, "weights": {}}),
            "mixture.schedule.anchors[1].step: must be > 3 and increasing, got 2",
        ),
        (_callable("recipes.ramp"), "mixture.schedule.callable: must be an import path 'module:function', got 'recipes.ramp'"),
        (_callable(7), "mixture.schedule.callable: must be an import path 'module:function', got 7"),
        (_callable("nowhere:ramp"), "mixture.schedule.callable: cannot be imported: no module named 'nowhere', got 'nowhere:ramp'"),
        (_callable("recipes:number"), "mixture.schedule.callable: must name a callable, got 'recipes:number'"),
        (_callable("recipes:bad"), "mixture.schedule: callable 'recipes:bad' returned {'webb': 1} at step 0: 'webb' names no source"),
    ],
)
def test_bad_configuration_is_refused_naming_the_full_field_path(data, message: str) -> None:
    resolve = _resolver({"recipes:number": 3, "recipes:bad": lambda t: {"webb": 1}})
    with pytest.raises(ScheduleError, match=f"^{re.escape(message)}"):
        schedule_from_mapping(data, NAMES, resolve_callable=resolve)


def test_a_callable_needs_a_resolver() -> None:
    with pytest.raises(ScheduleError, match=r"^mixture\.schedule\.callable: cannot be imported here: no resolver was given"):
        schedule_from_mapping(_callable("recipes:ramp"), NAMES)


# ---- the mixture under schedules -------------------------------------------------------------


def _run(mixture: Mixture, steps: int, state: MixtureState | None = None) -> list[tuple[Allocation, MixtureState]]:
    """(allocation, state after it) of up to `steps` steps, until the data ends."""
    state = state or MixtureState.initial(mixture.num_sources)
    out = []
    for _ in range(steps):
        allocation, state = mixture.allocate(state)
        if allocation.end_of_data:
            break
        out.append((allocation, state))
    return out


def _sizes(mixture: Mixture) -> list[int]:
    size, extra = divmod(mixture.global_batch_size, mixture.microbatches)
    return [size + (m < extra) for m in range(mixture.microbatches) if size + (m < extra)]


def _shares(weights: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(w / sum(weights) for w in weights)


@st.composite
def weight_vectors(draw, k: int, *, zeros: bool) -> tuple[float, ...]:
    weight = st.floats(0.05, 20) | st.just(0.0) if zeros else st.floats(0.05, 20)
    return tuple(draw(st.lists(weight, min_size=k, max_size=k).filter(lambda w: sum(w) > 0)))


@st.composite
def schedules(draw, kind: str, k: int, *, zeros: bool = True) -> Schedule:
    vector = weight_vectors(k, zeros=zeros)
    if kind == "static":
        return Static(draw(vector))
    if kind == "callable":
        table = draw(st.lists(vector, min_size=1, max_size=6))
        period = draw(st.sampled_from([1, 2, 4]))
        return FromCallable(lambda t: table[math.floor(t * period) % len(table)], "test:table", [f"s{i}" for i in range(k)])
    gaps = draw(st.lists(st.integers(1, 60), min_size=0, max_size=4))
    first = 0 if kind == "staged" else draw(st.integers(0, 30))
    steps = [first + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    points = tuple((s, draw(vector)) for s in steps)
    return Staged(points) if kind == "staged" else Curriculum(points)


KINDS = ("static", "staged", "curriculum", "callable")


@st.composite
def mixtures(draw, kind: str, *, endless: bool = False, zeros: bool = True, granularity: str | None = None) -> Mixture:
    k = draw(st.integers(1, 5))
    ends = [None if endless else draw(st.none() | st.integers(0, 400)) for _ in range(k)]
    return Mixture(
        draw(schedules(kind, k, zeros=zeros)),
        global_batch_size=draw(st.integers(1, 48)),
        stream_ends=ends,
        granularity=granularity or draw(st.sampled_from(["step", "microbatch"])),
        microbatches=draw(st.integers(1, 8)),
    )


# The allocator as it was before schedules, frozen: `Static` must reproduce it exactly.
class _ReferenceMixture:
    def __init__(self, weights, *, global_batch_size, stream_ends):
        self.weights = tuple(float(w) for w in weights)
        self.global_batch_size = global_batch_size
        self.stream_ends = tuple(stream_ends)

    def allocate(self, state):
        remaining = [math.inf if e is None else max(e - c, 0) for e, c in zip(self.stream_ends, state.cursors)]
        active = tuple(k for k in range(len(self.weights)) if self.weights[k] > 0 and remaining[k] > 0)
        if not active:
            return Allocation(state.step, state.cursors, (0,) * len(self.weights)), state
        if active != state.phase:
            state = dataclasses.replace(state, phase=active, phase_total=0, phase_counts=(0,) * len(self.weights))
        n = int(min(self.global_batch_size, sum(remaining[k] for k in active)))
        taken = self._apportion(state, active, n, remaining)
        counts = tuple(taken[k] - state.phase_counts[k] for k in range(len(self.weights)))
        after = MixtureState(
            state.step + 1, tuple(c + m for c, m in zip(state.cursors, counts)), active, state.phase_total + n, tuple(taken)
        )
        return Allocation(state.step, state.cursors, counts), after

    def _apportion(self, state, active, n, remaining):
        total_weight = sum(self.weights[k] for k in active)
        share = {k: self.weights[k] / total_weight for k in active}
        delta = 1 / (2 * len(active) - 2) if len(active) > 1 else 0.5
        end = state.phase_total + n
        taken = list(state.phase_counts)
        cap = {k: taken[k] + remaining[k] for k in active}
        upper = {k: min(math.floor(share[k] * end + 1 - delta + 1e-9), cap[k]) for k in active}
        for k in active:
            taken[k] = min(max(taken[k], math.ceil(share[k] * end - 1 + delta - 1e-9)), cap[k])
        free = n - sum(taken[k] - state.phase_counts[k] for k in active)
        due = [((taken[k] + 1 - delta) / share[k], k) for k in active if taken[k] < upper[k]]
        heapq.heapify(due)
        while free > 0:
            if not due:
                due = [((taken[k] + 1 - delta) / share[k], k) for k in active if taken[k] < cap[k]]
                heapq.heapify(due)
                upper = cap
            _, k = heapq.heappop(due)
            taken[k] += 1
            free -= 1
            if taken[k] < upper[k]:
                heapq.heappush(due, ((taken[k] + 1 - delta) / share[k], k))
        while free < 0:
            k = max((k for k in active if taken[k] > state.phase_counts[k]), key=lambda k: ((taken[k] - delta) / share[k], k))
            taken[k] -= 1
            free += 1
        return taken


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda k: st.tuples(weight_vectors(k, zeros=True), st.lists(st.none() | st.integers(0, 600), min_size=k, max_size=k))
    ),
    st.integers(1, 96),
)
def test_a_static_schedule_allocates_exactly_as_the_allocator_before_schedules(weights_and_ends, batch) -> None:
    weights, ends = weights_and_ends
    new = Mixture(Static(weights), global_batch_size=batch, stream_ends=ends)
    old = _ReferenceMixture(weights, global_batch_size=batch, stream_ends=ends)
    state, reference = MixtureState.initial(len(weights)), MixtureState.initial(len(weights))
    for _ in range(300):
        allocation, state = new.allocate(state)
        expected, reference = old.allocate(reference)
        assert (allocation.step, allocation.starts, allocation.counts) == (expected.step, expected.starts, expected.counts)
        assert state.cursors == reference.cursors
        if expected.end_of_data:
            break


def test_a_stage_change_takes_effect_at_its_exact_step() -> None:
    # code is off in stage 1, math is off in stage 2: the active sources change at step 100.
    for granularity in ("step", "microbatch"):
        mixture = Mixture(
            Staged(((0, (1, 0, 1)), (100, (1, 1, 0)))),
            global_batch_size=10,
            stream_ends=[None] * 3,
            granularity=granularity,
            microbatches=4,
        )
        run = _run(mixture, 200)
        assert all(a.counts[1] == 0 and a.counts[2] > 0 for a, _ in run[:100])
        assert all(a.counts[2] == 0 and a.counts[1] > 0 for a, _ in run[100:])
        assert run[99][1].phase == (0, 2) and run[100][1].phase == (0, 1)
        assert run[100][1].phase_total == 10  # a fresh phase began with step 100
        assert [a.shares for a, _ in run[99:101]] == [(0.5, 0.0, 0.5), (0.5, 0.5, 0.0)]


def test_a_change_of_shares_starts_a_new_phase_at_its_exact_step_and_carries_what_is_owed() -> None:
    mixture = Mixture(Staged(((0, (2, 1)), (100, (1, 2)))), global_batch_size=10, stream_ends=[None, None])
    run = _run(mixture, 200)
    assert {s.phase_shares for _, s in run[:100]} == {(2 / 3, 1 / 3)}
    assert {s.phase_shares for _, s in run[100:]} == {(1 / 3, 2 / 3)}
    assert run[99][1].phase_total == 1000 and run[100][1].phase_total == 10
    # After 100 steps of 10, source 0 is owed 2/3 * 1000 - 667 = -1/3; the new phase inherits it.
    assert sum(a.counts[0] for a, _ in run[:100]) == 667
    assert run[100][1].phase_offsets == pytest.approx((-1 / 3, 1 / 3))
    assert {a.shares for a, _ in run[:100]} == {(2 / 3, 1 / 3)} and {a.shares for a, _ in run[100:]} == {(1 / 3, 2 / 3)}


def test_when_the_lower_bounds_ask_too_much_the_source_furthest_ahead_gives_back() -> None:
    # Owed 0.36 and 0.34, both sources must take a sample to stay within B = 3/4 of their
    # targets 0.81 and 0.79, but the step has one: source 1, the further ahead, gives it back.
    shares = (0.45, 0.45, 0.1)
    state = MixtureState(
        step=7,
        cursors=(0, 0, 0),
        phase=(0, 1, 2),
        phase_counts=(0, 0, 0),
        phase_shares=shares,
        phase_offsets=(0.36, 0.34, -0.7),
    )
    mixture = Mixture(Static(shares), global_batch_size=1, stream_ends=[None] * 3)
    allocation, after = mixture.allocate(state)
    assert allocation.counts == (1, 0, 0)
    assert after.phase_offsets == state.phase_offsets and after.phase_total == 1


def test_microbatch_granularity_reads_the_schedule_at_each_sub_step() -> None:
    # Sub-step m of 4 weighs only source m: the counts are the sub-step sizes, first ones larger.
    def one_hot(t: float) -> list[float]:
        return [float(m == round((t % 1) * 4)) for m in range(4)]

    mixture = Mixture(
        FromCallable(one_hot, "test:one_hot", list("abcd")),
        global_batch_size=10,
        stream_ends=[None] * 4,
        granularity="microbatch",
        microbatches=4,
    )
    for allocation, _ in _run(mixture, 3):
        assert allocation.counts == (3, 3, 2, 2)
        assert allocation.shares == pytest.approx((0.3, 0.3, 0.2, 0.2))
    few = Mixture(Static((1, 1)), global_batch_size=3, stream_ends=[None, None], granularity="microbatch", microbatches=5)
    assert _sizes(few) == [1, 1, 1] and all(a.total == 3 for a, _ in _run(few, 20))


def test_one_sample_sub_steps_do_not_starve_the_smaller_share() -> None:
    # With fresh counts at every change each one-sample sub-step would go to web; carried over,
    # code gets its 30-40 % and never falls more than B = 1/2 behind (m = 2: both sides proven).
    curriculum = Curriculum(((0, (0.7, 0.3)), (1000, (0.6, 0.4))))
    mixture = Mixture(curriculum, global_batch_size=8, stream_ends=[None, None], granularity="microbatch", microbatches=8)
    target = taken = 0.0
    for allocation, _ in _run(mixture, 1000):
        target += sum(_shares(curriculum.weights_at(allocation.step + m / 8))[1] for m in range(8))
        taken += allocation.counts[1]
        assert abs(taken - target) <= 0.5 + EPS
    assert taken > 0.3 * 8000


def _check_fidelity(mixture: Mixture, steps: int) -> None:
    """I5 on an endless job, from targets computed here from the schedule, after every step:

    - d_k = target - count since the active sources last changed is >= -B (proven, any schedule)
      and <= (m - 1) * B (proven: the d_k sum to 0);
    - until the shares first change after that, |d_k| <= B (Tijdeman).
    """
    k = mixture.num_sources
    owed = [0.0] * k
    active: tuple[int, ...] = ()
    shares_changed = False
    shares: tuple[float, ...] = ()
    for allocation, _ in _run(mixture, steps):
        for m, size in enumerate(_sizes(mixture)):
            weights = mixture.schedule.weights_at(allocation.step + m / mixture.microbatches)
            now = tuple(i for i in range(k) if weights[i] > 0)
            if now != active:
                assert mixture.granularity == "step" or m == 0, "the active sources change inside a step"
                owed, active, shares_changed = [0.0] * k, now, False
            elif _shares(weights) != shares:
                shares_changed = True
            shares = _shares(weights)
            for i in active:
                owed[i] += weights[i] / sum(weights) * size
        for i in range(k):
            owed[i] -= allocation.counts[i]
        bound = drift_bound(len(active))
        assert all(d >= -bound - EPS for d in owed), (allocation.step, owed)
        assert all(d <= (len(active) - 1) * bound + EPS for d in owed), (allocation.step, owed)
        if not shares_changed:
            assert all(abs(d) <= bound + EPS for d in owed), (allocation.step, owed)


@SETTINGS
@given(mixtures("static", endless=True))
def test_i5_static_counts_stay_within_tijdemans_bound_at_every_step(mixture: Mixture) -> None:
    _check_fidelity(mixture, 200)


@SETTINGS
@given(mixtures("staged", endless=True, granularity="step"))
def test_i5_staged_counts_are_tijdeman_exact_in_fresh_stages_and_bounded_in_every_stage(mixture: Mixture) -> None:
    _check_fidelity(mixture, 250)


@SETTINGS
@given(st.sampled_from(KINDS).flatmap(lambda kind: mixtures(kind, endless=True, zeros=False)))
def test_i5_cumulative_counts_track_the_cumulative_target_for_every_kind_and_granularity(mixture: Mixture) -> None:
    _check_fidelity(mixture, 200)


@SETTINGS
@given(st.sampled_from(KINDS).flatmap(lambda kind: mixtures(kind)), st.data())
def test_i4_allocation_is_deterministic_and_a_resume_from_any_state_continues_identically(mixture: Mixture, data) -> None:
    run = _run(mixture, 150)
    assert _run(mixture, 150) == run
    if not run:
        return
    s = data.draw(st.integers(0, len(run) - 1))
    saved = run[s][1]
    assert mixture.fast_forward(MixtureState.initial(mixture.num_sources), s + 1) == saved
    # A state saved as JSON and read back by a new planner with the same configuration.
    fields = json.loads(json.dumps(dataclasses.asdict(saved)))
    restored = MixtureState(**{name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()})
    again = Mixture(
        mixture.schedule,
        global_batch_size=mixture.global_batch_size,
        stream_ends=mixture.stream_ends,
        granularity=mixture.granularity,
        microbatches=mixture.microbatches,
    )
    assert _run(again, 150 - (s + 1), restored) == run[s + 1 :]


@SETTINGS
@given(st.sampled_from(KINDS).flatmap(lambda kind: mixtures(kind)))
def test_each_source_is_consumed_contiguously_and_never_past_its_end(mixture: Mixture) -> None:
    cursors = (0,) * mixture.num_sources
    run = _run(mixture, 400)
    for i, (allocation, after) in enumerate(run):
        assert allocation.starts == cursors
        assert all(c >= 0 for c in allocation.counts)
        cursors = tuple(s + c for s, c in zip(allocation.starts, allocation.counts))
        assert after.cursors == cursors
        assert all(end is None or c <= end for c, end in zip(cursors, mixture.stream_ends))
        assert 0 < allocation.total <= mixture.global_batch_size
        assert sum(allocation.shares) == pytest.approx(1.0)
        assert all(
            share == 0 for share, end, c in zip(allocation.shares, mixture.stream_ends, allocation.starts) if end is not None and c >= end
        )


def test_the_data_ends_when_the_schedule_weighs_only_sources_that_ran_out() -> None:
    mixture = Mixture(Staged(((0, (1, 0)), (100, (0, 1)))), global_batch_size=10, stream_ends=[50, None])
    run = _run(mixture, 200)
    assert [a.counts for a, _ in run] == [(10, 0)] * 5
    end, state = mixture.allocate(run[-1][1])
    assert end.end_of_data and end.shares == (0.0, 0.0) and state == run[-1][1]
    assert mixture.fast_forward(MixtureState.initial(2), 120) == dataclasses.replace(run[-1][1], step=120)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stream_ends": [None]}, "a schedule of 2 sources for 1 sources"),
        ({"granularity": "sample"}, "granularity must be one of step, microbatch, got 'sample'"),
        ({"global_batch_size": 0}, "global_batch_size must be >= 1, got 0"),
        ({"microbatches": 0}, "microbatches must be >= 1, got 0"),
    ],
)
def test_a_mixture_refuses_bad_arguments(kwargs, message: str) -> None:
    arguments = {"global_batch_size": 8, "stream_ends": [None, None], **kwargs}
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Mixture(Static((1, 1)), **arguments)


def test_a_mixture_describes_its_schedule_and_granularity() -> None:
    mixture = Mixture(
        Static((1, 3), source_names=("web", "code")),
        global_batch_size=8,
        stream_ends=[None, None],
        granularity="microbatch",
        microbatches=4,
    )
    assert mixture.describe() == "static web=1 code=3; read per microbatch (4 a step)"
