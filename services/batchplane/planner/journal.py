"""The durable ledger: every planned step's record on a `Storage`, written before its plan is
served, crash-safe, compacted, readable by `batchplane ledger`.

Where it lies (`open_ledger_storage`): `ledger.location` of the job, an object store URL such as
"s3://bucket/prefix" or a local folder, else `<run_dir>/ledger`. An object store must honour
conditional writes; a writer proves it when it opens the ledger.

Layout (keys of the storage):

    epochs/000000000002                                   a planner's writer epoch (see `fencing`)
    gen-000003/head.json                                  the generation's start
    gen-000003/steps/000000000123.json                    the record of one step
    gen-000003/steps/000000000124-000000000131.json       the records of steps 124..131, one JSON line each
    gen-000003/segments/000000000000-000000000999.json.gz  steps 0..999, one JSON line each
    gen-000003/segments/000000000000-000000000999.thin.json.gz  the same, thinned
    gen-000003/reports/000000000120.json                  a training report (adaptive mixing)

Every planner start opens a new *generation*, claimed with put_if_absent (the next number), and
writes each step's record once with put_if_absent: nothing is ever overwritten, so a crash at any
point leaves a ledger that opens. The steps a planner plans in one go (a constructor that takes
several steps' plans at once asks for them together) are written as one object of consecutive
records, never across a segment's end: one write (two flushes to disk, or one PUT) per group
instead of per step. A generation supersedes the earlier ones from its start step
on: the steps an earlier run planned ahead but no trainer checkpointed past are planned again,
possibly differently (another mixture, another mesh). Reading step s takes the newest generation
that started at or before s; if it has not recorded s, no record of s counts. A new generation
folds the step records earlier ones left loose into segments, so restarts leave nothing behind.

A record holds the step's target shares, the seq range taken from each source, tokens per
source, each rank's microbatches by sample identity, and the mixture state after the step, so a
resume at step s restores the cursors from record s - 1 whatever changed since (I1 across
changes). Steps are compacted into gzip segments of `SEGMENT_STEPS` (a generation's first one ends at
the next multiple) once every rank has moved past them; a crash between writing a segment and deleting its step records leaves duplicates
that are identical and harmless.

Size. A record is O(K) beside its per-rank sample lists ("ranks", and their content digests,
"digests"), which are O(samples per step). With `keep_detail_steps`, segments further than that
behind the slowest rank are rewritten *thinned*, without "ranks" and "digests": they keep what a
resume and the mixture figures need (shares, seq ranges taken, tokens, cursors, consumed sets),
so the ledger grows by about 80 bytes a step with 4 sources (gzipped) instead of by every
sample's id and digest (about 4 KB a step at 256 samples, 1 KB of it the ids: `batchplane bench
ledger --config 8:256:4 --steps 1000`, 3,965 bytes a step in segments, 1,057 without digests).
`ledger find` cannot see samples in thinned steps and says so.

Training reports (metric-driven mixing) are stored the moment they arrive, first report of a step
wins, in the generation that was running; the report of step t counts from the newest generation
that started at or before t and holds it, like records. The record of the step that applied a
report holds it too, so reports are deleted once compaction has folded that record.
"""

from __future__ import annotations

import dataclasses
import collections
import gzip
import json
import logging
import pathlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

from batchplane.core.config import JobSettings
from batchplane.core.errors import NotFound
from batchplane.core.object_storage import open_storage
from batchplane.core.storage import Storage

log = logging.getLogger(__name__)

SEGMENT_STEPS = 1000
#: The ledger's folder in the run folder, where `ledger.location` is not set.
LEDGER_DIR = "ledger"
_GEN = re.compile(r"^gen-(\d{6})/head\.json$")
_STEP = re.compile(r"/steps/(\d{12})(?:-(\d{12}))?\.json$")
_SEGMENT = re.compile(r"/segments/(\d{12})-(\d{12})(?:\.thin)?\.json\.gz$")
#: gzip level of segments: level 9 costs ~4x the time of 6 for ~2% less space on records.
_GZIP_LEVEL = 6
#: Parsed segments a reader keeps (lineage scans read segments in order).
_CACHED_SEGMENTS = 4
#: Record fields a thinned segment drops.
DETAIL_FIELDS = ("ranks", "digests")
#: Record fields that say how the run went, not what was planned: two runs of the same job
#: differ in them ("delivered_below": every rank had been handed the steps below it when the
#: step was planned; where a restarted planner resumes).
RUNTIME_FIELDS = ("delivered_below",)
_REPORT = re.compile(r"/reports/(\d{12})\.json$")


def ledger_location(job: JobSettings, run_dir: pathlib.Path) -> str:
    """Where the job's ledger lies: `ledger.location` (a URL as it is, a local path made absolute
    against the configuration file's folder), else `<run_dir>/ledger`.

    Args:
        run_dir: The job's run folder (`run_dir`, or the one `batchplane up --run-dir` gives).
    """
    if job.ledger.location is not None:
        return job.locate(job.ledger.location)
    return str(pathlib.Path(run_dir).absolute() / LEDGER_DIR)


def open_ledger_storage(job: JobSettings, run_dir: pathlib.Path, *, check_writes: bool = True) -> Storage:
    """Opens the job's ledger (see `ledger_location`); a local folder is created if missing.

    Args:
        run_dir: The job's run folder.
        check_writes: For a writer (the planner): prove that an object store honours
            conditional writes first (`object_storage.check_conditional_puts`). Readers
            (`batchplane ledger`) write nothing.
    Raises:
        FailedPrecondition: The store cannot be opened or ignores conditional writes (the
            message names it).
        Unavailable: The store cannot be reached.
    """
    return open_storage(ledger_location(job, run_dir), check_writes=check_writes)


def _gen_prefix(gen: int) -> str:
    return f"gen-{gen:06d}/"


def _segment_end(lo: int) -> int:
    """The last step of the segment that starts at `lo`: before the next multiple of SEGMENT_STEPS."""
    return (lo // SEGMENT_STEPS + 1) * SEGMENT_STEPS - 1


def _report_key(gen: int, step: int) -> str:
    return f"{_gen_prefix(gen)}reports/{step:012d}.json"


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class Generation:
    """One planner run's part of the ledger."""

    gen: int
    start_step: int
    fingerprints: Mapping[str, str]
    sources: tuple[str, ...]
    #: Source name -> [rows, row groups digest] as the run's loaders reported them (absent in
    #: ledgers written before it was recorded), with a third entry, the source's files
    #: ([[name, size_bytes, mtime_ns, rows], ...]), where the generations before did not record
    #: those files (`planner.source_changes.SourceRecord`).
    source_facts: Mapping[str, list] | None = None
    #: Sources whose data started over from its beginning at `start_step` (changed sources the
    #: job declared, `sources[].on_change: restart`).
    restarted: tuple[str, ...] = ()


class LedgerReader:
    """The ledger as it is on `storage`: generations and the authoritative record of each step.

    Args:
        storage: Where the ledger lies.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.generations: list[Generation] = []
        for key in storage.list("gen-"):
            m = _GEN.match(key)
            if m:
                head = json.loads(storage.get(key))
                self.generations.append(
                    Generation(
                        int(m.group(1)),
                        head["start_step"],
                        head["fingerprints"],
                        tuple(head["sources"]),
                        head.get("source_facts"),
                        tuple(head.get("restarted", ())),
                    )
                )
        self.generations.sort(key=lambda g: g.gen)
        self._index: dict[int, dict[int, str]] = {}  # gen -> step -> key of the record or segment
        self._segments: collections.OrderedDict[str, list[bytes]] = collections.OrderedDict()  # a few, as raw lines (groups too)

    def _keys(self, gen: int) -> dict[int, str]:
        if gen not in self._index:
            keys: dict[int, str] = {}
            for key in self.storage.list(_gen_prefix(gen)):
                if m := _SEGMENT.search(key):
                    for step in range(int(m.group(1)), int(m.group(2)) + 1):
                        keys.setdefault(step, key)
            for first, last, key in _step_objects(self.storage, _gen_prefix(gen)):
                for step in range(first, last + 1):
                    keys.setdefault(step, key)
            self._index[gen] = keys
        return self._index[gen]

    def _load(self, key: str, step: int) -> dict:
        m = _SEGMENT.search(key) or _STEP.search(key)
        assert m is not None, key
        if m.group(2) is None:  # one step's record
            return json.loads(self.storage.get(key))
        if key not in self._segments:
            data = self.storage.get(key)
            self._segments[key] = (gzip.decompress(data) if key.endswith(".gz") else data).split(b"\n")
            if len(self._segments) > _CACHED_SEGMENTS:
                self._segments.popitem(last=False)
        self._segments.move_to_end(key)
        return json.loads(self._segments[key][step - int(m.group(1))])

    def owner(self, step: int) -> Generation | None:
        """The generation whose record of `step` counts: the newest that started at or before
        it, if it holds it (an earlier one's record of that step was superseded)."""
        for g in reversed(self.generations):
            if g.start_step <= step:
                return g if step in self._keys(g.gen) else None
        return None

    def record(self, step: int) -> dict | None:
        """The record of `step`, or None when no generation planned it."""
        g = self.owner(step)
        return None if g is None else self._load(self._keys(g.gen)[step], step)

    def report(self, step: int) -> dict | None:
        """The training report of `step` that counts, or None when none was stored."""
        for g in reversed(self.generations):
            if g.start_step <= step:
                try:
                    return json.loads(self.storage.get(_report_key(g.gen, step)))
                except NotFound:
                    continue
        return None

    def last_step(self) -> int | None:
        """The latest step whose record counts (see `owner`)."""
        steps = sorted({step for g in self.generations for step in self._keys(g.gen)}, reverse=True)
        return next((step for step in steps if self.owner(step) is not None), None)

    def recorded_below(self) -> int:
        """The step after the latest one any generation recorded, superseded or not (a plan may
        have been served from it before a rewind superseded it); 0 on a new ledger."""
        return max((step + 1 for g in self.generations for step in self._keys(g.gen)), default=0)

    def records(self, first: int = 0, last: int | None = None) -> Iterator[dict]:
        """The authoritative records of steps first..last (inclusive) that exist, in order."""
        last = self.last_step() if last is None else last
        if last is None:
            return
        for step in range(first, last + 1):
            record = self.record(step)
            if record is not None:
                yield record


class LedgerWriter:
    """Appends this planner run's step records as a new generation.

    Args:
        reader: The ledger as it is (its storage, and the generations already there).
        start_step: The step this run starts planning at.
        fingerprints: The job's settings fingerprints (what a later resume compares against).
        sources: The job's source names.
        keep_detail_steps: Thin segments that end this many steps or more before the slowest
            rank (see the module docstring); None keeps every record whole.
        source_facts: Source name -> [rows, row groups digest] as the loaders reported them (a
            restarted planner expects them of every loader that registers), and the source's
            files where they are to be recorded (see `Generation.source_facts`).
        restarted: Sources whose data starts over from its beginning at `start_step`.
    """

    def __init__(
        self,
        reader: LedgerReader,
        *,
        start_step: int,
        fingerprints: Mapping[str, str],
        sources: tuple[str, ...],
        keep_detail_steps: int | None = None,
        source_facts: Mapping[str, Sequence[Any]] | None = None,
        restarted: Sequence[str] = (),
    ) -> None:
        self.storage = storage = reader.storage
        gen = (reader.generations[-1].gen + 1) if reader.generations else 1
        head = {"start_step": start_step, "fingerprints": dict(fingerprints), "sources": list(sources), "created": time.time()}
        if source_facts:
            head["source_facts"] = {name: list(facts) for name, facts in source_facts.items()}
        if restarted:
            head["restarted"] = list(restarted)
        while not storage.put_if_absent(f"{_gen_prefix(gen)}head.json", _encode(head)):
            gen += 1  # another planner claimed it: never share a generation
        self.generation = Generation(
            gen, start_step, dict(fingerprints), tuple(sources), head.get("source_facts"), tuple(head.get("restarted", ()))
        )
        self._earlier = [g.gen for g in reader.generations if g.gen < gen]  # whose loose steps to fold once
        self._prefix = _gen_prefix(gen)
        self._next_segment = start_step  # a generation's first segment ends at the next multiple of SEGMENT_STEPS
        self._next_thin = start_step
        self._appended_through = start_step - 1
        self._keep_detail_steps = keep_detail_steps
        self.bytes_written = 0

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Writes the records of consecutive steps durably (before any of their plans may be
        served): one object per group, a group ending where a segment does (one step: its own
        object, `steps/<step>.json`).

        Raises:
            ValueError: the records are not of consecutive steps.
            RuntimeError: a step is recorded twice in this generation.
        """
        if not records:
            return
        first = int(records[0]["step"])
        steps = [int(r["step"]) for r in records]
        if steps != list(range(first, first + len(steps))):
            raise ValueError(f"ledger records must be of consecutive steps, got steps {steps}")
        if first <= self._appended_through and self._appended_through >= self.generation.start_step:
            self._twice(max(first, self.generation.start_step))
        lines = [_encode(r) for r in records]
        at = 0
        while at < len(steps):
            end = min(len(steps), at + _segment_end(steps[at]) - steps[at] + 1)  # never across a segment's end
            lo, hi = steps[at], steps[end - 1]
            key = f"{self._prefix}steps/{lo:012d}.json" if lo == hi else f"{self._prefix}steps/{lo:012d}-{hi:012d}.json"
            data = b"\n".join(lines[at:end])
            if not self.storage.put_if_absent(key, data):
                self._twice(lo)
            self._appended_through = hi
            self.bytes_written += len(data)
            at = end

    def _twice(self, step: int) -> NoReturn:
        raise RuntimeError(f"ledger record of step {step} exists twice in generation {self.generation.gen} of {self.storage.describe()}")

    def put_report(self, step: int, report: Mapping[str, Any]) -> dict:
        """Stores the training report of `step` durably unless one is already stored; returns
        the one that stands (the first)."""
        key = _report_key(self.generation.gen, step)
        if self.storage.put_if_absent(key, _encode(report)):
            return dict(report)
        return json.loads(self.storage.get(key))

    def report(self, step: int) -> dict | None:
        """The training report of `step` stored in this generation, or None."""
        try:
            return json.loads(self.storage.get(_report_key(self.generation.gen, step)))
        except NotFound:
            return None

    def compact(self, below_step: int, *, report_delay: int | None = None) -> int:
        """Folds every whole segment of this generation's steps below `below_step` (which every
        rank has moved past) into one gzip object; returns the number of segments written.

        Args:
            report_delay: With adaptive mixing, the delay D after which a step's record holds the
                report it applied: reports of steps whose applying record was folded are deleted.
        """
        written = 0
        if self._earlier:
            self._fold_earlier()
        below_step = min(below_step, self._appended_through + 1)  # only steps this run wrote
        while _segment_end(self._next_segment) < below_step:
            lo, hi = self._next_segment, _segment_end(self._next_segment)
            objects = [o for o in _step_objects(self.storage, self._prefix) if lo <= o[0] <= hi]
            _fold(self.storage, self._prefix, lo, hi, objects)
            self._next_segment = hi + 1
            written += 1
        if self._keep_detail_steps is not None:
            self._thin(below_step - self._keep_detail_steps)
        if written and report_delay is not None:
            for key in self.storage.list(f"{self._prefix}reports/"):
                m = _REPORT.search(key)
                if m and int(m.group(1)) + report_delay < self._next_segment:
                    self.storage.delete(key)
        return written

    def _fold_earlier(self) -> None:
        """Folds the step records earlier generations left loose (the steps they planned past
        their last segment, superseded or not) into segments, so restarts do not accumulate
        them."""
        for gen in self._earlier:
            prefix = _gen_prefix(gen)
            runs: list[list[tuple[int, int, str]]] = []  # consecutive objects within one segment
            for first, last, key in _step_objects(self.storage, prefix):
                if runs and first == runs[-1][-1][1] + 1 and last <= _segment_end(runs[-1][0][0]):
                    runs[-1].append((first, last, key))
                else:
                    runs.append([(first, last, key)])
            for run in runs:
                _fold(self.storage, prefix, run[0][0], run[-1][1], run)
        self._earlier = []

    def _thin(self, below_step: int) -> None:
        """Rewrites this generation's whole segments that end before `below_step` without the
        records' detail fields (thinned copy first, then the whole one deleted: a crash between
        leaves both, and readers take the whole one)."""
        while self._next_thin < self._next_segment and _segment_end(self._next_thin) < below_step:
            lo, hi = self._next_thin, _segment_end(self._next_thin)
            whole = f"{self._prefix}segments/{lo:012d}-{hi:012d}.json.gz"
            records = (json.loads(line) for line in gzip.decompress(self.storage.get(whole)).split(b"\n"))
            thin = b"\n".join(_encode({k: v for k, v in r.items() if k not in DETAIL_FIELDS}) for r in records)
            self.storage.put_if_absent(whole.replace(".json.gz", ".thin.json.gz"), gzip.compress(thin, compresslevel=_GZIP_LEVEL))
            self.storage.delete(whole)
            self._next_thin = hi + 1


def _step_objects(storage: Storage, prefix: str) -> list[tuple[int, int, str]]:
    """(first step, last step, key) of every object of step records of the generation at
    `prefix`, by first step."""
    found = []
    for key in storage.list(prefix + "steps/"):
        if m := _STEP.search(key):
            first = int(m.group(1))
            found.append((first, first if m.group(2) is None else int(m.group(2)), key))
    return sorted(found)


def _fold(storage: Storage, prefix: str, lo: int, hi: int, objects: Sequence[tuple[int, int, str]]) -> None:
    """Folds the step records lo..hi of the generation at `prefix`, held by `objects` (first
    step, last step, key; in order), into one gzip segment of JSON lines (a record is one line),
    then deletes them: a crash between leaves identical copies.

    Raises:
        NotFound: the objects do not hold every step lo..hi, each once (the message names the
            first step missing).
    """
    held = [s for first, last, _ in objects for s in range(first, last + 1)]
    if held != list(range(lo, hi + 1)):
        gap = next((s for s, h in zip(range(lo, hi + 1), held) if s != h), lo + len(held))
        raise NotFound(f"ledger record of step {gap} in {prefix}steps/ of {storage.describe()}: not found (folding steps {lo}..{hi})")
    lines = b"\n".join(storage.get(key) for _, _, key in objects)
    storage.put_if_absent(f"{prefix}segments/{lo:012d}-{hi:012d}.json.gz", gzip.compress(lines, compresslevel=_GZIP_LEVEL))
    for _, _, key in objects:
        storage.delete(key)


def ledger_size(storage: Storage) -> int:
    """Bytes of every object of the ledger (for figures)."""
    return sum(len(storage.get(k)) for k in storage.list("gen-"))
