"""The operator's Kubernetes backend against an API emulator: kmock's KubernetesEmulator (PyPI
`kmock`), an in-memory API server on 127.0.0.1 that stores objects and serves list, create,
merge-patch and delete, subresources included. No real API server can run on the test machines,
so this is as close as the tests get; the emulator neither validates objects (the CRD's CEL
rule included), nor applies label selectors to lists, nor runs a Deployment controller. So the
test plays the Deployment controller itself (after each pass, every Deployment's ready pods catch
up with its replicas), and the operator's client-side filtering is what keeps it off foreign
Deployments.

The operator runs in-process, one pass per interval on a fake clock (`Operator.run_once`), with
a scripted observation source in place of Prometheus (the Prometheus path is tested in
test_prometheus_reader.py against a real Prometheus). The requests it made are read back from
the emulator and asserted: the loader Deployments it POSTs, the replicas it PATCHes through
deployments/<name>/scale as one source's weight rises and falls, the status it PATCHes, and that
it never changes a Deployment it did not create. A bad DataPlane gets a condition, a name clash
and a failing API are logged, counted and retried. A second test runs `--once` through the
image's entrypoint; a third builds the loader Deployments of the chart's own DataPlane.

Events and leader election: the same scripted passes write Events on the DataPlanes (what was
created and scaled, what failed, repeats counted on one Event); two operators share a Lease, one
leads, and the other takes over when the leader stops renewing, and at once when it releases
the Lease on stopping; an operator process serves its metrics (default collectors and build
info included), logs JSON lines and releases its Lease on SIGTERM. kmock keeps no
resourceVersion, which leader election relies on (a write carrying a stale one is refused with
409 Conflict), so `ApiServer` below adds that for Leases: the emulator stands in for a Kubernetes
API server, which cannot run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_helm_chart import CHART, helm_binary, load_values, one, template, validate_dataplane

from batchplane import entrypoint
from batchplane.operator.election import ElectionSettings
from batchplane.operator.events import EventSettings
from batchplane.operator.kubernetes import KubeConfig, KubernetesClient, KubernetesError, in_cluster_config, in_cluster_namespace
from batchplane.operator.leader import LeaderElection
from batchplane.operator.loop import Observed, Operator, PrometheusObservations
from batchplane.operator.dataplane import parse_dataplane
from batchplane.operator.manifests import LABEL_MANAGED_BY, MANAGER, loader_deployment
from batchplane.operator.metrics import OperatorMetrics
from batchplane.operator.recorder import EventRecorder

try:
    import kmock
except ImportError as exc:  # fail, never skip: the emulator is the only API server these tests have
    raise ImportError(
        "kmock is a test dependency (pyproject's dev extra): .venv/bin/pip install -c constraints.txt kmock pytest-asyncio"
    ) from exc


pytestmark = pytest.mark.integration

NS = "training"
INTERVAL_S = 10
DATAPLANES = kmock.resource("batchplane.dev", "v1alpha1", "dataplanes")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
EVENTS = kmock.resource("", "v1", "events")
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
EVENT_PATH = f"/api/v1/namespaces/{NS}/events"
DP_PATH = f"/apis/batchplane.dev/v1alpha1/namespaces/{NS}/dataplanes"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
COST_S = 0.01  # loader work per sample of every source, worker-seconds
THROUGHPUT = 300.0  # samples/s: a group whose sources hold share w needs 300 * 0.01 * w = 3w replicas


def dataplane(name: str, uid: str, groups: list[dict[str, Any]], **scaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batchplane.dev/v1alpha1",
        "kind": "DataPlane",
        "metadata": {"name": name, "namespace": NS, "uid": uid, "generation": 1},
        "spec": {
            "sourceGroups": groups,
            "mesh": {"dp": 1, "cp": 1, "tp": 1, "pp": 1},
            "batch": {"globalBatchSize": 8, "microbatches": 1},
            "planner": {"address": f"{name}-planner.{NS}.svc:50051"},
            "scaling": {
                "intervalSeconds": INTERVAL_S,
                "windowIntervals": 1,
                "consecutiveIntervals": 2,
                "cooldownSeconds": 0,
                "headroom": 0,
                **scaling,
            },
            "loader": {
                "image": "registry.example.com/batchplane:0.1.0",
                "jobConfigMap": f"{name}-job",
                "podLabels": {
                    "app.kubernetes.io/name": "batchplane",
                    "app.kubernetes.io/component": "loader",
                    "batchplane.dev/dataplane": name,
                },
                "podAnnotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9100"},
            },
        },
    }


def group(name: str, sources: list[str], low: int, high: int) -> dict[str, Any]:
    return {
        "name": name,
        "sources": [{"name": s, "path": f"s3://data/{s}/", "costSecondsPerSample": COST_S} for s in sources],
        "minReplicas": low,
        "maxReplicas": high,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}},
    }


DEMO = dataplane("demo", "uid-demo", [group("text", ["web", "books"], 1, 4), group("code", ["code"], 1, 3)])
BROKEN = dataplane("broken", "uid-broken", [group("all", ["x"], 3, 2)])  # minReplicas > maxReplicas
CLASH = dataplane("clash", "uid-clash", [group("main", ["m"], 1, 1)])
#: Deployments the operator did not create: one without labels, one with the operator's labels
#: but owned by a DataPlane since deleted, and one whose name the DataPlane "clash" needs.
FOREIGN = {
    "demo-loader-legacy": {"labels": {"app": "legacy"}},
    "demo-loader-orphan": {
        "labels": {LABEL_MANAGED_BY: MANAGER, "batchplane.dev/dataplane": "demo", "batchplane.dev/group": "orphan"},
        "ownerReferences": [
            {
                "apiVersion": "batchplane.dev/v1alpha1",
                "kind": "DataPlane",
                "name": "demo",
                "uid": "uid-of-a-deleted-demo",
                "controller": True,
            }
        ],
    },
    "clash-loader-main": {"labels": {"app": "hand-made"}},
}

#: The share of samples of each source per pass; pass 1's lists fail (the API is unavailable).
CODE_LOW = {"web": 0.6, "books": 0.3, "code": 0.1}
CODE_HIGH = {"web": 0.05, "books": 0.05, "code": 0.9}
SCRIPT = [CODE_LOW, CODE_LOW, CODE_LOW, CODE_HIGH, CODE_HIGH, CODE_LOW, CODE_LOW, CODE_LOW, CODE_LOW]
#: (text, code) replicas the policy must set at each pass's end (window 1, 2 intervals in a row).
EXPECTED = [(1, 1), (1, 1), (3, 1), (3, 1), (1, 3), (1, 3), (3, 1), (3, 1), (3, None)]


# ---- the emulator ---------------------------------------------------------------------------------


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus the optimistic concurrency of a real API server, for Leases: every
    write gives the Lease a new metadata.resourceVersion, and a merge patch that carries one
    other than the stored one is refused with 409 Conflict (kmock alone stores any write). The
    body a client sent is kept in `sent` (by request id): the stored one has the new version."""

    async def _handle(self, request: Any) -> Any:
        action = request.action
        if request.resource != LEASES or action not in (kmock.action.CREATE, kmock.action.UPDATE):
            return await super()._handle(request)
        if not hasattr(self, "lease_writes"):
            self.lease_writes, self.versions, self.sent = asyncio.Lock(), itertools.count(1), {}
        async with self.lease_writes:  # check and write at once, as etcd does
            self.sent[request.id] = copy.deepcopy(request.data)
            data = request.data
            if action == kmock.action.UPDATE:
                wanted = (data.get("metadata") or {}).get("resourceVersion")
                stored = next(
                    (
                        o.raw
                        for (res, ns, name), o in self.objects.items()
                        if (res, ns, name) == (LEASES, request.namespace, request.name) and not o.deleted
                    ),
                    None,
                )
                if stored is not None and wanted is not None and wanted != stored["metadata"].get("resourceVersion"):
                    raise kmock.KubernetesError(
                        status=409,
                        reason="Conflict",
                        message=f'Operation cannot be fulfilled on leases.coordination.k8s.io "{request.name}": the object has been modified',
                    )
            data.setdefault("metadata", {})["resourceVersion"] = str(next(self.versions))
            return await super()._handle(request)


@dataclasses.dataclass
class Emulator:
    """kmock's KubernetesEmulator served on 127.0.0.1 from a thread of its own."""

    handler: Any
    url: str
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the emulator's event loop (between the operator's requests)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def requests(self) -> list[dict[str, Any]]:
        """Every request served so far: method, path with query, body."""
        sent = lambda r: getattr(self.handler, "sent", {}).get(r.id, r.data)  # noqa: E731 - what the client sent
        return self.call(
            lambda: [{"method": str(r.method.value).upper(), "path": str(r.url.path_qs), "body": sent(r)} for r in self.handler]
        )

    def put(self, resource: Any, name: str, obj: dict[str, Any]) -> None:
        self.call(lambda: self.handler.objects.__setitem__((resource, NS, name), obj))

    def get(self, resource: Any, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            for (res, ns, n), obj in self.handler.objects.items():
                if res == resource and ns == NS and n == name and not obj.deleted:
                    return copy.deepcopy(obj.raw)
            return None

        return self.call(read)

    def delete(self, resource: Any, name: str) -> None:
        def drop() -> None:
            for (res, ns, n), obj in self.handler.objects.items():
                if res == resource and ns == NS and n == name:
                    obj.delete()

        self.call(drop)

    def patch(self, resource: Any, name: str, changes: dict[str, Any]) -> None:
        def apply() -> None:
            for (res, ns, n), obj in self.handler.objects.items():
                if res == resource and ns == NS and n == name and not obj.deleted:
                    obj.patch(changes)

        self.call(apply)

    def roll_out(self) -> None:
        """The Deployment controller's part: ready pods catch up with replicas."""

        def roll() -> None:
            for (res, _, _), obj in self.handler.objects.items():
                if res == DEPLOYMENTS and not obj.deleted:
                    n = obj.raw.get("spec", {}).get("replicas", 1)
                    obj.patch({"status": {"replicas": n, "readyReplicas": n}})

        self.call(roll)


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    ready, box = threading.Event(), {}

    async def serve() -> None:
        async with ApiServer() as handler, kmock.Server(handler) as server:
            handler.resources["apps/v1/deployments"] = {}
            handler.resources["batchplane.dev/v1alpha1/dataplanes"] = {}
            handler.resources["coordination.k8s.io/v1/leases"] = {}
            handler.resources["v1/events"] = {}
            box.update(handler=handler, url=str(server.url).rstrip("/"), loop=asyncio.get_running_loop(), stop=asyncio.Event())
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), name="kmock", daemon=True)
    thread.start()
    assert ready.wait(15), "kmock did not start"
    try:
        yield Emulator(box["handler"], box["url"], box["loop"])
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


class ScriptedObservations:
    """Fixed observations: the scripted shares of the current pass, a steady throughput."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}

    def observe(self, spec: Any) -> Observed:
        weights = {s: self.weights[s] for s in spec.source_names if s in self.weights}
        return Observed(weights=weights, throughput=THROUGHPUT, mixture=weights or None)


def summary(request: dict[str, Any]) -> str:
    """One line of the trace: method, path and the body's key fields."""
    body, method, path = request["body"], request["method"], request["path"].split("?")[0]
    if method == "POST" and body:
        c = body["spec"]["template"]["spec"]["containers"][0]
        owner = body["metadata"]["ownerReferences"][0]
        args = " ".join(c["args"])
        return f"POST {path} name={body['metadata']['name']} replicas={body['spec']['replicas']} owner={owner['kind']}/{owner['name']} args=[{args}]"
    if method == "PATCH" and path.endswith("/status"):
        s = body["status"]
        groups = ", ".join(f"{g['name']} {g['replicas']}/{g['desiredReplicas']}" for g in s.get("groups", []))
        conds = ", ".join(f"{c['type']}={c['status']}({c['reason']})" for c in s["conditions"])
        return f"PATCH {path} groups=[{groups}] observedMixture={s.get('observedMixture')} conditions=[{conds}]"
    if method == "PATCH":
        return f"PATCH {path} {json.dumps(body, sort_keys=True)[:160]}"
    return f"{method} {request['path']}"


# ---- the operator against the emulator ------------------------------------------------------------


def test_the_operator_creates_scales_and_reports_through_the_api(emulator: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="batchplane.operator")
    for obj in (DEMO, BROKEN, CLASH):
        emulator.put(DATAPLANES, obj["metadata"]["name"], copy.deepcopy(obj))
    for name, meta in FOREIGN.items():
        body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NS, **meta}, "spec": {"replicas": 7}}
        emulator.put(DEPLOYMENTS, name, body)
    failures = iter([kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="the API server is overloaded")])

    def unavailable() -> Any:
        return next(failures, None)  # an error once; then None, which retires this reaction

    registry = CollectorRegistry()
    observations = ScriptedObservations()
    client = KubernetesClient(KubeConfig(emulator.url, timeout_s=5))
    clock = {"t": 0.0}
    operator = Operator(
        client,
        observations,
        OperatorMetrics(registry),
        namespace=NS,
        wall_clock=lambda: f"2025-01-01T00:{int(clock['t']) // 60:02d}:{int(clock['t']) % 60:02d}Z",
    )

    trace, seen, results = [], 0, []
    for i, weights in enumerate(SCRIPT):
        clock["t"] = i * INTERVAL_S
        observations.weights = weights
        if i == 1:  # this pass's first list fails
            emulator.call(lambda: emulator.handler["list", DATAPLANES] << unavailable)
        if i == 3:
            emulator.delete(DEPLOYMENTS, "clash-loader-main")  # the clash is resolved by hand
        if i == 8:  # the code group is removed and the image changes
            spec = copy.deepcopy(DEMO["spec"])
            spec["sourceGroups"] = spec["sourceGroups"][:1]
            spec["loader"]["image"] = "registry.example.com/batchplane:0.2.0"
            emulator.patch(DATAPLANES, "demo", {"spec": spec, "metadata": {"generation": 2}})
        results.append(operator.run_once(clock["t"]))
        emulator.roll_out()
        requests = emulator.requests()
        trace.append({"pass": i, "t": clock["t"], "weights": weights, "requests": [summary(r) for r in requests[seen:]]})
        seen = len(requests)
    print("\nrequest trace (method, path, key body fields per interval):")
    for row in trace:
        print(f"-- pass {row['pass']} t={row['t']:.0f}s weights={row['weights']}")
        for line in row["requests"]:
            print("   ", line)

    requests = emulator.requests()
    writes = [r for r in requests if r["method"] != "GET"]

    # Creates: each group's Deployment once, with owner, labels and loader args; clash retried.
    posts = [r for r in writes if r["method"] == "POST"]
    assert [r["body"]["metadata"]["name"] for r in posts] == [
        "demo-loader-text", "demo-loader-code", "clash-loader-main", "clash-loader-main", "clash-loader-main",
    ]  # fmt: skip
    demo_spec = parse_dataplane(DEMO)
    for post, g in zip(posts[:2], demo_spec.groups):
        assert post["path"].startswith(DEP_PATH + "?")
        assert post["body"] == loader_deployment(demo_spec, g, replicas=1)
        meta = post["body"]["metadata"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "batchplane.dev/v1alpha1",
                "kind": "DataPlane",
                "name": "demo",
                "uid": "uid-demo",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][LABEL_MANAGED_BY] == MANAGER and meta["labels"]["batchplane.dev/group"] == g.name
        args = post["body"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:7] == ["loader", "-c", "/etc/batchplane/job.yaml", "--index", str(g.index), "--replica", "$(POD_NAME)"]
        assert args[7:] == [
            "--planner",
            "demo-planner.training.svc:50051",
            "--port",
            "50052",
            "--advertise",
            "$(POD_IP):50052",
            "--metrics-port",
            "9100",
        ]

    # Scaling: the replicas the policy decides as code's share rises and falls.
    scales = [
        (r["path"].split("?")[0].removeprefix(DEP_PATH + "/"), r["body"]) for r in writes if r["path"].split("?")[0].endswith("/scale")
    ]
    assert scales == [
        ("demo-loader-text/scale", {"spec": {"replicas": 3}}),  # pass 2: text needs 2.7
        ("demo-loader-text/scale", {"spec": {"replicas": 1}}),  # pass 4: code rose to 0.9, text needs 0.3
        ("demo-loader-code/scale", {"spec": {"replicas": 3}}),  #         code needs 2.7
        ("demo-loader-text/scale", {"spec": {"replicas": 3}}),  # pass 6: code fell back to 0.1
        ("demo-loader-code/scale", {"spec": {"replicas": 1}}),
    ]
    for i, (text, code) in enumerate(EXPECTED[:-1]):
        assert (trace[i]["pass"], emulator_replicas_at(trace, i, "text"), emulator_replicas_at(trace, i, "code")) == (i, text, code), trace[
            i
        ]

    # The status: groups, observed mixture and conditions, as the CRD allows.
    status_patches = [r for r in writes if r["path"].split("?")[0] == f"{DP_PATH}/demo/status"]
    assert len(status_patches) >= 6
    first = status_patches[0]["body"]["status"]
    assert first["groups"] == [{"name": "text", "replicas": 0, "desiredReplicas": 1}, {"name": "code", "replicas": 0, "desiredReplicas": 1}]
    assert first["observedMixture"] == CODE_LOW
    final_demo = emulator.get(DATAPLANES, "demo")
    validate_dataplane(final_demo)  # the status the operator wrote fits the chart's CRD
    status = final_demo["status"]
    assert status["observedGeneration"] == 2 and status["groups"] == [{"name": "text", "replicas": 3, "desiredReplicas": 3}]
    assert status["observedMixture"] == {"books": 0.3, "web": 0.6}  # code left with its group
    conds = {c["type"]: c for c in status["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("True", "LoadersReady")
    assert (conds["Scaling"]["status"], conds["Degraded"]["status"]) == ("False", "False")
    scaling = [
        c["message"] for r in status_patches for c in r["body"]["status"]["conditions"] if c["type"] == "Scaling" and c["status"] == "True"
    ]
    assert "text 1 -> 3 (up 1 -> 3: need 2.70 > 1 x 1.05 for 2 intervals)" in scaling

    # A spec change updates the Deployment without its replicas; a removed group is deleted.
    updates = [r for r in writes if r["method"] == "PATCH" and r["path"].split("?")[0] == f"{DEP_PATH}/demo-loader-text"]
    assert len(updates) == 1 and "replicas" not in updates[0]["body"]["spec"]
    assert updates[0]["body"]["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/batchplane:0.2.0"
    assert [r["path"].split("?")[0] for r in writes if r["method"] == "DELETE"] == [f"{DEP_PATH}/demo-loader-code"]
    assert emulator.get(DEPLOYMENTS, "demo-loader-text")["spec"]["replicas"] == 3  # the policy's replicas survived the update

    # Nothing it did not create was changed: every PATCH and DELETE names a Deployment it POSTed
    # (with its label), and the foreign ones are as they were.
    created = {r["body"]["metadata"]["name"] for r in posts}
    for r in writes:
        if r["method"] in ("PATCH", "DELETE") and r["path"].startswith(DEP_PATH + "/"):
            name = r["path"].split("?")[0].removeprefix(DEP_PATH + "/").split("/")[0]
            assert name in created and name not in FOREIGN, r
    for name in ("demo-loader-legacy", "demo-loader-orphan"):
        foreign = emulator.get(DEPLOYMENTS, name)
        assert (foreign["metadata"], foreign["spec"]) == ({"name": name, "namespace": NS, **FOREIGN[name]}, {"replicas": 7})

    # The bad DataPlane: a condition naming the field, no Deployment.
    broken = emulator.get(DATAPLANES, "broken")["status"]["conditions"]
    assert {(c["type"], c["status"], c["reason"]) for c in broken} == {
        ("Ready", "False", "InvalidSpec"),
        ("Degraded", "True", "InvalidSpec"),
    }
    assert all("spec.sourceGroups[0].maxReplicas: must be >= minReplicas (3), got 2" in c["message"] for c in broken)
    assert not any(
        "broken-loader" in r["path"] or (r["body"] or {}).get("metadata", {}).get("name", "").startswith("broken") for r in writes
    )

    # The name clash: refused by the API, reported, retried until it is resolved.
    clash_conditions = [
        {c["type"]: c for c in r["body"]["status"]["conditions"]} for r in writes if r["path"].split("?")[0] == f"{DP_PATH}/clash/status"
    ]
    assert (
        clash_conditions[0]["Degraded"]["reason"] == "NameConflict"
        and "clash-loader-main exists" in clash_conditions[0]["Degraded"]["message"]
    )
    assert emulator.get(DEPLOYMENTS, "clash-loader-main")["metadata"]["labels"][LABEL_MANAGED_BY] == MANAGER
    assert {c["type"]: c["status"] for c in emulator.get(DATAPLANES, "clash")["status"]["conditions"]}["Degraded"] == "False"

    # Errors are logged with resource and status, counted, and the loop went on.
    assert [r.errors > 0 for r in results] == [True, True, True, True, True, True, True, True, True]  # the bad DataPlane counts each pass
    assert results[1].dataplanes == 0  # the failed list ended pass 1
    log = caplog.text
    assert "GET dataplanes training/*: HTTP 503: ServiceUnavailable: the API server is overloaded" in log
    assert "POST deployments training/clash-loader-main: HTTP 409" in log
    sample = registry.get_sample_value
    assert sample("batchplane_operator_reconcile_errors_total", {"reason": "api"}) == 3  # the list, two clashes
    assert sample("batchplane_operator_reconcile_errors_total", {"reason": "invalid_spec"}) == 8  # every pass but the failed one
    assert sample("batchplane_operator_scale_events_total", {"dataplane": "demo", "group": "text", "direction": "up"}) == 2
    assert sample("batchplane_operator_scale_events_total", {"dataplane": "demo", "group": "text", "direction": "down"}) == 1
    assert sample("batchplane_operator_scale_events_total", {"dataplane": "demo", "group": "code", "direction": "up"}) == 1
    assert sample("batchplane_operator_desired_replicas", {"dataplane": "demo", "group": "text"}) == 3
    assert sample("batchplane_operator_desired_replicas", {"dataplane": "demo", "group": "code"}) is None  # forgotten with its group


def emulator_replicas_at(trace: list[dict[str, Any]], index: int, group: str) -> int:
    """A group's replicas after pass `index`, from the scale PATCHes (and creates) so far."""
    replicas = None
    for row in trace[: index + 1]:
        for line in row["requests"]:
            if line.startswith(f"POST {DEP_PATH} name=demo-loader-{group} "):
                replicas = int(line.split("replicas=")[1].split()[0])
            elif line.startswith(f"PATCH {DEP_PATH}/demo-loader-{group}/scale "):
                replicas = json.loads(line.split(" ", 2)[2])["spec"]["replicas"]
    return replicas


def dead_url() -> str:
    """The URL of a port nothing listens on."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_once_through_the_images_entrypoint(emulator: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    """`operator --once` (the chart's command line plus --kube-api): it takes the Lease for one
    pass, Prometheus is unreachable, so the Deployments are created at their minimum and the
    status and a Warning Event say why nothing scales; the exit status says a step failed; the
    Lease is released. With the Lease held by another operator, --once does nothing."""
    emulator.put(DATAPLANES, "demo", copy.deepcopy(DEMO))
    dead = dead_url()
    argv = [
        "operator",
        "--namespace",
        NS,
        "--prometheus",
        dead,
        "--metrics-port",
        "0",
        "--kube-api",
        emulator.url,
        "--identity",
        "op-once",
        "--once",
    ]
    code = entrypoint.main(argv)
    assert code == 1
    posts = [r for r in emulator.requests() if r["method"] == "POST" and r["path"].startswith(DEP_PATH)]
    assert [(r["body"]["metadata"]["name"], r["body"]["spec"]["replicas"]) for r in posts] == [
        ("demo-loader-text", 1),
        ("demo-loader-code", 1),
    ]
    conds = {c["type"]: c for c in emulator.get(DATAPLANES, "demo")["status"]["conditions"]}
    assert conds["Degraded"]["reason"] == "MetricsUnavailable" and f"Prometheus at {dead}" in conds["Degraded"]["message"]
    assert not any(r["path"].split("?")[0].endswith("/scale") for r in emulator.requests())
    assert {(e["type"], e["reason"]) for e in stored_events(emulator)} == {
        ("Normal", "DeploymentCreated"),
        ("Warning", "MetricsUnavailable"),
    }
    lease = emulator.get(LEASES, "batchplane-operator")
    assert lease["spec"]["holderIdentity"] == "" and lease["spec"]["leaseTransitions"] == 0  # released after the pass
    lease_writes = [
        (r["method"], r["body"]["spec"]["holderIdentity"])
        for r in emulator.requests()
        if r["path"].startswith(LEASE_PATH) and r["method"] != "GET"
    ]
    assert lease_writes[0] == ("POST", "op-once") and lease_writes[-1] == ("PATCH", "")  # created, then released
    assert set(lease_writes[1:-1]) <= {("PATCH", "op-once")}  # renewed while the pass ran

    # Another operator holds the Lease: --once leaves everything alone.
    emulator.patch(LEASES, "batchplane-operator", {"spec": {"holderIdentity": "op-leader", "leaseDurationSeconds": 15}})
    before = len([r for r in emulator.requests() if r["method"] != "GET"])
    assert entrypoint.main(argv) == 1
    assert [r for r in emulator.requests() if r["method"] != "GET"][before:] == []
    assert "another operator (op-leader) leads this namespace; --once did nothing" in caplog.text


def lease_history(emulator: Emulator, name: str = "batchplane-operator") -> list[dict[str, Any] | None]:
    """Every version the emulator stored of a Lease, oldest first."""

    def read() -> list[dict[str, Any] | None]:
        obj = next(o for (res, ns, n), o in emulator.handler.objects.items() if (res, ns, n) == (LEASES, NS, name))
        return [copy.deepcopy(v.raw) if v is not None else None for v in obj.history]

    return emulator.call(read)


def stored_events(emulator: Emulator) -> list[dict[str, Any]]:
    """The Events the emulator holds, oldest first (by name: <object>.<time in ns, hex>)."""

    def read() -> list[dict[str, Any]]:
        return [copy.deepcopy(o.raw) for (res, _, _), o in emulator.handler.objects.items() if res == EVENTS and not o.deleted]

    return sorted(emulator.call(read), key=lambda e: int(e["metadata"]["name"].rsplit(".", 1)[1], 16))


def test_the_charts_dataplane_gives_valid_loader_deployments(kubernetes_validate: Any) -> None:
    """The DataPlane `helm template` renders (ci/two-groups-values.yaml) builds loader
    Deployments that validate strictly for 1.30 and the newest Kubernetes, that the chart's
    loader NetworkPolicy and metrics Service select, and whose config volume is the chart's."""
    helm = helm_binary()
    if helm is None:
        pytest.fail("helm 3 not found (looked at $BATCHPLANE_HELM and .tools/helm-*/helm): run `make helm`", pytrace=False)
    docs = template(helm, "-f", CHART / "ci" / "two-groups-values.yaml")
    obj = one(docs, "DataPlane")
    obj["metadata"] |= {"uid": "uid-from-the-api-server", "generation": 1}
    spec = parse_dataplane(obj)
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-loaders"))
    service = one(docs, "Service", "-metrics")
    for g in spec.groups:
        d = loader_deployment(spec, g, replicas=g.min_replicas)
        for version in ("1.30.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(d, version, strict=True)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        ports = {p["name"]: p["containerPort"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert ports["grpc"] in {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
        assert ports["metrics"] == 9100 and any(p["targetPort"] == "metrics" for p in service["spec"]["ports"])
        volume = next(v for v in d["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
        assert volume["configMap"]["name"] == one(docs, "ConfigMap", "-job")["metadata"]["name"]


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: .venv/bin/pip install -c constraints.txt kubernetes-validate", pytrace=False)
    return kubernetes_validate


def test_the_client_authenticates_as_a_pod_would(emulator: Emulator, tmp_path: Any) -> None:
    """In a pod: the API from KUBERNETES_SERVICE_HOST/PORT, the ServiceAccount's token (read
    again as the kubelet rotates it) as a bearer token; a failure names verb, resource, status."""
    (tmp_path / "token").write_text("token-1\n")
    (tmp_path / "namespace").write_text(NS)
    config = in_cluster_config({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, directory=tmp_path)
    assert (config.api_url, config.token_file, config.ca_file) == ("https://10.96.0.1:443", tmp_path / "token", None)
    assert in_cluster_namespace(tmp_path) == NS
    with pytest.raises(KubernetesError, match="KUBERNETES_SERVICE_HOST is not set"):
        in_cluster_config({}, directory=tmp_path)
    client = KubernetesClient(dataclasses.replace(config, api_url=emulator.url))  # the emulator speaks plain HTTP
    assert client.list_dataplanes(NS) == []
    (header,) = emulator.call(lambda: [r.headers.get("Authorization") for r in emulator.handler])
    assert header == "Bearer token-1"
    with pytest.raises(KubernetesError) as info:
        client.scale_deployment(NS, "nothing-here", 2)
    assert (info.value.verb, info.value.resource, info.value.status) == ("PATCH", f"deployments {NS}/nothing-here/scale", 404)
    assert str(info.value).startswith(f"PATCH deployments {NS}/nothing-here/scale: HTTP 404: Object Not Found")


def test_prometheus_observations_read_the_dataplanes_own_pods() -> None:
    """The queries select the DataPlane's planner and loader pods by namespace and pod name, as
    the chart's dashboard does; their answers become the policy's observation."""

    class Reader:
        def __init__(self) -> None:
            self.queries: list[str] = []

        def instant(self, query: str) -> dict:
            self.queries.append(query)
            if "mixture_weight_ratio" in query:
                return {(("source", "web"),): 0.75, (("source", "code"),): 0.25}
            if "read_seconds_total" in query:
                return {(("source", "web"),): 0.002, (("source", "code"),): float("nan")}
            if "samples_total" in query:
                return {(("source", "web"),): 90.0, (("source", "code"),): 30.0}
            if "batchplane_planner_step{" in query:
                return {(): 1200.0}
            return {(): 2.5}

    reader = Reader()
    spec = parse_dataplane(DEMO)
    observed = PrometheusObservations(reader, rate_window_s=60).observe(spec)
    assert observed == Observed(
        weights={"web": 0.75, "code": 0.25},
        throughput=120.0,
        step=1200.0,
        step_rate=2.5,
        cost_s={"web": 0.002},
        mixture={"web": 0.75, "code": 0.25},
    )
    planner = 'namespace="training",pod=~"demo-planner-.+"'
    assert f"max by (source) (batchplane_planner_mixture_weight_ratio{{{planner}}})" in reader.queries
    assert f"sum by (source) (rate(batchplane_planner_samples_total{{{planner}}}[60000ms]))" in reader.queries
    assert any('batchplane_loader_read_seconds_total{namespace="training",pod=~"demo-loader-.+"}' in q for q in reader.queries)


# ---- Events ---------------------------------------------------------------------------------------


def test_events_say_what_the_operator_did_and_what_failed(emulator: Emulator) -> None:
    """The scripted passes of the first test, with Events: each Deployment created, updated,
    scaled and deleted is a Normal Event on its DataPlane; each problem a Warning, one Event per
    problem whose count follows its repeats (written at most every repeat interval)."""
    for obj in (DEMO, BROKEN, CLASH):
        emulator.put(DATAPLANES, obj["metadata"]["name"], copy.deepcopy(obj))
    emulator.put(
        DEPLOYMENTS,
        "clash-loader-main",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "clash-loader-main", "namespace": NS, **FOREIGN["clash-loader-main"]},
            "spec": {"replicas": 7},
        },
    )
    clock = {"t": 0.0}
    stamp = lambda: f"2025-01-01T00:{int(clock['t']) // 60:02d}:{int(clock['t']) % 60:02d}Z"  # noqa: E731
    client = KubernetesClient(KubeConfig(emulator.url, timeout_s=5))
    nanos = itertools.count(1)
    recorder = EventRecorder(
        client,
        instance="op-0",
        settings=EventSettings(repeat_interval_s=2 * INTERVAL_S),
        clock=lambda: clock["t"],
        wall_clock=stamp,
        nanos=lambda: next(nanos),
    )
    observations = ScriptedObservations()
    operator = Operator(client, observations, OperatorMetrics(CollectorRegistry()), namespace=NS, wall_clock=stamp, events=recorder)
    for i, weights in enumerate(SCRIPT):
        clock["t"] = i * INTERVAL_S
        observations.weights = weights
        if i == 3:
            emulator.delete(DEPLOYMENTS, "clash-loader-main")
        if i == 8:
            spec = copy.deepcopy(DEMO["spec"])
            spec["sourceGroups"] = spec["sourceGroups"][:1]
            spec["loader"]["image"] = "registry.example.com/batchplane:0.2.0"
            emulator.patch(DATAPLANES, "demo", {"spec": spec, "metadata": {"generation": 2}})
        operator.run_once(clock["t"])
        emulator.roll_out()

    stored = stored_events(emulator)
    by_object: dict[str, list[tuple[str, str, str, int]]] = {}
    for e in stored:
        ref = e["involvedObject"]
        assert (ref["apiVersion"], ref["kind"], ref["namespace"]) == ("batchplane.dev/v1alpha1", "DataPlane", NS)
        assert ref["uid"] == f"uid-{ref['name']}" and e["metadata"]["namespace"] == NS
        assert (e["source"]["component"], e["reportingComponent"], e["reportingInstance"]) == (
            "batchplane-operator",
            "batchplane-operator",
            "op-0",
        )
        by_object.setdefault(ref["name"], []).append((e["type"], e["reason"], e["message"], e["count"]))
    print("\nEvents:", json.dumps(by_object, indent=1))
    assert [(t, r, m.split(":")[0], n) for t, r, m, n in by_object["demo"]] == [
        ("Normal", "DeploymentCreated", "created demo-loader-text with 1 replicas", 1),
        ("Normal", "DeploymentCreated", "created demo-loader-code with 1 replicas", 1),
        ("Normal", "Scaled", "group text", 2),  # up 1 -> 3 in pass 2, and again in pass 6: one Event, count 2
        ("Normal", "Scaled", "group text", 1),  # pass 4: down 3 -> 1
        ("Normal", "Scaled", "group code", 1),  #         up 1 -> 3
        ("Normal", "Scaled", "group code", 1),  # pass 6: down 3 -> 1
        ("Normal", "DeploymentUpdated", "updated demo-loader-text", 1),  # pass 8: the image changes
        ("Normal", "DeploymentDeleted", "deleted demo-loader-code", 1),  #         and the code group goes
    ]
    assert by_object["demo"][2][2] == "group text: up 1 -> 3: need 2.70 > 1 x 1.05 for 2 intervals"
    assert by_object["demo"][3][2] == "group text: down 3 -> 1: need 0.30 < (3 - 1) x 0.85 for 2 intervals"
    # The invalid spec: one Event over the nine passes, its count written every 20 s.
    (broken,) = by_object["broken"]
    assert broken[:2] == ("Warning", "InvalidSpec") and "spec.sourceGroups[0].maxReplicas: must be >= minReplicas (3), got 2" in broken[2]
    assert broken[3] == 9
    # The name clash in passes 0, 1 and 2 (one Event, count 3), then the Deployment once resolved.
    assert [(t, r, n) for t, r, _, n in by_object["clash"]] == [("Warning", "NameConflict", 3), ("Normal", "DeploymentCreated", 1)]
    assert "clash-loader-main exists but was not made by the operator" in by_object["clash"][0][2]
    invalid = next(e for e in stored if e["reason"] == "InvalidSpec")
    assert (invalid["firstTimestamp"], invalid["lastTimestamp"]) == ("2025-01-01T00:00:00Z", "2025-01-01T00:01:20Z")
    patches = [
        r for r in emulator.requests() if r["method"] == "PATCH" and r["path"].startswith(f"{EVENT_PATH}/{invalid['metadata']['name']}")
    ]
    assert [r["body"]["count"] for r in patches] == [3, 5, 7, 9]  # every 2 intervals, never every pass


# ---- leader election -------------------------------------------------------------------------------

TIMING = ElectionSettings(lease_duration_s=3.0, renew_deadline_s=2.0, retry_period_s=0.2)


class PodClient(KubernetesClient):
    """One operator pod's API client; `cut` stands for losing the API (a partition, a hung node)."""

    def __init__(self, config: KubeConfig) -> None:
        super().__init__(config)
        self.cut = False
        #: Every write of this pod that went through, or may have: one whose answer never came
        #: (a timeout on a loaded machine) the server may have applied.
        self.writes: list[tuple[str, str]] = []

    def _request(self, verb: str, path: str, resource: str, **kwargs: Any) -> dict[str, Any]:
        if self.cut:
            raise KubernetesError(verb, resource, None, "cut off from the API server")
        try:
            answer = super()._request(verb, path, resource, **kwargs)
        except KubernetesError as exc:
            if verb != "GET" and exc.status is None:
                self.writes.append((verb, resource))
            raise
        if verb != "GET":
            self.writes.append((verb, resource))
        return answer


@dataclasses.dataclass
class Pod:
    """An operator as the chart runs it: election, control loop and Events, on threads."""

    identity: str
    api: PodClient
    leader: LeaderElection
    operator: Operator
    metrics: OperatorMetrics
    registry: CollectorRegistry
    stop: threading.Event
    threads: list[threading.Thread]

    @classmethod
    def start(cls, identity: str, url: str) -> Pod:
        api = PodClient(KubeConfig(url, timeout_s=2))
        registry = CollectorRegistry()
        metrics = OperatorMetrics(registry)
        leader = LeaderElection(
            api,
            namespace=NS,
            name="batchplane-operator",
            identity=identity,
            settings=TIMING,
            on_change=lambda leading: metrics.leader.set(1 if leading else 0),
        )
        events = EventRecorder(api, instance=identity, settings=EventSettings(repeat_interval_s=0.3))
        operator = Operator(api, ScriptedObservations(), metrics, namespace=NS, interval_s=0.2, events=events, leading=leader.is_leader)
        stop = threading.Event()
        threads = [leader.start(stop), threading.Thread(target=operator.run, args=(stop,), name=f"loop-{identity}", daemon=True)]
        threads[1].start()
        return cls(identity, api, leader, operator, metrics, registry, stop, threads)

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_two_operators_elect_one_leader_and_the_other_takes_over(emulator: Emulator) -> None:
    emulator.put(DATAPLANES, "demo", copy.deepcopy(DEMO))
    emulator.put(DATAPLANES, "broken", copy.deepcopy(BROKEN))
    pods = {name: Pod.start(name, emulator.url) for name in ("op-a", "op-b")}
    both, watching = [], threading.Event()

    def watch() -> None:  # samples who leads, all along
        while not watching.is_set():
            leaders = [n for n, p in pods.items() if p.leader.is_leader()]
            if len(leaders) > 1:
                both.append((time.monotonic(), leaders))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # One leads and reconciles; the other stands by and writes nothing at all.
        wait_for(lambda: any(p.leader.is_leader() for p in pods.values()), "a leader")
        first = next(p for p in pods.values() if p.leader.is_leader())
        second = next(p for p in pods.values() if p is not first)
        wait_for(lambda: emulator.get(DEPLOYMENTS, "demo-loader-code") is not None, "the leader's Deployments")
        # Its passes repeat the invalid spec; a repeat's count is written at most every 0.3 s.
        wait_for(
            lambda: any(e["reason"] == "InvalidSpec" and e["count"] > 1 for e in stored_events(emulator)),
            "the leader to write a repeat of the invalid spec's Event",
        )
        time.sleep(0.5)
        lease = emulator.get(LEASES, "batchplane-operator")
        assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"], lease["spec"]["leaseDurationSeconds"]) == (
            first.identity,
            0,
            3,
        )
        assert second.api.writes == []  # not a Deployment, status, Event or Lease write went through
        assert first.registry.get_sample_value("batchplane_operator_leader") == 1
        assert second.registry.get_sample_value("batchplane_operator_leader") == 0
        assert first.registry.get_sample_value("batchplane_operator_desired_replicas", {"dataplane": "demo", "group": "text"}) == 1

        # The leader stops renewing (cut off from the API): it steps down at its renew deadline,
        # the other takes the Lease over once it went unrenewed for its duration, and reconciles.
        first.api.cut = True
        wait_for(lambda: second.leader.is_leader(), "the standby to take over")
        assert not first.leader.is_leader()
        lease = emulator.get(LEASES, "batchplane-operator")
        assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == (second.identity, 1)
        wait_for(lambda: first.registry.get_sample_value("batchplane_operator_leader") == 0, "the old leader's gauge")
        wait_for(
            lambda: first.registry.get_sample_value("batchplane_operator_desired_replicas", {"dataplane": "demo", "group": "text"}) is None,
            "the old leader to forget its groups",
        )
        emulator.put(DATAPLANES, "late", copy.deepcopy(dataplane("late", "uid-late", [group("main", ["m"], 2, 2)])))
        # The server stores the Deployment before its answer reaches the client: wait on the
        # client's record of the write, then check the server has it.
        wait_for(lambda: ("POST", "deployments training/late-loader-main") in second.api.writes, "the new leader to reconcile")
        assert emulator.get(DEPLOYMENTS, "late-loader-main") is not None

        # Back online, the old leader stands by; the new one stops and releases the Lease, and
        # the old one takes it at once (a released Lease needs no waiting out).
        first.api.cut = False
        time.sleep(0.5)
        assert not first.leader.is_leader() and emulator.get(LEASES, "batchplane-operator")["spec"]["holderIdentity"] == second.identity
        second.halt()
        wait_for(lambda: first.leader.is_leader(), "the old leader to take the released Lease")
    finally:
        watching.set()
        for p in pods.values():
            p.halt()
        watcher.join(5)
    assert both == []  # never two leaders at once
    # The Lease's versions as stored (refused writes left out): who held it in turn.
    terms = [(v["spec"]["holderIdentity"], v["spec"]["leaseTransitions"]) for v in lease_history(emulator) if v is not None]
    terms = [t for i, t in enumerate(terms) if i == 0 or t != terms[i - 1]]
    assert terms == [
        (first.identity, 0),  # created, renewed
        (second.identity, 1),  # taken over once unrenewed for its duration
        ("", 1),  # released as it stopped
        (first.identity, 2),  # taken at once
        ("", 2),  # released at the end of the test
    ]
    # Events: each leader reported; the invalid spec is one Event per leader, its repeats counted.
    invalid = [e for e in stored_events(emulator) if e["reason"] == "InvalidSpec"]
    assert sorted({e["reportingInstance"] for e in invalid}) == sorted(pods)
    assert len(invalid) == 2  # the first leader counted on its own Event again when it led again
    assert max(e["count"] for e in invalid) > 1
    created = [e for e in stored_events(emulator) if e["reason"] == "DeploymentCreated"]
    assert {(e["reportingInstance"], e["message"].split()[1]) for e in created} == {
        (first.identity, "demo-loader-text"),
        (first.identity, "demo-loader-code"),
        (second.identity, "late-loader-main"),
    }


# ---- the operator process ---------------------------------------------------------------------------


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_text(url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value}."""
    out = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_the_operator_process_serves_metrics_logs_json_and_releases_its_lease(emulator: Emulator, tmp_path: pathlib.Path) -> None:
    """`python -m batchplane.operator` as the chart runs it (with --kube-api): its /metrics has
    the default collectors, batchplane_build_info and batchplane_operator_leader 1 once it leads;
    with BATCHPLANE_LOG_FORMAT=json every line of its log is one JSON object; on SIGTERM it
    releases the Lease and exits 0."""
    emulator.put(DATAPLANES, "demo", copy.deepcopy(DEMO))
    port = free_port()
    log_path = tmp_path / "operator.log"
    env = {
        **os.environ,
        "BATCHPLANE_LOG_FORMAT": "json",
        "POD_NAME": "batchplane-operator-7d4b9-x2x5q",
        "BATCHPLANE_GIT_REVISION": "0123abc",
    }
    command = [
        sys.executable,
        "-m",
        "batchplane.operator",
        "--namespace",
        NS,
        "--prometheus",
        dead_url(),
        "--kube-api",
        emulator.url,
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
        "--interval-s",
        "0.3",
        "--lease-name",
        "bp-operator",
        "--lease-duration-s",
        "3",
        "--renew-deadline-s",
        "2",
        "--retry-period-s",
        "0.2",
    ]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def leading() -> bool:
            try:
                return scrape_text(url).get("batchplane_operator_leader") == 1
            except OSError:
                return False

        wait_for(leading, "the operator to lead", timeout_s=30)
        wait_for(lambda: emulator.get(DEPLOYMENTS, "demo-loader-code") is not None, "its Deployments", timeout_s=30)
        desired = 'batchplane_operator_desired_replicas{dataplane="demo",group="text"}'
        wait_for(lambda: desired in scrape_text(url), "the pass to finish", timeout_s=30)
        page = scrape_text(url)
        assert process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
    assert code == 0
    assert page["process_resident_memory_bytes"] > 10e6 and page["process_cpu_seconds_total"] > 0
    assert any(k.startswith("python_gc_objects_collected_total{") for k in page) and any(k.startswith("python_info{") for k in page)
    (build,) = [k for k in page if k.startswith("batchplane_build_info{")]
    assert page[build] == 1 and 'part="operator"' in build and 'revision="0123abc"' in build and 'version="0.1.0"' in build
    assert page[desired] == 1
    lease = emulator.get(LEASES, "bp-operator")
    assert lease["spec"]["holderIdentity"] == ""  # released on SIGTERM
    assert [(v["spec"]["holderIdentity"]) for v in lease_history(emulator, "bp-operator")][0] == "batchplane-operator-7d4b9-x2x5q"
    assert {(e["reason"], e["reportingInstance"]) for e in stored_events(emulator)} == {
        ("DeploymentCreated", "batchplane-operator-7d4b9-x2x5q"),
        ("MetricsUnavailable", "batchplane-operator-7d4b9-x2x5q"),
    }
    lines = log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert len(records) >= 4
    for r in records:
        assert {"time", "level", "logger", "message", "part"} <= r.keys() and r["part"] == "operator", r
    messages = [r["message"] for r in records]
    assert any(m.startswith("leading: this operator (batchplane-operator-7d4b9-x2x5q) holds the lease") for m in messages)
    assert any(m.startswith("no longer leading: it stopped and released the lease") for m in messages)
    warned = [r for r in records if r["level"] == "WARNING" and r["logger"] == "batchplane.operator.loop"]
    assert warned and all(r["dataplane"] == f"{NS}/demo" for r in warned)  # the DataPlane as a field


def test_the_operators_deployments_carry_the_loader_pod_fields(emulator: Emulator, kubernetes_validate: Any) -> None:
    """Loader pods that reach their data and are placed. kmock stands in for the Kubernetes API
    server, which cannot run here: the DataPlane the chart renders from
    ci/loader-pods-values.yaml, with every pod field of spec.loader (env, envFrom, volumes,
    volumeMounts, serviceAccountName, nodeSelector, tolerations, affinity, priorityClassName,
    topologySpreadConstraints), is read through the API by the operator, whose Deployments carry
    them as given and validate strictly for 1.30 and the newest Kubernetes. Then the DataPlane
    changes its nodeSelector and drops its tolerations and ServiceAccount: after the operator's
    update (a merge patch the emulator applies), the live Deployment has exactly the new ones."""
    helm = helm_binary()
    if helm is None:
        pytest.fail("helm 3 not found (looked at $BATCHPLANE_HELM and .tools/helm-*/helm): run `make helm`", pytrace=False)
    values = load_values("loader-pods-values.yaml")["loader"]
    obj = one(template(helm, "-f", CHART / "ci" / "loader-pods-values.yaml"), "DataPlane")
    name = obj["metadata"]["name"]
    assert obj["metadata"]["namespace"] == NS
    obj["metadata"] |= {"uid": "uid-pods", "generation": 1}
    emulator.put(DATAPLANES, name, copy.deepcopy(obj))
    client = KubernetesClient(KubeConfig(emulator.url, timeout_s=5))
    operator = Operator(client, ScriptedObservations(), OperatorMetrics(CollectorRegistry()), namespace=NS)
    operator.run_once(0.0)
    emulator.roll_out()

    posts = [r for r in emulator.requests() if r["method"] == "POST" and r["path"].startswith(DEP_PATH)]
    assert [r["body"]["metadata"]["name"] for r in posts] == [f"{name}-loader-web", f"{name}-loader-local"]
    for post in posts:
        live = emulator.get(DEPLOYMENTS, post["body"]["metadata"]["name"])
        for d in (post["body"], live):
            pod = d["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            assert c["env"][:2] == [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ]  # the operator's own first, then the DataPlane's
            assert c["env"][-len(values["env"]) :] == values["env"] and c["envFrom"] == values["envFrom"]
            # The operator's own mounts first: the job, /tmp, the loader's certificate folder and
            # its token for the issuer with the CA certificate (the chart's default tls.mode, issued).
            own = ["/etc/batchplane", "/tmp", "/etc/batchplane/tls", "/etc/batchplane/issuer"]
            assert [m["mountPath"] for m in c["volumeMounts"]] == [*own, *[m["mountPath"] for m in values["volumeMounts"]]]
            assert len(pod["volumes"]) == len(own) + len(values["volumes"])
            assert pod["volumes"][len(own) :] == values["volumes"]
            assert all("subPath" not in m for m in c["volumeMounts"][: len(own)])
            for key in ("serviceAccountName", "nodeSelector", "tolerations", "affinity", "priorityClassName", "topologySpreadConstraints"):
                assert pod[key] == values[key], key
            assert pod["automountServiceAccountToken"] is False
            for version in ("1.30.0", kubernetes_validate.latest_version()):
                kubernetes_validate.validate(d, version, strict=True)

    loader = {k: v for k, v in obj["spec"]["loader"].items() if k not in ("tolerations", "serviceAccountName")}
    loader["nodeSelector"] = {"node-pool": "cpu-spot"}
    emulator.patch(
        DATAPLANES, name, {"spec": {"loader": {**loader, "tolerations": None, "serviceAccountName": None}}, "metadata": {"generation": 2}}
    )
    operator.run_once(30.0)
    updates = [r for r in emulator.requests() if r["method"] == "PATCH" and r["path"].split("?")[0] == f"{DEP_PATH}/{name}-loader-web"]
    assert len(updates) == 1, [r["path"] for r in emulator.requests()]
    pod = emulator.get(DEPLOYMENTS, f"{name}-loader-web")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node-pool": "cpu-spot"}
    assert "tolerations" not in pod and "serviceAccountName" not in pod
    assert pod["affinity"] == values["affinity"] and pod["volumes"][4:] == values["volumes"]  # after the job, /tmp, certificates and tokens


def test_the_charts_operator_elects_a_leader(emulator: Emulator) -> None:
    """The chart's operator Deployment (here with two replicas): its arguments, parsed by the
    operator's own flag parser with the downward API's values, name the Lease the Role lets it
    renew, its pod name as identity and the chart's timing."""
    helm = helm_binary()
    if helm is None:
        pytest.fail("helm 3 not found (looked at $BATCHPLANE_HELM and .tools/helm-*/helm): run `make helm`", pytrace=False)
    from batchplane.operator.__main__ import parse_args

    docs = template(helm, "--set", "operator.replicas=2", "--set", "operator.leaderElection.leaseDurationSeconds=20")
    deployment = one(docs, "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e and "fieldRef" in e["valueFrom"]
    }
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    pod = {"metadata.name": "demo-batchplane-operator-5f6d7-abcde", "metadata.namespace": NS}
    args = [re.sub(r"\$\((\w+)\)", lambda m: pod[env[m.group(1)]], a) for a in container["args"][1:]]
    settings = parse_args(args, {})
    role = one(docs, "Role", "-operator")
    (named,) = [r for r in role["rules"] if r.get("resourceNames")]
    assert settings.leader_elect and settings.identity == "demo-batchplane-operator-5f6d7-abcde" and settings.namespace == NS
    assert named["resourceNames"] == [settings.lease_name] and set(named["verbs"]) == {"get", "patch"}
    assert (settings.lease_duration_s, settings.renew_deadline_s, settings.retry_period_s) == (20, 10, 2)
