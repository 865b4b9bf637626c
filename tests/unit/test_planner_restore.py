"""Where a start or a rewind continues from (`planner.restore.restore_start`), read from a
durable ledger in memory that `ledger.Ledger.record` wrote: the mixture's state, the in-memory
ledger's consumption, the planning window a step lies inside, the adaptive mixing state with the
reports stored since, and the floor a restarted planner resumes at. No threads, no sockets."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.config import JobSettings, job_from_mapping
from batchplane.core.errors import FailedPrecondition
from batchplane.core.storage import MemoryStorage
from batchplane.planner.adaptive import AdaptiveState
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.journal import LedgerReader, LedgerWriter
from batchplane.planner.ledger import AdaptiveRecord, Ledger
from batchplane.planner.mixture import Allocation, MixtureState
from batchplane.planner.plan import SampleTable, build_step_plan
from batchplane.planner.membership import row_groups_digest
from batchplane.planner.restore import (
    check_sources,
    delivered_floor,
    expected_sources,
    new_generation,
    recorded_sources,
    restore_start,
    rewind_horizon,
)
from batchplane.planner.source_changes import FileFacts, SourceRecord
from batchplane.planner.strategy import JobSchedule, job_mixture, load_schedule, load_strategy
from batchplane.planner.window import Resume, Window

NAMES = ("a", "b")
ROWS = [1000, 600]
QUADRATIC = make_cost_fn("quadratic")
ADAPTIVE = {"schedule": {"kind": "adaptive", "adaptive": {"initial": {"a": 3}, "delay_steps": 2}}}


def _job(mixture: dict | None = None, *, batch: int = 8) -> JobSettings:
    data: dict = {"job": "t", "sources": [{"name": n, "path": n} for n in NAMES], "batch": {"global_batch_size": batch}}
    if mixture is not None:
        data["mixture"] = mixture
    return job_from_mapping(data)


def _schedule(job: JobSettings) -> JobSchedule:
    return load_schedule(job, load_strategy(job))


def _table(allocation: Allocation) -> SampleTable:
    """The samples of an allocation: row = seq, lengths 1..7."""
    seqs = [(k, s) for k, (start, count) in enumerate(zip(allocation.starts, allocation.counts)) for s in range(start, start + count)]
    return SampleTable(
        source=np.array([k for k, _ in seqs], np.int32),
        seq=np.array([s for _, s in seqs], np.int64),
        row=np.array([s for _, s in seqs], np.int64),
        length=np.array([1 + s % 7 for _, s in seqs], np.int32),
        epoch=np.zeros(len(seqs), np.int32),
    )


@dataclasses.dataclass
class Run:
    """A planner run that recorded steps on a ledger: its generation's writer, the states before
    each step (and after the last), its in-memory ledger and the records it wrote."""

    storage: MemoryStorage
    writer: LedgerWriter
    states: list[MixtureState]
    ledger: Ledger
    records: list[dict]


def _run(
    job: JobSettings,
    steps: int,
    *,
    storage: MemoryStorage | None = None,
    window: Window | None = None,
    delivered_below: int | None = None,
    adaptive: AdaptiveRecord | None = None,
) -> Run:
    """Plans `steps` steps from step 0 and records each (`PlanBook._plan_next`), in a new
    generation of `storage`'s ledger."""
    storage = storage if storage is not None else MemoryStorage()
    schedule = _schedule(job)
    mixture = job_mixture(job, schedule, num_rows=ROWS)
    writer = new_generation(LedgerReader(storage), 0, job=job)
    ledger = Ledger(job.source_names, method="greedy")
    states, records = [MixtureState.initial(len(NAMES))], []
    for step in range(steps):
        if schedule.adaptive is not None:
            schedule.schedule.set(step, schedule.adaptive.initial)
        allocation, after = mixture.allocate(states[-1])
        plan = build_step_plan(step, _table(allocation), dp=2, microbatches=1, method="greedy", cost_fn=QUADRATIC)
        record = ledger.record(
            allocation,
            plan,
            after,
            window=window.to_json() if window is not None else None,
            delivered_below=delivered_below,
            adaptive=adaptive,
        )
        writer.append([record])
        states.append(after)
        records.append(record)
    return Run(storage, writer, states, ledger, records)


def _restore(job: JobSettings, step: int, storage: MemoryStorage, *, resume: dict | None = None):
    """`restore_start` as `PlanBook._start` calls it; returns it with the in-memory ledger it continued."""
    schedule = _schedule(job)
    ledger = Ledger(job.source_names, method="greedy")
    start = restore_start(
        step,
        job=job,
        mixture=job_mixture(job, schedule, num_rows=ROWS),
        reader=LedgerReader(storage),
        resume=resume or {},
        rule=schedule.adaptive,
        ledger=ledger,
    )
    return start, ledger


def _consumed(ledger: Ledger) -> list:
    return [c.to_list() for c in ledger.consumed]


def test_a_fresh_job_starts_from_the_initial_state_with_nothing_consumed() -> None:
    start, ledger = _restore(_job(), 0, MemoryStorage())
    assert start.state == MixtureState.initial(len(NAMES))
    assert (start.inside, start.changed, start.adaptive) == (None, (), None)
    assert _consumed(ledger) == [[], []]


def test_a_resume_continues_from_the_record_of_the_step_before_and_refuses_its_seqs_again() -> None:
    job = _job()
    run = _run(job, 6)
    start, ledger = _restore(job, 4, run.storage, resume=job.fingerprints)
    assert start.state == run.states[4] and start.inside is None and start.changed == ()
    assert _consumed(ledger) == [[[0, run.states[4].cursors[0]]], [[0, run.states[4].cursors[1]]]]
    mixture = job_mixture(job, _schedule(job), num_rows=ROWS)
    allocation, after = mixture.allocate(run.states[3])  # step 3 again: its seqs were consumed (I1)
    with pytest.raises(ValueError, match="refusing to deliver a sample twice"):
        ledger.record(allocation, build_step_plan(3, _table(allocation), dp=2, microbatches=1, method="greedy", cost_fn=QUADRATIC), after)


def test_without_a_record_it_fast_forwards_and_counts_the_seqs_below_the_cursors_consumed() -> None:
    job = _job()
    start, ledger = _restore(job, 5, MemoryStorage(), resume=job.fingerprints)
    expected = job_mixture(job, _schedule(job), num_rows=ROWS).fast_forward(MixtureState.initial(len(NAMES)), 5)
    assert start.state == expected and start.changed == () and start.inside is None
    assert _consumed(ledger) == [[[0, c]] if c else [] for c in expected.cursors]


def test_a_changed_mixture_is_named_and_the_state_still_comes_from_the_record() -> None:
    run = _run(_job(), 4)
    changed = _job({"weights": {"a": 5}})
    start, _ = _restore(changed, 3, run.storage, resume=_job().fingerprints)
    assert start.changed == ("mixture",) and start.state == run.states[3]


def test_a_resume_across_a_mixture_change_without_a_record_is_refused() -> None:
    with pytest.raises(FailedPrecondition, match="cannot resume at step 3 across a mixture change"):
        _restore(_job({"weights": {"a": 5}}), 3, MemoryStorage(), resume=_job().fingerprints)


@pytest.mark.parametrize("changed", [False, True])
def test_a_step_inside_a_recorded_window_plans_from_the_window_start(changed: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Steps 0..4 were planned as one window; a resume at step 3 lands inside it: planned again
    as it was, or, across a change, its rest planned as a new window of steps 3..4."""
    job = _job()
    first = _run(job, 5)
    window = Window(first=0, steps=5, before=first.states[0], end=first.states[5])
    run = _run(job, 5, window=window)
    caplog.set_level(logging.INFO, logger="batchplane.planner.restore")
    start, _ = _restore(_job({"weights": {"a": 5}}) if changed else job, 3, run.storage, resume=job.fingerprints)
    assert start.state == window.before
    if changed:
        assert start.inside is not None and start.inside.step == 3 and start.inside.window.leftover
        assert (start.inside.window.first, start.inside.window.steps) == (3, 2)
        assert "step 3 lies inside the planning window of steps 3..4: its rest planned as a new window (settings changed)" in caplog.text
    else:
        assert start.inside == Resume(window, 3)
        assert "step 3 lies inside the planning window of steps 0..4: planned again as it was" in caplog.text


def test_an_adaptive_mixture_restores_its_state_with_the_reports_stored_since() -> None:
    job = _job(ADAPTIVE)
    rule = _schedule(job).adaptive
    state = AdaptiveState(weights=(0.6, 0.4), ema=(2.0, None), progress=(0.1, None), reports=3)
    run = _run(job, 6, adaptive=AdaptiveRecord([(2, {"a": 2.0})], 2, state))
    run.writer.put_report(3, {"losses": {"a": 1.5}})  # step 4's report never came
    run.writer.put_report(5, {"losses": {"b": 0.5}})
    start, _ = _restore(job, 6, run.storage, resume=job.fingerprints)
    assert start.adaptive is not None and start.adaptive.state == state and start.adaptive.applied_through == 2
    assert start.adaptive.reports == {3: {"a": 1.5}, 4: None, 5: {"b": 0.5}}
    fresh, _ = _restore(job, 0, MemoryStorage())
    assert fresh.adaptive is not None and fresh.adaptive.state == AdaptiveState.initial(rule) and fresh.adaptive.reports == {}
    with pytest.raises(FailedPrecondition, match="cannot resume an adaptive mixture at step 6"):
        _restore(job, 6, MemoryStorage(), resume=job.fingerprints)


def test_the_planners_fields_come_last_in_a_record_and_only_when_given() -> None:
    run = _run(_job(), 2)
    assert not {"substituted", "delivered_below", "adaptive"} & set(run.records[-1])
    assert delivered_floor(LedgerReader(run.storage)) is None
    mixture = job_mixture(_job(), _schedule(_job()), num_rows=ROWS)
    allocation, after = mixture.allocate(run.states[-1])
    plan = build_step_plan(2, _table(allocation), dp=2, microbatches=1, method="greedy", cost_fn=QUADRATIC)
    state = AdaptiveState(weights=(1.0, 0.0), ema=(None, None), progress=(None, None), reports=0)
    record = run.ledger.record(allocation, plan, after, substituted=[], delivered_below=1, adaptive=AdaptiveRecord([(0, None)], 0, state))
    assert list(record)[-3:] == ["substituted", "delivered_below", "adaptive"]
    assert (record["substituted"], record["delivered_below"]) == ([], 1)
    assert record["adaptive"] == {
        "applied": [[0, None]],
        "applied_through": 0,
        "state": {"weights": [1.0, 0.0], "ema": [None, None], "progress": [None, None], "reports": 0},
    }


@settings(max_examples=40, deadline=None)
@given(
    steps=st.integers(1, 6),
    cut=st.integers(1, 6),
    batch=st.integers(1, 12),
    delivered_below=st.integers(0, 6),
    applied_through=st.integers(-1, 5),
    ema=st.lists(st.one_of(st.none(), st.floats(0, 1e6)), min_size=2, max_size=2),
    weight=st.floats(0, 1),
)
def test_a_record_round_trips_through_the_restore_of_the_step_after(
    steps: int, cut: int, batch: int, delivered_below: int, applied_through: int, ema: list, weight: float
) -> None:
    """What `Ledger.record` writes (JSON on the durable ledger) is what a restarted planner
    restores at the step after: the mixture state, the consumption, where ranks stood and the
    adaptive state, exactly."""
    cut = min(cut, steps)
    job = _job(ADAPTIVE, batch=batch)
    state = AdaptiveState(weights=(weight, 1 - weight), ema=tuple(ema), progress=(None, 0.25), reports=applied_through + 1)
    adaptive = AdaptiveRecord([(applied_through, {"a": 1.0})] if applied_through >= 0 else [], min(applied_through, cut - 1), state)
    run = _run(job, steps, delivered_below=delivered_below, adaptive=adaptive)
    assert json.loads(json.dumps(run.records[-1])) == run.records[-1], "JSON-ready"
    start, ledger = _restore(job, cut, run.storage, resume=job.fingerprints)
    assert start.state == run.states[cut] and start.changed == ()
    kept = Ledger(job.source_names, method="greedy")
    kept.restore(run.records[cut - 1])
    assert _consumed(ledger) == _consumed(kept)
    if cut == steps:
        assert _consumed(ledger) == _consumed(run.ledger)
    assert start.adaptive is not None and start.adaptive.state == state
    assert start.adaptive.applied_through == adaptive.applied_through
    assert set(start.adaptive.reports) == set(range(adaptive.applied_through + 1, cut))
    assert delivered_floor(LedgerReader(run.storage)) == delivered_below


# ---- sources that changed since the ledger recorded them (issue 40, point 2) ---------------------


def _facts(*files: tuple[str, int]) -> SourceRecord:
    """A source of one row group per file: (name, rows) each, sizes and times fixed."""
    listed = tuple(FileFacts(name, 100 + rows, 5, rows) for name, rows in files)
    return SourceRecord(sum(r for _, r in files), row_groups_digest([r for _, r in files]), listed)


OLD = {"a": _facts(("x", 600), ("y", 400)), "b": _facts(("z", 600))}
NEW = {"a": _facts(("x", 600)), "b": OLD["b"]}


def _generations(*starts: tuple[int, dict, tuple[str, ...]]) -> MemoryStorage:
    """A ledger of generations, each (start step, source facts, restarted), planning 10 steps."""
    storage = MemoryStorage()
    job = _job()
    for start, facts, restarted in starts:
        writer = new_generation(LedgerReader(storage), start, job=job, source_facts=facts, restarted=restarted)
        writer.append([{"step": s} for s in range(start, start + 10)])
    return storage


def _heads(storage: MemoryStorage) -> list[dict]:
    return [json.loads(storage.get(k)) for k in storage.list("gen-") if k.endswith("head.json")]


def test_files_are_recorded_by_the_first_generation_and_again_only_where_they_changed() -> None:
    storage = _generations((0, OLD, ()), (5, OLD, ()), (8, NEW, ("a",)))
    heads = _heads(storage)
    assert [len(h["source_facts"]["a"]) for h in heads] == [3, 2, 3] and [len(h["source_facts"]["b"]) for h in heads] == [3, 2, 2]
    assert [h.get("restarted") for h in heads] == [None, None, ["a"]]
    reader = LedgerReader(storage)
    assert expected_sources(reader, job=_job()) == NEW
    assert recorded_sources(reader, 7)[1] == OLD and recorded_sources(reader, 12)[1] == NEW
    assert recorded_sources(reader, 0) is None and recorded_sources(reader, 30) is None


def test_a_resume_compares_with_the_facts_of_the_generation_it_continues() -> None:
    job = _job()
    storage = _generations((0, OLD, ()), (8, NEW, ("a",)))
    reader = LedgerReader(storage)
    assert check_sources(reader, 12, job=job, reported=NEW).restarted == ()
    with pytest.raises(FailedPrecondition, match=r"(?s)cannot resume at step 6: source 'a' changed since generation 1 .*files gone: y"):
        check_sources(reader, 6, job=job, reported=NEW)  # before the change: the old files' positions
    assert check_sources(reader, 0, job=job, reported=NEW).restarted == ()  # a fresh start carries nothing
    declared = _job()
    declared = dataclasses.replace(declared, sources=(dataclasses.replace(declared.sources[0], on_change="restart"), declared.sources[1]))
    assert [c.source for c in check_sources(reader, 6, job=declared, reported=NEW).restarted] == ["a"]
    other_data = dataclasses.replace(job, seed=99)  # restore_mixture refuses that one with its own message
    assert check_sources(reader, 6, job=other_data, reported=NEW).restarted == ()


def test_no_rewind_goes_before_a_restart_that_still_counts() -> None:
    reader = LedgerReader(_generations((0, OLD, ()), (8, NEW, ("a",))))
    assert rewind_horizon(reader, 14, adaptive=False) == 8
    assert rewind_horizon(reader, 6, adaptive=False) == 0  # a start before it supersedes it
    assert rewind_horizon(reader, 6, adaptive=False, restarted=True) == 6
    superseded = LedgerReader(_generations((0, OLD, ()), (8, NEW, ("a",)), (4, OLD, ())))
    assert rewind_horizon(superseded, 14, adaptive=False) == 0


def test_a_restarted_source_starts_from_nothing_consumed_and_the_others_go_on() -> None:
    job = _job()
    run = _run(job, 6)
    schedule = _schedule(job)
    ledger = Ledger(job.source_names, method="greedy")
    start = restore_start(
        4,
        job=job,
        mixture=job_mixture(job, schedule, num_rows=ROWS),
        reader=LedgerReader(run.storage),
        resume=job.fingerprints,
        rule=None,
        ledger=ledger,
        restarted=["b"],
    )
    assert start.state.cursors == (run.states[4].cursors[0], 0) and start.inside is None
    assert _consumed(ledger) == [[[0, run.states[4].cursors[0]]], []]
