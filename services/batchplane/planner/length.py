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
earlier than counted: the count is an upper bound (`exact` False) until the planner has planned
the end of the data (`exact_length`).
"""

from __future__ import annotations

import dataclasses

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


def settled_length(*, epochs: int | None, end_step: int | None) -> JobLength | None:
    """The length of a job that needs no counting: one whose data never ends (`epochs` None), or
    one whose planner planned the end of its data at `end_step` (exact); None otherwise."""
    if epochs is None:
        return JobLength(infinite=True)
    return None if end_step is None else JobLength(num_steps=end_step, exact=True)


def job_length(schedule: JobSchedule, mixture: Mixture, *, bad_policy: str = "skip") -> JobLength:
    """The number of steps of a job whose mixture allocator (with its sources' stream ends) is
    `mixture` and whose schedule is `schedule`; `bad_policy` (batch.bad_samples.policy):
    "substitute" makes the count an upper bound."""
    if any(end is None for end in mixture.stream_ends):
        return JobLength(infinite=True)
    count = mixture.num_sources
    rule = schedule.adaptive
    active: list[int] | None
    if rule is not None:
        if min(rule.minimum or (0.0,)) <= 0:
            return JobLength(
                unknown="the mixture adapts to training reports (mixture.schedule.kind: adaptive) and may stop reading a source "
                "(a minimum share of 0), so the step its data ends at depends on training"
            )
        active = list(range(count))
    elif isinstance(schedule.schedule, Static):
        active = [k for k, w in enumerate(schedule.schedule.weights) if w > 0]
    else:
        active = None
    return JobLength(num_steps=mixture.end_step(MixtureState.initial(count), always_active=active), exact=bad_policy != "substitute")
