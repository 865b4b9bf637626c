"""How many steps a job has (`planner.length`): the closed form against allocating step by step,
schedules that change which sources they weigh, endless and adaptive jobs. Pure."""

from __future__ import annotations

import dataclasses
from hypothesis import given, settings, strategies as st

from batchplane.planner.adaptive import AdaptiveRule, AdaptiveSchedule
from batchplane.planner.length import JobLength, JobLengths, job_length
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


# ---- the length as the planner answers it (`JobLengths`) -----------------------------------------


def _substituted_run(mixture: Mixture, bad: set[int]) -> list[MixtureState]:
    """The planning cursor's states of a one-source job whose seqs in `bad` are bad, each
    substituted by the next good seq (policy substitute, one step at a time): per step, the
    mixture state after it (its cursor past the substitutes), until a step takes nothing good."""
    state, states = MixtureState.initial(1), []
    end = mixture.stream_ends[0]
    while True:
        allocation, after = mixture.allocate(state)
        if allocation.end_of_data:
            return states
        cursor = after.cursors[0]
        short = sum(1 for seq in range(state.cursors[0], cursor) if seq in bad)
        while short and cursor < end:  # each bad sample takes the next good one after the step's range
            short -= cursor not in bad
            cursor += 1
        state = dataclasses.replace(after, cursors=(cursor,))
        states.append(state)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 200), batch=st.integers(1, 16), bad=st.sets(st.integers(0, 199), max_size=60))
def test_the_answered_length_tightens_as_bad_samples_are_met_and_never_undercounts(rows, batch, bad) -> None:
    """Substituted bad samples end the data early: the length counted from the start is an upper
    bound; counted on from each planning cursor it never rises, never falls below the steps that
    come, and is exact once no bad sample lies ahead."""
    bad = {b for b in bad if b < rows}
    schedule = JobSchedule(Static((1.0,)), "step")
    mixture = Mixture(schedule.schedule, global_batch_size=batch, stream_ends=[rows])
    states = _substituted_run(mixture, bad)
    real_end = len(states)  # steps that took something (the planner ends at the first that takes nothing)
    made = []
    lengths = JobLengths(schedule, epochs=1, bad_policy="substitute")
    answers = [lengths.now(lambda: made.append(1) or mixture, waiting="", planned=s, end_step=None)[0] for s in [None, *states]]
    assert len(made) == 1, "the mixture is made (and the job counted from the start) once"
    steps = [a.num_steps for a in answers]
    assert steps[0] == -(-rows // batch) and not any(a.exact for a in answers)
    assert all(a >= b for a, b in zip(steps, steps[1:])), "it never rises"
    assert all(n >= real_end for n in steps), "an upper bound"
    ahead = [s for s in states if not any(seq in bad for seq in range(s.cursors[0], rows))]
    assert all(
        lengths.now(lambda: mixture, waiting="", planned=s, end_step=None)[0].num_steps == real_end for s in ahead if s.step <= real_end
    )
    assert lengths.now(lambda: mixture, waiting="", planned=None, end_step=real_end)[0] == JobLength(num_steps=real_end, exact=True)


def test_the_answered_length_of_an_endless_job_a_job_waiting_for_its_loaders_and_a_skipping_one() -> None:
    schedule = JobSchedule(Static((1.0,)), "step")
    mixture = Mixture(schedule.schedule, global_batch_size=4, stream_ends=[40])
    assert (
        JobLengths(schedule, epochs=None, bad_policy="substitute")
        .now(lambda: mixture, waiting="w", planned=None, end_step=None)[0]
        .infinite
    )
    waiting = JobLengths(schedule, epochs=1, bad_policy="substitute").now(
        lambda: mixture, waiting="loaders [0]", planned=None, end_step=None
    )
    assert waiting == (JobLength(unknown="loaders [0]"), False)
    assert JobLengths(schedule, epochs=1, bad_policy="skip").now(lambda: mixture, waiting="", planned=None, end_step=None) == (
        JobLength(num_steps=10, exact=True),
        True,
    )
