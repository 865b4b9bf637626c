"""How many steps a job has (`planner.length`): the closed form against allocating step by step,
schedules that change which sources they weigh, endless and adaptive jobs. Pure."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from batchplane.planner.adaptive import AdaptiveRule, AdaptiveSchedule
from batchplane.planner.length import job_length
from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.core.schedule import Staged, Static
from batchplane.planner.strategy import JobSchedule


def allocated_steps(mixture: Mixture) -> int:
    """Steps until the first that takes nothing, allocating one by one (the planner's way)."""
    state = MixtureState.initial(mixture.num_sources)
    while True:
        allocation, state = mixture.allocate(state)
        if allocation.end_of_data:
            return allocation.step


@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    weights=st.data(),
    batch=st.integers(1, 64),
    microbatches=st.integers(1, 4),
    granularity=st.sampled_from(["step", "microbatch"]),
)
def test_a_static_jobs_closed_form_equals_allocating_every_step(rows, weights, batch, microbatches, granularity) -> None:
    w = weights.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=len(rows), max_size=len(rows)).filter(lambda x: sum(x) > 0))
    schedule = JobSchedule(Static(tuple(w)), granularity)
    mixture = Mixture(schedule.schedule, global_batch_size=batch, stream_ends=rows, granularity=granularity, microbatches=microbatches)
    length = job_length(schedule, mixture)
    assert length.num_steps == allocated_steps(mixture)
    assert not length.infinite and not length.unknown


def test_a_staged_schedule_that_drops_a_source_is_replayed() -> None:
    staged = Staged(((0, (1.0, 1.0)), (5, (1.0, 0.0))))  # source 1 unread from step 5 on
    schedule = JobSchedule(staged, "step")
    mixture = Mixture(staged, global_batch_size=10, stream_ends=[200, 200], granularity="step")
    length = job_length(schedule, mixture)
    assert length.num_steps == allocated_steps(mixture) == 5 + (200 - 25) // 10 + 1


def test_an_endless_job_has_no_length() -> None:
    schedule = JobSchedule(Static((1.0, 1.0)), "step")
    mixture = Mixture(schedule.schedule, global_batch_size=8, stream_ends=[None, None])
    assert job_length(schedule, mixture).infinite


def test_an_adaptive_mixture_is_counted_only_when_no_source_can_reach_a_share_of_0() -> None:
    names = ("a", "b")
    for minimum, known in (((0.1, 0.1), True), ((0.0, 0.1), False)):
        rule = AdaptiveRule(source_names=names, initial=(0.5, 0.5), minimum=minimum)
        schedule = JobSchedule(AdaptiveSchedule(rule), "step")
        mixture = Mixture(schedule.schedule, global_batch_size=8, stream_ends=[30, 50])
        length = job_length(schedule, mixture)
        if known:
            assert length.num_steps == 10  # ceil(80 / 8): every step takes 8 while any source has data
        else:
            assert length.num_steps is None and "adaptive" in length.unknown
