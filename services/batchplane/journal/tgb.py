"""The byte layout of a Transactional Global Batch (TGB): one immutable object holding every
DP x CP slice of one step, with a footer index at its end. Pure: no I/O, no clocks, no threads;
the caller fetches bytes (whole, or by range) and hands them in.

A slice is one (dp, cp) coordinate's delivered batch: a mapping of column name to a numpy
array (input_ids, labels, position_ids, cu_seqlens, payload columns, ...). TP and PP ranks read
the slice of their (dp, cp) coordinates. The object is laid out as

    [slice 0][slice 1] ... [slice n-1][footer][trailer]

- every slice starts at a multiple of ALIGN (64) bytes and its length is a multiple of ALIGN,
  so the slices tile [0, footer_offset) exactly; inside a slice each column starts at a
  multiple of ALIGN from the slice's start, zero bytes pad the gaps. Slices are written in
  (dp, cp) order, cp fastest;
- the footer is UTF-8 JSON (sorted keys, no spaces):
  {"cp": C, "dp": D, "format": "batchplane.tgb", "slices": [{"columns": [{"dtype": "int32",
  "length": L, "name": "input_ids", "offset": O, "shape": [r, w]}, ...], "cp": c, "crc32": X,
  "dp": d, "length": N, "offset": S}, ...], "step": s, "version": 1}, one entry per slice;
  a column's offset is relative to its slice's start, its bytes are the array in C order,
  little-endian, of `dtype` (a name of DTYPES); a slice's crc32 (zlib) covers its whole range,
  padding included. A slice entry may also hold "meta": {name: int >= 0, ...} (at most
  MAX_META names), small figures about the slice that a reader of other slices needs without
  fetching this one (journal delivery records each slice's loss tokens there, so a reader on
  another data mesh can sum the loss tokens of the slices its logical step reads); an entry
  without meta is written without the key, as before it existed;
- the trailer is TRAILER_BYTES (32) bytes, little-endian: magic b"BPTG", format version (u16),
  flags (u16, 0), footer offset (u64), footer length (u64), crc32 of the footer (u32), and
  b"GTPB". footer offset + footer length + 32 is the object's size.

So every byte of the object is covered by a check: a slice's bytes by its crc32, the footer's
by the trailer's crc32, the trailer's by its magics, version, flags and the size equation.

A reader that knows the object's size (the manifest records it) reads the trailer
(`trailer_range`, `read_trailer`), the footer (`footer_range`, `read_footer`) and then one
range per slice it needs (`Footer.slice`, `decode_slice`); `load_footer` and `load_slice` do
so through a `fetch(start, end)` callable such as `functools.partial(storage.get_range, key)`,
`load_footer(..., suffix_bytes=FOOTER_SUFFIX_BYTES)` with one suffix read of the object's last
bytes (a start computed from the size), which holds trailer and footer unless the footer is
larger. Decoding treats the bytes as hostile: every
offset and length is checked against the object's size, unknown dtypes, bad shapes, overlaps,
bad magic, version or checksum are refused with `CorruptTGB` naming the field. Decoded arrays
are views of the fetched bytes (np.frombuffer, no copy): read-only when given bytes, writable
when given a bytearray.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from batchplane.core.errors import InvalidArgument

#: Leading magic of the trailer, and its trailing magic.
MAGIC = b"BPTG"
END_MAGIC = b"GTPB"
#: Bytes of `load_footer`'s first (suffix) read: the trailer and a footer of up to about 50
#: slices in one request.
FOOTER_SUFFIX_BYTES = 8192
#: The format version this module writes and the only one it reads.
FORMAT_VERSION = 1
#: The footer's "format" value.
FORMAT_NAME = "batchplane.tgb"
#: Alignment of slices and columns, in bytes.
ALIGN = 64
#: Column dtypes a TGB may hold (numpy names); stored little-endian.
DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
#: Most dimensions of a column.
MAX_DIMS = 32
#: Most slices of one TGB (dp * cp), and most columns of one slice.
MAX_SLICES = 1 << 20
MAX_COLUMNS = 1 << 12
#: Largest step number.
MAX_STEP = 1 << 62
#: Largest size of one dimension.
MAX_DIM = 1 << 48
#: Longest column name (and meta name), in characters.
MAX_NAME = 256
#: Most meta names of one slice, and the largest meta value.
MAX_META = 16
MAX_META_VALUE = 1 << 62

_TRAILER = struct.Struct("<4sHHQQI4s")
#: Size of the trailer, in bytes.
TRAILER_BYTES = _TRAILER.size
_FOOTER_KEYS = frozenset({"format", "version", "step", "dp", "cp", "slices"})
_SLICE_KEYS = frozenset({"dp", "cp", "offset", "length", "crc32", "columns"})
_SLICE_KEYS_WITH_META = _SLICE_KEYS | {"meta"}
_COLUMN_KEYS = frozenset({"name", "dtype", "shape", "offset", "length"})


class CorruptTGB(InvalidArgument):
    """The bytes of a TGB object are not a valid TGB: truncated, altered or crafted.

    Args:
        field: What is wrong, e.g. "trailer.magic" or "slices[3].columns[0].shape".
        problem: How, e.g. "crc32 mismatch".
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"corrupt TGB object: {field}: {problem}")


@dataclasses.dataclass(frozen=True)
class Trailer:
    """The fixed-size end of a TGB object.

    Attributes:
        version: Format version.
        footer_offset: Where the footer starts (= where the slices end), in bytes.
        footer_length: The footer's length, in bytes.
        footer_crc32: zlib.crc32 of the footer.
        object_size: The whole object's size, in bytes.
    """

    version: int
    footer_offset: int
    footer_length: int
    footer_crc32: int
    object_size: int


@dataclasses.dataclass(frozen=True)
class ColumnEntry:
    """Where one column of a slice lies: `offset` (from the slice's start) and `length`, in
    bytes; its numpy `dtype` name and `shape`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class SliceEntry:
    """Where the slice of (dp, cp) lies in the object: `offset` and `length` in bytes, its
    crc32 and its columns in stored order."""

    dp: int
    cp: int
    offset: int
    length: int
    crc32: int
    columns: tuple[ColumnEntry, ...]
    #: The slice's meta figures (name -> int >= 0); empty when the writer recorded none.
    meta: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def range(self) -> tuple[int, int]:
        """The slice's byte range [start, end) in the object."""
        return self.offset, self.offset + self.length


@dataclasses.dataclass(frozen=True)
class Footer:
    """The index of a TGB: its step, mesh (dp x cp slices) and every slice's entry, in
    (dp, cp) order, cp fastest."""

    step: int
    dp: int
    cp: int
    slices: tuple[SliceEntry, ...]

    def slice(self, dp: int, cp: int) -> SliceEntry:
        """The entry of the slice of (dp, cp).

        Raises:
            InvalidArgument: (dp, cp) is outside the TGB's mesh.
        """
        if not (_is_int(dp) and _is_int(cp) and 0 <= dp < self.dp and 0 <= cp < self.cp):
            raise InvalidArgument(f"slice: ({dp!r}, {cp!r}) is outside the TGB's mesh dp={self.dp} x cp={self.cp}")
        return self.slices[dp * self.cp + cp]


# --- encoding ----------------------------------------------------------------------------


def encode_tgb(
    slices: Mapping[tuple[int, int], Mapping[str, np.ndarray]],
    *,
    step: int,
    dp: int,
    cp: int,
    meta: Mapping[tuple[int, int], Mapping[str, int]] | None = None,
) -> bytearray:
    """Lays out one step's TGB.

    Args:
        slices: Every (dp, cp) coordinate's batch: column name -> array. The keys must be
            exactly {0..dp-1} x {0..cp-1}; slices may hold different columns and shapes.
        step: The step the TGB is, in [0, MAX_STEP] (recorded in the footer, checked by readers).
        dp: The data-parallel size of the mesh it was built for, >= 1.
        cp: The context-parallel size, >= 1.
        meta: (dp, cp) -> that slice's meta figures (name -> int in [0, MAX_META_VALUE], at
            most MAX_META names), recorded in its footer entry; coordinates left out have none.

    Returns:
        The object's bytes (one buffer, written once; the arrays are copied into it).

    Raises:
        InvalidArgument: a bad step, dp or cp, missing or extra coordinates, a column name
            that is not a non-empty string, an array of a dtype outside DTYPES or of more
            than MAX_DIMS dimensions; the message names the slice and the column.
    """
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"step: must be an int in [0, {MAX_STEP}], got {step!r}")
    for name, size in (("dp", dp), ("cp", cp)):
        if not _is_int(size) or size < 1:
            raise InvalidArgument(f"{name}: must be an int >= 1, got {size!r}")
    if dp * cp > MAX_SLICES:
        raise InvalidArgument(f"dp * cp: must be <= {MAX_SLICES}, got {dp * cp}")
    expected = {(d, c) for d in range(dp) for c in range(cp)}
    got = set(slices)
    if got != expected:
        missing = sorted(expected - got)[:5]
        extra = sorted(got - expected, key=repr)[:5]
        raise InvalidArgument(f"slices: must hold exactly the coordinates of dp={dp} x cp={cp}; missing {missing}, unexpected {extra}")
    meta = dict(meta or {})
    unknown = sorted(set(meta) - expected, key=repr)[:5]
    if unknown:
        raise InvalidArgument(f"meta: coordinates {unknown} are outside dp={dp} x cp={cp}")
    for coords, figures in meta.items():
        problem = _meta_problem(figures)
        if problem:
            raise InvalidArgument(f"meta[{coords}]: {problem}")

    plans = []  # (d, c, [(name, dtype name, shape, little-endian contiguous array, offset)], length)
    offset = 0
    for d in range(dp):
        for c in range(cp):
            batch = slices[(d, c)]
            if len(batch) > MAX_COLUMNS:
                raise InvalidArgument(f"slices[({d}, {c})]: at most {MAX_COLUMNS} columns, got {len(batch)}")
            columns = []
            at = 0
            for name, array in batch.items():
                where = f"slices[({d}, {c})][{name!r}]"
                if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                    raise InvalidArgument(f"{where}: a column name must be a non-empty string of at most {MAX_NAME} characters")
                array = np.asarray(array)
                dtype = _dtype_name(array.dtype)
                if dtype not in DTYPES:
                    raise InvalidArgument(f"{where}: dtype {dtype!r} cannot be stored; use one of {sorted(DTYPES)}")
                if array.ndim > MAX_DIMS:
                    raise InvalidArgument(f"{where}: at most {MAX_DIMS} dimensions, got {array.ndim}")
                little = array if _is_little_contiguous(array) else np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
                columns.append((name, dtype, tuple(int(n) for n in array.shape), little, at))
                at = _align(at + little.nbytes)
            length = at
            plans.append((d, c, columns, offset, length))
            offset += length

    footer_offset = offset
    entries = []
    for d, c, columns, start, length in plans:
        entries.append(
            {
                "dp": d,
                "cp": c,
                "offset": start,
                "length": length,
                "crc32": 0,
                "columns": [{"name": n, "dtype": t, "shape": list(s), "offset": o, "length": a.nbytes} for n, t, s, a, o in columns],
            }
        )
        if meta.get((d, c)):
            entries[-1]["meta"] = {name: int(value) for name, value in meta[(d, c)].items()}
    # The footer's length depends on the crc32s' digits, so the data are laid out first.
    out = bytearray(footer_offset)
    view = memoryview(out)
    for entry, (_, _, columns, start, length) in zip(entries, plans):
        for _, _, _, little, rel in columns:
            if little.nbytes:
                view[start + rel : start + rel + little.nbytes] = little.reshape(-1).view(np.uint8).data
        entry["crc32"] = zlib.crc32(view[start : start + length])
    view.release()
    footer = json.dumps(
        {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step, "dp": dp, "cp": cp, "slices": entries},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    out += footer
    out += _TRAILER.pack(MAGIC, FORMAT_VERSION, 0, footer_offset, len(footer), zlib.crc32(footer), END_MAGIC)
    return out


# --- decoding ----------------------------------------------------------------------------


def trailer_range(object_size: int) -> tuple[int, int]:
    """The byte range [start, end) of the trailer of an object of `object_size` bytes.

    Raises:
        CorruptTGB: the object is smaller than a trailer.
    """
    _check_size(object_size)
    return object_size - TRAILER_BYTES, object_size


def read_trailer(data: bytes | bytearray | memoryview, *, object_size: int) -> Trailer:
    """Parses and checks the trailer.

    Args:
        data: The object's last TRAILER_BYTES bytes (`trailer_range`).
        object_size: The object's size, as the manifest records it.

    Returns:
        The trailer, its footer's range checked against the object's size.

    Raises:
        CorruptTGB: a short read, bad magic, an unknown version or flags, or a footer range
            that does not end where the trailer starts.
    """
    _check_size(object_size)
    if len(data) != TRAILER_BYTES:
        raise CorruptTGB("trailer", f"expected {TRAILER_BYTES} bytes, got {len(data)} (truncated object?)")
    magic, version, flags, footer_offset, footer_length, footer_crc, end = _TRAILER.unpack(bytes(data))
    if magic != MAGIC:
        raise CorruptTGB("trailer.magic", f"expected {MAGIC!r}, got {magic!r} (not a TGB object, or truncated)")
    if end != END_MAGIC:
        raise CorruptTGB("trailer.end_magic", f"expected {END_MAGIC!r}, got {end!r}")
    if version != FORMAT_VERSION:
        raise CorruptTGB("trailer.version", f"unknown format version {version} (this reader knows {FORMAT_VERSION})")
    if flags != 0:
        raise CorruptTGB("trailer.flags", f"unknown flags {flags:#x}")
    if footer_offset % ALIGN:
        raise CorruptTGB("trailer.footer_offset", f"{footer_offset} is not a multiple of {ALIGN}")
    if footer_offset + footer_length + TRAILER_BYTES != object_size:
        raise CorruptTGB(
            "trailer.footer_length",
            f"footer [{footer_offset}, +{footer_length}) and trailer do not end at the object's size {object_size}",
        )
    return Trailer(FORMAT_VERSION, footer_offset, footer_length, footer_crc, object_size)


def footer_range(trailer: Trailer) -> tuple[int, int]:
    """The byte range [start, end) of the footer."""
    return trailer.footer_offset, trailer.footer_offset + trailer.footer_length


def read_footer(data: bytes | bytearray | memoryview, trailer: Trailer, *, step: int | None = None) -> Footer:
    """Parses and checks the footer against its trailer.

    Args:
        data: The footer's bytes (`footer_range`).
        trailer: The object's trailer (`read_trailer`).
        step: The step the manifest says this object is; None skips that check.

    Returns:
        The footer: every slice's range inside [0, footer_offset), the slices tiling it,
        every column inside its slice, of a known dtype and of a length matching its shape.

    Raises:
        CorruptTGB: a short read, a crc32 mismatch, JSON that is not the footer's schema, a
            value out of bounds, or a step other than `step`; the message names the field.
    """
    if len(data) != trailer.footer_length:
        raise CorruptTGB("footer", f"expected {trailer.footer_length} bytes, got {len(data)} (truncated object?)")
    if zlib.crc32(data) != trailer.footer_crc32:
        raise CorruptTGB("footer", "crc32 mismatch")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptTGB("footer", f"not UTF-8 JSON: {e}") from None
    _check_keys(doc, _FOOTER_KEYS, "footer")
    if doc["format"] != FORMAT_NAME:
        raise CorruptTGB("footer.format", f"expected {FORMAT_NAME!r}, got {doc['format']!r}")
    _int(doc["version"], "footer.version", FORMAT_VERSION, FORMAT_VERSION)
    got_step = _int(doc["step"], "footer.step", 0, MAX_STEP)
    if step is not None and got_step != step:
        raise CorruptTGB("footer.step", f"the object is step {got_step}, the manifest says step {step}")
    dp = _int(doc["dp"], "footer.dp", 1, MAX_SLICES)
    cp = _int(doc["cp"], "footer.cp", 1, MAX_SLICES)
    raw = doc["slices"]
    if not isinstance(raw, list) or len(raw) != dp * cp:
        raise CorruptTGB("footer.slices", f"expected a list of dp * cp = {dp * cp} entries")
    entries = [_slice_entry(item, f"footer.slices[{i}]", trailer.footer_offset) for i, item in enumerate(raw)]
    for i, entry in enumerate(entries):
        if (entry.dp, entry.cp) != (i // cp, i % cp):
            raise CorruptTGB(f"footer.slices[{i}]", f"expected coordinates ({i // cp}, {i % cp}), got ({entry.dp}, {entry.cp})")
    at = 0
    for entry in sorted(entries, key=lambda e: (e.offset, e.length)):
        if entry.offset != at:
            raise CorruptTGB(
                f"footer.slices[({entry.dp}, {entry.cp})].offset",
                f"slices must tile [0, {trailer.footer_offset}): expected {at}, got {entry.offset}",
            )
        at += entry.length
    if at != trailer.footer_offset:
        raise CorruptTGB("footer.slices", f"slices end at {at}, the footer starts at {trailer.footer_offset}")
    return Footer(got_step, dp, cp, tuple(entries))


def decode_slice(data: bytes | bytearray | memoryview, entry: SliceEntry) -> dict[str, np.ndarray]:
    """The batch of one slice, zero-copy.

    Args:
        data: The slice's bytes (`entry.range` of the object).
        entry: Its footer entry (`Footer.slice`).

    Returns:
        Column name -> array, in stored order; each array a view of `data` (no copy; read-only
        when `data` is read-only).

    Raises:
        CorruptTGB: a short read or a crc32 mismatch.
    """
    if len(data) != entry.length:
        raise CorruptTGB(f"slices[({entry.dp}, {entry.cp})]", f"expected {entry.length} bytes, got {len(data)} (truncated object?)")
    if zlib.crc32(data) != entry.crc32:
        raise CorruptTGB(f"slices[({entry.dp}, {entry.cp})]", "crc32 mismatch")
    out: dict[str, np.ndarray] = {}
    for col in entry.columns:
        dtype = np.dtype(col.dtype).newbyteorder("<")
        count = math.prod(col.shape)
        if count == 0:
            array = np.empty(col.shape, dtype=dtype)
        else:
            array = np.frombuffer(data, dtype=dtype, count=count, offset=col.offset).reshape(col.shape)
        out[col.name] = array
    return out


def decode_tgb(data: bytes | bytearray | memoryview, *, step: int | None = None) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Every slice of a whole TGB object (the dense read), zero-copy.

    Args:
        data: The whole object.
        step: The step the manifest says it is; None skips that check.

    Returns:
        (dp, cp) -> the slice's batch, as `decode_slice` returns it.

    Raises:
        CorruptTGB: anything `read_trailer`, `read_footer` or `decode_slice` refuses.
    """
    view = memoryview(data)
    size = len(view)
    start, end = trailer_range(size)
    trailer = read_trailer(view[start:end], object_size=size)
    lo, hi = footer_range(trailer)
    footer = read_footer(view[lo:hi], trailer, step=step)
    return {(e.dp, e.cp): decode_slice(view[e.offset : e.offset + e.length], e) for e in footer.slices}


def load_footer(
    fetch: Callable[[int, int], bytes], *, object_size: int, step: int | None = None, suffix_bytes: int = TRAILER_BYTES
) -> Footer:
    """Reads a TGB's footer with one suffix range read of the object's last `suffix_bytes`
    (trailer and footer, when the footer fits), or a second read of the rest of the footer.
    The default reads the trailer alone, then the footer (two reads); `FOOTER_SUFFIX_BYTES`
    saves the second for footers of up to about 50 slices.

    Args:
        fetch: Returns bytes [start, end) of the object (e.g. a bound `Storage.get_range`);
            a short answer is refused, not retried.
        object_size: The object's size, as the manifest records it.
        step: The step the manifest says it is; None skips that check.
        suffix_bytes: Bytes of the first read (at least the trailer, at most the object):
            larger saves the second read for larger footers, at the price of fetching slice
            bytes for smaller ones. TRAILER_BYTES (the default) reads the trailer alone.

    Returns:
        The footer, checked (cache it: it is immutable, like the object).

    Raises:
        CorruptTGB: anything `read_trailer` or `read_footer` refuses.
    """
    start, end = trailer_range(object_size)
    first = max(start - max(0, suffix_bytes - TRAILER_BYTES), 0)
    suffix = fetch(first, end)
    if len(suffix) != end - first:
        raise CorruptTGB("trailer", f"expected {end - first} bytes, got {len(suffix)} (truncated object?)")
    view = memoryview(suffix)
    trailer = read_trailer(view[start - first :], object_size=object_size)
    lo, hi = footer_range(trailer)
    if hi <= lo:
        return read_footer(b"", trailer, step=step)
    if lo >= first:
        return read_footer(view[lo - first : hi - first], trailer, step=step)
    return read_footer(fetch(lo, first) + bytes(view[: hi - first]), trailer, step=step)


def load_slice(fetch: Callable[[int, int], bytes], footer: Footer, *, dp: int, cp: int) -> dict[str, np.ndarray]:
    """Reads one slice with one range read of exactly its bytes.

    Args:
        fetch: As for `load_footer`.
        footer: The object's footer (`load_footer`).
        dp, cp: The slice's coordinates.

    Returns:
        The slice's batch, as `decode_slice` returns it.

    Raises:
        InvalidArgument: (dp, cp) is outside the TGB's mesh.
        CorruptTGB: anything `decode_slice` refuses.
    """
    entry = footer.slice(dp, cp)
    lo, hi = entry.range
    return decode_slice(fetch(lo, hi) if hi > lo else b"", entry)


# --- helpers -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: np.dtype) -> str:
    """numpy's name of a dtype (a property that costs microseconds per call, once per dtype)."""
    return dtype.name


def _is_little_contiguous(array: np.ndarray) -> bool:
    """Whether the array's bytes already lie as a TGB stores them: C-contiguous, little-endian."""
    order = array.dtype.byteorder
    return array.flags.c_contiguous and (order in "<|" or (order == "=" and sys.byteorder == "little"))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_size(object_size: int) -> None:
    if not _is_int(object_size) or object_size < 0:
        raise InvalidArgument(f"object_size: must be an int >= 0, got {object_size!r}")
    if object_size < TRAILER_BYTES:
        raise CorruptTGB("object_size", f"{object_size} bytes is smaller than the {TRAILER_BYTES}-byte trailer (truncated object?)")


def _int(value: object, field: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptTGB(field, f"expected an int in [{lo}, {hi}], got {value!r}"[:300])
    return value


def _check_keys(doc: object, keys: frozenset[str], field: str) -> None:
    if not isinstance(doc, dict):
        raise CorruptTGB(field, f"expected an object, got {type(doc).__name__}")
    if set(doc) != keys:
        raise CorruptTGB(field, f"expected keys {sorted(keys)}, got {sorted(map(str, doc))[:20]}")


def _slice_entry(item: Any, field: str, data_end: int) -> SliceEntry:
    _check_keys(item, _SLICE_KEYS_WITH_META if isinstance(item, dict) and "meta" in item else _SLICE_KEYS, field)
    d = _int(item["dp"], f"{field}.dp", 0, MAX_SLICES)
    c = _int(item["cp"], f"{field}.cp", 0, MAX_SLICES)
    offset = _int(item["offset"], f"{field}.offset", 0, data_end)
    length = _int(item["length"], f"{field}.length", 0, data_end - offset)
    if offset % ALIGN or length % ALIGN:
        raise CorruptTGB(f"{field}.offset", f"offset {offset} and length {length} must be multiples of {ALIGN}")
    crc = _int(item["crc32"], f"{field}.crc32", 0, 0xFFFFFFFF)
    raw = item["columns"]
    if not isinstance(raw, list) or len(raw) > MAX_COLUMNS:
        raise CorruptTGB(f"{field}.columns", f"expected a list of at most {MAX_COLUMNS} columns")
    columns = tuple(_column_entry(col, f"{field}.columns[{j}]", length) for j, col in enumerate(raw))
    names = [col.name for col in columns]
    if len(set(names)) != len(names):
        raise CorruptTGB(f"{field}.columns", "duplicate column names")
    _check_disjoint(((col.offset, col.length) for col in columns), f"{field}.columns")
    meta = item.get("meta", {})
    problem = _meta_problem(meta)
    if problem:
        raise CorruptTGB(f"{field}.meta", problem[:300])
    return SliceEntry(d, c, offset, length, crc, columns, dict(meta))


def _meta_problem(meta: object) -> str | None:
    """What is wrong with a slice's meta figures, or None."""
    if not isinstance(meta, Mapping):
        return f"expected an object of names to ints, got {type(meta).__name__}"
    if len(meta) > MAX_META:
        return f"at most {MAX_META} names, got {len(meta)}"
    for name, value in meta.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            return f"a name must be a non-empty string of at most {MAX_NAME} characters, got {name!r}"
        if not _is_int(value) or not 0 <= value <= MAX_META_VALUE:
            return f"{name!r}: expected an int in [0, {MAX_META_VALUE}], got {value!r}"
    return None


def _column_entry(item: Any, field: str, slice_length: int) -> ColumnEntry:
    _check_keys(item, _COLUMN_KEYS, field)
    name = item["name"]
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise CorruptTGB(f"{field}.name", f"expected a non-empty string of at most {MAX_NAME} characters, got {name!r}"[:300])
    dtype = item["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CorruptTGB(f"{field}.dtype", f"unknown dtype {dtype!r}"[:300])
    shape = item["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise CorruptTGB(f"{field}.shape", f"expected a list of at most {MAX_DIMS} ints")
    dims = tuple(_int(n, f"{field}.shape", 0, MAX_DIM) for n in shape)
    offset = _int(item["offset"], f"{field}.offset", 0, slice_length)
    length = _int(item["length"], f"{field}.length", 0, slice_length - offset)
    if offset % ALIGN:
        raise CorruptTGB(f"{field}.offset", f"{offset} is not a multiple of {ALIGN}")
    nbytes = math.prod(dims) * np.dtype(dtype).itemsize
    if nbytes != length:
        raise CorruptTGB(f"{field}.shape", f"shape {list(dims)} of {dtype} is {nbytes} bytes, the entry says {length}")
    return ColumnEntry(name, dtype, dims, offset, length)


def _check_disjoint(ranges: Iterable[tuple[int, int]], field: str) -> None:
    end = 0
    for offset, length in sorted(r for r in ranges if r[1] > 0):
        if offset < end:
            raise CorruptTGB(field, f"byte ranges overlap at {offset}")
        end = offset + length
