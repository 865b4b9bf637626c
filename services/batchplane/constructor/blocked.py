"""A step that cannot be built yet: why, since when, how long building waits before it tries
again (doubling from FIRST_WAIT_S up to MOST_WAIT_S, so a peer that keeps failing at once is not
asked in a spin) and what it says (the first failure of a run, then one every TELL_EVERY_S while
it lasts, so the log is not flooded). Pure: the pipeline gives the time; it holds the lock."""

from __future__ import annotations

import dataclasses

FIRST_WAIT_S = 0.05
MOST_WAIT_S = 0.5
TELL_EVERY_S = 30.0
#: The least wait before a peer that answered a malformed response is asked again.
MALFORMED_WAIT_S = 0.25


@dataclasses.dataclass(frozen=True)
class Retry:
    """What to do after a failed try.

    Attributes:
        wait_s: How long to wait before the next (a rewind or a stop cuts it short).
        say: The line to log, or "" (said already, not long ago).
        first: The first failure since building last succeeded (a peer failure to count).
    """

    wait_s: float
    say: str
    first: bool


class Blocked:
    """Building's failures since it last built a step."""

    def __init__(self) -> None:
        self.reason = ""  # the last failure, on one line; "" while building succeeds
        self.since: float | None = None  # when the first failure's try began
        self._failures = 0
        self._told_at: float | None = None

    def failed(self, step: int, error: str, *, peer: str, began: float, now: float, malformed: bool = False) -> Retry:
        """Building `step` failed with `error` (waiting on `peer`), the try begun at `began`;
        `malformed`: the peer answered a malformed response (not asked again at once)."""
        first = self.since is None
        since = self.since = began if self.since is None else self.since
        self.reason = " ".join(error.splitlines())
        wait = min(MOST_WAIT_S, FIRST_WAIT_S * 2 ** min(self._failures, 30))
        wait = max(wait, MALFORMED_WAIT_S) if malformed else wait
        self._failures += 1
        say = ""
        if self._told_at is None or now - self._told_at >= TELL_EVERY_S:
            self._told_at = now
            say = (
                f"step {step} is not built yet: {self.reason}; trying again (every {MOST_WAIT_S:g} s at most) until the {peer} "
                f"answers, a rank restarts at another step or the constructor stops; blocked for {now - since:.1f} s so far "
                f"(said again every {TELL_EVERY_S:.0f} s while it lasts)"
            )
        return Retry(wait, say, first)

    def built(self, now: float) -> float | None:
        """A step was built: how long building had been blocked (None: it was not)."""
        blocked = None if self.since is None else now - self.since
        self.reason, self.since, self._failures, self._told_at = "", None, 0, None
        return blocked

    def why(self, now: float) -> str:
        """What a rank's request that timed out is told of it ("" while building succeeds)."""
        return "" if self.since is None else f": the constructor has been retrying for {now - self.since:.1f} s: {self.reason}"
