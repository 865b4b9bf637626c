"""What identifies a source's data, file by file: the facts a loader reports to the planner
(`SourceInfo.files`), which compares them with those its ledger recorded when a job resumes on a
run folder (`batchplane.planner.source_changes`).

A file's facts are its name relative to the source's location (moving a dataset keeps them), its
size and modification time as the listing gave them (-1 where the file system gives none:
pyarrow's FileInfo carries no ETag or version, so a store's object is known by its size and
LastModified), and its rows as its format says: for Parquet, the footer's row count. Another
format adds its own way of counting rows here, nothing else.

Pure: no I/O, no pyarrow (the listing and the footers are read by `filesystems` and `source`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: A size or modification time the file system does not give.
UNKNOWN = -1


@dataclasses.dataclass(frozen=True)
class FileStat:
    """What the listing said of one file of a source (`batchplane.loader.filesystems` lists it).

    Attributes:
        name: Its path relative to the location (the folder, or a glob's fixed prefix; a
            location that names the file itself: its name), "/"-separated.
        size_bytes: Its size; None when the file system gives none.
        mtime_ns: Its modification time, ns since the Unix epoch; None when the file system
            gives none.
    """

    name: str
    size_bytes: int | None
    mtime_ns: int | None


@dataclasses.dataclass(frozen=True)
class FileFacts:
    """One file of a source as the loader found it.

    Attributes:
        name: Its path relative to the source's location, "/"-separated.
        size_bytes: Its size; `UNKNOWN` when the file system gives none.
        mtime_ns: Its modification time in ns since the Unix epoch; `UNKNOWN` when none.
        rows: Rows in it.
    """

    name: str
    size_bytes: int
    mtime_ns: int
    rows: int


def file_facts(stats: Sequence[FileStat], rows: Sequence[int]) -> tuple[FileFacts, ...]:
    """The facts of a source's files from what the listing said of them and their row counts.

    Args:
        stats: Per file, in the source's order, what the listing said (`SourceFiles.stats`).
        rows: Per file, in the same order, its rows (a Parquet footer's `num_rows`).
    Raises:
        ValueError: `stats` and `rows` are not of the same files (their lengths differ).
    """
    if len(stats) != len(rows):
        raise ValueError(f"{len(stats)} files listed, {len(rows)} row counts")
    return tuple(
        FileFacts(
            name=stat.name,
            size_bytes=UNKNOWN if stat.size_bytes is None else int(stat.size_bytes),
            mtime_ns=UNKNOWN if stat.mtime_ns is None else int(stat.mtime_ns),
            rows=int(n),
        )
        for stat, n in zip(stats, rows)
    )
