"""Tests of batchplane.core.storage and batchplane.core.object_storage: the Storage contract
(`storage_contract`) on LocalStorage, MemoryStorage and ObjectStorage over obstore's in-memory
store, ObjectStorage's mapping of errors and the environment, the check of conditional writes,
and LocalStorage's temporary files and sweeps. Racing processes and writers killed mid-write
are in tests/integration/test_storage_crash.py, ObjectStorage on a real S3 endpoint in
tests/integration/test_ledger_bucket.py (unit tests spawn no processes)."""

from __future__ import annotations

import os
import pathlib
import tempfile

import obstore.store
import pytest
from hypothesis import given, settings
from storage_contract import *  # noqa: F403 - the contract's tests, run here on each implementation
from storage_contract import bad_keys

from batchplane.core import storage as storage_module
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.object_storage import ObjectStorage, check_conditional_puts, client_options, open_storage
from batchplane.core.storage import TEMP_PREFIX, LocalStorage, MemoryStorage, Storage

IMPLEMENTATIONS = ["local", "memory", "object-memory"]


@pytest.fixture(params=IMPLEMENTATIONS)
def new_storage(request: pytest.FixtureRequest, tmp_path: pathlib.Path):
    """A maker of empty storages of one implementation."""
    made = iter(range(1_000_000))

    def make() -> Storage:
        if request.param == "local":
            return LocalStorage(tmp_path / f"store-{next(made)}")
        if request.param == "memory":
            return MemoryStorage()
        return ObjectStorage(obstore.store.MemoryStore(), url=f"memory:///store-{next(made)}")

    return make


@pytest.fixture
def storage(new_storage) -> Storage:
    return new_storage()


def temp_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX))


# --- LocalStorage on disk --------------------------------------------------------------------


def test_local_objects_survive_a_new_instance_and_temp_files_are_ignored_then_swept(tmp_path: pathlib.Path) -> None:
    store = LocalStorage(tmp_path / "new" / "root")
    store.put_if_absent("a/b", b"payload")
    (tmp_path / "new/root/a" / f"{TEMP_PREFIX}crashed").write_bytes(b"half")
    (tmp_path / "new/root" / f"{TEMP_PREFIX}crashed").write_bytes(b"half")
    (tmp_path / "new/root/empty/left/over").mkdir(parents=True)
    assert store.list() == ["a/b"]
    assert store.sweep() == 2
    assert temp_files(tmp_path) == []
    assert not (tmp_path / "new/root/empty").exists()
    (tmp_path / "new/root/a" / f"{TEMP_PREFIX}again").write_bytes(b"half")
    reopened = LocalStorage(tmp_path / "new" / "root")
    assert temp_files(tmp_path) == []
    assert reopened.get("a/b") == b"payload"
    assert reopened.describe() == f"local storage at {tmp_path / 'new' / 'root'}"


def test_local_delete_removes_emptied_folders(tmp_path: pathlib.Path) -> None:
    store = LocalStorage(tmp_path)
    store.put_if_absent("a/b/c/d", b"1")
    store.put_if_absent("a/x", b"2")
    store.delete("a/b/c/d")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/x"]


def test_a_put_writes_again_when_another_instance_sweeps_its_temporary_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a LocalStorage sweeps; one opened by another process mid-put removes the writer's
    temporary file and its new, still empty folders. The writer then writes again."""
    store = LocalStorage(tmp_path)
    written = []

    def write_then_be_swept(folder: pathlib.Path, data: bytes) -> pathlib.Path:
        temp = real_write_temp(folder, data)
        written.append(temp)
        if len(written) <= 2:
            LocalStorage(tmp_path)
            assert not folder.exists()
        return temp

    real_write_temp = storage_module._write_temp
    monkeypatch.setattr(storage_module, "_write_temp", write_then_be_swept)
    assert store.put_if_absent("a/b/c", b"data")
    assert len(written) == 3
    assert store.get("a/b/c") == b"data" and temp_files(tmp_path) == []


def test_a_put_gives_up_when_its_files_keep_vanishing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStorage(tmp_path)

    def write_then_be_swept(folder: pathlib.Path, data: bytes) -> pathlib.Path:
        temp = real_write_temp(folder, data)
        store.sweep()
        return temp

    real_write_temp = storage_module._write_temp
    monkeypatch.setattr(storage_module, "_write_temp", write_then_be_swept)
    with pytest.raises(Unavailable, match="could not write 'a/b' to local storage at .*kept vanishing"):
        store.put_if_absent("a/b", b"data")
    assert store.list() == []


@settings(max_examples=50, deadline=None)
@given(bad_keys())
def test_invalid_keys_leave_nothing_on_disk(key: str) -> None:
    with tempfile.TemporaryDirectory() as root:
        storage = LocalStorage(root)
        for call in (lambda: storage.put_if_absent(key, b"x"), lambda: storage.delete(key)):
            with pytest.raises(InvalidArgument):
                call()
        assert os.listdir(root) == []


# --- Opening a location; ObjectStorage's environment ----------------------------------------------


def test_open_storage_takes_a_local_folder_a_file_url_or_an_object_store_url(tmp_path: pathlib.Path) -> None:
    local = open_storage(str(tmp_path / "a"))
    assert isinstance(local, LocalStorage) and local.root == tmp_path / "a" and (tmp_path / "a").is_dir()
    from_file_url = open_storage(f"file://{tmp_path}/b")
    assert isinstance(from_file_url, LocalStorage) and from_file_url.root == tmp_path / "b"
    bucket = open_storage("s3://bucket/jobs/j1/ledger/", environ={})  # builds the client; no request yet
    assert isinstance(bucket, ObjectStorage)
    assert bucket.describe() == "object store s3://bucket/jobs/j1/ledger"


def test_open_storage_names_a_url_it_cannot_open() -> None:
    with pytest.raises(FailedPrecondition, match="cannot open object store nosuch://bucket/x"):
        open_storage("nosuch://bucket/x", environ={})


@pytest.mark.parametrize(
    ("url", "environ", "options"),
    [
        ("s3://b/p", {"AWS_ENDPOINT_URL": "http://minio:9000"}, {"allow_http": True}),
        ("s3a://b/p", {"AWS_ENDPOINT": "http://minio:9000"}, {"allow_http": True}),
        ("s3://b/p", {"AWS_ENDPOINT_URL": "https://s3.example.com"}, {}),
        ("s3://b/p", {}, {}),
        # obstore's order: the S3-specific endpoint comes first
        ("s3://b/p", {"AWS_ENDPOINT_URL_S3": "https://s3.example.com", "AWS_ENDPOINT_URL": "http://minio:9000"}, {}),
        ("s3://b/p", {"AWS_ENDPOINT_URL_S3": "http://minio:9000", "AWS_ENDPOINT_URL": "https://s3.example.com"}, {"allow_http": True}),
        # said explicitly: obstore reads it itself
        ("s3://b/p", {"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_ALLOW_HTTP": "false"}, {}),
        ("gs://b/p", {"AWS_ENDPOINT_URL": "http://minio:9000"}, {}),
    ],
)
def test_client_options_allow_an_http_s3_endpoint(url: str, environ: dict[str, str], options: dict) -> None:
    assert client_options(url, environ) == options


# --- The check of conditional writes ---------------------------------------------------------------


class OverwritingStorage(MemoryStorage):
    """A store that ignores conditional writes: every put writes and reports it created."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.delete(key)
        return super().put_if_absent(key, data)

    def describe(self) -> str:
        return "object store s3://careless/ledger"


class RefusingButOverwritingStorage(MemoryStorage):
    """A store that answers 'taken' to a second put but has overwritten the object anyway."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        existed = key in self.list(key)
        self.delete(key)
        super().put_if_absent(key, data)
        return not existed


@pytest.mark.parametrize("make", [MemoryStorage, lambda: ObjectStorage(obstore.store.MemoryStore(), url="memory:///x")])
def test_a_store_with_conditional_writes_passes_the_check_and_keeps_nothing(make) -> None:
    storage = make()
    check_conditional_puts(storage)
    assert storage.list() == []


def test_a_store_that_ignores_conditional_writes_is_refused_by_name() -> None:
    storage = OverwritingStorage()
    with pytest.raises(FailedPrecondition) as caught:
        check_conditional_puts(storage)
    message = str(caught.value)
    assert message.startswith("object store s3://careless/ledger ignores conditional writes (If-None-Match)")
    assert "was reported written" in message and "the ledger needs them" in message
    assert storage.list() == [], "the scratch key was left behind"


def test_a_store_that_says_taken_but_overwrites_is_refused() -> None:
    with pytest.raises(FailedPrecondition, match="ignores conditional writes .*was refused but overwrote the first"):
        check_conditional_puts(RefusingButOverwritingStorage())
