"""The operator's own Prometheus metrics, served on --metrics-port.

batchplane_operator_desired_replicas{dataplane,group}      replicas the operator set
batchplane_operator_replicas{dataplane,group}              ready loader pods it saw
batchplane_operator_scale_events_total{dataplane,group,direction}   replica changes it made
batchplane_operator_reconcile_errors_total{reason}         failed steps of a pass
batchplane_operator_leader                                 1 while it leads (reconciles), else 0
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class OperatorMetrics:
    """The metrics of one operator process.

    Args:
        registry: Where to register them (a fresh one per process or test).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge(
            "batchplane_operator_desired_replicas",
            "Loader replicas the operator set for a source group (the Deployment's spec.replicas), "
            "by DataPlane (its name) and group (the source group's name).",
            ["dataplane", "group"],
            registry=registry,
        )
        self.replicas = Gauge(
            "batchplane_operator_replicas",
            "Ready loader pods of a source group as the operator last saw them, by DataPlane (its name) "
            "and group (the source group's name).",
            ["dataplane", "group"],
            registry=registry,
        )
        self.scale_events = Counter(
            "batchplane_operator_scale_events_total",
            "Replica changes the operator made to a loader Deployment, by DataPlane (its name), group (the "
            "source group's name) and direction (up or down; bounds clamps included).",
            ["dataplane", "group", "direction"],
            registry=registry,
        )
        self.errors = Counter(
            "batchplane_operator_reconcile_errors_total",
            "Steps of a reconcile pass that failed and are retried in the next one, by reason: api (a "
            "Kubernetes API request failed), invalid_spec (a DataPlane the operator cannot act on), metrics "
            "(Prometheus could not be read), internal (an unexpected error).",
            ["reason"],
            registry=registry,
        )
        for reason in ("api", "invalid_spec", "metrics", "internal"):
            self.errors.labels(reason)
        self.leader = Gauge(
            "batchplane_operator_leader",
            "1 while this operator holds its namespace's leader-election Lease and reconciles, 0 while it stands "
            "by (with several operator replicas, exactly one should report 1).",
            registry=registry,
        )

    def set_group(self, dataplane: str, group: str, *, desired: int, ready: int) -> None:
        """Records a group's replicas after a pass."""
        self.desired.labels(dataplane, group).set(desired)
        self.replicas.labels(dataplane, group).set(ready)

    def scaled(self, dataplane: str, group: str, previous: int, replicas: int) -> None:
        """Counts one replica change."""
        if replicas != previous:
            self.scale_events.labels(dataplane, group, "up" if replicas > previous else "down").inc()

    def forget_group(self, dataplane: str, group: str) -> None:
        """Drops the gauges of a group that is gone."""
        for gauge in (self.desired, self.replicas):
            try:
                gauge.remove(dataplane, group)
            except KeyError:
                pass
