"""A loader's stream says why each bad sample is bad (`core.bad` codes in its summaries), and
the reasons reach the planner's summary store: one small Parquet file (no processes, no sockets)
whose window holds an unreadable row group, one the transform fails on, a null, an empty and an
over-long sample."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry

from batchplane.core import bad
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing
from batchplane.loader.fetch import FetchBook
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.service import LoaderServicer
from batchplane.loader.source import ParquetSource
from batchplane.loader.reading import BufferedWindow
from batchplane.loader.stream import ByteBudget, SourceStream
from batchplane.loader.transforms import BoundTransform
from batchplane.planner.membership import SummaryTarget
from batchplane.planner.summaries import SummaryStore, parse_summary
from batchplane.v1 import loader_pb2

GROUP, GROUPS, MAX_LENGTH = 5, 4, 16
ROWS = GROUP * GROUPS
#: Row group 0 is unreadable, the transform fails on row group 1 (it holds FAIL_DOC).
FAIL_DOC = 7
#: Rows of row group 2: a null token list, an empty one, one longer than MAX_LENGTH.
NULL_ROW, EMPTY_ROW, LONG_ROW = 10, 11, 12


def _first_window(stream: SourceStream) -> BufferedWindow:
    """The first window the stream holds."""
    return next(iter(stream._windows)).data


def _tokens(row: int) -> list[int] | None:
    if row == NULL_ROW:
        return None
    if row == EMPTY_ROW:
        return []
    return list(range(1, (3 * MAX_LENGTH if row == LONG_ROW else 3 + row % 5) + 1))


def _fail_on_doc(batch: pa.Table, *, doc: int) -> pa.Table:
    """A transform that fails on a row group holding document `doc`."""
    if pc.any(pc.equal(batch.column("doc_id"), doc)).as_py():
        raise ValueError(f"cannot transform document {doc}")
    return pa.table({"input_ids": batch.column("input_ids")})


def _corrupt_row_group(path: pathlib.Path, index: int) -> None:
    """Flips bytes inside the data pages of one row group (their page checksums fail)."""
    column = pq.ParquetFile(path).metadata.row_group(index).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 20, start + column.total_compressed_size - 4, 7):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.fixture
def open_stream(tmp_path: pathlib.Path):
    folder = tmp_path / "a"
    folder.mkdir()
    table = pa.table(
        {
            "input_ids": pa.array([_tokens(r) for r in range(ROWS)], type=pa.list_(pa.int32())),
            "doc_id": pa.array(np.arange(ROWS), pa.int64()),
        }
    )
    path = folder / "part-00000.parquet"
    pq.write_table(table, path, row_group_size=GROUP, compression="zstd", write_page_checksum=True)
    _corrupt_row_group(path, 0)
    streams = []

    def make(policy: str) -> tuple[SourceStream, LoaderMetrics]:
        source = ParquetSource("a", folder, required_columns=("input_ids",), token_column="input_ids")
        assert [rg.num_rows for rg in source.row_groups] == [GROUP] * GROUPS
        # One window of every row group, shuffled: positions are not rows.
        order = SampleOrder([GROUP] * GROUPS, seed=1, source_name="a", window_row_groups=GROUPS, shuffle=True)
        transform = BoundTransform(_fail_on_doc, {"doc": FAIL_DOC}, ("input_ids", "doc_id"), max_length=MAX_LENGTH, length_policy=policy)
        metrics = LoaderMetrics(CollectorRegistry())
        stream = SourceStream(
            0,
            source,
            order,
            transform,
            epochs=1,
            read_ahead_samples=0,
            budget=ByteBudget(1 << 30),
            metrics=metrics,
            replica="0",
        )
        streams.append(stream)
        return stream, metrics

    yield make
    for s in streams:
        s.close()


def _expected(rows: np.ndarray, policy: str) -> np.ndarray:
    """The reason code of each row."""
    by_row = np.zeros(ROWS, np.uint8)
    by_row[0:GROUP] = bad.UNREADABLE
    by_row[GROUP : 2 * GROUP] = bad.TRANSFORM
    by_row[NULL_ROW] = bad.REJECTED
    by_row[EMPTY_ROW] = bad.EMPTY
    by_row[LONG_ROW] = bad.TOO_LONG if policy == "reject" else 0
    return by_row[rows]


@pytest.mark.parametrize("policy", ["reject", "truncate", "split"])
def test_each_bad_sample_carries_its_reason_and_good_ones_zero(open_stream, policy) -> None:
    stream, metrics = open_stream(policy)
    rows, lengths, reasons, _, end, _ = stream.summary(from_seq=0, planned_seq=0, max_samples=ROWS, wait_s=10)
    assert end and sorted(rows.tolist()) == list(range(ROWS))
    assert rows.tolist() != list(range(ROWS)), "shuffled: a position's reason must follow its row"
    assert reasons.dtype == np.uint8
    assert reasons.tolist() == _expected(rows, policy).tolist()
    assert ((reasons != 0) == (lengths == 0)).all(), "a reason exactly where a sample is bad"
    for code in range(1, len(bad.REASONS)):  # the metrics count what the codes say
        counted = metrics.bad_samples.labels("a", bad.reason_name(code))._value.get()
        assert counted == np.count_nonzero(reasons == code), bad.reason_name(code)
    window = _first_window(stream)
    assert window.nbytes >= window.reasons.nbytes + window.lengths.nbytes + window.rows.nbytes


def test_a_summary_from_the_middle_of_a_window_slices_the_reasons_with_the_rows(open_stream) -> None:
    stream, _ = open_stream("reject")
    all_rows, _, all_reasons, _, _, _ = stream.summary(from_seq=0, planned_seq=0, max_samples=ROWS, wait_s=10)
    rows, _, reasons, _, _, _ = stream.summary(from_seq=7, planned_seq=0, max_samples=6, wait_s=10)
    assert rows.tolist() == all_rows[7:13].tolist()
    assert reasons.tolist() == all_reasons[7:13].tolist()


def test_the_reasons_travel_to_the_planners_store(open_stream) -> None:
    stream, metrics = open_stream("reject")
    servicer = LoaderServicer({0: stream}, FetchBook({0: stream}), metrics)
    servicer.join(sources=("a",), hook=None)
    request = loader_pb2.GetSummaryRequest(source=0, from_seq=0, planned_seq=0, max_samples=ROWS, wait_ms=10_000)
    response = servicer.GetSummary(request, None)
    target = SummaryTarget("loader:1", ROWS, Routing.of(["0"]), (0, "0"), num_rows=ROWS, stream_end=ROWS)
    rows, lengths, features, reasons, digests = parse_summary(response, request, target)
    assert reasons.tolist() == _expected(rows, "reject").tolist()
    store = SummaryStore(1, lookahead=ROWS)
    store.start((0,))
    store.add(0, response.start_seq, rows, lengths, response.end_of_stream, features, reasons=reasons, digests=digests)
    assert store.reasons(0, 0, ROWS).tolist() == reasons.tolist()
    assert ((digests == 0) == (lengths == 0)).all() and store.digests(0, 0, ROWS).tolist() == digests.tolist()
