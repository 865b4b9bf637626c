"""Mixture-driven scaling of loader groups (MegaScale-Data §5.2): how many loader replicas each
source group needs, from the sources' sampling weights and the job's throughput.

Pure: no I/O, no grpc, no prometheus_client, no clock. The state is explicit (`GroupState`, a
frozen dataclass), so `decide(state, observation, now)` is a deterministic function of its
arguments; the operator keeps one state per group, feeds it one `Observation` per interval and
applies the returned replica count through its backend.

The model, per interval and per group g (units in brackets):

    w_s      sampling weight of source s at the latest planned step: its share of the samples
             (batchplane_planner_mixture_weight_ratio{source}); a source the observation does
             not name counts as 0 in that interval
    w̄_s      mean of w_s over the last M intervals, this one included   (M = window_intervals)
    ŵ_s      the declared schedule's weight of s at step x + lead_s · x', normalized over the
             schedule's sources (x the current step, x' the step rate [steps/s]); 0 without a
             schedule, a step or a step rate, or with lead_s = 0
    u_s      max(w̄_s, ŵ_s)
    T        the job's throughput [samples/s]: what the trainers consume
             (rate of batchplane_planner_samples_total, summed over sources)
    c_s      loader work per sample of s [worker-seconds], from the group's profile or, where
             the observation carries one, measured
    demand_g = Σ_{s ∈ g} u_s · T · c_s                              [worker-seconds per second]
    need_g   = demand_g · (1 + headroom) / capacity_g                [replicas, real]
             capacity_g: the worker-seconds per second one replica provides (its workers);
             a per-replica throughput r_g [samples/s] is capacity_g = 1 with c_s = 1 / r_g
    target_g = clamp(⌈need_g⌉, min_g, max_g)

With n the group's current replicas, u = up_threshold and d = down_threshold:

    up    when need_g > n · (1 + u)        and n < max_g  ->  n' = target_g  (> n)
    down  when need_g < (n − 1) · (1 − d)  and n > min_g  ->  n' = target_g  (< n)
    hold  otherwise

A direction acts only after it has held for K consecutive intervals (K = consecutive_intervals;
an interval without data, in the band or in the other direction restarts the count), and not
within cooldown_s seconds of the previous change (the count goes on meanwhile, so the change
comes as soon as the cooldown ends). A replica count outside [min_g, max_g] is clamped at once.

Hysteresis: after a change to m = ⌈need⌉, the count changes again only when need rises above
m · (1 + u) ≥ need · (1 + u) or falls below (m − 1) · (1 − d) < need · (1 − d). So a stationary
need with noise within a factor 1 ± a, a < u / (2 + u) and a < d / (2 − d), changes the count at
most once from any count within the bounds. The moving average delays a weight change by up to
M − 1 intervals; with K ≥ M a scale-down lands on the settled average (with a smaller K it may
land part way, one replica above, where the band then holds it).

Scaling ahead: u_s = max(w̄_s, ŵ_s) raises demand lead_s seconds (at the current step rate)
before a declared weight rises, so the new loaders are started and warm when it does; choose
lead_s above K intervals plus a loader's start-up time. A declared fall lowers nothing early
(the max keeps the current weight), so scaling down waits until the moving average has seen the
change.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from batchplane.core.errors import ConfigError

#: Float slack of the ceilings: a need of 3.0000000001 replicas is 3.
_EPS = 1e-9

#: The declared schedule as the policy sees it: step position -> weight per source name
#: (relative; normalized here).
ScheduleFn = Callable[[float], Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class ScalingSettings:
    """How eagerly groups scale; shared by the groups of a job."""

    #: M: intervals the sampling weights are averaged over.
    window_intervals: int = 3
    #: K: consecutive intervals a direction must hold before it acts.
    consecutive_intervals: int = 3
    #: u: need must exceed current replicas times (1 + u) to scale up (0: any shortfall).
    up_threshold: float = 0.05
    #: d: need must fall below (current − 1) replicas times (1 − d) to scale down; 0 <= d < 1.
    down_threshold: float = 0.15
    #: No change within this many seconds of the previous one.
    cooldown_s: float = 60.0
    #: Spare capacity kept above the demand, as a fraction of it (0.2: 20 %).
    headroom: float = 0.2
    #: Scale up this many seconds ahead of a declared weight rise (0: off).
    lead_s: float = 0.0

    def __post_init__(self) -> None:
        _at_least("scaling.window_intervals", self.window_intervals, 1, integer=True)
        _at_least("scaling.consecutive_intervals", self.consecutive_intervals, 1, integer=True)
        _at_least("scaling.up_threshold", self.up_threshold, 0.0)
        _at_least("scaling.down_threshold", self.down_threshold, 0.0)
        if self.down_threshold >= 1:
            raise ConfigError("scaling.down_threshold", "must be < 1", self.down_threshold)
        _at_least("scaling.cooldown_s", self.cooldown_s, 0.0)
        _at_least("scaling.headroom", self.headroom, 0.0)
        _at_least("scaling.lead_s", self.lead_s, 0.0)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One loader group: its sources, what they cost, what a replica provides, its bounds."""

    #: The group's name (the loader Deployment's suffix).
    name: str
    #: Names of the sources the group's loaders serve.
    sources: tuple[str, ...]
    #: Profiled loader work per sample of each source, in worker-seconds; a source left out
    #: costs 0.
    cost_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: Worker-seconds per second one replica provides (its workers; 1 with costs given as
    #: 1 / samples-per-second of one replica).
    capacity: float = 1.0
    #: Fewest replicas.
    min_replicas: int = 1
    #: Most replicas.
    max_replicas: int = 8
    #: How eagerly it scales.
    scaling: ScalingSettings = dataclasses.field(default_factory=ScalingSettings)

    def __post_init__(self) -> None:
        field = f"groups.{self.name}"
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources:
            raise ConfigError(f"{field}.sources", "must name at least one source", self.sources)
        if len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"{field}.sources", "must not repeat a source", self.sources)
        for source, cost in self.cost_s.items():
            _at_least(f"{field}.cost_s.{source}", cost, 0.0)
        if not (math.isfinite(self.capacity) and self.capacity > 0):
            raise ConfigError(f"{field}.capacity", "must be a finite number > 0", self.capacity)
        _at_least(f"{field}.min_replicas", self.min_replicas, 0, integer=True)
        _at_least(f"{field}.max_replicas", self.max_replicas, max(self.min_replicas, 1), integer=True)

    def clamp(self, replicas: int) -> int:
        """`replicas` within [min_replicas, max_replicas]."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the operator saw in one interval, for the whole job."""

    #: Sampling weight (share of samples, 0..1) per source name at the latest planned step.
    weights: Mapping[str, float]
    #: Samples per second the trainers consume.
    throughput: float
    #: The current step position, for scaling ahead; None: unknown.
    step: float | None = None
    #: Steps per second, for scaling ahead; None: unknown.
    step_rate: float | None = None
    #: The declared schedule, for scaling ahead; None: none declared.
    schedule: ScheduleFn | None = None
    #: Measured loader work per sample per source name, in worker-seconds; a source left out
    #: keeps its profiled cost.
    cost_s: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GroupState:
    """Everything `decide` remembers about one group between intervals."""

    #: The group.
    spec: GroupSpec
    #: Replicas the group runs (or was last told to run).
    replicas: int
    #: Sampling weights of the group's sources (in `spec.sources` order) of the last M
    #: intervals with data, oldest first.
    history: tuple[tuple[float, ...], ...] = ()
    #: Consecutive intervals so far that asked to scale up.
    up_intervals: int = 0
    #: Consecutive intervals so far that asked to scale down.
    down_intervals: int = 0
    #: When the replicas last changed, in the caller's clock (seconds); None: never.
    last_change_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The demand of one group in one interval (see the module docstring for the symbols)."""

    #: w̄_s per source of the group.
    average: tuple[float, ...]
    #: ŵ_s per source of the group; None when not scaling ahead.
    ahead: tuple[float, ...] | None
    #: u_s = max(w̄_s, ŵ_s) per source of the group.
    weights: tuple[float, ...]
    #: demand_g in worker-seconds per second.
    demand: float
    #: need_g in replicas.
    need: float
    #: clamp(⌈need_g⌉, min_g, max_g).
    target: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """What `decide` returns."""

    #: The group's state for the next interval.
    state: GroupState
    #: Replicas the group should run now.
    replicas: int
    #: Why, in a line for logs and the DataPlane status.
    reason: str
    #: The demand behind it; None in an interval without data.
    estimate: Estimate | None
    #: Replicas before this decision.
    previous: int

    @property
    def changed(self) -> bool:
        """Whether the replicas change."""
        return self.replicas != self.previous


def initial_state(spec: GroupSpec, replicas: int | None = None) -> GroupState:
    """A group's state before its first interval.

    Args:
        spec: The group.
        replicas: Replicas it runs now; None: `spec.min_replicas`.
    """
    return GroupState(spec=spec, replicas=spec.min_replicas if replicas is None else int(replicas))


def ahead_weights(spec: GroupSpec, observation: Observation) -> tuple[float, ...] | None:
    """ŵ_s for the group's sources, or None when the observation cannot scale ahead.

    Raises:
        ValueError: the schedule returned a weight that is not a finite number >= 0.
    """
    o = observation
    lead_s = spec.scaling.lead_s
    if lead_s <= 0 or o.schedule is None or o.step is None or o.step_rate is None:
        return None
    if not (math.isfinite(o.step) and math.isfinite(o.step_rate) and o.step_rate >= 0):
        return None
    future = o.schedule(o.step + lead_s * o.step_rate)
    for source, w in future.items():
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(
                f"schedule weight of source {source!r} at step {o.step + lead_s * o.step_rate:g}: must be a finite number >= 0, got {w!r}"
            )
    total = float(sum(future.values()))
    if total <= 0:
        return None
    return tuple(float(future.get(s, 0.0)) / total for s in spec.sources)


def estimate(spec: GroupSpec, history: tuple[tuple[float, ...], ...], observation: Observation) -> Estimate:
    """The group's demand from its weight history (this interval last) and the observation.

    Args:
        spec: The group.
        history: Weights of the group's sources per interval, oldest first; not empty.
        observation: This interval's observation (throughput, schedule, measured costs).
    """
    window = history[-spec.scaling.window_intervals :]
    average = tuple(sum(row[k] for row in window) / len(window) for k in range(len(spec.sources)))
    ahead = ahead_weights(spec, observation)
    weights = average if ahead is None else tuple(max(a, b) for a, b in zip(average, ahead))
    throughput = max(float(observation.throughput), 0.0)
    costs = [float(observation.cost_s.get(s, spec.cost_s.get(s, 0.0))) for s in spec.sources]
    demand = sum(w * throughput * c for w, c in zip(weights, costs))
    need = demand * (1 + spec.scaling.headroom) / spec.capacity
    return Estimate(average, ahead, weights, demand, need, spec.clamp(_ceil(need)))


def decide(state: GroupState, observation: Observation, now: float) -> Decision:
    """One interval of one group: the replicas it should run and the state to keep.

    Args:
        state: The group's state after the previous interval.
        observation: This interval's observation of the job.
        now: The caller's clock in seconds (monotonic); only differences are used.
    Returns:
        The decision: the new state, the replicas, the reason and the estimate behind it.
    Raises:
        ValueError: the observation's schedule returned a bad weight.
    """
    spec, settings = state.spec, state.spec.scaling
    n = state.replicas
    row = _row(spec, observation)
    if row is None:
        why = "no data (no weight for the group's sources, or no throughput)"
        held = dataclasses.replace(state, up_intervals=0, down_intervals=0)
        return _bounded(held, now, why, None) or Decision(held, n, f"hold {n}: {why}", None, n)
    history = (*state.history, row)[-settings.window_intervals :]
    est = estimate(spec, history, observation)
    k = settings.consecutive_intervals
    up = est.need > n * (1 + settings.up_threshold) + _EPS and n < spec.max_replicas
    down = est.need < (n - 1) * (1 - settings.down_threshold) - _EPS and n > spec.min_replicas
    state = dataclasses.replace(
        state,
        history=history,
        up_intervals=state.up_intervals + 1 if up else 0,
        down_intervals=state.down_intervals + 1 if down else 0,
    )
    bounded = _bounded(state, now, f"need {est.need:.2f}", est)
    if bounded is not None:
        return bounded
    if not (up or down):
        if est.need > n and n >= spec.max_replicas:
            why = f"at max_replicas {spec.max_replicas}"
        elif est.need < n - 1 and n <= spec.min_replicas:
            why = f"at min_replicas {spec.min_replicas}"
        else:
            lo = max((n - 1) * (1 - settings.down_threshold), 0.0)
            why = f"within [{lo:.2f}, {n * (1 + settings.up_threshold):.2f}]"
        return Decision(state, n, f"hold {n}: need {est.need:.2f} {why}", est, n)
    count = state.up_intervals if up else state.down_intervals
    direction = "up" if up else "down"
    if count < k:
        return Decision(state, n, f"hold {n}: {direction} pending {count}/{k} intervals (need {est.need:.2f})", est, n)
    if state.last_change_s is not None and now - state.last_change_s < settings.cooldown_s:
        left = settings.cooldown_s - (now - state.last_change_s)
        return Decision(state, n, f"hold {n}: {direction} after cooldown, {left:.1f} s left (need {est.need:.2f})", est, n)
    new = est.target
    if up:
        why = f"need {est.need:.2f} > {n} x {1 + settings.up_threshold:.2f} for {count} intervals"
    else:
        why = f"need {est.need:.2f} < ({n} - 1) x {1 - settings.down_threshold:.2f} for {count} intervals"
    changed = dataclasses.replace(state, replicas=new, up_intervals=0, down_intervals=0, last_change_s=now)
    return Decision(changed, new, f"{direction} {n} -> {new}: {why}", est, n)


def _bounded(state: GroupState, now: float, detail: str, est: Estimate | None) -> Decision | None:
    """The decision that brings replicas outside [min, max] back at once; None when inside."""
    n, bounded = state.replicas, state.spec.clamp(state.replicas)
    if bounded == n:
        return None
    bound = "min_replicas" if bounded > n else "max_replicas"
    new_state = dataclasses.replace(state, replicas=bounded, up_intervals=0, down_intervals=0, last_change_s=now)
    return Decision(new_state, bounded, f"bounds {n} -> {bounded}: {bound} is {bounded} ({detail})", est, n)


def _row(spec: GroupSpec, observation: Observation) -> tuple[float, ...] | None:
    """This interval's weights of the group's sources, or None without usable data."""
    if not (isinstance(observation.throughput, (int, float)) and math.isfinite(observation.throughput)):
        return None
    if not any(s in observation.weights for s in spec.sources):
        return None
    row = []
    for s in spec.sources:
        w = float(observation.weights.get(s, 0.0))
        row.append(w if math.isfinite(w) and w > 0 else 0.0)
    return tuple(row)


def _ceil(x: float) -> int:
    return max(math.ceil(x - _EPS), 0)


def _at_least(field: str, value: object, minimum: float, *, integer: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
        or not math.isfinite(value)
    ):
        raise ConfigError(field, "must be an integer" if integer else "must be a finite number", value)
    if value < minimum:
        raise ConfigError(field, f"must be >= {minimum}", value)
