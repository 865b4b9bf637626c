"""Shadow loaders: with `loaders.shadow`, a hot standby follows each loader. SIGKILL a loader and
the planner declares it failed (health probes, summary requests) and promotes its shadow;
constructors fetch from the shadow; the failed loader, restarted, becomes the new shadow, and
takes over in turn when the promoted one is killed. The trainers receive exactly what an
undisturbed run delivers."""

from __future__ import annotations

import pathlib

import pytest
from disturbed import Act, Kill, disturb, undisturbed_run
from harness import assert_same_batches, running_cluster, scrape, skewed_lengths, wait_until, write_job, write_source

from batchplane.launcher.local import LocalCluster, ServiceProcess

pytestmark = pytest.mark.integration

FIRST_KILL, SECOND_KILL = 8, 50


def _job(root: pathlib.Path, sources, run: str, *, shadow: bool) -> pathlib.Path:
    return write_job(
        root / f"{run}.yaml",
        sources,
        run_dir=str(root / run),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        loaders={
            "count": 2,
            "read_ahead_samples": 20,
            "shuffle": {"window_row_groups": 1},
            "shadow": shadow,
            "failover": {"probe_interval_s": 0.1, "failures": 3},
        },
    )


def test_a_killed_loader_is_replaced_by_its_shadow_and_nothing_changes_for_the_trainers(tmp_path: pathlib.Path) -> None:
    sources = [
        write_source(tmp_path / "data", name, skewed_lengths(rows, seed=i), row_group_size=10, seed=i)
        for i, (name, rows) in enumerate([("a", 300), ("b", 240), ("c", 180)])
    ]
    expected = undisturbed_run(_job(tmp_path, sources, "undisturbed", shadow=False), [0, 1])

    def restart_once_promoted(cluster: LocalCluster) -> ServiceProcess:
        """loader-0, killed, is restarted once its shadow took over: it comes back as the shadow."""
        wait_until(lambda: _promotions(cluster) >= 1, timeout_s=30, what="the shadow of loader 0 to be promoted")
        return cluster.restart(next(p for p in cluster.loaders if p.name == "loader-0"))

    schedule = [
        Kill(FIRST_KILL, "loader-0", restart=False),
        Act(FIRST_KILL, restart_once_promoted, hold=True),  # however long a start takes, the second kill comes mid-run
        Kill(SECOND_KILL, "loader-0-shadow", restart=False),  # the promoted one: the restarted original takes over again
    ]
    with running_cluster(_job(tmp_path, sources, "shadowed", shadow=True)) as cluster:
        names = sorted(p.name for p in cluster.loaders)
        assert names == ["loader-0", "loader-0-shadow", "loader-1", "loader-1-shadow"]
        got = disturb(cluster, [0, 1], schedule, step_s=0.04)
        metrics = scrape(f"http://127.0.0.1:{cluster.planner.metrics_port}/metrics")
        planner_log = cluster.planner.log_path.read_text()
    (restarted,) = got.acted
    assert got.killed[1].at < len(expected.batches[0]) - 1, "the second kill came after the last step"
    assert "serving as the shadow of replica '0'" in restarted.log_path.read_text()
    assert planner_log.count("promoted its shadow") == 2
    assert metrics['batchplane_planner_shadow_promotions_total{group="0"}'] == 2
    assert metrics['batchplane_planner_loader_failures_total{group="0"}'] == 2
    assert_same_batches(got.batches, expected.batches)


def _promotions(cluster: LocalCluster) -> float:
    """How many times the planner promoted the shadow of loader group 0."""
    metrics = scrape(f"http://127.0.0.1:{cluster.planner.metrics_port}/metrics")
    return metrics.get('batchplane_planner_shadow_promotions_total{group="0"}', 0)
