"""Which identity the issuer (tls.mode issued) gives a pod (`core.issuance`): a token names one
pod, the pod's ServiceAccount its role, what its controller wrote on it (never what runs in it)
its index, and anything that does not fit is refused with its reason. Pure: milliseconds."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.identity import Identity
from batchplane.core.issuance import (
    GROUP_INDEX_LABEL,
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    IssuancePolicy,
    IssuanceRefused,
    identity_for,
    reviewed,
)

NS = "training"
POLICY = IssuancePolicy(NS, {"bp-planner": "planner", "bp-loader": "loader", "bp-trainer": "constructor"}, index_from="indexed-job")


def review(pod: str, uid: str, account: str, *, namespace: str = NS, audiences: tuple[str, ...] = ("batchplane",)) -> dict[str, Any]:
    """A TokenReview status as the API server writes it for a projected token."""
    return {
        "authenticated": True,
        "audiences": list(audiences),
        "user": {
            "username": f"system:serviceaccount:{namespace}:{account}",
            "extra": {POD_NAME_EXTRA: [pod], POD_UID_EXTRA: [uid]},
        },
    }


def pod(name: str, uid: str, account: str, *, labels: dict | None = None, annotations: dict | None = None, phase: str = "Running") -> dict:
    return {
        "metadata": {"name": name, "namespace": NS, "uid": uid, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"serviceAccountName": account, "containers": [{"name": "main"}]},
        "status": {"phase": phase},
    }


def issue(status: dict, the_pod: dict | None, policy: IssuancePolicy = POLICY) -> Identity:
    return identity_for(policy, reviewed(policy, status), the_pod)


def test_each_role_gets_its_own_identity() -> None:
    assert issue(review("planner-7f", "u1", "bp-planner"), pod("planner-7f", "u1", "bp-planner")) == Identity("planner")
    loader = pod("d-loader-web-5d9-x2", "u2", "bp-loader", labels={GROUP_INDEX_LABEL: "3"})
    assert issue(review("d-loader-web-5d9-x2", "u2", "bp-loader"), loader) == Identity("loader", 3, "d-loader-web-5d9-x2")
    trainer = pod("train-4-abc", "u3", "bp-trainer", annotations={"batch.kubernetes.io/job-completion-index": "4"})
    assert issue(review("train-4-abc", "u3", "bp-trainer"), trainer) == Identity("constructor", 4)


def test_a_constructor_index_is_read_the_way_the_chart_s_index_source_reads_it() -> None:
    kubeflow = IssuancePolicy(NS, {"t": "constructor"}, index_from="kubeflow")
    labels = {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "2"}
    assert issue(review("pj-worker-2", "u", "t"), pod("pj-worker-2", "u", "t", labels=labels), kubeflow) == Identity("constructor", 3)
    ordinal = IssuancePolicy(NS, {"t": "constructor"}, index_from="pod-ordinal")
    assert issue(review("set-11", "u", "t"), pod("set-11", "u", "t"), ordinal) == Identity("constructor", 11)
    jobset = IssuancePolicy(NS, {"t": "constructor"}, index_from="jobset", trainer_pods=8)
    labels = {"jobset.sigs.k8s.io/job-index": "1", "jobset.sigs.k8s.io/replicatedjob-replicas": "2"}
    annotations = {"batch.kubernetes.io/job-completion-index": "3"}
    assert issue(review("js", "u", "t"), pod("js", "u", "t", labels=labels, annotations=annotations), jobset) == Identity("constructor", 7)
    by_env = IssuancePolicy(NS, {"t": "constructor"}, index_from="env:NODE_RANK")
    with_env = pod("p", "u", "t")
    with_env["spec"]["containers"][0]["env"] = [{"name": "NODE_RANK", "value": "5"}]
    assert issue(review("p", "u", "t"), with_env, by_env) == Identity("constructor", 5)


REFUSALS = [
    ("token", lambda s, p: s.update(authenticated=False)),
    ("audience", lambda s, p: s.update(audiences=["https://kubernetes.default.svc"])),
    ("subject", lambda s, p: s["user"].update(username="alice")),
    ("namespace", lambda s, p: s["user"].update(username="system:serviceaccount:other:bp-loader")),
    ("unbound", lambda s, p: s["user"]["extra"].pop(POD_NAME_EXTRA)),
    ("pod", lambda s, p: p["metadata"].update(uid="another")),  # deleted and made again under the same name
    ("pod", lambda s, p: p["spec"].update(serviceAccountName="bp-planner")),
    ("pod", lambda s, p: p["status"].update(phase="Succeeded")),
    ("pod", lambda s, p: p["metadata"].update(namespace="other")),
    ("label", lambda s, p: p["metadata"]["labels"].pop(GROUP_INDEX_LABEL)),
    ("label", lambda s, p: p["metadata"]["labels"].update({GROUP_INDEX_LABEL: "-1"})),
    ("label", lambda s, p: p["metadata"]["labels"].update({GROUP_INDEX_LABEL: "1e9"})),
]


@pytest.mark.parametrize(("reason", "change"), REFUSALS)
def test_anything_that_does_not_fit_is_refused_with_its_reason(reason: str, change) -> None:
    status = review("l-0", "u", "bp-loader")
    the_pod = pod("l-0", "u", "bp-loader", labels={GROUP_INDEX_LABEL: "0"})
    assert issue(copy.deepcopy(status), copy.deepcopy(the_pod)) == Identity("loader", 0, "l-0")  # unchanged, it is issued
    change(status, the_pod)
    with pytest.raises(IssuanceRefused) as refused:
        issue(status, the_pod)
    assert refused.value.reason == reason


def test_a_gone_pod_an_unmapped_account_and_an_unreadable_index_are_refused() -> None:
    with pytest.raises(IssuanceRefused, match="does not exist"):
        issue(review("l-0", "u", "bp-loader"), None)
    with pytest.raises(IssuanceRefused, match="given no batchplane role") as refused:
        issue(review("x", "u", "default"), pod("x", "u", "default"))
    assert refused.value.reason == "role"
    with pytest.raises(IssuanceRefused, match="job-completion-index") as refused:
        issue(review("t", "u", "bp-trainer"), pod("t", "u", "bp-trainer"))  # not an Indexed Job's pod
    assert refused.value.reason == "index"
    no_constructors = IssuancePolicy(NS, {"bp-trainer": "constructor"})
    with pytest.raises(IssuanceRefused, match="no constructor identities"):
        issue(review("t", "u", "bp-trainer"), pod("t", "u", "bp-trainer"), no_constructors)


def test_a_policy_names_only_roles_the_issuer_gives_and_known_index_sources() -> None:
    with pytest.raises(ValueError, match="operator"):
        IssuancePolicy(NS, {"sa": "operator"})
    with pytest.raises(Exception, match="not an index source"):
        IssuancePolicy(NS, {"sa": "constructor"}, index_from="rank")


names = st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9]", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(token_pod=names, other_pod=names, group=st.integers(0, 999), uid=names, other_uid=names)
def test_a_token_yields_only_its_own_pod_s_identity(token_pod: str, other_pod: str, group: int, uid: str, other_uid: str) -> None:
    """Whatever pod the API answers for the token's pod name, the identity names the token's pod
    or nothing: a pod of another uid (another pod, or one made again) is refused, and the replica
    is always the token's pod name, the group always the pod's own label."""
    status = review(token_pod, uid, "bp-loader")
    answered = pod(other_pod, other_uid, "bp-loader", labels={GROUP_INDEX_LABEL: str(group)})
    if other_uid != uid:
        with pytest.raises(IssuanceRefused):
            issue(status, answered)
        return
    assert issue(status, answered) == Identity("loader", group, token_pod)
