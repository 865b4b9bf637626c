"""Where a job's constructors stand, which plans the planner keeps, and what a plan request
means: serve it, start the job, re-plan from an earlier step (a rewind), or refuse. Pure: no
threads, clocks, I/O or grpc; `PlanBook` drives it under its lock and does what it decides.

Rules (each a test in tests/unit/test_plan_progress.py):
- The first request starts the job (`Start`); `started` says at which step and from which step
  on the ledger can re-plan (its *horizon*: the first step of its oldest generation).
- A constructor asking for step s is done with every earlier step it asked for; asking for an
  earlier step is refused as consumed, unless the request says `rewind` (a trainer restarted
  from an older checkpoint while the data plane kept running).
- A rewind to s is served from the plans kept when s is among them (`Serve`), else the planner
  must re-plan from s (`Replan`): the plan sequence is a function of configuration, seed and the
  ledger's record of s - 1, so re-planning reproduces it byte for byte. From the decision on, the
  kept plans are those from s: a second rank rewinding to s meanwhile is served, not re-planned.
  A rewind before the horizon is refused, naming the horizon.
- Plans are kept from the step below which every constructor that pulls data has handed its
  ranks every step (`consumed_below`): a restarted constructor may build any later one again.
  Constructors none of whose ranks ask for data (e.g. middle pipeline stages under
  `constructors.pulling_ranks: megatron`) are not waited for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from batchplane.core.errors import FailedPrecondition, rewind_refused


@dataclasses.dataclass(frozen=True)
class Start:
    """The job has not started: start it (at the step `start_step` says), then ask again."""


@dataclasses.dataclass(frozen=True)
class Serve:
    """The plan of the step is kept, or will be built in sequence: wait for it."""


@dataclasses.dataclass(frozen=True)
class Replan:
    """Re-plan from `step`, restoring the planner's state from the ledger's record of step - 1."""

    step: int


Decision = Start | Serve | Replan


def start_step(asked: int, *, floor: int | None, rejoined: Mapping[int, int]) -> int:
    """The step a job starts at when its first plan request asks for `asked`.

    Args:
        asked: The step the first request asks for (a fresh job: 0; a resume: the step after
            the checkpoint).
        floor: For a planner restarted mid-run, the step below which the ledger says every rank
            had been handed its batch; None for a fresh start or a resume.
        rejoined: For a restarted planner, the oldest step each constructor that rejoined may
            still ask for.
    """
    if floor is None:
        return asked
    return min([asked, floor, *rejoined.values()])


class PlanProgress:
    """Where each constructor of a job stands, and which plans are kept.

    Args:
        constructors: The job's constructor indices.
        pulling: Those with a rank that asks for data (the ones waited for).
    """

    def __init__(self, constructors: Iterable[int], *, pulling: Iterable[int] | None = None) -> None:
        self._constructors = tuple(constructors)
        waited = tuple(pulling) if pulling is not None else self._constructors
        self._waited = waited or self._constructors
        self.start: int | None = None
        #: The oldest step a rewind can re-plan (the first step of the ledger's oldest generation).
        self.horizon = 0
        self._asked: dict[int, int] = {}  # constructor -> the latest step it asked for
        self._delivered: dict[int, int] = {}  # constructor -> every step below reached its ranks
        self._kept = (0, 0)  # plans of steps [lo, hi) are kept; hi: the next step to plan

    # ---- events --------------------------------------------------------------------------

    def started(self, step: int, *, horizon: int, positions: Mapping[int, int] | None = None) -> None:
        """The job starts at `step`; the ledger can re-plan from `horizon` on (<= step).
        `positions`: steps rejoined constructors (of a restarted planner) asked for last."""
        self.start = step
        self.horizon = min(horizon, step)
        self._asked.update(positions or {})
        self._kept = (step, step)

    def ask(self, constructor: int, step: int, *, delivered_below: int = 0, rewind: bool = False) -> Decision:
        """Constructor `constructor` asks for the plan of `step`; `delivered_below`: every step
        below it reached all of its ranks; `rewind`: a rank restarted from an older checkpoint.

        Raises:
            FailedPrecondition: a step before the job's start or one the constructor moved past
                (without `rewind`), or a rewind before the horizon (the message names it).
        """
        if self.start is None:
            return Start()
        latest = self._asked.get(constructor, step)
        behind = step < latest or step < self.start
        if behind and not rewind:
            if step < self.start:
                raise FailedPrecondition(f"step {step} is before step {self.start}, where this job started")
            raise FailedPrecondition(f"step {step} was already consumed: constructor {constructor} asked for step {latest} since")
        replan = step < self._kept[0]
        if replan and step < self.horizon:
            raise rewind_refused(step, self.horizon)
        self._asked[constructor] = step
        if behind:  # a rewind: its ranks need the steps from `step` again
            self._delivered[constructor] = min(self._delivered.get(constructor, step), delivered_below, step)
        else:
            self._delivered[constructor] = max(self._delivered.get(constructor, self.start), delivered_below)
        if not replan:
            return Serve()
        self.start = min(self.start, step)
        self._kept = (step, step)
        return Replan(step)

    def delivered(self, constructor: int, below: int) -> None:
        """Constructor `constructor` says (a heartbeat) every step below `below` reached its ranks."""
        if self.start is not None:
            self._delivered[constructor] = max(self._delivered.get(constructor, self.start), below)

    def restarted(self, constructor: int) -> int:
        """Constructor `constructor` registered anew (restarted): it may ask again for the steps
        from the last one its ranks were handed. Returns that step (-1 before the job starts)."""
        self._asked.pop(constructor, None)
        if self.start is None:
            return -1
        return self._delivered.get(constructor, self.start)

    def planned(self, step: int) -> None:
        """The plan of `step` is kept (the next one in sequence)."""
        lo, _ = self._kept
        self._kept = (lo, step + 1)

    def forget_consumed(self) -> range:
        """Drops the plans below `consumed_below` from the kept ones; returns the steps dropped."""
        lo, hi = self._kept
        low = min(max(self.consumed_below, lo), hi)
        self._kept = (low, hi)
        return range(lo, low)

    # ---- questions -----------------------------------------------------------------------

    @property
    def consumed_below(self) -> int:
        """Every constructor that pulls data handed its ranks every step below it."""
        start = self.start if self.start is not None else 0
        return min(self._delivered.get(c, start) for c in self._waited)

    def kept(self, step: int) -> bool:
        """Whether the plan of `step` is kept (built and not yet dropped)."""
        lo, hi = self._kept
        return lo <= step < hi

    @property
    def next_to_plan(self) -> int:
        """The step the plan sequence continues at."""
        return self._kept[1]

    def finished(self, end_step: int | None) -> bool:
        """Whether every constructor that pulls data handed its ranks every step of a job whose
        data ends at `end_step`."""
        if end_step is None or self.start is None:
            return False
        return all(self._delivered.get(c, -1) >= end_step for c in self._waited)
