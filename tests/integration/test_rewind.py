"""Rewinding on a running data plane: trainers restarted from checkpoints older than what the
data plane served continue exactly from them, with no restart of the data plane; ranks that
rewind to different steps at different moments each get what an undisturbed run gives them; a
rewind before the ledger's horizon is refused naming the oldest step. Real processes."""

from __future__ import annotations

import collections
import os
import threading

import pytest
from harness import (
    assert_same_batches,
    collect,
    ledger_records,
    sample_ids,
    scrape,
    start_cluster,
    to_numpy,
    wait_until,
    write_job,
    write_source,
)

from batchplane.client import Client, StepUnavailableError

pytestmark = pytest.mark.integration


@pytest.fixture
def sources(tmp_path):
    return [
        write_source(tmp_path / "data", "web", [4 + i % 29 for i in range(240)], row_group_size=20, seed=1),
        write_source(tmp_path / "data", "code", [3 + i % 17 for i in range(160)], row_group_size=20, seed=2),
    ]


def job(tmp_path, sources, name: str):
    return write_job(
        tmp_path / f"{name}.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        mesh={"dp": 2},
        constructors={"prefetch_steps": 2},
        run_dir=str(tmp_path / name),
    )


def test_ranks_rewinding_to_different_steps_at_different_moments_get_an_undisturbed_runs_batches(tmp_path, sources) -> None:
    reference_cluster = start_cluster(job(tmp_path, sources, "reference"))
    try:
        reference, _ = collect(reference_cluster.endpoints_path, [0, 1])
    finally:
        reference_cluster.stop()
    steps = len(reference[0])
    assert steps == 50  # 400 samples / 8

    cluster = start_cluster(job(tmp_path, sources, "run"))
    os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
    try:
        saved: dict[int, dict] = {}
        first: dict[int, list] = collections.defaultdict(list)
        checkpoint = {0: 10, 1: 20}

        def run_until(rank: int, last: int) -> None:  # a trainer that dies after step `last`
            with Client(rank=rank, timeout_s=60) as client:
                for batch in client:
                    first[rank].append(to_numpy(batch))
                    if batch["step"] == checkpoint[rank] - 1:
                        saved[rank] = client.state_dict()
                    if batch["step"] == last:
                        break

        threads = [threading.Thread(target=run_until, args=(r, 30)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        planner_metrics = f"http://127.0.0.1:{cluster.planner.metrics_port}/metrics"
        # Both ranks were handed step 30: the planner keeps no plan below it any more.
        wait_until(lambda: scrape(planner_metrics).get("batchplane_planner_step", 0) >= 30, timeout_s=30, what="planning past step 30")

        again: dict[int, list] = {}
        rank0_started = threading.Event()

        def resume(rank: int) -> None:  # a trainer restarted from its checkpoint
            if rank == 1:
                assert rank0_started.wait(timeout=60)
            with Client(rank=rank, timeout_s=60) as client:
                client.load_state_dict(saved[rank])
                out = []
                for batch in client:
                    out.append(to_numpy(batch))
                    if rank == 0 and len(out) == 3:
                        rank0_started.set()  # rank 1 rewinds later, and less far
                again[rank] = out

        threads = [threading.Thread(target=resume, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert again.keys() == {0, 1}
        for rank in (0, 1):
            assert [b["step"] for b in again[rank]] == list(range(checkpoint[rank], steps))
            assert_same_batches({rank: again[rank]}, {rank: reference[rank][checkpoint[rank] :]})
        # I1 across the rewind: what each rank trained on before its checkpoint and after it
        # covers every sample of the epoch exactly once.
        seen = collections.Counter()
        for rank in (0, 1):
            trained = first[rank][: checkpoint[rank]] + again[rank]
            for step in sample_ids(trained):
                seen.update(sample for mb in step for sample in mb)
        assert sum(seen.values()) == 400 and set(seen.values()) == {1}
        assert scrape(planner_metrics)["batchplane_planner_rewinds_total"] >= 1
        wait_until(lambda: cluster.status().finished, timeout_s=30, what="the job to finish")
    finally:
        cluster.stop()
    # The ledger says what the undisturbed run's says: the same plan for every step.
    assert ledger_records(tmp_path / "run") == ledger_records(tmp_path / "reference")


def test_a_rewind_before_the_ledgers_horizon_is_refused_naming_the_oldest_step(tmp_path, sources) -> None:
    first = start_cluster(job(tmp_path, sources, "first"))
    states = {}
    try:
        os.environ["BATCHPLANE_ENDPOINTS"] = str(first.endpoints_path)
        with Client(rank=0, timeout_s=60) as a, Client(rank=1, timeout_s=60) as b:
            for batch, _ in zip(a, b):
                states[batch["step"] + 1] = a.state_dict()
                if batch["step"] == 14:
                    break
        reference, _ = collect(first.endpoints_path, [0], states={0: states[12]}, stop_after=1)
    finally:
        first.stop()
    # A new run folder: its ledger starts where the job resumes, at step 12.
    cluster = start_cluster(job(tmp_path, sources, "moved"))
    try:
        resumed, _ = collect(cluster.endpoints_path, [0, 1], states={0: states[12], 1: states[12]}, stop_after=4)
        assert [b["step"] for b in resumed[0]] == [12, 13, 14, 15]
        assert_same_batches({0: resumed[0][:1]}, reference)
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        with Client(rank=0, timeout_s=30) as late:
            late.load_state_dict(states[5])
            with pytest.raises(
                StepUnavailableError, match="cannot rewind to step 5: the oldest step the planner's ledger can re-plan is 12"
            ):
                next(iter(late))
        with Client(rank=0, timeout_s=30) as late:  # the oldest step itself is fine
            late.load_state_dict(states[12])
            assert_same_batches({0: [to_numpy(next(iter(late)))]}, reference)
        # A restarted constructor (a new pod) knows the horizon from its registration: it refuses
        # at once, and a trainer restarting at a valid step afterwards is served.
        cluster.restart_constructor(0)
        with Client(rank=0, timeout_s=30) as late:
            late.load_state_dict(states[5])
            with pytest.raises(StepUnavailableError, match="the oldest step the planner's ledger can re-plan is 12"):
                next(iter(late))
        with Client(rank=0, timeout_s=30) as late:
            late.load_state_dict(states[12])
            assert_same_batches({0: [to_numpy(next(iter(late)))]}, reference)
    finally:
        cluster.stop()
