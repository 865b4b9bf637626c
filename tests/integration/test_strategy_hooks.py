"""The strategy's low-level hooks in real processes: loaders run loader_do_plan on what they
send, constructors run constructor_do_plan on what they build, and a hook that breaks the
plan stops the job with an error that names it instead of delivering wrong data."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
from harness import collect, scrape, skewed_lengths, start_cluster, write_job, write_source

from batchplane.client import DataPlaneError

pytestmark = pytest.mark.integration

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "strategies" / "llm_hooks.py"


def test_the_example_hooks_clip_tokens_in_loaders_and_add_loss_weights_in_constructors(tmp_path: pathlib.Path) -> None:
    sources = [
        write_source(tmp_path / "data", "a", skewed_lengths(60, seed=1, long=200), seed=1),
        write_source(tmp_path / "data", "b", skewed_lengths(40, seed=2, long=200), seed=2),
    ]
    strategy = tmp_path / "llm_hooks.py"
    shutil.copy(EXAMPLE, strategy)
    config = write_job(tmp_path / "job.yaml", sources, strategy=str(strategy), loaders={"count": 2})
    cluster = start_cluster(config)
    try:
        got, _ = collect(cluster.endpoints_path, [0, 1])
    finally:
        cluster.stop()
    seen = []
    clipped = 0
    for batches in got.values():
        for batch in batches:
            for mb in batch["microbatches"]:
                for b, (k, row, n) in enumerate(zip(mb["sample_source"], mb["sample_row"], mb["sample_length"])):
                    original = sources[k].rows[row]
                    expected = np.where(original < 32_000, original, 1)  # VOCAB_SIZE, UNK_ID
                    np.testing.assert_array_equal(mb["input_ids"][b, :n], expected)
                    np.testing.assert_array_equal(mb["labels"][b, : n - 1], expected[1:])  # labels follow the clipped tokens
                    clipped += int(np.sum(original >= 32_000))
                    seen.append((int(k), int(row)))
                weights = mb["loss_weights"]
                assert weights.dtype == np.float32 and weights.shape == mb["input_ids"].shape
                np.testing.assert_allclose(weights.sum(axis=1), (mb["sample_length"] > 1).astype(np.float32), rtol=1e-5)
    assert sorted(seen) == sorted((k, r) for k, s in enumerate(sources) for r in range(len(s.rows)))  # I1 with hooks on
    assert clipped > 0


BREAKING = """
import pyarrow as pa
from batchplane.planner import DGraph

def truncate(samples, plan):
    ids = [row[:2] for row in samples.column("input_ids").to_pylist()]
    return samples.set_column(2, "input_ids", pa.array(ids, pa.list_(pa.int32())))

def strategy(mesh):
    return DGraph().mix().loader_do_plan(truncate).plan()
"""


def test_a_loader_hook_that_changes_lengths_stops_the_job_naming_the_hook(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "a", [5] * 40, seed=4)]
    strategy = tmp_path / "breaking.py"
    strategy.write_text(BREAKING)
    config = write_job(tmp_path / "job.yaml", sources, strategy=str(strategy))
    cluster = start_cluster(config)
    try:
        with pytest.raises(
            DataPlaneError,
            match=r"loader_do_plan 'truncate' \(step 0\) changed the length of sample seq \d+ of source 'a' from 5 to 2 tokens",
        ):
            collect(cluster.endpoints_path, [0, 1])
        host = cluster.job.network.host
        failures = [
            scrape(f"http://{host}:{p.metrics_port}/metrics") for p in cluster.processes if p.name.startswith(("loader", "constructor"))
        ]
    finally:
        cluster.stop()
    assert sum(m.get("batchplane_loader_hook_failures_total", 0) for m in failures) >= 1
