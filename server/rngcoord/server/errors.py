"""The coordinator's error types: each one carries the gRPC status code it maps to.

The domain logic (coordinator.py) and the stores raise these; the servicer turns them into
`context.abort(error.code, error.message)`. Anything else that escapes is a bug and becomes
INTERNAL there. `keep_writes` tells the group-commit writer to commit what the failing
operation wrote (divergence records its audit entry) and raise the error after the commit.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

__all__ = [
    "CoordinatorError",
    "Divergence",
    "FailedPrecondition",
    "InvalidArgument",
    "JoinTimeout",
    "NotFound",
    "ResourceExhausted",
    "StaleEpoch",
    "Unavailable",
]


class CoordinatorError(Exception):
    """A refused request: a gRPC status code and a message for the caller.

    Args:
        message: what failed and, where it helps, what to do; sent to the client verbatim.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    keep_writes: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(CoordinatorError):
    """A malformed request field; the message names the field and the bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CoordinatorError):
    """An unknown job, group or epoch."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(CoordinatorError):
    """The request is well formed but the stored state refuses it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleEpoch(FailedPrecondition):
    """The caller's epoch has been fenced by a newer one; the message names the current one."""


class Divergence(FailedPrecondition):
    """Ranks disagree about a lease; the audit record of the event commits with the refusal."""

    keep_writes = True


class ResourceExhausted(CoordinatorError):
    """The group's offset space cannot hold the requested lease."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class JoinTimeout(CoordinatorError):
    """A join barrier timed out; the message names the missing ranks."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(CoordinatorError):
    """The store could not complete the operation; the client may retry."""

    code = grpc.StatusCode.UNAVAILABLE
