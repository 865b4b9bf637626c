"""What identifies a source's data, file by file (`loader.file_facts`), as the loader finds it
opening real Parquet files: names relative to the location (a folder, a glob's fixed prefix, or
the file itself), sizes and modification times from the listing, rows from the footers."""

from __future__ import annotations

import os
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchplane.loader.file_facts import UNKNOWN, FileFacts, file_facts
from batchplane.loader.file_facts import FileStat
from batchplane.loader.source import ParquetSource


def _write(path: pathlib.Path, rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]] * rows, pa.list_(pa.int32()))}), path, row_group_size=10)


@pytest.fixture
def folder(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "web"
    _write(root / "a.parquet", 25)
    _write(root / "sub" / "b.parquet", 7)
    os.utime(root / "a.parquet", ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    return root


def test_a_folder_source_reports_relative_names_sizes_times_and_rows(folder: pathlib.Path) -> None:
    facts = ParquetSource("web", folder).file_facts
    a, b = folder / "a.parquet", folder / "sub" / "b.parquet"
    assert facts == (
        FileFacts("a.parquet", a.stat().st_size, 1_700_000_000_123_456_789, 25),
        FileFacts("sub/b.parquet", b.stat().st_size, b.stat().st_mtime_ns, 7),
    )


def test_a_glob_names_files_below_its_fixed_prefix_and_a_file_by_its_name(folder: pathlib.Path) -> None:
    assert [f.name for f in ParquetSource("web", folder / "**" / "*.parquet").file_facts] == ["a.parquet", "sub/b.parquet"]
    assert [(f.name, f.rows) for f in ParquetSource("web", folder / "sub" / "b.parquet").file_facts] == [("b.parquet", 7)]


def test_a_moved_copy_that_keeps_times_has_the_same_facts(folder: pathlib.Path, tmp_path: pathlib.Path) -> None:
    moved = shutil.copytree(folder, tmp_path / "elsewhere" / "web")  # copy2: times kept
    assert ParquetSource("web", moved).file_facts == ParquetSource("web", folder).file_facts


def test_what_the_file_system_does_not_give_is_unknown() -> None:
    assert file_facts([FileStat("x.parquet", None, None)], [3]) == (FileFacts("x.parquet", UNKNOWN, UNKNOWN, 3),)
    with pytest.raises(ValueError, match="2 files listed, 1 row counts"):
        file_facts([FileStat("x", 1, 1), FileStat("y", 1, 1)], [3])
