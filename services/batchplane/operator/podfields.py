"""The Kubernetes pod fields that a DataPlane's `spec.loader`, and the chart's `loader` and
`planner` values, may set: described once here and read by everything that must agree on them.

Pure: no I/O. What is here:

- `LOADER_FIELDS` and `PLANNER_FIELDS`: each field in the spelling of the Kubernetes PodSpec or
  Container it lands in (`env`, `volumes`, `serviceAccountName`, ...), its Kubernetes type and
  its documentation;
- `parse_pod_options`: reads those fields from a mapping into a typed `PodOptions`. Every
  Kubernetes object in them is checked strictly against the API's own schema
  (`batchplane.operator.kube_types`, generated from kubernetes-validate's strict schemas of the
  newest Kubernetes it knows): an unknown or misspelled field, a wrong type or a missing
  required field fails naming its path, e.g. `spec.loader.env[1].valueFrom.secretKeyRef.nmae`.
  Then the rules that span fields and the parts the operator owns: a user volume or mount may
  not use the names `batchplane-job` and `tmp` or the mount paths `/etc/batchplane` (or below it)
  and `/tmp`, env may not set the variables the operator sets, names are unique, a mount names a
  volume of the same spec, a volume has exactly one source;
- `crd_properties` and `values_properties`: the schemas of those fields for the DataPlane CRD
  (Kubernetes objects as `x-kubernetes-preserve-unknown-fields`, since the operator checks them
  as above) and for the chart's values.schema.json (Kubernetes objects by `$ref` to the same
  definitions, so `helm install` refuses what the operator would). deploy/helm/sync_schemas.py
  writes them into the chart, and tests/unit/test_pod_fields.py fails when the committed files
  drift from this module.

The ServiceAccount token: a pod that names `serviceAccountName` still gets
`automountServiceAccountToken: false` unless `automountServiceAccountToken` says otherwise.
batchplane never calls the Kubernetes API from a loader or the planner, and the cloud identity
webhooks that give pods bucket credentials (EKS IRSA and Pod Identity, Azure Workload Identity)
inject their own projected token, bound to their own audience, whatever the pod's automount
setting; GKE Workload Identity reads the ServiceAccount from the node's metadata server. Only a
credential provider that reads the Kubernetes API token itself (e.g. Vault's Kubernetes auth)
needs `automountServiceAccountToken: true`, and that mounts a token that can call the API with the
ServiceAccount's RBAC.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from batchplane.core.errors import ConfigError
from batchplane.operator.kube_types import DEFINITIONS

#: Names of the volumes the operator puts into every loader pod (the job ConfigMap, /tmp).
RESERVED_VOLUMES = ("batchplane-job", "tmp")
#: Mount paths the operator uses: the job ConfigMap (read-only, nothing may be mounted below
#: it) and the writable /tmp.
RESERVED_MOUNT_PATHS = ("/etc/batchplane", "/tmp")
#: Environment variables the operator sets in loader containers (the chart sets the last three
#: in every batchplane container; the loader's --replica and --advertise read the first two).
RESERVED_ENV = ("POD_IP", "POD_NAME", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "HOME")

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


@dataclasses.dataclass(frozen=True)
class PodField:
    """One field a pod template may take from the DataPlane or the values."""

    #: Its name, as in the Kubernetes PodSpec or Container (and in spec.loader and the values).
    name: str
    #: "list" (of `kube_type`), "object" (a `kube_type`), "string-map", "string" or "boolean".
    shape: str
    #: Where it lands: "container" (the batchplane container) or "pod" (the PodSpec).
    target: str
    #: The Kubernetes definition of its items ("list") or of itself ("object").
    kube_type: str | None
    #: What it is for (the CRD's and the values schema's description).
    description: str


def _core(name: str) -> str:
    return f"io.k8s.api.core.v1.{name}"


#: The pod fields of a loader (DataPlane spec.loader, chart values `loader`).
LOADER_FIELDS: tuple[PodField, ...] = (
    PodField("env", "list", "container", _core("EnvVar"),
             "Extra environment variables of the container, after the ones batchplane sets "
             f"({', '.join(RESERVED_ENV)}, which are refused)."),
    PodField("envFrom", "list", "container", _core("EnvFromSource"),
             "ConfigMaps and Secrets whose keys become environment variables, e.g. bucket credentials."),
    PodField("volumes", "list", "pod", _core("Volume"),
             f"Extra volumes of the pod (not named {' or '.join(RESERVED_VOLUMES)}, which batchplane uses)."),
    PodField("volumeMounts", "list", "container", _core("VolumeMount"),
             f"Mounts of the extra volumes in the container (not at {' or '.join(RESERVED_MOUNT_PATHS)}, "
             "nor below /etc/batchplane)."),
    PodField("serviceAccountName", "string", "pod", None,
             "ServiceAccount the pods run as, e.g. one bound to a cloud IAM role (EKS IRSA or Pod "
             "Identity, GKE or Azure Workload Identity) that may read the buckets."),
    PodField("automountServiceAccountToken", "boolean", "pod", None,
             "Mount the ServiceAccount's Kubernetes API token (default false: batchplane never calls "
             "the API, and the cloud identity webhooks inject their own audience-bound token). Only for "
             "a credential provider that reads the API token itself, e.g. Vault's Kubernetes auth."),
    PodField("nodeSelector", "string-map", "pod", None, "Node labels the pods must run on."),
    PodField("tolerations", "list", "pod", _core("Toleration"), "Taints the pods tolerate."),
    PodField("affinity", "object", "pod", _core("Affinity"), "Node affinity and pod (anti-)affinity of the pods."),
    PodField("priorityClassName", "string", "pod", None, "PriorityClass of the pods."),
    PodField("topologySpreadConstraints", "list", "pod", _core("TopologySpreadConstraint"),
             "How the pods spread over zones or nodes, e.g. selecting batchplane.dev/group."),
)  # fmt: skip

#: The pod fields of the planner (chart values `planner`; the chart renders them itself).
PLANNER_FIELDS: tuple[PodField, ...] = tuple(
    f for f in LOADER_FIELDS if f.name in ("env", "envFrom", "serviceAccountName", "automountServiceAccountToken")
)


@dataclasses.dataclass(frozen=True)
class PodOptions:
    """The pod fields a DataPlane sets, validated; each empty (or None) when not set."""

    env: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    service_account_name: str | None = None
    #: None: not set, i.e. false.
    automount_service_account_token: bool | None = None
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()

    def container_fields(self) -> dict[str, list[Any]]:
        """What goes into the container besides batchplane's own (appended to them)."""
        return {
            "env": [copy.deepcopy(dict(e)) for e in self.env],
            "envFrom": [copy.deepcopy(dict(e)) for e in self.env_from],
            "volumeMounts": [copy.deepcopy(dict(m)) for m in self.volume_mounts],
        }

    def pod_fields(self) -> dict[str, Any]:
        """What goes into the PodSpec besides batchplane's own: only the fields that are set,
        `volumes` to be appended to batchplane's, the token setting always."""
        out: dict[str, Any] = {"automountServiceAccountToken": bool(self.automount_service_account_token)}
        if self.volumes:
            out["volumes"] = [copy.deepcopy(dict(v)) for v in self.volumes]
        if self.service_account_name:
            out["serviceAccountName"] = self.service_account_name
        if self.node_selector:
            out["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            out["tolerations"] = [copy.deepcopy(dict(t)) for t in self.tolerations]
        if self.affinity:
            out["affinity"] = copy.deepcopy(dict(self.affinity))
        if self.priority_class_name:
            out["priorityClassName"] = self.priority_class_name
        if self.topology_spread_constraints:
            out["topologySpreadConstraints"] = [copy.deepcopy(dict(t)) for t in self.topology_spread_constraints]
        return out


#: PodField.name -> PodOptions attribute.
_ATTRIBUTES = {
    "env": "env",
    "envFrom": "env_from",
    "volumes": "volumes",
    "volumeMounts": "volume_mounts",
    "serviceAccountName": "service_account_name",
    "automountServiceAccountToken": "automount_service_account_token",
    "nodeSelector": "node_selector",
    "tolerations": "tolerations",
    "affinity": "affinity",
    "priorityClassName": "priority_class_name",
    "topologySpreadConstraints": "topology_spread_constraints",
}

# ---- reading -----------------------------------------------------------------------------------


def parse_pod_options(raw: Mapping[str, Any], *, at: str, fields: Sequence[PodField] = LOADER_FIELDS) -> PodOptions:
    """The pod fields of `raw` (other keys are left to the caller), validated.

    Args:
        raw: The mapping holding them, e.g. a DataPlane's spec.loader.
        at: Its path in the resource, e.g. "spec.loader", for messages.
        fields: The fields to read.
    Returns:
        The validated options.
    Raises:
        ConfigError: a field that is malformed, unknown to Kubernetes or clashing with what
            batchplane sets; `field` is its path, e.g. "spec.loader.volumes[0].name".
    """
    values: dict[str, Any] = {}
    for field in fields:
        if field.name not in raw or raw[field.name] is None:
            continue
        value, where = raw[field.name], f"{at}.{field.name}"
        if field.shape == "list":
            if not isinstance(value, list):
                raise ConfigError(where, f"must be a list of {_short(field.kube_type)}", value)
            for i, item in enumerate(value):
                validate_kube(item, field.kube_type, f"{where}[{i}]")
                if not isinstance(item, Mapping):
                    raise ConfigError(f"{where}[{i}]", f"must be a {_short(field.kube_type)}", item)
            values[_ATTRIBUTES[field.name]] = tuple(copy.deepcopy(dict(item)) for item in value)
        elif field.shape == "object":
            validate_kube(value, field.kube_type, where)
            values[_ATTRIBUTES[field.name]] = copy.deepcopy(dict(value)) if value else None
        elif field.shape == "string-map":
            if not isinstance(value, Mapping):
                raise ConfigError(where, "must be a mapping of label keys to values", value)
            for key, text in value.items():
                if not (isinstance(key, str) and _LABEL_KEY.fullmatch(key)):
                    raise ConfigError(f"{where}.{key}", "must be a label key", key)
                if not (isinstance(text, str) and _LABEL_VALUE.fullmatch(text) and len(text) <= 63):
                    raise ConfigError(f"{where}.{key}", "must be a label value (a string of at most 63 characters)", text)
            values[_ATTRIBUTES[field.name]] = dict(value)
        elif field.shape == "string":
            if not isinstance(value, str):
                raise ConfigError(where, "must be a string", value)
            if value and not (_DNS_SUBDOMAIN.fullmatch(value) and len(value) <= 253):
                raise ConfigError(where, "must be a DNS subdomain name (lowercase letters, digits, '-', '.')", value)
            values[_ATTRIBUTES[field.name]] = value or None
        elif field.shape == "boolean":
            if not isinstance(value, bool):
                raise ConfigError(where, "must be true or false", value)
            values[_ATTRIBUTES[field.name]] = value
    options = PodOptions(**values)
    _check_ownership(options, at)
    return options


def _check_ownership(options: PodOptions, at: str) -> None:
    """The rules across fields, and what batchplane reserves for itself."""
    seen_env: set[str] = set()
    for i, env in enumerate(options.env):
        name = env["name"]
        if name in RESERVED_ENV:
            raise ConfigError(f"{at}.env[{i}].name", f"is set by batchplane ({', '.join(RESERVED_ENV)} are reserved)", name)
        if name in seen_env:
            raise ConfigError(f"{at}.env[{i}].name", "is listed twice", name)
        seen_env.add(name)
    volumes: set[str] = set()
    for i, volume in enumerate(options.volumes):
        name = volume["name"]
        if name in RESERVED_VOLUMES:
            raise ConfigError(f"{at}.volumes[{i}].name", f"is used by batchplane ({', '.join(RESERVED_VOLUMES)} are reserved)", name)
        if name in volumes:
            raise ConfigError(f"{at}.volumes[{i}].name", "is listed twice", name)
        sources = [key for key, value in volume.items() if key != "name" and value is not None]
        if len(sources) != 1:
            raise ConfigError(
                f"{at}.volumes[{i}]", "must name exactly one volume source (emptyDir, persistentVolumeClaim, csi, ...)", sources
            )
        volumes.add(name)
    paths: set[str] = set()
    for i, mount in enumerate(options.volume_mounts):
        name, path = mount["name"], mount.get("mountPath")
        if name in RESERVED_VOLUMES:
            raise ConfigError(f"{at}.volumeMounts[{i}].name", f"is used by batchplane ({', '.join(RESERVED_VOLUMES)} are reserved)", name)
        if name not in volumes:
            raise ConfigError(f"{at}.volumeMounts[{i}].name", f"names no volume of {at}.volumes", name)
        if not (isinstance(path, str) and path.startswith("/")):
            raise ConfigError(f"{at}.volumeMounts[{i}].mountPath", "must be an absolute path", path)
        normal = "/" + "/".join(p for p in path.split("/") if p)
        if normal in RESERVED_MOUNT_PATHS or normal.startswith(RESERVED_MOUNT_PATHS[0] + "/"):
            raise ConfigError(
                f"{at}.volumeMounts[{i}].mountPath",
                f"is used by batchplane ({RESERVED_MOUNT_PATHS[0]} holds the job configuration, read-only; {RESERVED_MOUNT_PATHS[1]} is its scratch space)",
                path,
            )
        if normal in paths:
            raise ConfigError(f"{at}.volumeMounts[{i}].mountPath", "is mounted twice", path)
        paths.add(normal)


# ---- strict validation against the Kubernetes API's schema --------------------------------------


def validate_kube(value: Any, type_name: str | None, at: str) -> None:
    """Checks `value` against the Kubernetes definition `type_name` (e.g.
    "io.k8s.api.core.v1.EnvVar"), as the API server's strict field validation would.

    Raises:
        ConfigError: the first problem, with `field` its path below `at`.
    """
    if type_name not in DEFINITIONS:
        raise KeyError(f"no Kubernetes definition {type_name!r} (batchplane.operator.kube_types knows {len(DEFINITIONS)})")
    _check({"$ref": f"#/$defs/{type_name}"}, value, at)


def _check(schema: Mapping[str, Any], value: Any, at: str) -> None:
    ref = schema.get("$ref")
    if ref is not None:
        _check(DEFINITIONS[ref.rsplit("/", 1)[-1]], value, at)
        return
    if "oneOf" in schema:
        matched = 0
        for option in schema["oneOf"]:
            try:
                _check(option, value, at)
                matched += 1
            except ConfigError:
                pass
        if matched != 1:
            raise ConfigError(at, "must be " + " or ".join(_type_words(o) for o in schema["oneOf"]), value)
        return
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is_type(value, k) for k in kinds):
            raise ConfigError(at, f"must be {_type_words(schema)}", value)
    if value is None:
        return
    if isinstance(value, Mapping):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        if extra is False:  # a misspelled field first: it is likely why a required one is missing
            for key, item in value.items():
                if key not in properties:
                    known = ", ".join(sorted(properties)) or "none"
                    raise ConfigError(f"{at}.{key}", f"unknown field (known: {known})", item)
        for key in schema.get("required", ()):
            if key not in value:
                raise ConfigError(f"{at}.{key}", "is required", None)
        for key, item in value.items():
            if key in properties:
                _check(properties[key], item, f"{at}.{key}")
            elif isinstance(extra, Mapping):
                _check(extra, item, f"{at}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{at}[{i}]")


def _is_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "object":
        return isinstance(value, Mapping)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    raise ValueError(f"unsupported schema type {kind!r}")


def _type_words(schema: Mapping[str, Any]) -> str:
    if "$ref" in schema:
        return "a " + _short(schema["$ref"].rsplit("/", 1)[-1])
    kinds = schema.get("type", ())
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds if k != "null"]
    words = {
        "object": "a mapping",
        "array": "a list",
        "string": "a string",
        "boolean": "true or false",
        "integer": "an integer",
        "number": "a number",
    }
    return " or ".join(words[k] for k in kinds) or "null"


def _short(type_name: str | None) -> str:
    return (type_name or "").rsplit(".", 1)[-1]


# ---- schemas for the chart ---------------------------------------------------------------------------


def crd_properties(fields: Sequence[PodField] = LOADER_FIELDS) -> dict[str, Any]:
    """The DataPlane CRD's openAPIV3Schema of `fields` (under spec.loader.properties): Kubernetes
    objects keep unknown fields (the operator checks them strictly, `parse_pod_options`)."""
    out: dict[str, Any] = {}
    node: dict[str, Any]
    for f in fields:
        if f.shape == "list":
            node = {"type": "array", "description": f.description,
                    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}  # fmt: skip
        elif f.shape == "object":
            node = {"type": "object", "description": f.description, "x-kubernetes-preserve-unknown-fields": True}
        elif f.shape == "string-map":
            node = {"type": "object", "description": f.description, "additionalProperties": {"type": "string"}}
        elif f.shape == "string":
            node = {"type": "string", "description": f.description, "maxLength": 253}
        else:
            node = {"type": "boolean", "description": f.description}
        out[f.name] = node
    return out


def values_properties(fields: Sequence[PodField] = LOADER_FIELDS) -> dict[str, Any]:
    """The chart's values.schema.json of `fields`: Kubernetes objects by `$ref` to
    `values_definitions()`, the same schema the operator checks them with."""
    out: dict[str, Any] = {}
    node: dict[str, Any]
    for f in fields:
        if f.shape == "list":
            node = {"type": "array", "description": f.description, "items": {"$ref": f"#/definitions/{f.kube_type}"}}
        elif f.shape == "object":
            node = {"description": f.description, "$ref": f"#/definitions/{f.kube_type}"}
        elif f.shape == "string-map":
            node = {"type": "object", "description": f.description, "additionalProperties": {"type": "string"}}
        elif f.shape == "string":
            node = {"type": "string", "description": f.description,
                    "pattern": "^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", "maxLength": 253}  # fmt: skip
        else:
            node = {"type": "boolean", "description": f.description}
        out[f.name] = node
    return out


def values_definitions() -> dict[str, Any]:
    """The Kubernetes definitions for values.schema.json's `definitions`: those of
    `batchplane.operator.kube_types`, with references in draft-07 spelling."""
    return {name: _rewrite_refs(schema) for name, schema in DEFINITIONS.items()}


def _rewrite_refs(node: Any) -> Any:
    if isinstance(node, Mapping):
        return {k: (v.replace("#/$defs/", "#/definitions/") if k == "$ref" else _rewrite_refs(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(v) for v in node]
    return node
