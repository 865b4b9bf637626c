"""Changed sources on an existing run folder (issue 40, point 2), with real processes on real
Parquet files: a job runs partway, its source 'py' changes (a file dropped, rows appended to a
file, a file replaced by one of the same rows and another size), and the job resumes on the same
run folder. The planner refuses at start, before it writes anything, naming the source and what
differs; with identical files (a copy that keeps modification times) it resumes; with
`sources[].on_change: restart` the changed source's data starts over at the resume step and
every row of it is delivered once."""

from __future__ import annotations

import collections
import pathlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import SourceData, assert_rows_as_written, collect, sample_ids, skewed_lengths, start_cluster, write_job, write_source

from batchplane.client import DataPlaneError
from batchplane.core.storage import LocalStorage

pytestmark = pytest.mark.integration

STOP_AFTER = 3


def _job(root: pathlib.Path, sources, **py) -> pathlib.Path:
    entries = [{"name": s.name, "path": str(s.path), **(py if s.name == "py" else {})} for s in sources]
    return write_job(root / "job.yaml", sources, sources=entries, run_dir=str(root / "run"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[pathlib.Path, dict, dict]:
    """A job of sources 'web' (2 files) and 'py' (3 files) run for STOP_AFTER steps on a run
    folder: (its folder, the batches per rank, the client states at the stop)."""
    root = tmp_path_factory.mktemp("first")
    sources = [
        write_source(root / "data", "web", skewed_lengths(60, seed=1), seed=1),
        write_source(root / "data", "py", skewed_lengths(120, seed=2), files=3, seed=2),
    ]
    cluster = start_cluster(_job(root, sources))
    try:
        batches, states = collect(cluster.endpoints_path, [0, 1], stop_after=STOP_AFTER)
    finally:
        cluster.stop()
    assert {s["next_step"] for s in states.values()} == {STOP_AFTER}
    return root, batches, states


def _copy(first: pathlib.Path, root: pathlib.Path) -> list[SourceData]:
    """The first run's data and run folder copied under `root` (modification times kept), as
    sources at their new place."""
    shutil.copytree(first / "data", root / "data")
    shutil.copytree(first / "run" / "ledger", root / "run" / "ledger")
    return [_read(root / "data" / name, name) for name in ("web", "py")]


def _read(folder: pathlib.Path, name: str) -> SourceData:
    rows = [np.asarray(r, np.int32) for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f)["input_ids"].to_pylist()]
    return SourceData(name, folder, rows)


def _rewrite(path: pathlib.Path, rows: list[np.ndarray], **options) -> None:
    table = pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32())), "doc_id": pa.array(np.arange(len(rows)), pa.int64())})
    pq.write_table(table, path, row_group_size=40, write_page_checksum=True, **options)


def _heads(root: pathlib.Path) -> list[str]:
    return [k for k in LocalStorage(root / "run" / "ledger").list("gen-") if k.endswith("head.json")]


def _refused(root: pathlib.Path, sources, states) -> str:
    """Resumes on the run folder; returns the error the trainer got."""
    before = _heads(root)
    cluster = start_cluster(_job(root, sources))
    try:
        with pytest.raises(DataPlaneError) as refused:
            collect(cluster.endpoints_path, [0, 1], states=states)
        planner_log = next(p for p in cluster.processes if p.name == "planner").log_tail(200)
    finally:
        cluster.stop()
    assert _heads(root) == before, "a refused start writes no generation"
    message = str(refused.value)
    assert "source 'py' changed since generation 1 of the ledger at" in message
    assert "sources[1].on_change: restart" in message
    assert "would take seqs" not in message and "would take seqs" not in planner_log
    assert "'web'" not in message, "the source that did not change is not named"
    return message


def test_a_dropped_file_is_refused_naming_it(tmp_path, first_run) -> None:
    first, _, states = first_run
    sources = _copy(first, tmp_path)
    (tmp_path / "data" / "py" / "part-00002.parquet").unlink()
    message = _refused(tmp_path, sources, states)
    assert "files gone: part-00002.parquet" in message and "rows in all: 120 -> 80" in message


def test_rows_appended_to_a_file_are_refused_naming_the_file(tmp_path, first_run) -> None:
    first, _, states = first_run
    sources = _copy(first, tmp_path)
    path = tmp_path / "data" / "py" / "part-00001.parquet"
    rows = pq.read_table(path)["input_ids"].to_pylist()
    _rewrite(path, [np.asarray(r, np.int32) for r in rows] + [np.arange(5, dtype=np.int32)] * 15)
    message = _refused(tmp_path, sources, states)
    assert "rows changed: part-00001.parquet: 40 -> 55" in message and "rows in all: 120 -> 135" in message


def test_a_file_replaced_by_one_of_the_same_rows_and_another_size_is_refused(tmp_path, first_run) -> None:
    first, _, states = first_run
    sources = _copy(first, tmp_path)
    path = tmp_path / "data" / "py" / "part-00000.parquet"
    size = path.stat().st_size
    rows = pq.read_table(path)["input_ids"].to_pylist()
    _rewrite(path, [np.asarray(r[::-1], np.int32) for r in rows], compression="none")
    assert path.stat().st_size != size
    message = _refused(tmp_path, sources, states)
    assert f"sizes changed: part-00000.parquet: {size} bytes -> {path.stat().st_size} bytes" in message
    assert "rows changed" not in message and "files gone" not in message


def test_identical_files_resume_and_every_sample_is_delivered_once(tmp_path, first_run) -> None:
    first, batches, states = first_run
    sources = _copy(first, tmp_path)  # moved, modification times kept: the same data
    cluster = start_cluster(_job(tmp_path, sources))
    try:
        second, _ = collect(cluster.endpoints_path, [0, 1], states=states)
    finally:
        cluster.stop()
    delivered = collections.Counter()
    for per_rank in (batches, second):
        for rank_batches in per_rank.values():
            for step in sample_ids(rank_batches):
                delivered.update(sample for mb in step for sample in mb)
    assert max(delivered.values()) == 1
    assert set(delivered) == {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))}


def test_a_declared_change_restarts_the_source_and_delivers_its_new_rows_once(tmp_path, first_run) -> None:
    first, batches, states = first_run
    sources = _copy(first, tmp_path)
    (tmp_path / "data" / "py" / "part-00002.parquet").unlink()
    sources[1] = _read(tmp_path / "data" / "py", "py")
    cluster = start_cluster(_job(tmp_path, sources, on_change="restart"))
    try:
        second, _ = collect(cluster.endpoints_path, [0, 1], states=states)
        planner_log = next(p for p in cluster.processes if p.name == "planner").log_tail(300)
    finally:
        cluster.stop()
    assert "source 'py' changed since generation 1" in planner_log and "starts over from its beginning at step 3" in planner_log
    assert [b["step"] for b in second[0]][0] == STOP_AFTER
    first_ids = collections.Counter(s for rb in batches.values() for step in sample_ids(rb) for mb in step for s in mb)
    after = collections.Counter(s for rb in second.values() for step in sample_ids(rb) for mb in step for s in mb)
    assert max(after.values()) == 1
    assert {r for k, r in after if k == 1} == set(range(len(sources[1].rows))), "every row of the new data, once"
    web = collections.Counter(s for s in first_ids.elements() if s[0] == 0) + collections.Counter(s for s in after.elements() if s[0] == 0)
    assert set(web) == {(0, r) for r in range(len(sources[0].rows))} and max(web.values()) == 1
    # The tokens delivered are the new data's rows, byte for byte.
    assert_rows_as_written(second, sources)
    heads = LocalStorage(tmp_path / "run" / "ledger")
    assert len(_heads(tmp_path)) == 2 and b'"restarted":["py"]' in heads.get("gen-000002/head.json")
