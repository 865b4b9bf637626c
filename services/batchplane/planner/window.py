"""Planning windows: token-budget batching planned over several steps at once.

A token-budget job groups samples by length; the more samples a grouping sees, the less it pads
and the fewer microbatches it needs (ODB §2.2 groups within a buffer for the same reason). In
token-budget mode the planner therefore takes a window of `steps` consecutive steps: the mixture
allocates each of them as usual (a contiguous range of every source's stream per step, so the
window is a contiguous range too), and `token_budget_steps` groups the window's samples at once
and cuts the groups into the window's steps. A sample may thus train in another step of its
window than the one the mixture allocated it to. The bound: inside a window a source's running
count leads or lags the schedule's by at most what the schedule gives it in that window (step 3
of `token_budget_steps` keeps it near one step's worth); at the end of every window it equals
the schedule's, so drift there stays within the schedule's own (Tijdeman) bound.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError
from batchplane.planner.dgraph import Strategy
from batchplane.planner.intervals import IntervalSet
from batchplane.planner.ledger import state_from_json, state_to_json
from batchplane.planner.mixture import Allocation, Mixture, MixtureState
from batchplane.planner.plan import SampleTable, StepPlan

#: Samples a token-budget window holds by default (whole steps, at least one): measured with
#: `batchplane bench token-budget --window-steps 1 --window-steps 4 --window-steps 16` (256
#: samples per step): on ODB-matched length distributions at Lmax 4096/12288 and 4/8 ranks,
#: padding at most 0.21 points above an offline global grouping and at most 1.3 % more
#: microbatches at 16 steps (4096 samples), against up to 1.5 points at 4 steps and 5.6 at 1.
DEFAULT_WINDOW_SAMPLES = 4096
#: ... and no more steps than this by default, so that a source's share of a step never wanders
#: over a long stretch of small steps.
DEFAULT_MAX_WINDOW_STEPS = 32


def default_window_steps(global_batch: int, *, read_ahead_samples: int) -> int:
    """The default window of a token-budget job, in steps: as many whole steps as hold about
    `DEFAULT_WINDOW_SAMPLES` samples, no more than the loaders read ahead (the planner needs
    the summaries of a whole window before it plans its first step) and no more than
    `DEFAULT_MAX_WINDOW_STEPS`, at least one.

    Args:
        global_batch: Samples per step.
        read_ahead_samples: Samples a loader reads ahead of the planner's cursor, per source.
    Returns:
        Steps per window, >= 1.
    """
    return max(1, min(min(DEFAULT_WINDOW_SAMPLES, read_ahead_samples) // global_batch, DEFAULT_MAX_WINDOW_STEPS))


def window_steps(job: JobSettings, strategy: Strategy, *, adaptive: bool) -> int:
    """The steps of every planning window of `job`.

    Args:
        job: The job's settings (`balance.window_steps`).
        strategy: Its strategy: only a primary graph that plans token budgets plans windows.
        adaptive: Its mixture adapts to training reports (each step's weights come from the
            reports of the steps before, so steps are planned one at a time).
    Returns:
        Steps per window, >= 1.
    Raises:
        ConfigError: `balance.window_steps` > 1 where windows do not apply.
    """
    configured = job.balance.window_steps
    if not strategy.windowed or adaptive:
        if configured not in (None, 1):
            why = (
                "an adaptive mixture plans one step at a time"
                if strategy.windowed
                else "the strategy's primary graph does not plan token budgets"
            )
            raise ConfigError("balance.window_steps", f"must be 1 (or left out): {why}", configured)
        return 1
    if configured is not None:
        return configured
    return default_window_steps(job.batch.global_batch_size, read_ahead_samples=job.loaders.read_ahead_samples)


@dataclasses.dataclass(frozen=True)
class Window:
    """A planning window: steps first .. first + steps - 1, planned together from the samples
    of every source between the mixture states `before` and `end`.

    Attributes:
        first: Its first step.
        steps: Its number of steps, >= 1.
        before: The mixture's state before the window's samples were allocated.
        end: The state after them (the state the step after the window starts from).
        skip: Per source, seqs in [before, end) that steps before `first` consumed: a window
            begun at a resume across a settings change (`leftover`) plans the rest only.
        leftover: The rest of a window cut short by a resume that changed settings: its
            samples were allocated to the steps of the window before; a bad one counts against
            its first step.
    """

    first: int
    steps: int
    before: MixtureState
    end: MixtureState
    skip: tuple[IntervalSet, ...] = ()
    leftover: bool = False

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Per source, (first seq, count) of the window's range."""
        return tuple((lo, hi - lo) for lo, hi in zip(self.before.cursors, self.end.cursors))

    def holds(self, step: int) -> bool:
        return self.first <= step < self.first + self.steps

    def to_json(self) -> dict[str, Any]:
        out = {"first": self.first, "steps": self.steps, "before": state_to_json(self.before), "end": state_to_json(self.end)}
        if self.leftover:
            out["leftover"] = True
            out["skip"] = [s.to_list() for s in self.skip]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Window:
        return cls(
            first=int(data["first"]),
            steps=int(data["steps"]),
            before=state_from_json(data["before"]),
            end=state_from_json(data["end"]),
            skip=tuple(IntervalSet.from_list(s) for s in data.get("skip", ())),
            leftover=bool(data.get("leftover", False)),
        )


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where planning goes on inside a window after a resume or rewind to step `step`.

    Attributes:
        window: The window to plan (again).
        step: Its first step to keep; the ones before were planned and consumed already.
    """

    window: Window
    step: int


def resume_inside(record: Mapping[str, Any] | None, step: int, *, changed: bool, source_names: Sequence[str]) -> Resume | None:
    """Whether a resume at `step`, from the ledger's record of step - 1, lands inside a window,
    and how it goes on: with the settings unchanged, the window is planned again as it was
    (the same plans, I4) and kept from `step` on; across a change, what the window's steps
    before `step` left is planned as a new window of the remaining steps, from `step`.

    Args:
        record: The ledger's record of step - 1 (None: none, e.g. step 0).
        step: The step resumed at.
        changed: The mesh, the batching or the mixture changed since the record was written.
        source_names: The job's sources, in source order (the record names them).
    Returns:
        None when `step` starts a window (or no window is recorded): plan from the record's
        "after" state as usual.
    """
    if record is None or "window" not in record:
        return None
    window = Window.from_json(record["window"])
    if not window.holds(step):
        return None
    if not changed:
        return Resume(window, step)
    consumed = record.get("consumed", {})
    skip = []
    for name, (lo, count) in zip(source_names, window.ranges):
        done = IntervalSet.from_list(consumed.get(name, []))
        skip.append(done.intersection(IntervalSet([(lo, lo + count)])) if count else IntervalSet.empty())
    rest = dataclasses.replace(window, first=step, steps=window.first + window.steps - step, skip=tuple(skip), leftover=True)
    return Resume(rest, step)


def allocate(mixture: Mixture, state: MixtureState, steps: int) -> tuple[list[Allocation], list[MixtureState]]:
    """The mixture's allocations of up to `steps` steps from `state`, and the state after each;
    fewer when the data ends within them (none when it ended before `state.step`)."""
    allocations, afters = [], []
    for _ in range(steps):
        allocation, after = mixture.allocate(state)
        if allocation.end_of_data:
            break
        allocations.append(allocation)
        afters.append(after)
        state = after
    return allocations, afters


def home_steps(table: SampleTable, allocations: Sequence[Allocation]) -> np.ndarray:
    """int64 per sample of a window's table: the step of the window (0-based) whose allocation
    holds it. A function of the arguments only."""
    home = np.zeros(len(table), np.int64)
    for k in np.unique(table.source):
        mine = table.source == k
        ends = np.array([a.starts[k] + a.counts[k] for a in allocations], np.int64)
        home[mine] = np.searchsorted(ends, table.seq[mine], side="right")
    return home


def without(table: SampleTable, skip: Sequence[IntervalSet]) -> SampleTable:
    """The table less the samples whose (source, seq) `skip` holds."""
    if not any(not s.is_empty for s in skip):
        return table
    keep = np.array([int(seq) not in skip[int(k)] for k, seq in zip(table.source, table.seq)], bool)
    return table.take(np.flatnonzero(keep))


def taken(plan: StepPlan, table: SampleTable, home: np.ndarray, offset: int, num_sources: int) -> list[IntervalSet]:
    """Per source, the seqs one step of a window consumes: the good samples it trains and the
    bad samples of the window that count against it (`home` == `offset`)."""
    bad = (np.asarray(table.length) <= 0) & (home == offset)
    source = np.concatenate([plan.samples.source, table.source[bad]]).astype(np.int64)
    seq = np.concatenate([plan.samples.seq, table.seq[bad]]).astype(np.int64)
    return [runs(seq[source == k]) for k in range(num_sources)]


def runs(seqs: np.ndarray) -> IntervalSet:
    """The intervals of a set of seqs."""
    seqs = np.unique(np.asarray(seqs, np.int64))
    if not len(seqs):
        return IntervalSet.empty()
    breaks = np.flatnonzero(np.diff(seqs) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(seqs)]])
    return IntervalSet([(int(seqs[a]), int(seqs[b - 1]) + 1) for a, b in zip(starts, ends)])
