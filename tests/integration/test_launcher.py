"""`batchplane up` starts every part as a local process, prints where each listens, keeps a log
per process and stops them all on SIGTERM or at the end of the job."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
from harness import collect, sample_ids, skewed_lengths, wait_until, write_job, write_source

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_up(config: pathlib.Path) -> tuple[subprocess.Popen, list[str]]:
    up = subprocess.Popen(
        [sys.executable, "-m", "batchplane.cli", "up", "-c", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    for line in up.stdout:
        lines.append(line.rstrip())
        if "Ctrl-C" in line:
            break
    return up, lines


def _service_pids(run_dir: pathlib.Path) -> list[int]:
    """Processes started with this job's configuration file (the launcher passes --config)."""
    config = str(run_dir.parent / "job.yaml").encode()
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--config" in argv and config in argv and b"up" not in argv:
            pids.append(int(proc.name))
    return pids


def test_up_prints_endpoints_and_stops_everything_on_sigterm(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(50, seed=0))]
    config = write_job(tmp_path / "job.yaml", sources, epochs="infinite", loaders={"count": 1})
    up, lines = _start_up(config)
    try:
        text = "\n".join(lines)
        for name in ("planner", "loader-0", "constructor-0", "constructor-1"):
            assert re.search(rf"{name}\s+127\.0\.0\.1:\d+\s+metrics http://127\.0\.0\.1:\d+/metrics\s+log ", text), text
            assert (tmp_path / "run" / "logs" / f"{name}.log").exists()
        endpoints = json.loads((tmp_path / "run" / "endpoints.json").read_text())
        assert set(endpoints["constructors"]) == {"0", "1"}
        pids = _service_pids(tmp_path / "run")
        assert len(pids) == 4
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        wait_until(lambda: not any(_alive(p) for p in pids), timeout_s=10, what="every service to exit")
        assert "stopped" in (tmp_path / "run" / "logs" / "planner.log").read_text()
    finally:
        up.kill()


def test_up_stops_by_itself_when_every_rank_reached_the_end_of_data(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(40, seed=1))]
    config = write_job(tmp_path / "job.yaml", sources, loaders={"count": 1})
    up, _ = _start_up(config)
    try:
        batches, _ = collect(tmp_path / "run" / "endpoints.json", range(2))
        assert sum(len(mb["sample_row"]) for rank in batches.values() for b in rank for mb in b["microbatches"]) == 40
        assert up.wait(timeout=30) == 0
        assert "every rank reached the end of the data" in up.stdout.read()
    finally:
        up.kill()


def test_services_exit_when_their_launcher_is_killed(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(30, seed=2))]
    config = write_job(tmp_path / "job.yaml", sources, epochs="infinite", loaders={"count": 1})
    up, _ = _start_up(config)
    pids = _service_pids(tmp_path / "run")
    assert len(pids) == 4
    up.kill()
    up.wait()
    wait_until(lambda: not any(_alive(p) for p in pids), timeout_s=15, what="orphaned services to exit")


@pytest.mark.parametrize(
    ("groups", "extra", "message"),
    [
        ([["a"], ["b"]], ["--prometheus", "http://127.0.0.1:9"], "loaders.groups: must be the DataPlane's sourceGroups [['a', 'b']]"),
        ([["a", "b"]], [], "--prometheus: is required with --autoscale"),
    ],
    ids=["groups-differ", "no-prometheus"],
)
def test_up_refuses_an_autoscale_dataplane_that_does_not_fit_the_job(tmp_path: pathlib.Path, groups, extra, message) -> None:
    sources = [write_source(tmp_path / "data", n, [5] * 20) for n in "ab"]
    config = write_job(tmp_path / "job.yaml", sources, loaders={"groups": groups})
    dataplane = tmp_path / "dataplane.yaml"
    dataplane.write_text(json.dumps({"metadata": {"name": "local"}, "spec": {"sourceGroups": [
        {"name": "text", "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], "minReplicas": 1, "maxReplicas": 2},
    ]}}))
    out = subprocess.run(
        [sys.executable, "-m", "batchplane.cli", "up", "-c", str(config), "--autoscale", str(dataplane), *extra],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert _service_pids(tmp_path / "run") == [], "nothing started"


def test_up_restarts_a_planner_that_died_and_the_trainers_finish(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(60, seed=3))]
    config = write_job(tmp_path / "job.yaml", sources, loaders={"count": 1})
    up, _ = _start_up(config)
    endpoints_path = tmp_path / "run" / "endpoints.json"
    try:
        address = json.loads(endpoints_path.read_text())["planner"]
        planner = next(p for p in _service_pids(tmp_path / "run") if b"batchplane.planner" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes())
        first, states = collect(endpoints_path, [0, 1], stop_after=2)
        os.kill(planner, signal.SIGKILL)
        line = ""
        while "restarting it" not in line:
            line = up.stdout.readline()
            assert line, "batchplane up ended without restarting the planner"
        assert "status -9" in line
        rest, _ = collect(endpoints_path, [0, 1], states=states)
        assert json.loads(endpoints_path.read_text())["planner"] == address, "the planner keeps its address"
        assert up.wait(timeout=60) == 0, "up stops by itself at the end of the data"
    finally:
        up.kill()
    delivered = [s for rank in (0, 1) for batch in (*first[rank], *rest[rank]) for mb in sample_ids([batch])[0] for s in mb]
    assert sorted(delivered) == [(0, r) for r in range(60)], "every sample exactly once across the restart"
