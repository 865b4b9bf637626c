"""The command line every service process takes."""

from __future__ import annotations

import pathlib

import pytest

from batchplane.core.process import ProcessSettings, parse_process_args


def test_a_loader_in_a_cluster_advertises_its_pod_address() -> None:
    settings = parse_process_args(
        "loader", ["-c", "job.yaml", "--index", "3", "--planner", "planner:50051", "--port", "50052", "--advertise", "10.1.2.3:50052"]
    )
    assert settings == ProcessSettings(
        config=pathlib.Path("job.yaml"),
        index=3,
        planner="planner:50051",
        port=50052,
        advertise="10.1.2.3:50052",
        log_level=settings.log_level,
    )


def test_without_advertise_the_served_address_is_used() -> None:
    assert parse_process_args("planner", ["-c", "job.yaml"]).advertise is None


def test_the_configuration_is_required() -> None:
    with pytest.raises(SystemExit):
        parse_process_args("planner", [])


def test_listen_takes_only_a_unix_socket(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_process_args("constructor", ["-c", "j.yaml", "--listen", "unix:///run/c.sock"]).listen == "unix:///run/c.sock"
    with pytest.raises(SystemExit):
        parse_process_args("planner", ["-c", "j.yaml", "--listen", "0.0.0.0:50051"])
    assert "--listen takes a Unix socket address" in capsys.readouterr().err
