"""Watching loader replicas and replacing the ones that fail.

Every replica is probed (grpc.health.v1 Check) every `loaders.failover.probe_interval_s`; the
summary puller reports the outcome of every request too. `failover.FailureDetector` turns the
observations into a verdict. A failed replica's shadow is promoted (`Membership.promote`); one
without a shadow is adopted by a live replica of its group (`Membership.adopt`), or by the next
to join. From then on plans name the new server, and constructors, whose fetches from the dead
replica fail, ask for the plan again and fetch from it. A replica restarted under its id (the
local launcher's way) serves its windows again as soon as it registers.
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
            self._detector.forget(owner)
            if address is None:
                adopter = self._membership.adopt(group, replica)
                if adopter is None:
                    log.error("loader replica %r of group %d failed and the group has no other live replica: its windows wait for one to join or for it to restart", replica, group)
                else:
                    self._metrics.adoptions.labels(str(group)).inc()
                    log.warning("loader replica %r of group %d failed: replica %r serves its windows, %.2f s after the first failure", replica, group, adopter, now - since)
                return
        self._metrics.promotions.labels(str(group)).inc()
        self._metrics.failover_seconds.observe(now - since)
        log.warning("loader replica %r of group %d failed: promoted its shadow at %s, %.2f s after the first failure", replica, group, address, now - since)

    def _probe_loop(self) -> None:
        while not self._stopped.wait(self._interval):
            for owner, address in self._membership.watched():
                self.observe(owner, self._healthy(address))

    def _healthy(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.insecure_channel(address)
        try:
            # A busy replica may answer late; a dead one is refused at once.
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=max(4 * self._interval, 0.5))
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()
