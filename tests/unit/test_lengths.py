"""Tests of batchplane.core.lengths (`batch.max_length` and `batch.length_policy`) and of the
parts that call it agreeing with it: the loader's limit on a transformed window, the planner's
costs and loss tokens, and the constructor's microbatches (padded, packed, CP-sliced), whose
loss weights sum to 1 over a step."""

from __future__ import annotations

import ast
import math
import pathlib

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor.assemble import RankSamples, assemble, derive, metadata_only, tensors_of
from batchplane.core import lengths
from batchplane.core.config import LENGTH_POLICIES, SourceSettings
from batchplane.core.lengths import chunk_counts, chunk_lengths, chunks, limited, loss_tokens, over_limit
from batchplane.core.mesh import ClientPlaceTree
from batchplane.loader.transforms import bind_transform, lengths_of, limit_lengths
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.dgraph import default_strategy
from batchplane.planner.plan import SampleTable, build_step_plan, sample_costs

FAST = settings(max_examples=100, deadline=None)
QUADRATIC = make_cost_fn("quadratic")

policies = st.sampled_from(LENGTH_POLICIES)
limits = st.one_of(st.none(), st.integers(1, 64))
length_arrays = st.lists(st.integers(0, 300), max_size=40).map(lambda xs: np.array(xs, np.int64))


def test_pure_numpy() -> None:
    tree = ast.parse(pathlib.Path(lengths.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "numpy"}, imported


def test_policies_are_the_configuration_s() -> None:
    assert lengths.POLICIES == LENGTH_POLICIES


# ---- the arithmetic --------------------------------------------------------------------------


@FAST
@given(raw=length_arrays, max_length=limits, policy=policies)
def test_chunks_of_delivered_lengths_cover_each_sample_within_the_limit(raw, max_length, policy) -> None:
    delivered = limited(raw, max_length=max_length, policy=policy)
    seqs = chunks(delivered, max_length=max_length, policy=policy)
    counts = chunk_counts(delivered, max_length=max_length, policy=policy)
    assert len(seqs) == int(counts.sum())
    assert np.array_equal(np.bincount(seqs.sample, weights=seqs.lengths, minlength=len(raw)), delivered)  # chunks sum to the sample
    assert np.array_equal(np.bincount(seqs.sample, minlength=len(raw)), counts)
    assert np.all(np.diff(seqs.sample) >= 0) and np.array_equal(seqs.first, np.searchsorted(seqs.sample, np.arange(len(raw))))
    if max_length is not None:
        assert np.all(seqs.lengths <= max_length)  # every policy: nothing over the limit is laid out
        assert np.all(delivered <= max_length) or policy == "split"
    for i, n in enumerate(delivered.tolist()):
        mine = seqs.lengths[seqs.sample == i].tolist()
        assert mine == chunk_lengths(n, max_length=max_length, policy=policy)
        assert seqs.start[seqs.sample == i].tolist() == np.concatenate([[0], np.cumsum(mine)[:-1]]).tolist()  # consecutive
        if policy == "split" and max_length is not None and n > max_length:
            assert len(mine) == math.ceil(n / max_length) and mine[:-1] == [max_length] * (len(mine) - 1)
        else:
            assert mine == [n]
    # One loss token fewer per chunk: L - ceil(L / max_length) for a split sample, L - 1 else.
    assert loss_tokens(delivered, max_length=max_length, policy=policy) == sum(
        max(n - c, 0) for n, c in zip(delivered.tolist(), counts.tolist())
    )


@FAST
@given(raw=length_arrays, max_length=limits, policy=policies)
def test_limited_lengths(raw, max_length, policy) -> None:
    out = limited(raw, max_length=max_length, policy=policy)
    over = over_limit(raw, max_length=max_length)
    assert np.array_equal(out[~over], raw[~over])
    if policy == "truncate":
        assert (out[over] == max_length).all()
    elif policy == "reject":
        assert (out[over] == 0).all()
    else:
        assert np.array_equal(out, raw)


def test_by_hand() -> None:
    assert chunk_lengths(10, max_length=4) == [4, 4, 2]
    assert chunk_lengths(8, max_length=4) == [4, 4]
    assert chunk_lengths(10, max_length=4, policy="truncate") == [10]
    assert chunk_lengths(10) == [10]
    assert loss_tokens(np.array([10, 3, 1]), max_length=4) == (10 - 3) + (3 - 1) + 0
    assert loss_tokens(np.array([10, 3, 1])) == 9 + 2 + 0
    assert limited(np.array([10, 3]), max_length=4, policy="truncate").tolist() == [4, 3]
    assert limited(np.array([10, 3]), max_length=4, policy="reject").tolist() == [0, 3]


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"max_length": 0, "policy": "split"}, "max_length"), ({"max_length": 4, "policy": "cut"}, "length policy")]
)
def test_bad_limits(kwargs: dict, match: str) -> None:
    for fn in (chunks, chunk_counts, limited):
        with pytest.raises(ValueError, match=match):
            fn(np.array([3]), **kwargs)


# ---- the loader: a transformed window --------------------------------------------------------


def _window(rows: list[list[int] | None]) -> tuple[pa.ListArray, dict]:
    table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))})
    return bind_transform(0, SourceSettings(name="web", path="data"))(table)


@FAST
@given(rows=st.lists(st.one_of(st.none(), st.lists(st.integers(0, 1000), max_size=20)), max_size=30), max_length=limits, policy=policies)
def test_limit_lengths_on_a_transformed_window(rows, max_length, policy) -> None:
    ids, _ = _window(rows)
    out, over = limit_lengths(ids, max_length=max_length, policy=policy)
    before = lengths_of(ids)
    assert np.array_equal(over, over_limit(before, max_length=max_length))
    assert np.array_equal(lengths_of(out), limited(before, max_length=max_length, policy=policy))  # the one rule
    assert len(out) == len(ids) and out.type == ids.type
    for i, row in enumerate(rows):
        got = out[i].as_py()
        if row is None:
            assert got is None
        elif not over[i] or policy == "split":
            assert got == row
        elif policy == "truncate":
            assert got == row[:max_length]  # its first max_length tokens
        else:
            assert got is None  # a bad sample


def test_the_bound_transform_carries_the_job_s_limit() -> None:
    source = SourceSettings(name="web", path="data")
    table = pa.table({"input_ids": pa.array([[1, 2, 3, 4, 5], [6, 7]], pa.list_(pa.int32()))})
    for policy, want in (("truncate", [[1, 2, 3], [6, 7]]), ("reject", [None, [6, 7]]), ("split", [[1, 2, 3, 4, 5], [6, 7]])):
        bound = bind_transform(0, source, max_length=3, length_policy=policy)
        ids, _ = bound(table)
        out, over = bound.limit(ids)
        assert out.to_pylist() == want and over.tolist() == [True, False]
    ids, _ = bind_transform(0, source)(table)
    assert bind_transform(0, source).limit(ids)[0] is ids  # no limit: untouched


# ---- the planner -----------------------------------------------------------------------------


def test_a_split_sample_costs_the_sum_of_its_chunks() -> None:
    costs = sample_costs(QUADRATIC, np.array([10, 3]), {}, max_length=4)
    assert costs.tolist() == [16 + 16 + 4, 9]
    assert sample_costs(QUADRATIC, np.array([10, 3]), {}, max_length=4, length_policy="truncate").tolist() == [100, 9]
    assert sample_costs(QUADRATIC, np.array([10, 3]), {}).tolist() == [100, 9]

    def with_images(lengths, features):
        return lengths.astype(np.float64) + 1000 * features["images"]

    costs = sample_costs(with_images, np.array([10, 3]), {"images": np.array([2.0, 1.0])}, max_length=4)
    assert costs.tolist() == [10 + 2000, 3 + 1000]  # a sample's features count once


def _table(length: np.ndarray) -> SampleTable:
    n = len(length)
    return SampleTable(
        source=np.zeros(n, np.int32),
        seq=np.arange(n, dtype=np.int64),
        row=np.arange(n, dtype=np.int64) * 3,
        length=length.astype(np.int32),
        epoch=np.zeros(n, np.int32),
    )


@FAST
@given(
    raw=st.lists(st.integers(1, 90), min_size=1, max_size=24).map(lambda xs: np.array(xs, np.int64)),
    max_length=limits,
    policy=policies,
    method=st.sampled_from(["karmarkar_karp", "token_budget"]),
    packed=st.booleans(),
    dp=st.integers(1, 3),
    microbatches=st.integers(1, 3),
)
def test_loss_tokens_agree_between_plan_and_microbatches_and_weights_sum_to_one(
    raw, max_length, policy, method, packed, dp, microbatches
) -> None:
    """The lengths as a loader delivers them, planned, then built by every bucket: each
    microbatch's loss tokens are its labels, the metadata-only build agrees, the plan's
    loss tokens are their sum, and the loss weights sum to 1 over the step's buckets."""
    delivered = limited(raw, max_length=max_length, policy=policy)
    limit = {"max_length": max_length, "length_policy": policy}
    strategy = default_strategy(
        method=method, microbatches=microbatches, cost_fn=QUADRATIC, max_tokens=64 if method == "token_budget" else None, padded=not packed
    )
    plan = strategy.run(0, _table(delivered), ClientPlaceTree(dp=dp), default_cost=QUADRATIC, **limit)
    assert plan.loss_tokens == loss_tokens(plan.samples.length, max_length=max_length, policy=policy)
    rng = np.random.default_rng(0)
    total_loss, total_weight = 0, 0.0
    for bucket in range(plan.dp):
        table, offsets = plan.rank_samples(bucket)
        samples = RankSamples(
            tokens=[rng.integers(0, 1000, n) for n in table.length.tolist()],
            source=table.source,
            row=table.row,
            epoch=table.epoch,
            offsets=offsets,
        )
        built = assemble(
            samples,
            step=0,
            rank=bucket,
            pad_id=0,
            ignore_id=-100,
            token_dtype="int32",
            global_loss_tokens=plan.loss_tokens,
            pack_length=32 if packed else None,
            **limit,
        )
        meta = metadata_only(step=0, rank=bucket, lengths=table.length, offsets=offsets, global_loss_tokens=plan.loss_tokens, **limit)
        for mb, other, tensors in zip(built.microbatches, meta.microbatches, tensors_of(built)):
            assert mb.loss_tokens == other.loss_tokens == int(np.count_nonzero(tensors["labels"] != -100))
            assert mb.loss_weight == other.loss_weight
            if max_length is not None:  # no sequence over the limit, whatever the policy
                widths = np.diff(tensors["cu_seqlens"]) if packed else tensors["attention_mask"].sum(axis=1)
                assert (widths <= max_length).all()
            total_loss += mb.loss_tokens
            total_weight += mb.loss_weight
    assert total_loss == plan.loss_tokens
    assert math.isclose(total_weight, 1.0, rel_tol=1e-12) or plan.loss_tokens == 0


@pytest.mark.parametrize("packed", [False, True])
def test_cp_slices_of_split_samples_share_out_the_loss_tokens(packed: bool) -> None:
    lengths = np.array([23, 5, 17])
    samples = RankSamples(
        tokens=[np.arange(1, n + 1) for n in lengths],
        source=np.zeros(3, np.int32),
        row=np.arange(3),
        epoch=np.zeros(3, np.int32),
        offsets=np.array([0, 2, 3]),
    )
    total = loss_tokens(lengths, max_length=8)
    built = assemble(
        samples,
        step=0,
        rank=0,
        pad_id=0,
        ignore_id=-100,
        token_dtype="int64",
        global_loss_tokens=total,
        pack_length=16 if packed else None,
        max_length=8,
    )
    weights = 0.0
    for cp_rank in range(2):
        part = derive(built, cp=2, cp_rank=cp_rank, pad_id=0, ignore_id=-100)
        weights += sum(mb.loss_weight for mb in part.microbatches)
        for tensors in tensors_of(part):
            assert tensors["sample_chunks"].tolist() in ([3, 1], [3])  # per sample, not sliced
    assert math.isclose(weights, 1.0, rel_tol=1e-12)
    assert sum(mb.loss_tokens for mb in built.microbatches) == total == (23 - 3) + (5 - 1) + (17 - 3)


def test_build_step_plan_takes_the_limit() -> None:
    plan = build_step_plan(0, _table(np.array([10, 3, 0])), dp=1, microbatches=1, method="greedy", cost_fn=QUADRATIC, max_length=4)
    assert plan.bad_samples == 1
    assert plan.loss_tokens == (10 - 3) + (3 - 1)
    assert plan.costs.tolist() == [36.0, 9.0]
    plain = build_step_plan(0, _table(np.array([10, 3, 0])), dp=1, microbatches=1, method="greedy", cost_fn=QUADRATIC)
    assert plain.loss_tokens == 9 + 2 and plain.costs.tolist() == [100.0, 9.0]
