"""Tests of batchplane.journal.slices: topology change at resume. Properties: over any chain of
reader meshes (DP and CP grown or shrunk by integer ratios, any TP and PP) resumed from each
other's cursors, every written slice — every column of it — is read exactly once (I1) and TP/PP
peers read alike; CP re-cuts deliver exactly the tokens `cp_slice` would give the reader's rank
or are refused. Tables: the paper's DP examples."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor.parallel import TOKEN_TENSORS, cp_columns, cp_slice, cp_width
from batchplane.core.errors import InvalidArgument
from batchplane.core.mesh import ClientPlaceTree, Coord
from batchplane.journal.slices import (
    DataMesh,
    SliceCursor,
    SliceRead,
    TopologyError,
    advance,
    assemble,
    cp_picks,
    cursor_for,
    logical_steps,
    reads_for,
    written_steps,
)

_settings = settings(max_examples=80, deadline=None)


def _coord(dp: int, cp: int = 0, tp: int = 0, pp: int = 0) -> Coord:
    return Coord(rank=0, pp=pp, dp=dp, cp=cp, tp=tp)


@st.composite
def _reader_of(draw, written: DataMesh) -> DataMesh:
    """A reader mesh: DP grown or shrunk by an integer ratio (or any size), CP by an integer ratio."""
    d = written.dp
    dp = draw(
        st.one_of(
            st.integers(1, 3).map(lambda k: d * k),
            st.sampled_from([d // k for k in range(1, d + 1) if d % k == 0]),
            st.integers(1, 7),
        )
    )
    c = written.cp
    cp = draw(st.sampled_from(sorted({c * k for k in (1, 2, 3)} | {c // k for k in range(1, c + 1) if c % k == 0})))
    return DataMesh(dp=dp, cp=cp, cp_mode=written.cp_mode)


@st.composite
def _chain(draw):
    written = DataMesh(
        dp=draw(st.integers(1, 4)), cp=draw(st.sampled_from([1, 2, 4])), cp_mode=draw(st.sampled_from(["zigzag", "contiguous"]))
    )
    start = SliceCursor(draw(st.integers(0, 5)), draw(st.integers(0, written.dp - 1)))
    segments = draw(
        st.lists(st.tuples(_reader_of(written), st.integers(0, 4), st.integers(1, 2), st.integers(1, 2)), min_size=1, max_size=3)
    )
    return written, start, segments


@_settings
@given(_chain())
def test_every_written_slice_is_read_exactly_once_across_topology_changes(case) -> None:
    written, start, segments = case
    coverage: dict[tuple[int, int, int], list[tuple[Fraction, Fraction]]] = {}
    cursor = start
    for reader, steps, tp, pp in segments:
        tree = ClientPlaceTree(pp=pp, dp=reader.dp, cp=reader.cp, tp=tp)
        resumed_at = cursor  # a checkpoint's cursor, resumed on the new mesh
        for t in range(steps):
            assert cursor == cursor_for(t, origin_step=0, origin=resumed_at, written=written, reader=reader)
            by_data_coord: dict[tuple[int, int], list[SliceRead]] = {}
            for rank in range(tree.world):
                coord = tree.coords(rank)
                reads = reads_for(coord, cursor=cursor, written=written, reader=reader)
                key = (coord.dp, coord.cp)
                if key in by_data_coord:
                    assert reads == by_data_coord[key]  # TP and PP peers read alike
                    continue
                by_data_coord[key] = reads
                assert len({(r.step, r.dp) for r in reads}) == 1  # one written (step, dp) per rank and step
                assert {r.step for r in reads} <= set(written_steps(cursor, written=written, reader=reader))
                for r in reads:
                    coverage.setdefault(r.key, []).append((Fraction(r.first, r.parts), Fraction(r.last, r.parts)))
            cursor = advance(cursor, written=written, reader=reader)
    f0 = start.step * written.dp + start.offset
    f1 = cursor.step * written.dp + cursor.offset
    expected = {(f // written.dp, f % written.dp, c) for f in range(f0, f1) for c in range(written.cp)}
    assert set(coverage) == expected
    for key, pieces in coverage.items():
        at = Fraction(0)
        for lo, hi in sorted(pieces):
            assert lo == at and hi > lo, (key, sorted(pieces))
            at = hi
        assert at == 1, key


@_settings
@given(_chain(), st.integers(0, 30))
def test_cursors_and_whole_logical_steps(case, committed_end) -> None:
    written, start, segments = case
    reader = segments[0][0]
    n = logical_steps(start, committed_end, written=written, reader=reader)
    end = cursor_for(n, origin_step=0, origin=start, written=written, reader=reader)
    assert end == advance(start, written=written, reader=reader, steps=n)
    assert end.step * written.dp + end.offset <= max(committed_end * written.dp, start.step * written.dp + start.offset)
    if n:  # the last whole logical step reads only committed steps, the next one does not fit
        last = cursor_for(n - 1, origin_step=0, origin=start, written=written, reader=reader)
        assert written_steps(last, written=written, reader=reader).stop <= committed_end
    assert written_steps(end, written=written, reader=reader).stop > committed_end
    # cursor_for composes: from any intermediate origin the same cursors follow.
    mid = cursor_for(3, origin_step=0, origin=start, written=written, reader=reader)
    assert cursor_for(7, origin_step=3, origin=mid, written=written, reader=reader) == cursor_for(
        7, origin_step=0, origin=start, written=written, reader=reader
    )


@pytest.mark.parametrize("t", range(4))
@pytest.mark.parametrize("d", range(4))
def test_dp_doubled_reads_two_consecutive_written_steps_as_one(t: int, d: int) -> None:
    written, reader = DataMesh(dp=2), DataMesh(dp=4)
    cursor = cursor_for(t, origin_step=0, origin=SliceCursor(0), written=written, reader=reader)
    assert reads_for(_coord(d), cursor=cursor, written=written, reader=reader) == [SliceRead(2 * t + d // 2, d % 2, 0)]
    assert written_steps(cursor, written=written, reader=reader) == range(2 * t, 2 * t + 2)


@pytest.mark.parametrize("t", range(4))
@pytest.mark.parametrize("r", range(2))
def test_dp_halved_reads_alternating_slices_of_one_written_step(t: int, r: int) -> None:
    written, reader = DataMesh(dp=4), DataMesh(dp=2)
    cursor = cursor_for(t, origin_step=0, origin=SliceCursor(0), written=written, reader=reader)
    assert reads_for(_coord(r), cursor=cursor, written=written, reader=reader) == [SliceRead(t // 2, (t % 2) * 2 + r, 0)]
    assert written_steps(cursor, written=written, reader=reader) == range(t // 2, t // 2 + 1)


def test_tp_and_pp_changes_leave_the_reads_unchanged() -> None:
    written = DataMesh(dp=2, cp=2)
    for tp, pp in [(1, 1), (2, 1), (1, 4), (8, 2)]:
        reader = DataMesh(dp=2, cp=2)  # tp and pp are not part of the data mesh
        for d in range(2):
            for c in range(2):
                got = reads_for(_coord(d, c, tp=tp - 1, pp=pp - 1), cursor=SliceCursor(3), written=written, reader=reader)
                assert got == [SliceRead(3, d, c)]


@pytest.mark.parametrize(
    ("written", "reader", "rank", "picks"),
    [
        # zigzag 2 -> 1: chunks 0 (rank 0 first half), 1, 2 (rank 1 whole), 3 (rank 0 second half)
        (DataMesh(1, 2), DataMesh(1, 1), 0, ((0, 2, 0, 1), (1, 1, 0, 1), (0, 2, 1, 2))),
        # zigzag 1 -> 2: rank 0 holds quarters 0 and 3, rank 1 quarters 1 and 2
        (DataMesh(1, 1), DataMesh(1, 2), 0, ((0, 4, 0, 1), (0, 4, 3, 4))),
        (DataMesh(1, 1), DataMesh(1, 2), 1, ((0, 4, 1, 3),)),
        # zigzag 2 -> 4: rank 3 reads written rank 1, pieces 1 and 2 of 4 (adjacent: merged)
        (DataMesh(1, 2), DataMesh(1, 4), 3, ((1, 4, 1, 3),)),
        (DataMesh(1, 4, "contiguous"), DataMesh(1, 2, "contiguous"), 1, ((2, 1, 0, 1), (3, 1, 0, 1))),
        (DataMesh(1, 2, "contiguous"), DataMesh(1, 6, "contiguous"), 4, ((1, 3, 1, 2),)),
    ],
)
def test_cp_picks_table(written, reader, rank, picks) -> None:
    assert cp_picks(rank, written=written, reader=reader) == picks


@st.composite
def _cp_case(draw):
    mode = draw(st.sampled_from(["zigzag", "contiguous"]))
    c = draw(st.sampled_from([1, 2, 3, 4]))
    m = draw(st.integers(1, 3))
    c2 = draw(st.sampled_from([x for x in (c * m, c // m) if x >= 1 and (x * m == c or x == c * m)]))
    width = draw(st.integers(1, 40))
    return mode, c, c2, width


def _row_tensors(width: int) -> dict[str, np.ndarray]:
    ids = np.arange(1, 2 * width + 1, dtype=np.int64).reshape(2, width)
    return {
        "input_ids": ids,
        "labels": ids + 1000,
        "position_ids": np.tile(np.arange(width, dtype=np.int64), (2, 1)),
        "tok_feat": np.stack([ids, -ids], axis=-1).astype(np.float32),  # a declared token column [rows, width, 2]
        "cu_seqlens": np.array([0, width, 2 * width], dtype=np.int32),
        "pixels": np.arange(12, dtype=np.uint8).reshape(4, 3),
        "max_seqlen": np.array(width, dtype=np.int32),
    }


_PAD = {"input_ids": 0, "labels": -100, "position_ids": 0, "tok_feat": -1.0}
_TOKENS = TOKEN_TENSORS | {"tok_feat"}


@settings(max_examples=120, deadline=None)
@given(_cp_case())
def test_cp_remap_delivers_exactly_the_readers_tokens_or_refuses(case) -> None:
    mode, c, c2, width = case
    written, reader = DataMesh(1, c, mode), DataMesh(1, c2, mode)
    full = _row_tensors(width)
    stored = {(0, 0, k): cp_slice(full, cp=c, rank=k, mode=mode, pad_values=_PAD) for k in range(c)}
    padded_width = cp_width(width, cp=c, mode=mode)
    padded = cp_slice(full, cp=1, rank=0, mode=mode, pad_values=_PAD)
    padded = {
        n: (np.concatenate([a, np.full((a.shape[0], padded_width - width, *a.shape[2:]), _PAD[n], a.dtype)], axis=1) if n in _PAD else a)
        for n, a in padded.items()
    }
    multiple = c2 if mode == "contiguous" or c2 == 1 else 2 * c2
    seen = []
    for r in range(c2):
        reads = reads_for(_coord(0, r), cursor=SliceCursor(0), written=written, reader=reader)
        if padded_width % multiple:
            with pytest.raises(TopologyError, match="cannot be remapped exactly"):
                assemble(reads, stored, token_names=_TOKENS)
            continue
        got = assemble(reads, stored, token_names=_TOKENS)
        cols = cp_columns(padded_width, cp=c2, rank=r, mode=mode)
        for name, array in full.items():
            if name in _PAD:
                np.testing.assert_array_equal(got[name], padded[name][:, cols], err_msg=name)
            else:
                np.testing.assert_array_equal(got[name], array, err_msg=name)
        seen.append(got["input_ids"])
    if padded_width % multiple == 0:  # every real token of every row exactly once over the CP ranks
        tokens = np.concatenate(seen, axis=1)
        real = np.sort(tokens[tokens > 0])
        np.testing.assert_array_equal(real, np.arange(1, 2 * width + 1))


def test_a_whole_slice_read_returns_the_slice_itself() -> None:
    batch = _row_tensors(8)
    out = assemble([SliceRead(0, 0, 0)], {(0, 0, 0): batch}, token_names=_TOKENS)
    assert all(out[n] is batch[n] for n in batch)


def test_cp_changes_that_cannot_be_exact_are_refused() -> None:
    with pytest.raises(TopologyError, match="not a multiple"):
        cp_picks(0, written=DataMesh(1, 2), reader=DataMesh(1, 3))
    with pytest.raises(TopologyError, match="not a divisor"):
        cp_picks(0, written=DataMesh(1, 3), reader=DataMesh(1, 2))
    with pytest.raises(TopologyError, match="cp_mode"):
        cp_picks(0, written=DataMesh(1, 2, "zigzag"), reader=DataMesh(1, 4, "contiguous"))
    # A CP size of 1 holds whole rows: either mode reads it.
    assert cp_picks(1, written=DataMesh(1, 1, "contiguous"), reader=DataMesh(1, 2, "zigzag")) == ((0, 4, 1, 3),)


def test_assemble_refuses_slices_that_disagree() -> None:
    written, reader = DataMesh(1, 2, "contiguous"), DataMesh(1, 1, "contiguous")
    reads = reads_for(_coord(0), cursor=SliceCursor(0), written=written, reader=reader)
    a = {"input_ids": np.zeros((1, 2), np.int32), "cu_seqlens": np.array([0, 4], np.int32)}
    b = {"input_ids": np.ones((1, 2), np.int32), "cu_seqlens": np.array([0, 5], np.int32)}
    with pytest.raises(TopologyError, match="cu_seqlens"):
        assemble(reads, {(0, 0, 0): a, (0, 0, 1): b}, token_names=_TOKENS)
    with pytest.raises(TopologyError, match="columns"):
        assemble(reads, {(0, 0, 0): a, (0, 0, 1): {"input_ids": a["input_ids"]}}, token_names=_TOKENS)
    with pytest.raises(TopologyError, match="dtypes"):
        assemble(reads, {(0, 0, 0): a, (0, 0, 1): {**a, "input_ids": a["input_ids"].astype(np.int64)}}, token_names=_TOKENS)
    with pytest.raises(InvalidArgument, match="no batch"):
        assemble(reads, {(0, 0, 0): a}, token_names=_TOKENS)
    with pytest.raises(InvalidArgument, match="empty"):
        assemble([], {}, token_names=_TOKENS)


def test_bad_meshes_coords_and_cursors_are_refused() -> None:
    with pytest.raises(TopologyError, match="mesh.dp"):
        DataMesh(dp=0)
    with pytest.raises(TopologyError, match="mesh.cp_mode"):
        DataMesh(dp=1, cp=2, cp_mode="ring")
    with pytest.raises(TopologyError, match="cursor.step"):
        SliceCursor(-1)
    with pytest.raises(TopologyError, match="cursor.offset"):
        reads_for(_coord(0), cursor=SliceCursor(0, 2), written=DataMesh(2), reader=DataMesh(2))
    with pytest.raises(TopologyError, match="coord.dp"):
        reads_for(_coord(2), cursor=SliceCursor(0), written=DataMesh(2), reader=DataMesh(2))
    with pytest.raises(TopologyError, match="coord.cp"):
        reads_for(_coord(0, 1), cursor=SliceCursor(0), written=DataMesh(2), reader=DataMesh(2))
    with pytest.raises(TopologyError, match="logical_step"):
        cursor_for(1, origin_step=2, origin=SliceCursor(0), written=DataMesh(2), reader=DataMesh(2))
