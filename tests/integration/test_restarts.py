"""A planner, a constructor or a loader killed with SIGKILL mid-job and restarted on its address:
for the planner, loaders register again, constructors rejoin at the steps they need and it
resumes from its ledger; a constructor registers anew, builds its ranks' steps again from the
kept plans and the clients' retries reach it; a loader reads again, at once, the windows the
planner says constructors may still fetch. Either way the trainers receive exactly what an
undisturbed run delivers: the same steps, the same samples, byte-identical tensors (I1, I2, I4)."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable

import pytest
from disturbed import Kill, Run, assert_same_run, disturb, kill, undisturbed_run
from harness import (
    SourceData,
    assert_same_batches,
    collect,
    running_cluster,
    scrape,
    skewed_lengths,
    start_steps,
    wait_until,
    write_job,
    write_source,
)

pytestmark = pytest.mark.integration

# Past the first steps: a constructor takes up to fetch_steps (8) plans at once, and the records of
# the first ones are written before any rank was handed anything, so a planner killed there has
# a ledger that says "resume at 0" (its designed recovery, but not the mid-job one this checks).
KILL_AT = 12
HOLD_AT = 6


def _job(root: pathlib.Path, sources, run: str, *, windows: bool = False) -> pathlib.Path:
    # Windows of one 10-row group: loaders free them soon after a step is fetched, so a restarted
    # constructor finds its steps' samples only if nothing was released before its trainers had them.
    # With `windows`, token budgets planned 5 steps at a time: the restarted planner resumes from the
    # ledger, usually inside a window (which it plans again from the window's start).
    extra = {"balance": {"method": "token_budget", "max_tokens": 600, "window_steps": 5}} if windows else {}
    return write_job(
        root / f"{run}.yaml",
        sources,
        run_dir=str(root / run),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        loaders={"read_ahead_samples": 40 if windows else 20, "shuffle": {"window_row_groups": 1}},
        **extra,
    )


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, bool], tuple[list[SourceData], Run]]:
    """The sources of a seed and the undisturbed run of their job, made once per (seed, windows)
    and shared by the tests that kill a different part of the same job: (sources, run)."""
    made: dict[tuple[int, bool], tuple[list[SourceData], Run]] = {}

    def get(seed: int, windows: bool) -> tuple[list[SourceData], Run]:
        if (seed, windows) not in made:
            root = tmp_path_factory.mktemp(f"seed{seed}-windows{int(windows)}")
            sources = [
                # About 41 steps: longer than the planning window (25 steps by default), so
                # that the ledger's records follow the ranks (a job within one window is planned
                # and written whole before any rank was handed a step).
                write_source(root / "data", "a", skewed_lengths(240, seed=seed), row_group_size=10, seed=seed),
                write_source(root / "data", "b", skewed_lengths(90, seed=seed + 7), row_group_size=10, seed=seed + 7),
            ]
            made[seed, windows] = sources, undisturbed_run(_job(root, sources, "undisturbed", windows=windows), [0, 1])
        return made[seed, windows]

    return get


@pytest.mark.parametrize(
    ("part", "seed", "windows"),
    [
        ("planner", 0, False),
        ("planner", 1, False),
        ("constructor", 0, False),
        ("constructor", 1, False),
        ("loader", 0, False),
        ("loader", 1, False),
        ("planner", 1, True),
    ],
)
def test_a_part_killed_and_restarted_changes_nothing_the_trainers_receive(
    tmp_path: pathlib.Path,
    undisturbed: Callable[[int, bool], tuple[list[SourceData], Run]],
    part: str,
    seed: int,
    windows: bool,
) -> None:
    sources, expected = undisturbed(seed, windows)
    victim = {"planner": "planner", "constructor": "constructor-1", "loader": "loader-0"}[part]
    with running_cluster(_job(tmp_path, sources, "restarted", windows=windows)) as cluster:
        got = disturb(cluster, [0, 1], [Kill(KILL_AT + seed, victim)], step_s=0.03)
        started = start_steps(cluster, victim)
    (killed,) = got.killed
    # The restarted planner resumed mid-job, the constructor started past step 0 and the loader
    # restored its position (joined mid-job: a start step per source).
    assert started and min(started.values()) >= (0 if part == "loader" else 1), f"{victim} did not recover mid-job: {started}"
    assert killed.at < len(expected.batches[0]) - 1, "the kill came after the last step"
    assert_same_run(got, expected)


def test_a_restarted_constructor_serves_ranks_that_lag_each_other(tmp_path: pathlib.Path) -> None:
    """One constructor serves both ranks (ranks_per_constructor 2); rank 1 lags, so when the
    constructor is killed its ranks want different steps, and rank 0 reaches the restarted one
    first. Restarted, it starts at the oldest step either may ask for (the planner says), so the
    lagging rank finds its step."""
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(160, seed=3), row_group_size=10, seed=3)]

    def job(run: str) -> pathlib.Path:
        return write_job(
            tmp_path / f"{run}.yaml",
            sources,
            run_dir=str(tmp_path / run),
            batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
            constructors={"ranks_per_constructor": 2, "prefetch_steps": 3},
        )

    expected = undisturbed_run(job("undisturbed"), [0, 1]).batches
    progress = {0: -1, 1: -1}
    restarted = {}
    holding = threading.Event()  # rank 1 is between steps: it has not asked for its next one
    restarted_event = threading.Event()

    def uneven(rank: int, batch: dict) -> None:
        progress[rank] = batch["step"]
        if rank == 0:
            time.sleep(0.01)
        elif batch["step"] == HOLD_AT:  # hold while the constructor is killed and restarted,
            holding.set()
            assert restarted_event.wait(timeout=60)
            # and until rank 0's retries have reached the restarted one first (it builds once asked)
            metrics = f"http://127.0.0.1:{restarted['process'].metrics_port}/metrics"
            wait_until(
                lambda: scrape(metrics).get("batchplane_constructor_batches_built_total", 0) > 0, timeout_s=30, what="rank 0 to reach it"
            )

    def kill_and_restart() -> None:
        holding.wait(timeout=60)
        wait_until(lambda: progress[0] > HOLD_AT, timeout_s=30, what="rank 0 to run ahead of rank 1")
        victim = cluster.constructors[0]
        kill(victim)
        restarted["at"] = dict(progress)
        restarted["process"] = cluster.restart(victim)
        restarted_event.set()

    with running_cluster(job("restarted")) as cluster:
        killer = threading.Thread(target=kill_and_restart)
        killer.start()
        got, _ = collect(cluster.endpoints_path, [0, 1], on_batch=uneven)
        killer.join(timeout=60)
        started = start_steps(cluster, restarted["process"].name)
    assert restarted["at"][0] > restarted["at"][1] == HOLD_AT, "the ranks did not lag each other at the kill"
    assert len(started) == 1 and min(started.values()) >= 1, f"the restarted constructor did not start mid-job: {started}"
    assert_same_batches(got, expected)


def test_a_planner_restarted_after_the_constructors_had_the_last_step_finishes_the_job(tmp_path: pathlib.Path) -> None:
    """`batchplane up` stops once the planner says the job finished, and a restarted planner
    starts on a plan request. Restarted after every constructor was told where the data ends
    (here: after the trainers finished; with several steps per GetBatch call, often before), it
    gets no plan request from them for any later step: they ask for the end step while it has
    not started, so it learns the end again and that every rank was handed every step."""
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(64, seed=5), row_group_size=16, seed=5)]
    with running_cluster(_job(tmp_path, sources, "run")) as cluster:
        got, _ = collect(cluster.endpoints_path, [0, 1])
        wait_until(lambda: cluster.status().finished, timeout_s=30, what="the planner to see every rank finished")
        end = cluster.status().end_step
        cluster.restart_planner()
        wait_until(lambda: cluster.status().finished, timeout_s=30, what="the restarted planner to see the job finished")
        assert cluster.status().end_step == end == len(got[0])
