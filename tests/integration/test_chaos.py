"""Chaos: a seeded harness SIGKILLs a random loader, a constructor and the planner (each at least
once, one at a time) at random steps of a job of a few hundred steps with two DP ranks and four
sources (the same job for every seed, so its undisturbed run is made once), and restarts each on
its address as `batchplane up` does; one seed runs the loaders with shadows, so a killed loader may
be replaced by its shadow or be a shadow. The trainers must not notice anything but a wait:
compared with an undisturbed run of the same job, the planner plans the same sequence of steps (its
ledger), every sample is delivered exactly once (I1), every rank takes the same steps (I2) and
receives byte-identical tensors (I4)."""

from __future__ import annotations

import pathlib
import random

import pytest
from disturbed import Kill, Run, assert_same_run, disturb, undisturbed_run
from harness import SourceData, running_cluster, sample_ids, skewed_lengths, start_steps, write_job, write_source

from batchplane.launcher.local import LocalCluster

pytestmark = pytest.mark.integration

#: (seed, loaders.shadow, constructors.fetch_steps); seed 210 kills the planner, then a
#: constructor before it rejoined. The undisturbed run fetches 8 steps per loader call (the
#: default): how many a run fetches at once changes nothing the trainers receive.
RUNS = ((5, False, 1), (17, False, 8), (23, True, 2), (210, True, 4))
RANKS = (0, 1)
DATA_SEED = 5  # the sources' rows and lengths; the seeds of RUNS draw the kills


def _job(root: pathlib.Path, sources, run: str, *, shadow: bool = False, fetch_steps: int = 8) -> pathlib.Path:
    return write_job(
        root / f"{run}.yaml",
        sources,
        run_dir=str(root / run),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        loaders={"count": 2, "read_ahead_samples": 40, "shuffle": {"window_row_groups": 2}, "shadow": shadow},
        constructors={"prefetch_steps": 2, "fetch_steps": fetch_steps},
    )


#: Steps between two kills: more than the trainers can take while the part killed before is
#: away (constructors hold plans and samples for at most 2 x fetch_steps steps past the last
#: one built), so each kill comes once the part before has recovered. Closer kills overlap two
#: recoveries: a loader killed again while a restarted planner waits for its constructors to
#: rejoin registers before the job restarts, so the planner cannot tell it where the job stands
#: yet (it is positioned by the first summary asked for instead), which this test does not
#: check; seed 17 drew kills 8 steps apart and failed on that about one run in three.
KILL_SPACING = 32


def _schedule(rng: random.Random, cluster: LocalCluster, steps: int) -> list[Kill]:
    """The kills, in step order: the planner, a random constructor and a random loader, then one
    more of any kind, at distinct steps spread over the run."""
    victims = ["planner", rng.choice(cluster.constructors).name, rng.choice(cluster.loaders).name]
    victims.append(rng.choice([p.name for p in cluster.processes]))
    rng.shuffle(victims)
    at = sorted(rng.sample(range(8, steps - 80, KILL_SPACING), len(victims)))
    return [Kill(step, name) for step, name in zip(at, victims)]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[SourceData], Run]:
    """The job's four sources and its undisturbed run, made once: every seed disturbs the same job."""
    root = tmp_path_factory.mktemp("undisturbed")
    sources = [
        write_source(root / "data", name, skewed_lengths(rows, seed=DATA_SEED + i), row_group_size=10, seed=DATA_SEED + i)
        for i, (name, rows) in enumerate([("web", 600), ("code", 500), ("books", 400), ("math", 300)])
    ]
    return sources, undisturbed_run(_job(root, sources, "undisturbed"), RANKS)


@pytest.mark.parametrize(("seed", "shadow", "fetch_steps"), RUNS)
def test_killing_any_part_at_random_steps_changes_nothing_the_trainers_receive(
    tmp_path: pathlib.Path, undisturbed: tuple[list[SourceData], Run], seed: int, shadow: bool, fetch_steps: int
) -> None:
    sources, expected = undisturbed
    steps = len(expected.batches[0])
    assert steps >= 200, "the job should run a few hundred steps"

    with running_cluster(_job(tmp_path, sources, "chaos", shadow=shadow, fetch_steps=fetch_steps)) as cluster:
        schedule = _schedule(random.Random(seed), cluster, steps)
        got = disturb(cluster, RANKS, schedule, step_s=0.01, lockstep=True)  # data-parallel ranks all-reduce every step
        # Where each killed part's last process started: its own metrics, while it still runs.
        started = {k.kill.name: start_steps(cluster, k.kill.name) for k in got.killed}

    # Every kill happened mid-job and the restarted part recovered as designed: a planner resumed
    # the job and a constructor started building past step 0; a loader joined the job mid-way
    # (it has a start step, where the planner's ledger says the job stood).
    assert [k.kill.name for k in got.killed] == [k.name for k in schedule]
    for killed in got.killed:
        name = killed.kill.name
        assert killed.at < steps - 1, f"{name} was killed after the last step"
        first = 0 if name.startswith("loader") else 1
        assert started[name] and min(started[name].values()) >= first, (
            f"{name} killed at step {killed.at} did not recover mid-job: its start steps {started[name]}; see {killed.process.log_path}"
        )

    # The same plan sequence, step by step; the same steps everywhere (I2), byte-identical tensors (I4).
    assert_same_run(got, expected)

    # Exactly once (I1).
    delivered = [sample for rank in RANKS for step in sample_ids(got.batches[rank]) for mb in step for sample in mb]
    assert len(delivered) == len(set(delivered)) == sum(len(s.rows) for s in sources)
