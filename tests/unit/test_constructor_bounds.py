"""A constructor's bounds (`batchplane.constructor.bounds`, `.responses`): every field a trainer
sends is bounded by the job, and every number a peer answers with is checked before anything is
allocated from it; a malformed answer is a retryable error of that call (counted, logged with the
peer's address), never a dead build thread."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry

from batchplane.constructor.bounds import (
    MAX_RESUME_KEYS,
    MalformedResponse,
    check_batch_request,
    check_bucket,
    check_following,
    check_plan_step,
    check_report,
    fetch_payload_limit,
)
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import StepPipeline
from batchplane.constructor.responses import FETCH_SCHEMA, Wanted, plan_buckets, receive_samples
from batchplane.core.config import job_from_mapping
from batchplane.core.errors import InvalidArgument, Unavailable
from batchplane.v1 import common_pb2, loader_pb2, planner_pb2
from batchplane.wire import encode_array, iter_chunks

from rpc_fakes import Channel

# ---- from the trainer ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        ({"rank": 4}, "outside the job's mesh of 4 ranks"),
        ({"rank": -1}, "outside the job's mesh"),
        ({"step": -1}, "step must be"),
        ({"step": 2**63 - 1}, "step must be"),
        ({"resume": {f"k{i}": "v" for i in range(MAX_RESUME_KEYS + 1)}}, "at most 32 fingerprints"),
        ({"resume": {"data": "v" * 10_000}}, "values of at most"),
        ({"resume": {"k" * 10_000: "v"}}, "names of at most"),
        ({"max_steps": -1}, "max_steps must be in [0, 8] (constructors.batch_steps), got -1"),
        ({"max_steps": 2, "batch_steps": 1}, "max_steps must be in [0, 1] (constructors.batch_steps), got 2"),
        ({"max_steps": 9}, "max_steps must be in [0, 8] (constructors.batch_steps), got 9"),
        ({"max_steps": 2**31 - 1}, "max_steps must be"),
    ],
)
def test_a_batch_request_outside_the_job_is_invalid(request_, names) -> None:
    good = {"rank": 3, "step": 7, "world": 4, "resume": {"data": "0123456789abcdef", "mixture": "x"}, "max_steps": 8, "batch_steps": 8}
    check_batch_request(**good)
    with pytest.raises(InvalidArgument) as info:
        check_batch_request(**{**good, **request_})
    assert names in str(info.value)


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        ({"losses": {"a": float("nan")}}, "the loss of source 'a' must be a finite number >= 0"),
        ({"losses": {"a": float("inf")}}, "finite"),
        ({"losses": {"a": -1.0}}, "finite"),
        ({"losses": {"c": 1.0}}, "'c' names no source"),
        ({"losses": {f"x{i}": 1.0 for i in range(100_000)}}, "(100000 unknown names)"),
        ({"step": -3}, "step must be"),
        ({"step": 2**63 - 1}, "step must be"),
    ],
)
def test_a_report_outside_the_job_is_invalid(request_, names) -> None:
    good = {"step": 3, "losses": {"a": 1.5, "b": 0.0}, "sources": ("a", "b")}
    check_report(**good)
    with pytest.raises(InvalidArgument) as info:
        check_report(**{**good, **request_})
    assert names in str(info.value)


# ---- from a loader -------------------------------------------------------------------------------


def payload(sources, seqs, lengths) -> bytes:
    batch = pa.record_batch(
        [
            pa.array(np.asarray(sources, np.int32)),
            pa.array(np.asarray(seqs, np.int64)),
            pa.array([list(range(n)) for n in lengths], pa.list_(pa.int32())),
        ],
        schema=FETCH_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def stream(data: bytes, *, payload_bytes: int | None = None, num_samples: int = 3, chunk: int = 100):
    header = loader_pb2.FetchHeader(num_samples=num_samples, payload_bytes=len(data) if payload_bytes is None else payload_bytes)
    yield loader_pb2.FetchSamplesResponse(header=header)
    for piece in iter_chunks(data, chunk):
        yield loader_pb2.FetchSamplesResponse(chunk=common_pb2.Chunk(data=piece))


SOURCES, SEQS, LENGTHS = np.array([0, 0, 1], np.int32), np.array([5, 9, 5], np.int64), np.array([3, 40, 7], np.int32)


def receive(messages):
    tables, nbytes = receive_samples(messages, address="10.0.0.7:5000", wanted=[Wanted(SOURCES, SEQS, LENGTHS)])
    return tables[0], nbytes


def test_a_well_formed_fetch_is_received_in_any_row_order() -> None:
    data = payload([1, 0, 0], [5, 9, 5], [7, 40, 3])
    table, nbytes = receive(stream(data))
    assert table.num_rows == 3 and nbytes == len(data)
    assert len(data) <= fetch_payload_limit(samples=3, tokens=50)


def test_a_huge_header_is_refused_before_anything_is_allocated() -> None:
    """2^40 announced bytes: refused naming the loader's address, without a MemoryError."""
    with pytest.raises(MalformedResponse, match=r"loader at 10\.0\.0\.7:5000 .*payload_bytes 1099511627776") as info:
        receive(stream(b"", payload_bytes=2**40))
    assert isinstance(info.value, Unavailable) and info.value.peer == "loader"


@pytest.mark.parametrize(
    ("messages", "names"),
    [
        (lambda good: iter(()), "did not start with a header"),
        (lambda good: iter([loader_pb2.FetchSamplesResponse(chunk=common_pb2.Chunk(data=b"x"))]), "did not start with a header"),
        (lambda good: stream(good, payload_bytes=-1), "payload_bytes -1"),
        (lambda good: stream(good, num_samples=2), "num_samples 2"),
        (lambda good: stream(good, payload_bytes=len(good) - 10), "overflows"),
        (lambda good: stream(good, payload_bytes=len(good) + 10), "truncated"),
        (lambda good: stream(b"\x00" * len(good)), "malformed response"),
        (lambda good: stream(payload([0, 0, 1], [5, 10, 5], [3, 40, 7])), "other than those requested"),
        (lambda good: stream(payload([0, 0, 1], [5, 9, 5], [3, 41, 7])), "other lengths than planned"),
        (lambda good: stream(payload([0, 0], [5, 9], [3, 40]), num_samples=3), "2 samples for 3"),
        (lambda good: iter([*stream(good), loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader())]), "other than a chunk"),
    ],
    ids=[
        "empty",
        "no-header",
        "negative",
        "count",
        "overflow",
        "short",
        "garbage",
        "other-samples",
        "other-lengths",
        "fewer",
        "second-header",
    ],
)
def test_a_malformed_fetch_stream_is_an_error_of_the_call(messages, names) -> None:
    good = payload([0, 0, 1], [5, 9, 5], [3, 40, 7])
    with pytest.raises(MalformedResponse, match=names):
        receive(messages(good))


def steps_payload(*steps) -> bytes:
    """One record batch per step, each (sources, seqs, lengths)."""
    batches = [pa.ipc.open_stream(payload(*step)).read_next_batch() for step in steps]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, FETCH_SCHEMA) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


STEPS = [
    Wanted(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32)),  # the step built: none here
    Wanted(np.array([0, 0], np.int32), np.array([20, 21], np.int64), np.array([3, 4], np.int32)),
    Wanted(np.array([1], np.int32), np.array([8], np.int64), np.array([5], np.int32)),
]


def steps_stream(data: bytes, *, served: int, num_samples: int):
    header = loader_pb2.FetchHeader(num_samples=num_samples, payload_bytes=len(data), following_served=served)
    yield loader_pb2.FetchSamplesResponse(header=header)
    for piece in iter_chunks(data, 100):
        yield loader_pb2.FetchSamplesResponse(chunk=common_pb2.Chunk(data=piece))


def test_a_fetch_of_several_steps_is_received_per_step_and_may_serve_a_prefix() -> None:
    """constructors.fetch_steps: one record batch per step served, each that step's samples in
    any order; a loader that served only the first following step says so."""
    every = steps_payload(([], [], []), ([0, 0], [21, 20], [4, 3]), ([1], [8], [5]))
    tables, nbytes = receive_samples(steps_stream(every, served=2, num_samples=3), address="10.0.0.7:5000", wanted=STEPS)
    assert [t.num_rows for t in tables] == [0, 2, 1] and nbytes == len(every)
    assert tables[1].column("seq").to_pylist() == [21, 20] and tables[2].column("source").to_pylist() == [1]
    prefix = steps_payload(([], [], []), ([0, 0], [20, 21], [3, 4]))
    tables, _ = receive_samples(steps_stream(prefix, served=1, num_samples=2), address="10.0.0.7:5000", wanted=STEPS)
    assert [t.num_rows for t in tables] == [0, 2]


@pytest.mark.parametrize(
    ("data", "served", "num_samples", "names"),
    [
        (steps_payload(([], [], []), ([0, 0], [20, 21], [3, 4]), ([1], [8], [5])), 3, 3, "following_served 3 outside"),
        (steps_payload(([], [], []), ([0, 0], [20, 21], [3, 4]), ([1], [8], [5])), -1, 3, "following_served -1 outside"),
        (steps_payload(([], [], []), ([0, 0, 1], [20, 21, 8], [3, 4, 5])), 2, 3, "2 record batches for 3 steps"),
        (steps_payload(([], [], []), ([0, 1], [20, 8], [3, 5]), ([0], [21], [4])), 2, 3, "other than those requested"),
        (steps_payload(([], [], []), ([0, 0], [20, 21], [3, 4]), ([1], [8], [5])), 2, 2, "num_samples 2"),
    ],
    ids=["served-past-asked", "served-negative", "batches-merged", "rows-swapped-between-steps", "count"],
)
def test_a_fetch_of_several_steps_that_mixes_them_up_is_malformed(data, served, num_samples, names) -> None:
    with pytest.raises(MalformedResponse, match=names):
        receive_samples(steps_stream(data, served=served, num_samples=num_samples), address="10.0.0.7:5000", wanted=STEPS)


@pytest.mark.parametrize(
    ("following", "names"),
    [
        (dict(steps=[5, 6, 7, 8]), "4 following plans for at most 3"),
        (dict(steps=[5, 7]), "following plan 1 is of step 7, not 6"),
        (dict(steps=[4]), "following plan 0 is of step 4, not 5"),
        (dict(steps=[5, 6], ends=[False, True]), "step 6.*end of data"),
        (dict(steps=[5], nested=[1]), "carries plans itself"),
    ],
)
def test_following_plans_other_than_the_next_steps_are_malformed(following, names) -> None:
    n = len(following["steps"])
    args = {"ends": [False] * n, "nested": [0] * n, **following}
    with pytest.raises(MalformedResponse, match=names):
        check_following(asked=4, stride=1, max_steps=4, address="planner:1", **args)


def test_following_plans_are_the_next_steps_of_the_constructor() -> None:
    check_following(asked=4, steps=[5, 6, 7], stride=1, max_steps=4, ends=[False] * 3, nested=[0] * 3, address="planner:1")
    check_following(asked=4, steps=[], stride=1, max_steps=1, ends=[], nested=[], address="planner:1")
    check_following(asked=5, steps=[8, 11], stride=3, max_steps=3, ends=[False, False], nested=[0, 0], address="planner:1")
    with pytest.raises(MalformedResponse, match="step 6, not 8"):
        check_following(asked=5, steps=[6], stride=3, max_steps=3, ends=[False], nested=[0], address="planner:1")


# ---- from the planner ------------------------------------------------------------------------------


def rank_plan(n: int = 3, *, bucket: int = 0, offsets=None, fetchers: int = 1, lengths=None) -> planner_pb2.RankPlan:
    return planner_pb2.RankPlan(
        dp_rank=bucket,
        samples=common_pb2.SampleSet(
            source=encode_array(np.zeros(n, np.int32)),
            seq=encode_array(np.arange(n, dtype=np.int64)),
            row=encode_array(np.arange(n, dtype=np.int64)),
            epoch=encode_array(np.zeros(n, np.int32)),
            length=encode_array(np.asarray(lengths if lengths is not None else [4] * n, np.int32)),
        ),
        microbatch_offsets=encode_array(np.asarray(offsets if offsets is not None else [0, n], np.int64)),
        fetchers=fetchers,
        loaders=encode_array(np.zeros(n, np.int32)),
    )


def buckets(plan: planner_pb2.GetPlanResponse, asked: int = 5):
    return plan_buckets(plan, asked=asked, address="planner:1", constructors=2, max_samples=8, microbatches=2)


def test_a_well_formed_plan_gives_each_buckets_arrays() -> None:
    got = buckets(
        planner_pb2.GetPlanResponse(
            step=5, oldest_step=2, ranks=[rank_plan(3, offsets=[0, 1, 3]), rank_plan(0, bucket=1, offsets=[0, 0, 0])]
        )
    )
    assert sorted(got) == [0, 1] and got[0][1].tolist() == [0, 1, 2] and got[0][6] == 1


@pytest.mark.parametrize(
    ("plan", "names"),
    [
        (planner_pb2.GetPlanResponse(step=6), "the plan of step 6 for step 5"),
        (planner_pb2.GetPlanResponse(step=5, oldest_step=6), "oldest_step 6"),
        (planner_pb2.GetPlanResponse(step=5, oldest_step=-1), "oldest_step -1"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(9, offsets=[0, 9])]), "more than one step's 8"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(3, offsets=[0, 5])]), "rise from 0 to 3"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(3, offsets=[0, 2, 1, 3])]), "rise from 0 to 3"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(3, offsets=[1, 3])]), "rise from 0 to 3"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(3, offsets=[0] * 50 + [3])]), "microbatches for 3 samples"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(3, fetchers=2**31 - 1)]), "fetchers 2147483647"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[rank_plan(3, lengths=[1, -2, 3])]), "negative sample length"),
        (planner_pb2.GetPlanResponse(step=5, ranks=[planner_pb2.RankPlan(dp_rank=0)]), "unknown dtype"),
    ],
)
def test_a_malformed_plan_is_an_error_of_the_call(plan, names) -> None:
    with pytest.raises(MalformedResponse, match=names) as info:
        buckets(plan)
    assert "planner at planner:1" in str(info.value) and info.value.peer == "planner"


def test_per_sample_arrays_must_agree() -> None:
    plan = rank_plan(3)
    plan.loaders.CopyFrom(encode_array(np.zeros(2, np.int32)))
    with pytest.raises(MalformedResponse, match="different lengths"):
        buckets(planner_pb2.GetPlanResponse(step=5, ranks=[plan]))
    check_bucket(
        bucket=0,
        sizes={},
        offsets=np.array([0, 0]),
        lengths=np.zeros(0, np.int32),
        fetchers=1,
        constructors=1,
        max_samples=4,
        microbatches=1,
        peer="planner",
        address="p",
    )  # a filler bucket: no samples
    check_plan_step(asked=3, step=3, oldest_step=3, peer="planner", address="p")


# ---- a constructor whose loader sends a 2^40-byte header keeps building -------------------------

JOB = job_from_mapping(
    {"job": "j", "sources": [{"name": "a", "path": "unused"}], "mesh": {"dp": 1}, "batch": {"global_batch_size": 3, "microbatches": 1}}
)


class _Planner:
    def GetPlan(self, request, timeout):  # noqa: N802 - the stub's method name
        return planner_pb2.GetPlanResponse(
            step=request.step,
            ranks=[rank_plan(3, lengths=LENGTHS_PLANNED)],
            loader_addresses=["loader-0:1"],
            global_loss_tokens=9,
            axis="DP",
        )


LENGTHS_PLANNED = [3, 4, 5]


class _Loader:
    def __init__(self) -> None:
        self.hostile = True
        self.calls = 0

    def FetchSamples(self, request, timeout):  # noqa: N802 - the stub's method name
        self.calls += 1
        if not len(request.samples.seq.data):
            return iter([loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader())])
        if self.hostile:
            return iter([loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader(num_samples=3, payload_bytes=2**40))])
        return stream(payload([0, 0, 0], [0, 1, 2], LENGTHS_PLANNED))


def test_a_constructor_whose_loader_sends_a_huge_header_retries_and_builds_once_it_answers_well() -> None:
    registry = CollectorRegistry()
    pipeline = StepPipeline(
        JOB, index=0, ranks=(0,), planner="planner:1", metrics=ConstructorMetrics(registry), connect=lambda a, p: Channel()
    )
    loader = _Loader()
    pipeline._planner = _Planner()
    pipeline._fetcher._loader = lambda address: loader
    try:
        with pytest.raises(Unavailable, match=r"loader at loader-0:1 sent a malformed response"):
            pipeline.batch(0, 0, timeout_s=1.5)
        assert registry.get_sample_value("batchplane_constructor_malformed_responses_total", {"peer": "loader"}) >= 1
        assert any(t.name == "build" and t.is_alive() for t in threading.enumerate())
        loader.hostile = False
        delivery = pipeline.batch(0, 0, timeout_s=10)
        assert delivery is not None and delivery.batch.microbatches[0].num_tokens == sum(LENGTHS_PLANNED)
    finally:
        pipeline.stop()
