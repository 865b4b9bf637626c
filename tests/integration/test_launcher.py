"""`batchplane up` starts every part as a local process, prints where each listens, keeps a log
per process and stops them all on SIGTERM or at the end of the job; started again on the same run
folder it keeps every address, and moves only a process whose port another program took."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
from concurrent import futures
from urllib.parse import urlsplit

import grpc
import pytest
from disturbed import kill_tree, running
from harness import collect, running_cluster, sample_ids, skewed_lengths, start_cluster, wait_until, write_job, write_source
from prometheus_client import CollectorRegistry

from batchplane.core.rpc import PortUnavailable, RpcSettings, ServerMetrics, create_grpc_server
from batchplane.core.tls import Security
from batchplane.launcher.local import LocalCluster, Ports

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
            # Constructors serve their trainers on a Unix socket (local credentials), the others on TCP with mutual TLS.
            address = rf"unix://\S+/{name}\.sock" if name.startswith("constructor") else r"127\.0\.0\.1:\d+"
            assert re.search(rf"{name}\s+{address}\s+metrics http://127\.0\.0\.1:\d+/metrics\s+log ", text), text
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
        kill_tree(up)  # and whatever of its services still runs


@pytest.mark.parametrize("batch_steps", [None, 1])
def test_up_stops_by_itself_when_every_rank_reached_the_end_of_data(tmp_path: pathlib.Path, batch_steps: int | None) -> None:
    """With one step per call (large batches) every call ends at the step it asked for: the
    last batch's header says where the data ends, the trainer asks for nothing past it, and
    that alone must count as reaching the end."""
    sources = [write_source(tmp_path / "data", "s", skewed_lengths(40, seed=1))]
    config = write_job(tmp_path / "job.yaml", sources, loaders={"count": 1}, constructors={"batch_steps": batch_steps})
    up, _ = _start_up(config)
    try:
        batches, _ = collect(tmp_path / "run" / "endpoints.json", range(2))
        assert sum(len(mb["sample_row"]) for rank in batches.values() for b in rank for mb in b["microbatches"]) == 40
        assert up.wait(timeout=30) == 0
        assert "every rank reached the end of the data" in up.stdout.read()
    finally:
        kill_tree(up)  # and whatever of its services still runs


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
    dataplane.write_text(
        json.dumps(
            {
                "metadata": {"name": "local"},
                "spec": {
                    "sourceGroups": [
                        {
                            "name": "text",
                            "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
                            "minReplicas": 1,
                            "maxReplicas": 2,
                        },
                    ]
                },
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "batchplane.cli", "up", "-c", str(config), "--autoscale", str(dataplane), *extra],
        capture_output=True,
        text=True,
        timeout=60,
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
        planner = next(
            p for p in _service_pids(tmp_path / "run") if b"batchplane.planner" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()
        )
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
        kill_tree(up)  # and whatever of its services still runs
    delivered = [s for rank in (0, 1) for batch in (*first[rank], *rest[rank]) for mb in sample_ids([batch])[0] for s in mb]
    assert sorted(delivered) == [(0, r) for r in range(60)], "every sample exactly once across the restart"


def _endpoints(run_dir: pathlib.Path) -> dict:
    return json.loads((run_dir / "endpoints.json").read_text())


#: The launcher's warning for a process it started on another port than the one it kept.
_MOVED = re.compile(
    r"^(?P<name>[\w-]+): its (?P<what>gRPC|metrics) port (?P<old>\d+) is held by another process; .*?port (?P<new>\d+) instead"
)


def _as_reported(before: dict, caplog: pytest.LogCaptureFixture) -> dict:
    """`before` (an endpoints table) with the moves the launcher warned of applied. A port a
    process had can be taken by another process before it starts again (in a parallel test run,
    the ephemeral port of some other test's server or connection): the launcher then starts it
    on a free port and warns, naming the process and both ports; nothing else may move."""
    expected = json.loads(json.dumps(before))
    for record in caplog.records:
        if not (m := _MOVED.match(record.getMessage())):
            continue
        name, old, new = m["name"], f":{m['old']}", f":{m['new']}"
        if m["what"] == "metrics":
            expected["metrics"][name] = expected["metrics"][name].replace(f"{old}/", f"{new}/")
        elif name == "planner":
            expected["planner"] = expected["planner"].replace(old, new)
        else:  # a loader (a constructor serves on the run's socket: it never moves)
            key = name.removeprefix("loader-")
            expected["loaders"][key] = expected["loaders"][key].replace(old, new)
    return expected


def _port(address_or_url: str) -> int:
    return urlsplit(address_or_url if "//" in address_or_url else f"//{address_or_url}").port


def _listener(port: int) -> socket.socket:
    """A program that is not batchplane, listening on 127.0.0.1:`port`. Like most servers it
    sets SO_REUSEADDR: the connections of the processes that had the port linger in TIME_WAIT
    (without it the bind fails on them, not on a listener)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_up_started_again_on_its_run_folder_keeps_every_address(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    sources = [write_source(tmp_path / "data", "s", [5] * 30)]
    config = write_job(tmp_path / "job.yaml", sources, epochs="infinite", loaders={"count": 1, "shadow": True})
    first = start_cluster(config)
    first.stop()
    assert not any(running(p.pid) for p in first.processes), "the first start's processes are gone: they hold no port"
    before = _endpoints(tmp_path / "run")
    assert set(before["metrics"]) == {"planner", "loader-0", "loader-0-shadow", "constructor-0", "constructor-1"}
    caplog.set_level(logging.WARNING, logger="batchplane.launcher.local")
    with running_cluster(config) as cluster:
        after = _endpoints(tmp_path / "run")
        assert after == _as_reported(before, caplog), "every gRPC address and metrics URL is the same (but one taken meanwhile)"
        assert cluster.status().job.job_id == "test", "and the processes serve there"


def test_only_a_process_whose_port_another_program_holds_moves(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    sources = [write_source(tmp_path / "data", "s", [5] * 30)]
    config = write_job(tmp_path / "job.yaml", sources, epochs="infinite", loaders={"count": 1})
    start_cluster(config).stop()
    before = _endpoints(tmp_path / "run")
    taken = {
        "planner": _port(before["planner"]),
        "loader-0": _port(before["loaders"]["0"]),
        "constructor-1 metrics": _port(before["metrics"]["constructor-1"]),
    }
    holders = [_listener(port) for port in taken.values()]
    caplog.set_level(logging.INFO, logger="batchplane.launcher.local")
    try:
        with running_cluster(config) as cluster:
            after = _endpoints(tmp_path / "run")
            assert cluster.status().job.job_id == "test", "the planner serves on its new address, and the loaders found it"
    finally:
        for sock in holders:
            sock.close()
    moved = {
        "planner": _port(after["planner"]),
        "loader-0": _port(after["loaders"]["0"]),
        "constructor-1 metrics": _port(after["metrics"]["constructor-1"]),
    }
    assert all(moved[k] != taken[k] for k in taken), (taken, moved)
    assert after == _as_reported(before, caplog), "what moved is what the launcher warned of, to the port it names"
    assert after["constructors"] == before["constructors"], "a constructor's socket is the run's: it never moves"
    assert {k: v for k, v in after["metrics"].items() if k != "constructor-1"} == {
        k: v for k, v in before["metrics"].items() if k != "constructor-1"
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name, what in (("planner", "gRPC"), ("loader-0", "gRPC"), ("constructor-1 metrics", "metrics")):
        process = name.removesuffix(" metrics")
        assert any(w.startswith(f"{process}: its {what} port {taken[name]} ") and f"port {moved[name]} instead" in w for w in warnings), (
            name,
            warnings,
        )


def test_up_started_again_after_its_launcher_was_killed_keeps_every_address(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "s", [5] * 30)]
    config = write_job(tmp_path / "job.yaml", sources, epochs="infinite", loaders={"count": 1})
    up, _ = _start_up(config)
    before = _endpoints(tmp_path / "run")
    up.kill()  # its services are still stopping, and hold their ports, while the next one starts
    up.wait()
    cluster = LocalCluster(config).start()
    try:
        assert _endpoints(tmp_path / "run") == before
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"job": "another", "planner": "127.0.0.1:5000", "loaders": {}, "constructors": {}, "metrics": {}}', "job 'another'"),
        ("{not json", "cannot read it"),
        ('{"job": "test", "planner": "127.0.0.1:99999", "loaders": {}, "constructors": {}, "metrics": {}}', "out of range"),
        ('{"job": "test", "planner": "127.0.0.1:5000"}', "cannot read it"),
        ('{"job": "test", "planner": "unix:///run/p.sock", "loaders": {}, "constructors": {}, "metrics": {}}', "cannot read it"),
        ('{"job": "test", "planner": "nohost", "loaders": {}, "constructors": {}, "metrics": {}}', "cannot read it"),
    ],
    ids=["another-job", "not-json", "bad-port", "not-an-endpoints-file", "a-socket", "no-port"],
)
def test_an_endpoints_file_of_another_job_or_unreadable_is_ignored(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    config = write_job(tmp_path / "job.yaml", [write_source(tmp_path / "data", "s", [5] * 10)])
    cluster = LocalCluster(config)
    cluster.run_dir.mkdir(parents=True)
    cluster.endpoints_path.write_text(content)
    caplog.set_level(logging.INFO, logger="batchplane.launcher.local")
    assert cluster._earlier_ports() == {}
    assert any(
        r.levelno == logging.INFO and "not keeping the addresses" in r.getMessage() and reason in r.getMessage() for r in caplog.records
    )


def test_the_ports_of_an_earlier_run_are_read_by_process_name(tmp_path: pathlib.Path) -> None:
    config = write_job(
        tmp_path / "job.yaml", [write_source(tmp_path / "data", "s", [5] * 10)], mesh={"dp": 4}, constructors={"ranks_per_constructor": 2}
    )
    cluster = LocalCluster(config)
    cluster.run_dir.mkdir(parents=True)
    cluster.endpoints_path.write_text(
        json.dumps(
            {
                "job": "test",
                "planner": "127.0.0.1:5000",
                "loaders": {"0": "127.0.0.1:5001", "0-1": "127.0.0.1:5002"},
                "constructors": {"0": "127.0.0.1:5003", "1": "127.0.0.1:5003", "2": "127.0.0.1:5004", "3": "127.0.0.1:5004"},
                "metrics": {"planner": "http://127.0.0.1:6000/metrics", "constructor-1": "http://127.0.0.1:6004/metrics"},
            }
        )
    )
    assert cluster._earlier_ports() == {
        "planner": Ports(5000, 6000),
        "loader-0": Ports(5001, 0),
        "loader-0-1": Ports(5002, 0),
        "constructor-0": Ports(5003, 0),
        "constructor-1": Ports(5004, 6004),
    }


def _server(port: int = 0) -> tuple[grpc.Server, int]:
    server, bound, _ = create_grpc_server(
        RpcSettings(security=Security(None), max_message_bytes=1 << 20),
        host="127.0.0.1",
        port=port,
        metrics=ServerMetrics("planner", CollectorRegistry()),
    )
    return server, bound


def test_a_second_server_on_a_live_port_fails_rather_than_sharing_it() -> None:
    first, port = _server()
    first.start()
    # A plain grpc server sets SO_REUSEPORT on Linux: two of them would split one port's connections.
    foreign = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    foreign_port = foreign.add_insecure_port("127.0.0.1:0")
    foreign.start()
    try:
        with pytest.raises(PortUnavailable):
            _server(port)
        with pytest.raises(PortUnavailable):
            _server(foreign_port)
        with pytest.raises(RuntimeError):  # nor can a foreign grpc server join ours
            grpc.server(futures.ThreadPoolExecutor(max_workers=1)).add_insecure_port(f"127.0.0.1:{port}")
    finally:
        first.stop(0)
        foreign.stop(0)


def test_a_port_left_in_time_wait_binds_again() -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server side closes first: its port stays in TIME_WAIT
    listener.close()
    client.close()
    server, bound = _server(port)
    server.stop(0)
    assert bound == port
