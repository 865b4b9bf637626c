"""batchplane.journal.steplist: a chunked sorted list behaves as the sorted tuple it stands for,
under any sequence of appends, inserts and prefix drops, at chunk sizes small enough that every
operation crosses chunk boundaries."""

from __future__ import annotations

import bisect
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.journal import steplist
from batchplane.journal.steplist import ChunkedList


def _key(item: tuple[int, str]) -> int:
    return item[0]


def _check(got: ChunkedList, want: list) -> None:
    assert len(got) == len(want)
    assert list(got) == want
    assert got == tuple(want) and tuple(want) == got and got == want
    assert [got[i] for i in range(len(want))] == want
    assert [got[-i] for i in range(1, len(want) + 1)] == [want[-i] for i in range(1, len(want) + 1)]
    assert got[1:3] == tuple(want[1:3])
    with pytest.raises(IndexError):
        got[len(want)]
    keys = [k for k, _ in want]
    for probe in range(-1, (keys[-1] + 2) if keys else 2):
        for lo in {0, len(want) // 2, len(want)}:
            assert got.bisect_left(probe, lo) == bisect.bisect_left(keys, probe, lo=lo)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 60), max_size=12)),  # keys to add (new ones only)
        st.tuples(st.just("drop"), st.integers(0, 20)),  # drop this many from the front
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(0, 60), unique=True, max_size=30), operations)
def test_a_chunked_list_is_the_sorted_list_it_stands_for(chunk: int, start: list[int], ops) -> None:
    with mock.patch.object(steplist, "CHUNK", chunk):
        want = [(k, f"v{k}") for k in sorted(start)]
        got = ChunkedList(want, key=_key)
        _check(got, want)
        version = 0
        for op, arg in ops:
            version += 1
            previous, before = got, list(got)
            if op == "add":
                keys = sorted(set(arg) - {k for k, _ in want})
                added = [(k, f"v{k}@{version}") for k in keys]
                last = want[-1][0] if want else -1
                positions = None if not want or not keys or keys[0] > last else [got.bisect_left(k) for k in keys]
                got = got.merged(added, positions)
                want = sorted(want + added)
            else:
                got = got.from_position(arg)
                want = want[arg:]
            _check(got, want)
            assert list(previous) == before  # a version never changes the one it came from
        assert ChunkedList(want, key=_key) == got


def test_appending_copies_the_last_chunk_only_and_later_states_share_the_rest() -> None:
    items = [(k, "x") for k in range(10 * steplist.CHUNK)]
    first = ChunkedList(items, key=_key)
    second = first.merged([(10 * steplist.CHUNK, "y")], None)
    assert second._chunks[:9] == first._chunks[:9]
    assert all(a is b for a, b in zip(second._chunks[:9], first._chunks[:9]))
    assert max(len(c) for c in second._chunks) <= steplist.CHUNK
    assert len(second) == len(first) + 1 and list(first) == items  # the first state is unchanged
