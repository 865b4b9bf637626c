"""The DataPlane custom resource as the operator reads it (deploy/helm/batchplane/crds).

Pure: no I/O, no clock, no Kubernetes client. `parse_dataplane` turns a DataPlane object (the
JSON the API server returns) into a typed, validated `DataPlaneSpec`, or raises `SpecError`
naming the field in the resource's own spelling (e.g. `spec.sourceGroups[1].maxReplicas`).
Fields the resource leaves out get the chart's values: the planner at
`<name>-planner.<namespace>.svc:50051`, the job ConfigMap `<name>-job`, ports 50052 and 9100,
UID/GID 10001, a 30 s scaling interval and `ScalingSettings`' defaults. spec.loader's pod fields
(env, envFrom, volumes, volumeMounts, serviceAccountName, automountServiceAccountToken,
nodeSelector, tolerations, affinity, priorityClassName, topologySpreadConstraints) are read and
checked by `batchplane.operator.podfields`. spec.loader.identity has loader pods get their
certificates from batchplane's issuer (the chart's tls.mode issued, certManager and
existingSecret) with a projected ServiceAccount token, each pod one naming it alone, and verify
it by the CA certificate of a ConfigMap (caConfigMap) or of a Secret's key ca.crt (caSecret);
absent, loaders get no TLS flags (tls.mode disabled). spec.loader.authTokens.secretName names the
Secret of the per-role bearer tokens they mount (absent: none). spec.loader.tls (one certificate
Secret every loader pod mounted) is refused, naming identity: any pod holding it could act for
every replica. `batchplane.operator.manifests` says how each is mounted. `declared_schedule` reads spec.mixture's staged or curriculum schedule, for
scaling ahead of a declared change.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from batchplane.core.errors import ConfigError
from batchplane.core.schedule import ScheduleError, schedule_from_mapping
from batchplane.operator.podfields import PodOptions, parse_pod_options
from batchplane.operator.policy import GroupSpec, ScalingSettings, ScheduleFn

#: The DataPlane custom resource.
GROUP = "batchplane.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DataPlane"
PLURAL = "dataplanes"

#: Defaults of spec.loader and spec.scaling fields the resource leaves out (the chart's values).
DEFAULT_GRPC_PORT = 50052
DEFAULT_METRICS_PORT = 9100
DEFAULT_PLANNER_PORT = 50051
DEFAULT_RUN_AS = 10001
DEFAULT_INTERVAL_S = 30.0

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: Volumes the operator adds to loader pods for TLS, tokens and the issuer (a user volume may not
#: take them).
TLS_VOLUME = "batchplane-tls"
AUTH_TOKENS_VOLUME = "batchplane-auth-tokens"
ISSUER_VOLUME = "batchplane-issuer"
#: Defaults of spec.loader.identity's audience and tokenExpirationSeconds (the chart's tls.issued).
DEFAULT_AUDIENCE = "batchplane"
DEFAULT_TOKEN_EXPIRATION_S = 3600
#: The shortest projected token Kubernetes makes, and the longest it accepts.
MIN_TOKEN_EXPIRATION_S = 600
MAX_TOKEN_EXPIRATION_S = 2**32
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: host:port, or [IPv6]:port.
_ADDRESS = re.compile(r"[^\s:]+:\d+|\[[0-9a-fA-F:]+\]:\d+")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
#: spec.scaling field -> ScalingSettings field, for messages in the resource's spelling.
_SCALING_FIELDS = {
    "windowIntervals": "window_intervals",
    "consecutiveIntervals": "consecutive_intervals",
    "upThreshold": "up_threshold",
    "downThreshold": "down_threshold",
    "cooldownSeconds": "cooldown_s",
    "headroom": "headroom",
    "leadSeconds": "lead_s",
}


class SpecError(ConfigError):
    """A DataPlane the operator cannot act on; `field` is the path in the resource, e.g.
    "spec.sourceGroups[0].maxReplicas"."""


@dataclasses.dataclass(frozen=True)
class LoaderIdentity:
    """spec.loader.identity: loader pods get their certificates from batchplane's issuer."""

    #: The issuer's address host:port, passed as --issuer.
    issuer: str
    #: The CA certificate, for --issuer-ca: the ConfigMap holding it (key ca.crt), or the Secret
    #: whose key ca.crt alone is projected (its other keys, e.g. a CA's tls.key, never are).
    #: Exactly one is set.
    ca_config_map: str | None = None
    ca_secret: str | None = None
    #: Audience of the pod's projected ServiceAccount token (--issuer-token-file).
    audience: str = DEFAULT_AUDIENCE
    #: Seconds the projected token is valid; the kubelet renews it.
    token_expiration_s: int = DEFAULT_TOKEN_EXPIRATION_S


@dataclasses.dataclass(frozen=True)
class LoaderTemplate:
    """How loader pods look (spec.loader, spec.planner.address)."""

    #: The batchplane image.
    image: str
    #: The planner's gRPC address host:port, passed as --planner.
    planner_address: str
    #: ConfigMap holding job.yaml, mounted at /etc/batchplane.
    job_config_map: str
    #: Kubernetes imagePullPolicy; None: the cluster's default.
    image_pull_policy: str | None = None
    #: Names of image pull secrets.
    image_pull_secrets: tuple[str, ...] = ()
    #: The loaders' gRPC port (--port; advertised as $(POD_IP):port).
    grpc_port: int = DEFAULT_GRPC_PORT
    #: The loaders' metrics port (--metrics-port).
    metrics_port: int = DEFAULT_METRICS_PORT
    #: UID and GID the loader runs as (never 0).
    run_as_user: int = DEFAULT_RUN_AS
    run_as_group: int = DEFAULT_RUN_AS
    #: Labels and annotations every loader pod carries.
    pod_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pod_annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: The pod fields of spec.loader (env, volumes, serviceAccountName, nodeSelector, ...;
    #: batchplane.operator.podfields), validated.
    pod: PodOptions = dataclasses.field(default_factory=PodOptions)
    #: spec.loader.authTokens.secretName: the Secret of per-role bearer tokens (one key per role),
    #: mounted whole for --auth-tokens, with the loader's own key as --token-file; None: none.
    auth_tokens_secret: str | None = None
    #: spec.loader.authTokens.verifiers: the tokens' Secret also holds each role's verifier
    #: (`<role>.sha256`), so a loader pod mounts its own token and the verifiers only.
    auth_token_verifiers: bool = False
    #: spec.loader.identity: certificates from the issuer; None: no TLS flags (tls.mode disabled).
    identity: LoaderIdentity | None = None


@dataclasses.dataclass(frozen=True)
class SourceGroup:
    """One entry of spec.sourceGroups."""

    #: The group's name (a DNS label).
    name: str
    #: Its position in spec.sourceGroups: the loader's --index.
    index: int
    #: Names of its sources, in order.
    sources: tuple[str, ...]
    #: Profiled loader work per sample per source, in worker-seconds (costSecondsPerSample).
    cost_s: Mapping[str, float]
    #: Replica bounds.
    min_replicas: int
    max_replicas: int
    #: Transform workers per replica: the capacity of one replica, in worker-seconds per second.
    workers_per_actor: int
    #: Resources of one loader pod ({requests, limits}), as given.
    resources: Mapping[str, Any]

    def clamp(self, replicas: int) -> int:
        """`replicas` within [min_replicas, max_replicas]."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclasses.dataclass(frozen=True)
class DataPlaneSpec:
    """A validated DataPlane: what the operator reconciles and scales."""

    #: metadata.name, metadata.namespace, metadata.uid, metadata.generation.
    name: str
    namespace: str
    uid: str
    generation: int
    #: spec.sourceGroups, in order.
    groups: tuple[SourceGroup, ...]
    #: spec.loader and spec.planner.address.
    loader: LoaderTemplate
    #: spec.scaling as the policy's settings.
    scaling: ScalingSettings
    #: spec.scaling.intervalSeconds: seconds between two scaling decisions.
    interval_s: float = DEFAULT_INTERVAL_S
    #: The declared schedule (spec.mixture), for scaling ahead; None: none that changes.
    schedule: ScheduleFn | None = dataclasses.field(default=None, compare=False)

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s for g in self.groups for s in g.sources)

    def group_spec(self, group: SourceGroup) -> GroupSpec:
        """The scaling policy's view of `group`."""
        return GroupSpec(
            name=group.name,
            sources=group.sources,
            cost_s=dict(group.cost_s),
            capacity=float(group.workers_per_actor),
            min_replicas=group.min_replicas,
            max_replicas=group.max_replicas,
            scaling=self.scaling,
        )


# ---- reading a DataPlane ----------------------------------------------------------------------


def parse_dataplane(obj: Mapping[str, Any]) -> DataPlaneSpec:
    """A DataPlane object, validated.

    Args:
        obj: The DataPlane as the API server returns it (apiVersion, kind, metadata, spec).
    Returns:
        The typed spec.
    Raises:
        SpecError: a field the operator cannot act on; its message names the field and value.
    """
    meta = _mapping(obj.get("metadata"), "metadata")
    name = meta.get("name")
    if not (isinstance(name, str) and _DNS_LABEL.fullmatch(name) and len(name) <= 63):
        raise SpecError("metadata.name", "must be a DNS label of at most 63 characters (it is a label value)", name)
    namespace = meta.get("namespace")
    if not (isinstance(namespace, str) and namespace):
        raise SpecError("metadata.namespace", "is required", namespace)
    uid = meta.get("uid")
    if not (isinstance(uid, str) and uid):
        raise SpecError("metadata.uid", "is required (the loader Deployments' ownerReference)", uid)
    generation = meta.get("generation", 0)
    generation = generation if _is_int(generation) else 0
    spec = _mapping(obj.get("spec"), "spec")

    raw_groups = spec.get("sourceGroups")
    if not (isinstance(raw_groups, list) and raw_groups):
        raise SpecError("spec.sourceGroups", "must be a non-empty list", raw_groups)
    groups, seen_groups, seen_sources = [], set(), set()
    for i, raw in enumerate(raw_groups):
        group = _parse_group(raw, i, name)
        if group.name in seen_groups:
            raise SpecError(f"spec.sourceGroups[{i}].name", "is used by another group", group.name)
        seen_groups.add(group.name)
        for j, source in enumerate(group.sources):
            if source in seen_sources:
                raise SpecError(f"spec.sourceGroups[{i}].sources[{j}].name", "is listed in another group too", source)
            seen_sources.add(source)
        groups.append(group)

    scaling_raw = _mapping(spec.get("scaling", {}), "spec.scaling")
    scaling = _parse_scaling(scaling_raw)
    interval_s = scaling_raw.get("intervalSeconds", DEFAULT_INTERVAL_S)
    if not (_is_number(interval_s) and interval_s >= 1):
        raise SpecError("spec.scaling.intervalSeconds", "must be a number >= 1", interval_s)
    mixture = _mapping(spec.get("mixture", {}), "spec.mixture")
    schedule = declared_schedule(mixture, [s for g in groups for s in g.sources])
    return DataPlaneSpec(
        name=name,
        namespace=namespace,
        uid=uid,
        generation=generation,
        groups=tuple(groups),
        loader=_parse_loader(spec, name, namespace),
        scaling=scaling,
        interval_s=float(interval_s),
        schedule=schedule,
    )


def _parse_group(raw: object, i: int, dataplane: str) -> SourceGroup:
    at = f"spec.sourceGroups[{i}]"
    raw = _mapping(raw, at)
    name = raw.get("name")
    if not (isinstance(name, str) and _DNS_LABEL.fullmatch(name) and len(name) <= 63):
        raise SpecError(f"{at}.name", "must be a DNS label (lowercase letters, digits, '-') of at most 63 characters", name)
    if len(deployment_name(dataplane, name)) > 253:
        raise SpecError(f"{at}.name", f"makes the Deployment name {deployment_name(dataplane, name)!r} longer than 253 characters", name)
    sources_raw = raw.get("sources")
    if not (isinstance(sources_raw, list) and sources_raw):
        raise SpecError(f"{at}.sources", "must be a non-empty list", sources_raw)
    sources, cost_s = [], {}
    for j, source in enumerate(sources_raw):
        source = _mapping(source, f"{at}.sources[{j}]")
        source_name = source.get("name")
        if not (isinstance(source_name, str) and _SOURCE_NAME.fullmatch(source_name)):
            raise SpecError(f"{at}.sources[{j}].name", "must be a source name (letters, digits, _ - .)", source_name)
        if source_name in sources:
            raise SpecError(f"{at}.sources[{j}].name", "is listed twice", source_name)
        sources.append(source_name)
        if "costSecondsPerSample" in source:
            cost = source["costSecondsPerSample"]
            if not (_is_number(cost) and cost >= 0):
                raise SpecError(f"{at}.sources[{j}].costSecondsPerSample", "must be a finite number >= 0", cost)
            cost_s[source_name] = float(cost)
    low, high = _positive_int(raw, at, "minReplicas"), _positive_int(raw, at, "maxReplicas")
    if high < low:
        raise SpecError(f"{at}.maxReplicas", f"must be >= minReplicas ({low})", high)
    workers = _positive_int(raw, at, "workersPerActor", default=1)
    resources = _mapping(raw.get("resources", {}), f"{at}.resources")
    for key, quantities in resources.items():
        if key not in ("requests", "limits"):
            raise SpecError(f"{at}.resources.{key}", "unknown key; known keys: requests, limits", quantities)
        for resource, quantity in _mapping(quantities, f"{at}.resources.{key}").items():
            if not (isinstance(quantity, str) and quantity or _is_int(quantity) or _is_number(quantity)):
                raise SpecError(f"{at}.resources.{key}.{resource}", "must be a quantity (a string or a number)", quantity)
    return SourceGroup(
        name=name,
        index=i,
        sources=tuple(sources),
        cost_s=cost_s,
        min_replicas=low,
        max_replicas=high,
        workers_per_actor=workers,
        resources=copy.deepcopy(dict(resources)),
    )


def _positive_int(raw: Mapping[str, Any], at: str, field: str, *, default: int | None = None) -> int:
    """`raw[field]` (`default` when absent), an integer >= 1."""
    value = raw.get(field, default)
    if not (_is_int(value) and value >= 1):
        raise SpecError(f"{at}.{field}", "must be an integer >= 1", value)
    return value


def _parse_scaling(raw: Mapping[str, Any]) -> ScalingSettings:
    kwargs: dict[str, Any] = {}  # ScalingSettings' fields by name: ints and floats, checked by it
    threshold = raw.get("threshold")
    if threshold is not None:
        if not (_is_number(threshold) and 0 <= threshold < 1):
            raise SpecError("spec.scaling.threshold", "must be a number in [0, 1)", threshold)
        kwargs["up_threshold"] = kwargs["down_threshold"] = float(threshold)
    for field, name in _SCALING_FIELDS.items():
        if field not in raw:
            continue
        value = raw[field]
        integer = field in ("windowIntervals", "consecutiveIntervals")
        if not (_is_int(value) if integer else _is_number(value)):
            raise SpecError(f"spec.scaling.{field}", "must be an integer" if integer else "must be a finite number", value)
        kwargs[name] = value if integer else float(value)
    try:
        return ScalingSettings(**kwargs)
    except ConfigError as exc:
        field = {v: k for k, v in _SCALING_FIELDS.items()}.get(exc.field.removeprefix("scaling."), exc.field)
        raise SpecError(f"spec.scaling.{field}", exc.problem, exc.value) from None


def _parse_loader(spec: Mapping[str, Any], name: str, namespace: str) -> LoaderTemplate:
    raw = _mapping(spec.get("loader", {}), "spec.loader")
    image = raw.get("image")
    if not (isinstance(image, str) and image):
        raise SpecError("spec.loader.image", "is required (the batchplane image loaders run)", image)
    planner = _mapping(spec.get("planner", {}), "spec.planner")
    address = planner.get("address", f"{name}-planner.{namespace}.svc:{DEFAULT_PLANNER_PORT}")
    if not (isinstance(address, str) and _ADDRESS.fullmatch(address)):
        raise SpecError("spec.planner.address", "must be host:port", address)
    config_map = raw.get("jobConfigMap", f"{name}-job")
    if not (isinstance(config_map, str) and config_map):
        raise SpecError("spec.loader.jobConfigMap", "must be a ConfigMap name", config_map)
    policy = raw.get("imagePullPolicy")
    if policy is not None and policy not in _PULL_POLICIES:
        raise SpecError("spec.loader.imagePullPolicy", f"must be one of {', '.join(_PULL_POLICIES)}", policy)
    secrets = raw.get("imagePullSecrets", [])
    if not (isinstance(secrets, list) and all(isinstance(s, Mapping) and isinstance(s.get("name"), str) for s in secrets)):
        raise SpecError("spec.loader.imagePullSecrets", "must be a list of {name: <secret>}", secrets)
    ports = {}
    for field, default in (("grpcPort", DEFAULT_GRPC_PORT), ("metricsPort", DEFAULT_METRICS_PORT)):
        port = raw.get(field, default)
        if not (_is_int(port) and 1 <= port <= 65535):
            raise SpecError(f"spec.loader.{field}", "must be a port number (1..65535)", port)
        ports[field] = port
    if ports["grpcPort"] == ports["metricsPort"]:
        raise SpecError("spec.loader.metricsPort", "must differ from grpcPort", ports["metricsPort"])
    ids = {}
    for field in ("runAsUser", "runAsGroup"):
        value = raw.get(field, DEFAULT_RUN_AS)
        if not (_is_int(value) and value >= 1):
            raise SpecError(f"spec.loader.{field}", "must be an integer >= 1 (never root)", value)
        ids[field] = value
    maps = {}
    for field in ("podLabels", "podAnnotations"):
        value = _mapping(raw.get(field, {}), f"spec.loader.{field}")
        for key, text in value.items():
            if not isinstance(text, str):
                raise SpecError(f"spec.loader.{field}.{key}", "must be a string", text)
        maps[field] = dict(value)
    try:
        pod = parse_pod_options(raw, at="spec.loader")
    except ConfigError as exc:
        raise SpecError(exc.field, exc.problem, exc.value) from None
    if raw.get("tls") is not None:
        raise SpecError(
            "spec.loader.tls",
            "is no longer taken: one certificate Secret mounted by every loader pod lets any of them act for every replica; "
            "use spec.loader.identity (the issuer gives each pod a certificate naming it alone; the chart's tls.mode issued)",
            raw["tls"],
        )
    auth_tokens = _secret_name(raw, "authTokens")
    identity = _identity(raw)
    reserved = (TLS_VOLUME, AUTH_TOKENS_VOLUME, ISSUER_VOLUME)
    for i, volume in enumerate(pod.volumes):
        if volume.get("name") in reserved:
            raise SpecError(
                f"spec.loader.volumes[{i}].name",
                f"is used by batchplane ({', '.join(reserved)} are reserved)",
                volume.get("name"),
            )
    return LoaderTemplate(
        image=image,
        planner_address=address,
        job_config_map=config_map,
        image_pull_policy=policy,
        image_pull_secrets=tuple(s["name"] for s in secrets),
        grpc_port=ports["grpcPort"],
        metrics_port=ports["metricsPort"],
        run_as_user=ids["runAsUser"],
        run_as_group=ids["runAsGroup"],
        pod_labels=maps["podLabels"],
        pod_annotations=maps["podAnnotations"],
        pod=pod,
        auth_tokens_secret=auth_tokens,
        auth_token_verifiers=_verifiers(raw),
        identity=identity,
    )


#: The fields of spec.loader.authTokens.
_SECRET_FIELDS = {"authTokens": ("secretName", "verifiers")}


def _secret_name(loader: Mapping[str, Any], field: str) -> str | None:
    """spec.loader.<field>.secretName: a Secret's name, or None when <field> is absent."""
    if loader.get(field) is None:
        return None
    section = _mapping(loader[field], f"spec.loader.{field}")
    known = _SECRET_FIELDS[field]
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise SpecError(f"spec.loader.{field}.{unknown[0]}", f"unknown field; known fields: {', '.join(known)}", section[unknown[0]])
    name = section.get("secretName")
    if not (isinstance(name, str) and _DNS_SUBDOMAIN.fullmatch(name) and len(name) <= 253):
        raise SpecError(f"spec.loader.{field}.secretName", "must be a Secret name (a DNS subdomain)", name)
    return name


#: The fields of spec.loader.identity.
_IDENTITY_FIELDS = ("issuer", "caConfigMap", "caSecret", "audience", "tokenExpirationSeconds")


def _identity(loader: Mapping[str, Any]) -> LoaderIdentity | None:
    """spec.loader.identity, or None when absent."""
    if loader.get("identity") is None:
        return None
    section = _mapping(loader["identity"], "spec.loader.identity")
    unknown = sorted(set(section) - set(_IDENTITY_FIELDS))
    if unknown:
        raise SpecError(
            f"spec.loader.identity.{unknown[0]}", f"unknown field; known fields: {', '.join(_IDENTITY_FIELDS)}", section[unknown[0]]
        )
    issuer = section.get("issuer")
    if not (isinstance(issuer, str) and _ADDRESS.fullmatch(issuer)):
        raise SpecError("spec.loader.identity.issuer", "must be host:port (the issuer's address)", issuer)
    if "caConfigMap" in section and "caSecret" in section:
        raise SpecError(
            "spec.loader.identity.caSecret",
            "is set with caConfigMap: the CA certificate comes from a ConfigMap or a Secret, not both",
            section["caSecret"],
        )
    field, kind = ("caSecret", "Secret") if "caSecret" in section else ("caConfigMap", "ConfigMap")
    ca = section.get(field)
    if not (isinstance(ca, str) and _DNS_SUBDOMAIN.fullmatch(ca) and len(ca) <= 253):
        raise SpecError(
            f"spec.loader.identity.{field}", f"must be a {kind} name (a DNS subdomain); one of caConfigMap and caSecret is required", ca
        )
    audience = section.get("audience", DEFAULT_AUDIENCE)
    if not (isinstance(audience, str) and audience):
        raise SpecError("spec.loader.identity.audience", "must be a non-empty string", audience)
    expiration = section.get("tokenExpirationSeconds", DEFAULT_TOKEN_EXPIRATION_S)
    if not (_is_int(expiration) and MIN_TOKEN_EXPIRATION_S <= expiration <= MAX_TOKEN_EXPIRATION_S):
        raise SpecError(
            "spec.loader.identity.tokenExpirationSeconds",
            f"must be an integer from {MIN_TOKEN_EXPIRATION_S} to {MAX_TOKEN_EXPIRATION_S} (Kubernetes' bounds)",
            expiration,
        )
    return LoaderIdentity(
        issuer=issuer,
        ca_config_map=ca if field == "caConfigMap" else None,
        ca_secret=ca if field == "caSecret" else None,
        audience=audience,
        token_expiration_s=expiration,
    )


def _verifiers(loader: Mapping[str, Any]) -> bool:
    """spec.loader.authTokens.verifiers: a boolean, false when absent."""
    value = (loader.get("authTokens") or {}).get("verifiers", False)
    if not isinstance(value, bool):
        raise SpecError("spec.loader.authTokens.verifiers", "must be true or false", value)
    return value


# ---- the declared schedule ----------------------------------------------------------------------


def declared_schedule(mixture: Mapping[str, Any], source_names: Sequence[str]) -> ScheduleFn | None:
    """The weights spec.mixture declares per step, for scaling ahead of a change.

    Staged (piecewise constant) and curriculum (piecewise linear) schedules are read by the
    planner's own schedule semantics (`batchplane.core.schedule`): a source a weights mapping
    leaves out gets weight 1. Static weights, and the kinds whose weights are not known in
    advance (callable, adaptive), give None.

    Raises:
        SpecError: a staged or curriculum schedule that is malformed, named as in the resource
            (e.g. "spec.mixture.schedule.stages[1].start").
    """
    spec = mixture.get("schedule")
    if spec is None:
        return None
    spec = _mapping(spec, "spec.mixture.schedule")
    if spec.get("kind") not in ("staged", "curriculum"):
        return None
    # The job may name sources of groups this DataPlane no longer has: read them as the planner
    # does (it has them all) and leave them out of the result.
    points = spec.get("stages" if spec.get("kind") == "staged" else "anchors")
    named = (
        [n for p in points if isinstance(p, Mapping) and isinstance(p.get("weights"), Mapping) for n in p["weights"]]
        if isinstance(points, list)
        else []
    )
    served = tuple(source_names)
    names = served + tuple(dict.fromkeys(n for n in named if n not in served))
    try:
        schedule, _ = schedule_from_mapping({"schedule": spec}, names)
    except ScheduleError as exc:
        raise SpecError(f"spec.{exc.field}", exc.problem, exc.value) from None

    def at_step(t: float) -> dict[str, float]:
        return dict(zip(served, schedule.weights_at(t)))

    return at_step


# ---- names --------------------------------------------------------------------------------------


def deployment_name(dataplane: str, group: str) -> str:
    """`<DataPlane>-loader-<group>`."""
    return f"{dataplane}-loader-{group}"


# ---- helpers --------------------------------------------------------------------------------------


def _mapping(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(field, "must be a mapping", value)
    return value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
