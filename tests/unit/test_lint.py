"""The linter and the formatter in the test command: `ruff check` with the configuration of
pyproject.toml ([tool.ruff]: pyflakes and the pycodestyle rules the code meets; the generated
protobuf code left out) finds nothing in the source, the tests and the deployment scripts, and
`ruff format --check` would change none of them."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKED = ("client", "proto", "services", "tests", "deploy", "examples")


def ruff() -> str:
    """The ruff of this environment (the dev extra installs it), else the one on PATH."""
    here = pathlib.Path(sys.executable).with_name("ruff")
    found = str(here) if here.exists() else shutil.which("ruff")
    assert found, "ruff is missing: `make venv` installs it (the dev extra)"
    return found


def test_ruff_finds_nothing() -> None:
    out = subprocess.run(
        [ruff(), "check", "--no-cache", "--output-format", "concise", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"ruff check found:\n{out.stdout}{out.stderr}"


def test_the_code_is_as_the_formatter_writes_it() -> None:
    """`ruff format` (line length 140 for code; comments and docstrings are wrapped by hand)."""
    out = subprocess.run([ruff(), "format", "--check", "--no-cache", *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"`ruff format` would change these files (run it):\n{out.stdout}{out.stderr}"


def test_ruff_leaves_out_only_the_generated_code() -> None:
    """The checked files are every Python file of those folders but the generated *_pb2*.py."""
    out = subprocess.run(
        [ruff(), "check", "--no-cache", "--show-files", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    shown = {pathlib.Path(line).resolve() for line in out.stdout.splitlines() if line.endswith(".py")}
    expected = {p.resolve() for d in CHECKED for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name and ".venv" not in p.parts}
    assert shown == expected
    assert any(p.name.endswith("_pb2.py") for d in CHECKED for p in (ROOT / d).rglob("*.py"))
