"""Failure-transparent substitution in a real job (issue 16 point 3): separate planner, loader
and constructor processes over Parquet files with bad samples injected at seeded positions (an
unreadable row group, a transform that fails on one row group and rejects single rows, empty
token lists, samples over batch.max_length under "reject"). Ground truth is the files: every
good row is delivered exactly once, every step but the last has the planned number of samples
(less one for each bad sample whose source had run out, which the ledger says),
the ledger names each bad row with its reason and the row that stood in for it (delivered in
that step), `batchplane ledger find` shows both, a metric counts them, and a second run from
nothing plans the same substitutions."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import SourceData, collect, corrupt_row_group, ledger_records, scrape, start_cluster, write_job

pytestmark = pytest.mark.integration

USER_CODE = """
import pyarrow as pa
import pyarrow.compute as pc

def picky(batch, fail_doc, reject_docs):
    docs = batch.column("doc_id").to_pylist()
    if fail_doc in docs:
        raise RuntimeError(f"cannot parse document {fail_doc}")
    ids = batch.column("input_ids").to_pylist()
    return pa.table({"input_ids": pa.array([None if d in reject_docs else x for d, x in zip(docs, ids)], pa.list_(pa.int32()))})
"""

GLOBAL = 12
MAX_LENGTH = 64


def _source(root: pathlib.Path, name: str, n: int, *, seed: int) -> tuple[SourceData, set[int], dict[int, str]]:
    """n rows in two files of 20-row groups; returns the source, its empty rows and the reason
    each injected bad row will be given, by row."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 48, n)
    bad: dict[int, str] = {}
    for r in rng.choice(n, 6, replace=False):
        lengths[r] = 0
        bad[int(r)] = "empty"
    for r in rng.choice(sorted(set(range(n)) - set(bad)), 3, replace=False):
        lengths[r] = MAX_LENGTH + 10
        bad[int(r)] = "too_long"
    rows = [rng.integers(0, 1000, int(k)).astype(np.int32) for k in lengths]
    folder = root / name
    folder.mkdir(parents=True)
    half = n // 2
    for f, (lo, hi) in enumerate(((0, half), (half, n))):
        table = pa.table({"input_ids": pa.array(rows[lo:hi], pa.list_(pa.int32())), "doc_id": pa.array(np.arange(lo, hi), pa.int64())})
        pq.write_table(table, folder / f"part-{f:05d}.parquet", row_group_size=20, write_page_checksum=True)
    return SourceData(name, folder, rows), {r for r, why in bad.items() if why == "empty"}, bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("substitution")
    (root / "user_code.py").write_text(textwrap.dedent(USER_CODE))
    a, _, bad_a = _source(root / "data", "a", 200, seed=1)
    b, _, bad_b = _source(root / "data", "b", 160, seed=2)
    victim = a.path / "part-00001.parquet"
    first = pq.ParquetFile(a.path / "part-00000.parquet").metadata.num_rows
    rows = corrupt_row_group(victim, 2)
    bad_a.update({r: "unreadable" for r in range(first + 40, first + 40 + rows)})
    bad_b.update({r: "transform" for r in range(60, 80)})  # the row group holding doc 65
    for r in (3, 141):
        bad_b[r] = "rejected"
    sources = [
        {"name": "a", "path": str(a.path)},
        {
            "name": "b",
            "path": str(b.path),
            "transform": "user_code:picky",
            "transform_args": {"fail_doc": 65, "reject_docs": [3, 141]},
            "columns": ["input_ids", "doc_id"],
        },
    ]
    out = []
    for attempt in ("first", "second"):
        folder = root / attempt
        folder.mkdir()
        config = write_job(
            folder / "job.yaml",
            [a, b],
            sources=sources,
            loaders={"count": 1},
            batch={
                "global_batch_size": GLOBAL,
                "microbatches": 2,
                "token_dtype": "int32",
                "max_length": MAX_LENGTH,
                "length_policy": "reject",
            },
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", str(root))  # the loader imports the transform
            cluster = start_cluster(config)
        try:
            batches, _ = collect(cluster.endpoints_path, range(2))
            planner = scrape(json.loads(cluster.endpoints_path.read_text())["metrics"]["planner"])
        finally:
            cluster.stop()
        out.append(
            {
                "batches": batches,
                "records": ledger_records(cluster.run_dir),
                "metrics": planner,
                "config": config,
                "run_dir": cluster.run_dir,
            }
        )
    return {"a": a, "b": b, "bad": {0: bad_a, 1: bad_b}, "runs": out}


def _per_step(batches) -> list[list[tuple[int, int]]]:
    steps = collections.defaultdict(list)
    for rank in batches.values():
        for b in rank:
            for mb in b["microbatches"]:
                steps[b["step"]] += list(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist()))
    return [steps[s] for s in sorted(steps)]


def test_every_good_row_once_and_every_step_its_planned_size(runs) -> None:
    first = runs["runs"][0]
    steps = _per_step(first["batches"])
    seen = collections.Counter(pair for step in steps for pair in step)
    assert max(seen.values()) == 1, "nothing delivered twice"
    good = {(0, r) for r in range(200) if r not in runs["bad"][0]} | {(1, r) for r in range(160) if r not in runs["bad"][1]}
    assert set(seen) == good, "every good row of the files, none of the bad ones"
    for record in first["records"][:-1]:  # the end of data may cut the last step short
        without = sum(e["by"] is None and not e.get("passed_over") for e in record.get("substituted", []))  # its source had run out
        assert len(steps[record["step"]]) == GLOBAL - without, f"step {record['step']} keeps its {GLOBAL} samples"
    assert sum(e["by"] is None and not e.get("passed_over") for r in first["records"] for e in r.get("substituted", [])) <= 3


def test_the_ledger_names_each_substitution_with_its_reason(runs) -> None:
    first = runs["runs"][0]
    steps = _per_step(first["batches"])
    names = {"a": 0, "b": 1}
    named = {}
    for record in first["records"]:
        for entry in record.get("substituted", []):
            k = names[entry["source"]]
            bad_row = entry["bad"][0]
            named[(k, bad_row)] = entry["reason"]
            assert runs["bad"][k][bad_row] == entry["reason"], entry
            if entry["by"] is not None:
                assert (k, entry["by"][0]) in steps[record["step"]], (
                    f"the substitute trains in the step of the bad row it replaces: {entry}"
                )
    allocated_bad = {(k, r) for k in (0, 1) for r in runs["bad"][k]}
    assert set(named) == allocated_bad, "every injected bad row is named once, with its reason (met while seeking substitutes too)"
    assert len(named) == sum(len(r.get("substituted", [])) for r in first["records"])
    metric = sum(v for key, v in first["metrics"].items() if key.startswith("batchplane_planner_substitutions_total"))
    assert metric == sum(1 for r in first["records"] for e in r.get("substituted", []) if e["by"] is not None) > 0
    assert first["metrics"]['batchplane_planner_substitutions_total{reason="transform",source="b"}'] >= 1


def test_ledger_find_shows_the_bad_row_and_its_substitute(runs) -> None:
    first = runs["runs"][0]
    entry = next(e for r in first["records"] for e in r.get("substituted", []) if e["by"] is not None and e["source"] == "b")
    for row in (entry["bad"][0], entry["by"][0]):
        out = subprocess.run(
            [sys.executable, "-m", "batchplane.cli", "ledger", "find", f"b:{row}", "-c", str(first["config"])],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert f"b:{entry['bad'][0]}" in out.stdout and f"b:{entry['by'][0]}" in out.stdout, out.stdout


def test_a_second_run_plans_the_same_substitutions(runs) -> None:
    first, second = runs["runs"]
    assert [r.get("substituted") for r in first["records"]] == [r.get("substituted") for r in second["records"]]
    assert [r["ranks"] for r in first["records"]] == [r["ranks"] for r in second["records"]]
