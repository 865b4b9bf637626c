"""The loader side of the payload schema (issue 17, point 1): transforms return declared columns
of every kind, `batch.max_length` cuts or empties them, windows buffer them shuffled like the
token lists, and a fetch sends them (`FetchBook.fetch`) with their bytes counted. One small
Parquet file, no processes, no sockets; the expected values come from the file's rows."""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batchplane.core import bad
from batchplane.core.errors import ResourceExhausted
from batchplane.core.order import SampleOrder
from batchplane.core.payload import PayloadColumn, arrow_type
from batchplane.loader.fetch import PAYLOAD_SCHEMA, FetchBook, encode_payload, payload_schema
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.source import ParquetSource
from batchplane.loader.reading import BufferedWindow
from batchplane.loader.stream import ByteBudget, SourceStream
from batchplane.loader.transforms import (
    BoundTransform,
    TransformError,
    check_output,
    check_transform,
    limit_columns,
    limit_lengths,
    per_sample,
)

MASK = PayloadColumn("mask", "token", "uint8", (), fill=9)
NUM = PayloadColumn("num", "sample", "int64", (), fill=-1)
GRID = PayloadColumn("grid", "sample", "int32", (3,))
PIX = PayloadColumn("pix", "blob", "uint8", (2,))
ABSENT = PayloadColumn("absent", "sample", "float32", (), fill=0.5)  # no transform returns it
PAYLOAD = (MASK, NUM, GRID, PIX, ABSENT)

GROUP, GROUPS = 6, 8
ROWS = GROUP * GROUPS
FAIL_DOC = 20  # the transform breaks a declaration on this document's row group (row group 3)
NULL_ROW = 31  # a sample the transform rejects (row group 5)


def _first_window(stream: SourceStream) -> BufferedWindow:
    """The first window the stream holds."""
    return next(iter(stream._windows)).data


def _tokens(row: int) -> list[int]:
    return [(row * 7 + k) % 50 + 1 for k in range(1 + row % 5 + (12 if row % 11 == 0 else 0))]


def _pix(row: int) -> list[int]:
    return [(row + k) % 256 for k in range(2 * (row % 3))]


def _transform(batch: pa.Table, *, fail_doc: int) -> pa.Table:
    """Every kind: a token column, a sample one (null for docs divisible by 4), a fixed-shape
    sample one, a blob of doc % 3 rows of 2 values; `absent` is never returned."""
    docs = batch.column("doc").to_numpy()
    ids = batch.column("input_ids")
    pix = [_pix(int(d)) for d in docs]
    if fail_doc in docs:
        pix[0] = [1, 2, 3]  # not a multiple of a row of 2: a broken declaration
    ids_out = pc.if_else(pc.equal(batch.column("doc"), NULL_ROW), pa.scalar(None, ids.type), ids)
    return pa.table(
        {
            "input_ids": ids_out,
            "mask": pa.array([[t % 3 for t in row] for row in ids.to_pylist()], pa.list_(pa.int64())),
            "num": pa.array([None if d % 4 == 0 else int(d) for d in docs], pa.int32()),
            "grid": pa.array([[int(d), 1, 2] for d in docs], pa.list_(pa.int64())),
            "pix": pa.array(pix, pa.list_(pa.int16())),
            "length": pc.list_value_length(ids),  # a feature
        }
    )


def _expected(row: int, column: PayloadColumn) -> object:
    """What the fetch must send for a good sample of `row`: computed from the row alone."""
    tokens = _tokens(row)
    if column is MASK:
        return [t % 3 for t in tokens]
    if column is NUM:
        return -1 if row % 4 == 0 else row
    if column is GRID:
        return [row, 1, 2]
    if column is PIX:
        return _pix(row)
    return 0.5


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("payload") / "a"
    folder.mkdir()
    table = pa.table({"input_ids": pa.array([_tokens(r) for r in range(ROWS)], pa.list_(pa.int32())), "doc": pa.array(np.arange(ROWS))})
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=GROUP)
    return folder


def _open(
    folder: pathlib.Path, *, window_row_groups: int, shuffle: bool, seed: int = 1, max_length: int | None = None, policy: str = "split"
) -> SourceStream:
    source = ParquetSource("a", folder, required_columns=("input_ids", "doc"), token_column="input_ids")
    order = SampleOrder([GROUP] * GROUPS, seed=seed, source_name="a", window_row_groups=window_row_groups, shuffle=shuffle)
    transform = BoundTransform(
        _transform, {"fail_doc": FAIL_DOC}, ("input_ids", "doc"), max_length=max_length, length_policy=policy, payload=PAYLOAD
    )
    return SourceStream(
        0,
        source,
        order,
        transform,
        epochs=1,
        read_ahead_samples=ROWS,
        budget=ByteBudget(1 << 30),
        metrics=LoaderMetrics(CollectorRegistry()),
        replica="0",
    )


def _summary(stream: SourceStream) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parts, end = [], False
    while not end:
        at = sum(len(p[0]) for p in parts)
        rows, lengths, reasons, _, end, _ = stream.summary(from_seq=at, planned_seq=0, max_samples=ROWS, wait_s=30)
        assert len(rows) or end, "the reader answers within wait_s"
        parts.append((rows, lengths, reasons))
    rows, lengths, reasons = (np.concatenate([p[k] for p in parts]) for k in range(3))
    assert len(rows) == ROWS
    # As a planner that has seen every window: it asked about the last one, so every position
    # may be fetched (however many calls the reads above took).
    stream.summary(from_seq=ROWS - 1, planned_seq=0, max_samples=1, wait_s=30)
    return rows, lengths, reasons


# ---- the transform contract ------------------------------------------------------------------


def test_declared_columns_are_normalized_missing_ones_empty_and_none_is_a_feature() -> None:
    docs = pa.table({"input_ids": pa.array([_tokens(r) for r in range(6)], pa.list_(pa.int32())), "doc": pa.array(np.arange(6))})
    out = check_transform(_transform(docs, fail_doc=-1), 6, payload=PAYLOAD)
    assert set(out.features) == {"length"}, "a declared column is not a feature"
    assert list(out.columns) == [c.name for c in PAYLOAD]
    for column in PAYLOAD:
        assert out.columns[column.name].type == arrow_type(column)
        assert out.columns[column.name].to_pylist() == [_expected(r, column) for r in range(6)], column.name


def test_a_rejected_sample_gets_every_column_empty() -> None:
    docs = pa.table({"input_ids": pa.array([_tokens(r) for r in range(30, 36)], pa.list_(pa.int32())), "doc": pa.array(np.arange(30, 36))})
    out = check_transform(_transform(docs, fail_doc=-1), 6, payload=PAYLOAD)
    i = NULL_ROW - 30
    assert out.ids[i].as_py() is None
    assert [out.columns[c.name][i].as_py() for c in PAYLOAD] == [[], -1, [0, 0, 0], [], 0.5]


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("mask", pa.array([[1], [1]], pa.list_(pa.int8())), "'mask'.*1 values for 2 tokens"),
        ("grid", pa.array([[1, 2], [1, 2, 3]]), "'grid'.*2 values"),
        ("pix", pa.array([[1, 2, 3], []]), "'pix'.*not a multiple"),
        ("num", pa.array(["x", "y"]), "'num'"),
    ],
)
def test_a_broken_declaration_is_a_transform_error_naming_the_column(column: str, value: pa.Array, message: str) -> None:
    out = {"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())), column: value}
    with pytest.raises(TransformError, match=message):
        check_transform(pa.table(out), 2, payload=PAYLOAD)


def test_an_undeclared_column_that_is_not_a_number_says_how_to_deliver_it() -> None:
    out = pa.table({"input_ids": pa.array([[1]], pa.list_(pa.int32())), "pixels": pa.array([[1, 2]])})
    with pytest.raises(TransformError, match="declare it in batch.payload to deliver it"):
        check_output(out, 1)
    assert check_transform(out, 1, payload=(PayloadColumn("pixels", "blob", "uint8"),)).columns["pixels"].to_pylist() == [[1, 2]]


def test_per_sample_takes_dicts_of_columns_or_ids() -> None:
    def fn(row: dict) -> object:
        if row["doc"] == 0:
            return None
        if row["doc"] == 1:
            return [5, 6]
        return {"input_ids": [7], "pix": np.array([[1, 2], [3, 4]], np.uint8), "num": 3}

    table = pa.table({"doc": [0, 1, 2]})
    out = check_transform(per_sample(fn)(table), 3, payload=(PIX, NUM))
    assert out.ids.to_pylist() == [None, [5, 6], [7]]
    assert out.columns["pix"].to_pylist() == [[], [], [1, 2, 3, 4]]
    assert out.columns["num"].to_pylist() == [-1, -1, 3]


# ---- batch.max_length ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["truncate", "reject", "split"])
def test_max_length_applies_to_the_declared_columns(policy: str) -> None:
    ids = pa.array([[1, 2, 3, 4, 5], [6, 7], None], pa.list_(pa.int32()))
    out = check_transform(
        pa.table(
            {
                "input_ids": ids,
                "mask": pa.array([[1, 2, 3, 4, 5], [6, 7], None]),
                "pix": pa.array([[1, 2, 3, 4], [5, 6], None]),
                "num": [1, 2, 3],
            }
        ),
        3,
        payload=(MASK, PIX, NUM),
    )
    limited, over = limit_lengths(out.ids, max_length=3, policy=policy)
    lengths = pc.fill_null(pc.list_value_length(limited), 0).to_numpy()
    got = {
        k: v.to_pylist()
        for k, v in limit_columns(out.columns, (MASK, PIX, NUM), over=over, lengths=lengths, max_length=3, policy=policy).items()
    }
    if policy == "truncate":
        assert got == {"mask": [[1, 2, 3], [6, 7], []], "pix": [[1, 2, 3, 4], [5, 6], []], "num": [1, 2, -1]}
    elif policy == "reject":
        assert got == {"mask": [[], [6, 7], []], "pix": [[], [5, 6], []], "num": [-1, 2, -1]}
    else:
        assert got == {"mask": [[1, 2, 3, 4, 5], [6, 7], []], "pix": [[1, 2, 3, 4], [5, 6], []], "num": [1, 2, -1]}


@pytest.mark.parametrize("policy", ["truncate", "reject"])
def test_a_window_cuts_or_empties_the_columns_of_long_samples(data: pathlib.Path, policy: str) -> None:
    stream = _open(data, window_row_groups=GROUPS, shuffle=True, max_length=5, policy=policy)
    try:
        rows, lengths, reasons = _summary(stream)
        window = _first_window(stream)
        for j, row in enumerate(rows.tolist()):
            mask = window.columns["mask"][j].as_py()
            if len(_tokens(row)) > 5 and reasons[j] in (0, bad.TOO_LONG):
                assert mask == ([t % 3 for t in _tokens(row)][:5] if policy == "truncate" else [])
                assert window.columns["pix"][j].as_py() == (_pix(row) if policy == "truncate" else [])
            assert len(mask) == lengths[j]
    finally:
        stream.close()


# ---- the stream and the fetch ----------------------------------------------------------------


def test_a_row_group_whose_transform_breaks_a_declaration_is_bad_and_logged(data: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    stream = _open(data, window_row_groups=2, shuffle=True)
    try:
        rows, lengths, reasons = _summary(stream)
    finally:
        stream.close()
    failed = (rows // GROUP) == FAIL_DOC // GROUP
    assert (reasons[failed] == bad.TRANSFORM).all() and (lengths[failed] == 0).all()
    assert (reasons[rows == NULL_ROW] == bad.REJECTED).all()
    assert np.count_nonzero(reasons) == GROUP + 1
    logged = [r.getMessage() for r in caplog.records if "transform failed" in r.getMessage()]
    assert len(logged) == 1 and "part-00000.parquet" in logged[0] and f"row group {FAIL_DOC // GROUP}" in logged[0] and "'pix'" in logged[0]
    window = next(w.data for w in stream._windows if w.seq_start <= int(np.flatnonzero(failed)[0]) < w.seq_end)
    j = int(np.flatnonzero(failed)[0]) - window.seq_start
    assert [window.columns[c.name][j].as_py() for c in PAYLOAD] == [[], -1, [0, 0, 0], [], 0.5], "a failed row group's columns are empty"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    window_row_groups=st.sampled_from([1, 2, 3, 8]),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
    picks=st.lists(st.tuples(st.integers(0, ROWS - 1), st.integers(1, 12)), min_size=1, max_size=5),
)
def test_a_fetch_sends_every_declared_column_as_the_transform_made_it(data: pathlib.Path, window_row_groups, shuffle, seed, picks) -> None:
    stream = _open(data, window_row_groups=window_row_groups, shuffle=shuffle, seed=seed)
    try:
        rows, lengths, _ = _summary(stream)
        seqs = np.unique(np.concatenate([np.arange(a, min(ROWS, a + n)) for a, n in picks]))  # runs and gaps
        seqs = seqs[lengths[seqs] > 0]  # the planner never plans a bad sample
        if len(seqs) > 3:
            seqs = np.concatenate([seqs[1::2], seqs[::2]])  # out of order too
        book = FetchBook({0: stream})
        batch = book.fetch(constructor=0, step=0, sources=np.zeros(len(seqs), np.int32), seqs=seqs)
    finally:
        stream.close()
    assert batch.schema == payload_schema(PAYLOAD)
    assert batch.schema.names[:3] == PAYLOAD_SCHEMA.names and batch.schema.names[3:] == [c.name for c in PAYLOAD]
    assert sorted(batch.column("seq").to_pylist()) == sorted(seqs.tolist())
    by_seq = {s: i for i, s in enumerate(batch.column("seq").to_pylist())}
    for seq in seqs.tolist():
        row = int(rows[seq])
        i = by_seq[seq]
        assert batch.column("input_ids")[i].as_py() == _tokens(row)
        for column in PAYLOAD:
            assert batch.column(column.name)[i].as_py() == _expected(row, column), (column.name, seq, row)
    decoded = pa.ipc.open_stream(encode_payload([batch])).read_all()
    assert decoded.equals(pa.Table.from_batches([batch]))


def test_a_contiguous_fetch_is_a_slice_of_the_window(data: pathlib.Path) -> None:
    stream = _open(data, window_row_groups=GROUPS, shuffle=True)
    try:
        _, lengths, _ = _summary(stream)
        start = next(s for s in range(ROWS) if lengths[s : s + 4].all())
        batch = FetchBook({0: stream}).fetch(constructor=0, step=0, sources=np.zeros(4, np.int32), seqs=np.arange(start, start + 4))
        window = _first_window(stream)
        assert batch.column("input_ids").values.buffers()[1].address == window.ids.values.buffers()[1].address
        assert batch.column("pix").to_pylist() == window.columns["pix"].slice(start, 4).to_pylist()
    finally:
        stream.close()


def test_the_payload_bytes_count_the_declared_columns(data: pathlib.Path) -> None:
    stream = _open(data, window_row_groups=GROUPS, shuffle=False)
    try:
        rows, lengths, _ = _summary(stream)
        seqs = np.flatnonzero(lengths > 0)[:10]
        tokens = int(lengths[seqs].sum())
        columns = (
            tokens * 1 + 4 * len(seqs) + 8 * len(seqs) + 3 * 4 * len(seqs) + sum(len(_pix(int(r))) + 4 for r in rows[seqs]) + 4 * len(seqs)
        )
        exact = 4 * tokens + 16 * len(seqs) + columns
        sources = np.zeros(len(seqs), np.int32)
        assert FetchBook({0: stream}, max_payload_bytes=exact).fetch(constructor=0, step=0, sources=sources, seqs=seqs).num_rows == len(
            seqs
        )
        with pytest.raises(ResourceExhausted):
            FetchBook({0: stream}, max_payload_bytes=exact - 1).fetch(constructor=0, step=1, sources=sources, seqs=seqs)
        window = _first_window(stream)
        assert window.nbytes > window.ids.nbytes + sum(c.nbytes for c in window.columns.values()) - 1
    finally:
        stream.close()
