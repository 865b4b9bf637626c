"""`batchplane profile` and `batchplane partition` as a user runs them: profile a small demo
dataset (two text sources and an image-text one with its decoding transform) in a subprocess,
check the profile is sane, partition it into a DataPlane and chart values, and check that bad
sources and impossible limits exit with 2 and a message naming the source."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from batchplane.demo.dataset import DemoSource, ImageTextSource, LogNormal, write_demo_dataset
from batchplane.demo.images import PAYLOAD
from batchplane.demo.run import TRANSFORMS

pytestmark = pytest.mark.integration

SOURCES = (
    DemoSource(name="short", description="", num_rows=300, files=2, rows_per_row_group=50, lengths=(LogNormal(median=24, sigma=0.4),)),
    DemoSource(
        name="long",
        description="",
        num_rows=120,
        files=3,
        rows_per_row_group=40,
        lengths=(LogNormal(median=400, sigma=0.3),),
        min_length=64,
    ),
    ImageTextSource(name="images", description="", num_rows=40, files=2, rows_per_row_group=10),
)
WEIGHTS = {"short": 0.5, "long": 0.3, "images": 0.2}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("profile")
    write_demo_dataset(root / "data", sources=SOURCES, vocab_size=1024)
    write_job(root / "job.yaml", {s.name: f"data/{s.name}" for s in SOURCES})
    return root


#: A source read twice per epoch: its `repeat` travels through the profile into the partition.
REPEAT = {SOURCES[-1].name: 2}


def write_job(path: pathlib.Path, paths: dict[str, str]) -> pathlib.Path:
    job = {
        "job": "profiled",
        "sources": [
            {"name": name, "path": p, **TRANSFORMS.get(name, {}), **({"repeat": REPEAT[name]} if name in REPEAT else {})}
            for name, p in paths.items()
        ],
        "mixture": {"weights": {k: v for k, v in WEIGHTS.items() if k in paths}},
        "batch": {"payload": [dict(c) for c in PAYLOAD]},  # the demo transform ships pixels
    }
    path.write_text(yaml.safe_dump(job))
    return path


def cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchplane.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def profiled(dataset: pathlib.Path) -> tuple[dict, subprocess.CompletedProcess]:
    result = cli("profile", "-c", "job.yaml", "--json", cwd=dataset)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result


def test_profile_measures_every_source(dataset, profiled) -> None:
    profile, run = profiled
    assert json.loads((dataset / "profiles.json").read_text()) == profile  # --out defaults to ./profiles.json
    assert profile["job"] == "profiled" and profile["samples"] == 256
    assert profile["mixture"] == {"weights": WEIGHTS} and profile["mesh"] == {"dp": 1, "cp": 1, "tp": 1, "pp": 1}
    assert profile["state_method"] in ("mallinfo2", "rss")
    assert [s["name"] for s in profile["sources"]] == [s.name for s in SOURCES]
    for spec, s in zip(SOURCES, profile["sources"]):
        files = sorted((dataset / "data" / spec.name).glob("*.parquet"))
        assert [f["path"] for f in s["files"]] == [str(f) for f in files]
        assert [f["rows"] for f in s["files"]] == [pq.ParquetFile(f).metadata.num_rows for f in files]
        assert s["rows"] == spec.num_rows == sum(f["rows"] for f in s["files"])
        assert s["row_groups"] == sum(f["row_groups"] for f in s["files"]) == sum(pq.ParquetFile(f).metadata.num_row_groups for f in files)
        assert s["path"] == f"data/{spec.name}" and s["weight"] == WEIGHTS[spec.name]
        configured = TRANSFORMS.get(spec.name, {})
        assert (s["transform"], s["transform_args"], s["columns"]) == (
            configured.get("transform"),
            configured.get("transform_args", {}),
            configured.get("columns"),
        )
        assert s["repeat"] == REPEAT.get(spec.name, 1)
        assert s["samples"] == min(256, spec.num_rows)
        if profile["state_method"] == "mallinfo2":
            assert all(f["state_bytes"] > 0 for f in s["files"])
        assert s["state_bytes"] >= sum(f["state_bytes"] for f in s["files"]) and s["state_bytes"] > 0
        assert s["transform_s_per_sample"] > 0 and s["transform_p95_s"] > 0 and s["read_s_per_sample"] > 0
        assert s["bytes_per_sample"] > 0 and s["buffer_bytes_per_sample"] > 0
        assert s["rejected_samples"] == 0
        assert f"profile {spec.name}" in run.stderr  # the progress line of each source
    short, long_, images = profile["sources"]
    assert 2 <= short["tokens_per_sample"] < long_["tokens_per_sample"] <= 2048
    # An image-text sample is its caption plus a token per 14x14 patch of its images.
    assert images["tokens_per_sample"] > 8


def test_profile_takes_fewer_samples_when_asked(dataset) -> None:
    run = cli("profile", "-c", "job.yaml", "--samples", "32", "--out", "few.json", cwd=dataset)
    assert run.returncode == 0, run.stderr
    profile = json.loads((dataset / "few.json").read_text())
    assert [s["samples"] for s in profile["sources"]] == [32, 32, 32]
    assert "short" in run.stdout and "images" in run.stdout  # the table


def test_partition_writes_a_dataplane_and_chart_values(dataset, profiled) -> None:
    run = cli(
        "partition",
        "--profiles",
        "profiles.json",
        "--pod-memory",
        "4Gi",
        "--pod-cpus",
        "4",
        "--samples-per-s",
        "2000",
        "--out",
        "dataplane.yaml",
        cwd=dataset,
    )
    assert run.returncode == 0, run.stderr
    assert "loader groups" in run.stderr  # the summary
    document = yaml.safe_load((dataset / "dataplane.yaml").read_text())
    assert document["kind"] == "DataPlane" and document["metadata"]["name"] == "profiled"
    spec = document["spec"]
    assert spec["mixture"] == {"weights": WEIGHTS} and spec["mesh"] == {"dp": 1, "cp": 1, "tp": 1, "pp": 1}
    assert spec["batch"] == {"globalBatchSize": 32, "microbatches": 1}
    groups = spec["sourceGroups"]
    placed = [source["name"] for g in groups for source in g["sources"]]
    assert sorted(placed) == sorted(s.name for s in SOURCES)
    for g in groups:
        assert set(g) == {"name", "sources", "minReplicas", "maxReplicas", "workersPerActor", "resources"}
        assert all(source["path"] == f"data/{source['name']}" for source in g["sources"])
        assert all(source["costSecondsPerSample"] > 0 for source in g["sources"])
        assert all(source.get("transform") == TRANSFORMS.get(source["name"], {}).get("transform") for source in g["sources"])
        assert 1 <= g["minReplicas"] <= g["maxReplicas"] == 8
        assert 1 <= g["workersPerActor"] <= 4
        assert g["resources"]["limits"] == {"cpu": str(g["workersPerActor"]), "memory": "4Gi"}
        assert g["resources"]["requests"]["cpu"] == str(g["workersPerActor"])

    values = cli(
        "partition",
        "--profiles",
        "profiles.json",
        "--pod-memory",
        "4Gi",
        "--pod-cpus",
        "4",
        "--samples-per-s",
        "2000",
        "--format",
        "values",
        "--weights",
        "job.yaml",
        cwd=dataset,
    )
    assert values.returncode == 0, values.stderr
    text = values.stdout
    assert text.startswith("# Written by `batchplane partition`")
    # The chart's values: the same groups (the job's weights are the profile's), and the sources
    # as job.yaml needs them.
    ((key, values_groups),) = yaml.safe_load(text).items()
    assert key == "sourceGroups" and [v["name"] for v in values_groups] == [g["name"] for g in groups]
    for g, v in zip(groups, values_groups):
        assert [x["name"] for x in v["sources"]] == [x["name"] for x in g["sources"]]
        assert {k: x for k, x in v.items() if k != "sources"} == {k: x for k, x in g.items() if k != "sources"}
        for source, in_values in zip(g["sources"], v["sources"]):
            assert source.get("repeat", 1) == REPEAT.get(source["name"], 1)
            configured = TRANSFORMS.get(source["name"], {})
            expected = dict(source)
            if configured:
                expected.update(transformArgs=configured["transform_args"], columns=configured["columns"])
            assert in_values == expected


def test_a_bad_source_path_exits_2_naming_the_source(dataset) -> None:
    job = write_job(dataset / "bad.yaml", {"short": "data/short", "ghost": "data/no-such-dir"})
    run = cli("profile", "-c", str(job), "--out", "bad.json", cwd=dataset)
    assert run.returncode == 2
    assert "source 'ghost'" in run.stderr and "data/no-such-dir" in run.stderr
    assert not (dataset / "bad.json").exists()


def test_a_file_that_is_not_parquet_exits_2_naming_the_file(dataset) -> None:
    folder = dataset / "broken"
    folder.mkdir()
    (folder / "part-00000.parquet").write_bytes(b"not parquet at all")
    job = write_job(dataset / "broken.yaml", {"broken": "broken"})
    run = cli("profile", "-c", str(job), "--out", "broken.json", cwd=dataset)
    assert run.returncode == 2
    assert "source 'broken'" in run.stderr and "part-00000.parquet" in run.stderr


def test_partition_exits_2_when_a_source_cannot_fit_a_pod(dataset, profiled) -> None:
    run = cli(
        "partition",
        "--profiles",
        "profiles.json",
        "--pod-memory",
        "1Ki",
        "--pod-cpus",
        "1",
        "--actor-memory",
        "0",
        "--buffer-memory",
        "0",
        "--worker-memory",
        "0",
        cwd=dataset,
    )
    assert run.returncode == 2
    assert "source 'images'" in run.stderr and "1024 bytes" in run.stderr  # the first by name
    bad = cli("partition", "--profiles", "profiles.json", "--pod-memory", "lots", "--pod-cpus", "1", cwd=dataset)
    assert bad.returncode == 2 and "--pod-memory" in bad.stderr
