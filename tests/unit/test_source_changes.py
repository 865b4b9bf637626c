"""Changed sources on a resume (issue 40, point 2): the pure comparison of a source's facts with
what the ledger recorded (`planner.source_changes`), the bounds on the files a loader reports
(`planner.bounds.check_source_files`), and the real plan book on a ledger in memory refusing a
changed source at start, or, declared (`sources[].on_change: restart`), starting it over with
every sample of its new data planned once. No sockets."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.storage import MemoryStorage
from batchplane.planner.bounds import MAX_FILE_NAME_CHARS, MAX_SOURCE_FILES, check_source_files
from batchplane.planner.membership import row_groups_digest
from batchplane.planner.source_changes import (
    SHOWN_NAMES,
    FileFacts,
    SourceRecord,
    compare_source,
    compare_sources,
    decide,
    refusal,
)
from batchplane.v1 import common_pb2

import planner_plane

FIELDS = {"py": "sources[1]", "web": "sources[0]"}


def _record(files: list[FileFacts]) -> SourceRecord:
    """A source of `files`, one row group per file."""
    return SourceRecord(sum(f.rows for f in files), row_groups_digest([f.rows for f in files]), tuple(files))


def _files(n: int, *, rows: int = 40) -> list[FileFacts]:
    return [FileFacts(f"part-{i:05d}.parquet", 1000 + i, 1_700_000_000_000_000_000 + i, rows) for i in range(n)]


def _text(change) -> str:
    return refusal([change], step=7, since="generation 1 of the ledger at /run/ledger", fields=FIELDS)


# ---- the comparison ------------------------------------------------------------------------------


def test_a_dropped_file_names_it_and_the_rows_in_all() -> None:
    before = _files(3)
    change = compare_source("py", _record(before), _record(before[:2]))
    assert change is not None and change.gone == ("part-00002.parquet",) and change.rows == (120, 80)
    assert _text(change) == (
        "cannot resume at step 7: source 'py' changed since generation 1 of the ledger at /run/ledger recorded it\n"
        "  files gone: part-00002.parquet\n"
        "  rows in all: 120 -> 80\n"
        "The ledger's positions in a changed source name other rows now: resuming would repeat or skip samples. Restore the "
        "files, declare the change (sources[1].on_change: restart: the data starts over from its beginning at step 7), or start "
        "on a new run folder (run_dir or ledger.location)."
    )


def test_changed_rows_sizes_and_times_name_the_file_old_and_new() -> None:
    before = _files(2)
    after = [before[0], FileFacts(before[1].name, 2048, before[1].mtime_ns + 1_000_000_000, 55)]
    text = _text(compare_source("py", _record(before), _record(after)))
    assert "  rows changed: part-00001.parquet: 40 -> 55\n" in text
    assert "  sizes changed: part-00001.parquet: 1001 bytes -> 2048 bytes\n" in text
    assert "  modified: part-00001.parquet: 2023-11-14T22:13:20.000000Z -> 2023-11-14T22:13:21.000000Z\n" in text
    assert "  rows in all: 80 -> 95\n" in text


def test_many_names_are_cut_to_a_handful_and_a_count() -> None:
    change = compare_source("py", _record(_files(SHOWN_NAMES + 3)), _record([FileFacts("new.parquet", 1, 1, 1)]))
    assert change is not None
    line = next(line for line in change.lines() if line.startswith("files gone"))
    assert line.endswith(f"part-{SHOWN_NAMES - 1:05d}.parquet and 3 more") and line.count(".parquet") == SHOWN_NAMES


def test_only_what_both_sides_know_is_compared() -> None:
    files = _files(2)
    old_ledger = SourceRecord(80, row_groups_digest([40, 40]))  # written before files were recorded
    assert compare_source("py", old_ledger, _record(files)) is None
    assert compare_source("py", _record(files), SourceRecord(80, row_groups_digest([40, 40]))) is None  # a loader without files
    changed = compare_source("py", old_ledger, _record(files[:1]))
    assert changed is not None and changed.lines() == ["rows in all: 80 -> 40"]
    regrouped = compare_source("py", old_ledger, SourceRecord(80, row_groups_digest([20, 60])))
    assert regrouped is not None and regrouped.lines() == ["its row groups differ (same rows in all)"]
    unknown = [FileFacts(f.name, -1, -1, f.rows) for f in files]  # a file system that gives neither
    assert compare_source("py", _record(files), _record(unknown)) is None


def test_a_copy_that_did_not_keep_modification_times_says_so() -> None:
    files = _files(2)
    copied = [FileFacts(f.name, f.size_bytes, f.mtime_ns + 5, f.rows) for f in files]
    change = compare_source("py", _record(files), _record(copied))
    assert change is not None and change.only_modified
    assert _text(change).endswith("only modification times differ: a copy that keeps them (cp -p, rsync -t) counts as unchanged.")


def test_several_changed_sources_are_named_each_with_its_lines_and_setting() -> None:
    recorded = {"web": _record(_files(2)), "py": _record(_files(3))}
    reported = {"web": _record(_files(1)), "py": _record(_files(2))}
    changes = compare_sources(recorded, reported)
    text = refusal(changes, step=3, since="generation 2 of the ledger at x", fields=FIELDS)
    assert text.startswith("cannot resume at step 3: sources 'web', 'py' changed since generation 2 of the ledger at x recorded it\n")
    assert "  'web': files gone: part-00001.parquet\n" in text and "  'py': files gone: part-00002.parquet\n" in text
    assert "(sources[0].on_change: restart, sources[1].on_change: restart:" in text


def test_declared_changes_restart_and_the_others_refuse() -> None:
    changes = compare_sources({"web": _record(_files(2)), "py": _record(_files(3))}, {"web": _record(_files(1)), "py": _record(_files(2))})
    decision = decide(changes, {"py": "restart", "web": "refuse"})
    assert [c.source for c in decision.refused] == ["web"] and [c.source for c in decision.restarted] == ["py"]
    assert decide([], {"py": "restart"}).restarted == ()


def test_a_record_round_trips_through_a_ledger_head() -> None:
    record = _record(_files(2))
    assert SourceRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert SourceRecord.from_json([80, "d"]) == SourceRecord(80, "d") and record.to_json(with_files=False) == [80, record.digest]


NAMES = st.text(string.ascii_lowercase + "/_-.", min_size=1, max_size=12)
FILE_LISTS = st.lists(
    st.tuples(NAMES, st.integers(-1, 10**6), st.integers(-1, 2**62), st.integers(0, 1000)),
    min_size=1,
    max_size=12,
    unique_by=lambda t: t[0],
).map(lambda ts: [FileFacts(*t) for t in ts])


@settings(max_examples=200, deadline=None)
@given(FILE_LISTS)
def test_identical_facts_never_refuse(files: list[FileFacts]) -> None:
    assert compare_source("py", _record(files), _record(list(files))) is None


@settings(max_examples=300, deadline=None)
@given(FILE_LISTS, st.sampled_from(["drop", "add", "rename", "rows", "size", "modified"]), st.data())
def test_any_single_change_to_a_file_list_is_detected_and_named(files: list[FileFacts], kind: str, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(files) - 1))
    f = files[i]
    changed = list(files)
    named = [f.name]
    if kind == "drop":
        del changed[i]
    elif kind == "add":
        new = data.draw(NAMES.filter(lambda n: n not in {g.name for g in files}))
        changed.insert(i, FileFacts(new, 10, 10, data.draw(st.integers(0, 1000))))
        named = [new]
    elif kind == "rename":
        new = data.draw(NAMES.filter(lambda n: n not in {g.name for g in files}))
        changed[i] = FileFacts(new, f.size_bytes, f.mtime_ns, f.rows)
        named = [f.name, new]
    elif kind == "rows":
        changed[i] = FileFacts(f.name, f.size_bytes, f.mtime_ns, data.draw(st.integers(0, 1000).filter(lambda n: n != f.rows)))
    elif kind == "size":
        changed[i] = FileFacts(f.name, data.draw(st.integers(0, 10**6).filter(lambda n: n != f.size_bytes)), f.mtime_ns, f.rows)
    else:
        changed[i] = FileFacts(f.name, f.size_bytes, data.draw(st.integers(0, 2**62).filter(lambda n: n != f.mtime_ns)), f.rows)
    change = compare_source("py", _record(files), _record(changed))
    if kind in ("size", "modified") and -1 in ((f.size_bytes, changed[i].size_bytes) if kind == "size" else (f.mtime_ns,)):
        return  # the file system did not give it before: nothing to compare
    assert change is not None, f"{kind} of {f.name!r} went unnoticed"
    text = _text(change)
    for name in named:
        assert name in text, (kind, name, text)
    assert decide([change], {}).refused == (change,)


# ---- bounds on what a loader reports -------------------------------------------------------------


def _file(name: str = "a.parquet", size: int = 10, mtime: int = 5, rows: int = 4) -> common_pb2.SourceFile:
    return common_pb2.SourceFile(name=name, size_bytes=size, mtime_ns=mtime, rows=rows)


def test_the_files_a_loader_reports_are_bounded() -> None:
    assert check_source_files("py", 8, [_file(), _file("b/c.parquet", -1, -1)]) == (
        FileFacts("a.parquet", 10, 5, 4),
        FileFacts("b/c.parquet", -1, -1, 4),
    )
    assert check_source_files("py", 8, []) == ()
    cases = [
        ([_file(str(i), rows=0) for i in range(MAX_SOURCE_FILES + 1)], f"at most {MAX_SOURCE_FILES} files"),
        ([_file("")], "files\\[0\\].name must have 1 to"),
        ([_file("x" * (MAX_FILE_NAME_CHARS + 1))], "files\\[0\\].name must have 1 to"),
        ([_file("a\nb")], "printable"),
        ([_file(), _file()], "files\\[1\\].name repeats"),
        ([_file(size=-2)], "files\\[0\\]: size_bytes and mtime_ns must be >= 0, or -1"),
        ([_file(mtime=-(2**63))], "files\\[0\\]: size_bytes and mtime_ns"),
        ([_file(rows=-1)], "files\\[0\\].rows must be >= 0"),
        ([_file(rows=3)], "files of 3 rows for 8 rows"),
    ]
    for files, match in cases:
        with pytest.raises(InvalidArgument, match=match):
            check_source_files("py", 8, files)


# ---- the real plan book on a ledger in memory -------------------------------------------------


def _job(*, on_change: str = "refuse", **settings):
    return job_from_mapping(
        {
            "job": "changes",
            "sources": [{"name": "web", "path": "web"}, {"name": "py", "path": "py", "on_change": on_change}],
            "mesh": {"dp": 2},
            "batch": {"global_batch_size": 4, "microbatches": 1},
            "constructors": {"batch_steps": 1},
            "loaders": {"count": 1},
            **settings,
        }
    )


WEB = [(48, 48)]
WEB_FILES = [_file("w.parquet", 100, 1, 96)]


def _py_files(rows: list[int]) -> list[common_pb2.SourceFile]:
    return [_file(f"part-{i}.parquet", 1000 + i, 7, n) for i, n in enumerate(rows)]


def _plane(job, py_rows: list[int], ledger: MemoryStorage) -> planner_plane.Plane:
    plane = planner_plane.Plane(job, row_groups=[*WEB, tuple(py_rows)], ledger=ledger, files=[WEB_FILES, _py_files(py_rows)])
    plane.join()
    return plane


def _first_run(job, ledger: MemoryStorage, *, until: int) -> dict[int, list[tuple[int, int]]]:
    plane = _plane(job, [40, 40, 40], ledger)
    try:
        return {s: planner_plane.step_samples(a) for s, a in plane.run(until=until).items()}
    finally:
        plane.stop()


def _heads(ledger: MemoryStorage) -> list[str]:
    return [k for k in ledger.list("gen-") if k.endswith("head.json")]


def test_the_plan_book_refuses_a_changed_source_at_start_and_writes_nothing() -> None:
    job, ledger = _job(), MemoryStorage()
    _first_run(job, ledger, until=4)
    heads = _heads(ledger)
    assert len(json.loads(ledger.get(heads[0]))["source_facts"]["py"][2]) == 3, "the first generation keeps the files"
    plane = _plane(job, [40, 40], ledger)
    try:
        with pytest.raises(FailedPrecondition, match=r"(?s)source 'py' changed since generation 1 .*files gone: part-2.parquet"):
            plane.plan(0, 4, resume=job.fingerprints)
        assert _heads(ledger) == heads
    finally:
        plane.stop()
    same = _plane(job, [40, 40, 40], ledger)  # the files as they were: it resumes
    try:
        assert sorted(same.run(4, until=6)) == [4, 5]
        head = json.loads(ledger.get(_heads(ledger)[-1]))
        assert len(head["source_facts"]["py"]) == 2, "a later generation with the same files does not repeat them"
    finally:
        same.stop()


@pytest.mark.parametrize("window", [False, True], ids=["steps", "inside-a-window"])
def test_a_declared_change_starts_the_source_over_and_plans_its_new_data_once(window: bool) -> None:
    settings = {"balance": {"method": "token_budget", "max_tokens": 64, "window_steps": 4}} if window else {}
    job, ledger = _job(on_change="restart", **settings), MemoryStorage()
    resume_at = 6  # inside the window of steps 4..7 when planned four at a time
    first = _first_run(job, ledger, until=resume_at)
    plane = _plane(job, [40, 40], ledger)
    try:
        rest = {s: planner_plane.step_samples(a) for s, a in plane.run(resume_at, resume=job.fingerprints).items()}
        assert plane.book.oldest_step == resume_at, "no rewind before the step where the source started over"
    finally:
        plane.stop()
    py = sorted(seq for step in rest.values() for k, seq in step if k == 1)
    assert py == list(range(80)), "every sample of the new data once, from its beginning"
    web = sorted(seq for steps in (first, rest) for step in steps.values() for k, seq in step if k == 0)
    assert web == list(range(96)), "the unchanged source goes on: every sample once"
    head = json.loads(ledger.get(_heads(ledger)[-1]))
    assert head["restarted"] == ["py"] and len(head["source_facts"]["py"][2]) == 2
    later = _plane(job, [40, 40], ledger)  # a later resume compares with the new files: nothing restarts again
    try:
        later.run(resume_at + 2, resume=job.fingerprints, until=resume_at + 3)
        assert "restarted" not in json.loads(ledger.get(_heads(ledger)[-1]))
        assert later.book.oldest_step == resume_at
    finally:
        later.stop()


def test_the_planner_service_bounds_the_files_a_registration_reports() -> None:
    plane = planner_plane.Plane(_job(), row_groups=[*WEB, (40, 40)], files=[WEB_FILES, [_file("a", rows=40), _file("a", rows=40)]])
    try:
        with pytest.raises(InvalidArgument, match=r"source 'py': files\[1\]\.name repeats"):
            plane.join()
        plane.files[1] = [_file("x" * 10**5, rows=80)]
        with pytest.raises(InvalidArgument, match=r"source 'py': files\[0\]\.name must have 1 to 4096 printable characters"):
            plane.join()
        assert not plane.membership.ready
    finally:
        plane.stop()
