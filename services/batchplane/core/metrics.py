"""The metrics every batchplane process exposes besides its own: the registry each process
starts from, and the HTTP endpoint serving it (with the health probe).

A process's registry carries prometheus_client's default collectors (process_* for memory, CPU
and open files; python_gc_* for the garbage collector; python_info for the interpreter) and
`batchplane_build_info`, a gauge of value 1 whose labels say what runs: the package version, the
Python version, the git revision the build was made from and the part (planner, loader,
constructor, operator). The services then register their own metrics on it.

Reads no environment itself: `build_info(environ)` takes the one main() passes.
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.metadata
import json
import platform
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, GCCollector, Gauge, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from batchplane.core.identity import token_verifier

#: The distribution whose version `batchplane_build_info` reports.
DISTRIBUTION = "batchplane"
#: The environment variable an image build sets to the git revision it was built from
#: (e.g. `docker build --build-arg BATCHPLANE_GIT_REVISION=$(git rev-parse HEAD)` with a matching
#: ARG/ENV in the Dockerfile).
REVISION_ENV = "BATCHPLANE_GIT_REVISION"
#: What a label says when the value is not known.
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """What runs, as `batchplane_build_info` labels it."""

    #: The installed package's version, e.g. "0.1.0".
    version: str = UNKNOWN
    #: The interpreter's version, e.g. "3.11.7".
    python: str = UNKNOWN
    #: The git revision the build was made from, or "unknown".
    revision: str = UNKNOWN


def build_info(environ: Mapping[str, str]) -> BuildInfo:
    """The build of this process: the package version from its installed metadata, the
    interpreter's version, and the git revision from `REVISION_ENV` (set when the image was
    built) or from the install record of a `pip install git+...` (its vcs_info commit).

    Args:
        environ: The process environment.
    Returns:
        The build info; fields that cannot be known are "unknown".
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
        direct_url = importlib.metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        version, direct_url = UNKNOWN, None
    revision = environ.get(REVISION_ENV, "").strip() or _vcs_commit(direct_url) or UNKNOWN
    return BuildInfo(version=version, python=platform.python_version(), revision=revision)


def process_registry(part: str, info: BuildInfo) -> CollectorRegistry:
    """A fresh registry with the default collectors and `batchplane_build_info`.

    Args:
        part: The process's part: "planner", "loader", "constructor" or "operator".
        info: What runs (`build_info`).
    Returns:
        The registry the process registers its own metrics on and serves on /metrics.
    """
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    Gauge(
        "batchplane_build_info",
        "What runs, always 1: by version (the batchplane package's), python (the interpreter's), revision "
        "(the git revision of the build, or unknown) and part (planner, loader, constructor or operator).",
        ["version", "python", "revision", "part"],
        registry=registry,
    ).labels(info.version, info.python, info.revision, part).set(1)
    return registry


def _vcs_commit(direct_url: str | None) -> str | None:
    """The commit of a PEP 610 direct_url.json record of an install from version control."""
    if not direct_url:
        return None
    try:
        record = json.loads(direct_url)
    except ValueError:
        return None
    commit = (record.get("vcs_info") or {}).get("commit_id") if isinstance(record, dict) else None
    return commit if isinstance(commit, str) and commit else None


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def start_metrics_server(
    port: int,
    host: str,
    registry: CollectorRegistry,
    serving: Callable[[], bool],
    *,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """The process's HTTP endpoint, on a thread of its own: `/metrics` (Prometheus) and
    `/healthz`: 200 while the service's gRPC health is SERVING, 503 otherwise (kubelet probes
    it: its gRPC probes speak plaintext, which a mutual-TLS port refuses). Any other path is 404:
    the endpoint answers nothing else.

    Args:
        token: Required of `/metrics` as `Authorization: Bearer <token>` (Prometheus's
            `authorization`), else 401; only its digest is kept. `/healthz` stays open (it says
            SERVING or not, nothing more).
        tls: Serve HTTPS with this context (`metrics_tls`; Prometheus's `scheme: https` and
            `tls_config`).
    Raises:
        OSError: the port cannot be bound.
    """
    metrics_app = make_wsgi_app(registry)
    verifier = None if token is None else token_verifier(token)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO")
        if path == "/healthz":
            ok = serving()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"SERVING\n" if ok else b"NOT_SERVING\n"]
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: this endpoint serves /metrics and /healthz only\n"]
        if verifier is not None and not _bearer_matches(environ.get("HTTP_AUTHORIZATION", ""), verifier):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="metrics"')])
            return [b"/metrics needs the metrics bearer token\n"]
        return metrics_app(environ, start_response)

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    if tls is not None:  # the handshake on each request's own thread: a client that stalls in it holds only its own
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread


def _bearer_matches(header: str, verifier: bytes) -> bool:
    """Whether an Authorization header carries the bearer token whose digest is `verifier`."""
    scheme, _, credentials = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token_verifier(credentials.strip()), verifier)
