"""A constructor checks what loaders send against the plan's digests (issue 41, point 5): the
plan's digests decoded and bounded (`responses`), kept through the fetch list (`subbatch`),
each received sample digested and compared (`integrity.check_digests`), and a replica that
sends altered samples counted, logged and reported to the planner until a plan no longer names
it (`fetcher.Fetcher`). The loaders are stand-ins answering the real wire format; no sockets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry

from batchplane.constructor.bounds import MalformedResponse
from batchplane.constructor.fetcher import Fetcher, StepFetch
from batchplane.constructor.integrity import AlteredSamples, check_digests
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.responses import FETCH_SCHEMA, Wanted, fetch_schema, plan_buckets
from batchplane.constructor.subbatch import FetchGroup, fetch_list
from batchplane.core.config import job_from_mapping
from batchplane.core.digest import sample_digests
from batchplane.core.payload import PayloadColumn, normalize
from batchplane.v1 import common_pb2, loader_pb2, planner_pb2
from batchplane.wire import decode_array, encode_array, iter_chunks

JOB = job_from_mapping(
    {"job": "d", "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], "mesh": {"dp": 1}, "loaders": {"count": 2}}
)


def tokens(source: int, seq: int) -> list[int]:
    """What the loaders read at a position: a sample of 3..7 tokens."""
    return [1000 * source + seq + t for t in range(3 + (7 * source + seq) % 5)]


def digests(source: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """What the loaders summarize of those samples (`core.digest`)."""
    ids = pa.array([tokens(int(k), int(q)) for k, q in zip(source, seq)], pa.list_(pa.int32()))
    return sample_digests(ids, {}, ())


# ---- the plan's digests -----------------------------------------------------------------------


def rank_plan(n: int = 3, *, digest=None) -> planner_pb2.RankPlan:
    samples = common_pb2.SampleSet(
        source=encode_array(np.zeros(n, np.int32)),
        seq=encode_array(np.arange(n, dtype=np.int64)),
        row=encode_array(np.arange(n, dtype=np.int64)),
        epoch=encode_array(np.zeros(n, np.int32)),
        length=encode_array(np.full(n, 4, np.int32)),
        digest=None if digest is None else encode_array(np.asarray(digest)),
    )
    return planner_pb2.RankPlan(
        dp_rank=0,
        samples=samples,
        microbatch_offsets=encode_array(np.array([0, n], np.int64)),
        fetchers=1,
        loaders=encode_array(np.zeros(n, np.int32)),
    )


def buckets(plan: planner_pb2.RankPlan):
    return plan_buckets(
        planner_pb2.GetPlanResponse(step=5, ranks=[plan]), asked=5, address="planner:1", constructors=1, max_samples=8, microbatches=1
    )


def test_a_plans_digests_are_taken_and_a_plan_without_them_is_not_checked() -> None:
    assert buckets(rank_plan(digest=np.array([5, -6, 7], np.int64)))[0].digest.tolist() == [5, -6, 7]
    assert buckets(rank_plan())[0].digest is None


@pytest.mark.parametrize(
    ("digest", "problem"),
    [
        (np.array([1, 2, 3], np.float64), "samples.digest: dtype must be int64"),
        (np.array([1, 2, 3], np.int32), "samples.digest: dtype must be int64"),
        (np.ones((3, 1), np.int64), "samples.digest: must have 1 dimension"),
        (np.array([1, 2], np.int64), r"different lengths .*'samples.digest': 2"),
        (np.array([1, 2, 3, 4], np.int64), r"different lengths .*'samples.digest': 4"),
    ],
)
def test_digests_of_another_dtype_or_length_are_a_malformed_plan_naming_the_field(digest, problem) -> None:
    with pytest.raises(MalformedResponse, match=problem) as info:
        buckets(rank_plan(digest=digest))
    assert info.value.peer == "planner"


def test_a_sample_listed_twice_must_carry_one_digest_and_the_union_has_digests_only_if_every_list_does() -> None:
    def group(seqs, digest) -> FetchGroup:
        n = len(seqs)
        return FetchGroup(
            np.zeros(n, np.int32), np.array(seqs, np.int64), np.full(n, 4, np.int32), np.ones(n, np.int32), np.zeros(n, np.int32), digest
        )

    union = fetch_list([group([1, 2], np.array([11, 12])), group([2, 3], np.array([12, 13]))], address="planner:1")
    assert union.seq.tolist() == [1, 2, 3] and union.digest.tolist() == [11, 12, 13]
    with pytest.raises(MalformedResponse, match=r"\(source 0, seq 2\) is listed with different digests"):
        fetch_list([group([1, 2], np.array([11, 12])), group([2], np.array([99]))], address="planner:1")
    assert fetch_list([group([1], np.array([11])), group([2], None)], address="planner:1").digest is None


# ---- what arrives -------------------------------------------------------------------------------


def table(source, seq, *, altered: set[tuple[int, int]] = frozenset(), columns=None) -> pa.Table:
    ids = [[t + 1 for t in tokens(k, q)] if (k, q) in altered else tokens(k, q) for k, q in zip(source, seq)]
    arrays = [pa.array(source, pa.int32()), pa.array(seq, pa.int64()), pa.array(ids, pa.list_(pa.int32()))]
    names = ["source", "seq", "input_ids"]
    for name, array in (columns or {}).items():
        arrays.append(array)
        names.append(name)
    return pa.table(arrays, names=names)


def wanted(source, seq, *, checked: bool = True) -> Wanted:
    source, seq = np.array(source, np.int32), np.array(seq, np.int64)
    lengths = np.array([len(tokens(int(k), int(q))) for k, q in zip(source, seq)], np.int32)
    return Wanted(source, seq, lengths, digests(source, seq) if checked else None)


def test_samples_that_match_the_plans_digests_pass_in_any_row_order() -> None:
    check_digests(table([1, 0, 1], [4, 2, 3]), wanted([0, 1, 1], [2, 3, 4]), step=3, address="l:1", columns=())


def test_an_altered_sample_is_refused_naming_it_and_the_loader() -> None:
    with pytest.raises(AlteredSamples) as info:
        check_digests(table([1, 0, 1], [4, 2, 3], altered={(1, 3)}), wanted([0, 1, 1], [2, 3, 4]), step=3, address="l:1", columns=())
    exc = info.value
    assert (exc.address, exc.step, exc.sources.tolist(), exc.seqs.tolist()) == ("l:1", 3, [1], [3])
    assert "the loader at l:1 sent 1 sample(s) of step 3" in str(exc) and "source 1 position 3" in str(exc)
    # Without the plan's digests (a job with a loader hook) nothing is checked.
    check_digests(table([0], [2], altered={(0, 2)}), wanted([0], [2], checked=False), step=3, address="l:1", columns=())


def test_a_declared_column_counts_as_content() -> None:
    column = PayloadColumn("lang", "sample", "int16")
    honest = normalize(column, pa.array([1, 2], pa.int16()), np.array([3, 3]))
    source, seq = np.zeros(2, np.int32), np.array([0, 1], np.int64)
    ids = pa.array([tokens(0, 0), tokens(0, 1)], pa.list_(pa.int32()))
    want = Wanted(source, seq, np.array([3, 4], np.int32), sample_digests(ids, {"lang": honest}, (column,)))
    check_digests(table([0, 0], [0, 1], columns={"lang": honest}), want, step=0, address="l:1", columns=(column,))
    other = normalize(column, pa.array([1, 3], pa.int16()), np.array([3, 3]))
    with pytest.raises(AlteredSamples) as info:
        check_digests(table([0, 0], [0, 1], columns={"lang": other}), want, step=0, address="l:1", columns=(column,))
    assert info.value.seqs.tolist() == [1]
    assert fetch_schema((column,)).names == ["source", "seq", "input_ids", "lang"]


# ---- the fetcher ------------------------------------------------------------------------------------


class Loader:
    """Answers a FetchSamples call with the samples asked for; a rogue one adds 1 to every token
    of the samples at positions `alter`."""

    def __init__(self, alter: set[int] = frozenset()) -> None:
        self.alter = alter

    def FetchSamples(self, request, timeout):  # noqa: N802 - the stub's method name
        sources = decode_array(request.samples.source, field="source").astype(np.int32)
        seqs = decode_array(request.samples.seq, field="seq").astype(np.int64)
        got = table(sources.tolist(), seqs.tolist(), altered={(int(k), int(q)) for k, q in zip(sources, seqs) if int(q) in self.alter})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, FETCH_SCHEMA) as writer:
            writer.write_table(got.cast(FETCH_SCHEMA))
        data = sink.getvalue().to_pybytes()
        yield loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader(num_samples=got.num_rows, payload_bytes=len(data)))
        for piece in iter_chunks(data, 64):
            yield loader_pb2.FetchSamplesResponse(chunk=common_pb2.Chunk(data=piece))


def step(number: int, samples: list[tuple[int, int, int]], addresses: tuple[str, ...]) -> StepFetch:
    """A step's samples as (source, seq, holder), holders indexing `addresses`."""
    source = np.array([s for s, _, _ in samples], np.int32)
    seq = np.array([q for _, q, _ in samples], np.int64)
    lengths = np.array([len(tokens(s, q)) for s, q, _ in samples], np.int32)
    holders = np.array([h for _, _, h in samples], np.int32)
    group = FetchGroup(source, seq, lengths, np.ones(len(seq), np.int32), holders, digests(source, seq))
    return StepFetch(number, group, addresses)


def test_a_replica_that_sends_altered_samples_is_counted_and_reported_until_a_plan_no_longer_names_it() -> None:
    registry = CollectorRegistry()
    loaders = {"A": Loader(), "R": Loader(alter={5, 6}), "B": Loader()}
    f = Fetcher(
        JOB,
        index=0,
        metrics=ConstructorMetrics(registry),
        connect=lambda address, role: None,
        delivered=lambda: 0,
        stopped=lambda: False,
    )
    f._loader = lambda address: loaders[address]
    try:
        assert f.altered() == []
        assert sorted(f.fetch([step(0, [(0, 1, 0), (1, 2, 2)], ("A", "R", "B"))])[0].tokens) == [(0, 1), (1, 2)]
        with pytest.raises(AlteredSamples, match="the loader at R sent 2 sample"):
            f.fetch([step(1, [(0, 4, 1), (0, 5, 1), (0, 6, 1), (1, 3, 2)], ("A", "R", "B"))])
        count = registry.get_sample_value("batchplane_constructor_digest_mismatches_total", {"group": "0", "address": "R"})
        assert count == 2
        (report,) = f.altered()
        assert (report.loader_address, report.source, report.seq, report.step, report.count) == ("R", 0, 5, 1, 2)
        with pytest.raises(AlteredSamples):  # the planner did not fence it (a plan still names it): reported again
            f.fetch([step(1, [(0, 5, 1)], ("A", "R"))])
        assert [r.loader_address for r in f.altered()] == ["R"]
        assert registry.get_sample_value("batchplane_constructor_digest_mismatches_total", {"group": "0", "address": "R"}) == 3
        # The planner fenced it: the fresh plan names A for its samples, which match.
        got = f.fetch([step(1, [(0, 4, 0), (0, 5, 0), (0, 6, 0), (1, 3, 1)], ("A", "B"))])
        assert sorted(got[1].tokens) == [(0, 4), (0, 5), (0, 6), (1, 3)]
        assert all(got[1].tokens[(0, q)].tolist() == tokens(0, q) for q in (4, 5, 6))
        assert f.altered() == []
    finally:
        f.close()
