"""Opening a source's Parquet files once and reading their row groups.

A source is a file, a directory (every *.parquet below it) or a glob; its files are taken in
sorted path order and its rows are numbered over them in that order. Opening checks what can
be checked up front and fails with a `SourceError` naming the source, the file and the problem:
no file matched, a file that cannot be read, a missing column, a token column that is not a
list of integers, a source without rows.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import pathlib
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from batchplane.core.errors import SourceError

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


def expand_path(path: pathlib.Path) -> list[pathlib.Path]:
    """The Parquet files a source path names, sorted: the file itself, every *.parquet below a
    directory, or the matches of a glob."""
    text = str(path)
    if any(c in text for c in "*?["):
        return sorted(pathlib.Path(p) for p in glob.glob(text, recursive=True) if pathlib.Path(p).is_file())
    if path.is_dir():
        return sorted(p for p in path.rglob("*.parquet") if p.is_file())
    return [path] if path.exists() else []


class ParquetSource:
    """The file state of one source: open Parquet files and their row-group index.

    Args:
        name: The source's name (for errors and logs).
        path: File, directory or glob, already resolved.
        required_columns: Columns that must exist in every file.
        token_column: If given, a column that must be a list of integers.
    Raises:
        SourceError: see the module docstring.
    """

    def __init__(
        self,
        name: str,
        path: pathlib.Path,
        *,
        required_columns: Sequence[str] = (),
        token_column: str | None = None,
    ) -> None:
        self.name = name
        self.files = expand_path(path)
        if not self.files:
            raise SourceError(f"source {name!r}: no Parquet file found at {str(path)!r}")
        self._handles: list[pq.ParquetFile] = []
        row_groups: list[RowGroup] = []
        first_row = 0
        for file_index, file in enumerate(self.files):
            try:
                handle = pq.ParquetFile(file, page_checksum_verification=True)
            except (OSError, pa.ArrowException) as exc:
                raise SourceError(f"source {name!r}: cannot read Parquet file {str(file)!r}: {exc}") from exc
            self._check_schema(file, handle.schema_arrow, required_columns, token_column)
            self._handles.append(handle)
            meta = handle.metadata
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                row_groups.append(RowGroup(file=file_index, index=g, num_rows=n, first_row=first_row))
                first_row += n
        self.row_groups = tuple(rg for rg in row_groups if rg.num_rows > 0)
        self.num_rows = first_row
        if self.num_rows == 0:
            raise SourceError(f"source {name!r}: no rows in {len(self.files)} file(s) at {str(path)!r}")

    def _check_schema(
        self, file: pathlib.Path, schema: pa.Schema, required: Sequence[str], token_column: str | None
    ) -> None:
        for column in (*required, *([token_column] if token_column else [])):
            if schema.get_field_index(column) < 0:
                raise SourceError(
                    f"source {self.name!r}: file {str(file)!r} has no column {column!r} "
                    f"(columns: {', '.join(schema.names)})"
                )
        if token_column:
            kind = schema.field(token_column).type
            if not (
                (pa.types.is_list(kind) or pa.types.is_large_list(kind))
                and pa.types.is_integer(kind.value_type)
            ):
                raise SourceError(
                    f"source {self.name!r}: file {str(file)!r} column {token_column!r} must be a list of "
                    f"integers (token ids), got {kind}"
                )

    def read(self, row_group: RowGroup, columns: Sequence[str] | None) -> pa.Table:
        """The rows of one row group (only `columns`, if given).

        Raises:
            OSError, pyarrow.ArrowException: the row group cannot be read or decoded (corrupt
                data, a failed page checksum); the caller decides what to do.
        """
        return self._handles[row_group.file].read_row_group(
            row_group.index, columns=list(columns) if columns else None, use_threads=False
        )

    def describe(self, row_group: RowGroup) -> str:
        """'file F row group G' for logs."""
        return f"file {str(self.files[row_group.file])!r} row group {row_group.index}"
