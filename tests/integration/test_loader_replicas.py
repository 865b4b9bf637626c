"""Loader groups scale while the job runs, with real processes: a replica joins a source's loader
group mid-epoch and takes half of the windows not yet asked about; then the original replica
leaves, serves the windows it was routed and exits; the trainers see every sample exactly once
(I1) and every rank the same steps (I2)."""

from __future__ import annotations

import collections
import pathlib

import pytest
from disturbed import Act, Kill, disturb, undisturbed_run
from harness import assert_same_batches, running_cluster, sample_ids, scrape, write_job, write_source

from batchplane.launcher.local import LocalCluster, ServiceProcess

pytestmark = pytest.mark.integration

JOIN_AT, LEAVE_AT = 8, 40


def test_a_replica_joins_and_the_original_leaves_mid_epoch_and_nothing_is_lost(tmp_path: pathlib.Path) -> None:
    sources = [
        write_source(tmp_path / "data", "a", [8] * 1600, files=2, row_group_size=10, seed=1),
        write_source(tmp_path / "data", "b", [8] * 160, files=1, row_group_size=20, seed=2),
    ]
    job = write_job(
        tmp_path / "job.yaml",
        sources,
        run_dir=str(tmp_path / "run"),
        batch={"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"},
        loaders={"read_ahead_samples": 40, "shuffle": {"window_row_groups": 2}},
    )

    def leave(cluster: LocalCluster) -> tuple[ServiceProcess, float]:
        """The original replica leaves; returns it and what it had sent of source a before."""
        original = next(p for p in cluster.loaders if p.name == "loader-0")
        sent = scrape(f"http://127.0.0.1:{original.metrics_port}/metrics")['batchplane_loader_samples_sent_total{source="a"}']
        cluster.remove_loader(original)
        return original, sent

    with running_cluster(job) as cluster:  # the trainers wait for the new replica to start (a long step)
        run = disturb(cluster, [0, 1], [Act(JOIN_AT, lambda c: c.add_loader(0), hold=True), Act(LEAVE_AT, leave)], step_s=0.02)
        joined, (left, sent_before_leaving) = run.acted
        sent_by_joined = scrape(f"http://127.0.0.1:{joined.metrics_port}/metrics")['batchplane_loader_samples_sent_total{source="a"}']
        left_log = left.log_tail(50)
    batches = run.batches
    assert [b["step"] for b in batches[0]] == [b["step"] for b in batches[1]], "every rank gets the same steps (I2)"
    delivered = collections.Counter(s for rank in (0, 1) for step in sample_ids(batches[rank]) for mb in step for s in mb)
    assert max(delivered.values()) == 1, "a sample was delivered twice"
    assert set(delivered) == {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))}, "a sample was lost"
    assert left.popen.returncode == 0 and "every window routed here was served" in left_log
    assert 0 < sent_by_joined < 1600 and 0 < sent_before_leaving < 1600, "both replicas served part of source a"


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
            tmp_path / f"{run}.yaml",
            sources,
            run_dir=str(tmp_path / run),
            batch={"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"},
            loaders={"read_ahead_samples": 40, "shuffle": {"window_row_groups": 2}, "failover": {"probe_interval_s": 0.1, "failures": 3}},
        )

    expected = undisturbed_run(job("undisturbed"), [0, 1])
    with running_cluster(job("adopted")) as cluster:
        # a second replica joins (the trainers wait for it: however long it takes to start, the
        # kill comes mid-run); then the original dies, and nobody restarts it
        got = disturb(cluster, [0, 1], [Act(4, lambda c: c.add_loader(0), hold=True), Kill(30, "loader-0", restart=False)], step_s=0.02)
        planner_log = cluster.planner.log_path.read_text()
        metrics = scrape(f"http://127.0.0.1:{cluster.planner.metrics_port}/metrics")
    (killed,) = got.killed
    assert killed.at < len(expected.batches[0]) - 1
    assert "loader replica '0' of group 0 failed: replica '0-1' serves its windows" in planner_log
    assert metrics['batchplane_planner_loader_adoptions_total{group="0"}'] == 1
    assert_same_batches(got.batches, expected.batches)
