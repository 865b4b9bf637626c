"""Tests of batchplane.core.payload (the normalized Arrow form of each column kind) and of
batchplane.loader.rows (gathering rows with the fewest copies)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.payload import PayloadColumn, PayloadError, arrow_type, empty, normalize, schema_fields, values_of
from batchplane.loader.rows import gather, rows_nbytes, runs, shuffle

MASK = PayloadColumn("mask", "token", "uint8", (), fill=7)
PAIRS = PayloadColumn("pairs", "token", "float32", (2,))
NUM = PayloadColumn("num", "sample", "int64", (), fill=-1)
GRID = PayloadColumn("grid", "sample", "int64", (3,))
PIX = PayloadColumn("pix", "blob", "uint8", (2,))


@pytest.mark.parametrize(
    ("column", "expected"),
    [
        (MASK, pa.list_(pa.uint8())),
        (NUM, pa.int64()),
        (GRID, pa.list_(pa.int64(), 3)),
        (PIX, pa.list_(pa.uint8())),
    ],
)
def test_arrow_type_per_kind(column: PayloadColumn, expected: pa.DataType) -> None:
    assert arrow_type(column) == expected
    assert schema_fields([column])[0].type == expected


def test_empty_values_follow_the_token_lengths() -> None:
    lengths = np.array([2, 0, 3])
    assert empty(MASK, lengths).to_pylist() == [[7, 7], [], [7, 7, 7]]
    assert empty(PAIRS, lengths).to_pylist() == [[0.0] * 4, [], [0.0] * 6]
    assert empty(NUM, lengths).to_pylist() == [-1, -1, -1]
    assert empty(GRID, lengths).to_pylist() == [[0, 0, 0]] * 3
    assert empty(PIX, lengths).to_pylist() == [[], [], []]


def test_normalize_casts_fills_nulls_and_flattens_nested_rows() -> None:
    lengths = np.array([2, 1, 1])
    assert normalize(MASK, pa.array([[1, 2], None, [3]]), lengths).to_pylist() == [[1, 2], [7], [3]]
    assert normalize(NUM, pa.array([1.0, None, 3.0]), lengths).to_pylist() == [1, -1, 3]
    assert normalize(GRID, pa.array([[1, 2, 3], None, [4, 5, 6]]), lengths).to_pylist() == [[1, 2, 3], [0, 0, 0], [4, 5, 6]]
    assert normalize(GRID, pa.array([[[1], [2, 3]], None, [[4, 5, 6]]]), lengths).to_pylist() == [[1, 2, 3], [0, 0, 0], [4, 5, 6]]
    got = normalize(PIX, pa.array([[[1, 2], [3, 4]], [], None]), lengths)
    assert got.type == arrow_type(PIX) and got.to_pylist() == [[1, 2, 3, 4], [], []]


BLOB = PayloadColumn("blob", "blob", "int64", ())


def _leaves_of(row: object) -> list[int]:
    """A row's leaf values, depth first; a null list holds none."""
    if row is None:
        return []
    if isinstance(row, list):
        return [v for item in row for v in _leaves_of(item)]
    return [row]


@st.composite
def nested_arrays(draw: st.DrawFn) -> tuple[pa.Array, list]:
    """A list array 1 to 3 levels deep (list, large_list or fixed-size list at each level, nulls
    at any list level, never among the leaves), sliced or not, with its rows as Python values."""
    kinds = draw(st.lists(st.sampled_from(["list", "large", "fixed1", "fixed2", "fixed3"]), min_size=1, max_size=3))

    def value(level: int) -> st.SearchStrategy:
        if level == len(kinds):
            return st.integers(-5, 5)
        kind = kinds[level]
        size = int(kind[-1]) if kind.startswith("fixed") else None
        inner = st.lists(value(level + 1), min_size=size or 0, max_size=size or 4)
        return st.one_of(st.none(), inner) if level > 0 else inner

    arrow: pa.DataType = pa.int64()
    for kind in reversed(kinds):
        arrow = {"list": pa.list_, "large": pa.large_list}[kind](arrow) if not kind.startswith("fixed") else pa.list_(arrow, int(kind[-1]))
    rows = draw(st.lists(st.one_of(st.none(), value(0)), max_size=8))
    array = pa.array(rows, type=arrow)
    start = draw(st.integers(0, len(rows)))
    stop = draw(st.integers(start, len(rows)))
    return array.slice(start, stop - start), rows[start:stop]


@settings(max_examples=200, deadline=None)
@given(nested_arrays())
def test_normalize_flattens_any_nesting_of_lists_into_each_rows_leaves(case: tuple[pa.Array, list]) -> None:
    array, rows = case
    got = normalize(BLOB, array, np.ones(len(rows), np.int64))
    assert got.to_pylist() == [_leaves_of(row) for row in rows]


@pytest.mark.parametrize(
    ("column", "array", "message"),
    [
        (MASK, pa.array([[1], [2], [3]]), "sample 0 has 1 values for 2 tokens"),
        (PAIRS, pa.array([[1, 2], [1, 2], [1, 2]]), "sample 0 has 2 values"),
        (GRID, pa.array([[1, 2], [1, 2, 3], [1, 2, 3]]), "sample 0 has 2 values"),
        (PIX, pa.array([[1, 2, 3], [], []]), "not a multiple of a row"),
        (NUM, pa.array([[1], [2], [3]]), "one number per sample"),
        (MASK, pa.array(["a", "b", "c"]), "holds a list per sample"),
        (MASK, pa.array([["a", "b"], ["c"], ["d"]]), "cannot be token values of uint8"),
        (NUM, pa.array([1, 2]), "2 rows for 3 samples"),
        (PIX, pa.array([[1, None], [], []]), "null values inside"),
    ],
)
def test_normalize_names_the_column_of_a_broken_declaration(column: PayloadColumn, array: pa.Array, message: str) -> None:
    with pytest.raises(PayloadError, match=message) as info:
        normalize(column, array, np.array([2, 1, 1]))
    assert repr(column.name) in str(info.value)


def test_values_of_a_slice_keeps_its_offset() -> None:
    grid = normalize(GRID, pa.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), np.ones(3))
    values, offsets = values_of(GRID, grid.slice(1, 2))
    assert offsets is None and values.tolist() == [4, 5, 6, 7, 8, 9]
    pix = normalize(PIX, pa.array([[1, 2], [3, 4, 5, 6], []]), np.ones(3))
    values, offsets = values_of(PIX, pix.slice(1, 2))
    assert values[offsets[0] : offsets[-1]].tolist() == [3, 4, 5, 6] and np.diff(offsets).tolist() == [4, 0]


# ---- loader.rows -----------------------------------------------------------------------------


def test_runs_break_on_a_gap_or_another_array() -> None:
    assert runs(np.array([0, 0, 0, 1, 1]), np.array([3, 4, 6, 7, 8])).tolist() == [0, 2, 3, 5]
    assert runs(np.zeros(0), np.zeros(0)).tolist() == [0]


def test_one_run_is_a_slice_without_a_copy() -> None:
    ids = pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32()))
    got = gather([ids], np.zeros(2, np.int64), np.array([1, 2]))
    assert got.to_pylist() == [[3], [4, 5, 6]]
    assert got.values.buffers()[1].address == ids.values.buffers()[1].address  # the same buffer


ARRAYS = {
    "list": lambda rng, n: pa.array([rng.integers(0, 100, rng.integers(0, 6)).tolist() for _ in range(n)], pa.list_(pa.int32())),
    "fixed": lambda rng, n: pa.FixedSizeListArray.from_arrays(pa.array(rng.random(3 * n)), 3),
    "plain": lambda rng, n: pa.array(rng.integers(-5, 5, n), pa.int16()),
    "nulls": lambda rng, n: pa.array([None if i % 3 == 0 else [i] for i in range(n)], pa.list_(pa.int64())),
    "bool": lambda rng, n: pa.array(rng.random(n) < 0.5),
}


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(ARRAYS)),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    seed=st.integers(0, 2**31),
    sliced=st.booleans(),
)
def test_gather_equals_a_take_of_the_concatenation(kind: str, sizes: list[int], seed: int, sliced: bool) -> None:
    rng = np.random.default_rng(seed)
    arrays = [ARRAYS[kind](rng, n + 2) for n in sizes]
    if sliced:  # windows and fetches hand over slices: offsets must be respected
        arrays = [a.slice(1, len(a) - 2) for a in arrays]
    which = rng.integers(0, len(arrays), int(rng.integers(0, 40)))
    if rng.random() < 0.3:  # grouped by array, as a fetch's windows are
        which = np.sort(which)
    index = np.array([rng.integers(0, len(arrays[w])) for w in which], np.int64)
    if rng.random() < 0.5:  # runs: consecutive rows
        index = np.array([min(len(arrays[w]) - 1, i + k % 3) for k, (w, i) in enumerate(zip(which, index))], np.int64)
    expected = [arrays[w][int(i)].as_py() for w, i in zip(which, index)]
    got = gather(arrays, which, index)
    assert got.type == arrays[0].type
    assert got.to_pylist() == expected
    perm = rng.permutation(sum(len(a) for a in arrays))
    flat = [v for a in arrays for v in a.to_pylist()]
    assert shuffle(arrays, perm).to_pylist() == [flat[i] for i in perm]


def test_rows_nbytes_counts_values_and_offsets() -> None:
    ids = pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32()))
    assert rows_nbytes(ids, np.array([0, 2])) == 4 * 5 + 4 * 2
    assert rows_nbytes(ids.slice(1, 2), np.array([1])) == 4 * 3 + 4
    grid = normalize(GRID, pa.array([[1, 2, 3]] * 3), np.ones(3))
    assert rows_nbytes(grid, np.array([0, 1])) == 2 * 3 * 8
    assert rows_nbytes(pa.array([1, 2, 3], pa.float32()), np.array([2])) == 4
