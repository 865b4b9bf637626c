"""Writes the operator's Kubernetes Events through the API, as `operator.events` decides:
created once, their count updated on repeats, dropped beyond the rate limit. Best effort: an
Event that cannot be written is logged (at debug level) and never fails a reconcile pass.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from batchplane.operator import events
from batchplane.operator.kubernetes import KubernetesError

log = logging.getLogger(__name__)


class EventApi(Protocol):
    """The calls the recorder makes (`kubernetes.KubernetesClient`)."""

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...


def rfc3339_now() -> str:
    """The wall-clock time as RFC 3339 (seconds), as Event timestamps are written."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Records Events about DataPlanes; thread-safe.

    Args:
        api: The Kubernetes API.
        instance: Who reports (the operator's pod name).
        settings: Deduplication and rate limits.
        clock: Monotonic seconds, for deduplication and rate limits.
        wall_clock: The Events' timestamps (RFC 3339).
        nanos: Nanoseconds since the epoch, for unique Event names.
    """

    def __init__(
        self,
        api: EventApi,
        *,
        instance: str,
        settings: events.EventSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], str] = rfc3339_now,
        nanos: Callable[[], int] = time.time_ns,
    ) -> None:
        self.api = api
        self.instance = instance
        self.filter = events.EventFilter(settings)
        self.clock = clock
        self.wall_clock = wall_clock
        self.nanos = nanos
        self._lock = threading.Lock()

    def normal(self, ref: events.ObjectRef, reason: str, message: str) -> None:
        """Records what the operator did."""
        self.record(events.EventKey(ref, events.NORMAL, reason, message))

    def warning(self, ref: events.ObjectRef, reason: str, message: str) -> None:
        """Records what went wrong."""
        self.record(events.EventKey(ref, events.WARNING, reason, message))

    def record(self, key: events.EventKey) -> None:
        """Writes, updates, holds or drops one occurrence of `key`."""
        with self._lock:
            decision = self.filter.decide(key, self.clock())
            if isinstance(decision, events.New):
                self._create(key)
            elif isinstance(decision, events.Repeat):
                self._repeat(decision)
            elif isinstance(decision, events.Drop):
                log.debug("event dropped (rate limit of %s): %s %s", key.ref.name, key.reason, key.message)

    def flush(self) -> None:
        """Writes the counts of repeats held back that may be written now."""
        with self._lock:
            for repeat in self.filter.due(self.clock()):
                self._repeat(repeat)

    def _create(self, key: events.EventKey) -> None:
        name = events.event_name(key.ref, self.nanos())
        body = events.event_body(key, name=name, time=self.wall_clock(), instance=self.instance)
        try:
            self.api.create_event(key.ref.namespace, body)
        except KubernetesError as exc:
            log.debug("cannot write the event %s %s of %s: %s", key.type, key.reason, key.ref.name, exc)
            self.filter.lost(key)
            return
        self.filter.written(key, name, 1, self.clock())

    def _repeat(self, repeat: events.Repeat) -> None:
        key = repeat.key
        try:
            self.api.patch_event(key.ref.namespace, repeat.name, events.repeat_patch(repeat.count, time=self.wall_clock()))
        except KubernetesError as exc:
            log.debug("cannot update the event %s of %s: %s", repeat.name, key.ref.name, exc)
            if exc.status == 404:  # expired on the API server: the next occurrence writes a new one
                self.filter.lost(key)
            return
        self.filter.written(key, repeat.name, repeat.count, self.clock())
