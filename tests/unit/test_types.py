"""The type checker in the test command: mypy, configured in pyproject.toml ([tool.mypy]), finds
no error in the pure modules (every one of test_architecture.PURE) and the client's public API
(the batchplane.client package, which ships py.typed). Modules they import are read for their
types; their own errors are not reported here."""

from __future__ import annotations

import os
import subprocess
import sys

from test_architecture import ALL, PURE, ROOT

CLIENT = ROOT / "client" / "batchplane" / "client"


def checked_files() -> list[str]:
    pure = [ALL[m] for m in PURE]
    client = sorted(CLIENT.glob("*.py"))
    return [str(p.relative_to(ROOT)) for p in (*pure, *client)]


def test_the_client_ships_its_types() -> None:
    assert (CLIENT / "py.typed").exists()


def test_mypy_finds_no_error() -> None:
    # No cache: writing one costs more than it saves in a single cold run.
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", os.devnull, "--no-error-summary", *checked_files()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"mypy found:\n{out.stdout}{out.stderr}"
