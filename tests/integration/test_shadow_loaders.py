"""Shadow loaders: with `loaders.shadow`, a hot standby follows each loader. SIGKILL a loader and
the planner declares it failed (health probes, summary requests) and promotes its shadow;
constructors fetch from the shadow; the failed loader, restarted, becomes the new shadow, and
takes over in turn when the promoted one is killed. The trainers receive exactly what an
undisturbed run delivers."""

from __future__ import annotations

import pathlib
import signal
import threading
import time

import pytest
from harness import assert_same_batches, collect, scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration

FIRST_KILL, SECOND_KILL = 8, 50


def _job(root: pathlib.Path, sources, run: str, *, shadow: bool) -> pathlib.Path:
    return write_job(
        root / f"{run}.yaml", sources, run_dir=str(root / run),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        loaders={"count": 2, "read_ahead_samples": 20, "shuffle": {"window_row_groups": 1}, "shadow": shadow,
                 "failover": {"probe_interval_s": 0.1, "failures": 3}},
    )


def test_a_killed_loader_is_replaced_by_its_shadow_and_nothing_changes_for_the_trainers(tmp_path: pathlib.Path) -> None:
    sources = [
        write_source(tmp_path / "data", name, skewed_lengths(rows, seed=i), row_group_size=10, seed=i)
        for i, (name, rows) in enumerate([("a", 300), ("b", 240), ("c", 180)])
    ]
    cluster = start_cluster(_job(tmp_path, sources, "undisturbed", shadow=False))
    try:
        expected, _ = collect(cluster.endpoints_path, [0, 1])
    finally:
        cluster.stop()

    cluster = start_cluster(_job(tmp_path, sources, "shadowed", shadow=True))
    names = sorted(p.name for p in cluster.loaders)
    assert names == ["loader-0", "loader-0-shadow", "loader-1", "loader-1-shadow"]
    reached = threading.Condition()
    progress = {0: -1, 1: -1}
    events: dict[str, object] = {}

    def paced(rank: int, batch: dict) -> None:
        time.sleep(0.04)
        with reached:
            progress[rank] = batch["step"]
            reached.notify_all()

    def kill(name: str) -> None:
        victim = next(p for p in cluster.loaders if p.name == name)
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait()

    def chaos() -> None:
        try:
            with reached:
                reached.wait_for(lambda: min(progress.values()) >= FIRST_KILL, timeout=60)
            kill("loader-0")  # not restarted until the shadow has taken over
            events["first"] = min(progress.values())
            planner_log = cluster.planner.log_path
            wait_until(lambda: "promoted its shadow" in planner_log.read_text(), timeout_s=30, what="the shadow of loader 0 to be promoted")
            original = next(p for p in cluster.loaders if p.name == "loader-0")
            events["restarted_log"] = cluster.restart(original).log_path  # comes back as the shadow
            with reached:
                reached.wait_for(lambda: min(progress.values()) >= SECOND_KILL, timeout=60)
            kill("loader-0-shadow")  # the promoted one: the restarted original takes over again
            events["second"] = min(progress.values())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            events["failure"] = exc

    killer = threading.Thread(target=chaos)
    try:
        killer.start()
        got, _ = collect(cluster.endpoints_path, [0, 1], on_batch=paced)
        killer.join(timeout=60)
        metrics = scrape(f"http://127.0.0.1:{cluster.planner.metrics_port}/metrics")
        planner_log = cluster.planner.log_path.read_text()
    finally:
        cluster.stop()
    if "failure" in events:
        raise events["failure"]
    assert events["second"] < len(expected[0]) - 1, "the second kill came after the last step"
    assert "serving as the shadow of replica '0'" in events["restarted_log"].read_text()
    assert planner_log.count("promoted its shadow") == 2
    assert metrics['batchplane_planner_shadow_promotions_total{group="0"}'] == 2
    assert metrics['batchplane_planner_loader_failures_total{group="0"}'] == 2
    assert_same_batches(got, expected)
