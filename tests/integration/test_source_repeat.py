"""A finite job whose small source has `repeat: 2`, as real processes on 127.0.0.1: every row of
the small source arrives exactly twice (once per pass, byte-identical to its Parquet row), every
row of the other source exactly once; the planner counts the moment each source runs out and
GetStatus and the metrics report the drift against the configured mixture."""

from __future__ import annotations

import collections
import json
import pathlib

import pytest
from harness import collect, scrape, skewed_lengths, start_cluster, wait_until, write_job, write_source

pytestmark = pytest.mark.integration


def test_a_source_with_repeat_2_arrives_exactly_twice_per_epoch(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    sources = [
        write_source(data, "web", skewed_lengths(240, seed=1, long=120), files=2, row_group_size=40, seed=1),
        write_source(data, "small", skewed_lengths(40, seed=2, long=120), files=1, row_group_size=10, seed=2),
    ]
    job = write_job(
        tmp_path / "job.yaml",
        sources,
        sources=[{"name": "web", "path": str(sources[0].path)}, {"name": "small", "path": str(sources[1].path), "repeat": 2}],
        mixture={"weights": {"web": 1, "small": 1}},
    )
    cluster = start_cluster(job)
    try:
        batches, _ = collect(cluster.endpoints_path, range(2))
        wait_until(lambda: cluster.status().finished, timeout_s=10, what="the planner to see every rank finished")
        status = cluster.status()
        planner = scrape(json.loads(cluster.endpoints_path.read_text())["metrics"]["planner"])
    finally:
        cluster.stop()
    seen = collections.Counter()
    passes = collections.defaultdict(set)
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                for i, (source, row, epoch) in enumerate(
                    zip(mb["sample_source"].tolist(), mb["sample_row"].tolist(), mb["sample_epoch"].tolist())
                ):
                    seen[(source, row)] += 1
                    passes[(source, row)].add(epoch)
                    length = int(mb["sample_length"][i])
                    assert mb["input_ids"][i, :length].tobytes() == sources[source].rows[row].tobytes()
    assert {key: n for key, n in seen.items() if key[0] == 0} == {(0, r): 1 for r in range(240)}
    assert {key: n for key, n in seen.items() if key[0] == 1} == {(1, r): 2 for r in range(40)}
    # The sample's epoch is its pass over the source: passes 0 and 1 of job epoch 0.
    assert all(passes[(1, r)] == {0, 1} for r in range(40)) and all(passes[(0, r)] == {0} for r in range(240))
    assert [s.samples for s in status.sources] == [240, 80]
    # small's 2 x 40 samples last as long as web's first 80, then web takes the other 160 alone.
    # Against the renormalized target only the step it ran out in drifts (under one step's 12
    # samples); against the configured half of the 320 samples small is 80 short.
    assert abs(status.sources[1].samples - status.sources[1].target_samples) < 12
    assert status.sources[1].configured_samples == pytest.approx(160)
    assert status.sources[0].configured_samples == pytest.approx(160)
    assert planner['batchplane_planner_mixture_configured_drift_ratio{source="small"}'] == pytest.approx(-80 / 320)
    assert planner['batchplane_planner_source_exhausted_total{source="small"}'] == 1
    assert planner['batchplane_planner_source_exhausted_total{source="web"}'] == 1
