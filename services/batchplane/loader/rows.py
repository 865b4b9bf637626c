"""Taking rows out of Arrow arrays with the fewest copies, and counting their bytes. Pure: no
I/O, no threads, no grpc.

A loader moves every payload byte from its windows into a fetch's record batch; `gather` does
it with at most one copy per byte, and none where it can:

- the rows are one contiguous run of one array: a zero-copy slice of it;
- lists, fixed-size lists or plain values of a fixed-width number type without nulls, in few or
  long runs: the output's buffer is allocated once and each run is one memcpy into it;
- anything else (nulls, booleans, many short runs): Arrow's `take` (one copy from one array;
  from several, a take of each and a concatenation, or of their concatenation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

#: At most this many runs are copied one by one whatever their size ...
FEW_RUNS = 32
#: ... and above it, only runs of at least this many values on average (below: Arrow's take).
LONG_RUN_VALUES = 512


def runs(which: np.ndarray, index: np.ndarray) -> np.ndarray:
    """int64 [r + 1]: where each maximal run of rows starts (and the end), a run being
    consecutive outputs k whose rows are consecutive rows of one array."""
    n = len(index)
    if not n:
        return np.zeros(1, np.int64)
    breaks = np.flatnonzero((np.diff(index) != 1) | (np.diff(which) != 0)) + 1
    return np.concatenate([[0], breaks, [n]]).astype(np.int64)


def gather(arrays: Sequence[pa.Array], which: np.ndarray, index: np.ndarray) -> pa.Array:
    """Output row k is row index[k] of arrays[which[k]]: one array of their common type.

    Args:
        arrays: Arrays of one type (at least one).
        which: int [n]: the array of each output row.
        index: int [n]: the row in it.
    Returns:
        A slice of one array (no copy) when the rows are one run of it; else a new array (one
        copy of each row's bytes; see the module docstring).
    """
    which = np.asarray(which, np.int64)
    index = np.asarray(index, np.int64)
    starts = runs(which, index)
    if len(starts) == 2:  # one run (the rows of a window in order, a fetch of a contiguous range)
        return arrays[int(which[0])].slice(int(index[0]), len(index))
    if not len(index):
        return arrays[0].slice(0, 0)
    used = np.unique(which).tolist()
    if all(_copyable(arrays[w]) for w in used):
        first, last = index[starts[:-1]], index[starts[1:] - 1] + 1
        source = which[starts[:-1]]
        if len(first) <= FEW_RUNS or _values(arrays, source, first, last) >= LONG_RUN_VALUES * len(first):
            return _copy_runs(arrays, which, index, source, first, last)
    if len(used) == 1:
        return arrays[used[0]].take(pa.array(index))
    if (np.diff(which) >= 0).all():  # grouped by array (a fetch's windows): Arrow concatenates a
        # chunked array's nested chunks whole before taking, so take from each and concatenate
        return pa.concat_arrays([arrays[w].take(pa.array(index[which == w])) for w in used])
    sizes = np.array([len(a) for a in arrays], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    taken = pa.chunked_array(arrays, type=arrays[0].type).take(pa.array(offsets[which] + index))
    return taken.chunk(0) if taken.num_chunks == 1 else taken.combine_chunks()


def shuffle(parts: Sequence[pa.Array], perm: np.ndarray) -> pa.Array:
    """Row perm[k] of the parts' concatenation as output row k (a window's row groups in its
    shuffled order): `gather`, so no copy for the identity over one part and one copy else.

    Args:
        parts: Arrays of one type (at least one).
        perm: int [sum of their lengths]: a permutation.
    """
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    perm = np.asarray(perm, np.int64)
    which = np.searchsorted(starts, perm, side="right") - 1
    return gather(parts, which, perm - starts[which])


def rows_nbytes(array: pa.Array, index: np.ndarray) -> int:
    """The bytes rows `index` of `array` take in a payload: their values, plus 4 per row for a
    list's offset."""
    t = array.type
    if pa.types.is_list(t):
        offsets = array.offsets.to_numpy()
        values = int((offsets[index + 1].astype(np.int64) - offsets[index]).sum())
        return values * _width(t.value_type) + 4 * len(index)
    if pa.types.is_fixed_size_list(t):
        return len(index) * t.list_size * _width(t.value_type)
    return len(index) * _width(t)


def _width(t: pa.DataType) -> int:
    return max(1, t.bit_width // 8) if pa.types.is_primitive(t) else 8


def _number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _copyable(array: pa.Array) -> bool:
    t = array.type
    if array.null_count:
        return False
    if pa.types.is_list(t) or pa.types.is_fixed_size_list(t):
        return _number(t.value_type) and array.values.null_count == 0
    return _number(t)


def _flat(array: pa.Array) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(the values as numpy, list offsets into them per row (None: fixed width), values per row)."""
    t = array.type
    if pa.types.is_list(t):
        return array.values.to_numpy(), array.offsets.to_numpy(), 0
    if pa.types.is_fixed_size_list(t):
        return array.flatten().to_numpy(), None, t.list_size
    return array.to_numpy(), None, 1


def _values(arrays: Sequence[pa.Array], source: np.ndarray, first: np.ndarray, last: np.ndarray) -> int:
    """Values in the runs (rows for fixed-width arrays)."""
    total = 0
    for w in np.unique(source).tolist():
        mine = source == w
        _, offsets, per_row = _flat(arrays[w])
        if offsets is None:
            total += int((last[mine] - first[mine]).sum()) * per_row
        else:
            total += int((offsets[last[mine]].astype(np.int64) - offsets[first[mine]]).sum())
    return total


def _copy_runs(
    arrays: Sequence[pa.Array], which: np.ndarray, index: np.ndarray, source: np.ndarray, first: np.ndarray, last: np.ndarray
) -> pa.Array:
    """The runs copied one memcpy each into one new buffer (see `gather`)."""
    t = arrays[0].type
    flats = {w: _flat(arrays[w]) for w in np.unique(source).tolist()}
    rows = int((last - first).sum())
    _, offsets0, per_row = flats[int(source[0])]
    dtype = flats[int(source[0])][0].dtype
    if offsets0 is None:  # fixed width: per_row values a row
        out = np.empty(rows * per_row, dtype)
        at = 0
        for w, a, b in zip(source.tolist(), first.tolist(), last.tolist()):
            n = (b - a) * per_row
            out[at : at + n] = flats[w][0][a * per_row : b * per_row]
            at += n
        values = pa.array(out)
        return pa.FixedSizeListArray.from_arrays(values, t.list_size) if pa.types.is_fixed_size_list(t) else values.cast(t)
    lengths = np.empty(rows, np.int64)
    for w, (_, offs, _) in flats.items():
        mine = which == w
        lengths[mine] = offs[index[mine] + 1].astype(np.int64) - offs[index[mine]]
    out_offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), dtype)
    at = 0
    for w, a, b in zip(source.tolist(), first.tolist(), last.tolist()):
        values, offs, _ = flats[w]
        lo, hi = int(offs[a]), int(offs[b])
        out[at : at + hi - lo] = values[lo:hi]
        at += hi - lo
    return pa.ListArray.from_arrays(pa.array(out_offsets.astype(np.int32)), pa.array(out), type=t)
