"""The driver of the operator's leader election: reads and writes the Lease through the API on a
thread of its own, feeds the results to the state machine of `operator.election`, and answers
`is_leader()` for the control loop, which reconciles only while it is true.

Several operator pods may run (the chart's operator.replicas); the one whose pod name holds the
Lease `<release>-operator` reconciles, the others wait to take over. A leader that stops
releases the Lease so a standby takes over within one retry period.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from batchplane.operator import election
from batchplane.operator.kubernetes import KubernetesError

log = logging.getLogger(__name__)


class LeaseApi(Protocol):
    """The calls the election makes (`kubernetes.KubernetesClient`)."""

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]: ...


def micro_now() -> str:
    """The wall-clock time as a Kubernetes MicroTime (RFC 3339 with microseconds)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElection:
    """One candidate of the election over Lease `namespace/name`; thread-safe.

    Args:
        api: The Kubernetes API.
        namespace: The Lease's namespace (the operator's).
        name: The Lease's name.
        identity: This candidate (its pod name).
        settings: Lease duration, renew deadline and retry period.
        labels: Labels of the Lease when this candidate creates it.
        on_change: Called with True when this candidate starts leading and False when it stops.
        clock: Monotonic seconds, for every decision.
        wall_clock: The time written into the Lease (MicroTime).
    """

    def __init__(
        self,
        api: LeaseApi,
        *,
        namespace: str,
        name: str,
        identity: str,
        settings: election.ElectionSettings | None = None,
        labels: Mapping[str, str] | None = None,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], str] = micro_now,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.labels = dict(labels or {})
        self.on_change = on_change
        self.clock = clock
        self.wall_clock = wall_clock
        self._state = election.initial_state(identity, settings)
        self._lock = threading.Lock()
        self._was_leading = False

    @property
    def identity(self) -> str:
        return self._state.identity

    @property
    def settings(self) -> election.ElectionSettings:
        return self._state.settings

    @property
    def holder(self) -> str | None:
        """The holder of the Lease as last seen; None before the first read."""
        observed = self._state.observed
        return observed.holder if observed is not None else None

    def is_leader(self) -> bool:
        """Whether this candidate leads now (its last renewal is younger than the renew deadline)."""
        with self._lock:
            return election.leading(self._state, now=self.clock())

    def try_once(self) -> bool:
        """Reads the Lease and acquires or renews it when it may. Returns whether it leads."""
        with self._lock:
            what = f"lease {self.namespace}/{self.name}"
            try:
                lease = election.record_of(self.api.get_lease(self.namespace, self.name))
            except KubernetesError as exc:
                log.warning("cannot read the %s: %s", what, exc)
                self._state = election.failed(self._state, now=self.clock())
                return self._settle()
            self._state, step = election.attempt(self._state, lease, now=self.clock(), wall=self.wall_clock())
            if isinstance(step, election.Wait):
                log.debug("%s is held by %s for %.1f s more", what, step.holder, step.expires_in_s)
                return self._settle()
            try:
                if isinstance(step, election.Create):
                    answer = self.api.create_lease(
                        self.namespace, election.new_lease(step.record, namespace=self.namespace, name=self.name, labels=self.labels)
                    )
                else:
                    answer = self.api.update_lease(self.namespace, self.name, election.lease_update(step.record))
            except KubernetesError as exc:
                # 409: another candidate wrote first (or created it); it is read again next time.
                level = logging.DEBUG if exc.status == 409 else logging.WARNING
                log.log(level, "cannot %s the %s: %s", "create" if isinstance(step, election.Create) else step.why, what, exc)
                self._state = election.failed(self._state, now=self.clock())
                return self._settle()
            written = election.record_of(answer) or step.record
            self._state = election.written(self._state, written, now=self.clock())
            return self._settle()

    def release(self) -> None:
        """Gives the Lease up if this candidate holds it (on a graceful stop)."""
        with self._lock:
            step = election.release(self._state, now=self.clock(), wall=self.wall_clock())
            self._state = election.stopped(self._state)
            why = "it stopped"
            if step is not None:
                try:
                    self.api.update_lease(self.namespace, self.name, election.lease_update(step.record))
                    why = "it stopped and released the lease"
                except KubernetesError as exc:
                    log.warning("cannot release the lease %s/%s (it expires on its own): %s", self.namespace, self.name, exc)
            self._settle(why)

    def run(self, stop: threading.Event) -> None:
        """Tries every retry period until `stop` is set, then releases the Lease."""
        period = self.settings.retry_period_s
        try:
            while not stop.is_set():
                started = self.clock()
                self.try_once()
                stop.wait(max(period - (self.clock() - started), 0.0))
        finally:
            self.release()

    def start(self, stop: threading.Event) -> threading.Thread:
        """Runs `run` on a daemon thread."""
        thread = threading.Thread(target=self.run, args=(stop,), name="leader-election", daemon=True)
        thread.start()
        return thread

    def _settle(self, why: str | None = None) -> bool:
        """Reports a change of leadership (with the lock held); returns whether it leads."""
        leading = election.leading(self._state, now=self.clock())
        if leading != self._was_leading:
            self._was_leading = leading
            if leading:
                log.info("leading: this operator (%s) holds the lease %s/%s", self.identity, self.namespace, self.name)
            elif why is not None:
                log.info("no longer leading: %s", why)
            else:
                holder = self.holder
                log.warning(
                    "no longer leading: the lease %s/%s %s",
                    self.namespace,
                    self.name,
                    f"is held by {holder}" if holder and holder != self.identity else "could not be renewed in time",
                )
            if self.on_change is not None:
                self.on_change(leading)
        return leading
