"""`batchplane demo` (what `make run` runs): a dataset, the data plane, two trainer processes and
a summary."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_trains_and_summarizes(tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "batchplane.cli", "demo", "--dir", str(tmp_path), "--steps", "12", "--log-every", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "=== batchplane demo summary ===" in out
    assert "steps 12 on 2 ranks" in out
    for source, share in (("captions", "0.300"), ("docs", "0.200"), ("code", "0.200"), ("chat", "0.200"), ("images", "0.100")):
        line = next(line for line in out.splitlines() if line.strip().startswith(source))
        assert line.split()[1] == share  # configured
        assert abs(float(line.split()[2]) - float(share)) < 0.02  # planned
    for method in ("karmarkar_karp", "greedy", "round_robin"):
        assert method in out
    assert "resident memory: planner" in out
    assert (tmp_path / "data" / ".complete").exists()
