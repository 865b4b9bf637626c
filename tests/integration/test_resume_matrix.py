"""Exact resume across one change at a time, with real processes: a job checkpointed by its
clients after k steps restarts with fewer data-parallel ranks, another number of loaders, or
another CP/TP/PP layout, and the epoch continues at step k with no sample lost and none repeated
(I1 over both runs), every rank on the same steps, re-planned from the durable ledger's record of
step k - 1; the planner names the groups of settings that changed."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from harness import run_ranks, SourceData, skewed_lengths, start_cluster, write_job, write_source

from batchplane.client import Client
from batchplane.core.mesh import ClientPlaceTree

pytestmark = pytest.mark.integration

#: Steps the first run delivers before its clients checkpoint.
STOP_AFTER = 3
RESUME_LINE = re.compile(
    r"resumes at step (\d+) from the ledger's record of step (\d+) \(generation \d+\)(?:; changed since: ([a-z, ]+), re-planned)?"
)


@dataclasses.dataclass(frozen=True)
class Delivery:
    """What one rank received at one step: its place in the mesh and the (source, row) of every
    sample it got, over its microbatches."""

    step: int
    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    samples: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the job: deliveries per rank, each client's final state_dict and what it said
    it resumed across."""

    mesh: Mapping[str, int]
    deliveries: dict[int, list[Delivery]]
    states: dict[int, dict]
    resumed_across: dict[int, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Resume:
    """Both runs of a resumed job and what the second run's planner logged about it."""

    first: Run
    second: Run
    resumed_at: int
    record_of: int
    changed: tuple[str, ...]


def _sources(root: pathlib.Path, sizes: Sequence[int]) -> list[SourceData]:
    return [
        write_source(root / "data", name, skewed_lengths(n, seed=20 + k, long=300), seed=20 + k)
        for k, (name, n) in enumerate(zip("abc", sizes))
    ]


def _mesh(settings: Mapping[str, int]) -> ClientPlaceTree:
    return ClientPlaceTree(**{axis: settings.get(axis, 1) for axis in ("pp", "dp", "cp", "tp")})


def _collect(
    endpoints: pathlib.Path,
    mesh: Mapping[str, int],
    *,
    states: Mapping[int, dict] | None = None,
    stop_after: int | None = None,
) -> Run:
    """Runs one client per rank of `mesh` concurrently (every rank must fetch for steps to
    advance) until the end of data or `stop_after` batches each, checking that each batch says
    where its rank sits in the mesh."""
    tree = _mesh(mesh)
    addresses = json.loads(endpoints.read_text())["constructors"]
    deliveries: dict[int, list[Delivery]] = {}
    final_states: dict[int, dict] = {}
    resumed_across: dict[int, tuple[str, ...]] = {}

    def run(rank: int) -> None:
        with Client(addresses[str(rank)], rank=rank, timeout_s=60) as client:
            if states is not None:
                client.load_state_dict(states[rank])
            out = []
            for batch in client:
                place = (batch["rank"], batch["pp_rank"], batch["dp_rank"], batch["cp_rank"], batch["tp_rank"])
                c = tree.coords(rank)
                assert place == (rank, c.pp, c.dp, c.cp, c.tp), f"rank {rank} at step {batch['step']} says it is at {place}"
                samples = tuple(
                    (int(k), int(r))
                    for mb in batch["microbatches"]
                    for k, r in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())
                )
                out.append(Delivery(batch["step"], rank, c.pp, c.dp, c.cp, c.tp, samples))
                if stop_after is not None and len(out) >= stop_after:
                    break
            deliveries[rank] = out
            final_states[rank] = client.state_dict()
            resumed_across[rank] = client.resumed_across

    run_ranks(run, range(tree.world))
    assert set(deliveries) == set(range(tree.world)), f"clients of ranks {sorted(set(range(tree.world)) - set(deliveries))} never finished"
    return Run(mesh, deliveries, final_states, resumed_across)


def _job(path: pathlib.Path, sources: Sequence[SourceData], *, run_dir: pathlib.Path, settings: Mapping[str, Any]) -> pathlib.Path:
    return write_job(
        path,
        sources,
        run_dir=str(run_dir),
        batch={"global_batch_size": 12, "microbatches": 2, "token_dtype": "int32"},
        **settings,
    )


def _resume(
    tmp_path: pathlib.Path,
    sources: Sequence[SourceData],
    first: Mapping[str, Any],
    second: Mapping[str, Any],
    *,
    state_of: int | None = None,
) -> Resume:
    """Runs the job with the `first` settings for STOP_AFTER steps, then restarts it on the same
    run folder with the `second` settings from the clients' checkpoints: each rank's own state,
    or the state of first-run rank `state_of` on every rank (a topology change)."""
    run_dir = tmp_path / "run"
    cluster = start_cluster(_job(tmp_path / "first.yaml", sources, run_dir=run_dir, settings=first))
    try:
        first_run = _collect(cluster.endpoints_path, first["mesh"], stop_after=STOP_AFTER)
    finally:
        cluster.stop()
    assert {s["next_step"] for s in first_run.states.values()} == {STOP_AFTER}

    planner_log = run_dir / "logs" / "planner.log"
    first_log_bytes = planner_log.stat().st_size
    world = _mesh(second["mesh"]).world
    states = {r: first_run.states[r if state_of is None else state_of] for r in range(world)}
    cluster = start_cluster(_job(tmp_path / "second.yaml", sources, run_dir=run_dir, settings=second))
    try:
        second_run = _collect(cluster.endpoints_path, second["mesh"], states=states)
    finally:
        cluster.stop()
    with open(planner_log, "rb") as f:
        f.seek(first_log_bytes)
        second_log = f.read().decode(errors="replace")
    found = RESUME_LINE.findall(second_log)
    assert len(found) == 1, f"expected one resume line in the second run's planner log, got {found}:\n{second_log[-3000:]}"
    resumed_at, record_of, changed = found[0]
    return Resume(first_run, second_run, int(resumed_at), int(record_of), tuple(g for g in changed.split(", ") if g))


def _identities(run: Run) -> list[tuple[int, int]]:
    """(source, row) of every sample a run delivered, once per DP replica: from the ranks at
    cp = tp = pp = 0, which carry whole samples (CP peers get slices of the same samples, TP
    peers copies, later pipeline stages their part)."""
    return [sample for deliveries in run.deliveries.values() for d in deliveries if (d.cp, d.tp, d.pp) == (0, 0, 0) for sample in d.samples]


def _check(resume: Resume, sources: Sequence[SourceData], *, changed: tuple[str, ...]) -> None:
    """The assertions every case shares: resumed at STOP_AFTER from the record of the step
    before across exactly `changed`, both runs step-aligned on every rank, every DP replica
    present once per step, and every sample of the epoch delivered exactly once over both runs."""
    assert (resume.resumed_at, resume.record_of) == (STOP_AFTER, STOP_AFTER - 1)
    assert resume.changed == changed
    assert set(resume.second.resumed_across.values()) == {changed}

    for run, first_step in ((resume.first, 0), (resume.second, STOP_AFTER)):
        steps = {rank: [d.step for d in ds] for rank, ds in run.deliveries.items()}
        assert len({tuple(s) for s in steps.values()}) == 1, f"ranks of mesh {dict(run.mesh)} got different steps: {steps}"
        assert steps[0] and steps[0] == list(range(first_step, first_step + len(steps[0])))
        replicas = collections.defaultdict(list)
        for ds in run.deliveries.values():
            for d in ds:
                if (d.cp, d.tp, d.pp) == (0, 0, 0):
                    replicas[d.step].append(d.dp)
        assert {s: sorted(r) for s, r in replicas.items()} == {s: list(range(run.mesh["dp"])) for s in steps[0]}
    assert resume.first.deliveries[0][-1].step == STOP_AFTER - 1

    delivered = collections.Counter(_identities(resume.first) + _identities(resume.second))
    repeated = sorted(sample for sample, n in delivered.items() if n > 1)
    assert not repeated, f"delivered more than once: {repeated[:20]}"
    expected = {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))}
    assert not expected - set(delivered), f"never delivered: {sorted(expected - set(delivered))[:20]}"
    assert set(delivered) <= expected, f"not in the data: {sorted(set(delivered) - expected)[:20]}"


@pytest.mark.parametrize(("dp_before", "dp_after"), [(4, 2), (2, 3)])
def test_a_data_parallel_resize_loses_and_repeats_nothing(tmp_path: pathlib.Path, dp_before: int, dp_after: int) -> None:
    sources = _sources(tmp_path, [60, 48])
    resume = _resume(
        tmp_path,
        sources,
        {"mesh": {"dp": dp_before}, "constructors": {"ranks_per_constructor": 2}},
        {"mesh": {"dp": dp_after}, "constructors": {"ranks_per_constructor": 2}},
        state_of=dp_before - 1,
    )
    _check(resume, sources, changed=("topology",))


@pytest.mark.parametrize(("loaders_before", "loaders_after"), [(1, 3), (3, 2)])
def test_another_loader_count_loses_and_repeats_nothing(tmp_path: pathlib.Path, loaders_before: int, loaders_after: int) -> None:
    # The loader count is in no fingerprint group: the planner resumes from its ledger and names
    # no change, and each rank loads its own state.
    sources = _sources(tmp_path, [40, 50, 45])
    resume = _resume(
        tmp_path,
        sources,
        {"mesh": {"dp": 2}, "loaders": {"count": loaders_before}},
        {"mesh": {"dp": 2}, "loaders": {"count": loaders_after}},
    )
    _check(resume, sources, changed=())


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"dp": 2, "cp": 1, "tp": 1, "pp": 1}, {"dp": 2, "cp": 2, "tp": 2, "pp": 1}),
        ({"dp": 2, "pp": 1}, {"dp": 2, "pp": 2}),
        ({"dp": 2, "cp": 2, "pp": 2}, {"dp": 2, "tp": 2}),
    ],
    ids=["cp-tp-added", "pp-added", "cp-pp-to-tp"],
)
def test_another_cp_tp_pp_layout_loses_and_repeats_nothing(tmp_path: pathlib.Path, before: dict, after: dict) -> None:
    sources = _sources(tmp_path, [50, 40])
    resume = _resume(
        tmp_path,
        sources,
        {"mesh": before, "constructors": {"ranks_per_constructor": 4}},
        {"mesh": after, "constructors": {"ranks_per_constructor": 4}},
        state_of=1,
    )
    _check(resume, sources, changed=("topology",))
