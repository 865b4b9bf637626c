"""Per-source weight schedules: the target mixture as a function of the step. Pure; no I/O.

The one module of schedule semantics: the planner's mixture follows these schedules, and the
operator reads a DataPlane's declared schedule with them to scale ahead of a change.

A schedule maps a step position `t` to one weight per source, in source order. `t` is a float:
step `s` is position `s`, and with microbatch granularity microbatch `m` of `M` is position
`s + m / M` (see `mixture`). Four kinds:

- `Static`: the same weights at every step.
- `Staged`: piecewise constant; the weights of the last stage that starts at or before `t`.
- `Curriculum`: piecewise linear between anchor steps, constant before the first anchor and
  after the last.
- `FromCallable`: a user function of `t`, checked on every call.

Every schedule is a pure, deterministic function of `t`: the same on every rank and in every
replay (I4), which is what lets a resumed job fast-forward the mixture without data. Weights
are relative; the mixture renormalizes them over the sources that still have data.

Schedules validate themselves when built and raise `ScheduleError`, whose message names the
configuration field and the bad entry, e.g.
``mixture.schedule.stages[1].start: must be > 0 and increasing, got 0``.
`schedule_from_mapping` builds a schedule from the job configuration's `mixture` mapping
(`KINDS` is the list of kinds the configuration, the planner and the operator read); kind
"adaptive" is built by the planner's `batchplane.planner.adaptive`, which it passes in.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Weights = tuple[float, ...]
WeightsFn = Callable[[float], "Mapping[str, float] | Sequence[float]"]

#: How often the mixture reads the schedule: once per step, or once per microbatch.
GRANULARITIES = ("step", "microbatch")
#: The values of `mixture.schedule.kind`.
KINDS = ("static", "staged", "curriculum", "callable", "adaptive")
#: The weight of a source a weights mapping does not name.
DEFAULT_WEIGHT = 1.0

_NO_VALUE = object()
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class ScheduleError(ValueError):
    """A bad schedule: a bad configuration value, or a callable that returned bad weights.

    Args:
        field: Dotted path of the field, e.g. "mixture.schedule.stages[1].start".
        problem: What is wrong, e.g. "must be > 0 and increasing".
        value: The offending value; left out of the message when not given.
    """

    def __init__(self, field: str, problem: str, value: Any = _NO_VALUE) -> None:
        self.field = field
        self.problem = problem
        self.value = None if value is _NO_VALUE else value
        got = "" if value is _NO_VALUE else f", got {value!r}"
        super().__init__(f"{field}: {problem}{got}")


class Schedule(abc.ABC):
    """Per-source weights as a pure function of the step position."""

    source_names: tuple[str, ...]

    @property
    @abc.abstractmethod
    def num_sources(self) -> int:
        """K, the number of weights `weights_at` returns."""

    @abc.abstractmethod
    def weights_at(self, t: float) -> Weights:
        """The K weights (finite, >= 0, not all 0) at step position `t`."""

    @abc.abstractmethod
    def describe(self) -> str:
        """A short human description for logs."""


@dataclasses.dataclass(frozen=True)
class Static(Schedule):
    """The same weights at every step.

    Args:
        weights: Weight per source.
        source_names: Source names, for messages and `describe`; optional.
    Raises:
        ScheduleError: a weight that is not a finite number >= 0, or all weights 0.
    """

    weights: Weights
    source_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = _checked_names(self.source_names, "mixture.weights")
        object.__setattr__(self, "source_names", names)
        object.__setattr__(self, "weights", _checked_weights(self.weights, "mixture.weights", names))

    @property
    def num_sources(self) -> int:
        return len(self.weights)

    def weights_at(self, t: float) -> Weights:
        return self.weights

    def describe(self) -> str:
        return f"static {_format(self.weights, self.source_names)}"


@dataclasses.dataclass(frozen=True)
class Staged(Schedule):
    """Piecewise-constant weights: stage i holds from its start to the next stage's start.

    Args:
        stages: (start_step, weights) pairs; the first starts at 0, starts increase.
        source_names: Source names, for messages and `describe`; optional.
    Raises:
        ScheduleError: no stages, a first start other than 0, a start that does not increase,
            or bad weights (see `Static`).
    """

    stages: tuple[tuple[int, Weights], ...]
    source_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = _checked_names(self.source_names, "mixture.schedule.stages")
        object.__setattr__(self, "source_names", names)
        object.__setattr__(self, "stages", _checked_points(self.stages, "mixture.schedule.stages", "start", names))

    @property
    def num_sources(self) -> int:
        return len(self.stages[0][1])

    def weights_at(self, t: float) -> Weights:
        """The weights of the last stage starting at or before `t` (the first stage for t < 0)."""
        i = bisect.bisect_right(self.stages, t, key=_first) - 1
        return self.stages[max(i, 0)][1]

    def describe(self) -> str:
        parts = "; ".join(f"from step {start}: {_format(w, self.source_names)}" for start, w in self.stages)
        return f"staged, {len(self.stages)} stages: {parts}"


@dataclasses.dataclass(frozen=True)
class Curriculum(Schedule):
    """Piecewise-linear weights between anchors; the first anchor's weights before it, the
    last anchor's after it.

    Args:
        anchors: (step, weights) pairs, at least one, steps >= 0 and strictly increasing.
        source_names: Source names, for messages and `describe`; optional.
    Raises:
        ScheduleError: no anchors, a step that does not increase, or bad weights (see `Static`).
    """

    anchors: tuple[tuple[int, Weights], ...]
    source_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = _checked_names(self.source_names, "mixture.schedule.anchors")
        object.__setattr__(self, "source_names", names)
        object.__setattr__(self, "anchors", _checked_points(self.anchors, "mixture.schedule.anchors", "step", names))

    @property
    def num_sources(self) -> int:
        return len(self.anchors[0][1])

    def weights_at(self, t: float) -> Weights:
        """Between anchors (a, wa) and (b, wb): wa * (1 - f) + wb * f with f = (t - a) / (b - a)
        (the anchors' shares, where subnormal weights would underflow to all 0).

        At an anchor's own step the result is exactly its weights, and it never goes below 0.
        """
        i = bisect.bisect_right(self.anchors, t, key=_first)
        if i == 0:
            return self.anchors[0][1]
        if i == len(self.anchors):
            return self.anchors[-1][1]
        (a, wa), (b, wb) = self.anchors[i - 1], self.anchors[i]
        f = (t - a) / (b - a)
        out = tuple(x * (1 - f) + y * f for x, y in zip(wa, wb))
        if sum(out) > 0:
            return out
        # Subnormal weights can underflow to all 0: interpolate the anchors' shares instead.
        sa, sb = sum(wa), sum(wb)
        return tuple(x / sa * (1 - f) + y / sb * f for x, y in zip(wa, wb))

    def describe(self) -> str:
        parts = "; ".join(f"step {step}: {_format(w, self.source_names)}" for step, w in self.anchors)
        return f"curriculum, linear between {len(self.anchors)} anchors: {parts}"


@dataclasses.dataclass(frozen=True)
class FromCallable(Schedule):
    """Weights from a user function of the step position, checked on every call.

    The function must be pure and deterministic (I4); it is called once here, at step 0, so
    that a broken one fails when the job starts.

    Args:
        fn: t -> a mapping of source name to weight (missing names get 0), or K weights.
        name: How messages and logs name the function, e.g. its import path.
        source_names: The K source names, in source order.
    Raises:
        ScheduleError: no or duplicate source names, `fn` not callable, or a bad result at
            step 0 (see `weights_at`).
    """

    fn: WeightsFn
    name: str
    source_names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "source_names", _checked_names(self.source_names, "mixture.schedule.callable"))
        if not self.source_names:
            raise ScheduleError("mixture.schedule.callable", "needs the source names", self.source_names)
        if not callable(self.fn):
            raise ScheduleError("mixture.schedule.callable", "must name a callable", self.name)
        self.weights_at(0.0)

    @property
    def num_sources(self) -> int:
        return len(self.source_names)

    def weights_at(self, t: float) -> Weights:
        """`fn(t)` as K weights.

        Raises:
            ScheduleError: `fn` raised, or returned something other than finite weights >= 0
                and not all 0 for known sources; the message names the step.
        """
        try:
            result = self.fn(t)
        except Exception as exc:  # noqa: BLE001 - any failure of user code is a schedule error
            raise self._error(f"raised {exc!r}", t) from exc
        return self._weights_of(result, t)

    def describe(self) -> str:
        return f"callable {self.name!r} over sources {', '.join(self.source_names)}"

    def _weights_of(self, result: object, t: float) -> Weights:
        if isinstance(result, Mapping):
            unknown = [key for key in result if key not in self.source_names]
            if unknown:
                raise self._error(f"returned {dict(result)!r}", t, f"{unknown[0]!r} names no source")
            values: Sequence[object] = [result.get(n, 0.0) for n in self.source_names]
        else:
            try:
                values = [] if isinstance(result, (str, bytes)) else list(result)  # type: ignore[call-overload]
            except TypeError:
                values = []
            if not values:
                raise self._error(f"returned {result!r}", t, "expected a mapping of source name to weight or K weights")
        problem = _weights_problem(values, self.num_sources)
        if problem:
            raise self._error(f"returned {result!r}", t, problem)
        return tuple(float(w) for w in values)  # type: ignore[arg-type]

    def _error(self, what: str, t: float, why: str = "") -> ScheduleError:
        because = f": {why}" if why else ""
        return ScheduleError("mixture.schedule", f"callable {self.name!r} {what} at step {_step_text(t)}{because}")


def schedule_from_mapping(
    data: Mapping[str, Any],
    source_names: Sequence[str],
    *,
    resolve_callable: Callable[[str], Callable[..., Any]] | None = None,
    build_adaptive: Callable[[Any, tuple[str, ...]], Schedule] | None = None,
) -> tuple[Schedule, str]:
    """The schedule and granularity configured by the job's `mixture` mapping.

    Without `schedule`, `weights` gives static weights. With it, `schedule.kind` picks the kind
    and `schedule.granularity` ("step", the default, or "microbatch") how often it is read;
    staged and curriculum schedules give their weights in their stages or anchors, and
    `weights` must then be absent or empty. Every weights mapping gives weight 1.0
    (`DEFAULT_WEIGHT`) to the sources it does not name, in every stage and anchor alike; a
    callable's mapping gives them 0. Kind "adaptive" gives an `adaptive.AdaptiveSchedule`
    whose weights the planner sets step by step from training reports, configured by
    `schedule.adaptive` and built by `build_adaptive` (see `adaptive.rule_from_mapping`).

    Args:
        data: The content of the configuration's `mixture` mapping.
        source_names: The job's source names, in source order.
        resolve_callable: Imports a "module:function" path for kind "callable".
        build_adaptive: Builds kind "adaptive" from `schedule.adaptive` (None when absent) and
            the source names; None refuses the kind.
    Returns:
        (schedule, granularity).
    Raises:
        ScheduleError: an unknown key, a value of the wrong type, an unknown source name, or an
            invalid schedule; the message names the field path, e.g.
            ``mixture.schedule.anchors[2].weights.webb: names no source``.
    """
    names = _checked_names(source_names, "sources")
    _check_keys(data, "mixture", ("weights", "schedule"))
    spec = data.get("schedule")
    weights = data.get("weights")
    if spec is None:
        return Static(_weights_from(weights, "mixture.weights", names), source_names=names), "step"
    _check_keys(spec, "mixture.schedule", ("kind", "granularity", "stages", "anchors", "callable", "adaptive"))
    kind = _choice(spec.get("kind"), "mixture.schedule.kind", KINDS)
    granularity = _choice(spec.get("granularity", "step"), "mixture.schedule.granularity", GRANULARITIES)
    wanted = {"static": None, "staged": "stages", "curriculum": "anchors", "callable": "callable", "adaptive": "adaptive"}[kind]
    for key in ("stages", "anchors", "callable", "adaptive"):
        if key in spec and key != wanted:
            raise ScheduleError(f"mixture.schedule.{key}", f"is not used by kind {kind!r}", spec[key])
    if wanted is not None and wanted not in spec and kind != "adaptive":  # every adaptive setting has a default
        raise ScheduleError(f"mixture.schedule.{wanted}", f"is required by kind {kind!r}")
    if kind != "static" and weights:
        raise ScheduleError("mixture.weights", f"cannot be combined with a {kind} schedule; give the weights in mixture.schedule", weights)
    if kind == "static":
        return Static(_weights_from(weights, "mixture.weights", names), source_names=names), granularity
    if kind == "callable":
        return _callable_from(spec["callable"], names, resolve_callable), granularity
    if kind == "adaptive":
        if build_adaptive is None:
            raise ScheduleError("mixture.schedule.kind", "'adaptive' can be built only by the planner", kind)
        return build_adaptive(spec.get("adaptive"), names), granularity
    points = _points_from(spec[wanted], f"mixture.schedule.{wanted}", "start" if kind == "staged" else "step", names)
    if kind == "staged":
        return Staged(points, source_names=names), granularity
    return Curriculum(points, source_names=names), granularity


# ---- building from configuration ---------------------------------------------------------


def _check_keys(data: object, path: str, known: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping):
        raise ScheduleError(path, "must be a mapping", data)
    for key in data:
        if key not in known:
            raise ScheduleError(f"{path}.{key}", f"unknown key; known keys: {', '.join(known)}", data[key])


def _choice(value: object, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ScheduleError(path, f"must be one of {', '.join(choices)}", value)
    return value


def _weights_from(data: object, path: str, names: tuple[str, ...]) -> Weights:
    """A weights mapping (name -> weight, missing names 1.0) as K weights."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ScheduleError(path, "must be a mapping of source name to weight", data)
    for name, w in data.items():
        if name not in names:
            raise ScheduleError(f"{path}.{name}", f"names no source; sources are {', '.join(names)}", w)
        if not _is_number(w) or not math.isfinite(w) or w < 0:
            raise ScheduleError(f"{path}.{name}", "must be a finite number >= 0", w)
    return _checked_weights(tuple(float(data.get(n, DEFAULT_WEIGHT)) for n in names), path, names)


def _points_from(data: object, path: str, key: str, names: tuple[str, ...]) -> tuple[tuple[int, Weights], ...]:
    """A list of {key: step, weights: {...}} mappings as (step, weights) pairs."""
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Sequence) or not data:
        raise ScheduleError(path, f"must be a non-empty list of {{{key}, weights}} mappings", data)
    points = []
    for i, item in enumerate(data):
        _check_keys(item, f"{path}[{i}]", (key, "weights"))
        if key not in item:
            raise ScheduleError(f"{path}[{i}].{key}", "is required")
        points.append((item[key], _weights_from(item.get("weights"), f"{path}[{i}].weights", names)))
    return tuple(points)


def _callable_from(path: object, names: tuple[str, ...], resolve: Callable[[str], Callable[..., Any]] | None) -> FromCallable:
    field = "mixture.schedule.callable"
    if not isinstance(path, str) or not _IMPORT_PATH.fullmatch(path):
        raise ScheduleError(field, "must be an import path 'module:function'", path)
    if resolve is None:
        raise ScheduleError(field, "cannot be imported here: no resolver was given", path)
    try:
        fn = resolve(path)
    except Exception as exc:  # noqa: BLE001 - whatever the import raised, the field is bad
        raise ScheduleError(field, f"cannot be imported: {exc}", path) from exc
    return FromCallable(fn, path, names)


# ---- validation --------------------------------------------------------------------------


def _checked_names(names: Sequence[str], path: str) -> tuple[str, ...]:
    names = tuple(names)
    if len(set(names)) != len(names):
        raise ScheduleError(path, "source names must be unique", names)
    return names


def _checked_points(points: object, path: str, key: str, names: tuple[str, ...]) -> tuple[tuple[int, Weights], ...]:
    """Stages or anchors: (step, weights) pairs; steps start at 0 (stages) or >= 0 (anchors)
    and strictly increase, every pair has the same number of valid weights. A step out of order
    is named before a first stage that does not start at 0."""
    if not isinstance(points, Sequence) or not points:
        raise ScheduleError(path, f"must have at least one ({key}, weights) pair", points)
    out: list[tuple[int, Weights]] = []
    for i, point in enumerate(points):
        if not isinstance(point, Sequence) or len(point) != 2:
            raise ScheduleError(f"{path}[{i}]", f"must be a ({key}, weights) pair", point)
        step, weights = point
        field = f"{path}[{i}].{key}"
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ScheduleError(field, "must be an integer", step)
        if i == 0 and step < 0:
            raise ScheduleError(field, "must be >= 0", step)
        if i > 0 and step <= out[-1][0]:
            raise ScheduleError(field, f"must be > {out[-1][0]} and increasing", step)
        checked = _checked_weights(weights, f"{path}[{i}].weights", names)
        if out and len(checked) != len(out[0][1]):
            raise ScheduleError(f"{path}[{i}].weights", f"must have {len(out[0][1])} weights like {path}[0]", weights)
        out.append((int(step), checked))
    if key == "start" and out[0][0] != 0:
        raise ScheduleError(f"{path}[0].start", "must be 0 (the first stage starts the job)", out[0][0])
    return tuple(out)


def _checked_weights(weights: object, path: str, names: tuple[str, ...]) -> Weights:
    """K finite weights >= 0, not all 0, as floats; K = len(names) when names are given."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ScheduleError(path, "must be a sequence of weights, one per source", weights)
    for k, w in enumerate(weights):
        if not _is_number(w) or not math.isfinite(w) or w < 0:
            entry = f"{path}.{names[k]}" if k < len(names) else f"{path}[{k}]"
            raise ScheduleError(entry, "must be a finite number >= 0", w)
    problem = _weights_problem(weights, len(names) if names else len(weights))
    if problem:
        raise ScheduleError(path, problem, tuple(weights))
    return tuple(float(w) for w in weights)


def _weights_problem(values: Sequence[object], num_sources: int) -> str:
    """What is wrong with `values` as K weights, or "" when nothing is."""
    if len(values) != num_sources:
        return f"must have {num_sources} weights, one per source, not {len(values)}"
    if num_sources == 0:
        return "must have at least one source"
    for w in values:
        if not _is_number(w) or not math.isfinite(w) or w < 0:  # type: ignore[arg-type,operator]  # _is_number(w): a real
            return f"every weight must be a finite number >= 0, not {w!r}"
    total = sum(values)  # type: ignore[arg-type]
    if total <= 0:
        return "must give at least one source a weight > 0"
    if not math.isfinite(total):
        return "must have a finite sum"
    return ""


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ---- formatting --------------------------------------------------------------------------


def _first(pair: tuple[int, Weights]) -> int:
    return pair[0]


def _format(weights: Weights, names: tuple[str, ...]) -> str:
    if names:
        return " ".join(f"{n}={w:g}" for n, w in zip(names, weights))
    return "(" + ", ".join(f"{w:g}" for w in weights) + ")"


def _step_text(t: float) -> str:
    return str(int(t)) if float(t).is_integer() else repr(float(t))
