"""The journal's manifest: the state of one manifest version, the changes that lead from one
version to the next, their JSON encoding, and the rules that decide whether a change may be
committed (`apply`) and what of a losing producer's commit is still to commit (`rebase`).

Pure: no I/O, no threads, no clocks. `batchplane.journal.commit` reads and writes versions.

The state of version N (`ManifestState`):

- the committed steps, in plan order (step index), each with the object(s) of its transactional
  global batch (key, size, checksum), the producer that committed it and the version that made
  it visible. Steps may be committed out of order by several producers building disjoint steps;
  consumers read only the *visible prefix* (`visible_through`: the highest step s such that
  every step <= s is committed);
- the producers' state: producer id -> fencing epoch, last committed step, and the version of
  its last change. A producer's last step only advances, and it is committed in the same
  version as the steps it covers, so a producer restarted under its id resumes after it;
- the retention watermark: the first step still retained. Every step below it is committed
  (the watermark never passes the visible prefix) and no longer listed: its objects may be
  reclaimed;
- the live checkpoints' marks: mark id -> (manifest version read, first written step still
  needed). The retention watermark never passes the lowest mark, and a mark never points below
  the retention watermark; the reclaimer takes the minimum over them.

Version N+1 is version N with one `Change` applied: `Register` (a producer id claims the next
fencing epoch; every older process of that id is fenced from then on), `Commit` (a producer
publishes built steps and its new last step together), `Retain` (the watermark advances),
`Mark` (a live checkpoint records or moves its mark) or `Unmark` (a checkpoint is gone).
Version 0 is the empty state. `apply` is deterministic, so any reader that applies the same
changes to the same state gets the same state.

Encoding (`encode_record` / `decode_record`): one JSON object per version, no spaces, ASCII,
keys sorted within every value and at the top level but for "state", which comes last;
`format` and `format_version` first among the checks. A version record holds its change and,
in checkpoint versions, the whole state after it, last: a reader probing forward, which holds
the state the change leads to, checks a checkpoint by comparing the record's tail with that
state's text (`state_text`, joined from texts each step builds once) instead of parsing what
may be tens of MB of JSON per reader. Unknown fields, unknown kinds, wrong types and
out-of-range values are refused with `ManifestFormatError`, which names the field.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import json
import math
import operator
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from batchplane.core.errors import FailedPrecondition
from batchplane.journal.steplist import ChunkedList

#: The `format` field of every manifest version object.
FORMAT = "batchplane.journal.manifest"
#: The version of the encoding this module writes (and the newest it reads).
FORMAT_VERSION = 1

#: A producer id: used in object keys, so the characters of a storage key segment.
_PRODUCER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,127}")
_MAX_KEY_CHARS = 1024
_MAX_CHECKSUM_CHARS = 256
_STEP = operator.attrgetter("entry.step")
_PRODUCER = operator.attrgetter("producer")


class ManifestFormatError(FailedPrecondition):
    """A manifest version object that this code cannot read: not JSON, another format, a newer
    format version, an unknown or missing field, a value of the wrong type or range.

    Attributes:
        field: Dotted path of the field, e.g. "change.steps[0].objects[1].size".
        problem: What is wrong with it.
    """

    def __init__(self, field: str, problem: str, *, where: str = "manifest version") -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{where}: field {field!r} {problem}")


class Refusal(enum.Enum):
    """Why a change cannot be applied to a state."""

    FENCED = "fenced"  # a newer process registered the producer id
    UNREGISTERED = "unregistered"  # the producer id never registered
    EPOCH_AHEAD = "epoch_ahead"  # an epoch the manifest never gave out
    EMPTY = "empty"  # a commit of no steps
    NOT_INCREASING = "not_increasing"  # a commit's steps are not strictly increasing
    ALREADY_COMMITTED = "already_committed"  # a step is committed (or below the watermark)
    NOT_ADVANCING = "not_advancing"  # a step at or below the producer's last committed step
    WATERMARK_NOT_ADVANCING = "watermark_not_advancing"
    WATERMARK_AHEAD = "watermark_ahead"  # past the first uncommitted step
    WATERMARK_PAST_MARK = "watermark_past_mark"  # past a live checkpoint's mark
    MARK_RECLAIMED = "mark_reclaimed"  # a mark below the retention watermark
    MARK_AHEAD = "mark_ahead"  # a mark past the first uncommitted step, or of a future version
    MARK_UNKNOWN = "mark_unknown"  # an Unmark of a mark that is not there


class CommitRefused(FailedPrecondition):
    """A change that the state does not allow.

    Attributes:
        reason: Why (a `Refusal`).
        producer: The producer concerned, or "" for a `Retain`.
        steps: The steps concerned, if any.
    """

    def __init__(self, reason: Refusal, message: str, *, producer: str = "", steps: Sequence[int] = ()) -> None:
        self.reason = reason
        self.producer = producer
        self.steps = tuple(steps)
        super().__init__(message)


class Fenced(CommitRefused):
    """A newer process registered this producer id: this one must stop committing.

    Attributes:
        epoch: The epoch this process holds.
        current_epoch: The producer's epoch in the manifest.
    """

    def __init__(self, producer: str, epoch: int, current_epoch: int) -> None:
        self.epoch = epoch
        self.current_epoch = current_epoch
        super().__init__(
            Refusal.FENCED,
            f"producer {producer!r} is fenced: this process holds epoch {epoch}, a newer process registered "
            f"the id with epoch {current_epoch}; stop producing under this id",
            producer=producer,
        )


# A state holds a CommittedStep, a StepEntry and StepObjects per committed step, so these three
# are slotted, their texts cached in a field rather than a __dict__, and a checkpoint's producer
# ids interned: 420 B a decoded step where it was 581 (plus the cached text, 602 for 827).


@dataclass(frozen=True, slots=True)
class StepObject:
    """One immutable object of a step's transactional global batch.

    Attributes:
        key: Its storage key.
        size: Its size in bytes.
        checksum: Its checksum as "<algorithm>:<hex>" (the writer's choice of algorithm).
    """

    key: str
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)
class StepEntry:
    """A built step: its index in the plan and its objects."""

    step: int
    objects: tuple[StepObject, ...]
    _encoded: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def encoded(self) -> str:
        """Its JSON text in a Commit record (keys sorted, compact, ASCII), built once per object:
        a producer's pending steps ride along every attempt until one commits them, so each
        record's encoding costs joining the texts (`Producer.add` builds it when the step is
        added)."""
        text = self._encoded
        if text is None:
            if type(self.step) is int:
                text = f'{{"objects":{_objects_text(self.objects)},"step":{self.step}}}'
            else:
                text = _dumps({"step": self.step, "objects": _objects_doc(self.objects)})
            object.__setattr__(self, "_encoded", text)
        return text


@dataclass(frozen=True, slots=True)
class CommittedStep:
    """A step as the manifest lists it.

    Attributes:
        entry: The step and its objects.
        producer: The producer id that committed it.
        version: The manifest version that made it visible.
    """

    entry: StepEntry
    producer: str
    version: int
    _text: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def step(self) -> int:
        return self.entry.step

    @property
    def doc(self) -> dict[str, Any]:
        """Its JSON document in `state_doc`."""
        return {"step": self.entry.step, "producer": self.producer, "version": self.version, "objects": _objects_doc(self.entry.objects)}

    @property
    def text(self) -> str:
        """Its JSON text in `state_text`, built once per object: the steps of a state are shared
        by every later state of the same reader, so a checkpoint's text costs its new steps and
        a join."""
        text = self._text
        if text is None:
            entry = self.entry
            if type(entry.step) is int and type(self.version) is int and _PLAIN.fullmatch(self.producer):
                text = f'{{"objects":{_objects_text(entry.objects)},"producer":"{self.producer}","step":{entry.step},"version":{self.version}}}'
            else:
                text = _dumps(self.doc)
            object.__setattr__(self, "_text", text)
        return text


@dataclass(frozen=True)
class ProducerState:
    """A producer id's committed state.

    Attributes:
        producer: The id.
        epoch: Its fencing epoch (1 for its first registration); only the process holding the
            newest epoch may commit.
        last_step: The last step it committed, -1 if none; a restarted process resumes after it.
        version: The manifest version of its last registration or commit.
    """

    producer: str
    epoch: int
    last_step: int
    version: int


@dataclass(frozen=True)
class Register:
    """A producer id claims the next fencing epoch (fencing every older process of the id)."""

    producer: str


@dataclass(frozen=True)
class Commit:
    """A producer publishes built steps (strictly increasing) and its new last step, the last of
    them.

    Attributes:
        producer: Its id.
        epoch: The epoch its process holds.
        steps: The steps, strictly increasing, each after the producer's last committed step.
    """

    producer: str
    epoch: int
    steps: tuple[StepEntry, ...]


@dataclass(frozen=True)
class Retain:
    """The retention watermark advances to `watermark` (the first step still retained)."""

    watermark: int


@dataclass(frozen=True)
class Mark:
    """A live checkpoint records (or moves) its mark.

    Attributes:
        mark: The mark's id (the characters of a producer id), e.g. a consumer group or a
            checkpoint name.
        manifest_version: The manifest version its consumer had read (>= 0, <= the version
            the mark is committed on).
        step: The first written step it still needs (>= the retention watermark, <= one past
            the visible prefix).
    """

    mark: str
    manifest_version: int
    step: int


@dataclass(frozen=True)
class Unmark:
    """A live checkpoint is gone: its mark no longer holds anything back."""

    mark: str


@dataclass(frozen=True)
class MarkState:
    """A live checkpoint's mark as the manifest lists it.

    Attributes:
        mark: Its id.
        manifest_version: The manifest version its consumer had read.
        step: The first written step it still needs.
        version: The manifest version that recorded it.
    """

    mark: str
    manifest_version: int
    step: int
    version: int


Change = Union[Register, Commit, Retain, Mark, Unmark]


@dataclass(frozen=True)
class ManifestState:
    """The state of one manifest version (see the module docstring).

    Attributes:
        version: The version number; 0 is the empty state.
        watermark: The first retained step; every step below it is committed and unlisted.
        steps: The committed steps at or above the watermark, by step: a `steplist.ChunkedList`,
            whose chunks the states of later versions share (a tuple or list given is made one).
        producers: The producers' state, by id.
        marks: The live checkpoints' marks, by id.
    """

    version: int = 0
    watermark: int = 0
    steps: ChunkedList[CommittedStep] = dataclasses.field(default_factory=lambda: ChunkedList((), key=_STEP))
    producers: tuple[ProducerState, ...] = ()
    marks: tuple[MarkState, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.steps, ChunkedList):
            object.__setattr__(self, "steps", ChunkedList(self.steps, key=_STEP))

    @functools.cached_property
    def _producers_by_id(self) -> dict[str, ProducerState]:
        return {p.producer: p for p in self.producers}

    @functools.cached_property
    def visible_through(self) -> int:
        """The highest step s such that every step <= s is committed (watermark - 1 if none
        beyond the watermark): what consumers may read.

        O(log n): the steps are strictly increasing from at least the watermark, so
        steps[i].step == watermark + i holds for a prefix of them and never after it."""
        steps, watermark = self.steps, self.watermark
        lo, hi = 0, len(steps)
        while lo < hi:
            mid = (lo + hi) // 2
            if steps[mid].entry.step == watermark + mid:
                lo = mid + 1
            else:
                hi = mid
        return watermark + lo - 1

    def _index(self, step: int) -> int:
        """The position of `step` in `steps`, or where it would go (binary search)."""
        return self.steps.bisect_left(step)

    def step(self, step: int) -> CommittedStep | None:
        """The committed step `step`, or None (not committed, or below the watermark)."""
        i = self._index(step)
        if i < len(self.steps) and self.steps[i].entry.step == step:
            return self.steps[i]
        return None

    def is_committed(self, step: int) -> bool:
        """Whether `step` is committed (listed, or below the watermark)."""
        return step < self.watermark or self.step(step) is not None

    def producer(self, producer: str) -> ProducerState | None:
        """The producer's state, or None if the id never registered."""
        return self._producers_by_id.get(producer)

    def mark(self, mark: str) -> MarkState | None:
        """The live checkpoint mark `mark`, or None."""
        return next((m for m in self.marks if m.mark == mark), None)

    def active_producers(self, within_versions: int) -> int:
        """How many producers registered or committed in the last `within_versions` versions
        (at least 1): the producer count of the commit policy.

        Args:
            within_versions: The window, in versions (> 0).
        """
        since = self.version - within_versions
        return max(1, sum(1 for p in self.producers if p.version > since))


@dataclass(frozen=True)
class VersionRecord:
    """The content of one manifest version object.

    Attributes:
        version: Its number (> 0).
        change: The change from the previous version.
        written_at_s: The writer's wall-clock time (Unix seconds), for the reclaimer's minimum age.
        state: The whole state after the change, in checkpoint versions; else None.
    """

    version: int
    change: Change
    written_at_s: float
    state: ManifestState | None = None


@dataclass(frozen=True)
class Rebased:
    """What of a pending commit is still to commit on a newer state.

    Attributes:
        commit: The commit restricted to the steps still uncommitted, or None if none is left.
        mine: Steps already committed by this producer with these very objects (an earlier
            attempt won although it looked lost): their objects are referenced, keep them.
        taken: Steps committed by another producer, with other objects, or below the
            watermark: this producer's objects of them are orphans to reclaim.
    """

    commit: Commit | None
    mine: tuple[int, ...]
    taken: tuple[int, ...]


def apply(state: ManifestState, change: Change) -> ManifestState:
    """The state of the next version: `change` applied to `state`.

    Args:
        state: The state of version N.
        change: The change that version N+1 records.

    Returns:
        The state of version N+1.

    Raises:
        Fenced: A commit by a process whose epoch is older than the producer's.
        CommitRefused: Any other change the state does not allow (see `Refusal`).
    """
    version = state.version + 1
    if isinstance(change, Register):
        _check_producer_id(change.producer)
        old = state.producer(change.producer)
        new = ProducerState(
            producer=change.producer,
            epoch=(old.epoch if old else 0) + 1,
            last_step=old.last_step if old else -1,
            version=version,
        )
        return dataclasses.replace(state, version=version, producers=_with_producer(state.producers, new))
    if isinstance(change, Retain):
        if change.watermark <= state.watermark:
            raise CommitRefused(
                Refusal.WATERMARK_NOT_ADVANCING,
                f"watermark {change.watermark} does not advance the retained watermark {state.watermark}",
            )
        if change.watermark > state.visible_through + 1:
            raise CommitRefused(
                Refusal.WATERMARK_AHEAD,
                f"watermark {change.watermark} is past the first uncommitted step {state.visible_through + 1}",
            )
        lowest = min((m.step for m in state.marks), default=None)
        if lowest is not None and change.watermark > lowest:
            raise CommitRefused(
                Refusal.WATERMARK_PAST_MARK,
                f"watermark {change.watermark} is past step {lowest}, which a live checkpoint's mark still needs",
            )
        kept = state.steps.from_position(state._index(change.watermark))
        return dataclasses.replace(state, version=version, watermark=change.watermark, steps=kept)
    if isinstance(change, Mark):
        _check_producer_id(change.mark, what="mark id")
        if change.step < state.watermark:
            raise CommitRefused(
                Refusal.MARK_RECLAIMED,
                f"mark {change.mark!r} at step {change.step} is below the retention watermark {state.watermark}: "
                "those steps may be reclaimed already",
                steps=[change.step],
            )
        if change.step > state.visible_through + 1 or change.manifest_version > state.version:
            raise CommitRefused(
                Refusal.MARK_AHEAD,
                f"mark {change.mark!r} at step {change.step} of version {change.manifest_version} is ahead of the "
                f"manifest (version {state.version}, first uncommitted step {state.visible_through + 1})",
                steps=[change.step],
            )
        new_mark = MarkState(change.mark, change.manifest_version, change.step, version)
        marks = tuple(sorted((*(m for m in state.marks if m.mark != change.mark), new_mark), key=lambda m: m.mark))
        return dataclasses.replace(state, version=version, marks=marks)
    if isinstance(change, Unmark):
        if state.mark(change.mark) is None:
            raise CommitRefused(Refusal.MARK_UNKNOWN, f"there is no mark {change.mark!r} to remove")
        return dataclasses.replace(state, version=version, marks=tuple(m for m in state.marks if m.mark != change.mark))
    if isinstance(change, Commit):
        producer, positions = _check_commit(state, change)
        added = [CommittedStep(entry, change.producer, version) for entry in change.steps]
        steps = state.steps.merged(added, positions)
        new = dataclasses.replace(producer, last_step=change.steps[-1].step, version=version)
        return dataclasses.replace(state, version=version, steps=steps, producers=_with_producer(state.producers, new))
    raise TypeError(f"not a manifest change: {type(change).__name__}")


def rebase(state: ManifestState, commit: Commit) -> Rebased:
    """Rebases a pending commit onto a newer state (the winner of a conflict, or any later one).

    Args:
        state: The newer state.
        commit: The commit that was built on an older state.

    Returns:
        The part still to commit and the steps found committed (see `Rebased`).

    Raises:
        Fenced: A newer process registered the producer id.
        CommitRefused: The producer never registered or holds an epoch the manifest never gave
            out (UNREGISTERED, EPOCH_AHEAD), or an uncommitted step of the commit is at or
            below the producer's last committed step (NOT_ADVANCING: it could never be
            committed; the producer built its steps out of order).
    """
    current = _check_epoch(state, commit.producer, commit.epoch)
    keep: list[StepEntry] = []
    mine: list[int] = []
    taken: list[int] = []
    listed, watermark = state.steps, state.watermark
    positions = _positions(listed, [e.step for e in commit.steps])
    if positions is None:  # every step past the last listed one: only the watermark can take them
        for entry in commit.steps:
            if entry.step < watermark:
                taken.append(entry.step)
            else:
                keep.append(entry)
    else:
        for entry, i in zip(commit.steps, positions):
            done = listed[i] if i < len(listed) and listed[i].entry.step == entry.step else None
            if done is not None and done.entry == entry and done.producer == commit.producer:
                mine.append(entry.step)
            elif done is not None or entry.step < watermark:
                taken.append(entry.step)
            else:
                keep.append(entry)
    stuck = [e.step for e in keep if e.step <= current.last_step]
    if stuck:
        raise CommitRefused(
            Refusal.NOT_ADVANCING,
            f"producer {commit.producer!r} cannot commit steps {stuck}: its last committed step is {current.last_step}",
            producer=commit.producer,
            steps=stuck,
        )
    rest = dataclasses.replace(commit, steps=tuple(keep)) if keep else None
    return Rebased(commit=rest, mine=tuple(mine), taken=tuple(taken))


def _check_epoch(state: ManifestState, producer: str, epoch: int) -> ProducerState:
    current = state.producer(producer)
    if current is None:
        raise CommitRefused(Refusal.UNREGISTERED, f"producer {producer!r} never registered", producer=producer)
    if epoch < current.epoch:
        raise Fenced(producer, epoch, current.epoch)
    if epoch > current.epoch:
        raise CommitRefused(
            Refusal.EPOCH_AHEAD,
            f"producer {producer!r} claims epoch {epoch}, the manifest gave out only {current.epoch}",
            producer=producer,
        )
    return current


def _check_commit(state: ManifestState, commit: Commit) -> tuple[ProducerState, list[int] | None]:
    """The producer's state if `state` allows `commit`, and the steps' positions in
    `state.steps` (`_positions`), which the merge reuses.

    Raises:
        Fenced, CommitRefused: As `apply`.
    """
    current = _check_epoch(state, commit.producer, commit.epoch)
    steps = [e.step for e in commit.steps]
    if not steps:
        raise CommitRefused(Refusal.EMPTY, f"producer {commit.producer!r} commits no step", producer=commit.producer)
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise CommitRefused(Refusal.NOT_INCREASING, f"steps {steps} are not strictly increasing", producer=commit.producer, steps=steps)
    listed, watermark = state.steps, state.watermark
    positions = _positions(listed, steps)
    if positions is None:
        done = [s for s in steps if s < watermark]
    else:
        done = [s for s, i in zip(steps, positions) if s < watermark or (i < len(listed) and listed[i].entry.step == s)]
    if done:
        raise CommitRefused(Refusal.ALREADY_COMMITTED, f"steps {done} are already committed", producer=commit.producer, steps=done)
    if steps[0] <= current.last_step:
        raise CommitRefused(
            Refusal.NOT_ADVANCING,
            f"producer {commit.producer!r} cannot commit step {steps[0]}: its last committed step is {current.last_step}",
            producer=commit.producer,
            steps=[s for s in steps if s <= current.last_step],
        )
    for entry in commit.steps:
        if not entry.objects:
            raise CommitRefused(Refusal.EMPTY, f"step {entry.step} has no object", producer=commit.producer, steps=[entry.step])
    return current, positions


def _positions(steps: ChunkedList[CommittedStep], numbers: Sequence[int]) -> list[int] | None:
    """Where each step number of `numbers` is, or would be inserted, in `steps` (sorted by
    step): `ChunkedList.bisect_left` for each (two searches in C), from where the previous one
    ended while the numbers increase.

    Returns:
        The positions, or None when nothing is listed or every number is past the last listed
        step (each would be appended): a producer committing its newest steps, with no search.
    """
    if not steps or not numbers or min(numbers) > steps[-1].entry.step:
        return None
    out: list[int] = []
    lo, prev = 0, numbers[0]
    for s in numbers:
        if s < prev:  # not increasing (a rebase of any commit): search from the start
            lo = 0
        lo = steps.bisect_left(s, lo)
        out.append(lo)
        prev = s
    return out


def _with_producer(producers: tuple[ProducerState, ...], new: ProducerState) -> tuple[ProducerState, ...]:
    """`producers` (sorted by id) with `new` in its place: a binary search, no sort."""
    i = bisect.bisect_left(producers, new.producer, key=_PRODUCER)
    if i < len(producers) and producers[i].producer == new.producer:
        return (*producers[:i], new, *producers[i + 1 :])
    if any(a.producer >= b.producer for a, b in zip(producers, producers[1:])):  # not sorted: keep the old rule
        return tuple(sorted((*(p for p in producers if p.producer != new.producer), new), key=_PRODUCER))
    return (*producers[:i], new, *producers[i:])


def _check_producer_id(producer: str, *, what: str = "producer id") -> None:
    if not isinstance(producer, str) or not _PRODUCER_ID.fullmatch(producer):
        raise CommitRefused(
            Refusal.UNREGISTERED if what == "producer id" else Refusal.MARK_UNKNOWN,
            f"bad {what} {producer!r}: 1 to 128 characters of [A-Za-z0-9._=-], starting with a letter or digit",
            producer=str(producer) if what == "producer id" else "",
        )


# --- encoding ---------------------------------------------------------------------------------


def encode_record(record: VersionRecord, *, state: str | None = None) -> bytes:
    """The bytes of a manifest version object (deterministic: equal records, equal bytes).

    Args:
        record: The version's content.
        state: `state_text(record.state)` if the caller built it already (a writer builds a
            checkpoint's text, the slow part, before it stamps the record's `written_at_s`).

    Returns:
        Compact ASCII JSON: {"change":..,"format":..,"format_version":..,"version":..,
        "written_at_s":..,"state":..} (see the module docstring), every value with sorted keys.

    Raises:
        ValueError: `written_at_s` is not finite.
    """
    if not math.isfinite(record.written_at_s):
        raise ValueError(f"written_at_s must be finite, got {record.written_at_s}")
    head = _dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "version": record.version, "written_at_s": record.written_at_s})
    # A Commit's steps and a checkpoint's state are joined from their cached texts.
    if record.state is None:
        state = "null"
    elif state is None:
        state = state_text(record.state)
    return f'{{"change":{_change_text(record.change)},{head[1:-1]},"state":{state}}}'.encode("ascii")


def decode_record(data: bytes, *, version: int | None = None) -> VersionRecord:
    """Reads a manifest version object.

    Args:
        data: Its bytes.
        version: The version its key names; its content must say the same.

    Returns:
        The record.

    Raises:
        ManifestFormatError: Not JSON, another format or a newer format version, an unknown or
            missing field, a wrong type or value; naming the field.
    """
    r, doc, record = _decode_head(data, version)
    if doc["state"] is None:
        return record
    state = r.state(doc["state"], "state")
    if state.version != record.version:
        raise ManifestFormatError("state.version", f"is {state.version}, the record's version is {record.version}", where=r.where)
    return dataclasses.replace(record, state=state)


def decode_next(data: bytes, base: ManifestState) -> tuple[VersionRecord, ManifestState]:
    """Reads the object of version base.version + 1 and applies its change to `base`: what a
    reader probing forward does, at the cost of the change alone. A checkpoint's whole state
    is compared with the result rather than decoded: by its text (`state_text`) when the
    record holds it last, as `encode_record` writes it, else as a JSON document (`state_doc`).

    Args:
        data: The bytes of version base.version + 1.
        base: The state of the version before it.

    Returns:
        The record (its `state` None: the result stands for it) and the state after it.

    Raises:
        ManifestFormatError: As `decode_record` (the checkpoint's state is checked only against
            the result).
        CommitRefused: `base` does not allow the change.
        CheckpointMismatch: The record's checkpoint state is not the state its change leads to.
    """
    checked = _next_checkpoint_by_text(data, base)
    if checked is not None:
        return checked
    r, doc, record = _decode_head(data, base.version + 1)
    new = apply(base, record.change)
    if doc["state"] is not None and doc["state"] != state_doc(new):
        raise CheckpointMismatch(record.version)
    return record, new


#: The top-level keys a record's tail is found by: no nested object has such a key, and a JSON
#: string cannot hold them unescaped.
_STATE_KEY = b',"state":'
_WRITTEN_KEY = b',"written_at_s":'


def _next_checkpoint_by_text(data: bytes, base: ManifestState) -> tuple[VersionRecord, ManifestState] | None:
    """`decode_next` of a checkpoint written with the state last: everything but the state is
    parsed, the change applied, and the state's text compared with the record's tail. None if
    the record is not such a checkpoint, or does not match (the caller parses it whole, to
    accept an equal state written otherwise or name what is wrong)."""
    at = data.find(_STATE_KEY)
    if at < 0 or data.rfind(_WRITTEN_KEY) > at or data.endswith(b'"state":null}'):
        return None  # no state key, an older layout (state before written_at_s), or no checkpoint
    try:
        _, _, record = _decode_head(data[:at] + b',"state":null}', base.version + 1)
    except ManifestFormatError:
        return None
    new = apply(base, record.change)
    if data[at + len(_STATE_KEY) :] != f"{state_text(new)}}}".encode("ascii"):
        return None
    return record, new


class CheckpointMismatch(FailedPrecondition):
    """A checkpoint version whose whole state is not the state its change leads to (a corrupt
    manifest).

    Attributes:
        version: The checkpoint's version.
    """

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(f"manifest version {version}: its checkpoint disagrees with the changes before it (a corrupt manifest)")


def _decode_head(data: bytes, version: int | None) -> tuple[_Reader, dict[str, Any], VersionRecord]:
    """Checks everything of a version object but its state: (reader, document, record
    without state)."""
    where = "manifest version" if version is None else f"manifest version {version}"
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestFormatError("<document>", f"is not JSON ({exc})", where=where) from None
    r = _Reader(where)
    if not isinstance(doc, dict):
        raise r.fail("", f"must be an object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ManifestFormatError("format", f"must be {FORMAT!r}, got {doc.get('format')!r}", where=where)
    fv = doc.get("format_version")
    if isinstance(fv, bool) or not isinstance(fv, int) or fv < 1:
        raise ManifestFormatError("format_version", f"must be an integer >= 1, got {fv!r}", where=where)
    if fv > FORMAT_VERSION:
        raise ManifestFormatError("format_version", f"is {fv}, newer than {FORMAT_VERSION} (written by a newer batchplane)", where=where)
    r.fields(doc, "", {"format", "format_version", "version", "written_at_s", "change", "state"})
    number = r.integer(doc, "version", low=1)
    if version is not None and number != version:
        raise ManifestFormatError("version", f"is {number}, but the object's key names version {version}", where=where)
    written = doc["written_at_s"]
    if isinstance(written, bool) or not isinstance(written, (int, float)) or not math.isfinite(written):
        raise ManifestFormatError("written_at_s", f"must be a finite number, got {written!r}", where=where)
    change = r.change(doc["change"], "change")
    return r, doc, VersionRecord(version=number, change=change, written_at_s=float(written))


def state_doc(state: ManifestState) -> dict[str, Any]:
    """The JSON document of a state (as a checkpoint version holds it); "marks" only when
    there are live marks."""
    doc = _state_head_doc(state)
    doc["steps"] = [s.doc for s in state.steps]
    return doc


def state_text(state: ManifestState) -> str:
    """The JSON text of `state_doc(state)` as `encode_record` writes it (keys sorted, compact,
    ASCII), with the steps joined from their cached texts (`CommittedStep.text`): a reader
    that keeps its states pays for each step once, and then a join per checkpoint."""
    head = _dumps(_state_head_doc(state))
    # "steps" sorts after "marks" and "producers" and before "version" and "watermark".
    split = head.rindex(',"version":')
    return f'{head[:split]},"steps":[{",".join(s.text for s in state.steps)}]{head[split:]}'


def _state_head_doc(state: ManifestState) -> dict[str, Any]:
    """`state_doc` without its steps."""
    doc: dict[str, Any] = {
        "version": state.version,
        "watermark": state.watermark,
        "producers": [{"id": p.producer, "epoch": p.epoch, "last_step": p.last_step, "version": p.version} for p in state.producers],
    }
    if state.marks:
        doc["marks"] = [{"id": m.mark, "manifest_version": m.manifest_version, "step": m.step, "version": m.version} for m in state.marks]
    return doc


def decode_state(doc: Any, *, where: str = "manifest state") -> ManifestState:
    """Reads a state document (see `state_doc`).

    Raises:
        ManifestFormatError: Naming the field.
    """
    return _Reader(where).state(doc, "")


def _change_text(change: Change) -> str:
    """The JSON text of a change in its record. A Commit's steps are joined from their cached
    `StepEntry.encoded` texts: its keys in sorted order are epoch, kind, producer, steps."""
    if isinstance(change, Commit):
        head = _dumps({"epoch": change.epoch, "kind": "commit", "producer": change.producer})
        return f'{head[:-1]},"steps":[{",".join(e.encoded for e in change.steps)}]}}'
    if isinstance(change, Register):
        return _dumps({"kind": "register", "producer": change.producer})
    if isinstance(change, Retain):
        return _dumps({"kind": "retain", "watermark": change.watermark})
    if isinstance(change, Mark):
        return _dumps({"kind": "mark", "mark": change.mark, "manifest_version": change.manifest_version, "step": change.step})
    if isinstance(change, Unmark):
        return _dumps({"kind": "unmark", "mark": change.mark})
    raise TypeError(f"not a manifest change: {type(change).__name__}")


#: The records' JSON encoder (one instance: `json.dumps` with these options builds one per call).
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _dumps(doc: Any) -> str:
    """The record's JSON text of `doc`: keys sorted, no spaces, ASCII, no NaN."""
    return _ENCODER.encode(doc)


def _objects_doc(objects: Iterable[StepObject]) -> list[dict[str, Any]]:
    return [{"key": o.key, "size": o.size, "checksum": o.checksum} for o in objects]


#: A string `_dumps` writes as it is between quotes: printable ASCII but '"' and '\\'.
_PLAIN = re.compile(r"[ !#-\[\]-~]*")


def _objects_text(objects: Iterable[StepObject]) -> str:
    """`_dumps(_objects_doc(objects))`, formatted directly where an object's strings need no
    escaping and its size is an int: a step's text is built for every step of every
    checkpoint a reader writes or checks, and this way costs about 0.6 of the encoder's time."""
    parts = [
        f'{{"checksum":"{o.checksum}","key":"{o.key}","size":{o.size}}}'
        if type(o.size) is int and _PLAIN.fullmatch(o.key) and _PLAIN.fullmatch(o.checksum)
        else _dumps({"key": o.key, "size": o.size, "checksum": o.checksum})
        for o in objects
    ]
    return f"[{','.join(parts)}]"


class _Reader:
    """Checks a decoded document field by field; every error names the dotted field path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, problem: str) -> ManifestFormatError:
        return ManifestFormatError(path or "<document>", problem, where=self.where)

    def fields(self, doc: Any, path: str, names: set[str]) -> None:
        if not isinstance(doc, dict):
            raise self.fail(path, f"must be an object, got {type(doc).__name__}")
        for name in sorted(set(doc) - names):
            raise self.fail(_join(path, name), "is not a field of this format")
        for name in sorted(names - set(doc)):
            raise self.fail(_join(path, name), "is missing")

    def integer(self, doc: Mapping[str, Any], name: str, *, path: str = "", low: int = 0) -> int:
        value = doc[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(_join(path, name), f"must be an integer, got {value!r}")
        if value < low:
            raise self.fail(_join(path, name), f"must be >= {low}, got {value}")
        return value

    def text(
        self, doc: Mapping[str, Any], name: str, *, path: str = "", pattern: re.Pattern[str] | None = None, max_chars: int = _MAX_KEY_CHARS
    ) -> str:
        value = doc[name]
        if not isinstance(value, str) or not value or len(value) > max_chars:
            raise self.fail(_join(path, name), f"must be a string of 1 to {max_chars} characters, got {value!r}")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.fail(_join(path, name), f"must match {pattern.pattern}, got {value!r}")
        return value

    def array(self, doc: Mapping[str, Any], name: str, *, path: str = "") -> list[Any]:
        value = doc[name]
        if not isinstance(value, list):
            raise self.fail(_join(path, name), f"must be an array, got {type(value).__name__}")
        return value

    def objects(self, doc: Mapping[str, Any], path: str) -> tuple[StepObject, ...]:
        out = []
        items = self.array(doc, "objects", path=path)
        if not items:
            raise self.fail(_join(path, "objects"), "must list at least one object")
        for i, item in enumerate(items):
            p = f"{_join(path, 'objects')}[{i}]"
            self.fields(item, p, {"key", "size", "checksum"})
            out.append(
                StepObject(
                    key=self.text(item, "key", path=p),
                    size=self.integer(item, "size", path=p),
                    checksum=self.text(item, "checksum", path=p, max_chars=_MAX_CHECKSUM_CHARS),
                )
            )
        return tuple(out)

    def change(self, doc: Any, path: str) -> Change:
        if not isinstance(doc, dict):
            raise self.fail(path, f"must be an object, got {type(doc).__name__}")
        kind = doc.get("kind")
        if kind == "register":
            self.fields(doc, path, {"kind", "producer"})
            return Register(self.text(doc, "producer", path=path, pattern=_PRODUCER_ID))
        if kind == "retain":
            self.fields(doc, path, {"kind", "watermark"})
            return Retain(self.integer(doc, "watermark", path=path, low=1))
        if kind == "mark":
            self.fields(doc, path, {"kind", "mark", "manifest_version", "step"})
            return Mark(
                self.text(doc, "mark", path=path, pattern=_PRODUCER_ID),
                self.integer(doc, "manifest_version", path=path),
                self.integer(doc, "step", path=path),
            )
        if kind == "unmark":
            self.fields(doc, path, {"kind", "mark"})
            return Unmark(self.text(doc, "mark", path=path, pattern=_PRODUCER_ID))
        if kind == "commit":
            self.fields(doc, path, {"kind", "producer", "epoch", "steps"})
            entries = []
            for i, item in enumerate(self.array(doc, "steps", path=path)):
                quick = _well_formed_entry(item)
                if quick is not None:
                    entries.append(quick)
                    continue
                p = f"{_join(path, 'steps')}[{i}]"
                self.fields(item, p, {"step", "objects"})
                entries.append(StepEntry(self.integer(item, "step", path=p), self.objects(item, p)))
            if not entries:
                raise self.fail(_join(path, "steps"), "must list at least one step")
            return Commit(
                producer=self.text(doc, "producer", path=path, pattern=_PRODUCER_ID),
                epoch=self.integer(doc, "epoch", path=path, low=1),
                steps=tuple(entries),
            )
        raise self.fail(_join(path, "kind"), f"must be 'register', 'commit', 'retain', 'mark' or 'unmark', got {kind!r}")

    def state(self, doc: Any, path: str) -> ManifestState:
        names = {"version", "watermark", "producers", "steps"}
        self.fields(doc, path, names | ({"marks"} if isinstance(doc, dict) and "marks" in doc else set()))
        version = self.integer(doc, "version", path=path)
        producers = []
        for i, item in enumerate(self.array(doc, "producers", path=path)):
            p = f"{_join(path, 'producers')}[{i}]"
            self.fields(item, p, {"id", "epoch", "last_step", "version"})
            producers.append(
                ProducerState(
                    producer=self.text(item, "id", path=p, pattern=_PRODUCER_ID),
                    epoch=self.integer(item, "epoch", path=p, low=1),
                    last_step=self.integer(item, "last_step", path=p, low=-1),
                    version=self.integer(item, "version", path=p, low=1),
                )
            )
        ids = [p.producer for p in producers]
        if ids != sorted(set(ids)):
            raise self.fail(_join(path, "producers"), "must be sorted by id without repeats")
        steps = []
        for i, item in enumerate(self.array(doc, "steps", path=path)):
            quick = _well_formed_committed(item)
            if quick is not None:
                steps.append(quick)
                continue
            p = f"{_join(path, 'steps')}[{i}]"
            self.fields(item, p, {"step", "producer", "version", "objects"})
            steps.append(
                CommittedStep(
                    entry=StepEntry(self.integer(item, "step", path=p), self.objects(item, p)),
                    producer=sys.intern(self.text(item, "producer", path=p, pattern=_PRODUCER_ID)),
                    version=self.integer(item, "version", path=p, low=1),
                )
            )
        numbers = [s.step for s in steps]
        if any(b <= a for a, b in zip(numbers, numbers[1:])):
            raise self.fail(_join(path, "steps"), "must be sorted by step without repeats")
        watermark = self.integer(doc, "watermark", path=path)
        if numbers and numbers[0] < watermark:
            raise self.fail(_join(path, "steps"), f"lists step {numbers[0]}, below the watermark {watermark}")
        marks = []
        for i, item in enumerate(self.array(doc, "marks", path=path) if "marks" in doc else []):
            p = f"{_join(path, 'marks')}[{i}]"
            self.fields(item, p, {"id", "manifest_version", "step", "version"})
            marks.append(
                MarkState(
                    mark=self.text(item, "id", path=p, pattern=_PRODUCER_ID),
                    manifest_version=self.integer(item, "manifest_version", path=p),
                    step=self.integer(item, "step", path=p),
                    version=self.integer(item, "version", path=p, low=1),
                )
            )
        ids = [m.mark for m in marks]
        if ids != sorted(set(ids)):
            raise self.fail(_join(path, "marks"), "must be sorted by id without repeats")
        if "marks" in doc and not marks:
            raise self.fail(_join(path, "marks"), "is written only when it lists a mark")
        return ManifestState(
            version=version, watermark=watermark, steps=ChunkedList(steps, key=_STEP), producers=tuple(producers), marks=tuple(marks)
        )


def _well_formed_entry(item: Any) -> StepEntry | None:
    """A Commit's step entry decoded when it meets every rule `_Reader` checks (plain JSON
    types, exactly its fields, a step >= 0, objects as `_well_formed_objects`); None for
    anything else, which `_Reader` then checks field by field to name what is wrong. Every
    step of every version a producer catches up on comes through here."""
    if type(item) is not dict or len(item) != 2 or "step" not in item or "objects" not in item:
        return None
    step = item["step"]
    if type(step) is not int or step < 0:
        return None
    objects = _well_formed_objects(item["objects"])
    return None if objects is None else StepEntry(step, objects)


def _well_formed_committed(item: Any) -> CommittedStep | None:
    """A checkpoint's step decoded when it meets every rule `_Reader.state` checks of one (its
    four fields; step >= 0, a producer id, version >= 1, objects as `_well_formed_objects`);
    else None, for `_Reader` to name what is wrong."""
    if type(item) is not dict or len(item) != 4 or "producer" not in item or "version" not in item:
        return None
    producer, version = item["producer"], item["version"]
    if type(producer) is not str or not 0 < len(producer) <= _MAX_KEY_CHARS or not _PRODUCER_ID.fullmatch(producer):
        return None
    step, objects = item.get("step"), _well_formed_objects(item.get("objects"))
    if type(version) is not int or version < 1 or type(step) is not int or step < 0 or objects is None:
        return None
    return CommittedStep(StepEntry(step, objects), sys.intern(producer), version)


def _well_formed_objects(items: Any) -> tuple[StepObject, ...] | None:
    """A step's objects when the list meets every rule of `_Reader.objects` (at least one; each
    exactly key, size, checksum: a key of 1 to `_MAX_KEY_CHARS` characters, a size >= 0, a
    checksum of 1 to `_MAX_CHECKSUM_CHARS`); else None."""
    if type(items) is not list or not items:
        return None
    out = []
    for o in items:
        if type(o) is not dict or len(o) != 3 or "key" not in o or "size" not in o or "checksum" not in o:
            return None
        key, size, checksum = o["key"], o["size"], o["checksum"]
        if (
            type(key) is not str
            or not 0 < len(key) <= _MAX_KEY_CHARS
            or type(size) is not int
            or size < 0
            or type(checksum) is not str
            or not 0 < len(checksum) <= _MAX_CHECKSUM_CHARS
        ):
            return None
        out.append(StepObject(key, size, checksum))
    return tuple(out)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
