"""Deciding that a loader replica has failed. Pure; no I/O, no clock of its own.

The planner watches every loader replica (one with a shadow is replaced by it, one without is
adopted, see `membership`): while its connection is not up, or since a failed observation, its
health is probed every `probe_interval_s`; a replica whose connection stays up and that answered
its last probe is probed once every CONFIRM_S only (`probe_due`); every summary request to it is
one more observation. A replica is declared failed after `failures` consecutive failed
observations (an RPC deadline, a broken stream, a failed health check); one success resets the
count. So a dead replica (its connection drops at once) is declared failed within about
`failures * probe_interval_s`, a hung one (its connection stays up) within CONFIRM_S more plus
the probes' deadlines, and a replica that misses one probe under load is not. Probing a healthy
replica ten times a second would cost the planner about a core at 64 loaders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable


#: Seconds between the probes of a replica whose connection stays up and that answered its last
#: probe: a hung process keeps its connection, so only a probe (or a failed request) finds it.
CONFIRM_S = 1.0


def probe_due(*, connected: bool, answered_at: float | None, now: float, confirm_s: float = CONFIRM_S) -> bool:
    """Whether to probe a replica now (the watch asks every `probe_interval_s`): always while its
    connection is not up or it has not answered a probe since its last failed observation
    (`answered_at` None), else once its last answer is `confirm_s` old."""
    return not connected or answered_at is None or now - answered_at >= confirm_s


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
