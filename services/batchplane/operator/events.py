"""Which Kubernetes Events the operator writes about its DataPlanes, and what they hold: pure
logic, no I/O (`operator.recorder` writes them through the API).

An Event says what the operator did (Normal: a loader Deployment created, updated, scaled or
deleted) or what went wrong (Warning: an invalid spec, a failed API request, unreadable
metrics). A reconcile pass runs every few seconds and repeats the same problem each time, so:

- Deduplicated: the same (DataPlane, type, reason, message) again within `dedup_window_s` of its
  last occurrence is a repeat of the Event already written: its count and lastTimestamp are
  updated (`kubectl describe` shows "(x12 over 5m)"), at most every `repeat_interval_s`; repeats
  in between are counted and written with the next update.
- Rate-limited: each DataPlane may start `burst` new Events at once and one more every
  `refill_s` (a token bucket, as client-go's event spam filter); beyond that new Events are
  dropped (the log and the metrics still have them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

#: Event types.
NORMAL = "Normal"
WARNING = "Warning"
#: Who reports the Events (source.component, reportingComponent).
COMPONENT = "batchplane-operator"
#: The longest message written, in characters (the API's limit for events.k8s.io is 1 kB).
MAX_MESSAGE = 1024


@dataclasses.dataclass(frozen=True)
class EventSettings:
    """Deduplication and rate limits of the operator's Events."""

    #: An identical Event within this many seconds of its last occurrence is a repeat.
    dedup_window_s: float = 600.0
    #: A repeat's count is written at most this often, in seconds.
    repeat_interval_s: float = 60.0
    #: New Events a DataPlane may get at once.
    burst: int = 10
    #: Seconds until a DataPlane may get one more new Event.
    refill_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("dedup_window_s", "repeat_interval_s", "refill_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a number > 0, got {value!r}")
        if not (isinstance(self.burst, int) and self.burst >= 1):
            raise ValueError(f"burst: must be an integer >= 1, got {self.burst!r}")


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about (its involvedObject)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str


@dataclasses.dataclass(frozen=True)
class EventKey:
    """What makes two Events the same."""

    ref: ObjectRef
    type: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class New:
    """Create an Event (count 1) for the key."""

    key: EventKey


@dataclasses.dataclass(frozen=True)
class Repeat:
    """Update the Event already written for the key: its count is now `count`."""

    key: EventKey
    name: str
    count: int


@dataclasses.dataclass(frozen=True)
class Hold:
    """A repeat counted but not written yet (written with the next update)."""

    key: EventKey
    count: int


@dataclasses.dataclass(frozen=True)
class Drop:
    """Too many new Events for the object: this one is not written."""

    key: EventKey


Decision = New | Repeat | Hold | Drop


@dataclasses.dataclass
class _Series:
    name: str | None
    count: int
    written: int
    last_seen: float
    last_written: float


@dataclasses.dataclass
class _Bucket:
    tokens: float
    at: float


class EventFilter:
    """Decides, Event by Event, what to write (see the module's docstring).

    Args:
        settings: Deduplication and rate limits.
    """

    def __init__(self, settings: EventSettings | None = None) -> None:
        self.settings = settings or EventSettings()
        self._series: dict[EventKey, _Series] = {}
        self._buckets: dict[str, _Bucket] = {}

    def decide(self, key: EventKey, now: float) -> Decision:
        """One occurrence of `key` at `now` (seconds, monotonic)."""
        self._expire(now)
        series = self._series.get(key)
        if series is not None:
            series.count += 1
            series.last_seen = now
            if series.name is None:  # its creation failed or is pending: try again
                return New(key)
            if now - series.last_written >= self.settings.repeat_interval_s:
                return Repeat(key, series.name, series.count)
            return Hold(key, series.count)
        if not self._take(key.ref.uid, now):
            return Drop(key)
        self._series[key] = _Series(name=None, count=1, written=0, last_seen=now, last_written=now)
        return New(key)

    def due(self, now: float) -> list[Repeat]:
        """Repeats whose counts wait to be written and may be now (held ones of quiet series)."""
        self._expire(now)
        return [
            Repeat(key, s.name, s.count)
            for key, s in self._series.items()
            if s.name is not None and s.count > s.written and now - s.last_written >= self.settings.repeat_interval_s
        ]

    def written(self, key: EventKey, name: str, count: int, now: float) -> None:
        """The Event `name` of `key` was written with `count`."""
        series = self._series.get(key)
        if series is not None:
            series.name, series.written, series.last_written = name, count, now

    def lost(self, key: EventKey) -> None:
        """Writing `key`'s Event failed, or it is gone (expired on the API server): the next
        occurrence creates a new one."""
        series = self._series.get(key)
        if series is not None:
            series.name = None

    def _take(self, uid: str, now: float) -> bool:
        bucket = self._buckets.setdefault(uid, _Bucket(float(self.settings.burst), now))
        bucket.tokens = min(float(self.settings.burst), bucket.tokens + (now - bucket.at) / self.settings.refill_s)
        bucket.at = now
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True

    def _expire(self, now: float) -> None:
        window = self.settings.dedup_window_s
        for key in [k for k, s in self._series.items() if now - s.last_seen > window]:
            del self._series[key]
        full = self.settings.burst * self.settings.refill_s
        for uid in [u for u, b in self._buckets.items() if now - b.at > full]:
            del self._buckets[uid]


def dataplane_ref(obj: Mapping[str, Any], namespace: str) -> ObjectRef:
    """The reference of a DataPlane as listed."""
    meta = obj.get("metadata") or {}
    return ObjectRef(
        api_version=str(obj.get("apiVersion") or "batchplane.dev/v1alpha1"),
        kind=str(obj.get("kind") or "DataPlane"),
        namespace=str(meta.get("namespace") or namespace),
        name=str(meta.get("name") or "?"),
        uid=str(meta.get("uid") or ""),
    )


def event_name(ref: ObjectRef, nanos: int) -> str:
    """A unique Event name, as client-go makes them: `<object>.<time in ns, hex>`."""
    return f"{ref.name}.{nanos:x}"


def event_body(key: EventKey, *, name: str, time: str, instance: str) -> dict[str, Any]:
    """A core/v1 Event for `key`.

    Args:
        key: The object, type, reason and message.
        name: The Event's name (`event_name`).
        time: The wall-clock time, RFC 3339 (firstTimestamp and lastTimestamp).
        instance: Who reports it (the operator's pod name).
    """
    ref = key.ref
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": ref.namespace},
        "involvedObject": {"apiVersion": ref.api_version, "kind": ref.kind, "namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "type": key.type,
        "reason": key.reason,
        "message": key.message[:MAX_MESSAGE],
        "count": 1,
        "firstTimestamp": time,
        "lastTimestamp": time,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
    }


def repeat_patch(count: int, *, time: str) -> dict[str, Any]:
    """The merge patch of a repeated Event: its count and lastTimestamp."""
    return {"count": count, "lastTimestamp": time}
