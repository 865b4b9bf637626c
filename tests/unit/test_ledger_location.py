"""`ledger.location`: its validation (errors that name the field and the value) and where the
ledger lies for each setting (`journal.ledger_location`, `open_ledger_storage`)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import ConfigError
from batchplane.core.object_storage import ObjectStorage
from batchplane.core.storage import LocalStorage
from batchplane.planner.journal import ledger_location, open_ledger_storage


def _job(ledger: dict[str, Any] | None = None, *, base_dir: str | pathlib.Path = "/jobs/j1") -> Any:
    data: dict[str, Any] = {"job": "j", "sources": [{"name": "web", "path": "data/web"}]}
    if ledger is not None:
        data["ledger"] = ledger
    return job_from_mapping(data, base_dir=base_dir)


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        ("http://example.com/ledger", "must be a local folder or a URL with a scheme of"),
        ("memory:///x", "must be a local folder or a URL with a scheme of"),
        ("s3:///prefix", "must name a bucket or container, e.g. s3://bucket/prefix"),
        ("gs://", "must name a bucket or container, e.g. gs://bucket/prefix"),
        ("file://", "must name a folder after file://"),
        ("file:///", "must name a folder after file://"),
    ],
)
def test_a_bad_location_names_the_field_and_the_value(location: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _job({"location": location})
    assert caught.value.field == "ledger.location"
    assert caught.value.value == location
    assert problem in caught.value.problem
    assert str(caught.value).startswith(f"ledger.location: {problem}")


def test_a_location_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ledger.location: must be a string, got 5"):
        _job({"location": 5})


@pytest.mark.parametrize(
    "location",
    [
        "s3://bucket/prefix",
        "s3://bucket",
        "S3://Bucket/a/b/",
        "s3a://bucket/x",
        "gs://bucket/ledger",
        "az://container/ledger",
        "abfss://container@account.dfs.core.windows.net/ledger",
        "file:///data/ledger",
        "ledger-here",
        "/abs/ledger",
    ],
)
def test_good_locations_are_kept_as_written(location: str) -> None:
    assert _job({"location": location}).ledger.location == location


def test_without_a_location_the_ledger_is_in_the_run_folder(tmp_path: pathlib.Path) -> None:
    job = _job()
    assert job.ledger.location is None
    assert ledger_location(job, tmp_path / "run") == str(tmp_path / "run" / "ledger")
    storage = open_ledger_storage(job, tmp_path / "run")
    assert isinstance(storage, LocalStorage) and storage.root == tmp_path / "run" / "ledger"


def test_a_relative_location_is_a_folder_beside_the_configuration(tmp_path: pathlib.Path) -> None:
    job = _job({"location": "shared/ledger"}, base_dir=tmp_path)
    assert ledger_location(job, tmp_path / "run") == str(tmp_path / "shared" / "ledger")
    assert ledger_location(_job({"location": "/abs/ledger"}), tmp_path / "run") == "/abs/ledger"


def test_a_url_location_is_taken_as_it_is_whatever_the_run_folder(tmp_path: pathlib.Path) -> None:
    job = _job({"location": "s3://bucket/jobs/j1/ledger"})
    assert ledger_location(job, tmp_path / "run") == "s3://bucket/jobs/j1/ledger"
    storage = open_ledger_storage(job, tmp_path / "run", check_writes=False)  # no request: a reader's open
    assert isinstance(storage, ObjectStorage) and storage.describe() == "object store s3://bucket/jobs/j1/ledger"
    assert not (tmp_path / "run").exists()
