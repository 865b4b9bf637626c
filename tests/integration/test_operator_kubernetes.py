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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_helm_chart import CHART, helm_binary, one, template, validate_dataplane

from batchplane import entrypoint
from batchplane.operator.kubernetes import KubeConfig, KubernetesClient, KubernetesError, in_cluster_config, in_cluster_namespace
from batchplane.operator.loop import Observed, Operator, PrometheusObservations
from batchplane.operator.dataplane import parse_dataplane
from batchplane.operator.manifests import LABEL_MANAGED_BY, MANAGER, loader_deployment
from batchplane.operator.metrics import OperatorMetrics

try:
    import kmock
except ImportError as exc:  # fail, never skip: the emulator is the only API server these tests have
    raise ImportError("kmock is a test dependency (pyproject's dev extra): .venv/bin/pip install -c constraints.txt kmock pytest-asyncio") from exc


pytestmark = pytest.mark.integration

NS = "training"
INTERVAL_S = 10
DATAPLANES = kmock.resource("batchplane.dev", "v1alpha1", "dataplanes")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
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
            "scaling": {"intervalSeconds": INTERVAL_S, "windowIntervals": 1, "consecutiveIntervals": 2, "cooldownSeconds": 0, "headroom": 0, **scaling},
            "loader": {
                "image": "registry.example.com/batchplane:0.1.0",
                "jobConfigMap": f"{name}-job",
                "podLabels": {"app.kubernetes.io/name": "batchplane", "app.kubernetes.io/component": "loader", "batchplane.dev/dataplane": name},
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
        "ownerReferences": [{"apiVersion": "batchplane.dev/v1alpha1", "kind": "DataPlane", "name": "demo", "uid": "uid-of-a-deleted-demo", "controller": True}],
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
        return self.call(lambda: [{"method": str(r.method.value).upper(), "path": str(r.url.path_qs), "body": r.data} for r in self.handler])

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
        async with kmock.KubernetesEmulator() as handler, kmock.Server(handler) as server:
            handler.resources["apps/v1/deployments"] = {}
            handler.resources["batchplane.dev/v1alpha1/dataplanes"] = {}
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
    operator = Operator(client, observations, OperatorMetrics(registry), namespace=NS, wall_clock=lambda: f"2025-01-01T00:{int(clock['t']) // 60:02d}:{int(clock['t']) % 60:02d}Z")

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
            {"apiVersion": "batchplane.dev/v1alpha1", "kind": "DataPlane", "name": "demo", "uid": "uid-demo", "controller": True, "blockOwnerDeletion": True}
        ]
        assert meta["labels"][LABEL_MANAGED_BY] == MANAGER and meta["labels"]["batchplane.dev/group"] == g.name
        args = post["body"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:7] == ["loader", "-c", "/etc/batchplane/job.yaml", "--index", str(g.index), "--replica", "$(POD_NAME)"]
        assert args[7:] == ["--planner", "demo-planner.training.svc:50051", "--port", "50052", "--advertise", "$(POD_IP):50052", "--metrics-port", "9100"]

    # Scaling: the replicas the policy decides as code's share rises and falls.
    scales = [(r["path"].split("?")[0].removeprefix(DEP_PATH + "/"), r["body"]) for r in writes if r["path"].split("?")[0].endswith("/scale")]
    assert scales == [
        ("demo-loader-text/scale", {"spec": {"replicas": 3}}),  # pass 2: text needs 2.7
        ("demo-loader-text/scale", {"spec": {"replicas": 1}}),  # pass 4: code rose to 0.9, text needs 0.3
        ("demo-loader-code/scale", {"spec": {"replicas": 3}}),  #         code needs 2.7
        ("demo-loader-text/scale", {"spec": {"replicas": 3}}),  # pass 6: code fell back to 0.1
        ("demo-loader-code/scale", {"spec": {"replicas": 1}}),
    ]
    for i, (text, code) in enumerate(EXPECTED[:-1]):
        assert (trace[i]["pass"], emulator_replicas_at(trace, i, "text"), emulator_replicas_at(trace, i, "code")) == (i, text, code), trace[i]

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
    scaling = [c["message"] for r in status_patches for c in r["body"]["status"]["conditions"] if c["type"] == "Scaling" and c["status"] == "True"]
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
    assert {(c["type"], c["status"], c["reason"]) for c in broken} == {("Ready", "False", "InvalidSpec"), ("Degraded", "True", "InvalidSpec")}
    assert all("spec.sourceGroups[0].maxReplicas: must be >= minReplicas (3), got 2" in c["message"] for c in broken)
    assert not any("broken-loader" in r["path"] or (r["body"] or {}).get("metadata", {}).get("name", "").startswith("broken") for r in writes)

    # The name clash: refused by the API, reported, retried until it is resolved.
    clash_conditions = [
        {c["type"]: c for c in r["body"]["status"]["conditions"]} for r in writes if r["path"].split("?")[0] == f"{DP_PATH}/clash/status"
    ]
    assert clash_conditions[0]["Degraded"]["reason"] == "NameConflict" and "clash-loader-main exists" in clash_conditions[0]["Degraded"]["message"]
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


def test_once_through_the_images_entrypoint(emulator: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    """`operator --once` (the chart's command line plus --kube-api): one pass, Prometheus
    unreachable, so the Deployments are created at their minimum and the status says why
    nothing scales; the exit status says a step failed."""
    emulator.put(DATAPLANES, "demo", copy.deepcopy(DEMO))
    with contextlib.closing(socket.socket()) as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code = entrypoint.main(["operator", "--namespace", NS, "--prometheus", dead, "--metrics-port", "0", "--kube-api", emulator.url, "--once"])
    assert code == 1
    posts = [r for r in emulator.requests() if r["method"] == "POST"]
    assert [(r["body"]["metadata"]["name"], r["body"]["spec"]["replicas"]) for r in posts] == [("demo-loader-text", 1), ("demo-loader-code", 1)]
    conds = {c["type"]: c for c in emulator.get(DATAPLANES, "demo")["status"]["conditions"]}
    assert conds["Degraded"]["reason"] == "MetricsUnavailable" and f"Prometheus at {dead}" in conds["Degraded"]["message"]
    assert not any(r["path"].split("?")[0].endswith("/scale") for r in emulator.requests())


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
        weights={"web": 0.75, "code": 0.25}, throughput=120.0, step=1200.0, step_rate=2.5, cost_s={"web": 0.002}, mixture={"web": 0.75, "code": 0.25}
    )
    planner = 'namespace="training",pod=~"demo-planner-.+"'
    assert f"max by (source) (batchplane_planner_mixture_weight_ratio{{{planner}}})" in reader.queries
    assert f"sum by (source) (rate(batchplane_planner_samples_total{{{planner}}}[60000ms]))" in reader.queries
    assert any('batchplane_loader_read_seconds_total{namespace="training",pod=~"demo-loader-.+"}' in q for q in reader.queries)
