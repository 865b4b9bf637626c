"""Exact resume across changes, with real processes: a job checkpointed at step k restarts with
another mixture and twice the data-parallel ranks, and the epoch continues with no sample lost
and none repeated, re-planned from the durable ledger; `batchplane ledger` reads the lineage;
a change the planner cannot honour is refused clearly."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys

import pytest
from harness import collect, sample_ids, skewed_lengths, start_cluster, write_job, write_source

from batchplane.client import DataPlaneError

pytestmark = pytest.mark.integration

STOP_AFTER = 3


def _sources(root: pathlib.Path):
    return [
        write_source(root / "data", "a", skewed_lengths(90, seed=5), seed=5),
        write_source(root / "data", "b", skewed_lengths(60, seed=6), seed=6),
    ]


def _job(path: pathlib.Path, sources, *, dp: int, weights: dict, run_dir: pathlib.Path) -> pathlib.Path:
    return write_job(
        path,
        sources,
        mesh={"dp": dp},
        mixture={"weights": weights},
        run_dir=str(run_dir),
        batch={"global_batch_size": 12, "microbatches": 2, "token_dtype": "int32"},
    )


def _first_run(tmp_path: pathlib.Path, sources, run_dir: pathlib.Path):
    cluster = start_cluster(_job(tmp_path / "first.yaml", sources, dp=2, weights={"a": 1, "b": 1}, run_dir=run_dir))
    try:
        batches, states = collect(cluster.endpoints_path, [0, 1], stop_after=STOP_AFTER)
    finally:
        cluster.stop()
    assert {s["next_step"] for s in states.values()} == {STOP_AFTER}
    return batches, states


def _ledger_cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "batchplane.cli", "ledger", *args, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_resume_with_another_mixture_and_dp_2_to_4_loses_and_repeats_nothing(tmp_path: pathlib.Path) -> None:
    sources = _sources(tmp_path)
    run_dir = tmp_path / "run"
    first, states = _first_run(tmp_path, sources, run_dir)
    cluster = start_cluster(_job(tmp_path / "second.yaml", sources, dp=4, weights={"a": 3, "b": 1}, run_dir=run_dir))
    try:
        second, _ = collect(cluster.endpoints_path, range(4), states={r: states[0] for r in range(4)})
        planner_log = next(p for p in cluster.processes if p.name == "planner").log_tail(200)
    finally:
        cluster.stop()
    assert "resumes at step 3 from the ledger's record of step 2" in planner_log
    assert "changed since: mixture, topology" in planner_log
    delivered = collections.Counter()
    for batches in (*first.values(), *second.values()):
        for step in sample_ids(batches):
            delivered.update(sample for mb in step for sample in mb)
    assert max(delivered.values()) == 1, "a sample was delivered twice"
    assert set(delivered) == {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))}
    assert [b["step"] for b in second[0]] == [b["step"] for b in second[3]] and second[0][0]["step"] == STOP_AFTER

    ledger = str(run_dir / "ledger")
    stats = _ledger_cli("stats", "--ledger", ledger)
    assert stats["samples"] == len(delivered) and stats["first"] == 0
    shown = _ledger_cli("show", "--ledger", ledger, "--step", "4")
    assert len({row["bucket"] for row in shown["microbatches"]}) == 4 and shown["generation"] == 2
    assert shown["shares"] == {"a": 0.75, "b": 0.25}
    (k, row), _ = delivered.most_common(1)[0]
    found = _ledger_cli("find", "--ledger", ledger, f"{'ab'[k]}:{row}")
    assert len(found["seen"]) == 1


def test_a_mixture_change_without_the_ledger_is_refused(tmp_path: pathlib.Path) -> None:
    sources = _sources(tmp_path)
    _, states = _first_run(tmp_path, sources, tmp_path / "run")
    cluster = start_cluster(_job(tmp_path / "elsewhere.yaml", sources, dp=2, weights={"a": 3, "b": 1}, run_dir=tmp_path / "new-run"))
    try:
        with pytest.raises(
            DataPlaneError, match=r"cannot resume at step 3 across a mixture change: the ledger at .* has no record of step 2"
        ):
            collect(cluster.endpoints_path, [0, 1], states=states)
    finally:
        cluster.stop()
