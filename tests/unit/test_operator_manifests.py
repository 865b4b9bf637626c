"""The operator's reading of a DataPlane (batchplane.operator.dataplane) and the loader
Deployment it builds per source group (batchplane.operator.manifests)
(deploy/helm/README.md, "The operator contract"): the contract's fields, strict validation with
kubernetes-validate for Kubernetes 1.30 and the newest version it knows, the spec hash, the
declared schedule, bad specs refused with the field named, spec.loader's pod fields (env,
volumes, serviceAccountName, nodeSelector, ...: batchplane.operator.podfields) carried into the
Deployment, refused where they clash with the operator's own, and removed again by an update,
and the loaders' transport security: spec.loader.identity (certificates from the issuer: an
in-memory emptyDir, a projected ServiceAccount token and the CA certificate, from a ConfigMap or
the one key ca.crt of a Secret, behind --tls-dir, --issuer, --issuer-token-file and --issuer-ca,
and the pod label naming the group's index), spec.loader.authTokens mounted as a whole Secret
(never subPath) behind --auth-tokens and --token-file, spec.loader.tls (a certificate Secret
every loader pod shared) refused; and probes on the metrics port's /healthz (kubelet's gRPC
probe cannot pass mutual TLS)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest

from batchplane.core.process import parse_process_args
from batchplane.operator.dataplane import SpecError, declared_schedule, parse_dataplane
from batchplane.operator.manifests import (
    ANNOTATION_SPEC_HASH,
    LABEL_DATAPLANE,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    MANAGER,
    loader_deployment,
    spec_hash,
)
from batchplane.operator.policy import ScalingSettings

TOKENS_SECRET = "text-and-code-auth-tokens"
ISSUER = "text-and-code-operator.training.svc:8443"
IDENTITY = {"issuer": ISSUER, "caConfigMap": "text-and-code-ca", "audience": "batchplane", "tokenExpirationSeconds": 3600}

NAMESPACE = "training"
UID = "6f1c0a52-0d1e-4c55-9b1e-2a8c0f3d4e5f"
POD_LABELS = {
    "app.kubernetes.io/name": "batchplane",
    "app.kubernetes.io/instance": "demo",
    "app.kubernetes.io/component": "loader",
    "app.kubernetes.io/part-of": "batchplane",
    "batchplane.dev/dataplane": "text-and-code",
    "batchplane.dev/scrape": "text-and-code",
}
POD_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": "9100",
    "prometheus.io/path": "/metrics",
    "checksum/job-config": "5ea0a5ef",
}

#: The DataPlane the chart renders for ci/two-groups-values.yaml, as the API server returns it.
DATAPLANE: dict[str, Any] = {
    "apiVersion": "batchplane.dev/v1alpha1",
    "kind": "DataPlane",
    "metadata": {"name": "text-and-code", "namespace": NAMESPACE, "uid": UID, "generation": 3},
    "spec": {
        "sourceGroups": [
            {
                "name": "text",
                "sources": [
                    {"name": "web", "path": "s3://datasets/web/*.parquet", "costSecondsPerSample": 0.00025},
                    {"name": "books", "path": "s3://datasets/books/", "tokenColumn": "ids", "costSecondsPerSample": 0.0004},
                ],
                "minReplicas": 2,
                "maxReplicas": 8,
                "workersPerActor": 1,
                "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}},
            },
            {
                "name": "code",
                "sources": [{"name": "code", "path": "/mnt/datasets/code", "transform": "batchplane.loader.transforms:token_ids"}],
                "minReplicas": 1,
                "maxReplicas": 3,
                "workersPerActor": 2,
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
            },
        ],
        "mixture": {
            "schedule": {
                "kind": "staged",
                "granularity": "step",
                "stages": [
                    {"start": 0, "weights": {"web": 6, "books": 2, "code": 2}},
                    {"start": 500, "weights": {"web": 4, "books": 2, "code": 4}},
                ],
            },
            "weights": {},
        },
        "mesh": {"dp": 2, "cp": 1, "tp": 1, "pp": 1},
        "batch": {"globalBatchSize": 16, "microbatches": 2},
        "planner": {"address": "text-and-code-planner.training.svc:50051"},
        "scaling": {
            "intervalSeconds": 15,
            "windowIntervals": 3,
            "consecutiveIntervals": 4,
            "cooldownSeconds": 120,
            "leadSeconds": 120,
            "upThreshold": 0.05,
            "downThreshold": 0.15,
            "headroom": 0.2,
        },
        "loader": {
            "image": "registry.example.com/ml/batchplane:0.1.0-rc1",
            "imagePullPolicy": "Always",
            "imagePullSecrets": [{"name": "registry-credentials"}],
            "jobConfigMap": "text-and-code-job",
            "grpcPort": 50052,
            "metricsPort": 9100,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "podLabels": POD_LABELS,
            "podAnnotations": POD_ANNOTATIONS,
            # the chart's default tls.mode issued: each pod's certificate from the issuer
            "identity": dict(IDENTITY),
        },
    },
}

CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def dataplane(**changes: Any) -> dict[str, Any]:
    """A deep copy of DATAPLANE with dotted-path changes, e.g. {"spec.loader.image": "x"}."""
    obj = copy.deepcopy(DATAPLANE)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return obj


_DELETE = object()


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(
            "kubernetes-validate is missing: it is a test dependency (pyproject's dev extra); "
            "install it with `.venv/bin/pip install -c constraints.txt kubernetes-validate`",
            pytrace=False,
        )
    return kubernetes_validate


# ---- reading the DataPlane -------------------------------------------------------------------------


def test_the_charts_dataplane_is_read_as_written() -> None:
    spec = parse_dataplane(DATAPLANE)
    assert (spec.name, spec.namespace, spec.uid, spec.generation, spec.interval_s) == ("text-and-code", NAMESPACE, UID, 3, 15.0)
    assert [(g.name, g.index, g.sources, g.min_replicas, g.max_replicas, g.workers_per_actor) for g in spec.groups] == [
        ("text", 0, ("web", "books"), 2, 8, 1),
        ("code", 1, ("code",), 1, 3, 2),
    ]
    assert spec.source_names == ("web", "books", "code")
    assert spec.scaling == ScalingSettings(
        window_intervals=3, consecutive_intervals=4, up_threshold=0.05, down_threshold=0.15, cooldown_s=120.0, headroom=0.2, lead_s=120.0
    )
    text, code = (spec.group_spec(g) for g in spec.groups)
    assert text.cost_s == {"web": 0.00025, "books": 0.0004} and text.capacity == 1.0
    assert code.cost_s == {} and code.capacity == 2.0 and (code.min_replicas, code.max_replicas) == (1, 3)
    loader = spec.loader
    assert (loader.image, loader.planner_address, loader.job_config_map) == (
        "registry.example.com/ml/batchplane:0.1.0-rc1",
        "text-and-code-planner.training.svc:50051",
        "text-and-code-job",
    )
    assert (loader.grpc_port, loader.metrics_port, loader.image_pull_policy, loader.image_pull_secrets) == (
        50052,
        9100,
        "Always",
        ("registry-credentials",),
    )


def test_a_minimal_dataplane_gets_the_charts_defaults() -> None:
    obj = {
        "metadata": {"name": "mini", "namespace": "ns", "uid": "u"},
        "spec": {
            "sourceGroups": [{"name": "all", "sources": [{"name": "a", "path": "/a"}], "minReplicas": 1, "maxReplicas": 1}],
            "loader": {"image": "batchplane:0.1.0"},
        },
    }
    spec = parse_dataplane(obj)
    assert spec.loader.planner_address == "mini-planner.ns.svc:50051" and spec.loader.job_config_map == "mini-job"
    assert (spec.loader.grpc_port, spec.loader.metrics_port, spec.loader.run_as_user, spec.interval_s) == (50052, 9100, 10001, 30.0)
    assert spec.scaling == ScalingSettings() and spec.schedule is None and spec.generation == 0
    deployment = loader_deployment(spec, spec.groups[0], replicas=1)
    assert "imagePullPolicy" not in deployment["spec"]["template"]["spec"]["containers"][0]
    assert "imagePullSecrets" not in deployment["spec"]["template"]["spec"]


def test_threshold_sets_both_directions_unless_one_is_given() -> None:
    both = parse_dataplane(dataplane(**{"spec.scaling": {"threshold": 0.1}})).scaling
    assert (both.up_threshold, both.down_threshold) == (0.1, 0.1)
    one = parse_dataplane(dataplane(**{"spec.scaling": {"threshold": 0.1, "downThreshold": 0.3}})).scaling
    assert (one.up_threshold, one.down_threshold) == (0.1, 0.3)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"spec.sourceGroups.0.minReplicas": 9}, "spec.sourceGroups[0].maxReplicas"),
        ({"spec.sourceGroups.1.maxReplicas": 0}, "spec.sourceGroups[1].maxReplicas"),
        ({"spec.sourceGroups.1.minReplicas": "2"}, "spec.sourceGroups[1].minReplicas"),
        ({"spec.sourceGroups.1.name": "text"}, "spec.sourceGroups[1].name"),
        ({"spec.sourceGroups.1.name": "Code_Group"}, "spec.sourceGroups[1].name"),
        ({"spec.sourceGroups.1.sources": [{"name": "web", "path": "/w"}]}, "spec.sourceGroups[1].sources[0].name"),
        ({"spec.sourceGroups.1.sources": []}, "spec.sourceGroups[1].sources"),
        ({"spec.sourceGroups.0.sources.0.costSecondsPerSample": -1}, "spec.sourceGroups[0].sources[0].costSecondsPerSample"),
        ({"spec.sourceGroups.1.workersPerActor": 0}, "spec.sourceGroups[1].workersPerActor"),
        ({"spec.sourceGroups.1.resources": {"requests": {"cpu": None}}}, "spec.sourceGroups[1].resources.requests.cpu"),
        ({"spec.sourceGroups": []}, "spec.sourceGroups"),
        ({"spec.loader.image": ""}, "spec.loader.image"),
        ({"spec.loader.metricsPort": 50052}, "spec.loader.metricsPort"),
        ({"spec.loader.runAsUser": 0}, "spec.loader.runAsUser"),
        ({"spec.loader.imagePullPolicy": "Sometimes"}, "spec.loader.imagePullPolicy"),
        ({"spec.planner.address": "no-port"}, "spec.planner.address"),
        ({"spec.scaling.windowIntervals": 0}, "spec.scaling.windowIntervals"),
        ({"spec.scaling.downThreshold": 1.5}, "spec.scaling.downThreshold"),
        ({"spec.scaling.intervalSeconds": 0}, "spec.scaling.intervalSeconds"),
        (
            {"spec.mixture.schedule.stages": [{"start": 5, "weights": {}}, {"start": 5, "weights": {}}]},
            "spec.mixture.schedule.stages[1].start",
        ),
        ({"metadata.uid": _DELETE}, "metadata.uid"),
        ({"metadata.name": "x" * 64}, "metadata.name"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_dataplane(dataplane(**changes))
    assert info.value.field == field and str(info.value).startswith(field + ":")


def test_the_declared_schedule_reads_as_the_planner_reads_it() -> None:
    stages = {"schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {"a": 1, "b": 3}}, {"start": 100, "weights": {"a": 4}}]}}
    staged = declared_schedule(stages, ["a", "b"])
    assert staged(0) == {"a": 1, "b": 3} and staged(99.5) == {"a": 1, "b": 3}
    assert staged(100) == {"a": 4, "b": 1.0}  # a source a stage leaves out weighs 1
    anchors = {
        "schedule": {
            "kind": "curriculum",
            "anchors": [{"step": 10, "weights": {"a": 0, "b": 2}}, {"step": 20, "weights": {"a": 2, "b": 0}}],
        }
    }
    curriculum = declared_schedule(anchors, ["a", "b"])
    assert curriculum(0) == {"a": 0, "b": 2} and curriculum(15) == {"a": 1, "b": 1} and curriculum(30) == {"a": 2, "b": 0}
    for mixture in ({}, {"weights": {"a": 2}}, {"schedule": {"kind": "static"}}, {"schedule": {"kind": "callable", "callable": "m:f"}}):
        assert declared_schedule(mixture, ["a", "b"]) is None
    assert parse_dataplane(DATAPLANE).schedule(600) == {"web": 4, "books": 2, "code": 4}


# ---- the loader Deployment ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1])
def test_the_loader_deployment_follows_the_contract(index: int, tmp_path: pathlib.Path) -> None:
    spec = parse_dataplane(DATAPLANE)
    group = spec.groups[index]
    d = loader_deployment(spec, group, replicas=3)
    meta, dspec = d["metadata"], d["spec"]
    assert (d["apiVersion"], d["kind"], meta["name"], meta["namespace"]) == (
        "apps/v1",
        "Deployment",
        f"text-and-code-loader-{group.name}",
        NAMESPACE,
    )
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "batchplane.dev/v1alpha1",
            "kind": "DataPlane",
            "name": "text-and-code",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert meta["labels"] == {**POD_LABELS, LABEL_GROUP: group.name, LABEL_MANAGED_BY: MANAGER, "batchplane.dev/group-index": str(index)}
    assert meta["annotations"] == {ANNOTATION_SPEC_HASH: spec_hash(d)}
    assert dspec["replicas"] == 3
    assert dspec["selector"]["matchLabels"] == {LABEL_DATAPLANE: "text-and-code", LABEL_GROUP: group.name}
    template = dspec["template"]
    assert template["metadata"]["labels"] == meta["labels"] and template["metadata"]["annotations"] == POD_ANNOTATIONS
    assert all(template["metadata"]["labels"][k] == v for k, v in dspec["selector"]["matchLabels"].items())
    pod = template["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (c,) = pod["containers"]
    assert "command" not in c and c["image"] == "registry.example.com/ml/batchplane:0.1.0-rc1" and c["imagePullPolicy"] == "Always"
    assert c["args"] == [
        "loader", "-c", "/etc/batchplane/job.yaml", "--index", str(index), "--replica", "$(POD_NAME)",
        "--planner", "text-and-code-planner.training.svc:50051",
        "--port", "50052", "--advertise", "$(POD_IP):50052", "--metrics-port", "9100",
        "--tls-dir", "/etc/batchplane/tls", "--issuer", ISSUER,
        "--issuer-token-file", "/etc/batchplane/issuer/token", "--issuer-ca", "/etc/batchplane/issuer/ca.crt",
    ]  # fmt: skip
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env["POD_NAME"] == {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert env["HOME"]["value"] == "/tmp"
    # the kubelet expands $(POD_IP) and $(POD_NAME) from the container's env; the loader's own parser reads the rest
    expanded = [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "loader-abc") for a in c["args"][1:]]
    settings = parse_process_args("loader", expanded)
    assert (settings.index, settings.replica, settings.planner, settings.port, settings.advertise, settings.metrics_port) == (
        index, "loader-abc", "text-and-code-planner.training.svc:50051", 50052, "10.0.0.7:50052", 9100
    )  # fmt: skip
    assert (
        c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["python", "-c"]
        and "SIGUSR1" in c["lifecycle"]["preStop"]["exec"]["command"][2]
    )
    assert pod["terminationGracePeriodSeconds"] > 300, "longer than a leaving loader's drain"
    assert settings.config == pathlib.Path("/etc/batchplane/job.yaml") and settings.listen is None
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50052, "metrics": 9100}
    assert POD_ANNOTATIONS["prometheus.io/port"] == str(settings.metrics_port)
    # kubelet's gRPC probe speaks plaintext: /healthz on the metrics port answers for grpc.health.v1
    assert all(
        c[probe]["httpGet"] == {"path": "/healthz", "port": settings.metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    )
    assert (settings.tls_dir, settings.issuer, settings.auth_tokens, settings.token_file) == (
        pathlib.Path("/etc/batchplane/tls"),
        ISSUER,
        None,
        None,
    )
    assert c["resources"] == DATAPLANE["spec"]["sourceGroups"][index]["resources"]
    assert c["securityContext"] == CONTAINER_SECURITY
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/batchplane"]]["configMap"] == {"name": "text-and-code-job"}
    assert volumes[mounts["/tmp"]]["emptyDir"] == {}
    assert volumes[mounts["/etc/batchplane/tls"]]["emptyDir"]["medium"] == "Memory"
    assert not any("secret" in v for v in volumes.values()), "no Secret in a loader pod"
    # the pod name (Deployment name + ReplicaSet hash + pod suffix) fits
    assert len(meta["name"]) + len("-0123456789-abcde") <= 253


@pytest.mark.parametrize("kube_version", ["1.30.0", "latest"])
def test_the_loader_deployment_validates_strictly(kube_version: str, kubernetes_validate: Any) -> None:
    version = kubernetes_validate.latest_version() if kube_version == "latest" else kube_version
    spec = parse_dataplane(DATAPLANE)
    for group in spec.groups:
        d = loader_deployment(spec, group, replicas=group.min_replicas)
        kubernetes_validate.validate(d, version, strict=True)
    minimal = parse_dataplane(dataplane(**{"spec.loader": {"image": "batchplane:0.1.0"}, "spec.sourceGroups.0.resources": {}}))
    kubernetes_validate.validate(loader_deployment(minimal, minimal.groups[0], replicas=1), version, strict=True)
    typo = loader_deployment(spec, spec.groups[0], replicas=1)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)


def test_the_spec_hash_follows_everything_but_the_replicas() -> None:
    spec = parse_dataplane(DATAPLANE)
    base = loader_deployment(spec, spec.groups[0], replicas=2)
    assert loader_deployment(spec, spec.groups[0], replicas=7)["metadata"]["annotations"] == base["metadata"]["annotations"]
    assert spec_hash(base) == spec_hash(copy.deepcopy(base))
    for change in (
        {"spec.loader.image": "batchplane:0.2.0"},
        {"spec.sourceGroups.0.resources": {"limits": {"cpu": "8"}}},
        {"spec.planner.address": "elsewhere:50051"},
        {"spec.loader.podAnnotations": {**POD_ANNOTATIONS, "checksum/job-config": "other"}},
        {"metadata.uid": "another-uid"},
    ):
        other = parse_dataplane(dataplane(**change))
        assert spec_hash(loader_deployment(other, other.groups[0], replicas=2)) != spec_hash(base), change


# ---- the loader pod fields (batchplane.operator.podfields) ---------------------------------------

#: spec.loader's pod fields, every one set: a loader that reads a bucket with IRSA-style
#: credentials and a dataset claim, placed on a tainted CPU pool and spread over zones.
POD_FIELDS: dict[str, Any] = {
    "env": [
        {"name": "AWS_REGION", "value": "eu-west-1"},
        {"name": "AWS_ENDPOINT_URL_S3", "valueFrom": {"configMapKeyRef": {"name": "bucket-endpoint", "key": "url"}}},
    ],
    "envFrom": [{"secretRef": {"name": "bucket-credentials"}}],
    "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
        {"name": "cache", "emptyDir": {"sizeLimit": "2Gi"}},
    ],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}, {"name": "cache", "mountPath": "/var/cache/batchplane"}],
    "serviceAccountName": "dataset-reader",
    "automountServiceAccountToken": True,
    "nodeSelector": {"node-pool": "cpu-highmem"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "data-loading", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-west-1a"]}]}
                ]
            }
        }
    },
    "priorityClassName": "batch-high",
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "loader"}},
            "matchLabelKeys": ["batchplane.dev/group"],
        }
    ],
}


def with_pod_fields(**overrides: Any) -> dict[str, Any]:
    return dataplane(**{"spec.loader": {**DATAPLANE["spec"]["loader"], **POD_FIELDS, **overrides}})


def test_the_deployment_carries_every_pod_field() -> None:
    spec = parse_dataplane(with_pod_fields())
    base = loader_deployment(parse_dataplane(DATAPLANE), spec.groups[0], replicas=2)["spec"]["template"]["spec"]
    pod = loader_deployment(spec, spec.groups[0], replicas=2)["spec"]["template"]["spec"]
    (c,), (c0,) = pod["containers"], base["containers"]
    # appended after the operator's own, which stay first and unchanged
    assert c["env"] == c0["env"] + POD_FIELDS["env"]
    assert c["envFrom"] == POD_FIELDS["envFrom"] and "envFrom" not in c0
    assert c["volumeMounts"] == c0["volumeMounts"] + POD_FIELDS["volumeMounts"]
    assert pod["volumes"] == base["volumes"] + POD_FIELDS["volumes"]
    for field in ("serviceAccountName", "nodeSelector", "tolerations", "affinity", "priorityClassName", "topologySpreadConstraints"):
        assert pod[field] == POD_FIELDS[field], field
        assert field not in base, field
    assert pod["automountServiceAccountToken"] is True and base["automountServiceAccountToken"] is False
    # the contract's other parts are untouched
    assert c["args"] == c0["args"] and c["securityContext"] == c0["securityContext"] and pod["securityContext"] == base["securityContext"]
    # the DataPlane's objects are copied, not shared
    pod["affinity"]["nodeAffinity"] = None
    assert spec.loader.pod.affinity["nodeAffinity"] is not None


def test_a_service_account_alone_mounts_no_api_token() -> None:
    """IRSA, EKS Pod Identity and Azure Workload Identity inject their own audience-bound token
    and GKE Workload Identity needs none: naming a ServiceAccount does not mount the API token."""
    spec = parse_dataplane(with_pod_fields(automountServiceAccountToken=None))  # null: not set
    pod = loader_deployment(spec, spec.groups[0], replicas=1)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "dataset-reader" and pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("kube_version", ["1.30.0", "latest"])
def test_a_deployment_with_every_pod_field_validates_strictly(kube_version: str, kubernetes_validate: Any) -> None:
    version = kubernetes_validate.latest_version() if kube_version == "latest" else kube_version
    spec = parse_dataplane(with_pod_fields())
    for group in spec.groups:
        kubernetes_validate.validate(loader_deployment(spec, group, replicas=1), version, strict=True)


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.loader.volumes[0].name", "is used by batchplane"),
        (
            {"volumes": [{"name": "batchplane-job", "emptyDir": {}}], "volumeMounts": []},
            "spec.loader.volumes[0].name",
            "is used by batchplane",
        ),
        (
            {"volumeMounts": [{"name": "batchplane-job", "mountPath": "/config"}]},
            "spec.loader.volumeMounts[0].name",
            "is used by batchplane",
        ),
        (
            {"volumeMounts": [{"name": "data", "mountPath": "/etc/batchplane"}]},
            "spec.loader.volumeMounts[0].mountPath",
            "is used by batchplane",
        ),
        ({"volumeMounts": [{"name": "cache", "mountPath": "/tmp"}]}, "spec.loader.volumeMounts[0].mountPath", "is used by batchplane"),
        ({"env": [{"name": "POD_NAME", "value": "x"}]}, "spec.loader.env[0].name", "is set by batchplane"),
        (
            {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"nam": "s"}}}]},
            "spec.loader.env[0].valueFrom.secretKeyRef.nam",
            "unknown field",
        ),
        ({"tolerations": [{"key": "k", "efect": "NoSchedule"}]}, "spec.loader.tolerations[0].efect", "unknown field"),
        ({"affinity": {"nodeAfinity": {}}}, "spec.loader.affinity.nodeAfinity", "unknown field"),
        (
            {"topologySpreadConstraints": [{"maxSkew": "1", "topologyKey": "z", "whenUnsatisfiable": "DoNotSchedule"}]},
            "spec.loader.topologySpreadConstraints[0].maxSkew",
            "must be an integer",
        ),
        ({"serviceAccountName": "Not A Name"}, "spec.loader.serviceAccountName", "DNS subdomain"),
        ({"nodeSelector": ["pool"]}, "spec.loader.nodeSelector", "must be a mapping"),
    ],
)
def test_a_bad_pod_field_is_refused_naming_the_field(overrides: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_dataplane(with_pod_fields(**overrides))
    assert info.value.field == field and words in info.value.problem and str(info.value).startswith(field + ":"), str(info.value)


def test_the_spec_hash_follows_the_pod_fields() -> None:
    spec = parse_dataplane(with_pod_fields())
    base = spec_hash(loader_deployment(spec, spec.groups[0], replicas=1))
    for field, value in (
        ("nodeSelector", {"node-pool": "other"}),
        ("serviceAccountName", "someone-else"),
        ("env", POD_FIELDS["env"][:1]),
        ("tolerations", []),
        ("automountServiceAccountToken", False),
    ):
        other = parse_dataplane(with_pod_fields(**{field: value}))
        assert spec_hash(loader_deployment(other, other.groups[0], replicas=1)) != base, field


def test_an_update_leaves_exactly_the_pod_fields_the_dataplane_sets() -> None:
    """Merge patches merge maps and keep fields they do not name: the update of a Deployment
    whose DataPlane dropped or changed pod fields removes what it dropped, also inside maps."""
    from batchplane.operator.reconcile import update_patch

    live = loader_deployment(parse_dataplane(with_pod_fields()), parse_dataplane(DATAPLANE).groups[0], replicas=3)
    live["spec"]["template"]["spec"]["serviceAccount"] = "dataset-reader"  # the API's deprecated alias, as it returns it
    changed = parse_dataplane(
        with_pod_fields(
            nodeSelector={"other-pool": "yes"},
            affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            serviceAccountName=None,
            tolerations=None,
            priorityClassName=None,
            topologySpreadConstraints=None,
        )
    )
    desired = loader_deployment(changed, changed.groups[0], replicas=3)
    patch = update_patch(desired, live)
    pod = patch["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node-pool": None, "other-pool": "yes"}
    assert pod["affinity"] == {"nodeAffinity": None, "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    for gone in ("serviceAccountName", "serviceAccount", "tolerations", "priorityClassName", "topologySpreadConstraints"):
        assert pod[gone] is None, gone
    assert "replicas" not in patch["spec"]
    assert merge_patch(live, patch)["spec"]["template"]["spec"] == desired["spec"]["template"]["spec"]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# ---- transport security of the loader pods ---------------------------------------------------------


def secret_mounts(d: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mount path -> (mount, Secret volume source) of the loader container's Secret mounts."""
    pod = d["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (c,) = pod["containers"]
    return {m["mountPath"]: (m, volumes[m["name"]]["secret"]) for m in c["volumeMounts"] if "secret" in volumes[m["name"]]}


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "neither"])
def test_without_an_identity_loader_pods_mount_only_the_tokens_secret_the_dataplane_names(tokens: bool) -> None:
    """Without spec.loader.identity (the chart's tls.mode disabled) no TLS flag; spec.loader.authTokens
    gives --auth-tokens on the whole tokens Secret and --token-file on its `loader` key, the Secret
    mounted whole as a read-only directory (never subPath, which never sees a renewed file),
    readable by root and the pod's fsGroup only. Neither: no flag, no Secret."""
    changes: dict[str, Any] = {"spec.loader.identity": _DELETE}
    if tokens:
        changes["spec.loader.authTokens"] = {"secretName": TOKENS_SECRET}
    spec = parse_dataplane(dataplane(**changes))
    d = loader_deployment(spec, spec.groups[0], replicas=1)
    (c,) = d["spec"]["template"]["spec"]["containers"]
    settings = parse_process_args("loader", [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "p") for a in c["args"][1:]])
    mounts = secret_mounts(d)
    for mount, source in mounts.values():
        assert "subPath" not in mount and "subPathExpr" not in mount and mount["readOnly"] is True
        assert "items" not in source and source["defaultMode"] == 0o440
    assert settings.tls_dir is None and "--tls-dir" not in c["args"] and settings.issuer is None
    expected = {}
    if tokens:
        assert settings.token_file == settings.auth_tokens / "loader"  # its own key of the Secret it serves with
        expected[str(settings.auth_tokens)] = TOKENS_SECRET
    else:
        assert settings.auth_tokens is None and settings.token_file is None
    assert {path: source["secretName"] for path, (_, source) in mounts.items()} == expected
    assert spec.loader.auth_tokens_secret == (TOKENS_SECRET if tokens else None)


def test_a_certificate_secret_shared_by_every_loader_is_refused_naming_identity() -> None:
    """spec.loader.tls (one certificate Secret every loader pod mounted, as the chart's retired
    tls.mode generated made) lets any loader pod act for every replica: refused, naming
    spec.loader.identity, with or without an identity beside it."""
    for changes in (
        {"spec.loader.tls": {"secretName": "text-and-code-loader-tls"}},
        {"spec.loader.tls": {"secretName": "x"}, "spec.loader.identity": _DELETE},
    ):
        with pytest.raises(SpecError) as info:
            parse_dataplane(dataplane(**changes))
        assert info.value.field == "spec.loader.tls" and "spec.loader.identity" in info.value.problem, str(info.value)


@pytest.mark.parametrize("kube_version", ["1.30.0", "latest"])
def test_a_loader_with_its_secrets_and_every_pod_field_validates_strictly(kube_version: str, kubernetes_validate: Any) -> None:
    version = kubernetes_validate.latest_version() if kube_version == "latest" else kube_version
    with_tokens = with_pod_fields(authTokens={"secretName": TOKENS_SECRET})
    del with_tokens["spec"]["loader"]["identity"]
    for obj in (with_pod_fields(), with_tokens):
        spec = parse_dataplane(obj)
        d = loader_deployment(spec, spec.groups[0], replicas=1)
        assert set(secret_mounts(d)) == (set() if spec.loader.identity else {"/etc/batchplane/auth-tokens"})
        kubernetes_validate.validate(d, version, strict=True)


def test_the_spec_hash_follows_the_secrets() -> None:
    """A DataPlane that names other Secrets (or none) rolls its loader Deployments."""
    base = spec_hash(loader_deployment(parse_dataplane(DATAPLANE), parse_dataplane(DATAPLANE).groups[0], replicas=1))
    for change in (
        {"spec.loader.identity": _DELETE},
        {"spec.loader.authTokens": {"secretName": "tokens"}},
        {"spec.loader.identity": _DELETE, "spec.loader.authTokens": {"secretName": "other-tokens"}},
    ):
        other = parse_dataplane(dataplane(**change))
        assert spec_hash(loader_deployment(other, other.groups[0], replicas=1)) != base, change


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"spec.loader.authTokens": {"secretName": "Not_A_Secret"}}, "spec.loader.authTokens.secretName"),
        ({"spec.loader.authTokens": {}}, "spec.loader.authTokens.secretName"),
        ({"spec.loader.authTokens": "text-and-code-auth-tokens"}, "spec.loader.authTokens"),
        ({"spec.loader.authTokens": {"secretName": "x", "subPath": "loader"}}, "spec.loader.authTokens.subPath"),
        ({"spec.loader.authTokens": {"secretName": 7}}, "spec.loader.authTokens.secretName"),
    ],
)
def test_a_bad_secret_is_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_dataplane(dataplane(**changes))
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize("name", ["batchplane-tls", "batchplane-auth-tokens"])
def test_a_user_volume_may_not_take_the_secrets_names(name: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_dataplane(with_pod_fields(volumes=[{"name": name, "emptyDir": {}}], volumeMounts=[]))
    assert info.value.field == "spec.loader.volumes[0].name" and "is used by batchplane" in info.value.problem


def test_a_loader_pod_holds_its_own_token_and_the_verifiers_only_when_the_secret_has_them() -> None:
    """Issue 41, point 2: with spec.loader.authTokens.verifiers the Secret also holds each role's
    `<role>.sha256`; the loader pod then mounts its own token and the verifiers, no other role's
    token (its server accepts tokens by their digests). A value that is no boolean is refused."""
    spec = parse_dataplane(dataplane(**{"spec.loader.authTokens": {"secretName": TOKENS_SECRET, "verifiers": True}}))
    d = loader_deployment(spec, spec.groups[0], replicas=1)
    (c,) = d["spec"]["template"]["spec"]["containers"]
    settings = parse_process_args("loader", [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "p") for a in c["args"][1:]])
    mount, source = secret_mounts(d)[str(settings.auth_tokens)]
    keys = ["loader", "planner.sha256", "loader.sha256", "constructor.sha256", "operator.sha256"]
    assert source["items"] == [{"key": k, "path": k} for k in keys] and source["secretName"] == TOKENS_SECRET
    assert settings.token_file == settings.auth_tokens / "loader" and mount["readOnly"] is True
    for other in ("planner", "constructor", "operator"):
        assert other not in {item["key"] for item in source["items"]}, "another role's token"
    with pytest.raises(SpecError) as info:
        parse_dataplane(dataplane(**{"spec.loader.authTokens": {"secretName": TOKENS_SECRET, "verifiers": "yes"}}))
    assert info.value.field == "spec.loader.authTokens.verifiers"


# ---- loader pods with an identity from the issuer (tls.mode issued) ----------------------------------


@pytest.mark.parametrize("index", [0, 1])
def test_loader_pods_with_an_identity_ask_the_issuer(index: int) -> None:
    """spec.loader.identity: each loader pod writes the certificate it is issued into an in-memory
    emptyDir of its own (--tls-dir, writable), proves who it is with its projected ServiceAccount
    token for the identity's audience and verifies the issuer by the CA ConfigMap's certificate
    (read-only, no Secret at all), and carries the label naming its group's index, from which
    the issuer names it batchplane://loader/<index>/<pod>."""
    spec = parse_dataplane(dataplane())
    assert spec.loader.identity is not None
    d = loader_deployment(spec, spec.groups[index], replicas=1)
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    settings = parse_process_args("loader", [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "p") for a in c["args"][1:]])
    assert (settings.tls_dir, settings.issuer, settings.issuer_token_file, settings.issuer_ca) == (
        pathlib.Path("/etc/batchplane/tls"), ISSUER, pathlib.Path("/etc/batchplane/issuer/token"), pathlib.Path("/etc/batchplane/issuer/ca.crt")
    )  # fmt: skip
    assert settings.auth_tokens is None and settings.token_file is None
    assert secret_mounts(d) == {}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/batchplane/tls"] == {"name": "batchplane-tls", "mountPath": "/etc/batchplane/tls"}  # the loader writes there
    assert volumes["batchplane-tls"] == {"name": "batchplane-tls", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    assert mounts["/etc/batchplane/issuer"] == {"name": "batchplane-issuer", "mountPath": "/etc/batchplane/issuer", "readOnly": True}
    assert volumes["batchplane-issuer"]["projected"] == {
        "defaultMode": 0o440,
        "sources": [
            {"serviceAccountToken": {"audience": "batchplane", "expirationSeconds": 3600, "path": settings.issuer_token_file.name}},
            {"configMap": {"name": "text-and-code-ca", "items": [{"key": "ca.crt", "path": settings.issuer_ca.name}]}},
        ],
    }
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert labels["batchplane.dev/group-index"] == str(index) == c["args"][c["args"].index("--index") + 1]
    assert d["spec"]["selector"]["matchLabels"] == {LABEL_DATAPLANE: "text-and-code", LABEL_GROUP: spec.groups[index].name}
    # a DataPlane without an identity: no such label, no issuer flags
    plain = parse_dataplane(dataplane(**{"spec.loader.identity": _DELETE}))
    plain_pod = loader_deployment(plain, plain.groups[index], replicas=1)["spec"]["template"]
    assert (
        "batchplane.dev/group-index" not in plain_pod["metadata"]["labels"] and "--issuer" not in plain_pod["spec"]["containers"][0]["args"]
    )


def test_a_ca_secret_projects_its_ca_crt_alone(kubernetes_validate: Any) -> None:
    """spec.loader.identity.caSecret (the chart's tls.mode certManager: the Secret cert-manager
    writes for the operator's CA, its tls.key included): the pod's issuer volume projects the
    key ca.crt of it and nothing else, so the pod never holds the CA's key; no Secret volume."""
    spec = parse_dataplane(dataplane(**{"spec.loader.identity": {"issuer": ISSUER, "caSecret": "text-and-code-issuer-ca"}}))
    assert (spec.loader.identity.ca_secret, spec.loader.identity.ca_config_map) == ("text-and-code-issuer-ca", None)
    d = loader_deployment(spec, spec.groups[0], replicas=1)
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    settings = parse_process_args("loader", [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "p") for a in c["args"][1:]])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["batchplane-issuer"]["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": "batchplane", "expirationSeconds": 3600, "path": settings.issuer_token_file.name}},
        {"secret": {"name": "text-and-code-issuer-ca", "items": [{"key": "ca.crt", "path": settings.issuer_ca.name}]}},
    ]
    assert secret_mounts(d) == {} and settings.issuer == ISSUER
    kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)


def test_an_identity_gets_the_charts_defaults() -> None:
    spec = parse_dataplane(dataplane(**{"spec.loader.identity": {"issuer": ISSUER, "caConfigMap": "ca"}}))
    assert (spec.loader.identity.audience, spec.loader.identity.token_expiration_s) == ("batchplane", 3600)


@pytest.mark.parametrize("kube_version", ["1.30.0", "latest"])
def test_a_loader_with_an_identity_and_every_pod_field_validates_strictly(kube_version: str, kubernetes_validate: Any) -> None:
    version = kubernetes_validate.latest_version() if kube_version == "latest" else kube_version
    obj = with_pod_fields()
    obj["spec"]["loader"]["identity"] = dict(IDENTITY, audience="batchplane.example.com", tokenExpirationSeconds=600)
    spec = parse_dataplane(obj)
    d = loader_deployment(spec, spec.groups[1], replicas=1)
    assert d["spec"]["template"]["spec"]["serviceAccountName"] == obj["spec"]["loader"]["serviceAccountName"]
    kubernetes_validate.validate(d, version, strict=True)


def test_the_spec_hash_follows_the_identity() -> None:
    base = parse_dataplane(dataplane())
    digest = spec_hash(loader_deployment(base, base.groups[0], replicas=1))
    for change in (
        {"spec.loader.identity.issuer": "elsewhere:8443"},
        {"spec.loader.identity.caConfigMap": "other-ca"},
        {"spec.loader.identity.caConfigMap": _DELETE, "spec.loader.identity.caSecret": IDENTITY["caConfigMap"]},
        {"spec.loader.identity.audience": "other"},
        {"spec.loader.identity.tokenExpirationSeconds": 7200},
    ):
        other = parse_dataplane(dataplane(**change))
        assert spec_hash(loader_deployment(other, other.groups[0], replicas=1)) != digest, change
    without = parse_dataplane(dataplane(**{"spec.loader.identity": _DELETE}))
    assert spec_hash(loader_deployment(without, without.groups[0], replicas=1)) != digest


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"spec.loader.identity": "text-and-code-operator:8443"}, "spec.loader.identity"),
        ({"spec.loader.identity.issuer": "no-port"}, "spec.loader.identity.issuer"),
        ({"spec.loader.identity.issuer": _DELETE}, "spec.loader.identity.issuer"),
        ({"spec.loader.identity.caConfigMap": "Not_A_ConfigMap"}, "spec.loader.identity.caConfigMap"),
        ({"spec.loader.identity.caConfigMap": _DELETE}, "spec.loader.identity.caConfigMap"),  # one of them is required
        ({"spec.loader.identity.caSecret": "text-and-code-issuer-ca"}, "spec.loader.identity.caSecret"),  # not both
        ({"spec.loader.identity.caConfigMap": _DELETE, "spec.loader.identity.caSecret": "Not_A_Secret"}, "spec.loader.identity.caSecret"),
        ({"spec.loader.identity.caConfigMap": _DELETE, "spec.loader.identity.caSecret": None}, "spec.loader.identity.caSecret"),
        ({"spec.loader.identity.audience": ""}, "spec.loader.identity.audience"),
        ({"spec.loader.identity.tokenExpirationSeconds": 599}, "spec.loader.identity.tokenExpirationSeconds"),
        ({"spec.loader.identity.tokenExpirationSeconds": "3600"}, "spec.loader.identity.tokenExpirationSeconds"),
        ({"spec.loader.identity.tokenExpirationSeconds": True}, "spec.loader.identity.tokenExpirationSeconds"),
        ({"spec.loader.identity.secretName": "x"}, "spec.loader.identity.secretName"),
    ],
)
def test_a_bad_identity_is_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_dataplane(dataplane(**changes))
    assert info.value.field == field and str(info.value).startswith(field + ":"), str(info.value)


def test_a_user_volume_may_not_take_the_issuers_name() -> None:
    with pytest.raises(SpecError) as info:
        parse_dataplane(with_pod_fields(volumes=[{"name": "batchplane-issuer", "emptyDir": {}}], volumeMounts=[]))
    assert info.value.field == "spec.loader.volumes[0].name" and "batchplane-issuer" in info.value.problem
