"""Finding a source's Parquet files on the file system its location names, through `pyarrow.fs`.

A location is a local path or a URL:

- a local path, or `file://`: pyarrow's `LocalFileSystem`;
- `s3://bucket/key`, `gs://` (`gcs://`), `hdfs://` (`viewfs://`), `abfs://` (`abfss://`):
  pyarrow's own file systems (`FileSystem.from_uri`);
- any other scheme (`memory://`, `az://` with adlfs, ...): fsspec's implementation wrapped in
  `PyFileSystem(FSSpecHandler(...))`; fsspec is the optional extra `batchplane[fsspec]`.

It may name one file, a folder (every `*.parquet` below it) or a glob (`*`, `?`, `[`, and `**`
for any depth, matched on the listing below the glob's fixed prefix); see
`batchplane.loader.locations` for the exact rules and the order files are taken in.

Credentials and endpoints come from the standard environment, read by the clients themselves:

- S3 (measured with pyarrow 26 against a real S3 endpoint and one that records requests):
  `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN` sign requests; a web
  identity (`AWS_WEB_IDENTITY_TOKEN_FILE` with `AWS_ROLE_ARN`, as IRSA sets them), `~/.aws`
  and the instance's role come through the AWS SDK's default chain (the web identity's STS
  call goes to AWS, not to `AWS_ENDPOINT_URL_STS`, so it was not exercised locally);
  `AWS_REGION` (else `AWS_DEFAULT_REGION`; without an endpoint variable pyarrow also asks AWS
  for the bucket's region). Without credentials pyarrow sends unsigned requests, which a
  private bucket refuses ("access denied"). The endpoint: `AWS_ENDPOINT_URL_S3`, else
  `AWS_ENDPOINT_URL` (e.g. "http://minio:9000"; `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`
  ignores both). pyarrow 26 honours both in `FileSystem.from_uri`, the S3-specific one first,
  but not in a bare `S3FileSystem()`, and the project allows pyarrow >= 15, so this module
  builds `S3FileSystem(endpoint_override=..., scheme=...)` from them itself.
- gs://, hdfs://, abfs://: as pyarrow's `GcsFileSystem` (Google's default credentials),
  `HadoopFileSystem` (a Java runtime, `HADOOP_HOME`, `CLASSPATH`) and `AzureFileSystem`
  (Azure's default credential: `AZURE_CLIENT_ID`, `AZURE_TENANT_ID`, `AZURE_CLIENT_SECRET` or a
  workload identity) read them; not measured here.
- fsspec schemes: fsspec's configuration (`FSSPEC_<PROTOCOL>_<OPTION>` variables, e.g.
  `FSSPEC_AZ_ACCOUNT_NAME`, or its config files) and the implementation's own variables.

Every failure is a `SourceError` naming the source, the location and the problem: an unknown
scheme, fsspec missing, no such bucket, access denied or no credentials, an unreachable
endpoint, no Parquet file there.

The listing's size and modification time of each file are kept (`SourceFiles.stats`): with its
rows they identify the source's data (`batchplane.loader.file_facts`).

I/O: this module lists and opens; the decisions on text are in `batchplane.loader.locations`
(globs, order) and `batchplane.core.store_errors` (error meanings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import urllib.parse
from collections.abc import Iterator, Mapping

import pyarrow as pa
import pyarrow.fs as pafs

from batchplane.core.config import url_scheme
from batchplane.core.errors import SourceError
from batchplane.core.store_errors import Problem, classify_error, explain, first_line
from batchplane.loader.file_facts import FileStat
from batchplane.loader.locations import (
    BUCKET_SCHEMES,
    NATIVE_SCHEMES,
    GlobSplit,
    is_parquet_name,
    matches_glob,
    relative_to,
    s3_endpoint,
    sorted_paths,
    split_glob,
)

FSSPEC_EXTRA = "batchplane[fsspec]"


@dataclasses.dataclass(frozen=True)
class Place:
    """A location opened on its file system.

    Attributes:
        filesystem: The file system.
        path: The location's path on it (no trailing "/", but for a root).
        shown: The location as configured (a URL or a local path), for messages.
        scheme: Its URL scheme, None for a local path.
    """

    filesystem: pafs.FileSystem
    path: str
    shown: str
    scheme: str | None

    def show(self, path: str) -> str:
        """How `path` (on `filesystem`, `path` or below it) is shown: a local path in the form
        the location was written in, else a URL (e.g. "s3://bucket/key.parquet")."""
        rel = relative_to(self.path, path)
        if self.scheme is None:
            return str(pathlib.PurePath(self.shown) / rel)
        if not rel:
            return self.shown
        return self.shown + rel if self.shown.endswith("/") else f"{self.shown}/{rel}"


@dataclasses.dataclass(frozen=True)
class SourceFiles:
    """A source's Parquet files, in the order its rows are numbered in.

    Attributes:
        filesystem: Their file system.
        paths: Their paths on it.
        names: The same files as shown in messages (local paths or URLs).
        scheme: The location's URL scheme, None for a local path.
        stats: What the listing said of each file, in the same order.
    """

    filesystem: pafs.FileSystem
    paths: tuple[str, ...]
    names: tuple[str, ...]
    scheme: str | None
    stats: tuple[FileStat, ...] = ()


def open_location(location: str, *, source: str, environ: Mapping[str, str] | None = None) -> Place:
    """The file system `location` (a local path or URL, no glob) is on, and its path there.

    Args:
        location: A local path (relative ones against the working folder) or a URL.
        source: The source's name, for errors.
        environ: The environment to take an S3 endpoint from (default: `os.environ`).
    Raises:
        SourceError: an unknown scheme, fsspec missing for a scheme only it knows, a bad URL
            or endpoint variable, or a file system that cannot be created (see the module
            docstring).
    """
    scheme = url_scheme(location)
    if scheme is None:
        return Place(pafs.LocalFileSystem(), os.path.abspath(location or "."), location, None)
    if scheme in BUCKET_SCHEMES and not location.split("://", 1)[1].strip("/"):
        raise SourceError(f"source {source!r}: cannot open {location!r}: the URL names no bucket ('{scheme}://bucket/prefix')")
    with translated_errors(source, "open", location, scheme):
        if scheme == "s3":
            filesystem, path = _s3(location, source=source, environ=os.environ if environ is None else environ)
        elif scheme in NATIVE_SCHEMES:
            filesystem, path = pafs.FileSystem.from_uri(location)
        else:
            filesystem, path = _fsspec(location, scheme, source=source)
    return Place(filesystem, _trimmed(path), location, scheme)


def _s3(location: str, *, source: str, environ: Mapping[str, str]) -> tuple[pafs.FileSystem, str]:
    """An S3 file system with the endpoint the environment names, else pyarrow's own choice."""
    try:
        endpoint = s3_endpoint(environ)
    except ValueError as exc:
        raise SourceError(f"source {source!r}: cannot open {location!r}: {exc}") from exc
    if endpoint is None:
        return pafs.FileSystem.from_uri(location)
    path = urllib.parse.unquote(location.split("://", 1)[1]).strip("/")
    return pafs.S3FileSystem(endpoint_override=endpoint.host, scheme=endpoint.scheme), path


def _fsspec(location: str, scheme: str, *, source: str) -> tuple[pafs.FileSystem, str]:
    """fsspec's file system for `scheme`, as a pyarrow file system."""
    try:
        import fsspec.core
    except ImportError as exc:
        raise SourceError(
            f"source {source!r}: cannot open {location!r}: pyarrow does not know the scheme {scheme!r}; "
            f"fsspec would, but it is not installed: pip install '{FSSPEC_EXTRA}' (and the package of "
            f"fsspec's {scheme!r} implementation, e.g. adlfs for az://)"
        ) from exc
    try:
        filesystem, path = fsspec.core.url_to_fs(location)
    except ImportError as exc:
        raise SourceError(f"source {source!r}: cannot open {location!r}: fsspec's {scheme!r} file system needs a package: {exc}") from exc
    except ValueError as exc:
        if scheme not in fsspec.available_protocols():
            raise SourceError(
                f"source {source!r}: cannot open {location!r}: unknown scheme {scheme!r}: neither pyarrow "
                f"({', '.join(sorted(NATIVE_SCHEMES))}) nor fsspec (fsspec.available_protocols()) knows it"
            ) from exc
        raise SourceError(f"source {source!r}: cannot open {location!r}: {first_line(str(exc))}") from exc
    except Exception as exc:  # noqa: BLE001 - an fsspec implementation's own failure, reported as the source's
        raise SourceError(
            f"source {source!r}: cannot open {location!r}: fsspec's {scheme!r} file system failed: {type(exc).__name__}: {first_line(str(exc))}"
        ) from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), path


def _trimmed(path: str) -> str:
    """`path` without a trailing "/" (a root keeps it)."""
    stripped = path.rstrip("/")
    return stripped if stripped or not path else "/"


def find_parquet_files(source: str, location: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> SourceFiles:
    """The Parquet files `location` names: the file itself, every `*.parquet` below a folder,
    or the files a glob matches; sorted (`locations.sorted_paths`).

    Args:
        source: The source's name, for errors.
        location: A local path or URL, possibly a glob.
        environ: As `open_location`.
    Raises:
        SourceError: as `open_location`; the location cannot be listed (no such bucket, access
            denied, an unreachable endpoint, ...); no Parquet file there.
    """
    text = os.fspath(location)
    if url_scheme(text) is None:
        text = str(pathlib.PurePath(text))  # "a//b/./c/" is "a/b/c", as it always was for a local source
    try:
        split = split_glob(text)
    except ValueError as exc:
        raise SourceError(f"source {source!r}: cannot open {text!r}: {exc}") from exc
    place = open_location(split.base, source=source, environ=environ)
    with translated_errors(source, "list", text, place.scheme):
        found, why = _matches(place, split) if split.parts else _named(place)
        if not found:
            raise SourceError(f"source {source!r}: no Parquet file found at {text!r}: {why or _nothing_there(place)}")
    infos = {info.path: info for info in found}
    paths = sorted_paths(infos)
    stats = tuple(_stat(place.path, infos[p]) for p in paths)
    return SourceFiles(place.filesystem, tuple(paths), tuple(place.show(p) for p in paths), place.scheme, stats)


def _stat(base: str, info: pafs.FileInfo) -> FileStat:
    """What the listing said of the file `info` below `base` (or at it: its name)."""
    name = relative_to(base, info.path) or info.path.rsplit("/", 1)[-1]
    return FileStat(name, info.size, info.mtime_ns)


def _named(place: Place) -> tuple[list[pafs.FileInfo], str | None]:
    """The file at `place`, or every *.parquet below the folder there; and why there is none
    (None: nothing is there)."""
    fs = place.filesystem
    info = fs.get_file_info(place.path)
    if info.type == pafs.FileType.File:
        return [info], None
    if info.type != pafs.FileType.Directory:
        return [], None
    listed = _files(fs, pafs.FileSelector(place.path, recursive=True))
    if fs.type_name == "local":  # pyarrow follows links to folders; a folder source never did (rglob)
        listed = _not_through_links(place.path, listed)
    found = [i for i in listed if is_parquet_name(i.path.rsplit("/", 1)[-1])]
    return found, f"{len(listed)} file(s) below it, none named *.parquet" if listed else "an empty folder"


def _not_through_links(base: str, files: list[pafs.FileInfo]) -> list[pafs.FileInfo]:
    """The local `files` below `base` whose folders below `base` are no symbolic links."""
    linked: dict[str, bool] = {}

    def through_link(path: str) -> bool:
        folder = os.path.dirname(path)
        if folder == base or not folder.startswith(base):
            return False
        if folder not in linked:
            linked[folder] = os.path.islink(folder) or through_link(folder)
        return linked[folder]

    return [i for i in files if not through_link(i.path)]


def _matches(place: Place, split: GlobSplit) -> tuple[list[pafs.FileInfo], str | None]:
    """The files below the folder at `place` (the glob's base) that the glob matches; and why
    there is none (None: nothing is there). Lists recursively only when the pattern can reach
    below the base's own entries."""
    fs = place.filesystem
    info = fs.get_file_info(place.path)
    if info.type == pafs.FileType.File:
        if all(p == "**" for p in split.parts):  # "x.parquet/**" is x.parquet, as glob has it
            return [info], None
        return [], f"{place.show(place.path)!r} is a file, not a folder to match {split.pattern!r} in"
    if info.type != pafs.FileType.Directory:
        return [], None
    recursive = len(split.parts) > 1 or split.parts[0] == "**"
    listed = _files(fs, pafs.FileSelector(place.path, recursive=recursive, allow_not_found=True))
    found = [i for i in listed if matches_glob(split.parts, relative_to(place.path, i.path))]
    return found, f"nothing below {place.show(place.path)!r} matches {split.pattern!r}"


def _files(fs: pafs.FileSystem, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
    """The files (not folders) the selector lists, with what the listing says of them."""
    return [info for info in fs.get_file_info(selector) if info.type == pafs.FileType.File]


def _nothing_there(place: Place) -> str:
    """Why nothing is at `place`: its bucket does not exist, or nothing is stored there."""
    if place.scheme in BUCKET_SCHEMES:
        bucket = place.path.split("/", 1)[0]
        if bucket and place.filesystem.get_file_info(bucket).type == pafs.FileType.NotFound:
            return explain(Problem.NO_SUCH_BUCKET, scheme=place.scheme, bucket=bucket)
        return "no object under that prefix"
    return "no such file or folder"


@contextlib.contextmanager
def translated_errors(source: str, action: str, shown: str, scheme: str | None) -> Iterator[None]:
    """Turns a file system's OSError or Arrow error inside the block into a `SourceError`:
    "source S: cannot ACTION SHOWN: what it means (what pyarrow said)"."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise source_error(source, action, shown, scheme, exc) from exc


def source_error(source: str, action: str, shown: str, scheme: str | None, exc: BaseException) -> SourceError:
    """The `SourceError` for `exc`, raised while doing `action` ("list", "read Parquet file",
    ...) on `shown`, a location or file of `scheme` (None: local)."""
    text = str(exc)
    problem = classify_error(text, errno=exc.errno) if isinstance(exc, OSError) else Problem.OTHER
    detail = first_line(text)
    if problem is Problem.OTHER:
        return SourceError(f"source {source!r}: cannot {action} {shown!r}: {detail}")
    return SourceError(f"source {source!r}: cannot {action} {shown!r}: {explain(problem, scheme=scheme)} ({detail})")
