"""Tests of batchplane.loader.transforms: the default transform, per_sample, output checks and
normalization, binding a configured transform, and lengths."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchplane.core.config import SourceSettings
from batchplane.core.errors import ConfigError
from batchplane.loader.transforms import (
    BoundTransform,
    TransformError,
    bind_transform,
    check_output,
    lengths_of,
    per_sample,
    token_ids,
)

USER_MODULE = "bp_test_user_transforms"
BROKEN_MODULE = "bp_test_broken_transforms"

_USER_SOURCE = '''
import pyarrow as pa

from batchplane.loader.transforms import per_sample

NOT_CALLABLE = 3


def repeat_text(batch, *, times=1):
    """Token ids: the code point of each character of `text`, `times` over."""
    return pa.table(
        {"input_ids": pa.array([[ord(c) for c in t] * times for t in batch.column("text").to_pylist()], pa.list_(pa.int64()))}
    )


@per_sample
def word_lengths(row, *, minimum=0):
    words = [len(w) for w in row["text"].split()]
    return words if len(words) > minimum else None


def wrong_rows(batch):
    return pa.table({"input_ids": pa.array([[1]], pa.list_(pa.int64()))})
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(_USER_SOURCE))
    (tmp_path / f"{BROKEN_MODULE}.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    for name in (USER_MODULE, BROKEN_MODULE):
        sys.modules.pop(name, None)


def _ids(values, value_type=pa.int64(), *, large: bool = False) -> pa.Array:
    list_type = pa.large_list(value_type) if large else pa.list_(value_type)
    return pa.array(values, type=list_type)


# ---- token_ids and per_sample ----------------------------------------------------------------


def test_token_ids_renames_the_column_unchanged() -> None:
    tokens = _ids([[1, 2, 3], [4], None, []], pa.int32())
    batch = pa.table({"text": ["a", "b", "c", "d"], "tokens": tokens})
    out = token_ids(batch, column="tokens")
    assert out.schema.names == ["input_ids"]
    assert out.column("input_ids").type == pa.list_(pa.int32())
    assert out.column("input_ids").to_pylist() == [[1, 2, 3], [4], None, []]


def test_token_ids_default_column_is_input_ids() -> None:
    batch = pa.table({"input_ids": _ids([[7, 8]]), "other": [1]})
    out = token_ids(batch)
    assert out.schema.names == ["input_ids"]
    assert out.column("input_ids").to_pylist() == [[7, 8]]


def test_per_sample_applies_the_function_row_by_row() -> None:
    seen: list[dict] = []

    def fn(row, *, offset=0):
        """Doc of fn."""
        seen.append(row)
        return [row["a"] + offset, row["b"] + offset]

    transform = per_sample(fn)
    assert transform.__name__ == "fn"
    assert transform.__doc__ == "Doc of fn."
    out = transform(pa.table({"a": [1, 2, 3], "b": [10, 20, 30]}), offset=100)
    assert seen == [{"a": 1, "b": 10}, {"a": 2, "b": 20}, {"a": 3, "b": 30}]
    assert out.column("input_ids").type == pa.list_(pa.int64())
    assert out.column("input_ids").to_pylist() == [[101, 110], [102, 120], [103, 130]]


def test_per_sample_rejects_a_row_with_none() -> None:
    transform = per_sample(lambda row: None if row["x"] < 0 else [row["x"]] * row["x"])
    out = transform(pa.table({"x": [2, -1, 1, 0]}))
    ids, _ = check_output(out, 4)
    assert ids.to_pylist() == [[2, 2], None, [1], []]
    assert lengths_of(ids).tolist() == [2, 0, 1, 0]


def test_per_sample_on_an_empty_batch() -> None:
    out = per_sample(lambda row: [1])(pa.table({"x": pa.array([], pa.int64())}))
    assert out.num_rows == 0
    assert check_output(out, 0)[0].type == pa.list_(pa.int64())


# ---- check_output ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "num_rows", "message"),
    [
        ({"input_ids": [[1]]}, 1, r"must return a pyarrow\.Table, got dict"),
        (_ids([[1]]), 1, r"must return a pyarrow\.Table, got ListArray"),
        (None, 1, r"must return a pyarrow\.Table, got NoneType"),
        (pa.table({"input_ids": _ids([[1], [2]])}), 3, r"one row per input row: got 2 for 3"),
        (pa.table({"input_ids": _ids([[1], [2]])}), 1, r"one row per input row: got 2 for 1"),
        (pa.table({"tokens": _ids([[1]]), "text": ["a"]}), 1, r"no 'input_ids' column \(columns: tokens, text\)"),
        (
            pa.table({"input_ids": pa.array([["a"]], pa.list_(pa.string()))}),
            1,
            r"'input_ids' must be lists of integers, got list<item: string>",
        ),
        (
            pa.table({"input_ids": pa.array([[1.5]], pa.list_(pa.float64()))}),
            1,
            r"'input_ids' must be lists of integers, got list<item: double>",
        ),
        (pa.table({"input_ids": pa.array([1, 2], pa.int64())}), 2, r"'input_ids' must be lists of integers, got int64"),
        (pa.table({"input_ids": pa.array(["1"])}), 1, r"'input_ids' must be lists of integers, got string"),
    ],
    ids=["dict", "array", "none", "too-few-rows", "too-many-rows", "no-input-ids", "strings", "floats", "not-lists", "string-column"],
)
def test_check_output_errors(out, num_rows: int, message: str) -> None:
    with pytest.raises(TransformError, match=message):
        check_output(out, num_rows)


def test_transform_error_is_a_value_error() -> None:
    assert issubclass(TransformError, ValueError)


@pytest.mark.parametrize(
    ("ids", "expected_type"),
    [
        (_ids([[1, 2], None, [3]], pa.int16()), pa.list_(pa.int64())),
        (_ids([[1, 2], None, [3]], pa.int8()), pa.list_(pa.int64())),
        (_ids([[1, 2], None, [3]], pa.uint16()), pa.list_(pa.int64())),
        (_ids([[1, 2], None, [3]], pa.int16(), large=True), pa.list_(pa.int64())),
        (_ids([[1, 2], None, [3]], pa.int64(), large=True), pa.list_(pa.int64())),
        (_ids([[1, 2], None, [3]], pa.int32(), large=True), pa.list_(pa.int32())),
        (_ids([[1, 2], None, [3]], pa.int32()), pa.list_(pa.int32())),
        (_ids([[1, 2], None, [3]], pa.int64()), pa.list_(pa.int64())),
    ],
    ids=["int16", "int8", "uint16", "large-int16", "large-int64", "large-int32", "int32", "int64"],
)
def test_check_output_normalizes_to_list_of_int32_or_int64(ids: pa.Array, expected_type: pa.DataType) -> None:
    out, features = check_output(pa.table({"input_ids": ids, "num_images": [1, 0, 2]}), 3)
    assert features["num_images"].tolist() == [1.0, 0.0, 2.0]
    assert isinstance(out, pa.ListArray)
    assert out.type == expected_type
    assert out.to_pylist() == [[1, 2], None, [3]]


def test_check_output_accepts_a_record_batch_and_combines_chunks() -> None:
    batch = pa.RecordBatch.from_pydict({"input_ids": _ids([[5], [6, 7]])})
    assert check_output(batch, 2)[0].to_pylist() == [[5], [6, 7]]
    chunked = pa.table({"input_ids": pa.chunked_array([_ids([[1]]), _ids([[2, 3], []])])})
    out, features = check_output(chunked, 3)
    assert features == {}
    assert isinstance(out, pa.ListArray)
    assert out.to_pylist() == [[1], [2, 3], []]


# ---- bind_transform --------------------------------------------------------------------------


def _source(**changes) -> SourceSettings:
    return SourceSettings(**{"name": "web", "path": "data", **changes})


def test_bind_without_a_transform_reads_only_the_token_column() -> None:
    bound = bind_transform(0, _source(token_column="toks"))
    assert isinstance(bound, BoundTransform)
    assert bound.fn is token_ids
    assert dict(bound.kwargs) == {"column": "toks"}
    assert bound.columns == ("toks",)
    ids = bound(pa.table({"toks": _ids([[1, 2], [3]], pa.int16())}))[0]
    assert ids.type == pa.list_(pa.int64())
    assert ids.to_pylist() == [[1, 2], [3]]


def test_bind_an_import_path(user_module: str) -> None:
    source = _source(transform=f"{user_module}:repeat_text", transform_args={"times": 2}, columns=("text",))
    bound = bind_transform(0, source)
    assert bound.columns == ("text",)
    assert dict(bound.kwargs) == {"times": 2}
    assert bound(pa.table({"text": ["ab", ""]}))[0].to_pylist() == [[97, 98, 97, 98], []]


def test_bind_a_per_sample_transform(user_module: str) -> None:
    bound = bind_transform(1, _source(transform=f"{user_module}:word_lengths", transform_args={"minimum": 1}))
    assert bound.columns is None
    ids = bound(pa.table({"text": ["a bb ccc", "single", "dd e"]}))[0]
    assert ids.to_pylist() == [[1, 2, 3], None, [2, 1]]
    assert lengths_of(ids).tolist() == [3, 0, 2]


def test_a_bound_transform_checks_its_output(user_module: str) -> None:
    bound = bind_transform(0, _source(transform=f"{user_module}:wrong_rows"))
    with pytest.raises(TransformError, match=r"got 1 for 2"):
        bound(pa.table({"text": ["a", "b"]}))


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("bp_test_no_such_module_xyz:fn", r"cannot import module 'bp_test_no_such_module_xyz'"),
        (f"{BROKEN_MODULE}:fn", rf"cannot import module '{BROKEN_MODULE}': boom at import"),
        (f"{USER_MODULE}:missing", rf"module '{USER_MODULE}' has no callable 'missing'"),
        (f"{USER_MODULE}:NOT_CALLABLE", rf"module '{USER_MODULE}' has no callable 'NOT_CALLABLE'"),
        (f"{USER_MODULE}:", rf"module '{USER_MODULE}' has no callable ''"),
        (":fn", r"cannot import module ''"),
    ],
    ids=["no-module", "broken-module", "missing-attr", "not-callable", "empty-attr", "empty-module"],
)
def test_bind_bad_import_paths(user_module: str, path: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        bind_transform(2, _source(transform=path))
    err = info.value
    assert err.field == "sources[2].transform"
    assert err.value == path
    assert re.search(problem, err.problem), err.problem


# ---- lengths_of ------------------------------------------------------------------------------


@pytest.mark.parametrize("value_type", [pa.int32(), pa.int64()])
def test_lengths_of_counts_tokens_and_gives_zero_for_null(value_type: pa.DataType) -> None:
    ids = _ids([[1, 2, 3], None, [], [4], None], value_type)
    lengths = lengths_of(ids)
    assert lengths.dtype == np.int32
    assert lengths.tolist() == [3, 0, 0, 1, 0]


def test_lengths_of_empty_and_sliced_arrays() -> None:
    assert lengths_of(_ids([])).tolist() == []
    ids = _ids([[1], [1, 2], None, [1, 2, 3, 4]])
    assert lengths_of(ids.slice(1, 3)).tolist() == [2, 0, 4]


def test_extra_numeric_columns_become_float_features_with_nulls_as_zero() -> None:
    out = pa.table({"input_ids": _ids([[1], [2], [3]]), "num_images": pa.array([2, None, 1]), "crop": [True, False, True]})
    _, features = check_output(out, 3)
    assert features["num_images"].dtype == np.float64
    assert features["num_images"].tolist() == [2.0, 0.0, 1.0]
    assert features["crop"].tolist() == [1.0, 0.0, 1.0]


def test_an_extra_column_that_is_not_a_number_is_refused_by_name() -> None:
    with pytest.raises(TransformError, match=r"column 'caption' must hold one number per row"):
        check_output(pa.table({"input_ids": _ids([[1]]), "caption": ["a cat"]}), 1)


def test_fixed_size_lists_are_accepted_as_token_lists() -> None:
    ids = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4], pa.int32()), 2)
    out, _ = check_output(pa.table({"input_ids": ids}), 2)
    assert out.to_pylist() == [[1, 2], [3, 4]]
