"""Tests of batchplane.planner.ledger (running totals, ledger lines, balance figures) and
batchplane.planner.membership (which loaders and constructors joined, and whether they fit)."""

from __future__ import annotations

import json
import math

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.routing import Routing, last_owned
from batchplane.planner.balance import METHODS
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.intervals import IntervalSet
from batchplane.planner.ledger import BalanceTotals, Ledger, state_from_json
from batchplane.planner.membership import Membership, SourceFacts
from batchplane.planner.mixture import Allocation, MixtureState
from batchplane.planner.plan import SampleTable, StepPlan, build_step_plan

QUADRATIC = make_cost_fn("quadratic")
NAMES = ("a", "b", "c")


def _table(rows: list[tuple[int, int, int, int, int]]) -> SampleTable:
    """Rows of (source, seq, row, length, epoch)."""
    source, seq, row, length, epoch = (np.array(c) for c in zip(*rows)) if rows else ([],) * 5
    return SampleTable(
        source=np.asarray(source, np.int32),
        seq=np.asarray(seq, np.int64),
        row=np.asarray(row, np.int64),
        length=np.asarray(length, np.int32),
        epoch=np.asarray(epoch, np.int32),
    )


# Source a: seqs 10..12 (seq 11 is bad, length 0); source b: seqs 0..1; source c: nothing.
# Good samples in (source, seq) order have lengths 5, 3, 8, 2 -> quadratic costs 25, 9, 64, 4.
STEP3 = _table(
    [
        (1, 1, 2, 2, 1),
        (0, 10, 7, 5, 0),
        (0, 11, 3, 0, 0),
        (1, 0, 4, 8, 1),
        (0, 12, 9, 3, 0),
    ]
)
ALLOC3 = Allocation(step=3, starts=(10, 0, 0), counts=(3, 2, 0))
AFTER = MixtureState(step=4, cursors=(13, 2, 0))

# Per-rank costs over dp=2, one microbatch each, as the constructor builds it (every row padded
# to the microbatch's longest; good lengths 5, 3, 8, 2): round robin takes items 0,2 | 1,3 ->
# lengths {5, 8} | {3, 2} -> [2 x 64, 2 x 9] = [128, 18]; greedy and Karmarkar-Karp both give
# {8} | {5, 2, 3} -> [64, 3 x 25] = [64, 75] (their unpadded sums were [64, 38]).
EXPECTED_SPREAD = {
    "round_robin": (128 / 18, 128 / 73),
    "greedy": (75 / 64, 75 / 69.5),
    "karmarkar_karp": (75 / 64, 75 / 69.5),
}


def _plan(
    step: int, table: SampleTable, *, dp: int = 2, microbatches: int = 1, method: str = "karmarkar_karp", cost_fn=QUADRATIC
) -> StepPlan:
    return build_step_plan(step, table, dp=dp, microbatches=microbatches, method=method, cost_fn=cost_fn)


# ---- ledger ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_ledger_totals_count_bad_samples(method: str) -> None:
    ledger = Ledger(NAMES, method=method)
    ledger.record(ALLOC3, _plan(3, STEP3, method=method), AFTER)
    assert ledger.steps == 1
    got = [(t.samples, t.tokens, t.bad_samples) for t in ledger.sources]
    assert got == [(3, 8, 1), (2, 10, 0), (0, 0, 0)]
    for t in ledger.sources:
        assert isinstance(t.tokens, int)


def test_ledger_totals_accumulate_over_steps() -> None:
    ledger = Ledger(NAMES, method="greedy")
    ledger.record(ALLOC3, _plan(3, STEP3, method="greedy"), AFTER)
    step4 = _table([(2, 0, 5, 6, 0), (2, 1, 6, 0, 0), (0, 13, 1, 4, 0)])
    ledger.record(Allocation(step=4, starts=(13, 2, 0), counts=(1, 0, 2)), _plan(4, step4, method="greedy"), AFTER)
    assert ledger.steps == 2
    got = [(t.samples, t.tokens, t.bad_samples) for t in ledger.sources]
    assert got == [(4, 12, 1), (2, 10, 0), (2, 6, 1)]


def test_ledger_line_content() -> None:
    plan = _plan(3, STEP3, dp=2, microbatches=2, method="greedy")
    record = json.loads(json.dumps(Ledger(NAMES, method="greedy").record(ALLOC3, plan, AFTER)))
    assert set(record) == {"step", "shares", "take", "tokens", "bad", "ranks", "after", "consumed"}
    assert record["consumed"] == {"a": [[10, 13]], "b": [[0, 2]]}
    assert record["tokens"] == {"a": 8, "b": 10}
    assert state_from_json(record["after"]) == AFTER
    assert record["step"] == 3
    assert record["take"] == {"a": [10, 3], "b": [0, 2]}  # c took nothing and is left out
    assert record["bad"] == 1
    ranks = record["ranks"]
    assert len(ranks) == 2
    assert all(len(rank) == 2 for rank in ranks)
    # Each microbatch lists [source, row, epoch] of its samples, in plan order.
    identity = {(0, 10): (0, 7, 0), (0, 12): (0, 9, 0), (1, 0): (1, 4, 1), (1, 1): (1, 2, 1)}
    for rank, rank_mbs in zip(plan.microbatches, ranks):
        for mb, listed in zip(rank, rank_mbs):
            expected = [list(identity[(int(plan.samples.source[i]), int(plan.samples.seq[i]))]) for i in mb]
            assert listed == expected
    everything = sorted(tuple(s) for rank in ranks for mb in rank for s in mb)
    assert everything == sorted(identity.values())  # the bad sample (row 3) is not delivered


def test_ledger_line_of_an_all_bad_step() -> None:
    table = _table([(0, 0, 0, 0, 0), (0, 1, 1, 0, 0)])
    ledger = Ledger(NAMES, method="round_robin")
    record = json.loads(json.dumps(ledger.record(Allocation(0, (0, 0, 0), (2, 0, 0)), _plan(0, table, method="round_robin"), AFTER)))
    assert record["take"] == {"a": [0, 2]}
    assert record["bad"] == 2
    assert record["ranks"] == [[[]], [[]]]
    assert (ledger.sources[0].samples, ledger.sources[0].tokens, ledger.sources[0].bad_samples) == (2, 0, 2)
    assert all(b.steps == 0 for b in ledger.balance.values())


@pytest.mark.parametrize("method", METHODS)
def test_balance_figures_for_all_methods_configured_first(method: str) -> None:
    ledger = Ledger(NAMES, method=method, compare=True)
    assert list(ledger.balance)[0] == method
    assert sorted(ledger.balance) == sorted(METHODS)
    plan = _plan(3, STEP3, method=method)
    ledger.record(ALLOC3, plan, AFTER)
    ledger.record(Allocation(4, (13, 2, 0), ALLOC3.counts), _plan(4, STEP3, method=method), AFTER)
    for m, totals in ledger.balance.items():
        assert totals.steps == 2, m
        max_over_min, max_over_mean = EXPECTED_SPREAD[m]
        assert totals.mean_max_over_min == pytest.approx(max_over_min), m
        assert totals.mean_max_over_mean == pytest.approx(max_over_mean), m


def test_balance_is_not_recorded_when_a_step_has_fewer_samples_than_ranks() -> None:
    ledger = Ledger(NAMES, method="karmarkar_karp")
    ledger.record(ALLOC3, _plan(3, STEP3, dp=5), AFTER)  # 4 good samples over 5 ranks
    assert ledger.steps == 1
    for totals in ledger.balance.values():
        assert totals.steps == 0
        assert math.isnan(totals.mean_max_over_min) and math.isnan(totals.mean_max_over_mean)
    assert ledger.sources[0].samples == 3


def test_balance_totals_skip_steps_with_an_idle_rank() -> None:
    totals = BalanceTotals()
    totals.add(np.array([0.0, 5.0]))
    assert totals.steps == 0
    totals.add(np.array([2.0, 4.0]))
    totals.add(np.array([3.0, 3.0]))
    assert totals.steps == 2
    assert totals.mean_max_over_min == pytest.approx((2.0 + 1.0) / 2)
    assert totals.mean_max_over_mean == pytest.approx((4 / 3 + 1.0) / 2)


def test_taking_a_consumed_seq_again_is_refused_and_resume_restores_consumption() -> None:
    ledger = Ledger(NAMES, method="greedy")
    record = ledger.record(ALLOC3, _plan(3, STEP3, method="greedy"), AFTER)
    with pytest.raises(ValueError, match=r"step 4 would take seqs \[\[12, 13\]\] of source 'a' again \(consumed: \[\[10, 13\]\]\)"):
        ledger.record(Allocation(4, (12, 2, 0), ALLOC3.counts), _plan(4, STEP3, method="greedy"), AFTER)
    resumed = Ledger(NAMES, method="greedy")
    resumed.restore(json.loads(json.dumps(record)))
    assert [c.to_list() for c in resumed.consumed] == [[[10, 13]], [[0, 2]], []]
    resumed.assume_consumed((5, 0, 2))
    assert [c.to_list() for c in resumed.consumed] == [[[0, 5]], [], [[0, 2]]]


def test_the_refusal_of_a_consumed_seq_shows_a_few_ranges_and_counts_the_rest() -> None:
    ledger = Ledger(NAMES, method="greedy")
    ledger.consumed[0] = IntervalSet([(s, s + 1) for s in range(0, 20_000, 2)])  # 10,000 ranges
    with pytest.raises(ValueError) as refused:
        ledger.record(Allocation(4, (10, 2, 0), ALLOC3.counts), _plan(4, STEP3, method="greedy"), AFTER)
    message = str(refused.value)
    assert "(consumed: [[0, 1], [2, 3], [4, 5], ... 10000 ranges, 10000 seqs in all])" in message and len(message) < 300


def test_mismatched_allocation_and_plan_step_is_rejected() -> None:
    ledger = Ledger(NAMES, method="greedy")
    with pytest.raises(ValueError, match=r"allocation of step 4 with plan of step 3"):
        ledger.record(Allocation(4, ALLOC3.starts, ALLOC3.counts), _plan(3, STEP3, method="greedy"), AFTER)
    assert ledger.steps == 0
    assert all((t.samples, t.tokens, t.bad_samples) == (0, 0, 0) for t in ledger.sources)
    assert all(b.steps == 0 for b in ledger.balance.values())


# ---- membership ------------------------------------------------------------------------------


def _membership(*, dp: int = 4, ranks_per_constructor: int = 2) -> Membership:
    job = job_from_mapping(
        {
            "job": "j",
            "sources": [{"name": n, "path": n} for n in NAMES],
            "loaders": {"count": 2},  # loader 0: a, c; loader 1: b
            "mesh": {"dp": dp},
            "batch": {"global_batch_size": dp},
            "constructors": {"ranks_per_constructor": ranks_per_constructor},
        }
    )
    return Membership(job)


def _facts(name: str, rows: int, groups: int = 1) -> SourceFacts:
    """A source of `rows` rows in `groups` row groups as equal as possible."""
    sizes = [rows // groups + (g < rows % groups) for g in range(groups)] if rows else [0]
    return SourceFacts(name, rows, tuple(sizes))


def test_loaders_registering_make_the_job_ready() -> None:
    m = _membership()
    assert not m.ready
    assert m.missing_loaders() == [0, 1]
    assert m.summary_target(0, 0) is None
    m.register_loader(0, "host:1", [_facts("a", 10), _facts("c", 5)])
    assert not m.ready
    assert m.missing_loaders() == [1]
    assert m.replicas(0) == {"0": "host:1"} and m.replicas(1) == {}
    assert [m.num_rows(k) for k in range(3)] == [10, None, 5]
    m.register_loader(1, "host:2", [_facts("b", 7)])
    assert m.ready
    assert m.missing_loaders() == []
    assert [m.summary_target(k, 0)[0] for k in range(3)] == ["host:1", "host:2", "host:1"]
    assert [m.num_rows(k) for k in range(3)] == [10, 7, 5]


@pytest.mark.parametrize(
    "reported",
    [
        ["a"],
        ["c", "a"],
        ["a", "c", "b"],
        ["a", "b"],
        [],
    ],
)
def test_loader_with_the_wrong_sources_is_rejected(reported: list[str]) -> None:
    m = _membership()
    with pytest.raises(InvalidArgument) as info:
        m.register_loader(0, "host:1", [_facts(n, 3) for n in reported])
    message = str(info.value)
    assert "loader 0" in message
    assert "['a', 'c']" in message
    assert repr(reported) in message
    assert m.replicas(0) == {} and m.num_rows(0) is None


def test_empty_source_is_rejected_and_nothing_is_recorded() -> None:
    m = _membership()
    with pytest.raises(InvalidArgument, match=r"source 'c' has no rows"):
        m.register_loader(0, "host:1", [_facts("a", 10), _facts("c", 0)])
    assert m.num_rows(0) is None
    assert m.replicas(0) == {}
    assert m.missing_loaders() == [0, 1]


def test_reregistration_replaces_the_address_and_rejects_a_changed_row_count() -> None:
    m = _membership()
    m.register_loader(0, "host:1", [_facts("a", 10), _facts("c", 5)])
    m.register_loader(0, "host:9", [_facts("a", 10), _facts("c", 5)])
    assert m.replicas(0) == {"0": "host:9"}
    with pytest.raises(InvalidArgument, match=r"source 'c' had 5 rows and now has 6"):
        m.register_loader(0, "host:3", [_facts("a", 10), _facts("c", 6)])
    with pytest.raises(InvalidArgument, match=r"other row groups than the group's other replicas"):
        m.register_loader(0, "host:3", [_facts("a", 10), _facts("c", 5, groups=2)], replica="b")
    assert m.replicas(0) == {"0": "host:9"}
    assert m.num_rows(2) == 5


def test_replicas_joining_and_leaving_reroute_only_windows_nobody_was_asked_about() -> None:
    """Source a: 40 rows in 8 row groups of 5, shuffle off, windows of 4 row groups: windows of
    20 positions. Every window asked about keeps its owner whatever joins or leaves."""
    job = job_from_mapping(
        {
            "job": "t",
            "epochs": "infinite",
            "sources": [{"name": "a", "path": "a"}],
            "loaders": {"shuffle": {"enabled": False, "window_row_groups": 4}},
        }
    )
    m = Membership(job)
    m.register_loader(0, "host:r1", [_facts("a", 40, groups=8)], replica="r1")
    asked = {}
    for seq in (0, 20):  # windows 0 and 1 asked about: the frontier is window 2
        address, end = m.summary_target(0, seq)[:2]
        asked[seq] = address
        assert end == seq + 20
    m.register_loader(0, "host:r2", [_facts("a", 40, groups=8)], replica="r2")
    assert m.holders(0, [0, 19, 20, 39]) == ["host:r1"] * 4, "asked-about windows keep their owner"
    owners = [m.summary_target(0, 20 * w)[0] for w in range(2, 6)]
    assert owners == ["host:r1", "host:r2", "host:r1", "host:r2"], "new windows alternate over both"
    drain = m.deregister_loader(0, "r1")
    assert drain == [100], "r1 serves its windows below the frontier (window 6), the last being window 4 (to 100)"
    assert m.holders(0, [40, 60, 80]) == ["host:r1", "host:r2", "host:r1"], "a leaving replica keeps its windows"
    assert [m.summary_target(0, 20 * w)[0] for w in range(6, 9)] == ["host:r2"] * 3
    assert m.summary_target(0, 85)[0] == "host:r1", "a leaver's window still asked about goes to the leaver"
    with pytest.raises(FailedPrecondition, match="left loader group 0; it joins again once restarted"):
        m.register_loader(0, "host:r1", [_facts("a", 40, groups=8)], replica="r1")
    with pytest.raises(FailedPrecondition, match="the last of loader 0"):
        m.deregister_loader(0, "r2")
    with pytest.raises(InvalidArgument, match="has no such replica"):
        m.deregister_loader(0, "r9")


def test_a_replica_leaving_waits_only_for_windows_it_was_asked_about() -> None:
    """r2 joins and is asked for the frontier window at once; r1, never asked again (its routes
    still say every window is its own), leaves: it drains through its own last window, not
    through the frontier, or it would wait for window 3 forever (seen in
    test_loader_replicas under load)."""
    job = job_from_mapping(
        {
            "job": "t",
            "epochs": "infinite",
            "sources": [{"name": "a", "path": "a"}],
            "loaders": {"shuffle": {"enabled": False, "window_row_groups": 4}},
        }
    )
    m = Membership(job)
    m.register_loader(0, "host:r1", [_facts("a", 40, groups=8)], replica="r1")
    assert [m.summary_target(0, seq)[0] for seq in (0, 20, 40)] == ["host:r1"] * 3
    m.register_loader(0, "host:r2", [_facts("a", 40, groups=8)], replica="r2")
    assert m.summary_target(0, 60)[0] == "host:r2", "window 3, the first after the join, is r2's"
    assert m.deregister_loader(0, "r1") == [60], "r1 drains through window 2 (to 60), its last"


@hypothesis.given(
    routes=st.lists(st.tuples(st.integers(1, 30), st.sets(st.sampled_from("abcd"), min_size=1)), min_size=0, max_size=5),
    first=st.sets(st.sampled_from("abcd"), min_size=1),
    replica=st.sampled_from("abcd"),
    before=st.integers(0, 200),
)
def test_last_owned_is_the_last_window_a_scan_finds(routes, first, replica, before) -> None:
    routing = Routing.of(sorted(first))
    start = 0
    for gap, replicas in routes:
        start += gap
        routing = routing.switch(start, sorted(replicas))
    scanned = [w for w in range(before) if routing.owner(w) == replica]
    assert last_owned(routing, replica, before) == (scanned[-1] if scanned else None)


@pytest.mark.parametrize("index", [-1, 2, 10])
def test_loader_index_outside_the_job_is_rejected(index: int) -> None:
    m = _membership()
    with pytest.raises(InvalidArgument, match=rf"loader_index {index} is outside \[0, 2\)"):
        m.register_loader(index, "host:1", [_facts("b", 3)])
    assert m.missing_loaders() == [0, 1]


def test_constructors_register_the_ranks_the_configuration_assigns() -> None:
    m = _membership(dp=4, ranks_per_constructor=2)
    assert m.constructor_ranks(0) is None
    m.register_constructor(0, "c:0", [0, 1])
    m.register_constructor(1, "c:1", (2, 3))
    m.register_constructor(1, "c:1", (2, 3))  # registering again (after a restart) is fine
    assert m.constructor_ranks(0) == (0, 1)
    assert m.constructor_ranks(1) == (2, 3)


@pytest.mark.parametrize("ranks", [[2, 3], [0], [1, 0], [0, 1, 2], [], [0, 0]])
def test_other_ranks_than_the_layout_are_rejected(ranks: list[int]) -> None:
    m = _membership(dp=4, ranks_per_constructor=2)
    with pytest.raises(InvalidArgument, match=rf"constructor 0 must serve ranks \[0, 1\] .*not {_re_list(ranks)}"):
        m.register_constructor(0, "c:0", ranks)
    assert m.constructor_ranks(0) is None


@pytest.mark.parametrize("index", [-1, 2, 9])
def test_constructor_indices_outside_the_layout_are_rejected(index: int) -> None:
    m = _membership(dp=4, ranks_per_constructor=2)
    with pytest.raises(InvalidArgument, match=rf"constructor_index {index} is outside \[0, 2\)"):
        m.register_constructor(index, "c", [0, 1])


def _re_list(values: list[int]) -> str:
    return "\\[" + ", ".join(str(v) for v in values) + "\\]"


def test_other_methods_are_compared_only_when_asked() -> None:
    ledger = Ledger(NAMES, method="greedy")
    ledger.record(ALLOC3, _plan(3, STEP3, method="greedy"), AFTER)
    assert list(ledger.balance) == ["greedy"] and ledger.balance["greedy"].steps == 1
