"""Lightning over batchplane, for real: `lightning.Trainer(accelerator="cpu", devices=2,
strategy="ddp")` (two processes, gloo) trains on `BatchplaneDataModule`, checkpoints every 3
steps with ModelCheckpoint and stops; a second `fit(ckpt_path=...)` against the same running data
plane receives exactly the steps after the checkpoint, byte for byte as an uninterrupted read of
the same job does (a plain `Client` per rank on another run folder: what every rank receives is
the data plane's, whatever framework reads it). Lightning writes its checkpoint from rank 0 only, so rank 1 resumes from rank 0's data
state. The infinite job has no length, so Lightning fetches one batch ahead: the checkpoint must
still name the step after the last one trained. Real processes (tests/integration/trainers/
lightning_trainer.py)."""

from __future__ import annotations

import collections
import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from disturbed import wait_trainer
from harness import corrupt_row_group, run_ranks, running_cluster, start_cluster, write_job, write_source
from trainers.hashes import tensor_hashes

from batchplane.client import Client
from batchplane.launcher.local import LocalCluster

pytestmark = pytest.mark.integration

TRAINER = pathlib.Path(__file__).parent / "trainers" / "lightning_trainer.py"
SAMPLES = 96  # 12 steps of 8


def run_trainer(endpoints: pathlib.Path, out: pathlib.Path, ckpt_dir: pathlib.Path, *args: str) -> None:
    """Runs the Lightning trainer (it starts its second rank itself) to its end; its whole
    process group is killed if it outlives the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["BATCHPLANE_ENDPOINTS"] = str(endpoints)
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(TRAINER), "--out", str(out), "--ckpt-dir", str(ckpt_dir), *args],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    code = wait_trainer(proc, log)
    assert code == 0, f"the Lightning trainer exited with {code}:\n{log.read_text()[-4000:]}"


def uninterrupted(cluster: LocalCluster, steps: int | None) -> dict[int, list[dict]]:
    """What each rank receives in the first `steps` steps (None: to the end of a finite job),
    read with a plain client, as the trainer records it (samples and tensor hashes, through
    JSON)."""
    endpoints = json.loads(cluster.endpoints_path.read_text())
    got: dict[int, list[dict]] = {}

    def read(rank: int) -> None:
        with Client(endpoints["constructors"][str(rank)], rank=rank, timeout_s=60) as client:
            got[rank] = json.loads(
                json.dumps(
                    [
                        {
                            "step": batch["step"],
                            "samples": [list(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())) for mb in batch["microbatches"]],
                            "hashes": tensor_hashes(batch["microbatches"]),
                        }
                        for batch in itertools.islice(client, steps)
                    ]
                )
            )

    run_ranks(read, (0, 1))
    return got


def lines(out: pathlib.Path) -> dict[int, list[dict]]:
    return {r: [json.loads(x) for x in open(out / f"rank{r}.jsonl")] for r in (0, 1)}


@pytest.mark.parametrize("epochs", [1, "infinite"])
def test_a_fit_resumed_from_a_lightning_checkpoint_receives_exactly_the_steps_after_it(tmp_path, epochs) -> None:
    sources = [
        write_source(tmp_path / "data", "web", [4 + i % 29 for i in range(56)], row_group_size=20, seed=1),
        write_source(tmp_path / "data", "code", [3 + i % 17 for i in range(40)], row_group_size=20, seed=2),
    ]

    def job(name: str) -> pathlib.Path:
        return write_job(
            tmp_path / f"{name}.yaml",
            sources,
            epochs=epochs,
            batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
            mesh={"dp": 2},
            constructors={"prefetch_steps": 2},
            run_dir=str(tmp_path / name),
        )

    steps = SAMPLES // 8
    to_the_end = ("--max-steps", str(steps)) if epochs == "infinite" else ()  # a finite job: max_epochs=1

    with running_cluster(job("reference")) as reference_cluster:
        reference = uninterrupted(reference_cluster, steps if epochs == "infinite" else None)
    assert [b["step"] for b in reference[0]] == list(range(steps))

    cluster = start_cluster(job("run"))
    try:
        ckpt = tmp_path / "ckpt"
        run_trainer(cluster.endpoints_path, tmp_path / "first", ckpt, "--max-steps", "7", "--every", "3")
        saved = torch.load(ckpt / "step=6.ckpt", weights_only=False)["BatchplaneDataModule"]
        # Written by rank 0 alone, after 6 steps: the data plane served step 6 (and, for the
        # infinite job, Lightning fetched step 7 ahead) before the first fit stopped.
        assert saved["next_step"] == 6 and saved["rank"] == 0
        run_trainer(cluster.endpoints_path, tmp_path / "resumed", ckpt, "--resume", str(ckpt / "step=6.ckpt"), *to_the_end)
    finally:
        cluster.stop()
    first, resumed = lines(tmp_path / "first"), lines(tmp_path / "resumed")
    for rank in (0, 1):
        assert [b["step"] for b in first[rank]] == list(range(7))
        # Exactly the steps after the checkpoint, in Lightning's step count too.
        assert [(b["step"], b["global_step"]) for b in resumed[rank]] == [(s, s) for s in range(6, steps)]
        for mine, theirs in zip(resumed[rank], reference[rank][6:]):
            assert (mine["samples"], mine["hashes"]) == (theirs["samples"], theirs["hashes"]), (rank, mine["step"])
    if epochs == 1:
        # What the two fits trained on (the first up to its checkpoint) covers the epoch once.
        seen = collections.Counter()
        for rank in (0, 1):
            for b in first[rank][:6] + resumed[rank]:
                seen.update(tuple(s) for mb in b["samples"] for s in mb)
        assert sum(seen.values()) == SAMPLES and set(seen.values()) == {1}


def test_a_finite_job_with_an_unreadable_row_group_ends_the_fit_where_its_data_does(tmp_path) -> None:
    """Issue 40: a row group of "web" is unreadable, so substitution ends the data a step before
    the length counted at the start (len() is an upper bound). The fit ends at the real end,
    trains every good row once, and the checkpoint Lightning saves at the epoch's end holds the data
    state there (a step-based ModelCheckpoint saves only on its steps)."""
    sources = [
        write_source(tmp_path / "data", "web", [4 + i % 29 for i in range(56)], row_group_size=20, seed=1),
        write_source(tmp_path / "data", "code", [3 + i % 17 for i in range(40)], row_group_size=20, seed=2),
    ]
    lost = {(0, row) for row in range(20, 20 + corrupt_row_group(sources[0].path / "part-00000.parquet", 1))}
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        mesh={"dp": 2},
        constructors={"prefetch_steps": 2},
    )
    with running_cluster(config) as cluster:
        endpoints = json.loads(cluster.endpoints_path.read_text())
        with Client(endpoints["constructors"]["0"], rank=0, timeout_s=60) as client:
            counted = len(client)
        run_trainer(cluster.endpoints_path, tmp_path / "out", tmp_path / "ckpt", "--every", "5", "--save-at-end")
    trained = lines(tmp_path / "out")
    delivered = len(trained[0])
    assert counted == SAMPLES // 8 and delivered == -(-(SAMPLES - len(lost)) // 8) < counted
    seen = collections.Counter(tuple(s) for r in (0, 1) for b in trained[r] for mb in b["samples"] for s in mb)
    good = {(k, row) for k, s in enumerate(sources) for row in range(len(s.rows))} - lost
    assert set(seen) == good and set(seen.values()) == {1}
    end = torch.load(tmp_path / "ckpt" / f"end-step={delivered}.ckpt", weights_only=False)
    assert end["BatchplaneDataModule"]["next_step"] == delivered and end["global_step"] == delivered
