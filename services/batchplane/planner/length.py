"""How many steps a job has: the step its data ends at, counted from its configuration and the
sources' row counts without reading data. Pure; no I/O.

A finite job ends at the first step that takes nothing (see `mixture`). When the schedule weighs
the same sources at every step (a static schedule, or an adaptive rule whose minimum shares are
all > 0), every step takes min(global_batch_size, samples left), so the count has a closed form;
a schedule that changes which sources it weighs is replayed. An adaptive rule that may drop a
source to a share of 0 ends where training takes it: unknown in advance.

Bad samples (an unreadable row group, a failed transform) are met only as the data is read. Under
batch.bad_samples.policy "skip" (and "fail") a bad sample keeps its place, so the count stays
exact; under "substitute" each takes the next good sample of its source, so the data may end
earlier than counted: the count is an upper bound (`exact` False). `JobLengths` counts it as the
planner answers it: with the closed form, on from the planning cursor, whose mixture state has
every bad sample met so far (and its substitute) in its cursors, also those a resumed job's ledger
recorded, so the bound tightens as bad samples are met; exact once the end of the data is planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.core.schedule import Static
from batchplane.planner.strategy import JobSchedule


@dataclasses.dataclass(frozen=True)
class JobLength:
    """How many steps a job has."""

    #: Steps from step 0 to the end of data; None when not known.
    num_steps: int | None = None
    #: The data never ends (epochs: infinite).
    infinite: bool = False
    #: Why the length is not known, when it is not.
    unknown: str = ""
    #: `num_steps` is where the data ends; False: an upper bound (bad samples substituted).
    exact: bool = False


_ADAPTS = (
    "the mixture adapts to training reports (mixture.schedule.kind: adaptive) and may stop reading a source "
    "(a minimum share of 0), so the step its data ends at depends on training"
)


def job_length(schedule: JobSchedule, mixture: Mixture, *, bad_policy: str = "skip", state: MixtureState | None = None) -> JobLength:
    """The number of steps of a job whose mixture allocator (with its sources' stream ends) is
    `mixture` and whose schedule is `schedule`, counted on from `state` (default: the start);
    `bad_policy` (batch.bad_samples.policy): "substitute" makes the count an upper bound."""
    if any(end is None for end in mixture.stream_ends):
        return JobLength(infinite=True)
    if _adapts_to_zero(schedule):
        return JobLength(unknown=_ADAPTS)
    start = MixtureState.initial(mixture.num_sources) if state is None else state
    return JobLength(
        num_steps=mixture.end_step(start, always_active=_always_active(schedule, mixture.num_sources)), exact=bad_policy != "substitute"
    )


def _adapts_to_zero(schedule: JobSchedule) -> bool:
    rule = schedule.adaptive
    return rule is not None and min(rule.minimum or (0.0,)) <= 0


def _always_active(schedule: JobSchedule, count: int) -> list[int] | None:
    """The sources (of `count`) every step weighs, when no other is weighed at any step (the
    closed form); None: a schedule that changes which sources it weighs (replayed)."""
    if schedule.adaptive is not None:
        return list(range(count))
    if isinstance(schedule.schedule, Static):
        return [k for k, w in enumerate(schedule.schedule.weights) if w > 0]
    return None


class JobLengths:
    """The job's length as the planner answers it, from the job's settings and the planning
    cursor (see the module docstring). Counted once from the start (a replay can take a while);
    with the closed form, counted on from the cursor at each question (a few operations).

    Args:
        schedule: The job's schedule.
        epochs: The job's epochs (None: its data never ends).
        bad_policy: batch.bad_samples.policy.
    """

    def __init__(self, schedule: JobSchedule, *, epochs: int | None, bad_policy: str) -> None:
        self._schedule = schedule
        self._epochs = epochs
        self._bad_policy = bad_policy
        self._counted: tuple[Mixture, JobLength] | None = None  # the mixture, and the length from the start

    def now(
        self, mixture: Callable[[], Mixture], *, waiting: str, planned: MixtureState | None, end_step: int | None
    ) -> tuple[JobLength, bool]:
        """The length now, and whether it was counted from the start just now (to log).

        Args:
            mixture: Makes the job's mixture allocator (once every loader has registered).
            waiting: Why the sources' row counts are not known yet ("" once they are).
            planned: The mixture's state at the planning cursor; None before the job starts.
            end_step: Where the data ends, once the planner has planned it.
        """
        if self._epochs is None:
            return JobLength(infinite=True), False
        if end_step is not None:
            return JobLength(num_steps=end_step, exact=True), False
        if waiting:
            return JobLength(unknown=waiting), False
        first = self._counted is None
        if self._counted is None:
            made = mixture()
            self._counted = (made, job_length(self._schedule, made, bad_policy=self._bad_policy))
        made, counted = self._counted
        if planned is None or counted.num_steps is None or _always_active(self._schedule, made.num_sources) is None:
            return counted, first
        on = job_length(self._schedule, made, bad_policy=self._bad_policy, state=planned)
        return (on if on.num_steps is not None and on.num_steps < counted.num_steps else counted), first
