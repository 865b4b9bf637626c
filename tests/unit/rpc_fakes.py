"""Stand-ins for gRPC in unit tests that run a client or a pipeline without a server: a failed
call's error with a status and details, and a channel whose stubs the test replaces."""

from __future__ import annotations

import grpc


class Failed(grpc.RpcError):
    """A call that failed with `code` and `details`, as grpc raises it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Channel:
    """Stands for a grpc channel: the stubs made on it are replaced, nothing is ever called on it."""

    def unary_unary(self, *args, **kwargs):
        return None

    unary_stream = stream_unary = stream_stream = unary_unary

    def close(self) -> None:
        pass
