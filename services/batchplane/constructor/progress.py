"""Where a constructor's ranks stand and what it builds next: the rules of starting, serving,
rewinding and prefetching, as a pure state machine. No threads, clocks, I/O or grpc;
`pipeline.StepPipeline` drives it under its lock and does the building.

Rules (each a test in tests/unit/test_build_progress.py):
- The first step any rank asks for is where building starts; a constructor restarted mid-job
  starts at the oldest step its ranks may still ask for (`resume_step`), if lower.
- A rank asking for step s is done with every earlier step: its batches of earlier steps are
  dropped. Asking for an earlier step is refused as consumed, unless the request says `restart`
  (a trainer restarted, e.g. from an older checkpoint): then it is a *rewind*, and building goes
  back to the rank's first step from s on whose batch is not held. Plan requests are marked
  `rewind` up to the furthest step asked of the planner before a restart (the planner serves them
  again although this constructor moved past them), and at the restart's step itself.
- Building runs up to `prefetch_steps` past the slowest rank that pulls data (ranks that never
  ask, e.g. tensor-parallel peers under `constructors.pulling_ranks: megatron`, are never
  waited for, and their batches are dropped once every pulling rank has moved past them).
- A call may carry the steps after the one it asks for (`GetBatchRequest.max_steps`): each is
  *handed* once built (`hand`), without counting as asked (the rank is not done with it, and a
  retry or a restart may ask for it), but building runs `prefetch_steps` past the step a rank
  was handed last, so that the call's next step is built while the current one is sent. A
  request ends the call's hand-outs: the rank was handed up to its asked step again. A call
  that reaches the end of data (handed the end step) counts as the rank asking for it: it
  was handed every step (`slowest`, `finished`), though nothing it holds is dropped.
- Steps below the slowest rank are skipped; the end of data stops building, and a rewind starts
  it again (the end stays where it is: the plan sequence is deterministic).
- A build finished across a rewind still yields batches (the plans are the same) but does not
  move building forward.
- Once building has started, a request may name at most one step past the furthest step any
  rank here asked for or was handed, or the next step to build if that is later (`furthest_step`): a trainer
  moves one step at a time, and one resuming from a checkpoint resumes where this data plane
  has been. A step further ahead is refused before it is acted on, so that no request makes the
  constructor skip steps or ask the planner for steps the job has not reached.
- A report is forwarded for a step built here (asked of the planner) and not past the end;
  one before the oldest step the planner's ledger keeps is not used (`reportable`).
- Once every pulling rank has asked for the end-of-data step, whatever the loaders hold for this
  constructor can go (`finished`, true once; again after a rewind reaches the end again): no
  later fetch will carry the release.
- A plan request carries the checkpoint fingerprints of the request that started building
  (with the start step's request only) and the step below which every pulling rank was handed
  everything (`plan_request`).
- A planner that answers NotFound (it restarted and does not know this constructor) is joined
  again from the slowest pulling rank's step (`rejoin_after`); the step a constructor asks to be
  planned from when it registers again is that one too, once the planner has planned for it
  (`rejoin_step`).
- A constructor with a `stride` (journal producers: producer i of n builds the steps s with
  s % n == i) builds and serves only its own steps: "the next step" is the next own one,
  prefetching counts own steps, and a request for another's step is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from batchplane.core.errors import BatchplaneError, FailedPrecondition, NotFound, rewind_refused


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What a plan request to the planner says (planner.proto GetPlanRequest).

    Attributes:
        rewind: Behind steps the planner served this constructor before a restart, or the
            restart's own step: the planner serves it again.
        resume: The checkpoint fingerprints of the rank whose request started building, sent
            with the start step's request only.
        delivered_below: Every step below it was handed to all of this constructor's pulling ranks.
    """

    step: int
    rewind: bool
    resume: Mapping[str, str]
    delivered_below: int


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a rank's request meant.

    Attributes:
        started: Building started with this request (at `BuildProgress.start`).
        rewound: The request rewound its rank (building goes back unless its batch is held).
        drop: (rank, step) batches no longer needed.
    """

    started: bool = False
    rewound: bool = False
    drop: tuple[tuple[int, int], ...] = ()


class BuildProgress:
    """The build state of one constructor.

    Args:
        ranks: The global ranks it serves.
        pulling: Those that ask for batches (default: all).
        prefetch_steps: Steps built ahead of the slowest pulling rank.
        resume_step: For a constructor restarted mid-job, the oldest step its ranks may still
            ask for (None: the first step asked for).
        oldest: The oldest step a rewind can go back to, as the planner said (0: unknown).
        stride: It builds the steps s with s % stride == offset (1: every step).
        offset: See `stride`.
    """

    def __init__(
        self,
        ranks: Iterable[int],
        *,
        pulling: Iterable[int] | None = None,
        prefetch_steps: int,
        resume_step: int | None = None,
        oldest: int = 0,
        stride: int = 1,
        offset: int = 0,
    ) -> None:
        if not 0 <= offset < stride:
            raise ValueError(f"offset {offset} must be in [0, stride {stride})")
        self.stride, self.offset = stride, offset
        self.ranks = tuple(ranks)
        waited = set(self.ranks if pulling is None else pulling) & set(self.ranks)
        self._waited = tuple(sorted(waited))
        self._prefetch = prefetch_steps
        self._resume_step = resume_step
        self.start: int | None = None
        #: The next step to build.
        self.next = 0
        #: The end-of-data step, once a build found it.
        self.end: int | None = None
        #: Counts rewinds that moved building back: a build begun before one does not move it on.
        self.epoch = 0
        #: The oldest step a rewind can go back to, as the planner last said (0 until it says).
        self.oldest = oldest
        self._progress: dict[int, int] = {}  # rank -> the step it asked for last
        self._handed: dict[int, int] = {}  # rank -> the last step its current call was handed, past the asked one
        self._ready: set[tuple[int, int]] = set()  # (rank, step) batches held
        self._planned_through = -1  # the furthest step asked of the planner
        self._rewind_through = -1  # plan requests up to it are marked rewind
        self._finished = False  # `finished` said so since the last rewind
        self._planned = False  # the planner has answered a plan request: the job has started
        self._resume: dict[str, str] = {}  # the starting request's checkpoint fingerprints

    # ---- trainer side ----------------------------------------------------------------------

    def ask(self, rank: int, step: int, *, restart: bool = False, resume: Mapping[str, str] | None = None) -> Asked:
        """Rank `rank` asks for `step`; `restart`: its trainer (re)starts there; `resume`: the
        fingerprints of the checkpoint it resumed from (those of the request that starts
        building go to the planner with the plan request of the start step).

        Raises:
            FailedPrecondition: without `restart`, a step before the start or one the rank has
                moved past; with it, a rewind before the oldest step the planner can re-plan;
                after the start, a step past `furthest_step`.
        """
        if step % self.stride != self.offset:
            raise FailedPrecondition(
                f"step {step} is built by producer {step % self.stride} of {self.stride}, not here (producer {self.offset})"
            )
        if restart and step < self.oldest:
            raise rewind_refused(step, self.oldest)
        latest = self._progress.get(rank, step)
        started = self.start is None
        if not started and step > self.furthest_step():
            raise FailedPrecondition(
                f"step {step} is ahead of every step asked here: ask for step {self.furthest_step()} or earlier "
                "(a trainer resumes at a step the data plane has reached)"
            )
        if self.start is None:
            self.start = self.next = step if self._resume_step is None else self.own(min(step, self._resume_step))
            self._resume = dict(resume or {})
        start = self.start
        behind = step < latest or step < start
        if behind and not restart:
            if step < start:
                raise FailedPrecondition(f"step {step} is before step {start}, where this job started")
            raise FailedPrecondition(f"step {step} was already consumed: rank {rank} asked for step {latest} since")
        self._progress[rank] = step
        self._handed.pop(rank, None)
        if restart:
            self._rewind_through = max(self._rewind_through, self._planned_through, step)
        if behind:
            self._finished = False
            self.start = min(start, step)
            missing = step
            while (rank, missing) in self._ready:
                missing += self.stride
            if missing < self.next:
                self.next = missing
                self.epoch += 1
        drop = tuple(sorted(key for key in self._ready if key[0] == rank and key[1] < step))
        drop += self._idle_below(self.slowest())
        self._ready.difference_update(drop)
        return Asked(started=started, rewound=behind, drop=drop)

    def asked(self, rank: int) -> int | None:
        """The step rank `rank` asked for last (None: none yet)."""
        return self._progress.get(rank)

    def hand(self, rank: int, step: int) -> None:
        """Rank `rank`'s current call was handed `step`, a step after the one it asked for
        (`max_steps`): building runs `prefetch_steps` past it. The end-of-data step is handed
        when the call reaches it. Nothing is dropped.

        Raises:
            FailedPrecondition: `step` is not past the step the rank asked for last.
        """
        asked = self._progress.get(rank)
        if asked is None or step <= asked:
            raise FailedPrecondition(f"step {step} handed to rank {rank} is not past step {asked}, the one it asked for")
        self._handed[rank] = max(self._handed.get(rank, step), step)

    def told_end(self, rank: int, step: int) -> int:
        """The end of data to tell rank `rank` with its batch of `step` (0: not known yet). The
        client asks for nothing past it, so a rank told that `step` is its last counts at once
        as handed the end-of-data step: its call may be closed before it reaches it."""
        if self.end is None:
            return 0
        if step + 1 >= self.end and self._progress.get(rank, self.end) < self.end:
            self._handed[rank] = self.end
        return self.end

    def finished(self) -> bool:
        """True the first time every pulling rank has asked for the end-of-data step (or
        past it) since the start or the last rewind: what loaders hold for this constructor
        can all be released."""
        if self._finished or self.end is None or self.start is None or self.slowest() < self.end:
            return False
        self._finished = True
        return True

    def furthest_step(self) -> int:
        """The furthest step a request may name now: one past the furthest step asked here, or
        the next step to build if that is later (meaningful once building has started)."""
        reached = max((*self._progress.values(), *self._handed.values()), default=self.next)
        return max(reached + self.stride, self.next)

    def _idle_below(self, step: int) -> tuple[tuple[int, int], ...]:
        """Held batches below `step` of ranks that do not pull (nobody waits for them)."""
        return tuple(sorted(key for key in self._ready if key[0] not in self._waited and key[1] < step))

    def is_ready(self, rank: int, step: int) -> bool:
        return (rank, step) in self._ready

    def past_end(self, step: int) -> bool:
        return self.end is not None and step >= self.end

    # ---- building --------------------------------------------------------------------------

    def slowest(self) -> int:
        """The step the slowest pulling rank asked for last (one that has not asked: the start;
        with no pulling rank here, the slowest that asked): every step below it was handed to
        all of them."""
        start = self.start if self.start is not None else 0
        ranks = self._waited or tuple(self._progress) or self.ranks
        return min(self._reached(r, start) for r in ranks)

    def _reached(self, rank: int, start: int) -> int:
        """The step rank `rank` asked for last (`start` if none), or the end of data once its
        call was handed every step before it."""
        step = self._progress.get(rank, start)
        if self.end is not None and self._handed.get(rank, -1) >= self.end:
            return max(step, self.end)
        return step

    def _slowest_handed(self) -> int:
        """`slowest`, with each rank at the last step its current call was handed."""
        start = self.start if self.start is not None else 0
        ranks = self._waited or tuple(self._progress) or self.ranks
        return min(self._handed.get(r, self._reached(r, start)) for r in ranks)

    def to_build(self) -> int | None:
        """The step to build now, or None (not started, prefetched far enough past the steps
        the ranks were handed, or past the end); steps below the slowest rank are skipped."""
        if self.start is None:
            return None
        slowest = self.slowest()
        step = self.own(max(self.next, slowest))
        if self.past_end(step) or step > self._slowest_handed() + self._prefetch * self.stride:
            return None
        self.next = step
        return step

    def plan_request(self, step: int) -> PlanRequest:
        """The planner is asked for the plan of `step`: what the request says."""
        self._planned_through = max(self._planned_through, step)
        return PlanRequest(
            step=step,
            rewind=step <= self._rewind_through,
            resume=dict(self._resume) if step == self.start else {},
            delivered_below=self.slowest(),
        )

    def planned(self, oldest: int) -> None:
        """The planner answered a plan request, saying the oldest step its ledger keeps."""
        self._planned = True
        self.oldest = oldest

    def rejoin_after(self, error: BatchplaneError) -> int | None:
        """The step to register again from after a plan request failed with `error`, or None
        (the error is not the planner's NotFound for an unregistered constructor: it restarted
        and does not know this one). The signal is the status code (`core.rpc.reraise`), never
        the error's text."""
        return self.slowest() if isinstance(error, NotFound) else None

    def prefetched(self) -> int:
        """Own steps built ahead of the step after the slowest pulling rank's."""
        return max((self.next - self.slowest()) // self.stride - 1, 0)

    def built(self, step: int, ranks: Iterable[int], *, epoch: int) -> tuple[tuple[int, int], ...]:
        """`step` was built for `ranks` in epoch `epoch`; returns the (rank, step) batches to keep
        (those nobody has moved past)."""
        keep = tuple((r, step) for r in ranks if step >= self._progress.get(r, step) and (r in self._waited or step >= self.slowest()))
        self._ready.update(keep)
        if epoch == self.epoch:
            self.next = max(self.next, step + self.stride)
        return keep

    def ended(self, step: int, *, epoch: int) -> None:
        """The plan says the data ends before `step`."""
        self.end = step if self.end is None else min(self.end, step)
        if epoch == self.epoch:
            self.next = max(self.next, step + self.stride)

    def reportable(self, step: int) -> str:
        """Whether a training report of `step` is forwarded: "" when it is, else why not (a step
        before the oldest step the planner's ledger keeps).

        Raises:
            FailedPrecondition: a step not built here (never asked of the planner, or past the end).
        """
        if step > self._planned_through or (self.end is not None and step >= self.end):
            raise FailedPrecondition(
                f"report of step {step}: no rank here has been given that step (built through step {self._planned_through})"
            )
        if step < self.oldest:
            return f"step {step} is before step {self.oldest}, the oldest step the planner's ledger keeps, so its report is not used"
        return ""

    def own(self, step: int) -> int:
        """The first step from `step` on that this constructor builds."""
        return step + (self.offset - step) % self.stride

    def rejoin_step(self) -> int | None:
        """The oldest step this constructor may still need planned (its ranks have not all been
        handed it; a restart would build it again); None until the planner has planned for it."""
        return self.slowest() if self._planned else None
