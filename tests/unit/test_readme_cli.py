"""The README's command-line reference ("Command line": every command with its flags) and its
"Benchmarks" table, checked against the parser (batchplane.cli.build_parser) and the benchmark
registry (batchplane.bench.BENCHMARKS) both ways."""

from __future__ import annotations

import argparse
import pathlib
import re

from batchplane.bench import BENCHMARKS
from batchplane.cli import build_parser

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# Benchmarks registered while their README row is being written (the journal's, issue 18).
UNDOCUMENTED_BENCHMARKS = {"journal"}


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(title: str) -> list[list[str]]:
    rows = [line for line in section(title).splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # without the header and its rule


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def parser_commands() -> dict[str, set[str]]:
    """ "up", "ledger show", ... -> every option string of the command, -h/--help left out."""
    out = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        inner = subcommands(parser)
        if prefix and not inner:
            out[prefix] = {o for a in parser._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings}
        for name, sub in inner.items():
            walk(f"{prefix} {name}".strip(), sub)

    walk("", build_parser())
    return out


def readme_commands() -> dict[str, set[str]]:
    out = {}
    for command, flags, _ in table_rows("Command line"):
        words = re.fullmatch(r"`batchplane ([^`]+)`", command)
        assert words, command
        name = " ".join(w for w in words.group(1).split() if w.islower())  # NAME, SOURCE:INDEX are arguments
        out[name] = set(re.findall(r"`(-[-\w]+)`", flags)) if not flags.startswith("the benchmark's own") else set()
    return out


def test_every_command_of_the_parser_is_documented_and_no_other() -> None:
    assert sorted(readme_commands()) == sorted(parser_commands())


def test_every_documented_flag_exists_and_every_flag_is_documented() -> None:
    parser, readme = parser_commands(), readme_commands()
    bad = {name: (readme[name] ^ parser[name]) for name in parser if name in readme and readme[name] != parser[name]}
    assert bad == {}, "flags in only one of README and parser"


def test_the_benchmarks_table_is_the_registry() -> None:
    documented = [row[0].strip("`") for row in table_rows("Benchmarks")]
    assert len(documented) == len(set(documented))
    assert set(documented) <= set(BENCHMARKS)
    assert set(BENCHMARKS) - set(documented) <= UNDOCUMENTED_BENCHMARKS
    assert set(build_parser().parse_args(["bench", name]).benchmark for name in BENCHMARKS) == set(BENCHMARKS)
