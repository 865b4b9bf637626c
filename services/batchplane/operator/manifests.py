"""The loader Deployment the operator builds for each source group of a DataPlane
(deploy/helm/README.md, "The operator contract").

Pure: no I/O, no clock, no Kubernetes client. `loader_deployment` builds the apps/v1 Deployment
of one group of a `dataplane.DataPlaneSpec` as a plain dict.

A loader Deployment, for group G (index I in `spec.sourceGroups`) of DataPlane D:

- name `<D>-loader-<G>`; labels `spec.loader.podLabels` plus `batchplane.dev/dataplane: D`,
  `batchplane.dev/group: G`, `app.kubernetes.io/component: loader` and
  `app.kubernetes.io/managed-by: batchplane-operator` (the label the operator selects its own
  Deployments by; it never touches one without it);
- an ownerReference to D (controller, blockOwnerDeletion), so deleting D deletes it;
- selector {batchplane.dev/dataplane, batchplane.dev/group} (immutable once created);
- `replicas` as the operator decides (the scaling policy); `spec.replicas` is never part of a
  spec update, only of the scale subresource;
- pods running `spec.loader.image` with args `loader -c /etc/batchplane/job.yaml --index I
  --replica $(POD_NAME) --planner <spec.planner.address> --port <grpcPort> --advertise
  $(POD_IP):<grpcPort> --metrics-port <metricsPort>` (POD_NAME and POD_IP from the downward
  API); a preStop hook that asks the loader to leave its group (SIGUSR1) and waits while it serves
  the windows routed to it, within a termination grace period longer than its drain timeout;
  ports `grpc` and `metrics`, probes on `GET /healthz` of the metrics port (200 once the
  loader's grpc.health.v1 is SERVING: kubelet's own gRPC probe speaks plaintext and cannot pass
  mutual TLS), the group's resources, the job ConfigMap at /etc/batchplane and an emptyDir at
  /tmp, non-root with a read-only root filesystem, no privilege escalation, all capabilities
  dropped and the RuntimeDefault seccomp profile;
- with spec.loader.authTokens.secretName: that Secret (one bearer token per role) as volume
  `batchplane-auth-tokens`, mounted read-only as a directory at /etc/batchplane/auth-tokens,
  with `--auth-tokens /etc/batchplane/auth-tokens` (the tokens the loader's server accepts)
  and `--token-file /etc/batchplane/auth-tokens/loader` (the one it presents to the planner);
  with spec.loader.authTokens.verifiers only the `loader` key and every role's verifier
  (`<role>.sha256`) of it: the pod holds no other role's token;
- with spec.loader.identity: an in-memory emptyDir `batchplane-tls` at
  /etc/batchplane/tls (`--tls-dir`, writable: the loader writes the certificate it is issued
  there, and renews it), and, read-only at /etc/batchplane/issuer, the projected volume
  `batchplane-issuer`: the pod's ServiceAccount token for the identity's audience (`token`,
  `--issuer-token-file`) and the CA certificate (`ca.crt`, `--issuer-ca`): the key `ca.crt` of
  the identity's caConfigMap, or of its caSecret (that key alone: the pod never sees the
  Secret's others, e.g. a CA's tls.key); `--issuer <issuer>`; and the label
  `batchplane.dev/group-index: I` on the Deployment and its pods, from which (with the pod's name
  and ServiceAccount) the issuer names the pod `batchplane://loader/I/<pod>`;
- spec.loader's pod fields (`batchplane.operator.podfields`): `env`, `envFrom` and
  `volumeMounts` appended to the loader container's own, `volumes` appended to the pod's own,
  `serviceAccountName`, `nodeSelector`, `tolerations`, `affinity`, `priorityClassName` and
  `topologySpreadConstraints` on the pod when set, and `automountServiceAccountToken` false
  unless spec.loader sets it true (a ServiceAccount alone does not mount the API token: see
  podfields);
- annotation `batchplane.dev/spec-hash`: a digest of everything above but `replicas`, which
  tells the operator whether a live Deployment still matches its DataPlane (the API server adds
  defaults, so live specs are not compared field by field).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from batchplane.core.identity import CERTIFIED_ROLES, VERIFIER_SUFFIX
from batchplane.core.issuance import GROUP_INDEX_LABEL
from batchplane.operator.dataplane import (
    API_VERSION,
    AUTH_TOKENS_VOLUME,
    ISSUER_VOLUME,
    KIND,
    TLS_VOLUME,
    DataPlaneSpec,
    SourceGroup,
    deployment_name,
)

#: Labels the operator sets on every loader Deployment and pod.
LABEL_DATAPLANE = "batchplane.dev/dataplane"
LABEL_GROUP = "batchplane.dev/group"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
#: The value of app.kubernetes.io/managed-by on what the operator creates.
MANAGER = "batchplane-operator"
#: Digest of a Deployment's desired state without its replicas.
ANNOTATION_SPEC_HASH = "batchplane.dev/spec-hash"

#: Where the job ConfigMap is mounted in loader pods, and the job file in it.
CONFIG_DIR = "/etc/batchplane"
JOB_FILE = f"{CONFIG_DIR}/job.yaml"
#: Where the loader writes its issued certificate (--tls-dir), and where the tokens Secret is
#: mounted (--auth-tokens; --token-file is its `loader` key).
TLS_DIR = f"{CONFIG_DIR}/tls"
AUTH_TOKENS_DIR = f"{CONFIG_DIR}/auth-tokens"
#: spec.loader.identity: where the projected ServiceAccount token and the CA certificate lie.
ISSUER_DIR = f"{CONFIG_DIR}/issuer"
ISSUER_TOKEN = "token"
ISSUER_CA = "ca.crt"
#: The size limit of the in-memory emptyDir an issued certificate and key are written to.
ISSUED_TLS_SIZE = "1Mi"
#: The loader's role: its token's key in the tokens Secret.
ROLE = "loader"
#: File mode of the mounted Secrets' files: readable by root and the pod's fsGroup only.
SECRET_MODE = 0o440
#: The HTTP path of the metrics port that answers 200 while grpc.health.v1 is SERVING.
HEALTH_PATH = "/healthz"
#: The loader container's name.
CONTAINER = "loader"
#: PodSpec fields a loader Deployment has only when the DataPlane sets them (an update removes
#: them when it no longer does; `serviceAccount` is the API's deprecated alias of
#: serviceAccountName, which would otherwise bring it back).
OPTIONAL_POD_FIELDS = (
    "imagePullSecrets",
    "serviceAccountName",
    "serviceAccount",
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "topologySpreadConstraints",
)
#: Of those, the mappings: an update replaces them rather than merging into the live ones.
REPLACED_POD_MAPS = ("nodeSelector", "affinity")


# ---- building a loader Deployment ---------------------------------------------------------------


#: How long a leaving loader replica serves its windows at most (batchplane.loader.server).
DRAIN_TIMEOUT_S = 300
#: The preStop hook: SIGUSR1 to the loader (PID 1), then wait for it to finish leaving.
LEAVE_COMMAND = "import os, signal, time; os.kill(1, signal.SIGUSR1); time.sleep(3600)"


def selector_labels(spec: DataPlaneSpec, group: SourceGroup) -> dict[str, str]:
    """The Deployment's selector: what tells its pods from every other group's."""
    return {LABEL_DATAPLANE: spec.name, LABEL_GROUP: group.name}


def managed_selector() -> str:
    """A label selector for every Deployment the operator made, in the API's syntax."""
    return f"{LABEL_MANAGED_BY}={MANAGER}"


def owner_reference(spec: DataPlaneSpec) -> dict[str, Any]:
    """The ownerReference that ties a loader Deployment to its DataPlane."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def loader_args(spec: DataPlaneSpec, group: SourceGroup) -> list[str]:
    """The loader container's args (the image's entrypoint runs `python -m batchplane.loader`)."""
    port = spec.loader.grpc_port
    return [
        "loader",
        "-c",
        JOB_FILE,
        "--index",
        str(group.index),
        "--replica",
        "$(POD_NAME)",
        "--planner",
        spec.loader.planner_address,
        "--port",
        str(port),
        "--advertise",
        f"$(POD_IP):{port}",
        "--metrics-port",
        str(spec.loader.metrics_port),
        *security_args(spec),
    ]


def security_args(spec: DataPlaneSpec) -> list[str]:
    """--tls-dir, --issuer, --issuer-token-file, --issuer-ca, --auth-tokens and --token-file, as
    spec.loader's identity and Secrets say."""
    args = []
    identity = spec.loader.identity
    if identity:
        args += [
            "--tls-dir",
            TLS_DIR,
            "--issuer",
            identity.issuer,
            "--issuer-token-file",
            f"{ISSUER_DIR}/{ISSUER_TOKEN}",
            "--issuer-ca",
            f"{ISSUER_DIR}/{ISSUER_CA}",
        ]
    if spec.loader.auth_tokens_secret:
        args += ["--auth-tokens", AUTH_TOKENS_DIR, "--token-file", f"{AUTH_TOKENS_DIR}/{ROLE}"]
    return args


def security_volumes(spec: DataPlaneSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts) of spec.loader's identity (the issued certificate's emptyDir and
    the issuer's token and CA) and of its tokens Secret (a read-only directory, never subPath: a
    subPath mount never sees a renewed file)."""
    volumes, mounts = issuer_volumes(spec)
    secret = spec.loader.auth_tokens_secret
    if secret:
        source: dict[str, Any] = {"secretName": secret, "defaultMode": SECRET_MODE}
        if spec.loader.auth_token_verifiers:  # its own token, the others' verifiers only
            keys = [ROLE, *(f"{role}{VERIFIER_SUFFIX}" for role in CERTIFIED_ROLES)]
            source["items"] = [{"key": key, "path": key} for key in keys]
        volumes.append({"name": AUTH_TOKENS_VOLUME, "secret": source})
        mounts.append({"name": AUTH_TOKENS_VOLUME, "mountPath": AUTH_TOKENS_DIR, "readOnly": True})
    return volumes, mounts


def issuer_volumes(spec: DataPlaneSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts) of spec.loader.identity: none without it."""
    identity = spec.loader.identity
    if identity is None:
        return [], []
    token = {"audience": identity.audience, "expirationSeconds": identity.token_expiration_s, "path": ISSUER_TOKEN}
    items = [{"key": ISSUER_CA, "path": ISSUER_CA}]  # the certificate alone, never another key
    ca: dict[str, Any] = (
        {"secret": {"name": identity.ca_secret, "items": items}}
        if identity.ca_secret
        else {"configMap": {"name": identity.ca_config_map, "items": items}}
    )
    volumes: list[dict[str, Any]] = [
        {"name": TLS_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": ISSUED_TLS_SIZE}},
        {"name": ISSUER_VOLUME, "projected": {"defaultMode": SECRET_MODE, "sources": [{"serviceAccountToken": token}, ca]}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": TLS_VOLUME, "mountPath": TLS_DIR},
        {"name": ISSUER_VOLUME, "mountPath": ISSUER_DIR, "readOnly": True},
    ]
    return volumes, mounts


def loader_deployment(spec: DataPlaneSpec, group: SourceGroup, *, replicas: int) -> dict[str, Any]:
    """The apps/v1 Deployment of `group`, with `replicas` pods and its spec-hash annotation.

    Args:
        spec: The DataPlane.
        group: One of `spec.groups`.
        replicas: Pods to run (the caller keeps it within the group's bounds).
    Returns:
        The Deployment as a dict, ready to POST.
    """
    loader = spec.loader
    labels = {**loader.pod_labels, LABEL_COMPONENT: "loader", **selector_labels(spec, group), LABEL_MANAGED_BY: MANAGER}
    if loader.identity:  # the issuer names the pod's group by it
        labels[GROUP_INDEX_LABEL] = str(group.index)
    health = {"path": HEALTH_PATH, "port": loader.metrics_port}
    secret_volumes, secret_mounts = security_volumes(spec)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": loader.image,
        "args": loader_args(spec, group),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [
            {"name": "grpc", "containerPort": loader.grpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": loader.metrics_port, "protocol": "TCP"},
        ],
        # /healthz answers 200 once grpc.health.v1 is SERVING, which it turns once the loader
        # has registered with the planner (kubelet's gRPC probe cannot speak mutual TLS).
        "startupProbe": {"httpGet": dict(health), "periodSeconds": 2, "failureThreshold": 150},
        "readinessProbe": {"httpGet": dict(health), "periodSeconds": 10},
        "livenessProbe": {"httpGet": dict(health), "periodSeconds": 20, "timeoutSeconds": 5, "failureThreshold": 6},
        # Scaled in: leave the group and serve the windows routed here first (the loader exits
        # when done, which ends this hook; the grace period bounds it).
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", LEAVE_COMMAND]}}},
        "resources": copy.deepcopy(dict(group.resources)),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": loader.run_as_user,
            "runAsGroup": loader.run_as_group,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "batchplane-job", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *secret_mounts,
        ],
    }
    extra = loader.pod.container_fields()
    container["env"] += extra["env"]
    if extra["envFrom"]:
        container["envFrom"] = extra["envFrom"]
    container["volumeMounts"] += extra["volumeMounts"]
    if loader.image_pull_policy is not None:
        container["imagePullPolicy"] = loader.image_pull_policy
    pod_fields = loader.pod.pod_fields()
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": pod_fields.pop("automountServiceAccountToken"),
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": loader.run_as_user,
            "runAsGroup": loader.run_as_group,
            "fsGroup": loader.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": int(DRAIN_TIMEOUT_S) + 30,
        "containers": [container],
        "volumes": [
            {"name": "batchplane-job", "configMap": {"name": loader.job_config_map}},
            {"name": "tmp", "emptyDir": {}},
            *secret_volumes,
            *pod_fields.pop("volumes", []),
        ],
        **pod_fields,
    }
    if loader.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in loader.image_pull_secrets]
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(spec.name, group.name),
            "namespace": spec.namespace,
            "labels": dict(labels),
            "annotations": {},
            "ownerReferences": [owner_reference(spec)],
        },
        "spec": {
            "replicas": int(replicas),
            "selector": {"matchLabels": selector_labels(spec, group)},
            # Loader replicas of a group are interchangeable: keep them all up during a rollout.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": dict(labels), "annotations": dict(loader.pod_annotations)},
                "spec": pod_spec,
            },
        },
    }
    deployment["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = spec_hash(deployment)
    return deployment


def spec_hash(deployment: Mapping[str, Any]) -> str:
    """A digest of a Deployment's labels, owner, selector, strategy and pod template: what the
    operator sets, without `replicas` (the scaling policy's) and its own annotation."""
    meta = deployment.get("metadata", {})
    spec = deployment.get("spec", {})
    content = {
        "labels": meta.get("labels", {}),
        "annotations": {k: v for k, v in meta.get("annotations", {}).items() if k != ANNOTATION_SPEC_HASH},
        "ownerReferences": meta.get("ownerReferences", []),
        "spec": {k: v for k, v in spec.items() if k != "replicas"},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
