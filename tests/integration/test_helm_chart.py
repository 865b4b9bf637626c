"""The Helm chart deploy/helm/batchplane, checked offline with a real helm 3 binary.

For the default values and each file in the chart's ci/ folder: `helm lint --strict`, `helm
template` (CRD included), and every rendered manifest validated with kubernetes-validate in
strict mode (unknown fields are errors) against Kubernetes 1.30 and the newest version it knows.

kubernetes-validate knows only built-in kinds, so the custom kinds are checked otherwise, and
this file says how:
- DataPlane (batchplane.dev/v1alpha1): against the openAPIV3Schema of the chart's own CRD, turned
  into a JSON schema that, like the API server's strict field validation, rejects unknown fields.
  The CRD's CEL rule (maxReplicas >= minReplicas) is checked in Python.
- ServiceMonitor (monitoring.coreos.com/v1): no CRD of the prometheus-operator is available
  offline; its structure is checked against a JSON schema of the fields the chart uses (names as
  in the prometheus-operator API), and its selector and ports against the rendered Service.
- The example trainers' PyTorchJob (kubeflow.org/v1), JobSet (jobset.x-k8s.io/v1alpha2) and
  LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): their CRDs are not available offline either.
  Every pod template they embed is validated strictly by kubernetes-validate as a core
  PodTemplate (a JobSet's Job templates as whole batch/v1 Jobs), and the outer object against a
  JSON schema of the fields the chart uses, with the API's names and required fields. Neither
  checks what only their controllers check (e.g. a PyTorchJob's container named "pytorch").

Beyond validity: the security context of every container, the constructor sidecar (a native
sidecar: an init container with restartPolicy Always) also when a parent chart includes it, the
constructor index each pod of each example trainer gets (its controller's labels and annotations
through the downward API, the constructor's own flag handling, and the trainer's script run
against a stand-in torchrun), the loader pods the operator makes of the chart's DataPlane, the
planner's ledger (a claim by default, none with a bucket location),
the rendered job.yaml loading with batchplane's own configuration loader (and its strategy and
schedule), the commands parsing with the services' own flag parser, the NOTES, the RBAC, the
NetworkPolicy selectors, the dashboard's metric names, and values the schema or the templates
must refuse, naming the field.

helm comes from $BATCHPLANE_HELM (the Makefile sets it) or .tools/helm-*/helm; `make helm`
fetches it. Without it these tests fail; they never skip.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from batchplane.constructor.__main__ import index_args
from batchplane.core import pod_rank
from batchplane.core.config import LEDGER_SCHEMES, JobSettings, load_job
from batchplane.core.process import ProcessSettings, parse_process_args
from batchplane.entrypoint import PARTS
from batchplane.operator import podfields
from batchplane.planner.strategy import load_schedule, load_strategy

try:
    import jsonschema  # comes with kubernetes-validate; the `kubernetes_validate` fixture says what is missing
except ImportError:
    jsonschema = None

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "batchplane"
CRD_FILE = CHART / "crds" / "dataplanes.batchplane.dev.yaml"
RELEASE = "demo"
NAMESPACE = "training"
RENDER_KUBE_VERSION = "1.30.0"
CASES = ["default", *sorted(p.name for p in (CHART / "ci").glob("*.yaml"))]
#: The example trainers' custom kinds: (apiVersion, kind) -> the paths of their pod templates.
TRAINER_KINDS = {
    ("kubeflow.org/v1", "PyTorchJob"): "spec.pytorchReplicaSpecs.*.template",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "spec.replicatedJobs.*.template.spec.template",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "spec.leaderWorkerTemplate.workerTemplate",
}
CUSTOM_KINDS = {("batchplane.dev/v1alpha1", "DataPlane"), ("monitoring.coreos.com/v1", "ServiceMonitor"), *TRAINER_KINDS}
POD_OWNERS = {"Deployment", "Job", "StatefulSet", "DaemonSet"}

RUN_AS_USER = 10001
CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
SOCKET = "unix:///run/batchplane/constructor.sock"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
INDEX_FILE = "/run/batchplane/constructor-index"
EXAMPLE_CASES = {
    "example-torchrun-values.yaml": "torchrun",
    "example-pytorchjob-values.yaml": "pytorchjob",
    "example-jobset-values.yaml": "jobset",
    "example-leaderworkerset-values.yaml": "leaderworkerset",
}


# ---- helm -------------------------------------------------------------------------------------


@functools.cache
def helm_binary() -> pathlib.Path | None:
    configured = os.environ.get("BATCHPLANE_HELM")
    candidates = [pathlib.Path(configured)] if configured else []
    candidates += sorted(ROOT.glob(".tools/helm-*/helm"), reverse=True)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="session")
def helm() -> pathlib.Path:
    path = helm_binary()
    if path is None:
        pytest.fail(
            "helm 3 not found (looked at $BATCHPLANE_HELM and .tools/helm-*/helm): run `make helm` "
            "to fetch it, or point BATCHPLANE_HELM at a helm 3 binary",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session", autouse=True)
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


@dataclasses.dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_helm(helm: pathlib.Path, *args: str | os.PathLike) -> Run:
    proc = subprocess.run(
        [str(helm), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        # No cluster is reachable or wanted; keep helm away from the user's kubeconfig and cache.
        env={**os.environ, "KUBECONFIG": os.devnull, "HELM_CACHE_HOME": "/nonexistent-helm-cache"},
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def values_args(case: str) -> list[str]:
    return [] if case == "default" else ["-f", str(CHART / "ci" / case)]


def template(helm: pathlib.Path, *args: str | os.PathLike, chart: pathlib.Path = CHART, release: str = RELEASE) -> list[dict]:
    """`helm template` with the CRD; the rendered documents, or a test failure with helm's error."""
    result = run_helm(helm, "template", release, chart, "--namespace", NAMESPACE, "--include-crds", "--kube-version", RENDER_KUBE_VERSION, *args)
    assert result.returncode == 0, f"helm template {' '.join(map(str, args))} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


_rendered: dict[str, list[dict]] = {}


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def docs(helm: pathlib.Path, case: str) -> list[dict]:
    if case not in _rendered:
        _rendered[case] = template(helm, *values_args(case))
    return copy.deepcopy(_rendered[case])


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def all_of(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(kind/name, pod template metadata, pod spec) of every workload, the example trainers'
    custom kinds included (one per pod template they hold)."""
    for doc in docs:
        if doc["kind"] in POD_OWNERS:
            tpl = doc["spec"]["template"]
            yield f"{doc['kind']}/{doc['metadata']['name']}", tpl.get("metadata", {}), tpl["spec"]
        elif (doc["apiVersion"], doc["kind"]) in TRAINER_KINDS:
            for where, tpl in pod_templates(doc):
                yield f"{doc['kind']}/{doc['metadata']['name']}:{where}", tpl.get("metadata", {}), tpl["spec"]


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(path, pod template) of each pod template a trainer custom kind holds."""
    found = [("", doc)]
    for key in TRAINER_KINDS[(doc["apiVersion"], doc["kind"])].split("."):
        step = []
        for where, node in found:
            if key == "*":
                items = node.items() if isinstance(node, dict) else enumerate(node)
                step += [(f"{where}.{k}", v) for k, v in items]
            elif key in node:
                step.append((f"{where}.{key}", node[key]))
        found = step
    assert found, f"{doc['kind']} holds no pod template"
    return [(where.lstrip("."), tpl) for where, tpl in found]


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(spec: dict, name: str) -> dict:
    (found,) = [c for c in containers(spec) if c["name"] == name]
    return found


def env_of(c: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def load_values(case: str) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if case != "default":
        values = deep_merge(values, yaml.safe_load((CHART / "ci" / case).read_text()))
    return values


def deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


#: The metadata of a trainer pod that any index source reads as index 0.
FIRST_POD = {
    "name": "trainer-0",
    "labels": {
        "training.kubeflow.org/replica-type": "master",
        "training.kubeflow.org/replica-index": "0",
        "jobset.sigs.k8s.io/job-index": "0",
        "jobset.sigs.k8s.io/replicatedjob-replicas": "1",
        "leaderworkerset.sigs.k8s.io/group-index": "0",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    },
    "annotations": {"batch.kubernetes.io/job-completion-index": "0", "leaderworkerset.sigs.k8s.io/size": "1"},
}


def downward_env(c: dict, meta: Mapping[str, Any]) -> dict[str, str]:
    """The environment the kubelet gives container `c` of a pod with metadata `meta` (name,
    labels, annotations): plain values, and the downward API's fieldRefs, where a label or an
    annotation the pod lacks reads as "" (as the kubelet has it)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        path = e["valueFrom"]["fieldRef"]["fieldPath"] if "fieldRef" in e.get("valueFrom", {}) else None
        if path == "metadata.name":
            env[e["name"]] = meta["name"]
        elif path and (m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)):
            env[e["name"]] = meta.get(m.group(1), {}).get(m.group(2), "")
        else:
            env[e["name"]] = "from-the-cluster"  # status.podIP, spec.nodeName, secrets, ...
    return env


def part_settings(c: dict, part: str, meta: Mapping[str, Any] = FIRST_POD) -> ProcessSettings:
    """The part a container runs, through the image's entrypoint (first argument: the part),
    and its flags as the services' own parser reads them; a constructor's --index-from is
    worked out as the constructor does, from the environment of a pod with metadata `meta`."""
    assert "command" not in c, f"{c['name']}: the image's entrypoint picks the part from the args"
    assert c["args"][0] == part and part in PARTS, c["args"]
    args = c["args"][1:]
    if part == "constructor":
        args, _, _ = index_args(args, downward_env(c, meta))
    return parse_process_args(part, args)


def job_from_configmap(docs: list[dict], folder: pathlib.Path) -> JobSettings:
    """Writes the job ConfigMap's files into `folder` (as its volume would be mounted) and loads
    job.yaml with batchplane's own loader."""
    data = one(docs, "ConfigMap", "-job")["data"]
    for key, text in data.items():
        (folder / key).write_text(text)
    return load_job(folder / "job.yaml")


# ---- custom kinds ------------------------------------------------------------------------------


def crd() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


def crd_version_schema(definition: dict) -> dict:
    (version,) = definition["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def to_json_schema(node: dict) -> dict:
    """A CRD's structural schema as a JSON schema that rejects unknown fields, as the API
    server's strict field validation does (objects with properties and no
    x-kubernetes-preserve-unknown-fields). Kubernetes extensions and formats are dropped."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "format", "nullable", "example"):
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        else:
            out[key] = value
    if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_dataplane(doc: dict) -> None:
    schema = to_json_schema(crd_version_schema(crd()))
    jsonschema.Draft7Validator(schema).validate(doc)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63
    for group in doc["spec"]["sourceGroups"]:  # the CRD's CEL rule
        assert group["maxReplicas"] >= group["minReplicas"], group


DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
#: The subset of monitoring.coreos.com/v1 ServiceMonitor the chart uses, with the API's field names.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": LABELS, "annotations": LABELS},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {"matchLabels": LABELS}},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "targetLabel": {"type": "string"},
                                        "action": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def validate_service_monitor(doc: dict, docs: list[dict]) -> None:
    jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).validate(doc)
    spec = doc["spec"]
    services = [
        s
        for s in all_of(docs, "Service")
        if s["metadata"]["namespace"] in spec.get("namespaceSelector", {}).get("matchNames", [doc["metadata"]["namespace"]])
        and matches(spec["selector"]["matchLabels"], s["metadata"].get("labels", {}))
    ]
    assert len(services) == 1, f"ServiceMonitor {doc['metadata']['name']} selects {len(services)} Services"
    ports = {p["name"] for p in services[0]["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in ports, f"ServiceMonitor port {endpoint['port']!r} is not a port of Service {services[0]['metadata']['name']}"


POD_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}}
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string", "maxLength": 63}, "namespace": {"type": "string"}, "labels": LABELS, "annotations": LABELS},
}
INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
#: The parts of kubeflow.org/v1 PyTorchJob the chart uses (names as in the training operator's API).
PYTORCHJOB_REPLICA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["template"],
    "properties": {"replicas": INT32, "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]}, "template": POD_TEMPLATE},
}
#: Outer structures of the example trainers' custom kinds: the fields the chart uses, with the
#: API's names and required fields; their pod templates are validated by kubernetes-validate.
TRAINER_SCHEMAS = {
    "PyTorchJob": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "kubeflow.org/v1"},
            "kind": {"const": "PyTorchJob"},
            "metadata": OBJECT_META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["pytorchReplicaSpecs"],
                "properties": {
                    "runPolicy": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"backoffLimit": INT32, "cleanPodPolicy": {"enum": ["All", "Running", "None"]}, "ttlSecondsAfterFinished": INT32},
                    },
                    "pytorchReplicaSpecs": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["Master"],
                        "properties": {"Master": {**PYTORCHJOB_REPLICA, "properties": {**PYTORCHJOB_REPLICA["properties"], "replicas": {"const": 1}}}, "Worker": PYTORCHJOB_REPLICA},
                    },
                },
            },
        },
    },
    "JobSet": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
            "kind": {"const": "JobSet"},
            "metadata": OBJECT_META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["replicatedJobs"],
                "properties": {
                    "network": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"enableDNSHostnames": {"type": "boolean"}, "subdomain": {"type": "string"}, "publishNotReadyAddresses": {"type": "boolean"}},
                    },
                    "failurePolicy": {"type": "object", "additionalProperties": False, "properties": {"maxRestarts": INT32}},
                    "replicatedJobs": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "template"],
                            "properties": {
                                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                                "replicas": INT32,
                                "template": {"type": "object", "additionalProperties": False, "required": ["spec"], "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}},
                            },
                        },
                    },
                },
            },
        },
    },
    "LeaderWorkerSet": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
            "kind": {"const": "LeaderWorkerSet"},
            "metadata": OBJECT_META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["leaderWorkerTemplate"],
                "properties": {
                    "replicas": INT32,
                    "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                    "leaderWorkerTemplate": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["workerTemplate"],
                        "properties": {
                            "size": {**INT32, "minimum": 1},
                            "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                            "leaderTemplate": POD_TEMPLATE,
                            "workerTemplate": POD_TEMPLATE,
                        },
                    },
                },
            },
        },
    },
}


def validate_trainer_kind(doc: dict, version: str, kv: Any) -> None:
    """An example trainer's custom kind: its outer structure against TRAINER_SCHEMAS, every pod
    template it holds strictly as a core PodTemplate (a JobSet's Jobs as batch/v1 Jobs)."""
    jsonschema.Draft7Validator(TRAINER_SCHEMAS[doc["kind"]]).validate(doc)
    wrapped = []
    if doc["kind"] == "JobSet":
        for job in doc["spec"]["replicatedJobs"]:
            wrapped.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{doc['metadata']['name']}-{job['name']}-0"}, "spec": job["template"]["spec"]})
    else:
        for where, tpl in pod_templates(doc):
            wrapped.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{doc['metadata']['name']}-{where.rsplit('.', 2)[-2].lower()}"}, "template": tpl})
    for obj in wrapped:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: a pod template is invalid for Kubernetes {version}: {path}: {exc.message}") from None


def validate_document(doc: dict, docs: list[dict], version: str, kv: Any) -> str:
    """Validates one rendered document; returns how (for the resource list)."""
    if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
        if doc["kind"] == "DataPlane":
            validate_dataplane(doc)
            return "CRD schema"
        if (doc["apiVersion"], doc["kind"]) in TRAINER_KINDS:
            validate_trainer_kind(doc, version, kv)
            return "structure + k8s pod templates"
        validate_service_monitor(doc, docs)
        return "structure"
    try:
        return "k8s " + kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {path}: {exc.message}") from None


# ---- lint, render, validate ---------------------------------------------------------------------


def test_chart_metadata_follows_the_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.M).group(1)
    assert (chart["apiVersion"], chart["type"], chart["appVersion"]) == ("v2", "application", version)


def test_helm_lint_strict(helm: pathlib.Path, case: str) -> None:
    result = run_helm(helm, "lint", "--strict", CHART, "--namespace", NAMESPACE, *values_args(case))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("kube_version", ["1.30.0", "latest"])
def test_every_manifest_validates(docs: list[dict], kube_version: str, kubernetes_validate: Any) -> None:
    version = kubernetes_validate.latest_version() if kube_version == "latest" else kube_version
    kinds = set()
    for doc in docs:
        assert doc["metadata"]["name"], doc
        validate_document(doc, docs, version, kubernetes_validate)
        kinds.add(doc["kind"])
    assert {"CustomResourceDefinition", "ConfigMap", "Deployment", "Service", "DataPlane"} <= kinds


def test_strict_validation_catches_mistakes(docs: list[dict], kubernetes_validate: Any) -> None:
    """The validators are not vacuous: a misspelled field, a wrong type, an unknown DataPlane
    field and a bad ServiceMonitor port are each refused."""
    planner = one(docs, "Deployment", "-planner")
    typo = copy.deepcopy(planner)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    wrong_type = copy.deepcopy(planner)
    wrong_type["spec"]["replicas"] = "one"
    for bad in (typo, wrong_type):
        with pytest.raises(AssertionError, match="is invalid for Kubernetes"):
            validate_document(bad, docs, RENDER_KUBE_VERSION, kubernetes_validate)
    dataplane = copy.deepcopy(one(docs, "DataPlane"))
    dataplane["spec"]["sourceGroups"][0]["replicas"] = 3
    with pytest.raises(jsonschema.ValidationError, match="replicas"):
        validate_dataplane(dataplane)
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "x", "namespace": NAMESPACE},
        "spec": {"selector": {"matchLabels": one(docs, "Service", "-planner")["metadata"]["labels"]}, "endpoints": [{"port": "nope"}]},
    }
    with pytest.raises(AssertionError, match="nope"):
        validate_service_monitor(monitor, docs)


def test_names_fit_kubernetes_limits(helm: pathlib.Path) -> None:
    """A long release name still gives valid, distinct names, and room for the operator's
    "<DataPlane>-loader-<group>" Deployments and their pods."""
    release = "a-very-long-release-name-for-a-pretraining-run-of-70b"
    docs = template(helm, "-f", CHART / "ci" / "two-groups-values.yaml", "--set", "fullnameOverride=", release=release)
    names = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
    assert len(set(names)) == len(names), names
    for _, name in names:
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
    dataplane = one(docs, "DataPlane")["metadata"]["name"]
    assert len(dataplane) <= 40
    loader = f"{dataplane}-loader-{'g' * 63}"  # the longest group name the schema allows
    assert len(loader) + len("-0123456789-abcde") <= 253  # a pod of its Deployment


def test_older_kubernetes_is_refused(helm: pathlib.Path) -> None:
    result = run_helm(helm, "template", RELEASE, CHART, "--kube-version", "1.28.0")
    assert result.returncode != 0 and "kubeVersion" in result.stderr, result.stderr


# ---- the CRD -----------------------------------------------------------------------------------


def structural_problems(node: dict, path: str = "", *, in_combinator: bool = False) -> Iterator[str]:
    """Violations of Kubernetes' structural schema rules (simplified to what can go wrong here)."""
    special = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if in_combinator:
        if set(node) - {"type", "pattern", "minimum", "maximum", "minLength", "maxLength"} or node.get("type") not in ("integer", "string"):
            yield f"{path}: only the int-or-string pattern may use anyOf/oneOf here"
        return
    if not node.get("type") and not special:
        yield f"{path or '(root)'}: no type"
    if node.get("additionalProperties") is False:
        yield f"{path}: additionalProperties: false is forbidden in a CRD"
    if "properties" in node and "additionalProperties" in node:
        yield f"{path}: properties and additionalProperties together"
    if node.get("x-kubernetes-int-or-string") and node.get("anyOf") != [{"type": "integer"}, {"type": "string"}]:
        yield f"{path}: int-or-string needs anyOf [integer, string]"
    if node.get("x-kubernetes-list-type") == "map":
        missing = set(node.get("x-kubernetes-list-map-keys", [])) - set(node["items"].get("required", []))
        if missing or not node.get("x-kubernetes-list-map-keys"):
            yield f"{path}: list-map keys {sorted(missing)} must be required"
    if "default" in node:
        try:
            jsonschema.Draft7Validator(to_json_schema(node)).validate(node["default"])
        except jsonschema.ValidationError as exc:
            yield f"{path}: default {node['default']!r} violates its own schema: {exc.message}"
    for name, sub in node.get("properties", {}).items():
        yield from structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from structural_problems(node[key], f"{path}.{key}")
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(node.get(key, [])):
            yield from structural_problems(sub, f"{path}.{key}[{i}]", in_combinator=True)


def test_crd_is_structural_and_as_specified(kubernetes_validate: Any) -> None:
    definition = crd()
    for version in ("1.30.0", kubernetes_validate.latest_version()):
        validate_document(definition, [definition], version, kubernetes_validate)
    spec = definition["spec"]
    assert definition["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"], spec["names"]["shortNames"]) == (
        "batchplane.dev",
        "Namespaced",
        "DataPlane",
        "dataplanes",
        ["dp"],
    )
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"], version["subresources"]) == ("v1alpha1", True, True, {"status": {}})
    schema = version["schema"]["openAPIV3Schema"]
    assert list(structural_problems(schema)) == []
    assert schema["properties"]["metadata"] == {"type": "object"}
    props = schema["properties"]["spec"]["properties"]
    assert {"sourceGroups", "mixture", "strategy", "mesh", "batch", "planner", "scaling"} <= set(props)
    group = props["sourceGroups"]["items"]["properties"]
    assert {"name", "sources", "minReplicas", "maxReplicas", "resources", "workersPerActor"} <= set(group)
    assert set(group["sources"]["items"]["properties"]) == {"name", "path", "tokenColumn", "transform", "costSecondsPerSample"}
    assert props["mixture"]["x-kubernetes-preserve-unknown-fields"] is True
    assert set(props["mesh"]["properties"]) == {"dp", "cp", "tp", "pp"}
    assert set(props["batch"]["properties"]) == {"globalBatchSize", "microbatches"}
    assert {"intervalSeconds", "consecutiveIntervals", "threshold", "cooldownSeconds"} <= set(props["scaling"]["properties"])
    status = schema["properties"]["status"]["properties"]
    assert set(status["groups"]["items"]["properties"]) == {"name", "replicas", "desiredReplicas"}
    assert status["observedMixture"]["additionalProperties"] == {"type": "number"}
    assert status["conditions"]["items"]["required"] == ["type", "status", "lastTransitionTime", "reason", "message"]


def test_crd_accepts_an_operator_status_and_refuses_bad_ones(docs: list[dict]) -> None:
    dataplane = one(docs, "DataPlane")
    names = [s["name"] for g in dataplane["spec"]["sourceGroups"] for s in g["sources"]]
    dataplane["status"] = {
        "observedGeneration": 3,
        "groups": [{"name": g["name"], "replicas": g["minReplicas"], "desiredReplicas": g["maxReplicas"]} for g in dataplane["spec"]["sourceGroups"]],
        "observedMixture": {name: 1 / len(names) for name in names},
        "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z", "reason": "LoadersReady", "message": "all loader groups are serving", "observedGeneration": 3}
        ],
    }
    validate_dataplane(dataplane)
    for path, bad in [
        (("observedMixture",), {"web": "half"}),
        (("conditions", 0, "status"), "Maybe"),
        (("groups", 0, "replicas"), -1),
    ]:
        broken = copy.deepcopy(dataplane)
        target = broken["status"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            validate_dataplane(broken)
    inverted = copy.deepcopy(dataplane)
    inverted["spec"]["sourceGroups"][0]["minReplicas"] = inverted["spec"]["sourceGroups"][0]["maxReplicas"] + 1
    with pytest.raises(AssertionError):
        validate_dataplane(inverted)


# ---- what runs -----------------------------------------------------------------------------------


def test_every_container_is_locked_down(docs: list[dict]) -> None:
    seen = 0
    for where, _, spec in pod_specs(docs):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == RUN_AS_USER and pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for c in containers(spec):
            ctx = c.get("securityContext", {})
            wrong = {k: ctx.get(k) for k, v in CONTAINER_SECURITY.items() if ctx.get(k) != v}
            assert not wrong, f"{where} container {c['name']}: {wrong}"
            seen += 1
            # read-only root: whatever the process writes goes to a mounted emptyDir or volume
            assert any(m["mountPath"] == "/tmp" for m in c.get("volumeMounts", [])), f"{where} {c['name']} has no writable /tmp"
    assert seen >= 1
    dataplane = one(docs, "DataPlane")  # the operator builds loader pods with the same identity
    assert dataplane["spec"]["loader"]["runAsUser"] == RUN_AS_USER


def test_every_pod_is_scraped(docs: list[dict]) -> None:
    for where, meta, spec in pod_specs(docs):
        annotations = meta.get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", where
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for c in containers(spec) for p in c.get("ports", [])}, where
    loader = one(docs, "DataPlane")["spec"]["loader"]
    assert loader["podAnnotations"]["prometheus.io/port"] == str(loader["metricsPort"])


def test_job_yaml_loads_with_batchplane_config(docs: list[dict], case: str, tmp_path: pathlib.Path) -> None:
    job = job_from_configmap(docs, tmp_path)
    values = load_values(case)
    strategy = load_strategy(job)  # as the planner does at start: imports the strategy file
    load_schedule(job, strategy)
    # every part binds all interfaces: a pod is reached at its IP, probes and scrapes included
    assert job.network.host == "0.0.0.0"
    dataplane = one(docs, "DataPlane")["spec"]
    assert list(job.source_names) == [s["name"] for g in dataplane["sourceGroups"] for s in g["sources"]]
    assert list(job.source_names) == [s["name"] for g in values["sourceGroups"] for s in g["sources"]]
    # loader group g (the operator's --index g) serves exactly the sources of sourceGroups[g]
    assert [[job.source_names[k] for k in job.loader_sources(g)] for g in range(job.loader_count)] == [
        [s["name"] for s in group["sources"]] for group in dataplane["sourceGroups"]
    ]
    assert dataclasses.asdict(job.mesh) | {"order": None} == {**dataplane["mesh"], "order": None}
    assert (job.batch.global_batch_size, job.batch.microbatches) == (dataplane["batch"]["globalBatchSize"], dataplane["batch"]["microbatches"])
    assert job.constructors.ranks_per_constructor == values["trainer"]["ranksPerPod"]
    # the ledger lives on the planner's writable state volume
    planner = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
    state = [m["mountPath"] for m in planner["containers"][0]["volumeMounts"] if m["name"] == "state"]
    assert pathlib.PurePosixPath(job.run_dir).is_absolute() and job.run_dir.startswith(state[0] + "/")
    claim = [v for v in planner["volumes"] if v["name"] == "state"][0]
    ledger = values["planner"]["ledger"]
    assert job.ledger.location == (ledger["location"] or None)
    if ledger["persistence"]["enabled"] and not ledger["location"]:
        assert claim["persistentVolumeClaim"]["claimName"] == one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    else:  # no claim: the ledger is lost with the pod, or lies in a bucket
        assert "emptyDir" in claim and not all_of(docs, "PersistentVolumeClaim")


def test_commands_fit_the_services_flags(docs: list[dict], tmp_path: pathlib.Path) -> None:
    """Each part's arguments, parsed by the services' own flag parser, point at the mounted job
    file and the ports the pods and Services declare."""
    job = job_from_configmap(docs, tmp_path)
    planner_pod = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
    planner = planner_pod["containers"][0]
    settings = part_settings(planner, "planner")
    config_mount = [m["mountPath"] for m in planner["volumeMounts"] if m["name"] == "batchplane-job"][0]
    assert settings.config == pathlib.Path(config_mount) / "job.yaml"
    # create_grpc_server binds f"{--listen or network.host}:{--port}": no --listen for TCP
    assert settings.listen is None and settings.port == 50051
    ports = {p["name"]: p["containerPort"] for p in planner["ports"]}
    assert ports == {"grpc": settings.port, "metrics": settings.metrics_port} and settings.metrics_port == 9100
    service = one(docs, "Service", "-planner")
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {("grpc", 50051, "grpc"), ("metrics", 9100, "metrics")}
    assert matches(service["spec"]["selector"], one(docs, "Deployment", "-planner")["spec"]["template"]["metadata"]["labels"])
    assert one(docs, "Deployment", "-planner")["spec"]["strategy"] == {"type": "Recreate"}
    assert one(docs, "Deployment", "-planner")["spec"]["replicas"] == 1
    assert one(docs, "DataPlane")["spec"]["planner"]["address"] == f"{service['metadata']['name']}.{NAMESPACE}.svc:50051"
    assert one(docs, "DataPlane")["spec"]["loader"]["jobConfigMap"] == one(docs, "ConfigMap", "-job")["metadata"]["name"]
    assert job.loader_count >= 1
    for doc in all_of(docs, "Deployment"):
        if doc["metadata"]["name"].endswith("-operator"):
            operator = doc["spec"]["template"]["spec"]["containers"][0]
            assert "command" not in operator and operator["args"][0] == "operator" and "operator" in PARTS
            assert operator["args"][1:3] == ["--namespace", "$(POD_NAMESPACE)"] and operator["args"][3] == "--prometheus"
            assert env_of(operator)["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


# ---- the constructor sidecar --------------------------------------------------------------------


def check_trainer_pod(spec: dict, docs: list[dict], job: JobSettings, *, trainer: str) -> None:
    sidecar = container(spec, "batchplane-constructor")
    assert sidecar in spec["initContainers"] and sidecar["restartPolicy"] == "Always"
    assert "startupProbe" in sidecar and "readinessProbe" in sidecar
    # the index: worked out from the pod by the constructor (--index-from), published for the trainer
    args = sidecar["args"]
    source = args[args.index("--index-from") + 1]
    assert "--index" not in args and args[args.index("--publish-index") + 1] == INDEX_FILE
    check_index_env(sidecar, source, job.constructor_count)
    settings = part_settings(sidecar, "constructor")
    assert settings.index == 0  # FIRST_POD, as every source reads it
    assert settings.listen == SOCKET and settings.metrics_port == sidecar["ports"][0]["containerPort"]
    assert settings.config == pathlib.Path("/etc/batchplane/job.yaml")
    service = one(docs, "Service", "-planner")
    assert settings.planner == f"{service['metadata']['name']}.{NAMESPACE}.svc:50051"
    assert sidecar["startupProbe"]["httpGet"]["port"] == settings.metrics_port
    main = container(spec, trainer)
    assert env_of(main)["BATCHPLANE_CONSTRUCTOR"] == settings.listen
    assert env_of(main)["BATCHPLANE_CONSTRUCTOR_INDEX_FILE"] == INDEX_FILE and env_of(main)["BATCHPLANE_CONSTRUCTOR_INDEX_FROM"] == source
    check_index_env(main, source, job.constructor_count)  # the trainer gets the same inputs
    if source == "indexed-job":  # the one source Kubernetes gives as a plain value
        assert env_of(main)["BATCHPLANE_CONSTRUCTOR_INDEX"] == {"fieldRef": {"fieldPath": COMPLETION_INDEX}}
    else:
        assert "BATCHPLANE_CONSTRUCTOR_INDEX" not in env_of(main)
    socket_dir = str(pathlib.PurePosixPath(SOCKET.removeprefix("unix://")).parent)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in (sidecar, main):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == socket_dir]
        assert "emptyDir" in volumes[mount["name"]]
    (config,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == "/etc/batchplane"]
    assert volumes[config["name"]]["configMap"]["name"] == one(docs, "ConfigMap", "-job")["metadata"]["name"]
    assert job.constructor_count >= 1


def check_index_env(c: dict, source: str, pods: int) -> None:
    """`c` carries the variables `source` reads, from the downward API fieldPaths pod_rank names
    (and the job's `pods` trainer pods where it needs them)."""
    env = env_of(c)
    for name in pod_rank.variables(source):
        if name == pod_rank.TRAINER_PODS:
            assert env[name] == str(pods), name
        elif not source.startswith(pod_rank.ENV_PREFIX):
            assert env[name] == {"fieldRef": {"fieldPath": pod_rank.FIELD_PATHS[name]}}, name


def test_example_trainer_job_uses_the_sidecar(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    docs = template(helm, "-f", CHART / "ci" / "two-groups-values.yaml")
    job = job_from_configmap(docs, tmp_path)
    trainer_job = one(docs, "Job", "-example")
    spec = trainer_job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == job.constructor_count
    check_trainer_pod(spec["template"]["spec"], docs, job, trainer="trainer")
    script = container(spec["template"]["spec"], "trainer")["args"][0]
    assert "python -m batchplane.examples.tiny_lm" in script and f"--world-size {job.world}" in script
    assert (ROOT / "client" / "batchplane" / "examples" / "tiny_lm.py").is_file()
    assert not all_of(template(helm), "Job")  # example.enabled is false by default


def test_parent_chart_includes_the_sidecar(helm: pathlib.Path, tmp_path: pathlib.Path, kubernetes_validate: Any) -> None:
    """The named templates work from a user's own chart that depends on this one."""
    parent = tmp_path / "trainer"
    (parent / "templates").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "batchplane")
    (parent / "Chart.yaml").write_text(
        "apiVersion: v2\nname: trainer\nversion: 0.1.0\ndependencies:\n  - name: batchplane\n    version: "
        + yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
        + "\n"
    )
    (parent / "values.yaml").write_text("batchplane:\n  mesh: {dp: 4, cp: 1, tp: 2, pp: 1, order: tp-cp-dp-pp}\n  trainer: {ranksPerPod: 4}\n")
    (parent / "templates" / "job.yaml").write_text(
        """\
{{- $bp := .Subcharts.batchplane }}
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ .Release.Name }}-trainer
spec:
  completionMode: Indexed
  completions: {{ include "batchplane.trainerPods" $bp }}
  parallelism: {{ include "batchplane.trainerPods" $bp }}
  template:
    metadata:
      labels:
        {{- include "batchplane.trainerLabels" $bp | nindent 8 }}
      annotations:
        {{- include "batchplane.trainerPodAnnotations" $bp | nindent 8 }}
    spec:
      restartPolicy: Never
      securityContext:
        {{- include "batchplane.podSecurityContext" $bp | nindent 8 }}
      initContainers:
        {{- include "batchplane.constructorSidecar" $bp | nindent 8 }}
      containers:
        - name: train
          image: my-trainer:1
          env:
            {{- include "batchplane.trainerEnv" $bp | nindent 12 }}
          volumeMounts:
            {{- include "batchplane.trainerVolumeMounts" $bp | nindent 12 }}
      volumes:
        {{- include "batchplane.volumes" $bp | nindent 8 }}
"""
    )
    lint = run_helm(helm, "lint", "--strict", parent)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = template(helm, chart=parent)
    job = job_from_configmap(docs, tmp_path)
    trainer_job = one(docs, "Job", "-trainer")
    assert trainer_job["spec"]["completions"] == job.constructor_count == 2
    check_trainer_pod(trainer_job["spec"]["template"]["spec"], docs, job, trainer="train")
    for doc in docs:
        validate_document(doc, docs, RENDER_KUBE_VERSION, kubernetes_validate)


# ---- access, network, monitoring -----------------------------------------------------------------


def test_operator_rbac_is_least_privilege(docs: list[dict], case: str) -> None:
    assert not all_of(docs, "ClusterRole") and not all_of(docs, "ClusterRoleBinding")
    if not load_values(case)["operator"]["enabled"]:
        assert not [d for d in docs if d["metadata"]["name"].endswith("-operator")]
        return
    role = one(docs, "Role", "-operator")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]}
    assert rules == {
        (("batchplane.dev",), ("dataplanes",), ("get", "list")),
        (("batchplane.dev",), ("dataplanes/status",), ("patch",)),
        (("batchplane.dev",), ("dataplanes/finalizers",), ("update",)),
        (("apps",), ("deployments",), ("create", "delete", "get", "list", "patch")),
        (("apps",), ("deployments/scale",), ("patch",)),
        (("coordination.k8s.io",), ("leases",), ("create",)),  # leader election: its Lease, and only that one
        (("coordination.k8s.io",), ("leases",), ("get", "patch")),
        (("",), ("events",), ("create", "patch")),  # Events on the DataPlanes
    }
    lease = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert [(r["resources"], r["resourceNames"]) for r in named] == [(["leases"], [lease[lease.index("--lease-name") + 1]])]
    binding = one(docs, "RoleBinding", "-operator")
    account = one(docs, "ServiceAccount", "-operator")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    operator = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert operator["serviceAccountName"] == account["metadata"]["name"]
    for where, _, spec in pod_specs(docs):  # nothing else talks to the API server
        if spec is not operator:
            assert spec.get("automountServiceAccountToken") is False, where


def test_network_policies_admit_exactly_the_parts(helm: pathlib.Path) -> None:
    docs = template(helm, "-f", CHART / "ci" / "two-groups-values.yaml")
    pods = {name.split("/")[1].rsplit("-", 1)[1]: meta["labels"] for name, meta, _ in pod_specs(docs)}
    loader = one(docs, "DataPlane")["spec"]["loader"]["podLabels"]
    labels = {"planner": pods["planner"], "operator": pods["operator"], "trainer": pods["example"], "loader": loader}

    def admitted(policy: dict, port: int) -> set[str]:
        allowed = set()
        for rule in policy["spec"]["ingress"]:
            if port not in {p["port"] for p in rule["ports"]}:
                continue
            for peer in rule["from"]:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    allowed |= {part for part, lab in labels.items() if matches(peer["podSelector"]["matchLabels"], lab)}
                elif "namespaceSelector" in peer:
                    allowed.add("ns:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
        return allowed

    planner = one(docs, "NetworkPolicy", "-planner")
    assert matches(planner["spec"]["podSelector"]["matchLabels"], labels["planner"])
    assert admitted(planner, 50051) == {"loader", "trainer", "operator"}
    assert admitted(planner, 9100) == {"ns:monitoring"}
    loaders = one(docs, "NetworkPolicy", "-loaders")
    assert matches(loaders["spec"]["podSelector"]["matchLabels"], labels["loader"])
    assert not matches(loaders["spec"]["podSelector"]["matchLabels"], labels["planner"])
    assert admitted(loaders, one(docs, "DataPlane")["spec"]["loader"]["grpcPort"]) == {"planner", "trainer"}
    assert admitted(one(docs, "NetworkPolicy", "-operator"), 9100) == {"ns:monitoring"}
    for policy in all_of(docs, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    # the ServiceMonitor's Service reaches every part that serves metrics
    service = one(docs, "Service", "-metrics")
    for part in ("planner", "operator", "loader", "trainer"):
        assert matches(service["spec"]["selector"], labels[part]), part


def service_metric_names() -> set[str]:
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r"[\"'](batchplane_[a-z0-9_]+)[\"']", path.read_text()))
    return names


def test_dashboard_shows_real_metrics(docs: list[dict], case: str) -> None:
    values = load_values(case)
    found = [d for d in all_of(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    if not values["dashboard"]["enabled"]:
        assert not found
        return
    (configmap,) = found
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    ((key, text),) = configmap["data"].items()
    assert key.endswith(".json") and not re.search(r"__[A-Z]+__", text)  # placeholders replaced
    dashboard = json.loads(text)
    assert len(dashboard["uid"]) <= 40
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    known = service_metric_names()
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\b(batchplane_[a-z0-9_]+)", e)}
    assert used and used <= known, f"dashboard metrics the services do not export: {sorted(used - known)}"
    external = {m for e in exprs for m in re.findall(r"\b(kube_[a-z_]+)", e)}
    assert external == set()  # replicas come from the operator's own metrics, not kube-state-metrics
    joined = "\n".join(exprs)
    for needle in (
        "batchplane_planner_mixture_target_ratio",
        "batchplane_planner_mixture_realized_ratio",
        "batchplane_planner_mixture_weight_ratio",
        "rate(batchplane_planner_samples_total",
        "rate(batchplane_loader_samples_sent_total",
        "histogram_quantile(0.99, sum by (le) (rate(batchplane_planner_plan_duration_seconds_bucket",
        "rate(batchplane_constructor_rank_data_wait_seconds_total",
        "batchplane_operator_desired_replicas",
    ):
        assert needle in joined, needle
    assert f"{one(docs, 'DataPlane')['metadata']['name']}" in text and NAMESPACE in text


def test_notes_render(helm: pathlib.Path, case: str, tmp_path: pathlib.Path) -> None:
    """NOTES.txt rendered by helm's own engine: `helm install --dry-run` wants a cluster, so a copy
    of the chart renders it through a probe template."""
    chart = tmp_path / "batchplane"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "notes-probe.yaml").write_text(
        '{{- define "probe.notes" }}' + notes + "{{ end }}\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include "probe.notes" . | toJson }}\n'
    )
    (doc,) = template(helm, "--show-only", "templates/notes-probe.yaml", *values_args(case), chart=chart)
    text = doc["data"]["notes"]
    service = f"{RELEASE}-batchplane-planner" if case != "two-groups-values.yaml" else "text-and-code-planner"
    assert f"{service}.{NAMESPACE}.svc:50051" in text
    assert 'include "batchplane.constructorSidecar"' in text
    ledger = load_values(case)["planner"]["ledger"]
    assert ("WARNING: planner.ledger.persistence.enabled is false" in text) == (not ledger["persistence"]["enabled"] and not ledger["location"])
    if load_values(case)["example"]["enabled"]:
        assert f"Example trainer ({load_values(case)['example']['kind']}, index from {load_values(case)['constructor']['indexFrom']})" in text


# ---- values the chart must refuse ------------------------------------------------------------------

GROUP = {"name": "text", "sources": [{"name": "web", "path": "/data/web"}], "minReplicas": 1, "maxReplicas": 2}

SCHEMA_ERRORS = [
    ({"sourceGroups": [dict(GROUP, minReplicas=-1)]}, "sourceGroups.0.minReplicas"),
    ({"sourceGroups": [dict(GROUP, name="Text_Group")]}, "sourceGroups.0.name"),
    ({"sourceGroups": [dict(GROUP, sources=[{"name": "bad name", "path": "/d"}])]}, "sourceGroups.0.sources.0.name"),
    ({"sourceGroups": [dict(GROUP, replicas=3)]}, "replicas"),
    ({"sourceGroups": []}, "sourceGroups"),
    ({"mesh": {"dp": 0}}, "mesh.dp"),
    ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    ({"replicaCount": 3}, "replicaCount"),
    ({"job": {"epochs": 0}}, "job.epochs"),
    ({"securityContext": {"runAsUser": 0}}, "securityContext.runAsUser"),
    ({"mixture": {"weights": {"web": -1}}}, "mixture.weights.web"),
    ({"strategy": "plan.txt"}, "strategy"),
    # the pod fields: Kubernetes' own schema (batchplane.operator.kube_types), through values.schema.json
    ({"loader": {"env": [{"name": "A", "valueFrom": {"secretKeyRf": {"name": "s", "key": "k"}}}]}}, "loader.env.0.valueFrom: Additional property secretKeyRf"),
    ({"loader": {"tolerations": [{"key": "k", "efect": "NoSchedule"}]}}, "loader.tolerations.0: Additional property efect"),
    ({"loader": {"affinity": {"nodeAfinity": {}}}}, "loader.affinity: Additional property nodeAfinity"),
    ({"loader": {"volumes": [{"name": "d", "emptyDir": {"sizeLimit": True}}]}}, "loader.volumes.0.emptyDir.sizeLimit"),
    ({"loader": {"serviceAccountName": "Not_A_Name"}}, "loader.serviceAccountName"),
    ({"planner": {"envFrom": [{"secretRef": {"nme": "x"}}]}}, "planner.envFrom.0.secretRef: Additional property nme"),
    ({"planner": {"ledger": {"location": "/var/ledger"}}}, "planner.ledger.location"),
    ({"constructor": {"indexFrom": "statefulset"}}, "constructor.indexFrom"),
    ({"example": {"kind": "mpijob"}}, "example.kind"),
]

TEMPLATE_ERRORS = [
    ({"sourceGroups": [dict(GROUP, minReplicas=3, maxReplicas=2)]}, "sourceGroups[0].maxReplicas: must be >= minReplicas (3), got 2"),
    ({"sourceGroups": [GROUP, dict(GROUP, name="more")]}, 'sourceGroups[1].sources[0].name: source "web" is listed twice'),
    ({"mixture": {"weights": {"wbe": 1}}}, "mixture.weights.wbe: names no source"),
    ({"mesh": {"dp": 8}, "batch": {"globalBatchSize": 8, "microbatches": 2}}, "batch.globalBatchSize: must be >= mesh.dp * batch.microbatches = 16"),
    ({"job": {"settings": {"network": {"host": "127.0.0.1"}}}}, "job.settings.network.host: set by the chart"),
    ({"job": {"settings": {"sources": []}}}, "job.settings.sources: set by the chart"),
    ({"strategy": "mine.py"}, 'strategy: "mine.py" is not a key of strategyFiles'),
    ({"example": {"enabled": True}, "mesh": {"dp": 2}}, "example.enabled: tiny_lm meets its peers on 127.0.0.1"),
    ({"job": {"settings": {"ledger": {"location": "s3://b/l"}}}}, "job.settings.ledger.location: set by the chart; use planner.ledger.location"),
    ({"example": {"enabled": True, "kind": "pytorchjob"}, "mesh": {"dp": 2}}, 'constructor.indexFrom: example.kind pytorchjob gives each pod its index through "kubeflow"'),
    ({"example": {"enabled": True, "kind": "jobset", "jobsetJobs": 3}, "constructor": {"indexFrom": "jobset"}, "mesh": {"dp": 4}}, "example.jobsetJobs: must divide the 4 trainer pods, got 3"),
    ({"loader": {"volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": [{"name": "dta", "mountPath": "/data"}]}}, 'loader.volumeMounts[0].name: "dta" names no volume of loader.volumes'),
    ({"loader": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}, 'loader.env[1].name: "A" is listed twice'),
]


def bad_values(tmp_path: pathlib.Path, values: dict) -> pathlib.Path:
    path = tmp_path / "bad-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize(("values", "field"), SCHEMA_ERRORS, ids=[f for _, f in SCHEMA_ERRORS])
def test_schema_refuses_bad_values(helm: pathlib.Path, tmp_path: pathlib.Path, values: dict, field: str) -> None:
    path = bad_values(tmp_path, values)
    rendered = run_helm(helm, "template", RELEASE, CHART, "-f", path)
    linted = run_helm(helm, "lint", "--strict", CHART, "-f", path)
    assert rendered.returncode != 0 and linted.returncode != 0
    assert "values don't meet the specifications of the schema" in rendered.stderr
    assert field in rendered.stderr and field in linted.stdout + linted.stderr, rendered.stderr


@pytest.mark.parametrize(("values", "message"), TEMPLATE_ERRORS, ids=[m.split(":")[0] for _, m in TEMPLATE_ERRORS])
def test_templates_refuse_inconsistent_values(helm: pathlib.Path, tmp_path: pathlib.Path, values: dict, message: str) -> None:
    rendered = run_helm(helm, "template", RELEASE, CHART, "-f", bad_values(tmp_path, values))
    assert rendered.returncode != 0 and message in rendered.stderr, rendered.stderr


@pytest.mark.parametrize("name", podfields.RESERVED_ENV)
@pytest.mark.parametrize("section", ["loader", "planner"])
def test_the_environment_batchplane_sets_is_refused(helm: pathlib.Path, tmp_path: pathlib.Path, section: str, name: str) -> None:
    """The chart refuses what the operator would (batchplane.operator.podfields), with the same
    reserved names, naming the field."""
    rendered = run_helm(helm, "template", RELEASE, CHART, "-f", bad_values(tmp_path, {section: {"env": [{"name": name, "value": "x"}]}}))
    assert rendered.returncode != 0 and f'{section}.env[0].name: "{name}" is set by batchplane' in rendered.stderr, rendered.stderr


@pytest.mark.parametrize("name", podfields.RESERVED_VOLUMES)
def test_the_volumes_batchplane_uses_are_refused(helm: pathlib.Path, tmp_path: pathlib.Path, name: str) -> None:
    for values, message in (
        ({"volumes": [{"name": name, "emptyDir": {}}]}, f'loader.volumes[0].name: "{name}" is used by batchplane'),
        ({"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": name, "mountPath": "/d"}]}, f'loader.volumeMounts[0].name: "{name}" is used by batchplane'),
    ):
        rendered = run_helm(helm, "template", RELEASE, CHART, "-f", bad_values(tmp_path, {"loader": values}))
        assert rendered.returncode != 0 and message in rendered.stderr, rendered.stderr


@pytest.mark.parametrize("path", [*podfields.RESERVED_MOUNT_PATHS, "/etc/batchplane/extra", "/tmp/"])
def test_the_mount_paths_batchplane_uses_are_refused(helm: pathlib.Path, tmp_path: pathlib.Path, path: str) -> None:
    values = {"loader": {"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": "d", "mountPath": path}]}}
    rendered = run_helm(helm, "template", RELEASE, CHART, "-f", bad_values(tmp_path, values))
    assert rendered.returncode != 0 and f'loader.volumeMounts[0].mountPath: "{path}" is used by batchplane' in rendered.stderr, rendered.stderr
    # and the operator refuses the same
    with pytest.raises(podfields.ConfigError, match="is used by batchplane"):
        podfields.parse_pod_options(values["loader"], at="spec.loader")


# ---- loader and planner pods -------------------------------------------------------------------


def test_loader_pods_carry_every_pod_field_and_validate(helm: pathlib.Path, kubernetes_validate: Any) -> None:
    """ci/loader-pods-values.yaml sets every pod field of `loader`: the DataPlane carries them as
    given, the operator reads it, and its Deployments carry them and validate strictly for 1.30
    and the newest Kubernetes."""
    from batchplane.operator.dataplane import parse_dataplane
    from batchplane.operator.manifests import loader_deployment

    values = load_values("loader-pods-values.yaml")["loader"]
    docs = template(helm, "-f", CHART / "ci" / "loader-pods-values.yaml")
    obj = one(docs, "DataPlane")
    names = [f.name for f in podfields.LOADER_FIELDS]
    given = {k: values[k] for k in names if values[k]}
    assert set(given) == set(names) - {"automountServiceAccountToken"}  # every field but the default false
    assert {k: obj["spec"]["loader"][k] for k in given} == given and "automountServiceAccountToken" not in obj["spec"]["loader"]
    obj["metadata"] |= {"uid": "uid-from-the-api-server", "generation": 1}
    spec = parse_dataplane(obj)
    for group in spec.groups:
        d = loader_deployment(spec, group, replicas=group.min_replicas)
        pod = d["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["env"][-len(values["env"]) :] == values["env"] and c["envFrom"] == values["envFrom"]
        assert c["volumeMounts"][-len(values["volumeMounts"]) :] == values["volumeMounts"]
        assert pod["volumes"][-len(values["volumes"]) :] == values["volumes"]
        for key in ("serviceAccountName", "nodeSelector", "tolerations", "affinity", "priorityClassName", "topologySpreadConstraints"):
            assert pod[key] == values[key], key
        assert pod["automountServiceAccountToken"] is False
        for version in ("1.30.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(d, version, strict=True)


def test_the_planner_gets_bucket_credentials(helm: pathlib.Path) -> None:
    values = load_values("loader-pods-values.yaml")["planner"]
    docs = template(helm, "-f", CHART / "ci" / "loader-pods-values.yaml")
    pod = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert [e["name"] for e in c["env"]] == ["PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "HOME", *[e["name"] for e in values["env"]]]
    assert c["envFrom"] == values["envFrom"]
    assert pod["serviceAccountName"] == values["serviceAccountName"] == "ledger-writer"
    assert pod["automountServiceAccountToken"] is False  # a ServiceAccount alone mounts no API token
    default = one(template(helm), "Deployment", "-planner")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in default and "envFrom" not in default["containers"][0]
    opted_in = one(template(helm, "--set", "planner.automountServiceAccountToken=true"), "Deployment", "-planner")["spec"]["template"]["spec"]
    assert opted_in["automountServiceAccountToken"] is True


def test_the_ledger_is_persistent_by_default_and_in_the_bucket_with_a_location(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    def ledger_of(docs: list[dict]) -> tuple[dict, list[dict], JobSettings]:
        planner = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        return next(v for v in planner["volumes"] if v["name"] == "state"), all_of(docs, "PersistentVolumeClaim"), job_from_configmap(docs, folder)

    state, claims, job = ledger_of(template(helm))
    (claim,) = claims
    assert state == {"name": "state", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" and claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert job.ledger.location is None  # <run_dir>/ledger, on the claim
    for url in ("s3://training-ledgers/llama/run-7", "gs://ledgers/run", "az://container/ledger"):
        state, claims, job = ledger_of(template(helm, "--set", f"planner.ledger.location={url}"))
        assert claims == [] and state == {"name": "state", "emptyDir": {}}
        assert job.ledger.location == url
        assert url.split("://")[0] in LEDGER_SCHEMES
    state, claims, _ = ledger_of(template(helm, "--set", "planner.ledger.persistence.existingClaim=ledgers"))
    assert claims == [] and state["persistentVolumeClaim"] == {"claimName": "ledgers"}
    state, claims, _ = ledger_of(template(helm, "--set", "planner.ledger.persistence.enabled=false"))
    assert claims == [] and "emptyDir" in state
    # every scheme the chart accepts is one the ledger can live in
    schema = json.loads((CHART / "values.schema.json").read_text())
    pattern = schema["properties"]["planner"]["properties"]["ledger"]["properties"]["location"]["pattern"]
    schemes = re.search(r"\^\(([a-z0-9|]+)\)://", pattern).group(1).split("|")
    assert set(schemes) <= set(LEDGER_SCHEMES) and "file" not in schemes  # file:// would be the planner's read-only root


# ---- the example trainers under each kind of job -----------------------------------------------------

TORCHRUN_STUB = """#!/bin/sh
printf '%s\\n' "$@" > "$TORCHRUN_ARGS"
"""


def simulated_pods(doc: dict, pods: int) -> list[tuple[dict, dict]]:
    """(pod metadata as the kind's controller makes it, pod template) of every pod of `doc`."""
    name = doc["metadata"]["name"]
    out = []
    if doc["kind"] == "Job":
        for i in range(doc["spec"]["completions"]):
            meta = {"name": f"{name}-{i}-x7k2q", "labels": {}, "annotations": {"batch.kubernetes.io/job-completion-index": str(i)}}
            out.append((meta, doc["spec"]["template"]))
    elif doc["kind"] == "PyTorchJob":
        for kind, replica in doc["spec"]["pytorchReplicaSpecs"].items():
            for i in range(replica["replicas"]):
                labels = {"training.kubeflow.org/replica-type": kind.lower(), "training.kubeflow.org/replica-index": str(i), "training.kubeflow.org/job-name": name}
                out.append(({"name": f"{name}-{kind.lower()}-{i}", "labels": labels, "annotations": {}}, replica["template"]))
    elif doc["kind"] == "JobSet":
        (rjob,) = doc["spec"]["replicatedJobs"]
        for j in range(rjob["replicas"]):
            for c in range(rjob["template"]["spec"]["completions"]):
                labels = {"jobset.sigs.k8s.io/job-index": str(j), "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]), "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"]}
                meta = {"name": f"{name}-{rjob['name']}-{j}-{c}-abcde", "labels": labels, "annotations": {"batch.kubernetes.io/job-completion-index": str(c)}}
                out.append((meta, rjob["template"]["spec"]["template"]))
    elif doc["kind"] == "LeaderWorkerSet":
        size = doc["spec"]["leaderWorkerTemplate"]["size"]
        for g in range(doc["spec"]["replicas"]):
            for w in range(size):
                labels = {"leaderworkerset.sigs.k8s.io/group-index": str(g), "leaderworkerset.sigs.k8s.io/worker-index": str(w)}
                meta = {"name": f"{name}-{g}" + (f"-{w}" if w else ""), "labels": labels, "annotations": {"leaderworkerset.sigs.k8s.io/size": str(size)}}
                out.append((meta, doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]))
    assert len(out) == pods, f"{doc['kind']} makes {len(out)} pods, the job has {pods} constructors"
    return out


@pytest.mark.parametrize("case", sorted(EXAMPLE_CASES))
def test_each_example_gives_every_pod_its_constructor(helm: pathlib.Path, case: str, tmp_path: pathlib.Path) -> None:
    """Under each kind of job, every pod's sidecar works out a distinct constructor index from
    the labels and annotations its controller sets (through the downward API and the
    constructor's own flag handling), and the trainer's script, run against a stand-in
    torchrun, starts it with that index as the node rank (static rendezvous), so torchrun's
    global ranks are the ones the pod's constructor serves."""
    kind = EXAMPLE_CASES[case]
    docs = template(helm, "-f", CHART / "ci" / case)
    job = job_from_configmap(docs, tmp_path)
    per = job.constructors.ranks_per_constructor
    workloads = [d for d in docs if d["metadata"]["name"].endswith("-example")]
    workload = next(d for d in workloads if d["kind"] != "Service")
    assert {d["kind"] for d in workloads} == {"torchrun": {"Job", "Service"}, "pytorchjob": {"PyTorchJob"}, "jobset": {"JobSet"}, "leaderworkerset": {"LeaderWorkerSet"}}[kind]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("torchrun", "sleep"):
        (bin_dir / tool).write_text(TORCHRUN_STUB if tool == "torchrun" else "#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    indices = []
    for meta, tpl in simulated_pods(workload, job.constructor_count):
        spec = tpl["spec"]
        check_trainer_pod(spec, docs, job, trainer=spec["containers"][0]["name"])
        sidecar = container(spec, "batchplane-constructor")
        index = part_settings(sidecar, "constructor", meta).index
        indices.append(index)
        # the trainer: the index file as the sidecar publishes it, the rest from the pod
        trainer = spec["containers"][0]
        env = downward_env(trainer, meta)
        index_file = tmp_path / f"index-{index}"
        index_file.write_text(f"{index}\n")
        controller_env = {"MASTER_ADDR": f"{workload['metadata']['name']}-master-0", "MASTER_PORT": "23456", "LWS_LEADER_ADDRESS": f"{workload['metadata']['name']}-0.{workload['metadata']['name']}"}
        env |= {"BATCHPLANE_CONSTRUCTOR_INDEX_FILE": str(index_file), "TORCHRUN_ARGS": str(tmp_path / "args"), "PATH": f"{bin_dir}:/usr/bin:/bin"} | controller_env
        assert trainer["command"] == ["sh", "-c"]
        run = subprocess.run(["sh", "-c", trainer["args"][0]], env=env, capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        args = (tmp_path / "args").read_text().splitlines()
        flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
        assert flags["--node-rank"] == str(index) and flags["--rdzv-backend"] == "static"
        assert (flags["--nnodes"], flags["--nproc-per-node"]) == (str(job.constructor_count), str(per))
        name = workload["metadata"]["name"]
        if kind == "torchrun":  # pod 0 of the Indexed Job, through the headless Service
            master = f"{name}-0.{workload['spec']['template']['spec']['subdomain']}"
        elif kind == "jobset":  # the first pod of the first Job: <jobset>-<replicatedJob>-0-0.<subdomain>
            master = f"{name}-{workload['spec']['replicatedJobs'][0]['name']}-0-0.{name}"
        elif kind == "pytorchjob":  # what the training operator sets
            master = controller_env["MASTER_ADDR"]
        else:  # what the LeaderWorkerSet controller sets
            master = controller_env["LWS_LEADER_ADDRESS"]
        assert flags["--master-addr"] == master
        # torchrun's ranks on this node are this pod's constructor's ranks
        assert [index * per + r for r in range(per)] == list(job.constructor_ranks(index))
    assert sorted(indices) == list(range(job.constructor_count))
    if kind == "torchrun":  # pod 0 resolves before it is ready, through the headless Service
        service = one(docs, "Service", "-example")
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert workload["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
        assert matches(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
        assert workload["spec"]["completionMode"] == "Indexed"
    if kind == "jobset":
        assert workload["spec"]["network"]["enableDNSHostnames"] is True


def test_a_sidecar_in_the_wrong_kind_of_pod_says_so(helm: pathlib.Path) -> None:
    """The crash loop this replaces: an Indexed-Job sidecar in a PyTorchJob's pod got `--index ''`.
    Now the constructor stops at once, naming the source and the variable."""
    docs = template(helm, "--set", "example.enabled=true")  # constructor.indexFrom indexed-job
    sidecar = container(one(docs, "Job", "-example")["spec"]["template"]["spec"], "batchplane-constructor")
    pytorchjob_pod = {"name": "run-worker-0", "labels": {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"}, "annotations": {}}
    with pytest.raises(pod_rank.PodRankError, match=r"--index-from indexed-job: BATCHPLANE_COMPLETION_INDEX: is empty .*only an Indexed Job's pods"):
        index_args(sidecar["args"][1:], downward_env(sidecar, pytorchjob_pod))
