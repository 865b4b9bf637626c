"""The job's length under journal delivery (issue 18): the length object's codec
(`journal.writer.encode_length` / `decode_length`) round-trips and refuses hostile bytes naming
the key and the field; the producer stores the planner's finite length once (put-if-absent),
none for an infinite job, keeps a different one already there (logging both), and retries a
storage or planner failure without stopping; a consumer answers GetLength from the end marker,
else from the length object (mapped to logical steps under a DP change), else unknown, and
refuses a corrupt length object while no end marker is written."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
from prometheus_client import CollectorRegistry
from test_journal_produce import FakePipeline, info_of, make_job, produce

from batchplane.constructor.consume import JournalConsumer
from batchplane.constructor.journal_service import JournalConstructorServicer
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.produce import JournalProducer
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.storage import MemoryStorage
from batchplane.journal.writer import LENGTH_KEY, claim_length, decode_length, encode_length, read_end, read_length
from batchplane.v1 import common_pb2, constructor_pb2

# ---- the codec -----------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, 1, 20, 2**62])
def test_the_length_object_round_trips_with_deterministic_bytes(steps: int) -> None:
    data = encode_length(steps)
    assert data == f'{{"num_steps":{steps}}}'.encode()
    assert decode_length(data, where="length object 'length.json'") == steps


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[3]", '["num_steps"]'),
        (b"3", '["num_steps"]'),
        (b'{"steps": 3}', '["num_steps"]'),
        (b'{"num_steps": 3, "end_step": 3}', '["num_steps"]'),
        (b"{}", '["num_steps"]'),
        (b'{"num_steps": -1}', "'num_steps'"),
        (b'{"num_steps": 1.5}', "'num_steps'"),
        (b'{"num_steps": "3"}', "'num_steps'"),
        (b'{"num_steps": true}', "'num_steps'"),
        (b'{"num_steps": null}', "'num_steps'"),
    ],
)
def test_a_hostile_length_object_is_refused_naming_the_key_and_the_field(data: bytes, names: str) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        decode_length(data, where="length object 'j/length.json'")
    assert "'j/length.json'" in str(caught.value) and names in str(caught.value)


@pytest.mark.parametrize("steps", [-1, True, 2.0])
def test_encoding_refuses_what_is_not_a_step_count(steps) -> None:
    with pytest.raises(InvalidArgument, match="num_steps"):
        encode_length(steps)


def test_a_stored_length_is_never_overwritten() -> None:
    storage = MemoryStorage()
    assert read_length(storage, "j/") is None
    assert claim_length(storage, "j/", num_steps=12) == 12
    assert claim_length(storage, "j/", num_steps=12) == 12
    assert claim_length(storage, "j/", num_steps=13) == 12  # the one there: the caller compares
    assert read_length(storage, "j/") == 12 and storage.get("j/" + LENGTH_KEY) == encode_length(12)


# ---- the producer --------------------------------------------------------------------------


class FlakyStorage(MemoryStorage):
    """Fails the first `failures` puts of the length object."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.endswith(LENGTH_KEY) and self.failures:
            self.failures -= 1
            raise Unavailable("the store is down")
        return super().put_if_absent(key, data)


def test_the_producer_stores_the_planners_length_once_it_is_known() -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    pipeline = FakePipeline(job, end=5)
    pipeline.lengths = [common_pb2.JobLength(unknown="waiting for loaders ['a'] to register"), Unavailable("planner restarting")]
    producer = produce(job, storage, pipeline)
    assert read_length(storage) == 5 and read_end(storage) == 5
    assert producer.length_settled and producer.end_step == 5


def test_the_producer_stores_no_length_for_an_infinite_job() -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    pipeline = FakePipeline(job, end=3)
    pipeline.lengths = [common_pb2.JobLength(infinite=True)]
    producer = produce(job, storage, pipeline)
    assert read_length(storage) is None and producer.length_settled


def test_a_storage_failure_storing_the_length_is_retried_and_production_goes_on() -> None:
    job = make_job(dp=2)
    storage = FlakyStorage(failures=2)
    producer = produce(job, storage, FakePipeline(job, end=4))
    assert read_length(storage) == 4 and producer.end_step == 4 and storage.failures == 0


def test_a_journal_holding_another_length_keeps_it_and_the_producer_says_so(caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    claim_length(storage, num_steps=7)
    with caplog.at_level(logging.ERROR, logger="batchplane.constructor.produce"):
        producer = produce(job, storage, FakePipeline(job, end=4))
    assert read_length(storage) == 7 and producer.end_step == 4
    (record,) = [r for r in caplog.records if "never changes" in r.getMessage()]
    assert record.levelno == logging.ERROR and "'length.json'" in record.getMessage()
    assert "says 7 steps, the planner says 4" in record.getMessage()


def test_an_unreadable_length_object_is_left_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    storage.put_if_absent(LENGTH_KEY, b"garbage")
    with caplog.at_level(logging.ERROR, logger="batchplane.constructor.produce"):
        producer = produce(job, storage, FakePipeline(job, end=3))
    assert producer.end_step == 3 and storage.get(LENGTH_KEY) == b"garbage"
    assert any("cannot read" in r.getMessage() and "not JSON" in r.getMessage() for r in caplog.records)


# ---- the consumer --------------------------------------------------------------------------


class Context:
    def time_remaining(self) -> float | None:
        return None


_STARTED: list[JournalConsumer] = []


@pytest.fixture(autouse=True)
def _stop_consumers():
    yield
    while _STARTED:
        _STARTED.pop().stop()


def serve(job, storage, index: int = 0) -> JournalConstructorServicer:
    metrics = ConstructorMetrics(CollectorRegistry())
    consumer = JournalConsumer(job, storage=storage, index=index, ranks=job.pod_ranks(index), metrics=metrics)
    _STARTED.append(consumer)
    return JournalConstructorServicer(job, consumer, metrics, storage=storage)


def length(servicer: JournalConstructorServicer, wait_ms: int = 0) -> common_pb2.JobLength:
    return servicer.GetLength(constructor_pb2.GetLengthRequest(wait_ms=wait_ms), Context()).length


def fetch(servicer: JournalConstructorServicer, rank: int, step: int) -> constructor_pb2.BatchHeader:
    request = constructor_pb2.GetBatchRequest(rank=rank, step=step, wait_ms=2000)
    first = next(iter(servicer.GetBatch(request, Context())))
    return (
        first.header if isinstance(first, constructor_pb2.GetBatchResponse) else constructor_pb2.GetBatchResponse.FromString(first).header
    )


def written(*, dp: int = 2, end: int = 6, length: int | None = None, end_marker: bool = True) -> MemoryStorage:
    """A journal of steps 0..end-1 written at `dp`; its length object says `length` (the
    planner's `end` by default), its end marker is removed unless `end_marker`."""
    job = make_job(dp=dp)
    storage = MemoryStorage()
    if length is not None:
        claim_length(storage, num_steps=length)
    produce(job, storage, FakePipeline(job, end=end))
    if not end_marker:
        storage.delete("end/p0.json")
    return storage


def test_the_length_comes_from_the_length_object_else_the_end_marker_else_unknown() -> None:
    job = make_job(dp=2)
    storage = written(end_marker=False)
    # the length object, before the end
    assert length(serve(job, storage)) == common_pb2.JobLength(num_steps=6)
    storage.delete(LENGTH_KEY)
    unknown = length(serve(job, storage))
    assert unknown.num_steps == 0 and not unknown.infinite
    assert "length.json" in unknown.unknown and "end of the data" in unknown.unknown
    assert length(serve(job, written(end=4))) == common_pb2.JobLength(num_steps=4)  # the end marker


def test_an_empty_journal_is_unknown_and_an_infinite_job_infinite() -> None:
    assert "waiting for a producer" in length(serve(make_job(dp=2), MemoryStorage())).unknown
    infinite = dataclasses.replace(make_job(dp=2), epochs=None)  # epochs: infinite
    assert length(serve(infinite, MemoryStorage())) == common_pb2.JobLength(infinite=True)


def test_the_end_marker_wins_over_a_length_object_that_disagrees_warning_once(caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(dp=2)
    storage = written(end=6, length=9)  # the producer kept the 9 it found
    servicer = serve(job, storage)
    with caplog.at_level(logging.WARNING, logger="batchplane.constructor.consume"):
        assert [length(servicer).num_steps for _ in range(3)] == [6, 6, 6]
    warned = [r.getMessage() for r in caplog.records if "answering the end marker's" in r.getMessage()]
    assert len(warned) == 1 and "says 9 steps" in warned[0] and "step 6" in warned[0]


def test_an_end_marker_past_the_stored_length_is_no_contradiction(caplog: pytest.LogCaptureFixture) -> None:
    """With several producers, each finds the end at its first own step at or past it: until the
    producer of the last step writes its marker, the least marker can lie past the end. The
    planner's count (stored) is exact then."""
    job = make_job(dp=2)
    storage = written(end=6, end_marker=False)  # the producer of the last step has not written its marker
    storage.put_if_absent("end/p1.json", b'{"end_step":9}')  # another producer's: its first own step past the end
    with caplog.at_level(logging.WARNING, logger="batchplane.constructor.consume"):
        assert length(serve(job, storage)) == common_pb2.JobLength(num_steps=6)
    assert not [r for r in caplog.records if "answering the end marker's" in r.getMessage()]


def test_a_corrupt_length_object_is_refused_before_the_end_and_ignored_after(caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(dp=2)
    storage = written(end_marker=False)
    storage.delete(LENGTH_KEY)
    storage.put_if_absent(LENGTH_KEY, b'{"num_steps": -4}')
    with pytest.raises(FailedPrecondition, match="'length.json'.*'num_steps'"):
        length(serve(job, storage))
    storage.put_if_absent("end/p0.json", b'{"end_step":6}')
    with caplog.at_level(logging.WARNING, logger="batchplane.constructor.consume"):
        assert length(serve(job, storage)) == common_pb2.JobLength(num_steps=6)
    assert any("'num_steps'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("end_marker", [False, True])
def test_the_length_is_mapped_to_logical_steps_like_the_end_marker_under_a_dp_change(end_marker: bool) -> None:
    storage = written(dp=2, end=8, end_marker=end_marker)  # 16 written slices
    wider = make_job(dp=4, ranks_per_constructor=2)
    servicer = serve(wider, storage, 0)
    assert length(servicer).num_steps == 4  # from step 0: 16 slices / 4 per step
    for step in (2, 3):  # resumed at step 2 (a checkpoint taken at dp=2): written step 2 on
        for rank in wider.pod_ranks(0):
            assert fetch(servicer, rank, step).step == step
    assert length(servicer).num_steps == 2 + (16 - 4) // 4


def test_get_length_waits_for_the_length_object() -> None:
    job = make_job(dp=2)
    storage = written(end_marker=False)
    storage.delete(LENGTH_KEY)
    servicer = serve(job, storage)
    timer = threading.Timer(0.2, claim_length, args=(storage,), kwargs={"num_steps": 6})
    timer.start()
    try:
        assert length(servicer, wait_ms=30_000) == common_pb2.JobLength(num_steps=6)
    finally:
        timer.cancel()


def test_a_stopped_consumer_answers_at_once() -> None:
    job = make_job(dp=2)
    servicer = serve(job, MemoryStorage())
    _STARTED[-1].stop()
    assert length(servicer, wait_ms=30_000).unknown


def test_producer_and_consumer_agree_on_the_length_before_the_end() -> None:
    """The producer stores it before its first step: a consumer knows it while steps are still
    being produced."""
    job = make_job(dp=2)
    storage = MemoryStorage()
    pipeline = FakePipeline(job, end=10)
    producer = JournalProducer(job, pipeline=pipeline, storage=storage, info=info_of(job), metrics=ConstructorMetrics(CollectorRegistry()))
    original = pipeline.batch
    seen: list[tuple[int | None, common_pb2.JobLength]] = []

    def batch(rank: int, step: int, **kwargs):
        if step == 3 and rank == 0:  # steps 0..2 written, the end not reached
            seen.append((read_end(storage), length(serve(job, storage))))
        return original(rank, step, **kwargs)

    pipeline.batch = batch
    producer.run()
    assert producer.end_step == 10
    assert seen == [(None, common_pb2.JobLength(num_steps=10))]
