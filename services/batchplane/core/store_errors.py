"""What an error of a file system or object store means, in one voice for every part: the
loader's sources (pyarrow, fsspec) and the ledger's and journal's storage (obstore) classify an
error's text into a `Problem` and say it with `explain`, a sentence of what to check.

Pure: no I/O, no client library imported; texts in, meanings out.
"""

from __future__ import annotations

import enum
import errno as errnos


class Problem(enum.Enum):
    """What went wrong when a file system or object store was asked something."""

    NO_SUCH_BUCKET = "no such bucket"
    ACCESS_DENIED = "access denied"
    UNREACHABLE = "unreachable endpoint"
    WRONG_REGION = "wrong region"
    THROTTLED = "throttled"
    NOT_FOUND = "not found"
    OTHER = "other"


class Client(enum.Enum):
    """The client library that met the error: each finds S3 credentials its own way."""

    PYARROW = "pyarrow"
    OBSTORE = "obstore"


#: Fragments of the clients' error texts, in the order they are tried: the AWS SDK's error names
#: under pyarrow ("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation", measured against a
#: real S3 endpoint), S3's own error codes (which obstore quotes from the answer's XML), HTTP
#: statuses as pyarrow ("HTTP status 403") and obstore ("403 Forbidden") write them, curl's,
#: reqwest's and gRPC's words. obstore's texts were measured against moto's S3 server (see
#: tests/integration/test_ledger_bucket.py).
_TEXTS: tuple[tuple[Problem, tuple[str, ...]], ...] = (
    (Problem.NO_SUCH_BUCKET, ("NO_SUCH_BUCKET", "NoSuchBucket", "bucket does not exist", "ContainerNotFound")),
    (
        Problem.ACCESS_DENIED,
        (
            "ACCESS_DENIED",
            "AccessDenied",
            "INVALID_ACCESS_KEY_ID",
            "InvalidAccessKeyId",
            "SIGNATURE_DOES_NOT_MATCH",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "MISSING_AUTHENTICATION_TOKEN",
            "HTTP status 401",
            "HTTP status 403",
            "401 Unauthorized",
            "403 Forbidden",
            "PERMISSION_DENIED",
            "UNAUTHENTICATED",
            "AuthenticationFailed",
            "AuthorizationFailure",
            "AuthorizationPermissionMismatch",
            "No credentials",
            "Unable to locate credentials",
            # obstore asks the instance metadata service (or a container's) only when it found
            # no credentials anywhere else: its failure means "no credentials", not "unreachable".
            "169.254.169.254",
            "169.254.170.2",
        ),
    ),
    (
        Problem.WRONG_REGION,
        ("PermanentRedirect", "HTTP status 301", "301 Moved Permanently", "AuthorizationHeaderMalformed", "IllegalLocationConstraint"),
    ),
    (
        Problem.UNREACHABLE,
        (
            "NETWORK_CONNECTION",
            "Could not connect",
            "Could not resolve host",
            "Failed to connect",
            "Connection refused",
            "Couldn't connect",
            "Timeout was reached",
            "timed out",
            "Name or service not known",
            "SSL connect error",
            "Connection reset",
            "Recv failure",
            "Send failure",
            "Broken pipe",
            "error sending request",
            "tcp connect error",
            "dns error",
        ),
    ),
    (
        Problem.THROTTLED,
        (
            "SLOW_DOWN",
            "SlowDown",
            "HTTP status 503",
            "503 Service Unavailable",
            "SERVICE_UNAVAILABLE",
            "RESOURCE_EXHAUSTED",
            "HTTP status 500",
            "HTTP status 502",
            "HTTP status 504",
            "500 Internal Server Error",
            "502 Bad Gateway",
            "504 Gateway Timeout",
            "INTERNAL_FAILURE",
            "InternalError",
            "REQUEST_TIMEOUT",
        ),
    ),
)


def classify_error(text: str, *, errno: int | None = None) -> Problem:
    """What an error of a file system or object store means, from its errno (local files) or
    its text.

    Args:
        text: The exception's text (all of it: obstore names the cause of a failed connection
            only in its debug part).
        errno: Its errno, when it has one.
    """
    if errno in (errnos.EACCES, errnos.EPERM):
        return Problem.ACCESS_DENIED
    for problem, fragments in _TEXTS:
        if any(f in text for f in fragments):
            return problem
    if errno == errnos.ENOENT or "Path does not exist" in text:
        return Problem.NOT_FOUND
    return Problem.OTHER


#: How each client finds S3 credentials, for the sentence on access denied.
_S3_CREDENTIALS = {
    Client.PYARROW: (
        "pyarrow's S3 client signs requests with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with "
        "AWS_SESSION_TOKEN for temporary keys), a web identity (AWS_WEB_IDENTITY_TOKEN_FILE with "
        "AWS_ROLE_ARN, as IRSA sets them), ~/.aws or the instance's role, and sends unsigned requests "
        "when it finds none"
    ),
    Client.OBSTORE: (
        "the ledger's and journal's S3 client (obstore) signs requests with AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary keys), a web identity "
        "(AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN, as IRSA sets them) or the container's or "
        "instance's role; it does not read ~/.aws or AWS_PROFILE"
    ),
}


def explain(problem: Problem, *, scheme: str | None, bucket: str | None = None, client: Client = Client.PYARROW) -> str:
    """A sentence on `problem` for a location of `scheme` (None: a local path): what it means
    and what to check.

    Args:
        bucket: The bucket's name, where known.
        client: The client that met it (where S3 credentials come from).
    """
    s3 = scheme == "s3"
    if problem is Problem.NO_SUCH_BUCKET:
        hint = " (check its name, and AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL when it is not on AWS)" if s3 else ""
        return f"no such bucket{f' {bucket!r}' if bucket else ''}{hint}"
    if problem is Problem.ACCESS_DENIED:
        if scheme in (None, "file"):
            return "permission denied"
        return "access denied or no credentials" + (f": {_S3_CREDENTIALS[client]}" if s3 else "")
    if problem is Problem.WRONG_REGION:
        return "the bucket is in another region or behind another endpoint" + (": set AWS_REGION to the bucket's region" if s3 else "")
    if problem is Problem.UNREACHABLE:
        where = " (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else AWS itself)" if s3 else ""
        return f"cannot reach the endpoint{where}"
    if problem is Problem.THROTTLED:
        return "the store refuses requests for now (throttled or unavailable); try again"
    if problem is Problem.NOT_FOUND:
        return "no such file"
    return "failed"


def first_line(text: str, *, limit: int = 500) -> str:
    """The first line of `text`, cut to `limit` characters (the clients' texts can run to pages)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
