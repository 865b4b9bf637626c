"""The one description of the pod fields a DataPlane's spec.loader and the chart's values may set
(batchplane.operator.podfields) and what is generated from it: the committed CRD, values.schema.json
and kube_types.py must be what deploy/helm/sync_schemas.py makes of it today (regenerate with
`.venv/bin/python deploy/helm/sync_schemas.py`); the operator's strict validation agrees with
kubernetes-validate's; values.yaml documents every field."""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Any

import pytest
import yaml

from batchplane.core.errors import ConfigError
from batchplane.operator import kube_types, podfields
from batchplane.operator.podfields import LOADER_FIELDS, PLANNER_FIELDS, parse_pod_options, validate_kube

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "batchplane"


def sync_schemas() -> Any:
    spec = importlib.util.spec_from_file_location("sync_schemas", ROOT / "deploy" / "helm" / "sync_schemas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: .venv/bin/pip install -c constraints.txt kubernetes-validate", pytrace=False)
    return kubernetes_validate


def test_the_committed_files_are_what_the_definition_generates(kubernetes_validate: Any) -> None:
    sync = sync_schemas()
    assert kube_types.KUBERNETES_VERSION == kubernetes_validate.latest_version()  # the newest Kubernetes it knows
    for path, text in sync.outputs().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is out of date: run .venv/bin/python deploy/helm/sync_schemas.py"
    # and the check notices a drift
    crd = (CHART / "crds" / "dataplanes.batchplane.dev.yaml").read_text()
    drifted = crd.replace("description: Taints the pods tolerate.", "description: Taints.")
    assert sync.render_crd(drifted) == crd != drifted


def test_crd_values_schema_and_parser_name_the_same_fields() -> None:
    crd = yaml.safe_load((CHART / "crds" / "dataplanes.batchplane.dev.yaml").read_text())
    loader = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["loader"]["properties"]
    values_schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    names = [f.name for f in LOADER_FIELDS]
    assert names == [
        "env", "envFrom", "volumes", "volumeMounts", "serviceAccountName", "automountServiceAccountToken",
        "nodeSelector", "tolerations", "affinity", "priorityClassName", "topologySpreadConstraints",
    ]  # fmt: skip
    assert set(names) <= set(loader) and set(names) <= set(values_schema["properties"]["loader"]["properties"])
    assert {f.name for f in PLANNER_FIELDS} == {"env", "envFrom", "serviceAccountName", "automountServiceAccountToken"}
    assert {f.name for f in PLANNER_FIELDS} <= set(values_schema["properties"]["planner"]["properties"])
    for f in LOADER_FIELDS:
        if f.kube_type:
            assert f.kube_type in kube_types.DEFINITIONS
            assert values_schema["definitions"][f.kube_type] is not None
            # the CRD keeps Kubernetes objects as they are; the operator checks them
            node = loader[f.name]["items"] if f.shape == "list" else loader[f.name]
            assert node.get("x-kubernetes-preserve-unknown-fields") is True, f.name
    for name in podfields._ATTRIBUTES:  # every field maps to an attribute of PodOptions
        assert podfields._ATTRIBUTES[name] in {a.name for a in podfields.dataclasses.fields(podfields.PodOptions)}


def test_values_yaml_documents_every_pod_field_with_an_empty_default() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    for section, fields in (("loader", LOADER_FIELDS), ("planner", PLANNER_FIELDS)):
        for f in fields:
            assert f.name in values[section], f"values.yaml {section}.{f.name}"
            assert not values[section][f.name], f"{section}.{f.name} must default to empty/false"
            block = text.split(f"\n{section}:\n", 1)[1]
            assert re.search(rf"  # -- [^\n]*(\n  #[^\n]*)*\n  {f.name}:", block), f"{section}.{f.name} has no `# --` comment"


# ---- strict validation -----------------------------------------------------------------------------

ALL_FIELDS = {
    "env": [
        {"name": "AWS_REGION", "value": "eu-west-1"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token", "optional": True}}},
        {"name": "LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
    ],
    "envFrom": [{"secretRef": {"name": "bucket"}}, {"prefix": "X_", "configMapRef": {"name": "cm"}}],
    "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
        {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}},
        {
            "name": "creds",
            "projected": {
                "sources": [{"serviceAccountToken": {"audience": "sts.amazonaws.com", "path": "token", "expirationSeconds": 3600}}]
            },
        },
    ],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}, {"name": "cache", "mountPath": "/tmp/cache"}],
    "serviceAccountName": "reader",
    "automountServiceAccountToken": True,
    "nodeSelector": {"node-pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "data", "effect": "NoSchedule", "tolerationSeconds": 30}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }
        }
    },
    "priorityClassName": "high",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"a": "b"}}}
    ],
}


def test_every_field_is_read() -> None:
    options = parse_pod_options(ALL_FIELDS, at="spec.loader")
    assert [e["name"] for e in options.env] == ["AWS_REGION", "TOKEN", "LIMIT"]
    assert options.service_account_name == "reader" and options.automount_service_account_token is True
    pod = options.pod_fields()
    assert set(pod) == {
        "automountServiceAccountToken", "volumes", "serviceAccountName", "nodeSelector", "tolerations", "affinity",
        "priorityClassName", "topologySpreadConstraints",
    }  # fmt: skip
    assert options.container_fields()["volumeMounts"] == ALL_FIELDS["volumeMounts"]
    assert parse_pod_options({}, at="spec.loader").pod_fields() == {"automountServiceAccountToken": False}


BAD = [
    # (field changes, the path named, a piece of the message)
    (
        {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"nmae": "s", "key": "k"}}}]},
        "spec.loader.env[0].valueFrom.secretKeyRef.nmae",
        "unknown field (known: key, name, optional)",
    ),
    ({"env": [{"name": "A", "value": 3}]}, "spec.loader.env[0].value", "must be a string"),
    ({"env": [{"value": "x"}]}, "spec.loader.env[0].name", "is required"),
    ({"env": {"name": "A"}}, "spec.loader.env", "must be a list of EnvVar"),
    ({"envFrom": [{"secretReff": {"name": "s"}}]}, "spec.loader.envFrom[0].secretReff", "unknown field"),
    (
        {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "c", "readonly": True}}]},
        "spec.loader.volumes[0].persistentVolumeClaim.readonly",
        "unknown field",
    ),
    (
        {"volumes": [{"name": "d", "emptyDir": {"sizeLimit": ["1Gi"]}}]},
        "spec.loader.volumes[0].emptyDir.sizeLimit",
        "must be a string or a number",
    ),
    ({"volumes": [{"name": "d"}]}, "spec.loader.volumes[0]", "exactly one volume source"),
    ({"volumes": [{"name": "d", "emptyDir": {}, "secret": {"secretName": "s"}}]}, "spec.loader.volumes[0]", "exactly one volume source"),
    ({"tolerations": [{"key": "k", "effect": "NoSchedule", "seconds": 3}]}, "spec.loader.tolerations[0].seconds", "unknown field"),
    ({"tolerations": [{"key": "k", "tolerationSeconds": "30"}]}, "spec.loader.tolerations[0].tolerationSeconds", "must be an integer"),
    ({"affinity": {"nodeAffinity": {"required": {}}}}, "spec.loader.affinity.nodeAffinity.required", "unknown field"),
    ({"affinity": ["zone-a"]}, "spec.loader.affinity", "must be a mapping"),
    (
        {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]},
        "spec.loader.topologySpreadConstraints[0].whenUnsatisfiable",
        "is required",
    ),
    ({"nodeSelector": {"pool": 1}}, "spec.loader.nodeSelector.pool", "label value"),
    ({"serviceAccountName": "Reader_1"}, "spec.loader.serviceAccountName", "DNS subdomain"),
    ({"priorityClassName": 5}, "spec.loader.priorityClassName", "must be a string"),
    ({"automountServiceAccountToken": "yes"}, "spec.loader.automountServiceAccountToken", "must be true or false"),
]


@pytest.mark.parametrize(("raw", "field", "words"), BAD, ids=[f for _, f, _ in BAD])
def test_a_malformed_kubernetes_object_is_refused_naming_its_path(raw: dict, field: str, words: str, kubernetes_validate: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pod_options(raw, at="spec.loader")
    assert info.value.field == field and words in info.value.problem, str(info.value)


@pytest.mark.parametrize("version", ["1.30.0", "latest"])
def test_the_validator_agrees_with_kubernetes_validate(version: str, kubernetes_validate: Any) -> None:
    """What the operator accepts, kubernetes-validate accepts in a Pod, strictly, for 1.30 and the
    newest Kubernetes; what it refuses as unknown or mistyped, kubernetes-validate refuses too."""
    version = kubernetes_validate.latest_version() if version == "latest" else version

    def pod(fields: dict) -> dict:
        container = {"name": "c", "image": "i", **{k: fields[k] for k in ("env", "envFrom", "volumeMounts") if k in fields}}
        spec = {"containers": [container], **{k: v for k, v in fields.items() if k not in ("env", "envFrom", "volumeMounts")}}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}

    parse_pod_options(ALL_FIELDS, at="spec.loader")
    kubernetes_validate.validate(pod(ALL_FIELDS), version, strict=True)
    for raw, _, words in BAD:
        if "unknown field" in words or words.startswith("must be a") and "volume source" not in words:
            fields = (
                {**ALL_FIELDS, **raw} if "volumeMounts" not in raw and "volumes" not in raw else {**ALL_FIELDS, **raw, "volumeMounts": []}
            )
            with pytest.raises(kubernetes_validate.ValidationError):
                kubernetes_validate.validate(pod(fields), version, strict=True)


CLASHES = [
    ({"env": [{"name": "POD_IP", "value": "1.2.3.4"}]}, "spec.loader.env[0].name", "is set by batchplane"),
    ({"env": [{"name": "HOME", "value": "/home"}]}, "spec.loader.env[0].name", "is set by batchplane"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "spec.loader.env[1].name", "is listed twice"),
    ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.loader.volumes[0].name", "is used by batchplane"),
    ({"volumes": [{"name": "batchplane-job", "configMap": {"name": "mine"}}]}, "spec.loader.volumes[0].name", "is used by batchplane"),
    ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}, "spec.loader.volumes[1].name", "is listed twice"),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "tmp", "mountPath": "/scratch"}]},
        "spec.loader.volumeMounts[0].name",
        "is used by batchplane",
    ),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "b", "mountPath": "/b"}]},
        "spec.loader.volumeMounts[0].name",
        "names no volume of spec.loader.volumes",
    ),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/etc/batchplane"}]},
        "spec.loader.volumeMounts[0].mountPath",
        "is used by batchplane",
    ),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/etc/batchplane/extra/"}]},
        "spec.loader.volumeMounts[0].mountPath",
        "is used by batchplane",
    ),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "//tmp/"}]},
        "spec.loader.volumeMounts[0].mountPath",
        "is used by batchplane",
    ),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/x"}, {"name": "a", "mountPath": "/x/"}]},
        "spec.loader.volumeMounts[1].mountPath",
        "is mounted twice",
    ),
    (
        {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "data"}]},
        "spec.loader.volumeMounts[0].mountPath",
        "absolute path",
    ),
]


@pytest.mark.parametrize(("raw", "field", "words"), CLASHES, ids=[f"{f}-{w}" for _, f, w in CLASHES])
def test_what_batchplane_owns_is_refused_naming_the_field(raw: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pod_options(raw, at="spec.loader")
    assert info.value.field == field and words in info.value.problem, str(info.value)


def test_mounts_beside_batchplanes_own_are_fine() -> None:
    raw = {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/etc/batchplane-extra"}]}
    assert parse_pod_options(raw, at="spec.loader").volume_mounts[0]["mountPath"] == "/etc/batchplane-extra"


def test_validate_kube_knows_its_definitions() -> None:
    validate_kube({"key": "k", "operator": "Exists"}, "io.k8s.api.core.v1.Toleration", "x")
    with pytest.raises(KeyError, match="no Kubernetes definition"):
        validate_kube({}, "io.k8s.api.core.v1.Pod", "x")
