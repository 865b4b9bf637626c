"""The constructor's side of subgraph delivery (`constructor.subbatch`, `responses.plan_subplans`):
a plan whose secondary graph delivers payload columns makes the constructor fetch the union of
its buckets' samples and the delivering parts' samples, each once; each rank's subbatch lays the
delivered columns out for the part's samples in the part's order; the primary microbatches lack
them; and hostile plan fields are refused."""

from __future__ import annotations

import numpy as np
import pytest

from batchplane.constructor.assemble import RankSamples, assemble, tensors_of
from batchplane.constructor.bounds import MalformedResponse
from batchplane.constructor.responses import plan_buckets, plan_subplans
from batchplane.constructor.subbatch import FetchGroup, fetch_list, lay_out_subbatches, part_group, primary_payload
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.payload import PayloadColumn
from batchplane.v1 import common_pb2, planner_pb2
from batchplane.wire import encode_array

PAYLOAD = (
    PayloadColumn("weight", "token", "float32"),
    PayloadColumn("pixel_values", "blob", "uint8", (6,)),
    PayloadColumn("image_grid_thw", "blob", "int64", (3,)),
    PayloadColumn("lang", "sample", "int32", (2,)),
)
MESH = ClientPlaceTree(dp=2)  # WORLD == DP here: rank r consumes bucket r of both axes
RANKS = (0,)  # this constructor serves rank 0


def _samples(seqs, *, source=0):
    seqs = np.asarray(seqs, np.int64)
    return common_pb2.SampleSet(
        source=encode_array(np.full(len(seqs), source, np.int32)),
        seq=encode_array(seqs),
        row=encode_array(seqs * 10),
        epoch=encode_array(np.zeros(len(seqs), np.int32)),
        length=encode_array((seqs % 5 + 2).astype(np.int32)),
    )


def _plan(*, part_seqs=(7, 3, 12), copies=None, part_copies=None, loaders=None, columns=("pixel_values", "image_grid_thw"), parts=None):
    """Rank 0 trains samples 1, 3, 5 (bucket 0); it encodes the images of samples 7, 3 and 12
    (7 and 12 are trained by bucket 1, on another constructor)."""
    n = len(part_seqs)
    rank = planner_pb2.RankPlan(
        dp_rank=0,
        samples=_samples([1, 3, 5]),
        microbatch_offsets=encode_array(np.array([0, 1, 3], np.int64)),
        fetchers=1,
        loaders=encode_array(np.array([0, 0, 1], np.int32)),
        copies=encode_array(np.asarray(copies if copies is not None else [1, 1, 1], np.int32)),
    )
    part = planner_pb2.SubPlanPart(
        name="images",
        axis="WORLD",
        metadata="image_tokens",
        bucket=0,
        samples=_samples(part_seqs),
        values=encode_array(np.arange(n, dtype=np.int64) + 100),
        columns=list(columns),
        loaders=encode_array(np.asarray(loaders if loaders is not None else [1, 0, 1][:n], np.int32)),
        copies=encode_array(np.asarray(part_copies if part_copies is not None else [2, 1, 2][:n], np.int32)),
    )
    return planner_pb2.GetPlanResponse(
        step=4,
        ranks=[rank],
        subplans=parts if parts is not None else [part],
        loader_addresses=["l0:1", "l1:1"],
        global_loss_tokens=10,
        axis="DP",
    )


def _parse(plan):
    buckets = plan_buckets(plan, asked=4, address="planner:1", constructors=2, max_samples=8, microbatches=2)
    parts = plan_subplans(
        plan,
        address="planner:1",
        constructors=2,
        max_samples=8,
        payload=PAYLOAD,
        consumes=lambda axis, b: any(MESH.bucket_of(r, axis) == b for r in RANKS),
    )
    return buckets, parts


def _fetched(keys):
    """What loaders would send for these samples: per column, per key, a view (values derived
    from the key, so a misplaced row shows)."""
    out = {c.name: {} for c in PAYLOAD}
    for source, seq in keys:
        images = seq % 3  # 0..2 images
        grids = np.array([[1, 1 + i, 2] for i in range(images)], np.int64).reshape(-1, 3)
        rows = int(grids.prod(axis=1).sum())
        out["pixel_values"][(source, seq)] = ((np.arange(rows * 6) + seq * 7) % 256).astype(np.uint8).reshape(rows, 6)
        out["image_grid_thw"][(source, seq)] = grids
        out["lang"][(source, seq)] = np.array([seq, -seq], np.int32)
        out["weight"][(source, seq)] = np.full(seq % 5 + 2, seq / 2, np.float32)
    return out


def test_the_fetch_is_the_union_of_buckets_and_delivering_parts_each_sample_once() -> None:
    buckets, parts = _parse(_plan())
    b = buckets[0]
    groups = [FetchGroup(b.source, b.seq, b.length, b.copies, b.loaders)] + [part_group(p) for p in parts if p.columns]
    got = fetch_list(groups, address="planner:1")
    assert got.seq.tolist() == [1, 3, 5, 7, 12]  # 3 is both trained and encoded here: fetched once
    assert got.copies.tolist() == [1, 1, 1, 2, 2] and got.holders.tolist() == [0, 0, 1, 1, 1]
    assert got.length.tolist() == [3, 5, 2, 4, 4]


def test_a_sample_listed_with_other_copies_or_holders_is_refused() -> None:
    buckets, parts = _parse(_plan(part_copies=[2, 2, 2]))  # sample 3: copies 1 in the bucket, 2 in the part
    b = buckets[0]
    with pytest.raises(MalformedResponse, match=r"sample \(source 0, seq 3\) is listed with different copies"):
        fetch_list([FetchGroup(b.source, b.seq, b.length, b.copies, b.loaders), part_group(parts[0])], address="planner:1")
    buckets, parts = _parse(_plan(loaders=[1, 1, 1]))
    b = buckets[0]
    with pytest.raises(MalformedResponse, match="different loaders"):
        fetch_list([FetchGroup(b.source, b.seq, b.length, b.copies, b.loaders), part_group(parts[0])], address="planner:1")


def test_each_delivered_column_lies_in_the_subbatch_in_part_order_and_not_in_the_microbatches() -> None:
    buckets, parts = _parse(_plan())
    fetched = _fetched([(0, s) for s in (1, 3, 5, 7, 12)])
    (sub,), extra = lay_out_subbatches(parts, fetched, PAYLOAD, step=4, rank=0, base=128)
    assert sub.name == "images" and sub.metadata == "image_tokens"
    names = [t.name for t in sub.tensors]
    assert names == [
        "sample_source",
        "sample_row",
        "sample_epoch",
        "image_tokens",
        "pixel_values",
        "pixel_values_offsets",
        "image_grid_thw",
        "image_grid_thw_offsets",
    ]
    payload = bytearray(128) + extra
    t = {s.name: np.frombuffer(payload, s.dtype, int(np.prod(s.shape)), s.offset).reshape(s.shape) for s in sub.tensors}
    assert t["sample_row"].tolist() == [70, 30, 120] and t["image_tokens"].tolist() == [100, 101, 102]
    for name in ("pixel_values", "image_grid_thw"):
        offsets = t[f"{name}_offsets"]
        assert offsets.dtype == np.int32 and len(offsets) == 4
        for b, seq in enumerate((7, 3, 12)):
            np.testing.assert_array_equal(t[name][offsets[b] : offsets[b + 1]], fetched[name][(0, seq)])
    assert t["image_grid_thw"].prod(axis=1).sum() == len(t["pixel_values"])

    primary = primary_payload(PAYLOAD, parts)
    assert [c.name for c in primary] == ["weight", "lang"]
    b = buckets[0]
    keys = [(0, int(s)) for s in b.seq]
    samples = RankSamples(
        tokens=[np.arange(int(n), dtype=np.int32) for n in b.length],
        source=b.source,
        row=b.row,
        epoch=b.epoch,
        offsets=b.offsets,
        columns={c.name: [fetched[c.name][k] for k in keys] for c in primary},
    )
    built = assemble(samples, step=4, rank=0, pad_id=0, ignore_id=-100, token_dtype="int32", global_loss_tokens=10, payload=primary)
    for mb in tensors_of(built):
        assert "lang" in mb and "weight" in mb
        assert not {"pixel_values", "pixel_values_offsets", "image_grid_thw", "image_grid_thw_offsets"} & set(mb)


def test_a_part_without_columns_lays_out_identities_only_and_fetches_nothing() -> None:
    buckets, parts = _parse(_plan(columns=()))
    assert parts[0].loaders is None and primary_payload(PAYLOAD, parts) == PAYLOAD
    (sub,), _ = lay_out_subbatches(parts, {}, PAYLOAD, step=4, rank=0, base=0)
    assert [t.name for t in sub.tensors] == ["sample_source", "sample_row", "sample_epoch", "image_tokens"]


def _part(**fields):
    base = {
        "name": "images",
        "axis": "WORLD",
        "metadata": "image_tokens",
        "bucket": 0,
        "samples": _samples([7, 3]),
        "values": encode_array(np.array([1, 2], np.int64)),
        "columns": ["pixel_values"],
        "loaders": encode_array(np.array([0, 1], np.int32)),
        "copies": encode_array(np.array([1, 2], np.int32)),
    }
    base.update(fields)
    return planner_pb2.SubPlanPart(**{k: v for k, v in base.items() if v is not None})


@pytest.mark.parametrize(
    ("parts", "names"),
    [
        ([_part(copies=encode_array(np.array([1], np.int32)))], "copies of 1 entries for 2 samples"),
        ([_part(copies=encode_array(np.array([1, 3], np.int32)))], r"copies outside \[1, 2\]"),
        ([_part(copies=encode_array(np.array([0, 1], np.int32)))], r"copies outside \[1, 2\]"),
        ([_part(loaders=encode_array(np.array([0, 2], np.int32)))], "loaders outside its 2 loader addresses"),
        ([_part(loaders=encode_array(np.array([-1, 0], np.int32)))], "loaders outside"),
        ([_part(loaders=encode_array(np.array([0, 0, 0], np.int32)))], "loaders of 3 entries for 2 samples"),
        ([_part(loaders=None)], "without loaders and copies"),
        ([_part(columns=["pixels"])], "'pixels' is not a declared payload column"),
        ([_part(columns=["weight"])], "'weight' is a token column"),
        ([_part(columns=["pixel_values", "pixel_values"])], "named twice"),
        ([_part(samples=_samples([7, 7]))], r"sample \(source 0, seq 7\) is listed twice"),
        ([_part(), _part(bucket=0)], "listed twice"),
        ([_part(bucket=1)], "no rank of this constructor consumes bucket 1"),
        ([_part(axis="TP")], "axis 'TP' is none of"),
        ([_part(values=encode_array(np.array([1], np.int64)))], "different lengths"),
        ([_part(metadata="pixel_values_offsets")], "metadata name 'pixel_values_offsets' is another tensor's"),
        ([_part(metadata="sample_row")], "is another tensor's"),
        (
            [
                _part(
                    samples=_samples(np.arange(9)),
                    values=encode_array(np.arange(9, dtype=np.int64)),
                    loaders=encode_array(np.zeros(9, np.int32)),
                    copies=encode_array(np.ones(9, np.int32)),
                )
            ],
            "more than one step's 8",
        ),
        ([_part(copies=common_pb2.Array(dtype="int32", shape=[2], data=b"\x00"))], "copies"),
    ],
)
def test_hostile_subplan_fields_are_refused(parts, names) -> None:
    with pytest.raises(MalformedResponse, match=names) as info:
        _parse(_plan(parts=parts))
    assert "planner at planner:1" in str(info.value) and info.value.peer == "planner"


@pytest.mark.parametrize(("copies", "names"), [([1, 1], "copies of 2 entries for 3 samples"), ([1, 3, 1], r"copies outside \[1, 2\]")])
def test_hostile_rank_plan_copies_are_refused(copies, names) -> None:
    with pytest.raises(MalformedResponse, match=names):
        _parse(_plan(copies=copies))
