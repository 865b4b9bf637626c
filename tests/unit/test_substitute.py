"""Failure-transparent substitution (`planner.substitute`, issue 16 point 3): which sample
stands in for which (pure), and what the plan book makes of it under each policy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import FailedPrecondition
from batchplane.planner.journal import LedgerReader
from batchplane.planner.substitute import match

import planner_plane


def test_each_bad_sample_takes_the_next_good_one_after_the_window_in_order() -> None:
    m = match(np.array([3, 7]), np.array([0, 1]), np.array([5, 0, 6, 9]), after_start=10, stream_end=None)
    assert m.pairs == ((3, 10, 0), (7, 12, 1))  # seq 11 is bad too: met on the way, consumed against step 1
    assert m.consumed == 3 and m.homes.tolist() == [0, 1, 1] and m.done


def test_more_samples_are_needed_until_every_bad_one_has_a_substitute() -> None:
    m = match(np.array([3, 7]), np.array([0, 0]), np.array([5]), after_start=10, stream_end=None)
    assert not m.done and m.pairs == ((3, 10, 0),)
    again = match(np.array([3, 7]), np.array([0, 0]), np.array([5, 4]), after_start=10, stream_end=None)
    assert again.done and again.pairs == ((3, 10, 0), (7, 11, 0))


def test_at_the_stream_end_or_the_search_bound_the_rest_go_without() -> None:
    m = match(np.array([3, 7]), np.array([0, 2]), np.array([0, 5]), after_start=10, stream_end=11)
    assert m.done and m.pairs == ((3, -1, 0), (7, -1, 2)) and m.consumed == 1 and m.homes.tolist() == [0]
    bounded = match(np.array([3]), np.array([1]), np.zeros(10, np.int32), after_start=10, stream_end=None, max_search=4)
    assert bounded.done and bounded.pairs == ((3, -1, 1),) and bounded.consumed == 4


@settings(max_examples=200, deadline=None)
@given(
    bad=st.lists(st.integers(0, 99), max_size=12, unique=True),
    after=st.lists(st.integers(0, 3), max_size=40),
    known=st.integers(0, 40),
    end=st.one_of(st.none(), st.integers(0, 40)),
)
def test_substitutes_are_good_distinct_in_order_and_stable_as_more_is_known(bad, after, known, end) -> None:
    bad_seqs = np.array(sorted(bad), np.int64)
    homes = np.arange(len(bad_seqs), dtype=np.int64) % 3
    lengths = np.array(after, np.int32)
    full = match(bad_seqs, homes, lengths, after_start=100, stream_end=None if end is None else 100 + end)
    subs = [s for _, s, _ in full.pairs if s >= 0]
    assert all(lengths[s - 100] > 0 for s in subs), "a substitute is a good sample"
    assert subs == sorted(set(subs)), "distinct, in stream order, matched to the bad ones in order"
    assert [b for b, _, _ in full.pairs] == bad_seqs.tolist()[: len(full.pairs)]
    assert full.consumed == len(full.homes) and all(100 + full.consumed > s for s in subs)
    if full.done:
        assert len(full.pairs) == len(bad_seqs)
    part = match(bad_seqs, homes, lengths[:known], after_start=100, stream_end=None if end is None else 100 + end)
    if part.done:
        assert (part.pairs, part.consumed, part.homes.tolist()) == (full.pairs, full.consumed, full.homes.tolist())
    else:
        assert full.pairs[: len(part.pairs)] == part.pairs, "knowing more never changes what was matched"


# ---- the plan book (real servicer and book, a thread for the loader: `planner_plane`) -------

ROWS = 96


def _job(policy: str = "substitute", **extra):
    return job_from_mapping(
        {
            "job": "substitution",
            "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
            "mixture": {"weights": {"a": 3, "b": 1}},
            "mesh": {"dp": 2},
            "batch": {"global_batch_size": 8, "microbatches": 2, "bad_samples": {"policy": policy, **extra}},
            "loaders": {"count": 1},
        }
    )


def _lengths(source: int, seq: np.ndarray) -> np.ndarray:
    """Lengths no plan chose; every 7th sample of "a" and every 5th of "b" bad."""
    out = (20 + (seq * 31 + 17 * source) % 50).astype(np.int32)
    out[seq % (7 if source == 0 else 5) == 3] = 0
    return out


def _run(job):
    plane = planner_plane.Plane(job, row_groups=[[24] * 4, [32] * 3], lengths=_lengths)
    plane.join()
    try:
        steps = plane.run()
        records = [LedgerReader(plane.ledger).record(s) for s in sorted(steps)]
    finally:
        plane.stop()
    return {s: planner_plane.step_samples(a) for s, a in steps.items()}, records


def _good() -> set[tuple[int, int]]:
    return {(k, s) for k, n in ((0, ROWS), (1, ROWS)) for s in range(n) if _lengths(k, np.array([s]))[0] > 0}


def test_the_book_substitutes_so_every_step_keeps_its_size_and_the_ledger_names_each() -> None:
    steps, records = _run(_job())
    delivered = [pair for s in sorted(steps) for pair in steps[s]]
    assert len(delivered) == len(set(delivered)) and set(delivered) == _good(), "every good sample exactly once"
    last = max(steps)
    for record in records:
        without = sum(e["by"] is None and not e.get("passed_over") for e in record.get("substituted", []))  # its stream ended: none left
        if record["step"] != last:  # the end of data may cut the last step short
            assert len(steps[record["step"]]) == 8 - without, f"step {record['step']} keeps its 8 samples"
    assert sum(e["by"] is None and not e.get("passed_over") for r in records for e in r.get("substituted", [])) <= 2
    named = [(r["step"], e) for r in records for e in r.get("substituted", [])]
    bad = {(k, s) for k in (0, 1) for s in range(ROWS) if _lengths(k, np.array([s]))[0] == 0}
    assert sorted(({"a": 0, "b": 1}[e["source"]], e["bad"][0]) for _, e in named) == sorted(bad), "every bad sample named once"
    for step, e in named:
        k = {"a": 0, "b": 1}[e["source"]]
        assert _lengths(k, np.array([e["bad"][0]]))[0] == 0 and e["reason"] == "unknown"  # the plane's loader gives no reason
        if e["by"] is not None:
            assert (k, e["by"][0]) in steps[step], "the substitute trains in the bad sample's step"
    again, records_again = _run(_job())
    assert again == steps and [r.get("substituted") for r in records_again] == [r.get("substituted") for r in records], (
        "the same substitutions"
    )


def test_policy_skip_trains_steps_short_of_their_bad_samples() -> None:
    steps, records = _run(_job("skip"))
    delivered = [pair for s in sorted(steps) for pair in steps[s]]
    assert set(delivered) == _good() and len(delivered) == len(set(delivered))
    assert min(len(v) for v in steps.values()) < 8 and not any("substituted" in r for r in records)


def test_policy_fail_stops_the_job_naming_the_setting() -> None:
    plane = planner_plane.Plane(_job("fail", max_per_window=0), row_groups=[[24] * 4, [32] * 3], lengths=_lengths)
    plane.join()
    try:
        with pytest.raises(FailedPrecondition, match=r"batch.bad_samples.max_per_window = 0.*'a' positions \[3\]"):
            plane.run()
    finally:
        plane.stop()


def test_substitute_fetches_after_the_window_and_a_replan_finds_the_same_in_its_recorded_range() -> None:
    from batchplane.planner.mixture import Allocation, MixtureState
    from batchplane.planner.plan import SampleTable
    from batchplane.planner.substitute import substitute
    from batchplane.planner.window import Window

    def rows(k: int, lo: int, hi: int) -> SampleTable:
        seq = np.arange(lo, hi, dtype=np.int64)
        return SampleTable(
            source=np.full(len(seq), k, np.int32), seq=seq, row=seq, length=_lengths(k, seq), epoch=np.zeros(len(seq), np.int32)
        )

    last = Allocation(1, (6, 2), (6, 2))
    before = MixtureState(step=0, cursors=(0, 0), phase_counts=(0, 0))
    window = Window(first=0, steps=2, before=before, end=MixtureState(step=2, cursors=(12, 4), phase_counts=(12, 4)))
    table = SampleTable.concat([rows(0, 0, 12), rows(1, 0, 4)])
    home = (table.seq >= np.where(table.source == 0, 6, 2)).astype(np.int64)
    asked = []

    def fetch(k, start, count):
        asked.append((k, start, count))
        return rows(k, start, start + count)

    done = substitute(window, last, table, home, stream_ends=[None, 10], fetch=fetch)
    assert asked[0][:2] == (0, 12) and all(a[0] in (0, 1) for a in asked)
    assert done.window.end.cursors == (14, 5)  # a: bad seqs 3 and 10 take 12 and 13; b: bad 3 takes 4
    assert done.matches[0].pairs == ((3, 12, 0), (10, 13, 1)) and done.matches[1].pairs == ((3, 4, 1),)
    assert len(done.table) == len(table) + 3 and done.home[len(table) :].tolist() == [0, 1, 1]
    # Planned again (a resume): the recorded window holds the substitutes; nothing is fetched.
    again = substitute(
        done.window, last, done.table, home_of(done, len(table)), stream_ends=[None, 10], fetch=lambda *a: pytest.fail("fetched")
    )
    assert {k: m.pairs for k, m in again.matches.items()} == {k: m.pairs for k, m in done.matches.items()}
    assert np.array_equal(again.home, done.home) and again.window.end == done.window.end
    assert substitute(window, last, table, home, stream_ends=[None, 10], fetch=lambda *a: None) is None, "interrupted"


def home_of(done, allocated: int) -> np.ndarray:
    """The steps a re-plan starts from: the allocation's, past the range out of range (as
    `window.home_steps` gives them)."""
    home = done.home.copy()
    home[allocated:] = 2
    return home
