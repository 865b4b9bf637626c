"""Leader election over a coordination.k8s.io/v1 Lease, as a pure state machine: which write to
try next, and whether this candidate leads, from the Lease it read and the time. No I/O, threads
or clocks: the driver (`operator.leader`) reads and writes the Lease and feeds the results in.

The rules follow client-go's leaderelection package:

- A candidate reads the Lease every retry period. When there is none, it creates one naming
  itself; when the holder is itself, it renews (a new renewTime); when the holder is another
  candidate, it takes the Lease over only once the Lease has not changed for its
  leaseDurationSeconds, measured on this candidate's own clock from when it saw the last change
  (so clock skew between pods does not matter); an empty holder is free at once (a leader that
  stepped down released it).
- Every write carries the resourceVersion that was read, so of two candidates writing at once
  the API server refuses one (409 Conflict): at most one holds the Lease.
- A leader leads while its last successful renewal is younger than the renew deadline (shorter
  than the lease duration, so it stops acting before anyone else may take over); a leader whose
  renewals fail for that long, or who reads another holder, steps down.
- A leader that stops releases the Lease (holder "", leaseDurationSeconds 1), so a standby takes
  over within one retry period instead of one lease duration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ElectionSettings:
    """The timing of the election; lease_duration_s > renew_deadline_s > retry_period_s > 0.

    Client-go's defaults: a standby takes over at most lease_duration_s after the leader's last
    renewal; a leader that cannot renew stops acting after renew_deadline_s.
    """

    #: Seconds a Lease stays valid without a renewal (the Lease's leaseDurationSeconds).
    lease_duration_s: float = 15.0
    #: Seconds a leader keeps leading without a successful renewal.
    renew_deadline_s: float = 10.0
    #: Seconds between two attempts to acquire or renew.
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("lease_duration_s", "renew_deadline_s", "retry_period_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a number > 0, got {value!r}")
        if not self.lease_duration_s > self.renew_deadline_s:
            raise ValueError(f"lease_duration_s: must be > renew_deadline_s ({self.renew_deadline_s:g}), got {self.lease_duration_s:g}")
        if not self.renew_deadline_s > self.retry_period_s:
            raise ValueError(f"renew_deadline_s: must be > retry_period_s ({self.retry_period_s:g}), got {self.renew_deadline_s:g}")


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """The election's fields of a Lease (its spec and resourceVersion)."""

    #: spec.holderIdentity; "" when nobody holds it.
    holder: str = ""
    #: spec.leaseDurationSeconds.
    lease_duration_s: int = 0
    #: spec.acquireTime and spec.renewTime (RFC 3339 MicroTime), as written.
    acquire_time: str | None = None
    renew_time: str | None = None
    #: spec.leaseTransitions: how many times the holder changed.
    transitions: int = 0
    #: metadata.resourceVersion: the version a write must match; None for a Lease not yet created.
    resource_version: str | None = None

    def same_term(self, other: LeaseRecord | None) -> bool:
        """Whether `other` is this record unchanged (same holder, renewal and version)."""
        return other is not None and (self.holder, self.renew_time, self.resource_version) == (
            other.holder,
            other.renew_time,
            other.resource_version,
        )


@dataclasses.dataclass(frozen=True)
class ElectionState:
    """What one candidate knows."""

    #: This candidate's identity (its pod name).
    identity: str
    settings: ElectionSettings = ElectionSettings()
    #: The Lease as last read or written; None before the first read.
    observed: LeaseRecord | None = None
    #: When `observed` last changed, on this candidate's clock (seconds).
    observed_at: float | None = None
    #: When this candidate last renewed (or acquired) the Lease successfully; None: it does not lead.
    renewed_at: float | None = None


@dataclasses.dataclass(frozen=True)
class Create:
    """Create the Lease with this record (none exists)."""

    record: LeaseRecord


@dataclasses.dataclass(frozen=True)
class Update:
    """Write this record over the Lease read (its resourceVersion is the precondition)."""

    record: LeaseRecord
    #: "acquire" (taking it from nobody or an expired holder) or "renew".
    why: str


@dataclasses.dataclass(frozen=True)
class Wait:
    """Another candidate holds a valid Lease: try again after the retry period."""

    holder: str
    #: Seconds until the Lease expires unless renewed, on this candidate's clock.
    expires_in_s: float


Attempt = Create | Update | Wait


def initial_state(identity: str, settings: ElectionSettings | None = None) -> ElectionState:
    """A candidate that has read nothing yet.

    Raises:
        ValueError: an empty identity.
    """
    if not identity:
        raise ValueError("identity: must not be empty (the pod's name)")
    return ElectionState(identity=identity, settings=settings or ElectionSettings())


def attempt(state: ElectionState, lease: LeaseRecord | None, *, now: float, wall: str) -> tuple[ElectionState, Attempt]:
    """What to write after reading the Lease.

    Args:
        state: The candidate's state.
        lease: The Lease just read; None when there is none.
        now: The candidate's clock, in seconds (monotonic; only differences matter).
        wall: The wall-clock time as RFC 3339 MicroTime, for acquireTime and renewTime.
    Returns:
        The new state (the Lease observed; a leader that reads another holder no longer leads)
        and the attempt: Create, Update or Wait.
    """
    if lease is not None and not lease.same_term(state.observed):
        state = dataclasses.replace(state, observed=lease, observed_at=now)
    duration = max(int(math.ceil(state.settings.lease_duration_s)), 1)
    if lease is None:
        record = LeaseRecord(holder=state.identity, lease_duration_s=duration, acquire_time=wall, renew_time=wall, transitions=0)
        return dataclasses.replace(state, renewed_at=None), Create(record)
    if lease.holder == state.identity:
        acquired = lease.acquire_time or wall
        record = dataclasses.replace(lease, lease_duration_s=duration, acquire_time=acquired, renew_time=wall)
        return state, Update(record, "renew")
    state = dataclasses.replace(state, renewed_at=None)  # someone else's (or nobody's): not leading
    if lease.holder:
        seen = state.observed_at if state.observed_at is not None else now
        expires_in = seen + max(lease.lease_duration_s, 1) - now
        if expires_in > 0:
            return state, Wait(lease.holder, expires_in)
    record = dataclasses.replace(
        lease, holder=state.identity, lease_duration_s=duration, acquire_time=wall, renew_time=wall, transitions=lease.transitions + 1
    )
    return state, Update(record, "acquire")


def written(state: ElectionState, lease: LeaseRecord, *, now: float) -> ElectionState:
    """The write of `attempt` succeeded; `lease` is the Lease the API answered (its new
    resourceVersion). The candidate leads from `now`."""
    return dataclasses.replace(state, observed=lease, observed_at=now, renewed_at=now)


def failed(state: ElectionState, *, now: float) -> ElectionState:
    """A read or write failed (a conflict, an unreachable API): nothing changes but time. A leader
    keeps leading until its renew deadline passes (`leading`)."""
    if state.renewed_at is not None and not leading(state, now=now):
        return dataclasses.replace(state, renewed_at=None)
    return state


def leading(state: ElectionState, *, now: float) -> bool:
    """Whether the candidate leads at `now`: its last renewal is younger than the renew deadline."""
    return state.renewed_at is not None and now - state.renewed_at < state.settings.renew_deadline_s


def release(state: ElectionState, *, now: float, wall: str) -> Update | None:
    """The write that gives the Lease up when the leader stops; None when it does not hold it."""
    lease = state.observed
    if lease is None or lease.holder != state.identity or not leading(state, now=now):
        return None
    return Update(dataclasses.replace(lease, holder="", lease_duration_s=1, renew_time=wall), "release")


def stopped(state: ElectionState) -> ElectionState:
    """After a release (or when giving up): the candidate no longer leads."""
    return dataclasses.replace(state, renewed_at=None)


# ---- the Lease object ------------------------------------------------------------------------------


def record_of(lease: Mapping[str, Any] | None) -> LeaseRecord | None:
    """The election's fields of a Lease as the API returns it; None for no Lease."""
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    meta = lease.get("metadata") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        lease_duration_s=_int(spec.get("leaseDurationSeconds")),
        acquire_time=spec.get("acquireTime"),
        renew_time=spec.get("renewTime"),
        transitions=_int(spec.get("leaseTransitions")),
        resource_version=meta.get("resourceVersion"),
    )


def lease_spec(record: LeaseRecord) -> dict[str, Any]:
    """A Lease's spec holding `record`."""
    return {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.lease_duration_s,
        "acquireTime": record.acquire_time,
        "renewTime": record.renew_time,
        "leaseTransitions": record.transitions,
    }


def new_lease(record: LeaseRecord, *, namespace: str, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Lease to create for `Create(record)`."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": lease_spec(record)}


def lease_update(record: LeaseRecord) -> dict[str, Any]:
    """The merge patch for `Update(record)`: the spec, and the resourceVersion read as the
    precondition (the API server refuses it with 409 Conflict when the Lease changed since)."""
    return {"metadata": {"resourceVersion": record.resource_version}, "spec": lease_spec(record)}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
