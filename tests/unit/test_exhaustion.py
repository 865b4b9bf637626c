"""A source that runs out in a finite job: the mixture names the step it runs out in
(`Allocation.exhausted`), keeps the configured shares beside the renormalized targets
(`Allocation.configured`), the ledger sums both, and the planner's metrics log and count the
moment once and export the drift against the configured mixture. Pure: no processes, no files."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batchplane.planner.cost import make_cost_fn
from batchplane.planner.ledger import Ledger
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.mixture import Allocation, Mixture, MixtureState
from batchplane.planner.plan import SampleTable, StepPlan, build_step_plan
from batchplane.core.schedule import Staged, Static

NAMES = ("web", "small")


def _run(mixture: Mixture) -> list[tuple[Allocation, MixtureState]]:
    """Every allocation of the job until the data ends, with the state after it."""
    state, out = MixtureState.initial(mixture.num_sources), []
    while True:
        allocation, after = mixture.allocate(state)
        if allocation.end_of_data:
            return out
        out.append((allocation, after))
        state = after


def _plan(allocation: Allocation) -> StepPlan:
    """A plan of the allocation's samples, every one 4 tokens long."""
    source = np.repeat(np.arange(len(allocation.counts), dtype=np.int32), allocation.counts)
    seq = np.concatenate([np.arange(s, s + c, dtype=np.int64) for s, c in zip(allocation.starts, allocation.counts)])
    table = SampleTable(source=source, seq=seq, row=seq, length=np.full(len(seq), 4, np.int32), epoch=np.zeros(len(seq), np.int32))
    return build_step_plan(allocation.step, table, dp=1, microbatches=1, method="round_robin", cost_fn=make_cost_fn("linear"))


@pytest.mark.parametrize("repeat", [1, 2])
def test_a_small_source_runs_out_at_the_step_its_passes_end(repeat: int) -> None:
    # 90 % web (endless for this test's purposes), 10 % small of 25 rows, 10 samples a step:
    # small takes one sample a step and its repeat x 25 samples last repeat x 25 steps.
    mixture = Mixture(Static((9.0, 1.0)), global_batch_size=10, stream_ends=[10_000, repeat * 25])
    steps = _run(mixture)
    exhausted = [(a.step, a.exhausted) for a, _ in steps if a.exhausted]
    assert exhausted[0] == (repeat * 25 - 1, (1,))
    assert exhausted[1:] == [(steps[-1][0].step, (0,))]  # web runs out with the last step
    for allocation, _ in steps:
        assert allocation.configured == pytest.approx((0.9, 0.1))
        assert allocation.shares == pytest.approx((0.9, 0.1) if allocation.step < repeat * 25 else (1.0, 0.0))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(0.1, 10), min_size=1, max_size=4),
    st.lists(st.integers(1, 60), min_size=4, max_size=4),
    st.integers(1, 17),
    st.sampled_from([1, 3]),
)
def test_every_source_is_named_exhausted_exactly_once_at_its_last_sample(weights, rows, batch, microbatches) -> None:
    ends = rows[: len(weights)]
    mixture = Mixture(
        Static(weights), global_batch_size=max(batch, microbatches), stream_ends=ends, granularity="microbatch", microbatches=microbatches
    )
    steps = _run(mixture)
    named = [k for a, _ in steps for k in a.exhausted]
    assert sorted(named) == list(range(len(weights)))
    for allocation, after in steps:
        for k in allocation.exhausted:
            assert allocation.starts[k] < ends[k] == after.cursors[k]
        assert sum(allocation.configured) == pytest.approx(1.0)
        total = sum(weights)
        assert allocation.configured == pytest.approx(tuple(w / total for w in weights))


def test_configured_shares_follow_a_changing_schedule_over_the_sources_it_weighs() -> None:
    # Stage 1 weighs only web; stage 2 web and small 1:1. small (3 rows) runs out in stage 2.
    mixture = Mixture(Staged([(0, (1.0, 0.0)), (2, (1.0, 1.0))]), global_batch_size=2, stream_ends=[100, 3])
    steps = {a.step: a for a, _ in _run(mixture)}
    assert steps[0].configured == pytest.approx((1.0, 0.0))
    assert steps[2].configured == pytest.approx((0.5, 0.5))
    assert steps[4].exhausted == (1,) and steps[4].counts == (1, 1)
    assert steps[5].shares == pytest.approx((1.0, 0.0)) and steps[5].configured == pytest.approx((0.5, 0.5))


def test_the_ledger_shows_running_out_as_drift_against_the_configured_mixture() -> None:
    mixture = Mixture(Static((9.0, 1.0)), global_batch_size=10, stream_ends=[10_000, 25])
    ledger = Ledger(NAMES, method="round_robin")
    for allocation, after in _run(mixture)[:100]:
        ledger.record(allocation, _plan(allocation), after)
    web, small = ledger.sources
    assert (web.samples, small.samples) == (975, 25)
    # Against the renormalized target nothing drifted ...
    assert small.samples - small.target_samples == pytest.approx(0.0)
    # ... against the configured 10 % the small source is 75 samples short (100 - 25).
    assert small.samples - small.configured_samples == pytest.approx(-75.0)
    assert web.samples - web.configured_samples == pytest.approx(75.0)


def test_an_allocation_without_configured_shares_counts_its_targets() -> None:
    ledger = Ledger(NAMES, method="round_robin")
    allocation = Allocation(0, (0, 0), (3, 1), shares=(0.75, 0.25))
    ledger.record(allocation, _plan(allocation), MixtureState(step=1, cursors=(3, 1)))
    assert [t.configured_samples for t in ledger.sources] == pytest.approx([3.0, 1.0])


def test_metrics_log_and_count_the_moment_a_source_runs_out_once(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry, source_names=NAMES, target_weights=(0.9, 0.1))

    def sample(name: str, source: str) -> float | None:
        return registry.get_sample_value(name, {"source": source})

    assert sample("batchplane_planner_source_exhausted_total", "small") == 0.0
    mixture = Mixture(Static((9.0, 1.0)), global_batch_size=10, stream_ends=[10_000, 25])
    ledger = Ledger(NAMES, method="round_robin")
    steps = _run(mixture)[:40]
    with caplog.at_level(logging.INFO, logger="batchplane.planner.metrics"):
        for allocation, after in steps:
            plan = _plan(allocation)
            ledger.record(allocation, plan, after)
            metrics.observe_step(allocation, plan, ledger, waited_s=0.0, planned_s=0.0)
            if allocation.step == 24:
                assert sample("batchplane_planner_source_exhausted_total", "small") == 1.0
                # Up to here the small source had its 10 %: no drift either way.
                assert sample("batchplane_planner_mixture_configured_drift_ratio", "small") == pytest.approx(0.0)
            elif allocation.step < 24:
                assert sample("batchplane_planner_source_exhausted_total", "small") == 0.0
        allocation, after = steps[24]  # re-planned after a rewind: not logged or counted again
        metrics.observe_step(allocation, _plan(allocation), ledger, waited_s=0.0, planned_s=0.0)
    assert sample("batchplane_planner_source_exhausted_total", "small") == 1.0
    assert sample("batchplane_planner_source_exhausted_total", "web") == 0.0
    messages = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert len(messages) == 1 and "'small'" in messages[0] and "step 24" in messages[0]
    assert all(r.levelno == logging.INFO for r in caplog.records if "ran out" in r.getMessage())
    # 400 samples: small 25 of the configured 40 -> -15 / 400; the renormalized drift stays 0.
    assert sample("batchplane_planner_mixture_configured_drift_ratio", "small") == pytest.approx(-15 / 400)
    assert sample("batchplane_planner_mixture_drift_ratio", "small") == pytest.approx(0.0)
