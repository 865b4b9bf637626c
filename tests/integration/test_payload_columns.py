"""Declared payload columns (`batch.payload`) of all three kinds travel from a user's transform
through real loader and constructor processes to the client, laid out by kind, and equal what
the Parquet rows themselves say: a per-token float column (sliced for context parallelism like
input_ids), a per-sample pair and a variable-length blob of int16 rows. A second source without
the transform gets each column's empty value. Checked against values computed here from the
rows read with pyarrow, not from any code of ours."""

from __future__ import annotations

import collections
import pathlib
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
from harness import collect, skewed_lengths, start_cluster, write_job, write_source

pytestmark = pytest.mark.integration

USER_CODE = """
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

def with_columns(batch):
    ids = batch.column("input_ids").combine_chunks()
    docs = batch.column("doc_id").to_numpy()
    lengths = pc.list_value_length(ids).to_numpy()
    # per token: half the token id; per sample: (doc_id, length); blob: doc_id % 4 rows of 3
    weight = pa.ListArray.from_arrays(ids.offsets, pc.multiply(ids.values.cast(pa.float32()), 0.5))
    pair = [[int(d), int(n)] for d, n in zip(docs, lengths)]
    extra = [[[int(d) + j, -j, 7] for j in range(int(d) % 4)] for d in docs]
    return pa.table({"input_ids": ids, "weight": weight, "pair": pair, "extra": extra})
"""

PAYLOAD = [
    {"name": "weight", "kind": "token", "dtype": "float32", "fill": -1},
    {"name": "pair", "kind": "sample", "dtype": "int64", "shape": [2]},
    {"name": "extra", "kind": "blob", "dtype": "int16", "shape": [3]},
]


def _truth(folder: pathlib.Path) -> dict[int, tuple[np.ndarray, int]]:
    """doc_id -> (token ids, doc_id), read straight from the Parquet files."""
    out = {}
    for path in sorted(folder.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            out[row["doc_id"]] = np.asarray(row["input_ids"], np.int32)
    return out


def test_every_kind_of_column_arrives_as_the_parquet_rows_say(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_code.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the loader processes import it
    a = write_source(tmp_path / "data", "a", skewed_lengths(90, seed=1, long=300), seed=1)
    b = write_source(tmp_path / "data", "b", skewed_lengths(60, seed=2, long=300), seed=2)
    config = write_job(
        tmp_path / "job.yaml",
        [a, b],
        sources=[
            {"name": "a", "path": str(a.path), "transform": "user_code:with_columns", "columns": ["input_ids", "doc_id"]},
            {"name": "b", "path": str(b.path)},
        ],
        batch={"global_batch_size": 10, "microbatches": 2, "token_dtype": "int32", "payload": PAYLOAD},
        mesh={"dp": 2, "cp": 2},
        constructors={"cp_slicing": "contiguous"},
    )
    cluster = start_cluster(config)
    try:
        batches, _ = collect(cluster.endpoints_path, range(4))
    finally:
        cluster.stop()
    truth = {0: _truth(a.path), 1: _truth(b.path)}
    seen: collections.Counter = collections.Counter()
    for dp in range(2):
        first, second = batches[2 * dp], batches[2 * dp + 1]  # cp ranks 0 and 1 of the replica (tp-cp-dp-pp)
        assert len(first) == len(second)
        for x, y in zip(first, second):
            for mb0, mb1 in zip(x["microbatches"], y["microbatches"]):
                for name in ("sample_source", "sample_row", "pair", "extra", "extra_offsets"):
                    assert np.array_equal(mb0[name], mb1[name]), name  # whole on every CP rank
                ids = np.concatenate([mb0["input_ids"], mb1["input_ids"]], axis=1)  # contiguous CP halves
                weight = np.concatenate([mb0["weight"], mb1["weight"]], axis=1)
                assert weight.dtype == np.float32 and mb0["pair"].dtype == np.int64 and mb0["extra"].dtype == np.int16
                offsets = mb0["extra_offsets"]
                for i, (source, row) in enumerate(zip(mb0["sample_source"].tolist(), mb0["sample_row"].tolist())):
                    tokens = truth[source][row]  # the row's doc_id is its row: one file order
                    n = len(tokens)
                    assert np.array_equal(ids[i, :n], tokens)
                    rows = offsets[i + 1] - offsets[i]
                    if source == 0:  # the transform's columns, computed here from the row
                        assert np.array_equal(weight[i, :n], tokens.astype(np.float32) * np.float32(0.5))
                        assert mb0["pair"][i].tolist() == [row, n]
                        expected = [[row + j, -j, 7] for j in range(row % 4)]
                        assert mb0["extra"][offsets[i] : offsets[i + 1]].tolist() == expected
                    else:  # a source without them: the empty values
                        assert (weight[i, :n] == -1).all() and mb0["pair"][i].tolist() == [0, 0] and rows == 0
                    assert (weight[i, n:] == -1).all()  # padding: the column's fill
                    seen[(source, row)] += 1
                assert offsets[0] == 0 and offsets[-1] == len(mb0["extra"])
    assert sorted(seen) == sorted((s, r) for s in (0, 1) for r in truth[s]) and max(seen.values()) == 1
