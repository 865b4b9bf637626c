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
- cert-manager's Issuer and Certificate (cert-manager.io/v1, tls.mode certManager):
  kubernetes-validate has no schema of them and cert-manager's CRDs are not available offline.
  Their structure is checked against a JSON schema of the fields the chart uses (names, enums
  and required fields as in cert-manager's API), and what a schema cannot say is checked here:
  every Certificate's issuerRef names an Issuer the chart renders (or tls.certManager.issuerRef),
  the CA Issuer's Secret is the root CA Certificate's, which the self-signed Issuer signs; the one
  other Certificate is the operator's intermediate CA (isCA, ECDSA P-256, rotated at renewal),
  whose Secret the operator alone mounts, and of which every other pod projects the key ca.crt
  (the root) alone. tls.mode existingSecret renders what certManager does but for these kinds,
  with the user's CA Secret in place of that intermediate's.

Transport security, for every tls.mode (issued by default, also with operator.enabled false,
where this release's operator pods are its issuer alone; certManager, existingSecret, disabled,
and disabled with tokens): every part's flags parsed by the services' own flag parser; with
tokens --auth-tokens/--token-file (a server's own key and the verifiers, a caller's own key:
items, never the whole tokens Secret); with tls.mode issued, certManager or existingSecret
--tls-dir on an in-memory emptyDir, --issuer (the operator Service's issuer port) and the pod's projected ServiceAccount
token (the issuer's audience) with the CA certificate (issued: a ConfigMap; certManager and
existingSecret: the key ca.crt alone of the operator's CA Secret), the pod's ServiceAccount one
the operator's --issuer-role (read by the operator's own flag parser) gives the part's role, and
the CA's key in a Secret that only the operator mounts; job.yaml's network.tls; that tokens and
the issued mode's CA are kept when `lookup` finds them. `helm template` cannot run `lookup` (it never reaches a cluster, and
`--dry-run=server` needs an API server, which these tests do not have), so lookup's result is
handed to the same named templates by a probe template instead. Probes are HTTP /healthz on the
metrics port (kubelet's gRPC probe cannot pass mutual TLS). The NetworkPolicies are evaluated
over a model of the job's pods, Prometheus, the cluster DNS, the object store and the API
server: which connections each allows (ingress and egress), and which it refuses.

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

import base64
import hashlib
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
from batchplane.operator import partition, podfields
from batchplane.operator.__main__ import parse_args as parse_operator_args
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
#: cert-manager's kinds (tls.mode certManager): no schema in kubernetes-validate; see CERT_MANAGER_SCHEMAS.
CERT_MANAGER_KINDS = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate")}
CUSTOM_KINDS = {
    ("batchplane.dev/v1alpha1", "DataPlane"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    *TRAINER_KINDS,
    *CERT_MANAGER_KINDS,
}
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
SOCKET = "unix:///run/batchplane/socket/constructor.sock"
#: The emptyDir the trainer container and the sidecar share; the socket's folder is made in it
#: by the constructor (mode 2770), never the mount itself (an emptyDir lets every user in).
SOCKET_VOLUME_DIR = "/run/batchplane"
TLS_DIR = "/etc/batchplane/tls"
#: tls.mode issued: where a part reads its projected token and the CA certificate, and the
#: operator the CA's certificate and key.
ISSUER_DIR = "/etc/batchplane/issuer"
ISSUER_CA_DIR = "/etc/batchplane/ca"
TOKEN_ROLES = ("planner", "loader", "constructor", "operator")
HEALTH_PATH = "/healthz"
#: The tls.modes in which the operator issues each pod its own certificate.
ISSUER_MODES = ("issued", "certManager", "existingSecret")
#: Values that make each of them render (existingSecret needs the name of the user's CA Secret).
ISSUER_VALUES = {
    "issued": {},
    "certManager": {"tls": {"mode": "certManager"}},
    "existingSecret": {"tls": {"mode": "existingSecret", "existingSecret": {"ca": "corp-ca"}}},
}
#: The values of each tls.mode's case.
TLS_CASES = {
    "default": "issued",
    "tls-disabled-tokens-values.yaml": "disabled",
    "cp-tp-mesh-values.yaml": "issued",  # operator.enabled false: its operator pods are the issuer alone
    "tls-cert-manager-values.yaml": "certManager",
    "tls-existing-secret-values.yaml": "existingSecret",
    "tls-disabled-values.yaml": "disabled",
}
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
    # validate() reads and parses its schema files (the definitions alone are megabytes of JSON) on
    # every call: read once per session, this file takes 36 s instead of 48 (one process). The
    # parsed schemas are only read by jsonschema.
    kubernetes_validate.utils.schema_contents = functools.cache(kubernetes_validate.utils.schema_contents)
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
    result = run_helm(
        helm, "template", release, chart, "--namespace", NAMESPACE, "--include-crds", "--kube-version", RENDER_KUBE_VERSION, *args
    )
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
    for group in doc["spec"]["sourceGroups"]:  # the CRD's CEL rules
        assert group["maxReplicas"] >= group["minReplicas"], group
    identity = doc["spec"]["loader"].get("identity")
    if identity is not None:
        assert ("caConfigMap" in identity) != ("caSecret" in identity), identity


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
        assert endpoint["port"] in ports, (
            f"ServiceMonitor port {endpoint['port']!r} is not a port of Service {services[0]['metadata']['name']}"
        )


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
def custom_resource(api_version: str, kind: str, spec: dict) -> dict:
    """The schema of a custom resource's outer structure: apiVersion, kind, metadata and `spec`."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": OBJECT_META, "spec": spec},
    }


TRAINER_SCHEMAS = {
    "PyTorchJob": custom_resource(
        "kubeflow.org/v1",
        "PyTorchJob",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "backoffLimit": INT32,
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "ttlSecondsAfterFinished": INT32,
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["Master"],
                    "properties": {
                        "Master": {**PYTORCHJOB_REPLICA, "properties": {**PYTORCHJOB_REPLICA["properties"], "replicas": {"const": 1}}},
                        "Worker": PYTORCHJOB_REPLICA,
                    },
                },
            },
        },
    ),
    "JobSet": custom_resource(
        "jobset.x-k8s.io/v1alpha2",
        "JobSet",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["replicatedJobs"],
            "properties": {
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
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
                            "template": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["spec"],
                                "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
                            },
                        },
                    },
                },
            },
        },
    ),
    "LeaderWorkerSet": custom_resource(
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
        {
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
    ),
}


def validate_trainer_kind(doc: dict, version: str, kv: Any) -> None:
    """An example trainer's custom kind: its outer structure against TRAINER_SCHEMAS, every pod
    template it holds strictly as a core PodTemplate (a JobSet's Jobs as batch/v1 Jobs)."""
    jsonschema.Draft7Validator(TRAINER_SCHEMAS[doc["kind"]]).validate(doc)
    wrapped = []
    if doc["kind"] == "JobSet":
        for job in doc["spec"]["replicatedJobs"]:
            wrapped.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": f"{doc['metadata']['name']}-{job['name']}-0"},
                    "spec": job["template"]["spec"],
                }
            )
    else:
        for where, tpl in pod_templates(doc):
            wrapped.append(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{where.rsplit('.', 2)[-2].lower()}"},
                    "template": tpl,
                }
            )
    for obj in wrapped:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata']['name']}: a pod template is invalid for Kubernetes {version}: {path}: {exc.message}"
            ) from None


#: cert-manager's key usages (cert-manager.io/v1 KeyUsage).
CERT_MANAGER_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement", "data encipherment",
    "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth", "client auth", "code signing",
    "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
]  # fmt: skip
GO_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
ISSUER_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}, "kind": {"type": "string"}, "group": {"type": "string"}},
}
#: The parts of cert-manager.io/v1 Issuer and Certificate the chart uses, with cert-manager's
#: field names, enums and required fields. kubernetes-validate has no schema of cert-manager's
#: kinds (and its CRDs are not available offline), so this structure check, and the chains and
#: SANs test_cert_manager_resources checks, stand in for the API server's validation.
CERT_MANAGER_SCHEMAS = {
    "Issuer": custom_resource(
        "cert-manager.io/v1",
        "Issuer",
        {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 1,  # exactly one issuer type
            "properties": {
                "selfSigned": {"type": "object", "additionalProperties": False, "properties": {"crlDistributionPoints": {"type": "array"}}},
                "ca": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["secretName"],
                    "properties": {"secretName": {"type": "string", "minLength": 1}},
                },
            },
        },
    ),
    "Certificate": custom_resource(
        "cert-manager.io/v1",
        "Certificate",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["secretName", "issuerRef"],
            "properties": {
                "secretName": {
                    "type": "string",
                    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                    "maxLength": 253,
                },
                "secretTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"labels": LABELS, "annotations": LABELS},
                },
                "isCA": {"type": "boolean"},
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {
                    "type": "array",
                    "items": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                },
                "uris": {"type": "array", "items": {"type": "string", "format": "uri"}},
                "usages": {"type": "array", "items": {"enum": CERT_MANAGER_USAGES}, "uniqueItems": True},
                "duration": GO_DURATION,
                "renewBefore": GO_DURATION,
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                },
                "issuerRef": ISSUER_REF,
            },
        },
    ),
}


def go_duration_s(text: str) -> float:
    """A Go duration ("2160h", "1h30m") in seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ns|us|µs|ms|s|m|h)", text))


def validate_cert_manager(doc: dict) -> None:
    """A cert-manager Issuer or Certificate: its structure (CERT_MANAGER_SCHEMAS) and what
    cert-manager's webhook refuses beyond it."""
    jsonschema.Draft7Validator(CERT_MANAGER_SCHEMAS[doc["kind"]]).validate(doc)
    if doc["kind"] == "Certificate":
        spec = doc["spec"]
        key = spec.get("privateKey", {})
        if key.get("algorithm") == "ECDSA":
            assert key.get("size", 256) in (256, 384, 521), key
        if "renewBefore" in spec:
            assert go_duration_s(spec["renewBefore"]) < go_duration_s(spec.get("duration", "2160h")), spec
        assert spec.get("isCA") or spec.get("dnsNames") or spec.get("uris") or spec.get("commonName"), "a Certificate names something"


def validate_document(doc: dict, docs: list[dict], version: str, kv: Any) -> str:
    """Validates one rendered document; returns how (for the resource list)."""
    if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
        if doc["kind"] == "DataPlane":
            validate_dataplane(doc)
            return "CRD schema"
        if (doc["apiVersion"], doc["kind"]) in CERT_MANAGER_KINDS:
            validate_cert_manager(doc)
            return "structure (cert-manager)"
        if (doc["apiVersion"], doc["kind"]) in TRAINER_KINDS:
            validate_trainer_kind(doc, version, kv)
            return "structure + k8s pod templates"
        validate_service_monitor(doc, docs)
        return "structure"
    try:
        return "k8s " + kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(
            f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {path}: {exc.message}"
        ) from None


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
    assert set(group["sources"]["items"]["properties"]) == {"name", "path", "tokenColumn", "transform", "repeat", "costSecondsPerSample"}
    repeat = group["sources"]["items"]["properties"]["repeat"]
    assert (repeat["type"], repeat["minimum"]) == ("integer", 1)
    assert props["mixture"]["x-kubernetes-preserve-unknown-fields"] is True
    assert set(props["mesh"]["properties"]) == {"dp", "cp", "tp", "pp"}
    assert set(props["batch"]["properties"]) == {"globalBatchSize", "microbatches"}
    assert {"intervalSeconds", "consecutiveIntervals", "threshold", "cooldownSeconds"} <= set(props["scaling"]["properties"])
    loader = props["loader"]["properties"]
    assert {"tls", "authTokens", "identity"} <= set(loader)
    identity = loader["identity"]  # tls.mode issued and certManager: certificates from the operator's issuer
    assert identity["required"] == ["issuer"]
    assert set(identity["properties"]) == {"issuer", "caConfigMap", "caSecret", "audience", "tokenExpirationSeconds"}
    assert identity["x-kubernetes-validations"] == [
        {"rule": "has(self.caConfigMap) != has(self.caSecret)", "message": "exactly one of caConfigMap and caSecret"}
    ]
    assert identity["properties"]["tokenExpirationSeconds"]["minimum"] == 600  # Kubernetes' shortest projected token
    status = schema["properties"]["status"]["properties"]
    assert set(status["groups"]["items"]["properties"]) == {"name", "replicas", "desiredReplicas"}
    assert status["observedMixture"]["additionalProperties"] == {"type": "number"}
    assert status["conditions"]["items"]["required"] == ["type", "status", "lastTransitionTime", "reason", "message"]


def test_crd_accepts_an_operator_status_and_refuses_bad_ones(docs: list[dict]) -> None:
    dataplane = one(docs, "DataPlane")
    names = [s["name"] for g in dataplane["spec"]["sourceGroups"] for s in g["sources"]]
    dataplane["status"] = {
        "observedGeneration": 3,
        "groups": [
            {"name": g["name"], "replicas": g["minReplicas"], "desiredReplicas": g["maxReplicas"]}
            for g in dataplane["spec"]["sourceGroups"]
        ],
        "observedMixture": {name: 1 / len(names) for name in names},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
                "reason": "LoadersReady",
                "message": "all loader groups are serving",
                "observedGeneration": 3,
            }
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


def test_every_container_is_locked_down(docs: list[dict], case: str) -> None:
    seen = 0
    example_uid = load_values(case)["example"]["runAsUser"]
    for where, meta, spec in pod_specs(docs):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == RUN_AS_USER and pod["seccompProfile"] == {"type": "RuntimeDefault"}, (
            where
        )
        assert pod["fsGroup"] == RUN_AS_USER, where  # the group of the mounted Secrets (0440) and of the socket folder
        trainer_pod = meta.get("labels", {}).get("app.kubernetes.io/component") == "trainer"
        for c in containers(spec):
            ctx = c.get("securityContext", {})
            # an example trainer runs as another UID than its sidecar: it enters the socket's
            # folder through the pod's fsGroup alone
            uid = example_uid if trainer_pod and c["name"] != "batchplane-constructor" else RUN_AS_USER
            wrong = {k: ctx.get(k) for k, v in (CONTAINER_SECURITY | {"runAsUser": uid}).items() if ctx.get(k) != v}
            assert not wrong, f"{where} container {c['name']}: {wrong}"
            if trainer_pod and c["name"] != "batchplane-constructor":
                assert uid != RUN_AS_USER and ctx["runAsGroup"] != pod["fsGroup"], (
                    f"{where}: the example trainer shares the sidecar's UID or GID"
                )
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
    # each source as the values write it: how it is read, and how many passes per epoch (repeat,
    # which the planner plans by; the DataPlane carries it too, as it does tokenColumn)
    valued = [s for g in values["sourceGroups"] for s in g["sources"]]
    planned = [s for g in dataplane["sourceGroups"] for s in g["sources"]]
    for config, source, in_dataplane in zip(job.sources, valued, planned):
        assert (config.token_column, config.transform) == (source.get("tokenColumn", "input_ids"), source.get("transform"))
        assert (dict(config.transform_args), config.columns) == (
            source.get("transformArgs", {}),
            tuple(source["columns"]) if "columns" in source else None,
        )
        assert config.repeat == source.get("repeat", 1) == in_dataplane.get("repeat", 1)
    # loader group g (the operator's --index g) serves exactly the sources of sourceGroups[g]
    assert [[job.source_names[k] for k in job.loader_sources(g)] for g in range(job.loader_count)] == [
        [s["name"] for s in group["sources"]] for group in dataplane["sourceGroups"]
    ]
    assert dataclasses.asdict(job.mesh) | {"order": None} == {**dataplane["mesh"], "order": None}
    assert (job.batch.global_batch_size, job.batch.microbatches) == (
        dataplane["batch"]["globalBatchSize"],
        dataplane["batch"]["microbatches"],
    )
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


def test_partition_values_carry_repeat_into_job_yaml(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """`batchplane partition --format values` of a profile that upsamples a source (repeat 3),
    installed with the chart: job.yaml's source has repeat 3 (what the planner plans by), the
    DataPlane carries it within its CRD, and a source without it stays at 1."""
    profiles = partition.profiles_from_mapping(
        {
            "job": "j",
            "sources": [
                {"name": "small", "path": "/data/small", "state_bytes": 1 << 20, "transform_s_per_sample": 1e-3, "repeat": 3},
                {"name": "large", "path": "/data/large", "state_bytes": 1 << 20, "transform_s_per_sample": 1e-3},
            ],
        }
    )
    result = partition.partition(profiles.sources, partition.PartitionSettings(pod_memory_bytes=8 << 30, pod_cpus=4))
    values = partition.to_values(result)
    assert {s["name"]: s.get("repeat") for g in values["sourceGroups"] for s in g["sources"]} == {"small": 3, "large": None}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    docs = template(helm, "-f", path)
    (tmp_path / "job").mkdir()
    job = job_from_configmap(docs, tmp_path / "job")
    assert {s.name: s.repeat for s in job.sources} == {"small": 3, "large": 1}
    assert yaml.safe_load(one(docs, "ConfigMap", "-job")["data"]["job.yaml"])["sources"][job.source_names.index("small")]["repeat"] == 3
    dataplane = one(docs, "DataPlane")
    validate_dataplane(dataplane)
    assert {s["name"]: s.get("repeat") for g in dataplane["spec"]["sourceGroups"] for s in g["sources"]} == {"small": 3, "large": None}


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
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("grpc", 50051, "grpc"),
        ("metrics", 9100, "metrics"),
    }
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
            assert operator["args"][1:3] == ["--namespace", "$(POD_NAMESPACE)"]
            assert env_of(operator)["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
            settings = operator_settings(docs)  # the operator's own parser reads them
            assert settings.namespace == NAMESPACE and settings.metrics_port == 9100
            # it reconciles (reading Prometheus) where operator.enabled, else it is the issuer alone
            assert settings.reconcile is bool(settings.prometheus) is ("--no-reconcile" not in operator["args"])
            assert settings.reconcile or settings.issuer is not None


# ---- transport security -------------------------------------------------------------------------


def secret_volume(spec: dict, c: dict, path: str) -> tuple[dict, dict]:
    """(mount, volume) of the Secret container `c` mounts at `path`."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    found = [(m, volumes[m["name"]]) for m in c.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(found) == 1, f"{c['name']}: expected one mount at {path}, found {found}"
    mount, volume = found[0]
    assert "secret" in volume, f"{c['name']}: {path} is not a Secret: {volume}"
    return mount, volume


def check_token_secret(data: dict[str, str]) -> None:
    """The chart's tokens Secret: each role's token and, as `<role>.sha256`, its SHA-256 in hex."""
    assert set(data) == set(TOKEN_ROLES) | {f"{r}.sha256" for r in TOKEN_ROLES}
    for r in TOKEN_ROLES:
        assert base64.b64decode(data[f"{r}.sha256"]).decode() == hashlib.sha256(base64.b64decode(data[r])).hexdigest()


def operator_settings(docs: list[dict]) -> Any:
    """The operator's command line as its own parser reads it (after the kubelet expanded
    $(POD_NAMESPACE) and $(POD_NAME)); None without an operator."""
    found = [d for d in all_of(docs, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    if not found:
        return None
    (c,) = found[0]["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "operator"
    return parse_operator_args([a.replace("$(POD_NAMESPACE)", NAMESPACE).replace("$(POD_NAME)", "op-0") for a in c["args"][1:]], {})


def signing_ca_secret(values: Mapping[str, Any], fullname: str) -> str | None:
    """The Secret of the CA the operator signs with, by tls.mode: issued the Helm-made root,
    certManager cert-manager's intermediate, existingSecret the user's; None without an issuer."""
    return {
        "issued": f"{fullname}-ca",
        "certManager": f"{fullname}-issuer-ca",
        "existingSecret": values["tls"]["existingSecret"]["ca"],
    }.get(values["tls"]["mode"])


def operator_ca_volume(docs: list[dict]) -> dict:
    """The operator pod's one Secret volume: the CA it signs with (--issuer-ca-dir)."""
    pod = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    return volume


def check_issued(c: dict, spec: dict, docs: list[dict], *, role: str, settings: ProcessSettings) -> None:
    """tls.mode issued, certManager or existingSecret (the DataPlane's spec.loader.identity):
    container `c` asks the operator's issuer (the operator Service's issuer port) for its
    certificate and writes it into an in-memory emptyDir of its pod; it proves who it is with the
    pod's projected ServiceAccount token for the issuer's audience and verifies the issuer by the
    CA certificate, both read-only: issued, the ConfigMap `<name>-ca` (no key); certManager and
    existingSecret, the key ca.crt (the root) of the Secret of the CA the operator signs with
    (cert-manager's intermediate, or the user's), that key alone (the kubelet projects no other:
    never its tls.key); and its pod runs as a ServiceAccount the operator's --issuer-role gives
    `role`."""
    identity = one(docs, "DataPlane")["spec"]["loader"]["identity"]
    issuer = operator_settings(docs).issuer
    service = one(docs, "Service", "-operator")
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "issuer"]
    assert settings.issuer == identity["issuer"] == f"{service['metadata']['name']}.{NAMESPACE}.svc:{port['port']}", c["args"]
    assert port["port"] == issuer.port
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert settings.tls_dir == pathlib.Path(TLS_DIR) and not mounts[TLS_DIR].get("readOnly"), "the part writes its certificate there"
    assert volumes[mounts[TLS_DIR]["name"]]["emptyDir"]["medium"] == "Memory"
    assert settings.issuer_token_file.parent == settings.issuer_ca.parent == pathlib.Path(ISSUER_DIR)
    mount = mounts[ISSUER_DIR]
    assert mount["readOnly"] is True and "subPath" not in mount
    projected = volumes[mount["name"]]["projected"]
    tokens = [source["serviceAccountToken"] for source in projected["sources"] if "serviceAccountToken" in source]
    anchors = [source for source in projected["sources"] if "serviceAccountToken" not in source]
    assert len(tokens) == len(anchors) == 1 and len(projected["sources"]) == 2, projected
    assert projected["defaultMode"] == 0o440
    assert tokens[0] == {
        "audience": issuer.policy.audience,
        "expirationSeconds": identity["tokenExpirationSeconds"],
        "path": settings.issuer_token_file.name,
    }
    assert identity["audience"] == issuer.policy.audience
    only_the_certificate = [{"key": "ca.crt", "path": settings.issuer_ca.name}]
    if "caSecret" in identity:  # the root, from the Secret of the CA the operator signs with
        assert anchors[0] == {"secret": {"name": identity["caSecret"], "items": only_the_certificate}}
        assert "caConfigMap" not in identity
        assert identity["caSecret"] == operator_ca_volume(docs)["secret"]["secretName"]  # the CA the operator signs with
        written_by = [d for d in all_of(docs, "Certificate") if d["spec"]["secretName"] == identity["caSecret"]]
        if written_by:  # certManager: the intermediate CA cert-manager issues
            assert len(written_by) == 1 and written_by[0]["spec"]["isCA"] is True
        else:  # existingSecret: the user's CA, which the chart neither makes nor needs to see
            assert not all_of(docs, "Certificate") and identity["caSecret"] not in {d["metadata"]["name"] for d in all_of(docs, "Secret")}
    else:  # issued: the Helm-made CA's certificate, alone in a ConfigMap
        assert anchors[0] == {"configMap": {"name": identity["caConfigMap"], "items": only_the_certificate}}
        ca = [d for d in all_of(docs, "ConfigMap") if d["metadata"]["name"] == identity["caConfigMap"]]
        assert len(ca) == 1 and set(ca[0]["data"]) == {"ca.crt"} and "PRIVATE KEY" not in ca[0]["data"]["ca.crt"]
    account = spec.get("serviceAccountName", "default")
    assert issuer.policy.roles.get(account) == role, f"{c['name']}: ServiceAccount {account} is not one the issuer gives the {role} role"


def check_security(c: dict, spec: dict, docs: list[dict], *, role: str, server: bool) -> None:
    """Container `c` (a part of `role`) gets the transport security the chart's DataPlane says the
    job has (spec.loader.identity: TLS from the issuer, check_issued; spec.loader.authTokens:
    tokens), through its flags as the services' own parser reads them, each Secret mounted by
    items (never subPath: a subPath mount never sees a renewed file) and readable by the pod's
    fsGroup only."""
    loader = one(docs, "DataPlane")["spec"]["loader"]
    assert "tls" not in loader, "a certificate Secret shared by every loader pod"
    tokens = "authTokens" in loader
    settings = part_settings(c, c["args"][0])
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in c.get("volumeMounts", []):
        if "secret" in volumes[m["name"]]:
            assert "subPath" not in m and "subPathExpr" not in m, f"{c['name']}: Secret {m['name']} mounted with subPath"
            assert m.get("readOnly") is True and volumes[m["name"]]["secret"]["defaultMode"] == 0o440, m
    secrets = {d["metadata"]["name"]: d for d in all_of(docs, "Secret")}
    if "identity" in loader:
        check_issued(c, spec, docs, role=role, settings=settings)
    else:
        assert settings.tls_dir is None and not any(v["name"] == "batchplane-tls" for v in spec["volumes"]), c["args"]
        assert settings.issuer is None, c["args"]
    if tokens:
        secret = loader["authTokens"]["secretName"]
        if secret in secrets:  # the chart's Secret: each role's token and its verifier
            check_token_secret(secrets[secret]["data"])
        # the chart's or auth.tokens.existingSecret alike: each role's token and verifier, mounted by items
        assert loader["authTokens"].get("verifiers", False) is True
        if server:  # its own token to present, and what it accepts: the verifiers, never another role's token
            assert settings.auth_tokens == pathlib.Path("/etc/batchplane/auth-tokens")
            _, volume = secret_volume(spec, c, str(settings.auth_tokens))
            assert volume["secret"]["secretName"] == secret
            keys = [role, *(f"{r}.sha256" for r in TOKEN_ROLES)]
            assert volume["secret"]["items"] == [{"key": k, "path": k} for k in keys]
            assert settings.token_file == settings.auth_tokens / role
        else:  # only its own role's token
            assert settings.auth_tokens is None
            _, volume = secret_volume(spec, c, str(settings.token_file.parent))
            assert volume["secret"]["secretName"] == secret
            assert volume["secret"]["items"] == [{"key": role, "path": settings.token_file.name}] and settings.token_file.name == role
    else:
        assert settings.auth_tokens is None and settings.token_file is None, c["args"]


def loader_deployments(docs: list[dict]) -> list[dict]:
    """The loader Deployments the operator makes of the chart's DataPlane."""
    from batchplane.operator.dataplane import parse_dataplane
    from batchplane.operator.manifests import loader_deployment

    obj = copy.deepcopy(one(docs, "DataPlane"))
    obj["metadata"] |= {"uid": "uid-from-the-api-server", "generation": 1}
    spec = parse_dataplane(obj)
    return [loader_deployment(spec, group, replicas=group.min_replicas) for group in spec.groups]


def test_every_part_gets_its_transport_security(docs: list[dict], case: str, tmp_path: pathlib.Path) -> None:
    """Whatever tls.mode: job.yaml's network.tls, and every part's certificate and token flags
    backed by mounted Secrets (the planner's and the operator-made loaders'; the sidecar's in
    check_trainer_pod); the operator, which makes no gRPC call, gets none."""
    values = load_values(case)
    mode = values["tls"]["mode"]
    job = job_from_configmap(docs, tmp_path)
    assert job.network.tls is (mode != "disabled")
    loader = one(docs, "DataPlane")["spec"]["loader"]
    assert "tls" not in loader and ("identity" in loader) is (mode in ISSUER_MODES)
    assert ("authTokens" in loader) is values["auth"]["tokens"]["enabled"]
    planner = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
    check_security(planner["containers"][0], planner, docs, role="planner", server=True)
    for d in loader_deployments(docs):
        pod = d["spec"]["template"]["spec"]
        check_security(pod["containers"][0], pod, docs, role="loader", server=True)
        # the issuer names a loader pod by its group's index (this label), its name and account
        index = pod["containers"][0]["args"][pod["containers"][0]["args"].index("--index") + 1]
        assert d["spec"]["template"]["metadata"]["labels"].get("batchplane.dev/group-index") == (index if mode in ISSUER_MODES else None)
    fullname = one(docs, "DataPlane")["metadata"]["name"]
    for doc in all_of(docs, "Deployment"):
        if doc["metadata"]["name"].endswith("-operator"):
            pod = doc["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            secrets = [v for v in pod["volumes"] if "secret" in v]
            issuer = operator_settings(docs).issuer
            assert "--tls-dir" not in c["args"]
            if mode not in ISSUER_MODES:
                assert not secrets and issuer is None
                continue
            # the issuer: the CA's certificate and key from its Secret, which no other pod mounts:
            # issued, the Helm-made CA; certManager, the intermediate CA cert-manager issues;
            # existingSecret, the user's
            (volume,) = secrets
            assert volume["secret"] == {
                "secretName": signing_ca_secret(values, fullname),
                "defaultMode": 0o440,
                "items": [{"key": "tls.crt", "path": "ca.crt"}, {"key": "tls.key", "path": "ca.key"}],
            }
            assert [m for m in c["volumeMounts"] if m["name"] == volume["name"]] == [
                {"name": volume["name"], "mountPath": str(issuer.ca_dir), "readOnly": True}
            ]
            assert issuer.ca_dir == pathlib.Path(ISSUER_CA_DIR)
            assert {p["name"]: p["containerPort"] for p in c["ports"]}["issuer"] == issuer.port == values["tls"]["issued"]["port"]
            assert issuer.lifetime_s == values["tls"]["issued"]["lifetimeSeconds"]
            assert (issuer.policy.namespace, issuer.policy.audience) == (NAMESPACE, values["tls"]["issued"]["audience"])
            assert issuer.policy.index_from == values["constructor"]["indexFrom"] and issuer.policy.trainer_pods == job.constructor_count
            extra = values["tls"]["issued"]["constructorServiceAccounts"]
            assert sorted(r for r in issuer.policy.roles.values()) == sorted(
                ["planner", "loader", "constructor", *["constructor"] * len(extra)]
            )


def test_only_the_operator_can_read_the_ca_key(docs: list[dict], case: str) -> None:
    """Whatever tls.mode, no pod mounts a CA's key (it mints any identity of the job) but, with
    tls.mode issued, certManager or existingSecret, the operator, which signs with it (issued: the
    Helm-made CA `<name>-ca`; certManager: the intermediate `<name>-issuer-ca`; the chart's own
    root of certManager, `<name>-ca`, no pod at all; existingSecret: the user's,
    tls.existingSecret.ca). In those modes no other pod mounts any key of any Secret (no other
    role's token, no shared certificate) but, with certManager and existingSecret, the key ca.crt
    of the operator's CA Secret (the root: a certificate, no key)."""
    values = load_values(case)
    mode = values["tls"]["mode"]
    fullname = one(docs, "DataPlane")["metadata"]["name"]
    signing = signing_ca_secret(values, fullname)
    cas = {f"{fullname}-ca", f"{fullname}-issuer-ca", *([signing] if signing else [])}
    pods = [(where, spec) for where, _, spec in pod_specs(docs)]
    pods += [(f"Deployment/{d['metadata']['name']}", d["spec"]["template"]["spec"]) for d in loader_deployments(docs)]
    key_holders, projected = [], {}  # who may read a CA's key; pod -> (Secret, its keys) it projects
    for where, spec in pods:
        for v in spec["volumes"]:
            sources = [v["secret"] | {"name": v["secret"]["secretName"]}] if "secret" in v else []
            sources += [s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
            for source in sources:
                keys = {item["key"] for item in source["items"]} if "items" in source else {"(every key)"}
                projected.setdefault(where, set()).add((source["name"], frozenset(keys)))
                if source["name"] in cas and keys != {"ca.crt"}:
                    key_holders.append((where, source["name"]))
    operator = f"Deployment/{fullname}-operator"
    assert key_holders == ([(operator, signing)] if signing else [])
    if signing:
        anchored = mode != "issued"  # the pods' trust anchor: the key ca.crt of the signing CA's Secret
        others = {pair for where, pairs in projected.items() if where != operator for pair in pairs}
        assert others == ({(signing, frozenset({"ca.crt"}))} if anchored else set()), others
        assert len(projected) == (len(pods) if anchored else 1)  # every pod has the root
    if mode == "issued":
        assert [d["metadata"]["name"] for d in all_of(docs, "Secret")] == [f"{fullname}-ca"]
    elif mode in ISSUER_MODES:
        assert not all_of(docs, "Secret")  # cert-manager writes them (the root's and the operator's CA), or the user


def test_no_probe_speaks_grpc(docs: list[dict]) -> None:
    """kubelet's gRPC probe speaks plaintext and cannot pass mutual TLS: every part is probed
    on GET /healthz of its metrics port (200 while its grpc.health.v1 is SERVING)."""
    pods = [(where, spec) for where, _, spec in pod_specs(docs)]
    pods += [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in loader_deployments(docs)]
    probed = set()
    for where, spec in pods:
        for c in containers(spec):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c:
                    continue
                assert "grpc" not in c[probe], f"{where} {c['name']} {probe}"
                if c["args"][0] in ("planner", "loader", "constructor"):
                    get = c[probe]["httpGet"]
                    port = ports.get(get["port"], get["port"])
                    assert get["path"] == HEALTH_PATH and port == part_settings(c, c["args"][0]).metrics_port, (
                        f"{where} {c['name']} {probe}: {get}"
                    )
                    probed.add(c["args"][0])
    assert {"planner", "loader"} <= probed


@pytest.mark.parametrize("case", sorted(TLS_CASES))
def test_each_tls_mode_renders_what_it_says(helm: pathlib.Path, case: str) -> None:
    """What each tls.mode renders: issued: the CA Secret alone (for the operator), the ConfigMap of
    its certificate, and a ServiceAccount per role; certManager: the same accounts, and instead of
    the CA Secret and ConfigMap the Issuers and the Certificates of the root and of the operator's
    intermediate CA, no Secret, no per-part Certificate; existingSecret: the same accounts and
    nothing else, the operator signing with the user's CA Secret, whose ca.crt the parts trust;
    disabled: nothing and no TLS flag (with auth.tokens the tokens Secret alone)."""
    mode = TLS_CASES[case]
    values = load_values(case)
    docs = template(helm, *values_args(case))
    fullname = one(docs, "DataPlane")["metadata"]["name"]
    secrets = sorted(d["metadata"]["name"] for d in all_of(docs, "Secret"))
    tokens = [f"{fullname}-auth-tokens"] if values["auth"]["tokens"]["enabled"] and not values["auth"]["tokens"]["existingSecret"] else []
    accounts = {d["metadata"]["name"]: d for d in all_of(docs, "ServiceAccount")}
    ca_config_maps = [d for d in all_of(docs, "ConfigMap") if d["metadata"]["name"].endswith("-ca")]
    if mode in ISSUER_MODES:
        assert set(accounts) == {f"{fullname}-{a}" for a in ("operator", "planner", "loader", "trainer")}
        assert all(a["automountServiceAccountToken"] is False for n, a in accounts.items() if not n.endswith("-operator"))
    else:
        assert set(accounts) <= {f"{fullname}-operator"}
    if mode == "issued":
        assert secrets == [f"{fullname}-ca"] and not all_of(docs, "Certificate") and not all_of(docs, "Issuer")
        assert set(one(docs, "ConfigMap", "-ca")["data"]) == {"ca.crt"}
    else:
        assert not ca_config_maps
    if mode == "certManager":
        assert secrets == [] and not values["auth"]["tokens"]["enabled"]
        assert sorted(d["spec"]["secretName"] for d in all_of(docs, "Certificate")) == [f"{fullname}-ca", f"{fullname}-issuer-ca"]
        assert all(d["spec"]["isCA"] for d in all_of(docs, "Certificate"))  # no per-part certificate
    elif mode == "existingSecret":
        assert secrets == [] and not all_of(docs, "Certificate") and not all_of(docs, "Issuer")
        ca = values["tls"]["existingSecret"]["ca"]
        loader = one(docs, "DataPlane")["spec"]["loader"]
        assert loader["identity"]["caSecret"] == operator_ca_volume(docs)["secret"]["secretName"] == ca
        assert "tls" not in loader and "authTokens" not in loader
    elif mode == "disabled":
        assert secrets == tokens and not all_of(docs, "Certificate")
        text = yaml.safe_dump_all([d for d in docs if d["kind"] != "CustomResourceDefinition"])
        assert "--tls-dir" not in text and "batchplane-tls" not in text and ("--token-file" in text) == bool(tokens)
        assert yaml.safe_load(one(docs, "ConfigMap", "-job")["data"]["job.yaml"])["network"] == {
            "host": "0.0.0.0",
            "tls": False,
            "insecure": True,
        }
    if mode != "disabled":
        assert "tls" not in yaml.safe_load(one(docs, "ConfigMap", "-job")["data"]["job.yaml"])["network"]  # on: the default
    for example in [d for d in docs if d["metadata"]["name"].endswith("-example") and d["kind"] == "Job"]:
        tpl = example["spec"]["template"]["spec"]
        check_security(container(tpl, "batchplane-constructor"), tpl, docs, role="constructor", server=False)


def test_existing_secret_mode_is_cert_manager_mode_with_the_users_ca(helm: pathlib.Path) -> None:
    """tls.mode existingSecret renders exactly what certManager does (the same pods, accounts,
    flags, issuer, NetworkPolicies, DataPlane and example trainer) but for cert-manager's Issuers
    and Certificates: where certManager's operator signs with the intermediate `<name>-issuer-ca`,
    existingSecret's signs with the user's Secret (tls.existingSecret.ca, which rendering does not
    need to exist), mounted by the operator alone, and every other pod projects its ca.crt alone."""
    cert_manager = template(helm, "--set", "tls.mode=certManager", "--set", "example.enabled=true")
    existing = template(helm, "--set", "tls.mode=existingSecret", "--set", "tls.existingSecret.ca=corp-ca", "--set", "example.enabled=true")
    fullname = one(existing, "DataPlane")["metadata"]["name"]
    kinds = {(d["apiVersion"], d["kind"]) for d in existing}
    assert {(d["apiVersion"], d["kind"]) for d in cert_manager} - kinds == CERT_MANAGER_KINDS and not kinds & CERT_MANAGER_KINDS
    rest = [d for d in cert_manager if (d["apiVersion"], d["kind"]) not in CERT_MANAGER_KINDS]
    assert yaml.safe_dump_all(existing) == yaml.safe_dump_all(rest).replace(f"{fullname}-issuer-ca", "corp-ca")
    # where the user's Secret is used: the operator's CA volume, and every other pod's trust anchor
    assert operator_ca_volume(existing)["secret"]["secretName"] == "corp-ca"
    assert one(existing, "DataPlane")["spec"]["loader"]["identity"]["caSecret"] == "corp-ca"
    for where, _, spec in pod_specs(existing):
        if not where.endswith("-operator"):
            anchors = [s["secret"] for v in spec["volumes"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
            assert anchors == [{"name": "corp-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}], where


def test_an_existing_tokens_secret_is_mounted_by_items(helm: pathlib.Path, kubernetes_validate: Any) -> None:
    """auth.tokens.existingSecret (bearer tokens, with tls.mode disabled) is mounted as the
    chart's own tokens Secret is, never whole: a server (the planner, every loader the operator
    makes) its own role's key and every role's verifier `<role>.sha256`, the constructor sidecar
    its own key alone; so no pod holds another role's token. The DataPlane says the Secret holds
    verifiers, and the chart makes no tokens Secret of its own."""
    docs = template(helm, "-f", CHART / "ci" / "tls-disabled-tokens-values.yaml", "--set", "auth.tokens.existingSecret=corp-tokens")
    fullname = one(docs, "DataPlane")["metadata"]["name"]
    assert f"{fullname}-auth-tokens" not in {d["metadata"]["name"] for d in all_of(docs, "Secret")}
    assert one(docs, "DataPlane")["spec"]["loader"]["authTokens"] == {"secretName": "corp-tokens", "verifiers": True}
    planner = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
    check_security(planner["containers"][0], planner, docs, role="planner", server=True)
    loaders = [d["spec"]["template"]["spec"] for d in loader_deployments(docs)]
    for pod in loaders:
        check_security(pod["containers"][0], pod, docs, role="loader", server=True)
    example = one(docs, "Job", "-example")["spec"]["template"]["spec"]
    check_security(container(example, "batchplane-constructor"), example, docs, role="constructor", server=False)
    mounted = 0
    for spec in [planner, example, *loaders]:
        volumes = [v["secret"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "corp-tokens"]
        tokens = {item["key"] for v in volumes for item in v["items"] if not item["key"].endswith(".sha256")}
        assert len(volumes) == 1 and len(tokens) == 1, volumes  # by items, one role's token
        mounted += 1
        for version in ("1.30.0", kubernetes_validate.latest_version()):
            template_doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "p"}, "template": {"spec": spec}}
            kubernetes_validate.validate(template_doc, version, strict=True)
    assert mounted == 2 + len(loaders)


def test_default_values_lock_the_job_down(helm: pathlib.Path, kubernetes_validate: Any) -> None:
    """Out of the box: certificates the operator issues each pod (tls.mode issued: the CA's Secret
    for the operator, its certificate for the parts, an account per role, no tokens), and a
    NetworkPolicy with ingress and egress rules for every part the chart runs."""
    docs = template(helm)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    fullname = one(docs, "DataPlane")["metadata"]["name"]
    assert load_values("default")["tls"]["mode"] == "issued" and "identity" in one(docs, "DataPlane")["spec"]["loader"]
    assert [name for kind, name in kinds if kind == "Secret"] == [f"{fullname}-ca"] and ("ConfigMap", f"{fullname}-ca") in kinds
    for account in ("planner", "loader", "trainer"):
        assert ("ServiceAccount", f"{fullname}-{account}") in kinds, account
    for policy in ("planner", "loaders", "operator"):
        doc = one(docs, "NetworkPolicy", f"-{policy}")
        assert doc["spec"]["policyTypes"] == ["Ingress", "Egress"] and doc["spec"]["ingress"] and doc["spec"]["egress"], policy
    for doc in docs:
        if doc["kind"] in ("Secret", "NetworkPolicy", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service"):
            for version in ("1.30.0", kubernetes_validate.latest_version()):
                validate_document(doc, docs, version, kubernetes_validate)


def probe_chart(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    """A copy of the chart with one more template, templates/probe.yaml."""
    chart = tmp_path / "batchplane"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "probe.yaml").write_text(text)
    return chart


def test_the_tokens_are_kept_when_lookup_finds_them(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The tokens Secret: 48 random characters per role, kept when `lookup` finds them (the probe
    stands in for lookup as above); a role missing from the found Secret gets a new token."""
    chart = probe_chart(
        tmp_path,
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: probe\ndata:\n"
        '  {{- include "batchplane.auth.tokensData" (dict "root" . "found" (.Values.global.found | default dict)) | trim | nindent 2 }}\n',
    )

    def render(found: dict) -> dict[str, str]:
        values = tmp_path / "found.yaml"
        values.write_text(yaml.safe_dump({"global": {"found": found}}))
        (doc,) = template(helm, "--show-only", "templates/probe.yaml", "-f", values, chart=chart)
        return doc["data"]

    first = render({})
    check_token_secret(first)
    assert all(re.fullmatch(r"[A-Za-z0-9]{48}", base64.b64decode(first[r]).decode()) for r in TOKEN_ROLES)
    assert len({first[r] for r in TOKEN_ROLES}) == len(TOKEN_ROLES)
    assert render({"data": first}) == first
    partial = render({"data": {k: v for k, v in first.items() if k != "operator"}})
    kept = [k for k in first if not k.startswith("operator")]
    assert {k: partial[k] for k in kept} == {k: first[k] for k in kept} and partial["operator"] != first["operator"]
    check_token_secret(partial)  # the new token's verifier with it
    # and the real template is what hands lookup's result to it
    text = (CHART / "templates" / "auth" / "tokens-secret.yaml").read_text()
    assert 'include "batchplane.auth.tokensData" (dict "root" . "found" (lookup "v1" "Secret" .Release.Namespace $name))' in text


def test_the_issued_mode_ca_is_kept_when_lookup_finds_it(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """tls.mode issued: the Secret <name>-ca (the CA's key, for the operator) and the ConfigMap
    <name>-ca (its certificate alone) hold one self-signed ECDSA P-256 CA, valid
    tls.issued.caValidityDays; what `lookup` finds of the Secret is kept, nothing found makes a
    new one. (A probe template
    stands in for lookup, as above.)"""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    chart = probe_chart(tmp_path, '{{ include "batchplane.tls.issuedCa" (dict "root" . "found" (.Values.global.found | default dict)) }}\n')

    def render(found: dict) -> dict[str, dict]:
        values = tmp_path / "found.yaml"
        values.write_text(yaml.safe_dump({"global": {"found": found}}))
        return {d["kind"]: d for d in template(helm, "--show-only", "templates/probe.yaml", "-f", values, chart=chart)}

    first = render({})
    secret, config_map = first["Secret"], first["ConfigMap"]
    assert secret["metadata"]["name"] == config_map["metadata"]["name"] == f"{RELEASE}-batchplane-ca"
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    pem = base64.b64decode(secret["data"]["tls.crt"])
    assert set(config_map["data"]) == {"ca.crt"} and config_map["data"]["ca.crt"].strip() == pem.decode().strip()
    ca = x509.load_pem_x509_certificate(pem)
    ca.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    key = serialization.load_pem_private_key(base64.b64decode(secret["data"]["tls.key"]), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert key.public_key().public_numbers() == ca.public_key().public_numbers()
    days = (ca.not_valid_after_utc - ca.not_valid_before_utc) / datetime.timedelta(days=1)
    assert abs(days - load_values("default")["tls"]["issued"]["caValidityDays"]) <= 1
    assert render({})["Secret"]["data"] != secret["data"]  # nothing found: a new CA
    kept = render(secret)  # found: kept byte for byte, and the ConfigMap is its certificate
    assert kept["Secret"]["data"] == secret["data"] and kept["ConfigMap"]["data"] == config_map["data"]
    text = (CHART / "templates" / "tls" / "issued-ca.yaml").read_text()
    assert 'include "batchplane.tls.issuedCa" (dict "root" . "found" (lookup "v1" "Secret" .Release.Namespace $name))' in text


@pytest.mark.parametrize("issuer", ["own", "issuerRef"])
def test_cert_manager_resources(helm: pathlib.Path, issuer: str) -> None:
    """tls.mode certManager, with the chart's own CA chain or an existing issuer: every issuerRef
    resolves, the chain is self-signed Issuer -> root CA Certificate -> CA Issuer -> the one
    Certificate of the operator's intermediate CA (isCA, ECDSA P-256 made anew at each renewal,
    tls.certManager's duration and renewBefore); no Certificate per part (that would give every
    loader one shared identity). Its Secret is mounted by the operator alone, as its CA folder
    (tls.crt as ca.crt, tls.key as ca.key); every other pod (the planner, the operator-made loaders,
    the example's trainer pods) projects its key ca.crt (the root) and no other key of any Secret;
    the DataPlane names it as spec.loader.identity.caSecret. (Structure: CERT_MANAGER_SCHEMAS,
    through validate_document.)"""
    args = ["-f", CHART / "ci" / "tls-cert-manager-values.yaml"]
    if issuer == "issuerRef":
        args += ["--set", "tls.certManager.issuerRef.name=corp-ca", "--set", "tls.certManager.issuerRef.kind=ClusterIssuer"]
    docs = template(helm, *args)
    values = load_values("tls-cert-manager-values.yaml")["tls"]["certManager"]
    issuers = {d["metadata"]["name"]: d for d in all_of(docs, "Issuer")}
    certificates = {d["metadata"]["name"]: d for d in all_of(docs, "Certificate")}
    for doc in [*issuers.values(), *certificates.values()]:
        validate_cert_manager(doc)
    fullname = one(docs, "DataPlane")["metadata"]["name"]
    assert all(c["spec"].get("isCA") is True for c in certificates.values()) and not any("uris" in c["spec"] for c in certificates.values())
    intermediate = certificates.pop(f"{fullname}-issuer-ca")
    if issuer == "own":
        (root,) = certificates.values()
        self_signed = issuers[root["spec"]["issuerRef"]["name"]]
        assert root["spec"]["issuerRef"]["kind"] == "Issuer" and self_signed["spec"] == {"selfSigned": {}}
        assert root["spec"]["privateKey"] == {"algorithm": "ECDSA", "size": 256} and go_duration_s(root["spec"]["duration"]) >= 365 * 86400
        assert root["spec"]["secretName"] == f"{fullname}-ca"
        ca_issuers = [i for i in issuers.values() if i["spec"].get("ca", {}).get("secretName") == root["spec"]["secretName"]]
        assert len(ca_issuers) == 1 and len(issuers) == 2
        expected_ref = {"name": ca_issuers[0]["metadata"]["name"], "kind": "Issuer", "group": "cert-manager.io"}
    else:
        assert not issuers and not certificates
        expected_ref = {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    spec = intermediate["spec"]
    assert spec["issuerRef"] == expected_ref and spec["isCA"] is True
    assert spec["usages"] == ["cert sign", "crl sign", "digital signature"]
    assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}  # the issuer signs with EC keys
    assert (spec["duration"], spec["renewBefore"]) == (values["duration"], values["renewBefore"])
    secret = spec["secretName"]
    assert secret == f"{fullname}-issuer-ca"
    # the operator alone mounts it, as its CA folder
    operator = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert operator_ca_volume(docs)["secret"] == {
        "secretName": secret,
        "defaultMode": 0o440,
        "items": [{"key": "tls.crt", "path": "ca.crt"}, {"key": "tls.key", "path": "ca.key"}],
    }
    assert operator_settings(docs).issuer.ca_dir == pathlib.Path(ISSUER_CA_DIR)
    # the others: the root (the key ca.crt) and nothing else of any Secret
    identity = one(docs, "DataPlane")["spec"]["loader"]["identity"]
    assert identity["caSecret"] == secret and "caConfigMap" not in identity
    pods = [(where, pod) for where, _, pod in pod_specs(docs) if pod is not operator]
    pods += [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in loader_deployments(docs)]
    assert {"planner", "loader", "constructor"} <= {c["args"][0] for _, pod in pods for c in containers(pod) if c.get("args")}
    for where, pod in pods:
        assert not [v for v in pod["volumes"] if "secret" in v], where
        sources = [s for v in pod["volumes"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
        assert sources == [{"secret": {"name": secret, "items": [{"key": "ca.crt", "path": "ca.crt"}]}}], where


# ---- network policies ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A pod (namespace and labels) or an address outside the cluster (ip)."""

    name: str
    namespace: str = ""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    namespace_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ip: str = ""


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector ({} selects everything)."""
    if not matches(selector.get("matchLabels") or {}, labels):
        return False
    for req in selector.get("matchExpressions") or []:
        key, op, vals = req["key"], req["operator"], req.get("values", [])
        if (op == "In" and labels.get(key) not in vals) or (op == "NotIn" and labels.get(key) in vals):
            return False
        if (op == "Exists") != (key in labels) and op in ("Exists", "DoesNotExist"):
            return False
    return True


def peer_admits(peer: Mapping[str, Any], policy_namespace: str, other: Endpoint) -> bool:
    """A NetworkPolicyPeer: ipBlock matches addresses outside the cluster (this model gives pods
    no ipBlock match, which implementations leave undefined); pod and namespace selectors match
    pods, a podSelector alone within the policy's namespace."""
    import ipaddress

    if "ipBlock" in peer:
        if not other.ip:
            return False
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if other.ip:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector") or {}, other.labels)


def rule_admits(rule: Mapping[str, Any], direction: str, policy_namespace: str, other: Endpoint, port: int, protocol: str) -> bool:
    peers = rule.get("from" if direction == "Ingress" else "to")
    ports = rule.get("ports")
    if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports):
        return False
    return not peers or any(peer_admits(peer, policy_namespace, other) for peer in peers)


def connects(policies: list[dict], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether `src` may open a connection to `dst`:`port`: allowed out of `src` (no policy
    selecting it has Egress, or one of their egress rules admits `dst`) and into `dst` likewise."""

    def allowed(pod: Endpoint, other: Endpoint, direction: str) -> bool:
        if pod.ip:  # outside the cluster: no policy of ours applies
            return True
        applying = [
            p
            for p in policies
            if p["metadata"]["namespace"] == pod.namespace
            and selects(p["spec"]["podSelector"], pod.labels)
            and direction in p["spec"]["policyTypes"]
        ]
        key = "ingress" if direction == "Ingress" else "egress"
        return not applying or any(
            rule_admits(r, direction, p["metadata"]["namespace"], other, port, protocol) for p in applying for r in p["spec"].get(key, [])
        )

    return allowed(src, dst, "Egress") and allowed(dst, src, "Ingress")


def first_address(cidrs: list[str]) -> str:
    import ipaddress

    return str(next(iter(ipaddress.ip_network(cidrs[0]).hosts()))) if cidrs else ""


NP_CASES = [
    "default",
    "two-groups-values.yaml",
    "tls-existing-secret-values.yaml",
    "tls-cert-manager-values.yaml",
    "example-torchrun-values.yaml",
]


@pytest.mark.parametrize("case", NP_CASES)
def test_network_policies_allow_exactly_the_job_s_traffic(helm: pathlib.Path, case: str) -> None:
    """The NetworkPolicies, evaluated over the job's pods (their rendered labels; loaders as the
    operator labels them), the Prometheus scraper and the cluster DNS (as the values select them),
    a stranger pod in the namespace, the object store and the API server: each part may reach
    exactly what it needs, and nothing else gets in. With tls.mode issued or certManager that
    includes the operator's issuer port, from this release's planner, loaders and trainer pods only."""
    values = load_values(case)
    np = values["networkPolicy"]
    docs = template(helm, *values_args(case))
    policies = all_of(docs, "NetworkPolicy")
    ns = {"kubernetes.io/metadata.name": NAMESPACE}
    pods = {name.split("/")[1].rsplit("-", 1)[1]: meta["labels"] for name, meta, _ in pod_specs(docs)}
    loader_labels = loader_deployments(docs)[0]["spec"]["template"]["metadata"]["labels"]

    def pod(
        name: str, labels: Mapping[str, str], namespace: str = NAMESPACE, namespace_labels: Mapping[str, str] | None = None
    ) -> Endpoint:
        return Endpoint(name, namespace, dict(labels), dict(namespace_labels or {"kubernetes.io/metadata.name": namespace}))

    planner, loader = pod("planner", pods["planner"]), pod("loader", loader_labels)
    operator = pod("operator", pods["operator"]) if "operator" in pods else None
    trainer_labels = {**(values["trainer"]["selectorLabels"] or {"batchplane.dev/trainer": one(docs, "DataPlane")["metadata"]["name"]})}
    user_trainer = pod("user-trainer", trainer_labels)  # a trainer pod of the user's own, with batchplane.trainerLabels
    example = pod("example", pods["example"]) if "example" in pods else None
    stranger = pod("stranger", {"app": "something-else"})
    prom_ns = np["prometheus"]["namespaceSelector"].get("matchLabels", {})
    prometheus = pod(
        "prometheus",
        np["prometheus"]["podSelector"].get("matchLabels", {}),
        prom_ns.get("kubernetes.io/metadata.name", "monitoring"),
        prom_ns,
    )
    other_monitor = pod("not-prometheus", {"app": "grafana"}, prometheus.namespace, prom_ns)
    dns_ns = np["dns"]["namespaceSelector"].get("matchLabels", {})
    dns = pod("dns", np["dns"]["podSelector"].get("matchLabels", {}), dns_ns.get("kubernetes.io/metadata.name", "kube-system"), dns_ns)
    store = Endpoint("object-store", ip=first_address(np["objectStore"]["cidrs"]))
    api = Endpoint("api-server", ip=first_address(np["apiServer"]["cidrs"]))
    elsewhere = Endpoint("elsewhere", ip="203.0.113.9")
    grpc_planner, grpc_loader, metrics = 50051, 50052, 9100

    assert ns == planner.namespace_labels
    # the planner's gRPC port: this DataPlane's loaders and the trainer pods, nobody else
    assert connects(policies, loader, planner, grpc_planner) and connects(policies, user_trainer, planner, grpc_planner)
    for who in (stranger, prometheus, *([operator] if operator else [])):
        assert not connects(policies, who, planner, grpc_planner), who.name
    # the loaders' gRPC port: the planner and the trainer pods
    assert connects(policies, planner, loader, grpc_loader) and connects(policies, user_trainer, loader, grpc_loader)
    for who in (stranger, loader, prometheus):
        assert not connects(policies, who, loader, grpc_loader), who.name
    # metrics: the scraper only
    for part in (planner, loader, *([operator] if operator else [])):
        assert connects(policies, prometheus, part, metrics), part.name
        assert not connects(policies, other_monitor, part, metrics) or not np["prometheus"]["podSelector"], part.name
        assert not connects(policies, stranger, part, metrics), part.name
        # the cluster DNS, and no other egress into the cluster
        assert connects(policies, part, dns, 53, "UDP") and connects(policies, part, dns, 53, "TCP"), part.name
        assert not connects(policies, part, stranger, 80), part.name
    # the object store: the planner (a ledger in a bucket) and the loaders, on its ports only
    for part in (planner, loader):
        assert connects(policies, part, store, np["objectStore"]["ports"][0]) == bool(np["objectStore"]["cidrs"]), part.name
        assert not connects(policies, part, store, 22), part.name
    if np["objectStore"]["cidrs"] != ["0.0.0.0/0"]:
        assert not connects(policies, loader, elsewhere, 443)
    issued, issuer_port = values["tls"]["mode"] in ISSUER_MODES, values["tls"]["issued"]["port"]
    if operator:
        # the issuer (tls.mode issued or certManager): the parts that ask for certificates, nobody else
        for who in (planner, loader, user_trainer, *([example] if example else [])):
            assert connects(policies, who, operator, issuer_port) is issued, who.name
        for who in (stranger, prometheus):
            assert not connects(policies, who, operator, issuer_port), who.name
        assert not connects(policies, planner, operator, metrics)
        for port in np["apiServer"]["ports"]:
            assert connects(policies, operator, api, port)
        assert connects(policies, operator, prometheus, np["prometheus"]["port"])
        assert not connects(policies, operator, planner, grpc_planner) and not connects(policies, operator, loader, grpc_loader)
        if np["apiServer"]["cidrs"] != ["0.0.0.0/0"]:
            assert not connects(policies, operator, elsewhere, 443)
    if example:
        # the example's pods: each other (rendezvous, collectives), the sidecar's egress, its metrics to the scraper
        assert connects(policies, example, example, 29500) and connects(policies, example, example, 12345)
        assert connects(policies, example, planner, grpc_planner) and connects(policies, example, loader, grpc_loader)
        assert connects(policies, prometheus, example, values["constructor"]["metricsPort"])
        assert not connects(policies, stranger, example, values["constructor"]["metricsPort"]) and not connects(
            policies, stranger, example, 29500
        )
        assert not connects(policies, example, stranger, 80) and connects(policies, example, dns, 53, "UDP")
    # every policy is of this release and isolates both ways
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], policy["metadata"]["name"]
    # the ServiceMonitor's Service reaches every part that serves metrics
    if values["serviceMonitor"]["enabled"]:
        service = one(docs, "Service", "-metrics")
        for labels in (pods["planner"], pods["operator"], loader_labels, pods["example"]):
            assert matches(service["spec"]["selector"], labels)


def test_trainer_egress_rules_let_a_user_trainer_reach_its_data(
    helm: pathlib.Path, tmp_path: pathlib.Path, kubernetes_validate: Any
) -> None:
    """A parent chart's own trainer policy with batchplane.trainerEgressRules lets its pods reach
    the planner, the loaders, the issuer (tls.mode issued, the default) and the DNS, and nothing else."""
    chart = probe_chart(
        tmp_path,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: my-trainer\n  namespace: {{ .Release.Namespace }}\n"
        'spec:\n  podSelector:\n    matchLabels:\n      {{- include "batchplane.trainerSelectorLabels" . | nindent 6 }}\n'
        '  policyTypes: [Egress]\n  egress:\n    {{- include "batchplane.trainerEgressRules" . | nindent 4 }}\n',
    )
    docs = template(helm, chart=chart)
    policies = all_of(docs, "NetworkPolicy")
    mine = one(docs, "NetworkPolicy", "my-trainer")
    trainer = Endpoint("t", NAMESPACE, mine["spec"]["podSelector"]["matchLabels"], {"kubernetes.io/metadata.name": NAMESPACE})
    planner = Endpoint(
        "p", NAMESPACE, one(docs, "Deployment", "-planner")["spec"]["template"]["metadata"]["labels"], trainer.namespace_labels
    )
    loader = Endpoint("l", NAMESPACE, loader_deployments(docs)[0]["spec"]["template"]["metadata"]["labels"], trainer.namespace_labels)
    dns = Endpoint("d", "kube-system", {"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"})
    operator = Endpoint(
        "o", NAMESPACE, one(docs, "Deployment", "-operator")["spec"]["template"]["metadata"]["labels"], trainer.namespace_labels
    )
    assert (
        connects(policies, trainer, planner, 50051)
        and connects(policies, trainer, loader, 50052)
        and connects(policies, trainer, operator, 8443)
        and connects(policies, trainer, dns, 53, "UDP")
    )
    assert not connects(policies, trainer, Endpoint("x", ip="203.0.113.9"), 443) and not connects(policies, trainer, operator, 9100)
    kubernetes_validate.validate(mine, RENDER_KUBE_VERSION, strict=True)


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
    # the socket lies in a folder of its own, which the constructor makes (mode 2770) inside
    # the emptyDir that only the two containers mount; the pod's fsGroup lets the trainer in
    socket_folder = pathlib.PurePosixPath(SOCKET.removeprefix("unix://")).parent
    assert socket_folder.parent == pathlib.PurePosixPath(SOCKET_VOLUME_DIR)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in (sidecar, main):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == SOCKET_VOLUME_DIR]
        assert "emptyDir" in volumes[mount["name"]] and not any(m["mountPath"] == str(socket_folder) for m in c["volumeMounts"])
    assert spec["securityContext"]["fsGroup"] >= 1
    # the sidecar's probes: /healthz on its metrics port (its gRPC serves the trainer only, on the socket)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["httpGet"] == {"path": HEALTH_PATH, "port": settings.metrics_port}, probe
    # its transport security, as the job's network.tls asks
    check_security(sidecar, spec, docs, role="constructor", server=False)
    assert not [m for m in main["volumeMounts"] if volumes[m["name"]].get("secret")], (
        "the trainer container mounts no Secret of the sidecar"
    )
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
    (parent / "values.yaml").write_text(
        "batchplane:\n  mesh: {dp: 4, cp: 1, tp: 2, pp: 1, order: tp-cp-dp-pp}\n  trainer: {ranksPerPod: 4}\n"
    )
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
      serviceAccountName: {{ include "batchplane.trainerServiceAccountName" $bp }}
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
    """The operator's Role: what it calls in its namespace to reconcile (operator.enabled), and with
    tls.mode issued, certManager or existingSecret reading the pods that ask for certificates (an
    issuer alone, operator.enabled false, nothing else); cluster-wide only the issuer's
    TokenReviews."""
    issued = load_values(case)["tls"]["mode"] in ISSUER_MODES
    reconciles = load_values(case)["operator"]["enabled"]
    if not issued:
        assert not all_of(docs, "ClusterRole") and not all_of(docs, "ClusterRoleBinding")
    if not (reconciles or issued):
        assert not [d for d in docs if d["metadata"]["name"].endswith("-operator")]
        return
    role = one(docs, "Role", "-operator")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]}
    reconciling = {
        (("batchplane.dev",), ("dataplanes",), ("get", "list")),
        (("batchplane.dev",), ("dataplanes/status",), ("patch",)),
        (("batchplane.dev",), ("dataplanes/finalizers",), ("update",)),
        (("apps",), ("deployments",), ("create", "delete", "get", "list", "patch")),
        (("apps",), ("deployments/scale",), ("patch",)),
        (("coordination.k8s.io",), ("leases",), ("create",)),  # leader election: its Lease, and only that one
        (("coordination.k8s.io",), ("leases",), ("get", "patch")),
        (("",), ("events",), ("create", "patch")),  # Events on the DataPlanes
    }
    assert rules == (reconciling if reconciles else set()) | ({(("",), ("pods",), ("get",))} if issued else set())
    args = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    named = [r for r in role["rules"] if r.get("resourceNames")]
    if reconciles:
        assert [(r["resources"], r["resourceNames"]) for r in named] == [(["leases"], [args[args.index("--lease-name") + 1]])]
    else:
        assert not named and "--no-reconcile" in args and "--lease-name" not in args
    binding = one(docs, "RoleBinding", "-operator")
    account = one(docs, "ServiceAccount", "-operator")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    if issued:  # TokenReviews are cluster-scoped: one ClusterRole that may create them and nothing else
        (cluster_role,) = all_of(docs, "ClusterRole")
        (cluster_binding,) = all_of(docs, "ClusterRoleBinding")
        assert cluster_role["rules"] == [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}]
        assert NAMESPACE in cluster_role["metadata"]["name"]  # shared by every namespace
        assert cluster_binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": cluster_role["metadata"]["name"],
        }
        assert cluster_binding["subjects"] == binding["subjects"]
    operator = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert operator["serviceAccountName"] == account["metadata"]["name"]
    for where, _, spec in pod_specs(docs):  # nothing else talks to the API server
        if spec is not operator:
            assert spec.get("automountServiceAccountToken") is False, where


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
    assert ("WARNING: planner.ledger.persistence.enabled is false" in text) == (
        not ledger["persistence"]["enabled"] and not ledger["location"]
    )
    if load_values(case)["example"]["enabled"]:
        assert (
            f"Example trainer ({load_values(case)['example']['kind']}, index from {load_values(case)['constructor']['indexFrom']})" in text
        )
    # what is on and what is off, loudly where it is off
    values = load_values(case)
    mode = values["tls"]["mode"]
    assert ("WARNING: TLS IS DISABLED" in text) == (mode == "disabled")
    assert ("as its certificate issuer alone" in text) == (mode in ISSUER_MODES and not values["operator"]["enabled"])
    assert (f"tls.mode {mode}" in text) and ("nothing stands in its way" in text) == (
        mode == "disabled" and not values["networkPolicy"]["enabled"]
    )
    assert ("WARNING: networkPolicy.enabled is false" in text) == (not values["networkPolicy"]["enabled"])
    if mode in ISSUER_MODES:
        fullname = one(template(helm, *values_args(case)), "DataPlane")["metadata"]["name"]
        assert f"port {values['tls']['issued']['port']} of Service {fullname}-operator" in text
        assert f"pods as {fullname}-trainer" in text
        assert (f"ConfigMap {fullname}-ca" in text) is (mode == "issued")
        signing = signing_ca_secret(values, fullname)
        assert (f"Secret {signing} is mounted by the operator" in text) is (mode != "issued")
        assert ("The operator signs with your CA" in text) is (mode == "existingSecret")
    assert 'serviceAccountName: {{ include "batchplane.trainerServiceAccountName" . }}' in text
    assert ("Bearer tokens: Secret" in text) == values["auth"]["tokens"]["enabled"]


# ---- values the chart must refuse ------------------------------------------------------------------

GROUP = {"name": "text", "sources": [{"name": "web", "path": "/data/web"}], "minReplicas": 1, "maxReplicas": 2}

SCHEMA_ERRORS = [
    ({"sourceGroups": [dict(GROUP, minReplicas=-1)]}, "sourceGroups.0.minReplicas"),
    ({"sourceGroups": [dict(GROUP, name="Text_Group")]}, "sourceGroups.0.name"),
    ({"sourceGroups": [dict(GROUP, sources=[{"name": "bad name", "path": "/d"}])]}, "sourceGroups.0.sources.0.name"),
    ({"sourceGroups": [dict(GROUP, replicas=3)]}, "replicas"),
    ({"sourceGroups": [dict(GROUP, sources=[{"name": "web", "path": "/d", "repeat": 0}])]}, "sourceGroups.0.sources.0.repeat"),
    ({"sourceGroups": [dict(GROUP, sources=[{"name": "web", "path": "/d", "repeat": "x"}])]}, "sourceGroups.0.sources.0.repeat"),
    ({"sourceGroups": [dict(GROUP, sources=[{"name": "web", "path": "/d", "repeat": True}])]}, "sourceGroups.0.sources.0.repeat"),
    ({"sourceGroups": [dict(GROUP, sources=[{"name": "web", "path": "/d", "repeat": 1.5}])]}, "sourceGroups.0.sources.0.repeat"),
    ({"sourceGroups": []}, "sourceGroups"),
    ({"mesh": {"dp": 0}}, "mesh.dp"),
    ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    ({"replicaCount": 3}, "replicaCount"),
    ({"job": {"epochs": 0}}, "job.epochs"),
    ({"securityContext": {"runAsUser": 0}}, "securityContext.runAsUser"),
    ({"mixture": {"weights": {"web": -1}}}, "mixture.weights.web"),
    ({"strategy": "plan.txt"}, "strategy"),
    # the pod fields: Kubernetes' own schema (batchplane.operator.kube_types), through values.schema.json
    (
        {"loader": {"env": [{"name": "A", "valueFrom": {"secretKeyRf": {"name": "s", "key": "k"}}}]}},
        "loader.env.0.valueFrom: Additional property secretKeyRf",
    ),
    ({"loader": {"tolerations": [{"key": "k", "efect": "NoSchedule"}]}}, "loader.tolerations.0: Additional property efect"),
    ({"loader": {"affinity": {"nodeAfinity": {}}}}, "loader.affinity: Additional property nodeAfinity"),
    ({"loader": {"volumes": [{"name": "d", "emptyDir": {"sizeLimit": True}}]}}, "loader.volumes.0.emptyDir.sizeLimit"),
    ({"loader": {"serviceAccountName": "Not_A_Name"}}, "loader.serviceAccountName"),
    ({"planner": {"envFrom": [{"secretRef": {"nme": "x"}}]}}, "planner.envFrom.0.secretRef: Additional property nme"),
    ({"planner": {"ledger": {"location": "/var/ledger"}}}, "planner.ledger.location"),
    ({"constructor": {"indexFrom": "statefulset"}}, "constructor.indexFrom"),
    ({"example": {"kind": "mpijob"}}, "example.kind"),
    ({"tls": {"mode": "selfSigned"}}, "tls.mode"),
    ({"tls": {"certManager": {"duration": "90d"}}}, "tls.certManager.duration"),
    ({"tls": {"certManager": {"issuerRef": {"kind": "Issuer"}}}}, "tls.certManager.issuerRef"),
    ({"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "Issuers"}}}}, "tls.certManager.issuerRef.kind"),
    ({"tls": {"existingSecret": {"ca": "Not_A_Secret"}}}, "tls.existingSecret.ca"),
    ({"tls": {"existingSecret": {"operator": "x"}}}, "tls.existingSecret: Additional property operator"),
    ({"auth": {"tokens": {"enabled": "yes"}}}, "auth.tokens.enabled"),
    ({"networkPolicy": {"objectStore": {"cidrs": ["s3.amazonaws.com"]}}}, "networkPolicy.objectStore.cidrs.0"),
    ({"networkPolicy": {"objectStore": {"ports": [0]}}}, "networkPolicy.objectStore.ports.0"),
    ({"networkPolicy": {"apiServer": {"cidrs": []}}}, "networkPolicy.apiServer.cidrs"),
    (
        {"networkPolicy": {"prometheus": {"podSelector": {"matchLabel": {"a": "b"}}}}},
        "networkPolicy.prometheus.podSelector: Additional property matchLabel",
    ),
    ({"networkPolicy": {"monitoringNamespace": "monitoring"}}, "networkPolicy: Additional property monitoringNamespace"),
    ({"example": {"runAsUser": 0}}, "example.runAsUser"),
    ({"tls": {"issued": {"port": 0}}}, "tls.issued.port"),
    ({"tls": {"issued": {"lifetimeSeconds": 10}}}, "tls.issued.lifetimeSeconds"),
    ({"tls": {"issued": {"tokenExpirationSeconds": 60}}}, "tls.issued.tokenExpirationSeconds"),
    ({"tls": {"issued": {"audience": ""}}}, "tls.issued.audience"),
    ({"tls": {"issued": {"constructorServiceAccounts": ["Not_An_Account"]}}}, "tls.issued.constructorServiceAccounts.0"),
    ({"tls": {"issued": {"serviceAccounts": []}}}, "tls.issued: Additional property serviceAccounts"),
]

TEMPLATE_ERRORS = [
    ({"sourceGroups": [dict(GROUP, minReplicas=3, maxReplicas=2)]}, "sourceGroups[0].maxReplicas: must be >= minReplicas (3), got 2"),
    ({"sourceGroups": [GROUP, dict(GROUP, name="more")]}, 'sourceGroups[1].sources[0].name: source "web" is listed twice'),
    ({"mixture": {"weights": {"wbe": 1}}}, "mixture.weights.wbe: names no source"),
    (
        {"mesh": {"dp": 8}, "batch": {"globalBatchSize": 8, "microbatches": 2}},
        "batch.globalBatchSize: must be >= mesh.dp * batch.microbatches = 16",
    ),
    ({"job": {"settings": {"network": {"host": "127.0.0.1"}}}}, "job.settings.network.host: set by the chart"),
    ({"job": {"settings": {"sources": []}}}, "job.settings.sources: set by the chart"),
    ({"strategy": "mine.py"}, 'strategy: "mine.py" is not a key of strategyFiles'),
    ({"example": {"enabled": True}, "mesh": {"dp": 2}}, "example.enabled: tiny_lm meets its peers on 127.0.0.1"),
    (
        {"job": {"settings": {"ledger": {"location": "s3://b/l"}}}},
        "job.settings.ledger.location: set by the chart; use planner.ledger.location",
    ),
    (
        {"example": {"enabled": True, "kind": "pytorchjob"}, "mesh": {"dp": 2}},
        'constructor.indexFrom: example.kind pytorchjob gives each pod its index through "kubeflow"',
    ),
    (
        {"example": {"enabled": True, "kind": "jobset", "jobsetJobs": 3}, "constructor": {"indexFrom": "jobset"}, "mesh": {"dp": 4}},
        "example.jobsetJobs: must divide the 4 trainer pods, got 3",
    ),
    (
        {"loader": {"volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": [{"name": "dta", "mountPath": "/data"}]}},
        'loader.volumeMounts[0].name: "dta" names no volume of loader.volumes',
    ),
    ({"loader": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}, 'loader.env[1].name: "A" is listed twice'),
    ({"job": {"settings": {"network": {"tls": False}}}}, "job.settings.network.tls: set by the chart"),
    ({"job": {"settings": {"network": {"insecure": True}}}}, "job.settings.network.insecure: set by the chart"),
    ({"tls": {"mode": "disabled"}}, "tls.mode disabled serves plaintext gRPC on every pod's IP: anyone who reaches a pod could read"),
    # tls.mode existingSecret: the user's CA, named; the per-part Secrets it took before are refused
    ({"tls": {"mode": "existingSecret"}}, "tls.existingSecret.ca: empty: tls.mode existingSecret needs your CA's Secret"),
    *[
        (
            {"tls": {"mode": "existingSecret", "existingSecret": {"ca": "corp-ca", part: "corp-part"}}},
            f"tls.existingSecret.{part}: per-part Secrets are no longer taken",
        )
        for part in ("planner", "loader", "constructor")
    ],
    ({"tls": {"existingSecret": {"loader": "corp-loader"}}}, "Remove it and use tls.existingSecret.ca"),
    (
        {"loader": {"volumes": [{"name": "batchplane-tls", "emptyDir": {}}]}},
        'loader.volumes[0].name: "batchplane-tls" is used by batchplane',
    ),
    (
        {"loader": {"volumes": [{"name": "batchplane-issuer", "emptyDir": {}}]}},
        'loader.volumes[0].name: "batchplane-issuer" is used by batchplane',
    ),
    # tls.mode issued (the default): the issuer is this release's operator, which reads a constructor's index from its pod
    (
        {"constructor": {"indexFrom": "env:NODE_RANK"}},
        "constructor.indexFrom: tls.mode issued reads each trainer pod's constructor index from the pod itself",
    ),
    ({"auth": {"tokens": {"enabled": True}}}, "auth.tokens.enabled: tls.mode issued names each pod's own identity"),
    # tls.mode certManager and existingSecret: the same issuer, signing with cert-manager's intermediate CA or the user's
    *[
        entry
        for mode in ISSUER_MODES[1:]
        for entry in (
            (
                deep_merge(ISSUER_VALUES[mode], {"constructor": {"indexFrom": "env:NODE_RANK"}}),
                f"constructor.indexFrom: tls.mode {mode} reads each trainer pod's constructor index from the pod itself",
            ),
            (
                deep_merge(ISSUER_VALUES[mode], {"auth": {"tokens": {"enabled": True}}}),
                f"auth.tokens.enabled: tls.mode {mode} names each pod's own identity",
            ),
        )
    ],
    # a token for the issuer must not be one the API server accepts
    *[
        (
            deep_merge(ISSUER_VALUES[mode], {"tls": {"issued": {"audience": audience}}}),
            f'tls.issued.audience: "{audience}" is the Kubernetes API server',
        )
        for mode in ISSUER_MODES
        for audience in ("https://kubernetes.default.svc", "https://kubernetes.default.svc.cluster.local", "kubernetes", "api")
    ],
    ({"tls": {"issued": {"audience": None}}}, "tls.issued.audience: empty: a projected token without an audience"),
    (
        {"tls": {"clusterDomain": "corp.example", "issued": {"audience": "https://kubernetes.default.svc.corp.example"}}},
        'tls.issued.audience: "https://kubernetes.default.svc.corp.example" is the Kubernetes API server',
    ),
    (
        {"planner": {"serviceAccountName": "shared"}, "loader": {"serviceAccountName": "shared"}},
        'loader.serviceAccountName: ServiceAccount "shared" is already named by planner.serviceAccountName',
    ),
    (
        {"tls": {"issued": {"constructorServiceAccounts": ["mine", f"{RELEASE}-batchplane-loader"]}}},
        f'tls.issued.constructorServiceAccounts[1]: ServiceAccount "{RELEASE}-batchplane-loader" is already named by loader.serviceAccountName',
    ),
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
        (
            {"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": name, "mountPath": "/d"}]},
            f'loader.volumeMounts[0].name: "{name}" is used by batchplane',
        ),
    ):
        rendered = run_helm(helm, "template", RELEASE, CHART, "-f", bad_values(tmp_path, {"loader": values}))
        assert rendered.returncode != 0 and message in rendered.stderr, rendered.stderr


@pytest.mark.parametrize("path", [*podfields.RESERVED_MOUNT_PATHS, "/etc/batchplane/extra", "/tmp/"])
def test_the_mount_paths_batchplane_uses_are_refused(helm: pathlib.Path, tmp_path: pathlib.Path, path: str) -> None:
    values = {"loader": {"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": "d", "mountPath": path}]}}
    rendered = run_helm(helm, "template", RELEASE, CHART, "-f", bad_values(tmp_path, values))
    assert rendered.returncode != 0 and f'loader.volumeMounts[0].mountPath: "{path}" is used by batchplane' in rendered.stderr, (
        rendered.stderr
    )
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
    assert default["serviceAccountName"] == f"{RELEASE}-batchplane-planner" and "envFrom" not in default["containers"][0]  # tls.mode issued
    plain = one(template(helm, "-f", CHART / "ci" / "tls-disabled-values.yaml"), "Deployment", "-planner")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in plain  # the namespace's default
    opted_in = one(template(helm, "--set", "planner.automountServiceAccountToken=true"), "Deployment", "-planner")["spec"]["template"][
        "spec"
    ]
    assert opted_in["automountServiceAccountToken"] is True


def test_the_ledger_is_persistent_by_default_and_in_the_bucket_with_a_location(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    def ledger_of(docs: list[dict]) -> tuple[dict, list[dict], JobSettings]:
        planner = one(docs, "Deployment", "-planner")["spec"]["template"]["spec"]
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        return (
            next(v for v in planner["volumes"] if v["name"] == "state"),
            all_of(docs, "PersistentVolumeClaim"),
            job_from_configmap(docs, folder),
        )

    state, claims, job = ledger_of(template(helm))
    (claim,) = claims
    assert state == {"name": "state", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    assert (
        claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        and claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    )
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
                labels = {
                    "training.kubeflow.org/replica-type": kind.lower(),
                    "training.kubeflow.org/replica-index": str(i),
                    "training.kubeflow.org/job-name": name,
                }
                out.append(({"name": f"{name}-{kind.lower()}-{i}", "labels": labels, "annotations": {}}, replica["template"]))
    elif doc["kind"] == "JobSet":
        (rjob,) = doc["spec"]["replicatedJobs"]
        for j in range(rjob["replicas"]):
            for c in range(rjob["template"]["spec"]["completions"]):
                labels = {
                    "jobset.sigs.k8s.io/job-index": str(j),
                    "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]),
                    "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                }
                meta = {
                    "name": f"{name}-{rjob['name']}-{j}-{c}-abcde",
                    "labels": labels,
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(c)},
                }
                out.append((meta, rjob["template"]["spec"]["template"]))
    elif doc["kind"] == "LeaderWorkerSet":
        size = doc["spec"]["leaderWorkerTemplate"]["size"]
        for g in range(doc["spec"]["replicas"]):
            for w in range(size):
                labels = {"leaderworkerset.sigs.k8s.io/group-index": str(g), "leaderworkerset.sigs.k8s.io/worker-index": str(w)}
                meta = {
                    "name": f"{name}-{g}" + (f"-{w}" if w else ""),
                    "labels": labels,
                    "annotations": {"leaderworkerset.sigs.k8s.io/size": str(size)},
                }
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
    workloads = [d for d in docs if d["metadata"]["name"].endswith("-example") and d["kind"] != "NetworkPolicy"]
    workload = next(d for d in workloads if d["kind"] != "Service")
    assert {d["kind"] for d in workloads} == {
        "torchrun": {"Job", "Service"},
        "pytorchjob": {"PyTorchJob"},
        "jobset": {"JobSet"},
        "leaderworkerset": {"LeaderWorkerSet"},
    }[kind]
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
        controller_env = {
            "MASTER_ADDR": f"{workload['metadata']['name']}-master-0",
            "MASTER_PORT": "23456",
            "LWS_LEADER_ADDRESS": f"{workload['metadata']['name']}-0.{workload['metadata']['name']}",
        }
        env |= {
            "BATCHPLANE_CONSTRUCTOR_INDEX_FILE": str(index_file),
            "TORCHRUN_ARGS": str(tmp_path / "args"),
            "PATH": f"{bin_dir}:/usr/bin:/bin",
        } | controller_env
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
    pytorchjob_pod = {
        "name": "run-worker-0",
        "labels": {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"},
        "annotations": {},
    }
    with pytest.raises(
        pod_rank.PodRankError, match=r"--index-from indexed-job: BATCHPLANE_COMPLETION_INDEX: is empty .*only an Indexed Job's pods"
    ):
        index_args(sidecar["args"][1:], downward_env(sidecar, pytorchjob_pod))
