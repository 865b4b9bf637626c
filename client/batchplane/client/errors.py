"""The client's own exceptions: a trainer never sees a raw grpc.RpcError."""

from __future__ import annotations


class DataPlaneError(Exception):
    """Base of every error the batchplane client raises."""


class DataPlaneUnavailable(DataPlaneError):
    """The data plane did not answer within the client's deadline (retries exhausted); the
    message names the part and its address."""


class StepUnavailableError(DataPlaneError):
    """The requested step cannot be served: it was already consumed (the rank moved past it) or
    precedes the step the job started at. Resuming from an older checkpoint needs a data plane
    restarted from that checkpoint."""


class InvalidRequestError(DataPlaneError):
    """The request is wrong for this job: a rank outside the mesh, a checkpoint of another job."""


class MessageTooLargeError(DataPlaneError):
    """A message exceeded the configured gRPC size limit."""


class ProtocolError(DataPlaneError):
    """The data plane's answer did not follow the wire contract (e.g. a truncated payload)."""
