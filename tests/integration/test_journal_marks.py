"""Checkpoint marks of journal delivery (issue 18, lifecycle) with real processes: each trainer
calls `Client.checkpointed` after its checkpoint at step K; the pod's constructor keeps the mark
`ckpt-pod-I` at K in the manifest (and releases its start hold); the journal's reclaimer
deletes only the steps below the lowest mark; a client restored from the checkpoint at K still
receives byte-identical batches.

The producer's own reclaim loop cannot delete anything within this test (journal.min_age_s is at
least 120 s, 4 x the manifest's confirm window), so the round here is the same
`journal.reclaim.Reclaimer` run over the run's journal with its clock an hour ahead."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
from harness import assert_same_batches, collect, run_ranks, skewed_lengths, start_cluster, to_numpy, write_job, write_source

from batchplane.client import Client, StepUnavailableError
from batchplane.core.storage import LocalStorage
from batchplane.journal.commit import ManifestStore
from batchplane.journal.reclaim import Reclaimer
from batchplane.journal.retention import RetentionPolicy

pytestmark = pytest.mark.integration

MESH = {"dp": 2, "cp": 1}
BATCH = {"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32", "delivery": "journal"}
ROWS = 96
STEPS = ROWS // BATCH["global_batch_size"]
K = 5  # the checkpoint resumes at step K


def test_checkpoint_marks_bound_reclamation_and_a_restore_replays_its_batches(tmp_path: pathlib.Path) -> None:
    source = write_source(tmp_path / "data", "a", skewed_lengths(ROWS, seed=5, long=100), row_group_size=16, seed=5)
    (tmp_path / "job").mkdir()
    config = write_job(tmp_path / "job" / "job.yaml", [source], mesh=MESH, batch=BATCH,
                       journal={"policy": "naive", "min_age_s": 120, "prefetch_steps": 1})
    cluster = start_cluster(config)
    try:
        saved: dict[int, dict] = {}
        marked: dict[int, bool] = {}

        def checkpoint(rank: int, batch: dict) -> None:
            if batch["step"] == K - 1:  # the trainer saved its checkpoint after training step K - 1
                client = clients[rank]
                saved[rank] = client.state_dict()
                marked[rank] = client.checkpointed(saved[rank])

        clients: dict[int, Client] = {}
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        first: dict[int, list] = {}

        def train(rank: int) -> None:
            with Client(rank=rank, timeout_s=60) as client:
                clients[rank] = client
                first[rank] = []
                for batch in client:
                    first[rank].append(to_numpy(batch))
                    checkpoint(rank, batch)

        run_ranks(train, range(MESH["dp"]))
        assert [len(first[r]) for r in first] == [STEPS] * MESH["dp"]
        assert marked == {0: True, 1: True} and {s["next_step"] for s in saved.values()} == {K}

        journal = LocalStorage(cluster.run_dir / "journal")
        marks = {m.mark: m.step for m in ManifestStore(journal).latest().marks}
        assert marks["ckpt-pod-0"] == K and marks["ckpt-pod-1"] == K, marks
        assert not any(m.startswith("start-") for m in marks), marks  # released once every rank checkpointed
        floor = min(marks.values())
        assert floor == K  # progress marks are never below the checkpoint's

        # A round of the reclaimer (an hour later): only the steps below the lowest mark go.
        report = Reclaimer(journal, policy=RetentionPolicy(min_age_s=120), wall_clock=lambda: time.time() + 3600).run_once()
        assert report.decision.steps == tuple(range(K))
        assert report.watermark == K
        assert sorted(s.step for s in ManifestStore(journal).latest().steps) == list(range(K, STEPS))

        # Restored from the checkpoint at K: the same bytes as the first time.
        again, _ = collect(cluster.endpoints_path, range(MESH["dp"]), states=saved)
        assert_same_batches(again, {r: first[r][K:] for r in first})

        # A checkpoint of a reclaimed step is refused with a clear message.
        with Client(rank=0, timeout_s=10) as client, pytest.raises(StepUnavailableError, match="reclaimed|before step"):
            client.load_state_dict({**saved[0], "next_step": 0})
            next(iter(client), None)
    finally:
        cluster.stop()
