"""Tests of batchplane.constructor.parallel: CP slicing (partition, round trip, zigzag balance),
packing (against its invariants and a loop-by-loop reference) and the PP stage filter."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor import parallel
from batchplane.constructor.parallel import BUILT_TENSORS, CP_MODES, STAGE_TENSORS, cp_columns, cp_slice, cp_width, pack, stage_filter

FAST = settings(max_examples=60, deadline=None)

cps = st.integers(1, 8)
widths = st.integers(0, 300)
modes = st.sampled_from(CP_MODES)


def test_pure_numpy() -> None:
    tree = ast.parse(pathlib.Path(parallel.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    # batchplane.core.lengths is pure numpy too (tests/unit/test_lengths.py checks it).
    assert imported <= {"__future__", "collections.abc", "types", "numpy", "batchplane.core.lengths"}, imported


# --- CP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "cp", "mode", "want"),
    [
        (0, 4, "zigzag", 0),
        (7, 1, "zigzag", 7),
        (7, 1, "contiguous", 7),
        (7, 2, "contiguous", 8),
        (7, 2, "zigzag", 8),
        (9, 2, "zigzag", 12),
        (9, 3, "contiguous", 9),
        (10, 3, "contiguous", 12),
        (1, 4, "zigzag", 8),
        (16, 4, "zigzag", 16),
    ],
)
def test_cp_width(width: int, cp: int, mode: str, want: int) -> None:
    assert cp_width(width, cp=cp, mode=mode) == want


def test_cp_columns_by_hand() -> None:
    assert [cp_columns(8, cp=2, rank=r, mode="zigzag").tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [cp_columns(6, cp=3, rank=r, mode="zigzag").tolist() for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [cp_columns(7, cp=2, rank=r, mode="contiguous").tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cp_columns(5, cp=1, rank=0, mode="zigzag").tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cp": 0, "rank": 0, "mode": "zigzag"}, "cp"),
        ({"cp": 2, "rank": 2, "mode": "zigzag"}, "rank"),
        ({"cp": 2, "rank": -1, "mode": "contiguous"}, "rank"),
        ({"cp": 2, "rank": 0, "mode": "ring"}, "contiguous, zigzag"),
    ],
)
def test_cp_bad_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cp_columns(8, **kwargs)
    with pytest.raises(ValueError, match=field):
        cp_slice({"input_ids": np.zeros((1, 8), np.int32)}, pad_values={"input_ids": 0}, **kwargs)
    if "rank" not in field:
        with pytest.raises(ValueError, match=field):
            cp_width(8, cp=kwargs["cp"], mode=kwargs["mode"])


def test_cp_slice_bad_tensors() -> None:
    with pytest.raises(ValueError, match="pad_values: no pad value for labels"):
        cp_slice({"input_ids": np.zeros((1, 4)), "labels": np.zeros((1, 4))}, cp=2, rank=0, mode="zigzag", pad_values={"input_ids": 0})
    with pytest.raises(ValueError, match="share one width"):
        cp_slice({"a": np.zeros((1, 4)), "b": np.zeros((1, 5))}, cp=2, rank=0, mode="zigzag", pad_values={"a": 0, "b": 0})


@FAST
@given(width=widths, cp=cps, mode=modes)
def test_cp_columns_partition_the_padded_width(width: int, cp: int, mode: str) -> None:
    padded = cp_width(width, cp=cp, mode=mode)
    assert padded >= width and padded % (cp if mode == "contiguous" or cp == 1 else 2 * cp) == 0
    assert padded - width < (2 * cp if mode == "zigzag" else cp)
    columns = [cp_columns(width, cp=cp, rank=r, mode=mode) for r in range(cp)]
    assert all(c.dtype == np.int64 and len(c) == padded // cp for c in columns)
    together = np.concatenate(columns)
    assert len(np.unique(together)) == len(together)  # disjoint
    assert np.array_equal(np.sort(together), np.arange(padded))  # union is everything


@st.composite
def microbatches(draw):
    rows, width = draw(st.integers(1, 4)), draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tensors = {
        "input_ids": rng.integers(0, 50_000, (rows, width), dtype=np.int32),
        "labels": rng.integers(-100, 50_000, (rows, width), dtype=np.int64),
        "attention_mask": rng.random((rows, width)) < 0.8,
        "position_ids": rng.integers(0, width + 1, (rows, width), dtype=np.int64),
        "segment_ids": rng.integers(0, 4, (rows, width), dtype=np.int32),
        "sample_row": rng.integers(0, 2**40, rows, dtype=np.int64),
        "cu_seqlens": np.arange(rows + 1, dtype=np.int32),
        "max_seqlen": np.array(width, np.int32),
    }
    return tensors, width


PAD_VALUES = {"input_ids": 7, "labels": -100, "attention_mask": False, "position_ids": 0, "segment_ids": 0}


@FAST
@given(mb=microbatches(), cp=cps, mode=modes)
def test_cp_slices_scatter_back_to_the_padded_tensors(mb, cp: int, mode: str) -> None:
    tensors, width = mb
    padded = cp_width(width, cp=cp, mode=mode)
    restored = {name: np.empty((t.shape[0], padded), t.dtype) for name, t in tensors.items() if t.ndim == 2}
    for rank in range(cp):
        part = cp_slice(tensors, cp=cp, rank=rank, mode=mode, pad_values=PAD_VALUES)
        assert part.keys() == tensors.keys()
        columns = cp_columns(width, cp=cp, rank=rank, mode=mode)
        for name, t in tensors.items():
            if t.ndim != 2:
                assert part[name] is t  # metadata passes through
                continue
            got = part[name]
            assert got.shape == (t.shape[0], padded // cp) and got.dtype == t.dtype
            assert got.flags.c_contiguous and not np.shares_memory(got, t)
            restored[name][:, columns] = got
    for name, full in restored.items():
        assert np.array_equal(full[:, :width], tensors[name]), name
        assert (full[:, width:] == PAD_VALUES[name]).all(), name


def test_cp_slice_keeps_positions_and_labels_of_the_full_sequence() -> None:
    packed = pack([np.arange(10, 16), np.arange(20, 23)], max_length=9, pad_id=0, ignore_id=-1, dtype="int64")
    ranks = [cp_slice(packed, cp=2, rank=r, mode="zigzag", pad_values={**PAD_VALUES, "labels": -1}) for r in range(2)]
    # width 9 -> 12, chunks of 3: rank 0 holds columns 0-2 and 9-11, rank 1 columns 3-8.
    assert ranks[0]["input_ids"].tolist() == [[10, 11, 12, 7, 7, 7]]
    assert ranks[0]["position_ids"].tolist() == [[0, 1, 2, 0, 0, 0]]
    assert ranks[0]["labels"].tolist() == [[11, 12, 13, -1, -1, -1]]  # 13 lives on rank 1
    assert ranks[1]["input_ids"].tolist() == [[13, 14, 15, 20, 21, 22]]
    assert ranks[1]["position_ids"].tolist() == [[3, 4, 5, 0, 1, 2]]
    assert ranks[1]["labels"].tolist() == [[14, 15, -1, 21, 22, -1]]
    assert ranks[1]["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2]]
    assert ranks[1]["cu_seqlens"] is packed["cu_seqlens"]


def _work(width: int, *, cp: int, mode: str, real: bool) -> np.ndarray:
    """Causal-attention work per rank: sum of (c + 1) over its columns (real ones only, if asked)."""
    out = []
    for rank in range(cp):
        c = cp_columns(width, cp=cp, rank=rank, mode=mode)
        out.append(int((c[c < width] + 1 if real else c + 1).sum()))
    return np.array(out)


def _zigzag_bound(width: int, cp: int) -> float:
    """max/min of real work under zigzag (see cp_columns): k(W+1) / (k(W+1) - L)."""
    padded = cp_width(width, cp=cp, mode="zigzag")
    k, p = padded // (2 * cp), padded - width
    q = min(p, k)
    lost = q * padded - q * (q - 1) // 2
    return k * (padded + 1) / (k * (padded + 1) - lost)


@settings(max_examples=100, deadline=None)
@given(cp=st.integers(1, 8), width=st.integers(1, 600))
def test_zigzag_balances_causal_work(cp: int, width: int) -> None:
    padded = cp_width(width, cp=cp, mode="zigzag")
    k = padded // (2 * cp) if cp > 1 else None
    kernel = _work(width, cp=cp, mode="zigzag", real=False)
    assert (kernel == kernel[0]).all()  # padding included, every rank does the same work
    if cp > 1:
        assert kernel[0] == k * (padded + 1)
    if cp == 1 or k < 2:  # tiny widths: a rank may hold only padding
        return
    real = _work(width, cp=cp, mode="zigzag", real=True)
    assert real.sum() == width * (width + 1) // 2
    ratio, bound = real.max() / real.min(), _zigzag_bound(width, cp)
    assert ratio <= bound + 1e-12
    if k >= 3:
        assert ratio == pytest.approx(bound)  # the bound is attained: it is tight
    q = min(padded - width, k)
    if q < k:
        assert bound <= k / (k - q) + 1e-12
    assert real.max() - real.min() <= k * padded  # at most one chunk's worth apart


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(2, 8), data=st.data())
def test_zigzag_beats_contiguous(cp: int, data) -> None:
    width = data.draw(st.integers(8 * cp, 2500))
    # Kernel work (padding included): zigzag is exactly even; contiguous is
    # 1 + 2k'(cp - 1)/(k' + 1) with k' >= 8 columns a rank, so at least 1 + 16(cp - 1)/9.
    zig = _work(width, cp=cp, mode="zigzag", real=False)
    contiguous = _work(width, cp=cp, mode="contiguous", real=False)
    chunk = cp_width(width, cp=cp, mode="contiguous") // cp
    assert zig.max() == zig.min()
    assert contiguous.max() / contiguous.min() == pytest.approx(1 + 2 * chunk * (cp - 1) / (chunk + 1))
    assert contiguous.max() / contiguous.min() >= 1 + 16 * (cp - 1) / 9
    # Real work: once zigzag chunks are long next to the padding (k >= 4(2cp - 1), so q/k <= 1/4),
    # zigzag is within k/(k - q) <= 4/3 while contiguous stays near 2cp - 1.
    if cp_width(width, cp=cp, mode="zigzag") // (2 * cp) >= 4 * (2 * cp - 1):
        zig_real = _work(width, cp=cp, mode="zigzag", real=True)
        contiguous_real = _work(width, cp=cp, mode="contiguous", real=True)
        zig_ratio = zig_real.max() / zig_real.min()
        assert zig_ratio <= 4 / 3
        assert contiguous_real.max() / contiguous_real.min() > 1.5 * zig_ratio


# --- packing ----------------------------------------------------------------------------------


def _reference_pack(samples, max_length):
    rows, current = [], None
    for s in samples:
        if current is None or sum(map(len, current)) + len(s) > max_length:
            current = []
            rows.append(current)
        current.append([int(x) for x in s])
    return rows


samples_lists = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), max_size=12)


@FAST
@given(
    raw=samples_lists,
    max_length=st.integers(1, 20),
    pad_id=st.integers(-5, 5),
    ignore_id=st.integers(-100, -1),
    dtype=st.sampled_from(["int32", "int64"]),
    source_dtype=st.sampled_from([np.int32, np.int64, np.uint32]),
)
def test_pack_invariants(raw, max_length: int, pad_id: int, ignore_id: int, dtype: str, source_dtype) -> None:
    samples = [np.array(s, source_dtype) for s in raw]
    out = pack(samples, max_length=max_length, pad_id=pad_id, ignore_id=ignore_id, dtype=dtype)
    ids, labels, pos, seg, mask = (out[n] for n in ("input_ids", "labels", "position_ids", "segment_ids", "attention_mask"))
    for name in ("input_ids", "labels", "position_ids"):
        assert out[name].dtype == np.dtype(dtype)
    assert seg.dtype == np.int32 and mask.dtype == bool
    assert out["cu_seqlens"].dtype == np.int32 and out["sample_rows"].dtype == np.int32
    assert out["max_seqlen"].shape == () and out["max_seqlen"].dtype == np.int32
    assert ids.shape == labels.shape == pos.shape == seg.shape == mask.shape
    if not samples:
        assert ids.tolist() == [[pad_id]] and labels.tolist() == [[ignore_id]]
        assert seg.tolist() == [[0]] and mask.tolist() == [[False]] and pos.tolist() == [[0]]
        assert out["cu_seqlens"].tolist() == [0] and out["sample_rows"].tolist() == [] and int(out["max_seqlen"]) == 0
        return
    lengths = [len(s) for s in raw]
    rows = mask.sum(axis=1)
    assert rows.sum() == sum(lengths)
    assert ids.shape[1] == rows.max()
    reference = _reference_pack(raw, max_length)
    assert len(ids) == len(reference)
    got = []
    for r in range(len(ids)):
        n = rows[r]
        assert mask[r, :n].all() and not mask[r, n:].any()  # right padded
        assert (ids[r, n:] == pad_id).all() and (labels[r, n:] == ignore_id).all()
        assert (pos[r, n:] == 0).all() and (seg[r, n:] == 0).all()
        segs = seg[r, :n]
        assert segs[0] == 1 and (np.diff(segs) >= 0).all() and (np.diff(segs) <= 1).all()
        pieces = np.split(np.arange(n), np.flatnonzero(np.diff(segs)) + 1)
        assert [ids[r, p].tolist() for p in pieces] == reference[r]  # the samples, in order
        assert n <= max_length or len(pieces) == 1  # over max_length only alone
        for p in pieces:
            assert pos[r, p].tolist() == list(range(len(p)))
            assert labels[r, p[:-1]].tolist() == ids[r, p[1:]].tolist()  # the next token
            assert labels[r, p[-1]] == ignore_id  # never across a sample's end
        got.extend(ids[r, p].tolist() for p in pieces)
    assert got == raw
    cu = out["cu_seqlens"]
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    flat_ids, flat_seg = ids[mask], seg[mask]
    for s in range(len(raw)):
        assert flat_ids[cu[s] : cu[s + 1]].tolist() == raw[s]
        assert (flat_seg[cu[s] : cu[s + 1]] == flat_seg[cu[s]]).all()  # one segment a sample
    assert [int(r) for r in out["sample_rows"]] == [r for r, row in enumerate(reference) for _ in row]
    assert int(out["max_seqlen"]) == max(lengths)


def test_pack_by_hand() -> None:
    samples = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9, 10, 11]), np.array([12])]
    out = pack(samples, max_length=5, pad_id=0, ignore_id=-100, dtype="int64")
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 11], [12, 0, 0, 0, 0, 0]]
    assert out["labels"].tolist() == [[2, 3, -100, 5, -100, -100], [7, 8, 9, 10, 11, -100], [-100] * 6]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [0] * 6]
    assert out["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0], [1] * 6, [1, 0, 0, 0, 0, 0]]
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11, 12]
    assert out["sample_rows"].tolist() == [0, 0, 1, 2]
    assert int(out["max_seqlen"]) == 6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_length": 0, "dtype": "int64"}, "max_length"),
        ({"max_length": 4, "dtype": "float32"}, "dtype"),
        ({"max_length": 4, "dtype": "int16"}, "int32, int64"),
    ],
)
def test_pack_bad_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        pack([np.array([1, 2])], pad_id=0, ignore_id=-1, **kwargs)


def test_pack_refuses_empty_or_non_1d_samples() -> None:
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        pack([np.array([1]), np.array([], np.int64)], max_length=4, pad_id=0, ignore_id=-1, dtype="int32")
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        pack([np.ones((2, 2), np.int64)], max_length=4, pad_id=0, ignore_id=-1, dtype="int32")


# --- packing split samples (batch.length_policy "split") ----------------------------------------


@FAST
@given(
    raw=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), max_size=8),
    max_length=st.integers(1, 30),
    max_sample_length=st.integers(1, 12),
    policy=st.sampled_from(["split", "truncate", "reject"]),
    dtype=st.sampled_from(["int32", "int64"]),
)
def test_pack_split_chunks_are_sequences_of_their_own(raw, max_length: int, max_sample_length: int, policy: str, dtype: str) -> None:
    ignore_id = -100
    samples = [np.array(s, np.int64) for s in raw]
    out = pack(
        samples,
        max_length=max_length,
        pad_id=0,
        ignore_id=ignore_id,
        dtype=dtype,
        max_sample_length=max_sample_length,
        length_policy=policy,
    )
    if not samples:
        assert out["sample_chunks"].tolist() == [] and out["cu_seqlens"].tolist() == [0]
        return
    ids, labels, pos, seg, mask = (out[n] for n in ("input_ids", "labels", "position_ids", "segment_ids", "attention_mask"))
    # The sequences: every sample's chunks of max_sample_length (under split), in order.
    step = max_sample_length if policy == "split" else None
    expected = [s[i : i + step] if step else s for s in raw for i in (range(0, len(s), step) if step else [0])]
    chunks = [len(range(0, len(s), step)) if step else 1 for s in raw]
    assert out["sample_chunks"].tolist() == chunks
    cu = out["cu_seqlens"]
    assert cu.tolist() == np.concatenate([[0], np.cumsum([len(e) for e in expected])]).tolist()
    flat_ids, flat_labels, flat_pos, flat_seg = ids[mask], labels[mask], pos[mask], seg[mask]
    row_of_token = np.nonzero(mask)[0]
    for q, e in enumerate(expected):
        lo, hi = cu[q], cu[q + 1]
        assert flat_ids[lo:hi].tolist() == e  # the chunk's tokens, in order
        assert flat_pos[lo:hi].tolist() == list(range(len(e)))  # positions restart per chunk
        assert flat_labels[lo : hi - 1].tolist() == e[1:]  # the next token within the chunk
        assert flat_labels[hi - 1] == ignore_id  # never across a chunk's end
        assert len(set(flat_seg[lo:hi].tolist())) == 1 and len(set(row_of_token[lo:hi].tolist())) == 1  # one segment, one row
        if q + 1 < len(expected) and row_of_token[hi - 1] == row_of_token[hi]:
            assert flat_seg[hi] != flat_seg[hi - 1]  # chunks sharing a row never share a segment
        if step:
            assert len(e) <= step
    assert int(out["max_seqlen"]) == max(len(e) for e in expected)
    assert int(np.count_nonzero(labels != ignore_id)) == sum(len(e) - 1 for e in expected)
    first_chunk = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(int)
    assert out["sample_rows"].tolist() == row_of_token[cu[first_chunk]].tolist()
    rows = mask.sum(axis=1)
    assert all(n <= max_length or len(set(seg[r, :n].tolist())) == 1 for r, n in enumerate(rows))  # over max_length only alone


def test_pack_split_by_hand() -> None:
    samples = [np.array([1, 2, 3, 4, 5, 6, 7]), np.array([8, 9])]
    out = pack(samples, max_length=6, pad_id=0, ignore_id=-100, dtype="int64", max_sample_length=3)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]]
    assert out["labels"].tolist() == [[2, 3, -100, 5, 6, -100], [-100, 9, -100, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 0, 0, 0]]
    assert out["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2], [1, 2, 2, 0, 0, 0]]
    assert out["cu_seqlens"].tolist() == [0, 3, 6, 7, 9]
    assert out["sample_rows"].tolist() == [0, 1]
    assert out["sample_chunks"].tolist() == [3, 1]
    assert int(out["max_seqlen"]) == 3


def test_pack_without_a_limit_is_unchanged_by_the_policy() -> None:
    samples = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9, 10, 11])]
    plain = pack(samples, max_length=5, pad_id=0, ignore_id=-100, dtype="int64")
    for policy in ("split", "truncate", "reject"):
        for limit in (None, 2):
            if limit is not None and policy == "split":
                continue
            out = pack(samples, max_length=5, pad_id=0, ignore_id=-100, dtype="int64", max_sample_length=limit, length_policy=policy)
            assert out.keys() == plain.keys()
            assert all(np.array_equal(out[k], plain[k]) for k in plain)


@pytest.mark.parametrize(("kwargs", "match"), [({"max_sample_length": 0}, "max_length"), ({"length_policy": "drop"}, "length policy")])
def test_pack_bad_length_limit(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack([np.array([1, 2])], max_length=4, pad_id=0, ignore_id=-1, dtype="int32", **kwargs)


def test_sample_chunks_passes_cp_slicing_and_every_pipeline_stage() -> None:
    out = pack([np.arange(1, 8)], max_length=4, pad_id=0, ignore_id=-100, dtype="int64", max_sample_length=4)
    out.pop("sample_rows")
    sliced = cp_slice(
        out,
        cp=2,
        rank=1,
        mode="zigzag",
        pad_values={"input_ids": 0, "labels": -100, "attention_mask": False, "position_ids": 0, "segment_ids": 0},
    )
    assert sliced["sample_chunks"] is out["sample_chunks"] and sliced["cu_seqlens"] is out["cu_seqlens"]
    for stage in range(3):
        assert "sample_chunks" in stage_filter(sliced, stage=stage, stages=3, ignore_id=-100)


# --- PP ---------------------------------------------------------------------------------------

ALL_NAMES = (
    "input_ids",
    "labels",
    "attention_mask",
    "position_ids",
    "segment_ids",
    "cu_seqlens",
    "max_seqlen",
    "loss_mask",
    "sample_row",
    "sample_source",
    "extra",
)


@FAST
@given(
    names=st.sets(st.sampled_from(ALL_NAMES)),
    stages=st.integers(1, 6),
    data=st.data(),
    middle=st.lists(st.sampled_from(ALL_NAMES), max_size=3),
)
def test_stage_filter(names, stages: int, data, middle) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    tensors = {n: np.array([[1, -100, 3]]) for n in sorted(names)}
    out = stage_filter(tensors, stage=stage, stages=stages, ignore_id=-100, middle=middle)
    first, last = stage == 0, stage == stages - 1
    for name, t in out.items():
        if name in tensors:
            assert t is tensors[name]
    if last and "labels" in tensors and "loss_mask" not in tensors:
        assert out["loss_mask"].dtype == bool and out["loss_mask"].tolist() == [[True, False, True]]
    else:
        assert "loss_mask" not in out or "loss_mask" in tensors
    samples = {n for n in names if n.startswith("sample_")}
    samples |= names - BUILT_TENSORS  # tensors the constructor does not build (a hook's) go everywhere
    assert samples <= out.keys()
    if stages == 1:
        assert set(tensors) <= out.keys()
    elif first:
        assert out.keys() == (names & STAGE_TENSORS["first"]) | samples
        assert "labels" not in out and "loss_mask" not in out
    elif last:
        assert out.keys() - {"loss_mask"} == (names & STAGE_TENSORS["last"]) - {"loss_mask"} | samples
        assert "loss_mask" in out or "labels" not in names
        assert "input_ids" not in out
    else:
        assert out.keys() == (names & set(middle)) | samples


def test_stage_filter_bad_stage() -> None:
    with pytest.raises(ValueError, match="stage must be in"):
        stage_filter({}, stage=2, stages=2, ignore_id=-1)
    with pytest.raises(ValueError, match="stage must be in"):
        stage_filter({}, stage=-1, stages=2, ignore_id=-1)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        stage_filter({}, stage=0, stages=0, ignore_id=-1)
