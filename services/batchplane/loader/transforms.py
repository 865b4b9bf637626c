"""Sample transforms: what a loader does to the rows it reads before anyone sees them.

A transform is a callable `transform(batch: pyarrow.Table, **transform_args) -> pyarrow.Table`
named in the job configuration by its import path ("package.module:callable"). It returns one
row per input row, in order, with an `input_ids` column of token-id lists; a null or empty list
marks a sample the transform rejects (it is counted and skipped, never delivered). Every other
column must hold one number per row: it becomes a per-sample feature (e.g. `num_images`) that
the loader reports to the planner and cost functions may use. Row-wise Python functions become
transforms with `per_sample`.

The default, `token_ids`, uses the source's `token_column` as it is.

Right after the transform, the job's `batch.max_length` applies (`limit_lengths`): under
`batch.length_policy` "truncate" a longer sample is cut to its first max_length tokens, under
"reject" it becomes a bad sample (a null list), under "split" it stays whole (the constructor
splits it). Everything downstream (summaries, plans, ledger, loss weights) sees the result.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchplane.core.config import SourceSettings
from batchplane.core.errors import ConfigError
from batchplane.core.lengths import check_limit, over_limit

Transform = Callable[..., pa.Table]


class TransformError(ValueError):
    """A transform's output breaks the contract above."""


def token_ids(batch: pa.Table, *, column: str = "input_ids") -> pa.Table:
    """The default transform: `column` as the `input_ids` column, unchanged."""
    return pa.table({"input_ids": batch.column(column)})


def per_sample(fn: Callable[[dict[str, Any]], Any]) -> Transform:
    """Turns a row-wise function into a transform.

    `fn(row)` receives one row as a dict of Python values and returns the sample's token ids
    (a sequence of ints), or None to reject the sample.
    """

    def transform(batch: pa.Table, **kwargs: Any) -> pa.Table:
        ids = [fn(row, **kwargs) for row in batch.to_pylist()]
        return pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int64()))})

    transform.__name__ = getattr(fn, "__name__", "per_sample")
    transform.__doc__ = fn.__doc__
    return transform


@dataclasses.dataclass(frozen=True)
class BoundTransform:
    """A source's transform with its arguments and the columns it reads."""

    fn: Transform
    kwargs: Mapping[str, Any]
    #: Columns to read from the files (None: all).
    columns: tuple[str, ...] | None
    #: The job's `batch.max_length` in tokens (None: no limit) and `batch.length_policy`.
    max_length: int | None = None
    length_policy: str = "split"

    def __call__(self, batch: pa.Table) -> tuple[pa.ListArray, dict[str, np.ndarray]]:
        """Applies the transform; returns its validated `input_ids` (one list per row) and
        features (one float64 array per extra column)."""
        out = self.fn(batch, **self.kwargs)
        return check_output(out, batch.num_rows)

    def limit(self, ids: pa.ListArray) -> tuple[pa.ListArray, np.ndarray]:
        """`limit_lengths` of transformed token lists under this source's job settings."""
        return limit_lengths(ids, max_length=self.max_length, policy=self.length_policy)


def bind_transform(index: int, source: SourceSettings, *, max_length: int | None = None, length_policy: str = "split") -> BoundTransform:
    """The transform configured for `source` (sources[index]).

    Args:
        max_length: The job's limit on a sample's tokens (`JobSettings.max_length`); None: none.
        length_policy: The job's `batch.length_policy`, applied by `BoundTransform.limit`.
    Raises:
        ConfigError: the import path cannot be imported or does not name a callable.
    """
    limit = {"max_length": max_length, "length_policy": length_policy}
    if source.transform is None:
        return BoundTransform(token_ids, {"column": source.token_column}, (source.token_column,), **limit)
    field = f"sources[{index}].transform"
    module_name, _, attr = source.transform.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a configuration error
        raise ConfigError(field, f"cannot import module {module_name!r}: {exc}", source.transform) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(field, f"module {module_name!r} has no callable {attr!r}", source.transform)
    return BoundTransform(fn, dict(source.transform_args), source.columns, **limit)


def check_output(out: Any, num_rows: int) -> tuple[pa.ListArray, dict[str, np.ndarray]]:
    """The `input_ids` of a transform's output as one list array of integers, and its features.

    Raises:
        TransformError: not a table, wrong row count, no `input_ids`, not lists of integers, or
            an extra column that is not numeric.
    """
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    if not isinstance(out, pa.Table):
        raise TransformError(f"must return a pyarrow.Table, got {type(out).__name__}")
    if out.num_rows != num_rows:
        raise TransformError(f"must return one row per input row: got {out.num_rows} for {num_rows}")
    if out.schema.get_field_index("input_ids") < 0:
        raise TransformError(f"output has no 'input_ids' column (columns: {', '.join(out.schema.names)})")
    ids = out.column("input_ids").combine_chunks()
    if pa.types.is_large_list(ids.type) or pa.types.is_fixed_size_list(ids.type):
        ids = ids.cast(pa.list_(ids.type.value_type))
    if not (pa.types.is_list(ids.type) and pa.types.is_integer(ids.type.value_type)):
        raise TransformError(f"'input_ids' must be lists of integers, got {ids.type}")
    if ids.type.value_type not in (pa.int32(), pa.int64()):
        ids = ids.cast(pa.list_(pa.int64()))
    features = {}
    for name in out.schema.names:
        if name == "input_ids":
            continue
        column = out.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_boolean(column.type)):
            raise TransformError(f"column {name!r} must hold one number per row to be a feature, got {column.type}")
        features[name] = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy()
    return ids, features


def lengths_of(ids: pa.ListArray) -> np.ndarray:
    """int32 token count of each list; 0 for a null list."""
    return pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False).astype(np.int32)


def limit_lengths(ids: pa.ListArray, *, max_length: int | None, policy: str) -> tuple[pa.ListArray, np.ndarray]:
    """Applies `batch.max_length` to transformed token lists (see the module docstring and
    `batchplane.core.lengths.limited`).

    Args:
        ids: Token lists, one per sample (null for a bad sample).
        max_length: The most tokens of a delivered sample; None: no limit.
        policy: "split" (unchanged), "truncate" (cut to the first max_length tokens) or
            "reject" (a null list: a bad sample).
    Returns:
        (the token lists as delivered, bool [n]: which samples were longer than max_length,
        and so were cut or rejected, or are split by the constructor).
    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    check_limit(max_length=max_length, policy=policy)
    if max_length is None:
        return ids, np.zeros(len(ids), bool)
    over = over_limit(lengths_of(ids), max_length=max_length)
    if not over.any() or policy == "split":
        return ids, over
    if policy == "truncate":
        return pc.list_slice(ids, 0, max_length), over
    return pc.if_else(pa.array(over), pa.scalar(None, ids.type), ids), over
