"""Journal delivery's consumer side (batchplane.constructor.consume) over a journal the producer
wrote on MemoryStorage: every rank gets the very header and payload streaming delivery would
send, plus the journal cursor of the next step; past the end marker, the end-of-data header and
the length; DP 2->4 at resume delivers each written slice exactly once, and resumes that carry
the cursor (DP 2->4->2, 4->2->4, 2->1->2) go on where the last one stopped; a CP change and
Report are refused; marks follow the pod."""

from __future__ import annotations

import collections

import pytest
from prometheus_client import CollectorRegistry
from test_journal_produce import FakePipeline, info_of, loss_of, make_job, produce, streamed

from batchplane.constructor.consume import JournalConsumer
from batchplane.constructor.journal_service import JournalConstructorServicer
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.storage import MemoryStorage
from batchplane.journal.commit import ManifestStore
from batchplane.v1 import common_pb2, constructor_pb2


class Context:
    def time_remaining(self) -> float | None:
        return None


_STARTED: list[JournalConsumer] = []


@pytest.fixture(autouse=True)
def _stop_consumers():
    """Stops every consumer a test started (their readers prefetch on threads of their own)."""
    yield
    while _STARTED:
        _STARTED.pop().stop()


def serve(job, storage, index: int, **kwargs) -> JournalConstructorServicer:
    metrics = ConstructorMetrics(CollectorRegistry())
    consumer = JournalConsumer(job, storage=storage, index=index, ranks=job.pod_ranks(index), metrics=metrics, **kwargs)
    _STARTED.append(consumer)
    return JournalConstructorServicer(job, consumer, metrics, storage=storage)


def fetch(
    servicer, rank: int, step: int, *, restart: bool = False, cursor: constructor_pb2.JournalCursor | None = None
) -> tuple[constructor_pb2.BatchHeader, bytes]:
    """One GetBatch as a client receives it: the header, then the chunks joined."""
    request = constructor_pb2.GetBatchRequest(rank=rank, step=step, wait_ms=2000, restart=restart, journal_cursor=cursor)
    items = list(servicer.GetBatch(request, Context()))
    first = items[0] if isinstance(items[0], constructor_pb2.GetBatchResponse) else constructor_pb2.GetBatchResponse.FromString(items[0])
    chunks = [constructor_pb2.GetBatchResponse.FromString(i).chunk.data for i in items[1:]]
    return first.header, b"".join(chunks)


def get(servicer, rank: int, step: int, *, restart: bool = False) -> tuple[constructor_pb2.BatchHeader, bytes]:
    """`fetch` without the header's journal cursor: what streaming delivery would send."""
    header, payload = fetch(servicer, rank, step, restart=restart)
    header.ClearField("journal_cursor")
    return header, payload


@pytest.fixture
def written():
    """A dp=2 x tp=2 journal of steps 0..5, then the end."""
    job = make_job(dp=2, tp=2)
    storage = MemoryStorage()
    pipeline = FakePipeline(job, end=6, extra=b"\x01\x02tail")
    produce(job, storage, pipeline)
    return job, storage, pipeline


def test_every_rank_gets_what_streaming_delivery_sends_then_the_end(written) -> None:
    job, storage, pipeline = written
    servicer = serve(job, storage, 0)
    for step in range(6):
        for rank in pipeline.ranks:
            header, payload = get(servicer, rank, step)
            assert (header.SerializeToString(), payload) == streamed(pipeline.delivery(rank, step), pipeline.mesh)
    header, payload = get(servicer, 0, 6)
    assert header == constructor_pb2.BatchHeader(step=6, rank=0, end_of_data=True) and payload == b""
    length = servicer.GetLength(constructor_pb2.GetLengthRequest(), Context()).length
    assert length == common_pb2.JobLength(num_steps=6)


def test_get_info_is_the_producers_with_this_jobs_mesh(written) -> None:
    job, storage, _ = written
    info = serve(job, storage, 0).GetInfo(constructor_pb2.GetInfoRequest(), Context())
    expected = info_of(job)
    assert info.job.job_id == expected.job_id and info.job.fingerprint == expected.fingerprint
    assert (info.job.mesh.dp, info.job.mesh.tp, info.job.mesh.order) == (2, 2, job.mesh.order)
    assert list(info.ranks) == list(job.pod_ranks(0))


def test_report_is_refused(written) -> None:
    job, storage, _ = written
    with pytest.raises(FailedPrecondition, match="no training reports"):
        serve(job, storage, 0).Report(common_pb2.ReportRequest(step=0), Context())


def test_a_step_moved_past_is_refused_unless_restarting(written) -> None:
    job, storage, pipeline = written
    servicer = serve(job, storage, 0)
    for step in range(3):
        for rank in pipeline.ranks:
            get(servicer, rank, step)
    with pytest.raises(FailedPrecondition, match="already consumed"):
        get(servicer, 0, 1)
    for rank in pipeline.ranks:  # the trainers restart at step 1: read again
        header, payload = get(servicer, rank, 1, restart=True)
        assert (header.SerializeToString(), payload) == streamed(pipeline.delivery(rank, 1), pipeline.mesh)


def test_a_rollback_after_the_end_reads_the_journal_again(written) -> None:
    # Regression: with every step taken, the buffer is empty but the reader is past the end;
    # a restart at an earlier step must move the reader back, not wait for a step never read again.
    job, storage, pipeline = written
    servicer = serve(job, storage, 0)
    for step in range(7):
        for rank in pipeline.ranks:
            get(servicer, rank, step)
    for step in range(2, 6):
        for rank in pipeline.ranks:
            header, payload = get(servicer, rank, step, restart=step == 2)
            assert (header.SerializeToString(), payload) == streamed(pipeline.delivery(rank, step), pipeline.mesh)


def test_dp_2_to_4_at_resume_reads_each_written_slice_once() -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    pipeline = FakePipeline(job, end=8)
    produce(job, storage, pipeline)
    wider = make_job(dp=4, ranks_per_constructor=2)  # two pods of two ranks
    by_payload = {bytes(pipeline.delivery(dp, s).batch.payload): (s, dp) for s in range(8) for dp in range(2)}
    seen = collections.Counter()
    headers: dict[int, list] = collections.defaultdict(list)
    for pod in (0, 1):
        servicer = serve(wider, storage, pod)
        for step in range(2, 5):  # resumed at step 2 (a checkpoint taken at dp=2)
            for rank in wider.pod_ranks(pod):
                header, payload = get(servicer, rank, step)
                assert (header.step, header.rank, header.dp_rank) == (step, rank, rank)
                seen[by_payload[payload]] += 1
                headers[step].append(header)
        assert get(servicer, wider.pod_ranks(pod)[0], 5)[0].end_of_data  # written steps 8, 9 do not exist
        assert servicer.GetLength(constructor_pb2.GetLengthRequest(), Context()).length.num_steps == 5
    assert seen == {(s, dp): 1 for s in range(2, 8) for dp in range(2)}
    for step, got in headers.items():  # logical step t = written steps 2t-2 and 2t-1, on both pods
        assert len(got) == 4
        loss = sum(mb.loss_tokens for h in got for mb in h.microbatches)
        assert loss == sum(loss_of(s, dp * 10) for s in (2 * step - 2, 2 * step - 1) for dp in range(2))
        assert {h.global_loss_tokens for h in got} == {loss}, "the logical step's loss tokens, not a written step's"
        assert sum(mb.loss_weight for h in got for mb in h.microbatches) == pytest.approx(1.0)


def test_each_header_carries_where_the_next_step_starts_in_the_journal(written) -> None:
    job, storage, pipeline = written
    servicer = serve(job, storage, 0)
    for step in range(6):
        for rank in pipeline.ranks:
            cursor = fetch(servicer, rank, step)[0].journal_cursor
            assert (cursor.step, cursor.offset) == (step + 1, 0) and cursor.manifest_version >= step + 1
    assert not fetch(servicer, 0, 6)[0].HasField("journal_cursor")  # the end of data


@pytest.mark.parametrize("meshes", [(2, 4, 2), (4, 2, 4), (2, 1, 2), (2, 4, 1)])
def test_resumes_across_dp_changes_carry_the_cursor_and_read_each_written_slice_once(meshes: tuple[int, ...]) -> None:
    """Each resume takes two logical steps (the checkpoint's cursor from the last header),
    the last one reads to the end: the written slices are read in order, each exactly once."""
    first = make_job(dp=meshes[0])
    storage = MemoryStorage()
    pipeline = FakePipeline(first, end=12)
    produce(first, storage, pipeline)
    by_payload = {bytes(pipeline.delivery(dp, s).batch.payload): (s, dp) for s in range(12) for dp in range(meshes[0])}
    seen: list[tuple[int, int]] = []
    step, cursor = 0, None
    for n, dp in enumerate(meshes):
        servicer = serve(make_job(dp=dp), storage, 0)  # one pod of every rank
        resumed, last = step, n == len(meshes) - 1
        while last or step < resumed + 2:
            answers = [
                fetch(servicer, rank, step, restart=step == resumed, cursor=cursor if step == resumed else None) for rank in range(dp)
            ]
            if answers[0][0].end_of_data:
                break
            assert [h.step for h, _ in answers] == [step] * dp
            seen += [by_payload[payload] for _, payload in answers]
            cursor = answers[0][0].journal_cursor
            assert {h.journal_cursor.SerializeToString() for h, _ in answers} == {cursor.SerializeToString()}
            step += 1
    assert servicer.GetLength(constructor_pb2.GetLengthRequest(), Context()).length.num_steps == step
    written = [(s, d) for s in range(12) for d in range(meshes[0])]
    assert seen == written[: len(seen)] and len(written) - len(seen) < meshes[-1]


def test_a_restart_cursor_outside_the_written_mesh_is_refused(written) -> None:
    job, storage, pipeline = written
    servicer = serve(job, storage, 0)
    get(servicer, 0, 0)
    with pytest.raises(InvalidArgument, match="offset"):
        fetch(servicer, 0, 1, restart=True, cursor=constructor_pb2.JournalCursor(step=1, offset=2))
    with pytest.raises(InvalidArgument, match="manifest_version"):
        fetch(servicer, 0, 1, restart=True, cursor=constructor_pb2.JournalCursor(manifest_version=-1, step=1))


def test_a_cp_change_is_refused_naming_both_meshes(written) -> None:
    _, storage, _ = written
    other = make_job(dp=2, cp=2)
    with pytest.raises(FailedPrecondition, match="dp=2 cp=1.*dp=2 cp=2"):
        get(serve(other, storage, 0), 0, 0)


def test_the_pod_records_its_mark_as_its_ranks_move_on() -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    produce(job, storage, FakePipeline(job, end=12))
    servicer = serve(job, storage, 0, mark_every=4)
    for step in range(10):
        for rank in (0, 1):
            get(servicer, rank, step)
    mark = ManifestStore(storage, check_writes=False).latest().mark("pod-0")
    assert mark is not None and 4 <= mark.step <= 9
