"""Each rank's wait for data, as its trainer-side client measures it: the time the trainer's
thread spent blocked in the iterator, across every call and retry of a step. The client sends its
measure with each GetBatch and, while the trainer waits, about once a second (NoteWait), so the
metrics move while a stall lasts, not only once it ends. Pure: the metrics' collector holds it
(under its lock), the servicers feed it and a scrape reads it.

Rules (each a test in tests/unit/test_rank_waits.py):

- Counted per rank: what its clients' totals grew by since this process first heard of them,
  plus the wait that was under way then (a restarted constructor does not count again what an
  earlier process counted, nor lose the stall it restarted into). The count never decreases.
- A report may add no more than the time since the client's previous one (plus `SLACK_S`): a
  client, hostile or confused, cannot add a day in a second.
- A rank waits since (now - `waiting_s`) of its latest report that says it waits, until a report
  says it does not or none came for `STALE_S` (its client is gone).
- At most `MAX_CLIENTS` clients are remembered per rank; forgetting one loses nothing counted.
"""

from __future__ import annotations

import dataclasses
import math

from batchplane.core.errors import InvalidArgument

#: Characters of a client's id (a uuid in hex).
MAX_CLIENT_CHARS = 64
#: The largest total a client may report (about 31 years).
MAX_TOTAL_S = 1e9
#: Seconds a report may add beyond the time since the same client's previous one (the two
#: clocks, and the reports' time on the wire).
SLACK_S = 1.0
#: A wait no report has confirmed for this long is over: its client stopped (a client reports
#: about once a second while its trainer waits).
STALE_S = 10.0
#: Clients remembered per rank (a rank's trainer restarted that many times).
MAX_CLIENTS = 8


def check_wait(*, client: str, total_s: float, waiting_s: float) -> None:
    """Checks a client's measure (`DataWait`).

    Raises:
        InvalidArgument: an empty id or one longer than MAX_CLIENT_CHARS, a total that is not a
            finite number in [0, MAX_TOTAL_S], or a current wait outside [0, total_s].
    """
    if not client or len(client) > MAX_CLIENT_CHARS:
        raise InvalidArgument(f"data_wait.client must have 1 to {MAX_CLIENT_CHARS} characters, got {len(client)}")
    if not (math.isfinite(total_s) and 0 <= total_s <= MAX_TOTAL_S):
        raise InvalidArgument(f"data_wait.total_s must be a finite number in [0, {MAX_TOTAL_S:g}], got {total_s!r}")
    if not (math.isfinite(waiting_s) and 0 <= waiting_s <= total_s):
        raise InvalidArgument(f"data_wait.waiting_s must be a finite number in [0, total_s = {total_s!r}], got {waiting_s!r}")


@dataclasses.dataclass
class _Client:
    total_s: float  # the highest total it reported
    at: float  # when it last reported (this process's clock)
    waiting_s: float  # its current wait at `at`; 0: not waiting


@dataclasses.dataclass
class _Rank:
    counted_s: float = 0.0
    longest_s: float = 0.0
    clients: dict[str, _Client] = dataclasses.field(default_factory=dict)  # oldest report first


@dataclasses.dataclass(frozen=True)
class RankWait:
    """A rank's wait for data now.

    Attributes:
        rank: The global rank.
        counted_s: Seconds its trainer waited for data in all (a counter).
        longest_s: The longest single wait so far.
        waiting_s: How long its current wait has lasted; 0 when it does not wait.
    """

    rank: int
    counted_s: float
    longest_s: float
    waiting_s: float


class RankWaits:
    """The ranks' waits, from their clients' reports."""

    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}

    def note(self, rank: int, *, client: str, total_s: float, waiting_s: float, now: float) -> None:
        """Rank `rank`'s client `client` measured `total_s` seconds of waiting in all, the current
        wait `waiting_s` of it; `now`: this process's monotonic clock.

        Raises:
            InvalidArgument: a measure out of bounds (`check_wait`).
        """
        check_wait(client=client, total_s=total_s, waiting_s=waiting_s)
        r = self._ranks.setdefault(rank, _Rank())
        known = r.clients.pop(client, None)
        if known is None:  # first heard of: its current wait counts, what came before was counted elsewhere
            grown, highest = waiting_s, total_s
        else:
            grown = max(0.0, min(total_s - known.total_s, now - known.at + SLACK_S))
            highest = max(known.total_s, total_s)
        r.counted_s += grown
        r.longest_s = max(r.longest_s, waiting_s)
        r.clients[client] = _Client(highest, now, waiting_s)
        while len(r.clients) > MAX_CLIENTS:
            del r.clients[next(iter(r.clients))]

    def snapshot(self, now: float) -> list[RankWait]:
        """Every rank heard of, by rank, at `now` (the clock `note` was given)."""
        return [RankWait(rank, r.counted_s, r.longest_s, _waiting(r, now)) for rank, r in sorted(self._ranks.items())]


def _waiting(r: _Rank, now: float) -> float:
    """How long rank `r` has waited by `now`: its latest report's wait, carried on to `now`,
    unless that report says it does not wait or is older than STALE_S."""
    latest = r.clients[next(reversed(r.clients))]
    if latest.waiting_s <= 0 or now - latest.at > STALE_S:
        return 0.0
    return latest.waiting_s + max(now - latest.at, 0.0)
