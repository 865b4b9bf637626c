"""Every service exposes Prometheus metrics on its own port, named batchplane_<part>_..."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
import sys

import pytest
from harness import collect, scrape, skewed_lengths, start_cluster, write_job, write_source

pytestmark = pytest.mark.integration


def test_each_service_reports_its_work(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", n, skewed_lengths(90, seed=i), seed=i) for i, n in enumerate(["x", "y"])]
    cluster = start_cluster(
        write_job(tmp_path / "job.yaml", sources, mixture={"weights": {"x": 2, "y": 1}}, constructors={"batch_steps": 8})
    )
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
    assert planner['batchplane_planner_mixture_weight_ratio{source="x"}'] + planner[
        'batchplane_planner_mixture_weight_ratio{source="y"}'
    ] == pytest.approx(1)
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
    # every planned step is recorded in the ledger (here the whole job is served), in fewer writes
    # than steps: a constructor takes several steps' plans at once and they are written together
    assert planner["batchplane_planner_ledger_write_steps_sum"] == steps
    assert 1 <= planner["batchplane_planner_ledger_write_steps_count"] < steps
    assert planner["batchplane_planner_ledger_write_seconds_count"] == planner["batchplane_planner_ledger_write_steps_count"]
    # each constructor asks at least every constructors.fetch_steps-th step (8: the steps between
    # come with its plans, when the planner has planned them)
    assert planner['batchplane_planner_requests_total{code="OK",method="GetPlan"}'] >= 2 * math.ceil(steps / 8)
    # Both loaders registered; they register again every network.heartbeat_s.
    assert planner['batchplane_planner_requests_total{code="OK",method="RegisterLoader"}'] >= 2
    for name, source in (("loader-0", "x"), ("loader-1", "y")):
        loader = pages[name]
        assert loader[f'batchplane_loader_samples_read_total{{source="{source}"}}'] == 90
        assert loader[f'batchplane_loader_samples_sent_total{{source="{source}"}}'] == 90
        assert loader["batchplane_loader_sent_bytes_total"] > 0
        assert loader["batchplane_loader_fetch_steps_sum"] >= loader["batchplane_loader_fetch_steps_count"] >= 1
        assert loader[f'batchplane_loader_read_seconds_total{{source="{source}"}}'] > 0
        assert f'batchplane_loader_buffer_samples{{source="{source}"}}' in loader
        assert "batchplane_loader_buffer_bytes" in loader
    for name in ("constructor-0", "constructor-1"):
        constructor = pages[name]
        assert constructor["batchplane_constructor_batches_built_total"] == steps
        assert constructor["batchplane_constructor_fetch_steps_sum"] >= steps  # every step's samples fetched
        assert constructor["batchplane_constructor_fetch_steps_count"] <= steps
        assert constructor["batchplane_constructor_batches_sent_total"] >= steps
        assert constructor["batchplane_constructor_sent_bytes_total"] > 0
        assert constructor["batchplane_constructor_batch_wait_seconds_count"] >= steps
        # one call carries several small steps (the client's steps_per_call), each step's wait counted
        calls = constructor['batchplane_constructor_requests_total{code="OK",method="GetBatch"}']
        assert 1 <= calls < constructor["batchplane_constructor_batches_sent_total"]
    for name, page in pages.items():
        assert all(key.startswith(("batchplane_", "python_", "process_")) for key in page)
        # The default collectors and the build info, in every process's registry.
        assert page["process_resident_memory_bytes"] > 10e6 and page["process_cpu_seconds_total"] > 0
        assert any(k.startswith("python_gc_objects_collected_total{") for k in page)
        assert any(k.startswith("python_info{") for k in page)
        (build,) = [k for k in page if k.startswith("batchplane_build_info{")]
        part = name.split("-")[0]
        assert page[build] == 1 and f'part="{part}"' in build and f'version="{importlib.metadata.version("batchplane")}"' in build, build
        assert f'python="{platform.python_version()}"' in build and 'revision="' in build


def test_json_logs_are_one_object_per_line_with_the_process_context(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCHPLANE_LOG_FORMAT=json: every line each process writes is one JSON object with its
    time, level, logger, message and context (job, part; a loader's index and sources, a
    constructor's index and ranks)."""
    monkeypatch.setenv("BATCHPLANE_LOG_FORMAT", "json")  # the launched processes inherit it
    sources = [write_source(tmp_path / "data", n, skewed_lengths(40, seed=i), seed=i) for i, n in enumerate(["x", "y"])]
    cluster = start_cluster(write_job(tmp_path / "job.yaml", sources))
    try:
        collect(cluster.endpoints_path, range(2))
    finally:
        cluster.stop()
    logs = {p.stem: p.read_text().splitlines() for p in sorted((cluster.run_dir / "logs").glob("*.log"))}
    assert sorted(logs) == ["constructor-0", "constructor-1", "loader-0", "loader-1", "planner"]
    expected = {
        "planner": {"part": "planner"},
        "loader-0": {"part": "loader", "index": 0, "source": ["x"]},
        "loader-1": {"part": "loader", "index": 1, "source": ["y"]},
        "constructor-0": {"part": "constructor", "index": 0, "rank": [0]},
        "constructor-1": {"part": "constructor", "index": 1, "rank": [1]},
    }
    for name, lines in logs.items():
        assert lines, name
        records = [json.loads(line) for line in lines]  # fails on any line that is not one JSON object
        for r in records:
            assert {"time", "level", "logger", "message", "part"} <= r.keys(), (name, r)
            assert r["time"].endswith("Z") and r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
            assert r["part"] == expected[name]["part"]
        served = [r for r in records if " serving on " in r["message"]]
        assert len(served) == 1, (name, records)
        assert {k: served[0].get(k) for k in (*expected[name], "job")} == {**expected[name], "job": "test"}, name
        assert "index" not in served[0] if name == "planner" else True


def test_a_bad_log_format_stops_the_process_naming_the_variable(tmp_path: pathlib.Path) -> None:
    source = write_source(tmp_path / "data", "x", [5] * 8)
    job = write_job(tmp_path / "job.yaml", [source])
    env = {**os.environ, "BATCHPLANE_LOG_FORMAT": "xml"}
    done = subprocess.run([sys.executable, "-m", "batchplane.planner", "-c", str(job)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "BATCHPLANE_LOG_FORMAT: must be one of text, json, got 'xml'" in done.stderr
