"""The metrics endpoint answers `/metrics` and `/healthz` and nothing else (issue 41, point 4):
a real HTTP server on 127.0.0.1, asked as Prometheus and kubelet ask it."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from batchplane.core.metrics import start_metrics_server


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    Counter("batchplane_test_things_total", "Things.", registry=registry).inc(3)
    serving = [True]
    server, thread = start_metrics_server(0, "127.0.0.1", registry, lambda: serving[0])
    yield f"http://127.0.0.1:{server.server_port}", serving
    server.shutdown()
    thread.join(timeout=10)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_it_serves_metrics_and_health_and_nothing_else(endpoint) -> None:
    base, serving = endpoint
    status, text = _get(base + "/metrics")
    assert status == 200 and "batchplane_test_things_total 3.0" in text
    assert _get(base + "/healthz") == (200, "SERVING\n")
    serving[0] = False
    assert _get(base + "/healthz") == (503, "NOT_SERVING\n")
    for path in ("/", "/metrics/x", "/favicon.ico", "/debug", "/metrics?x=1&name[]=a"):
        status, text = _get(base + path)
        if path.startswith("/metrics?"):
            assert status == 200, "a query string is still /metrics (Prometheus's name[] filter)"
            continue
        assert status == 404 and "serves /metrics and /healthz only" in text, path
