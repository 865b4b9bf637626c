"""Watching loader replicas and replacing the ones that fail.

Every replica is probed (grpc.health.v1 Check) every `loaders.failover.probe_interval_s` while
its connection is down or since it failed an observation, and every `failover.CONFIRM_S` while
its connection stays up and it answers (`failover.probe_due`; the channel's connectivity comes
from grpc's callbacks, not from polling); the summary puller reports the outcome of every
request too. `failover.FailureDetector` turns the observations into a verdict. A failed
replica's shadow is promoted (`Membership.promote`); one without a shadow is adopted by a live
replica of its group (`Membership.adopt`), or by the next to join. From then on plans name the
new server, and constructors, whose fetches from the dead replica fail, ask for the plan again
and fetch from it. A replica restarted under its id (the local launcher's way) serves its
windows again as soon as it registers.

A replica a constructor reports for sending samples other than the plan's digests (`fence`) is
fenced at once: adopted like a failed one, and never let back in under its id.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchplane.core.config import FailoverSettings
from batchplane.planner.fence_votes import FenceVotes
from batchplane.planner.failover import FailureDetector, probe_due
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics

log = logging.getLogger(__name__)

#: How long a shadow waits for its replica to register before it is promoted (its replica is
#: gone for good: loaders register again every `network.heartbeat_s`).
LONE_SHADOW_S = 3.0

#: How long a replica may run without a shadow, with `loaders.shadow` set, before a warning.
UNSHADOWED_WARN_S = 10.0

#: Reported addresses not fenced that the watch remembers having said so of.
MAX_NOT_FENCED = 1024


class ReplicaWatch:
    """The planner's failure detection and failover for loader replicas.

    Args:
        membership: The job's membership (replicas and shadows).
        settings: `loaders.failover`.
        metrics: The planner's metrics.
        connect: Opens a channel to a loader at an address.
        shadows: `loaders.shadow`: every replica should have a shadow (warns when one has none).
        constructors: How many constructors pull data (`fence_votes.FenceVotes`).
    """

    def __init__(
        self,
        membership: Membership,
        settings: FailoverSettings,
        metrics: PlannerMetrics,
        *,
        connect: Callable[[str], grpc.Channel],
        shadows: bool = False,
        constructors: int = 1,
    ) -> None:
        self._membership = membership
        self._votes = FenceVotes(constructors)
        self._connect = connect
        self._shadows = shadows
        self._unshadowed: dict[tuple[int, str], float | None] = {}  # replica -> since when it has no shadow (None: warned)
        self._interval = settings.probe_interval_s
        self._metrics = metrics
        self._detector = FailureDetector(failures=settings.failures)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._connected: dict[str, bool] = {}  # address -> its channel is READY (grpc's callbacks)
        self._answered: dict[str, float] = {}  # address -> when it last answered a probe, since its last failure
        self._lone: dict[tuple[int, str], float] = {}  # shadow without its replica -> since when
        self._not_fenced: set[tuple[int, str]] = set()  # (group, address) reported but not fenced, said once
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="replica-watch", daemon=True)
        self._thread.start()

    def observe(self, owner: tuple[int, str], address: str, ok: bool, *, malformed: bool = False) -> None:
        """One observation of replica `owner` = (group, replica id) at `address`: a request it
        answered or failed to answer (an RPC deadline, a broken stream, a refused connection);
        `malformed`: it answered, but not what was asked (counted, and a failure: a replica that
        keeps answering so is replaced like one that does not answer). Observations of an
        address that no longer serves the replica (late answers from a replaced process) do
        not count."""
        if malformed:
            self._metrics.malformed_responses.labels(str(owner[0])).inc()
        if not ok:
            self._answered.pop(address, None)  # probed every interval again until it answers
        with self._lock:
            if self._membership.failed(*owner) or self._membership.serving(*owner) != address:
                return  # known to have failed, or replaced: nothing more to decide
            key = (owner, address)
            if ok:
                self._detector.ok(key)
                return
            now = time.monotonic()
            if not self._detector.failed(key, now):
                return
            group, replica = owner
            self._metrics.loader_failures.labels(str(group)).inc()
            since = self._detector.failing_since(key)
            self._detector.forget(key)
            address = self._membership.promote(group, replica)
            if address is None:
                adopter = self._membership.adopt(group, replica)
                if adopter is None:
                    log.warning(
                        "loader replica %r of group %d failed and the group has no other live replica: its windows wait for it to restart or for one to join",
                        replica,
                        group,
                    )
                else:
                    self._metrics.adoptions.labels(str(group)).inc()
                    log.warning(
                        "loader replica %r of group %d failed: replica %r serves its windows, %.2f s after the first failure",
                        replica,
                        group,
                        adopter,
                        now - since,
                    )
                return
        self._metrics.promotions.labels(str(group)).inc()
        self._metrics.failover_seconds.observe(now - since)
        log.warning(
            "loader replica %r of group %d failed: promoted its shadow at %s, %.2f s after the first failure",
            replica,
            group,
            address,
            now - since,
        )

    def fence(self, group: int, address: str, *, constructor: int, where: str) -> None:
        """Constructor `constructor` reports that the replica of loader group `group` at `address`
        sent it altered samples (`where` says which): fences it (`Membership.fence`), unless it
        is not (or no longer) a live replica of the group, or the group's last live one; once
        enough constructors reported it (`fence_votes.FenceVotes`)."""
        with self._lock:
            first = self._votes.reporters(group, address) == 0
            quorum = self._votes.report(group, address, constructor)
            fenced = self._membership.fence(group, address) if quorum else None
        if not quorum:
            if first:  # said once: a constructor reports it with every plan it asks for
                log.warning(
                    "constructor %d reports altered samples from loader %s of group %d (%s): fenced once %d constructors report it",
                    constructor,
                    address,
                    group,
                    where,
                    self._votes.needed,
                )
            return
        if fenced is None:
            if (group, address) in self._not_fenced:
                return
            if len(self._not_fenced) >= MAX_NOT_FENCED:  # what a hostile constructor names is not kept without bound
                self._not_fenced.clear()
            self._not_fenced.add((group, address))  # said once: a constructor reports it with every plan it asks for
            log.warning(
                "constructor %d reports altered samples from loader %s (%s): not fenced, as it is no live replica of group %d "
                "(fenced already, replaced or unknown) or its last one (constructors go on refusing what it sends)",
                constructor,
                address,
                where,
                group,
            )
            return
        replica, adopter = fenced
        self._metrics.fences.labels(str(group)).inc()
        self._metrics.loader_failures.labels(str(group)).inc()
        self._detector.forget(((group, replica), address))
        log.error(
            "loader replica %r of group %d at %s sent constructor %d altered samples (%s): fenced; replica %r serves its windows, "
            "and it may not register again",
            replica,
            group,
            address,
            constructor,
            where,
            adopter,
        )

    def _probe_loop(self) -> None:
        while not self._stopped.wait(self._interval):
            watched = self._membership.watched()
            for owner, address in watched:
                if not probe_due(
                    connected=self._connected.get(address, False), answered_at=self._answered.get(address), now=time.monotonic()
                ):
                    continue
                healthy = self._healthy(address)
                if healthy:
                    self._answered[address] = time.monotonic()
                self.observe(owner, address, healthy)
            self._promote_lone_shadows(time.monotonic())
            if self._shadows:
                self._warn_unshadowed([owner for owner, _ in watched], time.monotonic())

    def _warn_unshadowed(self, replicas: list[tuple[int, str]], now: float) -> None:
        """With `loaders.shadow`, warns once about a replica that has run without a shadow for
        UNSHADOWED_WARN_S (nobody started one: e.g. the Kubernetes operator does not yet)."""
        shadowed = {owner for owner, _, _ in self._membership.shadowed()}
        for owner in replicas:
            if owner in shadowed:
                self._unshadowed.pop(owner, None)
                continue
            since = self._unshadowed.setdefault(owner, now)
            if since is not None and now - since >= UNSHADOWED_WARN_S:
                self._unshadowed[owner] = None
                log.warning(
                    "loaders.shadow is set but loader replica %r of group %d has had no shadow for %.0f s: start one with "
                    "--shadow-of %s; until then a failure is recovered by restarting it or by another replica of its group",
                    owner[1],
                    owner[0],
                    UNSHADOWED_WARN_S,
                    owner[1],
                )

    def _promote_lone_shadows(self, now: float) -> None:
        """Promotes a shadow whose replica has not registered for LONE_SHADOW_S (after a planner
        restart, the replica may be the process that failed for good)."""
        lone = set(self._membership.lone_shadows())
        for key in set(self._lone) - lone:
            del self._lone[key]
        for key in lone:
            first = self._lone.setdefault(key, now)
            if now - first >= LONE_SHADOW_S and self._membership.promote(*key) is not None:
                del self._lone[key]
                self._metrics.promotions.labels(str(key[0])).inc()
                log.warning(
                    "loader replica %r of group %d has not registered for %.0f s: promoted its shadow", key[1], key[0], LONE_SHADOW_S
                )

    def _healthy(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._connect(address)
            channel.subscribe(functools.partial(self._on_connectivity, address), try_to_connect=True)
        try:
            # A busy replica may answer late; a dead one is refused at once.
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=max(4 * self._interval, 0.5))
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def _on_connectivity(self, address: str, state: grpc.ChannelConnectivity) -> None:
        """grpc's callback: the channel to `address` is now in `state`."""
        self._connected[address] = state is grpc.ChannelConnectivity.READY

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()
