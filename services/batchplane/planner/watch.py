"""Watching loader replicas and promoting a shadow when its replica fails.

Every replica that has a shadow is probed (grpc.health.v1 Check) every
`loaders.failover.probe_interval_s`; the summary puller reports the outcome of every request
too. `failover.FailureDetector` turns the observations into a verdict, and a failed replica's
shadow is promoted (`Membership.promote`): from then on plans name the shadow, and constructors,
whose fetches from the dead replica fail, ask for the plan again and fetch from it.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchplane.core.config import FailoverSettings
from batchplane.planner.failover import FailureDetector
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics

log = logging.getLogger(__name__)


class ReplicaWatch:
    """The planner's failure detection and failover for loader replicas.

    Args:
        membership: The job's membership (replicas and shadows).
        settings: `loaders.failover`.
        metrics: The planner's metrics.
    """

    def __init__(self, membership: Membership, settings: FailoverSettings, metrics: PlannerMetrics) -> None:
        self._membership = membership
        self._interval = settings.probe_interval_s
        self._metrics = metrics
        self._detector = FailureDetector(failures=settings.failures)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="replica-watch", daemon=True)
        self._thread.start()

    def observe(self, owner: tuple[int, str], ok: bool) -> None:
        """One observation of replica `owner` = (group, replica id): a request it answered or
        failed to answer (an RPC deadline, a broken stream, a refused connection)."""
        with self._lock:
            if ok:
                self._detector.ok(owner)
                return
            now = time.monotonic()
            if not self._detector.failed(owner, now):
                return
            group, replica = owner
            self._metrics.loader_failures.labels(str(group)).inc()
            since = self._detector.failing_since(owner)
            address = self._membership.promote(group, replica)
            if address is None:
                log.error("loader replica %r of group %d failed %.2f s ago and has no shadow: waiting for it to restart", replica, group, now - since)
                return
            self._detector.forget(owner)
        self._metrics.promotions.labels(str(group)).inc()
        self._metrics.failover_seconds.observe(now - since)
        log.warning("loader replica %r of group %d failed: promoted its shadow at %s, %.2f s after the first failure", replica, group, address, now - since)

    def _probe_loop(self) -> None:
        while not self._stopped.wait(self._interval):
            for owner, address, _ in self._membership.shadowed():
                self.observe(owner, self._healthy(address))

    def _healthy(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.insecure_channel(address)
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=self._interval)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()
