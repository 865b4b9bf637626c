"""The payload schema: the columns a job's samples carry besides `input_ids`, and the rule each
kind of column is laid out by. Pure: no I/O, no grpc, no threads.

A job declares its columns once, in `batch.payload` (see `PayloadColumn`); every source's
transform may return them (a source that does not gets each column's empty value), the loader
buffers and sends them, the constructor lays each one out by its kind, and the client yields
them as tensors. There are three kinds:

- "token": one value (or one `shape`-shaped array) per token, aligned with `input_ids`: a list
  as long as the sample's token list. Laid out like `input_ids`: [rows, width, *shape], padded
  with `fill`, packed into rows, cut by `batch.max_length`, sliced for context parallelism.
- "sample": one value (or one `shape`-shaped array) per sample, e.g. an image count or a
  language id. Laid out as [samples, *shape] in sample order, whole on every CP rank.
- "blob": a variable number of `shape`-shaped rows per sample, e.g. a sample's pixels as
  [patches, 1176] uint8, or its images' grids [images, 3]. Laid out concatenated along the
  sample axis as [Σ rows, *shape], with `<name>_offsets` int32 [samples + 1] (cu_seqlens
  style: sample b's rows are offsets[b]:offsets[b + 1]); whole on every CP rank.

On the Arrow side (a transform's output and the loader → constructor payload), a column of n
samples is normalized (`normalize`) to:

- token: list<dtype> with len(list_i) == len(input_ids_i) * prod(shape);
- sample: dtype [n] when shape is (), else fixed_size_list<dtype, prod(shape)> [n];
- blob: list<dtype> with len(list_i) a multiple of prod(shape) (the rows flattened).

Nulls become the column's empty value (token: `fill` for every token; sample: `fill`; blob:
no rows), as does a column a transform does not return.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TOKEN = "token"
SAMPLE = "sample"
BLOB = "blob"
KINDS = (TOKEN, SAMPLE, BLOB)

#: dtypes a column may have (those that travel on the wire; see batchplane.wire.DTYPES).
DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")

#: Names the constructor builds itself; a declared column may not take them.
BUILT = frozenset(
    {
        "input_ids",
        "labels",
        "attention_mask",
        "position_ids",
        "segment_ids",
        "cu_seqlens",
        "max_seqlen",
        "loss_mask",
        "source",
        "seq",
    }
)
#: Prefix of the per-sample identity tensors the constructor builds (sample_source, ...).
RESERVED_PREFIX = "sample_"
#: Suffix of a blob column's offsets tensor.
OFFSETS_SUFFIX = "_offsets"
#: Most dimensions of a column's inner shape, and the most elements in it.
MAX_SHAPE_DIMS = 4
MAX_INNER_ELEMENTS = 1 << 24
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PayloadError(ValueError):
    """A payload column breaks its declaration; the text names the column."""


@dataclasses.dataclass(frozen=True)
class PayloadColumn:
    """One column of the job's payload besides `input_ids` (an entry of `batch.payload`)."""

    #: The tensor's name, e.g. "pixel_values": letters, digits and _, not one the constructor
    #: builds (input_ids, labels, ..., sample_*) nor ending in "_offsets".
    name: str
    #: "token", "sample" or "blob" (see the module docstring).
    kind: str
    #: NumPy dtype name: bool, int8, uint8, int16, int32, int64, float16, float32 or float64.
    dtype: str
    #: The shape of one element: () for a scalar per token or sample; a blob's row shape, e.g.
    #: [1176] for patches of 3 * 2 * 14 * 14 pixels.
    shape: tuple[int, ...] = ()
    #: The value of padding and of a source that lacks the column.
    fill: float = 0.0

    @property
    def inner(self) -> int:
        """Elements per token, sample or blob row: prod(shape)."""
        return math.prod(self.shape)

    @property
    def offsets_name(self) -> str:
        """The name of a blob's offsets tensor."""
        return self.name + OFFSETS_SUFFIX


def check_columns(columns: Sequence[PayloadColumn]) -> list[tuple[str, str, object]]:
    """Problems of a declared schema as (field suffix, message, value), e.g.
    ("[1].dtype", "must be one of ...", "int128"); empty when it is valid. The caller turns
    them into ConfigErrors of `batch.payload`."""
    problems: list[tuple[str, str, object]] = []
    seen: dict[str, int] = {}
    for i, c in enumerate(columns):
        at = f"[{i}]"
        if not _NAME.fullmatch(c.name):
            problems.append((f"{at}.name", "must be letters, digits and _, not starting with a digit", c.name))
        elif c.name in BUILT or c.name.startswith(RESERVED_PREFIX) or c.name.endswith(OFFSETS_SUFFIX):
            problems.append(
                (f"{at}.name", f"is a name the constructor builds (input_ids, labels, ..., {RESERVED_PREFIX}*, *{OFFSETS_SUFFIX})", c.name)
            )
        elif c.name in seen:
            problems.append((f"{at}.name", f"duplicates batch.payload[{seen[c.name]}].name", c.name))
        else:
            seen[c.name] = i
        if c.kind not in KINDS:
            problems.append((f"{at}.kind", f"must be one of {', '.join(KINDS)}", c.kind))
        if c.dtype not in DTYPES:
            problems.append((f"{at}.dtype", f"must be one of {', '.join(DTYPES)}", c.dtype))
        if len(c.shape) > MAX_SHAPE_DIMS or any(d < 1 for d in c.shape) or math.prod(c.shape) > MAX_INNER_ELEMENTS:
            problems.append(
                (f"{at}.shape", f"must be at most {MAX_SHAPE_DIMS} extents >= 1 of at most {MAX_INNER_ELEMENTS} elements", list(c.shape))
            )
        if not math.isfinite(c.fill):
            problems.append((f"{at}.fill", "must be a finite number", c.fill))
    return problems


def value_type(column: PayloadColumn) -> pa.DataType:
    """The Arrow type of one value of `column` (its dtype)."""
    return pa.from_numpy_dtype(np.dtype(column.dtype))


def arrow_type(column: PayloadColumn) -> pa.DataType:
    """The normalized Arrow type of `column` (see the module docstring)."""
    value = value_type(column)
    if column.kind == SAMPLE:
        return value if not column.shape else pa.list_(value, column.inner)
    return pa.list_(value)


def schema_fields(columns: Iterable[PayloadColumn]) -> list[pa.Field]:
    """The Arrow fields of the declared columns, in order."""
    return [pa.field(c.name, arrow_type(c)) for c in columns]


def empty(column: PayloadColumn, token_lengths: np.ndarray) -> pa.Array:
    """The column's empty value for samples of `token_lengths` tokens (a source that does not
    return it): `fill` per token or sample, no blob rows."""
    n = len(token_lengths)
    value = np.dtype(column.dtype).type(column.fill)
    if column.kind == BLOB:
        return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array(np.zeros(0, column.dtype)))
    if column.kind == SAMPLE:
        flat = np.full(n * column.inner, value, column.dtype)
        return pa.array(flat) if not column.shape else pa.FixedSizeListArray.from_arrays(pa.array(flat), column.inner)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.asarray(token_lengths, np.int64) * column.inner, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(np.full(int(offsets[-1]), value, column.dtype)))


def normalize(column: PayloadColumn, array: pa.Array | pa.ChunkedArray | None, token_lengths: np.ndarray) -> pa.Array:
    """A transform's column as the normalized Arrow array of `column` (nulls and a missing
    column become its empty value).

    Args:
        array: What the transform returned for it (None: it returned no such column).
        token_lengths: Each sample's token count (of its `input_ids`; 0 for a bad sample).
    Raises:
        PayloadError: a type that cannot become the declared dtype, or lengths that break the
            kind's rule (a token list as long as its input_ids, a blob a multiple of its row).
    """
    n = len(token_lengths)
    if array is None:
        return empty(column, token_lengths)
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if len(array) != n:
        raise PayloadError(f"column {column.name!r}: {len(array)} rows for {n} samples")
    value = value_type(column)
    try:
        if column.kind == SAMPLE:
            return _normalize_sample(column, array, value, n)
        return _normalize_lists(column, array, value, token_lengths)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise PayloadError(
            f"column {column.name!r}: cannot be {column.kind} values of {column.dtype}{list(column.shape) or ''}: {exc}"
        ) from None


def _normalize_sample(column: PayloadColumn, array: pa.Array, value: pa.DataType, n: int) -> pa.Array:
    if not column.shape:
        if pa.types.is_nested(array.type):
            raise PayloadError(f"column {column.name!r}: a sample column of shape [] holds one number per sample, got {array.type}")
        return pc.fill_null(array.cast(value), pa.scalar(column.fill).cast(value))
    flat, counts = _leaves(column, array)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    bad = valid & (counts != column.inner)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PayloadError(
            f"column {column.name!r}: sample {i} has {int(counts[i])} values, shape {list(column.shape)} needs {column.inner}"
        )
    out = np.full(n * column.inner, np.dtype(column.dtype).type(column.fill), column.dtype)
    out[np.repeat(valid, column.inner)] = flat.cast(value).to_numpy(zero_copy_only=False)
    return pa.FixedSizeListArray.from_arrays(pa.array(out), column.inner)


def _normalize_lists(column: PayloadColumn, array: pa.Array, value: pa.DataType, token_lengths: np.ndarray) -> pa.Array:
    flat, counts = _leaves(column, array)
    flat = flat.cast(value)
    if column.kind == TOKEN:
        want = np.asarray(token_lengths, np.int64) * column.inner
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        bad = valid & (counts != want)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PayloadError(
                f"column {column.name!r}: sample {i} has {int(counts[i])} values for {int(token_lengths[i])} tokens of shape {list(column.shape)}"
            )
        if not valid.all():  # a null list: fill for every token
            out = np.full(int(want.sum()), np.dtype(column.dtype).type(column.fill), column.dtype)
            out[np.repeat(valid, want)] = flat.to_numpy(zero_copy_only=False)
            flat, counts = pa.array(out), want
    elif column.inner > 1 and (counts % column.inner).any():
        i = int(np.flatnonzero(counts % column.inner)[0])
        raise PayloadError(
            f"column {column.name!r}: sample {i} has {int(counts[i])} values, not a multiple of a row of shape {list(column.shape)}"
        )
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise PayloadError(f"column {column.name!r}: {int(offsets[-1])} values in one row group; at most 2**31 - 1")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _leaves(column: PayloadColumn, array: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """The leaf values of a (possibly nested) list array in order, and how many each row holds
    (0 for a null row or list). Work in the number of lists, not of leaf values: each level's list
    sizes map the rows' boundaries one level down (an image's pixels are never indexed one by one)."""
    if not _is_list(array.type):
        raise PayloadError(
            f"column {column.name!r}: a {column.kind} column of shape {list(column.shape)} holds a list per sample, got {array.type}"
        )
    flat, bounds = array, np.arange(len(array) + 1, dtype=np.int64)  # row i: flat[bounds[i]:bounds[i + 1]]
    while _is_list(flat.type):
        sizes = pc.fill_null(pc.list_value_length(flat), 0).to_numpy(zero_copy_only=False)
        below = np.zeros(len(flat) + 1, np.int64)  # where each list starts in the flattened level
        np.cumsum(sizes, out=below[1:])
        flat, bounds = pc.list_flatten(flat), below[bounds]  # list_flatten skips null lists
    if flat.null_count:
        raise PayloadError(f"column {column.name!r}: null values inside a sample's list")
    return flat, np.diff(bounds)


# ---- reading a normalized column -----------------------------------------------------------


def values_of(column: PayloadColumn, array: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """A normalized column as (flat values, offsets into them per sample in elements; None for
    a sample column, whose sample i is values[i * inner:(i + 1) * inner]). Views, no copy where
    Arrow allows it."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if column.kind == SAMPLE:
        flat = array.flatten() if column.shape else array  # flatten, not .values: it keeps a slice's offset
        return flat.to_numpy(zero_copy_only=False), None
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return values, offsets
