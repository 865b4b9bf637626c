"""The reclaimer's I/O driver: deletes what no live checkpoint needs any more — TGB objects of
steps below the lowest live mark, orphan objects, and old manifest versions — by the rules of
`batchplane.journal.retention.reclaim`, over the manifest's state and a listing of the store.

One round (`Reclaimer.run_once`):

1. read the newest manifest state; the live marks are its `marks` (their minimum is the floor);
2. list the TGB objects and the manifest versions; read each version's record once (cached:
   versions are immutable) for its time and whether it is a checkpoint;
3. decide with `retention.reclaim`;
4. advance the retention watermark (a `Retain` change) to the first step that is not
   reclaimable, so the steps below are no longer listed, and only then delete their objects and
   the orphans, in ascending key (= step) order;
5. delete the reclaimable manifest versions in ascending order.

Idempotent: a round interrupted anywhere leaves nothing the next round cannot finish (objects of
steps below the watermark are orphans to it). The contract of `batchplane.journal.commit` holds:
versions are deleted ascending, only below the newest checkpoint (retention keeps every version
a kept version is read through), only once `min_age_s` old, and `min_age_s` must be at least
`MIN_AGE_FACTOR` times the manifest's `confirm_after_s`. Orphans' ages are counted from when this
reclaimer first listed them (the storage keeps no times): later than their writing, so safe.

Not thread-safe; clocks are injectable; the only I/O is through the `Storage`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable

from batchplane.core.errors import ConfigError, NotFound
from batchplane.core.storage import Storage
from batchplane.journal.commit import MANIFEST_FOLDER, ManifestSettings, ManifestStore
from batchplane.journal.manifest import CommitRefused, ManifestState, Retain, VersionRecord
from batchplane.journal.retention import ObjectInfo, Reclamation, RetentionPolicy, StepInfo, VersionInfo, Watermark, reclaim
from batchplane.journal.writer import TGB_FOLDER, parse_object_key

log = logging.getLogger(__name__)

#: min_age_s must be at least this many times the manifest's confirm_after_s.
MIN_AGE_FACTOR = 4
_VERSION_NAME = re.compile(r"^(\d{12})\.json$")


@dataclasses.dataclass(frozen=True)
class ReclaimReport:
    """What one round did.

    Attributes:
        decision: What retention allowed.
        watermark: The retention watermark after the round.
        objects_deleted: TGB object keys deleted (steps below the watermark, orphans).
        versions_deleted: Manifest versions deleted.
    """

    decision: Reclamation
    watermark: int
    objects_deleted: tuple[str, ...]
    versions_deleted: tuple[int, ...]


class Reclaimer:
    """Deletes what the journal no longer needs (see the module docstring).

    Args:
        storage: Where the journal lies.
        prefix: Its folder ("" or ending in '/').
        policy: min_age_s (max_lag is the writers').
        manifest_settings: The manifest's settings (confirm_after_s bounds min_age_s).
        clock: Monotonic seconds.
        wall_clock: Unix seconds (the clock of the versions' written_at_s).

    Raises:
        ConfigError: min_age_s below MIN_AGE_FACTOR x confirm_after_s.
        FailedPrecondition: The storage ignores conditional puts.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        policy: RetentionPolicy = RetentionPolicy(),
        manifest_settings: ManifestSettings = ManifestSettings(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if policy.min_age_s < MIN_AGE_FACTOR * manifest_settings.confirm_after_s:
            raise ConfigError(
                "journal.retention.min_age_s",
                f"must be at least {MIN_AGE_FACTOR} x journal.confirm_after_s ({manifest_settings.confirm_after_s} s), "
                "so that a deleted manifest version is never mistaken for one never committed",
                policy.min_age_s,
            )
        self.storage = storage
        self.prefix = prefix
        self.policy = policy
        self._store = ManifestStore(
            storage, prefix=prefix, settings=manifest_settings, check_writes=True, clock=clock, wall_clock=wall_clock
        )
        self._wall_clock = wall_clock
        self._records: dict[int, tuple[float, bool]] = {}  # version -> (written_at_s, is a checkpoint)
        self._first_seen: dict[str, float] = {}

    def run_once(self) -> ReclaimReport:
        """One round: decide, advance the watermark, delete.

        Returns:
            What it did.

        Raises:
            Unavailable: The storage failed (the next round picks up where this one stopped).
            ManifestFormatError, FailedPrecondition: A manifest this code cannot read.
        """
        state = self._store.latest()
        now = float(self._wall_clock())
        versions = self._versions(now)
        decision = reclaim(
            watermarks=[Watermark(m.manifest_version, m.step) for m in state.marks],
            steps=[
                StepInfo(s.step, s.version, self._written_at(s.version, now), tuple(o.key for o in s.entry.objects)) for s in state.steps
            ],
            versions=versions,
            stored=self._stored(now),
            now_s=now,
            policy=self.policy,
        )
        state = self._retain(state, set(decision.steps))
        kept = {o.key for s in state.steps for o in s.entry.objects}
        below = {key for key in decision.objects if key not in kept}
        below.update(key for key in decision.orphans if key not in kept)
        deleted = []
        for key in sorted(below):
            self.storage.delete(key)
            self._first_seen.pop(key, None)
            deleted.append(key)
        gone_versions = []
        for version in decision.versions:  # ascending
            self.storage.delete(self._store.key(version))
            self._records.pop(version, None)
            gone_versions.append(version)
        if deleted or gone_versions:
            log.info(
                "journal reclaimer: watermark at step %d; deleted %d objects and manifest versions %s",
                state.watermark,
                len(deleted),
                _span(gone_versions),
            )
        return ReclaimReport(decision, state.watermark, tuple(deleted), tuple(gone_versions))

    def _retain(self, state: ManifestState, gone: set[int]) -> ManifestState:
        """Commits the watermark past the reclaimable steps at its bottom (one attempt: a lost
        race is retried next round)."""
        target = state.watermark
        while target in gone:
            target += 1
        if target == state.watermark:
            return state
        try:
            new = self._store.put(self._store.prepare(state, Retain(target)))
        except CommitRefused as exc:  # a mark moved under us: next round
            log.info("journal reclaimer: watermark %d refused (%s); trying again next round", target, exc)
            return state
        return new if new is not None else state

    def _versions(self, now: float) -> list[VersionInfo]:
        folder = self.prefix + MANIFEST_FOLDER
        numbers = sorted(
            int(m.group(1)) for key in self.storage.list(folder) if (m := _VERSION_NAME.match(key[len(folder) :])) and int(m.group(1)) > 0
        )
        out = []
        base = 0
        for version in numbers:
            written, checkpoint = self._record(version, now)
            if checkpoint:
                base = version
            out.append(VersionInfo(version, written, base))
        return out

    def _written_at(self, version: int, now: float) -> float:
        return self._record(version, now)[0]

    def _record(self, version: int, now: float) -> tuple[float, bool]:
        known = self._records.get(version)
        if known is None:
            try:
                record: VersionRecord = self._store.read_record(version)
                known = (record.written_at_s, record.state is not None)
            except NotFound:  # deleted: it was at least min_age_s old
                known = (now - self.policy.min_age_s, False)
            self._records[version] = known
        return known

    def _stored(self, now: float) -> list[ObjectInfo]:
        out = []
        listed = set()
        for key in self.storage.list(self.prefix + TGB_FOLDER):
            parsed = parse_object_key(self.prefix, key)
            if parsed is None:
                continue
            listed.add(key)
            out.append(ObjectInfo(key, parsed[0], self._first_seen.setdefault(key, now)))
        for key in set(self._first_seen) - listed:
            del self._first_seen[key]
        return out


def _span(versions: list[int]) -> str:
    return f"{versions[0]}..{versions[-1]}" if versions else "none"
