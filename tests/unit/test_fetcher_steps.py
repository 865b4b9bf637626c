"""A constructor's fetch of several steps at once (`constructor.fetcher.Fetcher.fetch`,
`constructors.fetch_steps`): one call per loader, each leading with the step being built, and a
following step returned only when every loader holding its samples served it. The loaders are
stand-ins answering the real wire format (Arrow IPC in chunks); no sockets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from prometheus_client import CollectorRegistry

from batchplane.constructor.fetcher import Fetcher, StepFetch
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.responses import FETCH_SCHEMA
from batchplane.constructor.subbatch import FetchGroup
from batchplane.core.config import job_from_mapping
from batchplane.v1 import common_pb2, loader_pb2
from batchplane.wire import decode_array, iter_chunks

JOB = job_from_mapping({"job": "f", "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], "mesh": {"dp": 1}})


def length(source: int, seq: int) -> int:
    return 3 + (7 * source + seq) % 5


class Loader:
    """Answers a FetchSamples call with the samples asked for, one record batch per step, the
    first `serve` following steps at most (None: all)."""

    def __init__(self, serve: int | None = None) -> None:
        self.serve = serve
        self.requests: list[loader_pb2.FetchSamplesRequest] = []

    def FetchSamples(self, request, timeout):  # noqa: N802 - the stub's method name
        self.requests.append(request)
        steps = [request, *request.following][: None if self.serve is None else 1 + self.serve]
        batches = []
        for step in steps:
            sources = decode_array(step.samples.source, field="source").astype(np.int32)
            seqs = decode_array(step.samples.seq, field="seq").astype(np.int64)
            ids = [list(range(length(int(k), int(q)))) for k, q in zip(sources, seqs)]
            batches.append(pa.record_batch([pa.array(sources), pa.array(seqs), pa.array(ids, pa.list_(pa.int32()))], schema=FETCH_SCHEMA))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, FETCH_SCHEMA) as writer:
            for batch in batches:
                writer.write_batch(batch)
        data = sink.getvalue().to_pybytes()
        header = loader_pb2.FetchHeader(
            num_samples=sum(b.num_rows for b in batches), payload_bytes=len(data), following_served=len(batches) - 1
        )
        yield loader_pb2.FetchSamplesResponse(header=header)
        for piece in iter_chunks(data, 64):
            yield loader_pb2.FetchSamplesResponse(chunk=common_pb2.Chunk(data=piece))


def step(number: int, samples: list[tuple[int, int, int]]) -> StepFetch:
    """A step's samples as (source, seq, holder), holders indexing ("A", "B")."""
    source = np.array([s for s, _, _ in samples], np.int32)
    seq = np.array([q for _, q, _ in samples], np.int64)
    lengths = np.array([length(s, q) for s, q, _ in samples], np.int32)
    holders = np.array([h for _, _, h in samples], np.int32)
    return StepFetch(number, FetchGroup(source, seq, lengths, np.ones(len(seq), np.int32), holders), ("A", "B"))


def fetcher(loaders: dict[str, Loader]) -> Fetcher:
    f = Fetcher(
        JOB,
        index=0,
        metrics=ConstructorMetrics(CollectorRegistry()),
        connect=lambda address, role: None,
        delivered=lambda: 0,
        stopped=lambda: False,
    )
    f._loader = lambda address: loaders[address]
    return f


# A holds steps 10 and 11 of source 0; B holds steps 11 and 12 of source 1, none of step 10.
STEPS = [
    step(10, [(0, 1, 0), (0, 2, 0)]),
    step(11, [(0, 3, 0), (1, 1, 1), (1, 2, 1)]),
    step(12, [(1, 3, 1)]),
]


def test_one_call_per_loader_leads_with_the_step_built_and_returns_every_step_served() -> None:
    loaders = {"A": Loader(), "B": Loader()}
    f = fetcher(loaders)
    try:
        got = f.fetch(STEPS)
        a, b = loaders["A"].requests, loaders["B"].requests
        assert len(a) == len(b) == 1
        assert a[0].step == 10 and [s.step for s in a[0].following] == [11]
        assert b[0].step == 10 and not b[0].samples.seq.data, "B holds none of step 10: the call leads with it empty"
        assert [s.step for s in b[0].following] == [11, 12]
        assert sorted(got) == [10, 11, 12]
        assert sorted(got[11].tokens) == [(0, 3), (1, 1), (1, 2)] and sorted(got[12].tokens) == [(1, 3)]
        assert all(
            len(got[s.step].tokens[(int(k), int(q))]) == length(int(k), int(q)) for s in STEPS for k, q in zip(s.group.source, s.group.seq)
        )
        assert f._releases._holding == {"A": 11, "B": 12}, "each loader is held through the furthest step fetched there"
    finally:
        f.close()


def test_a_step_some_loader_did_not_serve_is_not_returned() -> None:
    """B served a prefix (steps 10 and 11): step 12 is fetched again later. A served only step
    10: step 11, half served, is not returned either."""
    loaders = {"A": Loader(serve=0), "B": Loader(serve=1)}
    f = fetcher(loaders)
    try:
        assert sorted(f.fetch(STEPS)) == [10]
        loaders["A"].serve, loaders["B"].serve = None, 0
        assert sorted(f.fetch(STEPS[1:])) == [11], "the next call: 11 from both, B leaving 12 out"
    finally:
        f.close()


def test_one_step_is_one_call_per_loader_holding_its_samples() -> None:
    loaders = {"A": Loader(), "B": Loader()}
    f = fetcher(loaders)
    try:
        got = f.fetch(STEPS[:1])
        assert sorted(got) == [10] and len(loaders["A"].requests) == 1 and not loaders["B"].requests
        assert not loaders["A"].requests[0].following
    finally:
        f.close()
