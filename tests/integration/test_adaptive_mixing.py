"""Metric-driven mixing through real processes: a trainer reports per-source losses, the planner
adapts the weights within their bounds, and the plan sequence is a function of the reports: an
identical run, and a run stopped and resumed from its checkpoint, plan exactly the same steps."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from harness import run_ranks, ledger_records, skewed_lengths, start_cluster, write_job, write_source

from batchplane.client import Client, InvalidRequestError

pytestmark = pytest.mark.integration

RULE = {
    "initial": {"a": 1, "b": 1},
    "minimum": {"a": 0.2, "b": 0.2},
    "max_change": 0.05,
    "learning_rate": 2.0,
    "smoothing": 0.5,
    "delay_steps": 2,
}


def _job(root: pathlib.Path, run_dir: pathlib.Path) -> pathlib.Path:
    sources = [
        write_source(root / "data", "a", skewed_lengths(160, seed=3), seed=3),
        write_source(root / "data", "b", skewed_lengths(160, seed=4), seed=4),
    ]
    schedule = {"kind": "adaptive", "adaptive": RULE}
    return write_job(
        root / "job.yaml",
        sources,
        mixture={"schedule": schedule},
        batch={"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"},
        run_dir=str(run_dir),
    )


def _loss(source: int, row: int, step: int) -> float:
    """A synthetic training loss: a's stays flat, b's falls fast, so a should gain weight."""
    return (2.0 if source == 0 else 3.0 * 0.9**step) + (row % 7) * 0.01


def _train(endpoints: pathlib.Path, *, states: dict | None = None, stop_after: int | None = None) -> dict[int, dict]:
    """Runs both ranks to the end (or `stop_after` steps); rank 0 reports the mean loss of each
    source's samples it trained on. Returns each rank's state_dict."""
    os.environ["BATCHPLANE_ENDPOINTS"] = str(endpoints)
    out: dict[int, dict] = {}

    def run(rank: int) -> None:
        with Client(rank=rank, timeout_s=60) as client:
            if states:
                client.load_state_dict(states[rank])
            for n, batch in enumerate(client, 1):
                if rank == 0:
                    losses: dict[str, list[float]] = {}
                    for mb in batch["microbatches"]:
                        for k, row in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist()):
                            losses.setdefault(batch["sources"][k], []).append(_loss(k, row, batch["step"]))
                    assert client.report(batch["step"], {name: float(np.mean(v)) for name, v in losses.items()})
                if stop_after is not None and n >= stop_after:
                    break
            out[rank] = client.state_dict()

    run_ranks(run, (0, 1))
    return out


def _plans(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["shares"], r["take"], r["ranks"], r["adaptive"]) for r in records]


def test_weights_adapt_within_bounds_and_a_replay_or_a_resume_plans_the_same_steps(tmp_path: pathlib.Path) -> None:
    job = _job(tmp_path, tmp_path / "run-1")
    cluster = start_cluster(job)
    try:
        _train(cluster.endpoints_path)
    finally:
        cluster.stop()
    first = ledger_records(tmp_path / "run-1")
    weights = [r["adaptive"]["state"]["weights"] for r in first]
    assert weights[0] == [0.5, 0.5] and weights[-1][0] > 0.5 + 0.05, "a's flat loss should have gained it weight"
    for before, after in zip(weights, weights[1:]):
        assert all(0.2 - 1e-12 <= w <= 0.8 + 1e-12 for w in after)
        assert max(abs(x - y) for x, y in zip(before, after)) <= 0.05 + 1e-12
    assert [t for r in first for t, _ in r["adaptive"]["applied"]] == list(range(len(first) - 2)), "step s applies the report of s - 2"

    job = _job(tmp_path / "again", tmp_path / "run-2")
    cluster = start_cluster(job)
    try:
        _train(cluster.endpoints_path)
    finally:
        cluster.stop()
    assert _plans(ledger_records(tmp_path / "run-2")) == _plans(first)

    job = _job(tmp_path / "resumed", tmp_path / "run-3")
    cluster = start_cluster(job)
    try:
        states = _train(cluster.endpoints_path, stop_after=7)
    finally:
        cluster.stop()
    cluster = start_cluster(job)
    try:
        _train(cluster.endpoints_path, states=states)
    finally:
        cluster.stop()
    assert _plans(ledger_records(tmp_path / "run-3")) == _plans(first)


def test_a_bad_report_is_refused_naming_the_source_and_a_static_job_ignores_reports(tmp_path: pathlib.Path) -> None:
    job = _job(tmp_path, tmp_path / "run")
    cluster = start_cluster(job)
    os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
    try:
        with Client(rank=0, timeout_s=30) as client, Client(rank=1, timeout_s=30) as other:
            batch = next(iter(client))
            next(iter(other))
            with pytest.raises(InvalidRequestError, match="'c' names no source"):
                client.report(batch["step"], {"c": 1.0})
            with pytest.raises(InvalidRequestError, match="the loss of source 'a' must be a finite number >= 0"):
                client.report(batch["step"], {"a": float("nan")})
            assert client.report(batch["step"], {"a": 1.0})
            assert not client.report(batch["step"], {"a": 2.0}), "the first report of a step stands"
    finally:
        cluster.stop()
    static = write_job(tmp_path / "static.yaml", [write_source(tmp_path / "d", "a", [5] * 20)], run_dir=str(tmp_path / "static-run"))
    cluster = start_cluster(static)
    os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
    try:
        with Client(rank=0, timeout_s=30) as client, Client(rank=1, timeout_s=30) as other:
            next(iter(client))
            next(iter(other))
            assert not client.report(0, {"a": 1.0})
    finally:
        cluster.stop()
