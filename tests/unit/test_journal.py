"""The durable ledger on a storage: generations, supersession, compaction, lineage queries."""

from __future__ import annotations

import gzip
import json

import pytest

from batchplane.core.storage import MemoryStorage
from batchplane.planner import journal, lineage
from batchplane.planner.journal import SEGMENT_STEPS, LedgerReader, LedgerWriter

SOURCES = ("web", "code")
FP = {"data": "d1", "mixture": "m1", "topology": "t1", "batching": "b1"}


def _record(step: int, gen_tag: int = 0) -> dict:
    return {
        "step": step,
        "shares": [0.75, 0.25],
        "take": {"web": [3 * step, 3], "code": [step, 1]},
        "tokens": {"web": 30, "code": 10 + gen_tag},
        "bad": 0,
        "ranks": [[[[0, 3 * step, 0], [1, step, 0]]], [[[0, 3 * step + 1, 0], [0, 3 * step + 2, 0]]]],
        "after": {"step": step + 1, "cursors": [3 * step + 3, step + 1]},
        "consumed": {"web": [[0, 3 * step + 3]], "code": [[0, step + 1]]},
    }


def _write(storage, start: int, stop: int, *, fingerprints=FP, tag: int = 0) -> LedgerWriter:
    writer = LedgerWriter(LedgerReader(storage), start_step=start, fingerprints=fingerprints, sources=SOURCES)
    for step in range(start, stop):
        writer.append([_record(step, tag)])
    return writer


def test_a_later_generation_supersedes_from_its_start_step() -> None:
    storage = MemoryStorage()
    _write(storage, 0, 12)  # planned ahead to step 11, trainers checkpointed at 8
    _write(storage, 8, 15, fingerprints={**FP, "mixture": "m2"}, tag=1)
    reader = LedgerReader(storage)
    assert [(g.gen, g.start_step, g.fingerprints["mixture"]) for g in reader.generations] == [(1, 0, "m1"), (2, 8, "m2")]
    assert [reader.owner(s).gen for s in (0, 7, 8, 11, 14)] == [1, 1, 2, 2, 2]
    assert [r["tokens"]["code"] for r in reader.records()] == [10] * 8 + [11] * 7
    assert reader.record(15) is None and reader.last_step() == 14


def test_steps_are_written_once() -> None:
    storage = MemoryStorage()
    writer = _write(storage, 0, 3)
    with pytest.raises(RuntimeError, match="ledger record of step 2 exists twice in generation 1"):
        writer.append([_record(2)])


def test_compaction_folds_whole_segments_that_every_rank_passed_and_reads_the_same() -> None:
    storage = MemoryStorage()
    writer = _write(storage, 0, 2 * SEGMENT_STEPS + 10)
    before = list(LedgerReader(storage).records())
    assert writer.compact(SEGMENT_STEPS + 5) == 1
    assert writer.compact(SEGMENT_STEPS + 5) == 0
    keys = storage.list("gen-000001/")
    assert "gen-000001/segments/000000000000-000000000999.json.gz" in keys
    assert len([k for k in keys if "/steps/" in k]) == SEGMENT_STEPS + 10
    assert list(LedgerReader(storage).records()) == before
    size = journal.ledger_size(storage)
    assert size < sum(len(json.dumps(r)) for r in before)


def test_a_crash_between_segment_and_deletes_leaves_identical_duplicates() -> None:
    storage = MemoryStorage()
    writer = _write(storage, 0, SEGMENT_STEPS + 1)
    before = list(LedgerReader(storage).records())
    real_delete = storage.delete
    calls = []

    def crash_after_some(key: str) -> None:
        calls.append(key)
        if len(calls) > 10:
            raise KeyboardInterrupt("crash")
        real_delete(key)

    storage.delete = crash_after_some
    with pytest.raises(KeyboardInterrupt):
        writer.compact(SEGMENT_STEPS + 1)
    storage.delete = real_delete
    assert list(LedgerReader(storage).records()) == before


def test_a_generation_number_is_never_shared() -> None:
    storage = MemoryStorage()
    storage.put_if_absent("gen-000001/head.json", json.dumps({"start_step": 0, "fingerprints": FP, "sources": list(SOURCES)}).encode())
    a = LedgerWriter(LedgerReader(storage), start_step=0, fingerprints=FP, sources=SOURCES)
    assert a.generation.gen == 2


def test_lineage_show_find_and_stats() -> None:
    storage = MemoryStorage()
    _write(storage, 0, 4)
    reader = LedgerReader(storage)
    rows = lineage.step_table(reader.record(2), SOURCES)
    assert rows == [
        {"bucket": 0, "microbatch": 0, "samples": 2, "ids": ["web:6", "code:2"]},
        {"bucket": 1, "microbatch": 0, "samples": 2, "ids": ["web:7", "web:8"]},
    ]
    assert lineage.find(reader.records(), 0, 7) == ([lineage.Sighting(step=2, bucket=1, microbatch=0, epoch=0)], [])
    assert lineage.find(reader.records(), 1, 99) == ([], [])
    stats = lineage.realized_mixture(reader.records(1, 2), SOURCES)
    assert (stats["steps"], stats["first"], stats["last"], stats["samples"]) == (2, 1, 2, 8)
    web = stats["sources"][0]
    assert (web["target"], web["sample_share"], web["drift"]) == (0.75, 0.75, 0.0)
    assert lineage.parse_sample("code:12", SOURCES) == (1, 12)
    for bad, message in (("code", "expected SOURCE:INDEX"), ("nope:1", "no source 'nope'"), ("web:-1", "row number")):
        with pytest.raises(ValueError, match=message):
            lineage.parse_sample(bad, SOURCES)


def test_thinning_drops_only_the_per_rank_detail_of_old_segments_and_bounds_the_size() -> None:
    storage = MemoryStorage()
    writer = LedgerWriter(
        LedgerReader(storage), start_step=0, fingerprints=FP, sources=SOURCES, keep_detail_steps=SEGMENT_STEPS + SEGMENT_STEPS // 2
    )
    for step in range(3 * SEGMENT_STEPS + 10):
        writer.append([_record(step)])
        writer.compact(step - 4)  # the slowest rank is 4 steps behind the planner
    keys = storage.list("gen-000001/segments/")
    assert keys == [
        "gen-000001/segments/000000000000-000000000999.thin.json.gz",
        "gen-000001/segments/000000001000-000000001999.json.gz",
        "gen-000001/segments/000000002000-000000002999.json.gz",
    ]
    reader = LedgerReader(storage)
    old, recent = reader.record(10), reader.record(SEGMENT_STEPS + 10)
    assert lineage.is_thinned(old) and not lineage.is_thinned(recent)
    assert old == {k: v for k, v in _record(10).items() if k != "ranks"}
    assert recent == _record(SEGMENT_STEPS + 10)
    assert lineage.find(reader.records(), 0, 30) == ([], list(range(SEGMENT_STEPS)))
    stats = lineage.realized_mixture(reader.records(), SOURCES)
    assert stats["samples"] == 4 * (3 * SEGMENT_STEPS + 10), "thinned records still count for the mixture"
    whole = len(gzip.decompress(storage.get(keys[1])))
    thin = len(gzip.decompress(storage.get(keys[0])))
    assert thin < 0.8 * whole


def test_a_crash_while_thinning_leaves_the_whole_segment_readable() -> None:
    storage = MemoryStorage()
    writer = LedgerWriter(LedgerReader(storage), start_step=0, fingerprints=FP, sources=SOURCES, keep_detail_steps=0)
    for step in range(SEGMENT_STEPS + 1):
        writer.append([_record(step)])
    real_delete = storage.delete

    def crash_on_the_whole_segment(key: str) -> None:
        if key.endswith("999.json.gz"):
            raise KeyboardInterrupt("crash")
        real_delete(key)

    storage.delete = crash_on_the_whole_segment
    with pytest.raises(KeyboardInterrupt):
        writer.compact(SEGMENT_STEPS + 1)
    assert len(storage.list("gen-000001/segments/")) == 2
    assert LedgerReader(storage).record(5) == _record(5), "readers prefer the whole segment"


def test_reports_are_kept_first_wins_by_generation_and_deleted_once_folded() -> None:
    storage = MemoryStorage()
    first = LedgerWriter(LedgerReader(storage), start_step=0, fingerprints=FP, sources=SOURCES)
    assert first.put_report(3, {"losses": {"web": 1.0}}) == {"losses": {"web": 1.0}}
    assert first.put_report(3, {"losses": {"web": 2.0}}) == {"losses": {"web": 1.0}}, "the first report stands"
    first.put_report(9, {"losses": {"web": 5.0}})
    second = LedgerWriter(LedgerReader(storage), start_step=8, fingerprints=FP, sources=SOURCES)
    second.put_report(9, {"losses": {"web": 6.0}})
    reader = LedgerReader(storage)
    assert reader.report(3) == {"losses": {"web": 1.0}}
    assert reader.report(9) == {"losses": {"web": 6.0}}, "a step at or after a generation's start counts from it"
    assert reader.report(4) is None
    for step in range(8, SEGMENT_STEPS + 20):
        second.append([_record(step)])
        second.put_report(step, {"losses": {"code": float(step)}})
    second.compact(SEGMENT_STEPS + 20, report_delay=8)
    left = [int(k[-17:-5]) for k in storage.list("gen-000002/reports/")]
    assert left == list(range(SEGMENT_STEPS - 8, SEGMENT_STEPS + 20)), "reports whose applying record was folded are gone"


def test_a_generation_supersedes_every_later_step_even_those_it_has_not_planned_yet() -> None:
    storage = MemoryStorage()
    _write(storage, 0, 12)
    _write(storage, 8, 10, tag=1)  # restarted at 8, planned only 8 and 9 so far
    reader = LedgerReader(storage)
    assert reader.record(10) is None and reader.owner(11) is None
    assert reader.last_step() == 9
    assert [r["step"] for r in reader.records()] == list(range(10))
    _write(storage, 5, 6, tag=2)  # resumed from an older checkpoint: supersedes generation 2 too
    reader = LedgerReader(storage)
    assert reader.last_step() == 5 and reader.record(8) is None and reader.record(5)["tokens"]["code"] == 12


def test_a_new_generation_folds_the_loose_steps_earlier_ones_left() -> None:
    storage = MemoryStorage()
    first = _write(storage, 0, SEGMENT_STEPS + 6)
    first.compact(SEGMENT_STEPS + 3)  # a restart at 1003: steps 1000..1005 of generation 1 stay loose
    before = [LedgerReader(storage).record(s) for s in range(SEGMENT_STEPS + 3)]
    second = _write(storage, SEGMENT_STEPS + 3, SEGMENT_STEPS + 8, tag=1)
    second.compact(SEGMENT_STEPS + 3)
    assert storage.list("gen-000001/steps/") == []
    assert "gen-000001/segments/000000001000-000000001005.json.gz" in storage.list("gen-000001/segments/")
    reader = LedgerReader(storage)
    assert [reader.record(s) for s in range(SEGMENT_STEPS + 3)] == before
    assert reader.owner(SEGMENT_STEPS + 4).gen == 2
