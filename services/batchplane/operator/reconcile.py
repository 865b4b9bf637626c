"""What the operator does about one DataPlane: the loader Deployments to create, update, scale
or delete, and the status it writes.

Pure: no I/O, no clock (times come in as arguments), no Kubernetes client. `plan` compares a
DataPlane with the Deployments that exist and returns the actions; the caller applies them.

Rules of `plan`:

- It only ever considers Deployments the operator made for this DataPlane (`owned`): label
  app.kubernetes.io/managed-by=batchplane-operator, label batchplane.dev/dataplane=<name> and a
  controller ownerReference with the DataPlane's uid. Anything else is never changed.
- A group without its Deployment gets one (Create), with `minReplicas` replicas.
- A Deployment whose spec-hash annotation, image or args differ from what the DataPlane asks
  for gets a merge patch of its labels, owner, strategy and pod template (Update). The patch
  never carries `replicas`: those belong to the scaling policy.
- A Deployment whose replicas lie outside the group's [minReplicas, maxReplicas] is scaled to
  the nearest bound (Scale); otherwise its replicas are left as they are.
- An owned Deployment of a group the DataPlane no longer lists is deleted (Delete).

The status (`status`, `status_patch`): `groups` [{name, replicas (ready pods), desiredReplicas
(what the operator set)}], `observedMixture` {source: share}, `conditions` (Ready, Scaling,
Degraded; a condition keeps its lastTransitionTime while its status stays) and
`observedGeneration`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from batchplane.operator.dataplane import DataPlaneSpec, deployment_name
from batchplane.operator.manifests import (
    ANNOTATION_SPEC_HASH,
    CONTAINER,
    LABEL_DATAPLANE,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    MANAGER,
    OPTIONAL_POD_FIELDS,
    REPLACED_POD_MAPS,
    loader_deployment,
)

#: Digits kept of each observed share in the status (so float noise does not rewrite it).
MIXTURE_DIGITS = 4


@dataclasses.dataclass(frozen=True)
class Create:
    """Create a group's Deployment."""

    group: str
    name: str
    body: Mapping[str, Any]
    why: str


@dataclasses.dataclass(frozen=True)
class Update:
    """Merge-patch a group's Deployment (never its replicas)."""

    group: str
    name: str
    patch: Mapping[str, Any]
    why: str


@dataclasses.dataclass(frozen=True)
class Scale:
    """Set a group's replicas through the scale subresource."""

    group: str
    name: str
    replicas: int
    previous: int
    why: str


@dataclasses.dataclass(frozen=True)
class Delete:
    """Delete a Deployment the operator made for a group the DataPlane no longer lists."""

    group: str
    name: str
    why: str


Action = Create | Update | Scale | Delete


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One group after the plan's actions."""

    #: The group's name and its Deployment's name.
    name: str
    deployment: str
    #: Whether the Deployment existed before the plan.
    existed: bool
    #: Its spec.replicas once the actions are applied.
    replicas: int
    #: Its ready pods now (status.readyReplicas; 0 for a Deployment created now).
    ready: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do about one DataPlane's Deployments."""

    actions: tuple[Action, ...]
    #: Every group of the DataPlane, in spec order.
    groups: tuple[GroupView, ...]


@dataclasses.dataclass(frozen=True)
class Condition:
    """A status condition as the operator wants it; times are added by `conditions`."""

    type: str
    status: bool
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class GroupStatus:
    """One entry of status.groups."""

    name: str
    #: Ready pods.
    replicas: int
    #: Pods the operator wants (the Deployment's spec.replicas).
    desired: int


# ---- Deployments ----------------------------------------------------------------------------------


def owned(spec: DataPlaneSpec, deployments: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The Deployments the operator made for `spec`'s DataPlane, from any list of Deployments."""
    out = []
    for d in deployments:
        meta = d.get("metadata", {})
        labels = meta.get("labels") or {}
        if labels.get(LABEL_MANAGED_BY) != MANAGER or labels.get(LABEL_DATAPLANE) != spec.name:
            continue
        if meta.get("namespace", spec.namespace) != spec.namespace:
            continue
        if not any(r.get("uid") == spec.uid and r.get("controller") for r in meta.get("ownerReferences") or ()):
            continue
        out.append(d)
    return out


def plan(spec: DataPlaneSpec, deployments: Sequence[Mapping[str, Any]]) -> Plan:
    """The actions that bring `spec`'s loader Deployments in line with it.

    Args:
        spec: The DataPlane.
        deployments: Deployments of the namespace (any; only `owned` ones are considered).
    Returns:
        The actions, in order (creates and updates by group, then deletes), and every group's
        replicas once they are applied.
    """
    mine = {d["metadata"]["name"]: d for d in owned(spec, deployments)}
    actions: list[Action] = []
    views = []
    for group in spec.groups:
        name = deployment_name(spec.name, group.name)
        live = mine.get(name)
        if live is None or (live.get("metadata", {}).get("labels") or {}).get(LABEL_GROUP) != group.name:
            body = loader_deployment(spec, group, replicas=group.min_replicas)
            actions.append(Create(group.name, name, body, f"group {group.name!r} has no loader Deployment"))
            views.append(GroupView(group.name, name, existed=False, replicas=group.min_replicas, ready=0))
            continue
        desired = loader_deployment(spec, group, replicas=replicas(live))
        drift = _drift(desired, live)
        if drift:
            actions.append(Update(group.name, name, update_patch(desired, live), "; ".join(drift)))
        current = replicas(live)
        bounded = group.clamp(current)
        if bounded != current:
            why = f"replicas {current} outside [{group.min_replicas}, {group.max_replicas}]"
            actions.append(Scale(group.name, name, bounded, current, why))
        views.append(GroupView(group.name, name, existed=True, replicas=bounded, ready=ready_replicas(live)))
    expected = {deployment_name(spec.name, g.name): g.name for g in spec.groups}
    for name, live in sorted(mine.items()):
        group = (live["metadata"].get("labels") or {}).get(LABEL_GROUP, "")
        if expected.get(name) != group:
            actions.append(Delete(group, name, f"group {group!r} is no longer in the DataPlane"))
    return Plan(tuple(actions), tuple(views))


def replicas(deployment: Mapping[str, Any]) -> int:
    """A Deployment's spec.replicas (Kubernetes' default, 1, when absent)."""
    value = deployment.get("spec", {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def ready_replicas(deployment: Mapping[str, Any]) -> int:
    """A Deployment's ready pods (status.readyReplicas; 0 when absent)."""
    value = (deployment.get("status") or {}).get("readyReplicas", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def update_patch(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that sets `desired`'s labels, spec-hash, owner, strategy and pod
    template on `live`, leaving its replicas (and selector, which is immutable) alone.

    Merge patches replace lists whole (containers, volumes, tolerations) and merge maps;
    optional pod fields the DataPlane no longer sets are removed with null, and the keys of a
    mapping field (nodeSelector, affinity) that the DataPlane no longer sets too, so the live
    field ends up exactly as asked.
    """
    meta = desired["metadata"]
    template = desired["spec"]["template"]
    pod = dict(template["spec"])
    live_pod = live.get("spec", {}).get("template", {}).get("spec", {})
    for optional in OPTIONAL_POD_FIELDS:
        if optional not in pod and optional in live_pod:
            pod[optional] = None
    for name in REPLACED_POD_MAPS:
        if name in pod and isinstance(live_pod.get(name), Mapping):
            pod[name] = _replacing(live_pod[name], pod[name])
    return {
        "metadata": {
            "labels": dict(meta["labels"]),
            "annotations": {ANNOTATION_SPEC_HASH: meta["annotations"][ANNOTATION_SPEC_HASH]},
            "ownerReferences": list(meta["ownerReferences"]),
        },
        "spec": {
            "strategy": desired["spec"]["strategy"],
            "template": {"metadata": dict(template["metadata"]), "spec": pod},
        },
    }


def _replacing(live: Any, desired: Any) -> Any:
    """The merge patch that turns `live` into exactly `desired` (keys `desired` lacks: null)."""
    if not (isinstance(live, Mapping) and isinstance(desired, Mapping)):
        return desired
    patch: dict[str, Any] = {key: None for key in live if key not in desired}
    patch.update({key: _replacing(live.get(key), value) for key, value in desired.items()})
    return patch


def _drift(desired: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """How `live` differs from `desired` where it matters; empty when it does not."""
    out = []
    want = desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    have = (live.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if have != want:
        out.append(f"spec hash {have} -> {want}")
    ours = desired["spec"]["template"]["spec"]["containers"][0]
    theirs = next(
        (c for c in live.get("spec", {}).get("template", {}).get("spec", {}).get("containers", ()) if c.get("name") == CONTAINER), None
    )
    if theirs is None:
        out.append(f"no {CONTAINER!r} container")
    else:
        if theirs.get("image") != ours["image"]:
            out.append(f"image {theirs.get('image')} -> {ours['image']}")
        if theirs.get("args") != ours["args"]:
            out.append("args " + " ".join(map(str, theirs.get("args") or ())) + " -> " + " ".join(ours["args"]))
    return out


# ---- status ---------------------------------------------------------------------------------------


def conditions(
    wanted: Sequence[Condition], previous: Sequence[Mapping[str, Any]] | None, *, now: str, generation: int
) -> list[dict[str, Any]]:
    """Status conditions: `wanted`, each keeping its previous lastTransitionTime while its status
    is unchanged, then previous conditions of other types as they were.

    Args:
        wanted: The conditions as they are now.
        previous: status.conditions as read (may be None).
        now: The time of this pass, RFC 3339 ("2025-01-01T00:00:00Z").
        generation: metadata.generation the conditions were computed from.
    """
    before = {c.get("type"): c for c in previous or () if isinstance(c, Mapping)}
    out = []
    for c in wanted:
        status = "True" if c.status else "False"
        old = before.get(c.type)
        since = old.get("lastTransitionTime") if old is not None and old.get("status") == status else None
        out.append(
            {
                "type": c.type,
                "status": status,
                "observedGeneration": generation,
                "lastTransitionTime": since or now,
                "reason": c.reason,
                "message": c.message,
            }
        )
    types = {c.type for c in wanted}
    out += [dict(c) for t, c in before.items() if t not in types]
    return out


def ready_condition(groups: Sequence[GroupStatus]) -> Condition:
    """Ready: every group runs at least one ready pod and as many as it should."""
    short = [g for g in groups if g.replicas < max(g.desired, 1)]
    if not short:
        return Condition("Ready", True, "LoadersReady", f"{len(groups)} loader groups ready: " + _counts(groups))
    return Condition("Ready", False, "LoadersNotReady", "waiting for loader pods: " + _counts(short))


def scaling_condition(groups: Sequence[GroupStatus], reasons: Mapping[str, str]) -> Condition:
    """Scaling: some group runs other than its desired replicas (pods starting or stopping).

    Args:
        groups: Every group.
        reasons: The policy's reason per group that changed in this pass.
    """
    moving = [g for g in groups if g.replicas != g.desired]
    if not moving:
        return Condition("Scaling", False, "Steady", "every group runs its desired replicas")
    up = any(g.desired > g.replicas for g in moving)
    down = any(g.desired < g.replicas for g in moving)
    reason = "ScalingUp" if up and not down else "ScalingDown" if down and not up else "Scaling"
    parts = [f"{g.name} {g.replicas} -> {g.desired}" + (f" ({reasons[g.name]})" if g.name in reasons else "") for g in moving]
    return Condition("Scaling", True, reason, "; ".join(parts))


def degraded_condition(problems: Sequence[tuple[str, str]]) -> Condition:
    """Degraded: something failed in this pass. `problems`: (reason, message) pairs, most
    important first; empty when all went well."""
    if not problems:
        return Condition("Degraded", False, "AsExpected", "reconciled and observed the mixture")
    return Condition("Degraded", True, problems[0][0], "; ".join(m for _, m in problems))


def status(
    *,
    generation: int,
    groups: Sequence[GroupStatus] | None,
    mixture: Mapping[str, float] | None,
    conditions: Sequence[Mapping[str, Any]],
    previous: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The DataPlane's status.

    Args:
        generation: metadata.generation acted on.
        groups: Every group; None keeps the previous status.groups.
        mixture: Observed share per source; None keeps the previous status.observedMixture.
        conditions: From `conditions`.
        previous: The status as read (may be None).
    """
    previous = previous or {}
    out: dict[str, Any] = {"observedGeneration": generation}
    if groups is not None:
        out["groups"] = [{"name": g.name, "replicas": g.replicas, "desiredReplicas": g.desired} for g in groups]
    elif "groups" in previous:
        out["groups"] = previous["groups"]
    if mixture is not None:
        out["observedMixture"] = {s: round(float(w), MIXTURE_DIGITS) for s, w in sorted(mixture.items())}
    elif "observedMixture" in previous:
        out["observedMixture"] = previous["observedMixture"]
    out["conditions"] = list(conditions)
    return out


def status_patch(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch of the status subresource that turns `previous` into `new`; None when
    they are equal. Sources gone from observedMixture are removed with null."""
    previous = dict(previous or {})
    if previous == dict(new):
        return None
    body = dict(new)
    gone = set(previous.get("observedMixture") or {}) - set(new.get("observedMixture") or {})
    if gone:
        body["observedMixture"] = {**(new.get("observedMixture") or {}), **{s: None for s in sorted(gone)}}
    return {"status": body}


def _counts(groups: Sequence[GroupStatus]) -> str:
    return ", ".join(f"{g.name} {g.replicas}/{g.desired}" for g in groups)
