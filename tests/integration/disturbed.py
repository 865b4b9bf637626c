"""Disturbed runs for the integration tests: parts of a running data plane killed (SIGKILL) at
chosen steps while paced trainers take batches, and the outcome compared with an undisturbed run
of the same job (the same batches per rank, the same plans in the ledger); and one killer of a
trainer's whole process tree (torchrun and its workers), and one waiter for it that says where
it hung."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from harness import TRAINER_TIMEOUT_S, Batch, assert_same_batches, collect, ledger_records, running_cluster, wait_until

from batchplane.launcher.local import LocalCluster, ServiceProcess


@dataclasses.dataclass(frozen=True)
class Run:
    """What the trainers of one run received, per rank, and the run's folder (its ledger)."""

    batches: dict[int, list[Batch]]
    run_dir: pathlib.Path


@dataclasses.dataclass(frozen=True)
class Kill:
    """Once every rank has taken step `at`: SIGKILL the part named `name` (a `LocalCluster`
    process name: "planner", "loader-0", "constructor-1", ...) and, with `restart`, start it again
    on its address as `batchplane up` does. The ranks wait after step `at` until the part is dead
    (not until it is back): a restart before it, slow on a loaded machine, cannot push a kill past
    the end of the run."""

    at: int
    name: str
    restart: bool = True


@dataclasses.dataclass(frozen=True)
class Act:
    """Once every rank has taken step `at`: `act(cluster)` (a scale-out, say; its result is
    kept). With `hold`, the ranks wait after step `at` until it is done (a long training step),
    so that later items still come mid-run however long it takes."""

    at: int
    act: Callable[[LocalCluster], object]
    hold: bool = False


@dataclasses.dataclass(frozen=True)
class Killed:
    """What a `Kill` did: the step each rank had taken once its part was dead, and the process
    started in its place (the dead one where it was not restarted)."""

    kill: Kill
    progress: dict[int, int]
    process: ServiceProcess

    @property
    def at(self) -> int:
        """The step every rank had taken when the part died."""
        return min(self.progress.values())


@dataclasses.dataclass(frozen=True)
class DisturbedRun(Run):
    """A `Run`, what each of its kills did and what each of its acts returned, in schedule order."""

    killed: list[Killed]
    acted: list[object]


Schedule = Sequence[Kill | Act]


def undisturbed_run(config: pathlib.Path, ranks: Sequence[int]) -> Run:
    """Runs the job of `config` to its end on a cluster of its own, one client per rank."""
    with running_cluster(config) as cluster:
        batches, _ = collect(cluster.endpoints_path, ranks)
    return Run(batches, cluster.run_dir)


def disturb(
    cluster: LocalCluster,
    ranks: Sequence[int],
    schedule: Schedule | Callable[[LocalCluster], Schedule],
    *,
    step_s: float,
    lockstep: bool = False,
) -> DisturbedRun:
    """Runs `cluster`'s job to its end with one paced client per rank (each step takes `step_s`;
    with `lockstep`, ranks wait for each other every step as data-parallel ranks all-reduce)
    while a killer thread carries out `schedule` (or the schedule `schedule(cluster)` draws) in
    step order (items at the same step in the order given).

    Raises:
        The killer's error where it failed; AssertionError where a kill was not done.
    """
    planned = schedule(cluster) if callable(schedule) else schedule
    reached = threading.Condition()
    barrier = threading.Barrier(len(ranks), timeout=120) if lockstep else None
    progress = dict.fromkeys(ranks, -1)
    finished = threading.Event()  # the trainers are done: a kill still waiting never comes
    holds = sorted(item.at for item in planned if isinstance(item, Kill) or item.hold)  # not done yet
    killed: list[Killed] = []
    acted: list[object] = []
    failures: list[BaseException] = []

    def paced(rank: int, batch: dict) -> None:
        time.sleep(step_s)  # a trainer's step
        if barrier is not None:
            barrier.wait()
        with reached:
            progress[rank] = batch["step"]
            reached.notify_all()
            assert reached.wait_for(lambda: not holds or holds[0] > batch["step"], timeout=120), f"held at step {batch['step']} for ever"

    def killer() -> None:
        try:
            for item in sorted(planned, key=lambda item: item.at):
                with reached:
                    reached.wait_for(lambda: finished.is_set() or min(progress.values()) >= item.at, timeout=120)
                    assert min(progress.values()) >= item.at, f"the run ended or stalled before every rank reached step {item.at}"
                if isinstance(item, Act):
                    acted.append(item.act(cluster))
                    if item.hold:
                        with reached:
                            holds.remove(item.at)
                            reached.notify_all()
                    continue
                victim = next(p for p in cluster.processes if p.name == item.name)
                kill(victim)
                with reached:
                    at = dict(progress)
                    holds.remove(item.at)
                    reached.notify_all()
                killed.append(Killed(item, at, cluster.restart(victim) if item.restart else victim))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failures.append(exc)
            with reached:  # let the ranks go on to the end
                holds.clear()
                reached.notify_all()

    thread = threading.Thread(target=killer, name="killer")
    thread.start()
    try:
        batches, _ = collect(cluster.endpoints_path, ranks, on_batch=paced)
    finally:
        with reached:
            finished.set()
            reached.notify_all()
        thread.join(timeout=120)
    if failures:
        raise failures[0]
    assert len(killed) == sum(isinstance(item, Kill) for item in planned), "the run ended before every kill"
    return DisturbedRun(batches, cluster.run_dir, killed, acted)


def assert_same_run(got: Run, expected: Run) -> None:
    """`got` planned the same steps as `expected` (its ledger, without the timing fields) and
    every rank received the same steps with byte-identical tensors (I2, I4)."""
    planned = {r["step"]: r for r in ledger_records(got.run_dir)}
    undisturbed = {r["step"]: r for r in ledger_records(expected.run_dir)}
    assert planned == undisturbed, "the disturbed run planned other steps"
    assert_same_batches(got.batches, expected.batches)


def kill(process: ServiceProcess) -> None:
    """SIGKILLs one part of a cluster (nothing pending is flushed) and reaps it."""
    process.popen.send_signal(signal.SIGKILL)
    process.popen.wait()


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILLs `proc` and every process below it, each one's process group too (torchrun starts
    every worker in a session of its own, so killing torchrun's group alone would leave the
    workers training), as when a trainer's node dies; returns their pids once none is left. Of
    a `proc` that has exited already, only its process group is left to kill.
    """
    pids = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else [proc.pid]  # before the kill: orphans leave the tree
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a no-op error for a pid that leads no group
    for pid in pids[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()  # a no-op once it was reaped: its pid may be another process's by now
    proc.wait(timeout=30)
    wait_until(lambda: not any(running(pid) for pid in pids[1:]), timeout_s=30, what="every process of the killed trainer to be gone")
    return pids


def wait_trainer(proc: subprocess.Popen, log: pathlib.Path, *, timeout_s: float = TRAINER_TIMEOUT_S) -> int:
    """Waits for a trainer's process tree (`proc`, started with its output in `log`) to end and
    returns its exit code, killing the tree however the wait ends. One still running after
    `timeout_s` fails the test with where every process of it stood: each is sent SIGABRT, on
    which Python's faulthandler (PYTHONFAULTHANDLER, set for every process the tests start)
    prints every thread's stack into `log`, whose end the failure shows."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pids = [proc.pid, *descendants(proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(AssertionError):  # each aborts once its stacks are written
            wait_until(
                lambda: not any(running(pid) for pid in pids[1:]) and proc.poll() is not None,
                timeout_s=10,
                what="the aborted processes to end",
            )
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} ran past {timeout_s:.0f} s; its output ends:\n{log.read_text(errors='replace')[-20000:]}"
        ) from None
    finally:
        kill_tree(proc)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children[int(stat.rpartition(")")[2].split()[1])].append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped by another parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
