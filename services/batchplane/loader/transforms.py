"""Sample transforms: what a loader does to the rows it reads before anyone sees them.

A transform is a callable `transform(batch: pyarrow.Table, **transform_args) -> pyarrow.Table`
named in the job configuration by its import path ("package.module:callable"). It returns one
row per input row, in order, with

- an `input_ids` column of token-id lists; a null or empty list marks a sample the transform
  rejects (it is counted and skipped, never delivered);
- any of the job's declared payload columns (`batch.payload`, `batchplane.core.payload`): per
  token, per sample or a blob per sample, each normalized to its declared dtype and shape
  (`payload.normalize`). A declared column the transform does not return, a null value, and
  every column of a rejected sample, are the column's empty value. A column that breaks its
  declaration (a type that does not cast, a token list not as long as `input_ids`, a blob not a
  multiple of its row) fails the transform like any other error: the row group becomes bad
  samples (reason "transform"), logged with its file and row group;
- any other column holding one number per row: a per-sample feature (e.g. `num_images`) that
  the loader reports to the planner and cost functions may use (a declared column is never a
  feature). Any other column is an error: declare it in `batch.payload` to deliver it.

Row-wise Python functions become transforms with `per_sample`.

The default, `token_ids`, uses the source's `token_column` as it is.

Right after the transform, the job's `batch.max_length` applies (`limit_lengths`): under
`batch.length_policy` "truncate" a longer sample is cut to its first max_length tokens, under
"reject" it becomes a bad sample (a null list), under "split" it stays whole (the constructor
splits it). Its declared columns follow (`limit_columns`): per-token ones are cut to the same
first max_length tokens, a rejected sample's columns become their empty values, a split one's
stay whole. Everything downstream (summaries, plans, ledger, loss weights) sees the result.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchplane.core import payload as schema
from batchplane.core.config import SourceSettings
from batchplane.core.errors import ConfigError
from batchplane.core.lengths import check_limit, over_limit
from batchplane.core.payload import PayloadColumn, PayloadError

Transform = Callable[..., pa.Table]


class TransformError(ValueError):
    """A transform's output breaks the contract above."""


def token_ids(batch: pa.Table, *, column: str = "input_ids") -> pa.Table:
    """The default transform: `column` as the `input_ids` column, unchanged."""
    return pa.table({"input_ids": batch.column(column)})


def per_sample(fn: Callable[[dict[str, Any]], Any]) -> Transform:
    """Turns a row-wise function into a transform.

    `fn(row)` receives one row as a dict of Python values and returns the sample's token ids
    (a sequence of ints), or a dict of its columns (`input_ids` and any declared payload
    columns or features; a NumPy array of any shape is flattened in C order), or None to
    reject the sample.
    """

    def transform(batch: pa.Table, **kwargs: Any) -> pa.Table:
        out = [fn(row, **kwargs) for row in batch.to_pylist()]
        rows = [r if isinstance(r, Mapping) or r is None else {"input_ids": r} for r in out]
        names = list(dict.fromkeys(name for r in rows if r is not None for name in r))
        if "input_ids" not in names:
            names.insert(0, "input_ids")
        columns = {}
        for name in names:
            values = [None if r is None else _flat(r.get(name)) for r in rows]
            columns[name] = pa.array(values, type=pa.list_(pa.int64()) if name == "input_ids" else None)
        return pa.table(columns)

    transform.__name__ = getattr(fn, "__name__", "per_sample")
    transform.__doc__ = fn.__doc__
    return transform


def _flat(value: Any) -> Any:
    return value.ravel() if isinstance(value, np.ndarray) and value.ndim > 1 else value


@dataclasses.dataclass(frozen=True)
class TransformOutput:
    """A transform's checked output for n samples."""

    #: Token lists, one per sample (null: a rejected sample).
    ids: pa.ListArray
    #: float64 [n] per feature column.
    features: dict[str, np.ndarray]
    #: Every declared payload column, normalized (`payload.normalize`), by name.
    columns: dict[str, pa.Array]


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
    #: The job's declared payload columns (`batch.payload`).
    payload: tuple[PayloadColumn, ...] = ()

    def apply(self, batch: pa.Table) -> TransformOutput:
        """Applies the transform; returns its checked output (`check_transform`)."""
        return check_transform(self.fn(batch, **self.kwargs), batch.num_rows, payload=self.payload)

    def __call__(self, batch: pa.Table) -> tuple[pa.ListArray, dict[str, np.ndarray]]:
        """Applies the transform; returns its validated `input_ids` (one list per row) and
        features (one float64 array per extra column): `apply` without the payload columns."""
        out = self.apply(batch)
        return out.ids, out.features

    def limit(self, ids: pa.ListArray) -> tuple[pa.ListArray, np.ndarray]:
        """`limit_lengths` of transformed token lists under this source's job settings."""
        return limit_lengths(ids, max_length=self.max_length, policy=self.length_policy)

    def limit_columns(self, columns: Mapping[str, pa.Array], *, over: np.ndarray, lengths: np.ndarray) -> dict[str, pa.Array]:
        """`limit_columns` of the declared columns of samples `limit` was applied to."""
        return limit_columns(columns, self.payload, over=over, lengths=lengths, max_length=self.max_length, policy=self.length_policy)

    def failed(self, num_rows: int) -> TransformOutput:
        """The output standing for a row group that could not be read or transformed: null token
        lists, no features, every declared column empty."""
        zeros = np.zeros(num_rows, np.int32)
        return TransformOutput(pa.nulls(num_rows, pa.list_(pa.int32())), {}, {c.name: schema.empty(c, zeros) for c in self.payload})


def bind_transform(
    index: int,
    source: SourceSettings,
    *,
    max_length: int | None = None,
    length_policy: str = "split",
    payload: tuple[PayloadColumn, ...] = (),
) -> BoundTransform:
    """The transform configured for `source` (sources[index]).

    Args:
        max_length: The job's limit on a sample's tokens (`JobSettings.max_length`); None: none.
        length_policy: The job's `batch.length_policy`, applied by `BoundTransform.limit`.
        payload: The job's declared payload columns (`batch.payload`).
    Raises:
        ConfigError: the import path cannot be imported or does not name a callable.
    """
    limit = {"max_length": max_length, "length_policy": length_policy, "payload": tuple(payload)}
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
    """The `input_ids` of a transform's output as one list array of integers, and its features,
    for a job that declares no payload columns (`check_transform` without them).

    Raises:
        TransformError: as `check_transform`.
    """
    checked = check_transform(out, num_rows)
    return checked.ids, checked.features


def check_transform(out: Any, num_rows: int, *, payload: tuple[PayloadColumn, ...] = ()) -> TransformOutput:
    """A transform's output checked against the contract (see the module docstring): its
    `input_ids` as one list array of integers, its features, and every declared column
    normalized (a missing one, and those of rejected samples, as their empty values).

    Raises:
        TransformError: not a table, wrong row count, no `input_ids`, not lists of integers, a
            declared column that breaks its declaration (the text names it), or an undeclared
            column that is not numeric.
    """
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    if not isinstance(out, pa.Table):
        raise TransformError(f"must return a pyarrow.Table, got {type(out).__name__}")
    if out.num_rows != num_rows:
        raise TransformError(f"must return one row per input row: got {out.num_rows} for {num_rows}")
    if out.schema.get_field_index("input_ids") < 0:
        raise TransformError(f"output has no 'input_ids' column (columns: {', '.join(out.schema.names)})")
    ids = _one_chunk(out.column("input_ids"))
    if pa.types.is_large_list(ids.type) or pa.types.is_fixed_size_list(ids.type):
        ids = ids.cast(pa.list_(ids.type.value_type))
    if not (pa.types.is_list(ids.type) and pa.types.is_integer(ids.type.value_type)):
        raise TransformError(f"'input_ids' must be lists of integers, got {ids.type}")
    if ids.type.value_type not in (pa.int32(), pa.int64()):
        ids = ids.cast(pa.list_(pa.int64()))
    declared = {c.name for c in payload}
    features = {}
    for name in out.schema.names:
        if name == "input_ids" or name in declared:
            continue
        column = out.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_boolean(column.type)):
            raise TransformError(
                f"column {name!r} must hold one number per row to be a feature, got {column.type}; declare it in batch.payload to deliver it"
            )
        features[name] = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy()
    columns = {}
    if payload:
        lengths = lengths_of(ids)
        rejected = lengths == 0  # null or empty token lists: never delivered
        for column in payload:
            got = _one_chunk(out.column(column.name)) if column.name in out.schema.names else None
            if got is not None and rejected.any():
                got = pc.if_else(pa.array(rejected), pa.scalar(None, got.type), got)
            try:
                columns[column.name] = schema.normalize(column, got, lengths)
            except PayloadError as exc:
                raise TransformError(str(exc)) from exc
    return TransformOutput(ids, features, columns)


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """A column as one array: its only chunk as it is (no copy), else the chunks concatenated."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


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


def limit_columns(
    columns: Mapping[str, pa.Array],
    payload: tuple[PayloadColumn, ...],
    *,
    over: np.ndarray,
    lengths: np.ndarray,
    max_length: int | None,
    policy: str,
) -> dict[str, pa.Array]:
    """Applies `batch.max_length` to the declared columns of samples `limit_lengths` limited.

    Args:
        columns: The normalized declared columns, by name.
        over: bool [n]: `limit_lengths`' samples longer than max_length.
        lengths: int [n]: the samples' token counts after `limit_lengths` (0: rejected).
        max_length: As `limit_lengths`; policy: "split" (unchanged), "truncate" (token columns
            cut to the first max_length tokens) or "reject" (every column of a sample over it
            becomes its empty value).
    Returns:
        The columns as delivered (the same arrays where nothing changes).
    """
    if max_length is None or policy == "split" or not over.any():
        return dict(columns)
    out = dict(columns)
    for column in payload:
        array = columns[column.name]
        if policy == "truncate":
            if column.kind == schema.TOKEN:
                out[column.name] = pc.list_slice(array, 0, max_length * column.inner).cast(schema.arrow_type(column))
        else:
            out[column.name] = schema.normalize(column, pc.if_else(pa.array(over), pa.scalar(None, array.type), array), lengths)
    return out
