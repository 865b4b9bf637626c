"""The journal's commit protocol over a storage (batchplane.journal.commit): under any
interleaving of producers, races, crashes, lost answers and restarts (a store whose
interleavings the test drives), the committed steps are the plan's, each exactly once, the
producers' state matches the committed steps, and a fenced process never commits; plus finding
the latest version without a hint, checkpoints, and refusing a store without conditional puts."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import FailedPrecondition, NotFound, Unavailable
from batchplane.core.storage import MemoryStorage
from batchplane.journal import commit as commit_module
from batchplane.journal.commit import ManifestSettings, ManifestStore, PreparedVersion, Producer, version_key
from batchplane.journal.manifest import (
    Commit,
    Fenced,
    ManifestState,
    Register,
    StepEntry,
    StepObject,
    apply,
    decode_record,
    encode_record,
)
from batchplane.journal.policy import DacPolicy, DacSettings, NaivePolicy


class Crash(Exception):
    """The process dies right here."""


class ScheduledStorage(MemoryStorage):
    """A MemoryStorage whose next manifest put the test can interrupt: `before_put` runs first
    (another producer's whole attempt: a race), `after_put` is raised after the write (the
    process crashes, or loses the answer, after the version is in); and whose next probe that
    finds nothing `after_miss` follows (a race the prober catches up on)."""

    def __init__(self) -> None:
        super().__init__()
        self.before_put: Callable[[], None] | None = None
        self.after_put: BaseException | None = None
        self.after_miss: Callable[[], None] | None = None

    def get(self, key: str) -> bytes:
        """`after_miss` runs after the next manifest read that finds nothing (a probe): another
        producer's attempt lands right after it, so the prober's preparation is overtaken."""
        try:
            return super().get(key)
        except NotFound:
            if key.startswith("manifest/") and self.after_miss is not None:
                hook, self.after_miss = self.after_miss, None
                hook()
            raise

    def put_if_absent(self, key: str, data: bytes) -> bool:
        manifest = key.startswith("manifest/")
        if manifest and self.before_put is not None:
            hook, self.before_put = self.before_put, None
            hook()
        created = super().put_if_absent(key, data)
        if manifest and self.after_put is not None:
            exc, self.after_put = self.after_put, None
            raise exc
        return created


class Process:
    """One producer process: a slot (producer id) building its steps (step % slots == slot)."""

    counter = 0

    def __init__(self, storage: ScheduledStorage, slot: int, slots: int, total: int, k: int, *, dac: bool = False) -> None:
        Process.counter += 1
        self.nonce = Process.counter
        self.storage, self.slot, self.slots, self.total = storage, slot, slots, total
        store = ManifestStore(storage, settings=ManifestSettings(checkpoint_every=k), check_writes=False)
        # DAC defers an attempt that caught up (no put); the naive policy prepares again and puts
        policy = DacPolicy(random=random.Random(self.nonce).random) if dac else NaivePolicy()
        self.producer = Producer(store, f"p{slot}", policy=policy, sleep=lambda s: None)
        self.fenced = False

    def build(self) -> None:
        pending = self.producer.pending
        after = pending[-1].step if pending else self.producer.last_step
        step = after + 1
        while step % self.slots != self.slot:
            step += 1
        if step >= self.total:
            return
        key = f"tgb/p{self.slot}/{step:04d}-{self.nonce}"
        data = f"step {step}".encode()
        self.storage.put_if_absent(key, data)
        self.producer.add(StepEntry(step, (StepObject(key, len(data), f"test:{step}"),)))

    def race(self) -> None:
        """Builds a step if none is pending, and attempts (inside another process's attempt)."""
        if not self.producer.pending:
            self.build()
        if self.producer.pending:
            self.attempt()

    def attempt(self) -> None:
        try:
            self.producer.attempt()
        except Fenced:
            self.fenced = True


operations = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 2)),
        st.tuples(st.just("build"), st.integers(0, 5)),
        st.tuples(st.just("build"), st.integers(0, 5)),
        st.tuples(st.just("attempt"), st.integers(0, 5), st.none() | st.integers(0, 5), st.sampled_from([None, None, "crash", "unknown"])),
        st.tuples(st.just("attempt"), st.integers(0, 5), st.integers(0, 5), st.just(None)),
        st.tuples(st.just("attempt"), st.integers(0, 5), st.integers(0, 5), st.just("probe")),
        st.tuples(st.just("crash"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(slots=st.integers(1, 3), total=st.integers(1, 12), k=st.sampled_from([1, 3, 64]), ops=operations, dac=st.booleans())
def test_any_interleaving_commits_the_plan_exactly_once(slots: int, total: int, k: int, ops: list, dac: bool) -> None:
    storage = ScheduledStorage()
    alive: list[Process] = []
    everyone: list[Process] = []

    def start(slot: int) -> Process:
        proc = Process(storage, slot, slots, total, k, dac=dac)
        proc.producer.register()
        alive.append(proc)
        everyone.append(proc)
        return proc

    for slot in range(slots):
        start(slot)
    for op in ops:
        live = [p for p in alive if not p.fenced]
        if op[0] == "start":
            start(op[1] % slots)
        elif not live:
            continue
        elif op[0] == "build":
            live[op[1] % len(live)].build()
        elif op[0] == "crash":
            alive.remove(live[op[1] % len(live)])
        else:
            _, who, racer, after = op
            proc = live[who % len(live)]
            if not proc.producer.pending and after == "probe":
                proc.build()
            if not proc.producer.pending:
                continue
            if racer is not None and live[racer % len(live)] is not proc:
                other = live[racer % len(live)]
                if after == "probe":
                    storage.after_miss = other.race
                else:
                    storage.before_put = other.race
            if after == "crash":
                storage.after_put = Crash()
            elif after == "unknown":
                storage.after_put = Unavailable("the store's answer was lost")
            try:
                proc.attempt()
            except Crash:
                alive.remove(proc)
            storage.before_put, storage.after_put, storage.after_miss = None, None, None

    # Drain: each slot's current process (or a restarted one) builds and commits the rest.
    reader = ManifestStore(storage, check_writes=False)
    for slot in range(slots):
        state = reader.latest()
        current = state.producer(f"p{slot}")
        procs = [p for p in alive if p.slot == slot and not p.fenced and current and p.producer.epoch == current.epoch]
        proc = procs[0] if procs else start(slot)
        for _ in range(total):
            proc.build()
        proc.producer.flush()

    final = reader.latest()
    check_history(storage, final, slots=slots, total=total)
    assert final.visible_through == total - 1
    for s in range(total):
        obj = final.step(s).entry.objects[0]
        assert storage.get(obj.key) == f"step {s}".encode()
    referenced = {o.key for c in final.steps for o in c.entry.objects}
    for proc in everyone:
        assert not referenced & {o.key for o in proc.producer.orphans}
    # a cold reader (from a listing, through the checkpoints) sees the same state
    assert ManifestStore(storage, settings=ManifestSettings(checkpoint_every=k), check_writes=False).latest() == final


def check_history(storage: MemoryStorage, final: ManifestState, *, slots: int, total: int) -> None:
    """Replays every version: each is allowed by its predecessor (so no fenced process
    committed), each step is committed once by its slot, and at every version each producer's
    last step covers exactly its committed steps."""
    keys = storage.list("manifest/")
    assert keys == [version_key(v) for v in range(1, len(keys) + 1)]
    state = ManifestState()
    seen: list[int] = []
    visible = -1
    epochs: dict[str, int] = {}
    for v, key in enumerate(keys, start=1):
        record = decode_record(storage.get(key), version=v)
        change = record.change
        if isinstance(change, Commit):
            assert change.epoch == epochs[change.producer]  # never an older (fenced) epoch
            seen.extend(e.step for e in change.steps)
        if isinstance(change, Register):
            epochs[change.producer] = epochs.get(change.producer, 0) + 1
        state = apply(state, change)
        if record.state is not None:
            assert record.state == state
        assert state.visible_through >= visible
        visible = state.visible_through
        for p in state.producers:
            slot = int(p.producer[1:])
            mine = sorted(c.step for c in state.steps if c.producer == p.producer)
            assert mine == [s for s in range(slot, p.last_step + 1, slots)]
    assert state == final
    assert sorted(seen) == list(range(total)) == sorted(set(seen))


# --- examples -------------------------------------------------------------------------------


def obj(step: int, tag: str = "") -> StepEntry:
    return StepEntry(step, (StepObject(f"tgb/{step}{tag}", 1, "test:0"),))


def test_a_restarted_producer_resumes_after_its_last_step_and_fences_the_old_process() -> None:
    storage = MemoryStorage()
    old = Producer(ManifestStore(storage), "p0")
    old.register()
    old.commit([obj(0), obj(1), obj(2)])
    old.add(obj(3))  # built, never committed
    new = Producer(ManifestStore(storage), "p0")
    state = new.register()
    assert (state.epoch, state.last_step) == (2, 2)
    with pytest.raises(Fenced, match="fenced"):
        old.attempt()
    assert [o.key for o in old.orphans] == ["tgb/3"]
    with pytest.raises(Fenced):
        old.add(obj(4))
    new.commit([obj(3, "b")])
    assert new.store.latest().step(3).entry == obj(3, "b")


def test_a_lost_answer_is_found_committed_at_the_next_attempt() -> None:
    storage = ScheduledStorage()
    p = Producer(ManifestStore(storage, check_writes=False), "p0")
    p.register()
    p.add(obj(0))
    storage.after_put = Unavailable("timeout")
    attempt = p.attempt()
    assert not attempt.success and p.pending
    again = p.attempt()
    assert again.success and not again.wrote and again.already == (0,)
    assert p.last_step == 0 and not p.pending and not p.orphans


def test_steps_another_producer_committed_first_become_orphans() -> None:
    storage = MemoryStorage()
    a = Producer(ManifestStore(storage), "a")
    b = Producer(ManifestStore(storage), "b")
    a.register()
    b.register()
    b.commit([obj(0, "b")])
    a.add(obj(0, "a"))
    a.add(obj(1, "a"))
    attempt = a.attempt()
    assert attempt.taken == (0,) and attempt.committed == (1,)
    assert [o.key for o in a.take_orphans()] == ["tgb/0a"] and not a.orphans


def test_a_store_that_ignores_conditional_puts_is_refused() -> None:
    class Overwriting(MemoryStorage):
        def put_if_absent(self, key: str, data: bytes) -> bool:
            self._objects[key] = bytes(data)
            return True

    with pytest.raises(FailedPrecondition, match="ignores conditional writes"):
        ManifestStore(Overwriting())
    ManifestStore(MemoryStorage())  # an honest one is accepted


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def committed_journal(versions: int, k: int) -> tuple[MemoryStorage, ManifestState]:
    storage = MemoryStorage()
    p = Producer(ManifestStore(storage, settings=ManifestSettings(checkpoint_every=k)), "p0")
    p.register()
    for s in range(versions - 1):
        p.commit([obj(s)])
    return storage, p.store.latest()


def test_the_latest_version_is_found_from_a_listing_and_checkpoints_after_reclamation() -> None:
    storage, latest = committed_journal(20, k=4)
    assert latest.version == 20
    assert decode_record(storage.get(version_key(16))).state == ManifestStore(storage).read(16)
    assert decode_record(storage.get(version_key(17))).state is None
    clock = FakeClock()
    stale = ManifestStore(storage, settings=ManifestSettings(checkpoint_every=4, confirm_after_s=5), clock=clock, check_writes=False)
    assert stale.read(5).version == 5
    assert stale.latest() == latest
    for v in range(1, 17):  # the reclaimer: ascending, below the newest checkpoint
        storage.delete(version_key(v))
    cold = ManifestStore(storage, settings=ManifestSettings(checkpoint_every=4), check_writes=False)
    assert cold.latest() == latest
    # A reader whose known version was reclaimed and who has not seen it for a while finds out.
    behind = ManifestStore(storage, settings=ManifestSettings(checkpoint_every=4, confirm_after_s=5), clock=clock, check_writes=False)
    behind._state, behind._seen_at = ManifestState(version=7), 0.0  # as if it had read version 7 long ago
    clock.now = 100.0
    assert behind.latest() == latest
    # ... and a writer does not put on a base it has not seen recently.
    clock.now = 200.0
    assert behind.put(behind.prepare(latest, Register("p1"))) is None
    assert behind.latest() == latest
    assert behind.put(behind.prepare(latest, Register("p1"))) is not None


def test_a_version_its_predecessor_does_not_allow_is_reported_as_corrupt() -> None:
    storage, latest = committed_journal(3, k=64)
    record = json.loads(storage.get(version_key(3)))
    record["version"] = 4
    storage.put_if_absent(version_key(4), json.dumps(record).encode())  # step 1 again
    with pytest.raises(FailedPrecondition, match="manifest version 4 records a change"):
        ManifestStore(storage, check_writes=False).latest()


def test_dac_paces_a_producer_through_the_injected_clock() -> None:
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, clock=clock, check_writes=False)
    policy = DacPolicy(DacSettings(duty_budget=0.1, jitter=0.0), random=lambda: 0.5)
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock.sleep(s)

    p = Producer(store, "p0", policy=policy, clock=clock, sleep=sleep)
    storage_get = storage.get

    def slow_get(key: str) -> bytes:  # every read of the manifest takes 0.5 s
        clock.now += 0.5
        return storage_get(key)

    storage.get = slow_get  # type: ignore[method-assign]
    p.register()
    p.add(obj(0))
    assert not p.due()  # a gap of 9 windows after the registration's attempt
    clock.now += 100
    assert p.maybe_commit() is not None
    p.add(obj(1))
    p.add(obj(2))
    attempts = p.flush()
    assert [a.committed for a in attempts] == [(1, 2)]
    assert slept and all(s == pytest.approx(policy.gap_s(), rel=0.5) for s in slept)
    # every window is the final probe (one read, 0.5 s) and the put
    assert policy.fragile_window_s == pytest.approx(0.5)
    assert policy.gap_s() == pytest.approx(policy.fragile_window_s * 9)  # alone: the duty budget binds


def test_the_fragile_window_starts_at_the_read_of_the_current_version() -> None:
    """Catching up on the versions committed during the gap is not fragile (a version committed
    then is read too): the window runs from the probe that found no newer version to the put."""
    clock = FakeClock()
    storage = MemoryStorage()
    other = Producer(ManifestStore(storage, check_writes=False), "p1")
    other.register()
    store = ManifestStore(storage, clock=clock, check_writes=False)
    p = Producer(store, "p0", clock=clock, sleep=clock.sleep)
    p.register()
    for s in range(1, 6):  # five versions while p0 waits
        other.commit([obj(2 * s + 1)])
    storage_get = storage.get

    def slow_get(key: str) -> bytes:  # every read takes 0.5 s
        clock.now += 0.5
        return storage_get(key)

    storage.get = slow_get  # type: ignore[method-assign]
    p.add(obj(0))
    attempt = p.attempt()
    assert attempt.committed == (0,)
    assert store.catch_up_s == pytest.approx(2.5)  # five versions read before the probe that found none
    assert attempt.fragile_window_s == pytest.approx(0.5)  # that probe, then the put


def test_dac_reads_the_producer_count_from_the_committed_state_and_commits_every_pending_step() -> None:
    storage = MemoryStorage()
    for i in range(1, 4):
        Producer(ManifestStore(storage, check_writes=False), f"p{i}").register()
    policy = DacPolicy(DacSettings(jitter=0.0), random=lambda: 0.0)
    clock = FakeClock()
    p = Producer(ManifestStore(storage, clock=clock, check_writes=False), "p0", policy=policy, clock=clock, sleep=clock.sleep)
    p.register()
    assert policy._producers == 4
    for s in range(5):
        p.add(obj(s))
    clock.now += 1e6
    attempt = p.maybe_commit()
    assert attempt is not None and attempt.committed == (0, 1, 2, 3, 4)


class CountingStorage(MemoryStorage):
    """One producer's view of a shared MemoryStorage that counts its manifest puts."""

    def __init__(self, shared: MemoryStorage) -> None:
        super().__init__()
        self._objects = shared._objects
        self.manifest_puts = 0

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.startswith("manifest/"):
            self.manifest_puts += 1
        return super().put_if_absent(key, data)


class _Recording(NaivePolicy):
    """The naive policy (which never defers a caught-up attempt), recording outcomes."""

    def __init__(self) -> None:
        self.outcomes: list[bool] = []

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        self.outcomes.append(success)


def _racing(policy) -> tuple[MemoryStorage, CountingStorage, Producer, list[PreparedVersion]]:
    """Producer p0 with steps 0..2 pending, whose first preparation producer p1's commit of
    step 1 overtakes (after the prepare, before its final probe)."""
    shared = MemoryStorage()
    other = Producer(ManifestStore(shared, check_writes=False), "p1")
    other.register()
    counting = CountingStorage(shared)
    store = ManifestStore(counting, check_writes=False)
    p = Producer(store, "p0", policy=policy, sleep=lambda s: None)
    p.register()
    for s in range(3):
        p.add(obj(s))
    prepared: list[PreparedVersion] = []
    prepare = store.prepare

    def racing_prepare(base: ManifestState, change: Commit) -> PreparedVersion:
        out = prepare(base, change)
        if not prepared:
            other.commit([obj(1, "other")])  # lands after the first prepare, before its probe
        prepared.append(out)
        return out

    store.prepare = racing_prepare  # type: ignore[method-assign]
    return shared, counting, p, prepared


def test_a_version_committed_between_prepare_and_the_final_probe_is_caught_up_on_without_a_put() -> None:
    """The probe after preparing finds the other producer's version: the attempt reads it,
    rebases (the step it took is dropped) and prepares again, and puts once; no lost race."""
    policy = _Recording()
    shared, counting, p, prepared = _racing(policy)
    policy.outcomes.clear()
    puts_before = counting.manifest_puts
    attempt = p.attempt()
    assert len(prepared) == 2 and prepared[1].base_version == prepared[0].base_version + 1
    assert counting.manifest_puts - puts_before == 1  # the stale preparation was never put
    assert attempt.success and attempt.wrote and attempt.caught_up == 1
    assert attempt.committed == (0, 2) and attempt.taken == (1,)
    assert policy.outcomes == [True]  # one attempt reported to the policy, and no conflict
    final = ManifestStore(shared, check_writes=False).latest()
    assert final.version == attempt.version == prepared[1].base_version + 1
    assert [(c.step, c.producer) for c in final.steps] == [(0, "p0"), (1, "p1"), (2, "p0")]
    versions = [decode_record(shared.get(k)).change for k in shared.list("manifest/")]
    commits = [s.step for c in versions if isinstance(c, Commit) for s in c.steps]
    assert sorted(commits) == [0, 1, 2]  # each step committed once
    assert [o.key for o in p.orphans] == ["tgb/1"]


def test_dac_defers_an_attempt_that_caught_up_and_commits_it_after_a_spread_gap() -> None:
    """Under DAC the caught-up attempt puts nothing: its steps stay pending and the policy sets
    a gap anywhere in a whole cycle, as after a conflict; the next attempt commits them."""
    policy = DacPolicy(DacSettings(jitter=0.0, conflict_jitter=1.0), random=lambda: 0.75)
    shared, counting, p, prepared = _racing(policy)
    assert policy.fragile_window_s is not None  # the registration measured a window
    puts_before = counting.manifest_puts
    deferred = p.attempt()
    assert not deferred.success and not deferred.wrote and deferred.caught_up == 1 and deferred.committed == ()
    assert counting.manifest_puts == puts_before and len(prepared) == 1  # no put, no second preparation
    assert [e.step for e in p.pending] == [0, 1, 2]
    assert policy.gap_s() == pytest.approx(policy.optimal_gap_s * 1.75)  # spread like a conflict's retry
    committed = p.attempt()
    assert committed.success and committed.wrote and committed.committed == (0, 2) and committed.taken == (1,)
    final = ManifestStore(shared, check_writes=False).latest()
    assert [(c.step, c.producer) for c in final.steps] == [(0, "p0"), (1, "p1"), (2, "p0")]
    assert [o.key for o in p.orphans] == ["tgb/1"]


def test_the_fragile_window_excludes_the_rebase_apply_and_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """However long the CPU work of an attempt takes (here 7 s on the injected clock), the
    window is the final probe (0.5 s) and the put (0.25 s)."""
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, clock=clock, check_writes=False)
    p = Producer(store, "p0", clock=clock, sleep=clock.sleep)
    p.register()
    for s in range(4):
        p.add(obj(s))

    def slow(fn: Callable, seconds: float) -> Callable:
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            clock.now += seconds
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(commit_module, "rebase", slow(commit_module.rebase, 1.0))
    monkeypatch.setattr(commit_module, "apply", slow(commit_module.apply, 2.0))
    monkeypatch.setattr(commit_module, "encode_record", slow(commit_module.encode_record, 4.0))
    storage_get, storage_put = storage.get, storage.put_if_absent

    def slow_get(key: str) -> bytes:
        clock.now += 0.5
        return storage_get(key)

    def slow_put(key: str, data: bytes) -> bool:
        clock.now += 0.25
        return storage_put(key, data)

    storage.get = slow_get  # type: ignore[method-assign]
    storage.put_if_absent = slow_put  # type: ignore[method-assign]
    began = clock.now
    attempt = p.attempt()
    assert attempt.success and attempt.committed == (0, 1, 2, 3)
    # latest's probe, the rebase, apply and encoding, the final probe, the put
    assert clock.now - began == pytest.approx(0.5 + 1.0 + 2.0 + 4.0 + 0.5 + 0.25)
    assert attempt.fragile_window_s == pytest.approx(0.75)


def test_a_stale_preparation_is_not_put() -> None:
    """A version prepared longer ago than confirm_after_s is refused without a write (its
    written_at_s would make it look older to the reclaimer), as is one whose base is no longer
    the newest the store has seen."""
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, settings=ManifestSettings(confirm_after_s=5), clock=clock, check_writes=False)
    p = Producer(store, "p0", clock=clock, sleep=clock.sleep)
    p.register()
    base = store.latest()
    prepared = store.prepare(base, Commit("p0", 1, (obj(0),)))
    clock.now += 6
    assert store.latest() == base  # seen again: only the preparation is stale
    assert store.put(prepared) is None and storage.list("manifest/") == [version_key(1)]
    again = store.prepare(base, Commit("p0", 1, (obj(0),)))
    Producer(ManifestStore(storage, check_writes=False), "p1").register()  # version 2
    assert not store.still_newest(base) and store.cached is not None and store.cached.version == 2
    assert store.put(again) is None  # its base is no longer the newest seen
    assert store.put(store.prepare(store.cached, Commit("p0", 1, (obj(0),)))) is not None


def _slowed(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, name: str, seconds: float, *, then: Callable[[], None] = lambda: None
) -> None:
    """Makes the commit module's `name` (apply, state_text or encode_record) take `seconds` on `clock`, once,
    running `then` (what others do meanwhile) before it returns."""
    fn, calls = getattr(commit_module, name), []

    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not calls:
            calls.append(1)
            clock.now += seconds
            then()
        return fn(*args, **kwargs)

    monkeypatch.setattr(commit_module, name, wrapped)


def test_a_base_seen_long_ago_by_a_slow_attempt_is_looked_up_again_and_the_put_goes_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preparing (here apply) took longer than confirm_after_s and nobody committed meanwhile: the
    producer looks its base up again (one ranged read) before its final probe, and puts, where
    the store alone would refuse the put for the base's age and the policy be told a conflict."""
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, settings=ManifestSettings(confirm_after_s=5), clock=clock, check_writes=False)
    policy = DacPolicy(DacSettings(jitter=0.0), random=lambda: 0.0)
    p = Producer(store, "p0", policy=policy, clock=clock, sleep=clock.sleep)
    p.register()
    p.add(obj(0))
    clock.now += 100
    ranged: list[str] = []
    get_range = storage.get_range

    def counted(key: str, start: int, end: int) -> bytes:
        ranged.append(key)
        return get_range(key, start, end)

    storage.get_range = counted  # type: ignore[method-assign]
    _slowed(monkeypatch, clock, "apply", 6.0)
    attempt = p.attempt()
    assert attempt.success and attempt.wrote and not attempt.stale and attempt.committed == (0,)
    assert ranged == [version_key(1), version_key(1)]  # latest's own look-up (seen 100 s ago), then the producer's
    assert store.latest().version == 2


def test_a_base_looked_up_fresh_enough_costs_no_read() -> None:
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, settings=ManifestSettings(confirm_after_s=10), clock=clock, check_writes=False)
    Producer(store, "p0", clock=clock, sleep=clock.sleep).register()
    base = store.latest()
    storage.get_range = lambda *a: pytest.fail("looked up")  # type: ignore[method-assign]
    clock.now += 5
    assert store.reconfirm(base)
    assert store.reconfirm(ManifestState())  # version 0 has no object to look up


def test_a_preparation_grown_too_old_is_no_put_and_no_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding took longer than confirm_after_s: the record's written_at_s is too old to put. The
    attempt is stale, not a lost race: no put, the steps stay pending, the policy learns no
    window and no conflict; the next attempt commits them."""
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, settings=ManifestSettings(confirm_after_s=5), clock=clock, check_writes=False)
    policy = DacPolicy(DacSettings(jitter=0.0, conflict_jitter=0.0), random=lambda: 0.0)
    p = Producer(store, "p0", policy=policy, clock=clock, sleep=clock.sleep)
    p.register()
    window, gap = policy.fragile_window_s, policy.gap_s()
    p.add(obj(0))
    clock.now += 100
    _slowed(monkeypatch, clock, "encode_record", 6.0)
    stale = p.attempt()
    assert stale.stale and not stale.wrote and not stale.success and stale.committed == ()
    assert storage.list("manifest/") == [version_key(1)]
    assert [e.step for e in p.pending] == [0]
    assert (policy.fragile_window_s, policy.gap_s()) == (window, gap)
    assert p.flush()[-1].committed == (0,)


def test_a_base_reclaimed_while_a_slow_attempt_prepared_sends_it_back_to_a_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    """While p0 prepared on version 3 for 6 s, p1 committed up to a checkpoint (version 8) and the
    reclaimer deleted everything below it, versions 3 and 4 included: p0's final probe would find
    no version 4, and the store alone would refuse the put for its base's age. p0 reads the
    manifest afresh from a listing and commits on the newest version, without a lost put."""
    clock = FakeClock()
    storage = MemoryStorage()
    settings = ManifestSettings(checkpoint_every=4, confirm_after_s=5)
    p0 = Producer(ManifestStore(storage, settings=settings, clock=clock, check_writes=False), "p0", clock=clock, sleep=clock.sleep)
    p1 = Producer(ManifestStore(storage, settings=settings, clock=clock, check_writes=False), "p1", clock=clock, sleep=clock.sleep)
    p0.register()
    p1.register()
    p1.commit([obj(1)])  # version 3
    p0.add(obj(0))
    clock.now += 1

    def others() -> None:
        for step in (3, 5, 7, 9, 11):
            p1.commit([obj(step)])  # versions 4 to 8 (a checkpoint)
        for v in range(1, 8):  # the final probe's version 4 too: it would find nothing newer
            storage.delete(version_key(v))

    _slowed(monkeypatch, clock, "apply", 6.0, then=others)
    attempt = p0.attempt()
    assert attempt.success and attempt.wrote and attempt.committed == (0,) and attempt.version == 9
    final = ManifestStore(storage, settings=settings, check_writes=False).latest()
    assert [(c.step, c.producer) for c in final.steps] == [(0, "p0")] + [(s, "p1") for s in (1, 3, 5, 7, 9, 11)]


def test_a_checkpoint_slow_to_encode_is_still_put(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a checkpoint's state text took longer than confirm_after_s (a large state on a
    loaded machine): the record is stamped after it, so the put goes ahead, and its bytes are
    what `encode_record` alone writes."""
    clock = FakeClock()
    storage = MemoryStorage()
    store = ManifestStore(storage, settings=ManifestSettings(checkpoint_every=2, confirm_after_s=5), clock=clock, check_writes=False)
    p = Producer(store, "p0", clock=clock, sleep=clock.sleep)
    p.register()
    p.add(obj(0))
    _slowed(monkeypatch, clock, "state_text", 6.0)
    attempt = p.attempt()
    assert attempt.success and attempt.wrote and attempt.version == 2
    record = decode_record(storage.get(version_key(2)))
    assert record.state is not None and [c.step for c in record.state.steps] == [0]
    assert storage.get(version_key(2)) == encode_record(record)
