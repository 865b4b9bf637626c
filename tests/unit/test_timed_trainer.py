"""The stand-in trainer (`batchplane.examples.timed_trainer`) leaves with the harness that started
it: killed mid-run, a bench would otherwise leave it retrying a data plane that is gone until its
deadline. Real processes: a parent that starts the trainer against endpoints that do not exist
(so its client keeps waiting), SIGKILLed; the trainer's state is read from /proc."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time


PARENT = """
import os, subprocess, sys, time
flags = [f.replace("PARENT", str(os.getpid())) for f in sys.argv[1:]]
child = subprocess.Popen([sys.executable, "-m", "batchplane.examples.timed_trainer", "--ranks", "0", "--timeout", "60", *flags])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's exit may wait for a reaper)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _orphaned_trainer(tmp_path: pathlib.Path, *flags: str) -> int:
    """Starts a parent that starts the trainer with `flags`, SIGKILLs the parent once the trainer
    runs, and returns the trainer's pid."""
    env = {**os.environ, "BATCHPLANE_ENDPOINTS": str(tmp_path / "no-endpoints.json")}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "--out", str(tmp_path / "steps.jsonl"), *flags], stdout=subprocess.PIPE, env=env
    )
    trainer = int(parent.stdout.readline())
    time.sleep(2.0)  # the trainer is up, its client waiting for a constructor
    assert _alive(trainer)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return trainer


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_the_trainer_exits_once_its_parent_is_killed(tmp_path: pathlib.Path) -> None:
    trainer = _orphaned_trainer(tmp_path, "--parent", "PARENT")
    assert _gone_within(trainer, 10.0), "the trainer outlived its parent by 10 s"


def test_without_the_flag_an_orphaned_trainer_keeps_waiting(tmp_path: pathlib.Path) -> None:
    """The control: what `--parent` prevents (the client would wait up to its 60 s deadline)."""
    trainer = _orphaned_trainer(tmp_path)
    try:
        assert not _gone_within(trainer, 3.0)
    finally:
        os.kill(trainer, signal.SIGKILL)


def test_the_benches_start_their_trainer_with_their_pid_as_its_parent(tmp_path: pathlib.Path) -> None:
    from types import SimpleNamespace

    from batchplane.bench.jobs import start_trainer

    cluster = SimpleNamespace(endpoints_path=tmp_path / "no-endpoints.json")
    trainer = start_trainer(cluster, [0], step_seconds=0, out=tmp_path / "steps.jsonl")  # type: ignore[arg-type]
    try:
        assert trainer.args[-2:] == ["--parent", str(os.getpid())]
    finally:
        trainer.kill()
        trainer.wait()
