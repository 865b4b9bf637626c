"""The flags every benchmark shares: `--dir`, a working folder made where it is missing, and
refused with a usage error naming it where it cannot be made."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from batchplane.bench import BENCHMARKS, load


def parser_of(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    load(name).add_arguments(parser)
    return parser


WITH_DIR = [name for name in BENCHMARKS if any("--dir" in action.option_strings for action in parser_of(name)._actions)]


@pytest.mark.parametrize("name", WITH_DIR)
def test_dir_is_made_where_it_is_missing(name: str, tmp_path: pathlib.Path) -> None:
    parser = parser_of(name)
    folder = tmp_path / "not" / "yet"
    assert parser.parse_args(["--dir", str(folder)]).dir == folder
    assert folder.is_dir()


@pytest.mark.parametrize("name", WITH_DIR)
def test_dir_that_cannot_be_made_is_a_usage_error_naming_it(name: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = parser_of(name)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--dir", str(tmp_path / "a-file" / "below")])
    assert exit_.value.code == 2
    assert "a-file/below" in capsys.readouterr().err


def test_the_benchmarks_with_a_working_folder() -> None:
    assert sorted(WITH_DIR) == ["chaos", "delivery", "journal", "ledger", "transport", "vlm"]
