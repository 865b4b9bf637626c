"""The pure step builder (`constructor.build`): for random plans and meshes (CP zigzag and
contiguous, plans on the DP or CP axis, TP peers with and without broadcast, PP stages with and
without middle tensors, a secondary graph delivering a column), what the ranks receive, put back
together, is each sample's tokens and columns exactly; a rank's bytes do not depend on which
other ranks its constructor serves; what is fetched is what is built from. Pure: no processes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mesh import ORDERS
from test_parallel import modes
from test_payload_layout import IGNORE, PAD, _table, _unslice, payload_columns, step_samples

from batchplane.constructor.assemble import tensors_of
from batchplane.constructor.build import Bucket, Delivery, Fetched, Served, StepPlan, build_step, to_fetch
from batchplane.constructor.responses import fetched_samples
from batchplane.constructor.subbatch import SubPart
from batchplane.core.config import job_from_mapping
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import FailedPrecondition
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.payload import SAMPLE, TOKEN

PLANNER = "planner:1"


@st.composite
def steps(draw):
    """(served settings of the whole mesh, the plan, the fetched table, per bucket its
    (tokens, values, offsets))."""
    sizes = {axis: draw(st.integers(1, most)) for axis, most in (("pp", 3), ("dp", 3), ("cp", 3), ("tp", 2))}
    order = draw(st.sampled_from(ORDERS))
    middle = draw(st.sampled_from(((), ("attention_mask",))))
    job = job_from_mapping(
        {
            "job": "j",
            "sources": [{"name": "a", "path": "unused"}],
            "mesh": {**sizes, "order": order},
            "batch": {"global_batch_size": sizes["dp"], "microbatches": 1, "pad_id": PAD, "ignore_id": IGNORE, "token_dtype": "int64"},
            "constructors": {"cp_slicing": draw(modes), "pp_middle_tensors": list(middle)},
        }
    )
    columns = draw(payload_columns())
    job = dataclasses.replace(job, batch=dataclasses.replace(job.batch, payload=tuple(columns)))
    mesh = ClientPlaceTree(**sizes, order=order)
    axis = draw(st.sampled_from(("DP", "CP")))
    drawn = [draw(step_samples(columns))[1:] for _ in range(mesh.buckets(axis))]
    deliver = draw(st.sampled_from([None, *(c.name for c in columns if c.kind != TOKEN)]))
    buckets, parts, start = {}, [], 0
    for b, (tokens, _, offsets) in enumerate(drawn):
        n = len(tokens)
        seq = np.arange(start, start + n, dtype=np.int64)  # the table's seq: each sample's index in it
        start += n
        ids = dict(
            source=np.zeros(n, np.int32),
            seq=seq,
            row=seq * 10,
            epoch=np.full(n, b, np.int32),
            length=np.array([len(t) for t in tokens], np.int32),
        )
        buckets[b] = Bucket(**ids, offsets=offsets, fetchers=1, loaders=np.zeros(n, np.int32), copies=np.ones(n, np.int32))
        if deliver is not None:
            parts.append(
                SubPart(
                    name="images",
                    axis=axis,
                    metadata="image_tokens",
                    bucket=b,
                    **ids,
                    values=seq + 1000,
                    columns=(deliver,),
                    loaders=np.zeros(n, np.int32),
                    copies=np.ones(n, np.int32),
                )
            )
    table = _table(
        [t for tokens, _, _ in drawn for t in tokens],
        columns,
        {c.name: [v for _, values, _ in drawn for v in values[c.name]] for c in columns},
    )
    broadcast = draw(st.sampled_from((frozenset(), frozenset({"TP"}))))
    served = Served(job, mesh, tuple(range(mesh.world)), broadcast=broadcast)
    plan = StepPlan(step=3, axis=axis, global_loss_tokens=100, buckets=buckets, parts=tuple(parts))
    return served, plan, table, drawn


def _fetch_and_build(plan: StepPlan, served: Served, table) -> list[Delivery]:
    """Builds from exactly the samples `to_fetch` names (one that was not fetched is missing)."""
    fetch = to_fetch(plan, served, address=PLANNER)
    assert len(np.unique(fetch.seq)) == len(fetch.seq)
    return build_step(plan, fetched_samples([table.take(fetch.seq)], served.job.batch.payload), served)


def _subbatch(delivery: Delivery) -> dict[str, np.ndarray]:
    (sub,) = delivery.subbatches
    base = len(delivery.batch.payload)
    return {t.name: np.frombuffer(delivery.extra, t.dtype, int(np.prod(t.shape)), t.offset - base).reshape(t.shape) for t in sub.tensors}


def _check_column(got: np.ndarray, truth: list[np.ndarray], kind: str, at: np.ndarray | None) -> None:
    """A sample or blob column delivered whole: each sample's value, in order."""
    if kind == SAMPLE:
        assert len(got) == len(truth) and all(np.array_equal(g, v) for g, v in zip(got, truth))
    else:
        assert at is not None and at.tolist() == np.cumsum([0, *(len(v) for v in truth)]).tolist()
        assert all(np.array_equal(got[at[b] : at[b + 1]], v) for b, v in enumerate(truth))


@settings(max_examples=80, deadline=None)
@given(case=steps(), data=st.data())
def test_the_ranks_deliveries_put_back_together_are_every_samples_columns(case, data) -> None:
    served, plan, table, drawn = case
    job, mesh, cp = served.job, served.mesh, served.mesh.sizes["cp"]
    deliveries = _fetch_and_build(plan, served, table)
    assert [d.rank for d in deliveries] == list(served.ranks)
    rules = DeliveryRules(mesh, axis=plan.axis, broadcast=served.broadcast, middle_tensors=job.constructors.pp_middle_tensors)
    by_variant = {}
    for d in deliveries:
        assert d.variant == rules.variant(d.rank) and d.batch.step == 3
        assert by_variant.setdefault(d.variant, d.batch) is d.batch  # ranks of one variant share one batch (I3)
    delivered = {name for p in plan.parts for name in p.columns}
    for b, (tokens, values, offsets) in enumerate(drawn):
        mine = [d for d in deliveries if d.variant.bucket == b]
        for d in mine:  # every rank, tensors or not, gets its bucket's secondary part whole
            if not delivered:
                assert d.subbatches == ()
                continue
            sub = _subbatch(d)
            assert (
                sub["sample_row"].tolist() == plan.buckets[b].row.tolist()
                and sub["image_tokens"].tolist() == (plan.buckets[b].seq + 1000).tolist()
            )
            (c,) = [c for c in job.batch.payload if c.name in delivered]
            _check_column(sub[c.name], values[c.name], c.kind, sub.get(c.offsets_name))
        for d in mine:
            if not d.variant.tensors:  # metadata only: the microbatches' token counts, no tensors
                assert not d.batch.payload
                assert [mb.tensors for mb in d.batch.microbatches] == [()] * (len(offsets) - 1)
                assert [mb.num_tokens for mb in d.batch.microbatches] == [
                    sum(len(t) for t in tokens[offsets[m] : offsets[m + 1]]) for m in range(len(offsets) - 1)
                ]
        stages = {}  # stage -> the tensors of each of its CP ranks (one TP peer each)
        for d in mine:
            if d.variant.tensors:
                stages.setdefault(mesh.coords(d.rank).pp, {}).setdefault(d.variant.cp_rank or 0, tensors_of(d.batch))
        assert 0 in stages and mesh.sizes["pp"] - 1 in stages  # first and last stages get tensors
        parts = cp if plan.axis == "DP" else 1
        for m in range(len(offsets) - 1):
            lo, hi = int(offsets[m]), int(offsets[m + 1])
            lengths = [len(t) for t in tokens[lo:hi]]
            width = max([*lengths, 1])

            def whole(stage: int, name: str) -> np.ndarray:
                got = [stages[stage][r][m][name] for r in range(parts)]
                return _unslice(got, width=width, cp=parts, mode=job.constructors.cp_slicing)[:, :width]

            mask = whole(0, "attention_mask")
            assert mask.sum(axis=1).tolist() == (lengths or [0])
            assert np.array_equal(whole(0, "input_ids")[mask], np.concatenate(tokens[lo:hi]) if hi > lo else np.zeros(0))
            labels = whole(mesh.sizes["pp"] - 1, "labels")
            for row, t in enumerate(tokens[lo:hi]):  # the next token; none across a sample's end
                assert labels[row, : len(t) - 1].tolist() == t[1:].tolist() and (labels[row, len(t) - 1 :] == IGNORE).all()
            for c in job.batch.payload:
                truth = values[c.name][lo:hi]
                for stage, ranks in stages.items():
                    if c.name in delivered:
                        assert all(c.name not in got[m] for got in ranks.values())  # it lies in the subbatch instead
                    elif c.kind == TOKEN:
                        expected = np.concatenate(truth) if truth else np.zeros((0, *c.shape), c.dtype)
                        assert np.array_equal(whole(stage, c.name)[mask], expected)
                    else:
                        for got in ranks.values():
                            _check_column(got[m][c.name], truth, c.kind, got[m].get(c.offsets_name))
    # a constructor serving some of the ranks builds the very same bytes for them
    some = tuple(sorted(data.draw(st.sets(st.sampled_from(served.ranks), min_size=1), label="ranks")))
    full = {d.rank: d for d in deliveries}
    for d in _fetch_and_build(plan, dataclasses.replace(served, ranks=some), table):
        want = full[d.rank]
        assert d.variant == want.variant and d.batch.microbatches == want.batch.microbatches
        assert bytes(d.batch.payload) == bytes(want.batch.payload)
        assert d.subbatches == want.subbatches and bytes(d.extra) == bytes(want.extra)


def test_a_plan_lacking_a_bucket_a_served_rank_consumes_is_refused_before_any_fetch() -> None:
    job = job_from_mapping(
        {"job": "j", "sources": [{"name": "a", "path": "unused"}], "mesh": {"dp": 2}, "batch": {"global_batch_size": 2, "microbatches": 1}}
    )
    mesh = ClientPlaceTree(dp=2)
    empty = Bucket(*(np.zeros(0, np.int64),) * 5, np.array([0, 0], np.int64), 1, np.zeros(0, np.int32), np.zeros(0, np.int32))
    plan = StepPlan(step=7, axis="DP", global_loss_tokens=0, buckets={0: empty})
    assert len(to_fetch(plan, Served(job, mesh, (0,)), address=PLANNER).seq) == 0
    with pytest.raises(FailedPrecondition, match=r"the plan of step 7 lacks buckets \[1\]"):
        to_fetch(plan, Served(job, mesh, (0, 1)), address=PLANNER)


def test_a_sample_the_plan_builds_from_that_was_not_fetched_is_an_error_not_a_guess() -> None:
    job = job_from_mapping({"job": "j", "sources": [{"name": "a", "path": "unused"}], "batch": {"global_batch_size": 1, "microbatches": 1}})
    one = np.ones(1, np.int32)
    bucket = Bucket(
        np.zeros(1, np.int32),
        np.array([5], np.int64),
        np.zeros(1, np.int64),
        np.zeros(1, np.int32),
        one * 3,
        np.array([0, 1], np.int64),
        1,
        one * 0,
        one,
    )
    plan = StepPlan(step=0, axis="DP", global_loss_tokens=2, buckets={0: bucket})
    with pytest.raises(KeyError):
        build_step(plan, Fetched({(0, 4): np.arange(3)}, {}), Served(job, ClientPlaceTree(), (0,)))
    (d,) = build_step(plan, Fetched({(0, 5): np.arange(3)}, {}), Served(job, ClientPlaceTree(), (0,)))
    assert tensors_of(d.batch)[0]["input_ids"].tolist() == [[0, 1, 2]]
