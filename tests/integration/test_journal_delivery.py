"""Journal delivery (`batch.delivery: journal`, issue 18) with real processes: a producer builds
every step for the whole mesh and commits it to the journal on the local disk; each pod's
constructor range-reads its ranks' slices and serves them. The trainers receive byte-identical
batches to a streaming run of the same job; a producer killed (SIGKILL) mid-run and started
again commits every planned step exactly once (read back from the manifest), and the trainers
still receive the streaming run's batches; so do two producers building alternate steps without
coordination, one of them killed mid-run. A trainer asking `len()` before the producer reached
the end of the data gets the streaming run's length (the planner's)."""

from __future__ import annotations

import pathlib

import pytest
from disturbed import kill
from harness import assert_same_batches, collect, running_cluster, skewed_lengths, wait_until, write_job, write_source

from batchplane.client import Client
from batchplane.core.storage import LocalStorage
from batchplane.journal.commit import ManifestStore
from batchplane.journal.writer import read_end

pytestmark = pytest.mark.integration

MESH = {"dp": 2, "cp": 1}
BATCH = {"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"}
ROWS = 160
STEPS = ROWS // BATCH["global_batch_size"]


def _job(root: pathlib.Path, name: str, **settings) -> pathlib.Path:
    source = write_source(root / "data", "a", skewed_lengths(ROWS, seed=3, long=200), row_group_size=20, seed=3)
    (root / name).mkdir()
    return write_job(root / name / "job.yaml", [source], mesh=MESH, batch={**BATCH, **settings.pop("batch", {})}, **settings)


@pytest.fixture(scope="module")
def streaming_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, int]:
    """The reference: the same job delivered by streaming, and its `len()` (the planner's)."""
    root = tmp_path_factory.mktemp("stream")
    with running_cluster(_job(root, "stream")) as cluster:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
            with Client(rank=0, timeout_s=30) as client:
                length = len(client)
        batches, _ = collect(cluster.endpoints_path, range(MESH["dp"]))
    assert [len(b) for b in batches.values()] == [STEPS] * MESH["dp"]
    return batches, length


@pytest.fixture(scope="module")
def streamed(streaming_run: tuple[dict, int]) -> dict:
    """The streaming run's batches."""
    return streaming_run[0]


def _committed(run_dir: pathlib.Path) -> list[int]:
    """Every step committed in the journal's manifest history, once per commit that carried it."""
    store = ManifestStore(LocalStorage(run_dir / "journal"))
    latest = store.latest()
    steps = []
    for version in range(1, latest.version + 1):
        record = store.read_record(version)
        steps += [entry.step for entry in getattr(record.change, "steps", ())]
    return steps


def test_journal_delivery_gives_the_streaming_runs_batches(tmp_path: pathlib.Path, streamed: dict) -> None:
    config = _job(tmp_path, "journal", batch={"delivery": "journal"}, journal={"policy": "naive"})
    with running_cluster(config) as cluster:
        assert len(cluster.producers) == 1 and len(cluster.constructors) == MESH["dp"]
        batches, _ = collect(cluster.endpoints_path, range(MESH["dp"]))
    assert_same_batches(batches, streamed)
    assert sorted(_committed(cluster.run_dir)) == list(range(STEPS))


def test_a_killed_producer_resumes_after_its_last_commit_and_skips_or_repeats_nothing(tmp_path: pathlib.Path, streamed: dict) -> None:
    config = _job(tmp_path, "killed", batch={"delivery": "journal"}, journal={"policy": "fixed10", "prefetch_steps": 1})
    with running_cluster(config) as cluster:
        killed = []

        def kill_once(rank: int, batch: dict) -> None:
            if rank == 0 and batch["step"] == 3 and not killed:
                kill(cluster.producers[0])  # no flush of what it built but did not commit
                killed.append(batch["step"])
                cluster.restart_producer()

        batches, _ = collect(cluster.endpoints_path, range(MESH["dp"]), on_batch=kill_once)
        assert killed == [3]
        wait_until(lambda: len(_committed(cluster.run_dir)) >= STEPS, timeout_s=30, what="the producer to commit every step")
    assert_same_batches(batches, streamed)
    assert sorted(_committed(cluster.run_dir)) == list(range(STEPS))  # each planned step committed exactly once


def test_two_producers_build_alternate_steps_and_one_killed_loses_or_repeats_nothing(tmp_path: pathlib.Path, streamed: dict) -> None:
    config = _job(tmp_path, "two", batch={"delivery": "journal"}, journal={"policy": "dac", "producers": 2})
    with running_cluster(config) as cluster:
        assert len(cluster.producers) == 2
        killed = []

        def kill_once(rank: int, batch: dict) -> None:
            if rank == 1 and batch["step"] == 4 and not killed:
                kill(cluster.producers[1])
                killed.append(batch["step"])
                cluster.restart_producer(1)

        batches, _ = collect(cluster.endpoints_path, range(MESH["dp"]), on_batch=kill_once)
        assert killed == [4]
        wait_until(lambda: len(_committed(cluster.run_dir)) >= STEPS, timeout_s=30, what="the producers to commit every step")
        store = ManifestStore(LocalStorage(cluster.run_dir / "journal"))
        owners = {
            entry.step: record.change.producer
            for v in range(1, store.latest().version + 1)
            if hasattr((record := store.read_record(v)).change, "steps")
            for entry in record.change.steps
        }
    assert_same_batches(batches, streamed)
    assert sorted(_committed(cluster.run_dir)) == list(range(STEPS))
    assert owners == {step: f"p{step % 2}" for step in range(STEPS)}, "producer i committed exactly the steps s % 2 == i"


def test_a_trainer_gets_the_streaming_runs_length_before_the_producer_reaches_the_end(
    tmp_path: pathlib.Path, streaming_run: tuple[dict, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_lag_steps 4: with no trainer consuming, the producer pauses at step 4 of 20
    config = _job(tmp_path, "length", batch={"delivery": "journal"}, journal={"policy": "naive", "max_lag_steps": 4})
    with running_cluster(config) as cluster:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        with Client(rank=0, timeout_s=30) as client:
            length = len(client)
        assert read_end(LocalStorage(cluster.run_dir / "journal")) is None, "the producer reached the end of the data"
    assert length == streaming_run[1] == STEPS
