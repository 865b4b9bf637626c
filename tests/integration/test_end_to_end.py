"""The whole data plane as real processes on 127.0.0.1: three sources, two data-parallel ranks,
a finite epoch. Every row arrives exactly once and byte-identical to its file (I1), both ranks
take the same steps (I2), a second run with the same seed plans the same sequence and a client
restored from a checkpoint continues with exactly the batches of the uninterrupted run (I4)."""

from __future__ import annotations

import collections
import pathlib

import numpy as np
import pytest
from harness import collect, ledger_records, sample_ids, skewed_lengths, start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration

DP = 2
MICROBATCHES = 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("data")
    return [
        write_source(root, "captions", skewed_lengths(300, seed=1), files=3, row_group_size=40, seed=1),
        write_source(root, "docs", skewed_lengths(160, seed=2, long_share=0.6), files=2, row_group_size=32, seed=2),
        write_source(root, "code", skewed_lengths(200, seed=3, long_share=0.3), files=2, row_group_size=50, seed=3),
    ]


def job_file(folder: pathlib.Path, dataset) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_job(
        folder / "job.yaml",
        dataset,
        mixture={"weights": {"captions": 3, "docs": 1, "code": 2}},
        batch={"global_batch_size": 24, "microbatches": MICROBATCHES, "token_dtype": "int32"},
        loaders={"count": 2, "read_ahead_samples": 64},
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, dataset):
    """One uninterrupted run: every rank's batches, and the planner's ledger."""
    folder = tmp_path_factory.mktemp("reference")
    cluster = start_cluster(job_file(folder, dataset))
    try:
        batches, _ = collect(cluster.endpoints_path, range(DP))
        # Constructors tell the planner what their ranks were handed with their heartbeats.
        wait_until(lambda: cluster.status().finished, timeout_s=10, what="the planner to see every rank finished")
        status = cluster.status()
    finally:
        cluster.stop()
    return batches, ledger_records(cluster.run_dir), status


def test_every_row_arrives_exactly_once_and_byte_identical(reference, dataset) -> None:
    batches, _, status = reference
    seen = collections.Counter()
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                for i, (source, row) in enumerate(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())):
                    seen[(source, row)] += 1
                    expected = dataset[source].rows[row]
                    length = int(mb["sample_length"][i])
                    assert mb["input_ids"][i, :length].tobytes() == expected.tobytes()
                    assert mb["attention_mask"][i].sum() == length
                    assert (mb["labels"][i, : length - 1] == expected[1:]).all()
                    assert (mb["labels"][i, length - 1 :] == -100).all()
                    assert (mb["position_ids"][i, :length] == np.arange(length)).all()
    assert max(seen.values()) == 1, "a sample arrived twice"
    assert set(seen) == {(k, r) for k, s in enumerate(dataset) for r in range(len(s.rows))}
    assert status.finished
    assert [s.samples for s in status.sources] == [len(s.rows) for s in dataset]


def test_ranks_take_the_same_steps_and_microbatches(reference) -> None:
    batches, _, status = reference
    steps = {rank: [b["step"] for b in rank_batches] for rank, rank_batches in batches.items()}
    assert steps[0] == steps[1] == list(range(status.end_step))
    for rank_batches in batches.values():
        assert all(len(b["microbatches"]) == MICROBATCHES for b in rank_batches)
    # The loss normalizer is the step's loss tokens over all ranks, identical on every rank.
    for b0, b1 in zip(batches[0], batches[1]):
        loss_tokens = sum(mb["loss_tokens"] for mb in b0["microbatches"] + b1["microbatches"])
        assert b0["global_loss_tokens"] == b1["global_loss_tokens"] == loss_tokens


def test_a_second_run_with_the_same_seed_plans_the_same_sequence(reference, dataset, tmp_path: pathlib.Path) -> None:
    batches, ledger, _ = reference
    cluster = start_cluster(job_file(tmp_path, dataset))
    try:
        again, _ = collect(cluster.endpoints_path, range(DP))
    finally:
        cluster.stop()
    for rank in range(DP):
        assert sample_ids(again[rank]) == sample_ids(batches[rank])
    assert ledger_records(cluster.run_dir) == ledger


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert [b["step"] for b in got] == [b["step"] for b in want]
    for g, w in zip(got, want):
        for gm, wm in zip(g["microbatches"], w["microbatches"]):
            assert gm.keys() == wm.keys()
            for key, value in gm.items():
                if isinstance(value, np.ndarray):
                    assert value.dtype == wm[key].dtype and value.tobytes() == wm[key].tobytes(), key
                else:
                    assert value == wm[key], key


def test_a_restored_client_continues_exactly_where_the_uninterrupted_run_went(reference, dataset, tmp_path: pathlib.Path) -> None:
    batches, _, _ = reference
    k = 4
    config = job_file(tmp_path, dataset)
    cluster = start_cluster(config)
    try:
        first, states = collect(cluster.endpoints_path, range(DP), stop_after=k + 1)
        # A trainer restarted next to the same running data plane resumes after step k.
        live, _ = collect(cluster.endpoints_path, range(DP), states=states, stop_after=3)
    finally:
        cluster.stop()
    assert all(s["next_step"] == k + 1 for s in states.values())
    for rank in range(DP):
        assert_same_batches(first[rank], batches[rank][: k + 1])
        assert_same_batches(live[rank], batches[rank][k + 1 : k + 4])
    # The whole data plane restarted from nothing: the checkpoint alone says where to resume.
    cluster = start_cluster(config)
    try:
        resumed, _ = collect(cluster.endpoints_path, range(DP), states=states)
    finally:
        cluster.stop()
    for rank in range(DP):
        assert_same_batches(resumed[rank], batches[rank][k + 1 :])
