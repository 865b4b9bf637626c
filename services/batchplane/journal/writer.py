"""The producer's I/O driver of the journal: `JournalWriter` encodes one TGB per step from the
step's DP x CP slices, writes it as an immutable object, and commits it through
`batchplane.journal.commit.Producer` under a commit policy; `max_lag` backpressure holds it
back while it runs too far ahead of the live checkpoints' marks.

Layout it adds under the journal's prefix (beside `manifest/`, see `commit`):

    journal.json                          the journal's header (`JournalHeader`): the job's
                                          fingerprint, the written mesh (dp, cp, cp_mode) and
                                          the per-token column names; created once with
                                          put_if_absent, then every writer and reader checks it
    end/p0.json                           {"end_step": N}: producer p0 found the data ends at
                                          N (`finish`; put_if_absent, once); the least marker
                                          is the end (`read_end`)
    length.json                           {"num_steps": N}: the job's length as the planner
                                          counted it (steps 0..N-1), stored once a producer
                                          learnt it (put_if_absent, never changed;
                                          `claim_length`, `read_length`)
    tgb/000000000042/p0.e3.tgb            step 42's TGB as producer "p0" wrote it in epoch 3

A TGB's key is unique to (producer id, epoch, step) and created with put_if_absent, so a
restarted or fenced process never overwrites an object a manifest version may list. The
objects of steps that another producer committed first, and those a dead process of this id
left uncommitted (found at `resume`), are orphans: deleted here.

Decides nothing itself: when to commit is the policy's (`policy`), what to commit the
manifest's rules (`manifest`, `commit`), when to pause `retention.backpressure`'s. Not
thread-safe: one writer per producer thread. Clocks and sleep are injectable; the only I/O is
through the `Storage`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
import zlib
from collections.abc import Callable, Collection, Mapping
from typing import cast

import numpy as np

from batchplane.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from batchplane.core.storage import Storage
from batchplane.journal.commit import Attempt, ManifestSettings, ManifestStore, Producer
from batchplane.journal.manifest import Fenced, ManifestState, StepEntry, StepObject
from batchplane.journal.policy import CommitPolicy, make_policy
from batchplane.journal.retention import Backpressure, RetentionPolicy, Watermark, backpressure
from batchplane.journal.slices import DataMesh, TopologyError
from batchplane.journal.tgb import encode_tgb

log = logging.getLogger(__name__)

#: The header object's key, under the journal's prefix.
HEADER_KEY = "journal.json"
#: The end marker's key, under the journal's prefix.
#: The folder of the end markers, under the journal's prefix: each producer writes
#: `end/<producer id>.json` where it found the data ended (see `read_end`).
END_FOLDER = "end/"
#: The length object's key, under the journal's prefix (see `claim_length`).
LENGTH_KEY = "length.json"
#: The folder of the TGB objects, under the journal's prefix.
TGB_FOLDER = "tgb/"
HEADER_FORMAT = "batchplane.journal"
HEADER_FORMAT_VERSION = 1
_STEP_DIGITS = 12
_OBJECT_NAME = re.compile(r"^(\d{12})/(.+)\.e(\d+)\.tgb$")


@dataclasses.dataclass(frozen=True)
class JournalHeader:
    """What every step of one journal shares, fixed by its first writer.

    Attributes:
        job: The job's fingerprint (the caller's choice, e.g. a hash of the planning
            configuration); "" for none.
        mesh: The mesh the slices are written for (dp, cp, cp_mode).
        token_names: The per-token columns (cut on axis 1 over CP), for remapping CP at read.
    """

    job: str
    mesh: DataMesh
    token_names: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """The header object's bytes (deterministic)."""
        doc = {
            "format": HEADER_FORMAT,
            "format_version": HEADER_FORMAT_VERSION,
            "job": self.job,
            "dp": self.mesh.dp,
            "cp": self.mesh.cp,
            "cp_mode": self.mesh.cp_mode,
            "token_names": sorted(self.token_names),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> JournalHeader:
        """Reads a header object.

        Raises:
            FailedPrecondition: Not a header this code reads, naming the field.
        """
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FailedPrecondition(f"{where}: not JSON ({exc})") from None
        keys = {"format", "format_version", "job", "dp", "cp", "cp_mode", "token_names"}
        if not isinstance(doc, dict) or set(doc) != keys:
            raise FailedPrecondition(f"{where}: expected the fields {sorted(keys)}")
        if doc["format"] != HEADER_FORMAT or doc["format_version"] != HEADER_FORMAT_VERSION:
            raise FailedPrecondition(
                f"{where}: field 'format' is {doc['format']!r} version {doc['format_version']!r}, "
                f"expected {HEADER_FORMAT!r} version {HEADER_FORMAT_VERSION}"
            )
        names = doc["token_names"]
        if not isinstance(doc["job"], str) or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise FailedPrecondition(f"{where}: fields 'job' and 'token_names' must be a string and a list of strings")
        try:
            mesh = DataMesh(dp=doc["dp"], cp=doc["cp"], cp_mode=doc["cp_mode"])
        except TopologyError as exc:  # names the field
            raise FailedPrecondition(f"{where}: {exc}") from None
        return cls(job=doc["job"], mesh=mesh, token_names=tuple(sorted(names)))


def header_key(prefix: str) -> str:
    """The key of the journal's header under `prefix`."""
    return f"{prefix}{HEADER_KEY}"


def object_key(prefix: str, *, step: int, producer: str, epoch: int) -> str:
    """The key of the TGB of `step` written by `producer` in `epoch`."""
    return f"{prefix}{TGB_FOLDER}{step:0{_STEP_DIGITS}d}/{producer}.e{epoch}.tgb"


def parse_object_key(prefix: str, key: str) -> tuple[int, str, int] | None:
    """(step, producer, epoch) of a TGB key under `prefix`, or None if it is not one."""
    folder = prefix + TGB_FOLDER
    if not key.startswith(folder):
        return None
    m = _OBJECT_NAME.match(key[len(folder) :])
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def read_header(storage: Storage, prefix: str) -> JournalHeader:
    """The journal's header.

    Raises:
        NotFound: No writer has opened the journal yet.
        FailedPrecondition: A header this code cannot read.
    """
    key = header_key(prefix)
    return JournalHeader.decode(storage.get(key), where=f"journal header {key!r} in {storage.describe()}")


class JournalMismatch(FailedPrecondition):
    """The journal was opened for another job, mesh or token columns: writing on cannot help."""


def claim_header(storage: Storage, prefix: str, header: JournalHeader) -> JournalHeader:
    """Creates the journal's header, or checks that the existing one is `header`.

    Raises:
        JournalMismatch: The journal was opened for another job, mesh or token columns.
    """
    if storage.put_if_absent(header_key(prefix), header.encode()):
        return header
    found = read_header(storage, prefix)
    if found != header:
        diffs = [
            f"{name} {getattr(found, name)!r} (this writer: {getattr(header, name)!r})"
            for name in ("job", "mesh", "token_names")
            if getattr(found, name) != getattr(header, name)
        ]
        raise JournalMismatch(
            f"the journal at {prefix or '/'} in {storage.describe()} was opened with {', '.join(diffs)}; "
            "a journal holds one job written for one mesh: use another prefix"
        )
    return found


def encode_end(end_step: int) -> bytes:
    """The end marker's bytes (deterministic)."""
    return json.dumps({"end_step": int(end_step)}, separators=(",", ":")).encode("ascii")


def read_end(storage: Storage, prefix: str = "") -> int | None:
    """The step the journal's data ends at (one past its last step) as far as the end markers
    say, or None while none is written. A producer of several (each building every n-th step)
    finds the end at its first own step at or past it, so each marker is at or past the true
    end, and the producer of the true end step writes it exactly: the least marker is the end
    once that producer got there, and a step at or past any marker has no data.

    Raises:
        FailedPrecondition: An end marker this code cannot read.
    """
    found = [e for key in storage.list(f"{prefix}{END_FOLDER}") if (e := _read_end(storage, key)) is not None]
    return min(found) if found else None


def _read_end(storage: Storage, key: str) -> int | None:
    """One end marker's step; None if there is no such object."""
    try:
        data = storage.get(key)
    except NotFound:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FailedPrecondition(f"end marker {key!r} in {storage.describe()}: not JSON ({exc})") from None
    end = doc.get("end_step") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or set(doc) != {"end_step"} or not isinstance(end, int) or isinstance(end, bool) or end < 0:
        raise FailedPrecondition(f'end marker {key!r} in {storage.describe()}: expected {{"end_step": <int >= 0>}}, got {data[:80]!r}')
    return end


def length_key(prefix: str) -> str:
    """The key of the journal's length object under `prefix`."""
    return f"{prefix}{LENGTH_KEY}"


def encode_length(num_steps: int) -> bytes:
    """The length object's bytes (deterministic): the job has `num_steps` written steps, from
    step 0 to its end of data.

    Raises:
        InvalidArgument: A negative or non-integer `num_steps`.
    """
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 0:
        raise InvalidArgument(f"num_steps: must be an integer >= 0, got {num_steps!r}")
    return json.dumps({"num_steps": num_steps}, sort_keys=True, separators=(",", ":")).encode("ascii")


def decode_length(data: bytes, *, where: str) -> int:
    """Reads a length object (`encode_length`'s bytes): the job's number of written steps.

    Args:
        data: The object's bytes.
        where: What to call it in errors (its key and storage).

    Raises:
        FailedPrecondition: Not JSON, other fields than "num_steps", or a "num_steps" that is
            not an integer >= 0; the message names `where` and the field.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FailedPrecondition(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != {"num_steps"}:
        fields = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise FailedPrecondition(f'{where}: expected the fields ["num_steps"], got {fields}')
    steps = doc["num_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise FailedPrecondition(f"{where}: field 'num_steps' must be an integer >= 0, got {steps!r}")
    return steps


def read_length(storage: Storage, prefix: str = "") -> int | None:
    """The job's length in written steps as a producer stored it, or None while none has.

    Raises:
        FailedPrecondition: A length object this code cannot read (naming the key and field).
    """
    key = length_key(prefix)
    try:
        data = storage.get(key)
    except NotFound:
        return None
    return decode_length(data, where=f"length object {key!r} in {storage.describe()}")


def claim_length(storage: Storage, prefix: str = "", *, num_steps: int) -> int:
    """Stores the job's length (`num_steps` written steps) as the length object, unless one is
    there already: a journal's length never changes.

    Returns:
        The length the journal holds: `num_steps`, or the one stored before (the caller compares).

    Raises:
        InvalidArgument: A negative `num_steps`.
        FailedPrecondition: The stored length object cannot be read.
        Unavailable: The storage failed, or the object vanished between the put and the read
            (retry).
    """
    if storage.put_if_absent(length_key(prefix), encode_length(num_steps)):
        return num_steps
    found = read_length(storage, prefix)
    if found is None:
        raise Unavailable(f"the length object {length_key(prefix)!r} in {storage.describe()} was taken, then gone; retry")
    return found


def checksum(data: bytes | bytearray | memoryview) -> str:
    """The checksum a step's object is listed with in the manifest ("crc32:<8 hex>")."""
    return f"crc32:{zlib.crc32(data):08x}"


@dataclasses.dataclass
class WriterStats:
    """Counters of one writer (for the service's metrics), updated in place.

    Attributes:
        steps_written: TGB objects written.
        bytes_written: Their bytes.
        commits: Commit attempts whose put won.
        conflicts: Commit attempts that lost their race.
        steps_taken: Steps found committed by another producer (their objects deleted).
        orphans_deleted: Orphan objects deleted.
        fragile_window_s: The last attempt's fragile window, in seconds.
        backpressure_waits: Pauses before a step because of `max_lag`.
        backpressure_s: Seconds spent in those pauses (the writer's clock).
    """

    steps_written: int = 0
    bytes_written: int = 0
    commits: int = 0
    conflicts: int = 0
    steps_taken: int = 0
    orphans_deleted: int = 0
    fragile_window_s: float = 0.0
    backpressure_waits: int = 0
    backpressure_s: float = 0.0


class JournalWriter:
    """One producer id's writer of TGBs (see the module docstring).

    Call `resume` first; then for each step to build: `wait_for_room(step)`, build its slices,
    `write(step, slices)`; `flush` at the end.

    Args:
        storage: Where the journal lies.
        prefix: The journal's folder in it ("" or ending in '/').
        producer_id: A stable id, kept across restarts (1 to 128 characters of [A-Za-z0-9._=-]).
        mesh: The written mesh: every step has exactly its dp x cp slices.
        policy: A commit policy name (`batchplane.journal.policy.POLICIES`) or a policy.
        job: The job's fingerprint, recorded in the header and checked against it.
        token_names: The per-token columns, recorded in the header.
        first_step: The plan's first step.
        retention: `max_lag` (None: no backpressure).
        manifest_settings: The manifest's checkpoint cadence and probe freshness.
        poll_s: Seconds between looks at the manifest while paused.
        stop: Set to end a pause early (`wait_for_room` then answers False).
        clock: Monotonic seconds.
        wall_clock: Unix seconds (recorded in manifest versions).
        sleep: Sleeps that many seconds.
        random: The DAC policy's jitter source (0.0 if None).
        lag_marks: Which marks (by id) count for `max_lag`; None: every mark. The reclaimer
            counts every mark regardless.

    Raises:
        ConfigError: A bad policy name or setting.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        producer_id: str,
        mesh: DataMesh,
        policy: str | CommitPolicy = "naive",
        job: str = "",
        token_names: Collection[str] = (),
        first_step: int = 0,
        retention: RetentionPolicy | None = None,
        manifest_settings: ManifestSettings = ManifestSettings(),
        poll_s: float = 0.5,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        random: Callable[[], float] | None = None,
        lag_marks: Callable[[str], bool] | None = None,
    ) -> None:
        self.storage = storage
        self._lag_marks = lag_marks
        self.prefix = prefix
        self.producer_id = producer_id
        self.header = JournalHeader(job=job, mesh=mesh, token_names=tuple(sorted(set(token_names))))
        self.first_step = first_step
        self.retention = retention
        self.poll_s = poll_s
        self.stats = WriterStats()
        self._policy = make_policy(policy, random=random or (lambda: 0.0)) if isinstance(policy, str) else policy
        self._settings = manifest_settings
        self._stop = stop or threading.Event()
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._store: ManifestStore | None = None
        self._producer: Producer | None = None

    @property
    def producer(self) -> Producer:
        """The commit protocol's producer (after `resume`).

        Raises:
            FailedPrecondition: Before `resume`.
        """
        if self._producer is None:
            raise FailedPrecondition(f"journal writer {self.producer_id!r}: call resume() first")
        return self._producer

    @property
    def epoch(self) -> int:
        """This process's fencing epoch (0 before `resume`)."""
        return self._producer.epoch if self._producer else 0

    def resume(self) -> int:
        """Opens the journal (its header), registers the producer id with a new fencing epoch
        (fencing every older process of the id) and deletes what older processes of the id
        left uncommitted.

        Returns:
            The next step to build: the producer's last committed step + 1, or `first_step`.

        Raises:
            FailedPrecondition: The storage ignores conditional puts, or the journal was opened
                for another job or mesh.
            Unavailable: The storage failed, or registering kept losing its race.
        """
        store = ManifestStore(
            self.storage, prefix=self.prefix, settings=self._settings, check_writes=True, clock=self._clock, wall_clock=self._wall_clock
        )
        claim_header(self.storage, self.prefix, self.header)
        producer = Producer(store, self.producer_id, policy=self._policy, clock=self._clock, sleep=self._sleep)
        state = producer.register()
        self._store, self._producer = store, producer
        self._delete_stale(store.cached or store.latest(), producer.epoch)
        return max(state.last_step + 1, self.first_step)

    def wait_for_room(self, step: int) -> bool:
        """Blocks while building `step` would run `max_lag` or more steps ahead of the lowest
        live checkpoint mark (the plan's first step, or the retention watermark, without one);
        commits the pending steps before pausing (consumers need them to move on).

        Args:
            step: The step about to be built.

        Returns:
            True when there is room; False if `stop` was set first.

        Raises:
            As `flush`.
        """
        if self.retention is None:
            return not self._stop.is_set()
        started: float | None = None
        while not self._stop.is_set():
            bp = self._backpressure(self.producer.store.latest(), step)
            if not bp.pause:
                if started is not None:
                    self.stats.backpressure_s += self._clock() - started
                return True
            if started is None:
                started = self._clock()
                self.stats.backpressure_waits += 1
                log.info(
                    "producer %s pauses before step %d: %d steps ahead of step %d, the lowest live checkpoint mark (max_lag %d)",
                    self.producer_id,
                    step,
                    bp.lag,
                    bp.floor_step,
                    self.retention.max_lag,
                )
                if self.producer.pending:
                    self.flush()
            self._sleep(self.poll_s)
        return False

    def write(
        self,
        step: int,
        slices: Mapping[tuple[int, int], Mapping[str, np.ndarray]],
        meta: Mapping[tuple[int, int], Mapping[str, int]] | None = None,
    ) -> Attempt | None:
        """Encodes and writes step `step`'s TGB, adds it to the pending steps and commits when
        the policy says so.

        Args:
            step: The step, after every step this producer committed or holds pending.
            slices: (dp, cp) -> the batch of the rank with those coordinates (tp = pp = 0), for
                every coordinate of the written mesh.
            meta: (dp, cp) -> the slice's meta figures for readers of other slices
                (`tgb.encode_tgb`); None: none.

        Returns:
            The commit attempt made, or None if none was due.

        Raises:
            InvalidArgument: Slices that do not match the mesh, or arrays a TGB cannot hold.
            Fenced: A newer process registered the id (this writer's pending objects deleted).
            FailedPrecondition: Before `resume`; a step not after the last one; an object key
                already holding other bytes.
            Unavailable: The storage failed.
        """
        producer = self.producer
        after = producer.pending[-1].step if producer.pending else producer.last_step
        if step <= after:
            raise FailedPrecondition(f"producer {self.producer_id!r} writes step {step} after step {after}: steps must increase")
        mesh = self.header.mesh
        data = encode_tgb(slices, step=step, dp=mesh.dp, cp=mesh.cp, meta=meta)
        key = object_key(self.prefix, step=step, producer=self.producer_id, epoch=producer.epoch)
        if not self.storage.put_if_absent(key, cast(bytes, data)):  # any bytes-like is accepted
            try:
                same = self.storage.get(key) == data
            except NotFound:
                same = False
            if not same:
                raise FailedPrecondition(
                    f"TGB object {key!r} in {self.storage.describe()} already holds other bytes; a TGB is never overwritten"
                )
        self.stats.steps_written += 1
        self.stats.bytes_written += len(data)
        producer.add(StepEntry(step, (StepObject(key=key, size=len(data), checksum=checksum(data)),)))
        return self._commit()

    def flush(self) -> list[Attempt]:
        """Commits every pending step (waiting the policy's gap between attempts).

        Returns:
            The attempts made.

        Raises:
            Fenced: A newer process registered the id (this writer's pending objects deleted).
            Unavailable: Every attempt lost its race, or the storage failed.
        """
        producer = self.producer
        try:
            attempts = producer.flush()
        except Fenced:
            self._delete_orphans()
            raise
        for attempt in attempts:
            self._count(attempt)
        self._delete_orphans()
        return attempts

    def finish(self, end_step: int) -> list[Attempt]:
        """Commits every pending step, then writes the end marker: the data ends at `end_step`
        (one past the last step). A restarted producer finishing again writes the same marker.

        Returns:
            The attempts `flush` made.

        Raises:
            FailedPrecondition: Before `resume`; steps pending or committed at or past
                `end_step`; an end marker saying another step.
            As `flush`.
        """
        producer = self.producer
        last = producer.pending[-1].step if producer.pending else producer.last_step
        if end_step <= last:
            raise FailedPrecondition(f"producer {self.producer_id!r} ends the journal at step {end_step}, yet wrote step {last}")
        attempts = self.flush()
        key = f"{self.prefix}{END_FOLDER}{self.producer_id}.json"
        if not self.storage.put_if_absent(key, encode_end(end_step)):
            found = _read_end(self.storage, key)
            if found != end_step:
                raise FailedPrecondition(
                    f"the journal at {self.prefix or '/'} in {self.storage.describe()} ends at step {found}, "
                    f"producer {self.producer_id!r} ends it at step {end_step}"
                )
        log.info("producer %s: the data ends at step %d (end marker written)", self.producer_id, end_step)
        return attempts

    def _commit(self) -> Attempt | None:
        """Commits if the policy says so; counts the attempt, deletes orphans (also when fenced)."""
        try:
            attempt = self.producer.maybe_commit()
        except Fenced:
            self._delete_orphans()
            raise
        if attempt is not None:
            self._count(attempt)
        self._delete_orphans()
        return attempt

    def _count(self, attempt: Attempt) -> None:
        if attempt.wrote:
            self.stats.fragile_window_s = attempt.fragile_window_s
            if attempt.success:
                self.stats.commits += 1
            else:
                self.stats.conflicts += 1
        self.stats.steps_taken += len(attempt.taken)

    def _delete_orphans(self) -> None:
        for obj in self.producer.take_orphans():
            self.storage.delete(obj.key)
            self.stats.orphans_deleted += 1

    def _delete_stale(self, state: ManifestState, epoch: int) -> None:
        """Deletes the objects older processes of this id wrote and never committed: they are
        fenced, so no version can list them any more."""
        listed = {o.key for s in state.steps for o in s.entry.objects}
        for key in self.storage.list(self.prefix + TGB_FOLDER):
            parsed = parse_object_key(self.prefix, key)
            if parsed is None:
                continue
            _, producer, old_epoch = parsed
            if producer == self.producer_id and old_epoch < epoch and key not in listed:
                log.info("producer %s: deleting %s, left uncommitted by its process of epoch %d", self.producer_id, key, old_epoch)
                self.storage.delete(key)
                self.stats.orphans_deleted += 1

    def _backpressure(self, state: ManifestState, step: int) -> Backpressure:
        policy = self.retention if self.retention is not None else RetentionPolicy()
        counted = self._lag_marks or (lambda mark: True)
        marks = [Watermark(m.manifest_version, m.step) for m in state.marks if counted(m.mark)]
        return backpressure(watermarks=marks, next_step=step, policy=policy, origin_step=max(self.first_step, state.watermark))
