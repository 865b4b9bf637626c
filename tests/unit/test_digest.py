"""`batchplane.core.digest`: a sample's digest names its exact content (token ids, declared
payload columns, their lengths), is the same whichever part computes it and however the
samples are laid out in Arrow, and changes with any single value or split. Properties
(hypothesis) and examples; no I/O."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.digest import DTYPE, mismatched, sample_digests
from batchplane.core.payload import PayloadColumn, normalize

TOKENS = st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40), min_size=1, max_size=12)

#: One column of each kind, as a job declares them (`batch.payload`).
PAYLOAD = (
    PayloadColumn("loss_mask", "token", "bool"),
    PayloadColumn("lang", "sample", "int16"),
    PayloadColumn("grid", "sample", "int64", (3,)),
    PayloadColumn("pixels", "blob", "uint8", (4,)),
)


def _ids(rows: list[list[int]]) -> pa.Array:
    return pa.array(rows, pa.list_(pa.int32()))


def _digests(rows: list[list[int]]) -> np.ndarray:
    return sample_digests(_ids(rows), {}, ())


def _columns(rows: list[list[int]], seed: int) -> dict[str, pa.Array]:
    """A value of every column of PAYLOAD for samples of `rows`' token lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.array([len(r) for r in rows])
    raw = {
        "loss_mask": pa.array([rng.random(n) < 0.5 for n in lengths], pa.list_(pa.bool_())),
        "lang": pa.array(rng.integers(0, 100, len(rows)), pa.int16()),
        "grid": pa.array([rng.integers(0, 9, 3) for _ in rows], pa.list_(pa.int64())),
        "pixels": pa.array([rng.integers(0, 255, 4 * int(rng.integers(0, 3))) for _ in rows], pa.list_(pa.uint8())),
    }
    return {c.name: normalize(c, raw[c.name], lengths) for c in PAYLOAD}


@settings(max_examples=200, deadline=None)
@given(TOKENS)
def test_equal_contents_give_equal_digests_and_good_samples_never_get_zero(rows) -> None:
    first, again = _digests(rows), _digests([list(r) for r in rows])
    assert first.dtype == DTYPE and first.tolist() == again.tolist()
    assert (first != 0).all()
    for i, row in enumerate(rows):  # a sample's digest depends on its own content only
        assert _digests([row])[0] == first[i]


@settings(max_examples=300, deadline=None)
@given(TOKENS, st.data())
def test_any_single_token_change_changes_that_samples_digest_only(rows, data) -> None:
    nonempty = [i for i, r in enumerate(rows) if r]
    if not nonempty:
        rows[0].append(data.draw(st.integers(0, 50_000)))
        nonempty = [0]
    i = data.draw(st.sampled_from(nonempty))
    t = data.draw(st.integers(0, len(rows[i]) - 1))
    changed = [list(r) for r in rows]
    changed[i][t] = data.draw(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != rows[i][t]))
    before, after = _digests(rows), _digests(changed)
    assert mismatched(after, before).tolist() == [i]


@settings(max_examples=200, deadline=None)
@given(TOKENS.filter(lambda rows: len(rows) >= 2 and any(rows[:-1])), st.data())
def test_the_same_tokens_split_otherwise_between_samples_give_other_digests(rows, data) -> None:
    i = data.draw(st.sampled_from([k for k in range(len(rows) - 1) if rows[k]]))
    moved = [list(r) for r in rows]
    moved[i + 1].insert(0, moved[i].pop())  # the last token of sample i opens sample i + 1
    before, after = _digests(rows), _digests(moved)
    assert before[i] != after[i] and before[i + 1] != after[i + 1]


def test_declared_columns_count_each_value_and_the_layout_of_the_arrays_does_not() -> None:
    rows = [[1, 2, 3], [4], [5, 6, 7, 8], [9, 9]]
    columns = _columns(rows, seed=1)
    base = sample_digests(_ids(rows), columns, PAYLOAD)
    assert base.tolist() != _digests(rows).tolist()  # the columns are covered
    # The same samples gathered into another order (slices, offsets not from 0) digest alike.
    order = pa.array([2, 0, 3, 1])
    taken = sample_digests(_ids(rows).take(order), {n: a.take(order) for n, a in columns.items()}, PAYLOAD)
    assert taken.tolist() == base[[2, 0, 3, 1]].tolist()
    sliced = sample_digests(_ids(rows).slice(1, 2), {n: a.slice(1, 2) for n, a in columns.items()}, PAYLOAD)
    assert sliced.tolist() == base[1:3].tolist()
    # One value of any column of one sample changes that sample's digest only.
    for column in PAYLOAD:
        altered = dict(columns)
        values = columns[column.name].to_pylist()
        victim = next(i for i, v in enumerate(values) if v not in ([], None))
        if column.kind == "sample" and not column.shape:
            values[victim] = values[victim] + 1
        else:
            first = values[victim][0]
            values[victim] = [(not first) if column.dtype == "bool" else first + 1, *values[victim][1:]]
        altered[column.name] = normalize(column, pa.array(values, columns[column.name].type), np.array([len(r) for r in rows]))
        got = sample_digests(_ids(rows), altered, PAYLOAD)
        assert mismatched(got, base).tolist() == [victim], column.name


def test_a_blob_row_moved_between_samples_changes_both() -> None:
    rows = [[1], [2]]
    blob = PayloadColumn("pixels", "blob", "uint8", (2,))
    lengths = np.array([1, 1])
    one = normalize(blob, pa.array([[1, 2, 3, 4], []], pa.list_(pa.uint8())), lengths)
    other = normalize(blob, pa.array([[1, 2], [3, 4]], pa.list_(pa.uint8())), lengths)
    a, b = sample_digests(_ids(rows), {"pixels": one}, (blob,)), sample_digests(_ids(rows), {"pixels": other}, (blob,))
    assert a[0] != b[0] and a[1] != b[1]


def test_only_the_good_samples_are_digested_the_others_get_zero() -> None:
    ids = pa.array([[1, 2], None, [], [3]], pa.list_(pa.int32()))
    got = sample_digests(ids, {}, (), good=np.array([True, False, False, True]))
    assert got[1] == got[2] == 0 and got[0] != 0 and got[3] != 0
    assert got[0] == _digests([[1, 2]])[0]


def test_a_declared_column_missing_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        sample_digests(_ids([[1]]), {}, PAYLOAD[:1])


def test_what_arrives_through_arrow_ipc_digests_as_what_the_loader_digested() -> None:
    """The loader digests its window's arrays; the constructor the record batch it decoded from
    the IPC payload: the same bytes, so the same digests."""
    rows = [[7, 8, 9], [1], [2, 3]]
    columns = _columns(rows, seed=5)
    loader = sample_digests(_ids(rows), columns, PAYLOAD)
    batch = pa.record_batch([_ids(rows), *(columns[c.name] for c in PAYLOAD)], names=["input_ids", *(c.name for c in PAYLOAD)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    table = pa.ipc.open_stream(sink.getvalue()).read_all()
    got = sample_digests(table.column("input_ids"), {c.name: table.column(c.name).combine_chunks() for c in PAYLOAD}, PAYLOAD)
    assert got.tolist() == loader.tolist()
