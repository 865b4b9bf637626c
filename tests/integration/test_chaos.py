"""Chaos: a seeded harness SIGKILLs a random loader, a constructor and the planner (each at least
once, one at a time) at random steps of a job of a few hundred steps with two DP ranks and four
sources, and restarts each on its address as `batchplane up` does; one seed runs the loaders
with shadows, so a killed loader may be replaced by its shadow or be a shadow. The trainers must not notice
anything but a wait: compared with an undisturbed run of the same job, the planner plans the same
sequence of steps (its ledger), every sample is delivered exactly once (I1), every rank takes the
same steps (I2) and receives byte-identical tensors (I4)."""

from __future__ import annotations

import pathlib
import random
import re
import signal
import threading
import time

import pytest
from harness import assert_same_batches, collect, ledger_records, sample_ids, skewed_lengths, start_cluster, write_job, write_source

from batchplane.launcher.local import LocalCluster

pytestmark = pytest.mark.integration

#: (seed, loaders.shadow); seed 210 kills the planner, then a constructor before it rejoined
RUNS = ((5, False), (17, False), (23, True), (210, True))
RANKS = (0, 1)


def _job(root: pathlib.Path, sources, run: str, *, shadow: bool = False) -> pathlib.Path:
    return write_job(
        root / f"{run}.yaml", sources, run_dir=str(root / run),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        loaders={"count": 2, "read_ahead_samples": 40, "shuffle": {"window_row_groups": 2}, "shadow": shadow},
        constructors={"prefetch_steps": 2},
    )


def _schedule(rng: random.Random, cluster: LocalCluster, steps: int) -> list[tuple[int, str]]:
    """(step, process name) of each kill, in step order: the planner, a random constructor and a
    random loader, then one more of any kind, at distinct steps spread over the run."""
    victims = ["planner", rng.choice(cluster.constructors).name, rng.choice(cluster.loaders).name]
    victims.append(rng.choice([p.name for p in cluster.processes]))
    rng.shuffle(victims)
    at = sorted(rng.sample(range(8, steps - 80, 8), len(victims)))  # spread: a restart takes up to a second
    return list(zip(at, victims))


@pytest.mark.parametrize(("seed", "shadow"), RUNS)
def test_killing_any_part_at_random_steps_changes_nothing_the_trainers_receive(tmp_path: pathlib.Path, seed: int, shadow: bool) -> None:
    sources = [
        write_source(tmp_path / "data", name, skewed_lengths(rows, seed=seed + i), row_group_size=10, seed=seed + i)
        for i, (name, rows) in enumerate([("web", 600), ("code", 500), ("books", 400), ("math", 300)])
    ]
    cluster = start_cluster(_job(tmp_path, sources, "undisturbed"))
    try:
        expected, _ = collect(cluster.endpoints_path, RANKS)
    finally:
        cluster.stop()
    steps = len(expected[0])
    assert steps >= 200, "the job should run a few hundred steps"

    cluster = start_cluster(_job(tmp_path, sources, "chaos", shadow=shadow))
    schedule = _schedule(random.Random(seed), cluster, steps)
    reached = threading.Condition()
    lockstep = threading.Barrier(len(RANKS), timeout=120)  # data-parallel ranks all-reduce every step
    progress = dict.fromkeys(RANKS, -1)
    kills: list[tuple[int, str, pathlib.Path]] = []
    failures: list[BaseException] = []

    def paced(rank: int, batch: dict) -> None:
        time.sleep(0.01)  # a trainer's step
        lockstep.wait()
        with reached:
            progress[rank] = batch["step"]
            reached.notify_all()

    def chaos() -> None:
        try:
            for step, name in schedule:
                with reached:
                    reached.wait_for(lambda: min(progress.values()) >= step, timeout=120)
                victim = next(p for p in cluster.processes if p.name == name)
                victim.popen.send_signal(signal.SIGKILL)
                victim.popen.wait()
                at = min(progress.values())
                kills.append((at, name, cluster.restart(victim).log_path))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failures.append(exc)

    killer = threading.Thread(target=chaos)
    try:
        killer.start()
        got, _ = collect(cluster.endpoints_path, RANKS, on_batch=paced)
        killer.join(timeout=120)
    finally:
        cluster.stop()
    if failures:
        raise failures[0]

    # Every kill happened mid-job and the restarted part recovered as designed.
    assert [name for _, name, _ in kills] == [name for _, name in schedule]
    for at, name, log_path in kills:
        assert at < steps - 1, f"{name} was killed after the last step"
        recovered = {"planner": r"resuming at step", "constructor": r"starting at step [1-9]", "loader": r"joined mid-job"}[name.split("-")[0]]
        assert re.search(recovered, log_path.read_text()), f"{name} killed at step {at} did not recover mid-job; see {log_path}"

    # The same plan sequence, step by step.
    planned = {r["step"]: r for r in ledger_records(tmp_path / "chaos")}
    undisturbed = {r["step"]: r for r in ledger_records(tmp_path / "undisturbed")}
    assert planned == undisturbed

    # Exactly once (I1), the same steps everywhere (I2), byte-identical tensors (I4).
    delivered = [sample for rank in RANKS for step in sample_ids(got[rank]) for mb in step for sample in mb]
    assert len(delivered) == len(set(delivered)) == sum(len(s.rows) for s in sources)
    assert_same_batches(got, expected)
