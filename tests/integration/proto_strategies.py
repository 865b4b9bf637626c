"""Hypothesis strategies for any protobuf message, built by walking its descriptor: every scalar
type with its extremes, strings from a vocabulary of the job's own names and of hostile ones,
repeated fields, maps, oneofs and nested messages; `batchplane.v1.Array` (and so `SampleSet`)
as well-formed arrays of random values or as arrays whose dtype, shape and bytes disagree; and
raw request bytes that mostly do not parse. Used by the fuzzing tests (test_fuzz_rpcs.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from batchplane.v1 import common_pb2

#: A field name -> the strategy drawing its value (a scalar, or a list for a repeated field).
Overrides = Mapping[str, st.SearchStrategy]

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    """Small values (indices, steps), the type's extremes and their neighbours, and any value."""
    extremes = {low, high, low + 1, high - 1, 2**31 - 1, 2**31, 2**53 + 1, 10**9, 10**15, -1, -2}
    extremes = sorted(v for v in extremes if low <= v <= high)
    return st.one_of(
        st.integers(max(low, -1), min(high, 4)),
        st.sampled_from(extremes),
        st.integers(low, high),
    )


#: Scalar field type -> its strategy (strings and messages are handled apart).
_SCALARS: dict[int, st.SearchStrategy] = {
    FieldDescriptor.TYPE_INT32: _ints(*INT32),
    FieldDescriptor.TYPE_SINT32: _ints(*INT32),
    FieldDescriptor.TYPE_SFIXED32: _ints(*INT32),
    FieldDescriptor.TYPE_INT64: _ints(*INT64),
    FieldDescriptor.TYPE_SINT64: _ints(*INT64),
    FieldDescriptor.TYPE_SFIXED64: _ints(*INT64),
    FieldDescriptor.TYPE_UINT32: _ints(*UINT32),
    FieldDescriptor.TYPE_FIXED32: _ints(*UINT32),
    FieldDescriptor.TYPE_UINT64: _ints(*UINT64),
    FieldDescriptor.TYPE_FIXED64: _ints(*UINT64),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
}

#: Strings every part may take for something: ids, names, addresses, fingerprints' keys, and
#: hostile ones (too long, blanks, control characters, path and URL tricks).
HOSTILE_STRINGS = (
    "",
    "0",
    "1",
    "-1",
    "data",
    "shape",
    "127.0.0.1:1",
    "localhost:0",
    "unix:///tmp/x.sock",
    "dns:///planner:50051",
    "x" * 254,
    "y" * 600,
    "a b",
    "line\nbreak",
    "nul\x00byte",
    "../../etc/passwd",
    "%2F..%2F",
    "é💥",
)

#: Dtype names for Array: those that travel, byte-order and alias spellings, ones numpy knows
#: but the wire does not, and nonsense.
DTYPE_NAMES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "<i8",
    ">i4",
    "object",
    "complex128",
    "U8",
    "V16",
    "datetime64",
    "int33",
    "",
    "int64 ",
)
_WIRE_DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")


def strings(vocabulary: Sequence[str] = ()) -> st.SearchStrategy[str]:
    """A job's own names (`vocabulary`), hostile strings, and any text."""
    return st.one_of(st.sampled_from((*vocabulary, *HOSTILE_STRINGS)), st.text(max_size=24))


@st.composite
def well_formed_arrays(draw: st.DrawFn, dtypes: Sequence[str] = _WIRE_DTYPES) -> common_pb2.Array:
    """An Array whose dtype, shape and bytes agree (1-D, a few values: small ones, extremes)."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    n = draw(st.integers(0, 12))
    if dtype.kind == "b":
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = draw(st.lists(_ints(int(info.min), int(info.max)), min_size=n, max_size=n))
    else:
        values = draw(st.lists(st.floats(width=16 if dtype.itemsize == 2 else 32 if dtype.itemsize == 4 else 64), min_size=n, max_size=n))
    array = np.asarray(values, dtype=dtype).reshape(n)
    return common_pb2.Array(dtype=dtype.name, shape=array.shape, data=array.tobytes())


@st.composite
def malformed_arrays(draw: st.DrawFn) -> common_pb2.Array:
    """An Array whose dtype, shape and bytes need not agree: any dtype name, any extents
    (negative, huge, many dimensions), any bytes."""
    return common_pb2.Array(
        dtype=draw(st.one_of(st.sampled_from(DTYPE_NAMES), st.text(max_size=8))),
        shape=draw(st.lists(_ints(*INT64), max_size=4)),
        data=draw(st.binary(max_size=96)),
    )


def arrays() -> st.SearchStrategy[common_pb2.Array]:
    """Well-formed Arrays of every wire dtype (int32 and int64 twice as likely: the dtypes
    requests ask for), and malformed ones."""
    return st.one_of(
        well_formed_arrays(("int32", "int64")),
        well_formed_arrays(),
        malformed_arrays(),
    )


@st.composite
def sample_sets(draw: st.DrawFn) -> common_pb2.SampleSet:
    """A SampleSet: mostly source (int32) and seq (int64) arrays of one length, with small
    positions, as a constructor would send (so a fetch gets past its format checks); otherwise
    every column any Array."""
    if draw(st.booleans()):
        n = draw(st.integers(0, 16))
        source = np.asarray(draw(st.lists(st.integers(-1, 2), min_size=n, max_size=n)), np.int32)
        seq = np.asarray(
            draw(st.lists(st.one_of(st.integers(-1, 400), st.sampled_from([2**31, 2**62, 2**63 - 1])), min_size=n, max_size=n)), np.int64
        )
        out = common_pb2.SampleSet(
            source=common_pb2.Array(dtype="int32", shape=[n], data=source.tobytes()),
            seq=common_pb2.Array(dtype="int64", shape=[n], data=seq.tobytes()),
        )
        for name in ("row", "length", "epoch"):
            if draw(st.booleans()):
                getattr(out, name).CopyFrom(draw(arrays()))
        return out
    out = common_pb2.SampleSet()
    for name in ("source", "seq", "row", "length", "epoch"):
        if draw(st.booleans()):
            getattr(out, name).CopyFrom(draw(arrays()))
    return out


#: Full message name -> a strategy replacing the generic walk.
SPECIAL: dict[str, Callable[[], st.SearchStrategy]] = {
    "batchplane.v1.Array": arrays,
    "batchplane.v1.SampleSet": sample_sets,
}


def messages(
    descriptor: Descriptor,
    *,
    overrides: Overrides | None = None,
    vocabulary: Sequence[str] = (),
    max_depth: int = 4,
    max_repeated: int = 6,
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type with every field drawn (or left unset) by its type.

    Args:
        overrides: Field name -> strategy for that field, at the top level only.
        vocabulary: Strings of the job (source names, addresses) drawn besides hostile ones.
        max_depth: Nested messages deeper than this are left empty.
        max_repeated: The most elements of a repeated field or entries of a map.
    """
    text = strings(vocabulary)

    def value_of(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
        if field.type == FieldDescriptor.TYPE_STRING:
            return text
        if field.type == FieldDescriptor.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return st.one_of(st.sampled_from(numbers), _ints(*INT32))
        if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            return walk(field.message_type, depth + 1)
        return _SCALARS[field.type]

    def walk(desc: Descriptor, depth: int, top: Overrides | None = None) -> st.SearchStrategy:
        if desc.full_name in SPECIAL:
            return SPECIAL[desc.full_name]()
        if depth > max_depth:
            return st.just(message_factory.GetMessageClass(desc)())
        message_cls = message_factory.GetMessageClass(desc)

        @st.composite
        def build(draw: st.DrawFn) -> Message:
            msg = message_cls()
            chosen_oneof = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in desc.oneofs}
            for field in desc.fields:
                if field.containing_oneof is not None and chosen_oneof[field.containing_oneof.name] != field.name:
                    continue
                if top and field.name in top:
                    _assign(msg, field, draw(top[field.name]))
                    continue
                if not draw(st.integers(0, 3)):  # a quarter of fields stay unset
                    continue
                if field.message_type is not None and field.message_type.GetOptions().map_entry:
                    key_field = field.message_type.fields_by_name["key"]
                    value_field = field.message_type.fields_by_name["value"]
                    entries = draw(st.dictionaries(value_of(key_field, depth), value_of(value_field, depth), max_size=max_repeated))
                    _assign(msg, field, entries)
                elif field.is_repeated:
                    _assign(msg, field, draw(st.lists(value_of(field, depth), max_size=max_repeated)))
                else:
                    _assign(msg, field, draw(value_of(field, depth)))
            return msg

        return build()

    return walk(descriptor, 0, overrides or {})


def _assign(msg: Message, field: FieldDescriptor, value: Any) -> None:
    """Sets `field` of `msg` to `value` (a scalar, a message, a list or a dict)."""
    target = getattr(msg, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_field.message_type is not None:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        if field.message_type is not None:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


@st.composite
def raw_requests(draw: st.DrawFn, valid: st.SearchStrategy[Message]) -> bytes:
    """Request bytes: random bytes, a valid request with bytes flipped, cut short or appended
    to, and protobuf framing that lies (a length past the end, a wrong wire type, a varint
    that never ends). Most do not parse; some do (the caller parses them to know which)."""
    kind = draw(st.sampled_from(["random", "flipped", "truncated", "appended", "framing"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=200))
    base = draw(valid).SerializeToString()
    if kind == "flipped" and base:
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return bytes(data)
    if kind == "truncated" and len(base) > 1:
        return base[: draw(st.integers(1, len(base) - 1))]
    if kind == "appended":
        return base + draw(st.binary(min_size=1, max_size=16))
    return draw(
        st.sampled_from(
            [
                b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length-delimited, 4 GiB long
                b"\x0a\x05ab",  # length 5, 2 bytes follow
                b"\x08" + b"\xff" * 11,  # a varint of 11 bytes
                b"\x08\x80",  # a varint cut short
                b"\x0b",  # start group, never ended
                b"\x0c",  # end group without a start
                b"\x0f",  # wire type 7 does not exist
                b"\x00\x01",  # field number 0
                b"\x12\x03\x0a\x01",  # a nested message cut short
            ]
        )
    )


@st.composite
def mutated(draw: st.DrawFn, typical: st.SearchStrategy[Message], wild: st.SearchStrategy[Message]) -> Message:
    """A typical request (what a correct caller sends) with some of its fields replaced by the
    wild request's (set or left unset): requests that get past most checks and then differ in
    one or two places, where bounds are easiest to miss."""
    base, other = draw(typical), draw(wild)
    names = [f.name for f in base.DESCRIPTOR.fields]
    if not names:
        return base
    replace = draw(st.sets(st.sampled_from(names), min_size=1, max_size=2))
    part = type(other)()
    part.CopyFrom(other)
    out = type(base)()
    out.CopyFrom(base)
    for name in names:
        (out if name in replace else part).ClearField(name)
    out.MergeFrom(part)
    return out
