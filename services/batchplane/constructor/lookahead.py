"""What a constructor holds of the steps after the one it builds: the plans that came with a
plan (`GetPlanResponse.following`) and the samples fetched together with a step's
(`constructors.fetch_steps`), each kept until its step is built. One call to a loader then
serves several steps: its fixed cost (the request, the loader's handler, the payload's framing,
the constructor's receive) is paid once for them. Pure: no threads, clocks, I/O or grpc; the
pipeline's build thread, its only user, drives it.

Rules (each a test in tests/unit/test_lookahead.py):
- A step's plan is taken from here when it came in the current epoch (no rewind since) and the
  request for it has nothing the planner must hear (no rewind, no resume). Else the planner is
  asked, and everything kept is dropped first: what comes with its answer replaces it.
- A fetch takes the step being built and then the following steps whose plans are kept and
  whose samples are not, in order: `steps` in all at most.
- Samples fetched for a following step are kept until that step is built (taken once).
- What is kept for a step below the one being built is dropped (its ranks moved on).
- A rewind (a new epoch) drops everything. So does a failure (a peer unavailable, a malformed
  answer); fetches then take one step each until one succeeds, so a retry asks of the loaders
  what a constructor that fetches one step at a time would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

P = TypeVar("P")
F = TypeVar("F")


class Lookahead(Generic[P, F]):
    """Plans (`P`) and fetched samples (`F`) of a constructor's steps after the one it builds.

    Args:
        steps: Steps one fetch takes at most (`constructors.fetch_steps`).
    """

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.steps = steps
        self._epoch = 0
        self._plans: dict[int, P] = {}
        self._fetched: dict[int, F] = {}
        self._single = False  # after a failure, until a fetch succeeds

    def plan(self, step: int, *, epoch: int, plain: bool) -> P | None:
        """The kept plan of `step`, taken; None: ask the planner (then nothing is kept).

        Args:
            epoch: The build epoch now (`BuildProgress.epoch`).
            plain: The request for it has no rewind and no resume.
        """
        self._move_to(step, epoch)
        plan = self._plans.pop(step, None) if plain else None
        if plan is None:
            self._plans.clear()
            self._fetched.clear()
        return plan

    def keep_plans(self, plans: Mapping[int, P], *, epoch: int) -> None:
        """The plans of following steps that came with the plan of a step of `epoch`."""
        if epoch == self._epoch:
            self._plans.update(plans)

    def following(self, step: int, *, epoch: int) -> list[tuple[int, P]]:
        """The steps to fetch together with `step`, with their plans: those kept whose samples
        are not, rising, `steps` - 1 at most (none after a failure until a fetch succeeds)."""
        if self._single or epoch != self._epoch:
            return []
        return [(t, self._plans[t]) for t in sorted(self._plans) if t > step and t not in self._fetched][: self.steps - 1]

    def fetched(self, step: int, *, epoch: int) -> F | None:
        """The samples of `step` fetched with an earlier step's, taken; None: fetch them."""
        self._move_to(step, epoch)
        return self._fetched.pop(step, None)

    def keep_fetched(self, fetched: Mapping[int, F], *, epoch: int) -> None:
        """A fetch succeeded in `epoch`: the samples of its following steps are kept until built."""
        self._single = False
        if epoch == self._epoch:
            self._fetched.update(fetched)

    def failed(self) -> None:
        """Building a step failed (a peer unavailable or malformed): nothing is kept, and the
        next fetches take one step each until one succeeds."""
        self._plans.clear()
        self._fetched.clear()
        self._single = True

    @property
    def kept(self) -> tuple[list[int], list[int]]:
        """The steps whose plans and whose samples are kept (for tests and logs)."""
        return sorted(self._plans), sorted(self._fetched)

    def _move_to(self, step: int, epoch: int) -> None:
        """Building is at `step` in `epoch`: what a rewind or moving on made stale goes."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._plans.clear()
            self._fetched.clear()
        for kept in (self._plans, self._fetched):
            for t in [t for t in kept if t < step]:
                del kept[t]
