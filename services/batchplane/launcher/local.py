"""Runs a whole job on one machine: the planner, the loaders and the constructors as local
processes on 127.0.0.1, each with its own log file.

Each process binds its ports and writes its address to a ready file; the launcher waits for
that file and a SERVING health check, then writes `endpoints.json` (what clients read through
BATCHPLANE_ENDPOINTS). Stopping sends SIGTERM, then SIGKILL to whatever is left; every process
also exits by itself if the launcher dies.

Addresses are stable, as a Kubernetes Service's are: started again on a run folder whose
`endpoints.json` is from an earlier run of the same job, every process asks for the gRPC and
metrics ports it had there (a restarted process too), so trainers that keep running reach the
data plane where they cached it. A process whose port another program holds exits with
EXIT_PORT_UNAVAILABLE (or EXIT_METRICS_PORT_UNAVAILABLE) and is started again on a free port,
with a warning; `endpoints.json` then names the new address.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Sequence

from batchplane.core.config import JobSettings, load_job
from batchplane.core.process import EXIT_METRICS_PORT_UNAVAILABLE, EXIT_PORT_UNAVAILABLE
from batchplane.planner.strategy import load_schedule, load_strategy
from batchplane.core.identity import INDEXED_ROLES, Identity
from batchplane.core.localca import LocalCA
from batchplane.core.rpc import RpcSettings, create_channel, is_serving
from batchplane.launcher import zygote
from batchplane.core.tls import TLS_OFF_WARNING, CertificateFolder, Security
from batchplane.v1 import planner_pb2, planner_pb2_grpc

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"

#: How long `start` waits at most for processes that a launcher of the same run folder left
#: behind (it died without stopping them) to exit by themselves and free their ports.
LEFTOVER_EXIT_S = 10.0


class LaunchError(RuntimeError):
    """A process could not start or died; the message carries the end of its log."""


@dataclasses.dataclass(frozen=True)
class Ports:
    """The TCP ports of one process; 0: any free one."""

    grpc: int = 0
    metrics: int = 0


@dataclasses.dataclass
class ServiceProcess:
    """One running service process."""

    name: str
    #: The process: a child of this process's zygote, or a plain subprocess (see `zygote`).
    popen: subprocess.Popen | zygote.ZygoteProcess
    log_path: pathlib.Path
    ready_path: pathlib.Path
    module: str = ""
    #: Its arguments, without the ports.
    args: tuple[str, ...] = ()
    #: The ports it was started with (--port, --metrics-port).
    ports: Ports = Ports()
    #: The ports it had before (an earlier run, or before a restart): the ones it keeps unless
    #: another program holds them.
    kept: Ports = Ports()
    address: str = ""
    metrics_port: int = 0
    #: Asked to leave (scale in): its exit is expected, not a failure.
    leaving: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        """The gRPC port it serves on (0 before it is ready, or on a Unix socket)."""
        return 0 if not self.address or self.address.startswith("unix:") else _port_of(self.address)

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
        run_dir: Folder for logs, endpoints and the ledger (unless the job's `ledger.location`
            puts it elsewhere); default: the job's `run_dir`.
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
        #: With journal delivery: the producer (a constructor for the whole mesh that commits
        #: every step to the journal); `constructors` are then the pods' journal readers.
        self.producers: list[ServiceProcess] = []
        self._replicas_started = 0
        self.ca: LocalCA | None = None
        #: How this launcher reaches the parts (health checks, the planner's status).
        self.rpc = RpcSettings.of(self.job.network, Security(None))

    @property
    def processes(self) -> list[ServiceProcess]:
        return [p for p in (self.planner, *self.loaders, *self.producers, *self.constructors) if p is not None]

    @property
    def endpoints_path(self) -> pathlib.Path:
        return self.run_dir / ENDPOINTS_FILE

    def start(self, *, timeout_s: float = 60.0) -> LocalCluster:
        """Starts every process and waits until each is serving. Where the run folder's endpoints
        file is from an earlier run of this job, each process asks for the ports it had there,
        and takes free ones only when another program holds them (logged as a warning).

        Raises:
            LaunchError: a process exited or did not become ready in time; everything started is
                stopped again.
        """
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._secure()
        earlier = self._earlier_ports()
        if earlier:
            self._wait_for_leftovers(min(LEFTOVER_EXIT_S, timeout_s))

        def spawn(name: str, module: str, args: Sequence[str]) -> ServiceProcess:
            return self._spawn(name, module, args, ports=earlier.get(name, Ports()))

        try:
            # The run folder holds the planner's ledger too (unless the job's ledger.location).
            self.planner = spawn("planner", "batchplane.planner", ["--run-dir", str(self.run_dir)])
            self._wait_ready([self.planner], timeout_s)
            planner_args = ["--planner", self.planner.address]
            self.loaders = [
                spawn(f"loader-{i}", "batchplane.loader", ["--index", str(i), *planner_args]) for i in range(self.job.loader_count)
            ]
            if self.job.loaders.shadow:  # a hot standby of each loader
                self.loaders += [
                    spawn(f"loader-{i}-shadow", "batchplane.loader", ["--index", str(i), "--shadow-of", str(i), *planner_args])
                    for i in range(self.job.loader_count)
                ]
            if self.job.batch.delivery == "journal":
                # Producers build every step for the whole mesh (producer i the steps s with
                # s % producers == i) and commit them to the journal; each pod's constructor
                # reads its ranks' slices from there.
                run_dir = ["--run-dir", str(self.run_dir)]
                self.producers = [
                    spawn(f"producer-{i}", "batchplane.constructor", ["--index", str(i), *run_dir, *planner_args, "--produce"])
                    for i in range(self.job.journal.producers)
                ]
                self.constructors = [
                    spawn(
                        f"constructor-{i}", "batchplane.constructor", ["--index", str(i), *self._trainer_socket(i), *run_dir, "--consume"]
                    )
                    for i in range(self.job.pod_count)
                ]
            else:
                self.constructors = [
                    spawn(f"constructor-{i}", "batchplane.constructor", ["--index", str(i), *self._trainer_socket(i), *planner_args])
                    for i in range(self.job.pod_count)
                ]
            self._wait_ready(self.loaders + self.producers + self.constructors, timeout_s)
        except BaseException:
            self.stop()
            raise
        self._write_endpoints()
        return self

    @property
    def tls_dir(self) -> pathlib.Path:
        """The run's certificates: one folder per process (each its own leaf and the CA's
        certificate; the CA's key is in this launcher's memory only)."""
        return self.run_dir / "tls"

    def _secure(self) -> None:
        """With network.tls on (the default): this run's CA, in memory (`LocalCA`: a file would be
        the services' to read), and the launcher's own certificate (role operator: it checks
        health and status). An earlier version's CA folder in the run folder is removed."""
        if not self.job.network.tls:
            log.warning(TLS_OFF_WARNING)
            return
        shutil.rmtree(self.tls_dir / "ca", ignore_errors=True)
        self.ca = LocalCA(None, name=self.job.job)
        own = self.ca.issue(Identity("operator"), self.tls_dir / "launcher")
        self.rpc = RpcSettings.of(self.job.network, Security(CertificateFolder(own)))

    def _trainer_socket(self, index: int) -> list[str]:
        """A constructor serves its trainers on a Unix socket, as the chart's sidecar does in a
        pod (with local credentials when TLS is on, plaintext when off), and so offers
        shared-memory delivery beside it: in a folder of this run under the temporary directory
        (a socket path must stay under 108 bytes, which a run folder's may not)."""
        return ["--listen", f"unix://{self._socket_folder}/constructor-{index}.sock"]

    @property
    def _socket_folder(self) -> pathlib.Path:
        digest = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:12]
        return pathlib.Path(tempfile.gettempdir()) / f"batchplane-{os.getuid()}" / digest

    def _earlier_ports(self) -> dict[str, Ports]:
        """The ports each process had in the earlier run of this job in the run folder, by
        process name, read from its endpoints file; empty where there is none, or it is another
        job's or cannot be read (logged)."""
        path = self.endpoints_path
        try:
            table = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.info("not keeping the addresses in %s: cannot read it (%s); every process takes a free port", path, exc)
            return {}
        job = table.get("job") if isinstance(table, dict) else None
        if job != self.job.job:
            log.info(
                "not keeping the addresses in %s: they are job %r's, not %r's; every process takes a free port", path, job, self.job.job
            )
            return {}
        try:
            ports = _ports_in(table, self.job)
        except (AttributeError, LookupError, TypeError, ValueError) as exc:
            log.info(
                "not keeping the addresses in %s: cannot read it (%s: %s); every process takes a free port", path, type(exc).__name__, exc
            )
            return {}
        log.info("keeping the addresses of the earlier run of job %r in %s", self.job.job, path)
        return ports

    def _wait_for_leftovers(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) for processes that an earlier launcher of this run folder
        left running to exit: it died without stopping them, and they stop by themselves once
        they see it gone (--exit-with-parent), freeing the ports this run keeps."""
        leftovers = {ready: pid for ready in sorted(self.run_dir.glob(".*.ready")) if (pid := _service_pid(ready))}
        if not leftovers:
            return
        log.info("waiting up to %.0f s for %d process(es) an earlier launcher left running to exit", timeout_s, len(leftovers))
        give_up = time.monotonic() + timeout_s
        while leftovers and time.monotonic() < give_up:
            time.sleep(0.1)
            leftovers = {ready: pid for ready, pid in leftovers.items() if _service_pid(ready, pid)}
        if leftovers:
            log.warning(
                "processes %s of an earlier launcher of %s still run; the ports they hold are replaced by free ones",
                sorted(leftovers.values()),
                self.run_dir,
            )

    def _spawn(self, name: str, module: str, args: Sequence[str], *, ports: Ports = Ports(), kept: Ports | None = None) -> ServiceProcess:
        """Starts one process.

        Args:
            ports: The ports it asks for; 0: any free one.
            kept: The ports it had before, which it keeps unless taken; default: `ports`.
        """
        log_path = self.run_dir / "logs" / f"{name}.log"
        ready_path = self.run_dir / f".{name}.ready"
        ready_path.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            module,
            "--config",
            str(self.config_path),
            "--ready-file",
            str(ready_path),
            "--exit-with-parent",
            "--log-level",
            self.log_level,
            *args,
        ]
        if ports.grpc:
            command += ["--port", str(ports.grpc)]
        if ports.metrics:
            command += ["--metrics-port", str(ports.metrics)]
        if self.ca is not None:
            command += ["--tls-dir", str(self.ca.issue(_identity_of(module, args), self.tls_dir / name))]
        with open(log_path, "ab") as log_file:
            popen = zygote.spawn(module, command[3:], log_fd=log_file.fileno()) or subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        log.debug("started %s (pid %d): %s", name, popen.pid, " ".join(command))
        return ServiceProcess(name, popen, log_path, ready_path, module, tuple(args), ports, ports if kept is None else kept)

    def _wait_ready(self, processes: Sequence[ServiceProcess], timeout_s: float, *, fixed_address: bool = False) -> list[ServiceProcess]:
        """Waits until every process serves. One that exits because another program holds a
        port it asked for is started again on a free one in its place (in this cluster's lists
        too); its gRPC port stays fixed with `fixed_address` (others were given its address).

        Returns:
            The processes, each one started again in place of the one it replaces.
        Raises:
            LaunchError: a process exited otherwise, or did not become ready in time.
        """
        give_up = time.monotonic() + timeout_s
        processes = list(processes)
        pending = list(processes)
        while pending:
            for p in list(pending):
                code = p.popen.poll()
                if code is not None:
                    again = self._again_on_free_port(p, code, fixed_address=fixed_address)
                    if again is None:
                        raise LaunchError(f"{p.name} exited with status {code} while starting; end of {p.log_path}:\n{p.log_tail()}")
                    processes[processes.index(p)] = again
                    pending[pending.index(p)] = again
                    continue
                if p.ready_path.exists():
                    info = json.loads(p.ready_path.read_text())
                    p.address, p.metrics_port = info["address"], info["metrics_port"]
                    if is_serving(self.rpc, p.address, peer=_role_of(p.module)):
                        pending.remove(p)
                        _warn_if_moved(p)
            if pending and time.monotonic() > give_up:
                names = ", ".join(p.name for p in pending)
                raise LaunchError(f"{names} not serving after {timeout_s:.0f} s; see {self.run_dir / 'logs'}")
            time.sleep(0.05)
        return processes

    def _again_on_free_port(self, p: ServiceProcess, code: int, *, fixed_address: bool) -> ServiceProcess | None:
        """Starts `p` again with a free port in place of the one it could not bind (exit status
        `code`); None where its exit has another cause or that port must stay."""
        if code == EXIT_PORT_UNAVAILABLE and p.ports.grpc and not fixed_address:
            ports, what = dataclasses.replace(p.ports, grpc=0), f"gRPC port {p.ports.grpc}"
        elif code == EXIT_METRICS_PORT_UNAVAILABLE and p.ports.metrics:
            ports, what = dataclasses.replace(p.ports, metrics=0), f"metrics port {p.ports.metrics}"
        else:
            return None
        log.info("%s cannot bind its %s (another process holds it); starting it again on a free one", p.name, what)
        again = self._spawn(p.name, p.module, p.args, ports=ports, kept=p.kept)
        self._replace(p, again)
        return again

    def _replace(self, old: ServiceProcess, new: ServiceProcess) -> None:
        """Puts `new` in the place of `old` in this cluster's processes (if it is there)."""
        if old is self.planner:
            self.planner = new
        for group in (self.loaders, self.producers, self.constructors):
            if old in group:
                group[group.index(old)] = new

    def _write_endpoints(self) -> None:
        table = {
            "job": self.job.job,
            "planner": self.planner.address,
            "loaders": {p.name.removeprefix("loader-"): p.address for p in self.loaders},
            "constructors": {str(rank): p.address for i, p in enumerate(self.constructors) for rank in self.job.pod_ranks(i)},
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

    def restart_producer(self, index: int = 0, *, timeout_s: float = 60.0) -> ServiceProcess:
        """Starts journal producer `index` again (killing it first if it still runs): it fences
        its earlier self, resumes after the last step the journal committed for it, and builds
        on from there (nothing committed twice, nothing skipped).

        Raises:
            LaunchError: it exited or did not become ready in time.
        """
        return self.restart(self.producers[index], timeout_s=timeout_s)

    def restart(self, old: ServiceProcess, *, timeout_s: float = 60.0) -> ServiceProcess:
        """Starts process `old` again with its arguments on its address and metrics port,
        killing it first if it still runs. A loader replica restarts under its id and reads again
        the windows constructors may still fetch (the planner's replay of its ledger); see
        `restart_planner` and `restart_constructor` for the others. A loader or constructor whose
        port another program took meanwhile moves to a free one (a warning); the planner does not.

        Raises:
            LaunchError: it exited or did not become ready in time.
        """
        if old.popen.poll() is None:
            old.popen.kill()
        old.popen.wait()
        process = self._spawn(old.name, old.module, old.args, ports=Ports(old.port, old.metrics_port))
        # Loaders and constructors were given the planner's address: it must not move.
        (process,) = self._wait_ready([process], timeout_s, fixed_address=old is self.planner)
        self._replace(old, process)
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
        process = self._spawn(
            name, "batchplane.loader", ["--index", str(index), "--replica", f"{index}-{n}", "--planner", self.planner.address]
        )
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
        with create_channel(self.rpc, self.planner.address, peer="planner") as channel:
            return planner_pb2_grpc.PlannerStub(channel).GetStatus(planner_pb2.GetStatusRequest(), timeout=timeout_s)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM to every process (constructors, loaders, then the planner), SIGKILL after
        `timeout_s`."""
        order = [*self.constructors, *self.producers, *self.loaders, *([self.planner] if self.planner else [])]
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
        if self.job.network.tls:  # the constructors' socket folder, once they are gone
            for socket_path in self._socket_folder.glob("constructor-*.sock"):
                socket_path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self._socket_folder.rmdir()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ports_in(table: dict, job: JobSettings) -> dict[str, Ports]:
    """The ports of each process named in an endpoints file of `job`, by process name (a
    constructor serving on a Unix socket has none: its socket's path is the run's own).

    Raises:
        AttributeError, LookupError, TypeError, ValueError: the table is not an endpoints file.
    """
    addresses = {"planner": table["planner"], **{f"loader-{k}": a for k, a in table["loaders"].items()}}
    ports = {name: _port_of(address) for name, address in addresses.items()}
    for i in range(job.pod_count):  # the file names constructors by the ranks they serve
        rank = str(job.pod_ranks(i)[0])
        if rank in table["constructors"]:
            address = table["constructors"][rank]
            ports[f"constructor-{i}"] = 0 if address.startswith("unix:") else _port_of(address)
    metrics = {name: urllib.parse.urlsplit(url).port or 0 for name, url in table["metrics"].items()}
    return {name: Ports(ports.get(name, 0), metrics.get(name, 0)) for name in ports.keys() | metrics.keys()}


def _port_of(address: str | None) -> int:
    """The port of a host:port address (0 for None).

    Raises:
        ValueError: no port in 1..65535.
    """
    if address is None:
        return 0
    port = int(address.rsplit(":", 1)[1])
    if not 0 < port < 65536:
        raise ValueError(f"port {port} of {address!r} is out of range")
    return port


def _role_of(module: str) -> str:
    """The role of a service module, e.g. "batchplane.loader" -> "loader"."""
    return module.rsplit(".", 1)[-1]


def _identity_of(module: str, args: Sequence[str]) -> Identity:
    """The identity a process started with `args` acts as: its role, and for a loader or
    constructor its --index (a loader's replica: --replica, else the index)."""
    role = _role_of(module)
    if role not in INDEXED_ROLES:
        return Identity(role)
    flags = {flag: value for flag, value in zip(args, args[1:]) if flag in ("--index", "--replica")}
    index = int(flags["--index"])
    return Identity(role, index, (flags.get("--replica") or str(index)) if role == "loader" else None)


def _service_pid(ready_path: pathlib.Path, pid: int | None = None) -> int | None:
    """The process that was started with `ready_path` as its ready file (pid: the one it
    names, or `pid`) where it still runs; None otherwise, or where /proc cannot tell."""
    try:
        pid = pid or int(json.loads(ready_path.read_text())["pid"])
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if str(ready_path).encode() in argv else None  # not a pid reused since


def _warn_if_moved(p: ServiceProcess) -> None:
    """Warns where a process that just became ready does not serve on a port it kept."""
    if p.kept.grpc and p.port != p.kept.grpc:
        log.warning(
            "%s: its gRPC port %d is held by another process; it serves on port %d instead (%s names it)",
            p.name,
            p.kept.grpc,
            p.port,
            ENDPOINTS_FILE,
        )
    if p.kept.metrics and p.metrics_port != p.kept.metrics:
        log.warning(
            "%s: its metrics port %d is held by another process; metrics on port %d instead", p.name, p.kept.metrics, p.metrics_port
        )


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
