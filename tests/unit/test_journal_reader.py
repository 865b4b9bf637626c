"""The journal's reader (batchplane.journal.reader) and reclaimer (batchplane.journal.reclaim),
on memory and local disk: slices are range-read (footer once per step, each slice once, never
the whole object); DP 2->4 and 4->2 at resume deliver every written slice exactly once; a
reader waiting for an uncommitted step says so; a corrupt object is refused naming the step and
the key; marks and the reclaimer never delete what a live mark needs; prefetch follows a live
writer."""

from __future__ import annotations

import collections
import logging
import pathlib
import random
import threading
import time

import numpy as np
import pytest

from batchplane.core.errors import ConfigError, FailedPrecondition, Unavailable
from batchplane.core.storage import LocalStorage, MemoryStorage, Storage
from batchplane.journal.commit import ManifestSettings, ManifestStore
from batchplane.journal.manifest import CommitRefused, Refusal
from batchplane.journal.reader import JournalReader, ReaderCursor, Watermarks
from batchplane.journal.reclaim import Reclaimer
from batchplane.journal.retention import RetentionPolicy
from batchplane.journal.slices import DataMesh, SliceCursor
from batchplane.journal.tgb import CorruptTGB
from batchplane.journal.writer import JournalWriter

PREFIX = "j/"
TOKENS = ("input_ids",)
# Short enough that the tests' writers and readers look versions up again, long enough that a
# loaded machine's pause between a read and a put does not refuse put after put as too old (at
# 10 ms, the reclaimer test below failed twice in four runs beside a 64-producer `bench journal`).
FAST = ManifestSettings(checkpoint_every=4, confirm_after_s=0.25)


def loss_tokens(step: int, dp: int, cp: int) -> int:
    """The meta figure each test slice carries: distinct per slice, so a sum names its slices."""
    return 1 + step * 7 + dp * 3 + cp


def batch(step: int, dp: int, cp: int) -> dict[str, np.ndarray]:
    tag = step * 1000 + dp * 10 + cp
    return {"input_ids": np.arange(64, dtype=np.int64).reshape(2, 32) + tag * 100, "tag": np.array([tag], dtype=np.int64)}


class CountingStorage(MemoryStorage):
    """Counts whole and ranged reads of TGB objects."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: list[str] = []
        self.ranges: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self._ranged = False

    def get(self, key: str) -> bytes:
        if "/tgb/" in f"/{key}" and not self._ranged:
            self.gets.append(key)
        return super().get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self.ranges[(key, start, end)] += 1
        self._ranged = True  # MemoryStorage slices a whole get
        try:
            return super().get_range(key, start, end)
        finally:
            self._ranged = False


@pytest.fixture(params=["memory", "local"])
def storage(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Storage:
    return CountingStorage() if request.param == "memory" else LocalStorage(tmp_path / "store")


def write(
    storage: Storage, steps: range, *, mesh: DataMesh = DataMesh(2), producer: str = "p0", settings: ManifestSettings = FAST
) -> JournalWriter:
    w = JournalWriter(
        storage, prefix=PREFIX, producer_id=producer, mesh=mesh, token_names=TOKENS, manifest_settings=settings, sleep=lambda s: None
    )
    w.resume()
    for step in steps:
        coords = [(d, c) for d in range(mesh.dp) for c in range(mesh.cp)]
        w.write(step, {k: batch(step, *k) for k in coords}, {k: {"loss_tokens": loss_tokens(step, *k)} for k in coords})
    w.flush()
    return w


def reader(storage: Storage, mesh: DataMesh, **kw) -> JournalReader:
    coords = kw.pop("coords", [(d, c) for d in range(mesh.dp) for c in range(mesh.cp)])
    kw.setdefault("depth", 0)
    return JournalReader(storage, prefix=PREFIX, mesh=mesh, coords=coords, poll_s=0.005, manifest_settings=FAST, **kw)


def test_slices_are_range_read_once_and_the_footer_once_per_step() -> None:
    storage = CountingStorage()
    write(storage, range(4), mesh=DataMesh(4))
    with reader(storage, DataMesh(4), coords=[(1, 0)]) as r:
        got = [r.next(timeout_s=5) for _ in range(4)]
    assert storage.gets == [], "no whole-object read"
    for s in got:
        assert s.batches[(1, 0)]["tag"].tolist() == [s.step * 1000 + 10]
    state = ManifestStore(storage, prefix=PREFIX, check_writes=False).latest()
    for step in range(4):
        (obj,) = state.step(step).entry.objects
        reads = {k: n for k, n in storage.ranges.items() if k[0] == obj.key}
        assert sum(reads.values()) == 3, "trailer, footer, one slice"
        assert all(n == 1 for n in reads.values())
        slice_bytes = sum(end - start for (_, start, end) in reads)
        assert slice_bytes < obj.size / 2, "a quarter of the slices, and the footer"
    assert r.stats.footer_reads == 4 and r.stats.slices_read == 4


@pytest.mark.parametrize(("written", "before", "after"), [(2, 2, 4), (4, 4, 2), (2, 4, 2), (4, 2, 4)])
def test_dp_changed_at_resume_delivers_every_written_slice_exactly_once(storage: Storage, written: int, before: int, after: int) -> None:
    total = 12
    write(storage, range(total), mesh=DataMesh(written))
    delivered: collections.Counter[int] = collections.Counter()

    def take(r: JournalReader, n: int) -> ReaderCursor:
        cursor = None
        for _ in range(n):
            s = r.next(timeout_s=5)
            assert sorted(s.batches) == [(d, 0) for d in range(r.mesh.dp)]
            read = 0
            for b in s.batches.values():
                (tag,) = b["tag"].tolist()
                step, dp = divmod(tag, 1000)
                np.testing.assert_array_equal(b["input_ids"], batch(step, dp // 10, 0)["input_ids"])
                delivered[tag] += 1
                read += loss_tokens(step, dp // 10, 0)
            assert s.totals == {"loss_tokens": read}, "the figures of exactly the slices the logical step reads"
            cursor = s.cursor
        return cursor

    with reader(storage, DataMesh(before), depth=2) as r:
        half = total * written // before // 2
        cursor = take(r, half)
    resume_step = half
    with reader(storage, DataMesh(after), cursor=cursor, start_step=resume_step) as r:
        remaining = (total * written - half * before) // after
        take(r, remaining)
        with pytest.raises(Unavailable):
            r.next(timeout_s=0.05)
    assert set(delivered) == {s * 1000 + d * 10 for s in range(total) for d in range(written)}
    assert set(delivered.values()) == {1}, "each written slice once"


@pytest.mark.parametrize(("written", "after"), [(2, 4), (4, 2), (2, 8)])
def test_a_reader_of_one_coordinate_sums_the_figures_of_every_slice_of_the_logical_step(written: int, after: int) -> None:
    storage = CountingStorage()
    write(storage, range(8), mesh=DataMesh(written))
    with reader(storage, DataMesh(after)) as everyone, reader(storage, DataMesh(after), coords=[(after - 1, 0)]) as one:
        steps = 8 * written // after
        for _ in range(steps):
            whole, mine = everyone.next(timeout_s=5), one.next(timeout_s=5)
            assert mine.totals == whole.totals and whole.totals["loss_tokens"] > 0
            assert sorted(mine.batches) == [(after - 1, 0)]
    # the single-coordinate reader read every written step's footer (8), and only its own slices
    assert one.stats.footer_reads == 8
    assert one.stats.slices_read == steps, "one written slice per logical step"


def test_a_journal_without_slice_figures_has_no_totals() -> None:
    storage = MemoryStorage()
    w = JournalWriter(
        storage, prefix=PREFIX, producer_id="p0", mesh=DataMesh(2), token_names=TOKENS, manifest_settings=FAST, sleep=lambda s: None
    )
    w.resume()
    w.write(0, {(d, 0): batch(0, d, 0) for d in range(2)})
    w.flush()
    with reader(storage, DataMesh(1)) as r:
        assert r.next(timeout_s=5).totals == {}


def test_a_reader_waiting_for_an_uncommitted_step_says_so(storage: Storage, caplog: pytest.LogCaptureFixture) -> None:
    write(storage, range(2))
    r = reader(storage, DataMesh(2), stall_log_s=0.02)
    r.next()
    r.next()
    with caplog.at_level(logging.WARNING, logger="batchplane.journal.reader"):
        with pytest.raises(Unavailable, match="journal step 2 is not committed yet"):
            r.next(timeout_s=0.2)
    assert "no producer has committed step 2 for" in caplog.text
    assert "last committed step 1" in caplog.text
    assert r.stats.waits == 1


def test_prefetch_follows_a_live_writer() -> None:
    storage = MemoryStorage()
    w = JournalWriter(
        storage, prefix=PREFIX, producer_id="p0", mesh=DataMesh(2), token_names=TOKENS, manifest_settings=FAST, sleep=lambda s: None
    )
    w.resume()

    def produce() -> None:
        for step in range(20):
            w.write(step, {(d, 0): batch(step, d, 0) for d in range(2)})

    with reader(storage, DataMesh(2), depth=3) as r:
        thread = threading.Thread(target=produce)
        thread.start()
        got = [r.next(timeout_s=10) for _ in range(20)]
        thread.join()
    assert [s.step for s in got] == list(range(20))
    assert [s.batches[(1, 0)]["tag"][0] for s in got] == [s * 1000 + 10 for s in range(20)]


def _corrupt(storage: Storage, key: str, at: int) -> None:
    data = bytearray(storage.get(key))
    data[at] ^= 0xFF
    if isinstance(storage, LocalStorage):
        (pathlib.Path(storage.root) / key).write_bytes(bytes(data))
    else:
        storage._objects[key] = bytes(data)  # noqa: SLF001 - a hostile store


@pytest.mark.parametrize("where", ["slice", "trailer"])
def test_a_corrupt_object_is_refused_naming_the_step_and_the_key(storage: Storage, where: str) -> None:
    write(storage, range(3))
    state = ManifestStore(storage, prefix=PREFIX, check_writes=False).latest()
    (obj,) = state.step(1).entry.objects
    _corrupt(storage, obj.key, 5 if where == "slice" else obj.size - 3)
    r = reader(storage, DataMesh(2))
    r.next()
    with pytest.raises(CorruptTGB) as caught:
        r.next()
    assert f"journal step 1, object {obj.key!r}" in str(caught.value)
    assert ("crc32 mismatch" if where == "slice" else "end_magic") in str(caught.value)


def test_a_reader_started_before_any_producer_waits_for_the_journal() -> None:
    storage = MemoryStorage()
    r = reader(storage, DataMesh(2), depth=1)
    with r:
        with pytest.raises(Unavailable):
            r.next(timeout_s=0.05)
        write(storage, range(1))
        assert r.next(timeout_s=5).step == 0


def test_bad_reader_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="journal.coords"):
        reader(MemoryStorage(), DataMesh(2), coords=[(2, 0)])
    with pytest.raises(ConfigError, match="journal.read_ahead_steps"):
        reader(MemoryStorage(), DataMesh(2), depth=-1)


# --- marks and the reclaimer ------------------------------------------------------------------


class Wall:
    """A wall clock the test moves (from now: the writers' versions carry real times)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def frozen_clock() -> float:
    """The reclaimer's monotonic clock, frozen: FAST's 250 ms freshness window would otherwise
    refuse a round's watermark put whenever a loaded machine took longer than that between the
    round's read of the manifest and its put (the round then advances nothing, by design)."""
    return 0.0


def objects_of(storage: Storage, step: int) -> list[str]:
    return [k for k in storage.list(f"{PREFIX}tgb/{step:012d}/")]


def test_the_reclaimer_keeps_what_the_lowest_live_mark_needs(storage: Storage) -> None:
    write(storage, range(10))
    r = reader(storage, DataMesh(2))
    cursors = [r.next().cursor for _ in range(8)]
    r.record_watermark(cursors[3], mark="ckpt-a")  # needs steps >= 4
    r.record_watermark(cursors[6], mark="ckpt-b")  # needs steps >= 7
    wall = Wall()
    policy = RetentionPolicy(min_age_s=60.0)
    reclaimer = Reclaimer(storage, prefix=PREFIX, policy=policy, manifest_settings=FAST, clock=frozen_clock, wall_clock=wall)

    young = reclaimer.run_once()
    assert young.objects_deleted == () and young.watermark == 0, "nothing younger than min_age_s goes"
    wall.now += 10_000
    report = reclaimer.run_once()
    assert report.watermark == 4
    assert all(objects_of(storage, s) == [] for s in range(4))
    assert all(objects_of(storage, s) for s in range(4, 10))
    assert report.versions_deleted and report.versions_deleted == tuple(range(1, len(report.versions_deleted) + 1))
    assert report.versions_deleted[-1] < cursors[3].manifest_version, "versions the lowest mark read are kept"
    assert reclaimer.run_once().objects_deleted == (), "idempotent"

    # A restore from ckpt-a replays its steps byte-identical; reading below the watermark is refused.
    with reader(storage, DataMesh(2), cursor=cursors[3], start_step=4) as again:
        for step in range(4, 10):
            s = again.next(timeout_s=5)
            assert s.batches[(0, 0)]["input_ids"].tobytes() == batch(step, 0, 0)["input_ids"].tobytes()
    with pytest.raises(FailedPrecondition, match="journal step 0 was reclaimed"):
        reader(storage, DataMesh(2)).next()
    with pytest.raises(CommitRefused) as refused:
        Watermarks(storage, prefix=PREFIX, settings=FAST).record("old", ReaderCursor(0, SliceCursor(2)))
    assert refused.value.reason is Refusal.MARK_RECLAIMED

    r.release_watermark(mark="ckpt-a")
    wall.now += 10_000
    assert reclaimer.run_once().watermark == 7
    assert all(objects_of(storage, s) == [] for s in range(7)) and objects_of(storage, 7)
    assert ManifestStore(storage, prefix=PREFIX, check_writes=False, settings=FAST).latest().watermark == 7


def test_marks_and_reclaim_rounds_in_any_order_never_delete_what_a_live_mark_needs() -> None:
    rng = random.Random(7)
    storage = MemoryStorage()
    wall = Wall()
    w = JournalWriter(
        storage,
        prefix=PREFIX,
        producer_id="p0",
        mesh=DataMesh(2),
        token_names=TOKENS,
        manifest_settings=FAST,
        sleep=lambda s: None,
        wall_clock=wall,
    )
    w.resume()
    marks = Watermarks(storage, prefix=PREFIX, settings=FAST)
    reclaimer = Reclaimer(
        storage, prefix=PREFIX, policy=RetentionPolicy(min_age_s=1.0), manifest_settings=FAST, clock=frozen_clock, wall_clock=wall
    )
    live: dict[str, int] = {}
    step = deleted = 0
    for _ in range(60):
        action = rng.choice(["write", "write", "mark", "unmark", "reclaim"])
        state = ManifestStore(storage, prefix=PREFIX, check_writes=False, settings=FAST).latest()
        if action == "write":
            w.write(step, {(d, 0): batch(step, d, 0) for d in range(2)})
            step += 1
        elif action == "mark" and state.visible_through >= state.watermark:
            at = rng.randint(state.watermark, state.visible_through + 1)
            name = f"ckpt-{rng.randint(0, 3)}"
            marks.record(name, ReaderCursor(state.version, SliceCursor(at)))
            live[name] = at
        elif action == "unmark" and live:
            name = rng.choice(sorted(live))
            marks.release(name)
            del live[name]
        elif action == "reclaim":
            wall.now += rng.choice([0.5, 5.0])
            deleted += len(reclaimer.run_once().objects_deleted)
        floor = min(live.values(), default=0)
        for s in range(floor, step):
            assert objects_of(storage, s), f"step {s} is needed by a live mark at {floor}"
    assert ManifestStore(storage, prefix=PREFIX, check_writes=False, settings=FAST).latest().visible_through == step - 1
    assert deleted, "the rounds reclaimed something"


def test_the_reclaimer_refuses_a_minimum_age_near_the_manifests_freshness() -> None:
    with pytest.raises(ConfigError, match="journal.retention.min_age_s"):
        Reclaimer(MemoryStorage(), policy=RetentionPolicy(min_age_s=1.0), manifest_settings=ManifestSettings(confirm_after_s=30))
