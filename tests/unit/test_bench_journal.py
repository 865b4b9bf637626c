"""Tests of `batchplane bench journal` on a tiny run on the local store: the record fields of each
kind, that committing every step conflicts more than DAC at 8 producers, that slice reads fetch
less than dense reads, that reclamation bounds the bytes stored, and the registry and flags."""

from __future__ import annotations

import argparse

import pytest

from batchplane.bench import BENCHMARKS, journal_commit, load
from batchplane.bench import journal as bench
from batchplane.core.errors import Unavailable
from batchplane.journal.manifest import Commit, ManifestState, Register, StepEntry, StepObject, apply

COMMIT_FIELDS = {
    "kind",
    "store",
    "policy",
    "producers",
    "payload_kb",
    "commit_success_rate",
    "commit_success_rate_ci95",
    "committed_mb_per_s",
    "commit_latency_s",
    "step_visible_latency_s",
    "attempts",
    "conflicts",
    "reprepared",
    "deferred",
    "stale",
    "object_errors",
    "commit_success_rate_counting_reprepares",
    "errors",
    "commits",
    "steps_committed",
    "offered_mb_per_s",
    "fragile_window_s",
    "gap_s",
    "cycle_s",
    "warmup_s",
    "measured_s",
    "attempts_per_producer",
    "manifest_versions",
    "manifest_version_start",
    "manifest_version_end",
    "exactly_once",
    "cpu_util",
    "load_avg",
    "paper_commit_success_rate",
    "paper_committed_mb_per_s",
}
READ_FIELDS = {
    "kind",
    "store",
    "world",
    "read",
    "dp",
    "cp",
    "bytes_per_rank",
    "slice_bytes",
    "read_amplification",
    "latency_p50_s",
    "latency_p95_s",
    "ranks",
    "steps",
}
STORAGE_FIELDS = {"kind", "store", "reclaim", "step", "bytes_stored"}
STATE_FIELDS = {
    "kind",
    "store",
    "payload_kb",
    "commits",
    "commit_latency_s",
    "control_latency_s",
    "manifest_latency_s",
    "control_manifest_latency_s",
    "delta_pct",
    "delta_median_pct",
}


def _args(tmp_path, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(
        [
            "--dir",
            str(tmp_path),
            "--stores",
            "local",
            "--producers",
            "8",
            "--policies",
            "naive,dac",
            "--duration-s",
            "1.5",
            "--warmup-s",
            "0.5",
            "--cycles",
            "2",
            "--max-duration-s",
            "20",
            "--max-warmup-s",
            "10",
            "--payload-kb",
            "10",
            "--build-ms",
            "5",
            "--pregrown-steps",
            "100",
            "--worlds",
            "4,8",
            "--read-cp",
            "2",
            "--slice-kb",
            "4",
            "--read-steps",
            "2",
            "--read-ranks",
            "4",
            "--trace-steps",
            "60",
            "--checkpoint-every",
            "5",
            "--max-lag",
            "20",
            "--trace-points",
            "4",
            "--state-payload-kb",
            "10",
            "--state-commits",
            "2",
            *argv,
        ]
    )


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    messages: list[str] = []
    out = bench.run(_args(tmp_path_factory.mktemp("bench"), []), messages.append)
    assert any("dac x8" in m for m in messages)
    return out


def _kind(result: dict, kind: str) -> list[dict]:
    return [r for r in result["records"] if r["kind"] == kind]


def test_every_record_kind_has_its_fields(result) -> None:
    expected = {"commit": COMMIT_FIELDS, "read": READ_FIELDS, "storage": STORAGE_FIELDS, "producer_state": STATE_FIELDS}
    assert {r["kind"] for r in result["records"]} == set(expected)
    for record in result["records"]:
        assert set(record) == expected[record["kind"]], record["kind"]
    assert {(r["policy"], r["producers"]) for r in _kind(result, "commit")} == {("naive", 8), ("dac", 8)}
    assert {(r["world"], r["read"]) for r in _kind(result, "read")} == {(w, m) for w in (4, 8) for m in ("slice", "dense")}
    assert result["skipped"] == {}
    assert result["paper"]["figure7_at_32_producers"]["dac"] == {"commit_success_rate": 0.963, "committed_mb_per_s": 431.9}


def test_committing_every_step_conflicts_more_than_dac(result) -> None:
    by_policy = {r["policy"]: r for r in _kind(result, "commit")}
    naive, dac = by_policy["naive"], by_policy["dac"]
    assert naive["attempts"] > 0 and dac["attempts"] > 0
    assert naive["conflicts"] > dac["conflicts"]
    assert naive["commit_success_rate"] < dac["commit_success_rate"]
    for r in (naive, dac):
        assert r["exactly_once"]
        assert r["steps_committed"] > 0 and r["committed_mb_per_s"] > 0
        assert r["manifest_version_end"] >= r["manifest_version_start"] + r["commits"]
        assert r["paper_commit_success_rate"] is None  # the paper's figures are at 32 producers


def test_a_commit_record_counts_only_the_attempts_that_end_in_the_window(tmp_path) -> None:
    args = _args(tmp_path, [])
    entry = StepEntry(7, (StepObject("tgb/000000000007.tgb", 2_000_000, "crc32:00000000"),))
    state = apply(apply(ManifestState(), Register("p000")), Commit("p000", 1, (entry,)))
    # (end, batch start, outcome, fragile window, gap, committed, versions caught up on before the
    # put): before, in (lost, won), after.
    results = [
        {
            "attempts": [
                (0.5, 0.4, 1, 0.1, 0.0, ((3, 9_000_000, 0.2),), 5),
                (1.5, 1.0, 0, 0.2, 1.0, (), 0),
                (2.0, 1.0, journal_commit._NO_PUT, 0.0, 9.0, (), 1),  # deferred after catching up: no put
                (2.2, 1.0, journal_commit._STALE, 0.0, 9.0, (), 0),  # grown too old to put: no put
                (2.5, 1.0, 1, 0.4, 3.0, ((7, 2_000_000, 1.2),), 2),
                (4.5, 4.0, -1, 0.1, 0.0, (), 0),
            ],
            "built": [(0.2, 9_000_000), (1.2, 2_000_000), (4.2, 5_000_000)],
            "cpu_s": 1.5,
            "object_errors": 2,
        }
    ]
    r = journal_commit._record("local", "dac", 1, args, results, final=state, version_start=1, start=0.0, window=(1.0, 3.0), cycle_s=1.0)
    assert (r["attempts"], r["conflicts"], r["errors"], r["commits"]) == (2, 1, 0, 1)
    assert r["commit_success_rate"] == 0.5 and r["steps_committed"] == 1 and r["exactly_once"]
    assert r["reprepared"] == 3 and r["deferred"] == 1 and r["commit_success_rate_counting_reprepares"] == 0.2
    assert r["stale"] == 1 and r["object_errors"] == 2
    assert r["committed_mb_per_s"] == pytest.approx(1.0) and r["offered_mb_per_s"] == pytest.approx(1.0)
    assert r["fragile_window_s"] == pytest.approx(0.3) and r["gap_s"] == pytest.approx(2.0)
    assert r["commit_latency_s"] == pytest.approx(1.5) and r["step_visible_latency_s"] == pytest.approx(1.3)
    assert r["cpu_util"] == pytest.approx(0.5) and r["measured_s"] == 2.0 and r["warmup_s"] == 1.0
    other = apply(apply(ManifestState(), Register("p001")), Commit("p001", 1, (entry,)))
    assert not journal_commit._record(
        "local", "dac", 1, args, results, final=other, version_start=1, start=0.0, window=(1.0, 3.0), cycle_s=1.0
    )["exactly_once"]  # committed by another


def test_slice_reads_fetch_about_one_slice_and_dense_reads_the_whole_step(result) -> None:
    for r in _kind(result, "read"):
        assert r["dp"] * r["cp"] == r["world"] and r["cp"] == 2
        if r["read"] == "slice":
            assert r["slice_bytes"] <= r["bytes_per_rank"] < 1.5 * r["slice_bytes"]
        else:
            assert r["bytes_per_rank"] >= r["world"] * r["slice_bytes"]


def test_reclamation_bounds_the_bytes_stored(result) -> None:
    trace = {flag: [r for r in _kind(result, "storage") if r["reclaim"] is flag] for flag in (False, True)}
    kept = [r["bytes_stored"] for r in trace[False]]
    assert kept == sorted(kept) and trace[False][-1]["step"] == 60  # without deletion it only grows
    assert trace[True][-1]["bytes_stored"] < kept[-1] / 2
    summary = {s["reclaim"]: s for s in result["storage_summary"]}
    assert summary[True]["peak_bytes"] < summary[False]["peak_bytes"]


def test_the_benchmark_is_registered_and_refuses_bad_flags(tmp_path) -> None:
    assert BENCHMARKS["journal"] == "batchplane.bench.journal" and load("journal") is bench
    with pytest.raises(ValueError, match="--max-lag"):
        bench.run(_args(tmp_path, ["--max-lag", "10"]), print)
    with pytest.raises(SystemExit):
        _args(tmp_path, ["--policies", "naive,nope"])


def test_the_success_rate_comes_with_its_wilson_interval() -> None:
    assert journal_commit.wilson_interval(0, 0) == [0.0, 1.0]
    assert journal_commit.wilson_interval(150, 151) == pytest.approx([0.9634, 0.9988], abs=1e-4)
    assert journal_commit.wilson_interval(49, 52) == pytest.approx([0.8436, 0.9802], abs=1e-4)
    for wins, n in ((0, 10), (10, 10), (3, 7), (500, 1000)):
        lo, hi = journal_commit.wilson_interval(wins, n)
        assert 0.0 <= lo <= wins / n <= hi <= 1.0


def test_a_step_object_the_store_fails_to_write_is_retried_and_counted(monkeypatch) -> None:
    monkeypatch.setattr(journal_commit.time, "sleep", lambda s: None)
    outcomes = iter([Unavailable("500 from the server"), Unavailable("again"), "written"])

    def flaky() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    failures = [0]
    assert journal_commit._retrying(flaky, failures) == "written" and failures == [2]

    def down() -> None:
        raise Unavailable("down")

    with pytest.raises(Unavailable, match="down"):
        journal_commit._retrying(down, failures)
    assert failures == [2 + journal_commit._OBJECT_TRIES - 1]
