"""Every service exposes Prometheus metrics on its own port, named batchplane_<part>_..."""

from __future__ import annotations

import json
import pathlib

import pytest
from harness import collect, scrape, skewed_lengths, start_cluster, write_job, write_source

pytestmark = pytest.mark.integration


def test_each_service_reports_its_work(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", n, skewed_lengths(90, seed=i), seed=i) for i, n in enumerate(["x", "y"])]
    cluster = start_cluster(write_job(tmp_path / "job.yaml", sources, mixture={"weights": {"x": 2, "y": 1}}))
    try:
        batches, _ = collect(cluster.endpoints_path, range(2))
        urls = json.loads(cluster.endpoints_path.read_text())["metrics"]
        pages = {name: scrape(url) for name, url in urls.items()}
    finally:
        cluster.stop()
    steps = len(batches[0])
    planner = pages["planner"]
    assert planner["batchplane_planner_steps_planned_total"] == steps
    assert planner["batchplane_planner_step"] == steps - 1
    assert planner['batchplane_planner_mixture_weight_ratio{source="x"}'] + planner['batchplane_planner_mixture_weight_ratio{source="y"}'] == pytest.approx(1)
    assert planner['batchplane_planner_samples_total{source="x"}'] == 90
    target = planner['batchplane_planner_mixture_target_ratio{source="x"}']
    realized = planner['batchplane_planner_mixture_realized_ratio{source="x"}']
    # x (weight 2 of 3) runs out first; the target follows the shares step by step, so the
    # cumulative target lies below 2/3. Only the step where x runs out takes fewer than its
    # share asks for, so the drift is under one step's samples (12, the harness's batch).
    total = sum(v for k, v in planner.items() if k.startswith("batchplane_planner_samples_total{"))
    assert 0.4 < target < 2 / 3
    assert planner['batchplane_planner_mixture_drift_ratio{source="x"}'] == pytest.approx(realized - target)
    assert abs(realized - target) * total < 12
    assert 0 < planner['batchplane_planner_mixture_realized_ratio{source="y"}'] < 1
    assert planner["batchplane_planner_plan_duration_seconds_count"] == steps
    assert planner['batchplane_planner_requests_total{code="OK",method="GetPlan"}'] >= 2 * steps
    # Both loaders registered; they register again every network.heartbeat_s.
    assert planner['batchplane_planner_requests_total{code="OK",method="RegisterLoader"}'] >= 2
    for name, source in (("loader-0", "x"), ("loader-1", "y")):
        loader = pages[name]
        assert loader[f'batchplane_loader_samples_read_total{{source="{source}"}}'] == 90
        assert loader[f'batchplane_loader_samples_sent_total{{source="{source}"}}'] == 90
        assert loader["batchplane_loader_sent_bytes_total"] > 0
        assert loader[f'batchplane_loader_read_seconds_total{{source="{source}"}}'] > 0
        assert f'batchplane_loader_buffer_samples{{source="{source}"}}' in loader
        assert "batchplane_loader_buffer_bytes" in loader
    for name in ("constructor-0", "constructor-1"):
        constructor = pages[name]
        assert constructor["batchplane_constructor_batches_built_total"] == steps
        assert constructor["batchplane_constructor_batches_sent_total"] >= steps
        assert constructor["batchplane_constructor_sent_bytes_total"] > 0
        assert constructor["batchplane_constructor_batch_wait_seconds_count"] >= steps
        assert constructor['batchplane_constructor_requests_total{code="OK",method="GetBatch"}'] >= steps
    for page in pages.values():
        assert all(key.startswith(("batchplane_", "python_", "process_")) for key in page)
