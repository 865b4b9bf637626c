"""Fencing of the ledger's writers (batchplane.planner.fencing): writer epochs claimed with
put_if_absent, one read per put to see a newer claim, and a fenced writer refused for good,
through the ledger's own writer too. On MemoryStorage and LocalStorage."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest

from batchplane.core.errors import FailedPrecondition
from batchplane.core.storage import LocalStorage, MemoryStorage, Storage
from batchplane.planner.fencing import Fenced, FencedStorage, check_epoch, claim_epoch, epoch_key
from batchplane.planner.journal import LedgerReader, LedgerWriter


@pytest.fixture(params=["memory", "local"])
def storage(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Storage:
    return MemoryStorage() if request.param == "memory" else LocalStorage(tmp_path / "ledger")


class CountingStorage(MemoryStorage):
    """Counts the reads (get) it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, key: str) -> bytes:
        self.gets += 1
        return super().get(key)


class StaleListStorage(MemoryStorage):
    """A store whose listing lags: it never shows the writer epochs."""

    def list(self, prefix: str = "") -> list[str]:
        return [k for k in super().list(prefix) if not k.startswith("epochs/")]


def _record(step: int) -> dict:
    return {"step": step, "after": {"step": step + 1}}


def test_epochs_are_claimed_in_order_with_their_owner(storage: Storage) -> None:
    assert [claim_epoch(storage, owner={"pid": pid}) for pid in (10, 11, 12)] == [1, 2, 3]
    assert storage.list("epochs/") == ["epochs/000000000001", "epochs/000000000002", "epochs/000000000003"]
    assert json.loads(storage.get(epoch_key(2))) == {"epoch": 2, "pid": 11}


def test_a_claim_that_loses_a_race_takes_the_next_epoch() -> None:
    storage = StaleListStorage()
    assert claim_epoch(storage, owner={}) == 1
    assert claim_epoch(storage, owner={}) == 2, "listing nothing, it tried 1 (taken), then 2"
    check_epoch(storage, 2)
    with pytest.raises(Fenced):
        check_epoch(storage, 1)


def test_writers_racing_for_epochs_get_distinct_ones_without_a_gap(storage: Storage) -> None:
    threads = 8
    barrier = threading.Barrier(threads)
    claimed: list[int] = []

    def claim() -> None:
        barrier.wait()
        claimed.append(claim_epoch(storage, owner={}))

    workers = [threading.Thread(target=claim) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(claimed) == list(range(1, threads + 1))


def test_the_older_writer_is_refused_once_a_newer_one_claims(storage: Storage) -> None:
    older = FencedStorage(storage, epoch=claim_epoch(storage, owner={"host": "pod-a", "pid": 1}))
    assert older.put_if_absent("gen-000001/steps/000000000000.json", b"0")
    newer = FencedStorage(storage, epoch=claim_epoch(storage, owner={"host": "pod-b", "pid": 2}))
    with pytest.raises(Fenced) as caught:
        older.put_if_absent("gen-000001/steps/000000000001.json", b"1")
    assert isinstance(caught.value, FailedPrecondition)
    message = str(caught.value)
    assert "this planner (writer epoch 1) is fenced" in message
    assert f"claimed the ledger at {storage.describe()} as writer epoch 2 (host pod-b, pid 2)" in message
    assert (caught.value.epoch, caught.value.newer) == (1, {"epoch": 2, "host": "pod-b", "pid": 2})
    assert storage.list("gen-") == ["gen-000001/steps/000000000000.json"], "the refused put wrote nothing"
    assert newer.put_if_absent("gen-000002/steps/000000000001.json", b"1")
    # reads still work for the fenced one (it may still be asked what it planned)
    assert older.get("gen-000002/steps/000000000001.json") == b"1"
    assert older.describe() == storage.describe()


def test_a_fenced_writer_stays_refused_without_asking_again_and_reports_once() -> None:
    storage = CountingStorage()
    reported: list[Fenced] = []
    older = FencedStorage(storage, epoch=claim_epoch(storage, owner={}), on_fenced=reported.append)
    for i in range(3):
        older.put_if_absent(f"k{i}", b"x")
    assert storage.gets == 3, "one read per put"
    claim_epoch(storage, owner={})
    for i in range(3, 6):
        with pytest.raises(Fenced):
            older.put_if_absent(f"k{i}", b"x")
    assert storage.gets == 4, "fenced once, it does not ask again"
    assert len(reported) == 1 and isinstance(reported[0], Fenced)
    assert storage.list("k") == ["k0", "k1", "k2"]


def test_the_ledger_writer_of_a_fenced_planner_writes_nothing_more(storage: Storage) -> None:
    older = FencedStorage(storage, epoch=claim_epoch(storage, owner={}))
    writer = LedgerWriter(LedgerReader(older), start_step=0, fingerprints={"data": "d"}, sources=("a",))
    writer.append([_record(0)])
    writer.append([_record(1)])
    newer = FencedStorage(storage, epoch=claim_epoch(storage, owner={}))
    with pytest.raises(Fenced):
        writer.append([_record(2)])
    with pytest.raises(Fenced):
        writer.put_report(1, {"losses": {"a": 1.0}})
    with pytest.raises(Fenced):  # a rewind opens a new generation: refused too, so it never supersedes the newer one's
        LedgerWriter(LedgerReader(older), start_step=1, fingerprints={"data": "d"}, sources=("a",))
    # The newer planner resumes from what the older one wrote, in a generation of its own.
    reader = LedgerReader(newer)
    assert [g.gen for g in reader.generations] == [1] and reader.last_step() == 1
    resumed = LedgerWriter(reader, start_step=2, fingerprints={"data": "d"}, sources=("a",))
    resumed.append([_record(2)])
    assert [(r["step"], LedgerReader(storage).owner(r["step"]).gen) for r in LedgerReader(storage).records()] == [(0, 1), (1, 1), (2, 2)]


def test_an_unreadable_epoch_object_still_fences() -> None:
    storage = MemoryStorage()
    claim_epoch(storage, owner={})
    storage.put_if_absent(epoch_key(2), b"not json")
    with pytest.raises(Fenced, match=r"as writer epoch 2; only one planner"):
        check_epoch(storage, 1)
