"""The two tables that turn errors into gRPC status codes (services) and status codes into the
client's exceptions; and the round trip between them."""

from __future__ import annotations

import grpc
import pytest

from batchplane.client import errors as client_errors
from batchplane.client.transport import ERROR_OF
from batchplane.core import errors
from batchplane.core.rpc import reraise, status_of
from batchplane.wire import WireFormatError


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ConfigError("f", "bad", 1), grpc.StatusCode.INVALID_ARGUMENT),
        (WireFormatError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.SourceError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
        (KeyError("a bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_service_errors_map_to_status_codes(error: Exception, code: grpc.StatusCode) -> None:
    assert status_of(error) == code


@pytest.mark.parametrize(
    ("code", "exception"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, client_errors.InvalidRequestError),
        (grpc.StatusCode.NOT_FOUND, client_errors.InvalidRequestError),
        (grpc.StatusCode.FAILED_PRECONDITION, client_errors.StepUnavailableError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, client_errors.MessageTooLargeError),
        (grpc.StatusCode.UNAVAILABLE, client_errors.DataPlaneUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, client_errors.DataPlaneUnavailable),
    ],
)
def test_client_maps_status_codes_to_its_own_exceptions(code: grpc.StatusCode, exception: type) -> None:
    assert ERROR_OF[code] is exception
    assert issubclass(exception, client_errors.DataPlaneError)
    assert not issubclass(exception, grpc.RpcError)


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgument("x"),
        errors.NotFound("x"),
        errors.FailedPrecondition("x"),
        errors.ResourceExhausted("x"),
        errors.Unavailable("x"),
    ],
)
def test_a_peers_error_is_reraised_as_the_same_domain_error(error: Exception) -> None:
    again = reraise(_FakeRpcError(status_of(error)), "peer")
    assert type(again) is type(error)
    assert "peer" in str(again)
