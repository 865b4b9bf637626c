"""Which loaders a constructor tells what its ranks were handed (a release: a fetch of nothing
with `release_below_step`), as a pure state machine; `fetcher.Fetcher` drives it under its lock
and makes the calls.

Rules (each a test in tests/unit/test_loader_releases.py):
- A loader that served a step is held until it is told every step it served was handed (a
  release below a step past the last one it served succeeded); then it is dropped. A fetch of
  several steps (`constructors.fetch_steps`) holds each loader through the furthest step
  fetched there.
- A loader that served earlier steps but is not fetched from for the step being built is
  released at once (a replica that left its group waits for that before it exits), once per
  step built, until it is dropped.
- At the end of data every held loader is released (no later fetch will carry the release).
- A loader at which `give_up` releases in a row failed is gone (it left, or failed and was
  replaced): it is dropped. A release that succeeds resets the count.
- The answer of a release for a loader dropped meanwhile changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Failed releases in a row at a loader that served earlier steps after which it counts as gone.
RELEASE_GIVE_UP = 20


class LoaderReleases:
    """The loaders one constructor still holds data at, and its releases there.

    Args:
        give_up: Failed releases in a row after which a loader counts as gone.
    """

    def __init__(self, *, give_up: int = RELEASE_GIVE_UP) -> None:
        self._give_up = give_up
        self._holding: dict[str, int] = {}  # loader replica -> the last step fetched there, until released
        self._failures: dict[str, int] = {}  # loader replica -> releases there that failed in a row

    def fetching(self, last: Mapping[str, int]) -> list[str]:
        """A fetch from the loaders `last` names, each with the furthest step fetched there;
        returns those to release at (they served earlier steps, not these)."""
        release = sorted(set(self._holding) - set(last))
        self._holding.update(last)
        return release

    def held(self) -> list[str]:
        """The loaders still holding data for this constructor (at the end of data: release
        at every one)."""
        return sorted(self._holding)

    def released(self, address: str, *, below: int, ok: bool) -> None:
        """A release at `address` telling it every step below `below` was handed answered
        (`ok`) or failed."""
        if address not in self._holding:
            return
        if ok:
            self._failures.pop(address, None)
            if below > self._holding[address]:  # it was told every step it served was handed
                del self._holding[address]
            return
        self._failures[address] = self._failures.get(address, 0) + 1
        if self._failures[address] >= self._give_up:
            del self._holding[address], self._failures[address]
