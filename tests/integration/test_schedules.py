"""Mixture schedules through real processes: a staged change takes effect at its exact step on
every rank and is recorded in the ledger, and a job resumed under a new schedule continues the
epoch with no sample lost or repeated."""

from __future__ import annotations

import collections
import pathlib

import pytest
from harness import collect, ledger_records, sample_ids, skewed_lengths, start_cluster, write_job, write_source

pytestmark = pytest.mark.integration

CHANGE = 3


def _sources(root: pathlib.Path):
    return [
        write_source(root / "data", "a", skewed_lengths(60, seed=1), seed=1),
        write_source(root / "data", "b", skewed_lengths(60, seed=2), seed=2),
    ]


def test_a_staged_change_takes_effect_at_its_step_on_every_rank(tmp_path: pathlib.Path) -> None:
    sources = _sources(tmp_path)
    stages = [{"start": 0, "weights": {"a": 1, "b": 0}}, {"start": CHANGE, "weights": {"a": 0, "b": 1}}]
    job = write_job(
        tmp_path / "job.yaml", sources, mixture={"schedule": {"kind": "staged", "stages": stages}}, run_dir=str(tmp_path / "run")
    )
    cluster = start_cluster(job)
    try:
        batches, _ = collect(cluster.endpoints_path, [0, 1])
    finally:
        cluster.stop()
    assert [b["step"] for b in batches[0]] == [b["step"] for b in batches[1]]
    for rank, got in batches.items():
        for batch, step in zip(got, sample_ids(got)):
            expected = 0 if batch["step"] < CHANGE else 1
            assert {source for mb in step for source, _ in mb} == {expected}, (rank, batch["step"])
    # b's 60 samples, 12 a step from step 3 on: steps 3..7; a is unread after the change.
    assert batches[0][-1]["step"] == CHANGE + 60 // 12 - 1
    records = ledger_records(tmp_path / "run")
    assert [r["shares"] for r in records[CHANGE - 1 : CHANGE + 1]] == [[1.0, 0.0], [0.0, 1.0]]


def test_resume_under_a_new_schedule_loses_and_repeats_nothing(tmp_path: pathlib.Path) -> None:
    sources = _sources(tmp_path)
    run_dir = str(tmp_path / "run")
    first_job = write_job(tmp_path / "first.yaml", sources, run_dir=run_dir)
    cluster = start_cluster(first_job)
    try:
        first, states = collect(cluster.endpoints_path, [0, 1], stop_after=CHANGE)
    finally:
        cluster.stop()
    anchors = [{"step": 0, "weights": {"a": 3, "b": 1}}, {"step": 8, "weights": {"a": 1, "b": 3}}]
    schedule = {"kind": "curriculum", "granularity": "microbatch", "anchors": anchors}
    second_job = write_job(tmp_path / "second.yaml", sources, mixture={"schedule": schedule}, run_dir=run_dir)
    cluster = start_cluster(second_job)
    try:
        second, _ = collect(cluster.endpoints_path, [0, 1], states=states)
        planner_log = next(p for p in cluster.processes if p.name == "planner").log_tail(200)
    finally:
        cluster.stop()
    assert f"resumes at step {CHANGE} from the ledger's record of step {CHANGE - 1}" in planner_log
    assert "changed since: mixture" in planner_log
    delivered = collections.Counter()
    for batches in (*first.values(), *second.values()):
        for step in sample_ids(batches):
            delivered.update(sample for mb in step for sample in mb)
    assert max(delivered.values()) == 1, "a sample was delivered twice"
    assert set(delivered) == {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))}
    records = ledger_records(tmp_path / "run")
    shares_b = [r["shares"][1] for r in records[CHANGE:9]]  # both sources have data until step 8
    # b's share at position t is (1 + 2 min(t, 8) / 8) / 4; a step's share is the mean of its two sub-steps'
    share = lambda t: (1 + 2 * min(t, 8) / 8) / 4  # noqa: E731
    assert shares_b == pytest.approx([(share(s) + share(s + 0.5)) / 2 for s in range(CHANGE, 9)])
