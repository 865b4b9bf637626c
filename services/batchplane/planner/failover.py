"""Deciding that a loader replica has failed. Pure; no I/O, no clock of its own.

The planner watches every replica that has a shadow (a hot standby that reads the same windows,
see `membership`): its health is probed every `probe_interval_s`, and every summary request to
it is one more observation. A replica is declared failed after `failures` consecutive failed
observations (an RPC deadline, a broken stream, a failed health check); one success resets the
count. So a dead replica is declared failed within about `failures * probe_interval_s` plus one
probe deadline, and a replica that misses one probe under load is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass
class _Watch:
    failures: int = 0
    since: float | None = None  # time of the first failure of the current run of failures
    declared: bool = False


class FailureDetector:
    """Consecutive-failure detection per watched key (e.g. (group, replica)).

    Args:
        failures: Consecutive failed observations that declare a key failed (>= 1).
    """

    def __init__(self, *, failures: int) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        self.failures = failures
        self._watches: dict[Hashable, _Watch] = {}

    def ok(self, key: Hashable) -> None:
        """A successful observation of `key`: its run of failures ends."""
        self._watches[key] = _Watch()

    def failed(self, key: Hashable, now: float) -> bool:
        """A failed observation of `key` at time `now`. Returns True exactly once per run of
        failures: when it reaches `failures`, i.e. when `key` is declared failed."""
        watch = self._watches.setdefault(key, _Watch())
        watch.failures += 1
        if watch.since is None:
            watch.since = now
        if watch.failures >= self.failures and not watch.declared:
            watch.declared = True
            return True
        return False

    def failing_since(self, key: Hashable) -> float | None:
        """When the current run of failures of `key` began (None while it is healthy)."""
        watch = self._watches.get(key)
        return None if watch is None else watch.since

    def forget(self, key: Hashable) -> None:
        """Stops watching `key` (it was replaced)."""
        self._watches.pop(key, None)
