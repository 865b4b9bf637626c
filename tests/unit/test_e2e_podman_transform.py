"""deploy/e2e_podman.py's transform: the chart's manifests as pods `podman kube play` (4.3) runs.

Pure and fast: a small set of manifests shaped as the chart renders them (a planner Deployment
and Service, the job ConfigMap, the DataPlane, an Indexed Job whose pods carry the constructor as
a native sidecar and a headless Service for torchrun's rendezvous), plus, where helm is at hand,
the chart itself rendered with each example kind the e2e runs.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("e2e_podman", ROOT / "deploy" / "e2e_podman.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_podman"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


e2e = _load()

NS = "e2e"
SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "readOnlyRootFilesystem": True}


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": "e2e", "app.kubernetes.io/component": component}


def _sidecar() -> dict:
    probe = {"httpGet": {"path": "/metrics", "port": 9101}, "periodSeconds": 2, "failureThreshold": 150}
    return {
        "name": "batchplane-constructor",
        "image": "localhost/batchplane:dev",
        "restartPolicy": "Always",
        "args": [
            "constructor",
            "-c",
            "/etc/batchplane/job.yaml",
            "--index-from",
            "indexed-job",
            "--planner",
            "e2e-batchplane-planner.e2e.svc:50051",
            "--metrics-port",
            "9101",
        ],
        "env": [
            {
                "name": "BATCHPLANE_COMPLETION_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}},
            }
        ],
        "ports": [{"name": "bp-ctor-metrics", "containerPort": 9101, "protocol": "TCP"}],
        "startupProbe": probe,
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": 9101}},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": 9101}},
        "securityContext": SECURITY,
        "volumeMounts": [
            {"name": "batchplane-socket", "mountPath": "/run/batchplane"},
            {"name": "batchplane-job", "mountPath": "/etc/batchplane", "readOnly": True},
        ],
    }


def manifests() -> list[dict]:
    """What `helm template` gives for example.kind torchrun, cut to what the transform reads."""
    planner_labels = _labels("planner")
    trainer_labels = {**_labels("trainer"), "batchplane.dev/trainer": "e2e-batchplane"}
    script = (
        'set -eu\nindex=$(cat "$BATCHPLANE_CONSTRUCTOR_INDEX_FILE")\n'
        'torchrun --nnodes=2 --node-rank="$index" --master-addr="e2e-batchplane-example-0.e2e-batchplane-example" '
        "--master-port=29500 --no-python sh -c 'exec python -m x --ranks \"$RANK\"'\n"
    )
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "e2e-batchplane-job", "namespace": NS},
            "data": {"job.yaml": "job: e2e\n"},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "e2e-batchplane-example", "namespace": NS},
            "spec": {"clusterIP": "None", "selector": _labels("trainer"), "ports": [{"port": 29500}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "e2e-batchplane-planner", "namespace": NS},
            "spec": {"selector": planner_labels, "ports": [{"port": 50051}]},
        },
        None,  # an empty document, as helm leaves between templates that render nothing
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "e2e-batchplane-planner", "namespace": NS, "labels": planner_labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": planner_labels},
                "template": {
                    "metadata": {"labels": planner_labels, "annotations": {"checksum/job-config": "c" * 64}},
                    "spec": {
                        "containers": [
                            {
                                "name": "planner",
                                "image": "localhost/batchplane:dev",
                                "args": ["planner", "-c", "/etc/batchplane/job.yaml", "--port", "50051", "--metrics-port", "9100"],
                                "env": [{"name": "AWS_ENDPOINT_URL", "value": "http://10.89.0.1:9000"}],
                                "ports": [{"name": "grpc", "containerPort": 50051}, {"name": "metrics", "containerPort": 9100}],
                                "startupProbe": {"grpc": {"port": 50051}},
                                "volumeMounts": [
                                    {"name": "batchplane-job", "mountPath": "/etc/batchplane"},
                                    {"name": "state", "mountPath": "/var/lib/batchplane"},
                                    {"name": "tmp", "mountPath": "/tmp"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "batchplane-job", "configMap": {"name": "e2e-batchplane-job"}},
                            {"name": "state", "emptyDir": {}},
                            {"name": "tmp", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "e2e-batchplane-operator", "namespace": NS, "labels": _labels("operator")},
            "spec": {"template": {"metadata": {}, "spec": {"containers": [{"name": "operator", "image": "x"}]}}},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "e2e-batchplane-example", "namespace": NS, "labels": _labels("trainer")},
            "spec": {
                "completionMode": "Indexed",
                "completions": 2,
                "parallelism": 2,
                "template": {
                    "metadata": {"labels": trainer_labels, "annotations": {"prometheus.io/port": "9101"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "subdomain": "e2e-batchplane-example",
                        "initContainers": [_sidecar()],
                        "containers": [
                            {
                                "name": "trainer",
                                "image": "localhost/batchplane-trainer:e2e",
                                "command": ["sh", "-c"],
                                "args": [script],
                                "env": [{"name": "BATCHPLANE_CONSTRUCTOR_INDEX_FILE", "value": "/run/batchplane/constructor-index"}],
                                "ports": [{"name": "rendezvous", "containerPort": 29500}],
                                "volumeMounts": [
                                    {"name": "batchplane-socket", "mountPath": "/run/batchplane"},
                                    {"name": "trainer-tmp", "mountPath": "/tmp"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "batchplane-socket", "emptyDir": {}},
                            {"name": "batchplane-job", "configMap": {"name": "e2e-batchplane-job"}},
                            {"name": "trainer-tmp", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "batchplane.dev/v1alpha1",
            "kind": "DataPlane",
            "metadata": {"name": "e2e-batchplane", "namespace": NS},
            "spec": {
                "sourceGroups": [
                    {
                        "name": "text",
                        "sources": [{"name": "docs", "path": "s3://b/data/docs/"}],
                        "minReplicas": 1,
                        "maxReplicas": 2,
                        "workersPerActor": 1,
                    }
                ],
                "planner": {"address": "e2e-batchplane-planner.e2e.svc:50051"},
                "loader": {
                    "image": "localhost/batchplane:dev",
                    "jobConfigMap": "e2e-batchplane-job",
                    "podAnnotations": {"checksum/job-config": "c" * 64},
                    "env": [{"name": "AWS_ENDPOINT_URL", "value": "http://10.89.0.1:9000"}],
                },
            },
        },
    ]


def containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def names(pods: list[dict]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


@pytest.fixture(scope="module")
def plan():
    return e2e.transform(manifests())


def test_expand_k8s_follows_kubernetes() -> None:
    env = {"POD_NAME": "p-0", "POD_IP": "p-0", "EMPTY": ""}
    assert e2e.expand_k8s("--replica $(POD_NAME) --advertise $(POD_IP):50052", env) == "--replica p-0 --advertise p-0:50052"
    assert e2e.expand_k8s("$(UNKNOWN) $(EMPTY)x", env) == "$(UNKNOWN) x"
    assert e2e.expand_k8s("$$(POD_NAME) costs $$5 $x $", env) == "$(POD_NAME) costs $5 $x $"
    shell = 'first=$(($(cat "$F") * 2)); n=$((a + b)); ${HOME}'
    assert e2e.expand_k8s(shell, env) == shell
    assert e2e.expand_k8s("open $(POD_NAME", env) == "open $(POD_NAME"
    used: dict[str, str] = {}
    e2e.expand_k8s("$(POD_NAME)/$(UNKNOWN)", env, used)
    assert used == {"POD_NAME": "p-0"}


def test_phases_planner_then_operator_made_loaders_then_one_pod_per_completion_index(plan) -> None:
    assert [phase for phase, _ in plan.phases] == ["planner", "loaders", "trainers"]
    assert names(plan.pods("planner")) == ["e2e-batchplane-planner-0"]
    assert names(plan.pods("loaders")) == ["e2e-batchplane-loader-text-0"]
    assert names(plan.pods("trainers")) == ["e2e-batchplane-example-0", "e2e-batchplane-example-1"]
    assert [cm["metadata"]["name"] for cm in plan.config_maps] == ["e2e-batchplane-job"]
    for phase, pods in plan.phases:
        docs = plan.documents(phase)
        assert [d["kind"] for d in docs] == ["ConfigMap", *["Pod"] * len(pods)]
        assert all(d["apiVersion"] == "v1" for d in docs)
    assert plan.unresolved == []
    text = "\n".join(plan.rewrites)
    assert "Service/e2e-batchplane-planner: dropped" in text
    assert "Deployment/e2e-batchplane-operator: dropped" in text


def test_loader_pods_are_the_operators_deployment_with_literal_names(plan) -> None:
    from batchplane.operator.dataplane import parse_dataplane
    from batchplane.operator.manifests import loader_deployment

    dataplane = next(d for d in manifests() if d and d["kind"] == "DataPlane")
    spec = parse_dataplane({**dataplane, "metadata": {**dataplane["metadata"], "uid": e2e.DATAPLANE_UID}})
    made = loader_deployment(spec, spec.groups[0], replicas=1)["spec"]["template"]["spec"]["containers"][0]
    pod = plan.pods("loaders")[0]
    loader = containers(pod)["loader"]
    name = "e2e-batchplane-loader-text-0"
    assert loader["image"] == made["image"]
    assert loader["args"] == [
        a.replace("$(POD_NAME)", name).replace("$(POD_IP)", name).replace("e2e-batchplane-planner.e2e.svc", "e2e-batchplane-planner-0")
        for a in made["args"]
    ]
    assert "--advertise" in loader["args"] and f"{name}:50052" in loader["args"]
    env = {e["name"]: e for e in loader["env"]}
    assert env["POD_IP"] == {"name": "POD_IP", "value": name}  # kube play refuses status.podIP
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # kube play fills it
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://10.89.0.1:9000"  # spec.loader's env, kept
    assert "ports" not in loader
    assert "ownerReferences" not in pod["metadata"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "batchplane-operator"
    assert all(len(v) <= e2e.MAX_ANNOTATION for v in pod["metadata"]["annotations"].values())


def test_trainer_pods_carry_their_index_and_run_the_sidecar_as_a_container(plan) -> None:
    for i, pod in enumerate(plan.pods("trainers")):
        name = f"e2e-batchplane-example-{i}"
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["annotations"][e2e.COMPLETION_INDEX] == str(i)
        assert meta["labels"][e2e.COMPLETION_INDEX] == str(i)
        assert meta["labels"]["batchplane.dev/trainer"] == "e2e-batchplane"
        assert spec["restartPolicy"] == "Never"
        assert "initContainers" not in spec and "subdomain" not in spec
        assert [c["name"] for c in spec["containers"]] == ["batchplane-constructor", "trainer"]
        sidecar, trainer = spec["containers"]
        assert not set(sidecar) & {"restartPolicy", "startupProbe", "readinessProbe", "livenessProbe", "ports"}
        assert "e2e-batchplane-planner-0:50051" in sidecar["args"]
        # the annotation source stays a downward-API field (kube play fills it); the Job
        # controller's variable is added
        env = {e["name"]: e for e in sidecar["env"]}
        assert "fieldRef" in env["BATCHPLANE_COMPLETION_INDEX"]["valueFrom"]
        assert env[e2e.COMPLETION_INDEX_ENV]["value"] == str(i)
        assert trainer["command"] == ["sh", "-c"] and len(trainer["args"]) == 1
        script = trainer["args"][0]
        gate, _, rest = script.partition("set -eu\n")
        assert 'urllib.request.urlopen("http://127.0.0.1:9101/metrics"' in gate
        assert "time.monotonic() + 300" in gate  # periodSeconds 2 x failureThreshold 150
        assert '--master-addr="e2e-batchplane-example-0"' in rest
        assert 'index=$(cat "$BATCHPLANE_CONSTRUCTOR_INDEX_FILE")' in rest  # shell, not $(VAR)
        # emptyDirs are per pod (kube play would share one named volume between the pods)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert set(volumes) == {f"{name}-batchplane-socket", "batchplane-job", f"{name}-trainer-tmp"}
        mounts = {m["name"] for c in spec["containers"] for m in c["volumeMounts"]}
        assert mounts <= set(volumes)
    assert set(plan.volume_names()) == {
        "e2e-batchplane-job",
        "e2e-batchplane-planner-0-state",
        "e2e-batchplane-planner-0-tmp",
        "e2e-batchplane-loader-text-0-tmp",
        *(f"e2e-batchplane-example-{i}-{v}" for i in range(2) for v in ("batchplane-socket", "trainer-tmp")),
    }


def test_every_rewrite_is_recorded_and_the_input_is_left_alone(plan) -> None:
    docs = manifests()
    before = copy.deepcopy(docs)
    e2e.transform(docs)
    assert docs == before
    text = "\n".join(plan.rewrites)
    for expected in (
        "Deployment/e2e-batchplane-planner -> Pod e2e-batchplane-planner-0",
        "Job/e2e-batchplane-example -> Pod e2e-batchplane-example-0, e2e-batchplane-example-1",
        "loader Deployment/e2e-batchplane-loader-text made by batchplane.operator.manifests.loader_deployment",
        "env POD_IP fieldRef status.podIP -> 'e2e-batchplane-loader-text-0'",
        "args: $(POD_NAME) -> 'e2e-batchplane-loader-text-0'",
        "Service DNS name e2e-batchplane-planner.e2e.svc -> e2e-batchplane-planner-0",
        "Service DNS name e2e-batchplane-example-0.e2e-batchplane-example -> e2e-batchplane-example-0",
        "native sidecar batchplane-constructor moved from initContainers into containers",
        "first waits as the sidecar's startupProbe made it wait",
        "annotation checksum/job-config cut to its first 63 characters",
        "emptyDir volumes renamed batchplane-socket -> e2e-batchplane-example-1-batchplane-socket",
        "ports dropped (50051, 9100)",
        "subdomain dropped",
    ):
        assert expected in text, expected


def test_what_it_cannot_turn_into_pods_is_refused() -> None:
    docs = [d for d in manifests() if not (d and d["kind"] == "Deployment" and d["metadata"]["name"].endswith("planner"))]
    with pytest.raises(ValueError, match="no planner"):
        e2e.transform(docs)
    docs = manifests()
    job = next(d for d in docs if d and d["kind"] == "Job")
    del job["spec"]["template"]["spec"]["initContainers"][0]["startupProbe"]
    with pytest.raises(ValueError, match="no HTTP startupProbe"):
        e2e.transform(docs)


def _helm() -> str | None:
    for candidate in (os.environ.get("BATCHPLANE_HELM"), str(ROOT / ".tools" / "helm-3.17.2" / "helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.parametrize("kind", ["job", "torchrun"])
def test_the_rendered_chart_transforms_cleanly(kind: str, tmp_path: pathlib.Path) -> None:
    """The e2e's own values, rendered by helm, leave no $(VAR), Service name or native sidecar."""
    helm = _helm()
    assert helm is not None, "helm 3 not found (looked at $BATCHPLANE_HELM and .tools/helm-3.17.2/helm): run `make helm`"
    values = e2e.chart_values(kind, "batchplane:dev", "batchplane-trainer:e2e", {"AWS_ENDPOINT_URL": "http://10.89.0.1:1"})
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    rendered = subprocess.run(
        [helm, "template", e2e.RELEASE, str(e2e.CHART), "-n", e2e.NAMESPACE, "-f", str(tmp_path / "values.yaml")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    plan = e2e.transform(list(yaml.safe_load_all(rendered)))
    pods = {phase: names(pods) for phase, pods in plan.phases}
    assert pods["planner"] == ["e2e-batchplane-planner-0"] and pods["loaders"] == ["e2e-batchplane-loader-text-0"]
    assert pods["trainers"] == (["e2e-batchplane-example-0"] if kind == "job" else ["e2e-batchplane-example-0", "e2e-batchplane-example-1"])
    assert plan.unresolved == []
    for _, phase_pods in plan.phases:
        for pod in phase_pods:
            text = yaml.safe_dump(pod)
            assert not re.search(r"\$\((POD_NAME|POD_IP|POD_NAMESPACE)\)", text)
            assert "initContainers" not in pod["spec"] and "restartPolicy: Always" not in text
            assert all(len(str(v)) <= e2e.MAX_ANNOTATION for v in pod["metadata"]["annotations"].values())
            for c in pod["spec"]["containers"]:
                assert "ports" not in c
                for e in c.get("env", []):
                    assert e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") not in e2e.REFUSED_FIELDS
