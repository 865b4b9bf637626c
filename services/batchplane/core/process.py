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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from batchplane.core import logformat
from batchplane.core.config import JobSettings, load_job
from batchplane.core.errors import BatchplaneError, ConfigError
from batchplane.core.metrics import build_info, process_registry, start_metrics_server

if TYPE_CHECKING:
    from batchplane.core.rpc import RpcSettings

log = logging.getLogger(__name__)

#: Exit status of a process that could not start because of bad configuration or data.
EXIT_BAD_INPUT = 2
#: Exit status of a process that could not bind the gRPC port it was given (--port).
EXIT_PORT_UNAVAILABLE = 3
#: Exit status of a process that could not bind the metrics port it was given (--metrics-port).
EXIT_METRICS_PORT_UNAVAILABLE = 4
#: Exit status of a planner fenced by a newer planner of its ledger (batchplane.planner.fencing):
#: a launcher must not start it again.
EXIT_FENCED = 5


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
    #: A Unix socket to serve gRPC on instead of host:port, e.g.
    #: "unix:///run/batchplane/socket/constructor.sock" (a constructor makes its folder, mode 2770).
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
    #: Log format: "text" (lines for people) or "json" (one object per line); see core.logformat.
    log_format: str = "text"
    #: The job's run folder (the planner's ledger lies in <run_dir>/ledger unless the job's
    #: ledger.location says otherwise); None: the job's run_dir.
    run_dir: pathlib.Path | None = None
    #: The process's certificate folder (ca.crt, tls.crt, tls.key) when the job's network.tls is on.
    tls_dir: pathlib.Path | None = None
    #: A file holding the bearer token this process sends with its calls.
    token_file: pathlib.Path | None = None
    #: A folder holding each role's token (one file per role) that this process's server accepts.
    auth_tokens: pathlib.Path | None = None
    #: A file holding the bearer token the metrics endpoint requires of /metrics; None: open.
    metrics_token_file: pathlib.Path | None = None
    #: A certificate folder (tls.crt, tls.key) the metrics endpoint serves HTTPS with; None: HTTP.
    metrics_tls_dir: pathlib.Path | None = None
    #: batchplane's certificate issuer (the operator), host:port: the process gets its own
    #: certificate there and writes it into tls_dir (core.enroll); None: tls_dir is given.
    issuer: str | None = None
    #: The pod's projected ServiceAccount token, proving to the issuer who the pod is.
    issuer_token_file: pathlib.Path | None = None
    #: The CA certificate the issuer's certificate, and every part's, chains to.
    issuer_ca: pathlib.Path | None = None


class Running(Protocol):
    """A started service (a loader also has `leave() -> bool`, run on SIGUSR1; it stops once left)."""

    address: str

    def serving(self) -> bool: ...

    def stop(self, grace_s: float) -> None: ...


def parse_process_args(part: str, argv: Sequence[str] | None) -> ProcessSettings:
    parser = argparse.ArgumentParser(prog=f"python -m batchplane.{part}", description=f"batchplane {part} service")
    parser.add_argument("--config", "-c", type=pathlib.Path, required=True, help="job configuration (YAML)")
    parser.add_argument("--index", type=int, default=0, help=f"this {part}'s index in the job (default 0)")
    parser.add_argument("--replica", help="a loader's replica id in its group, unique (default: its index), e.g. $(POD_NAME)")
    parser.add_argument("--shadow-of", help="run a loader as the shadow (hot standby) of this replica id of its group, e.g. 0")
    parser.add_argument("--planner", help="planner address host:port (loaders and constructors)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default: any free port)")
    parser.add_argument(
        "--listen",
        help="a Unix socket to serve gRPC on instead of host:port, e.g. unix:///run/batchplane/socket/constructor.sock (its folder is made with mode 2770)",
    )
    parser.add_argument("--advertise", help="address other parts reach this one at (default: the served address), e.g. $(POD_IP):50052")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port (default: any free port)")
    parser.add_argument("--ready-file", type=pathlib.Path, help="write the bound addresses here once serving")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process exits")
    parser.add_argument("--log-level", default=os.environ.get("BATCHPLANE_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", help=f"log format: text or json (one object per line) (default: ${logformat.ENV}, else text)")
    for flag, env, what in (
        ("--tls-dir", "BATCHPLANE_TLS_DIR", "certificate folder: ca.crt, tls.crt, tls.key (a mounted Secret; never subPath)"),
        ("--token-file", "BATCHPLANE_TOKEN_FILE", "bearer token this process sends"),
        ("--auth-tokens", "BATCHPLANE_AUTH_TOKENS", "folder of the tokens accepted: <role>.sha256 (a verifier) or <role>, one per role"),
        (
            "--metrics-token-file",
            "BATCHPLANE_METRICS_TOKEN_FILE",
            "bearer token /metrics requires (Prometheus's authorization); none: open",
        ),
        (
            "--metrics-tls-dir",
            "BATCHPLANE_METRICS_TLS_DIR",
            "certificate folder (tls.crt, tls.key) /metrics is served over HTTPS with; none: HTTP",
        ),
        ("--issuer-token-file", "BATCHPLANE_ISSUER_TOKEN_FILE", "the pod's projected ServiceAccount token, for --issuer"),
        ("--issuer-ca", "BATCHPLANE_ISSUER_CA", "the CA certificate the issuer's and every part's certificate chain to, for --issuer"),
    ):
        parser.add_argument(flag, type=pathlib.Path, default=_env_path(env), help=f"{what} (default: ${env})")
    parser.add_argument(
        "--run-dir",
        type=pathlib.Path,
        help="the job's run folder (default: its run_dir); the planner's ledger is in <run-dir>/ledger unless ledger.location is set",
    )
    parser.add_argument(
        "--issuer",
        default=os.environ.get("BATCHPLANE_ISSUER"),
        help="batchplane's certificate issuer host:port (the operator): this process's certificate is got there and written into "
        "--tls-dir, which must be a writable folder of this pod only (default: $BATCHPLANE_ISSUER)",
    )
    ns = parser.parse_args(argv)
    if ns.issuer is not None:
        missing = [
            flag
            for flag, value in (("--tls-dir", ns.tls_dir), ("--issuer-token-file", ns.issuer_token_file), ("--issuer-ca", ns.issuer_ca))
            if value is None
        ]
        if missing:
            parser.error(f"--issuer needs {', '.join(missing)} too")
    if ns.listen is not None and not ns.listen.startswith("unix:"):
        parser.error(
            f"--listen takes a Unix socket address (unix:///path), got {ns.listen!r}; for TCP use --port and the job's network.host"
        )
    ns.log_format = log_format_setting(ns.log_format, os.environ, parser)
    return ProcessSettings(**vars(ns))


def metrics_endpoint(settings: ProcessSettings) -> dict[str, Any]:
    """What the metrics endpoint requires (`start_metrics_server`'s token and tls) from
    --metrics-token-file and --metrics-tls-dir.

    Raises:
        ConfigError: a token file or certificate folder that cannot be read.
    """
    from batchplane.core.tls import metrics_tls, read_token  # here: the operator logs through this module without grpc

    token = read_token(settings.metrics_token_file, "--metrics-token-file") if settings.metrics_token_file is not None else None
    return {"token": token, "tls": metrics_tls(settings.metrics_tls_dir) if settings.metrics_tls_dir is not None else None}


def _env_path(name: str) -> pathlib.Path | None:
    value = os.environ.get(name)
    return pathlib.Path(value) if value else None


def log_format_setting(flag: str | None, environ: Mapping[str, str], parser: argparse.ArgumentParser) -> str:
    """The log format from --log-format, else $BATCHPLANE_LOG_FORMAT, else text; a bad value
    ends the process (exit status 2) with an error naming the flag or the variable."""
    try:
        if flag is not None:
            return logformat.parse_log_format(flag, field="--log-format")
        return logformat.parse_log_format(environ.get(logformat.ENV))
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # parser.error exits


def configure_logging(level: str, name: str, *, log_format: str = "text", **context: object) -> logformat.LogContext:
    """Sends log records to standard error as text lines or JSON objects (core.logformat).

    Args:
        level: Log level name, e.g. "INFO".
        name: The process's name in text lines, e.g. "loader-0".
        log_format: "text" or "json". JSON also routes warnings, and uncaught exceptions of
            every thread, through the log, so each line of standard error is one object.
        context: Fields every record carries (part, index, ...).
    Returns:
        The context; `update` it as more becomes known (the job's name once loaded).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logformat.formatter(log_format, name))
    fields = logformat.LogContext(**context)
    handler.addFilter(fields)
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if log_format == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = lambda args: _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback, args.thread)
    return fields


def _log_uncaught(kind: type[BaseException], value: BaseException | None, tb: object, thread: threading.Thread | None = None) -> None:
    if issubclass(kind, SystemExit):
        return
    where = f" in thread {thread.name}" if thread is not None else ""
    logging.getLogger("batchplane").critical("uncaught %s%s", kind.__name__, where, exc_info=(kind, value, tb))


def write_ready_file(path: pathlib.Path, info: dict) -> None:
    """Writes `info` as JSON atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def run_service(
    part: str,
    argv: Sequence[str] | None,
    start: Callable[[JobSettings, ProcessSettings, CollectorRegistry, RpcSettings], Running],
) -> int:
    """Runs one service process until SIGTERM/SIGINT (or its parent's exit).

    Args:
        part: "planner", "loader" or "constructor".
        argv: Command-line arguments (None: sys.argv).
        start: Builds and starts the service with the process's gRPC settings (core.rpc: the
            job's message limit and the transport security of core.tls: mutual TLS from
            --tls-dir unless the job's network.tls is off, tokens from --token-file and
            --auth-tokens); raises BatchplaneError for bad configuration or
            data, which ends the process with exit status 2 and the error in the log, and
            PortUnavailable when it cannot bind its --port (exit status 3).
    Returns:
        The process exit status: 0 after a stop, EXIT_BAD_INPUT, EXIT_PORT_UNAVAILABLE or
        EXIT_METRICS_PORT_UNAVAILABLE (--metrics-port cannot be bound).
    """
    from batchplane.core.rpc import PortUnavailable, RpcSettings  # here: the operator logs through this module without grpc
    from batchplane.core.enroll import Enrollment, IssuerSource
    from batchplane.core.tls import process_security

    settings = parse_process_args(part, argv)
    name = part if part == "planner" else f"{part}-{settings.replica or settings.index}" + ("-shadow" if settings.shadow_of else "")
    context = configure_logging(
        settings.log_level,
        name,
        log_format=settings.log_format,
        part=part,
        index=None if part == "planner" else settings.index,
        replica=settings.replica,
    )
    registry = process_registry(part, build_info(os.environ))
    try:
        job = load_job(settings.config)
        context.update(**_job_context(job, part, settings.index))
        # The metrics endpoint opens only once the service serves (a pod's startup probe reads
        # it), so its port is checked first: a taken one fails before registering anywhere.
        if settings.metrics_port and not _can_bind(job.network.host, settings.metrics_port):
            log.error("cannot start %s: metrics port %d on %s is taken", name, settings.metrics_port, job.network.host)
            return EXIT_METRICS_PORT_UNAVAILABLE
        reloads = Counter(
            f"batchplane_{part}_certificate_reloads_total",
            "Times this process read its rotated certificate folder again (servers and channels each count).",
            registry=registry,
        )
        if settings.issuer is not None and job.network.tls:  # the certificate in --tls-dir comes from the issuer
            assert settings.tls_dir is not None and settings.issuer_token_file is not None and settings.issuer_ca is not None
            Enrollment(IssuerSource(settings.issuer, settings.issuer_token_file, settings.issuer_ca, settings.tls_dir)).start()
        security = process_security(
            tls=job.network.tls,
            tls_dir=settings.tls_dir,
            token_file=settings.token_file,
            auth_tokens=settings.auth_tokens,
            on_reload=reloads.inc,
        )
        endpoint = metrics_endpoint(settings)  # read now: a bad file ends the process before it registers anywhere
        running = start(job, settings, registry, RpcSettings.of(job.network, security))
    except PortUnavailable as exc:
        log.error("cannot start %s: %s", name, exc)
        return EXIT_PORT_UNAVAILABLE
    except BatchplaneError as exc:
        log.error("cannot start %s: %s", name, exc)
        return EXIT_BAD_INPUT
    try:
        metrics_server, _ = start_metrics_server(settings.metrics_port, job.network.host, registry, running.serving, **endpoint)
    except OSError as exc:
        if not settings.metrics_port:
            raise
        log.error("cannot start %s: metrics port %d on %s: %s", name, settings.metrics_port, job.network.host, exc)
        running.stop(grace_s=0)  # taken since the check above
        return EXIT_METRICS_PORT_UNAVAILABLE
    metrics_port = metrics_server.server_port
    stop_event = stop_on_signals()
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
        write_ready_file(settings.ready_file, {"address": running.address, "metrics_port": metrics_port, "pid": os.getpid()})
    log.info(
        "%s serving on %s (%s), metrics on http://%s:%d/metrics",
        name,
        running.address,
        "mutual TLS" if security.enabled else "PLAINTEXT",
        job.network.host,
        metrics_port,
    )
    # Wait in slices: the kernel may deliver SIGTERM to one of grpc's threads, and CPython runs
    # signal handlers only when the main thread wakes; an untimed wait can then miss it forever.
    while not stop_event.wait(0.2):
        pass
    running.stop(grace_s=5.0)
    metrics_server.shutdown()
    log.info("%s stopped", name)
    return 0


def _job_context(job: JobSettings, part: str, index: int) -> dict[str, object]:
    """The log context the job adds: its name, a constructor's ranks, a loader's sources."""
    fields: dict[str, object] = {"job": job.job}
    if part == "constructor" and 0 <= index < job.constructor_count:
        fields["rank"] = list(job.constructor_ranks(index))
    elif part == "loader" and 0 <= index < job.loader_count:
        fields["source"] = [job.source_names[k] for k in job.loader_sources(index)]
    return fields


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


def stop_on_signals() -> threading.Event:
    """An event set on SIGTERM or SIGINT (logged; `set_from_signal`)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        set_from_signal(stop)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def set_from_signal(event: threading.Event) -> None:
    """Sets `event` from a signal handler, through a new thread. A handler runs in the main thread
    between two bytecodes, possibly while that thread holds the event's own lock inside
    `event.wait()` (Condition.wait takes it back before returning); `event.set()` there waits
    for that lock forever, and the process never stops (an operator was found so, hung after
    SIGTERM). The thread waits for the lock until the main thread lets it go."""
    threading.Thread(target=event.set, name="signal", daemon=True).start()


def _watch_parent(stop_event: threading.Event) -> None:
    parent = os.getppid()

    def watch() -> None:
        while not stop_event.wait(1.0):
            if os.getppid() != parent:
                log.warning("launcher (pid %d) is gone, stopping", parent)
                stop_event.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
