"""The operator's view of a running job through a real Prometheus server: a small job with a
staged mixture (a:b from 1:3 to 3:1 at step CHANGE) runs as local processes with clients
consuming at a steady pace, Prometheus (Debian's `prometheus`, started here on 127.0.0.1)
scrapes the planner and the loaders every second, and `PrometheusReader` feeds the scaling
policy one observation per second. The group of source a must want more loaders after the
change than before, the group of b fewer, and a policy scaling ahead of the declared change must
raise a's loaders before the planner reaches it.

No loader is started or stopped here (no backend yet): a group's current replicas are what the
policy last decided. When the prometheus binary is missing the test fails, saying how to
install it.
"""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time

import pytest
from harness import skewed_lengths, start_cluster, write_job, write_source
from prometheus_server import PrometheusServer, find_prometheus

from batchplane.client import Client
from batchplane.operator.policy import GroupSpec, Observation, ScalingSettings, decide, initial_state
from batchplane.operator.prometheus import PrometheusError, PrometheusReader

pytestmark = pytest.mark.integration

JOB = "scaling"
CHANGE = 80  # the step where a's weight rises from 1/4 to 3/4 (and b's falls from 3/4 to 1/4)
STAGES = [{"start": 0, "weights": {"a": 1, "b": 3}}, {"start": CHANGE, "weights": {"a": 3, "b": 1}}]
# A's need triples at the change (about 1.4 to 4.3 replicas at 120 samples/s), so the replica
# counts before and after it stay apart under the measured rates' noise (±40 %).
STEP_PAUSE_S = 0.1  # each client's pause per batch: about 10 steps/s, 120 samples/s
INTERVAL_S = 1.0  # the operator's interval (= the scrape interval)
RATE_WINDOW_S = 3.0
COST_S = 0.04  # loader work per sample of either source, worker-seconds
SCALING = ScalingSettings(window_intervals=3, consecutive_intervals=2, up_threshold=0.05, down_threshold=0.15, cooldown_s=2.0, headroom=0.2)
AHEAD = ScalingSettings(**{**SCALING.__dict__, "lead_s": 4.0})
AFTER_INTERVALS = 6  # intervals observed after the change before the test stops


def schedule(step: float) -> dict[str, float]:
    """The declared schedule as the operator reads it from the job (STAGES)."""
    return dict(next(s for s in reversed(STAGES) if s["start"] <= step)["weights"])


def groups(scaling: ScalingSettings) -> dict[str, GroupSpec]:
    return {
        name: GroupSpec(name, (name,), {name: COST_S}, capacity=1.0, min_replicas=1, max_replicas=8, scaling=scaling) for name in ("a", "b")
    }


def consume(address: str, rank: int, stop: threading.Event, failures: list[BaseException]) -> None:
    """A trainer rank: one batch every STEP_PAUSE_S until `stop`."""
    try:
        with Client(address, rank=rank, timeout_s=30) as client:
            for _ in client:
                if stop.wait(STEP_PAUSE_S):
                    return
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        failures.append(exc)


def test_the_group_of_a_rising_source_wants_more_loaders(tmp_path: pathlib.Path) -> None:
    find_prometheus()  # fails with how to install it
    sources = [write_source(tmp_path / "data", n, skewed_lengths(60, seed=i), seed=i) for i, n in enumerate(["a", "b"])]
    job = write_job(tmp_path / "job.yaml", sources, job=JOB, epochs="infinite", mixture={"schedule": {"kind": "staged", "stages": STAGES}})
    stop = threading.Event()
    failures: list[BaseException] = []
    threads: list[threading.Thread] = []
    cluster = prometheus = None
    trace = []
    try:
        cluster = start_cluster(job)
        endpoints = json.loads(cluster.endpoints_path.read_text())
        targets = {name: url for name, url in endpoints["metrics"].items() if name == "planner" or name.startswith("loader-")}
        prometheus = PrometheusServer(tmp_path / "prometheus", targets, job=JOB, scrape_interval_s=INTERVAL_S).start()
        prometheus.wait_for_scrapes(timeout_s=15)
        reader = PrometheusReader(prometheus.url, timeout_s=5)
        assert reader.mixture_weights(JOB) == pytest.approx({"a": 0.25, "b": 0.75})  # before any step: the stage-0 weights

        threads = [
            threading.Thread(target=consume, args=(endpoints["constructors"][str(r)], r, stop, failures), daemon=True) for r in (0, 1)
        ]
        for t in threads:
            t.start()
        plain = {name: initial_state(spec) for name, spec in groups(SCALING).items()}
        ahead = {name: initial_state(spec) for name, spec in groups(AHEAD).items()}
        start, after = time.monotonic(), 0
        for interval in range(40):
            time.sleep(max(start + (interval + 1) * INTERVAL_S - time.monotonic(), 0))
            assert not failures, f"a client failed: {failures[0]!r}"
            cluster.check_alive()
            weights = reader.mixture_weights(JOB)
            rates = reader.sample_rate(RATE_WINDOW_S, JOB)
            observation = Observation(
                weights=weights,
                throughput=sum(rates.values()),
                step=reader.steps_planned(JOB),
                step_rate=reader.step_rate(RATE_WINDOW_S, JOB),
                schedule=schedule,
            )
            now = time.monotonic() - start
            row = {"t": now, "step": observation.step, "weights": weights, "T": observation.throughput}
            row["loader_rates"] = reader.loader_sample_rate(RATE_WINDOW_S, JOB)
            for label, states in (("plain", plain), ("ahead", ahead)):
                for name in states:
                    before = states[name].replicas
                    decision = decide(states[name], observation, now)
                    states[name] = decision.state
                    est = decision.estimate
                    row[f"{label}:{name}"] = {
                        "current": before,
                        "desired": decision.replicas,
                        "demand": None if est is None else est.demand,
                        "need": None if est is None else est.need,
                        "average": None if est is None else est.average[0],
                        "ahead": None if est is None or est.ahead is None else est.ahead[0],
                        "reason": decision.reason,
                    }
            trace.append(row)
            after += weights.get("a", 0) > 0.7
            if after >= AFTER_INTERVALS:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        if prometheus is not None:
            prometheus.stop()
        if cluster is not None:
            cluster.stop()
    _print_trace(trace)

    assert not failures, f"a client failed: {failures[0]!r}"
    assert after >= AFTER_INTERVALS, "the planner never reached the stage change"
    pre = [r for r in trace if r["weights"]["a"] == pytest.approx(0.25)]
    post = [r for r in trace if r["weights"]["a"] == pytest.approx(0.75)]
    assert len(pre) >= 4 and len(post) == AFTER_INTERVALS, [r["weights"] for r in trace]
    assert all(r["weights"]["b"] == pytest.approx(0.25) for r in post)
    # Throughput is read once Prometheus has scraped a rate window of the running job (how many
    # intervals that takes depends on the machine's load), before the stage change, and from
    # then on in every interval.
    first = next((i for i, r in enumerate(trace) if r["T"] > 0), len(trace))
    assert first < len(trace) and trace[first] in pre[:-2], "no throughput read before the stage change"
    assert all(r["T"] > 0 for r in trace[first:]), "the throughput read dropped to 0 while the job ran"
    before_a = max(r["plain:a"]["desired"] for r in pre)
    assert post[-1]["plain:a"]["desired"] > before_a
    assert post[-1]["plain:b"]["desired"] < max(r["plain:b"]["desired"] for r in pre)
    # Scaling ahead: from the planned step and step rate read from Prometheus, the policy saw the
    # declared weight of a (3/4) lead_s ahead while the planner still planned 1/4, in at least two
    # intervals; in each, its need was the plain policy's (same throughput, same interval) times
    # 3/4 over a's measured average weight: the need comes from the declared weight, not the
    # measured one. And it raised a's loaders then, above any count the plain policy wanted
    # before the change.
    seen = [r for r in pre if r["ahead:a"]["ahead"] == pytest.approx(0.75)]
    assert len(seen) >= 2, [(r["step"], r["ahead:a"]["ahead"]) for r in pre]
    for r in seen:
        assert r["ahead:a"]["need"] == pytest.approx(r["plain:a"]["need"] * 0.75 / r["plain:a"]["average"], rel=1e-9)
    assert max(r["ahead:a"]["desired"] for r in pre) > before_a
    assert all(r["ahead:b"]["desired"] >= r["plain:b"]["desired"] for r in trace)  # no early scale-down


def _print_trace(trace: list[dict]) -> None:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    print("\nscaling trace (t s, planned steps, weights a/b, T samples/s, per group: demand worker-s/s, need, current -> desired)")
    for r in trace:
        w = r["weights"]
        cells = [
            f"{label}:{g} {num(r[f'{label}:{g}']['demand'])} {num(r[f'{label}:{g}']['need'])} "
            f"{r[f'{label}:{g}']['current']}->{r[f'{label}:{g}']['desired']}"
            for label in ("plain", "ahead")
            for g in ("a", "b")
        ]
        loaders = {k: round(v, 1) for k, v in r["loader_rates"].items()}
        print(
            f"t={r['t']:5.1f} step={r['step']} w={w.get('a', 0):.2f}/{w.get('b', 0):.2f} T={r['T']:.1f} loaders={loaders} "
            f"ahead w_a={num(r['ahead:a']['ahead'])} | " + " | ".join(cells)
        )
    for r in trace:
        print(f"t={r['t']:5.1f} plain:a {r['plain:a']['reason']} ; plain:b {r['plain:b']['reason']} ; ahead:a {r['ahead:a']['reason']}")


def test_an_unreachable_server_names_the_url_and_the_query() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reader = PrometheusReader(f"http://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(
        PrometheusError, match=rf"127\.0\.0\.1:{port}/api/v1/query, query 'batchplane_planner_mixture_weight_ratio.*cannot connect"
    ):
        reader.mixture_weights("x")


def test_a_server_that_does_not_answer_times_out() -> None:
    with socket.socket() as silent:  # accepts connections (into the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        reader = PrometheusReader(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        began = time.monotonic()
        with pytest.raises(PrometheusError, match=r"query 'up': no answer within 0\.5 s"):
            reader.instant("up")
        assert time.monotonic() - began < 5


def test_a_rejected_query_names_the_url_and_prometheus_s_error(tmp_path: pathlib.Path) -> None:
    server = PrometheusServer(tmp_path / "prometheus", {}, job="none").start()
    try:
        reader = PrometheusReader(server.url, timeout_s=5)
        with pytest.raises(PrometheusError) as caught:
            reader.instant("sum(rate(x[5m])")
        assert server.url in str(caught.value) and "sum(rate(x[5m])" in str(caught.value) and "HTTP 400" in str(caught.value)
        assert reader.instant("1 + 1") == {(): 2.0}
        assert reader.mixture_weights("none") == {}
    finally:
        server.stop()
