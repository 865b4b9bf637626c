"""Sources in a bucket: a real S3 endpoint (moto's server on 127.0.0.1) holds the Parquet files,
the loaders (real processes) reach it through the standard AWS environment they inherit. A job
whose sources are an S3 folder, an S3 glob and a single S3 file delivers every row of those
files exactly once and byte-identical to them; a missing bucket, a prefix without Parquet files,
refused credentials and an unreachable endpoint fail naming the source, the URL and the
problem; a store that fails reads for a while (503 SlowDown) delays the job and loses nothing; `batchplane profile` and `batchplane partition` work on S3 sources."""

from __future__ import annotations

import collections
import json
import pathlib
import socket
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml
from harness import collect, scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source
from s3_proxy import S3Proxy
from s3_server import S3Server

from batchplane.core.errors import SourceError
from batchplane.launcher.local import LaunchError, LocalCluster
from batchplane.loader.source import ParquetSource

pytestmark = pytest.mark.integration

BUCKET = "datasets"
DP = 2


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The endpoint, with s3://datasets/corpus/ holding three sources' files, and, per source,
    its URL and its files' local copies in the order their rows are numbered in."""
    root = tmp_path_factory.mktemp("s3-sources")
    local = root / "local"
    write_source(local / "web", "2024", skewed_lengths(70, seed=1), files=2, row_group_size=16, seed=1)
    write_source(local / "web", "2025", skewed_lengths(50, seed=2), files=2, row_group_size=16, seed=2)
    (local / "web" / "_SUCCESS").write_bytes(b"")  # not Parquet: a folder source skips it
    write_source(local / "code", "x", skewed_lengths(60, seed=3), files=3, row_group_size=10, seed=3)
    write_source(local / "code", "y", skewed_lengths(45, seed=4), files=3, row_group_size=10, seed=4)
    write_source(local, "books", skewed_lengths(80, seed=5, long_share=0.4), files=2, row_group_size=20, seed=5)
    with S3Server(root / "moto") as server:
        server.create_bucket(BUCKET)
        keys = server.upload_folder(local, BUCKET, "corpus")
        assert "corpus/web/_SUCCESS" in keys and "corpus/code/y/part-00002.parquet" in keys
        sources = {
            "web": (f"s3://{BUCKET}/corpus/web/", [local / "web" / d / f"part-0000{i}.parquet" for d in ("2024", "2025") for i in (0, 1)]),
            "code": (
                f"s3://{BUCKET}/corpus/code/**/part-0000[02].parquet",
                [local / "code" / d / f"part-0000{i}.parquet" for d in ("x", "y") for i in (0, 2)],
            ),
            "books": (f"s3://{BUCKET}/corpus/books/part-00001.parquet", [local / "books" / "part-00001.parquet"]),
        }
        yield server, sources


def aws_env(monkeypatch, server: S3Server) -> None:
    """The standard AWS environment of `server`, for this process and the processes it starts."""
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)


def rows_of(files: list[pathlib.Path]) -> list[list[int]]:
    """Ground truth: the token lists of `files`, read from the local copies, in order."""
    return [row for f in files for row in pq.read_table(f, columns=["input_ids"]).column("input_ids").to_pylist()]


def test_a_job_of_s3_folder_glob_and_file_delivers_every_row_once(s3, tmp_path, monkeypatch) -> None:
    server, sources = s3
    aws_env(monkeypatch, server)
    names = list(sources)
    config = write_job(
        tmp_path / "job.yaml",
        [],
        sources=[{"name": name, "path": sources[name][0]} for name in names],
        mixture={"weights": {"web": 2, "code": 2, "books": 1}},
        loaders={"count": 2, "read_ahead_samples": 32},
    )
    cluster = start_cluster(config)
    try:
        batches, _ = collect(cluster.endpoints_path, range(DP))
        wait_until(lambda: cluster.status().finished, timeout_s=20, what="the planner to see every rank finished")
        status = cluster.status()
        logs = "".join((cluster.run_dir / "logs" / f"loader-{i}.log").read_text() for i in range(2))
    finally:
        cluster.stop()
    expected = {k: rows_of(sources[name][1]) for k, name in enumerate(names)}
    seen = collections.Counter()
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                for i, (source, row) in enumerate(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())):
                    seen[(source, row)] += 1
                    length = int(mb["sample_length"][i])
                    assert mb["input_ids"][i, :length].tolist() == expected[source][row], (names[source], row)
    assert max(seen.values()) == 1, "a sample arrived twice"
    assert set(seen) == {(k, r) for k, rows in expected.items() for r in range(len(rows))}
    assert [s.samples for s in status.sources] == [len(expected[k]) for k in range(len(names))]
    # The loaders opened exactly the files each URL names, in that order.
    for name in names:
        count = len(sources[name][1])
        assert f"source {name!r}: {len(expected[names.index(name)])} rows in {count} file(s)" in logs


def test_reads_the_store_fails_are_tried_again_and_lose_nothing(s3, tmp_path, monkeypatch) -> None:
    """The store answers a run of reads with 503 SlowDown, more than pyarrow's own retries
    absorb: the loader waits and reads again instead of skipping the row groups."""
    server, sources = s3
    aws_env(monkeypatch, server)
    with S3Proxy(server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        config = write_job(
            tmp_path / "job.yaml",
            [],
            sources=[{"name": "code", "path": sources["code"][0]}],
            loaders={"count": 1, "read_ahead_samples": 8},
        )
        cluster = start_cluster(config)
        try:
            proxy.refuse_reads(12)  # the files are open: these are reads of row groups
            batches, _ = collect(cluster.endpoints_path, range(DP))
            metrics = scrape(json.loads(cluster.endpoints_path.read_text())["metrics"]["loader-0"])
            log = (cluster.run_dir / "logs" / "loader-0.log").read_text()
        finally:
            cluster.stop()
    assert proxy.refused == 12
    expected = rows_of(sources["code"][1])
    seen = collections.Counter(
        row
        for rank_batches in batches.values()
        for batch in rank_batches
        for mb in batch["microbatches"]
        for row in mb["sample_row"].tolist()
    )
    assert seen == collections.Counter(range(len(expected))), "a row was lost or repeated"
    assert metrics['batchplane_loader_read_retries_total{source="code"}'] >= 1
    assert metrics.get('batchplane_loader_corrupt_row_groups_total{source="code"}', 0) == 0
    assert "(throttled), try 2 again" in log


def test_a_source_opened_in_process_shows_its_files_as_urls(s3, monkeypatch) -> None:
    server, sources = s3
    aws_env(monkeypatch, server)
    url, files = sources["code"]
    source = ParquetSource("code", url, token_column="input_ids")
    shown = [f"s3://{BUCKET}/corpus/code/{f.parent.name}/{f.name}" for f in files]
    assert source.files == shown
    assert source.describe(source.row_groups[-1]).startswith(f"file {shown[-1]!r} row group ")
    read = [r for rg in source.row_groups for r in source.read(rg, ["input_ids"]).column("input_ids").to_pylist()]
    assert read == rows_of(files)


def test_the_s3_specific_endpoint_variable_wins(s3, monkeypatch) -> None:
    server, sources = s3
    aws_env(monkeypatch, server)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    url, files = sources["books"]
    assert ParquetSource("books", url).num_rows == len(rows_of(files))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://no-such-bucket/corpus/web/", "no Parquet file found at 's3://no-such-bucket/corpus/web/': no such bucket 'no-such-bucket'"),
        (
            f"s3://{BUCKET}/corpus/nothing-here/",
            f"no Parquet file found at 's3://{BUCKET}/corpus/nothing-here/': no object under that prefix",
        ),
        (
            f"s3://{BUCKET}/corpus/web/2024/*.json",
            f"no Parquet file found at 's3://{BUCKET}/corpus/web/2024/*.json': nothing below 's3://{BUCKET}/corpus/web/2024' matches '*.json'",
        ),
    ],
    ids=["no-bucket", "empty-prefix", "no-match"],
)
def test_a_missing_s3_source_stops_the_start_naming_source_and_url(s3, tmp_path, monkeypatch, url, problem) -> None:
    server, sources = s3
    aws_env(monkeypatch, server)
    config = write_job(
        tmp_path / "job.yaml", [], sources=[{"name": "web", "path": sources["web"][0]}, {"name": "bad", "path": url}], loaders={"count": 2}
    )
    with pytest.raises(LaunchError) as info:
        LocalCluster(config).start(timeout_s=30)
    message = str(info.value)
    assert "loader-1" in message and f"source 'bad': {problem}" in message


def test_a_prefix_with_only_other_files_says_so(s3, monkeypatch) -> None:
    server, _ = s3
    aws_env(monkeypatch, server)
    server.client().put_object(Bucket=BUCKET, Key="notes/readme.txt", Body=b"not data")
    with pytest.raises(
        SourceError, match=rf"source 'notes': no Parquet file found at 's3://{BUCKET}/notes': 1 file\(s\) below it, none named \*\.parquet"
    ):
        ParquetSource("notes", f"s3://{BUCKET}/notes")


def test_refused_credentials_are_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # this moto checks every request's key
    with S3Server(tmp_path / "moto") as server:
        aws_env(monkeypatch, server)
        for url in (f"s3://{BUCKET}/corpus/", f"s3://{BUCKET}/corpus/*.parquet"):
            with pytest.raises(SourceError) as info:
                ParquetSource("web", url)
            message = str(info.value)
            assert message.startswith(f"source 'web': cannot list {url!r}: access denied or no credentials: ")
            assert "AWS_ACCESS_KEY_ID" in message and "AWS_WEB_IDENTITY_TOKEN_FILE" in message


def test_an_unreachable_endpoint_is_named(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(SourceError) as info:
        ParquetSource("web", f"s3://{BUCKET}/corpus/")
    message = str(info.value)
    assert message.startswith(
        f"source 'web': cannot list 's3://{BUCKET}/corpus/': cannot reach the endpoint (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL"
    )
    assert "NETWORK_CONNECTION" in message


def cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchplane.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_profile_and_partition_work_on_s3_sources(s3, tmp_path, monkeypatch) -> None:
    server, sources = s3
    aws_env(monkeypatch, server)
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the S3-specific variable alone, this time
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    names = ["web", "books"]
    job = {
        "job": "bucketed",
        "sources": [{"name": n, "path": sources[n][0]} for n in names],
        "mixture": {"weights": {"web": 0.7, "books": 0.3}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = cli("profile", "-c", "job.yaml", "--samples", "32", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    profile = json.loads(run.stdout)
    for name, s in zip(names, profile["sources"]):
        url, files = sources[name]
        assert s["name"] == name and s["path"] == url
        prefix = url if url.endswith(".parquet") else None
        shown = [prefix] if prefix else [f"{url}{f.parent.name}/{f.name}" for f in files]
        assert [f["path"] for f in s["files"]] == shown
        assert [f["rows"] for f in s["files"]] == [pq.ParquetFile(f).metadata.num_rows for f in files]
        assert s["rows"] == len(rows_of(files)) and s["samples"] == 32
        assert s["transform_s_per_sample"] > 0 and s["read_s_per_sample"] > 0 and s["state_bytes"] > 0
    part = cli(
        "partition", "--profiles", "profiles.json", "--pod-memory", "4Gi", "--pod-cpus", "4", "--out", "dataplane.yaml", cwd=tmp_path
    )
    assert part.returncode == 0, part.stderr
    placed = {
        x["name"]: x["path"]
        for g in yaml.safe_load((tmp_path / "dataplane.yaml").read_text())["spec"]["sourceGroups"]
        for x in g["sources"]
    }
    assert placed == {n: sources[n][0] for n in names}


def test_profile_of_a_missing_bucket_exits_2_naming_source_and_url(s3, tmp_path, monkeypatch) -> None:
    server, _ = s3
    aws_env(monkeypatch, server)
    job = {"job": "bucketed", "sources": [{"name": "ghost", "path": "s3://no-such-bucket/x/"}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = cli("profile", "-c", "job.yaml", cwd=tmp_path)
    assert run.returncode == 2
    assert "source 'ghost': no Parquet file found at 's3://no-such-bucket/x/': no such bucket 'no-such-bucket'" in run.stderr
