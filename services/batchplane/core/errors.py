"""Domain errors of the batchplane services. No grpc here: `batchplane.core.rpc` maps each
class to a gRPC status code in one table.
"""

from __future__ import annotations

from typing import Any


class BatchplaneError(Exception):
    """Base of every error a service raises on purpose."""


class InvalidArgument(BatchplaneError):
    """The request is malformed or names something that does not exist in the job."""


class NotFound(BatchplaneError):
    """The request names data the service does not hold."""


class FailedPrecondition(BatchplaneError):
    """The request is valid but not in the service's current state (e.g. a consumed step)."""


def rewind_refused(step: int, oldest: int) -> FailedPrecondition:
    """The error of a rewind to `step` before `oldest`, the first step the planner's ledger can
    re-plan (planner and constructors refuse it alike)."""
    return FailedPrecondition(
        f"cannot rewind to step {step}: the oldest step the planner's ledger can re-plan is {oldest} "
        f"(where its oldest generation starts); restart from a checkpoint at step {oldest} or later"
    )


class Unavailable(BatchplaneError):
    """Temporarily unable to answer (data not ready, a peer is down); retry with backoff."""


class ResourceExhausted(BatchplaneError):
    """The request or its answer is too big."""


class ConfigError(BatchplaneError):
    """A bad configuration value, found at start-up.

    Args:
        field: Dotted path of the field, e.g. "mixture.weights.web", or a file path.
        problem: What is wrong, e.g. "must be >= 0".
        value: The offending value.
    """

    def __init__(self, field: str, problem: str, value: Any) -> None:
        self.field = field
        self.problem = problem
        self.value = value
        super().__init__(f"{field}: {problem}, got {value!r}")


class SourceError(BatchplaneError):
    """A source cannot be opened: a missing or unreadable file, a missing column, a column of
    the wrong type, an empty source. The message names the source and the file."""


class Unauthenticated(BatchplaneError):
    """The caller has no identity the service accepts (no certificate naming a role, no valid
    token)."""


class PermissionDenied(BatchplaneError):
    """The caller's identity may not make this call (another role's call, or acting for
    another index or replica than its own)."""
