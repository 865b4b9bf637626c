"""Metric-driven ("online") data mixing: per-source weights adapted to the trainer's losses.
Pure; no I/O, no clocks, standard library only.

The trainer reports, per training step, the mean loss of each source's samples in that step.
`update` turns one report into new weights with an exponentiated-gradient rule that gives more
weight to the sources whose loss falls slowest, within per-source bounds and a largest change
per update. Every function here is a pure function of (rule, state, report).

The rule. With beta = `smoothing`, eta = `learning_rate`, c = `max_change`, w the current
shares, e the smoothed losses and p the progress (both None until known), a report r
(r_k: the mean loss of source k in one step) first updates each reported source k::

    e_k' = r_k                                     if e_k is None (its first report)
    e_k' = beta * e_k + (1 - beta) * r_k           otherwise
    p_k' = max(-1, (e_k - e_k') / e_k)             if e_k is not None and e_k > 0, else None

p_k' is the relative fall of the smoothed loss over this report (a rise counts as at most
-1, so that a loss leaving 0 cannot overflow). A source not in the report keeps e_k and p_k.
Let G be the sources whose p_k' is known. If G is empty the weights do not change. Otherwise::

    gbar = mean_{k in G} p_k'
    g_k  = p_k' for k in G; gbar (neutral) for the others
    a    = max(mean_{k in G} |p_k'|, 1e-12)       the typical progress
    z_k  = (g_k - gbar) / a                        the progress gap, scale-free
    t_k  = w_k * exp(-eta * (z_k - min_j z_j)),  then t = t / sum(t)
    w'   = project(t, lo, hi),  lo_k = max(minimum_k, w_k - c),  hi_k = min(maximum_k, w_k + c)

A source whose loss falls slower than the mean (z_k < 0) gains weight, a faster one loses it;
the gap is measured relative to the typical progress, so only ratios of progress matter, not
the loss's units or the learning-rate schedule's pace. Subtracting min_j z_j changes nothing
after normalizing; it only keeps exp from overflowing. `project` is the Euclidean projection
onto {x : lo <= x <= hi, sum(x) = 1}, which contains w, so it is never empty. (If every t_k
underflows to 0, t is projected unnormalized.)

Guarantees, for every rule and every sequence of valid reports:

- the weights sum to 1 (within 1e-9) and lie within [minimum_k, maximum_k] exactly;
- no share changes by more than `max_change` per update (within rounding, 1e-12);
- the same sequence of reports gives bit-identical weights (I4): the arithmetic is a fixed
  sequence of float operations, with `math.fsum` for sums and `math.exp` the only libm call.

Delay. The plan of step s uses the weights after the reports of steps <= s - `delay_steps`,
so that planning can run ahead of training and a replay computes the same weights: the
planner applies the report of step s - D, then sets step s's weights on the `AdaptiveSchedule`
that its Mixture reads, then allocates step s. The state (`AdaptiveState`) is small and goes to
and from JSON exactly (`state_to_json`, `state_from_json`) for checkpoints.

Errors are `ScheduleError`s naming the field, e.g.
``mixture.schedule.adaptive.minimum.web: must be a share in [0, 1], got 1.5``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from batchplane.core.schedule import Schedule, ScheduleError, Weights

#: The configuration path of the adaptive schedule's settings.
FIELD = "mixture.schedule.adaptive"
#: The keys of the `mixture.schedule.adaptive` mapping.
KEYS = ("initial", "minimum", "maximum", "max_change", "learning_rate", "smoothing", "delay_steps")

_REPORT = "mixture.adaptive report"
_STATE = "mixture.adaptive state"
_SUM_TOLERANCE = 1e-9
_TINY = 1e-12


@dataclasses.dataclass(frozen=True)
class AdaptiveRule:
    """How the weights adapt; validated when built.

    Args:
        source_names: The K source names, in source order.
        initial: Relative weight per source at the start; normalized here to shares summing to 1.
        minimum: Lowest share per source; () means 0.0 for every source.
        maximum: Highest share per source; () means 1.0 for every source.
        max_change: Largest change of any source's share in one update, in (0, 1].
        learning_rate: eta > 0, how strongly a progress gap moves the weights.
        smoothing: beta in [0, 1), the weight of the past in each source's loss average.
        delay_steps: D >= 1; step s is planned with the reports of steps <= s - D.
    Raises:
        ScheduleError: a bad value (the field names it, e.g. "mixture.schedule.adaptive.max_change"),
            a share out of its bounds after normalizing `initial`, sum(minimum) > 1 or sum(maximum) < 1.
    """

    source_names: tuple[str, ...]
    initial: Weights
    minimum: Weights = ()
    maximum: Weights = ()
    max_change: float = 0.02
    learning_rate: float = 1.0
    smoothing: float = 0.9
    delay_steps: int = 8

    def __post_init__(self) -> None:
        names = _checked_names(self.source_names)
        initial = _checked_values(self.initial, f"{FIELD}.initial", names, "a finite number >= 0", _is_weight)
        total = math.fsum(initial)
        if total <= 0 or not math.isfinite(total):
            raise ScheduleError(f"{FIELD}.initial", "must give at least one source a finite weight > 0", initial)
        shares = tuple(w / total for w in initial)
        share = "a share in [0, 1]"
        minimum = _checked_values(self.minimum or (0.0,) * len(names), f"{FIELD}.minimum", names, share, _is_share)
        maximum = _checked_values(self.maximum or (1.0,) * len(names), f"{FIELD}.maximum", names, share, _is_share)
        for name, lo, hi in zip(names, minimum, maximum):
            if hi < lo:
                raise ScheduleError(f"{FIELD}.maximum.{name}", f"must be >= minimum {lo!r}", hi)
        if math.fsum(minimum) > 1:
            raise ScheduleError(f"{FIELD}.minimum", "must sum to <= 1", minimum)
        if math.fsum(maximum) < 1:
            raise ScheduleError(f"{FIELD}.maximum", "must sum to >= 1", maximum)
        for name, lo, hi, x in zip(names, minimum, maximum, shares):
            if not lo <= x <= hi:
                problem = f"gives share {x!r}, outside [minimum, maximum] = [{lo!r}, {hi!r}]"
                raise ScheduleError(f"{FIELD}.initial.{name}", problem, self.initial)
        _check_scalar(self.max_change, "max_change", "a number in (0, 1]", lambda x: 0 < x <= 1)
        _check_scalar(self.learning_rate, "learning_rate", "a finite number > 0", lambda x: 0 < x)
        _check_scalar(self.smoothing, "smoothing", "a number in [0, 1)", lambda x: 0 <= x < 1)
        if not _is_integer(self.delay_steps) or self.delay_steps < 1:
            raise ScheduleError(f"{FIELD}.delay_steps", "must be an integer >= 1", self.delay_steps)
        for key, value in (
            ("source_names", names),
            ("initial", shares),
            ("minimum", minimum),
            ("maximum", maximum),
            ("max_change", float(self.max_change)),
            ("learning_rate", float(self.learning_rate)),
            ("smoothing", float(self.smoothing)),
            ("delay_steps", int(self.delay_steps)),
        ):
            object.__setattr__(self, key, value)


@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    """Where the adaptation stands: what `update` reads and returns.

    Attributes:
        weights: The current shares, in source order; they sum to 1.
        ema: Smoothed loss per source; None before its first report.
        progress: Last relative fall of the smoothed loss per source; None while unknown.
        reports: How many reports have been applied.
    """

    weights: Weights
    ema: tuple[float | None, ...]
    progress: tuple[float | None, ...]
    reports: int

    @classmethod
    def initial(cls, rule: AdaptiveRule) -> AdaptiveState:
        """The state before any report: the rule's initial shares, nothing known."""
        unknown = (None,) * len(rule.source_names)
        return cls(weights=rule.initial, ema=unknown, progress=unknown, reports=0)


def update(rule: AdaptiveRule, state: AdaptiveState, losses: Mapping[str, float]) -> AdaptiveState:
    """Applies one step's report (see the module docstring for the formulas).

    Args:
        rule: The adaptation rule.
        state: The state before the report, for the same sources as `rule`.
        losses: {source name: mean loss of that source's samples in the step}; sources missing
            from it keep their smoothed loss and progress.
    Returns:
        The state after the report.
    Raises:
        ScheduleError: field "mixture.adaptive report" for a name that is no source or a loss
            that is not a finite number >= 0 (the message names the source); field
            "mixture.adaptive state" for a state of another number of sources.
    """
    names = rule.source_names
    if not (len(state.weights) == len(state.ema) == len(state.progress) == len(names)):
        raise ScheduleError(_STATE, f"must have one weight, ema and progress per source ({len(names)})", state)
    check_report(rule, losses)
    beta = rule.smoothing
    ema, progress = list(state.ema), list(state.progress)
    for k, name in enumerate(names):
        if name not in losses:
            continue
        r, old = float(losses[name]), state.ema[k]
        new = ema[k] = r if old is None else beta * old + (1 - beta) * r
        progress[k] = max(-1.0, (old - new) / old) if old is not None and old > 0 else None
    after = dataclasses.replace(state, ema=tuple(ema), progress=tuple(progress), reports=state.reports + 1)
    known = [p for p in progress if p is not None]
    if not known:
        return after
    gbar = math.fsum(known) / len(known)
    scale = max(math.fsum(abs(p) for p in known) / len(known), _TINY)
    z = [(gbar if p is None else p) - gbar for p in progress]
    z = [x / scale for x in z]
    low = min(z)
    target = [w * math.exp(-rule.learning_rate * (x - low)) for w, x in zip(state.weights, z)]
    total = math.fsum(target)
    if total > 0:
        target = [x / total for x in target]
    c = rule.max_change
    lower = [max(lo, w - c) for lo, w in zip(rule.minimum, state.weights)]
    upper = [min(hi, w + c) for hi, w in zip(rule.maximum, state.weights)]
    return dataclasses.replace(after, weights=project(target, lower, upper))


def check_report(rule: AdaptiveRule, losses: Mapping[str, float]) -> None:
    """Checks one step's report.

    Raises:
        ScheduleError: field "mixture.adaptive report" for something else than a mapping, a name
            that is no source or a loss that is not a finite number >= 0 (naming the source).
    """
    if not isinstance(losses, Mapping):
        raise ScheduleError(_REPORT, "must be a mapping of source name to mean loss", losses)
    for name, loss in losses.items():
        if name not in rule.source_names:
            raise ScheduleError(_REPORT, f"{name!r} names no source; sources are {', '.join(rule.source_names)}", loss)
        if not _is_number(loss) or not math.isfinite(loss) or loss < 0:
            raise ScheduleError(_REPORT, f"the loss of source {name!r} must be a finite number >= 0", loss)


def project(target: Sequence[float], lower: Sequence[float], upper: Sequence[float]) -> Weights:
    """The point of {x : lower <= x <= upper, sum(x) = 1} nearest to `target` (Euclidean).

    It is x_k = clip(target_k - tau, lower_k, upper_k) for the tau that makes the sum 1; the
    sum is piecewise linear in tau with breakpoints target_k - upper_k and target_k - lower_k,
    so tau is found exactly by bisecting the sorted breakpoints and interpolating between the
    two that bracket it.

    Args:
        target: The point to project, K finite numbers.
        lower: K finite lower bounds.
        upper: K finite upper bounds, each >= its lower bound.
    Returns:
        The K coordinates; within the bounds exactly, summing to 1 within rounding.
    Raises:
        ValueError: lengths differ or are 0, a value is not finite, a lower bound exceeds its
            upper bound, or the set is empty: sum(lower) > 1 + 1e-9 or sum(upper) < 1 - 1e-9.
    """
    t, lo, hi = (tuple(float(x) for x in values) for values in (target, lower, upper))
    if not t or not len(t) == len(lo) == len(hi):
        raise ValueError(f"project needs K >= 1 targets and bounds of the same length, got {len(t)}, {len(lo)}, {len(hi)}")
    if not all(math.isfinite(x) for x in (*t, *lo, *hi)):
        raise ValueError("project needs finite targets and bounds")
    if any(a > b for a, b in zip(lo, hi)):
        raise ValueError(f"a lower bound exceeds its upper bound: {lo} > {hi}")
    low, high = math.fsum(lo), math.fsum(hi)
    if low > 1 + _SUM_TOLERANCE or high < 1 - _SUM_TOLERANCE:
        raise ValueError(f"no point within the bounds sums to 1: sum(lower) = {low!r}, sum(upper) = {high!r}")
    if low >= 1:
        return lo
    if high <= 1:
        return hi

    def total(tau: float) -> float:
        return math.fsum(min(b, max(a, x - tau)) for x, a, b in zip(t, lo, hi))

    points = sorted({x - b for x, b in zip(t, hi)} | {x - a for x, a in zip(t, lo)})
    points = [points[0] - 1 - abs(points[0]), *points, points[-1] + 1 + abs(points[-1])]
    i, j = 0, len(points) - 1  # total(points[i]) = sum(upper) > 1 > sum(lower) = total(points[j])
    while j - i > 1:
        mid = (i + j) // 2
        if total(points[mid]) >= 1:
            i = mid
        else:
            j = mid
    a, b = points[i], points[j]
    fa, fb = total(a), total(b)
    tau = min(b, max(a, a + (fa - 1) * (b - a) / (fa - fb)))  # total is linear on [a, b]
    return tuple(min(h, max(l, x - tau)) for x, l, h in zip(t, lo, hi))


def rule_from_mapping(data: Mapping[str, Any] | None, source_names: Sequence[str]) -> AdaptiveRule:
    """The rule configured by the mapping under `mixture.schedule.adaptive`.

    Keys (all optional): `initial` (source name -> relative weight; missing sources 1.0),
    `minimum` and `maximum` (source name -> share; missing 0.0 and 1.0), `max_change`,
    `learning_rate`, `smoothing`, `delay_steps` (defaults as in `AdaptiveRule`).

    Args:
        data: The mapping; None reads as empty.
        source_names: The job's source names, in source order.
    Returns:
        The validated rule.
    Raises:
        ScheduleError: an unknown key, a value of the wrong type, a name that is no source, or
            an invalid rule; the field is the full path, e.g. "mixture.schedule.adaptive.minimum.webb".
    """
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ScheduleError(FIELD, "must be a mapping", data)
    for key in data:
        if key not in KEYS:
            raise ScheduleError(f"{FIELD}.{key}", f"unknown key; known keys: {', '.join(KEYS)}", data[key])
    names = _checked_names(source_names)
    initial, minimum, maximum = (
        _per_source(data.get(key), f"{FIELD}.{key}", names, default)
        for key, default in (("initial", 1.0), ("minimum", 0.0), ("maximum", 1.0))
    )
    scalars = {key: data[key] for key in KEYS[3:] if key in data}
    return AdaptiveRule(source_names=names, initial=initial, minimum=minimum, maximum=maximum, **scalars)


def adaptive_schedule(data: Mapping[str, Any] | None, source_names: Sequence[str]) -> AdaptiveSchedule:
    """The schedule of kind "adaptive" configured by `mixture.schedule.adaptive` (what
    `core.schedule.schedule_from_mapping` builds it with).

    Raises:
        ScheduleError: as `rule_from_mapping`.
    """
    return AdaptiveSchedule(rule_from_mapping(data, source_names))


def state_to_json(state: AdaptiveState) -> dict[str, Any]:
    """The state as JSON-ready data; `state_from_json` reads it back exactly."""
    return {
        "weights": list(state.weights),
        "ema": list(state.ema),
        "progress": list(state.progress),
        "reports": state.reports,
    }


def state_from_json(data: Mapping[str, Any]) -> AdaptiveState:
    """The state `state_to_json` wrote (after a JSON round trip: floats are exact).

    Raises:
        ScheduleError: field "mixture.adaptive state" for data of another shape.
    """
    if not isinstance(data, Mapping) or set(data) != {"weights", "ema", "progress", "reports"}:
        raise ScheduleError(_STATE, "must be a mapping with keys weights, ema, progress, reports", data)
    weights, ema, progress, reports = data["weights"], data["ema"], data["progress"], data["reports"]
    lists = (weights, ema, progress)
    if not all(isinstance(x, list) and len(x) == len(weights) for x in lists):
        raise ScheduleError(_STATE, "weights, ema and progress must be lists of one length", data)
    if not all(_is_number(w) and math.isfinite(w) for w in weights):
        raise ScheduleError(_STATE, "weights must be finite numbers", weights)
    if not all(x is None or (_is_number(x) and math.isfinite(x)) for x in (*ema, *progress)):
        raise ScheduleError(_STATE, "ema and progress must be finite numbers or null", data)
    if not _is_integer(reports) or reports < 0:
        raise ScheduleError(_STATE, "reports must be an integer >= 0", reports)
    return AdaptiveState(
        weights=tuple(float(w) for w in weights),
        ema=tuple(None if x is None else float(x) for x in ema),
        progress=tuple(None if x is None else float(x) for x in progress),
        reports=int(reports),
    )


class AdaptiveSchedule(Schedule):
    """The schedule the Mixture reads: the planner sets each step's weights before allocating it.

    Args:
        rule: The adaptation rule; gives the source names and `describe`.
    """

    def __init__(self, rule: AdaptiveRule) -> None:
        self.rule = rule
        self.source_names = rule.source_names
        self._weights: dict[int, Weights] = {}

    @property
    def num_sources(self) -> int:
        return len(self.source_names)

    def set(self, step: int, weights: Sequence[float]) -> None:
        """Sets (or replaces) the weights of step `step`.

        Raises:
            ScheduleError: a step that is not an integer >= 0, or not K finite weights >= 0
                with a positive sum.
        """
        if not _is_integer(step) or step < 0:
            raise ScheduleError(FIELD, "weights can be set only for an integer step >= 0", step)
        values = tuple(weights)
        if len(values) != self.num_sources or not all(_is_weight(w) for w in values) or not math.fsum(values) > 0:
            raise ScheduleError(FIELD, f"step {step} needs {self.num_sources} finite weights >= 0, not all 0", values)
        self._weights[int(step)] = tuple(float(w) for w in values)

    def weights_at(self, t: float) -> Weights:
        """The weights set for step floor(t).

        Raises:
            ScheduleError: none were set for that step (a planner bug), or t is not finite.
        """
        if not _is_number(t) or not math.isfinite(t):
            raise ScheduleError(FIELD, "the step position must be a finite number", t)
        step = math.floor(t)
        try:
            return self._weights[step]
        except KeyError:
            problem = f"no weights were set for step {step}; the planner must set them before allocating it"
            raise ScheduleError(FIELD, problem) from None

    def forget_before(self, step: int) -> None:
        """Drops the weights of the steps before `step`."""
        for old in [s for s in self._weights if s < step]:
            del self._weights[old]

    def describe(self) -> str:
        r = self.rule
        return (
            f"adaptive, initial {_format(r.initial, r.source_names)}; minimum {_format(r.minimum, r.source_names)}; "
            f"maximum {_format(r.maximum, r.source_names)}; max_change {r.max_change:g}, learning_rate "
            f"{r.learning_rate:g}, smoothing {r.smoothing:g}, delay_steps {r.delay_steps}"
        )


# ---- validation --------------------------------------------------------------------------


def _checked_names(names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ScheduleError("sources", "must be a sequence of source names", names)
    out = tuple(names)
    if not out or not all(isinstance(n, str) and n for n in out) or len(set(out)) != len(out):
        raise ScheduleError("sources", "must be at least one unique, non-empty source name", out)
    return out


def _checked_values(values: object, path: str, names: tuple[str, ...], what: str, ok: Any) -> Weights:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(names):
        raise ScheduleError(path, f"must be {len(names)} values, one per source", values)
    for name, value in zip(names, values):
        if not ok(value):
            raise ScheduleError(f"{path}.{name}", f"must be {what}", value)
    return tuple(float(v) for v in values)


def _check_scalar(value: object, key: str, what: str, ok: Any) -> None:
    if not _is_number(value) or not math.isfinite(value) or not ok(value):  # type: ignore[arg-type]
        raise ScheduleError(f"{FIELD}.{key}", f"must be {what}", value)


def _per_source(data: object, path: str, names: tuple[str, ...], default: float) -> Weights:
    """A mapping of source name -> number as K values, `default` for the missing names."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ScheduleError(path, "must be a mapping of source name to number", data)
    for name, value in data.items():
        if name not in names:
            raise ScheduleError(f"{path}.{name}", f"names no source; sources are {', '.join(names)}", value)
        if not _is_number(value):
            raise ScheduleError(f"{path}.{name}", "must be a number", value)
    return tuple(data.get(n, default) for n in names)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_weight(value: object) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= 0  # type: ignore[operator, arg-type]


def _is_share(value: object) -> bool:
    return _is_number(value) and 0 <= value <= 1  # type: ignore[operator]


def _format(values: Weights, names: tuple[str, ...]) -> str:
    return " ".join(f"{n}={v:g}" for n, v in zip(names, values))
