"""Kill and resume, as on a cluster: two trainers under `torchrun --nproc_per_node 2` (gloo, CPU)
train over `Client()` and checkpoint every 5 steps; the whole job (torchrun and both workers) is
SIGKILLed mid-run after a checkpoint exists while the data plane keeps running; torchrun started
again restores the latest complete checkpoint into every rank and trains to the end. The
resumed run starts at the checkpoint's step and receives what an uninterrupted run of the same
job (another run folder) received, tensor for tensor, with the same losses; what was trained
before the checkpoint and after the restart covers the epoch exactly once.

Two checkpoint formats: torch.distributed.checkpoint with the client itself as a Stateful
(`dcp.save({"model", "optim", "data": client})`), and a plain `torch.save` by rank 0 alone that
every rank loads (as Hugging Face Trainer, Lightning and accelerate save).
Real processes (tests/integration/trainers/dcp_trainer.py)."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

import pytest
from disturbed import kill_tree, wait_trainer
from harness import start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration

TRAINER = pathlib.Path(__file__).parent / "trainers" / "dcp_trainer.py"
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
SAMPLES = 240
STEPS = SAMPLES // 8
EVERY = 5


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return [
        write_source(root, "web", [4 + i % 29 for i in range(140)], row_group_size=20, seed=1),
        write_source(root, "code", [3 + i % 17 for i in range(100)], row_group_size=20, seed=2),
    ]


def job(folder: pathlib.Path, sources, name: str) -> pathlib.Path:
    return write_job(
        folder / f"{name}.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        mesh={"dp": 2},
        constructors={"prefetch_steps": 2},
        run_dir=str(folder / name),
    )


def torchrun(endpoints: pathlib.Path, out: pathlib.Path, ckpt: pathlib.Path, fmt: str, *extra: str) -> subprocess.Popen:
    """Starts `torchrun --standalone` (a free port for its rendezvous) in a session of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["BATCHPLANE_ENDPOINTS"] = str(endpoints)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "torchrun.log", "w") as log:
        return subprocess.Popen(
            [
                str(TORCHRUN),
                "--standalone",
                "--nproc_per_node",
                "2",
                str(TRAINER),
                "--out",
                str(out),
                "--ckpt",
                str(ckpt),
                "--format",
                fmt,
                "--every",
                str(EVERY),
                *extra,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def alive(pids: list[int]) -> list[int]:
    live = []
    for pid in pids:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.append(pid)
    return live


def run_to_end(proc: subprocess.Popen, out: pathlib.Path) -> None:
    code = wait_trainer(proc, out / "torchrun.log")
    assert code == 0, f"torchrun exited with {code}:\n{(out / 'torchrun.log').read_text()[-4000:]}"


def read_lines(out: pathlib.Path, rank: int) -> list[dict]:
    """The rank's step lines; a last line cut by the kill is left out."""
    path = out / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    found = []
    for text in path.read_text().splitlines():
        try:
            found.append(json.loads(text))
        except json.JSONDecodeError:
            pass
    return found


def latest_checkpoint(ckpt: pathlib.Path, fmt: str) -> int:
    if fmt == "dcp":
        steps = [int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / ".metadata").is_file()]
    else:
        steps = [int(p.stem.split("-")[1]) for p in ckpt.glob("step-*.pt")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sources) -> dict[int, list[dict]]:
    """An uninterrupted run of the same job in another run folder."""
    folder = tmp_path_factory.mktemp("reference")
    cluster = start_cluster(job(folder, sources, "reference"))
    try:
        run_to_end(torchrun(cluster.endpoints_path, folder / "out", folder / "ckpt", "dcp"), folder / "out")
    finally:
        cluster.stop()
    lines = {r: read_lines(folder / "out", r) for r in (0, 1)}
    assert [b["step"] for b in lines[0]] == [b["step"] for b in lines[1]] == list(range(STEPS))
    return lines


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_a_job_killed_mid_run_resumes_from_its_latest_checkpoint_with_nothing_lost_or_repeated(tmp_path, sources, reference, fmt) -> None:
    cluster = start_cluster(job(tmp_path, sources, "run"))
    first_out, second_out, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    try:
        first = torchrun(cluster.endpoints_path, first_out, ckpt, fmt, "--step-sleep-s", "0.15")
        try:
            # Mid-run, with a checkpoint behind it: two steps past a checkpoint of step >= 10.
            def ready() -> bool:
                assert first.poll() is None, (first_out / "torchrun.log").read_text()[-4000:]
                k = latest_checkpoint(ckpt, fmt)
                return k >= 10 and max((b["step"] for b in read_lines(first_out, 0)), default=-1) >= k + 1

            wait_until(ready, timeout_s=90, what="the first run to train two steps past a checkpoint")
        finally:
            pids = kill_tree(first)
        wait_until(lambda: not alive(pids), timeout_s=10, what="every process of the killed job to be gone")
        assert not list(first_out.glob("done*.json")), "the first run ended before it was killed"
        checkpoint = latest_checkpoint(ckpt, fmt)
        killed_after = {r: max(b["step"] for b in read_lines(first_out, r)) for r in (0, 1)}

        run_to_end(torchrun(cluster.endpoints_path, second_out, ckpt, fmt), second_out)
    finally:
        cluster.stop()

    first_lines = {r: read_lines(first_out, r) for r in (0, 1)}
    second_lines = {r: read_lines(second_out, r) for r in (0, 1)}
    for rank in (0, 1):
        resumed = json.loads((second_out / f"resumed{rank}.json").read_text())
        assert resumed["checkpoint"] == checkpoint and resumed["state"]["next_step"] == checkpoint
        if fmt == "torch":
            assert resumed["state_of_rank"] == 0  # rank 0's state restored rank 1 too
        # (a) The resumed run starts at the checkpoint's step and gets what the uninterrupted
        # run got for the same steps: the same samples, the same tensors, the same losses.
        assert [b["step"] for b in second_lines[rank]] == list(range(checkpoint, STEPS))
        assert first_lines[rank][:checkpoint] == reference[rank][:checkpoint]
        assert second_lines[rank] == reference[rank][checkpoint:], rank
    # (b) Trained before the checkpoint plus trained after the restart: every sample once.
    seen = collections.Counter()
    for rank in (0, 1):
        for b in first_lines[rank][:checkpoint] + second_lines[rank]:
            seen.update(tuple(s) for mb in b["samples"] for s in mb)
    replayed = sum(len(mb) for r in (0, 1) for b in first_lines[r][checkpoint:] for mb in b["samples"])
    print(
        f"{fmt}: killed after steps {killed_after}, resumed at {checkpoint}; samples delivered {sum(seen.values())} "
        f"of {SAMPLES}, distinct {len(seen)}, lost {SAMPLES - len(seen)}, repeated {sum(n - 1 for n in seen.values())}; "
        f"trained after the checkpoint before the kill and served again: {replayed}"
    )
    assert len(seen) == SAMPLES and sum(seen.values()) == SAMPLES
