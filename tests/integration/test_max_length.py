"""`batch.max_length` end to end, as real processes on 127.0.0.1: a source with a few samples far
longer than the limit, run once per `batch.length_policy`, checked against the Parquet rows
themselves. Split delivers every token of a long sample, in order, across chunks of at most
max_length tokens with no label across a chunk; truncate delivers its first max_length tokens;
reject never delivers it and the loader counts it. Every other sample arrives exactly once, the
loss weights of each step sum to 1 over the DP ranks and the ledger's token counts are the
delivered (truncate) or full (split) lengths."""

from __future__ import annotations

import collections
import json
import math
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
from harness import collect, ledger_records, scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration

DP = 2
MAX_LENGTH = 64
IGNORE = -100
# Rows of "docs" far longer than MAX_LENGTH (one exactly a multiple of it).
LONG = {3: 300, 41: 128, 77: 517, 120: 1000, 150: 65}

RUNS = {
    # name: (length_policy, batch settings besides the harness's)
    "split-padded": ("split", {"max_length": MAX_LENGTH}),
    "split-packed": ("split", {"packing": True, "pack_length": MAX_LENGTH}),  # max_length defaults to pack_length
    "truncate": ("truncate", {"max_length": MAX_LENGTH}),
    "reject": ("reject", {"packing": True, "pack_length": MAX_LENGTH}),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("data")
    lengths = skewed_lengths(160, seed=7, long_share=0.2, short=8, long=MAX_LENGTH)
    for row, n in LONG.items():
        lengths[row] = n
    return [
        write_source(root, "docs", lengths, files=2, row_group_size=40, seed=7),
        write_source(root, "chat", skewed_lengths(100, seed=8, short=16, long=MAX_LENGTH), files=1, row_group_size=25, seed=8),
    ]


def parquet_rows(folder: pathlib.Path) -> list[list[int]]:
    """The token lists of a source as its files hold them: the ground truth."""
    return [row for f in sorted(folder.glob("*.parquet")) for row in pq.read_table(f).column("input_ids").to_pylist()]


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory: pytest.TempPathFactory, dataset):
    policy, batch = RUNS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    config = write_job(
        folder / "job.yaml",
        dataset,
        batch={"global_batch_size": 12, "microbatches": 2, "token_dtype": "int32", "length_policy": policy, **batch},
    )
    cluster = start_cluster(config)
    try:
        batches, _ = collect(cluster.endpoints_path, range(DP))
        wait_until(lambda: cluster.status().finished, timeout_s=10, what="the planner to see every rank finished")
        metrics = scrape(json.loads(cluster.endpoints_path.read_text())["metrics"]["loader-0"])
    finally:
        cluster.stop()
    log = (cluster.run_dir / "logs" / "loader-0.log").read_text()
    return policy, batch.get("packing", False), batches, metrics, log, ledger_records(cluster.run_dir)


def sequences(mb: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(tokens, labels, positions) of every sequence of a microbatch, in order: its rows
    (padded), or its cu_seqlens spans (packed)."""
    mask = mb["attention_mask"]
    if "cu_seqlens" not in mb:
        return [
            (mb["input_ids"][r][mask[r]], mb["labels"][r][mask[r]], mb["position_ids"][r][mask[r]])
            for r in range(len(mask))
            if mask[r].any()
        ]
    cu = mb["cu_seqlens"]
    ids, labels, positions, segments = (mb[k][mask] for k in ("input_ids", "labels", "position_ids", "segment_ids"))
    rows = np.nonzero(mask)[0]
    for q in range(len(cu) - 2):  # consecutive sequences in one row never share a segment
        end = cu[q + 1]
        assert rows[end - 1] != rows[end] or segments[end - 1] != segments[end]
    return [(ids[a:b], labels[a:b], positions[a:b]) for a, b in zip(cu[:-1], cu[1:])]


def delivered(batches: dict[int, list[dict]]) -> tuple[dict[tuple[int, int], list[list[int]]], dict[int, dict[int, int]]]:
    """Every delivered sample's sequences by (source, row), checking each sequence's labels and
    positions on the way; and per step, per source, the tokens delivered."""
    out: dict[tuple[int, int], list[list[int]]] = {}
    seen = collections.Counter()
    tokens: dict[int, dict[int, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                seqs = sequences(mb)
                n = len(mb["sample_row"])
                chunks = mb["sample_chunks"].tolist() if "sample_chunks" in mb else [1] * n
                assert sum(chunks) == len(seqs)
                at = 0
                for source, row, length, k in zip(
                    mb["sample_source"].tolist(), mb["sample_row"].tolist(), mb["sample_length"].tolist(), chunks
                ):
                    mine = seqs[at : at + k]
                    at += k
                    for ids, labels, positions in mine:
                        assert labels[:-1].tolist() == ids[1:].tolist() and labels[-1] == IGNORE  # no label across a chunk's end
                        assert positions.tolist() == list(range(len(ids)))  # positions restart per chunk
                    out[(source, row)] = [ids.tolist() for ids, _, _ in mine]
                    assert sum(len(c) for c in out[(source, row)]) == length  # sample_length: the whole sample
                    seen[(source, row)] += 1
                    tokens[batch["step"]][source] += length
    assert max(seen.values()) == 1, "a sample arrived twice"
    return out, tokens


def test_long_samples_follow_the_policy_and_every_other_sample_arrives_once(run, dataset) -> None:
    policy, packed, batches, _, _, _ = run
    truth = [parquet_rows(s.path) for s in dataset]
    got, _ = delivered(batches)
    long = {(0, row) for row in LONG}
    expected = {(k, r) for k, rows in enumerate(truth) for r in range(len(rows))}
    assert set(got) == (expected - long if policy == "reject" else expected)
    for (k, r), chunks in got.items():
        row = truth[k][r]
        assert all(len(c) <= MAX_LENGTH for c in chunks)
        if (k, r) not in long:
            assert chunks == [row]
        elif policy == "split":
            assert sum(chunks, []) == row  # every token, in order
            assert [len(c) for c in chunks] == [MAX_LENGTH] * (len(row) // MAX_LENGTH) + (
                [len(row) % MAX_LENGTH] if len(row) % MAX_LENGTH else []
            )
        else:
            assert chunks == [row[:MAX_LENGTH]]  # its first max_length tokens
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                assert mb["input_ids"].shape[1] <= MAX_LENGTH  # width: padded to the longest chunk, packed rows of pack_length
                assert ("cu_seqlens" in mb) == packed


def test_loss_weights_sum_to_one_and_count_the_labels(run) -> None:
    _, _, batches, _, _, _ = run
    steps = [b["step"] for b in batches[0]]
    assert steps == [b["step"] for b in batches[1]] and steps
    for step_batches in zip(*(batches[r] for r in range(DP))):
        mbs = [mb for b in step_batches for mb in b["microbatches"]]
        assert all(mb["loss_tokens"] == int(np.count_nonzero(mb["labels"] != IGNORE)) for mb in mbs)
        assert sum(mb["loss_tokens"] for mb in mbs) == step_batches[0]["global_loss_tokens"] == step_batches[1]["global_loss_tokens"]
        assert math.isclose(sum(mb["loss_weight"] for mb in mbs), 1.0, rel_tol=1e-9)


def test_the_ledger_counts_what_is_delivered(run, dataset) -> None:
    policy, _, batches, _, _, ledger = run
    _, tokens = delivered(batches)
    assert len(ledger) == len(tokens)
    names = [s.name for s in dataset]
    for record in ledger:
        counted = {name: n for name, n in record["tokens"].items() if n}  # a step whose docs were all rejected counts 0
        assert counted == {names[k]: n for k, n in sorted(tokens[record["step"]].items())}, record["step"]
    truth = parquet_rows(dataset[0].path)
    counted = sum(r["tokens"].get("docs", 0) for r in ledger)
    full = sum(len(row) for row in truth)
    cut = sum(len(truth[r]) - MAX_LENGTH for r in LONG)
    assert counted == {"split": full, "truncate": full - cut, "reject": full - sum(len(truth[r]) for r in LONG)}[policy]


def test_the_loader_counts_and_logs_what_it_cut_or_rejected(run) -> None:
    policy, _, _, metrics, log, _ = run
    truncated = metrics.get('batchplane_loader_truncated_samples_total{source="docs"}', 0)
    too_long = metrics.get('batchplane_loader_bad_samples_total{reason="too_long",source="docs"}', 0)
    assert (truncated, too_long) == {"split": (0, 0), "truncate": (len(LONG), 0), "reject": (0, len(LONG))}[policy]
    if policy == "truncate":
        assert f"longer than batch.max_length = {MAX_LENGTH} to their first {MAX_LENGTH} tokens" in log
    if policy == "reject":
        assert f"longer than batch.max_length = {MAX_LENGTH} (batch.length_policy reject)" in log
        assert "part-00000.parquet" in log  # the file, then row group and rows
