"""A loader's stream rebuilds what it does not hold (real Parquet files, no processes): windows a
constructor or the planner asks for are read again on demand; a restarted replica reads at once
what the planner's replay says constructors may still fetch; windows that only steps every rank
was handed planned from are freed even when their release counts cannot reach zero; positions past
the end of the stream are refused."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from harness import wait_until, write_source
from prometheus_client import CollectorRegistry

from batchplane.core.errors import NotFound
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.rows import gather
from batchplane.loader.source import ParquetSource
from batchplane.loader.stream import ByteBudget, SourceStream
from batchplane.loader.transforms import BoundTransform, token_ids

pytestmark = pytest.mark.integration

ROWS, GROUP = 120, 10  # windows of one row group: 12 windows an epoch


@pytest.fixture
def open_stream(tmp_path: pathlib.Path):
    data = write_source(tmp_path, "a", [5 + i % 7 for i in range(ROWS)], row_group_size=GROUP, seed=3)
    streams = []

    def make(*, replica: str = "0", read_ahead: int = 20) -> tuple[SourceStream, LoaderMetrics]:
        source = ParquetSource("a", data.path, required_columns=("input_ids",), token_column="input_ids")
        order = SampleOrder([rg.num_rows for rg in source.row_groups], seed=1, source_name="a", window_row_groups=1, shuffle=True)
        metrics = LoaderMetrics(CollectorRegistry())
        stream = SourceStream(
            0,
            source,
            order,
            BoundTransform(token_ids, {"column": "input_ids"}, ("input_ids",)),
            epochs=1,
            read_ahead_samples=read_ahead,
            budget=ByteBudget(1 << 30),
            metrics=metrics,
            replica=replica,
        )
        streams.append(stream)
        return stream, metrics

    yield make
    for s in streams:
        s.close()


def _fetch(stream: SourceStream, seqs: list[int]) -> list[np.ndarray]:
    """Token lists of positions `seqs`, as a fetch takes them."""
    out = {}
    for window, mask, index in stream.locate(np.array(seqs, np.int64), wait_s=10):
        stream.check_good(window, index)
        ids = gather([window.ids], np.zeros(len(index), np.int64), index)
        for seq, tokens in zip(np.array(seqs)[mask].tolist(), ids.to_pylist()):
            out[seq] = tokens
    return [out[s] for s in seqs]


def _ask(stream: SourceStream, start: int, end: int, **progress: int) -> None:
    """Summaries of positions [start, end), pulled as the planner does; `progress`: planned_seq,
    planned_steps, delivered_below."""
    progress.setdefault("planned_seq", start)
    while start < end:
        rows = stream.summary(from_seq=start, max_samples=end - start, wait_s=10, **progress).rows
        start += len(rows)


def _held(stream: SourceStream) -> list[int]:
    return [w.seq_start for w in stream._windows]


def test_a_window_dropped_is_read_again_with_the_same_samples(open_stream) -> None:
    stream, metrics = open_stream()
    _ask(stream, 0, 40)
    first = _fetch(stream, [3, 14])
    # Every rank was handed the steps planning positions 0..39: their windows are freed.
    _ask(stream, 40, 50, planned_seq=40, planned_steps=4, delivered_below=4)
    assert not {0, 10} & set(_held(stream))
    # A restarted constructor (or planner) asks again: read on demand, byte-identical.
    assert _fetch(stream, [3, 14]) == first
    assert metrics.samples_replayed.labels("a")._value.get() == 2 * GROUP


def test_windows_wait_for_the_steps_that_planned_from_them(open_stream) -> None:
    stream, _ = open_stream()
    _ask(stream, 0, 30)
    _ask(stream, 30, 40, planned_seq=30, planned_steps=3, delivered_below=2)
    assert {0, 10, 20} <= set(_held(stream)), "step 2 planned from them and not every rank was handed it"
    _ask(stream, 40, 50, planned_seq=30, planned_steps=3, delivered_below=3)
    assert not {0, 10, 20} & set(_held(stream))


def test_a_restarted_replica_reads_at_once_what_constructors_may_still_fetch(open_stream) -> None:
    before, _ = open_stream()
    _ask(before, 0, 60)
    expected = _fetch(before, list(range(20, 50)))
    # Killed; its replacement gets the planner's replay: steps from the one at cursor 20 may
    # still be fetched, the planner asked about positions below 60.
    after, metrics = open_stream()
    replay = after.restore(from_seq=20, through_seq=60, routes=None, planned_seq=50, planned_steps=5, delivered_below=2)
    assert replay == 40
    assert _fetch(after, list(range(20, 50))) == expected
    wait_until(lambda: metrics.samples_replayed.labels("a")._value.get() == 40, timeout_s=10, what="the replay of windows up to 60")
    with pytest.raises(NotFound, match="past the end of the stream"):
        _fetch(after, [ROWS])


def test_a_replica_reads_again_only_its_own_windows(open_stream) -> None:
    stream, _ = open_stream(replica="r1", read_ahead=0)  # no read-ahead past the replay: what it holds is the replay
    routes = Routing.of(["r0", "r1"])  # r1 owns the odd windows
    assert stream.restore(from_seq=0, through_seq=60, routes=routes, planned_seq=60, planned_steps=6, delivered_below=0) == 30
    _fetch(stream, [10, 30, 50])
    assert sorted(_held(stream)) == [10, 30, 50]
