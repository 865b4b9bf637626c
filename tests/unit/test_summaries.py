"""Tests of batchplane.planner.summaries.SummaryStore and wait_for_summary (the pure part), and
how often SummaryPuller calls a loader (against a fake channel; its gRPC path is covered by
integration tests)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.routing import Routing
from batchplane.planner.membership import SummaryTarget
from batchplane.planner.summaries import PULL_LOOKAHEADS, SummaryPuller, SummaryStore, wait_for_summary
from batchplane.v1 import loader_pb2
from batchplane.wire import encode_array


def _rows(start: int, count: int) -> np.ndarray:
    """Distinct, recognisable rows for seqs [start, start + count)."""
    return np.arange(start, start + count, dtype=np.int64) * 100 + 7


def _lengths(start: int, count: int) -> np.ndarray:
    return (np.arange(start, start + count, dtype=np.int32) % 13) + 1


def _add(store: SummaryStore, source: int, start: int, count: int, *, end: bool = False) -> None:
    store.add(source, start, _rows(start, count), _lengths(start, count), end)


def _wanted(store: SummaryStore, source: int):
    with store.cond:
        return store.wanted(source)


def _get(store: SummaryStore, source: int, start: int, count: int):
    got = store.get(source, start, count)
    if got is None:
        return None
    rows, lengths, _ = got
    return rows.tolist(), lengths.tolist()


def _expected(start: int, count: int):
    return _rows(start, count).tolist(), _lengths(start, count).tolist()


def test_nothing_is_wanted_before_start() -> None:
    store = SummaryStore(2, lookahead=10)
    assert _wanted(store, 0) is None
    assert _wanted(store, 1) is None


def test_start_sets_the_cursors() -> None:
    store = SummaryStore(2, lookahead=10)
    store.start((5, 0))
    assert _wanted(store, 0) == (5, 5)
    assert _wanted(store, 1) == (0, 0)
    assert store.get(0, 5, 0) is not None
    with pytest.raises(ValueError, match=r"source 0: seq 4 is before the store's base 5"):
        store.get(0, 4, 1)


def test_wanted_until_the_lookahead_is_satisfied() -> None:
    store = SummaryStore(1, lookahead=10)
    store.start((5,))
    _add(store, 0, 5, 4)
    assert _wanted(store, 0) == (9, 5)
    _add(store, 0, 9, 5)
    assert _wanted(store, 0) == (14, 5)
    _add(store, 0, 14, 1)  # known through 15 = cursor 5 + lookahead 10
    assert _wanted(store, 0) is None
    store.advance((6,))
    assert _wanted(store, 0) == (15, 6)


def test_get_returns_none_until_all_requested_entries_are_known() -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    assert store.get(0, 0, 1) is None
    _add(store, 0, 0, 5)
    assert _get(store, 0, 0, 5) == _expected(0, 5)
    assert _get(store, 0, 2, 3) == _expected(2, 3)
    assert store.get(0, 0, 6) is None
    assert store.get(0, 4, 2) is None
    assert store.get(0, 7, 1) is None
    _add(store, 0, 5, 3)
    assert _get(store, 0, 0, 8) == _expected(0, 8)
    assert _get(store, 0, 4, 2) == _expected(4, 2)


def test_overlapping_adds_ignore_known_entries() -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    _add(store, 0, 0, 6)
    # A second report from seq 3 with different values: 3..5 are known and must not change.
    store.add(0, 3, np.array([-1, -2, -3, 900, 1000], np.int64), np.array([50, 51, 52, 53, 54], np.int32), False)
    rows, lengths, _ = store.get(0, 0, 8)
    assert rows.tolist() == _rows(0, 6).tolist() + [900, 1000]
    assert lengths.tolist() == _lengths(0, 6).tolist() + [53, 54]
    # A report entirely inside what is known changes nothing.
    store.add(0, 1, np.array([-5, -6], np.int64), np.array([9, 9], np.int32), False)
    assert store.get(0, 0, 8)[0].tolist() == rows.tolist()
    assert store.get(0, 0, 9) is None


def test_gaps_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    _add(store, 0, 0, 4)
    with caplog.at_level(logging.WARNING, logger="batchplane.planner.summaries"):
        _add(store, 0, 6, 4)
    assert "gap" in caplog.text
    assert store.get(0, 6, 1) is None
    assert store.get(0, 4, 1) is None
    assert _wanted(store, 0) == (4, 0)
    # The gap filled in order is accepted.
    _add(store, 0, 4, 6)
    assert _get(store, 0, 0, 10) == _expected(0, 10)


def test_gap_with_end_of_stream_does_not_end_the_stream() -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    _add(store, 0, 5, 2, end=True)
    assert _wanted(store, 0) == (0, 0)


def test_advance_drops_entries_below_the_cursor() -> None:
    store = SummaryStore(2, lookahead=100)
    store.start((0, 0))
    _add(store, 0, 0, 10)
    _add(store, 1, 0, 3)
    store.advance((4, 3))
    with pytest.raises(ValueError, match=r"before the store's base 4"):
        store.get(0, 3, 1)
    assert _get(store, 0, 4, 6) == _expected(4, 6)
    with pytest.raises(ValueError, match=r"source 1: seq 2 is before the store's base 3"):
        store.get(1, 2, 1)
    assert store.get(1, 3, 1) is None
    assert _wanted(store, 0) == (10, 4)
    assert _wanted(store, 1) == (3, 3)


def test_advance_past_what_is_known() -> None:
    store = SummaryStore(1, lookahead=5)
    store.start((0,))
    _add(store, 0, 0, 3)
    store.advance((8,))
    assert _wanted(store, 0) == (3, 8)
    _add(store, 0, 3, 10)
    assert _get(store, 0, 8, 5) == _expected(8, 5)
    assert _wanted(store, 0) is None


def test_nothing_is_wanted_after_the_stream_ended() -> None:
    store = SummaryStore(2, lookahead=100)
    store.start((0, 0))
    _add(store, 1, 0, 3, end=True)
    assert _wanted(store, 1) is None
    assert _get(store, 1, 0, 3) == _expected(0, 3)
    assert store.get(1, 0, 4) is None
    assert _wanted(store, 0) == (0, 0)
    # An empty final report ends the stream where it stands.
    _add(store, 0, 0, 2)
    store.add(0, 2, np.zeros(0, np.int64), np.zeros(0, np.int32), True)
    assert _wanted(store, 0) is None


@settings(max_examples=100, deadline=None)
@given(
    reports=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), max_size=20),
    cursor=st.integers(0, 30),
)
def test_store_holds_exactly_the_contiguous_prefix_it_was_given(reports, cursor) -> None:
    store = SummaryStore(1, lookahead=1000)
    store.start((cursor,))
    known = cursor
    for start, count in reports:
        _add(store, 0, start, count)
        if start <= known:
            known = max(known, start + count)
    with store.cond:
        assert store.wanted(0) == (known, cursor)
    assert _get(store, 0, cursor, known - cursor) == _expected(cursor, known - cursor)
    assert store.get(0, cursor, known - cursor + 1) is None


# ---- bad samples' reasons --------------------------------------------------------------------


def _reasons(start: int, count: int) -> np.ndarray:
    """Recognisable reason codes for seqs [start, start + count): every third seq is bad."""
    seqs = np.arange(start, start + count)
    return np.where(seqs % 3 == 0, seqs % 5 + 1, 0).astype(np.uint8)


def _add_bad(store: SummaryStore, source: int, start: int, count: int, *, end: bool = False) -> None:
    store.add(source, start, _rows(start, count), _lengths(start, count), end, reasons=_reasons(start, count))


def test_reasons_are_none_until_all_are_known_and_then_sliced_like_get() -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    assert store.reasons(0, 0, 1) is None
    _add_bad(store, 0, 0, 5)
    assert store.reasons(0, 0, 6) is None
    got = store.reasons(0, 1, 4)
    assert got.dtype == np.uint8
    assert got.tolist() == _reasons(1, 4).tolist()
    assert store.reasons(0, 5, 0).tolist() == []
    # A report overlapping what is known keeps the known reasons.
    store.add(0, 3, _rows(3, 4), _lengths(3, 4), False, reasons=np.full(4, 5, np.uint8))
    assert store.reasons(0, 0, 7).tolist() == _reasons(0, 5).tolist() + [5, 5]
    assert _get(store, 0, 0, 5) == _expected(0, 5), "get is unchanged"


def test_reasons_not_sent_are_zero() -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    _add(store, 0, 0, 3)  # no reasons: an older loader
    store.add(0, 3, _rows(3, 2), _lengths(3, 2), False, reasons=np.zeros(0, np.uint8))  # empty: the same
    _add_bad(store, 0, 5, 4)
    assert store.reasons(0, 0, 9).tolist() == [0] * 5 + _reasons(5, 4).tolist()


def test_reasons_survive_advance_and_rewind() -> None:
    store = SummaryStore(2, lookahead=100)
    store.start((0, 0))
    _add_bad(store, 0, 0, 10)
    _add_bad(store, 1, 0, 3)
    store.advance((4, 3))
    with pytest.raises(ValueError, match=r"before the store's base 4"):
        store.reasons(0, 3, 1)
    assert store.reasons(0, 4, 6).tolist() == _reasons(4, 6).tolist()
    assert store.reasons(1, 3, 1) is None
    _add_bad(store, 1, 3, 6)
    assert store.reasons(1, 3, 6).tolist() == _reasons(3, 6).tolist()
    store.advance((12, 3))  # past what is known: everything dropped
    assert store.reasons(0, 12, 1) is None
    _add_bad(store, 0, 10, 5)
    assert store.reasons(0, 12, 3).tolist() == _reasons(12, 3).tolist()
    store.rewind((2, 1), step=0, delivered_below=0)
    assert store.reasons(0, 2, 1) is None and store.reasons(1, 1, 1) is None
    _add_bad(store, 0, 2, 4)
    assert store.reasons(0, 2, 4).tolist() == _reasons(2, 4).tolist()
    assert _get(store, 0, 2, 4) == _expected(2, 4)


@settings(max_examples=50, deadline=None)
@given(
    reports=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), max_size=20),
    cursors=st.lists(st.integers(0, 80), max_size=4),
)
def test_reasons_stay_aligned_with_rows(reports, cursors) -> None:
    store = SummaryStore(1, lookahead=1000)
    store.start((0,))
    cursor = 0
    for i, (start, count) in enumerate(reports):
        _add_bad(store, 0, start, count)
        if i < len(cursors):
            cursor = max(cursor, cursors[i])
            store.advance((cursor,))
    with store.cond:
        count = store.wanted(0)[0] - cursor
    if count < 0:  # the cursor moved past what is known
        assert store.get(0, cursor, 0) is None and store.reasons(0, cursor, 0) is None
        return
    rows, _, _ = store.get(0, cursor, count)
    assert ((rows - 7) // 100).tolist() == list(range(cursor, cursor + count))
    assert store.reasons(0, cursor, count).tolist() == _reasons(cursor, count).tolist()
    assert store.reasons(0, cursor, count + 1) is None


# ---- wait_for_summary ------------------------------------------------------------------------


class _WatchedCondition(threading.Condition):
    """A condition that records that someone waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_wait_for_summary_returns_data_added_by_another_thread() -> None:
    store = SummaryStore(1, lookahead=10)
    store.cond = _WatchedCondition()
    store.start((0,))
    _add(store, 0, 0, 2)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(wait_for_summary(store, 0, 0, 5, timeout_s=30)))
    waiter.start()
    try:
        assert store.cond.waiting.wait(timeout=10), "wait_for_summary never waited"
        assert not result
        _add(store, 0, 2, 3)
    finally:
        waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert len(result) == 1 and result[0] is not None
    rows, lengths, _ = result[0]
    assert (rows.tolist(), lengths.tolist()) == _expected(0, 5)


def test_wait_for_summary_keeps_waiting_through_partial_data() -> None:
    store = SummaryStore(1, lookahead=10)
    store.start((0,))
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(wait_for_summary(store, 0, 0, 4, timeout_s=30)))
    waiter.start()
    try:
        for seq in range(4):
            _add(store, 0, seq, 1)
    finally:
        waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert result[0] is not None and result[0][0].tolist() == _rows(0, 4).tolist()


def test_wait_for_summary_gives_up_after_its_timeout() -> None:
    store = SummaryStore(1, lookahead=10)
    store.start((0,))
    _add(store, 0, 0, 2)
    began = time.monotonic()
    assert wait_for_summary(store, 0, 0, 3, timeout_s=0.05) is None
    assert time.monotonic() - began >= 0.05


def test_wait_for_summary_with_the_data_at_hand_or_no_time() -> None:
    store = SummaryStore(1, lookahead=10)
    store.start((0,))
    _add(store, 0, 0, 3)
    got = wait_for_summary(store, 0, 1, 2, timeout_s=0)
    assert got is not None and got[0].tolist() == _rows(1, 2).tolist()
    assert wait_for_summary(store, 0, 0, 4, timeout_s=0) is None
    store.advance((2,))
    with pytest.raises(ValueError, match=r"seq 1 is before the store's base 2"):
        wait_for_summary(store, 0, 1, 1, timeout_s=1)


def test_features_stay_aligned_with_rows_through_adds_and_advances() -> None:
    store = SummaryStore(1, lookahead=100)
    store.start((0,))
    store.add(0, 0, np.arange(4, dtype=np.int64), np.ones(4, np.int32), False, {"images": np.array([1.0, 2, 3, 4])})
    # An overlapping report: known positions keep their values; a new feature is 0 before it.
    store.add(
        0,
        2,
        np.arange(2, 6, dtype=np.int64),
        np.ones(4, np.int32),
        False,
        {"images": np.array([9.0, 9, 5, 6]), "crops": np.array([0.0, 0, 7, 8])},
    )
    _, _, features = store.get(0, 0, 6)
    assert features["images"].tolist() == [1, 2, 3, 4, 5, 6]
    assert features["crops"].tolist() == [0, 0, 0, 0, 7, 8]
    store.advance((3,))
    _, _, features = store.get(0, 3, 3)
    assert features["images"].tolist() == [4, 5, 6]
    assert features["crops"].tolist() == [0, 7, 8]


def test_a_rewind_forgets_what_is_known_and_pulls_again_from_its_cursors_even_after_the_end() -> None:
    store = SummaryStore(2, lookahead=10)
    store.start((0, 0))
    _add(store, 0, 0, 30, end=True)  # source 0 ended at 30
    _add(store, 1, 0, 10)
    store.advance((25, 8), steps=9)
    store.delivered(7)
    assert _wanted(store, 0) is None
    store.rewind((12, 4), step=4, delivered_below=3)
    assert store.planned_steps == 4 and store.delivered_below == 3
    assert _wanted(store, 0) == (12, 12) and _wanted(store, 1) == (4, 4)
    _add(store, 0, 40, 5)  # a late answer to a request from before the rewind: a gap, ignored
    assert _get(store, 0, 12, 1) is None
    _add(store, 0, 12, 18, end=True)
    assert _get(store, 0, 12, 18) == (_rows(12, 18).tolist(), _lengths(12, 18).tolist())
    assert _wanted(store, 0) is None  # up to the end again


class _ReadingLoader:
    """A fake loader channel for `SummaryPuller`: it has read `read_ahead` samples past the
    planner's cursor that the last summary request named (`planned_seq`), and answers what it
    has read from `from_seq` on, up to `max_samples`; it counts the calls."""

    def __init__(self, read_ahead: int) -> None:
        self.read_ahead = read_ahead
        self.read = 0
        self.calls = 0

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **_):
        def call(request, timeout=None):
            self.calls += 1
            self.read = max(self.read, request.planned_seq + self.read_ahead)
            n = max(min(request.max_samples, self.read - request.from_seq), 0)
            return loader_pb2.GetSummaryResponse(
                start_seq=request.from_seq,
                row=encode_array(np.arange(request.from_seq, request.from_seq + n, dtype=np.int64)),
                length=encode_array(np.full(n, 5, np.int32)),
                digest=encode_array(np.arange(request.from_seq, request.from_seq + n, dtype=np.int64) + 1),
            )

        return call

    def unary_stream(self, *args, **kwargs):
        return None

    def close(self) -> None:
        pass


def test_a_pull_takes_what_the_loader_read_ahead_so_a_step_costs_less_than_one_call() -> None:
    """The planner pulls once it knows less than a look-ahead past its cursor, and then asks for
    `PULL_LOOKAHEADS` look-aheads: a loader that reads 4,096 samples ahead answers several
    steps' samples in one call. Pulling one look-ahead at a time made it a call every 4 steps
    of 64 samples against a look-ahead of 256 (each call about 1 ms of CPU on either side)."""
    store = SummaryStore(1, lookahead=256)
    loader = _ReadingLoader(read_ahead=4096)
    target = SummaryTarget("loader:1", 1 << 30, Routing.of(["0"]), (0, "0"), num_rows=1 << 30, stream_end=1 << 30)
    puller = SummaryPuller(store, num_sources=1, target=lambda k, seq: target, connect=lambda address: loader, observe=lambda *a, **k: None)
    steps, batch = 120, 64
    try:
        store.start((0,))
        for step in range(steps):
            assert wait_for_summary(store, 0, step * batch, batch, timeout_s=10) is not None
            store.advance(((step + 1) * batch,), steps=step + 1)
        assert store.pull_samples == PULL_LOOKAHEADS * 256
        # 8 calls: each answers about 1,000 samples (16 steps); with one look-ahead a call, 30
        assert loader.calls <= steps // 12, f"{loader.calls} summary calls for {steps} steps"
    finally:
        puller.stop()
