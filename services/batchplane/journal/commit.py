"""The journal's manifest on a `Storage`: finding, reading and committing manifest versions
(`ManifestStore`), and the producer side of the commit protocol (`Producer`): a fenced
producer id, exactly-once commits of built steps with the producer's state in the same version,
rebase on conflict, cadence by a commit policy.

Layout (keys under the store's prefix):

    manifest/000000000001.json    version 1
    manifest/000000000064.json    version 64: a checkpoint (it also holds the whole state)

Version N is an immutable object created with put_if_absent of its key, never overwritten and
never pointed at: whoever creates `manifest/<N+1>` first commits version N+1, and a loser of
that race gets False and rebases. Names are 12 zero-padded digits, so they sort by version.
Version 0 is the empty state and has no object. Every version object records the change from
the previous version (`batchplane.journal.manifest`: Register, Commit, Retain); every
`checkpoint_every`-th version (version % K == 0) also holds the whole state after it, so a reader
starting cold reads one checkpoint and at most K - 1 changes, whatever the journal's length.
Commits stay small (one change) except at checkpoints.

Finding the latest version trusts no hint: a reader probes forward from the version it knows
(GET N+1, N+2, ... until NotFound), and starts cold from a listing of `manifest/` (the newest
key; then the newest checkpoint at or below it, walking down if K changed). A probe that finds
nothing new is trusted only while the known version was seen within `confirm_after_s`;
otherwise the known version's object is looked up again, and if it is gone (reclaimed) the
reader starts cold from a listing.

Contract with the reclaimer (what keeps the probe and put_if_absent safe once old versions are
deleted): delete version objects only in ascending order, only below the newest checkpoint
version, and only once older than a minimum age (by the record's `written_at_s`) far above
`confirm_after_s`. Then "N exists and N+1 does not" means N+1 was never committed, and a
writer never re-creates a deleted version: it puts N+1 only on a base N it saw within
`confirm_after_s`, and only a record prepared within `confirm_after_s` (so its `written_at_s`
is no older than that when it is put). A writer that prepared slowly (under load) looks its
base up again before the final probe (`reconfirm`, once half of `confirm_after_s` has passed),
so its put is not refused for the base's age; a put refused for its age is no lost race
(`Attempt.stale`), and the policy is not told of a conflict.

A commit attempt does its CPU work before the read it races from: it reads the newest version,
rebases its pending steps onto it and prepares the next version (`ManifestStore.prepare`: the
change applied, the record encoded), and only then probes for the version after its base (one
GET). If one appeared, it catches up and prepares again, without a put (that is not a lost
race), unless its policy defers the attempt (`CommitPolicy.on_caught_up`: DAC waits a gap,
spread as after a conflict, since every producer that was preparing then caught up on the same
version and would race the others for the next); if none did, it puts. The fragile window W,
in which another producer's commit makes the put lose, runs from the start of that final probe
to the end of the put: one GET and one put, with no CPU work per pending step in between (the
commit policy's gap grows with W, and the steps pending at an attempt with the gap).

Exactly once across producer failures: a producer id registers (a Register change: the next
fencing epoch) before it commits; its state (epoch, last committed step) is committed in the
same version as its steps; a restarted process of the id registers again and resumes after its
last committed step; an older process of the id is refused (`Fenced`) at its next attempt.
The objects of steps that another producer committed first are orphans (`Producer.orphans`),
to be deleted by the caller.

Not thread-safe: one `ManifestStore` and one `Producer` per thread. Clocks and sleep are
injectable; the only I/O is through the `Storage`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchplane.core.errors import ConfigError, FailedPrecondition, NotFound, Unavailable
from batchplane.core.object_storage import check_conditional_puts
from batchplane.core.storage import Storage
from batchplane.journal.manifest import (
    Change,
    CheckpointMismatch,
    Commit,
    CommitRefused,
    Fenced,
    ManifestState,
    ProducerState,
    Register,
    StepEntry,
    StepObject,
    VersionRecord,
    apply,
    decode_next,
    decode_record,
    encode_record,
    rebase,
    state_text,
)
from batchplane.journal.policy import CommitPolicy, NaivePolicy, is_due

log = logging.getLogger(__name__)

#: The folder of the manifest versions, under the store's prefix.
MANIFEST_FOLDER = "manifest/"
_DIGITS = 12
_VERSION_NAME = re.compile(r"^(\d{12})\.json$")
_COLD_TRIES = 5


@dataclass(frozen=True)
class ManifestSettings:
    """How the manifest is kept.

    Attributes:
        checkpoint_every: K: every K-th version holds the whole state (versions, >= 1).
        confirm_after_s: A known version not seen for longer is looked up again before a probe
            that finds nothing new is trusted (seconds, > 0; far below the reclaimer's
            minimum age of a version).
        active_within_versions: A producer counts as active (the commit policy's producer
            count) if it registered or committed within this many versions (>= 1).
    """

    checkpoint_every: int = 64
    confirm_after_s: float = 30.0
    active_within_versions: int = 256

    def check(self) -> None:
        """Raises ConfigError naming a field out of range."""
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1:
            raise ConfigError("journal.checkpoint_every", "must be an integer >= 1", self.checkpoint_every)
        if not (isinstance(self.confirm_after_s, (int, float)) and self.confirm_after_s > 0 and math.isfinite(self.confirm_after_s)):
            raise ConfigError("journal.confirm_after_s", "must be a finite number > 0", self.confirm_after_s)
        if (
            isinstance(self.active_within_versions, bool)
            or not isinstance(self.active_within_versions, int)
            or self.active_within_versions < 1
        ):
            raise ConfigError("journal.active_within_versions", "must be an integer >= 1", self.active_within_versions)


def version_key(version: int, *, prefix: str = "") -> str:
    """The key of manifest version `version` (> 0) under `prefix` ("" or ending in '/')."""
    return f"{prefix}{MANIFEST_FOLDER}{version:0{_DIGITS}d}.json"


class ManifestStore:
    """Reads and commits the manifest versions under `prefix` of a storage.

    Args:
        storage: Where the journal lies.
        prefix: The journal's folder in it ("" or ending in '/').
        settings: Checkpoint cadence and probe freshness.
        check_writes: Prove first that the storage honours conditional puts (for writers).
        clock: Monotonic seconds.
        wall_clock: Unix seconds, recorded in each version for the reclaimer's minimum age.

    Raises:
        ConfigError: A bad setting or prefix.
        FailedPrecondition: `check_writes` and the storage ignores conditional puts.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        settings: ManifestSettings = ManifestSettings(),
        check_writes: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        settings.check()
        if prefix and not prefix.endswith("/"):
            raise ConfigError("journal.prefix", "must be empty or end with '/'", prefix)
        self.storage = storage
        self.prefix = prefix
        self.settings = settings
        self._clock = clock
        self._wall_clock = wall_clock
        self._state: ManifestState | None = None
        self._seen_at = -math.inf  # when the cached version was last seen to exist
        self._probed_at = -math.inf  # when the read that found no newer version began
        self._catch_up_s = 0.0  # of the last `latest`: seconds before the read that found the newest version
        if check_writes:
            try:
                check_conditional_puts(storage)
            except FailedPrecondition as exc:
                raise FailedPrecondition(
                    f"the journal's manifest cannot be committed on {storage.describe()}: versions are claimed with "
                    f"put-if-absent, and {exc}"
                ) from exc

    def key(self, version: int) -> str:
        """The key of manifest version `version`."""
        return version_key(version, prefix=self.prefix)

    @property
    def catch_up_s(self) -> float:
        """Seconds the last `latest` spent before the read that found the newest version (the
        probe for the version after it, which found none): reading and applying the versions
        committed since the previous call. Not fragile: a version committed then is read too."""
        return self._catch_up_s

    @property
    def cached(self) -> ManifestState | None:
        """The newest state this store has seen, without asking the storage."""
        return self._state

    def latest(self) -> ManifestState:
        """The state of the newest committed version, probing forward from the cached one.

        Returns:
            The state (version 0, empty, when nothing is committed).

        Raises:
            ManifestFormatError: A version object this code cannot read.
            FailedPrecondition: A version records a change its predecessor does not allow, or
                a checkpoint disagrees with the changes before it (a corrupt manifest).
            Unavailable: The storage cannot be reached, or versions kept vanishing under a
                cold start.
        """
        began = self._clock()
        if self._state is None:
            state = self._cold_start()
            self._catch_up_s = max(0.0, self._probed_at - began)
            return state
        known = self._state
        state = self._probe(known)
        self._catch_up_s = max(0.0, self._probed_at - began)
        if state.version == known.version and state.version > 0 and self._clock() - self._seen_at > self.settings.confirm_after_s:
            if not self._exists(state.version):
                log.info("manifest version %d was reclaimed under this reader; reading the manifest afresh", state.version)
                return self._cold_start()
            self._seen_at = self._clock()
        return state

    def read(self, version: int) -> ManifestState:
        """The state of one version (e.g. a consumer's cursor), from the newest checkpoint at
        or below it.

        Args:
            version: The version (>= 0).

        Returns:
            Its state.

        Raises:
            NotFound: The version, or a version it needs, is not committed or was reclaimed.
            ManifestFormatError, FailedPrecondition: As `latest`.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if self._state is not None and self._state.version == version:
            return self._state
        state, _ = self._load_down_from(version)
        return state

    def read_record(self, version: int) -> VersionRecord:
        """The record of one version object.

        Raises:
            NotFound: No such version object.
            ManifestFormatError: As `latest`.
        """
        return decode_record(self.storage.get(self.key(version)), version=version)

    def prepare(self, base: ManifestState, change: Change) -> PreparedVersion:
        """Builds version base.version + 1 without writing it: `change` applied to `base` and the
        version's record encoded (the whole state too at a checkpoint). The CPU work of a
        commit, done before the final probe so that it lies outside the fragile window.

        Args:
            base: The state it applies to (the newest this store has seen, to be put).
            change: The change.

        Returns:
            The prepared version, for `put`.

        Raises:
            Fenced, CommitRefused: `base` does not allow `change`.
        """
        new = apply(base, change)
        checkpoint = new.version % self.settings.checkpoint_every == 0
        # A checkpoint's text first: it can take seconds of a loaded machine, and the record's
        # written_at_s must be no older than confirm_after_s when it is put.
        text = state_text(new) if checkpoint else None
        prepared_at = self._clock()  # with the record's written_at_s
        record = VersionRecord(
            version=new.version, change=change, written_at_s=float(self._wall_clock()), state=new if checkpoint else None
        )
        return PreparedVersion(base_version=base.version, state=new, data=encode_record(record, state=text), prepared_at_s=prepared_at)

    def still_newest(self, state: ManifestState) -> bool:
        """Whether `state` is still the newest version: one GET of the version after it (the
        final probe before a put). A version found there is read and cached: the next `latest`
        probes on from it.

        Args:
            state: The newest state this store has seen (else False, reading nothing).

        Returns:
            True if version state.version + 1 does not exist.

        Raises:
            ManifestFormatError, FailedPrecondition, Unavailable: As `latest`.
        """
        if self._state is None or state.version != self._state.version:
            return False
        try:
            data = self.storage.get(self.key(state.version + 1))
        except NotFound:
            return True
        self._state = _advance_bytes(self._state, data)
        self._seen_at = self._clock()
        return False

    def put(self, prepared: PreparedVersion) -> ManifestState | None:
        """Tries to commit a prepared version as version prepared.base_version + 1.

        Args:
            prepared: From `prepare`. Nothing is written unless its base is the newest version
                this store has seen, seen within `confirm_after_s`, and it was prepared within
                `confirm_after_s` (a stale base could re-create a reclaimed version; a stale
                record's `written_at_s` would make it look older to the reclaimer).

        Returns:
            The new state if this call committed it; None if the version was taken (or the
            base or the record is stale): read `latest`, rebase, prepare and try again.

        Raises:
            Unavailable: The storage failed; whether the version was written is unknown.
        """
        if self._state is None or prepared.base_version != self._state.version or self.stale(prepared):
            return None
        new = prepared.state
        if not self.storage.put_if_absent(self.key(new.version), prepared.data):
            return None
        self._state = new
        self._seen_at = self._clock()
        return new

    def stale(self, prepared: PreparedVersion) -> str | None:
        """Why `put` would refuse `prepared` without trying, for its age: its base was last seen
        to exist, or it was prepared, more than `confirm_after_s` ago (see `put`); None if
        neither."""
        now = self._clock()
        if now - self._seen_at > self.settings.confirm_after_s:
            return f"its base, version {prepared.base_version}, was last seen {now - self._seen_at:.1f} s ago"
        if now - prepared.prepared_at_s > self.settings.confirm_after_s:
            return f"it was prepared {now - prepared.prepared_at_s:.1f} s ago"
        return None

    def reconfirm(self, state: ManifestState) -> bool:
        """Looks version `state.version` up again if it was last seen more than half of
        `confirm_after_s` ago, so that a put prepared on it slowly (under load) is not refused
        for the age of its base: one ranged GET, only then.

        Args:
            state: The newest state this store has seen.

        Returns:
            False if the version is gone (reclaimed under a slow writer): the next `latest`
            reads the manifest afresh. Else True.
        """
        if self._state is None or state.version != self._state.version or state.version == 0:
            return True
        if self._clock() - self._seen_at <= self.settings.confirm_after_s / 2:
            return True
        asked = self._clock()
        if not self._exists(state.version):
            log.info("manifest version %d was reclaimed under this writer; reading the manifest afresh", state.version)
            self._state = None  # the next `latest` starts cold
            return False
        self._seen_at = asked
        return True

    def _probe(self, state: ManifestState) -> ManifestState:
        """Applies the versions after `state` until one is missing; caches the result."""
        while True:
            asked = self._clock()
            try:
                data = self.storage.get(self.key(state.version + 1))
            except NotFound:
                self._probed_at = asked
                break
            state = _advance_bytes(state, data)
            self._state = state
            self._seen_at = self._clock()
        self._state = state
        return state

    def _cold_start(self) -> ManifestState:
        """Reads the manifest from a listing: the newest version, from the checkpoint below it."""
        for _ in range(_COLD_TRIES):
            versions = self._listed_versions()
            top = versions[-1] if versions else 0
            try:
                state, _ = self._load_down_from(top)
            except NotFound:
                continue  # reclaimed under us: list again
            self._state = state
            self._seen_at = self._clock()
            return self._probe(state)
        raise Unavailable(
            f"could not read the manifest in {self.storage.describe()}: versions kept vanishing while it was read ({_COLD_TRIES} listings)"
        )

    def _load_down_from(self, top: int) -> tuple[ManifestState, int]:
        """The state of version `top`: the newest checkpoint at or below it, then the changes.

        Raises:
            NotFound: A version needed is missing.
        """
        k = self.settings.checkpoint_every
        records: list[VersionRecord] = []
        base = ManifestState()
        candidate = (top // k) * k
        version = top
        if candidate > 0:
            record = self.read_record(candidate)
            if record.state is not None:
                base, version = record.state, candidate
        if base.version == 0:  # no checkpoint where expected (K changed): walk down
            while version > 0:
                record = self.read_record(version)
                if record.state is not None:
                    base = record.state
                    break
                records.append(record)
                version -= 1
            records.reverse()
        else:
            records = [self.read_record(v) for v in range(candidate + 1, top + 1)]
        state = base
        for record in records:
            state = _advance(state, record)
        return state, len(records)

    def _listed_versions(self) -> list[int]:
        out = []
        folder = self.prefix + MANIFEST_FOLDER
        for key in self.storage.list(folder):
            m = _VERSION_NAME.match(key[len(folder) :])
            if m and int(m.group(1)) > 0:
                out.append(int(m.group(1)))
        return sorted(out)

    def _exists(self, version: int) -> bool:
        try:
            self.storage.get_range(self.key(version), 0, 0)
        except NotFound:
            return False
        return True


@dataclass(frozen=True)
class PreparedVersion:
    """The next manifest version, built and encoded but not written (`ManifestStore.prepare`).

    Attributes:
        base_version: The version it follows.
        state: Its state.
        data: Its version object's bytes.
        prepared_at_s: When it was prepared (the store's monotonic clock, seconds).
    """

    base_version: int
    state: ManifestState
    data: bytes
    prepared_at_s: float


def _advance(state: ManifestState, record: VersionRecord) -> ManifestState:
    """The state after `record`, checked against its checkpoint if it holds one."""
    try:
        new = apply(state, record.change)
    except CommitRefused as exc:
        raise FailedPrecondition(
            f"manifest version {record.version} records a change that version {state.version} does not allow "
            f"(a corrupt manifest or a writer that skipped the rules): {exc}"
        ) from exc
    if record.state is not None and record.state != new:
        raise FailedPrecondition(
            f"manifest version {record.version}: its checkpoint disagrees with the changes before it (a corrupt manifest)"
        )
    return new


def _advance_bytes(state: ManifestState, data: bytes) -> ManifestState:
    """The state after the version object `data` that follows `state` (its change decoded and
    applied; a checkpoint compared, not decoded)."""
    try:
        _, new = decode_next(data, state)
    except CheckpointMismatch as exc:
        raise FailedPrecondition(str(exc)) from exc
    except CommitRefused as exc:
        raise FailedPrecondition(
            f"manifest version {state.version + 1} records a change that version {state.version} does not allow "
            f"(a corrupt manifest or a writer that skipped the rules): {exc}"
        ) from exc
    return new


@dataclass(frozen=True)
class Attempt:
    """The outcome of one commit attempt.

    Attributes:
        success: Whether every pending step is now committed (this attempt's put won, or
            nothing was left to put after the rebase).
        wrote: Whether a put was tried (not when the policy deferred the attempt after
            catching up: success is then False and the steps stay pending).
        version: The version committed (success) or the newest seen.
        committed: Steps this attempt made visible.
        already: Steps found committed by an earlier attempt of this producer.
        taken: Steps found committed by another producer (their objects here are orphans).
        fragile_window_s: Seconds from the start of the final probe (the GET that found no
            version after the prepared one's base) to the end of the put; the rebase, apply
            and encoding before it are outside. 0 when no put was tried.
        caught_up: Versions that appeared between preparing and the final probe (each read,
            and the commit rebased and prepared again, without a put: no lost race).
        stale: No put was tried because the prepared version had grown too old to put
            (`ManifestStore.stale`: preparing took longer than `confirm_after_s`, under load);
            the steps stay pending and the policy is not told of a conflict.
    """

    success: bool
    wrote: bool
    version: int
    committed: tuple[int, ...] = ()
    already: tuple[int, ...] = ()
    taken: tuple[int, ...] = ()
    fragile_window_s: float = 0.0
    caught_up: int = 0
    stale: bool = False


class Producer:
    """One producer id's side of the commit protocol (see the module docstring).

    Build steps in increasing order after `last_step`, `add` each, call `maybe_commit` between
    steps and `flush` at the end.

    Args:
        store: The manifest.
        producer_id: A stable id (kept across restarts), 1 to 128 characters of
            [A-Za-z0-9._=-].
        policy: When to attempt a commit (default: naive).
        clock: Monotonic seconds.
        sleep: Sleeps that many seconds (`flush` and `register` wait the policy's gap).
    """

    def __init__(
        self,
        store: ManifestStore,
        producer_id: str,
        *,
        policy: CommitPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.producer_id = producer_id
        self.policy: CommitPolicy = policy if policy is not None else NaivePolicy()
        self._clock = clock
        self._sleep = sleep
        self._epoch = 0
        self._last_step = -1
        self._pending: list[StepEntry] = []
        self._orphans: list[StepObject] = []
        self._fenced: Fenced | None = None
        self._last_end = -math.inf

    @property
    def epoch(self) -> int:
        """This process's fencing epoch (0 before `register`)."""
        return self._epoch

    @property
    def last_step(self) -> int:
        """The producer's last committed step as this process knows it (-1: none)."""
        return self._last_step

    @property
    def pending(self) -> tuple[StepEntry, ...]:
        """Built steps not yet committed."""
        return tuple(self._pending)

    @property
    def orphans(self) -> tuple[StepObject, ...]:
        """Objects of steps that another producer committed first, or that a fenced process
        built: referenced by no version, to delete."""
        return tuple(self._orphans)

    def take_orphans(self) -> list[StepObject]:
        """Returns the orphans and forgets them (the caller deletes them)."""
        out, self._orphans = self._orphans, []
        return out

    def register(self, *, max_attempts: int = 1000) -> ProducerState:
        """Claims the next fencing epoch of the id through the manifest (fencing every older
        process of the id) and learns the last committed step to resume after.

        Args:
            max_attempts: Conditional puts tried before giving up.

        Returns:
            The producer's committed state in the version that registered it.

        Raises:
            Unavailable: Every attempt lost its race, or the storage failed.
        """
        for _ in range(max_attempts):
            self._wait_gap()
            base, prepared, start, _ = self._prepare_on_newest(lambda _: Register(self.producer_id))
            if prepared is None:  # cannot happen: a Register is always prepared
                raise FailedPrecondition(f"producer {self.producer_id!r} prepared no registration")
            if self._too_old(prepared):
                self._last_end = self._clock()
                continue
            try:
                new = self.store.put(prepared)
            except Unavailable:
                new = None  # perhaps written: registering again only fences that registration
            end = self._clock()
            self._last_end = end
            self.policy.on_attempt(
                success=new is not None,
                fragile_window_s=end - start,
                producers=(new or base).active_producers(self.store.settings.active_within_versions),
            )
            if new is not None:
                state = new.producer(self.producer_id)
                if state is None:  # cannot happen: the Register just applied made it
                    raise FailedPrecondition(f"producer {self.producer_id!r} is missing from the version that registered it")
                self._epoch, self._last_step, self._fenced = state.epoch, state.last_step, None
                self._orphan_pending(new)
                log.info(
                    "producer %s registered with epoch %d at manifest version %d; resuming after step %d",
                    self.producer_id,
                    state.epoch,
                    new.version,
                    state.last_step,
                )
                return state
        raise Unavailable(f"producer {self.producer_id!r} could not register: {max_attempts} attempts lost their race")

    def add(self, entry: StepEntry) -> None:
        """Holds a built step (its objects written) until a commit.

        Raises:
            FailedPrecondition: Not registered, fenced, or the step is not after the last
                committed and pending ones (steps are built in increasing order).
        """
        self._check_live()
        after = self._pending[-1].step if self._pending else self._last_step
        if entry.step <= after:
            raise FailedPrecondition(f"producer {self.producer_id!r} builds step {entry.step} after step {after}: steps must increase")
        # Its record text, cached now: every attempt that carries the step only joins texts.
        _ = entry.encoded
        self._pending.append(entry)

    def due(self) -> bool:
        """Whether the policy says to attempt now."""
        return is_due(self.policy, pending_steps=len(self._pending), since_attempt_s=self._clock() - self._last_end)

    def maybe_commit(self) -> Attempt | None:
        """Attempts a commit if the policy says so.

        Returns:
            The attempt, or None if none was due.

        Raises:
            As `attempt`.
        """
        return self.attempt() if self._pending and self.due() else None

    def attempt(self) -> Attempt:
        """One commit attempt: read the newest version, rebase the pending steps onto it and
        prepare the next version with them and this producer's new last step, then probe for a
        version after the base; if one appeared, catch up and prepare again (no put: not a lost
        race), else put. The fragile window is the final probe and the put.

        Returns:
            The outcome; a lost race keeps the steps pending.

        Raises:
            Fenced: A newer process registered the id (the pending steps become orphans).
            CommitRefused: The manifest does not allow the pending steps (see `rebase` and
                `batchplane.journal.manifest.apply`).
            FailedPrecondition: Not registered.
            Unavailable: The storage failed while reading.
        """
        self._check_live()
        already: list[int] = []
        taken: list[int] = []
        commits: list[Commit] = []  # the rebased commit of each turn; the last is put

        def rebased_commit(base: ManifestState) -> Commit | None:
            try:
                rebased = rebase(base, Commit(self.producer_id, self._epoch, tuple(self._pending)))
            except Fenced as exc:
                self._fence(exc, base)
                raise
            self._drop(rebased.mine, rebased.taken)
            already.extend(rebased.mine)
            taken.extend(rebased.taken)
            mine = base.producer(self.producer_id)
            self._last_step = max(self._last_step, mine.last_step if mine else -1)
            if rebased.commit is not None:
                commits.append(rebased.commit)
            return rebased.commit

        base, prepared, start, caught_up = self._prepare_on_newest(rebased_commit, defer=self._defer)
        stale = prepared is not None and self._too_old(prepared)
        if stale or (prepared is None and caught_up and self._pending):  # too old, or deferred by the policy: no put now
            self._last_end = self._clock()
            return Attempt(
                success=False,
                wrote=False,
                version=base.version + 1,
                already=tuple(already),
                taken=tuple(taken),
                caught_up=caught_up,
                stale=stale,
            )
        if prepared is None:
            return Attempt(success=True, wrote=False, version=base.version, already=tuple(already), taken=tuple(taken), caught_up=caught_up)
        try:
            new = self.store.put(prepared)
        except Unavailable as exc:
            log.warning(
                "producer %s: commit of version %d failed, outcome unknown (the next attempt finds out): %s",
                self.producer_id,
                base.version + 1,
                exc,
            )
            new = None
        end = self._clock()
        self._last_end = end
        window = end - start
        self.policy.on_attempt(
            success=new is not None,
            fragile_window_s=window,
            producers=(new or base).active_producers(self.store.settings.active_within_versions),
        )
        outcome = Attempt(
            success=new is not None,
            wrote=True,
            version=base.version if new is None else new.version,
            already=tuple(already),
            taken=tuple(taken),
            fragile_window_s=window,
            caught_up=caught_up,
        )
        if new is None:
            return outcome
        committed = tuple(e.step for e in commits[-1].steps)
        self._pending = []
        self._last_step = committed[-1]
        return dataclasses.replace(outcome, committed=committed)

    def flush(self, *, max_attempts: int = 10_000) -> list[Attempt]:
        """Commits every pending step, waiting the policy's gap between attempts (the count of
        steps a policy wants is ignored: these are the last ones).

        Args:
            max_attempts: Attempts before giving up.

        Returns:
            The attempts made.

        Raises:
            Unavailable: `max_attempts` attempts lost their race.
            Fenced, FailedPrecondition: As `attempt`.
        """
        attempts: list[Attempt] = []
        while self._pending:
            if len(attempts) >= max_attempts:
                raise Unavailable(
                    f"producer {self.producer_id!r} could not commit steps {[e.step for e in self._pending]}: "
                    f"{max_attempts} attempts lost their race"
                )
            self._wait_gap()
            attempts.append(self.attempt())
        return attempts

    def commit(self, entries: Sequence[StepEntry]) -> list[Attempt]:
        """Adds `entries` and flushes them.

        Raises:
            As `add` and `flush`.
        """
        for entry in entries:
            self.add(entry)
        return self.flush()

    def _prepare_on_newest(
        self, change_for: Callable[[ManifestState], Change | None], *, defer: Callable[[ManifestState, float], bool] = lambda base, s: False
    ) -> tuple[ManifestState, PreparedVersion | None, float, int]:
        """Reads the newest version, prepares `change_for(base)` on it, and probes for a version
        after the base; while one appeared, does it all again on the newer version (each turn
        means another producer committed, so the manifest progresses) unless `defer(base,
        seconds spent reading and preparing)` says to stop there.

        Returns:
            (base, the version prepared on it or None if `change_for` gave no change or the
            attempt was deferred after catching up, the start of the final probe on the
            producer's clock, versions caught up on after preparing).
        """
        caught_up = 0
        while True:
            began = self._clock()
            base = self.store.latest()
            change = change_for(base)
            if change is None:
                return base, None, 0.0, caught_up
            prepared = self.store.prepare(base, change)
            if not self.store.reconfirm(base):
                continue  # reclaimed while this attempt prepared: read the manifest again
            start = self._clock()
            if self.store.still_newest(base):
                return base, prepared, start, caught_up
            caught_up += 1
            if defer(base, start - began):
                return base, None, 0.0, caught_up

    def _too_old(self, prepared: PreparedVersion) -> bool:
        """Whether `prepared` grew too old to put (`ManifestStore.stale`), logged: not a lost
        race, so the policy is not told of one."""
        why = self.store.stale(prepared)
        if why is not None:
            log.warning("producer %s: version %d not put: %s; trying again", self.producer_id, prepared.base_version + 1, why)
        return why is not None

    def _defer(self, base: ManifestState, prepare_s: float) -> bool:
        """Whether the policy defers an attempt that caught up on a version committed after
        `base`, which it read and prepared on in `prepare_s`."""
        producers = base.active_producers(self.store.settings.active_within_versions)
        return self.policy.on_caught_up(producers=producers, prepare_s=prepare_s)

    def _wait_gap(self) -> None:
        remaining = self.policy.gap_s() - (self._clock() - self._last_end)
        if remaining > 0:
            self._sleep(remaining)

    def _drop(self, mine: tuple[int, ...], taken: tuple[int, ...]) -> None:
        if not mine and not taken:
            return
        gone = set(mine) | set(taken)
        orphaned = set(taken)
        self._orphans.extend(o for e in self._pending if e.step in orphaned for o in e.objects)
        self._pending = [e for e in self._pending if e.step not in gone]
        if taken:
            log.info(
                "producer %s: steps %s were committed by another producer; their objects here are orphans", self.producer_id, list(taken)
            )

    def _fence(self, exc: Fenced, state: ManifestState) -> None:
        self._fenced = exc
        self._orphan_pending(state)
        log.warning("%s", exc)

    def _orphan_pending(self, state: ManifestState) -> None:
        """Gives up the pending steps: their objects are orphans unless `state` lists them as
        this producer's (an attempt that looked lost had won)."""
        for entry in self._pending:
            done = state.step(entry.step)
            if done is None or done.entry != entry or done.producer != self.producer_id:
                self._orphans.extend(entry.objects)
        self._pending = []

    def _check_live(self) -> None:
        if self._fenced is not None:
            raise self._fenced
        if self._epoch == 0:
            raise FailedPrecondition(f"producer {self.producer_id!r} has not registered")
