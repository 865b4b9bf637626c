"""Per-sample features travel from a loader's transform to the planner's cost function and steer
the balancing; one constructor can serve several ranks; the client takes its rank from the
torchrun environment."""

from __future__ import annotations

import collections
import json
import pathlib
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import SourceData, collect, skewed_lengths, start_cluster, write_job, write_source

from batchplane.client import Client, InvalidRequestError

pytestmark = pytest.mark.integration

USER_CODE = """
import pyarrow as pa

def with_heavy(batch):
    return pa.table({"input_ids": batch.column("input_ids"), "heavy": batch.column("heavy")})

def heavy_cost(lengths, features):
    return 1.0 + 1e6 * features["heavy"]
"""


def _heavy_source(root: pathlib.Path) -> SourceData:
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 1000, 8).astype(np.int32) for _ in range(256)]
    heavy = (rng.random(256) < 0.5).astype(np.int8)
    folder = root / "imgs"
    folder.mkdir(parents=True)
    table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32())), "heavy": heavy})
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=64)
    return SourceData("imgs", folder, rows), heavy


def _heavy_spread(batches, heavy) -> list[int]:
    """Per step: |heavy samples on rank 0 - heavy samples on rank 1|."""
    spread = []
    for b0, b1 in zip(batches[0], batches[1]):
        counts = [sum(int(heavy[r]) for mb in b["microbatches"] for r in mb["sample_row"]) for b in (b0, b1)]
        spread.append(abs(counts[0] - counts[1]))
    return spread


def test_features_reach_the_cost_function_and_steer_balancing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_code.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the loader and planner processes import it
    source, heavy = _heavy_source(tmp_path / "data")
    spreads = {}
    for name, cost in (("feature", {"kind": "user_code:heavy_cost"}), ("length", {"kind": "linear"})):
        folder = tmp_path / name
        folder.mkdir()
        job = {"name": "imgs", "path": str(source.path), "transform": "user_code:with_heavy", "columns": ["input_ids", "heavy"]}
        config = write_job(
            folder / "job.yaml",
            [source],
            sources=[job],
            batch={"global_batch_size": 16, "microbatches": 1, "token_dtype": "int32"},
            balance={"method": "karmarkar_karp", "cost": cost},
        )
        cluster = start_cluster(config)
        try:
            batches, _ = collect(cluster.endpoints_path, range(2))
        finally:
            cluster.stop()
        rows = [r for rank in batches.values() for b in rank for mb in b["microbatches"] for r in mb["sample_row"].tolist()]
        assert sorted(rows) == list(range(256))
        spreads[name] = _heavy_spread(batches, heavy)
    assert max(spreads["feature"]) <= 1  # heavy samples split evenly: the cost saw the feature
    assert max(spreads["length"]) >= 2  # the control: lengths alone cannot see it


def test_one_constructor_serves_several_ranks(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(150, seed=8), seed=8)]
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        mesh={"dp": 4},
        batch={"global_batch_size": 16, "microbatches": 2, "token_dtype": "int32"},
        constructors={"ranks_per_constructor": 2},
    )
    cluster = start_cluster(config)
    try:
        endpoints = json.loads(cluster.endpoints_path.read_text())
        assert len(cluster.constructors) == 2
        assert endpoints["constructors"]["0"] == endpoints["constructors"]["1"] != endpoints["constructors"]["2"]
        batches, _ = collect(cluster.endpoints_path, range(4))
    finally:
        cluster.stop()
    seen = collections.Counter(r for rank in batches.values() for b in rank for mb in b["microbatches"] for r in mb["sample_row"].tolist())
    assert set(seen) == set(range(150)) and max(seen.values()) == 1
    assert len({len(rank) for rank in batches.values()}) == 1


def test_the_client_takes_its_rank_from_the_torchrun_environment(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(40, seed=9), seed=9)]
    cluster = start_cluster(write_job(tmp_path / "job.yaml", sources, epochs="infinite"))
    try:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with Client() as client:
            assert client.rank == 1
            assert client.address == json.loads(cluster.endpoints_path.read_text())["constructors"]["1"]
        monkeypatch.setenv("WORLD_SIZE", "8")
        with pytest.raises(InvalidRequestError, match=r"WORLD_SIZE=8 but the job's mesh has 2 ranks \(pp=1 dp=2 cp=1 tp=1\)"):
            Client()
    finally:
        cluster.stop()
