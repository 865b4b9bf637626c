"""The client's own exceptions: a trainer never sees a raw grpc.RpcError."""

from __future__ import annotations


class DataPlaneError(Exception):
    """Base of every error the batchplane client raises."""


class DataPlaneUnavailable(DataPlaneError):
    """The data plane did not answer within the client's deadline (retries exhausted); the
    message names the part and its address."""


class StepUnavailableError(DataPlaneError):
    """The requested step cannot be served: a rewind to a step before the oldest one the
    planner's ledger can re-plan (the message names it), a step the rank moved past asked for
    without restarting (a stale request), or planning failed for good (the message says why)."""


class InvalidRequestError(DataPlaneError):
    """The request is wrong for this job: a rank outside the mesh, a checkpoint of another job."""


class MessageTooLargeError(DataPlaneError):
    """A message exceeded the configured gRPC size limit."""


class ProtocolError(DataPlaneError):
    """The data plane's answer did not follow the wire contract (e.g. a truncated payload)."""
