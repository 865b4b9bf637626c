"""The operator's local backend: scales the loader groups of a job that runs as local processes
(`LocalCluster`, `batchplane up`) from Prometheus, with the policy the operator uses in a cluster.

Each interval it reads the planner's mixture weights and sample throughput through Prometheus's
HTTP API, decides each group's replicas (`operator.policy.decide`: moving average, K intervals
past a threshold, hysteresis, cooldown, bounds, scaling ahead of a declared schedule change) and
applies them by starting loader replicas (`LocalCluster.add_loader`) or asking the newest to leave
(`remove_loader`: it serves the windows routed to it, then exits). The planner re-routes windows
as replicas come and go, so the trainers keep receiving every sample exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

from batchplane.launcher.local import LocalCluster, ServiceProcess
from batchplane.operator.policy import Decision, GroupSpec, GroupState, Observation, ScheduleFn, decide, initial_state
from batchplane.operator.prometheus import PrometheusError, PrometheusReader

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Interval:
    """What one interval saw and did: the weights and throughput read, and per group the replicas
    before, the decision and its reason (a row of the scaling trace)."""

    t: float
    weights: Mapping[str, float]
    throughput: float
    step: float | None
    groups: Mapping[int, tuple[int, int, str]]


class LocalAutoscaler:
    """Scales `cluster`'s loader groups.

    Args:
        cluster: The running job.
        reader: Prometheus, scraping at least the job's planner.
        groups: Loader group index -> its policy spec (sources, per-sample costs, capacity,
            bounds, scaling settings).
        job: The value of the reader's job label the planner is scraped under (None: any).
        rate_window_s: The window of the throughput rate.
        schedule: The declared schedule (step -> weights), for scaling ahead; None: none.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        reader: PrometheusReader,
        groups: Mapping[int, GroupSpec],
        *,
        job: str | None = None,
        rate_window_s: float = 10.0,
        schedule: ScheduleFn | None = None,
    ) -> None:
        self._cluster = cluster
        self._reader = reader
        self._specs = dict(groups)
        self._job = job
        self._rate_window_s = rate_window_s
        self._schedule = schedule
        self._states: dict[int, GroupState] = {g: initial_state(spec, replicas=len(self.replicas(g))) for g, spec in self._specs.items()}

    def replicas(self, group: int) -> list[ServiceProcess]:
        """The running replicas of loader group `group`, oldest first (shadows are not replicas:
        they stand by for one)."""
        name = f"loader-{group}"
        return [p for p in self._cluster.loaders if (p.name == name or p.name.startswith(name + "-")) and not p.name.endswith("-shadow")]

    def step(self, now: float) -> Interval | None:
        """One interval: observe, decide, apply. None when Prometheus could not be read (the
        groups are left as they are)."""
        try:
            weights = self._reader.mixture_weights(self._job)
            throughput = sum(self._reader.sample_rate(self._rate_window_s, self._job).values())
            step = self._reader.steps_planned(self._job)
            step_rate = self._reader.step_rate(self._rate_window_s, self._job)
        except PrometheusError as exc:
            log.warning("autoscaling skips an interval: %s", exc)
            return None
        observation = Observation(weights=weights, throughput=throughput, step=step, step_rate=step_rate, schedule=self._schedule)
        rows = {}
        for group, spec in self._specs.items():
            before = len(self.replicas(group))
            decision = decide(dataclasses.replace(self._states[group], replicas=before), observation, now)
            self._states[group] = decision.state
            self._apply(group, decision)
            rows[group] = (before, decision.replicas, decision.reason)
        return Interval(round(now, 2), dict(weights), throughput, step, rows)

    def _apply(self, group: int, decision: Decision) -> None:
        while len(self.replicas(group)) < decision.replicas:
            added = self._cluster.add_loader(group)
            log.info("loader group %d: started replica %s (%s)", group, added.name, decision.reason)
        while len(self.replicas(group)) > decision.replicas:
            newest = self.replicas(group)[-1]
            log.info("loader group %d: replica %s leaves (%s)", group, newest.name, decision.reason)
            self._cluster.remove_loader(newest)

    def run(
        self,
        stop: threading.Event,
        *,
        interval_s: float,
        on_interval: Callable[[Interval], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Steps every `interval_s` of `clock` (seconds) until `stop` is set; each step is told
        the seconds since the first."""
        start = clock()
        n = 0
        while not stop.wait(max(start + (n + 1) * interval_s - clock(), 0)):
            n += 1
            row = self.step(clock() - start)
            if row is not None and on_interval is not None:
                on_interval(row)
