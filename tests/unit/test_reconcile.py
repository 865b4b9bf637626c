"""What the operator does about a DataPlane given the Deployments that exist (pure): create what
is missing, leave what matches, update what drifted without touching the replicas the scaling
policy set (except to clamp them into the group's bounds), delete only its own Deployments of
groups that are gone; and the status it writes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_operator_manifests import DATAPLANE, UID, dataplane

from batchplane.operator.dataplane import parse_dataplane
from batchplane.operator.manifests import ANNOTATION_SPEC_HASH, LABEL_MANAGED_BY, loader_deployment
from batchplane.operator.reconcile import (
    Condition,
    Create,
    Delete,
    GroupStatus,
    Scale,
    Update,
    conditions,
    degraded_condition,
    owned,
    plan,
    ready_condition,
    scaling_condition,
    status,
    status_patch,
)

SPEC = parse_dataplane(DATAPLANE)
T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:05:00Z"


def live(spec=SPEC, index: int = 0, replicas: int | None = None, ready: int = 0) -> dict[str, Any]:
    """The group's Deployment as the API server would return it: defaults and status added."""
    group = spec.groups[index]
    d = loader_deployment(spec, group, replicas=group.min_replicas if replicas is None else replicas)
    d["metadata"] |= {"uid": f"dep-{index}", "resourceVersion": "42", "generation": 1}
    c = d["spec"]["template"]["spec"]["containers"][0]
    c |= {"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}
    d["spec"]["template"]["spec"] |= {"restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler"}
    d["spec"] |= {"revisionHistoryLimit": 10, "progressDeadlineSeconds": 600}
    d["status"] = {"replicas": d["spec"]["replicas"], "readyReplicas": ready}
    return d


def all_live(spec=SPEC) -> list[dict[str, Any]]:
    return [live(spec, i) for i in range(len(spec.groups))]


def test_missing_deployments_are_created_with_min_replicas() -> None:
    result = plan(SPEC, [])
    assert [type(a) for a in result.actions] == [Create, Create]
    text, code = result.actions
    assert (text.name, text.body["spec"]["replicas"]) == ("text-and-code-loader-text", 2)
    assert (code.name, code.body["spec"]["replicas"]) == ("text-and-code-loader-code", 1)
    assert text.body == loader_deployment(SPEC, SPEC.groups[0], replicas=2)
    assert [(g.name, g.existed, g.replicas, g.ready) for g in result.groups] == [("text", False, 2, 0), ("code", False, 1, 0)]


def test_matching_deployments_are_left_alone_whatever_the_server_added() -> None:
    deployments = [live(SPEC, 0, replicas=5, ready=5), live(SPEC, 1, replicas=1, ready=1)]
    result = plan(SPEC, deployments)
    assert result.actions == ()
    assert [(g.name, g.existed, g.replicas, g.ready) for g in result.groups] == [("text", True, 5, 5), ("code", True, 1, 1)]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"spec.loader.image": "registry.example.com/ml/batchplane:0.2.0"}, "image"),
        ({"spec.sourceGroups.0.resources": {"requests": {"cpu": "3", "memory": "6Gi"}}}, "spec hash"),
        ({"spec.planner.address": "other-planner.training.svc:50051"}, "args"),
    ],
)
def test_a_drifted_spec_is_updated_without_its_replicas(change: dict[str, Any], why: str) -> None:
    new = parse_dataplane(dataplane(**change))
    deployments = [live(SPEC, 0, replicas=6), live(SPEC, 1)]  # built from the old spec; scaled to 6 by the policy
    result = plan(new, deployments)
    (update,) = [a for a in result.actions if a.group == "text"]
    assert isinstance(update, Update) and update.name == "text-and-code-loader-text" and why in update.why
    assert "replicas" not in update.patch["spec"] and "selector" not in update.patch["spec"]
    desired = loader_deployment(new, new.groups[0], replicas=6)
    assert update.patch["spec"]["template"] == desired["spec"]["template"]
    assert update.patch["metadata"]["annotations"] == {ANNOTATION_SPEC_HASH: desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]}
    assert result.groups[0].replicas == 6  # the policy's replicas stand
    assert not any(isinstance(a, Scale) for a in result.actions)


def test_a_hand_edited_image_is_put_back() -> None:
    edited = live(SPEC, 0)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    (update,) = plan(SPEC, [edited, live(SPEC, 1)]).actions
    assert isinstance(update, Update) and "image someone/else:latest ->" in update.why
    assert update.patch["spec"]["template"]["spec"]["containers"][0]["image"] == SPEC.loader.image


def test_removed_pull_secrets_are_removed_from_the_pod() -> None:
    new = parse_dataplane(dataplane(**{"spec.loader.imagePullSecrets": []}))
    (update,) = [a for a in plan(new, all_live()).actions if a.group == "text"]
    assert update.patch["spec"]["template"]["spec"]["imagePullSecrets"] is None


@pytest.mark.parametrize(("replicas", "bounded"), [(1, 2), (9, 8), (2, None), (8, None), (5, None)])
def test_replicas_are_only_clamped_into_the_bounds(replicas: int, bounded: int | None) -> None:
    result = plan(SPEC, [live(SPEC, 0, replicas=replicas), live(SPEC, 1)])
    scales = [a for a in result.actions if isinstance(a, Scale)]
    if bounded is None:
        assert scales == [] and result.groups[0].replicas == replicas
    else:
        assert [(a.name, a.previous, a.replicas) for a in scales] == [("text-and-code-loader-text", replicas, bounded)]
        assert "outside [2, 8]" in scales[0].why and result.groups[0].replicas == bounded


def test_new_bounds_clamp_at_once() -> None:
    narrower = parse_dataplane(dataplane(**{"spec.sourceGroups.0.maxReplicas": 4}))
    result = plan(narrower, [live(SPEC, 0, replicas=7), live(SPEC, 1)])
    assert [(type(a), a.replicas) for a in result.actions if isinstance(a, Scale)] == [(Scale, 4)]


def test_only_its_own_deployments_of_removed_groups_are_deleted() -> None:
    only_text = parse_dataplane(dataplane(**{"spec.sourceGroups": [copy.deepcopy(DATAPLANE["spec"]["sourceGroups"][0])]}))
    foreign = live(SPEC, 1)
    foreign["metadata"] |= {"name": "text-and-code-loader-legacy", "labels": {"app": "legacy"}}  # no managed-by label
    other_owner = live(SPEC, 1)
    other_owner["metadata"]["name"] = "text-and-code-loader-old"
    other_owner["metadata"]["ownerReferences"][0]["uid"] = "a-dataplane-since-deleted"
    hand_made = live(SPEC, 1)
    hand_made["metadata"]["name"] = "text-and-code-loader-copy"
    del hand_made["metadata"]["labels"][LABEL_MANAGED_BY]
    deployments = [live(SPEC, 0), live(SPEC, 1), foreign, other_owner, hand_made]
    assert [d["metadata"]["name"] for d in owned(only_text, deployments)] == ["text-and-code-loader-text", "text-and-code-loader-code"]
    result = plan(only_text, deployments)
    assert [(type(a), a.name) for a in result.actions] == [(Delete, "text-and-code-loader-code")]
    assert "'code' is no longer in the DataPlane" in result.actions[0].why


def test_a_deployment_of_another_dataplane_is_never_ours() -> None:
    other = parse_dataplane(dataplane(**{"metadata.name": "other", "metadata.uid": "other-uid"}))
    result = plan(SPEC, [live(other, 0), live(other, 1)])
    assert [type(a) for a in result.actions] == [Create, Create]
    assert owned(SPEC, [live(other, 0)]) == [] and UID != "other-uid"


# ---- status ---------------------------------------------------------------------------------------


def test_the_status_reports_groups_mixture_and_conditions() -> None:
    groups = [GroupStatus("text", 2, 3), GroupStatus("code", 1, 1)]
    wanted = [ready_condition(groups), scaling_condition(groups, {"text": "up 2 -> 3: need 2.60"}), degraded_condition([])]
    conds = conditions(wanted, None, now=T0, generation=3)
    new = status(generation=3, groups=groups, mixture={"web": 0.6, "books": 0.2, "code": 0.2000000001}, conditions=conds, previous=None)
    assert new["observedGeneration"] == 3
    assert new["groups"] == [{"name": "text", "replicas": 2, "desiredReplicas": 3}, {"name": "code", "replicas": 1, "desiredReplicas": 1}]
    assert new["observedMixture"] == {"books": 0.2, "code": 0.2, "web": 0.6}
    by_type = {c["type"]: c for c in new["conditions"]}
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == ("False", "LoadersNotReady")
    assert "text 2/3" in by_type["Ready"]["message"]
    assert (by_type["Scaling"]["status"], by_type["Scaling"]["reason"]) == ("True", "ScalingUp")
    assert by_type["Scaling"]["message"] == "text 2 -> 3 (up 2 -> 3: need 2.60)"
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["reason"]) == ("False", "AsExpected")
    assert all(c["lastTransitionTime"] == T0 and c["observedGeneration"] == 3 for c in new["conditions"])
    assert status_patch(None, new) == {"status": new}


def test_conditions_keep_their_transition_time_while_unchanged() -> None:
    first = conditions(
        [Condition("Ready", False, "LoadersNotReady", "x"), Condition("Degraded", False, "AsExpected", "ok")], None, now=T0, generation=1
    )
    later = conditions(
        [Condition("Ready", True, "LoadersReady", "y"), Condition("Degraded", False, "AsExpected", "ok")], first, now=T1, generation=2
    )
    times = {c["type"]: c["lastTransitionTime"] for c in later}
    assert times == {"Ready": T1, "Degraded": T0}
    kept = conditions(
        [Condition("Ready", False, "InvalidSpec", "bad")], later + [{"type": "Scaling", "status": "False"}], now=T1, generation=3
    )
    assert [c["type"] for c in kept] == ["Ready", "Degraded", "Scaling"]  # types not recomputed stay as they were


def test_ready_and_scaling_conditions() -> None:
    steady = [GroupStatus("text", 3, 3), GroupStatus("code", 1, 1)]
    assert ready_condition(steady).status is True and scaling_condition(steady, {}).reason == "Steady"
    down = [GroupStatus("text", 3, 2), GroupStatus("code", 1, 1)]
    assert scaling_condition(down, {}).reason == "ScalingDown" and ready_condition(down).status is True
    mixed = [GroupStatus("text", 3, 2), GroupStatus("code", 0, 1)]
    assert scaling_condition(mixed, {}).reason == "Scaling" and ready_condition(mixed).status is False
    bad = degraded_condition([("MetricsUnavailable", "cannot observe"), ("ApiError", "PATCH x: HTTP 500")])
    assert (bad.status, bad.reason, bad.message) == (True, "MetricsUnavailable", "cannot observe; PATCH x: HTTP 500")


def test_an_unchanged_status_is_not_written_and_gone_sources_are_removed() -> None:
    conds = conditions([ready_condition([GroupStatus("text", 1, 1)])], None, now=T0, generation=1)
    old = status(generation=1, groups=[GroupStatus("text", 1, 1)], mixture={"a": 0.5, "b": 0.5}, conditions=conds, previous=None)
    again = status(
        generation=1,
        groups=[GroupStatus("text", 1, 1)],
        mixture={"a": 0.5, "b": 0.5},
        conditions=conditions([ready_condition([GroupStatus("text", 1, 1)])], conds, now=T1, generation=1),
        previous=old,
    )
    assert status_patch(old, again) is None
    new = status(generation=1, groups=[GroupStatus("text", 1, 1)], mixture={"a": 1.0}, conditions=conds, previous=old)
    assert status_patch(old, new)["status"]["observedMixture"] == {"a": 1.0, "b": None}
    kept = status(generation=2, groups=None, mixture=None, conditions=conds, previous=old)
    assert (kept["groups"], kept["observedMixture"]) == (old["groups"], old["observedMixture"])
