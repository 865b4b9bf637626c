"""Loader groups scale while the job runs, with real processes: a replica joins a source's loader
group mid-epoch and takes half of the windows not yet asked about; then the original replica
leaves, serves the windows it was routed and exits; the trainers see every sample exactly once
(I1) and every rank the same steps (I2)."""

from __future__ import annotations

import collections
import pathlib
import threading
import time

import pytest
from harness import assert_same_batches, collect, sample_ids, scrape, start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration

JOIN_AT, LEAVE_AT = 8, 40


def test_a_replica_joins_and_the_original_leaves_mid_epoch_and_nothing_is_lost(tmp_path: pathlib.Path) -> None:
    sources = [
        write_source(tmp_path / "data", "a", [8] * 1600, files=2, row_group_size=10, seed=1),
        write_source(tmp_path / "data", "b", [8] * 160, files=1, row_group_size=20, seed=2),
    ]
    job = write_job(
        tmp_path / "job.yaml", sources, run_dir=str(tmp_path / "run"),
        batch={"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"},
        loaders={"read_ahead_samples": 40, "shuffle": {"window_row_groups": 2}},
    )
    cluster = start_cluster(job)
    reached = collections.Counter()
    progress = threading.Condition()

    def paced(rank: int, batch: dict) -> None:
        time.sleep(0.02)
        with progress:
            reached[rank] = batch["step"]
            progress.notify_all()

    def scale() -> None:
        with progress:
            progress.wait_for(lambda: min(reached[0], reached[1]) >= JOIN_AT, timeout=120)
        scaled["joined"] = cluster.add_loader(0)
        with progress:
            progress.wait_for(lambda: min(reached[0], reached[1]) >= LEAVE_AT, timeout=120)
        original = next(p for p in cluster.loaders if p.name == "loader-0")
        scaled["sent_before_leaving"] = scrape(f"http://127.0.0.1:{original.metrics_port}/metrics")['batchplane_loader_samples_sent_total{source="a"}']
        cluster.remove_loader(original)
        scaled["left"] = original

    scaled: dict = {}
    scaler = threading.Thread(target=scale)
    try:
        scaler.start()
        batches, _ = collect(cluster.endpoints_path, [0, 1], on_batch=paced)
        scaler.join(timeout=120)
        joined = scaled["joined"]
        wait_until(lambda: "left" in scaled, timeout_s=10, what="the original replica to leave")
        sent_by_joined = scrape(f"http://127.0.0.1:{joined.metrics_port}/metrics")['batchplane_loader_samples_sent_total{source="a"}']
        left_log = scaled["left"].log_tail(50)
    finally:
        cluster.stop()
    assert [b["step"] for b in batches[0]] == [b["step"] for b in batches[1]], "every rank gets the same steps (I2)"
    delivered = collections.Counter(s for rank in (0, 1) for step in sample_ids(batches[rank]) for mb in step for s in mb)
    assert max(delivered.values()) == 1, "a sample was delivered twice"
    assert set(delivered) == {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))}, "a sample was lost"
    assert scaled["left"].popen.returncode == 0 and "every window routed here was served" in left_log
    assert 0 < sent_by_joined < 1600 and 0 < scaled["sent_before_leaving"] < 1600, "both replicas served part of source a"


def test_a_replica_killed_without_a_shadow_is_adopted_by_its_sibling(tmp_path: pathlib.Path) -> None:
    """SIGKILL one of two replicas of a group and never restart it: the planner declares it
    failed and the other replica serves its windows (reading again what it needs); the trainers
    receive exactly what an undisturbed run delivers."""
    sources = [
        write_source(tmp_path / "data", "a", [8] * 600, files=2, row_group_size=10, seed=1),
        write_source(tmp_path / "data", "b", [8] * 160, files=1, row_group_size=20, seed=2),
    ]

    def job(run: str) -> pathlib.Path:
        return write_job(
            tmp_path / f"{run}.yaml", sources, run_dir=str(tmp_path / run),
            batch={"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"},
            loaders={"read_ahead_samples": 40, "shuffle": {"window_row_groups": 2}, "failover": {"probe_interval_s": 0.1, "failures": 3}},
        )

    cluster = start_cluster(job("undisturbed"))
    try:
        expected, _ = collect(cluster.endpoints_path, [0, 1])
    finally:
        cluster.stop()

    cluster = start_cluster(job("adopted"))
    reached = collections.Counter()
    progress = threading.Condition()
    events: dict = {}

    def paced(rank: int, batch: dict) -> None:
        time.sleep(0.02)
        with progress:
            reached[rank] = batch["step"]
            progress.notify_all()

    def scale_then_kill() -> None:
        try:
            with progress:
                progress.wait_for(lambda: min(reached[0], reached[1]) >= 4, timeout=120)
            cluster.add_loader(0)
            with progress:
                progress.wait_for(lambda: min(reached[0], reached[1]) >= 30, timeout=120)
            original = next(p for p in cluster.loaders if p.name == "loader-0")
            original.popen.kill()  # SIGKILL; nobody restarts it
            original.popen.wait()
            events["killed_at"] = min(reached[0], reached[1])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            events["failure"] = exc

    killer = threading.Thread(target=scale_then_kill)
    try:
        killer.start()
        got, _ = collect(cluster.endpoints_path, [0, 1], on_batch=paced)
        killer.join(timeout=120)
        planner_log = cluster.planner.log_path.read_text()
        metrics = scrape(f"http://127.0.0.1:{cluster.planner.metrics_port}/metrics")
    finally:
        cluster.stop()
    if "failure" in events:
        raise events["failure"]
    assert events["killed_at"] < len(expected[0]) - 1
    assert "loader replica '0' of group 0 failed: replica '0-1' serves its windows" in planner_log
    assert metrics['batchplane_planner_loader_adoptions_total{group="0"}'] == 1
    assert_same_batches(got, expected)
