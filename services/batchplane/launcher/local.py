"""Runs a whole job on one machine: the planner, the loaders and the constructors as local
processes on 127.0.0.1, each with its own log file.

Each process binds a free port and writes its address to a ready file; the launcher waits for
that file and a SERVING health check, then writes `endpoints.json` (what clients read through
BATCHPLANE_ENDPOINTS). Stopping sends SIGTERM, then SIGKILL to whatever is left; every process
also exits by itself if the launcher dies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc

from batchplane.core.config import JobSettings, load_job
from batchplane.planner.strategy import load_schedule, load_strategy
from batchplane.core.rpc import is_serving
from batchplane.v1 import planner_pb2, planner_pb2_grpc

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"


class LaunchError(RuntimeError):
    """A process could not start or died; the message carries the end of its log."""


@dataclasses.dataclass
class ServiceProcess:
    """One running service process."""

    name: str
    popen: subprocess.Popen
    log_path: pathlib.Path
    ready_path: pathlib.Path
    module: str = ""
    args: tuple[str, ...] = ()
    address: str = ""
    metrics_port: int = 0
    #: Asked to leave (scale in): its exit is expected, not a failure.
    leaving: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def rss_bytes(self) -> int | None:
        """Resident memory of the process, from /proc (None where unavailable)."""
        try:
            for line in pathlib.Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


class LocalCluster:
    """The processes of one job on this machine.

    Args:
        config_path: The job configuration file.
        run_dir: Folder for logs and endpoints; default: the job's `run_dir`.
        log_level: Log level of every process.
    Raises:
        ConfigError: from loading the configuration or its strategy (checked here, so a bad
            strategy or cost model fails before any process starts).
    """

    def __init__(self, config_path: str | pathlib.Path, *, run_dir: pathlib.Path | None = None, log_level: str = "INFO") -> None:
        self.config_path = pathlib.Path(config_path).resolve()
        self.job: JobSettings = load_job(self.config_path)
        _check_strategy(self.job)
        self.run_dir = (run_dir or self.job.resolve(self.job.run_dir)).resolve()
        self.log_level = log_level
        self.planner: ServiceProcess | None = None
        self.loaders: list[ServiceProcess] = []
        self.constructors: list[ServiceProcess] = []
        self._replicas_started = 0

    @property
    def processes(self) -> list[ServiceProcess]:
        return [p for p in (self.planner, *self.loaders, *self.constructors) if p is not None]

    @property
    def endpoints_path(self) -> pathlib.Path:
        return self.run_dir / ENDPOINTS_FILE

    def start(self, *, timeout_s: float = 60.0) -> LocalCluster:
        """Starts every process and waits until each is serving.

        Raises:
            LaunchError: a process exited or did not become ready in time; everything started is
                stopped again.
        """
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            self.planner = self._spawn("planner", "batchplane.planner", [])
            self._wait_ready([self.planner], timeout_s)
            planner_args = ["--planner", self.planner.address]
            self.loaders = [
                self._spawn(f"loader-{i}", "batchplane.loader", ["--index", str(i), *planner_args])
                for i in range(self.job.loader_count)
            ]
            if self.job.loaders.shadow:  # a hot standby of each loader
                self.loaders += [
                    self._spawn(f"loader-{i}-shadow", "batchplane.loader", ["--index", str(i), "--shadow-of", str(i), *planner_args])
                    for i in range(self.job.loader_count)
                ]
            self.constructors = [
                self._spawn(f"constructor-{i}", "batchplane.constructor", ["--index", str(i), *planner_args])
                for i in range(self.job.constructor_count)
            ]
            self._wait_ready(self.loaders + self.constructors, timeout_s)
        except BaseException:
            self.stop()
            raise
        self._write_endpoints()
        return self

    def _spawn(self, name: str, module: str, args: Sequence[str]) -> ServiceProcess:
        log_path = self.run_dir / "logs" / f"{name}.log"
        ready_path = self.run_dir / f".{name}.ready"
        ready_path.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", module,
            "--config", str(self.config_path),
            "--ready-file", str(ready_path),
            "--exit-with-parent",
            "--log-level", self.log_level,
            *args,
        ]
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.debug("started %s (pid %d): %s", name, popen.pid, " ".join(command))
        return ServiceProcess(name, popen, log_path, ready_path, module, tuple(args))

    def _wait_ready(self, processes: Sequence[ServiceProcess], timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        pending = list(processes)
        while pending:
            for p in list(pending):
                code = p.popen.poll()
                if code is not None:
                    raise LaunchError(f"{p.name} exited with status {code} while starting; end of {p.log_path}:\n{p.log_tail()}")
                if p.ready_path.exists():
                    info = json.loads(p.ready_path.read_text())
                    p.address, p.metrics_port = info["address"], info["metrics_port"]
                    if is_serving(p.address):
                        pending.remove(p)
            if pending and time.monotonic() > give_up:
                names = ", ".join(p.name for p in pending)
                raise LaunchError(f"{names} not serving after {timeout_s:.0f} s; see {self.run_dir / 'logs'}")
            time.sleep(0.05)

    def _write_endpoints(self) -> None:
        table = {
            "job": self.job.job,
            "planner": self.planner.address,
            "loaders": {p.name.removeprefix("loader-"): p.address for p in self.loaders},
            "constructors": {
                str(rank): p.address for i, p in enumerate(self.constructors) for rank in self.job.constructor_ranks(i)
            },
            "metrics": {p.name: f"http://{self.job.network.host}:{p.metrics_port}/metrics" for p in self.processes},
        }
        tmp = self.endpoints_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=2))
        os.replace(tmp, self.endpoints_path)

    def restart_planner(self, *, timeout_s: float = 60.0) -> ServiceProcess:
        """Starts the planner again on its address (killing it first if it still runs): loaders
        register again within `network.heartbeat_s`, constructors rejoin at the steps they need, and it resumes
        the plan sequence from its ledger exactly where it was.

        Raises:
            LaunchError: it exited or did not become ready in time.
        """
        return self.restart(self.planner, timeout_s=timeout_s)

    def restart_constructor(self, index: int, *, timeout_s: float = 60.0) -> ServiceProcess:
        """Starts constructor `index` again on its address (killing it first if it still runs):
        it registers anew, builds its ranks' steps again from the plans, and their clients'
        retries reach it.

        Raises:
            LaunchError: it exited or did not become ready in time.
        """
        return self.restart(self.constructors[index], timeout_s=timeout_s)

    def restart(self, old: ServiceProcess, *, timeout_s: float = 60.0) -> ServiceProcess:
        """Starts process `old` again with its arguments on its address, killing it first if it
        still runs. A loader replica restarts under its id and reads again the windows
        constructors may still fetch (the planner's replay of its ledger); see `restart_planner`
        and `restart_constructor` for the others.

        Raises:
            LaunchError: it exited or did not become ready in time.
        """
        if old.popen.poll() is None:
            old.popen.kill()
        old.popen.wait()
        process = self._spawn(old.name, old.module, [*_without_port(old.args), "--port", old.address.rsplit(":", 1)[1]])
        self._wait_ready([process], timeout_s)
        if old is self.planner:
            self.planner = process
        for group in (self.loaders, self.constructors):
            if old in group:
                group[group.index(old)] = process
        self._write_endpoints()
        return process

    def add_loader(self, index: int, *, timeout_s: float = 60.0) -> ServiceProcess:
        """Starts another replica of loader group `index` (scale out); the planner routes it
        windows from the next one it has not asked about.

        Raises:
            LaunchError: the replica exited or did not become ready in time.
        """
        if not 0 <= index < self.job.loader_count:
            raise ValueError(f"loader group {index} is outside [0, {self.job.loader_count})")
        self._replicas_started += 1  # ids are never reused: the planner remembers those that left
        n = self._replicas_started
        name = f"loader-{index}-{n}"
        process = self._spawn(name, "batchplane.loader", ["--index", str(index), "--replica", f"{index}-{n}", "--planner", self.planner.address])
        self.loaders.append(process)
        try:
            self._wait_ready([process], timeout_s)
        except BaseException:
            process.popen.kill()
            process.popen.wait()
            self.loaders.remove(process)
            raise
        self._write_endpoints()
        return process

    def remove_loader(self, process: ServiceProcess, *, timeout_s: float = 120.0) -> None:
        """Scales in: asks loader replica `process` to leave its group (SIGUSR1): it serves the
        windows it was routed until they are consumed, then exits.

        Raises:
            LaunchError: it did not exit within `timeout_s` (it is killed), or exited with an error.
        """
        process.leaving = True
        process.popen.send_signal(signal.SIGUSR1)
        try:
            code = process.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.popen.kill()
            process.popen.wait()
            raise LaunchError(f"{process.name} did not leave within {timeout_s:.0f} s; killed; see {process.log_path}") from None
        finally:
            self.loaders.remove(process)
            process.ready_path.unlink(missing_ok=True)
            self._write_endpoints()
        if code != 0:
            raise LaunchError(f"{process.name} exited with status {code} while leaving; end of {process.log_path}:\n{process.log_tail()}")

    def check_alive(self) -> None:
        """Raises LaunchError naming the first process that has exited."""
        for p in self.processes:
            code = p.popen.poll()
            if code is not None:
                raise LaunchError(f"{p.name} exited with status {code}; end of {p.log_path}:\n{p.log_tail()}")

    def status(self, *, timeout_s: float = 5.0) -> planner_pb2.GetStatusResponse:
        """The planner's GetStatus."""
        with grpc.insecure_channel(self.planner.address) as channel:
            return planner_pb2_grpc.PlannerStub(channel).GetStatus(planner_pb2.GetStatusRequest(), timeout=timeout_s)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM to every process (constructors, loaders, then the planner), SIGKILL after
        `timeout_s`."""
        order = [*self.constructors, *self.loaders, *([self.planner] if self.planner else [])]
        for p in order:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + timeout_s
        for p in order:
            try:
                p.popen.wait(timeout=max(give_up - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop on SIGTERM; killing it", p.name, p.pid)
                p.popen.kill()
                p.popen.wait()
            p.ready_path.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _without_port(args: Sequence[str]) -> list[str]:
    """Process arguments without a --port (a restart passes the one it had)."""
    out = list(args)
    if "--port" in out:
        i = out.index("--port")
        del out[i : i + 2]
    return out


def _check_strategy(job: JobSettings) -> None:
    """Loads the job's strategy, cost model and mixture schedule as the planner will, with the
    PYTHONPATH it inherits, so a bad one fails before any process starts.

    Raises:
        ConfigError: field "strategy", "balance.cost.kind" or "mixture.*".
    """
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra
    try:
        load_schedule(job, load_strategy(job))
    finally:
        for p in extra:
            sys.path.remove(p)
