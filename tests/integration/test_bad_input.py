"""Bad input gets a clear error and loses nothing: bad configuration and bad sources fail at
start-up naming the field or the file; a corrupt row group at run time is skipped, counted and
logged while every other row still arrives exactly once; bad requests get the right status."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import (
    assert_same_batches,
    collect,
    corrupt_row_group,
    peer_channel,
    scrape,
    skewed_lengths,
    start_cluster,
    to_numpy,
    write_job,
    write_source,
)

from batchplane.client import Client, InvalidRequestError, StepUnavailableError
from batchplane.core.errors import ConfigError
from batchplane.launcher.local import LaunchError, LocalCluster
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc, loader_pb2, loader_pb2_grpc
from batchplane.wire import encode_array

pytestmark = pytest.mark.integration


@pytest.fixture
def good(tmp_path: pathlib.Path):
    root = tmp_path / "data"
    return [
        write_source(root, "a", skewed_lengths(120, seed=4), seed=4),
        write_source(root, "b", skewed_lengths(80, seed=5), seed=5),
    ]


# ---- start-up: configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"mixture": {"weights": {"nope": 1.0}}}, "mixture.weights.nope"),
        ({"mixture": {"weights": {"a": -1.0}}}, "mixture.weights.a"),
        ({"mixture": {"weights": {"a": 0.0, "b": 0.0}}}, "mixture.weights"),
        ({"mesh": {"dp": 0}}, "mesh.dp"),
        ({"batch": {"global_batch_size": 3, "microbatches": 2}}, "batch.global_batch_size"),
        ({"balance": {"cost": {"kind": "cubic"}}}, "balance.cost.kind"),
        ({"strategy": "no/such/strategy.py"}, "strategy"),
        ({"mesh": {"dp": 2, "order": "tp-dp-pp"}}, "mesh.order"),
    ],
)
def test_bad_configuration_fails_before_anything_starts(tmp_path, good, settings, field) -> None:
    config = write_job(tmp_path / "job.yaml", good, **settings)
    with pytest.raises(ConfigError) as info:
        LocalCluster(config)
    assert info.value.field == field
    result = subprocess.run([sys.executable, "-m", "batchplane.cli", "up", "-c", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert field in result.stderr


# ---- start-up: sources -------------------------------------------------------------------


def _write_table(folder: pathlib.Path, table: pa.Table) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "x.parquet")
    return folder / "x.parquet"


def _write_bytes(folder: pathlib.Path, data: bytes) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "x.parquet").write_bytes(data)
    return folder / "x.parquet"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing", "no Parquet file found"),
        (lambda d: _write_bytes(d, b"not parquet at all"), "cannot read Parquet file"),
        (lambda d: _write_table(d, pa.table({"other": [[1, 2]]})), "has no column 'input_ids'"),
        (lambda d: _write_table(d, pa.table({"input_ids": ["a b c"]})), "must be a list of integers"),
        (lambda d: _write_table(d, pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))})), "no rows"),
    ],
    ids=["missing", "unreadable", "missing-column", "wrong-type", "empty"],
)
def test_a_bad_source_stops_the_start_naming_the_source_and_file(tmp_path, good, make, expected) -> None:
    path = make(tmp_path / "bad")
    config = write_job(tmp_path / "job.yaml", [*good, type(good[0])("bad", path, [])], loaders={"count": 3})
    with pytest.raises(LaunchError) as info:
        LocalCluster(config).start(timeout_s=30)
    message = str(info.value)
    assert "loader-2" in message and "source 'bad'" in message and expected in message
    assert str(path) in message


# ---- run time: a corrupt row group ---------------------------------------------------------


def test_a_corrupt_row_group_is_skipped_counted_and_logged_and_nothing_else_is_lost(tmp_path, good) -> None:
    victim = good[0].path / "part-00001.parquet"
    first_row = pq.ParquetFile(good[0].path / "part-00000.parquet").metadata.num_rows
    group_rows = corrupt_row_group(victim, 1)
    lost = set(range(first_row + 40, first_row + 40 + group_rows))  # row group 1 of file 1 (40 rows per group)
    cluster = start_cluster(write_job(tmp_path / "job.yaml", good, loaders={"count": 1}))
    try:
        batches, _ = collect(cluster.endpoints_path, range(2))
        metrics = scrape(json.loads(cluster.endpoints_path.read_text())["metrics"]["loader-0"])
        status = cluster.status()
        log = (cluster.run_dir / "logs" / "loader-0.log").read_text()
    finally:
        cluster.stop()
    ledger = subprocess.run(
        [sys.executable, "-m", "batchplane.cli", "ledger", "stats", "--ledger", str(cluster.run_dir / "ledger")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    seen = collections.Counter(
        (s, r)
        for rank in batches.values()
        for b in rank
        for mb in b["microbatches"]
        for s, r in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())
    )
    assert max(seen.values()) == 1
    expected = {(0, r) for r in range(len(good[0].rows)) if r not in lost} | {(1, r) for r in range(len(good[1].rows))}
    assert set(seen) == expected
    assert metrics['batchplane_loader_corrupt_row_groups_total{source="a"}'] == 1
    assert metrics['batchplane_loader_bad_samples_total{reason="unreadable",source="a"}'] == group_rows
    assert status.sources[0].bad_samples == group_rows
    assert f"file '{victim}' row group 1 is unreadable" in log
    # `batchplane ledger stats` tells the samples delivered from the bad rows consumed.
    assert ledger.returncode == 0, ledger.stderr
    assert f"{len(expected)} samples delivered, {group_rows} bad rows consumed" in ledger.stdout.splitlines()[0], ledger.stdout


# ---- run time: bad requests ----------------------------------------------------------------


def test_bad_requests_get_clear_errors_of_the_right_kind(tmp_path, good) -> None:
    cluster = start_cluster(write_job(tmp_path / "job.yaml", good, epochs="infinite"))
    try:
        endpoints = json.loads(cluster.endpoints_path.read_text())
        rank0 = endpoints["constructors"]["0"]
        with pytest.raises(InvalidRequestError, match="outside the job's mesh"):
            Client(rank0, rank=5)
        with pytest.raises(InvalidRequestError, match="serves ranks \\[0\\], not rank 1"):
            Client(rank0, rank=1)
        first = []
        with Client(rank0, rank=0) as client:
            for batch in client:
                first.append(to_numpy(batch))
                if batch["step"] == 3:
                    state = client.state_dict()
                    break
        # an earlier step than the rank's last call asked for, without `restart`: a stale request
        # (the call that asked for step 1 carried the steps after it: a retry may ask for those)
        with peer_channel(cluster, rank0, role="trainer") as channel:
            stub = constructor_pb2_grpc.ConstructorStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                next(stub.GetBatch(constructor_pb2.GetBatchRequest(rank=0, step=0, wait_ms=1000), timeout=10))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "already consumed" in info.value.details()
        with Client(rank0, rank=0) as late:
            late.load_state_dict({**state, "next_step": 1, "rank": 1})  # any rank's state; older than what ran: a rewind
            again = to_numpy(next(iter(late)))
            assert again["step"] == 1
            assert_same_batches({0: [again]}, {0: [first[1]]})
            with pytest.raises(InvalidRequestError, match="data settings .* differ"):
                late.load_state_dict({**state, "fingerprints": json.dumps({**json.loads(state["fingerprints"]), "data": "0" * 16})})
            with pytest.raises(InvalidRequestError, match="data settings .* differ"):  # a version 3 state: a mapping
                late.load_state_dict({**state, "version": 3, "fingerprints": {**json.loads(state["fingerprints"]), "data": "0" * 16}})
        with peer_channel(cluster, endpoints["loaders"]["0"], role="planner") as channel:
            with pytest.raises(grpc.RpcError) as info:
                loader_pb2_grpc.LoaderStub(channel).GetSummary(loader_pb2.GetSummaryRequest(source=9, from_seq=0), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not 9" in info.value.details()
        with peer_channel(cluster, endpoints["loaders"]["0"], role="constructor") as channel:
            loader = loader_pb2_grpc.LoaderStub(channel)
            negative = common_pb2.SampleSet(source=encode_array(np.zeros(1, np.int32)), seq=encode_array(np.array([-1], np.int64)))
            with pytest.raises(grpc.RpcError) as info:
                list(loader.FetchSamples(loader_pb2.FetchSamplesRequest(constructor_index=7, step=0, samples=negative), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "samples.seq must be >= 0" in info.value.details()
            huge = common_pb2.SampleSet(source=encode_array(np.zeros(700_000, np.int32)), seq=encode_array(np.zeros(700_000, np.int64)))
            with pytest.raises(grpc.RpcError) as info:
                list(loader.FetchSamples(loader_pb2.FetchSamplesRequest(samples=huge), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        cluster.stop()


def test_a_failing_cost_function_reaches_the_trainer_as_a_clear_error(tmp_path, good, monkeypatch) -> None:
    (tmp_path / "bad_cost.py").write_text("def cost(lengths):\n    return -1.0 * lengths\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the planner process imports it
    cluster = start_cluster(write_job(tmp_path / "job.yaml", good, balance={"cost": {"kind": "bad_cost:cost"}}))
    try:
        endpoints = json.loads(cluster.endpoints_path.read_text())
        with Client(endpoints["constructors"]["0"], rank=0, timeout_s=30) as client:
            with pytest.raises(StepUnavailableError, match="planning failed.*negative cost"):
                next(iter(client))
    finally:
        cluster.stop()
