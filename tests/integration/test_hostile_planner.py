"""Well-formed but hostile requests to a running planner (issue 15, point 3, the planner's rows
of the attack table), each from a caller authorized as the constructor it claims to be, so that
authorization alone would not stop it: refused, and the job still delivers every sample exactly
once, ending where it should. One small job (one source of 96 rows, 12 steps over two ranks) is
shared by the module (module-scoped fixture); the pure rules are tested in tests/unit/test_plan_progress.py,
test_hostile_planner.py and test_hostile_peers.py."""

from __future__ import annotations

import collections
import json
import time

import grpc
import pytest
from harness import collect, peer_channel, start_cluster, wait_until, write_job, write_source

from batchplane.launcher.local import LocalCluster
from batchplane.v1 import planner_pb2, planner_pb2_grpc

pytestmark = pytest.mark.integration

ROWS = 384  # 48 steps: more than the planning window (plan_lead) past step 3, where the attacks come
BATCH = 8
STEPS = ROWS // BATCH


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hostile")
    source = write_source(root / "data", "a", [16] * ROWS, row_group_size=24, seed=7)
    config = write_job(root / "job.yaml", [source], batch={"global_batch_size": BATCH, "microbatches": 1, "token_dtype": "int32"})
    running = start_cluster(config)
    yield running
    running.stop()


def _planner(cluster: LocalCluster, role: str, index: int | None = None) -> planner_pb2_grpc.PlannerStub:
    endpoints = json.loads(cluster.endpoints_path.read_text())
    return planner_pb2_grpc.PlannerStub(peer_channel(cluster, endpoints["planner"], role=role, index=index))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_hostile_steps_and_rejoins_skip_end_or_stall_nothing(cluster: LocalCluster) -> None:
    planners = {c: _planner(cluster, "constructor", c) for c in (0, 1)}
    operator = _planner(cluster, "operator")  # GetStatus

    # c: the job's first request asks for step 100, then for 1e15: the job starts at 0 all the same
    for step in (100, 10**15):
        began = time.monotonic()
        error = _refused(lambda: planners[0].GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=step, wait_ms=300), timeout=30))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "ahead of the planning window" in error.details()
        assert time.monotonic() - began < 10

    attacked = []

    def attack(rank: int, batch: dict) -> None:
        if rank != 0 or batch["step"] != 3:
            return
        for c, planner in planners.items():
            # a: a far step with a far delivered_below, as each constructor: not served. Every
            # constructor claiming delivery up to the planning cursor is believed (by design, see
            # planner.progress), so the window may reach the job's true end meanwhile: the far
            # step is then past the end and truly has no data.
            try:
                answer = planner.GetPlan(
                    planner_pb2.GetPlanRequest(constructor_index=c, step=10**9, delivered_below=10**9, wait_ms=200), timeout=30
                )
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE and "ahead of the planning window" in error.details()
            else:
                assert answer.end_of_data and not answer.ranks, answer
        assert not operator.GetStatus(planner_pb2.GetStatusRequest(), timeout=30).finished
        # b: constructor 1 rejoins far ahead: believed only up to what is planned
        planners[1].RegisterConstructor(
            planner_pb2.RegisterConstructorRequest(constructor_index=1, address="hostile:1", ranks=[1], rejoin=True, next_step=10**9),
            timeout=30,
        )
        # d: a later step for constructor 1 than it asked for: its own next requests are still served
        planners[1].GetPlan(planner_pb2.GetPlanRequest(constructor_index=1, step=6, delivered_below=6, wait_ms=10_000), timeout=30)
        attacked.append(batch["step"])

    batches, _ = collect(cluster.endpoints_path, (0, 1), on_batch=attack)
    assert attacked == [3]
    for rank in (0, 1):
        assert [b["step"] for b in batches[rank]] == list(range(STEPS)), f"rank {rank}: every step, none skipped, none after the end"
    rows = collections.Counter(
        (int(s), int(r))
        for rank in (0, 1)
        for b in batches[rank]
        for mb in b["microbatches"]
        for s, r in zip(mb["sample_source"], mb["sample_row"])
    )
    assert sorted(rows) == [(0, r) for r in range(ROWS)] and set(rows.values()) == {1}, "every sample exactly once"
    wait_until(lambda: cluster.status().finished, timeout_s=10, what="the planner to see every rank finished")
    status = operator.GetStatus(planner_pb2.GetStatusRequest(), timeout=30)
    assert status.end_step == STEPS  # (a false delivery claim may have cost a re-plan: running totals restart there)

    # after the end, a far request is told so and changes nothing
    response = planners[0].GetPlan(
        planner_pb2.GetPlanRequest(constructor_index=0, step=10**9, delivered_below=10**9, wait_ms=200), timeout=30
    )
    assert response.end_of_data
    assert operator.GetStatus(planner_pb2.GetStatusRequest(), timeout=30).end_step == STEPS
    error = _refused(lambda: planners[0].GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=-1), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
