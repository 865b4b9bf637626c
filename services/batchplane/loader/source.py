"""Opening a source's Parquet files once and reading their row groups.

A source is a file, a directory (every *.parquet below it) or a glob, local or anywhere pyarrow
reaches (s3://, gs://, hdfs://, abfs://, file://, and fsspec's schemes: see
`batchplane.loader.filesystems`); its files are taken in sorted path order and its rows are
numbered over them in that order. Opening checks what can be checked up front and fails with a
`SourceError` naming the source, the file (a local path or a URL) and the problem: nothing
there, no such bucket, no access, an unreachable endpoint, a file that cannot be read, a missing
column, a token column that is not a list of integers, a source without rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from batchplane.core.errors import SourceError
from batchplane.loader.file_facts import FileFacts, file_facts
from batchplane.loader.filesystems import find_parquet_files, translated_errors
from batchplane.core.store_errors import classify_error, first_line
from batchplane.loader.locations import is_store_trouble, retry_delay

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One row group of a source.

    Attributes:
        file: Index of its file in `ParquetSource.files`.
        index: Its index within the file.
        num_rows: Rows in it.
        first_row: The source row of its first row.
    """

    file: int
    index: int
    num_rows: int
    first_row: int


class ParquetSource:
    """The file state of one source: open Parquet files and their row-group index.

    Attributes:
        files: Its files as messages show them: local paths, or URLs ("s3://bucket/key.parquet").
        file_facts: What identifies its data, file by file (`file_facts.FileFacts`: name
            relative to the location, size, modification time, rows), as the loader reports it.

    Args:
        name: The source's name (for errors and logs).
        path: File, directory or glob: a local path, already resolved, or a URL.
        required_columns: Columns that must exist in every file.
        token_column: If given, a column that must be a list of integers.
        on_retry: Called before each retry of a read the store failed (see `read`).
    Raises:
        SourceError: see the module docstring.
    """

    def __init__(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        required_columns: Sequence[str] = (),
        token_column: str | None = None,
        on_retry: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        #: Called before each retry of a read the store failed (see `read`), e.g. a counter.
        self.on_retry = on_retry
        found = find_parquet_files(name, path)
        self._filesystem = found.filesystem
        self._paths = found.paths
        self._scheme = found.scheme
        self.files: list[str] = list(found.names)
        self._handles: list[pq.ParquetFile] = []
        row_groups: list[RowGroup] = []
        rows_per_file: list[int] = []
        first_row = 0
        for file_index, file in enumerate(self.files):
            handle = self.open_file(file_index)
            self._check_schema(file, handle.schema_arrow, required_columns, token_column)
            self._handles.append(handle)
            meta = handle.metadata
            rows_per_file.append(meta.num_rows)
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                row_groups.append(RowGroup(file=file_index, index=g, num_rows=n, first_row=first_row))
                first_row += n
        self.row_groups = tuple(rg for rg in row_groups if rg.num_rows > 0)
        self.num_rows = first_row
        self.file_facts: tuple[FileFacts, ...] = file_facts(found.stats, rows_per_file)
        if self.num_rows == 0:
            raise SourceError(f"source {name!r}: no rows in {len(self.files)} file(s) at {os.fspath(path)!r}")

    def open_file(self, index: int) -> pq.ParquetFile:
        """A new reader of file `index`, opened as the source opens its own: one input file of
        the source's file system, page checksums verified.

        Raises:
            SourceError: the file cannot be opened or is not Parquet (names source and file).
        """
        with translated_errors(self.name, "read Parquet file", self.files[index], self._scheme):
            handle = self._filesystem.open_input_file(self._paths[index])
            try:
                return pq.ParquetFile(handle, page_checksum_verification=True)
            except BaseException:
                handle.close()
                raise

    def _check_schema(self, file: str, schema: pa.Schema, required: Sequence[str], token_column: str | None) -> None:
        for column in (*required, *([token_column] if token_column else [])):
            if schema.get_field_index(column) < 0:
                raise SourceError(f"source {self.name!r}: file {file!r} has no column {column!r} (columns: {', '.join(schema.names)})")
        if token_column:
            kind = schema.field(token_column).type
            if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)):
                raise SourceError(
                    f"source {self.name!r}: file {file!r} column {token_column!r} must be a list of integers (token ids), got {kind}"
                )

    def read(self, row_group: RowGroup, columns: Sequence[str] | None) -> pa.Table:
        """The rows of one row group (only `columns`, if given).

        A read of a remote file that fails on trouble of the store (unreachable, throttled,
        credentials refused: `locations.is_store_trouble`) is tried again until it succeeds,
        waiting `locations.retry_delay` between tries, logged and counted by `on_retry`: a
        store's hiccup never loses rows; the trainers wait instead.

        Raises:
            OSError, pyarrow.ArrowException: the row group cannot be read or decoded (corrupt
                data, a failed page checksum, a file gone); the caller decides what to do.
        """
        attempt = 0
        while True:
            try:
                return self._handles[row_group.file].read_row_group(
                    row_group.index, columns=list(columns) if columns else None, use_threads=False
                )
            except (OSError, pa.ArrowException) as exc:
                if not is_store_trouble(str(exc), remote=self._scheme not in (None, "file")):
                    raise
                delay = retry_delay(attempt)
                attempt += 1
                log.warning(
                    "source %r: reading %s failed (%s), try %d again in %.1f s: %s",
                    self.name,
                    self.describe(row_group),
                    classify_error(str(exc)).value,
                    attempt + 1,
                    delay,
                    first_line(str(exc)),
                )
                self.on_retry()
                time.sleep(delay)

    def describe(self, row_group: RowGroup) -> str:
        """'file F row group G' for logs."""
        return f"file {self.files[row_group.file]!r} row group {row_group.index}"
