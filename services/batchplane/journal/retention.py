"""What the journal may reclaim, and whether producers must wait: checkpoint-aligned lifecycle
(BatchWeave §5.3). Pure decisions over small frozen inputs: no I/O, no clocks (times are inputs,
in seconds of the caller's clock), no threads. A reclaimer driver lists the store and the
manifest, calls `reclaim`, and deletes what it answers; producers call `backpressure` before
building a step.

Rules:
- A watermark is a live checkpoint's cursor: the manifest version it read and the first written
  step it still needs (`slices.SliceCursor.step`; a partly read step is still needed). The floor
  is the minimum over live watermarks: floor_step, floor_version. Checkpoints that were deleted
  must not be passed; no live watermark means nothing below any step is reclaimable.
- A committed step may be deleted iff step < floor_step and it was committed at least
  `min_age_s` ago. Its objects are deleted unless a kept step also lists them.
- A manifest version may be deleted iff version < floor_version, it is not the latest, no kept
  version is read through it (a version is read from its `base`, the compacted checkpoint it
  builds on, through every version between), and it was written at least `min_age_s` ago. So
  the kept versions are a contiguous run ending at the latest.
- An orphan (a stored object no committed step lists) may be deleted iff its step can no longer
  be committed with it — the step is committed with other objects, or it is below floor_step —
  and it was written at least `min_age_s` ago. An object of a step not yet committed is never
  an orphan: its producer may still commit it.
- Producers pause while next_step - floor_step >= max_lag (floor_step: `origin_step` without a
  live watermark): at most max_lag steps from the floor are built, so storage stays bounded
  when checkpoints stall. max_lag must exceed the checkpoint interval plus the consumers'
  prefetch, in steps, or training waits for a checkpoint that waits for training.

Caution for the manifest's owner: a deleted manifest version's name is free again, so a stale
producer's put-if-absent of that name succeeds; the commit protocol must not treat such a
write as a commit of the head (e.g. check that no higher version exists after writing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from batchplane.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class Watermark:
    """A live checkpoint's position in the journal.

    Attributes:
        manifest_version: The manifest version its consumer read, >= 0.
        step: The first written step it still needs, >= 0.
    """

    manifest_version: int
    step: int


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A step the manifest lists.

    Attributes:
        step: The written step, >= 0.
        version: The manifest version that first listed it, >= 0.
        committed_at_s: When that version was committed, in seconds.
        objects: The keys of the objects holding its TGB.
    """

    step: int
    version: int
    committed_at_s: float
    objects: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    """A stored manifest version.

    Attributes:
        version: Its number, >= 0.
        written_at_s: When it was written, in seconds.
        base: The version it is read from (its compacted checkpoint), <= version; itself for
            a self-contained version.
    """

    version: int
    written_at_s: float
    base: int


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """A TGB object found in the store.

    Attributes:
        key: Its key.
        step: The written step it was written for (from its key).
        written_at_s: When it was written, in seconds.
    """

    key: str
    step: int
    written_at_s: float


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """How long the journal keeps data.

    Attributes:
        min_age_s: Nothing younger is deleted, in seconds, >= 0.
        max_lag: Most steps producers build from the floor step, >= 1.
    """

    min_age_s: float = 600.0
    max_lag: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.min_age_s, (int, float)) or isinstance(self.min_age_s, bool) or not 0 <= self.min_age_s < math.inf:
            raise InvalidArgument(f"retention.min_age_s: must be a finite number >= 0, got {self.min_age_s!r}")
        if not _is_int(self.max_lag) or self.max_lag < 1:
            raise InvalidArgument(f"retention.max_lag: must be an int >= 1, got {self.max_lag!r}")


@dataclasses.dataclass(frozen=True)
class Reclamation:
    """What may be deleted now.

    Attributes:
        floor_step: The minimum live watermark step; None without a live watermark.
        floor_version: The minimum live watermark manifest version; None without one.
        steps: Committed steps that may be deleted, ascending.
        objects: Object keys to delete: those of `steps` that no kept step lists, then
            `orphans`; sorted, no duplicates.
        orphans: Orphan object keys that may be deleted, sorted.
        versions: Manifest versions that may be deleted, ascending.
    """

    floor_step: int | None
    floor_version: int | None
    steps: tuple[int, ...]
    objects: tuple[str, ...]
    orphans: tuple[str, ...]
    versions: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Backpressure:
    """Whether producers must wait.

    Attributes:
        floor_step: The step the lag is counted from.
        lag: next_step - floor_step (negative when the floor is ahead of production).
        pause: lag >= max_lag: build nothing until a checkpoint advances the floor.
    """

    floor_step: int
    lag: int
    pause: bool


def reclaim(
    *,
    watermarks: Iterable[Watermark],
    steps: Iterable[StepInfo],
    versions: Iterable[VersionInfo],
    stored: Iterable[ObjectInfo] = (),
    now_s: float,
    policy: RetentionPolicy,
) -> Reclamation:
    """Decides what may be deleted (the module docstring's rules).

    Args:
        watermarks: The live checkpoints' watermarks.
        steps: The committed steps the latest manifest lists.
        versions: The manifest versions in the store (the latest among them is kept).
        stored: TGB objects in the store, for orphans; empty skips orphans.
        now_s: The current time, in the clock of the other times, in seconds.
        policy: min_age_s.

    Returns:
        The floor and what may be deleted.

    Raises:
        InvalidArgument: a negative step or version, a step or version listed twice, a base
            above its version, or a time that is not a finite number; the message names it.
    """
    marks = list(watermarks)
    committed = sorted(steps, key=lambda s: s.step)
    stored_versions = sorted(versions, key=lambda v: v.version)
    found = list(stored)
    now_s = _time(now_s, "now_s")
    for i, m in enumerate(marks):
        _nonneg(m.manifest_version, f"watermarks[{i}].manifest_version")
        _nonneg(m.step, f"watermarks[{i}].step")
    for s in committed:
        _nonneg(s.step, "steps.step")
        _nonneg(s.version, f"steps[{s.step}].version")
        _time(s.committed_at_s, f"steps[{s.step}].committed_at_s")
    _unique([s.step for s in committed], "steps")
    for v in stored_versions:
        _nonneg(v.version, "versions.version")
        _nonneg(v.base, f"versions[{v.version}].base")
        if v.base > v.version:
            raise InvalidArgument(f"versions[{v.version}].base: must be <= the version, got {v.base}")
        _time(v.written_at_s, f"versions[{v.version}].written_at_s")
    _unique([v.version for v in stored_versions], "versions")
    for o in found:
        _nonneg(o.step, f"stored[{o.key!r}].step")
        _time(o.written_at_s, f"stored[{o.key!r}].written_at_s")

    if not marks:
        floor_step = floor_version = None
    else:
        floor_step = min(m.step for m in marks)
        floor_version = min(m.manifest_version for m in marks)

    def old(at_s: float) -> bool:
        return now_s - at_s >= policy.min_age_s

    gone = [s for s in committed if floor_step is not None and s.step < floor_step and old(s.committed_at_s)]
    gone_steps = {s.step for s in gone}
    kept_objects = {key for s in committed if s.step not in gone_steps for key in s.objects}
    step_objects = {key for s in gone for key in s.objects} - kept_objects

    listed = {key for s in committed for key in s.objects}
    committed_steps = {s.step for s in committed}
    orphans = sorted(
        {
            o.key
            for o in found
            if o.key not in listed
            and (o.step in committed_steps or (floor_step is not None and o.step < floor_step))
            and old(o.written_at_s)
        }
    )

    old_versions: list[int] = []
    if floor_version is not None and stored_versions:
        latest = stored_versions[-1].version
        keep_from = min([floor_version, latest] + [v.base for v in stored_versions if v.version >= floor_version])
        old_versions = [v.version for v in stored_versions if v.version < keep_from and old(v.written_at_s)]

    return Reclamation(
        floor_step=floor_step,
        floor_version=floor_version,
        steps=tuple(sorted(gone_steps)),
        objects=tuple(sorted(step_objects | set(orphans))),
        orphans=tuple(orphans),
        versions=tuple(old_versions),
    )


def backpressure(*, watermarks: Iterable[Watermark], next_step: int, policy: RetentionPolicy, origin_step: int = 0) -> Backpressure:
    """Whether producers must wait before building `next_step`.

    Args:
        watermarks: The live checkpoints' watermarks.
        next_step: One past the highest step built (committed or being committed).
        policy: max_lag.
        origin_step: The run's first step: the floor while there is no live watermark.

    Returns:
        The floor, the lag and whether to pause.

    Raises:
        InvalidArgument: a negative step.
    """
    _nonneg(next_step, "next_step")
    _nonneg(origin_step, "origin_step")
    marks = list(watermarks)
    for i, m in enumerate(marks):
        _nonneg(m.step, f"watermarks[{i}].step")
    floor = min((m.step for m in marks), default=origin_step)
    lag = next_step - floor
    return Backpressure(floor_step=floor, lag=lag, pause=lag >= policy.max_lag)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonneg(value: object, field: str) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidArgument(f"{field}: must be an int >= 0, got {value!r}")


def _time(value: object, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgument(f"{field}: must be a finite number of seconds, got {value!r}")
    return float(value)


def _unique(values: list[int], field: str) -> None:
    if len(set(values)) != len(values):
        dup = sorted({v for v in values if values.count(v) > 1})[:5]
        raise InvalidArgument(f"{field}: listed twice: {dup}")
