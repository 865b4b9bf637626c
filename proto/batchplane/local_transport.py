"""The trainer's side of the pod: a constructor serves its trainer with gRPC local credentials
on a Unix socket (or a loopback port), which only processes of the pod, of the socket folder's
group, can reach. The trainer client and the services' health checks open channels to it here.
"""

from __future__ import annotations

from typing import Any

import grpc

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def local_channel(address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to a constructor's trainer side: local credentials on a Unix socket or a
    loopback address (they interoperate with a plaintext server: local credentials exchange no
    bytes), plaintext to any other address (a constructor with network.tls off)."""
    if address.startswith("unix:"):
        return grpc.secure_channel(address, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS), options=options)
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in LOOPBACK_HOSTS:
        return grpc.secure_channel(address, grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP), options=options)
    return grpc.insecure_channel(address, options=options)
