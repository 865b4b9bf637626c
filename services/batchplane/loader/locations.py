"""What a source location says, before anything is opened: its scheme, the fixed prefix and the
pattern of a glob, which paths below the prefix a glob matches, the order of a source's files,
the S3 endpoint the standard environment names, and which failed reads are tried again (what an
error text means is `batchplane.core.store_errors`, shared with the ledger's storage).

Globs mean what `glob.glob(pattern, recursive=True)` means for a local path, on any file
system: `*`, `?` and `[...]` match within one path component (`fnmatch` rules, case-sensitive),
`**` as a whole component matches any number of components (none too), and a wildcard
component never matches a name starting with "." unless the pattern component itself starts
with "." (nor does `**` descend into such folders); a file two ways match is taken once. A
folder means every file named `*.parquet` anywhere below it, hidden or not, as
`pathlib.Path.rglob` finds them (locally: through links to files, not through links to
folders, which a glob does follow). Files are taken in the order of their path components, as
sorting `pathlib` paths orders them.

Pure: no I/O, no pyarrow. `batchplane.loader.filesystems` does the listing and the opening.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from batchplane.core.config import URL_HEAD
from batchplane.core.store_errors import Problem, classify_error

#: The characters that make a location a glob.
GLOB_CHARS = "*?["

#: URL schemes pyarrow opens itself (`pyarrow.fs.FileSystem.from_uri`); any other scheme goes
#: to fsspec.
NATIVE_SCHEMES = frozenset({"file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})

#: Schemes whose first path component is a bucket (or container) that may not exist.
BUCKET_SCHEMES = frozenset({"s3", "gs", "gcs", "abfs", "abfss"})


def has_glob(text: str) -> bool:
    """True when `text` holds a glob character (`*`, `?` or `[`)."""
    return any(c in text for c in GLOB_CHARS)


@dataclasses.dataclass(frozen=True)
class GlobSplit:
    """A location cut where its first wildcard component starts.

    Attributes:
        base: The fixed prefix, a folder: for a URL "scheme://authority/..." (no trailing "/"
            but for a root, "file:///" or "/"), for a local path "" meaning the working folder.
        parts: The pattern's components, relative to `base` (empty: no glob).
    """

    base: str
    parts: tuple[str, ...]

    @property
    def pattern(self) -> str:
        """The pattern's components joined with "/"."""
        return "/".join(self.parts)


def split_glob(location: str) -> GlobSplit:
    """`location` cut before its first component holding a glob character.

    Empty components inside the pattern ("a//b") are dropped, as glob ignores them; a trailing
    one ("data/*/") is kept, so that the pattern matches folders only, i.e. no file.

    Raises:
        ValueError: a glob in a URL's authority (the bucket, container or host), which would
            mean listing every bucket.
    """
    if not has_glob(location):
        return GlobSplit(location, ())
    m = URL_HEAD.match(location)
    head = m.group(0) if m else ""
    parts = location[len(head) :].split("/")
    first = next(i for i, p in enumerate(parts) if has_glob(p))
    if head and first == 0:
        raise ValueError(f"a glob in the bucket, container or host of {location!r} is not supported; put it in the path below")
    fixed = parts[:first]
    base = head + "/".join(fixed)
    if fixed == [""]:  # "/*.parquet", "file:///*.parquet": the root
        base += "/"
    rest = parts[first:]
    return GlobSplit(base, tuple(p for p in rest[:-1] if p) + (rest[-1],))


def _hidden(name: str) -> bool:
    return name.startswith(".")


def matches_glob(parts: Sequence[str], relative: str) -> bool:
    """Whether the file `relative` (components joined with "/", relative to the glob's base)
    matches the pattern `parts` (`GlobSplit.parts`) as `glob.glob(recursive=True)` matches it."""
    return _match(tuple(parts), tuple(relative.split("/")), after_literal=False)


def _match(parts: tuple[str, ...], names: tuple[str, ...], *, after_literal: bool) -> bool:
    """glob's rules: a wildcard component followed by more matches folders only, a literal one
    anything that exists; "**" takes any number of names (none of them hidden), and taking
    none keeps the path so far, so "x/**" matches the file x when x was a literal component.
    `after_literal`: the last name taken was taken by a literal component."""
    if not names:
        return not parts or (after_literal and all(p == "**" for p in parts))
    if not parts:
        return False
    head, rest = parts[0], parts[1:]
    if head == "**":
        for k in range(len(names) + 1):
            if k and _hidden(names[k - 1]):
                return False
            if _match(rest, names[k:], after_literal=after_literal if k == 0 else False):
                return True
        return False
    name = names[0]
    if has_glob(head):
        if (_hidden(name) and not _hidden(head)) or not fnmatch.fnmatchcase(name, head):
            return False
    elif name != head:
        return False
    return _match(rest, names[1:], after_literal=not has_glob(head))


def is_parquet_name(name: str) -> bool:
    """True for a file name a folder source takes: ending in ".parquet" (case-sensitive)."""
    return name.endswith(".parquet")


def path_order(path: str) -> tuple[str, ...]:
    """The sort key of a source's file: its path components, so "a/b/c" comes before "a/b-c"
    (as `pathlib` paths sort, and unlike plain strings)."""
    return tuple(path.split("/"))


def sorted_paths(paths: Iterable[str]) -> list[str]:
    """`paths` without repeats, in `path_order`: the order a source's rows are numbered in."""
    return sorted(set(paths), key=path_order)


def relative_to(base: str, path: str) -> str:
    """`path` below the folder `base` ("" for `base` itself), both as a file system lists them.

    Raises:
        ValueError: `path` is neither `base` nor below it.
    """
    if path == base:
        return ""
    if not base:
        return path.lstrip("/")
    prefix = base if base.endswith("/") else base + "/"
    if not path.startswith(prefix):
        raise ValueError(f"{path!r} is not below {base!r}")
    return path[len(prefix) :]


# ---- the S3 endpoint --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """An S3 endpoint: `scheme` ("http" or "https") and `host` ("host[:port]", any path kept)."""

    scheme: str
    host: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"


def s3_endpoint(environ: Mapping[str, str]) -> Endpoint | None:
    """The S3 endpoint the standard AWS environment names: `AWS_ENDPOINT_URL_S3`, else
    `AWS_ENDPOINT_URL`; None when neither is set (or both are empty) or when
    `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS` is "true". A value without a scheme means https.

    Raises:
        ValueError: a scheme other than http or https, or no host.
    """
    if environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true":
        return None
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = environ.get(name, "").strip()
        if not value:
            continue
        scheme, sep, host = value.partition("://")
        if not sep:
            scheme, host = "https", value
        scheme, host = scheme.lower(), host.rstrip("/")
        if scheme not in ("http", "https") or not host:
            raise ValueError(f"{name}={value!r} is not an http(s) URL such as 'https://s3.example.com:9000'")
        return Endpoint(scheme, host)
    return None


# ---- reading through store trouble ------------------------------------------------------------

#: Problems of a remote store that say nothing about the data: the store did not answer, asked
#: to slow down, or stopped accepting the credentials (a web identity's token expires and is
#: renewed). A read that meets one is tried again, never skipped; any other failure (a corrupt
#: page, a failed checksum, a file gone) is the data's, and the row group is skipped and counted.
STORE_TROUBLE = frozenset({Problem.UNREACHABLE, Problem.THROTTLED, Problem.ACCESS_DENIED})

#: Seconds before the first retry of a read, and the most between two.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


def is_store_trouble(text: str, *, remote: bool) -> bool:
    """True when a failed read of a remote file (`remote`) should be tried again: its error
    `text` names trouble of the store rather than of the data. Local files: always False."""
    return remote and classify_error(text) in STORE_TROUBLE


def retry_delay(attempt: int) -> float:
    """Seconds to wait before retry `attempt` (0, 1, ...): doubling from RETRY_FIRST_S up to
    RETRY_MAX_S, so a store that comes back after minutes is asked about twice a minute."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(attempt, 16))
