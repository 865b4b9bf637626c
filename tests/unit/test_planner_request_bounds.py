"""Well-formed but hostile requests to the planner (issue 15, point 3), replayed against the
real servicer, plan book and membership with a fake loader filling the summary store: no sockets.
Each test is one row of the issue's attack table: refused, and nothing lost, repeated or
stalled (every sample is still planned exactly once, and the job ends where it should)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import InvalidArgument, NotFound, Unavailable
from batchplane.core.storage import MemoryStorage
from batchplane.planner.bounds import MAX_ADDRESS_CHARS, MAX_NAME_CHARS, plan_lead
from batchplane.v1 import common_pb2, planner_pb2

import planner_plane

ROWS = 192  # one source, 192 rows in 4 row groups: 48 steps of 4 samples (more than the window)
GROUPS = (48, 48, 48, 48)
STEPS = ROWS // 4
RULE = {"initial": {"a": 1}, "delay_steps": 2}
LEAD = plan_lead(2, 8)  # the window of the default constructors.prefetch_steps and fetch_steps, one step per GetBatch call


def _job(**settings):
    return job_from_mapping(
        {
            "job": "hostile",
            "sources": [{"name": "a", "path": "a"}],
            "mesh": {"dp": 2},
            "batch": {"global_batch_size": 4, "microbatches": 1},
            "constructors": {"batch_steps": 1},
            **settings,
        }
    )


class Plane(planner_plane.Plane):
    """The planner of `_job`'s shape: one source of ROWS rows, every sample 8 tokens."""

    def __init__(self, job, *, ledger: MemoryStorage | None = None) -> None:
        super().__init__(job, row_groups=[GROUPS], ledger=ledger)

    def run(self, first: int = 0) -> dict[int, list[tuple[int, int]]]:
        """Per step, the (source, seq) of its samples over both ranks (see `planner_plane.Plane.run`)."""
        return {step: planner_plane.step_samples(answers) for step, answers in super().run(first).items()}


def _assert_exactly_once(steps: dict[int, list[tuple[int, int]]], *, first: int = 0) -> None:
    assert sorted(steps) == list(range(first, STEPS)), "every step, in order, none skipped"
    seen = [pair for step in sorted(steps) for pair in steps[step]]
    assert sorted(seen) == [(0, s) for s in range(first * 4, ROWS)], "every sample once"


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane(_job())
    p.join()
    yield p
    p.stop()


def _threaded(fn, *, timeout_s: float):
    """Runs `fn` in a thread; returns (finished, outcome) after at most `timeout_s`."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), outcome[0] if outcome else None


# ---- a: GetPlan{step: 1e9, delivered_below: 1e9} per constructor --------------------------------


def test_a_far_step_with_a_far_delivered_below_is_refused_and_ends_nothing(plane: Plane) -> None:
    first = {step: [pair for c in (0, 1) for r in plane.plan(c, step).ranks for pair in planner_plane.samples(r)] for step in range(3)}
    for c in (0, 1):
        with pytest.raises(Unavailable, match="ahead of the planning window"):
            plane.plan(c, 10**9, delivered_below=10**9, wait_ms=50)
    assert not plane.book.finished and plane.book.end_step is None, "nothing was planned for the far step"
    # A request told to wait counts its claim of delivery once, believed up to the served
    # frontier (the 3 steps asked for), however far the planning thread had run ahead; the
    # window then reaches the lead past it, and the planner plans up to one step past the window.
    assert plane.book.steps_planned <= 3 + LEAD + 2 < STEPS
    rest = plane.run(first=3)
    _assert_exactly_once(first | rest)
    assert plane.book.finished


# ---- b: RegisterConstructor{rejoin, next_step: 1e9} ---------------------------------------------


def test_b_a_rejoin_far_ahead_drops_no_kept_plan(plane: Plane) -> None:
    """As constructor 1 (authorized as itself, so authorization alone does not stop it): its
    heartbeat claims every step below 1e9 was handed. Believed up to the served frontier only:
    constructor 0's plans stay kept, and a restarted constructor 1 resumes at a planned step."""
    got = {step: [pair for c in (0, 1) for r in plane.plan(c, step).ranks for pair in planner_plane.samples(r)] for step in range(3)}
    plane.service.RegisterConstructor(
        planner_pb2.RegisterConstructorRequest(constructor_index=1, address="c:1", ranks=[1], rejoin=True, next_step=10**9), None
    )
    assert not plane.book.finished
    restarted = plane.service.RegisterConstructor(
        planner_pb2.RegisterConstructorRequest(constructor_index=1, address="c:1", ranks=[1]), None
    )
    assert restarted.resume_step <= plane.book.steps_planned, "a restarted constructor builds again from a planned step, not from 1e9"
    got |= plane.run(first=3)
    _assert_exactly_once(got)
    with pytest.raises(InvalidArgument, match="next_step must be >= 0"):
        plane.service.RegisterConstructor(
            planner_pb2.RegisterConstructorRequest(constructor_index=0, address="c:0", ranks=[0], rejoin=True, next_step=-1), None
        )


# ---- c: the first GetPlan of a fresh job asks for step 100; step 1e15 on an infinite job -------


def test_c_the_first_request_does_not_choose_the_start_of_a_fresh_job(plane: Plane) -> None:
    with pytest.raises(Unavailable, match="ahead of the planning window"):
        plane.plan(0, 100, wait_ms=50)
    assert plane.book.start_step == 0
    _assert_exactly_once(plane.run())


def test_c_a_far_step_on_an_infinite_job_is_refused_without_planning_up_to_it() -> None:
    plane = Plane(_job(epochs="infinite"))
    try:
        plane.join()
        finished, outcome = _threaded(lambda: plane.plan(0, 10**15, wait_ms=100), timeout_s=5)
        assert finished, "the planner kept planning (or fast-forwarding) towards step 1e15"
        assert isinstance(outcome, Unavailable)
        assert plane.book.start_step == 0 and plane.book.steps_planned <= 2 + LEAD
        assert [plane.plan(c, 0).step for c in (0, 1)] == [0, 0], "the job runs on"
    finally:
        plane.stop()


# ---- d: GetPlan naming another constructor's index with a later step ---------------------------


def test_d_a_request_for_another_constructor_does_not_make_its_own_fail(plane: Plane) -> None:
    got = {0: [pair for c in (0, 1) for r in plane.plan(c, 0).ranks for pair in planner_plane.samples(r)]}
    plane.plan(1, 3, delivered_below=3)  # the hostile request, as constructor 1, within the window
    got |= plane.run(first=1)  # constructor 1 asks for steps 1, 2, ... : served, not "already consumed"
    _assert_exactly_once(got)


# ---- g: pre-sent reports for future steps; report floods ------------------------------------------


def _report(plane: Plane, step: int, loss: float = 1.0) -> common_pb2.ReportResponse:
    return plane.service.Report(common_pb2.ReportRequest(step=step, losses={"a": loss}), None)


def test_g_reports_only_for_steps_planned_and_not_past_at_most_one_each() -> None:
    plane = Plane(_job(mixture={"schedule": {"kind": "adaptive", "adaptive": RULE}}))
    try:
        plane.join()
        for c in (0, 1):
            plane.plan(c, 0)
        flood = [_report(plane, step) for step in range(LEAD + 1, 400)] + [_report(plane, 10**9)]
        assert not any(r.accepted for r in flood)
        assert all("not planned yet" in r.reason for r in flood)
        assert not [k for k in plane.ledger.list("gen-") if "/reports/" in k], "no report of a future step is stored"
        assert _report(plane, 0, 2.0).accepted, "the trainer's own report of a step it trained on"
        assert _report(plane, 0, 2.0).accepted, "the same report again: idempotent"
        refused = _report(plane, 0, 3.0)
        assert not refused.accepted and "first report stands" in refused.reason
        step = 1
        while True:  # the job runs to its end: every report the planner waits for is taken
            got = [plane.plan(c, step) for c in (0, 1)]
            if got[0].end_of_data:
                break
            assert _report(plane, step).accepted
            step += 1
        assert step == STEPS
        assert _report(plane, 0, 2.0).accepted, "a retry of an applied report is still taken"
        assert not _report(plane, 0, 3.0).accepted
        assert len([k for k in plane.ledger.list("gen-") if "/reports/" in k]) <= STEPS
    finally:
        plane.stop()


# ---- e and h: registrations and departures ----------------------------------------------------------


def test_e_a_false_registration_after_a_restart_does_not_lock_the_real_loader_out() -> None:
    ledger = MemoryStorage()
    first = Plane(_job(), ledger=ledger)
    first.join()
    first.plan(0, 0)  # the job starts: its ledger records the sources as its loaders reported them
    first.stop()
    restarted = Plane(_job(), ledger=ledger)
    try:
        false = planner_pb2.RegisterLoaderRequest(
            loader_index=0,
            address="evil:1",
            incarnation="x",
            sources=[common_pb2.SourceInfo(name="a", num_rows=ROWS + 1, row_group_sizes=(GROUPS[0] + 1, *GROUPS[1:]))],
        )
        restarted.service.RegisterLoader(false, None)  # wins the race
        restarted.join()  # the real loader, heartbeating: taken
        assert restarted.membership.replicas(0) == {"0": "loader:0"}
        with pytest.raises(InvalidArgument):
            restarted.service.RegisterLoader(false, None)
        restarted.join()
    finally:
        restarted.stop()


# ---- audit: every other field, well-formed but hostile ---------------------------------------------


def test_every_other_field_is_bounded(plane: Plane) -> None:
    service = plane.service
    with pytest.raises(InvalidArgument, match="step must be >= 0"):
        plane.plan(0, -1)
    with pytest.raises(InvalidArgument, match="wait_ms must be >= 0"):
        plane.plan(0, 0, wait_ms=-5)
    with pytest.raises(NotFound):
        plane.plan(7, 0)
    with pytest.raises(InvalidArgument, match="resume must have at most"):
        plane.plan(0, 0, resume={str(i): "x" for i in range(1000)})
    with pytest.raises(InvalidArgument, match="at most 128 characters"):
        plane.plan(0, 0, resume={"mixture": "f" * 10**6})
    with pytest.raises(InvalidArgument, match="data settings"):
        plane.plan(0, 0, resume={"data": "0" * 16})
    with pytest.raises(InvalidArgument, match="replica must have at most"):
        service.RegisterLoader(planner_pb2.RegisterLoaderRequest(loader_index=0, address="x:1", replica="r" * (MAX_NAME_CHARS + 1)), None)
    with pytest.raises(InvalidArgument, match="address must have at most"):
        service.RegisterLoader(planner_pb2.RegisterLoaderRequest(loader_index=0, address="x" * (MAX_ADDRESS_CHARS + 1)), None)
    with pytest.raises(InvalidArgument, match="address is required"):
        service.RegisterConstructor(planner_pb2.RegisterConstructorRequest(constructor_index=0, ranks=[0]), None)
    with pytest.raises(InvalidArgument, match="incarnation must have printable"):
        service.RegisterLoader(planner_pb2.RegisterLoaderRequest(loader_index=0, address="x:1", incarnation="a\nb"), None)
    with pytest.raises(InvalidArgument, match="negative size"):
        service.RegisterLoader(
            planner_pb2.RegisterLoaderRequest(
                loader_index=0,
                address="x:1",
                replica="r2",
                sources=[common_pb2.SourceInfo(name="a", num_rows=ROWS, row_group_sizes=(60, -12))],
            ),
            None,
        )
    with pytest.raises(InvalidArgument, match="step must be >= 0"):
        service.Report(common_pb2.ReportRequest(step=-1), None)
    with pytest.raises(InvalidArgument, match="at most 253 characters"):
        service.Report(common_pb2.ReportRequest(step=0, losses={"a" * 10**5: 1.0}), None)
    with pytest.raises(InvalidArgument, match="wait_ms must be >= 0"):
        service.GetJob(planner_pb2.GetJobRequest(wait_ms=-1), None)
    began = time.monotonic()
    service.GetJob(planner_pb2.GetJobRequest(wait_ms=2**31 - 1), None)  # ready: answers at once; capped anyway
    assert time.monotonic() - began < 5
    _assert_exactly_once(plane.run())


# ---- plans of following steps (constructors.fetch_steps) ------------------------------------------


def test_a_plan_comes_with_the_next_steps_plans_planned_already_each_as_a_request_for_it_gets(plane: Plane) -> None:
    """GetPlanRequest.max_steps: the answer carries the plans of the constructor's next steps
    that are planned (never waiting for one), each the very answer a request for that step
    alone gets, none with plans of its own; more than constructors.fetch_steps is refused."""
    for bad in (9, -1):
        with pytest.raises(InvalidArgument, match=r"max_steps must be in \[0, 8\] \(constructors.fetch_steps\)"):
            plane.plan(0, 0, max_steps=bad)
    deadline = time.monotonic() + 30
    while len(plane.plan(0, 0, delivered_below=0, max_steps=4).following) < 3:  # planned meanwhile
        assert time.monotonic() < deadline, "the planner plans the steps after the one asked for"
        time.sleep(0.01)
    got = plane.plan(0, 0, delivered_below=0, max_steps=4)
    assert [f.step for f in got.following] == [1, 2, 3] and not any(f.following for f in got.following)
    for following in got.following:
        assert following == plane.plan(0, following.step, delivered_below=0)
    assert not plane.plan(0, 0, delivered_below=0, max_steps=1).following
    assert not plane.plan(0, 0, delivered_below=0).following


def test_constructors_that_take_the_following_plans_are_planned_every_sample_exactly_once(plane: Plane) -> None:
    """Each constructor asks for the step after the last plan it holds, taking the plans that
    come with it, as a constructor with constructors.fetch_steps 4 does."""
    held: dict[int, dict[int, planner_pb2.GetPlanResponse]] = {0: {}, 1: {}}
    ended, asked = set(), 0
    while len(ended) < 2:
        for c in (0, 1):
            if c in ended:
                continue
            step = max(held[c], default=-1) + 1
            deadline = time.monotonic() + 30
            while step and plane.book.steps_planned < min(step + 4, STEPS):  # as a constructor that asks while
                assert time.monotonic() < deadline, "the planner plans ahead"  # its ranks train finds them planned
                time.sleep(0.005)
            answer = plane.plan(c, step, max_steps=4)
            asked += 1
            if answer.end_of_data:
                ended.add(c)
                continue
            for plan in (answer, *answer.following):
                held[c][plan.step] = plan
    assert sorted(held[0]) == sorted(held[1])
    assert asked < 2 * STEPS, "plans came with others"
    _assert_exactly_once({step: planner_plane.step_samples([held[0][step], held[1][step]]) for step in held[0]})


# ---- journal producers: each is planned only its own steps ---------------------------------------


def test_journal_producers_are_each_planned_only_their_own_steps_over_the_whole_mesh() -> None:
    """With `journal.producers: 2`, producer i is constructor i of the planner's view, serving
    the whole mesh for the steps s with s % 2 == i: another producer's step is refused before
    it is acted on, each step's samples are fetched by its one producer (fetchers 1), and the
    two together are planned every sample exactly once."""
    plane = Plane(_job(batch={"global_batch_size": 4, "microbatches": 1, "delivery": "journal"}, journal={"producers": 2}))
    plane.join()
    try:
        with pytest.raises(InvalidArgument, match="journal producer 1's"):
            plane.plan(0, 1)
        steps = {}
        for step in range(STEPS):
            answer = plane.plan(step % 2, step)
            assert not answer.end_of_data
            assert [r.dp_rank for r in answer.ranks] == [0, 1], "a producer builds for the whole mesh"
            assert [r.fetchers for r in answer.ranks] == [1, 1], "the step's producer alone fetches its samples"
            steps[step] = planner_plane.step_samples([answer])
        assert plane.plan(STEPS % 2, STEPS).end_of_data
        _assert_exactly_once(steps)
    finally:
        plane.stop()
