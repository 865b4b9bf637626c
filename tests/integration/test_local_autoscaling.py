"""The operator's local backend end to end: a job whose staged mixture raises source a's weight
from 1/16 to 15/16 runs as local processes; a real Prometheus (Debian's `prometheus`, started here
on 127.0.0.1) scrapes its planner every second; `LocalAutoscaler` reads the weights and
throughput through Prometheus's HTTP API each second and starts replicas of a's loader group.
a's group must gain replicas within a bounded number of intervals after the rise, the new
replica must serve a's samples, and the trainers receive every sample at most once (I1; the
epochs are endless) and every rank the same steps (I2) across the join. The policy's sequences
over time (the fall, cooldowns, the moving average) run on a simulated clock in
tests/unit/test_local_autoscaler.py and tests/unit/test_scaling_policy.py; a replica leaving
mid-epoch with real processes is tests/integration/test_loader_replicas.py. When the prometheus
binary is missing the test fails, saying how to install it."""

from __future__ import annotations

import collections
import json
import pathlib
import threading
import time

import pytest
from harness import scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source
from prometheus_server import PrometheusServer, find_prometheus

from batchplane.client import Client
from batchplane.launcher.autoscale import Interval, LocalAutoscaler
from batchplane.operator.policy import GroupSpec, ScalingSettings
from batchplane.operator.prometheus import PrometheusReader

pytestmark = pytest.mark.integration

JOB = "autoscale"
RISE = 150
STAGES = [
    {"start": 0, "weights": {"a": 1, "b": 15}},
    {"start": RISE, "weights": {"a": 15, "b": 1}},
]
STEP_PAUSE_S = 0.05
INTERVAL_S = 1.0
SCALING = ScalingSettings(window_intervals=2, consecutive_intervals=2, up_threshold=0.05, down_threshold=0.15, cooldown_s=2.0, headroom=0.2)
BOUND_INTERVALS = 8  # a decision lands within this many intervals of the weight change it follows


def test_the_operator_adds_loaders_when_a_weight_rises_and_the_new_one_serves(tmp_path: pathlib.Path) -> None:
    find_prometheus()  # fails with how to install it
    sources = [
        write_source(tmp_path / "data", n, skewed_lengths(400, seed=i), files=2, row_group_size=20, seed=i) for i, n in enumerate("ab")
    ]
    job = write_job(
        tmp_path / "job.yaml",
        sources,
        job=JOB,
        epochs="infinite",
        mixture={"schedule": {"kind": "staged", "stages": STAGES}},
        loaders={"read_ahead_samples": 120, "shuffle": {"window_row_groups": 2}},
        run_dir=str(tmp_path / "run"),
    )
    stop = threading.Event()
    seen: dict[int, list] = {0: [], 1: []}
    failures: list[BaseException] = []
    trace: list[Interval] = []
    cluster = prometheus = None
    threads: list[threading.Thread] = []
    try:
        cluster = start_cluster(job)
        endpoints = json.loads(cluster.endpoints_path.read_text())
        prometheus = PrometheusServer(
            tmp_path / "prometheus", {"planner": endpoints["metrics"]["planner"]}, job=JOB, scrape_interval_s=INTERVAL_S
        ).start()
        prometheus.wait_for_scrapes(timeout_s=15)
        reader = PrometheusReader(prometheus.url, timeout_s=5)

        def consume(rank: int) -> None:
            try:
                with Client(endpoints["constructors"][str(rank)], rank=rank, timeout_s=60) as client:
                    for batch in client:
                        ids = [
                            (k, r, e)
                            for mb in batch["microbatches"]
                            for k, r, e in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist(), mb["sample_epoch"].tolist())
                        ]
                        seen[rank].append((batch["step"], ids))
                        if stop.wait(STEP_PAUSE_S):
                            return
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)

        threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()

        # The throughput the trainers reach, measured as the operator will see it: once they have
        # run for most of the rate's 3 s window (40 steps of at least 0.05 s) and Prometheus has
        # scraped them doing so (a loaded machine may take seconds to start them).
        def throughput_now() -> float:
            return sum(reader.sample_rate(3.0, JOB).values())

        wait_until(
            lambda: min(len(seen[0]), len(seen[1])) >= 40 and throughput_now() > 0,
            timeout_s=60,
            what="Prometheus to see the trainers consume",
        )
        throughput = throughput_now()
        assert throughput > 0, "the trainers consume nothing"
        # a's group needs 1 replica at weight 1/16 (need 0.27) and 3 at 15/16 (need 4.05, max 3): 3.9x
        # either side of the up threshold (1.05), for a throughput measured low or high on a loaded
        # machine (the trainers' rate may double after the first seconds)
        cost = 3.6 / throughput
        specs = {
            0: GroupSpec("a", ("a",), {"a": cost}, min_replicas=1, max_replicas=3, scaling=SCALING),
            1: GroupSpec("b", ("b",), {"b": cost / 10}, min_replicas=1, max_replicas=1, scaling=SCALING),
        }
        autoscaler = LocalAutoscaler(cluster, reader, specs, job=JOB, rate_window_s=3.0)
        start = time.monotonic()
        while time.monotonic() - start < 90 and not failures:
            time.sleep(INTERVAL_S)
            row = autoscaler.step(time.monotonic() - start)
            if row is not None:
                trace.append(row)
            if trace and trace[-1].groups[0][1] >= 2:  # a's group grew
                break
        if len(autoscaler.replicas(0)) >= 2:  # the trainers run on until the new replica served some of a
            joined = autoscaler.replicas(0)[-1]
            metrics = f"http://127.0.0.1:{joined.metrics_port}/metrics"
            wait_until(
                lambda: scrape(metrics).get('batchplane_loader_samples_sent_total{source="a"}', 0) > 0,
                timeout_s=30,
                what="the new replica to serve",
            )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        if prometheus is not None:
            prometheus.stop()
        if cluster is not None:
            cluster.stop()
    for r in trace:
        print(r.t, r.step, {k: round(v, 3) for k, v in r.weights.items()}, round(r.throughput, 1), r.groups)
    assert not failures, f"a client failed: {failures[0]!r}"

    risen = next(i for i, r in enumerate(trace) if r.weights.get("a", 0) > 0.8)
    assert risen >= 1 and all(r.groups[0][1] == 1 for r in trace[:risen]), "one loader while a's weight is 1/16"
    most = max(r.groups[0][1] for r in trace[risen : risen + BOUND_INTERVALS])
    assert most >= 2, f"a's loader group did not grow within {BOUND_INTERVALS} intervals of the rise"
    assert all(r.groups[1][1] == 1 for r in trace)
    # I1 and I2 across the join
    steps = {rank: [s for s, _ in seen[rank]] for rank in seen}
    common = min(len(steps[0]), len(steps[1]))
    assert steps[0][:common] == steps[1][:common] == list(range(common))
    delivered = collections.Counter(i for rank in seen for _, ids in seen[rank] for i in ids)
    assert max(delivered.values()) == 1, "a sample was delivered twice"
    assert len(delivered) > 12 * (RISE - 10)
