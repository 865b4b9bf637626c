"""Tests of batchplane.journal.tgb: encode -> decode round-trips for any dtypes, shapes and
meshes; range reads of one slice (and their read amplification); every single-byte corruption
and every truncation refused; crafted footers refused with the field named."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchplane.core.errors import InvalidArgument
from batchplane.journal import tgb
from batchplane.journal.tgb import TRAILER_BYTES, CorruptTGB

_settings = settings(max_examples=60, deadline=None)

_dtype = st.sampled_from(sorted(tgb.DTYPES)).map(np.dtype)
_order = st.sampled_from(["<", ">"])


@st.composite
def _array(draw) -> np.ndarray:
    dtype = draw(_dtype)
    if dtype.itemsize > 1 and draw(_order) == ">":
        dtype = dtype.newbyteorder(">")
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    array = draw(hnp.arrays(dtype, shape, elements={"allow_nan": True} if dtype.kind in "fc" else None))
    layout = draw(st.sampled_from(["c", "fortran", "reversed"]))  # the encoder copies only what is not C-contiguous
    if layout == "fortran":
        return np.asfortranarray(array)
    return array[::-1] if layout == "reversed" and array.ndim else array


_names = st.text(alphabet="abcxyz_", min_size=1, max_size=6)
_batch = st.dictionaries(_names, _array(), max_size=4)


@st.composite
def _tgb(draw):
    dp = draw(st.integers(1, 3))
    cp = draw(st.integers(1, 3))
    slices = {(d, c): draw(_batch) for d in range(dp) for c in range(cp)}
    step = draw(st.integers(0, 2**40))
    return slices, step, dp, cp


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, array in want.items():
        out = got[name]
        assert out.dtype.name == array.dtype.name and out.shape == array.shape, name
        assert out.dtype.byteorder in "<|=", name
        np.testing.assert_array_equal(out, array)
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        assert out.tobytes() == little.tobytes(), name  # byte-identical, NaN payloads included


class _Fetcher:
    """A range reader over bytes that counts what it hands out, like Storage.get_range."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> bytes:
        self.calls.append((start, end))
        return self.data[start:end]

    @property
    def fetched(self) -> int:
        return sum(len(self.data[a:b]) for a, b in self.calls)


@_settings
@given(_tgb())
def test_round_trip_whole_object(case) -> None:
    slices, step, dp, cp = case
    data = bytes(tgb.encode_tgb(slices, step=step, dp=dp, cp=cp))
    got = tgb.decode_tgb(data, step=step)
    assert set(got) == set(slices)
    for key, want in slices.items():
        _same(got[key], want)


@_settings
@given(_tgb(), st.data())
def test_range_read_of_one_slice_reads_slice_plus_trailer_plus_footer(case, data) -> None:
    slices, step, dp, cp = case
    obj = bytes(tgb.encode_tgb(slices, step=step, dp=dp, cp=cp))
    d, c = data.draw(st.integers(0, dp - 1)), data.draw(st.integers(0, cp - 1))
    fetch = _Fetcher(obj)
    footer = tgb.load_footer(fetch, object_size=len(obj), step=step)
    batch = tgb.load_slice(fetch, footer, dp=d, cp=c)
    _same(batch, slices[(d, c)])
    entry = footer.slice(d, c)
    trailer = tgb.read_trailer(obj[-TRAILER_BYTES:], object_size=len(obj))
    assert fetch.fetched == entry.length + TRAILER_BYTES + trailer.footer_length
    assert len(fetch.calls) == 2 + (entry.length > 0)
    # With a suffix read: one read holds trailer and footer when they fit, else a second the rest.
    fetch = _Fetcher(obj)
    assert tgb.load_footer(fetch, object_size=len(obj), step=step, suffix_bytes=tgb.FOOTER_SUFFIX_BYTES) == footer
    tail = TRAILER_BYTES + trailer.footer_length
    suffix = min(len(obj), tgb.FOOTER_SUFFIX_BYTES)
    assert fetch.fetched == max(suffix, tail)
    assert len(fetch.calls) == 1 + (tail > suffix)
    # Padding is at most ALIGN - 1 bytes per column: a slice costs little more than its data.
    data_bytes = sum(np.asarray(a).nbytes for a in slices[(d, c)].values())
    assert data_bytes <= entry.length <= data_bytes + tgb.ALIGN * len(slices[(d, c)])


@_settings
@given(_tgb(), st.sampled_from([TRAILER_BYTES, 40, 100, 1000, 10**6]))
def test_the_footer_is_read_with_any_suffix_size(case, suffix_bytes) -> None:
    slices, step, dp, cp = case
    obj = bytes(tgb.encode_tgb(slices, step=step, dp=dp, cp=cp))
    want = tgb.load_footer(_Fetcher(obj), object_size=len(obj), step=step, suffix_bytes=TRAILER_BYTES)
    fetch = _Fetcher(obj)
    assert tgb.load_footer(fetch, object_size=len(obj), step=step, suffix_bytes=suffix_bytes) == want
    tail = TRAILER_BYTES + want_footer_length(obj)
    assert len(fetch.calls) == (1 if tail <= max(suffix_bytes, TRAILER_BYTES) else 2)


def want_footer_length(obj: bytes) -> int:
    return tgb.read_trailer(obj[-TRAILER_BYTES:], object_size=len(obj)).footer_length


def test_decoded_arrays_are_views_of_the_fetched_bytes() -> None:
    slices = {(0, 0): {"input_ids": np.arange(64, dtype=np.int32).reshape(4, 16)}}
    obj = tgb.encode_tgb(slices, step=0, dp=1, cp=1)
    got = tgb.decode_tgb(bytes(obj))[(0, 0)]["input_ids"]
    assert not got.flags.writeable and not got.flags.owndata
    writable = tgb.decode_tgb(obj)[(0, 0)]["input_ids"]  # a bytearray: writable views of it
    writable[0, 0] = 99
    assert np.frombuffer(obj, dtype=np.int32, count=1)[0] == 99


@settings(max_examples=25, deadline=None)
@given(_tgb(), st.data())
def test_every_single_byte_corruption_is_refused(case, data) -> None:
    slices, step, dp, cp = case
    obj = bytes(tgb.encode_tgb(slices, step=step, dp=dp, cp=cp))
    at = data.draw(st.integers(0, len(obj) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(obj)
    bad[at] ^= flip
    with pytest.raises(CorruptTGB):
        tgb.decode_tgb(bytes(bad), step=step)
    # Reading by range, the slice that holds the byte is refused; the others are intact.
    size = len(obj)
    try:
        footer = tgb.load_footer(_Fetcher(bytes(bad)), object_size=size, step=step)
    except CorruptTGB:
        assert at >= size - TRAILER_BYTES - len(_footer_bytes(obj))  # in the footer or trailer
        return
    for entry in footer.slices:
        lo, hi = entry.range
        if lo <= at < hi:
            with pytest.raises(CorruptTGB, match="crc32"):
                tgb.load_slice(_Fetcher(bytes(bad)), footer, dp=entry.dp, cp=entry.cp)
        else:
            _same(tgb.load_slice(_Fetcher(bytes(bad)), footer, dp=entry.dp, cp=entry.cp), slices[(entry.dp, entry.cp)])


def _footer_bytes(obj: bytes) -> bytes:
    trailer = tgb.read_trailer(obj[-TRAILER_BYTES:], object_size=len(obj))
    return obj[trailer.footer_offset : trailer.footer_offset + trailer.footer_length]


def test_every_byte_of_an_object_is_covered() -> None:
    slices = {
        (d, c): {"input_ids": np.arange(6, dtype=np.int64).reshape(2, 3) + d, "cu": np.array([0, 3], np.int32), "m": np.float16(c)}
        for d in range(2)
        for c in range(2)
    }
    slices[(1, 1)] = {}
    obj = bytes(tgb.encode_tgb(slices, step=7, dp=2, cp=2))
    for at in range(len(obj)):
        bad = bytearray(obj)
        bad[at] ^= 0x01
        with pytest.raises(CorruptTGB):
            tgb.decode_tgb(bytes(bad), step=7)


@settings(max_examples=25, deadline=None)
@given(_tgb(), st.data())
def test_truncated_objects_are_refused(case, data) -> None:
    slices, step, dp, cp = case
    obj = bytes(tgb.encode_tgb(slices, step=step, dp=dp, cp=cp))
    cut = data.draw(st.integers(0, len(obj) - 1))
    short = obj[:cut]
    with pytest.raises(CorruptTGB):
        tgb.decode_tgb(short)
    # A manifest that records the full size gets short range reads: refused too.
    fetch = _Fetcher(short)
    try:
        footer = tgb.load_footer(fetch, object_size=len(obj))
    except CorruptTGB:
        return
    entry = max(footer.slices, key=lambda e: e.offset + e.length)
    if entry.offset + entry.length > cut:
        with pytest.raises(CorruptTGB):
            tgb.load_slice(fetch, footer, dp=entry.dp, cp=entry.cp)


def _craft(obj: bytes, edit) -> bytes:
    """The object with its footer JSON edited by `edit` and the trailer rewritten to match
    (a hostile writer, not a corruption: every checksum is right)."""
    trailer = tgb.read_trailer(obj[-TRAILER_BYTES:], object_size=len(obj))
    doc = json.loads(_footer_bytes(obj))
    edit(doc)
    footer = json.dumps(doc).encode()
    tail = struct.pack("<4sHHQQI4s", tgb.MAGIC, 1, 0, trailer.footer_offset, len(footer), zlib.crc32(footer), tgb.END_MAGIC)
    return obj[: trailer.footer_offset] + footer + tail


def _base() -> bytes:
    slices = {(d, 0): {"input_ids": np.arange(8, dtype=np.int32).reshape(2, 4), "x": np.ones(3, np.float32)} for d in range(2)}
    return bytes(tgb.encode_tgb(slices, step=5, dp=2, cp=1))


def _set(path, value):
    def edit(doc):
        node = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set(["version"], 2), "footer.version"),
        (_set(["format"], "other"), "footer.format"),
        (_set(["step"], 6), "footer.step"),
        (_set(["step"], True), "footer.step"),
        (_set(["dp"], 3), "footer.slices"),
        (_set(["extra"], 1), "footer"),
        (_set(["slices", 0, "offset"], 10**12), "footer.slices[0].offset"),
        (_set(["slices", 0, "length"], 10**12), "footer.slices[0].length"),
        (_set(["slices", 0, "length"], -64), "footer.slices[0].length"),
        (_set(["slices", 1, "offset"], 0), "footer.slices[(1, 0)].offset"),
        (_set(["slices", 1, "dp"], 0), "footer.slices[1]"),
        (_set(["slices", 0, "crc32"], 2**33), "footer.slices[0].crc32"),
        (_set(["slices", 0, "columns", 0, "dtype"], "object"), "footer.slices[0].columns[0].dtype"),
        (_set(["slices", 0, "columns", 0, "dtype"], "<i4"), "footer.slices[0].columns[0].dtype"),
        (_set(["slices", 0, "columns", 0, "shape"], [2, 5]), "footer.slices[0].columns[0].shape"),
        (_set(["slices", 0, "columns", 0, "shape"], [2, -4]), "footer.slices[0].columns[0].shape"),
        (_set(["slices", 0, "columns", 0, "shape"], [1] * 40), "footer.slices[0].columns[0].shape"),
        (_set(["slices", 0, "columns", 0, "offset"], 32), "footer.slices[0].columns[0].offset"),
        (_set(["slices", 0, "columns", 0, "offset"], 64), "footer.slices[0].columns"),
        (_set(["slices", 0, "columns", 0, "offset"], 10**9), "footer.slices[0].columns[0].offset"),
        (_set(["slices", 0, "columns", 1, "offset"], 0), "footer.slices[0].columns"),
        (_set(["slices", 0, "columns", 1, "name"], "input_ids"), "footer.slices[0].columns"),
        (_set(["slices", 0, "columns", 0, "name"], ""), "footer.slices[0].columns[0].name"),
        (_set(["slices"], {}), "footer.slices"),
        (_set(["slices", 0, "meta"], {"loss_tokens": -1}), "footer.slices[0].meta"),
        (_set(["slices", 0, "meta"], {"loss_tokens": 2**63}), "footer.slices[0].meta"),
        (_set(["slices", 0, "meta"], {"loss_tokens": 1.5}), "footer.slices[0].meta"),
        (_set(["slices", 0, "meta"], {"loss_tokens": True}), "footer.slices[0].meta"),
        (_set(["slices", 0, "meta"], {"": 1}), "footer.slices[0].meta"),
        (_set(["slices", 0, "meta"], {f"m{i}": 1 for i in range(17)}), "footer.slices[0].meta"),
        (_set(["slices", 0, "meta"], [1]), "footer.slices[0].meta"),
        (_set(["slices", 0, "figures"], {}), "footer.slices[0]"),
    ],
)
def test_crafted_footers_are_refused_naming_the_field(edit, field) -> None:
    bad = _craft(_base(), edit)
    with pytest.raises(CorruptTGB) as e:
        tgb.decode_tgb(bad, step=5)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("at", "value", "field"),
    [
        (0, b"XPTG", "trailer.magic"),
        (28, b"XXXX", "trailer.end_magic"),
        (4, struct.pack("<H", 9), "trailer.version"),
        (6, struct.pack("<H", 1), "trailer.flags"),
        (8, struct.pack("<Q", 1), "trailer.footer_offset"),
        (16, struct.pack("<Q", 1), "trailer.footer_length"),
    ],
)
def test_bad_trailers_are_refused_naming_the_field(at, value, field) -> None:
    obj = bytearray(_base())
    start = len(obj) - TRAILER_BYTES + at
    obj[start : start + len(value)] = value
    with pytest.raises(CorruptTGB) as e:
        tgb.decode_tgb(bytes(obj))
    assert e.value.field == field


def test_garbage_and_tiny_objects_are_refused() -> None:
    for data in (b"", b"x" * 31, b"\0" * 32, b"\0" * 4096):
        with pytest.raises(CorruptTGB):
            tgb.decode_tgb(data)


def test_slice_meta_round_trips_and_is_absent_where_none_was_given() -> None:
    slices = {(d, c): {"x": np.full(3, d * 10 + c, np.int64)} for d in range(2) for c in range(2)}
    plain = tgb.encode_tgb(slices, step=1, dp=2, cp=2)
    with_meta = tgb.encode_tgb(slices, step=1, dp=2, cp=2, meta={(1, 0): {"loss_tokens": np.int64(7), "rows": 2}, (0, 1): {}})
    assert b"meta" not in bytes(plain), "an object without figures is written as before they existed"
    footer = tgb.load_footer(_Fetcher(bytes(with_meta)), object_size=len(with_meta))
    assert {(e.dp, e.cp): dict(e.meta) for e in footer.slices} == {
        (0, 0): {},
        (0, 1): {},
        (1, 0): {"loss_tokens": 7, "rows": 2},
        (1, 1): {},
    }
    for e in footer.slices:  # the data are laid out alike
        np.testing.assert_array_equal(tgb.load_slice(_Fetcher(bytes(with_meta)), footer, dp=e.dp, cp=e.cp)["x"], slices[(e.dp, e.cp)]["x"])


def test_encode_refuses_bad_meta() -> None:
    ok = {(0, 0): {"x": np.zeros(1)}}
    for meta, match in (
        ({(1, 0): {"a": 1}}, "outside"),
        ({(0, 0): {"a": -1}}, "'a'"),
        ({(0, 0): {"a": 1.0}}, "'a'"),
        ({(0, 0): {"": 1}}, "name"),
        ({(0, 0): {f"m{i}": 1 for i in range(17)}}, "at most 16"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            tgb.encode_tgb(ok, step=0, dp=1, cp=1, meta=meta)


def test_encode_refuses_bad_input() -> None:
    ok = {"input_ids": np.zeros((1, 2), np.int32)}
    with pytest.raises(InvalidArgument, match="missing"):
        tgb.encode_tgb({(0, 0): ok}, step=0, dp=2, cp=1)
    with pytest.raises(InvalidArgument, match="unexpected"):
        tgb.encode_tgb({(0, 0): ok, (0, 1): ok}, step=0, dp=1, cp=1)
    with pytest.raises(InvalidArgument, match="dtype 'object'"):
        tgb.encode_tgb({(0, 0): {"x": np.array([object()])}}, step=0, dp=1, cp=1)
    with pytest.raises(InvalidArgument, match="dtype 'str"):
        tgb.encode_tgb({(0, 0): {"x": np.array(["a"])}}, step=0, dp=1, cp=1)
    with pytest.raises(InvalidArgument, match="column name"):
        tgb.encode_tgb({(0, 0): {"": np.zeros(1)}}, step=0, dp=1, cp=1)
    with pytest.raises(InvalidArgument, match="step"):
        tgb.encode_tgb({(0, 0): ok}, step=-1, dp=1, cp=1)
    with pytest.raises(InvalidArgument, match="dp"):
        tgb.encode_tgb({}, step=0, dp=0, cp=1)


def test_footer_slice_lookup_refuses_outside_coordinates() -> None:
    obj = _base()
    footer = tgb.load_footer(_Fetcher(obj), object_size=len(obj))
    assert (footer.step, footer.dp, footer.cp) == (5, 2, 1)
    with pytest.raises(InvalidArgument, match="outside"):
        footer.slice(2, 0)
    with pytest.raises(InvalidArgument, match="outside"):
        footer.slice(0, -1)
