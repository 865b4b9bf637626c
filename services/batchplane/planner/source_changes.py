"""Whether a job's sources are still the data its ledger recorded, and what differs when they are
not. Pure: no I/O, no grpc.

Every generation of the ledger records each source's rows and a digest of its row groups; the
first one that sees a source's files (`SourceInfo.files`: name relative to the source's
location, size, modification time, rows) records them too, and so does a generation whose start
restarted a changed source (`sources[].on_change: restart`). A job that resumes on a run folder
continues the consumption the ledger recorded, position by position: if a source's files
changed since, those positions name other rows, and the resume would repeat or skip samples, or
fail deep in planning. So the planner compares what its loaders report with what the ledger
recorded before it plans anything (`compare_source`), and refuses a changed source naming it and
what differs (`refusal`), unless the job declares the change.

What is compared is what both sides have: a ledger written before files were recorded (or a
loader that does not report them) is compared on rows and row groups only; a size or time the
file system does not give (-1) is not compared.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

#: Names shown per kind of difference before "and N more".
SHOWN_NAMES = 5
#: A size or modification time the file system does not give.
UNKNOWN = -1


@dataclasses.dataclass(frozen=True)
class FileFacts:
    """One file of a source, as a loader reported it (`SourceFile`).

    Attributes:
        name: Its path relative to the source's location.
        size_bytes: Its size; `UNKNOWN` (-1) when the file system gives none.
        mtime_ns: Its modification time, ns since the Unix epoch; `UNKNOWN` when none.
        rows: Rows in it.
    """

    name: str
    size_bytes: int
    mtime_ns: int
    rows: int

    def to_json(self) -> list:
        return [self.name, self.size_bytes, self.mtime_ns, self.rows]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> FileFacts:
        name, size, mtime, rows = value
        return cls(str(name), int(size), int(mtime), int(rows))


@dataclasses.dataclass(frozen=True)
class SourceRecord:
    """What identifies a source's data.

    Attributes:
        rows: Its rows over all files.
        digest: A digest of its row groups' sizes (`membership.row_groups_digest`).
        files: Its files in row order; None when not known (a ledger written before they were
            recorded, a loader that does not report them).
    """

    rows: int
    digest: str
    files: tuple[FileFacts, ...] | None = None

    def to_json(self, *, with_files: bool = True) -> list:
        """As a ledger head records it: [rows, digest] and, when known and asked for, the files."""
        out: list = [self.rows, self.digest]
        if with_files and self.files is not None:
            out.append([f.to_json() for f in self.files])
        return out

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> SourceRecord:
        """From a ledger head's entry: [rows, digest] or [rows, digest, files]."""
        files = tuple(FileFacts.from_json(f) for f in value[2]) if len(value) > 2 and value[2] is not None else None
        return cls(int(value[0]), str(value[1]), files)


@dataclasses.dataclass(frozen=True)
class FileChange:
    """One fact of one file that differs.

    Attributes:
        name: The file.
        what: "rows", "size" or "modified".
        old: The recorded value.
        new: The reported value.
    """

    name: str
    what: str
    old: int
    new: int


@dataclasses.dataclass(frozen=True)
class SourceChange:
    """How a source differs from what the ledger recorded of it.

    Attributes:
        source: The source's name.
        added: Files reported that the record lacks, in row order.
        gone: Files recorded that are no longer reported, in row order.
        changed: Facts of files in both that differ, in row order.
        rows: (recorded, reported) total rows, when they differ.
        row_groups: The row groups differ (their digests).
    """

    source: str
    added: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    changed: tuple[FileChange, ...] = ()
    rows: tuple[int, int] | None = None
    row_groups: bool = False

    def lines(self) -> list[str]:
        """What differs, a line per kind, at most `SHOWN_NAMES` names each."""
        out = []
        if self.gone:
            out.append(f"files gone: {_names(self.gone)}")
        if self.added:
            out.append(f"files added: {_names(self.added)}")
        for what, label in (("rows", "rows changed"), ("size", "sizes changed"), ("modified", "modified")):
            picked = [c for c in self.changed if c.what == what]
            if picked:
                shown = ", ".join(f"{c.name}: {_value(what, c.old)} -> {_value(what, c.new)}" for c in picked[:SHOWN_NAMES])
                out.append(f"{label}: {shown}{_more(len(picked))}")
        if self.rows is not None:
            out.append(f"rows in all: {self.rows[0]} -> {self.rows[1]}")
        if self.row_groups and not out:
            out.append("its row groups differ (same rows in all)")
        return out

    @property
    def only_modified(self) -> bool:
        """Only modification times differ: the same names, sizes and rows (a copy that did not keep
        the times looks like that)."""
        return bool(self.changed) and all(c.what == "modified" for c in self.changed) and not (self.added or self.gone or self.rows)


def compare_source(name: str, recorded: SourceRecord, reported: SourceRecord) -> SourceChange | None:
    """How source `name` as its loader reported it differs from what the ledger recorded of it;
    None when nothing both know of differs.

    Args:
        name: The source's name.
        recorded: What the ledger recorded.
        reported: What its loader reports now.
    """
    added: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    changed: list[FileChange] = []
    if recorded.files is not None and reported.files is not None:
        before = {f.name: f for f in recorded.files}
        now = {f.name: f for f in reported.files}
        gone = tuple(f.name for f in recorded.files if f.name not in now)
        added = tuple(f.name for f in reported.files if f.name not in before)
        for f in reported.files:
            old = before.get(f.name)
            if old is None:
                continue
            if old.rows != f.rows:
                changed.append(FileChange(f.name, "rows", old.rows, f.rows))
            if UNKNOWN not in (old.size_bytes, f.size_bytes) and old.size_bytes != f.size_bytes:
                changed.append(FileChange(f.name, "size", old.size_bytes, f.size_bytes))
            if UNKNOWN not in (old.mtime_ns, f.mtime_ns) and old.mtime_ns != f.mtime_ns:
                changed.append(FileChange(f.name, "modified", old.mtime_ns, f.mtime_ns))
    rows = (recorded.rows, reported.rows) if recorded.rows != reported.rows else None
    row_groups = recorded.digest != reported.digest
    if not (added or gone or changed or rows or row_groups):
        return None
    return SourceChange(name, added, gone, tuple(changed), rows, row_groups)


def compare_sources(recorded: Mapping[str, SourceRecord], reported: Mapping[str, SourceRecord]) -> list[SourceChange]:
    """The changes of every source both name, in `reported`'s order."""
    out = []
    for name, now in reported.items():
        before = recorded.get(name)
        change = None if before is None else compare_source(name, before, now)
        if change is not None:
            out.append(change)
    return out


@dataclasses.dataclass(frozen=True)
class StartDecision:
    """What a start does about changed sources (`decide`).

    Attributes:
        refused: Changed sources the job does not declare: the start is refused.
        restarted: Changed sources the job declares (`on_change: restart`): their data starts
            over from its beginning at the start step.
    """

    refused: tuple[SourceChange, ...] = ()
    restarted: tuple[SourceChange, ...] = ()


def decide(changes: Sequence[SourceChange], on_change: Mapping[str, str]) -> StartDecision:
    """Which changed sources refuse the start and which restart, by each one's `on_change`
    ("refuse", the default, or "restart")."""
    restart = tuple(c for c in changes if on_change.get(c.source, "refuse") == "restart")
    return StartDecision(tuple(c for c in changes if c not in restart), restart)


def refusal(changes: Sequence[SourceChange], *, step: int, since: str, fields: Mapping[str, str]) -> str:
    """The text of a start refused for `changes`: a line naming the changed sources, what differs
    in each (a few lines, at most `SHOWN_NAMES` names per kind), and what to do.

    Args:
        changes: The changed sources (at least one).
        step: The step the job resumes at.
        since: Where the record is, e.g. "generation 2 of the ledger at /run/ledger".
        fields: Source name -> its setting's path, e.g. "sources[1]".
    """
    names = ", ".join(repr(c.source) for c in changes)
    lines = [f"cannot resume at step {step}: source{'s' if len(changes) > 1 else ''} {names} changed since {since} recorded it"]
    for c in changes:
        prefix = f"  {c.source!r}: " if len(changes) > 1 else "  "
        lines.extend(prefix + line for line in c.lines())
    declare = ", ".join(f"{fields[c.source]}.on_change: restart" for c in changes)
    advice = (
        f"The ledger's positions in a changed source name other rows now: resuming would repeat or skip samples. Restore the "
        f"files, declare the change ({declare}: the data starts over from its beginning at step {step}), or start on a new "
        f"run folder (run_dir or ledger.location)"
    )
    if all(c.only_modified for c in changes):
        advice += "; only modification times differ: a copy that keeps them (cp -p, rsync -t) counts as unchanged"
    return "\n".join([*lines, advice + "."])


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:SHOWN_NAMES]) + _more(len(names))


def _more(count: int) -> str:
    return f" and {count - SHOWN_NAMES} more" if count > SHOWN_NAMES else ""


def _value(what: str, value: int) -> str:
    if what == "modified":
        try:
            when = datetime.datetime.fromtimestamp(value / 1e9, datetime.timezone.utc)
        except (OverflowError, OSError, ValueError):
            return f"{value} ns"
        return when.isoformat(timespec="microseconds").replace("+00:00", "Z")
    if what == "size":
        return f"{value} bytes"
    return str(value)
