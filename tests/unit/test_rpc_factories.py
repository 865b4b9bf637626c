"""Every gRPC server and channel of the services comes from core.rpc's factories, built from one
settings object (`RpcSettings`): no module opens its own with grpc.server, grpc.insecure_channel,
grpc.secure_channel or a Security's `channel` (which would skip the job's message limits, the
authorizing interceptor or the transport security); and what the settings say reaches the
servers and channels the factories make."""

from __future__ import annotations

import ast
import pathlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from batchplane.core.config import NetworkSettings
from batchplane.core.rpc import RpcSettings, ServerMetrics, create_channel, create_grpc_server, is_serving, set_serving
from batchplane.core.tls import Security

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = (ROOT / "services", ROOT / "client", ROOT / "proto")

#: The factories themselves.
FACTORIES = {
    "services/batchplane/core/rpc.py": "the server and channel factories",
    "services/batchplane/core/tls.py": "Security.channel and its reloading channel, which core.rpc.create_channel drives",
}
#: Modules allowed to bypass the factories, each with its reason.
EXCEPTIONS = {
    "proto/batchplane/local_transport.py": (
        "the trainer side's channel (local credentials), shared by the client, which may not import "
        "the services, and core.rpc.create_channel(peer='constructor')"
    ),
    "services/batchplane/bench/delivery.py": (
        "the grpc_stream transport is the bare-gRPC baseline (no interceptor, no security) that the factory's server is measured against"
    ),
}
#: Calls that open a server or channel outside the factories.
GRPC_OPENERS = frozenset({"server", "insecure_channel", "secure_channel"})


def _openers_in(tree: ast.AST) -> list[str]:
    """The calls in `tree` that open a gRPC server or channel by hand: grpc.<opener>(...) under
    any alias of grpc, an opener imported from grpc by name, and <...security>.channel(...)."""
    grpc_aliases = {"grpc"}
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            grpc_aliases.update(a.asname or a.name for a in node.names if a.name == "grpc")
        elif isinstance(node, ast.ImportFrom) and node.module == "grpc":
            imported.update({a.asname or a.name: a.name for a in node.names if a.name in GRPC_OPENERS})
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in grpc_aliases
            and func.attr in GRPC_OPENERS
        ):
            found.append(f"line {node.lineno}: grpc.{func.attr}")
        elif isinstance(func, ast.Name) and func.id in imported:
            found.append(f"line {node.lineno}: grpc.{imported[func.id]}")
        elif isinstance(func, ast.Attribute) and func.attr == "channel" and ast.unparse(func.value).lower().endswith("security"):
            found.append(f"line {node.lineno}: {ast.unparse(func)}")
    return found


def test_the_scan_finds_every_way_of_opening_by_hand() -> None:
    source = """
import grpc
import grpc as g
from grpc import insecure_channel as ic, secure_channel
grpc.server(None)
g.insecure_channel("a")
ic("a")
secure_channel("a", None)
self.security.channel("a", peer="planner")
security.channel("a", peer="planner")
create_channel(rpc, "a", peer="planner")
grpc.server_credentials_from_nothing()
"""
    assert _openers_in(ast.parse(source)) == [
        "line 5: grpc.server",
        "line 6: grpc.insecure_channel",
        "line 7: grpc.insecure_channel",
        "line 8: grpc.secure_channel",
        "line 9: self.security.channel",
        "line 10: security.channel",
    ]


def test_no_module_opens_a_server_or_channel_outside_the_factories() -> None:
    bad = []
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in FACTORIES or name in EXCEPTIONS:
                continue
            bad += [f"{name} {where}" for where in _openers_in(ast.parse(path.read_text()))]
    assert bad == [], "open servers and channels with core.rpc.create_grpc_server / create_channel"


def test_every_listed_exception_still_needs_to_be_one() -> None:
    for name in EXCEPTIONS:
        assert _openers_in(ast.parse((ROOT / name).read_text())), f"{name} no longer bypasses the factories: drop it from EXCEPTIONS"


def test_settings_of_a_job_carry_its_message_limit() -> None:
    security = Security(None)
    settings = RpcSettings.of(NetworkSettings(max_message_bytes=12345), security)
    assert settings == RpcSettings(security=security, max_message_bytes=12345)


@pytest.fixture
def served():
    """A started factory server with a 64 KiB message limit."""
    settings = RpcSettings(security=Security(None), max_message_bytes=64 << 10)
    server, port, health = create_grpc_server(settings, host="127.0.0.1", port=0, metrics=ServerMetrics("planner", CollectorRegistry()))
    server.start()
    yield settings, f"127.0.0.1:{port}", health
    server.stop(0).wait()


def test_is_serving_follows_the_health_status(served) -> None:
    settings, address, health = served
    health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert not is_serving(settings, address, peer="planner", timeout_s=5)
    set_serving(health)
    assert is_serving(settings, address, peer="planner", timeout_s=5)


def test_the_settings_message_limit_bounds_the_server_and_the_channel(served) -> None:
    settings, address, health = served
    set_serving(health, "x" * 1000)
    request = health_pb2.HealthCheckRequest
    with create_channel(settings, address, peer="planner") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(request(service="x" * 1000), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.Check(request(service="x" * (70 << 10)), timeout=5)  # over the limit: the channel refuses to send it
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    wider = RpcSettings(security=settings.security, max_message_bytes=1 << 20)
    with create_channel(wider, address, peer="planner") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(request(service="x" * (70 << 10)), timeout=5)  # the server refuses it
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
