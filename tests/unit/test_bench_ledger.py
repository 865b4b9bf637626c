"""Tests of `batchplane bench ledger` on tiny runs with 10-step segments: record fields, that the
ledger grows with the steps and compaction shrinks it, the budget's stop at a whole segment,
thinning, and the command line."""

from __future__ import annotations

import argparse
import json

import pytest

from batchplane import cli
from batchplane.bench import BENCHMARKS, load
from batchplane.bench import ledger as bench
from batchplane.planner import journal

FIELDS = {
    "dp",
    "batch",
    "sources",
    "microbatches",
    "keep_detail_steps",
    "steps_written",
    "extrapolated",
    "records",
    "segments",
    "step_json_bytes_per_step",
    "bytes_after_compaction",
    "disk_bytes_after_compaction",
    "bytes_per_10k_steps",
    "segment_bytes_per_step",
    "compaction_ratio",
    "record_ms_mean",
    "write_ms_mean",
    "write_ms_p99",
    "compaction_s",
    "compaction_ms_per_segment",
    "open_reader_ms",
    "read_record_ms",
    "read_ok",
    "seconds",
}


@pytest.fixture(autouse=True)
def small_segments(monkeypatch) -> None:
    monkeypatch.setattr(journal, "SEGMENT_STEPS", 10)


def _run(tmp_path, argv: list[str], messages: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--dir", str(tmp_path), "--lag", "3", "--rows", "50000", *argv])
    return bench.run(args, (messages if messages is not None else []).append)


def test_the_ledger_grows_with_the_steps_and_compaction_shrinks_it(tmp_path) -> None:
    messages: list[str] = []
    short, long = (
        _run(tmp_path, ["--config", "2:8:2", "--config", "4:32:3", "--steps", str(steps)], messages)["records"] for steps in (20, 40)
    )
    assert len(messages) == (2 + 1) * 2 + (4 + 1) * 2  # one a segment, one a configuration
    assert list(tmp_path.iterdir()) == []  # the temporary ledgers are gone
    for records, steps in ((short, 20), (long, 40)):
        assert [(r["dp"], r["batch"], r["sources"]) for r in records] == [(2, 8, 2), (4, 32, 3)]
        for r in records:
            assert set(r) == FIELDS
            assert r["steps_written"] == r["records"] == steps and r["segments"] == steps // 10
            assert r["extrapolated"] is True and r["read_ok"] is True and r["keep_detail_steps"] is None
            assert r["bytes_per_10k_steps"] == r["bytes_after_compaction"] * 10_000 / steps
            assert r["disk_bytes_after_compaction"] >= r["bytes_after_compaction"]
            uncompacted = r["step_json_bytes_per_step"] * steps
            assert r["bytes_after_compaction"] < uncompacted / 2  # gzip segments
            assert r["compaction_ratio"] > 2
            assert r["segment_bytes_per_step"] < r["step_json_bytes_per_step"]
    for s, lg in zip(short, long):
        assert lg["bytes_after_compaction"] > 1.5 * s["bytes_after_compaction"]
        assert lg["step_json_bytes_per_step"] == pytest.approx(s["step_json_bytes_per_step"], rel=0.1)
    # More samples a step, more bytes a step.
    assert short[1]["step_json_bytes_per_step"] > 1.5 * short[0]["step_json_bytes_per_step"]


def test_a_partial_last_segment_stays_as_step_records(tmp_path) -> None:
    (r,) = _run(tmp_path, ["--config", "2:8:2", "--steps", "25"])["records"]
    assert r["steps_written"] == r["records"] == 25 and r["segments"] == 2
    assert r["read_ok"] is True
    # The 5 step records of the tail are stored whole, beside the two compacted segments.
    tail = r["bytes_after_compaction"] - r["segment_bytes_per_step"] * 20
    assert tail > 4 * r["step_json_bytes_per_step"]


def test_the_budget_stops_at_a_whole_segment(tmp_path) -> None:
    (r,) = _run(tmp_path, ["--config", "2:8:2", "--steps", "50", "--budget-s", "1e-9"])["records"]
    assert r["steps_written"] == r["records"] == 10 and r["segments"] == 1 and r["extrapolated"] is True


def test_thinning_keeps_a_fraction_and_reads_back(tmp_path) -> None:
    full, thin = (
        _run(tmp_path, ["--config", "4:32:2", "--steps", "30", *extra])["records"][0] for extra in ([], ["--keep-detail-steps", "0"])
    )
    assert thin["keep_detail_steps"] == 0 and thin["read_ok"] is True and thin["segments"] == 3
    assert thin["bytes_after_compaction"] < full["bytes_after_compaction"] / 2


def test_the_cli_prints_one_json_object(tmp_path, capsys) -> None:
    assert BENCHMARKS["ledger"] == "batchplane.bench.ledger" and load("ledger") is bench
    code = cli.main(["bench", "ledger", "--json", "--config", "2:8:2", "--steps", "10", "--dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0
    out = json.loads(captured.out)
    assert out["segment_steps"] == 10 and [r["steps_written"] for r in out["records"]] == [10]
    assert "[ledger] ledger: dp 2, batch 8, 2 sources done: 10 steps" in captured.err


@pytest.mark.parametrize(
    "argv", [["--config", "2:8"], ["--config", "2:0:1"], ["--config", "a:b:c"], ["--steps", "0"], ["--method", "token_budget"]]
)
def test_bad_flags_are_rejected(argv) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


@pytest.mark.parametrize(
    "argv, match", [(["--budget-s", "0"], "--budget-s"), (["--lag", "-1"], "--lag"), (["--keep-detail-steps", "-2"], "--keep-detail-steps")]
)
def test_bad_values_are_refused(tmp_path, argv, match) -> None:
    with pytest.raises(ValueError, match=match):
        _run(tmp_path, ["--steps", "5", *argv])
