"""When the planner fences a loader replica that constructors report for altered samples: once
`quorum` distinct constructors have reported it (FENCE_QUORUM, or every pulling constructor of a
job with fewer). One compromised constructor can then not fence honest replicas on its own:
what it refuses it refuses either way, and fencing only moves the replica's windows to another
replica; an altered replica serves many constructors, so the quorum comes with its next steps.
Pure: no I/O, no clock."""

from __future__ import annotations

#: Distinct constructors whose reports fence a replica.
FENCE_QUORUM = 2
#: Reported replicas tracked at most (what hostile constructors name is not kept without bound).
MAX_TRACKED = 1024


class FenceVotes:
    """Which constructors reported which replica (group, address) for altered samples.

    Args:
        constructors: How many constructors pull data (the quorum is at most this many).
        quorum: Distinct reporting constructors that fence a replica.
    """

    def __init__(self, constructors: int, *, quorum: int = FENCE_QUORUM) -> None:
        self.needed = max(1, min(quorum, constructors))
        self._votes: dict[tuple[int, str], set[int]] = {}

    def report(self, group: int, address: str, constructor: int) -> bool:
        """Constructor `constructor` reports the replica of `group` at `address`; returns whether
        the replica now has the quorum (to be fenced)."""
        key = (group, address)
        if key not in self._votes and len(self._votes) >= MAX_TRACKED:
            self._votes.pop(next(iter(self._votes)))  # the oldest report goes
        votes = self._votes.setdefault(key, set())
        votes.add(constructor)
        return len(votes) >= self.needed

    def reporters(self, group: int, address: str) -> int:
        """How many distinct constructors reported the replica so far."""
        return len(self._votes.get((group, address), ()))
