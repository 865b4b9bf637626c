"""The planner killed with SIGKILL mid-job and restarted on its address: loaders register again,
constructors rejoin at the steps they need, the planner resumes from its ledger, and the trainers
receive exactly what an undisturbed run delivers: the same steps, the same samples, byte-identical
tensors (I1, I2, I4)."""

from __future__ import annotations

import pathlib
import signal
import threading
import time

import numpy as np
import pytest
from harness import collect, skewed_lengths, start_cluster, write_job, write_source

pytestmark = pytest.mark.integration

KILL_AT = 6


def _job(root: pathlib.Path, sources, run: str) -> pathlib.Path:
    return write_job(root / f"{run}.yaml", sources, run_dir=str(root / run), batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"})


@pytest.mark.parametrize("seed", [0, 1])
def test_a_planner_killed_and_restarted_changes_nothing_the_trainers_receive(tmp_path: pathlib.Path, seed: int) -> None:
    sources = [
        write_source(tmp_path / "data", "a", skewed_lengths(120, seed=seed), seed=seed),
        write_source(tmp_path / "data", "b", skewed_lengths(90, seed=seed + 7), seed=seed + 7),
    ]
    cluster = start_cluster(_job(tmp_path, sources, "undisturbed"))
    try:
        expected, _ = collect(cluster.endpoints_path, [0, 1])
    finally:
        cluster.stop()

    cluster = start_cluster(_job(tmp_path, sources, "restarted"))
    reached = threading.Condition()
    progress = {0: -1, 1: -1}
    restarted = {}

    def paced(rank: int, batch: dict) -> None:
        time.sleep(0.03)
        with reached:
            progress[rank] = batch["step"]
            reached.notify_all()

    def kill_and_restart() -> None:
        with reached:
            reached.wait_for(lambda: min(progress.values()) >= KILL_AT + seed, timeout=60)
        planner = cluster.planner
        planner.popen.send_signal(signal.SIGKILL)
        planner.popen.wait()
        restarted["at"] = dict(progress)
        cluster.restart_planner()
        restarted["log"] = cluster.planner.log_path

    killer = threading.Thread(target=kill_and_restart)
    try:
        killer.start()
        got, _ = collect(cluster.endpoints_path, [0, 1], on_batch=paced)
        killer.join(timeout=60)
        log = restarted["log"].read_text()
    finally:
        cluster.stop()
    assert "resuming at step" in log, "the restarted planner did not resume mid-job"
    assert min(restarted["at"].values()) < len(expected[0]) - 1, "the kill came after the last step"
    for rank in (0, 1):
        assert [b["step"] for b in got[rank]] == [b["step"] for b in expected[rank]]
        for mine, theirs in zip(got[rank], expected[rank]):
            assert len(mine["microbatches"]) == len(theirs["microbatches"])
            for a, b in zip(mine["microbatches"], theirs["microbatches"]):
                assert a.keys() == b.keys()
                for name in a:
                    if isinstance(a[name], np.ndarray):
                        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), (rank, mine["step"], name)
