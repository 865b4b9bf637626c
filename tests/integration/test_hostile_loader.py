"""A loader bounds what an authorized but hostile peer may ask of it (issue 15, point 3): a fetch
reaches only positions the planner may have planned from the replica, the reads a fetch makes
stay within `loaders.buffer_bytes`, and every field outside what the job has is refused with
the right status; after the attacks, the job still delivers every sample exactly once.

The first tests drive one loader stream on real Parquet files (no processes); the rest share one
small running job (an endless one, so that "far ahead" exists)."""

from __future__ import annotations

import collections
import json
import pathlib
import threading
import time

import grpc
import numpy as np
import pyarrow as pa
import pytest
from harness import collect, peer_channel, scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source
from prometheus_client import CollectorRegistry

from batchplane.core.order import SampleOrder
from batchplane.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from batchplane.loader.bounds import MAX_HELD_STEPS, FetchLimits
from batchplane.loader.fetch import FetchBook
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.service import LoaderServicer
from batchplane.loader.source import ParquetSource
from batchplane.loader.stream import ByteBudget, SourceStream
from batchplane.loader.transforms import BoundTransform, token_ids
from batchplane.v1 import common_pb2, constructor_pb2, constructor_pb2_grpc, loader_pb2, loader_pb2_grpc
from batchplane.wire import encode_array

pytestmark = pytest.mark.integration

ROWS, GROUP = 120, 10  # windows of one row group: 12 windows an epoch

# ---- one stream, no processes --------------------------------------------------------------------


@pytest.fixture
def open_stream(tmp_path: pathlib.Path):
    data = write_source(tmp_path, "a", [5 + i % 7 for i in range(ROWS)], row_group_size=GROUP, seed=3)
    streams = []

    def make(*, budget: int, read_ahead: int = 20) -> tuple[SourceStream, LoaderMetrics]:
        source = ParquetSource("a", data.path, required_columns=("input_ids",), token_column="input_ids")
        order = SampleOrder([rg.num_rows for rg in source.row_groups], seed=1, source_name="a", window_row_groups=1, shuffle=True)
        metrics = LoaderMetrics(CollectorRegistry())
        stream = SourceStream(
            0,
            source,
            order,
            BoundTransform(token_ids, {"column": "input_ids"}, ("input_ids",)),
            epochs=None,
            read_ahead_samples=read_ahead,
            budget=ByteBudget(budget),
            metrics=metrics,
            replica="0",
        )
        streams.append(stream)
        return stream, metrics

    yield make
    for s in streams:
        s.close()


def _ask(stream: SourceStream, start: int, end: int, **progress: int) -> None:
    progress.setdefault("planned_seq", start)
    while start < end:
        rows = stream.summary(from_seq=start, max_samples=end - start, wait_s=10, **progress).rows
        start += len(rows)


def _read(metrics: LoaderMetrics) -> float:
    return metrics.samples_read.labels("a")._value.get()


def test_a_fetch_of_positions_never_asked_about_reads_nothing(open_stream) -> None:
    """Row "one request of far-ahead positions": refused before any read, however many."""
    stream, metrics = open_stream(budget=1 << 30, read_ahead=40)
    _ask(stream, 0, 30)
    wait_until(lambda: _read(metrics) >= 40, timeout_s=10, what="the read-ahead")  # 30 asked + 10 ahead
    time.sleep(0.2)
    read, held = _read(metrics), stream.budget.used
    book = FetchBook({0: stream})
    far = np.arange(10**6, 10**6 + 200_000, dtype=np.int64)
    for seqs in (far, np.array([3, 30], np.int64)):  # 30: read ahead, not asked about
        with pytest.raises(Unavailable, match="nothing was read"):
            book.fetch(constructor=0, step=0, sources=np.zeros(len(seqs), np.int32), seqs=seqs)
    assert _read(metrics) == read and stream.budget.used == held
    assert book.held_steps == 0
    assert book.fetch(constructor=0, step=0, sources=np.zeros(2, np.int32), seqs=np.array([3, 29], np.int64)).num_rows == 2
    stream.asked_through(40)  # the planner's heartbeat says it asked about window 3 (of another replica)
    assert book.fetch(constructor=0, step=1, sources=np.zeros(1, np.int32), seqs=np.array([30], np.int64)).num_rows == 1


def test_what_a_constructor_makes_the_loader_hold_is_bounded(open_stream) -> None:
    """Fetches of made-up steps (each recorded until released) keep at most MAX_HELD_STEPS steps
    per constructor, the lowest; fetches of nothing record nothing."""
    stream, _ = open_stream(budget=1 << 30)
    _ask(stream, 0, 30)
    book = FetchBook({0: stream})
    for step in range(10**6, 10**6 + 3 * MAX_HELD_STEPS):
        book.fetch(constructor=0, step=step, sources=np.zeros(2, np.int32), seqs=np.array([1, 12], np.int64))
        book.fetch(constructor=1, step=step, sources=np.zeros(0, np.int32), seqs=np.zeros(0, np.int64))
    assert book.held_steps == MAX_HELD_STEPS
    book.fetch(constructor=0, step=5, sources=np.zeros(1, np.int32), seqs=np.array([3], np.int64))  # a real, lower step is kept
    assert book.release(constructor=0, below_step=6) == 1


def test_with_the_jobs_limits_a_fetch_names_a_constructor_and_at_most_a_step_of_samples(open_stream) -> None:
    """Row "a made-up constructor index": the loader's servicer, given the job's limits, refuses
    an index the job does not have and more samples than one step plans; a payload past
    loaders.buffer_bytes is RESOURCE_EXHAUSTED."""
    stream, metrics = open_stream(budget=1 << 30)
    _ask(stream, 0, 30)
    servicer = LoaderServicer({0: stream}, FetchBook({0: stream}), metrics, limits=FetchLimits(constructors=2, max_samples=12))
    servicer.join(sources=("a",), hook=None)

    def fetch(constructor: int, seqs) -> int:
        request = loader_pb2.FetchSamplesRequest(
            constructor_index=constructor,
            step=0,
            samples=common_pb2.SampleSet(source=encode_array(np.zeros(len(seqs), np.int32)), seq=encode_array(np.asarray(seqs, np.int64))),
        )
        first = next(servicer.FetchSamples(request, None))  # serialized already: the server passes it on
        return loader_pb2.FetchSamplesResponse.FromString(first).header.num_samples

    assert fetch(1, range(12)) == 12
    with pytest.raises(InvalidArgument, match=r"constructor_index must be in \[0, 2\)"):
        fetch(2, [1])
    with pytest.raises(InvalidArgument, match="at most 12 samples"):
        fetch(0, range(13))
    servicer._book = FetchBook({0: stream}, max_payload_bytes=100)  # loaders.buffer_bytes: 100
    with pytest.raises(ResourceExhausted, match="more than loaders.buffer_bytes"):
        fetch(0, range(12))
    assert metrics.fetches_refused.labels("too_big")._value.get() == 1


def _steps_request(steps, *, constructor: int = 0) -> loader_pb2.FetchSamplesRequest:
    """A FetchSamples request for [(step, seqs)] of source 0: the first step, then following ones."""

    def samples(seqs) -> common_pb2.SampleSet:
        return common_pb2.SampleSet(source=encode_array(np.zeros(len(seqs), np.int32)), seq=encode_array(np.asarray(seqs, np.int64)))

    (step, seqs), rest = steps[0], steps[1:]
    return loader_pb2.FetchSamplesRequest(
        constructor_index=constructor,
        step=step,
        samples=samples(seqs),
        following=[loader_pb2.StepSamples(step=t, samples=samples(q)) for t, q in rest],
    )


def _served(servicer: LoaderServicer, request: loader_pb2.FetchSamplesRequest) -> tuple[loader_pb2.FetchHeader, list]:
    """The header and the record batches of a FetchSamples answer."""
    messages = [loader_pb2.FetchSamplesResponse.FromString(m) for m in servicer.FetchSamples(request, None)]
    data = b"".join(m.chunk.data for m in messages[1:])
    return messages[0].header, list(pa.ipc.open_stream(data))


def test_a_fetch_of_several_steps_serves_each_as_its_own_fetch_would_and_cuts_at_the_budget(open_stream) -> None:
    """constructors.fetch_steps: one call for steps 4, 5 and 7 answers one record batch per step,
    equal to what a fetch of that step alone returns, each recorded as that step's hold; with a
    budget that the third step would overrun, the loader serves the first two (a prefix), holds
    nothing for the third, and counts the cut."""
    stream, metrics = open_stream(budget=1 << 30)
    _ask(stream, 0, 60)
    steps = [(4, [1, 2, 3]), (5, [20, 11]), (7, [40, 41, 42, 43])]
    reference = FetchBook({0: stream})
    expected = [reference.fetch(constructor=1, step=t, sources=np.zeros(len(q), np.int32), seqs=np.asarray(q)) for t, q in steps]
    servicer = LoaderServicer({0: stream}, FetchBook({0: stream}), metrics, limits=FetchLimits(constructors=2, max_samples=12, max_steps=4))
    servicer.join(sources=("a",), hook=None)
    header, batches = _served(servicer, _steps_request(steps))
    assert header.following_served == 2 and header.num_samples == 9
    assert [b.num_rows for b in batches] == [3, 2, 4]
    assert all(got.equals(want) for got, want in zip(batches, expected))
    assert servicer._book.held_steps == 3
    assert metrics.fetch_steps._sum.get() == 3

    book = FetchBook({0: stream}, max_payload_bytes=expected[0].nbytes + expected[1].nbytes + expected[2].nbytes // 2)
    servicer = LoaderServicer({0: stream}, book, metrics, limits=FetchLimits(constructors=2, max_samples=12, max_steps=4))
    servicer.join(sources=("a",), hook=None)
    header, batches = _served(servicer, _steps_request(steps))
    assert header.following_served == 1 and [b.num_rows for b in batches] == [3, 2]
    assert book.held_steps == 2, "the step cut is not held"
    assert metrics.following_cut.labels("too_big")._value.get() == 1


def test_a_following_step_the_planner_has_not_told_of_is_left_for_a_later_fetch(open_stream) -> None:
    """A following step at positions this replica was not asked about (the planner planned them
    a moment ago, or nobody did): the first step is served, the rest cut as not ready."""
    stream, metrics = open_stream(budget=1 << 30)
    _ask(stream, 0, 30)
    servicer = LoaderServicer({0: stream}, FetchBook({0: stream}), metrics, limits=FetchLimits(constructors=2, max_samples=12, max_steps=4))
    servicer.join(sources=("a",), hook=None)
    header, batches = _served(servicer, _steps_request([(0, [1, 2]), (1, [3]), (2, [10**6])]))
    assert header.following_served == 1 and [b.num_rows for b in batches] == [2, 1]
    assert metrics.following_cut.labels("not_ready")._value.get() == 1


@pytest.mark.parametrize(
    ("steps", "names"),
    [
        ([(0, [1]), (1, [2]), (2, [3]), (3, [4]), (4, [5])], r"following: at most 3 steps \(constructors.fetch_steps 4"),
        ([(3, [1]), (3, [2])], r"following\[0\].step must be in \(3, "),
        ([(3, [1]), (5, [2]), (4, [3])], r"following\[1\].step must be in \(5, "),
        ([(3, [1, 2]), (4, [2])], r"the steps of one call name 1 \(source, seq\) pairs more than once"),
        ([(3, [1]), (4, [2]), (5, [-1])], r"following\[1\]\. ?samples.seq must be >= 0"),
        ([(3, [1]), (4, list(range(13)))], r"following\[0\]\. ?samples: at most 12 samples"),
    ],
    ids=["too-many", "not-rising", "falling", "repeated-across-steps", "bad-field", "too-many-samples"],
)
def test_a_fetch_of_several_steps_outside_what_the_job_allows_is_refused_naming_the_field(open_stream, steps, names) -> None:
    stream, metrics = open_stream(budget=1 << 30)
    _ask(stream, 0, 30)
    book = FetchBook({0: stream})
    servicer = LoaderServicer({0: stream}, book, metrics, limits=FetchLimits(constructors=2, max_samples=12, max_steps=4))
    servicer.join(sources=("a",), hook=None)
    with pytest.raises(InvalidArgument, match=names):
        _served(servicer, _steps_request(steps))
    assert book.held_steps == 0, "a refused call holds nothing"


def test_over_its_budget_a_fetch_reads_what_it_needs_and_the_buffer_does_not_grow(open_stream) -> None:
    """Row "reads ignore loaders.buffer_bytes": positions of six windows the loader freed, fetched
    over budget, are served byte-identical while the buffer keeps nothing of them."""
    reference, _ = open_stream(budget=1 << 30)
    _ask(reference, 0, 60)
    seqs = np.array([2, 13, 24, 35, 46, 57], np.int64)
    expected = FetchBook({0: reference}).fetch(constructor=0, step=0, sources=np.zeros(6, np.int32), seqs=seqs)
    stream, metrics = open_stream(budget=1)  # always over budget
    _ask(stream, 0, 60)
    _ask(stream, 60, 70, planned_seq=60, planned_steps=6, delivered_below=6)  # every step handed: windows 0..5 freed
    assert all(w.seq_start >= 60 for w in stream._windows)
    held = stream.budget.used
    book = FetchBook({0: stream}, max_payload_bytes=1 << 20)
    got = book.fetch(constructor=1, step=2, sources=np.zeros(6, np.int32), seqs=seqs)
    assert got.equals(expected)
    assert stream.budget.used == held, "windows read for a fetch over budget are not kept"
    assert metrics.samples_replayed.labels("a")._value.get() == 6 * GROUP
    assert book.release(constructor=1, below_step=3) == 6  # their holds go quietly


# ---- a running job ------------------------------------------------------------------------------------

BUDGET = 32 << 10


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    sources = [
        write_source(root / "data", "a", skewed_lengths(120, seed=4), row_group_size=10, seed=4),
        write_source(root / "data", "b", skewed_lengths(80, seed=5), row_group_size=10, seed=5),
    ]
    config = write_job(
        root / "job.yaml",
        sources,
        epochs="infinite",
        loaders={"count": 1, "buffer_bytes": BUDGET, "shuffle": {"window_row_groups": 1}},
    )
    cluster = start_cluster(config)
    try:
        yield cluster, json.loads(cluster.endpoints_path.read_text())
    finally:
        cluster.stop()


def _fetch(stub, *, constructor: int = 0, step: int = 0, sources, seqs, copies=None, release: int = 0):
    request = loader_pb2.FetchSamplesRequest(
        constructor_index=constructor,
        step=step,
        release_below_step=release,
        samples=common_pb2.SampleSet(source=encode_array(np.asarray(sources, np.int32)), seq=encode_array(np.asarray(seqs, np.int64))),
        copies=encode_array(np.asarray(copies, np.int32)) if copies is not None else None,
    )
    return list(stub.FetchSamples(request, timeout=30))


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _read_total(endpoints) -> float:
    metrics = scrape(endpoints["metrics"]["loader-0"])
    return sum(v for k, v in metrics.items() if k.startswith("batchplane_loader_samples_read_total"))


def _buffer(endpoints) -> float:
    return scrape(endpoints["metrics"]["loader-0"])["batchplane_loader_buffer_bytes"]


def test_hostile_fetches_and_summaries_are_refused_with_the_right_status(job) -> None:
    cluster, endpoints = job
    loader = endpoints["loaders"]["0"]
    with peer_channel(cluster, loader, role="constructor", index=0) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        # Before any step is planned, nothing is: the planner has asked about no window.
        code, details = _code(lambda: _fetch(stub, sources=[0], seqs=[0]))
        assert code == grpc.StatusCode.UNAVAILABLE and "not planned here" in details
        code, details = _code(lambda: _fetch(stub, sources=np.zeros(5), seqs=np.arange(10**9, 10**9 + 5)))
        assert code == grpc.StatusCode.UNAVAILABLE and "nothing was read" in details
        # 200,000 far-ahead positions (2.4 MB): refused before anything is read (UNAVAILABLE; once
        # the loader is given the job's limits, INVALID_ARGUMENT: more than one step's samples).
        far = np.arange(10**9, 10**9 + 200_000)
        code, details = _code(lambda: _fetch(stub, sources=np.zeros(len(far)), seqs=far))
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT), details
        assert _read_total(endpoints) == 0
        for bad, names in [
            ({"step": -1}, "step must be"),
            ({"release": -1}, "release_below_step"),
            ({"sources": [0, 0], "seqs": [5, 5]}, "more than once"),
            ({"sources": [7], "seqs": [5]}, "not [7]"),
            ({"sources": [0], "seqs": [5], "copies": [2**31 - 1]}, "copies must lie"),
        ]:
            request = {"sources": [0], "seqs": [5], **bad}
            code, details = _code(lambda: _fetch(stub, **request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and names in details, (bad, code, details)
    # A certificate naming no index (one per component, as the chart issues) may act for any
    # constructor: the index must still be one the job has.
    with peer_channel(cluster, loader, role="constructor") as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        for index in (2**31 - 1, -1):
            code, details = _code(lambda: _fetch(stub, constructor=index, sources=[0], seqs=[5]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "constructor_index" in details, (index, code, details)
    with peer_channel(cluster, loader, role="planner") as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        for request, names in [
            (loader_pb2.GetSummaryRequest(source=0, from_seq=0, planned_seq=10**12), "never passes what it knows"),
            (loader_pb2.GetSummaryRequest(source=0, from_seq=2**63 - 1), "from_seq"),
            (loader_pb2.GetSummaryRequest(source=0, delivered_below=-4), "delivered_below"),
            (
                loader_pb2.GetSummaryRequest(source=0, routes=[common_pb2.Route(from_window=3, replicas=["0"])]),
                "routes must start at window 0",
            ),
            (loader_pb2.GetSummaryRequest(source=0, routes=[common_pb2.Route(from_window=0, replicas=["0", "0"])]), "distinct replicas"),
        ]:
            code, details = _code(lambda: stub.GetSummary(request, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and names in details, (request, code, details)


def test_under_attack_the_job_still_delivers_every_sample_exactly_once(job) -> None:
    """While a peer with constructor 0's identity keeps fetching far-ahead positions and samples
    of made-up steps, two trainers run through the first epoch of both sources; then a hostile
    trainer sends its constructor every out-of-bounds field; the trainers go on. Each sample of
    the first epoch arrives exactly once."""
    cluster, endpoints = job
    stop = threading.Event()
    refused: collections.Counter = collections.Counter()

    def attack() -> None:
        with peer_channel(cluster, endpoints["loaders"]["0"], role="constructor", index=0) as channel:
            stub = loader_pb2_grpc.LoaderStub(channel)
            i = 0
            while not stop.is_set():
                i += 1
                for request in ({"seqs": [10**9 + i]}, {"seqs": [i % 40], "step": 10**6 + i}):
                    try:
                        _fetch(stub, sources=[i % 2], **request)
                    except grpc.RpcError as exc:
                        refused[exc.code()] += 1
                stop.wait(0.01)

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        batches, states = collect(cluster.endpoints_path, range(2), stop_after=30)
    finally:
        stop.set()
        attacker.join(timeout=30)
    assert refused[grpc.StatusCode.UNAVAILABLE] > 0
    _attack_constructor(cluster, endpoints["constructors"]["0"])
    more, _ = collect(cluster.endpoints_path, range(2), states=states, stop_after=3)
    assert [b["step"] for b in more[0]] == [30, 31, 32]
    for rank in batches:
        batches[rank] += more[rank]
    seen = collections.Counter(
        (s, r, e)
        for rank in batches.values()
        for b in rank
        for mb in b["microbatches"]
        for s, r, e in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist(), mb["sample_epoch"].tolist())
    )
    assert max(seen.values()) == 1, "a sample arrived twice"
    for source, rows in ((0, 120), (1, 80)):
        assert {r for s, r, e in seen if s == source and e == 0} == set(range(rows)), f"source {source}'s first epoch is incomplete"
    metrics = scrape(endpoints["metrics"]["loader-0"])
    assert metrics['batchplane_loader_fetches_refused_total{reason="not_planned"}'] > 0


def _attack_constructor(cluster, address: str) -> None:
    """Every GetBatch and Report field out of bounds, from the trainer of rank 0 (which has asked
    for steps up to 30): each refused with its status, nothing acted on."""
    with peer_channel(cluster, address, role="trainer") as channel:
        stub = constructor_pb2_grpc.ConstructorStub(channel)
        for request, code, names in [
            (constructor_pb2.GetBatchRequest(rank=5, step=30), grpc.StatusCode.INVALID_ARGUMENT, "outside the job's mesh of 2 ranks"),
            (constructor_pb2.GetBatchRequest(rank=0, step=-1), grpc.StatusCode.INVALID_ARGUMENT, "step must be"),
            (constructor_pb2.GetBatchRequest(rank=0, step=2**63 - 1), grpc.StatusCode.INVALID_ARGUMENT, "step must be"),
            (
                constructor_pb2.GetBatchRequest(rank=0, step=10**15, restart=True, wait_ms=2**31 - 1),
                grpc.StatusCode.FAILED_PRECONDITION,
                "ahead of every step",
            ),
            (constructor_pb2.GetBatchRequest(rank=0, step=10**9), grpc.StatusCode.FAILED_PRECONDITION, "ahead of every step"),
            (
                constructor_pb2.GetBatchRequest(rank=0, step=30, resume={str(i): "x" for i in range(1000)}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "fingerprints",
            ),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                next(stub.GetBatch(request, timeout=20))
            assert info.value.code() == code and names in info.value.details(), (request, info.value.details())
        for request, code, names in [
            (common_pb2.ReportRequest(step=3, losses={"a": float("nan")}), grpc.StatusCode.INVALID_ARGUMENT, "finite number >= 0"),
            (common_pb2.ReportRequest(step=3, losses={"a": float("-inf")}), grpc.StatusCode.INVALID_ARGUMENT, "finite number >= 0"),
            (
                common_pb2.ReportRequest(step=3, losses={f"k{i}": 1.0 for i in range(20_000)}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "names no source",
            ),
            (common_pb2.ReportRequest(step=-1, losses={"a": 1.0}), grpc.StatusCode.INVALID_ARGUMENT, "step must be"),
            (common_pb2.ReportRequest(step=10**9, losses={"a": 1.0}), grpc.StatusCode.FAILED_PRECONDITION, "no rank here has been given"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Report(request, timeout=20)
            assert info.value.code() == code and names in info.value.details(), (request.step, info.value.details())


def test_old_windows_a_hostile_fetch_asks_for_are_not_kept(job) -> None:
    """Once the job is idle: a request for a sample of each window of the first epoch (all freed
    long ago) is served over budget without the loader's buffer keeping those windows."""
    cluster, endpoints = job
    stable = []
    wait_until(
        lambda: stable.append(_buffer(endpoints)) or (len(stable) > 5 and len(set(stable[-5:])) == 1), timeout_s=30, what="an idle loader"
    )
    before = stable[-1]
    with peer_channel(cluster, endpoints["loaders"]["0"], role="constructor", index=1) as channel:
        stub = loader_pb2_grpc.LoaderStub(channel)
        got = _fetch(stub, constructor=1, step=10**6, sources=np.zeros(12), seqs=np.arange(0, 120, 10))
        assert got[0].header.num_samples == 12
        assert _buffer(endpoints) <= before
