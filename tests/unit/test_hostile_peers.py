"""Hostile registrations, departures and loader answers against the planner's pure cores
(issue 15, point 3): `membership` (rows e and h of the attack table), the summary checks and
the summary puller's thread (row f), and the bounds of `planner.bounds`. No sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.routing import Routing
from batchplane.planner.bounds import MalformedSummary, check_summary, plan_lead, report_refusal
from batchplane.planner.membership import Membership, SourceFacts, SummaryTarget
from batchplane.planner.source_changes import SourceRecord
from batchplane.planner.summaries import SummaryPuller, SummaryStore, parse_summary
from batchplane.v1 import loader_pb2
from batchplane.wire import WireFormatError, encode_array

REAL = [SourceFacts("a", 40, (10, 10, 10, 10))]
FALSE = [SourceFacts("a", 41, (11, 10, 10, 10))]


def _membership(**loaders) -> Membership:
    return Membership(job_from_mapping({"job": "j", "sources": [{"name": "a", "path": "a"}], "loaders": loaders}))


# ---- e: a false RegisterLoader wins the race after a planner restart ---------------------------


def test_e_the_ledgers_facts_decide_not_the_first_registration() -> None:
    m = _membership()
    m.expect_sources({"a": SourceRecord(40, REAL[0].digest)})  # what the restarted planner's ledger records
    assert not m.register_loader(0, "evil:1", FALSE, incarnation="x").displaced  # wins the race
    joined = m.register_loader(0, "real:1", REAL, incarnation="r")  # the real loader's heartbeat
    assert joined.displaced and m.replicas(0) == {"0": "real:1"} and m.num_rows(0) == 40
    with pytest.raises(InvalidArgument, match="had 40 rows and now has 41"):
        m.register_loader(0, "evil:1", FALSE, incarnation="x")
    m.register_loader(0, "real:1", REAL, incarnation="r")  # heartbeats go on being taken


def test_e_once_the_job_started_its_facts_are_final() -> None:
    m = _membership()
    m.register_loader(0, "real:1", REAL)
    assert m.commit_sources() == {"a": SourceRecord(40, REAL[0].digest)}
    with pytest.raises(InvalidArgument, match="its files changed under a running job"):
        m.register_loader(0, "other:1", FALSE, replica="r2")


def test_e_without_a_ledger_a_fresh_job_takes_what_its_loaders_agree_on() -> None:
    m = _membership()
    m.expect_sources({"a": SourceRecord(40, REAL[0].digest)})
    m.register_loader(0, "real:1", FALSE)  # the files changed since the ledger's run: a fresh run may use them
    m.register_loader(0, "real:2", FALSE, replica="r2")
    assert m.num_rows(0) == 41 and len(m.replicas(0)) == 2


def test_e_a_registration_under_another_address_or_incarnation_never_locks_the_replica_out() -> None:
    m = _membership()
    m.register_loader(0, "evil:1", REAL, incarnation="x")  # a false process under the real replica id
    for _ in range(3):
        assert m.register_loader(0, "real:1", REAL, incarnation="r").restarted in (True, False)
        assert m.serving(0, "0") == "real:1"
        m.register_loader(0, "evil:1", REAL, incarnation="x")
    m.register_loader(0, "real:1", REAL, incarnation="r")
    assert m.serving(0, "0") == "real:1", "the real replica's heartbeat always takes its id back"


# ---- h: DeregisterLoader of a live replica -----------------------------------------------------------


def test_h_an_unknown_replica_is_refused_without_naming_the_others() -> None:
    m = _membership()
    m.register_loader(0, "a:1", REAL, replica="pod-secret-1")
    m.register_loader(0, "a:2", REAL, replica="pod-secret-2")
    with pytest.raises(InvalidArgument) as info:
        m.deregister_loader(0, "guess")
    assert "pod-secret" not in str(info.value)


def test_h_a_replica_made_to_leave_rejoins_once_restarted_and_its_windows_are_never_orphaned() -> None:
    m = _membership(shuffle={"enabled": False, "window_row_groups": 1})
    m.register_loader(0, "a:1", REAL, replica="r1", incarnation="1")
    m.register_loader(0, "a:2", REAL, replica="r2", incarnation="2")
    owners = [m.summary_target(0, seq).owner[1] for seq in (0, 10)]
    assert owners == ["r1", "r2"]
    m.deregister_loader(0, "r1")  # a false DeregisterLoader of a live replica
    with pytest.raises(FailedPrecondition, match="joins again once restarted"):
        m.register_loader(0, "a:1", REAL, replica="r1", incarnation="1")  # its own heartbeat: it is leaving
    assert ((0, "r1"), "a:1") in m.watched(), "a leaving replica is still watched"
    assert m.adopt(0, "r1") == "r2", "it failed while draining: a live replica adopts its windows"
    assert m.holders(0, [0])[0] == "a:2"
    m.register_loader(0, "a:1b", REAL, replica="r1", incarnation="1b")  # restarted: joins again
    assert m.holders(0, [0])[0] == "a:1b" and "r1" in m.replicas(0)


# ---- f: a malformed summary from a loader -----------------------------------------------------------


def _target(**fields) -> SummaryTarget:
    return SummaryTarget("loader:1", 40, Routing.of(["0"]), (0, "0"), **({"num_rows": 40, "stream_end": 40} | fields))


def _request(from_seq: int = 0, max_samples: int = 8) -> loader_pb2.GetSummaryRequest:
    return loader_pb2.GetSummaryRequest(source=0, from_seq=from_seq, max_samples=max_samples)


_NO_DIGEST = np.zeros(0, np.int64)


def _response(
    start: int = 0, n: int = 8, *, rows=None, lengths=None, end: bool = False, bad_reason=None, digest=_NO_DIGEST, **features
) -> loader_pb2.GetSummaryResponse:
    """A summary answer; `digest` default: one per row, nonzero exactly for lengths other than 0; None: none sent."""
    lengths = np.full(n, 5, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if digest is _NO_DIGEST:
        digest = np.where(lengths[:n] != 0, np.arange(1, len(lengths[:n]) + 1) * 7919, 0).astype(np.int64)
    return loader_pb2.GetSummaryResponse(
        start_seq=start,
        row=encode_array(np.arange(start, start + n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)),
        length=encode_array(lengths),
        end_of_stream=end,
        features={k: encode_array(np.asarray(v, np.float64)) for k, v in features.items()},
        bad_reason=None if bad_reason is None else encode_array(np.asarray(bad_reason)),
        digest=None if digest is None else encode_array(np.asarray(digest)),
    )


@pytest.mark.parametrize(
    ("response", "problem"),
    [
        (_response(start=3), "starts at position 3, asked from 0"),
        (_response(n=9, rows=range(9), lengths=[1] * 9), "9 samples, at most 8"),
        (_response(lengths=[1] * 7), "7 lengths for 8 rows"),
        (_response(rows=[0, 1, 2, 3, 4, 5, 6, 40]), "rows outside"),
        (_response(rows=[-1] * 8), "rows outside"),
        (_response(lengths=[-1] * 8), "negative lengths"),
        (_response(end=True), "says the stream ends at 8, but the stream ends at 40"),
        (_response(cost=[1.0] * 7), "7 values for 8 rows"),
        (_response(cost=[float("nan")] * 8), "not finite"),
        (_response(bad_reason=np.zeros(7, np.uint8)), "7 bad reasons for 8 rows"),
        (_response(bad_reason=np.zeros(9, np.uint8)), "9 bad reasons for 8 rows"),
        (_response(digest=None), "no digests for 8 rows"),
        (_response(digest=np.arange(1, 8, dtype=np.int64)), "7 digests for 8 rows"),
        (_response(digest=np.arange(1, 10, dtype=np.int64)), "9 digests for 8 rows"),
        (_response(digest=np.arange(8, dtype=np.int64)), "digests of 0 for good samples"),
        (_response(lengths=[5, 0, 5, 5, 5, 5, 5, 5], digest=np.arange(1, 9, dtype=np.int64)), "other than 0 for bad ones"),
    ],
)
def test_f_a_summary_that_is_not_what_was_asked_is_refused(response, problem) -> None:
    with pytest.raises(MalformedSummary, match=problem):
        parse_summary(response, _request(), _target())


def test_f_bytes_that_do_not_match_their_shape_are_refused_before_anything_is_allocated() -> None:
    response = _response()
    response.row.shape[:] = [2**40]
    with pytest.raises(WireFormatError):
        parse_summary(response, _request(), _target())


@pytest.mark.parametrize(
    "bad_reason", [np.zeros(8, np.int32), np.zeros(8, np.float64), np.zeros((2, 4), np.uint8)], ids=["int32", "float64", "2d"]
)
def test_f_bad_reasons_of_another_dtype_or_shape_are_refused(bad_reason) -> None:
    with pytest.raises(WireFormatError, match="bad_reason"):
        parse_summary(_response(bad_reason=bad_reason), _request(), _target())


@pytest.mark.parametrize(
    "digest",
    [np.arange(1, 9, dtype=np.float64), np.arange(1, 9, dtype=np.int32), np.ones((2, 4), np.int64)],
    ids=["float64", "int32", "2d"],
)
def test_f_digests_of_another_dtype_or_shape_are_refused_naming_the_field(digest) -> None:
    with pytest.raises((WireFormatError, MalformedSummary), match="digest"):
        parse_summary(_response(digest=digest), _request(), _target())


def test_f_digests_are_taken_as_sent_and_an_empty_answer_may_carry_none() -> None:
    sent = np.array([3, 0, -5, 2**62, 0, 1, 9, -(2**63)], np.int64)
    *_, digests = parse_summary(_response(lengths=[5, 0, 5, 5, 0, 5, 5, 5], digest=sent), _request(), _target())
    assert digests.tolist() == sent.tolist()
    rows, _, _, _, digests = parse_summary(_response(n=0, digest=None), _request(), _target())
    assert len(rows) == 0 and len(digests) == 0


def test_f_bad_reasons_are_taken_or_zero_when_not_sent() -> None:
    codes = np.array([0, 1, 2, 3, 4, 5, 0, 200], np.uint8)  # 200: a code of a later version, "unknown"
    _, _, _, reasons, _ = parse_summary(_response(lengths=[0, 0, 0, 0, 0, 0, 5, 0], bad_reason=codes), _request(), _target())
    assert reasons.tolist() == codes.tolist()
    for sent in (None, np.zeros(0, np.uint8)):  # an older loader
        _, _, _, reasons, _ = parse_summary(_response(bad_reason=sent), _request(), _target())
        assert reasons.dtype == np.uint8 and reasons.tolist() == [0] * 8


def test_f_an_end_of_stream_only_where_the_stream_ends() -> None:
    rows, _, _, _, _ = parse_summary(_response(start=32, end=True), _request(32), _target())
    assert len(rows) == 8
    with pytest.raises(MalformedSummary, match="never ends"):
        parse_summary(_response(end=True), _request(), _target(stream_end=None))


class _Channel:
    """A fake channel whose GetSummary answers from a list of responses (then good ones)."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.calls = 0

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **_):
        def call(request, timeout=None):
            self.calls += 1
            if self.answers:
                return self.answers.pop(0)
            n = min(request.max_samples, 40 - request.from_seq)
            return _response(start=request.from_seq, n=n, end=request.from_seq + n == 40)

        return call

    def unary_stream(self, *args, **kwargs):
        return None  # FetchSamples: not called here

    def close(self) -> None:
        pass


def test_f_a_malformed_summary_is_an_error_for_that_call_never_a_dead_thread() -> None:
    store = SummaryStore(1, lookahead=40)
    channel = _Channel([_response(start=5), _response(lengths=[1] * 3), _response(n=0, end=True)])
    observed = []
    puller = SummaryPuller(
        store,
        num_sources=1,
        target=lambda k, seq: _target(),
        connect=lambda address: channel,
        observe=lambda owner, address, ok, **kw: observed.append((ok, kw.get("malformed", False))),
    )
    try:
        store.start((0,))
        deadline = time.monotonic() + 10
        while store.get(0, 0, 40) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.get(0, 0, 40) is not None, "the pulling thread went on after the malformed answers"
        assert observed[:3] == [(False, True)] * 3 and (True, False) in observed
    finally:
        puller.stop()


def test_f_the_watch_counts_malformed_answers_and_replaces_a_replica_that_keeps_sending_them() -> None:
    from batchplane.core.config import FailoverSettings
    from batchplane.planner.metrics import PlannerMetrics
    from batchplane.planner.watch import ReplicaWatch

    m = _membership()
    m.register_loader(0, "bad:1", REAL, replica="r1")
    m.register_loader(0, "good:1", REAL, replica="r2")
    metrics = PlannerMetrics(CollectorRegistry(), source_names=["a"], target_weights=[1.0])
    watch = ReplicaWatch(m, FailoverSettings(probe_interval_s=3600, failures=3), metrics, connect=lambda address: None)
    try:
        for _ in range(3):
            watch.observe((0, "r1"), "bad:1", False, malformed=True)
        assert metrics.malformed_responses.labels("0")._value.get() == 3
        assert m.failed(0, "r1") and m.serving(0, "r1") == "good:1"
    finally:
        watch.stop()


# ---- bounds ---------------------------------------------------------------------------------------------


def test_the_window_follows_the_constructors_prefetch_and_fetch_steps() -> None:
    assert plan_lead(2) == 4 and plan_lead(0) == 2
    assert plan_lead(2, 4) == 10  # the 3 steps after a request's, and the 4 after them


def test_report_refusals_say_why() -> None:
    assert report_refusal(5, start=0, applied_through=2, handed_below=8) is None
    assert "not planned yet" in report_refusal(8, start=0, applied_through=2, handed_below=8).reason
    past = report_refusal(2, start=0, applied_through=2, handed_below=8)
    assert past.applied and "past" in past.reason
    assert "before step 3" in report_refusal(1, start=3, applied_through=-1, handed_below=8).reason


def test_check_summary_takes_what_was_asked() -> None:
    rows = np.arange(4, dtype=np.int64)
    asked = {"start_seq": 0, "end_of_stream": False, "from_seq": 0, "max_samples": 4, "num_rows": 4, "stream_end": None}
    digests = np.zeros(4, np.int64)  # bad samples (length 0) have none
    check_summary(rows, np.zeros(4, np.int32), {}, **asked, digests=digests)
    check_summary(rows[:0], np.zeros(0, np.int32), {}, start_seq=8, end_of_stream=True, from_seq=8, max_samples=4, num_rows=4, stream_end=8)
    check_summary(rows, np.zeros(4, np.int32), {}, **asked, reasons=np.ones(4, np.uint8), digests=digests)
    for reasons, problem in (
        (np.ones(3, np.uint8), "3 bad reasons for 4 rows"),
        (np.ones(4, np.int32), "dtype int32"),
        (np.ones((4, 1), np.uint8), r"shape \(4, 1\)"),
    ):
        with pytest.raises(MalformedSummary, match=problem):
            check_summary(rows, np.zeros(4, np.int32), {}, **asked, reasons=reasons)
