"""The batchplane trainer-side client: batches of one rank as dicts of torch tensors.

Imports only torch, grpc, protobuf, numpy and the wire contract (batchplane.v1, batchplane.wire);
never service code.
"""

from batchplane.client.client import Client
from batchplane.client.errors import (
    DataPlaneError,
    DataPlaneUnavailable,
    InvalidRequestError,
    MessageTooLargeError,
    ProtocolError,
    StepUnavailableError,
)

__all__ = [
    "Client",
    "DataPlaneError",
    "DataPlaneUnavailable",
    "InvalidRequestError",
    "MessageTooLargeError",
    "ProtocolError",
    "StepUnavailableError",
]
