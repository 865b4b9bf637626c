"""gRPC plumbing shared by the services: the one table from domain errors to status codes, a
server interceptor that authorizes every call (core.authz), applies the table and counts every
request, server and channel factories built from one settings object (`RpcSettings`: the job's
message limits and the process's transport security, core.tls), health checking, and retries for
service-to-service calls. Every gRPC server and channel of the services is made here (or in
core.tls, which this module drives); tests/unit/test_rpc_factories.py holds them to it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from batchplane.core import errors
from batchplane.core.authz import authorize
from batchplane.core.config import NetworkSettings
from batchplane.core.identity import server_name
from batchplane.core.tls import Security
from batchplane.local_transport import local_channel
from batchplane.v1 import common_pb2
from batchplane.wire import WireFormatError, chunk_messages, iter_chunks

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Domain error -> gRPC status. Retryable -> UNAVAILABLE, bad request -> INVALID_ARGUMENT,
#: wrong state -> FAILED_PRECONDITION, too big -> RESOURCE_EXHAUSTED.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SourceError: grpc.StatusCode.FAILED_PRECONDITION,
    WireFormatError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

#: The longest a request may ask a service to wait (`wait_ms`); longer asks are cut to it.
MAX_WAIT_MS = 60_000


def wait_seconds(wait_ms: int, context: grpc.ServicerContext | None, *, default_ms: int = 0) -> float:
    """How long a request may keep a server thread waiting for data: its `wait_ms` (0:
    `default_ms`), cut to MAX_WAIT_MS and to what is left of the caller's deadline: a caller
    that gave up must not hold one of the server's threads (a few dozen such calls would stall
    every other caller of the part). `context` None: a call in process, without a deadline.

    Raises:
        InvalidArgument: `wait_ms` < 0.
    """
    if wait_ms < 0:
        raise errors.InvalidArgument(f"wait_ms must be >= 0, got {wait_ms}")
    seconds = min(wait_ms or default_ms, MAX_WAIT_MS) / 1000
    remaining = context.time_remaining() if context is not None else None
    return max(min(seconds, remaining), 0.0) if remaining is not None else seconds


#: Status codes a caller retries with backoff: a peer down or restarting, one that did not answer
#: in time, and a call cut by a peer stopping gracefully (its stop cancels the calls in flight).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of an exception: its class's entry in STATUS_OF, INTERNAL otherwise."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


class ServerMetrics:
    """Request counters and latencies of one service, named batchplane_<part>_...

    Args:
        part: "planner", "loader" or "constructor".
        registry: The service's metric registry.
    """

    def __init__(self, part: str, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            f"batchplane_{part}_requests_total",
            "RPCs served, by method (the RPC name) and code (the gRPC status name, OK on success).",
            ["method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            f"batchplane_{part}_request_duration_seconds",
            "Time to serve an RPC, by method (the RPC name); streams count until their last message.",
            ["method"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )


class _ErrorsAndMetrics(grpc.ServerInterceptor):
    """Authorizes every call, maps exceptions raised by servicer methods to status codes and
    records every call."""

    def __init__(self, metrics: ServerMetrics, security: Security) -> None:
        self._metrics = metrics
        self._security = security
        # Method -> (its handler, the handler wrapped): grpc asks on every call; wrapping once
        # per method keeps the wrapper's metric children resolved once.
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        full = handler_call_details.method
        known = self._wrapped.get(full)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(handler, full)
        self._wrapped[full] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, full: str):
        method = full.rsplit("/", 1)[-1]
        parse = _tolerant(handler.request_deserializer)
        if handler.unary_unary:
            return handler._replace(request_deserializer=parse, unary_unary=self._unary(handler.unary_unary, full, method))
        if handler.unary_stream:
            return handler._replace(request_deserializer=parse, unary_stream=self._stream(handler.unary_stream, full, method))
        return None  # no client-streaming methods: nothing unauthorized gets through

    def _authorize(self, context: grpc.ServicerContext, full: str, request: Any) -> None:
        if isinstance(request, _Unparsable):
            raise errors.InvalidArgument(f"the request is not a valid {full.rsplit('/', 1)[-1]} message: {request.reason}")
        identity = self._security.identify(context)
        if identity is not None:
            authorize(identity, full, request)

    def _fail(self, context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
        code = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method)
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            log.warning("%s from %s refused: %s: %s", method, context.peer(), code.name, exc)
        else:
            log.debug("%s: %s: %s", method, code.name, exc)
        self._metrics.requests.labels(method, code.name).inc()
        context.abort(code, str(exc) or type(exc).__name__)

    def _unary(self, behavior: Callable, full: str, method: str) -> Callable:
        latency, ok = self._metrics.latency.labels(method), self._metrics.requests.labels(method, "OK")

        def wrapper(request, context):
            start = time.perf_counter()
            try:
                self._authorize(context, full, request)
                response = behavior(request, context)
            except Exception as exc:  # noqa: BLE001 - every failure gets a status code
                if _is_abort(exc):
                    raise
                self._fail(context, method, exc)
            finally:
                latency.observe(time.perf_counter() - start)
            ok.inc()
            return response

        return wrapper

    def _stream(self, behavior: Callable, full: str, method: str) -> Callable:
        latency, ok = self._metrics.latency.labels(method), self._metrics.requests.labels(method, "OK")

        def wrapper(request, context):
            start = time.perf_counter()
            try:
                self._authorize(context, full, request)
                yield from behavior(request, context)
            except Exception as exc:  # noqa: BLE001
                if _is_abort(exc):
                    raise
                self._fail(context, method, exc)
            finally:
                latency.observe(time.perf_counter() - start)
            ok.inc()

        return wrapper


class _Unparsable:
    """A request whose bytes do not parse: refused INVALID_ARGUMENT by the interceptor (grpc
    itself would answer INTERNAL, as if the server were at fault)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def tolerant(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or a RuntimeWarning turned error
            return _Unparsable(type(exc).__name__)

    return tolerant


def _is_abort(exc: BaseException) -> bool:
    # context.abort raises a bare Exception subclass private to grpc; let it through.
    return type(exc).__module__.startswith("grpc")


def message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel/server options bounding messages in both directions."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class PortUnavailable(OSError):
    """A server cannot bind the TCP port it was asked for (typically: another process listens
    on it). Raised only for a port other than 0, so that a launcher may try again on a free one.

    Args:
        address: The host:port that could not be bound.
    """

    def __init__(self, address: str) -> None:
        super().__init__(f"cannot bind gRPC server to {address}: the port is taken or not allowed")
        self.address = address


#: Server options on top of the message limits. grpc sets SO_REUSEADDR on its listening sockets
#: (a port an exited server left in TIME_WAIT binds again at once) and, on Linux, SO_REUSEPORT
#: unless told not to: two servers, even of two jobs, could then bind one port and split its
#: connections between them. A port held by a live process must fail to bind instead.
SERVER_OPTIONS: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]


@dataclasses.dataclass(frozen=True)
class RpcSettings:
    """What every gRPC server and channel of a process is built with, made once at its start
    (`RpcSettings.of`) and handed to the factories below."""

    #: The process's transport security (mutual TLS and tokens, or off).
    security: Security
    #: Largest message accepted or sent (`network.max_message_bytes`).
    max_message_bytes: int

    @classmethod
    def of(cls, network: NetworkSettings, security: Security) -> RpcSettings:
        """The settings of a process of a job whose network section is `network`."""
        return cls(security=security, max_message_bytes=network.max_message_bytes)


def create_grpc_server(
    settings: RpcSettings,
    *,
    host: str,
    port: int,
    metrics: ServerMetrics,
    local: bool = False,
    max_workers: int = 16,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A gRPC server with the authorizing error/metrics interceptor and grpc.health.v1, bound
    but not started.

    Args:
        settings: The process's message limits and transport security.
        host: Interface to bind (e.g. "127.0.0.1"), or a Unix socket address "unix:///path".
        port: TCP port; 0 picks a free one; ignored for a Unix socket.
        metrics: The service's request metrics.
        local: Serve the trainer of this pod (local credentials) instead of the other parts.
        max_workers: Threads serving RPCs.
    Returns:
        (server, bound port (0 for a Unix socket), health servicer to set statuses on).
    Raises:
        PortUnavailable: `port` (not 0) cannot be bound, e.g. a live process listens on it.
        OSError: no free port could be bound.
    """
    security = settings.security
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[_ErrorsAndMetrics(metrics, security)],
        options=[*message_options(settings.max_message_bytes), *SERVER_OPTIONS],
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = host if host.startswith("unix:") else f"{host}:{port}"
    try:
        bound = security.add_local_port(server, address) if local else security.add_port(server, address)
    except RuntimeError:  # grpc raises here; older versions returned 0
        if host.startswith("unix:"):
            raise
        bound = 0
    if not host.startswith("unix:") and bound == 0:
        if port:
            raise PortUnavailable(address)
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, bound, health_servicer


def set_serving(health_servicer: health.HealthServicer, *services: str) -> None:
    """Marks the server and each named service SERVING."""
    for name in ("", *services):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


#: Channel options on top of the message limits. A response stream (FetchSamples) is read on the
#: thread that iterates it, not through the "channel spin" thread grpc otherwise starts whenever a
#: channel with no call in flight makes one, and hands every message over from (a thread started
#: per fetch, and two thread switches per message, on both sides of each handover). The callers
#: only iterate their streams, which is all such a call offers before it ends.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [("SingleThreadedUnaryStream", 1)]


def create_channel(settings: RpcSettings, address: str, *, peer: str) -> grpc.Channel:
    """A channel to the part of role `peer` at `address` with the job's message limits: to a
    planner or loader over mutual TLS unless the job turned it off; to a constructor's trainer
    side ("constructor") with local credentials, as its trainer connects."""
    options = [*message_options(settings.max_message_bytes), *CHANNEL_OPTIONS]
    if peer == "constructor":
        return local_channel(address, options=options)
    return settings.security.channel(address, peer=peer, options=options)


def create_issuer_channel(address: str, *, ca: bytes) -> grpc.Channel:
    """A channel to batchplane's certificate issuer (the operator, core.enroll): TLS that checks
    the issuer's certificate (it names `operator.batchplane` and chains to `ca`) and presents
    none, since a process asks before it has one; the request's ServiceAccount token is its
    credential."""
    options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name("operator"))]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=options)


def serving_status(health_servicer: health.HealthServicer) -> bool:
    """True while the server's overall health status is SERVING."""
    response = health_servicer.Check(health_pb2.HealthCheckRequest(), _NoContext())
    return response.status == health_pb2.HealthCheckResponse.SERVING


class _NoContext:
    """What HealthServicer.Check needs of a context when asked in-process."""

    def set_code(self, code: grpc.StatusCode) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass


def is_serving(settings: RpcSettings, address: str, *, peer: str, timeout_s: float = 1.0) -> bool:
    """True when the server of role `peer` at `address` answers its health check with SERVING
    (a constructor's trainer socket: peer "constructor")."""
    with create_channel(settings, address, peer=peer) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def call_with_retry(
    call: Callable[[], T],
    *,
    what: str,
    deadline_s: float,
    should_stop: Callable[[], bool] = lambda: False,
    initial_backoff_s: float = 0.05,
    max_backoff_s: float = 1.0,
) -> T:
    """Runs `call` until it succeeds, retrying retryable gRPC errors with jittered backoff.

    Args:
        call: The RPC, with its own per-attempt timeout.
        what: Description for logs and errors, e.g. "GetPlan(step 7) from planner at ...".
        deadline_s: Give up after this many seconds.
        should_stop: Checked between attempts; True gives up at once.
    Raises:
        errors.Unavailable: the deadline passed or `should_stop` became true; the message says
            the last status, the attempts made, and why they stopped, so a caller that tries
            again can say so without contradicting it.
        grpc.RpcError: a non-retryable error (the caller maps it).
    """
    start = time.monotonic()
    give_up = start + deadline_s
    backoff = initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE:
                raise
            status = exc.code().name + (f" ({exc.details()})" if exc.details() else "")
            now = time.monotonic()
            if now >= give_up or should_stop():
                why = f"a call is retried for up to {deadline_s:g} s" if now >= give_up else "retries stopped: no longer needed"
                tries = f"{attempt} attempt{'' if attempt == 1 else 's'}"
                raise errors.Unavailable(f"{what}: {status} after {tries} in {now - start:.1f} s ({why})") from exc
            if attempt in (1, 10) or attempt % 100 == 0:
                log.info("%s: %s on attempt %d; retrying for up to %.1f s more", what, status, attempt, give_up - now)
        sleep = min(backoff, max(give_up - time.monotonic(), 0))
        time.sleep(sleep * (0.5 + random.random() / 2))
        backoff = min(backoff * 2, max_backoff_s)


#: A peer's status code -> the domain error a service re-raises it as.
_ERROR_OF: dict[grpc.StatusCode, type[errors.BatchplaneError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
}


def reraise(exc: grpc.RpcError, what: str) -> errors.BatchplaneError:
    """The domain error matching a peer's gRPC error (Unavailable for anything else)."""
    cls = _ERROR_OF.get(exc.code(), errors.Unavailable)
    return cls(f"{what}: {exc.code().name}: {exc.details()}")


def _serialize(response: Any) -> bytes:
    """A response serializer that passes responses serialized already (bytes) on unchanged."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_servicer(server: grpc.Server, servicer: Any, service: Any) -> None:
    """Registers `servicer` for the proto service `service` (a ServiceDescriptor, e.g.
    `loader_pb2.DESCRIPTOR.services_by_name["Loader"]`) as the generated
    `add_..._to_server` does, except that a response stream may yield responses serialized
    already (bytes): `stream_payload(..., serialized=True)` yields its chunks so, one copy each."""
    handlers = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        if method.client_streaming:
            raise TypeError(f"{service.full_name}.{method.name}: client streaming is not used here")
        factory = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        serializer = _serialize if method.server_streaming else response.SerializeToString
        handlers[method.name] = factory(
            getattr(servicer, method.name), request_deserializer=request.FromString, response_serializer=serializer
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def stream_payload(response_cls: Callable[..., Any], header: Any, *payloads: memoryview | bytes, serialized: bool = False) -> Iterator[Any]:
    """A chunked response stream: the header first, then the payloads one after another in
    ~1 MiB chunks (the receiver sees one payload). `serialized`: every item is the response
    already serialized (bytes; `wire.chunk_messages`, one copy of each chunk), for a method
    registered with a serializer that passes bytes on."""
    if serialized:
        yield response_cls(header=header).SerializeToString()
        field = response_cls.DESCRIPTOR.fields_by_name["chunk"].number
        for payload in payloads:
            yield from chunk_messages(payload, field=field)
        return
    yield response_cls(header=header)
    for payload in payloads:
        for data in iter_chunks(payload):
            yield response_cls(chunk=common_pb2.Chunk(data=data))
