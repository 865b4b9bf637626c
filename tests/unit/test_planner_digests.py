"""The planner keeps what loaders summarize of each sample's content (issue 41, point 5): the
digests go into the plans' tables and the ledger's records (`planner.digests`), a start or a
rewind reads them back (`restore.recorded_digests`) and holds the steps it plans again to them
(`digests.held_to`); a constructor's report of altered samples fences the replica
(`Membership.fence`), within bounds (`bounds.check_altered`). No threads, no sockets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.config import JobSettings, job_from_mapping
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.storage import MemoryStorage
from batchplane.planner.bounds import MAX_ALTERED_REPORTS, check_altered
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.digests import digests_of, from_hex, held_to, record_digests, to_hex
from batchplane.planner.intervals import IntervalSet
from batchplane.planner.journal import DETAIL_FIELDS, LedgerReader
from batchplane.planner.ledger import Ledger
from batchplane.planner.membership import Membership, SourceFacts
from batchplane.planner.mixture import MixtureState
from batchplane.planner.plan import SampleTable, build_step_plan
from batchplane.planner import restore
from batchplane.planner.restore import new_generation, recorded_digests
from batchplane.planner.strategy import job_mixture, load_schedule, load_strategy
from batchplane.planner.summaries import SummaryStore
from batchplane.v1 import planner_pb2

NAMES = ("a", "b")
ROWS = [400, 300]
QUADRATIC = make_cost_fn("quadratic")


def _job(seed: int = 0) -> JobSettings:
    return job_from_mapping(
        {"job": "t", "seed": seed, "sources": [{"name": n, "path": n} for n in NAMES], "batch": {"global_batch_size": 8}}
    )


def _digest(source: int, row: int, epoch: int = 0) -> int:
    """A made-up digest of a sample (what a loader would summarize), negative ones too."""
    return (source * 1_000_003 + row * 7_919 + epoch + 1) * (-1 if row % 3 == 0 else 1) * 1_000_000_007


def _table(source: np.ndarray, seq: np.ndarray, *, bad_every: int = 0) -> SampleTable:
    length = np.array([0 if bad_every and s % bad_every == 0 else 1 + s % 7 for s in seq.tolist()], np.int32)
    digest = np.array([_digest(k, s) if n else 0 for k, s, n in zip(source.tolist(), seq.tolist(), length.tolist())], np.int64)
    return SampleTable(source=source, seq=seq, row=seq.copy(), length=length, epoch=np.zeros(len(seq), np.int32), digest=digest)


def test_digests_survive_the_plan_and_lie_beside_the_ranks_in_the_record() -> None:
    source = np.array([0] * 6 + [1] * 6, np.int32)
    seq = np.array(list(range(6)) + list(range(6)), np.int64)
    table = _table(source, seq, bad_every=4)
    plan = build_step_plan(0, table, dp=2, microbatches=2, method="greedy", cost_fn=QUADRATIC)
    assert (plan.samples.digest == [_digest(k, s) for k, s in zip(plan.samples.source, plan.samples.seq)]).all()
    taken = [IntervalSet([(0, 6)]), IntervalSet([(0, 6)])]
    record = Ledger(NAMES, method="greedy").record(None, plan, MixtureState.initial(2), taken=taken, delivered_below=0)
    assert [[len(mb) for mb in rank] for rank in record["digests"]] == [[len(mb) for mb in rank] for rank in record["ranks"]]
    held = digests_of(record, NAMES)
    assert held == {(int(k), int(r), 0): _digest(k, r) for k, r, n in zip(table.source, table.row, table.length) if n}
    assert digests_of(record, NAMES, skip=("a",)) == {key: d for key, d in held.items() if key[0] == 1}
    assert "digests" in DETAIL_FIELDS  # a thinned segment drops them with the ranks
    # Samples nobody summarized (a simulation) record no digests.
    bare = dataclasses.replace(table, digest=np.zeros(len(table), np.int64))
    assert record_digests(build_step_plan(0, bare, dp=2, microbatches=1, method="greedy", cost_fn=QUADRATIC)) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**63), 2**63 - 1))
def test_a_recorded_digest_reads_back_as_the_same_int64(value) -> None:
    text = to_hex(value)
    assert len(text) == 16 and int(text, 16) >= 0 and from_hex(text) == value


def test_held_to_puts_the_recorded_digests_in_and_names_the_samples_that_changed() -> None:
    source, seq = np.zeros(6, np.int32), np.arange(6, dtype=np.int64)
    table = _table(source, seq, bad_every=5)  # seq 0 and 5 are bad: no digest
    recorded = {(0, 1, 0): _digest(0, 1), (0, 2, 0): 12345, (0, 5, 0): 999, (1, 3, 0): 4}  # 2 differs; 5 is bad now; (1, 3) not here
    held, changed = held_to(table, recorded)
    assert changed.tolist() == [2]
    assert held.digest.tolist() == [0, _digest(0, 1), 12345, _digest(0, 3), _digest(0, 4), 0]
    assert table.digest[2] == _digest(0, 2), "the table given is not changed"
    same, none = held_to(table, {})
    assert same is table and not len(none)


def _run(job: JobSettings, storage: MemoryStorage, steps: int, *, first: int = 0) -> list[dict]:
    """Plans and records steps first .. first + steps - 1 (samples carrying digests) in a new
    generation of `storage`'s ledger, as a planner run does."""
    schedule = load_schedule(job, load_strategy(job))
    mixture = job_mixture(job, schedule, num_rows=ROWS)
    state = mixture.fast_forward(MixtureState.initial(2), first)
    writer = new_generation(LedgerReader(storage), first, job=job)
    ledger = Ledger(job.source_names, method="greedy")
    ledger.assume_consumed(state.cursors)
    records = []
    for step in range(first, first + steps):
        allocation, after = mixture.allocate(state)
        parts = [
            (np.full(c, k, np.int32), np.arange(s, s + c, dtype=np.int64))
            for k, (s, c) in enumerate(zip(allocation.starts, allocation.counts))
        ]
        table = _table(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        plan = build_step_plan(step, table, dp=2, microbatches=1, method="greedy", cost_fn=QUADRATIC)
        records.append(ledger.record(allocation, plan, after))
        writer.append([records[-1]])
        state = after
    return records


def test_a_start_or_rewind_reads_back_the_digests_of_the_steps_it_plans_again() -> None:
    job, storage = _job(), MemoryStorage()
    records = _run(job, storage, 6)
    got = recorded_digests(LedgerReader(storage), 3, job=job)
    expected = {key: d for r in records[3:] for key, d in digests_of(r, NAMES).items()}
    assert got == expected and len(got) == 3 * 8
    assert recorded_digests(LedgerReader(storage), 6, job=job) == {}
    assert recorded_digests(LedgerReader(storage), 3, job=job, restarted=("a",)) == {k: d for k, d in expected.items() if k[0] == 1}
    # Steps another data setting planned (another seed: other samples at those positions) hold nothing.
    assert recorded_digests(LedgerReader(storage), 0, job=_job(seed=1)) == {}


def test_what_a_start_or_rewind_reads_back_is_bounded_to_the_steps_nearest_it(monkeypatch) -> None:
    job, storage = _job(), MemoryStorage()
    records = _run(job, storage, 6)
    monkeypatch.setattr(restore, "MAX_REPLAY_SAMPLES", 20)  # two steps of 8 samples fit, not three
    assert recorded_digests(LedgerReader(storage), 1, job=job) == {k: d for r in records[1:3] for k, d in digests_of(r, NAMES).items()}
    monkeypatch.setattr(restore, "MAX_REPLAY_STEPS", 1)
    assert recorded_digests(LedgerReader(storage), 1, job=job) == digests_of(records[1], NAMES)


def test_the_summary_store_keeps_digests_from_the_cursor_on() -> None:
    store = SummaryStore(1, lookahead=16)
    store.start((0,))
    digests = np.arange(1, 11, dtype=np.int64) * -3
    store.add(0, 0, np.arange(10, dtype=np.int64), np.full(10, 4, np.int32), False, digests=digests)
    store.add(0, 10, np.arange(10, 12, dtype=np.int64), np.full(2, 4, np.int32), False)  # none sent: 0, unknown
    assert store.digests(0, 2, 10).tolist() == digests[2:].tolist() + [0, 0]
    store.advance((4,))
    assert store.digests(0, 4, 3).tolist() == digests[4:7].tolist() and store.digests(0, 10, 4) is None
    store.rewind((0,), step=0, delivered_below=0)
    assert store.digests(0, 0, 1) is None


# ---- fencing a replica a constructor reports ---------------------------------------------------


def _membership() -> Membership:
    m = Membership(
        job_from_mapping({"job": "j", "sources": [{"name": "a", "path": "a"}], "loaders": {"shuffle": {"window_row_groups": 1}}})
    )
    for replica, address in (("0", "l0:1"), ("rogue", "l1:1")):
        m.register_loader(0, address, [SourceFacts("a", 40, (10, 10, 10, 10))], replica=replica, incarnation=replica)
    m.summary_target(0, 0)  # the planner asks about window 0: routes are fixed from there
    return m


def test_a_reported_replica_is_fenced_its_windows_served_by_a_live_one_and_it_may_not_come_back() -> None:
    m = _membership()
    assert set(m.holders(0, range(40))) == {"l0:1", "l1:1"}
    assert m.fence(0, "l1:1") == ("rogue", "0")
    assert set(m.holders(0, range(40))) == {"l0:1"}, "every window of the fenced replica is served by the other"
    assert m.failed(0, "rogue") and ((0, "rogue"), "l1:1") not in m.watched()
    assert m.fence(0, "l1:1") is None, "fenced already"
    for again in ({"incarnation": "rogue"}, {"incarnation": "new"}, {"incarnation": "x", "shadow_of": "rogue"}):
        with pytest.raises(FailedPrecondition, match="fenced"):
            m.register_loader(0, "l9:1", [SourceFacts("a", 40, (10, 10, 10, 10))], replica="rogue", **again)
    assert m.fence(0, "l0:1") is None, "the group's last live replica is not fenced"
    assert set(m.holders(0, range(40))) == {"l0:1"}


def test_an_address_no_replica_of_the_group_serves_fences_nobody() -> None:
    m = _membership()
    assert m.fence(0, "elsewhere:1") is None
    assert set(m.holders(0, range(40))) == {"l0:1", "l1:1"}


def test_reports_of_altered_samples_are_bounded() -> None:
    report = planner_pb2.AlteredSamples(loader_address="l1:1", source=1, seq=3, step=2, count=1)
    check_altered([report] * MAX_ALTERED_REPORTS, sources=2)
    for reports, field in (
        ([report] * (MAX_ALTERED_REPORTS + 1), "altered has 9 entries"),
        ([planner_pb2.AlteredSamples(source=0)], r"altered\[0\].loader_address is required"),
        ([report, planner_pb2.AlteredSamples(loader_address="a b", source=0)], r"altered\[1\].loader_address must have printable"),
        ([planner_pb2.AlteredSamples(loader_address="l:1", source=2)], r"altered\[0\].source must be in \[0, 2\)"),
        ([planner_pb2.AlteredSamples(loader_address="l:1", source=-1)], r"altered\[0\].source"),
    ):
        with pytest.raises(InvalidArgument, match=field):
            check_altered(reports, sources=2)
