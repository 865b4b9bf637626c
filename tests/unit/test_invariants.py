"""The planner's invariants as properties over random jobs: I1 identity, I2 alignment,
I4 determinism (including resume), I5 mixture fidelity. Pure: no processes, no files."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_sim import SimJob, SimSource, delivered, fingerprint, simulate

from batchplane.core.order import job_epoch
from batchplane.planner.mixture import Mixture, MixtureState, drift_bound
from batchplane.core.schedule import Static

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def jobs(draw, *, epochs=1, bad_rows=True, repeats=False):
    n_sources = draw(st.integers(1, 4))
    sources = []
    for k in range(n_sources):
        n = draw(st.integers(1, 120))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        # Skewed lengths: mostly short, a long tail; some rows bad (length 0).
        lengths = np.where(rng.random(n) < 0.9, rng.integers(1, 64, n), rng.integers(64, 2048, n))
        if bad_rows:
            lengths[rng.random(n) < draw(st.sampled_from([0.0, 0.05, 0.3]))] = 0
        sources.append(SimSource(f"src{k}", lengths, row_group_size=draw(st.integers(1, 40))))
    weights = tuple(draw(st.lists(st.floats(0.05, 10), min_size=n_sources, max_size=n_sources)))
    dp = draw(st.integers(1, 4))
    microbatches = draw(st.integers(1, 3))
    return SimJob(
        sources=tuple(sources),
        weights=weights,
        global_batch_size=draw(st.integers(dp * microbatches, 40)),
        dp=dp,
        microbatches=microbatches,
        method=draw(st.sampled_from(["karmarkar_karp", "greedy", "round_robin"])),
        epochs=epochs,
        seed=draw(st.integers(0, 2**32)),
        window_row_groups=draw(st.integers(1, 3)),
        repeats=tuple(draw(st.lists(st.integers(1, 3), min_size=n_sources, max_size=n_sources))) if repeats else None,
    )


@SETTINGS
@given(jobs())
def test_i1_finite_epoch_delivers_every_good_row_exactly_once(job: SimJob) -> None:
    plans = simulate(job)
    got = delivered(plans)
    counts = collections.Counter((s, r) for s, r, _ in got)
    assert all(c == 1 for c in counts.values()), "a sample was delivered twice"
    expected = {(k, r) for k, src in enumerate(job.sources) for r in np.flatnonzero(src.lengths > 0).tolist()}
    assert set(counts) == expected
    assert all(epoch == 0 for _, _, epoch in got)


@SETTINGS
@given(jobs(epochs=2, bad_rows=False))
def test_i1_every_pass_of_a_multi_epoch_job_delivers_each_row_once(job: SimJob) -> None:
    got = delivered(simulate(job))
    per_epoch = collections.Counter((s, r, e) for s, r, e in got)
    assert set(per_epoch.values()) == {1}
    assert len(got) == 2 * sum(len(s.lengths) for s in job.sources)


@SETTINGS
@given(jobs(repeats=True), st.sampled_from([1, 2]))
def test_i1_a_source_with_repeat_k_delivers_each_row_exactly_k_times_per_epoch(job: SimJob, epochs: int) -> None:
    job = dataclasses.replace(job, epochs=epochs)
    got = delivered(simulate(job))
    # Each pass is its own identity: (source, row, pass) at most once (a job of bad rows only delivers none).
    assert set(collections.Counter(got).values()) <= {1}
    # The sample's epoch is its pass over the source; pass p lies in job epoch p // repeat.
    rows = [src.lengths.size for src in job.sources]
    per_epoch = collections.Counter((s, r, job_epoch(p * rows[s], num_rows=rows[s], repeat=job.repeat(s))) for s, r, p in got)
    for k, src in enumerate(job.sources):
        good = np.flatnonzero(src.lengths > 0).tolist()
        for e in range(epochs):
            assert {r: per_epoch[(k, r, e)] for r in good} == {r: job.repeat(k) for r in good}, (k, e)
        assert {p for s, _, p in got if s == k} <= set(range(epochs * job.repeat(k)))
    assert sum(per_epoch.values()) == sum(epochs * job.repeat(k) * int((s.lengths > 0).sum()) for k, s in enumerate(job.sources))


@SETTINGS
@given(jobs(repeats=True), st.data())
def test_i4_a_job_with_repeats_resumes_exactly(job: SimJob, data) -> None:
    plans = simulate(job)
    k = data.draw(st.integers(0, len(plans) - 1))
    resumed = simulate(job, start_step=k)
    assert [fingerprint(p) for p in resumed] == [fingerprint(p) for p in plans[k:]]


@SETTINGS
@given(jobs())
def test_i2_every_rank_gets_the_same_microbatches_every_step(job: SimJob) -> None:
    plans = simulate(job)
    for plan in plans:
        assert plan.dp == job.dp
        assert all(len(rank) == job.microbatches for rank in plan.microbatches)
        empty = sum(len(mb) == 0 for rank in plan.microbatches for mb in rank)
        # A microbatch is empty (a filler) only when the step has too few good samples.
        assert empty == max(job.dp * job.microbatches - len(plan.samples), 0)
    # Every step but the last takes a full global batch (bad samples included).
    for plan in plans[:-1]:
        assert len(plan.samples) + plan.bad_samples == job.global_batch_size


@SETTINGS
@given(jobs(), st.data())
def test_i4_plans_are_a_function_of_config_and_seed_and_resume_exactly(job: SimJob, data) -> None:
    plans = simulate(job)
    again = simulate(job)
    assert [fingerprint(p) for p in plans] == [fingerprint(p) for p in again]
    if plans:
        k = data.draw(st.integers(0, len(plans) - 1))
        resumed = simulate(job, start_step=k)
        assert [fingerprint(p) for p in resumed] == [fingerprint(p) for p in plans[k:]]


@SETTINGS
@given(jobs(epochs=None, bad_rows=False), st.integers(1, 200))
def test_i4_resume_of_an_endless_job_is_exact(job: SimJob, k: int) -> None:
    plans = simulate(job, max_steps=k + 5)
    resumed = simulate(job, start_step=k, max_steps=5)
    assert [fingerprint(p) for p in resumed] == [fingerprint(p) for p in plans[k:]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.01, 100), min_size=1, max_size=8),
    st.integers(1, 512),
    st.integers(1, 400),
)
def test_i5_realized_counts_stay_within_tijdemans_bound_of_the_target(weights, batch, steps) -> None:
    mixture = Mixture(Static(weights), global_batch_size=batch, stream_ends=[None] * len(weights))
    state = MixtureState.initial(len(weights))
    share = np.asarray(weights) / sum(weights)
    realized = np.zeros(len(weights))
    for step in range(steps):
        allocation, state = mixture.allocate(state)
        assert allocation.total == batch
        realized += allocation.counts
        target = share * batch * (step + 1)
        assert np.all(np.abs(realized - target) <= drift_bound(len(weights)) + 1e-6), (realized, target)
