"""The operator's control loop against Kubernetes: every interval, for each DataPlane of its
namespace, reconcile the loader Deployments, observe the mixture, let the scaling policy decide
each group's replicas, apply them through the scale subresource and write the status.

One pass (`Operator.run_once(now)`):

1. List the namespace's DataPlanes and the Deployments labelled
   app.kubernetes.io/managed-by=batchplane-operator (and, of those, consider per DataPlane only
   the ones it owns; see `reconcile.owned`). A failed list ends the pass; the next one retries.
2. Per DataPlane: parse it (a bad spec gets Ready=False/Degraded=True with reason InvalidSpec
   and the field in the message, and no Deployment is touched); apply `reconcile.plan`'s
   actions; when its spec.scaling.intervalSeconds have passed since its last decision, read an
   observation (`ObservationSource`; Prometheus in production) and run `policy.decide` per
   group, scaling where the decision changes the replicas; write the status when it changed.
3. Errors are logged with the resource and HTTP status, counted in
   batchplane_operator_reconcile_errors_total, reported in the Degraded condition and as a
   Warning Event on the DataPlane, and retried in the next pass; one DataPlane's failure never
   stops the others or the loop. What it changes (Deployments created, updated, scaled,
   deleted) is a Normal Event. Events go through `recorder.EventRecorder` (deduplicated and
   rate-limited, see `events`).

With leader election (`leader.LeaderElection`), passes run only while this operator holds the
Lease; one that loses it stops before its next DataPlane and forgets its policy state.

The policy's state per group lives in memory: after a restart, or after another operator led
for a while, the operator starts again from the Deployments' replicas (moving averages and
interval counts start empty).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

from batchplane.operator import reconcile
from batchplane.operator.events import ObjectRef, dataplane_ref
from batchplane.operator.kubernetes import KubernetesError
from batchplane.operator.dataplane import DataPlaneSpec, SourceGroup, SpecError, parse_dataplane
from batchplane.operator.manifests import managed_selector
from batchplane.operator.metrics import OperatorMetrics
from batchplane.operator.policy import GroupState, Observation, decide, initial_state
from batchplane.operator.prometheus import Labels, PrometheusReader

log = logging.getLogger(__name__)

#: Seconds between passes when neither --interval-s nor any DataPlane says.
DEFAULT_PERIOD_S = 30.0
#: Seconds between two looks at the election while this operator stands by.
STANDBY_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Observed:
    """What an observation source saw of one DataPlane's job in one interval."""

    #: Sampling weight (share, 0..1) per source at the latest planned step.
    weights: Mapping[str, float]
    #: Samples per second the trainers consume (all sources).
    throughput: float
    #: The latest planned step, and steps per second; None: unknown (no scaling ahead).
    step: float | None = None
    step_rate: float | None = None
    #: Measured loader work per sample per source, in worker-seconds; missing: the profiled cost.
    cost_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: Realized share of samples per source (status.observedMixture); None: unknown.
    mixture: Mapping[str, float] | None = None


class ObservationSource(Protocol):
    """Where the loop reads a job's mixture and throughput from."""

    def observe(self, dataplane: DataPlaneSpec) -> Observed:
        """This interval's observation of `dataplane`'s job; raises when it cannot be read."""
        ...


class KubernetesApi(Protocol):
    """The calls the loop makes (`kubernetes.KubernetesClient`)."""

    def list_dataplanes(self, namespace: str) -> list[dict[str, Any]]: ...
    def patch_dataplane_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...
    def list_deployments(self, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...
    def create_deployment(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def patch_deployment(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...
    def scale_deployment(self, namespace: str, name: str, replicas: int) -> dict[str, Any]: ...
    def delete_deployment(self, namespace: str, name: str) -> dict[str, Any]: ...


class EventSink(Protocol):
    """Where the loop reports what it did and what failed (`recorder.EventRecorder`)."""

    def normal(self, ref: ObjectRef, reason: str, message: str) -> None: ...
    def warning(self, ref: ObjectRef, reason: str, message: str) -> None: ...
    def flush(self) -> None: ...


class PrometheusObservations:
    """Observations from Prometheus: the planner's and the loaders' metrics of one DataPlane,
    selected by the `namespace` and `pod` labels the usual scrape configurations attach (pods
    `<DataPlane>-planner-*` and `<DataPlane>-loader-*`, as the chart's dashboard selects them).

    Args:
        reader: The Prometheus client.
        rate_window_s: Window of the rates, in seconds (at least two scrape intervals).
    """

    def __init__(self, reader: PrometheusReader, *, rate_window_s: float = 120.0) -> None:
        if not (rate_window_s > 0 and math.isfinite(rate_window_s)):
            raise ValueError(f"rate_window_s: must be > 0, got {rate_window_s!r}")
        self.reader = reader
        self.window = f"{max(round(rate_window_s * 1000), 1)}ms"

    def queries(self, dataplane: DataPlaneSpec) -> dict[str, str]:
        """The PromQL queries of one observation, by what they read."""
        planner = f'namespace="{dataplane.namespace}",pod=~"{dataplane.name}-planner-.+"'
        loaders = f'namespace="{dataplane.namespace}",pod=~"{dataplane.name}-loader-.+"'
        w = self.window
        return {
            "weights": f"max by (source) (batchplane_planner_mixture_weight_ratio{{{planner}}})",
            "rates": f"sum by (source) (rate(batchplane_planner_samples_total{{{planner}}}[{w}]))",
            "step": f"max(batchplane_planner_step{{{planner}}})",
            "step_rate": f"sum(rate(batchplane_planner_steps_planned_total{{{planner}}}[{w}]))",
            "cost": (
                f"sum by (source) (rate(batchplane_loader_read_seconds_total{{{loaders}}}[{w}]))"
                f" / sum by (source) (rate(batchplane_loader_samples_read_total{{{loaders}}}[{w}]))"
            ),
        }

    def observe(self, dataplane: DataPlaneSpec) -> Observed:
        """Raises `prometheus.PrometheusError` when Prometheus cannot be read."""
        q = self.queries(dataplane)
        weights = _by_source(self.reader.instant(q["weights"]))
        rates = _by_source(self.reader.instant(q["rates"]))
        total = sum(v for v in rates.values() if math.isfinite(v) and v > 0)
        cost = {s: c for s, c in _by_source(self.reader.instant(q["cost"])).items() if math.isfinite(c) and c >= 0}
        return Observed(
            weights=weights,
            throughput=total if rates else math.nan,
            step=_scalar(self.reader.instant(q["step"])),
            step_rate=_scalar(self.reader.instant(q["step_rate"])),
            cost_s=cost,
            mixture={s: max(v, 0.0) / total for s, v in rates.items() if math.isfinite(v)} if total > 0 else None,
        )


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What one pass did."""

    #: DataPlanes seen.
    dataplanes: int
    #: Steps that failed (API requests, bad specs, unreadable metrics, unexpected errors).
    errors: int


class _DataPlaneLog(logging.LoggerAdapter):
    """Names the DataPlane in the message, and as the record's `dataplane` field (JSON logs)."""

    def process(self, msg: str, kwargs: MutableMapping[str, Any]) -> tuple[str, MutableMapping[str, Any]]:
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return f"DataPlane {self.extra['dataplane']}: {msg}", kwargs


def utc_now() -> str:
    """The wall-clock time as RFC 3339, for condition timestamps."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Operator:
    """Reconciles and scales the DataPlanes of one namespace.

    Args:
        api: The Kubernetes API.
        observations: Where mixtures and throughput come from.
        metrics: The operator's metrics.
        namespace: The namespace it serves.
        interval_s: Seconds between passes; None: the smallest spec.scaling.intervalSeconds of
            the DataPlanes (30 without any).
        wall_clock: The time for condition timestamps (RFC 3339).
        events: Where Events go; None: none are written.
        leading: Whether this operator leads (leader election); None: always.
    """

    def __init__(
        self,
        api: KubernetesApi,
        observations: ObservationSource,
        metrics: OperatorMetrics,
        *,
        namespace: str,
        interval_s: float | None = None,
        wall_clock: Callable[[], str] = utc_now,
        events: EventSink | None = None,
        leading: Callable[[], bool] | None = None,
    ) -> None:
        if interval_s is not None and not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"interval_s: must be > 0, got {interval_s!r}")
        self.api = api
        self.observations = observations
        self.metrics = metrics
        self.namespace = namespace
        self.interval_s = interval_s
        self.wall_clock = wall_clock
        self.events = events
        self.leading = leading or (lambda: True)
        self.period_s = interval_s or DEFAULT_PERIOD_S
        #: Policy state per (DataPlane uid, group).
        self._states: dict[tuple[str, str], GroupState] = {}
        #: When each DataPlane (by uid) last got a scaling decision, in the loop's clock.
        self._decided: dict[str, float] = {}
        #: Groups with metrics per DataPlane uid: (name, groups).
        self._groups: dict[str, tuple[str, set[str]]] = {}

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        """Runs passes every `period_s` while this operator leads, until `stop` is set."""
        led = False
        while not stop.is_set():
            started = clock()
            if self.leading():
                led = True
                self.run_once(started)
                wait = self.period_s - (clock() - started)
            else:
                if led:
                    self.step_down()
                    led = False
                wait = STANDBY_POLL_S
            stop.wait(max(wait, 0.0))

    def step_down(self) -> None:
        """Forgets what it decided while leading (another operator decides now): the policy
        state, the decision times and the group gauges."""
        for name, groups in self._groups.values():
            for group in groups:
                self.metrics.forget_group(name, group)
        self._groups.clear()
        self._states.clear()
        self._decided.clear()

    def run_once(self, now: float) -> PassResult:
        """One pass over the namespace's DataPlanes.

        Args:
            now: The loop's clock in seconds (monotonic; only differences are used).
        """
        try:
            dataplanes = self.api.list_dataplanes(self.namespace)
            deployments = self.api.list_deployments(self.namespace, managed_selector())
        except KubernetesError as exc:
            log.error("cannot list the namespace's DataPlanes and loader Deployments, retrying in %.0f s: %s", self.period_s, exc)
            self.metrics.errors.labels("api").inc()
            return PassResult(0, 1)
        errors, seen, intervals = 0, set(), []
        for obj in dataplanes:
            meta = obj.get("metadata") or {}
            where = _DataPlaneLog(log, {"dataplane": f"{self.namespace}/{meta.get('name', '?')}"})
            if not self.leading():
                where.warning("no longer leading: this pass stops here, the new leader reconciles")
                return PassResult(len(dataplanes), errors)
            seen.add(meta.get("uid"))
            try:
                failed, interval = self._reconcile(obj, deployments, now, where)
            except Exception as exc:  # noqa: BLE001 - one DataPlane must not stop the others
                where.exception("reconciling failed unexpectedly; retrying in the next pass")
                self.metrics.errors.labels("internal").inc()
                self._warn(
                    obj, "ReconcileError", f"reconciling failed unexpectedly, retrying in the next pass: {type(exc).__name__}: {exc}"
                )
                failed, interval = 1, None
            errors += failed
            if interval is not None:
                intervals.append(interval)
        self._forget(seen)
        self.period_s = self.interval_s or min(intervals, default=DEFAULT_PERIOD_S)
        if self.events is not None:
            self.events.flush()
        return PassResult(len(dataplanes), errors)

    # ---- one DataPlane ------------------------------------------------------------------------------

    def _reconcile(
        self, obj: Mapping[str, Any], deployments: list[dict[str, Any]], now: float, where: logging.LoggerAdapter
    ) -> tuple[int, float | None]:
        """Returns (failed steps, the DataPlane's scaling interval or None when invalid)."""
        previous = obj.get("status") or {}
        try:
            spec = parse_dataplane(obj)
        except SpecError as exc:
            where.warning("invalid spec, its loader Deployments are left as they are: %s", exc)
            self.metrics.errors.labels("invalid_spec").inc()
            self._warn(obj, "InvalidSpec", f"invalid spec, its loader Deployments are left as they are: {exc}")
            generation = (obj.get("metadata") or {}).get("generation", 0)
            wanted = [
                reconcile.Condition("Ready", False, "InvalidSpec", str(exc)),
                reconcile.Condition("Degraded", True, "InvalidSpec", str(exc)),
            ]
            conds = reconcile.conditions(wanted, previous.get("conditions"), now=self.wall_clock(), generation=generation)
            new = reconcile.status(generation=generation, groups=None, mixture=None, conditions=conds, previous=previous)
            return 1 + self._write_status(obj, previous, new, where), None

        problems: list[tuple[str, str]] = []
        plan = reconcile.plan(spec, deployments)
        replicas = {v.name: v.replicas for v in plan.groups}
        missing = set()
        for action in plan.actions:
            try:
                self._apply(obj, spec, action, where)
            except KubernetesError as exc:
                where.error("%s failed (%s), retrying in the next pass: %s", type(action).__name__.lower(), action.why, exc)
                self.metrics.errors.labels("api").inc()
                conflict = isinstance(action, reconcile.Create) and exc.status == 409
                if conflict:
                    msg = f"Deployment {action.name} exists but was not made by the operator for this DataPlane; it is left alone"
                    problems.append(("NameConflict", msg))
                else:
                    problems.append(("ApiError", str(exc)))
                if isinstance(action, reconcile.Create):
                    missing.add(action.group)
                elif isinstance(action, reconcile.Scale):
                    replicas[action.group] = action.previous

        observed: Observed | None = None
        due = self._due(spec, now)
        if due:
            self._decided[spec.uid] = now
            try:
                observed = self.observations.observe(spec)
            except Exception as exc:  # noqa: BLE001 - any failure to observe holds the replicas
                where.warning("cannot observe the mixture, holding the replicas: %s", exc)
                self.metrics.errors.labels("metrics").inc()
                problems.append(("MetricsUnavailable", f"cannot observe the mixture: {exc}"))
        observation = _observation(spec, observed)

        ready = {v.name: v.ready for v in plan.groups}
        deployments_by_group = {v.name: v.deployment for v in plan.groups}
        groups, reasons = [], {}
        for group in spec.groups:
            if group.name in missing:
                groups.append(reconcile.GroupStatus(group.name, 0, group.min_replicas))
                continue
            state = self._state(spec, group, replicas[group.name])
            if due:
                decision = decide(state, observation, now)
                if decision.changed:
                    try:
                        self.api.scale_deployment(spec.namespace, deployments_by_group[group.name], decision.replicas)
                    except KubernetesError as exc:
                        where.error(
                            "scaling group %s %d -> %d failed, retrying in the next pass: %s",
                            group.name,
                            decision.previous,
                            decision.replicas,
                            exc,
                        )
                        self.metrics.errors.labels("api").inc()
                        problems.append(("ApiError", str(exc)))
                    else:
                        where.info("group %s: %s", group.name, decision.reason)
                        self._note(obj, "Scaled", f"group {group.name}: {decision.reason}")
                        self.metrics.scaled(spec.name, group.name, decision.previous, decision.replicas)
                        reasons[group.name] = decision.reason
                        state = decision.state
                else:
                    where.debug("group %s: %s", group.name, decision.reason)
                    state = decision.state
                self._states[(spec.uid, group.name)] = state
            groups.append(reconcile.GroupStatus(group.name, ready[group.name], state.replicas))
            self.metrics.set_group(spec.name, group.name, desired=state.replicas, ready=ready[group.name])
        self._track(spec)

        wanted = [reconcile.ready_condition(groups), reconcile.scaling_condition(groups, reasons), reconcile.degraded_condition(problems)]
        conds = reconcile.conditions(wanted, previous.get("conditions"), now=self.wall_clock(), generation=spec.generation)
        mixture = observed.mixture if observed is not None else None
        new = reconcile.status(generation=spec.generation, groups=groups, mixture=mixture, conditions=conds, previous=previous)
        for reason, message in problems:
            self._warn(obj, reason, message)
        failed = sum(1 for reason, _ in problems if reason != "MetricsUnavailable") + (1 if due and observed is None else 0)
        return failed + self._write_status(obj, previous, new, where), spec.interval_s

    def _apply(self, obj: Mapping[str, Any], spec: DataPlaneSpec, action: reconcile.Action, where: logging.LoggerAdapter) -> None:
        ns = spec.namespace
        if isinstance(action, reconcile.Create):
            self.api.create_deployment(ns, action.body)
            where.info("created %s with %d replicas: %s", action.name, action.body["spec"]["replicas"], action.why)
            self._note(obj, "DeploymentCreated", f"created {action.name} with {action.body['spec']['replicas']} replicas: {action.why}")
        elif isinstance(action, reconcile.Update):
            self.api.patch_deployment(ns, action.name, action.patch)
            where.info("updated %s: %s", action.name, action.why)
            self._note(obj, "DeploymentUpdated", f"updated {action.name}: {action.why}")
        elif isinstance(action, reconcile.Scale):
            self.api.scale_deployment(ns, action.name, action.replicas)
            self.metrics.scaled(spec.name, action.group, action.previous, action.replicas)
            where.info("scaled %s %d -> %d: %s", action.name, action.previous, action.replicas, action.why)
            self._note(obj, "Scaled", f"scaled {action.name} {action.previous} -> {action.replicas}: {action.why}")
        else:
            self.api.delete_deployment(ns, action.name)
            self.metrics.forget_group(spec.name, action.group)
            self._states.pop((spec.uid, action.group), None)
            where.info("deleted %s: %s", action.name, action.why)
            self._note(obj, "DeploymentDeleted", f"deleted {action.name}: {action.why}")

    def _write_status(
        self, obj: Mapping[str, Any], previous: Mapping[str, Any], new: Mapping[str, Any], where: logging.LoggerAdapter
    ) -> int:
        """Patches the status when it changed; returns 1 when that failed."""
        patch = reconcile.status_patch(previous, new)
        if patch is None:
            return 0
        try:
            self.api.patch_dataplane_status(self.namespace, obj["metadata"]["name"], patch)
        except KubernetesError as exc:
            where.error("writing the status failed, retrying in the next pass: %s", exc)
            self.metrics.errors.labels("api").inc()
            self._warn(obj, "ApiError", f"writing the status failed, retrying in the next pass: {exc}")
            return 1
        return 0

    def _note(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        """A Normal Event on the DataPlane: something the operator did."""
        if self.events is not None:
            self.events.normal(dataplane_ref(obj, self.namespace), reason, message)

    def _warn(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        """A Warning Event on the DataPlane: something that failed."""
        if self.events is not None:
            self.events.warning(dataplane_ref(obj, self.namespace), reason, message)

    # ---- state ------------------------------------------------------------------------------------

    def _due(self, spec: DataPlaneSpec, now: float) -> bool:
        """Whether the DataPlane's scaling interval has passed (within half a pass)."""
        last = self._decided.get(spec.uid)
        return last is None or now - last >= spec.interval_s - self.period_s / 2

    def _state(self, spec: DataPlaneSpec, group: SourceGroup, replicas: int) -> GroupState:
        """The group's policy state, following its spec and its Deployment's replicas."""
        key = (spec.uid, group.name)
        wanted = spec.group_spec(group)
        state = self._states.get(key)
        if state is None:
            state = initial_state(wanted, replicas)
        else:
            if state.spec != wanted:
                keep = state.history if state.spec.sources == wanted.sources else ()
                state = dataclasses.replace(state, spec=wanted, history=keep)
            if state.replicas != replicas:  # scaled by someone else, or clamped: start from there
                state = dataclasses.replace(state, replicas=replicas, up_intervals=0, down_intervals=0)
        self._states[key] = state
        return state

    def _track(self, spec: DataPlaneSpec) -> None:
        names = {g.name for g in spec.groups}
        _, before = self._groups.get(spec.uid, (spec.name, set()))
        for gone in before - names:
            self.metrics.forget_group(spec.name, gone)
            self._states.pop((spec.uid, gone), None)
        self._groups[spec.uid] = (spec.name, names)

    def _forget(self, seen: set[str]) -> None:
        """Drops state and metrics of DataPlanes that are gone."""
        for uid in list(self._groups):
            if uid not in seen:
                name, groups = self._groups.pop(uid)
                for group in groups:
                    self.metrics.forget_group(name, group)
        self._states = {k: v for k, v in self._states.items() if k[0] in seen}
        self._decided = {k: v for k, v in self._decided.items() if k in seen}


def _observation(spec: DataPlaneSpec, observed: Observed | None) -> Observation:
    """The policy's observation; without data, one that holds every group."""
    if observed is None:
        return Observation(weights={}, throughput=math.nan)
    return Observation(
        weights=dict(observed.weights),
        throughput=observed.throughput,
        step=observed.step,
        step_rate=observed.step_rate,
        schedule=spec.schedule,
        cost_s=dict(observed.cost_s),
    )


def _by_source(values: Mapping[Labels, float]) -> dict[str, float]:
    out = {}
    for labels, value in values.items():
        source = dict(labels).get("source")
        if source is not None:
            out[source] = value
    return out


def _scalar(values: Mapping[Labels, float]) -> float | None:
    value = next(iter(values.values()), None)
    return value if value is not None and math.isfinite(value) else None
