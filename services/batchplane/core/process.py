"""What every service process does around its server: command-line flags, logging, the
metrics HTTP endpoint, the ready file that tells a launcher where it listens, graceful stop on
SIGTERM/SIGINT, and exiting when its launcher dies.

A port asked for (--port, --metrics-port) that cannot be bound ends the process with an exit
status of its own (EXIT_PORT_UNAVAILABLE, EXIT_METRICS_PORT_UNAVAILABLE), never on another port:
a launcher that can move the process (`batchplane up`) starts it again on a free one.

Only `run_service` reads flags and the environment; it passes settings down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server

from batchplane.core.config import JobSettings, load_job
from batchplane.core.errors import BatchplaneError

log = logging.getLogger(__name__)

#: Exit status of a process that could not start because of bad configuration or data.
EXIT_BAD_INPUT = 2
#: Exit status of a process that could not bind the gRPC port it was given (--port).
EXIT_PORT_UNAVAILABLE = 3
#: Exit status of a process that could not bind the metrics port it was given (--metrics-port).
EXIT_METRICS_PORT_UNAVAILABLE = 4


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """Per-process settings from the command line (the job's settings come from its file)."""

    #: Path of the job configuration file.
    config: pathlib.Path
    #: This process's index among its kind (loaders, constructors); 0 for the planner.
    index: int = 0
    #: A loader's replica id within its group (unique, e.g. its pod name); None: the index.
    replica: str | None = None
    #: A loader that runs as the shadow (hot standby) of this replica id of its group.
    shadow_of: str | None = None
    #: The planner's address, for loaders and constructors.
    planner: str | None = None
    #: gRPC port; 0 picks a free one.
    port: int = 0
    #: A Unix socket to serve gRPC on instead of host:port, e.g. "unix:///run/batchplane/constructor.sock".
    listen: str | None = None
    #: The address other parts reach this one at (e.g. the pod's IP and port in a cluster);
    #: None: the address it serves on.
    advertise: str | None = None
    #: Metrics HTTP port; 0 picks a free one.
    metrics_port: int = 0
    #: Where to write {"address", "metrics_port", "pid"} once serving.
    ready_file: pathlib.Path | None = None
    #: Exit when the parent process (the launcher) goes away.
    exit_with_parent: bool = False
    #: Log level name.
    log_level: str = "INFO"


class Running(Protocol):
    """A started service (a loader also has `leave() -> bool`, run on SIGUSR1; it stops once left)."""

    address: str

    def stop(self, grace_s: float) -> None: ...


def parse_process_args(part: str, argv: Sequence[str] | None) -> ProcessSettings:
    parser = argparse.ArgumentParser(prog=f"python -m batchplane.{part}", description=f"batchplane {part} service")
    parser.add_argument("--config", "-c", type=pathlib.Path, required=True, help="job configuration (YAML)")
    parser.add_argument("--index", type=int, default=0, help=f"this {part}'s index in the job (default 0)")
    parser.add_argument("--replica", help="a loader's replica id in its group, unique (default: its index), e.g. $(POD_NAME)")
    parser.add_argument("--shadow-of", help="run a loader as the shadow (hot standby) of this replica id of its group, e.g. 0")
    parser.add_argument("--planner", help="planner address host:port (loaders and constructors)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default: any free port)")
    parser.add_argument("--listen", help="a Unix socket to serve gRPC on instead of host:port, e.g. unix:///run/x.sock")
    parser.add_argument("--advertise", help="address other parts reach this one at (default: the served address), e.g. $(POD_IP):50052")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port (default: any free port)")
    parser.add_argument("--ready-file", type=pathlib.Path, help="write the bound addresses here once serving")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process exits")
    parser.add_argument("--log-level", default=os.environ.get("BATCHPLANE_LOG_LEVEL", "INFO"))
    ns = parser.parse_args(argv)
    if ns.listen is not None and not ns.listen.startswith("unix:"):
        parser.error(f"--listen takes a Unix socket address (unix:///path), got {ns.listen!r}; for TCP use --port and the job's network.host")
    return ProcessSettings(**vars(ns))


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
        stream=sys.stderr,
    )


def write_ready_file(path: pathlib.Path, info: dict) -> None:
    """Writes `info` as JSON atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def run_service(
    part: str,
    argv: Sequence[str] | None,
    start: Callable[[JobSettings, ProcessSettings, CollectorRegistry], Running],
) -> int:
    """Runs one service process until SIGTERM/SIGINT (or its parent's exit).

    Args:
        part: "planner", "loader" or "constructor".
        argv: Command-line arguments (None: sys.argv).
        start: Builds and starts the service; raises BatchplaneError for bad configuration or
            data, which ends the process with exit status 2 and the error in the log, and
            PortUnavailable when it cannot bind its --port (exit status 3).
    Returns:
        The process exit status: 0 after a stop, EXIT_BAD_INPUT, EXIT_PORT_UNAVAILABLE or
        EXIT_METRICS_PORT_UNAVAILABLE (--metrics-port cannot be bound).
    """
    from batchplane.core.rpc import PortUnavailable  # here: the operator logs through this module without grpc

    settings = parse_process_args(part, argv)
    name = part if part == "planner" else f"{part}-{settings.replica or settings.index}" + ("-shadow" if settings.shadow_of else "")
    configure_logging(settings.log_level, name)
    registry = CollectorRegistry()
    try:
        job = load_job(settings.config)
        # The metrics endpoint opens only once the service serves (a pod's startup probe reads
        # it), so its port is checked first: a taken one fails before registering anywhere.
        if settings.metrics_port and not _can_bind(job.network.host, settings.metrics_port):
            log.error("cannot start %s: metrics port %d on %s is taken", name, settings.metrics_port, job.network.host)
            return EXIT_METRICS_PORT_UNAVAILABLE
        running = start(job, settings, registry)
    except PortUnavailable as exc:
        log.error("cannot start %s: %s", name, exc)
        return EXIT_PORT_UNAVAILABLE
    except BatchplaneError as exc:
        log.error("cannot start %s: %s", name, exc)
        return EXIT_BAD_INPUT
    try:
        metrics_server, _ = start_http_server(settings.metrics_port, addr=job.network.host, registry=registry)
    except OSError as exc:
        if not settings.metrics_port:
            raise
        log.error("cannot start %s: metrics port %d on %s: %s", name, settings.metrics_port, job.network.host, exc)
        running.stop(grace_s=0)  # taken since the check above
        return EXIT_METRICS_PORT_UNAVAILABLE
    metrics_port = metrics_server.server_port
    stop_event = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    leave = getattr(running, "leave", None)
    if leave is not None:  # SIGUSR1: leave gracefully (a scaled-down loader replica), then stop

        def leave_then_stop() -> None:
            if leave():  # False: it cannot leave (e.g. the group's last replica) and serves on
                stop_event.set()

        def on_leave(signum: int, _frame: object) -> None:
            log.info("received SIGUSR1, leaving")
            threading.Thread(target=leave_then_stop, name="leave", daemon=True).start()

        signal.signal(signal.SIGUSR1, on_leave)
    if settings.exit_with_parent:
        _watch_parent(stop_event)
    if settings.ready_file:
        write_ready_file(
            settings.ready_file, {"address": running.address, "metrics_port": metrics_port, "pid": os.getpid()}
        )
    log.info("%s serving on %s, metrics on http://%s:%d/metrics", name, running.address, job.network.host, metrics_port)
    # Wait in slices: the kernel may deliver SIGTERM to one of grpc's threads, and CPython runs
    # signal handlers only when the main thread wakes; an untimed wait can then miss it forever.
    while not stop_event.wait(0.2):
        pass
    running.stop(grace_s=5.0)
    metrics_server.shutdown()
    log.info("%s stopped", name)
    return 0


def _can_bind(host: str, port: int) -> bool:
    """True when TCP `port` on `host` can be bound now, as the metrics server binds it
    (SO_REUSEADDR: a port left in TIME_WAIT counts as free, one a live process listens on not)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError:
        return False
    return True


def _watch_parent(stop_event: threading.Event) -> None:
    parent = os.getppid()

    def watch() -> None:
        while not stop_event.wait(1.0):
            if os.getppid() != parent:
                log.warning("launcher (pid %d) is gone, stopping", parent)
                stop_event.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
