"""Tests of batchplane.planner.intervals: every IntervalSet operation against a Python set of
the same integers, the normalized representation, sharing between versions, JSON and errors."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.planner.intervals import IntervalSet

SETTINGS = settings(max_examples=100, deadline=None)
UNIVERSE = range(0, 90)  # every generated integer lies below 80

pairs = st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda p: (p[0], p[0] + p[1]))
range_lists = st.lists(pairs, max_size=8)


def model(ranges) -> set[int]:
    return {x for lo, hi in ranges for x in range(lo, hi)}


def assert_normalized(s: IntervalSet) -> None:
    ranges = s.ranges
    assert all(isinstance(lo, int) and isinstance(hi, int) for lo, hi in ranges)
    assert all(0 <= lo < hi for lo, hi in ranges), "negative or empty range"
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:])), "unsorted, overlapping or adjacent"


def assert_matches(s: IntervalSet, expected: set[int]) -> None:
    assert_normalized(s)
    assert model(s.ranges) == expected
    assert len(s) == s.count == len(expected)
    assert s.is_empty == (not expected)
    if expected:
        assert (s.first, s.end) == (min(expected), max(expected) + 1)


@SETTINGS
@given(range_lists)
def test_the_constructor_normalizes_any_ranges(ranges: list[tuple[int, int]]) -> None:
    assert_matches(IntervalSet(ranges), model(ranges))


@SETTINGS
@given(range_lists, st.lists(st.tuples(st.integers(0, 30), pairs), max_size=12))
def test_add_agrees_with_sets_and_never_changes_older_versions(
    start: list[tuple[int, int]], steps: list[tuple[int, tuple[int, int]]]
) -> None:
    """Each step adds a range to some earlier version, so versions branch from shared lists."""
    versions = [IntervalSet(start)]
    models = [model(start)]
    for pick, (lo, hi) in steps:
        i = pick % len(versions)
        versions.append(versions[i].add(lo, hi))
        models.append(models[i] | set(range(lo, hi)))
    for s, expected in zip(versions, models):
        assert_matches(s, expected)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=30), st.integers(0, 40))
def test_a_growing_cursor_with_gaps_and_branches(steps: list[tuple[int, int]], branch_at: int) -> None:
    """The common case, growing at the end, plus a branch from an old version grown differently."""
    versions, models = [IntervalSet()], [set()]
    for gap, length in steps:
        lo = (versions[-1].end if models[-1] else 0) + gap
        versions.append(versions[-1].add(lo, lo + length))
        models.append(models[-1] | set(range(lo, lo + length)))
    old = branch_at % len(versions)
    branch = versions[old].add(200, 201).add(203, 204)
    for s, expected in zip(versions, models):
        assert_matches(s, expected)
    assert_matches(branch, models[old] | {200, 203})


@SETTINGS
@given(range_lists, range_lists)
def test_union_difference_and_intersection_agree_with_sets(a: list, b: list) -> None:
    sa, sb = IntervalSet(a), IntervalSet(b)
    assert_matches(sa.union(sb), model(a) | model(b))
    assert_matches(sa.difference(sb), model(a) - model(b))
    assert_matches(sa.intersection(sb), model(a) & model(b))


@SETTINGS
@given(range_lists, range_lists)
def test_operations_on_versions_that_share_lists(a: list, b: list) -> None:
    sa = IntervalSet()
    for lo, hi in sorted(a):
        sa = sa.add(lo, hi)
    sb = sa.add(100, 105).add(107, 110)
    assert_matches(sa.union(IntervalSet(b)), model(a) | model(b))
    assert_matches(sb.difference(sa), set(range(100, 105)) | set(range(107, 110)))
    assert_matches(sb.intersection(IntervalSet(b)), model(a) & model(b))
    assert_matches(sa, model(a))


@SETTINGS
@given(range_lists)
def test_membership_and_overlaps_agree_with_sets(ranges: list) -> None:
    s, expected = IntervalSet(ranges), model(ranges)
    for x in UNIVERSE:
        assert (x in s) == (x in expected)
    for lo in range(0, 85, 3):
        for hi in (lo, lo + 1, lo + 4, lo + 17):
            assert s.overlaps(lo, hi) == bool(expected & set(range(lo, hi)))


@SETTINGS
@given(range_lists, range_lists)
def test_equal_sets_are_equal_and_hash_alike(a: list, b: list) -> None:
    sa, sb = IntervalSet(a), IntervalSet(b)
    assert (sa == sb) == (model(a) == model(b))
    rebuilt = IntervalSet()
    for lo, hi in reversed(a):
        rebuilt = rebuilt.add(lo, hi)
    assert rebuilt == sa and hash(rebuilt) == hash(sa)


@SETTINGS
@given(range_lists)
def test_json_and_pickle_round_trips(ranges: list) -> None:
    s = IntervalSet(ranges).add(150, 160).add(170, 171)
    text = json.dumps(s.to_list())
    assert IntervalSet.from_list(json.loads(text)) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert IntervalSet.from_list(json.loads(text)).to_list() == json.loads(text)


def test_small_examples() -> None:
    s = IntervalSet([(5, 7), (0, 3), (3, 4), (9, 9)])
    assert s.ranges == ((0, 4), (5, 7))
    assert list(s) == [(0, 4), (5, 7)]
    assert s.to_list() == [[0, 4], [5, 7]]
    assert repr(s) == "IntervalSet([(0, 4), (5, 7)])"
    assert s.add(4, 5).ranges == ((0, 7),)
    assert s.add(7, 10).ranges == ((0, 4), (5, 10))
    assert "3" not in s and 3.0 not in s and -1 not in s
    assert IntervalSet.empty() == IntervalSet() and not IntervalSet.empty()
    assert {IntervalSet([(0, 2)]), IntervalSet([(0, 1), (1, 2)])} == {IntervalSet([(0, 2)])}


def test_adding_nothing_or_a_subset_returns_the_same_set() -> None:
    s = IntervalSet([(0, 10)])
    assert s.add(3, 3) is s and s.add(2, 8) is s and s.union(IntervalSet()) is s


@pytest.mark.parametrize("what", ["first", "end"])
def test_an_empty_set_has_no_first_or_end(what: str) -> None:
    with pytest.raises(ValueError, match=f"empty interval set has no {what}"):
        getattr(IntervalSet(), what)


BAD_PAIRS = [
    ((3, 2), "lo must be <= hi"),
    ((-1, 2), "must be >= 0"),
    ((-3, -1), "must be >= 0"),
    ((1.0, 2), "must be integers"),
    ((True, 2), "must be integers"),
    (("1", 2), "must be integers"),
    ((1, 2, 3), r"expected a \(lo, hi\) pair"),
    (5, r"expected a \(lo, hi\) pair"),
]


@pytest.mark.parametrize(("pair", "problem"), BAD_PAIRS)
def test_bad_pairs_are_refused_by_name(pair, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        IntervalSet([(0, 1), pair])
    assert repr(pair) in str(caught.value)
    if isinstance(pair, tuple) and len(pair) == 2:
        with pytest.raises(ValueError, match=problem):
            IntervalSet().add(*pair)
        with pytest.raises(ValueError, match=problem):
            IntervalSet().overlaps(*pair)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"0": [0, 1]}, "must be a list of"),
        ([[0, 1], [4, 2]], r"entry 1: bad range \[4, 2\]: lo must be <= hi"),
        ([[0, 1], 7], "entry 1: expected a \\[lo, hi\\] pair, got 7"),
        ([[0, 1, 2]], r"entry 0: bad range \[0, 1, 2\]"),
        ([[0, None]], r"entry 0: bad range \[0, None\]: bounds must be integers"),
        ([[0.5, 1]], "entry 0: .*must be integers"),
        ([[-2, 1]], "entry 0: .*must be >= 0"),
    ],
)
def test_from_list_names_the_bad_entry(data, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        IntervalSet.from_list(data)


def test_numpy_integers_are_bounds() -> None:
    np = pytest.importorskip("numpy")
    s = IntervalSet([(np.int64(2), np.int32(5))]).add(np.int64(5), np.int64(6))
    assert s.ranges == ((2, 6),) and all(type(b) is int for r in s.ranges for b in r)
    assert np.int64(3) in s
