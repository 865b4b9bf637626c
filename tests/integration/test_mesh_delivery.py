"""End to end over a 2 x 2 x 2 (DP x CP x TP) mesh and a pipeline of two stages: eight real
client processes (one per rank, as torchrun starts them) against two constructors (two pods of
four GPUs), checking identity (I1), alignment (I2) and replication (I3) on what they received."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from batchplane.constructor.parallel import cp_columns
from batchplane.core.mesh import ClientPlaceTree
from harness import collect, sample_ids, scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration

CLIENT = os.path.join(os.path.dirname(__file__), "mesh_client.py")


def _run_clients(endpoints, world: int, out_dir) -> dict[int, list[dict]]:
    """Every rank's batches, read by one client process per rank (mesh_client.py forks them)."""
    env = {**os.environ, "BATCHPLANE_ENDPOINTS": str(endpoints)}
    proc = subprocess.run([sys.executable, CLIENT, str(out_dir), str(world)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {rank: pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(world)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("slicing", ["zigzag", "contiguous"])
def test_dp_cp_tp_mesh_delivers_every_sample_once_sliced_and_replicated(tmp_path, slicing: str) -> None:
    sources = [
        write_source(tmp_path / "data", "a", skewed_lengths(70, seed=1, long=300), seed=1),
        write_source(tmp_path / "data", "b", skewed_lengths(50, seed=2, long=300), seed=2),
    ]
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32", "pad_id": 0, "ignore_id": -100},
        mesh={"dp": 2, "cp": 2, "tp": 2},
        constructors={"ranks_per_constructor": 4, "cp_slicing": slicing},
    )
    mesh = ClientPlaceTree(dp=2, cp=2, tp=2)
    cluster = start_cluster(config)
    try:
        got = _run_clients(cluster.endpoints_path, mesh.world, tmp_path)
    finally:
        cluster.stop()

    # I2: every rank the same steps, and per step the same number of microbatches.
    steps = {rank: [b["step"] for b in batches] for rank, batches in got.items()}
    assert len({tuple(s) for s in steps.values()}) == 1 and steps[0] == list(range(len(steps[0])))
    for s in range(len(steps[0])):
        assert len({len(got[r][s]["microbatches"]) for r in got}) == 1

    seen = []
    for s in range(len(steps[0])):
        weight = 0.0
        for dp in range(2):
            for cp in range(2):
                peers = [got[int(r)][s] for r in mesh.ranks(dp=dp, cp=cp)]
                # I3: TP peers get identical tensors.
                for other in peers[1:]:
                    for mb, mb_other in zip(peers[0]["microbatches"], other["microbatches"]):
                        assert _same(mb, mb_other)
                assert peers[0]["dp_rank"] == dp and peers[0]["cp_rank"] == cp
                weight += peers[0]["loss_weight"]
            # CP peers: disjoint slices of the same samples; put together they restore them.
            slices = [got[mesh.rank(dp=dp, cp=cp)][s]["microbatches"] for cp in range(2)]
            for m, (first, second) in enumerate(zip(*slices)):
                assert np.array_equal(first["sample_row"], second["sample_row"])
                width = first["input_ids"].shape[1] * 2
                ids = np.zeros((first["input_ids"].shape[0], width), first["input_ids"].dtype)
                positions = np.zeros_like(ids)
                labels = np.zeros_like(ids)
                for cp, part in enumerate((first, second)):
                    columns = cp_columns(width, cp=2, rank=cp, mode=slicing)
                    ids[:, columns] = part["input_ids"]
                    positions[:, columns] = part["position_ids"]
                    labels[:, columns] = part["labels"]
                for b, (source, row, length) in enumerate(zip(first["sample_source"], first["sample_row"], first["sample_length"])):
                    tokens = sources[source].rows[row]
                    assert length == len(tokens)
                    assert np.array_equal(ids[b, :length], tokens)
                    assert np.array_equal(positions[b, :length], np.arange(length))
                    assert np.array_equal(labels[b, : length - 1], tokens[1:]) and labels[b, length - 1] == -100
                    seen.append((int(source), int(row)))
        # Token-level loss weights of a step sum to 1 over its DP and CP ranks.
        assert weight == pytest.approx(1.0, rel=1e-9)

    # I1: every sample of the finite epoch exactly once.
    expected = sorted((k, r) for k, s in enumerate(sources) for r in range(len(s.rows)))
    assert sorted(seen) == expected


def test_pipeline_stages_get_their_part_and_broadcast_peers_only_metadata(tmp_path) -> None:
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(48, seed=3), seed=3)]
    strategy = tmp_path / "strategy.py"
    strategy.write_text(
        "from batchplane.planner import DGraph\n\n"
        "def strategy(mesh):\n"
        "    g = DGraph('text')\n"
        "    g.mix()\n"
        "    g.distribute(axis='DP')\n"
        "    g.balance('token_budget', max_tokens=512, microbatches=1)\n"
        "    g.broadcast_at('TP')\n"
        "    return g.plan()\n"
    )
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"},
        mesh={"dp": 2, "tp": 2, "pp": 2},
        constructors={"ranks_per_constructor": 2},
        strategy=str(strategy),
    )
    mesh = ClientPlaceTree(dp=2, tp=2, pp=2)
    cluster = start_cluster(config)
    try:
        got = _run_clients(cluster.endpoints_path, mesh.world, tmp_path)
    finally:
        cluster.stop()
    seen = defaultdict(list)
    for rank, batches in got.items():
        c = mesh.coords(rank)
        for batch in batches:
            assert (batch["pp_rank"], batch["dp_rank"], batch["tp_rank"]) == (c.pp, c.dp, c.tp)
            for mb in batch["microbatches"]:
                names = {k for k, v in mb.items() if isinstance(v, np.ndarray)}
                if c.tp > 0:
                    assert names == set()  # the trainer broadcasts from tp 0
                elif c.pp == 0:
                    assert {"input_ids", "position_ids", "attention_mask"} <= names and "labels" not in names
                else:
                    assert {"labels", "loss_mask"} <= names and "input_ids" not in names
                if c.tp == 0 and c.pp == 0:
                    lengths = mb["sample_length"]
                    assert len(lengths) * int(lengths.max()) <= 512 or len(lengths) == 1  # the token budget
                    seen[batch["step"]] += [int(r) for r in mb["sample_row"]]
    # I2 under a token budget: the same number of microbatches on every rank of a step.
    for s in range(len(got[0])):
        assert len({len(got[r][s]["microbatches"]) for r in got}) == 1
    assert sorted(r for rows in seen.values() for r in rows) == list(range(48))  # I1


def test_megatron_style_partial_pulls_do_not_hold_the_ranks_that_ask(tmp_path) -> None:
    """Megatron-LM reads data only on tensor-parallel rank 0 of the first and last pipeline
    stages and broadcasts it. With constructors.pulling_ranks: megatron, a mesh of dp 2 x tp 2
    x pp 3 (three pods, one per stage) runs to the end with only ranks 0, 2 (first stage) and
    8, 10 (last stage) asking; with the default ("all"), the first pod would wait for its TP
    peers forever."""
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(96, seed=5, long=200), seed=5)]
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        mesh={"dp": 2, "tp": 2, "pp": 3},
        constructors={"ranks_per_constructor": 4, "pulling_ranks": "megatron"},
    )
    mesh = ClientPlaceTree(dp=2, tp=2, pp=3)
    pulling = [r for r in range(mesh.world) if mesh.coords(r).tp == 0 and mesh.coords(r).pp in (0, 2)]
    assert pulling == [0, 2, 8, 10]
    cluster = start_cluster(config)
    try:
        got, _ = collect(cluster.endpoints_path, pulling)
        wait_until(lambda: cluster.status().finished, timeout_s=30, what="the planner to count the job finished")
        middle = scrape(f"http://127.0.0.1:{cluster.constructors[1].metrics_port}/metrics")
    finally:
        cluster.stop()
    assert middle.get("batchplane_constructor_batches_built_total", 0) == 0  # a middle stage's pod builds nothing
    steps = {r: [b["step"] for b in got[r]] for r in pulling}
    assert len({tuple(s) for s in steps.values()}) == 1 and steps[0] == list(range(12))
    first_stage = [s for r in (0, 2) for step in sample_ids(got[r]) for mb in step for s in mb]
    assert sorted(first_stage) == sorted({s for s in first_stage}) and len(first_stage) == 96  # every sample once
    for r in (8, 10):  # the last stage gets labels and the same samples as its DP peer in the first
        first = got[r - 8]
        for mine, theirs in zip(got[r], first):
            for a, b in zip(mine["microbatches"], theirs["microbatches"]):
                assert "labels" in a and "input_ids" not in a
                assert np.array_equal(a["sample_row"], b["sample_row"])
