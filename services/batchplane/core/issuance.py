"""Which identity batchplane's issuer (the operator, in the chart's `tls.mode: issued`) gives a
pod that asks for a certificate. Pure: the caller passes what the Kubernetes API said.

A pod proves who it is with a projected ServiceAccount token whose audience is batchplane's. The
API server's TokenReview says which ServiceAccount and which pod (name and uid) the token was
made for, so a token copied out of a pod still names that pod and no other. The identity comes
only from what a process in the pod cannot change about it:

| role | from | identity |
| --- | --- | --- |
| planner | a ServiceAccount the operator maps to it (`--issuer-role planner=SA`) | `batchplane://planner` |
| loader | the ServiceAccount, the label `batchplane.dev/group-index` the operator's Deployment puts on its pods, and the pod's name (its `--replica`) | `batchplane://loader/<group>/<pod>` |
| constructor | the ServiceAccount, and the index its trainer pod's controller gave it (labels, annotations, name: `core.pod_rank`, the chart's `constructor.indexFrom`) | `batchplane://constructor/<index>` |

A pod outside the operator's namespace, one whose uid is not the token's (a pod deleted and made
again under the same name), one that has finished, or one whose ServiceAccount maps to no role is
refused, with the reason named.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from batchplane.core import pod_rank
from batchplane.core.errors import PermissionDenied
from batchplane.core.identity import Identity

#: What a TokenReview's user.extra says of the pod a projected token was made for.
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
#: The label of a loader pod naming its group's index (set by the operator's loader Deployments).
GROUP_INDEX_LABEL = "batchplane.dev/group-index"
#: Roles the issuer gives out (the operator signs its own; the trainer has none).
ISSUED_ROLES = ("planner", "loader", "constructor")
_SERVICE_ACCOUNT = re.compile(r"^system:serviceaccount:([^:]+):([^:]+)$")
#: Pod phases whose pod may still serve: a finished one gets nothing.
_LIVE_PHASES = ("", "Pending", "Running")


class IssuanceRefused(PermissionDenied):
    """The issuer gives this pod no certificate.

    Attributes:
        reason: A short label for metrics (e.g. "audience", "role").
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class IssuancePolicy:
    """Whom the issuer serves.

    Attributes:
        namespace: The operator's namespace: only its pods are served.
        roles: ServiceAccount name -> the role its pods get.
        audience: The audience a pod's token must be for.
        index_from: How a constructor's index is read from its trainer pod (a `core.pod_rank`
            source); None: constructors are not served.
        trainer_pods: The number of trainer pods (the `jobset` source needs it); None: unknown.
    """

    namespace: str
    roles: Mapping[str, str]
    audience: str = "batchplane"
    index_from: str | None = None
    trainer_pods: int | None = None

    def __post_init__(self) -> None:
        for account, role in self.roles.items():
            if role not in ISSUED_ROLES:
                raise ValueError(f"ServiceAccount {account!r}: role {role!r} is not one the issuer gives ({', '.join(ISSUED_ROLES)})")
        if self.index_from is not None:
            pod_rank.check_source(self.index_from)


@dataclasses.dataclass(frozen=True)
class Reviewed:
    """Who a TokenReview says a token belongs to."""

    service_account: str
    pod: str
    pod_uid: str


def reviewed(policy: IssuancePolicy, status: Mapping[str, Any]) -> Reviewed:
    """The ServiceAccount and pod of a reviewed token (`status`: the TokenReview's status).

    Raises:
        IssuanceRefused: the token is not authenticated, not for the policy's audience, not a
            ServiceAccount's of the policy's namespace, or not bound to a pod.
    """
    if status.get("authenticated") is not True:
        error = str(status.get("error") or "")[:200]
        raise IssuanceRefused("token", "the token was not authenticated" + (f": {error}" if error else ""))
    audiences = status.get("audiences")
    if not isinstance(audiences, list) or policy.audience not in audiences:
        raise IssuanceRefused("audience", f"the token is not for audience {policy.audience!r}")
    user = _mapping(status.get("user"))
    match = _SERVICE_ACCOUNT.match(str(user.get("username", "")))
    if match is None:
        raise IssuanceRefused("subject", "the token is not a ServiceAccount's")
    namespace, account = match.groups()
    if namespace != policy.namespace:
        raise IssuanceRefused("namespace", f"the token is a ServiceAccount's of namespace {namespace!r}, not {policy.namespace!r}")
    extra = _mapping(user.get("extra"))
    pod, uid = _one(extra, POD_NAME_EXTRA), _one(extra, POD_UID_EXTRA)
    if not pod or not uid:
        raise IssuanceRefused("unbound", "the token is bound to no pod (a projected ServiceAccount token is)")
    return Reviewed(account, pod, uid)


def identity_for(policy: IssuancePolicy, who: Reviewed, pod: Mapping[str, Any] | None) -> Identity:
    """The identity the pod of `who` is issued; `pod`: the pod as the API has it (None: gone).

    Raises:
        IssuanceRefused: the pod is gone, made again, finished, or of a ServiceAccount with no
            role; a loader without its group label; a constructor whose index cannot be read.
    """
    if pod is None:
        raise IssuanceRefused("pod", f"pod {who.pod!r} does not exist")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if meta.get("uid") != who.pod_uid or meta.get("namespace", policy.namespace) != policy.namespace:
        raise IssuanceRefused("pod", f"pod {who.pod!r} is not the one the token was made for")
    if spec.get("serviceAccountName", "default") != who.service_account:
        raise IssuanceRefused("pod", f"pod {who.pod!r} does not run as ServiceAccount {who.service_account!r}")
    phase = str((pod.get("status") or {}).get("phase", ""))
    if phase not in _LIVE_PHASES:
        raise IssuanceRefused("pod", f"pod {who.pod!r} has finished ({phase})")
    role = policy.roles.get(who.service_account)
    if role is None:
        raise IssuanceRefused("role", f"ServiceAccount {who.service_account!r} is given no batchplane role")
    if role == "planner":
        return Identity("planner")
    if role == "loader":
        group = str((meta.get("labels") or {}).get(GROUP_INDEX_LABEL, ""))
        if not group.isdigit() or len(group) > 6:
            raise IssuanceRefused("label", f"loader pod {who.pod!r} has no valid label {GROUP_INDEX_LABEL} ({group!r})")
        return Identity("loader", int(group), who.pod)
    return Identity("constructor", _constructor_index(policy, who.pod, pod))


def _constructor_index(policy: IssuancePolicy, name: str, pod: Mapping[str, Any]) -> int:
    if policy.index_from is None:
        raise IssuanceRefused("role", "the issuer gives no constructor identities (no --issuer-index-from)")
    environ = pod_environment(pod)
    if policy.trainer_pods is not None:
        environ[pod_rank.TRAINER_PODS] = str(policy.trainer_pods)
    try:
        return pod_rank.resolve_index(policy.index_from, environ)
    except pod_rank.PodRankError as exc:
        raise IssuanceRefused("index", f"pod {name!r}: {exc}") from None


def pod_environment(pod: Mapping[str, Any]) -> dict[str, str]:
    """The variables `core.pod_rank` reads, as the downward API would fill them from `pod`,
    plus every literal `value` its containers' environments set (for an `env:NAME` source)."""
    meta = pod.get("metadata") or {}
    environ: dict[str, str] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for var in container.get("env") or []:
            if isinstance(var, Mapping) and isinstance(var.get("value"), str):
                environ[str(var.get("name"))] = var["value"]
    for variable, path in pod_rank.FIELD_PATHS.items():
        environ[variable] = _field(meta, path)
    return environ


def _field(meta: Mapping[str, Any], path: str) -> str:
    """A downward-API fieldPath of the pod's metadata ("" where the pod has none, as the API gives)."""
    if path == "metadata.name":
        return str(meta.get("name", ""))
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match is None:
        raise ValueError(f"unsupported fieldPath {path!r}")
    return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _one(extra: Mapping[str, Any], key: str) -> str:
    values = extra.get(key)
    return str(values[0]) if isinstance(values, list) and len(values) == 1 else ""
