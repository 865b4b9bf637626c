"""Where a job's constructors stand, which plans the planner keeps, and what a plan request
means: serve it, start the job, re-plan from an earlier step (a rewind), or refuse. Pure: no
threads, clocks, I/O or grpc; `PlanBook` drives it under its lock and does what it decides.

Rules (each a test in tests/unit/test_plan_progress.py):
- The first request starts the job (`Start`); `started` says at which step and from which step
  on the ledger can re-plan (its *horizon*: the first step of its oldest generation).
- A step whose plan is kept, or is still to be planned, is served to whoever asks, in any order
  (retrying returns the same plan): what one request for a constructor says never makes that
  constructor's own later requests fail. A step whose plan was dropped (every constructor was
  believed to have handed it) is planned again from the ledger (`Replan`), as for a rewind (a
  trainer restarted from an older checkpoint while the data plane kept running, `rewind`): the
  plan sequence is deterministic, so a false claim of delivery costs a re-plan, never a step.
  A step before the job's start is refused unless the request says `rewind`.
- A request for a step more than `lead` steps past `consumed_below` (see `bounds.plan_lead`)
  is told to wait (`Ahead`), and the planner plans no further than that either; what the
  request says its ranks were handed still counts (below), so a constructor that only ever
  asks ahead (restarted together with the planner) moves the window by its retries.
- What a request or heartbeat says was delivered is believed up to the served frontier only:
  no rank can have been handed a step that was never served (answered to a request, or sent
  along with one's answer) in this run, nor recorded in the ledger before it (a plan is served
  only once its record is durable, so an earlier run served nothing past its last record); and
  never past the planning cursor. How far the planning thread has run ahead of the requests
  (which depends on how busy the machine is) thus never changes what a claim can move.
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


@dataclasses.dataclass(frozen=True)
class Ahead:
    """The step is more than the window ahead of what every constructor was handed: nothing
    is served or planned for it (what the request said was delivered is recorded); wait until `consumed_below` reaches `step - lead` (the planner plans up to `limit`
    meanwhile), or give up (UNAVAILABLE)."""

    #: The furthest step a request may ask for now.
    limit: int


Decision = Start | Serve | Replan | Ahead


def start_step(asked: int, *, floor: int | None, rejoined: Mapping[int, int], resume: bool = False) -> int:
    """The step a job starts at when its first plan request asks for `asked`. The first caller
    does not choose it: a fresh job starts at 0, a restarted planner where its ledger and its
    rejoined constructors say, and only a resume from a checkpoint at the step it asks for.

    Args:
        asked: The step the first request asks for (a fresh job: 0; a resume: the step after
            the checkpoint).
        floor: For a planner restarted mid-run, the step below which the ledger says every rank
            had been handed its batch; None for a fresh start or a resume.
        rejoined: For a restarted planner, the oldest step each constructor that rejoined may
            still ask for.
        resume: The request carries the fingerprints of the checkpoint a trainer resumes from.
    """
    if floor is not None:
        return min([asked, floor, *rejoined.values()])
    return asked if resume else 0


class PlanProgress:
    """Where each constructor of a job stands, and which plans are kept.

    Args:
        constructors: The job's constructor indices.
        pulling: Those with a rank that asks for data (the ones waited for).
        lead: How many steps past `consumed_below` a request may ask for (`bounds.plan_lead`);
            None: no bound.
    """

    def __init__(self, constructors: Iterable[int], *, pulling: Iterable[int] | None = None, lead: int | None = None) -> None:
        self._constructors = tuple(constructors)
        waited = tuple(pulling) if pulling is not None else self._constructors
        self._waited = waited or self._constructors
        self._lead = lead
        self.start: int | None = None
        #: The oldest step a rewind can re-plan (the first step of the ledger's oldest generation).
        self.horizon = 0
        self._asked: dict[int, int] = {}  # constructor -> the latest step it asked for
        self._delivered: dict[int, int] = {}  # constructor -> every step below reached its ranks
        self._kept = (0, 0)  # plans of steps [lo, hi) are kept; hi: the next step to plan
        self._served_below = 0  # no rank can have been handed a step at or after it

    # ---- events --------------------------------------------------------------------------

    def started(self, step: int, *, horizon: int, positions: Mapping[int, int] | None = None, recorded_below: int = 0) -> None:
        """The job starts at `step`; the ledger can re-plan from `horizon` on (<= step).
        `positions`: steps rejoined constructors (of a restarted planner) asked for last;
        `recorded_below`: the step after the last one the ledger recorded (an earlier run of the
        planner may have served every step below it)."""
        self.start = step
        self.horizon = min(horizon, step)
        self._asked.update(positions or {})
        self._kept = (step, step)
        self._served_below = max(step, recorded_below)

    def ask(self, constructor: int, step: int, *, delivered_below: int = 0, rewind: bool = False, again: bool = False) -> Decision:
        """Constructor `constructor` asks for the plan of `step`; `delivered_below`: every step
        below it reached all of its ranks; `rewind`: a rank restarted from an older checkpoint;
        `again`: the same request asked again while it waits for the window (its claim of
        delivery counted when it was first asked: a request told to wait moves the window at
        most once, so one far request cannot walk the planner to the end of the job).

        Raises:
            FailedPrecondition: a step before the job's start (without `rewind`), or a re-plan
                before the horizon (the message names it).
        """
        if self.start is None:
            return Start()
        below = self._believed(delivered_below)
        lead = self._lead
        if lead is not None and step > self.consumed_below + lead:
            # What its ranks were handed still counts, so the window can move for it: a
            # constructor that only ever asks ahead (restarted while the planner was, its ranks
            # past the planner's restart) would otherwise hold it where it is for good.
            if not again:
                self._delivered[constructor] = max(self._delivered.get(constructor, self.start), below)
            if step > self.consumed_below + lead:
                return Ahead(self.consumed_below + lead)
        latest = self._asked.get(constructor)  # None: restarted (or new) since it last asked
        # Against the plans kept once those every constructor was handed are dropped (the
        # driver drops them after this decision): a claim recorded earlier (a far request told
        # to wait) may already have moved `consumed_below` past this step.
        lo, hi = self._kept
        replan = step < min(max(self.consumed_below, lo), hi)
        if step < self.start and not rewind:
            raise FailedPrecondition(f"step {step} is before step {self.start}, where this job started")
        if replan and step < self.horizon:
            raise rewind_refused(step, self.horizon)
        # A rewind from a constructor that restarted since it last asked is one too: what it was
        # believed to have handed (kept across its restart) no longer holds for its ranks.
        if replan or (rewind and (latest is None or step < latest)):  # its ranks need the steps from `step` again
            self._asked[constructor] = step
            self._delivered[constructor] = min(self._delivered.get(constructor, step), below, step)
        else:
            self._asked[constructor] = step if latest is None else max(latest, step)
            self._delivered[constructor] = max(self._delivered.get(constructor, self.start), below)
        self.served(step)  # answered with its plan (or the end of data) once planned
        if not replan:
            return Serve()
        self.start = min(self.start, step)
        self._kept = (step, step)
        return Replan(step)

    def served(self, step: int) -> None:
        """The plan of `step` is (or is about to be) handed to a constructor: a request's, or one
        sent along with a request's answer (`Planning.following`)."""
        self._served_below = max(self._served_below, step + 1)

    def delivered(self, constructor: int, below: int) -> None:
        """Constructor `constructor` says (a heartbeat) every step below `below` reached its ranks;
        believed up to the served frontier (`served_below`)."""
        if self.start is not None:
            self._delivered[constructor] = max(self._delivered.get(constructor, self.start), self._believed(below))

    def _believed(self, below: int) -> int:
        """How much of a claim that every step below `below` was handed can be true."""
        return min(below, self._served_below, self.next_to_plan)

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
    def kept_from(self) -> int:
        """The oldest step whose plan is kept (or, when none is, the next to plan)."""
        return self._kept[0]

    @property
    def next_to_plan(self) -> int:
        """The step the plan sequence continues at."""
        return self._kept[1]

    @property
    def served_below(self) -> int:
        """No rank can have been handed a step at or after it: none was served in this run, nor
        recorded in the ledger before it."""
        return self._served_below

    @property
    def limit(self) -> int | None:
        """The furthest step a request may ask for, and the planner plan, now: `lead` steps past
        `consumed_below` (None: no bound, or not started)."""
        if self._lead is None or self.start is None:
            return None
        return self.consumed_below + self._lead

    @property
    def handed_below(self) -> int:
        """No rank can have been handed a step at or after it: the planning cursor, or the end
        of the window where that is further (a restarted planner's ranks may hold steps its
        previous run planned)."""
        limit = self.limit
        return self.next_to_plan if limit is None else max(self.next_to_plan, limit + 1)

    def finished(self, end_step: int | None) -> bool:
        """Whether every constructor that pulls data handed its ranks every step of a job whose
        data ends at `end_step`."""
        if end_step is None or self.start is None:
            return False
        return all(self._delivered.get(c, -1) >= end_step for c in self._waited)
