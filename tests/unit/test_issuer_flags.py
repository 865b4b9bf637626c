"""The operator's --issuer-* flags (operator.issuer.issuer_settings): what the chart passes reads
as the policy it means, and a flag that would weaken it stops the operator naming the flag."""

from __future__ import annotations

import pathlib

import pytest

from batchplane.operator.__main__ import parse_args

BASE = ["--namespace", "training", "--prometheus", "http://prometheus:9090"]
ISSUER = ["--issuer-port", "8443", "--issuer-ca-dir", "/etc/batchplane/ca", "--issuer-role", "planner=p", "--issuer-role", "loader=l"]


def test_the_chart_s_flags_read_as_the_policy_they_mean() -> None:
    settings = parse_args(
        [*BASE, *ISSUER, "--issuer-role", "constructor=t", "--issuer-index-from", "jobset", "--issuer-trainer-pods", "4"], {}
    )
    issuer = settings.issuer
    assert issuer is not None and issuer.port == 8443 and issuer.ca_dir == pathlib.Path("/etc/batchplane/ca")
    assert dict(issuer.policy.roles) == {"p": "planner", "l": "loader", "t": "constructor"}
    assert (issuer.policy.namespace, issuer.policy.audience, issuer.policy.index_from, issuer.policy.trainer_pods) == (
        "training",
        "batchplane",
        "jobset",
        4,
    )
    assert issuer.lifetime_s == 86400
    assert parse_args(BASE, {}).issuer is None  # no --issuer-port: no issuer


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--issuer-audience", "https://kubernetes.default.svc.cluster.local"], "--issuer-audience"),
        (["--issuer-audience", ""], "--issuer-audience"),
        (["--issuer-role", "operator=o"], "--issuer-role"),
        (["--issuer-role", "constructor=p"], "--issuer-role"),  # one account, two roles
        (["--issuer-role", "loader"], "--issuer-role"),
        (["--issuer-lifetime-s", "10"], "--issuer-lifetime-s"),
        (["--issuer-index-from", "rank"], "--issuer-index-from"),
        (["--issuer-port", "70000"], "--issuer-port"),
    ],
)
def test_a_flag_that_would_weaken_the_policy_stops_the_operator(extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args([*BASE, *ISSUER, *extra], {})
    assert stopped.value.code == 2 and flag in capsys.readouterr().err


def test_an_issuer_without_its_ca_does_not_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--issuer-port", "8443"], {})
    assert "--issuer-ca-dir" in capsys.readouterr().err


def test_no_reconcile_serves_the_issuer_alone_and_needs_no_prometheus() -> None:
    """--no-reconcile (the chart's operator pods where operator.enabled is false): the issuer
    alone, so Prometheus is not needed; without an issuer, or with --once, it has nothing to do."""
    settings = parse_args(["--namespace", "training", "--no-reconcile", *ISSUER], {})
    assert settings.reconcile is False and settings.issuer is not None and settings.prometheus == ""
    assert parse_args(BASE, {}).reconcile is True


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--namespace", "training"], "--prometheus"),  # reconciling reads Prometheus
        (["--namespace", "training", "--no-reconcile"], "--issuer-port"),  # nothing to serve
        (["--namespace", "training", "--no-reconcile", "--once", *ISSUER], "--once"),
    ],
)
def test_an_operator_with_nothing_to_do_does_not_start(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv, {})
    assert stopped.value.code == 2 and flag in capsys.readouterr().err
