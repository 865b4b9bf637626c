"""torchtitan over batchplane. torchtitan's Trainer cannot be constructed on this CPU-only
machine (see tests/integration/trainers/torchtitan_trainer.py for why), so two ranks under
torchrun (gloo) run torchtitan's own `Trainer.train_step`, `batch_generator`,
`post_dataloading_process` and `CheckpointManager` with its debug Llama on CPU, fed by
`BatchplaneDataLoader` built as the Trainer builds its dataloader. A run that dies after step 7
resumes from torchtitan's latest checkpoint (step 6: model, optimizer, LR schedule, train state
and the loader's DCP state) and receives the uninterrupted run's microbatches (the same torchrun
trained that run, on a data plane of its own, before the one that died), tensor for tensor,
with the same losses; the job's end of data ends training at a step boundary through torchtitan's
DataloaderExhaustedError. In-process: a checkpoint taken between the microbatches of a step
resumes at the next microbatch, on every rank from one rank's state; a loader told another
number of microbatches per step than the job plans is refused at once, and a token-budget job
at its first step with more, before any of that step is handed out. Real processes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from disturbed import wait_trainer
from harness import SourceData, start_cluster, write_job

from batchplane.client import Client, InvalidRequestError
from batchplane.client.torchtitan import BatchplaneDataLoader

pytestmark = pytest.mark.integration

TRAINER = pathlib.Path(__file__).parent / "trainers" / "torchtitan_trainer.py"
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
STEPS = 12  # 96 samples, 8 per step
VOCAB = 2048  # torchtitan's debug Llama


def write_small_vocab_source(root: pathlib.Path, name: str, lengths: list[int], *, seed: int) -> SourceData:
    """A source like harness.write_source's, with token ids inside the debug Llama's vocabulary."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32())), "doc_id": pa.array(np.arange(len(rows)), pa.int64())})
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=20)
    return SourceData(name, folder, rows)


@pytest.fixture
def sources(tmp_path):
    return [
        write_small_vocab_source(tmp_path / "data", "web", [4 + i % 29 for i in range(56)], seed=1),
        write_small_vocab_source(tmp_path / "data", "code", [3 + i % 17 for i in range(40)], seed=2),
    ]


def job(tmp_path: pathlib.Path, sources, name: str) -> pathlib.Path:
    return write_job(
        tmp_path / f"{name}.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        mesh={"dp": 2},
        constructors={"prefetch_steps": 2},
        run_dir=str(tmp_path / name),
    )


def run_torchtitan(endpoints: pathlib.Path, dump: pathlib.Path, out: pathlib.Path, *args: str) -> dict[int, dict]:
    """Runs two ranks to their end; returns each rank's summary (done<r>.json)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["BATCHPLANE_ENDPOINTS"] = str(endpoints)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "torchrun.log", "w") as log:
        proc = subprocess.Popen(
            [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(TRAINER), "--dump", str(dump), "--out", str(out), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    code = wait_trainer(proc, out / "torchrun.log")
    assert code == 0, f"torchrun exited with {code}:\n{(out / 'torchrun.log').read_text()[-5000:]}"
    return {r: json.loads((out / f"done{r}.json").read_text()) for r in (0, 1)}


def lines(out: pathlib.Path) -> dict[int, list[dict]]:
    return {r: [json.loads(x) for x in open(out / f"rank{r}.jsonl")] for r in (0, 1)}


def test_torchtitan_resumed_from_its_checkpoint_trains_on_the_uninterrupted_runs_microbatches(tmp_path, sources) -> None:
    reference_cluster = start_cluster(job(tmp_path, sources, "reference"))
    cluster = start_cluster(job(tmp_path, sources, "run"))
    try:
        # The same two ranks train the reference job to its end (uninterrupted), then the run's
        # job until they leave after step 7, as a job that died there.
        dump = tmp_path / "dump"
        reference_run = [str(reference_cluster.endpoints_path), str(tmp_path / "reference-dump"), str(tmp_path / "reference")]
        first_run = ["--steps", "20", "--interval", "3", "--stop-after", "7"]
        run_torchtitan(cluster.endpoints_path, dump, tmp_path / "first", *first_run, "--reference", *reference_run)
        reference_cluster.stop()
        done = {r: json.loads((tmp_path / "reference" / f"done{r}.json").read_text()) for r in (0, 1)}
        reference = lines(tmp_path / "reference")
        for rank in (0, 1):
            # torchtitan step k trains batchplane step k - 1, two microbatches each (gradient
            # accumulation 2); the end of data ends training before step 13 without cutting one.
            assert [(b["step"], b["next_step"], b["microbatch"], len(b["pairs"])) for b in reference[rank]] == [
                (k, k, 0, 2) for k in range(1, STEPS + 1)
            ]
            assert done[rank]["exhausted_at"] == STEPS + 1
        assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3", "step-6"]
        # The resumed run ends with the data (`EndWithData`), before training.steps, its last step saved.
        done = run_torchtitan(cluster.endpoints_path, dump, tmp_path / "resumed", "--steps", "20", "--interval", "5", "--end-with-data")
    finally:
        reference_cluster.stop()
        cluster.stop()
    first, resumed = lines(tmp_path / "first"), lines(tmp_path / "resumed")
    for rank in (0, 1):
        assert first[rank] == reference[rank][:7]
        # torchtitan's CheckpointManager found step 6 and restored the loader's position with it.
        assert done[rank]["loaded"]["step"] == 6
        assert (done[rank]["loaded"]["position"]["next_step"], done[rank]["loaded"]["position"]["microbatch"]) == (6, 0)
        # The same microbatches as the uninterrupted run from step 7 on, and the same losses
        # (model, optimizer and LR schedule restored too).
        assert [b["step"] for b in resumed[rank]] == list(range(7, STEPS + 1))
        assert resumed[rank] == reference[rank][6:]
        assert done[rank]["exhausted_at"] is None and done[rank]["step"] == STEPS
    # Saved every 5 steps, and the last step (12) though training.steps is 20.
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-10", "step-12", "step-3", "step-6"]


def _pairs(loaders: list[BatchplaneDataLoader], iterators: list, n: int) -> list[list[tuple[dict, torch.Tensor]]]:
    """n pairs from each rank's loader, the ranks taking turns (as trainers run side by side)."""
    out: list[list] = [[] for _ in loaders]
    for _ in range(n):
        for rank, it in enumerate(iterators):
            out[rank].append(next(it))
    return out


def _same(a: list[tuple[dict, torch.Tensor]], b: list[tuple[dict, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) and torch.equal(lx, ly) for (x, lx), (y, ly) in zip(a, b)
    )


def test_a_checkpoint_between_microbatches_resumes_at_the_next_one_on_every_rank(tmp_path, sources) -> None:
    cluster = start_cluster(job(tmp_path, sources, "run"))
    os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
    config = BatchplaneDataLoader.Config(microbatches_per_step=2, timeout_s=60)
    try:
        loaders = [
            BatchplaneDataLoader(config, dp_world_size=2, dp_rank=r, client=Client(rank=r, device=None, timeout_s=60)) for r in (0, 1)
        ]
        iterators = [iter(loader) for loader in loaders]
        head = _pairs(loaders, iterators, 3)  # step 0, and the first microbatch of step 1
        states = [loader.state_dict() for loader in loaders]
        tail = _pairs(loaders, iterators, 3)  # the second microbatch of step 1, step 2
        for loader in loaders:
            loader.close()
        assert [sorted(s) for s in states] == [["dp_rank_0", "world_size"], ["dp_rank_1", "world_size"]]
        assert [(s[f"dp_rank_{r}"]["next_step"], s[f"dp_rank_{r}"]["microbatch"]) for r, s in enumerate(states)] == [(1, 1), (1, 1)]
        input0, labels0 = head[0][0]
        assert input0["input"].dtype == input0["positions"].dtype == labels0.dtype == torch.int64
        assert (labels0 == -100).any()  # torchtitan's IGNORE_INDEX on each sample's last token

        # Both ranks restore rank 0's state (DCP would hand each its own entry: they are equal).
        again = [BatchplaneDataLoader(config, dp_world_size=2, dp_rank=r, client=Client(rank=r, device=None, timeout_s=60)) for r in (0, 1)]
        for loader in again:
            loader.load_state_dict(states[0])
        resumed = _pairs(again, [iter(loader) for loader in again], 3)
        for loader in again:
            loader.close()
        for rank in (0, 1):
            assert _same(resumed[rank], tail[rank]), rank

        # torchtitan would take 4 per step from a job that plans 2: refused at once.
        with pytest.raises(InvalidRequestError, match="batch.microbatches=2 per rank and step but torchtitan takes 4"):
            BatchplaneDataLoader(BatchplaneDataLoader.Config(microbatches_per_step=4, timeout_s=60), dp_world_size=2, dp_rank=0)
    finally:
        os.environ.pop("BATCHPLANE_ENDPOINTS", None)
        cluster.stop()


def test_a_token_budget_job_is_refused_at_its_first_step_with_more_microbatches(tmp_path, sources) -> None:
    config = write_job(
        tmp_path / "budget.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        balance={"method": "token_budget", "max_tokens": 48, "window_steps": 1},  # one step at a time: counts vary per step
        mesh={"dp": 2},
        run_dir=str(tmp_path / "budget"),
    )
    cluster = start_cluster(config)
    try:
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        counts = []  # what the job plans (at least batch.microbatches), read with plain clients
        with Client(rank=0, device=None, timeout_s=60) as a, Client(rank=1, device=None, timeout_s=60) as b:
            for batch, _ in zip(a, b):
                counts.append(len(batch["microbatches"]))
        first_other = next(step for step, n in enumerate(counts) if n != 2)
        loaders = [
            BatchplaneDataLoader(
                BatchplaneDataLoader.Config(microbatches_per_step=2, timeout_s=60),
                dp_world_size=2,
                dp_rank=r,
                client=Client(rank=r, device=None, timeout_s=60),
            )
            for r in (0, 1)
        ]
        iterators = [iter(loader) for loader in loaders]
        with pytest.raises(InvalidRequestError, match=f"step {first_other} of the batchplane job has {counts[first_other]} microbatches"):
            _pairs(loaders, iterators, 2 * len(counts))
        # Every step before it was handed out whole; none of the refused step was.
        state = loaders[0].state_dict()["dp_rank_0"]
        assert (state["next_step"], state["microbatch"]) == (first_other, 0)
        for loader in loaders:
            loader.close()
    finally:
        os.environ.pop("BATCHPLANE_ENDPOINTS", None)
        cluster.stop()
