"""`Storage` on an object store (S3 and S3-compatible stores, GCS, Azure) through obstore, and
`open_storage`, which opens a storage location: a local folder or a URL.

Semantics and key rules are those of `batchplane.core.storage` (the same contract tests run
against every implementation). `put_if_absent` is one PUT with `If-None-Match: *` (obstore's
mode "create"); the store answers 412 when the key exists, which is what keeps a ledger record
from ever being overwritten. Not every S3-compatible store honours that header: some ignore it
and overwrite. `check_conditional_puts` proves at start-up that the store honours it, and
`open_storage(..., check_writes=True)` runs it, so a writer never runs on a store that would
let two writers of one key both win.

The rule "a key cannot be both an object and a folder of other keys" is enforced as on local
disk, with requests before the PUT: a LIST of "<key>/" (one request) and a HEAD of each folder
above the key, each folder once per instance (then remembered as not an object). An object
store holds "a" and "a/b" side by side without complaint, so the check is not atomic with the
PUT: a writer that creates "a/b" while another puts "a" can get both in (the race it leaves),
and a folder remembered as not an object is not asked again. The ledger never puts a key
where it has put a folder (its keys have fixed shapes), so the race cannot arise there; the
check keeps every implementation refusing the same calls.

Credentials, endpoint and region come from the environment, as obstore reads it by itself:
for S3 `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` (else
`AWS_DEFAULT_REGION`), `AWS_ENDPOINT_URL_S3` (before `AWS_ENDPOINT_URL`), `AWS_ALLOW_HTTP`, web
identity (`AWS_WEB_IDENTITY_TOKEN_FILE`, `AWS_ROLE_ARN`: IRSA on EKS), container and instance
credentials; `GOOGLE_*` for GCS, `AZURE_*` for Azure. One gap is filled here: an `http://`
endpoint (MinIO, a local test server) is allowed without `AWS_ALLOW_HTTP`, as boto3 allows it.
The shared config and credentials files (`~/.aws`, `AWS_PROFILE`) are not read.

Errors are the domain errors of `batchplane.core.errors`, each on one line: what was being
done, in which store, what it means and what to check (`batchplane.core.store_errors`, the
loader's words too), then the store's answer in short (`store_answer`: the request, the status
and S3's error code, never the XML or obstore's debug dump). NotFound: no such object.
FailedPrecondition: no such bucket, access denied or no credentials, the wrong region, an
operation the store does not support; asking again will not help. Unavailable: the store cannot
be reached or refuses requests for now (after obstore's own retries), or failed otherwise.
obstore reports a missing bucket as a failed listing of a generic type, or as a missing object
whose answer says NoSuchBucket: the answer's S3 error code tells them apart. A HEAD answer has
no body, so a missing bucket there reads as a missing object.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
import secrets
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

import obstore
import obstore.store
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from batchplane.core.config import is_url
from batchplane.core.errors import BatchplaneError, FailedPrecondition, NotFound, Unavailable
from batchplane.core.storage import LocalStorage, Storage, check_data, check_key, check_range, is_key
from batchplane.core.store_errors import Client, Problem, classify_error, explain

if TYPE_CHECKING:
    from obstore.store import ObjectStore

log = logging.getLogger(__name__)

#: Where `check_conditional_puts` writes its scratch objects (deleted right after).
PROBE_PREFIX = "conditional-put-check/"
#: PUTs of one key tried while the store answers that a conditional write of it is in flight
#: (409 ConditionalRequestConflict on S3); then Unavailable.
_PUT_ATTEMPTS = 5
#: Characters of a store's answer kept in our messages.
_MESSAGE_CHARS = 600
#: Problems that asking again will not mend: FailedPrecondition; the others are Unavailable.
_REFUSED = frozenset({Problem.NO_SUCH_BUCKET, Problem.ACCESS_DENIED, Problem.WRONG_REGION})


class ObjectStorage(Storage):
    """Objects in an object store, under the store's prefix. Thread-safe.

    Args:
        store: An obstore store (S3Store, GCSStore, AzureStore, or MemoryStore in tests), its
            prefix the ledger's folder.
        url: The location it stands for, for messages (e.g. "s3://bucket/prefix").
    """

    def __init__(self, store: ObjectStore, *, url: str) -> None:
        self.store = store
        self.url = url.rstrip("/")
        self._folders: set[str] = set()  # folders above keys put, seen not to be objects
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, environ: Mapping[str, str] | None = None) -> ObjectStorage:
        """Opens the object store at `url` ("s3://bucket/prefix", "gs://...", "az://..."), with
        credentials and endpoint from the environment (see the module docstring).

        Args:
            environ: The environment to read the gaps obstore leaves from (obstore reads the
                process's own); default: `os.environ`.
        Raises:
            FailedPrecondition: obstore cannot make a store of the URL (an unknown scheme, a
                bad setting in the environment).
        """
        environ = os.environ if environ is None else environ
        options = client_options(url, environ)
        try:
            store = obstore.store.from_url(url, client_options=options or None)
        except (BaseError, ValueError) as exc:
            raise FailedPrecondition(f"cannot open object store {url}: {store_answer(exc)}") from exc
        return cls(store, url=url)

    def describe(self) -> str:
        return f"object store {self.url}"

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        check_data(data)
        self._check_no_conflict(key)
        for attempt in range(_PUT_ATTEMPTS):
            try:
                obstore.put(self.store, key, bytes(data), mode="create", use_multipart=False)
            except AlreadyExistsError:
                return False
            except PreconditionError as exc:  # another conditional write of the key is in flight
                error: BaseException = exc
                time.sleep(0.05 * 2**attempt)
                continue
            except NotSupportedError as exc:
                raise FailedPrecondition(
                    f"cannot put {key!r} in {self.describe()}: the store does not support conditional writes; {store_answer(exc)}"
                ) from exc
            except (BaseError, FileNotFoundError) as exc:
                raise self._error(f"cannot put {key!r}", exc) from exc
            with self._lock:
                self._folders.discard(key)  # an object now
            return True
        raise Unavailable(
            f"cannot put {key!r} in {self.describe()}: other writes of the key kept conflicting; {store_answer(error)}"
        ) from error

    def get(self, key: str) -> bytes:
        check_key(key)
        try:
            return bytes(obstore.get(self.store, key).bytes())
        except FileNotFoundError as exc:
            raise self._absent(f"cannot get {key!r}", key, exc) from None
        except BaseError as exc:
            raise self._error(f"cannot get {key!r}", exc) from exc

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        check_range(start, end)
        if start == end:  # no bytes to ask for; the object must exist all the same
            self._size(key)
            return b""
        try:
            return bytes(obstore.get_range(self.store, key, start=start, end=end))
        except FileNotFoundError as exc:
            raise self._absent(f"cannot get bytes {start}..{end} of {key!r}", key, exc) from None
        except BaseError as exc:
            # A range that starts at or past the end is refused (416); it is empty here.
            doing = f"cannot get bytes {start}..{end} of {key!r}"
            try:
                size = self._size(key)
            except BatchplaneError:  # the store's trouble, told by the GET's fuller answer
                raise self._error(doing, exc) from exc
            if size <= start:
                return b""
            raise self._error(doing, exc) from exc

    def list(self, prefix: str = "") -> builtins.list[str]:
        folder = prefix.rpartition("/")[0]
        if folder and not is_key(folder):
            return []  # no key has this prefix
        try:
            paths = [meta["path"] for batch in obstore.list(self.store, folder or None, chunk_size=1000) for meta in batch]
        except (BaseError, FileNotFoundError) as exc:
            raise self._error(f"cannot list {prefix!r}", exc) from exc
        return sorted(p for p in paths if p.startswith(prefix) and is_key(p))

    def delete(self, key: str) -> None:
        check_key(key)
        try:
            obstore.delete(self.store, key)
        except FileNotFoundError as exc:
            if classify_error(str(exc)) is Problem.NO_SUCH_BUCKET:
                raise self._error(f"cannot delete {key!r}", exc) from exc
            return  # already gone (stores that answer 404)
        except BaseError as exc:
            raise self._error(f"cannot delete {key!r}", exc) from exc

    def _check_no_conflict(self, key: str) -> None:
        """Refuses what a file system cannot hold: "a/b" beside "a" (see the module docstring
        for the race it leaves)."""
        parts = key.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            with self._lock:
                known = folder in self._folders
            if known:
                continue
            if self._exists(folder, doing=f"cannot put {key!r}"):
                raise FailedPrecondition(f"cannot put {key!r} in {self.describe()}: {folder!r} is an object, not a folder")
            with self._lock:
                self._folders.add(folder)
        try:
            below = next(iter(obstore.list(self.store, key, chunk_size=1)), [])
        except (BaseError, FileNotFoundError) as exc:
            raise self._error(f"cannot put {key!r}", exc) from exc
        if below:
            raise FailedPrecondition(f"cannot put {key!r} in {self.describe()}: it is a folder of other keys")

    def _exists(self, key: str, *, doing: str) -> bool:
        try:
            obstore.head(self.store, key)
        except FileNotFoundError:
            return False
        except BaseError as exc:
            raise self._error(doing, exc) from exc
        return True

    def _size(self, key: str) -> int:
        """The object's size.

        Raises:
            NotFound: There is no such object.
        """
        try:
            return int(obstore.head(self.store, key)["size"])
        except FileNotFoundError as exc:
            raise self._absent(f"cannot look up {key!r}", key, exc) from None
        except BaseError as exc:
            raise self._error(f"cannot look up {key!r}", exc) from exc

    def _absent(self, doing: str, key: str, exc: FileNotFoundError) -> BatchplaneError:
        """NotFound for a missing object; the bucket's error where the answer says the whole
        bucket is missing (obstore reports both as FileNotFoundError)."""
        if classify_error(str(exc)) is Problem.NO_SUCH_BUCKET:
            return self._error(doing, exc)
        return NotFound(f"no object {key!r} in {self.describe()}")

    def _error(self, doing: str, exc: BaseException) -> BatchplaneError:
        """The domain error of an obstore error that is not about one key's existence, on one
        line: "DOING in STORE: what it means and what to check; the store's answer"."""
        answer = store_answer(exc)
        where = f"{doing} in {self.describe()}"
        problem = Problem.ACCESS_DENIED if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) else classify_error(str(exc))
        if problem is Problem.OTHER:
            if isinstance(exc, NotSupportedError):
                return FailedPrecondition(f"{where}: not supported by the store; {answer}")
            if isinstance(exc, FileNotFoundError):  # a 404 to a write or a listing
                return FailedPrecondition(f"{where}: not found (does the bucket exist?); {answer}")
            return Unavailable(f"{where}: {answer}")
        scheme, bucket = self._bucket()
        meaning = explain(problem, scheme=scheme, bucket=bucket, client=Client.OBSTORE)
        return (FailedPrecondition if problem in _REFUSED else Unavailable)(f"{where}: {meaning}; {answer}")

    def _bucket(self) -> tuple[str, str | None]:
        """The store's scheme ("s3" for "s3a" too) and its bucket, where the URL names one."""
        parts = urllib.parse.urlsplit(self.url)
        scheme = "s3" if parts.scheme.lower() in ("s3", "s3a") else parts.scheme.lower()
        return scheme, (parts.netloc or None) if scheme in ("s3", "gs", "gcs") else None


def client_options(url: str, environ: Mapping[str, str]) -> dict[str, object]:
    """The obstore client options that `url` needs beyond what obstore reads from the
    environment by itself: `allow_http` for an S3 endpoint given as http:// (as
    `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL` or `AWS_ENDPOINT`, obstore's order) unless
    `AWS_ALLOW_HTTP` says otherwise."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("s3", "s3a"):
        return {}
    endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or environ.get("AWS_ENDPOINT") or ""
    if endpoint.lower().startswith("http://") and "AWS_ALLOW_HTTP" not in environ:
        return {"allow_http": True}
    return {}


def check_conditional_puts(storage: Storage) -> None:
    """Proves that `storage` honours conditional writes: puts a scratch key twice with
    put_if_absent (the second must report it taken and leave the first content), then deletes it.

    Raises:
        FailedPrecondition: The store ignores conditional writes (the second put overwrote the
            first, or was reported written), naming the store; or it refuses the first put (no
            such bucket, access denied), as that put's error says.
        Unavailable: The store cannot be reached.
    """
    key = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    first = storage.put_if_absent(key, b"first")  # when it fails, nothing was written: its error is the one to tell
    try:
        second = storage.put_if_absent(key, b"second")
        kept = storage.get(key)
    finally:
        storage.delete(key)
    if not first:
        raise FailedPrecondition(f"{storage.describe()} reported a fresh key {key!r} taken; it cannot hold the ledger")
    if second or kept != b"first":
        raise FailedPrecondition(
            f"{storage.describe()} ignores conditional writes (If-None-Match): a second put-if-absent of {key!r} "
            f"{'was reported written' if second else 'was refused but overwrote the first'}; the ledger needs them "
            "(a record is never overwritten, two planners never share a generation). Use a store that honours "
            "'If-None-Match: *' (AWS S3, GCS, Azure, MinIO, ...)"
        )


def open_storage(location: str, *, check_writes: bool = False, environ: Mapping[str, str] | None = None) -> Storage:
    """Opens a storage location: a local folder (created if missing), a "file://" URL (the
    same), or an object store URL ("s3://bucket/prefix", "gs://...", "az://...").

    Args:
        location: An absolute local path or a URL (see `JobSettings.locate`).
        check_writes: For a writer: prove that an object store honours conditional writes
            (`check_conditional_puts`) before returning it.
        environ: See `ObjectStorage.from_url`.
    Raises:
        FailedPrecondition: The store cannot be opened, or ignores conditional writes.
        Unavailable: The store cannot be reached.
    """
    if not is_url(location):
        return LocalStorage(location)
    parts = urllib.parse.urlsplit(location)
    if parts.scheme.lower() == "file":
        return LocalStorage(urllib.parse.unquote(parts.path))
    storage = ObjectStorage.from_url(location, environ=environ)
    if check_writes:
        check_conditional_puts(storage)
        log.info("%s honours conditional writes (If-None-Match)", storage.describe())
    return storage


_XML_CODE = re.compile(r"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_REQUEST = re.compile(r"Error performing ([A-Z]+) (\S+)")
_RETRIES = re.compile(r"after (\d+) retries")
_STATUS = "Server returned non-2xx status code: "
_OS_MESSAGE = re.compile(r'message: "([^"]*)"')


def store_answer(exc: BaseException) -> str:
    """What the store (or the network) answered in obstore's error `exc`, on one line: the
    request and its status with S3's error code and message ("GET URL answered 404 Not Found
    (NoSuchBucket: The specified bucket does not exist)"), or why it failed ("GET URL failed
    after 10 retries: HTTP error: error sending request (Connection refused)"); never the XML
    document or obstore's debug dump. At most _MESSAGE_CHARS characters."""
    text = str(exc)
    head = text.split("\n\nDebug source", 1)[0]
    request = _REQUEST.search(head)
    rest = head[request.end() :] if request else ""
    if request is None or " - " not in rest:
        return _cut(_one_line(head) or type(exc).__name__)
    method, uri = request.groups()
    retries = _RETRIES.search(rest.split(" - ", 1)[0])
    after = f" after {retries.group(1)} retries" if retries and retries.group(1) != "0" else ""
    reason = rest.split(" - ", 1)[1].strip()
    if reason.startswith(_STATUS):
        status, _, body = reason[len(_STATUS) :].partition(":")
        code, message = _XML_CODE.search(body), _XML_MESSAGE.search(body)
        said = (code.group(1) + (f": {message.group(1)}" if message else "")) if code else _one_line(body)
        return _cut(f"{method} {uri} answered {status.strip()}{after}" + (f" ({said})" if said else ""))
    cause = _OS_MESSAGE.search(text)  # the system's word on a failed connection, in the debug part
    return _cut(f"{method} {uri} failed{after}: {_one_line(reason)}" + (f" ({cause.group(1)})" if cause else ""))


def _one_line(text: str) -> str:
    """`text` without an XML declaration, its whitespace runs made single spaces."""
    return " ".join(re.sub(r"<\?xml[^>]*\?>", "", text).split())


def _cut(line: str) -> str:
    return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."
