"""Tests of batchplane.constructor.assemble against a straightforward reference, and of the
payload layout (alignment, no overlap, bounds)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor.assemble import BuiltBatch, RankSamples, assemble, metadata_only
from batchplane.core.lengths import loss_tokens

TENSOR_NAMES = (
    "input_ids",
    "labels",
    "attention_mask",
    "position_ids",
    "sample_source",
    "sample_row",
    "sample_epoch",
    "sample_length",
)


def _reference(tokens, source, row, epoch, offsets, *, pad_id, ignore_id, token_dtype):
    """Per microbatch: a dict of name -> expected array, written out loop by loop."""
    out = []
    for m in range(len(offsets) - 1):
        lo, hi = offsets[m], offsets[m + 1]
        if hi == lo:  # filler: one row of one padding token without a label
            out.append(
                {
                    "input_ids": np.array([[pad_id]], token_dtype),
                    "labels": np.array([[ignore_id]], token_dtype),
                    "attention_mask": np.array([[False]]),
                    "position_ids": np.array([[0]], token_dtype),
                    "sample_source": np.zeros(0, np.int32),
                    "sample_row": np.zeros(0, np.int64),
                    "sample_epoch": np.zeros(0, np.int32),
                    "sample_length": np.zeros(0, np.int32),
                }
            )
            continue
        width = max(len(tokens[i]) for i in range(lo, hi))
        ids, labels, mask, pos = [], [], [], []
        for i in range(lo, hi):
            t = [int(x) for x in tokens[i]]
            n = len(t)
            ids.append(t + [pad_id] * (width - n))
            labels.append([t[j + 1] if j < n - 1 else ignore_id for j in range(width)])
            mask.append([j < n for j in range(width)])
            pos.append([j if j < n else 0 for j in range(width)])
        out.append(
            {
                "input_ids": np.array(ids, token_dtype),
                "labels": np.array(labels, token_dtype),
                "attention_mask": np.array(mask, bool),
                "position_ids": np.array(pos, token_dtype),
                "sample_source": np.array(source[lo:hi], np.int32),
                "sample_row": np.array(row[lo:hi], np.int64),
                "sample_epoch": np.array(epoch[lo:hi], np.int32),
                "sample_length": np.array([len(tokens[i]) for i in range(lo, hi)], np.int32),
            }
        )
    return out


def _views(batch: BuiltBatch, m: int) -> dict[str, np.ndarray]:
    views = {}
    for t in batch.microbatches[m].tensors:
        count = int(np.prod(t.shape, dtype=np.int64))
        views[t.name] = np.frombuffer(batch.payload, dtype=t.dtype, count=count, offset=t.offset).reshape(t.shape)
    return views


def _check_layout(batch: BuiltBatch) -> None:
    spans = []
    for mb in batch.microbatches:
        assert tuple(t.name for t in mb.tensors) == TENSOR_NAMES
        for t in mb.tensors:
            assert t.offset % 64 == 0, (t.name, t.offset)
            assert t.nbytes == int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
            assert 0 <= t.offset and t.offset + t.nbytes <= len(batch.payload)
            if t.nbytes:
                spans.append((t.offset, t.offset + t.nbytes))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "tensors overlap"


token_lists = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50)


@st.composite
def rank_samples(draw):
    sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    n = sum(sizes)
    tokens_dtype = draw(st.sampled_from([np.int32, np.int64]))
    tokens = [np.array(t, tokens_dtype) for t in draw(st.lists(token_lists, min_size=n, max_size=n))]
    source = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    row = draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n))
    epoch = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return tokens, source, row, epoch, offsets


@settings(max_examples=150, deadline=None)
@given(
    data=rank_samples(),
    pad_id=st.integers(-(2**31), 2**31 - 1),
    ignore_id=st.integers(-(2**31), 2**31 - 1),
    token_dtype=st.sampled_from(["int32", "int64"]),
    step=st.integers(0, 10**9),
    rank=st.integers(0, 4096),
    global_loss_tokens=st.integers(0, 10**9),
)
def test_assemble_matches_the_reference(data, pad_id, ignore_id, token_dtype, step, rank, global_loss_tokens) -> None:
    tokens, source, row, epoch, offsets = data
    samples = RankSamples(
        tokens=tokens,
        source=np.array(source, np.int32),
        row=np.array(row, np.int64),
        epoch=np.array(epoch, np.int32),
        offsets=offsets,
    )
    batch = assemble(
        samples,
        step=step,
        rank=rank,
        pad_id=pad_id,
        ignore_id=ignore_id,
        token_dtype=token_dtype,
        global_loss_tokens=global_loss_tokens,
    )
    assert (batch.step, batch.rank, batch.global_loss_tokens) == (step, rank, global_loss_tokens)
    assert isinstance(batch.payload, bytearray)
    assert len(batch.microbatches) == len(offsets) - 1
    _check_layout(batch)
    expected = _reference(tokens, source, row, epoch, offsets.tolist(), pad_id=pad_id, ignore_id=ignore_id, token_dtype=token_dtype)
    for m, (mb, want) in enumerate(zip(batch.microbatches, expected)):
        lo, hi = int(offsets[m]), int(offsets[m + 1])
        lengths = [len(tokens[i]) for i in range(lo, hi)]
        assert mb.filler == (hi == lo)
        assert mb.num_tokens == sum(lengths)
        assert mb.loss_tokens == sum(n - 1 for n in lengths)
        got = _views(batch, m)
        for name in TENSOR_NAMES:
            assert got[name].dtype == want[name].dtype, (m, name)
            assert got[name].shape == want[name].shape, (m, name)
            assert np.array_equal(got[name], want[name]), (m, name)
        assert int(got["attention_mask"].sum()) == mb.num_tokens
        assert int((got["labels"] != ignore_id).sum()) <= mb.loss_tokens


def test_small_example_by_hand() -> None:
    samples = RankSamples(
        tokens=[np.array([5, 6, 7], np.int64), np.array([8], np.int64), np.array([1, 2], np.int32)],
        source=np.array([0, 1, 2], np.int32),
        row=np.array([10, 11, 12], np.int64),
        epoch=np.array([0, 0, 3], np.int32),
        offsets=np.array([0, 2, 2, 3]),
    )
    batch = assemble(samples, step=4, rank=1, pad_id=0, ignore_id=-100, token_dtype="int64", global_loss_tokens=9)
    first, filler, last = (_views(batch, m) for m in range(3))
    assert first["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert first["labels"].tolist() == [[6, 7, -100], [-100, -100, -100]]
    assert first["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert first["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert first["sample_row"].tolist() == [10, 11]
    assert first["sample_length"].tolist() == [3, 1]
    assert [mb.filler for mb in batch.microbatches] == [False, True, False]
    assert [mb.num_tokens for mb in batch.microbatches] == [4, 0, 2]
    assert [mb.loss_tokens for mb in batch.microbatches] == [2, 0, 1]
    assert filler["input_ids"].tolist() == [[0]]
    assert filler["labels"].tolist() == [[-100]]
    assert filler["attention_mask"].tolist() == [[False]]
    assert filler["position_ids"].tolist() == [[0]]
    assert all(filler[n].shape == (0,) for n in TENSOR_NAMES[4:])
    assert last["input_ids"].tolist() == [[1, 2]]
    assert last["labels"].tolist() == [[2, -100]]
    assert last["sample_epoch"].tolist() == [3]
    _check_layout(batch)


@pytest.mark.parametrize("token_dtype", ["int32", "int64"])
def test_all_fillers(token_dtype: str) -> None:
    samples = RankSamples(
        tokens=[],
        source=np.zeros(0, np.int32),
        row=np.zeros(0, np.int64),
        epoch=np.zeros(0, np.int32),
        offsets=np.zeros(3, np.int64),
    )
    batch = assemble(samples, step=0, rank=0, pad_id=3, ignore_id=-1, token_dtype=token_dtype, global_loss_tokens=0)
    assert len(batch.microbatches) == 2
    _check_layout(batch)
    for m, mb in enumerate(batch.microbatches):
        assert mb.filler and mb.num_tokens == 0 and mb.loss_tokens == 0
        views = _views(batch, m)
        assert views["input_ids"].dtype == np.dtype(token_dtype)
        assert views["input_ids"].tolist() == [[3]]
        assert views["labels"].tolist() == [[-1]]
        assert views["attention_mask"].tolist() == [[False]]


def test_payload_views_are_writable_and_not_shared_with_the_inputs() -> None:
    tokens = [np.array([1, 2, 3], np.int64)]
    samples = RankSamples(
        tokens=tokens,
        source=np.zeros(1, np.int32),
        row=np.zeros(1, np.int64),
        epoch=np.zeros(1, np.int32),
        offsets=np.array([0, 1]),
    )
    batch = assemble(samples, step=0, rank=0, pad_id=0, ignore_id=-100, token_dtype="int64", global_loss_tokens=2)
    _views(batch, 0)["input_ids"][0, 0] = 99  # the payload is a bytearray, so views are writable
    assert tokens[0].tolist() == [1, 2, 3]


# ---- batch.max_length with length_policy "split" ---------------------------------------------


@st.composite
def long_samples(draw):
    sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    n = sum(sizes)
    tokens = [
        np.array(t, np.int64) for t in draw(st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=30), min_size=n, max_size=n))
    ]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    samples = RankSamples(
        tokens=tokens,
        source=np.arange(n, dtype=np.int32) % 3,
        row=np.arange(n, dtype=np.int64) * 7,
        epoch=np.zeros(n, np.int32),
        offsets=offsets,
    )
    return samples


@settings(max_examples=100, deadline=None)
@given(samples=long_samples(), max_length=st.integers(1, 12), packed=st.booleans(), policy=st.sampled_from(["split", "truncate", "reject"]))
def test_split_samples_become_chunk_rows_with_one_identity_entry_per_sample(samples, max_length: int, packed: bool, policy: str) -> None:
    ignore_id = -100
    limit = {"max_length": max_length, "length_policy": policy}
    batch = assemble(
        samples,
        step=1,
        rank=0,
        pad_id=0,
        ignore_id=ignore_id,
        token_dtype="int64",
        global_loss_tokens=10**6,
        pack_length=16 if packed else None,
        **limit,
    )
    _check_layout_of_split(batch, split=policy == "split")
    lengths = np.array([len(t) for t in samples.tokens], np.int32)
    meta = metadata_only(step=1, rank=0, lengths=lengths, offsets=samples.offsets, global_loss_tokens=10**6, **limit)
    for m, mb in enumerate(batch.microbatches):
        lo, hi = int(samples.offsets[m]), int(samples.offsets[m + 1])
        got = _views(batch, m)
        # One identity entry per sample, whatever the rows.
        assert got["sample_row"].tolist() == samples.row[lo:hi].tolist()
        assert got["sample_source"].tolist() == samples.source[lo:hi].tolist()
        assert got["sample_length"].tolist() == lengths[lo:hi].tolist()
        # The loss tokens counted three ways agree: labels, the layout, the planned lengths.
        assert int(np.count_nonzero(got["labels"] != ignore_id)) == mb.loss_tokens == meta.microbatches[m].loss_tokens
        assert mb.loss_tokens == loss_tokens(lengths[lo:hi], max_length=max_length, policy=policy)
        assert mb.num_tokens == int(got["attention_mask"].sum()) == int(lengths[lo:hi].sum())
        assert mb.loss_weight == meta.microbatches[m].loss_weight
        if packed or hi == lo:
            continue
        # Padded: row r is chunk r; each sample's chunks are consecutive rows.
        chunks = [len(range(0, n, max_length)) if policy == "split" else 1 for n in lengths[lo:hi]]
        if policy == "split":
            assert got["sample_chunks"].tolist() == chunks
        assert got["input_ids"].shape[0] == sum(chunks)
        assert got["input_ids"].shape[1] == max(min(n, max_length) if policy == "split" else n for n in lengths[lo:hi])
        r = 0
        for b in range(hi - lo):
            tokens = samples.tokens[lo + b].tolist()
            joined = []
            for _ in range(chunks[b]):
                n = int(got["attention_mask"][r].sum())
                assert got["attention_mask"][r, :n].all()
                assert policy != "split" or n <= max_length
                assert got["position_ids"][r, :n].tolist() == list(range(n))
                row = got["input_ids"][r, :n].tolist()
                assert got["labels"][r, : n - 1].tolist() == row[1:] and (got["labels"][r, n - 1 :] == ignore_id).all()
                joined += row
                r += 1
            assert joined == tokens  # every token, in order


def _check_layout_of_split(batch: BuiltBatch, *, split: bool) -> None:
    for mb in batch.microbatches:
        names = [t.name for t in mb.tensors]
        assert ("sample_chunks" in names) == split
        assert names[-1 - split : len(names) - split] == ["sample_length"]


def test_padded_split_by_hand() -> None:
    samples = RankSamples(
        tokens=[np.array([1, 2, 3, 4, 5], np.int64), np.array([6, 7], np.int64)],
        source=np.array([0, 1], np.int32),
        row=np.array([10, 11], np.int64),
        epoch=np.zeros(2, np.int32),
        offsets=np.array([0, 2]),
    )
    batch = assemble(samples, step=0, rank=0, pad_id=0, ignore_id=-100, token_dtype="int64", global_loss_tokens=4, max_length=2)
    got = _views(batch, 0)
    assert got["input_ids"].tolist() == [[1, 2], [3, 4], [5, 0], [6, 7]]
    assert got["labels"].tolist() == [[2, -100], [4, -100], [-100, -100], [7, -100]]
    assert got["position_ids"].tolist() == [[0, 1], [0, 1], [0, 0], [0, 1]]
    assert got["attention_mask"].tolist() == [[True, True], [True, True], [True, False], [True, True]]
    assert got["sample_row"].tolist() == [10, 11] and got["sample_length"].tolist() == [5, 2]
    assert got["sample_chunks"].tolist() == [3, 1]
    assert batch.microbatches[0].loss_tokens == 3 and batch.microbatches[0].loss_weight == 0.75


def test_no_limit_or_no_long_sample_changes_nothing() -> None:
    samples = RankSamples(
        tokens=[np.array([5, 6, 7], np.int64), np.array([8], np.int64)],
        source=np.array([0, 1], np.int32),
        row=np.array([10, 11], np.int64),
        epoch=np.zeros(2, np.int32),
        offsets=np.array([0, 2]),
    )
    base = dict(step=0, rank=0, pad_id=0, ignore_id=-100, token_dtype="int64", global_loss_tokens=2)
    for pack_length in (None, 4):
        plain = assemble(samples, **base, pack_length=pack_length)
        for limit in ({"max_length": None}, {"max_length": 3, "length_policy": "truncate"}, {"max_length": 3, "length_policy": "reject"}):
            other = assemble(samples, **base, pack_length=pack_length, **limit)
            assert other.microbatches == plain.microbatches and other.payload == plain.payload
