"""A metrics endpoint that requires TLS and a bearer token (issue 41, point 4), scraped by a real
Prometheus configured as its users would (`scheme: https`, `tls_config`, `authorization`), and
refused to whoever lacks the token. The service process reads both from its flags before it
serves: a token file it cannot read ends it naming the flag."""

from __future__ import annotations

import json
import pathlib
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_server import PrometheusServer

from batchplane.core.identity import Identity
from batchplane.core.localca import LocalCA
from batchplane.core.metrics import start_metrics_server
from batchplane.core.tls import metrics_tls

pytestmark = pytest.mark.integration

TOKEN = "s3cr3t-metrics-token"


def _get(url: str, context: ssl.SSLContext, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_prometheus_scrapes_an_endpoint_behind_tls_and_a_bearer_token_and_nobody_else_does(tmp_path: pathlib.Path) -> None:
    ca = LocalCA(tmp_path / "ca")
    certs = ca.issue(Identity("planner"), tmp_path / "planner-tls")
    (tmp_path / "token").write_text(TOKEN + "\n")
    registry = CollectorRegistry()
    Counter("batchplane_planner_things_total", "Things.", registry=registry).inc(7)
    server, thread = start_metrics_server(0, "127.0.0.1", registry, lambda: True, token=TOKEN, tls=metrics_tls(certs))
    base = f"https://127.0.0.1:{server.server_port}"
    try:
        client = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        client.check_hostname = False  # the leaf names planner.batchplane; asked at 127.0.0.1 here
        assert _get(base + "/metrics", client, None) == 401
        assert _get(base + "/metrics", client, "wrong") == 401
        assert _get(base + "/metrics", client, TOKEN) == 200
        assert _get(base + "/healthz", client, None) == 200, "kubelet's probe needs no token"
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10)
        with socket.create_connection(("127.0.0.1", server.server_port)):  # a client that never says anything
            assert _get(base + "/metrics", client, TOKEN) == 200, "it holds up nobody else"
        scrape = {
            "scheme": "https",
            "tls_config": {"ca_file": str(certs / "ca.crt"), "server_name": "planner.batchplane"},
            "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "token")},
        }
        with PrometheusServer(tmp_path / "prometheus", {"planner": base + "/metrics"}, job="bp", scrape=scrape) as prometheus:
            prometheus.wait_for_scrapes(timeout_s=30)
            query = urllib.parse.urlencode({"query": 'batchplane_planner_things_total{job="bp"}'})
            with urllib.request.urlopen(f"{prometheus.url}/api/v1/query?{query}", timeout=5) as response:
                result = json.loads(response.read())["data"]["result"]
            assert [float(r["value"][1]) for r in result] == [7.0]
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_a_service_whose_metrics_token_cannot_be_read_does_not_start(tmp_path: pathlib.Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"job": "j", "sources": [{"name": "a", "path": str(tmp_path)}], "network": {"tls": False}}))
    done = subprocess.run(
        [sys.executable, "-m", "batchplane.planner", "-c", str(job), "--metrics-token-file", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--metrics-token-file: cannot read token file" in done.stderr
