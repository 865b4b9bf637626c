"""Journal delivery's producer side (batchplane.constructor.produce, journal_slices): slices
round-trip to the header and payload streaming delivery sends, hostile slices are refused with
the field named, the producer commits every step, stores info.pb once, writes the end marker,
resumes after its last committed step asking with restart=True, and counts what it wrote."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from batchplane.constructor.assemble import BuiltBatch, MicrobatchLayout, TensorLayout
from batchplane.constructor.journal_slices import CorruptSlice, decode_slice, encode_step, slice_names
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.build import Delivery
from batchplane.constructor.progress import BuildProgress
from batchplane.constructor.produce import INFO_KEY, JournalProducer, load_info, store_info
from batchplane.constructor.service import batch_header
from batchplane.core.config import job_from_mapping
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.storage import MemoryStorage
from batchplane.journal.reader import JournalReader
from batchplane.journal.slices import DataMesh
from batchplane.journal.writer import read_end
from batchplane.v1 import common_pb2


def make_job(*, dp: int = 2, cp: int = 1, tp: int = 1, pp: int = 1, ranks_per_constructor: int | None = None, **journal):
    world = dp * cp * tp * pp
    return job_from_mapping(
        {
            "job": "journal",
            "sources": [{"name": "a", "path": "a"}],
            "mesh": {"dp": dp, "cp": cp, "tp": tp, "pp": pp},
            "batch": {"global_batch_size": 8, "microbatches": 1, "delivery": "journal"},
            "loaders": {"count": 1},
            "constructors": {"ranks_per_constructor": ranks_per_constructor or world},
            "journal": {"policy": "naive", "max_lag_steps": 64, "prefetch_steps": 2, **journal},
        }
    )


def mesh_of(job) -> ClientPlaceTree:
    m = job.mesh
    return ClientPlaceTree(pp=m.pp, dp=m.dp, cp=m.cp, tp=m.tp, order=m.order)


def loss_of(step: int, bucket: int) -> int:
    """The loss tokens of a test batch: they differ between steps and buckets."""
    return 1 + (step * 7 + bucket) % 11


def built(step: int, bucket: int, *, tensors: bool = True, extra: bytes = b"", total: int | None = None) -> BuiltBatch:
    """A rank batch whose bytes say its step and bucket (`tensors` False: a TP peer's empty batch),
    of `loss_of` loss tokens in a step of `total` (default: its own), weighed as a constructor does."""
    if not tensors:
        return BuiltBatch(step, 0, (MicrobatchLayout((), 0, 0, False),), bytearray(), 0)
    ids = (np.arange(12, dtype=np.int64) + step * 100_000 + bucket * 100).reshape(2, 6)
    layout = TensorLayout("input_ids", "int64", (2, 6), 0)
    loss = loss_of(step, bucket)
    total = loss if total is None else total
    return BuiltBatch(step, 0, (MicrobatchLayout((layout,), 12, loss, False, loss / total),), bytearray(ids.tobytes()), total)


class FakePipeline:
    """What a StepPipeline over every rank hands out: TP peers share one built batch (I3);
    `broadcast` TP: tp > 0 ranks get no tensors. Ends at `end` (None: never). Its planner says
    the job has `end` steps (None: infinite), after answering (or raising) `lengths` in order."""

    def __init__(self, job, *, end: int | None = None, broadcast: bool = False, extra: bytes = b"") -> None:
        self.mesh = mesh_of(job)
        self.ranks = tuple(range(self.mesh.world))
        self.end = end
        self.extra = extra
        self.rules = DeliveryRules(self.mesh, broadcast=frozenset({"TP"}) if broadcast else frozenset())
        self.asks: list[tuple[int, int, bool]] = []
        self.unavailable = 0  # raise Unavailable this many times first
        self.lengths: list[common_pb2.JobLength | Exception] = []
        self._cache: dict[tuple[int, object], BuiltBatch] = {}

    def delivery(self, rank: int, step: int) -> Delivery:
        variant = self.rules.variant(rank)
        key = (step, variant)
        if key not in self._cache:
            sizes = self.mesh.sizes
            total = sum(loss_of(step, dp * 10 + cp) for dp in range(sizes["dp"]) for cp in range(sizes["cp"]))
            self._cache[key] = built(step, variant.bucket * 10 + (variant.cp_rank or 0), tensors=variant.tensors, total=total)
        return Delivery(self._cache[key], rank, variant, extra=self.extra if variant.tensors else b"")

    def job_length(self, *, wait_ms: int) -> common_pb2.JobLength:
        if self.lengths:
            answer = self.lengths.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return common_pb2.JobLength(infinite=True) if self.end is None else common_pb2.JobLength(num_steps=self.end)

    def batch(self, rank: int, step: int, *, timeout_s: float, resume=None, restart: bool = False) -> Delivery | None:
        if self.unavailable:
            self.unavailable -= 1
            raise Unavailable("not yet")
        self.asks.append((rank, step, restart))
        if self.end is not None and step >= self.end:
            return None
        return self.delivery(rank, step)


def info_of(job) -> common_pb2.JobInfo:
    return common_pb2.JobInfo(
        job_id=job.job, fingerprint=job.fingerprint, sources=["a"], mesh=common_pb2.Mesh(dp=job.mesh.dp, cp=job.mesh.cp)
    )


def produce(job, storage, pipeline) -> JournalProducer:
    producer = JournalProducer(job, pipeline=pipeline, storage=storage, info=info_of(job), metrics=ConstructorMetrics(CollectorRegistry()))
    producer.run()
    return producer


def streamed(delivery: Delivery, mesh: ClientPlaceTree) -> tuple[bytes, bytes]:
    """What streaming delivery sends for `delivery`: its header and payload bytes."""
    return batch_header(delivery, mesh).SerializeToString(), bytes(delivery.batch.payload) + bytes(delivery.extra)


# ---- journal_slices ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dp", "cp", "tp", "pp", "broadcast"), [(2, 1, 1, 1, False), (1, 2, 2, 2, False), (2, 1, 2, 1, True), (1, 1, 3, 2, True)]
)
def test_every_rank_decodes_what_streaming_delivery_sends(dp: int, cp: int, tp: int, pp: int, broadcast: bool) -> None:
    job = make_job(dp=dp, cp=cp, tp=tp, pp=pp)
    pipeline = FakePipeline(job, broadcast=broadcast, extra=b"\x07extra")
    mesh = pipeline.mesh
    deliveries = {r: pipeline.delivery(r, 5) for r in pipeline.ranks}
    slices = encode_step(deliveries, mesh)
    assert set(slices) == {(d, c) for d in range(dp) for c in range(cp)}
    for rank in pipeline.ranks:
        c = mesh.coords(rank)
        header, payload = decode_slice(slices[(c.dp, c.cp)], rank=rank, step=5, mesh=mesh)
        assert (header.SerializeToString(), bytes(payload)) == streamed(deliveries[rank], mesh)
    # TP peers that get the same bytes are stored once; only a broadcast stores the peers' variant
    peers = [n for s in slices.values() for n in s if ".peer." in n]
    assert bool(peers) == (broadcast and tp > 1)


def test_a_slice_read_at_another_logical_step_and_rank_carries_them() -> None:
    job = make_job(dp=2)
    pipeline = FakePipeline(job)
    slices = encode_step({r: pipeline.delivery(r, 3) for r in pipeline.ranks}, pipeline.mesh)
    reader_mesh = ClientPlaceTree(dp=4)
    header, payload = decode_slice(slices[(1, 0)], rank=3, step=1, mesh=reader_mesh)
    assert (header.step, header.rank, header.dp_rank) == (1, 3, 3)
    assert bytes(payload) == bytes(pipeline.delivery(1, 3).batch.payload)


def test_encode_needs_every_rank() -> None:
    pipeline = FakePipeline(make_job(dp=2))
    with pytest.raises(InvalidArgument, match="ranks \\[1\\]"):
        encode_step({0: pipeline.delivery(0, 0)}, pipeline.mesh)


def _good_slice() -> tuple[dict[str, np.ndarray], ClientPlaceTree]:
    pipeline = FakePipeline(make_job(dp=1))
    return encode_step({0: pipeline.delivery(0, 0)}, pipeline.mesh)[(0, 0)], pipeline.mesh


def _header_with(**fields) -> np.ndarray:
    arrays, mesh = _good_slice()
    from batchplane.v1 import constructor_pb2

    header = constructor_pb2.BatchHeader.FromString(arrays["pp0.header"].tobytes())
    for name, value in fields.items():
        if name == "tensor_offset":
            header.microbatches[0].tensors[0].offset = value
        elif name == "tensor_dtype":
            header.microbatches[0].tensors[0].dtype = value
        else:
            setattr(header, name, value)
    return np.frombuffer(header.SerializeToString(), np.uint8)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda a: a.update({"pp0.header": np.frombuffer(b"\xff\xff\xff", np.uint8)}), "pp0.header"),
        (lambda a: a.update({"pp0.payload": a["pp0.payload"][:-1]}), "pp0.payload"),
        (lambda a: a.update({"pp0.payload": a["pp0.payload"].view(np.int8)}), "pp0.payload"),
        (lambda a: a.update({"pp0.header": _header_with(end_of_data=True)}), "pp0.header"),
        (lambda a: a.update({"pp0.header": _header_with(tensor_offset=8)}), "pp0.header"),
        (lambda a: a.update({"pp0.header": _header_with(tensor_dtype="no-such-dtype")}), "pp0.header"),
        (lambda a: a.update({"evil": np.zeros(1, np.uint8)}), "evil"),
        (lambda a: a.pop("pp0.payload"), "pp0.header"),
        (lambda a: a.update({"pp2.header": a["pp0.header"], "pp2.payload": a["pp0.payload"]}), "pp<k>"),
    ],
)
def test_hostile_slices_are_refused_naming_the_field(change, field: str) -> None:
    arrays, mesh = _good_slice()
    arrays = dict(arrays)
    change(arrays)
    with pytest.raises(CorruptSlice) as caught:
        decode_slice(arrays, rank=0, step=0, mesh=mesh)
    assert caught.value.field == field


def test_a_slice_of_another_pipeline_depth_is_refused() -> None:
    arrays, _ = _good_slice()
    with pytest.raises(FailedPrecondition, match="1 pipeline stages.*pp=2"):
        decode_slice(arrays, rank=0, step=0, mesh=ClientPlaceTree(pp=2))
    assert slice_names(1, peer=True) == ("pp1.peer.header", "pp1.peer.payload")


# ---- the producer --------------------------------------------------------------------------


def test_the_producer_commits_every_step_then_the_end_marker() -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    pipeline = FakePipeline(job, end=5)
    producer = produce(job, storage, pipeline)
    assert producer.end_step == 5 and producer.done.is_set()
    assert read_end(storage) == 5
    assert load_info(storage) == info_of(job)
    # every rank took every step; the first step (and only it) asked with restart=True
    assert sorted((r, s) for r, s, _ in pipeline.asks) == sorted((r, s) for r in (0, 1) for s in range(6))
    assert {s for _, s, restart in pipeline.asks if restart} == {0}
    with JournalReader(storage, mesh=DataMesh(dp=2), coords=[(0, 0), (1, 0)], depth=0) as reader:
        for step in range(5):
            got = reader.next(timeout_s=1)
            for dp in (0, 1):
                header, payload = decode_slice(got.batches[(dp, 0)], rank=dp, step=step, mesh=pipeline.mesh)
                assert (header.SerializeToString(), bytes(payload)) == streamed(pipeline.delivery(dp, step), pipeline.mesh)


def test_the_producer_counts_what_it_wrote() -> None:
    job = make_job(dp=2)
    registry = CollectorRegistry()
    producer = JournalProducer(
        job, pipeline=FakePipeline(job, end=3), storage=MemoryStorage(), info=info_of(job), metrics=ConstructorMetrics(registry)
    )
    producer.run()
    assert registry.get_sample_value("batchplane_constructor_journal_steps_written_total") == 3
    assert registry.get_sample_value("batchplane_constructor_journal_commits_total") >= 1
    assert registry.get_sample_value("batchplane_constructor_journal_written_bytes_total") > 0


def test_a_restarted_producer_resumes_after_its_last_committed_step_with_restart() -> None:
    job = make_job(dp=2)
    storage = MemoryStorage()
    produce(job, storage, FakePipeline(job, end=3))  # steps 0..2 committed, then "the end"
    storage.delete("end/p0.json")  # as if killed before the marker: the data goes on
    again = FakePipeline(job, end=6)
    again.unavailable = 2  # the planner is restarting: the producer asks again
    producer = produce(job, storage, again)
    assert producer.end_step == 6
    first = [(s, restart) for _, s, restart in again.asks[:2]]
    assert first == [(3, True), (3, True)]
    assert min(s for _, s, _ in again.asks) == 3  # nothing committed is built again
    with JournalReader(storage, mesh=DataMesh(dp=2), coords=[(0, 0)], depth=0) as reader:
        assert [reader.next(timeout_s=1).step for _ in range(6)] == list(range(6))


class ProgressPipeline(FakePipeline):
    """A pipeline whose batches are ready when the constructor's own build rules
    (`BuildProgress`) have built them: it builds at once whatever they allow, and a batch not
    built is Unavailable, as a real pipeline says once `timeout_s` passed."""

    def __init__(self, job, *, end: int, resume_step: int, prefetch_steps: int = 2) -> None:
        super().__init__(job, end=end)
        self.progress = BuildProgress(self.ranks, prefetch_steps=prefetch_steps, resume_step=resume_step)

    def batch(self, rank: int, step: int, *, timeout_s: float, resume=None, restart: bool = False) -> Delivery | None:
        self.progress.ask(rank, step, restart=restart)
        while (todo := self.progress.to_build()) is not None:
            self.progress.planned(0)
            if todo >= self.end:
                self.progress.ended(todo, epoch=self.progress.epoch)
            else:
                self.progress.built(todo, self.ranks, epoch=self.progress.epoch)
        if not (self.progress.is_ready(rank, step) or self.progress.past_end(step)):
            raise Unavailable(f"step {step} of rank {rank} is not built")
        return super().batch(rank, step, timeout_s=timeout_s, resume=resume, restart=restart)


@pytest.mark.parametrize("behind", [0, 2, 3, 9])
def test_a_producer_restarted_far_past_the_pipelines_start_asks_every_rank_before_waiting(behind: int) -> None:
    """A restarted producer's pipeline starts at the oldest step the planner says its ranks may
    still ask for, which can lie more than the prefetch depth (2) behind the journal's next
    step; it builds only so far ahead of its slowest rank, and a rank that has not asked counts
    as being at the start. A producer that waited on rank 0 before rank 1 asked never got its
    batch (the journal chaos test hung at the step after a kill)."""
    job = make_job(dp=2)
    storage = MemoryStorage()
    first = FakePipeline(job, end=12)
    first.lengths = [common_pb2.JobLength(num_steps=16)]
    produce(job, storage, first)
    storage.delete("end/p0.json")  # killed before the end marker: the data goes on
    pipeline = ProgressPipeline(job, end=16, resume_step=12 - behind)
    producer = JournalProducer(job, pipeline=pipeline, storage=storage, info=info_of(job), metrics=ConstructorMetrics(CollectorRegistry()))
    producer.start()
    producer.done.wait(10)
    producer.stop()
    assert producer.end_step == 16, f"stuck at step {max(s for _, s, _ in pipeline.asks)}: rank 0 waits on a step never built"
    with JournalReader(storage, mesh=DataMesh(dp=2), coords=[(0, 0)], depth=0) as reader:
        assert [reader.next(timeout_s=1).step for _ in range(16)] == list(range(16))


def test_a_journal_of_another_job_info_is_refused() -> None:
    storage = MemoryStorage()
    job = make_job(dp=2)
    store_info(storage, info_of(job))
    store_info(storage, info_of(job))  # the same again: fine
    other = info_of(job)
    other.job_id = "other"
    with pytest.raises(FailedPrecondition, match="other"):
        store_info(storage, other)
    assert storage.list(INFO_KEY) == [INFO_KEY]


def test_stop_ends_a_producer_waiting_for_batches() -> None:
    job = make_job(dp=2)
    pipeline = FakePipeline(job)
    pipeline.unavailable = 10**9
    producer = JournalProducer(
        job, pipeline=pipeline, storage=MemoryStorage(), info=info_of(job), metrics=ConstructorMetrics(CollectorRegistry())
    )
    producer.start()
    threading.Event().wait(0.05)
    producer.stop()
    assert producer.done.is_set() and producer.end_step is None


def test_a_producer_of_another_mesh_than_the_journals_stops_instead_of_retrying() -> None:
    """Trainers resumed at DP 4 over a journal written at DP 2 read it remapped; a producer of
    the new mesh cannot append to it (its header fixes the mesh), so it says so once and
    produces nothing rather than retrying forever."""
    storage = MemoryStorage()
    produce(make_job(dp=2), storage, FakePipeline(make_job(dp=2), end=2))
    wider = make_job(dp=4)
    pipeline = FakePipeline(wider, end=4)
    producer = produce(wider, storage, pipeline)  # returns: no retry loop
    assert producer.done.is_set() and producer.end_step is None
    assert pipeline.asks == [], "nothing was built for the journal it cannot write"
