"""Tests of batchplane.core.store_errors on obstore's error texts (the ledger's and journal's
storage), and of `object_storage.store_answer`, which says them in one line. pyarrow's texts
are tested in tests/unit/test_source_filesystems.py; the errors as raised against a real S3
endpoint in tests/integration/test_store_errors.py."""

from __future__ import annotations

import pytest

from batchplane.core.object_storage import store_answer
from batchplane.core.store_errors import Client, Problem, classify_error, explain

_XML = '<?xml version="1.0" encoding="utf-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message><RequestId>1</RequestId></Error>'


def _status(method: str, url: str, status: str, body: str, kind: str = "NotFound") -> str:
    """obstore's text of a request the store answered with `status`, as measured (moto's server,
    obstore 0.12): the summary, then the debug dump quoting the body again."""
    return (
        f"Object at location runs/a/k not found: Error performing {method} {url} in 3.05ms - Server returned non-2xx status "
        f'code: {status}: {body}\n\nDebug source:\n{kind} {{\n    path: "runs/a/k",\n    source: RetryError(\n'
        f"        RetryErrorImpl {{\n            method: {method},\n            retries: 0,\n            max_retries: 10,\n"
        f'            inner: Status {{\n                status: {status[:3]},\n                body: Some(\n                    "{body!r}",\n'
        "                ),\n            },\n        },\n    ),\n}"
    )


NO_BUCKET = (
    "Generic S3 error: Error performing list request: "
    + _status(
        "GET",
        "http://127.0.0.1:53289/corpsu?list-type=2&prefix=runs%2Fa%2F",
        "404 Not Found",
        _XML.format(code="NoSuchBucket", message="The specified bucket does not exist"),
    ).split(": ", 1)[1]
)
NO_BUCKET_GET = _status(
    "GET",
    "http://127.0.0.1:53289/corpsu/runs/a/k",
    "404 Not Found",
    _XML.format(code="NoSuchBucket", message="The specified bucket does not exist"),
)
NO_KEY = _status(
    "GET",
    "http://127.0.0.1:53289/ledgers/runs/a/k",
    "404 Not Found",
    _XML.format(code="NoSuchKey", message="The specified key does not exist."),
)
BAD_KEY = _status(
    "GET",
    "http://127.0.0.1:43379/corpsu/runs/a/k",
    "403 Forbidden",
    _XML.format(code="InvalidAccessKeyId", message="The AWS Access Key Id you provided does not exist in our records."),
    kind="PermissionDenied",
)
HEAD_FORBIDDEN = _status("HEAD", "http://127.0.0.1:43379/corpsu/runs/a/k", "403 Forbidden", "", kind="PermissionDenied")
NO_CREDENTIALS = _status(
    "PUT", "http://169.254.169.254/latest/api/token", "403 Forbidden", "resolve_deny: denied destination", kind="Generic"
)
REFUSED = (
    "Generic S3 error: Error performing GET http://127.0.0.1:53183/corpsu/runs/a/k in 3.047624092s, after 10 retries, "
    "max_retries: 10, retry_timeout: 180s  - HTTP error: error sending request\n\nDebug source:\nGeneric {\n"
    '    store: "S3",\n    source: RetryError(\n        RetryErrorImpl {\n            inner: Http(\n'
    "                HttpError {\n                    kind: Connect,\n                    source: reqwest::Error {\n"
    '                        source: ConnectError(\n                            "tcp connect error",\n'
    "                            127.0.0.1:53183,\n                            Os {\n                                code: 111,\n"
    '                                kind: ConnectionRefused,\n                                message: "Connection refused",\n'
    "                            },\n                        ),\n                    },\n                },\n            ),\n"
    "        },\n    ),\n}"
)
SLOW_DOWN = _status(
    "PUT",
    "http://127.0.0.1:1/b/k",
    "503 Service Unavailable",
    _XML.format(code="SlowDown", message="Please reduce your request rate."),
    kind="Generic",
)
REDIRECT = _status(
    "GET",
    "https://s3.amazonaws.com/b?list-type=2",
    "301 Moved Permanently",
    _XML.format(
        code="PermanentRedirect", message="The bucket you are attempting to access must be addressed using the specified endpoint."
    ),
    kind="Generic",
)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (NO_BUCKET, Problem.NO_SUCH_BUCKET),
        (NO_BUCKET_GET, Problem.NO_SUCH_BUCKET),
        (NO_KEY, Problem.OTHER),  # a missing object is told by its type (FileNotFoundError), not its text
        (BAD_KEY, Problem.ACCESS_DENIED),
        (HEAD_FORBIDDEN, Problem.ACCESS_DENIED),
        (NO_CREDENTIALS, Problem.ACCESS_DENIED),
        (REFUSED, Problem.UNREACHABLE),
        (SLOW_DOWN, Problem.THROTTLED),
        (REDIRECT, Problem.WRONG_REGION),
    ],
    ids=["no-bucket-list", "no-bucket-get", "no-key", "bad-key", "head-403", "no-credentials", "refused", "slow-down", "redirect"],
)
def test_obstores_texts_are_classified(text: str, problem: Problem) -> None:
    assert classify_error(text) is problem


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (
            NO_BUCKET,
            "GET http://127.0.0.1:53289/corpsu?list-type=2&prefix=runs%2Fa%2F answered 404 Not Found "
            "(NoSuchBucket: The specified bucket does not exist)",
        ),
        (
            BAD_KEY,
            "GET http://127.0.0.1:43379/corpsu/runs/a/k answered 403 Forbidden "
            "(InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records.)",
        ),
        (HEAD_FORBIDDEN, "HEAD http://127.0.0.1:43379/corpsu/runs/a/k answered 403 Forbidden"),
        (NO_CREDENTIALS, "PUT http://169.254.169.254/latest/api/token answered 403 Forbidden (resolve_deny: denied destination)"),
        (
            REFUSED,
            "GET http://127.0.0.1:53183/corpsu/runs/a/k failed after 10 retries: HTTP error: error sending request (Connection refused)",
        ),
        (
            "Generic S3 error: something new\nwith a second line\n\nDebug source:\n{ dump }",
            "Generic S3 error: something new with a second line",
        ),
        ("", "OSError"),
    ],
    ids=["no-bucket", "bad-key", "head-403", "no-credentials", "refused", "unknown", "empty"],
)
def test_the_stores_answer_is_one_line_without_the_xml_or_the_dump(text: str, answer: str) -> None:
    assert store_answer(OSError(text) if not text else Exception(text)) == answer


def test_a_long_answer_is_cut() -> None:
    answer = store_answer(Exception("x" * 5000))
    assert len(answer) == 600 and answer.endswith("...")


def test_obstores_credentials_are_named_as_obstore_reads_them() -> None:
    text = explain(Problem.ACCESS_DENIED, scheme="s3", client=Client.OBSTORE)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        assert name in text
    assert "does not read ~/.aws" in text and "pyarrow" not in text
    assert "pyarrow" in explain(Problem.ACCESS_DENIED, scheme="s3")  # the loader's client, by default
    assert explain(Problem.ACCESS_DENIED, scheme="gs", client=Client.OBSTORE) == "access denied or no credentials"
