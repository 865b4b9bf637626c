"""Checkpoint marks of journal delivery (issue 18, lifecycle) with real processes: each trainer
calls `Client.checkpointed` after its checkpoint at step K; the pod's constructor keeps the mark
`ckpt-pod-I` at K in the manifest (and releases its start hold); the journal's reclaimer
deletes only the steps below the lowest mark; a client restored from the checkpoint at K still
receives byte-identical batches. The Hugging Face Trainer adapter under torchrun marks each
checkpoint it saves (`on_save`) on every rank, and its ranks exit cleanly (status 0, no abort
at exit).

The producer's own reclaim loop cannot delete anything within this test (journal.min_age_s is at
least 120 s, 4 x the manifest's confirm window), so the round here is the same
`journal.reclaim.Reclaimer` run over the run's journal with its clock an hour ahead."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from disturbed import wait_trainer
from harness import (
    SourceData,
    assert_same_batches,
    collect,
    run_ranks,
    skewed_lengths,
    start_cluster,
    to_numpy,
    wait_until,
    write_job,
    write_source,
)

from batchplane.client import Client, StepUnavailableError
from batchplane.core.storage import LocalStorage
from batchplane.journal.commit import ManifestStore
from batchplane.journal.reclaim import Reclaimer
from batchplane.journal.retention import RetentionPolicy
from batchplane.journal.writer import read_end

pytestmark = pytest.mark.integration

MESH = {"dp": 2, "cp": 1}
BATCH = {"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32", "delivery": "journal"}
ROWS = 96
STEPS = ROWS // BATCH["global_batch_size"]
K = 5  # the checkpoint resumes at step K


def test_checkpoint_marks_bound_reclamation_and_a_restore_replays_its_batches(tmp_path: pathlib.Path) -> None:
    source = write_source(tmp_path / "data", "a", skewed_lengths(ROWS, seed=5, long=100), row_group_size=16, seed=5)
    (tmp_path / "job").mkdir()
    config = write_job(
        tmp_path / "job" / "job.yaml", [source], mesh=MESH, batch=BATCH, journal={"policy": "naive", "min_age_s": 120, "prefetch_steps": 1}
    )
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


HF_TRAINER = pathlib.Path(__file__).parent / "trainers" / "hf_successor.py"
TORCHRUN = pathlib.Path(sys.executable).parent / "torchrun"
VOCAB = 64
HF_STEPS = 10
HF_SAVE_STEPS = 4  # checkpoints after steps 4 and 8 (global steps), and Hugging Face saves at the end


def _successor_source(root: pathlib.Path, rows: int) -> SourceData:
    """`rows` samples of 8..48 tokens, each token the previous + 1 mod VOCAB (what hf_successor.py learns)."""
    rng = np.random.default_rng(7)
    samples = [((rng.integers(0, VOCAB) + np.arange(rng.integers(8, 49))) % VOCAB).astype(np.int32) for _ in range(rows)]
    folder = root / "up"
    folder.mkdir(parents=True)
    table = pa.table({"input_ids": pa.array(samples, type=pa.list_(pa.int32())), "doc_id": pa.array(np.arange(rows), pa.int64())})
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=40, compression="zstd")
    return SourceData("up", folder, samples)


def test_the_hf_trainer_marks_each_checkpoint_it_saves_and_its_ranks_exit_cleanly(tmp_path: pathlib.Path) -> None:
    batch = {"global_batch_size": 16, "microbatches": 2, "token_dtype": "int32", "delivery": "journal"}
    source = _successor_source(tmp_path / "data", HF_STEPS * batch["global_batch_size"])
    (tmp_path / "job").mkdir()
    config = write_job(
        tmp_path / "job" / "job.yaml", [source], mesh=MESH, batch=batch, journal={"policy": "naive", "min_age_s": 120, "prefetch_steps": 1}
    )
    cluster = start_cluster(config)
    out = tmp_path / "out"
    out.mkdir()
    try:
        journal = LocalStorage(cluster.run_dir / "journal")
        # The Trainer takes its max_steps from the job's length, which journal delivery knows at the end marker.
        wait_until(lambda: read_end(journal) is not None, timeout_s=60, what="the producer to reach the end")
        env = {**os.environ, "BATCHPLANE_ENDPOINTS": str(cluster.endpoints_path), "OMP_NUM_THREADS": "1"}
        command = [
            str(TORCHRUN),
            "--standalone",
            "--nproc_per_node",
            "2",
            str(HF_TRAINER),
            "--out",
            str(out),
            "--vocab",
            str(VOCAB),
            "--save-steps",
            str(HF_SAVE_STEPS),
        ]
        with open(out / "torchrun.log", "wb") as log:
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        code = wait_trainer(proc, out / "torchrun.log")
        text = (out / "torchrun.log").read_text(errors="replace")
        assert code == 0 and "terminate called" not in text, f"torchrun exited with {code}:\n{text[-6000:]}"
        saves = sorted(int(p.name.split("-")[1]) for p in (out / "hf").glob("checkpoint-*"))
        assert {4, 8} <= set(saves), saves
        last = saves[-1]  # each save moved the marks on: the last one's holds
        saved = json.loads((out / "hf" / f"checkpoint-{last}" / "batchplane_data.json").read_text())
        assert saved["next_step"] == last and json.loads(saved["journal"])[str(last)]["step"] == last
        marks = {m.mark: m.step for m in ManifestStore(journal).latest().marks}
        assert marks["ckpt-pod-0"] == marks["ckpt-pod-1"] == last, marks
        assert not any(m.startswith("start-") for m in marks), marks
    finally:
        cluster.stop()
