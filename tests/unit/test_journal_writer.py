"""The journal's writer (batchplane.journal.writer) with its reader, on memory and local disk:
slices round-trip byte-identical; several writers of disjoint steps are read in plan order; a
writer killed with steps written but uncommitted resumes after its last committed step, its
uncommitted objects deleted and nothing committed twice; a fenced writer commits nothing;
`max_lag` holds a writer until a checkpoint mark advances; the header pins one job and mesh."""

from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

from batchplane.core.errors import FailedPrecondition
from batchplane.core.storage import LocalStorage, MemoryStorage, Storage
from batchplane.journal.commit import ManifestStore, version_key
from batchplane.journal.manifest import Commit, Fenced, decode_record
from batchplane.journal.reader import JournalReader, ReaderCursor
from batchplane.journal.retention import RetentionPolicy
from batchplane.journal.slices import DataMesh, SliceCursor
from batchplane.journal.writer import JournalWriter, object_key, parse_object_key, read_header

PREFIX = "jobs/j1/journal/"
TOKENS = ("input_ids", "labels")


def batch(step: int, dp: int, cp: int) -> dict[str, np.ndarray]:
    """A recognisable slice: every value says (step, dp, cp)."""
    tag = step * 1000 + dp * 10 + cp
    width = 8 + step % 3  # slices of different shapes
    return {
        "input_ids": np.arange(2 * width, dtype=np.int32).reshape(2, width) + tag * 100,
        "labels": np.full((2, width), tag, dtype=np.int64),
        "cu_seqlens": np.array([0, width, 2 * width], dtype=np.int32),
        "weight": np.float32(tag) * np.ones(3, dtype=np.float32),
    }


def step_slices(step: int, mesh: DataMesh) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    return {(d, c): batch(step, d, c) for d in range(mesh.dp) for c in range(mesh.cp)}


@pytest.fixture(params=["memory", "local"])
def storage(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Storage:
    return MemoryStorage() if request.param == "memory" else LocalStorage(tmp_path / "store")


def writer(storage: Storage, producer: str = "p0", *, mesh: DataMesh = DataMesh(2), **kw) -> JournalWriter:
    return JournalWriter(
        storage, prefix=PREFIX, producer_id=producer, mesh=mesh, token_names=TOKENS, job="job-1", sleep=lambda s: None, **kw
    )


def read_all(storage: Storage, steps: int, *, mesh: DataMesh = DataMesh(2), **kw) -> list:
    coords = [(d, c) for d in range(mesh.dp) for c in range(mesh.cp)]
    with JournalReader(storage, prefix=PREFIX, mesh=mesh, coords=coords, depth=2, poll_s=0.005, **kw) as reader:
        return [reader.next(timeout_s=10) for _ in range(steps)]


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def committed_changes(storage: Storage) -> list[Commit]:
    store = ManifestStore(storage, prefix=PREFIX, check_writes=False)
    top = store.latest().version
    records = [decode_record(storage.get(version_key(v, prefix=PREFIX)), version=v) for v in range(1, top + 1)]
    return [r.change for r in records if isinstance(r.change, Commit)]


def test_slices_round_trip_byte_identical(storage: Storage) -> None:
    w = writer(storage)
    assert w.resume() == 0
    for step in range(5):
        assert w.wait_for_room(step)
        w.write(step, step_slices(step, DataMesh(2)))
    w.flush()
    assert w.stats.steps_written == 5 and w.stats.commits == 5 and w.stats.conflicts == 0
    assert w.stats.bytes_written == sum(len(storage.get(k)) for k in storage.list(PREFIX + "tgb/"))
    header = read_header(storage, PREFIX)
    assert (header.job, header.mesh, header.token_names) == ("job-1", DataMesh(2), TOKENS)

    steps = read_all(storage, 5)
    for logical, got in enumerate(steps):
        assert got.step == logical
        assert got.cursor.position == SliceCursor(logical + 1)
        assert sorted(got.batches) == [(0, 0), (1, 0)]
        for (d, c), b in got.batches.items():
            assert_identical(b, batch(logical, d, c))


def test_a_cp_mesh_round_trips_too(storage: Storage) -> None:
    mesh = DataMesh(2, 2, "contiguous")
    w = writer(storage, mesh=mesh, policy="fixed10")
    w.resume()
    for step in range(3):
        w.write(step, step_slices(step, mesh))
    assert w.stats.commits == 0, "fixed10 waits for ten steps"
    w.flush()
    assert w.stats.commits == 1
    for logical, got in enumerate(read_all(storage, 3, mesh=mesh)):
        for (d, c), b in got.batches.items():
            assert_identical(b, batch(logical, d, c))


def test_several_writers_of_disjoint_steps_are_read_in_plan_order(storage: Storage) -> None:
    writers = [writer(storage, f"p{i}", policy="fixed10") for i in range(3)]
    for w in writers:
        assert w.resume() == 0
    total = 12
    # Interleaved out of plan order: p2 first, commits at different moments.
    for rnd in range(total // 3):
        for i in (2, 0, 1):
            writers[i].write(rnd * 3 + i, step_slices(rnd * 3 + i, DataMesh(2)))
        writers[(rnd + 1) % 3].flush()
    for w in writers:
        w.flush()
    steps = read_all(storage, total)
    assert [s.step for s in steps] == list(range(total))
    for s in steps:
        assert_identical(s.batches[(1, 0)], batch(s.step, 1, 0))
    committed = [e.step for change in committed_changes(storage) for e in change.steps]
    assert sorted(committed) == list(range(total)) and len(committed) == total


def test_a_killed_writer_resumes_after_its_last_committed_step_and_nothing_is_committed_twice(storage: Storage) -> None:
    first = writer(storage, policy="fixed10")
    assert first.resume() == 0
    for step in range(5):
        first.write(step, step_slices(step, DataMesh(2)))
    first.flush()
    for step in (5, 6):  # written, never committed: then the process dies
        first.write(step, step_slices(step, DataMesh(2)))
    stale = [object_key(PREFIX, step=s, producer="p0", epoch=1) for s in (5, 6)]
    assert all(k in storage.list(PREFIX) for k in stale)

    second = writer(storage, policy="fixed10")
    assert second.resume() == 5
    assert second.epoch == 2
    assert not any(k in storage.list(PREFIX) for k in stale), "the dead process's uncommitted objects are deleted"
    assert second.stats.orphans_deleted == 2
    for step in range(5, 8):
        second.write(step, step_slices(step, DataMesh(2)))
    second.flush()

    # The first process comes back to life: it is fenced and commits nothing.
    with pytest.raises(Fenced):
        first.flush()
    committed = [e.step for change in committed_changes(storage) for e in change.steps]
    assert committed == list(range(8)), "every step once, in order"
    state = ManifestStore(storage, prefix=PREFIX, check_writes=False).latest()
    assert state.producer("p0").last_step == 7 and state.producer("p0").epoch == 2
    assert {parse_object_key(PREFIX, o.key)[2] for s in state.steps[5:] for o in s.entry.objects} == {2}
    listed = {o.key for s in state.steps for o in s.entry.objects}
    assert set(storage.list(PREFIX + "tgb/")) == listed, "no orphan is left"
    for s in read_all(storage, 8):
        assert_identical(s.batches[(0, 0)], batch(s.step, 0, 0))


def test_a_restarted_writer_with_nothing_committed_starts_at_the_plans_first_step(storage: Storage) -> None:
    assert writer(storage, first_step=3).resume() == 3
    with pytest.raises(FailedPrecondition, match="steps must increase"):
        w = writer(storage, first_step=3)
        w.resume()
        w.write(4, step_slices(4, DataMesh(2)))
        w.write(4, step_slices(4, DataMesh(2)))


def test_steps_another_writer_committed_first_are_dropped_and_their_objects_deleted(storage: Storage) -> None:
    a, b = writer(storage, "a", policy="fixed10"), writer(storage, "b", policy="fixed10")
    a.resume()
    b.resume()
    a.write(0, step_slices(0, DataMesh(2)))
    b.write(0, step_slices(0, DataMesh(2)))
    b.write(1, step_slices(1, DataMesh(2)))
    a.flush()
    b.flush()
    assert b.stats.steps_taken == 1 and b.stats.orphans_deleted == 1
    assert object_key(PREFIX, step=0, producer="b", epoch=1) not in storage.list(PREFIX)
    assert [s.step for s in read_all(storage, 2)] == [0, 1]


def test_max_lag_holds_the_writer_until_a_checkpoint_mark_advances(storage: Storage) -> None:
    marked = []

    def sleep(_: float) -> None:  # while the writer pauses, the trainer checkpoints after step 1
        if not marked:
            reader = JournalReader(storage, prefix=PREFIX, mesh=DataMesh(2), coords=[(0, 0)], depth=0)
            reader.next()
            cursor = reader.next().cursor
            reader.record_watermark(cursor)
            marked.append(cursor)

    w = JournalWriter(
        storage, prefix=PREFIX, producer_id="p0", mesh=DataMesh(2), policy="fixed10", retention=RetentionPolicy(max_lag=3), sleep=sleep
    )
    w.resume()
    for step in range(3):
        assert w.wait_for_room(step)
        w.write(step, step_slices(step, DataMesh(2)))
    assert w.stats.backpressure_waits == 0
    assert w.wait_for_room(3), "it waits, then goes on once the mark is at step 2"
    assert w.stats.backpressure_waits == 1
    assert marked == [ReaderCursor(marked[0].manifest_version, SliceCursor(2))]
    assert w.producer.pending == (), "the pending steps were committed before pausing (the trainer needs them)"
    w.write(3, step_slices(3, DataMesh(2)))
    w.write(4, step_slices(4, DataMesh(2)))
    stop = threading.Event()
    w2 = JournalWriter(
        storage,
        prefix=PREFIX,
        producer_id="p1",
        mesh=DataMesh(2),
        retention=RetentionPolicy(max_lag=3),
        stop=stop,
        sleep=lambda s: stop.set(),
    )
    w2.resume()
    assert not w2.wait_for_room(5), "a set stop event ends the pause"


def test_the_header_pins_the_job_and_the_mesh(storage: Storage) -> None:
    writer(storage).resume()
    with pytest.raises(FailedPrecondition, match=r"was opened with mesh DataMesh\(dp=2"):
        writer(storage, "p1", mesh=DataMesh(4)).resume()
    other = JournalWriter(storage, prefix=PREFIX, producer_id="p1", mesh=DataMesh(2), job="job-2", token_names=TOKENS)
    with pytest.raises(FailedPrecondition, match="'job-1'"):
        other.resume()
    with pytest.raises(FailedPrecondition, match="holds job 'job-1', this reader expects 'job-2'"):
        JournalReader(storage, prefix=PREFIX, mesh=DataMesh(2), coords=[(0, 0)], depth=0, expect_job="job-2").next()


def test_slices_that_do_not_match_the_mesh_are_refused_before_anything_is_written(storage: Storage) -> None:
    w = writer(storage)
    w.resume()
    with pytest.raises(Exception, match="missing"):
        w.write(0, {(0, 0): batch(0, 0, 0)})
    assert storage.list(PREFIX + "tgb/") == []
