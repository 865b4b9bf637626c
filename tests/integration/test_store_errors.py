"""The ledger's and journal's object-store errors, against a real S3 endpoint (moto's server):
each is one line saying what was being done, in which store, what it means and what to check,
in the loader's words (`batchplane.core.store_errors`), with the store's answer in short and
never its XML document or obstore's debug dump:

- a bucket that does not exist, on every operation, and through `batchplane up` (the planner
  exits at start naming the bucket) and `batchplane ledger`;
- credentials the store does not know (moto checking them: INITIAL_NO_AUTH_ACTION_COUNT=0);
- an endpoint nobody listens on.
"""

from __future__ import annotations

import pathlib
import re
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest
from harness import skewed_lengths, write_job, write_source
from s3_server import S3Server

from batchplane.core.errors import FailedPrecondition, Unavailable
from batchplane.core.object_storage import ObjectStorage, open_storage
from batchplane.core.process import EXIT_BAD_INPUT
from batchplane.planner.journal import LedgerReader

pytestmark = pytest.mark.integration

BUCKET = "ledgers"
MISSING = "corpsu"
LOCATION = f"s3://{MISSING}/runs/a"
NO_SUCH_BUCKET = f"no such bucket '{MISSING}' (check its name, and AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL when it is not on AWS); "


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def aws_environment(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Points obstore (here, and in the processes started, which inherit it) at the server."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)


def assert_one_clean_line(message: str) -> None:
    assert "\n" not in message, message
    for dump in ("<Error>", "<Code>", "<?xml", "Debug source", "RetryError"):
        assert dump not in message, message


#: Each operation of ObjectStorage: (what the message says was being done, the call).
OPERATIONS: list[tuple[str, Callable[[ObjectStorage], object]]] = [
    ("cannot list 'gen-'", lambda s: s.list("gen-")),
    ("cannot get 'gen-000001/head.json'", lambda s: s.get("gen-000001/head.json")),
    ("cannot get bytes 0..4 of 'gen-000001/head.json'", lambda s: s.get_range("gen-000001/head.json", 0, 4)),
    ("cannot put 'epochs/000000000001'", lambda s: s.put_if_absent("epochs/000000000001", b"{}")),
    ("cannot delete 'epochs/000000000001'", lambda s: s.delete("epochs/000000000001")),
]


@pytest.mark.parametrize(("doing", "call"), OPERATIONS, ids=[d for d, _ in OPERATIONS])
def test_every_operation_on_a_missing_bucket_names_it_in_one_line(aws_environment, doing: str, call) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        call(ObjectStorage.from_url(LOCATION))
    message = str(caught.value)
    assert message.startswith(f"{doing} in object store {LOCATION}: {NO_SUCH_BUCKET}"), message
    assert "answered 404 Not Found (NoSuchBucket: The specified bucket does not exist)" in message
    assert_one_clean_line(message)


def test_a_ledger_on_a_missing_bucket_is_refused_when_opened_and_when_read(aws_environment) -> None:
    with pytest.raises(FailedPrecondition, match=re.escape(f"in object store {LOCATION}: {NO_SUCH_BUCKET}")) as opened:
        open_storage(LOCATION, check_writes=True)
    assert_one_clean_line(str(opened.value))
    with pytest.raises(FailedPrecondition, match=re.escape(f"cannot list 'gen-' in object store {LOCATION}: {NO_SUCH_BUCKET}")) as read:
        LedgerReader(open_storage(LOCATION)).last_step()
    assert_one_clean_line(str(read.value))


def test_batchplane_up_with_a_ledger_on_a_missing_bucket_stops_naming_it(aws_environment, tmp_path: pathlib.Path) -> None:
    """The real entry point: `batchplane up` starts the planner, which cannot open its ledger
    and exits with EXIT_BAD_INPUT; the one line in its log, shown by `up`, names the bucket."""
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(24, seed=1), seed=1)]
    config = write_job(tmp_path / "job.yaml", sources, ledger={"location": LOCATION})
    out = subprocess.run([sys.executable, "-m", "batchplane.cli", "up", "-c", str(config)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"batchplane up: planner exited with status {EXIT_BAD_INPUT} while starting" in out.stderr, out.stderr
    named = [line for line in out.stderr.splitlines() if f"no such bucket '{MISSING}'" in line]
    assert len(named) == 1, out.stderr
    assert "cannot start planner: cannot put 'conditional-put-check/" in named[0]
    assert f"in object store {LOCATION}: {NO_SUCH_BUCKET}" in named[0]
    for dump in ("<Error>", "<Code>", "Debug source"):
        assert dump not in out.stdout + out.stderr
    log = (tmp_path / "run" / "logs" / "planner.log").read_text()
    assert sum(f"no such bucket '{MISSING}'" in line for line in log.splitlines()) == 1, log
    assert "<Error>" not in log and "<Code>" not in log, log


def test_batchplane_ledger_on_a_missing_bucket_says_so_in_one_line(aws_environment) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "batchplane.cli", "ledger", "stats", "--ledger", LOCATION], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.startswith(
        f"batchplane ledger: cannot read the ledger at {LOCATION}: cannot list 'gen-' in object store {LOCATION}: {NO_SUCH_BUCKET}"
    ), out.stderr
    assert_one_clean_line(out.stderr.strip())


def test_an_unreachable_endpoint_is_unavailable_and_says_which_variables_name_it(aws_environment, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    location = f"s3://{BUCKET}/ledger"
    with pytest.raises(Unavailable) as caught:
        ObjectStorage.from_url(location).list("gen-")
    message = str(caught.value)
    assert message.startswith(
        f"cannot list 'gen-' in object store {location}: cannot reach the endpoint (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, "
        f"else AWS itself); GET http://127.0.0.1:{port}/{BUCKET}?"
    ), message
    assert message.endswith("(Connection refused)"), message
    assert_one_clean_line(message)


@pytest.fixture(scope="module")
def checking_s3(tmp_path_factory: pytest.TempPathFactory):
    """A second server that checks credentials (moto's INITIAL_NO_AUTH_ACTION_COUNT=0): it knows
    no access key, so every request is refused as S3 refuses an unknown key."""
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # read by the server process at its start
        server = S3Server(tmp_path_factory.mktemp("s3-checking"))
    with server:
        yield server


@pytest.mark.parametrize(("doing", "call"), OPERATIONS, ids=[d for d, _ in OPERATIONS])
def test_credentials_the_store_refuses_are_named_with_the_variables_to_check(
    checking_s3: S3Server, monkeypatch: pytest.MonkeyPatch, doing: str, call
) -> None:
    for name, value in checking_s3.env().items():
        monkeypatch.setenv(name, value)
    location = f"s3://{BUCKET}/ledger"
    with pytest.raises(FailedPrecondition) as caught:
        call(ObjectStorage.from_url(location))
    message = str(caught.value)
    assert message.startswith(f"{doing} in object store {location}: access denied or no credentials: "), message
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message and "does not read ~/.aws" in message
    assert "answered 403 Forbidden" in message
    if "cannot put" in doing:  # a put looks the folder above its key up first: a HEAD, whose answer has no body
        assert f"HEAD {checking_s3.endpoint}/{BUCKET}/ledger/epochs answered 403 Forbidden" in message
    else:
        assert "(InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records.)" in message
    assert_one_clean_line(message)
