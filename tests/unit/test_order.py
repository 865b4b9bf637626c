"""Tests of batchplane.core.order: the seeded, windowed block shuffle of a source's rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batchplane.core.order import SampleOrder, Window, stable_key

row_group_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=15)
window_sizes = st.integers(1, 6)
seeds = st.integers(0, 2**63 - 1)
epochs = st.integers(0, 10_000)
names = st.text(min_size=0, max_size=12)


def _order(sizes, *, seed=0, name="web", window=2, shuffle=True) -> SampleOrder:
    return SampleOrder(sizes, seed=seed, source_name=name, window_row_groups=window, shuffle=shuffle)


def _epoch_rows(order: SampleOrder, epoch: int) -> np.ndarray:
    windows = order.windows(epoch)
    parts = [order.window_rows(epoch, w) for w in windows]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@settings(max_examples=150, deadline=None)
@given(sizes=row_group_sizes, window=window_sizes, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_an_epoch_is_a_permutation_of_all_rows(sizes, window, seed, epoch, shuffle) -> None:
    order = _order(sizes, seed=seed, window=window, shuffle=shuffle)
    assert order.num_rows == sum(sizes)
    rows = _epoch_rows(order, epoch)
    assert rows.dtype == np.int64
    assert np.array_equal(np.sort(rows), np.arange(sum(sizes)))


@settings(max_examples=150, deadline=None)
@given(sizes=row_group_sizes, window=window_sizes, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_windows_partition_positions_and_row_groups(sizes, window, seed, epoch, shuffle) -> None:
    order = _order(sizes, seed=seed, window=window, shuffle=shuffle)
    windows = order.windows(epoch)
    assert len(windows) == -(-len(sizes) // window)
    start = 0
    groups: list[int] = []
    for i, w in enumerate(windows):
        assert isinstance(w, Window)
        assert w.index == i
        assert w.start == start
        assert w.size == sum(sizes[g] for g in w.row_groups)
        if i < len(windows) - 1:
            assert len(w.row_groups) == window
        else:
            assert 1 <= len(w.row_groups) <= window
        # A window's rows are exactly its row groups' rows.
        wrows = order.window_rows(epoch, w)
        assert len(wrows) == w.size
        expected = [r for g in w.row_groups for r in range(sum(sizes[:g]), sum(sizes[: g + 1]))]
        assert sorted(wrows.tolist()) == sorted(expected)
        start += w.size
        groups.extend(w.row_groups)
    assert start == order.num_rows
    assert sorted(groups) == list(range(len(sizes)))


@settings(max_examples=60, deadline=None)
@given(sizes=row_group_sizes, window=window_sizes, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_window_at_returns_the_window_holding_the_position(sizes, window, seed, epoch, shuffle) -> None:
    order = _order(sizes, seed=seed, window=window, shuffle=shuffle)
    windows = order.windows(epoch)
    for position in range(order.num_rows):
        w = order.window_at(epoch, position)
        assert w in windows
        assert w.start <= position < w.start + w.size


@settings(max_examples=80, deadline=None)
@given(sizes=row_group_sizes, window=window_sizes, seed=seeds, epoch=epochs, name=names, shuffle=st.booleans())
def test_two_instances_with_the_same_arguments_agree(sizes, window, seed, epoch, name, shuffle) -> None:
    a = _order(sizes, seed=seed, name=name, window=window, shuffle=shuffle)
    b = _order(list(sizes), seed=seed, name=name, window=window, shuffle=shuffle)
    assert a.windows(epoch) == b.windows(epoch)
    assert np.array_equal(_epoch_rows(a, epoch), _epoch_rows(b, epoch))
    # and one instance agrees with itself after other epochs were computed
    first = _epoch_rows(a, epoch)
    for other in range(epoch + 1, epoch + 6):
        a.windows(other)
    assert np.array_equal(_epoch_rows(a, epoch), first)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10), window=window_sizes, seed=seeds, epoch=epochs)
def test_different_epochs_give_different_orders(sizes, window, seed, epoch) -> None:
    assume(sum(sizes) >= 50)
    order = _order(sizes, seed=seed, window=window)
    assert not np.array_equal(_epoch_rows(order, epoch), _epoch_rows(order, epoch + 1))


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    window=window_sizes,
    seed=seeds,
    epoch=epochs,
    pair=st.lists(names, min_size=2, max_size=2, unique=True),
)
def test_different_source_names_give_different_orders(sizes, window, seed, epoch, pair) -> None:
    assume(sum(sizes) >= 50)
    a = _order(sizes, seed=seed, name=pair[0], window=window)
    b = _order(sizes, seed=seed, name=pair[1], window=window)
    assert not np.array_equal(_epoch_rows(a, epoch), _epoch_rows(b, epoch))


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10), window=window_sizes, seed=seeds, epoch=epochs)
def test_different_seeds_give_different_orders(sizes, window, seed, epoch) -> None:
    assume(sum(sizes) >= 50)
    a = _order(sizes, seed=seed, window=window)
    b = _order(sizes, seed=seed ^ 1, window=window)
    assert not np.array_equal(_epoch_rows(a, epoch), _epoch_rows(b, epoch))


@settings(max_examples=80, deadline=None)
@given(sizes=row_group_sizes, window=window_sizes, seed=seeds, epoch=epochs)
def test_no_shuffle_keeps_file_order(sizes, window, seed, epoch) -> None:
    order = _order(sizes, seed=seed, window=window, shuffle=False)
    assert np.array_equal(_epoch_rows(order, epoch), np.arange(sum(sizes)))
    groups = [g for w in order.windows(epoch) for g in w.row_groups]
    assert groups == list(range(len(sizes)))


def test_shuffle_changes_the_order_of_a_large_source() -> None:
    order = _order([30, 30, 30], seed=3, window=2)
    rows = _epoch_rows(order, 0)
    assert not np.array_equal(rows, np.arange(90))


def test_small_example_windows() -> None:
    order = _order([3, 5, 2], window=2, shuffle=False)
    windows = order.windows(0)
    assert windows == (
        Window(index=0, row_groups=(0, 1), start=0, size=8),
        Window(index=1, row_groups=(2,), start=8, size=2),
    )
    assert order.window_at(0, 0) == windows[0]
    assert order.window_at(0, 7) == windows[0]
    assert order.window_at(0, 8) == windows[1]
    assert order.window_at(0, 9) == windows[1]
    assert order.rows(windows[1]).tolist() == [8, 9]


def test_empty_row_groups_are_skipped_by_window_at() -> None:
    order = _order([0, 4, 0, 0, 3, 0], window=1, shuffle=False)
    assert [order.window_at(0, p).row_groups for p in range(7)] == [(1,)] * 4 + [(4,)] * 3


def test_stable_key_is_deterministic_and_64_bit() -> None:
    # Pinned values: the key must be equal in every process and every version, or resumed jobs
    # would read a different order.
    assert stable_key("web") == 8401084237428129872
    assert stable_key("code") == 4469796212941144847
    assert stable_key("") == 13020603013274838756
    assert stable_key("web") == stable_key("w" + "eb")


@settings(max_examples=200, deadline=None)
@given(pair=st.lists(st.text(max_size=20), min_size=2, max_size=2, unique=True))
def test_stable_key_differs_for_different_names(pair) -> None:
    a, b = (stable_key(n) for n in pair)
    assert 0 <= a < 2**64 and 0 <= b < 2**64
    assert a != b


@pytest.mark.parametrize("window", [0, -1])
def test_bad_window_row_groups_is_rejected(window: int) -> None:
    with pytest.raises(ValueError, match=rf"window_row_groups must be >= 1, got {window}"):
        _order([3, 3], window=window)


@pytest.mark.parametrize("position", [-1, 10, 11, 1000])
def test_position_outside_the_source_is_rejected(position: int) -> None:
    order = _order([4, 6], window=1)
    with pytest.raises(ValueError, match=rf"position {position} outside \[0, 10\)"):
        order.window_at(0, position)
