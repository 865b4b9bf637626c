"""Tests of where a source's files are: `batchplane.loader.locations` (globs, order, the S3
endpoint, what pyarrow's error texts mean; pure) and `batchplane.loader.filesystems` with
`ParquetSource` on local folders, globs and files (the same files in the same order as before
sources could be remote), file:// URLs and fsspec's memory:// file system. S3 itself is tested
against a real endpoint in tests/integration/test_s3_sources.py."""

from __future__ import annotations

import errno
import glob
import os
import pathlib
import sys
import tempfile
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.config import url_scheme
from batchplane.core.errors import SourceError
from batchplane.core.store_errors import Problem, classify_error, explain, first_line
from batchplane.loader import filesystems
from batchplane.loader.filesystems import FSSPEC_EXTRA, find_parquet_files, open_location
from batchplane.loader import locations
from batchplane.loader.locations import (
    Endpoint,
    matches_glob,
    path_order,
    relative_to,
    s3_endpoint,
    sorted_paths,
    split_glob,
)
from batchplane.loader.source import ParquetSource


def old_expand_path(path: pathlib.Path) -> list[pathlib.Path]:
    """`expand_path` as it was when every source was local: the reference for local sources."""
    text = str(path)
    if any(c in text for c in "*?["):
        return sorted(pathlib.Path(p) for p in glob.glob(text, recursive=True) if pathlib.Path(p).is_file())
    if path.is_dir():
        return sorted(p for p in path.rglob("*.parquet") if p.is_file())
    return [path] if path.exists() else []


def write_parquet(where, rows: range, *, filesystem: pafs.FileSystem | None = None) -> None:
    table = pa.table({"input_ids": pa.array([[r, r + 1] for r in rows], pa.list_(pa.int32())), "row": pa.array(list(rows), pa.int64())})
    if filesystem is None:
        pathlib.Path(where).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, where, filesystem=filesystem, row_group_size=4)


# ---- pure: schemes, glob splitting and matching, order ------------------------------------------


@pytest.mark.parametrize(
    ("location", "scheme"),
    [
        ("s3://bucket/key", "s3"),
        ("S3://bucket/key", "s3"),
        ("gs://b/k", "gs"),
        ("hdfs://nn:8020/x", "hdfs"),
        ("abfs://c@acct.dfs.core.windows.net/x", "abfs"),
        ("file:///data/x", "file"),
        ("memory://x", "memory"),
        ("/data/x", None),
        ("data/x", None),
        ("C:/data", None),
        ("s3:/bucket", None),
    ],
)
def test_scheme_of(location, scheme) -> None:
    assert url_scheme(location) == scheme


@pytest.mark.parametrize(
    ("location", "base", "pattern"),
    [
        ("/data/web", "/data/web", ""),
        ("s3://b/corpus/", "s3://b/corpus/", ""),
        ("/data/*.parquet", "/data", "*.parquet"),
        ("/*.parquet", "/", "*.parquet"),
        ("*.parquet", "", "*.parquet"),
        ("data/**/part-?.parquet", "data", "**/part-?.parquet"),
        ("s3://b/corpus/**/*.parquet", "s3://b/corpus", "**/*.parquet"),
        ("s3://b/*.parquet", "s3://b", "*.parquet"),
        ("gs://b/x/y[0-9]/z.parquet", "gs://b/x", "y[0-9]/z.parquet"),
        ("file:///*/a.parquet", "file:///", "*/a.parquet"),
        ("file:///data/*/a.parquet", "file:///data", "*/a.parquet"),
        ("data/*//a.parquet", "data", "*/a.parquet"),
        ("data/*/", "data", "*/"),
    ],
)
def test_split_glob(location, base, pattern) -> None:
    split = split_glob(location)
    assert (split.base, split.pattern) == (base, pattern)


@pytest.mark.parametrize("location", ["s3://*/x.parquet", "s3://bucket-?/x", "gs://[ab]/x", "hdfs://nn*/x"])
def test_a_glob_in_the_bucket_or_host_is_refused(location) -> None:
    with pytest.raises(ValueError, match="bucket, container or host"):
        split_glob(location)


component = st.text(alphabet="abz.-_", min_size=1, max_size=4)
wild = st.sampled_from(["*", "?", "[ab]*", "*.parquet", "**", "a*", ".*"])


@settings(max_examples=200, deadline=None)
@given(
    scheme=st.sampled_from(["", "s3://", "file://", "memory://"]),
    fixed=st.lists(component, min_size=1, max_size=3),
    pattern=st.lists(st.one_of(wild, component), min_size=1, max_size=4),
)
def test_split_glob_cuts_before_the_first_wildcard_and_loses_nothing(scheme, fixed, pattern) -> None:
    wildcard = next((i for i, p in enumerate(pattern) if any(c in p for c in "*?[")), None)
    location = scheme + "/".join([*fixed, *pattern])
    split = split_glob(location)
    if wildcard is None:
        assert (split.base, split.parts) == (location, ())
        return
    assert split.base == scheme + "/".join([*fixed, *pattern[:wildcard]])
    assert split.parts == tuple(pattern[wildcard:])
    assert not any(c in split.base for c in "*?[")
    assert f"{split.base}/{split.pattern}" == location


@pytest.mark.parametrize(
    ("pattern", "relative", "expected"),
    [
        ("*.parquet", "a.parquet", True),
        ("*.parquet", "x/a.parquet", False),  # * stays within one component
        ("*.parquet", ".a.parquet", False),  # wildcards skip hidden names ...
        (".*.parquet", ".a.parquet", True),  # ... unless the pattern starts with "."
        ("**/*.parquet", "a.parquet", True),  # ** is any depth, none too
        ("**/*.parquet", "x/y/a.parquet", True),
        ("**/*.parquet", ".x/a.parquet", False),  # ** does not enter hidden folders
        ("**", "x/y/a.parquet", True),
        ("x/**/a.parquet", "x/a.parquet", True),
        ("part-?.parquet", "part-1.parquet", True),
        ("part-?.parquet", "part-10.parquet", False),
        ("part-[0-4].parquet", "part-5.parquet", False),
        ("part-[!0-4].parquet", "part-5.parquet", True),
        ("A*.parquet", "a.parquet", False),  # case-sensitive
        ("*/", "x/a.parquet", False),  # a trailing "/" matches folders only
        (".x/*.parquet", ".x/a.parquet", True),  # a literal hidden component is fine
    ],
)
def test_matches_glob(pattern, relative, expected) -> None:
    assert matches_glob(pattern.split("/"), relative) is expected


def test_path_order_puts_a_folder_before_names_that_extend_it() -> None:
    assert sorted_paths(["a/b-c", "a/b/c", "a/b.parquet", "a/b/c"]) == ["a/b/c", "a/b-c", "a/b.parquet"]


paths = st.lists(
    st.lists(
        st.text(alphabet="ab-._/0", min_size=1, max_size=3).filter(lambda s: "/" not in s and s not in (".", "..")), min_size=1, max_size=4
    ).map("/".join),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(names=paths, absolute=st.booleans())
def test_files_are_ordered_as_pathlib_orders_them(names, absolute) -> None:
    names = [("/" + n if absolute else n) for n in names]
    assert sorted_paths(names) == [str(p) for p in sorted(set(pathlib.PurePosixPath(n) for n in names))]
    assert all(path_order(a) <= path_order(b) for a, b in zip(sorted_paths(names), sorted_paths(names)[1:]))


@pytest.mark.parametrize(
    ("base", "path", "relative"),
    [("bucket/x", "bucket/x/a/b.parquet", "a/b.parquet"), ("/", "/a.parquet", "a.parquet"), ("bucket/x", "bucket/x", ""), ("", "/a", "a")],
)
def test_relative_to(base, path, relative) -> None:
    assert relative_to(base, path) == relative


def test_relative_to_refuses_a_path_outside() -> None:
    with pytest.raises(ValueError, match="not below"):
        relative_to("bucket/x", "bucket/xy/a.parquet")


# ---- pure: the S3 endpoint and error meanings -------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "endpoint"),
    [
        ({}, None),
        ({"AWS_ENDPOINT_URL": ""}, None),
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}, Endpoint("http", "127.0.0.1:9000")),
        ({"AWS_ENDPOINT_URL_S3": "https://s3.example.com/"}, Endpoint("https", "s3.example.com")),
        ({"AWS_ENDPOINT_URL": "http://generic:1", "AWS_ENDPOINT_URL_S3": "http://s3only:2"}, Endpoint("http", "s3only:2")),
        ({"AWS_ENDPOINT_URL": "minio:9000"}, Endpoint("https", "minio:9000")),
        ({"AWS_ENDPOINT_URL": "HTTP://minio:9000"}, Endpoint("http", "minio:9000")),
        ({"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}, None),
    ],
)
def test_s3_endpoint_from_the_standard_environment(environ, endpoint) -> None:
    assert s3_endpoint(environ) == endpoint


@pytest.mark.parametrize("value", ["ftp://host", "http://", "https:///"])
def test_a_bad_endpoint_variable_is_named(value) -> None:
    with pytest.raises(ValueError, match="AWS_ENDPOINT_URL_S3="):
        s3_endpoint({"AWS_ENDPOINT_URL_S3": value})


# Texts pyarrow 26 gave against a real S3 endpoint (moto's server) and an endpoint answering
# each S3 error code (see the report of issue 14).
MEASURED = [
    (
        "When listing objects under key 'x/' in bucket 'nobucket': AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation: The specified bucket does not exist (Request ID: 1)",
        Problem.NO_SUCH_BUCKET,
    ),
    (
        "When getting information for key 'x' in bucket 'data': AWS Error ACCESS_DENIED during HeadObject operation: No response body.",
        Problem.ACCESS_DENIED,
    ),
    (
        "When listing objects under key 'x/' in bucket 'data': AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation: The AWS Access Key Id you provided does not exist in our records. (Request ID: 1)",
        Problem.ACCESS_DENIED,
    ),
    (
        "When listing objects under key 'x/' in bucket 'data': AWS Error SIGNATURE_DOES_NOT_MATCH during ListObjectsV2 operation: The request signature we calculated does not match (Request ID: 1)",
        Problem.ACCESS_DENIED,
    ),
    (
        "When listing objects under key 'x/' in bucket 'data': AWS Error UNKNOWN (HTTP status 400) during ListObjectsV2 operation: Unable to parse ExceptionName: ExpiredToken Message: The provided token has expired. (Request ID: 1)",
        Problem.ACCESS_DENIED,
    ),
    (
        "When listing objects under key 'x/' in bucket 'data': AWS Error UNKNOWN (HTTP status 301) during ListObjectsV2 operation: Unable to parse ExceptionName: PermanentRedirect Message: The bucket you are attempting to access must be addressed using the specified endpoint.",
        Problem.WRONG_REGION,
    ),
    (
        "When listing objects under key 'x/' in bucket 'data': AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 7, Could not connect to server; Details: Failed to connect to 127.0.0.1:1 after 0 ms: Could not connect to server",
        Problem.UNREACHABLE,
    ),
    (
        "When resolving region for bucket 'b': AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 6, Could not resolve hostname; Details: Could not resolve host: s3.us-east-1.amazonaws.com",
        Problem.UNREACHABLE,
    ),
    (
        "When listing objects under key 'x/' in bucket 'data': AWS Error SLOW_DOWN during ListObjectsV2 operation: Please reduce your request rate. (Request ID: 1)",
        Problem.THROTTLED,
    ),
    ("[Errno 2] Path does not exist 'data/x/a.parquet'. Detail: [errno 2] No such file or directory", Problem.NOT_FOUND),
    ("Unable to load libjvm", Problem.OTHER),
]


@pytest.mark.parametrize(("text", "problem"), MEASURED)
def test_classify_measured_error_texts(text, problem) -> None:
    assert classify_error(text) is problem


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        (errno.EACCES, Problem.ACCESS_DENIED),
        (errno.EPERM, Problem.ACCESS_DENIED),
        (errno.ENOENT, Problem.NOT_FOUND),
        (errno.EIO, Problem.OTHER),
    ],
)
def test_classify_local_errors_by_errno(code, problem) -> None:
    assert classify_error(os.strerror(code), errno=code) is problem


def test_an_s3_access_error_names_the_credential_variables() -> None:
    text = explain(Problem.ACCESS_DENIED, scheme="s3")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        assert name in text
    assert explain(Problem.ACCESS_DENIED, scheme=None) == "permission denied"
    assert "AWS_ENDPOINT_URL_S3" in explain(Problem.UNREACHABLE, scheme="s3")
    assert explain(Problem.NO_SUCH_BUCKET, scheme="gs", bucket="b") == "no such bucket 'b'"


def test_first_line_keeps_messages_short() -> None:
    assert first_line("Unable to load libjvm\n" + "dlopen(...) failed\n" * 100) == "Unable to load libjvm"
    assert len(first_line("x" * 10_000)) == 500


# ---- local sources: the same files in the same order as before ------------------------------------


def make_tree(root: pathlib.Path, files: list[str]) -> None:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


TREE = [
    "a/b/c.parquet",
    "a/b-c.parquet",
    "a/b.parquet",
    "a/.hidden.parquet",
    "a/.dot/x.parquet",
    "a/notes.txt",
    "a/part-1.parquet",
    "a/part-10.parquet",
    "a/B.PARQUET",
    "top.parquet",
    "z/y/x/deep.parquet",
    "z/_SUCCESS",
]
LOCATIONS = [
    "",
    "a",
    "a/b",
    "top.parquet",
    "a/b/c.parquet",
    "missing",
    "missing/*.parquet",
    "*.parquet",
    "*",
    "**",
    "**/*.parquet",
    "a/*.parquet",
    "a/**/*.parquet",
    "a/part-?.parquet",
    "a/part-[0-9]*.parquet",
    "a/.*",
    "a/*/",
    "**/x.parquet",
    "z/**",
    "a/b*",
    "*/b/*.parquet",
    "a//*.parquet",
    "./a/*.parquet",
    "a/./b",
    "top.parquet/**",
    "*/b/c.parquet/**",
    "a/*/c.parquet/**",
    "top.parquet/*",
    "*/notes.txt",
]


@pytest.mark.parametrize("location", LOCATIONS)
def test_a_local_source_lists_the_files_it_listed_before(tmp_path, location) -> None:
    make_tree(tmp_path, TREE)
    path = f"{tmp_path}/{location}" if location else str(tmp_path)
    assert _listed(path) == [str(p) for p in old_expand_path(pathlib.Path(path))]


def test_links_are_followed_as_before(tmp_path) -> None:
    """A folder source took linked files but not linked folders (rglob); a glob both (glob)."""
    make_tree(tmp_path, ["real/sub/a.parquet", "src/b.parquet", "src/d/e.parquet"])
    (tmp_path / "src" / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "src" / "d" / "loop").symlink_to(tmp_path / "src")
    (tmp_path / "src" / "c.parquet").symlink_to(tmp_path / "real" / "sub" / "a.parquet")
    (tmp_path / "src" / "dangling.parquet").symlink_to(tmp_path / "nowhere")
    folder = str(tmp_path / "src")
    assert (
        _listed(folder)
        == [str(p) for p in old_expand_path(pathlib.Path(folder))]
        == [f"{folder}/{n}" for n in ("b.parquet", "c.parquet", "d/e.parquet")]
    )
    (tmp_path / "src" / "d" / "loop").unlink()  # glob (and pyarrow) would walk a loop until the OS stops it
    for pattern in ("**/*.parquet", "*/*/*.parquet", "*.parquet"):
        location = f"{folder}/{pattern}"
        assert _listed(location) == [str(p) for p in old_expand_path(pathlib.Path(location))]
    assert f"{folder}/linked/sub/a.parquet" in _listed(f"{folder}/**/*.parquet")


def test_a_relative_local_source_is_shown_as_written(tmp_path, monkeypatch) -> None:
    make_tree(tmp_path, TREE)
    monkeypatch.chdir(tmp_path)
    for location in ("a", "a/*.parquet", "*.parquet", "./a/**/*.parquet", "top.parquet"):
        expected = [str(p) for p in old_expand_path(pathlib.Path(location))]
        assert expected and _listed(location) == expected, location


def _listed(location: str) -> list[str]:
    try:
        return list(find_parquet_files("s", location).names)
    except SourceError as exc:
        assert "no Parquet file found at" in str(exc) and "source 's'" in str(exc)
        return []


tree_names = st.lists(
    st.lists(st.sampled_from(["a", "b", ".h", "x.parquet", "y.parquet", ".z.parquet", "n.txt", "b-c"]), min_size=1, max_size=4).map(
        "/".join
    ),
    min_size=1,
    max_size=10,
)
patterns = st.lists(
    st.sampled_from(["*", "**", "?", "a", "b", ".h", "x.parquet", "*.parquet", "[xy].parquet", "?.parquet", ".*", "b*", "*c", ""]),
    min_size=1,
    max_size=4,
).map("/".join)


@settings(max_examples=120, deadline=None)
@given(files=tree_names, pattern=patterns)
def test_local_globs_match_what_glob_matched(files, pattern) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        for name in files:  # a name may not be both a file and a folder: keep the first
            path = root / name
            if any(p.is_file() for p in [*path.parents][: len(pathlib.PurePosixPath(name).parts) - 1]) or path.is_dir():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
        location = f"{folder}/{pattern}"
        # glob yields a file once per way to match it ("**/**"); a source now takes it once
        assert _listed(location) == list(dict.fromkeys(str(p) for p in old_expand_path(pathlib.Path(location))))
        assert _listed(folder) == [str(p) for p in old_expand_path(root)]


def test_a_file_two_globstars_match_is_taken_once(tmp_path) -> None:
    make_tree(tmp_path, ["a/b.parquet"])
    location = f"{tmp_path}/**/**"
    assert [str(p) for p in old_expand_path(pathlib.Path(location))] == [f"{tmp_path}/a/b.parquet"] * 2  # its rows twice, before
    assert _listed(location) == [f"{tmp_path}/a/b.parquet"]


def test_a_file_url_lists_the_same_files_as_urls(tmp_path) -> None:
    make_tree(tmp_path, TREE)
    for location in ("a", "a/**/*.parquet"):
        local = [str(p) for p in old_expand_path(tmp_path / location)]
        found = find_parquet_files("s", f"file://{tmp_path}/{location}")
        assert list(found.names) == [f"file://{p}" for p in local]
        assert list(found.paths) == local


# ---- ParquetSource on local files, file:// and fsspec's memory:// -----------------------------------


def test_a_local_source_reads_every_row_in_file_order(tmp_path) -> None:
    write_parquet(tmp_path / "web" / "b" / "x.parquet", range(0, 10))
    write_parquet(tmp_path / "web" / "b-a.parquet", range(10, 15))
    write_parquet(tmp_path / "web" / "a.parquet", range(15, 22))
    source = ParquetSource("web", tmp_path / "web", required_columns=("row",), token_column="input_ids")
    assert source.files == [str(tmp_path / "web" / n) for n in ("a.parquet", "b/x.parquet", "b-a.parquet")]
    assert all(isinstance(f, str) for f in source.files)
    rows = np.concatenate([source.read(rg, ["row"]).column("row").to_numpy() for rg in source.row_groups])
    assert rows.tolist() == [*range(15, 22), *range(0, 10), *range(10, 15)]
    assert source.describe(source.row_groups[0]) == f"file {str(tmp_path / 'web' / 'a.parquet')!r} row group 0"
    reader = source.open_file(1)
    assert reader.metadata.num_rows == 10 and reader is not source._handles[1]


def test_a_file_url_source_reads_and_shows_urls(tmp_path) -> None:
    write_parquet(tmp_path / "web" / "a.parquet", range(0, 6))
    source = ParquetSource("web", f"file://{tmp_path}/web/*.parquet")
    assert source.files == [f"file://{tmp_path}/web/a.parquet"] and source.num_rows == 6
    assert f"'file://{tmp_path}/web/a.parquet'" in source.describe(source.row_groups[0])


@pytest.fixture
def memory_bucket():
    """A fresh folder in fsspec's (process-wide) memory file system; removed afterwards."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/t-{uuid.uuid4().hex[:8]}"
    yield fs, root
    fs.rm(root, recursive=True)


def test_an_fsspec_memory_source_is_read_through_pyfilesystem(memory_bucket) -> None:
    fs, root = memory_bucket
    arrow = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    write_parquet(f"{root}/corpus/p-1.parquet", range(0, 9), filesystem=arrow)
    write_parquet(f"{root}/corpus/deep/p-0.parquet", range(9, 13), filesystem=arrow)
    with fs.open(f"{root}/corpus/_SUCCESS", "wb") as f:
        f.write(b"")
    url = f"memory:/{root}/corpus"
    source = ParquetSource("mem", url, token_column="input_ids")
    assert source.files == [f"{url}/deep/p-0.parquet", f"{url}/p-1.parquet"]
    assert source.num_rows == 13
    assert isinstance(source._filesystem, pafs.PyFileSystem)
    rows = [r for rg in source.row_groups for r in source.read(rg, ["row"]).column("row").to_pylist()]
    assert rows == [*range(9, 13), *range(0, 9)]
    assert source.describe(source.row_groups[0]) == f"file '{url}/deep/p-0.parquet' row group 0"
    globbed = ParquetSource("mem", f"{url}/p-*.parquet")
    assert globbed.files == [f"{url}/p-1.parquet"] and globbed.num_rows == 9
    with pytest.raises(SourceError, match=r"source 'mem': no Parquet file found at 'memory://.*/nothing': no such file or folder"):
        ParquetSource("mem", f"{url}/nothing")


def test_an_fsspec_source_without_fsspec_says_to_install_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # "import fsspec" raises ImportError
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(SourceError) as info:
        ParquetSource("web", "memory://bucket/corpus")
    message = str(info.value)
    assert "source 'web'" in message and "'memory://bucket/corpus'" in message
    assert f"pip install '{FSSPEC_EXTRA}'" in message and "'memory'" in message


def test_an_unknown_scheme_is_named() -> None:
    with pytest.raises(SourceError, match=r"source 'web': cannot open 'nosuchscheme://b/x': unknown scheme 'nosuchscheme'"):
        ParquetSource("web", "nosuchscheme://b/x")


def test_an_fsspec_scheme_whose_package_is_missing_names_the_package(monkeypatch) -> None:
    import fsspec  # noqa: F401 - loads fsspec.registry, the module (the package's `registry` is a mapping)

    monkeypatch.setitem(
        sys.modules["fsspec.registry"].known_implementations,
        "needspkg",
        {"class": "batchplane_no_such_package.FileSystem", "err": "Install batchplane-no-such-package to access needspkg"},
    )
    with pytest.raises(SourceError, match=r"source 'web': cannot open 'needspkg://b/x': .*Install batchplane-no-such-package"):
        ParquetSource("web", "needspkg://b/x")


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("s3://", "the URL names no bucket"),
        ("gs:///", "the URL names no bucket"),
        ("gs:///x", "Missing bucket name"),
        ("s3://*/x.parquet", "a glob in the bucket"),
    ],
)
def test_a_url_without_a_bucket_is_refused(location, problem) -> None:
    with pytest.raises(SourceError, match=f"source 'web': cannot open '{glob.escape(location)}'.*{problem}".replace("[*]", r"\*")):
        ParquetSource("web", location)


def test_an_s3_endpoint_from_the_environment_is_used_as_is() -> None:
    place = open_location(
        "s3://bucket/corpus/", source="web", environ={"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_ENDPOINT_URL": "https://other"}
    )
    assert isinstance(place.filesystem, pafs.S3FileSystem) and place.path == "bucket/corpus"
    options = place.filesystem.__reduce__()[1][0]
    assert (options["endpoint_override"], options["scheme"]) == ("127.0.0.1:9", "http")
    assert place.show("bucket/corpus/a/b.parquet") == "s3://bucket/corpus/a/b.parquet"


def test_a_bad_endpoint_variable_fails_the_source() -> None:
    with pytest.raises(SourceError, match=r"source 'web': cannot open 's3://bucket/x': AWS_ENDPOINT_URL=.*not an http\(s\) URL"):
        open_location("s3://bucket/x", source="web", environ={"AWS_ENDPOINT_URL": "ftp://host"})


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            OSError(MEASURED[0][0]),
            "cannot list 's3://nobucket/x/': no such bucket (check its name, and AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL when it is not on AWS) (When listing",
        ),
        (OSError(MEASURED[2][0]), "cannot list 's3://nobucket/x/': access denied or no credentials: pyarrow's S3 client signs"),
        (OSError(MEASURED[6][0]), "cannot list 's3://nobucket/x/': cannot reach the endpoint (AWS_ENDPOINT_URL_S3"),
        (
            pa.ArrowInvalid("Parquet magic bytes not found in footer.\nsecond line"),
            "cannot list 's3://nobucket/x/': Parquet magic bytes not found in footer.",
        ),
    ],
)
def test_a_file_system_error_becomes_a_source_error(exc, expected) -> None:
    with pytest.raises(SourceError) as info, filesystems.translated_errors("web", "list", "s3://nobucket/x/", "s3"):
        raise exc
    assert str(info.value).startswith("source 'web': " + expected)
    assert "second line" not in str(info.value)
    assert info.value.__cause__ is exc


def test_a_file_that_is_not_parquet_is_named(tmp_path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match=rf"source 'web': cannot read Parquet file '{tmp_path}/x.parquet': .*Parquet magic bytes"):
        ParquetSource("web", tmp_path)


def test_a_folder_without_parquet_files_says_what_it_holds(tmp_path) -> None:
    make_tree(tmp_path, ["a/notes.txt", "a/_SUCCESS"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"no Parquet file found at '.*/a': 2 file\(s\) below it, none named \*\.parquet"):
        ParquetSource("web", tmp_path / "a")
    with pytest.raises(SourceError, match=r"no Parquet file found at '.*/empty': an empty folder"):
        ParquetSource("web", tmp_path / "empty")
    with pytest.raises(SourceError, match=r"no Parquet file found at '.*/a/\*\.parquet': nothing below '.*/a' matches '\*\.parquet'"):
        ParquetSource("web", f"{tmp_path}/a/*.parquet")


# ---- reading through store trouble ------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28, Timeout was reached",
        "AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.",
        "When reading information for key 'a.parquet' in bucket 'b': AWS Error UNKNOWN (HTTP status 503) during GetObject",
        "AWS Error UNKNOWN (HTTP status 500) during GetObject operation: InternalError",
        "AWS Error UNKNOWN (HTTP status 400) during GetObject operation: ExpiredToken",
        "curlCode: 56, Recv failure: Connection reset by peer",
    ],
)
def test_store_trouble_of_a_remote_read_is_tried_again(text: str) -> None:
    assert locations.is_store_trouble(text, remote=True)
    assert not locations.is_store_trouble(text, remote=False), "a local file's error is never the store's"


@pytest.mark.parametrize(
    "text",
    [
        "Couldn't deserialize thrift: TProtocolException: Invalid data",
        "Corrupt snappy compressed data.",
        "CRC checksum verification failed for page",
        "Path does not exist 'b/a.parquet'",
        "Unexpected end of stream",
    ],
)
def test_errors_of_the_data_are_not_tried_again(text: str) -> None:
    assert not locations.is_store_trouble(text, remote=True)


@given(st.integers(min_value=0, max_value=10_000))
def test_retry_delays_grow_to_their_cap_and_never_shrink(attempt: int) -> None:
    delay = locations.retry_delay(attempt)
    assert locations.RETRY_FIRST_S <= delay <= locations.RETRY_MAX_S
    assert locations.retry_delay(attempt + 1) >= delay
    assert locations.retry_delay(0) == locations.RETRY_FIRST_S
