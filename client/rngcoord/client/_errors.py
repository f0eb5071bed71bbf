"""The client's error hierarchy.

Every error rngcoord's client raises derives from :class:`RNGCoordError`. Errors that answer
a coordinator RPC carry the gRPC status name in ``code``, the ErrorInfo ``reason`` and
``metadata`` the coordinator sent (coordinator.proto's ``ErrorReason`` documents them), and the
server's message inside their own; every message says what failed and what to do about it.
The class of an error comes from its reason, never from the message's text.
"""

from __future__ import annotations

from collections.abc import Mapping

from rngcoord.v1.rules import RuleViolation


class RNGCoordError(Exception):
    """Root of the rngcoord client errors.

    Args:
        message: What failed, and what to do about it.
        code: The gRPC status name (``"FAILED_PRECONDITION"``...) when the error answers an
            RPC; ``None`` (the default) for errors raised by the client itself.
        reason: The coordinator's ErrorReason name (``"STALE_EPOCH"``...), or ``None`` (the
            default) when there is none.
        metadata: The ErrorInfo metadata (``{"group": "tp", "epoch": "3"}``...). Default: empty.
    """

    def __init__(
        self,
        message: str,
        code: str | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.metadata: Mapping[str, str] = dict(metadata or {})


def refused(violation: RuleViolation) -> InvalidRequest:
    """The client's refusal of a value that breaks one of the contract's rules, before any
    request is sent (the coordinator would refuse it with reason INVALID_FIELD)."""
    return InvalidRequest(
        str(violation), reason="INVALID_FIELD", metadata={"field": violation.field}
    )


class CoordinatorUnavailable(RNGCoordError):
    """No coordinator target answered within the outage budget (or install()'s first-contact
    bound); the message says since when, which targets were tried and how to raise it."""


class InvalidRequest(RNGCoordError):
    """A request or an argument was malformed (INVALID_ARGUMENT, or caught client-side)."""


class NotFoundError(RNGCoordError):
    """The coordinator does not know the job, the group or the epoch (NOT_FOUND)."""


class FailedPreconditionError(RNGCoordError):
    """The coordinator's state refuses the request (FAILED_PRECONDITION): a job seed
    conflict, a world-size mismatch, a member that is not in the epoch, a Restore conflict."""


class StaleEpochError(FailedPreconditionError):
    """This rank's epoch was fenced by a newer one: the group's membership changed."""


class NotMemberError(FailedPreconditionError):
    """This rank's (rank, member id) is not a member of the epoch it named."""


class DivergenceError(FailedPreconditionError):
    """The ranks of a group disagree about the sequence of random ops."""


class OffsetsExhausted(RNGCoordError):
    """A group's offset space is used up (RESOURCE_EXHAUSTED), or an offset no longer fits
    the device generator (CUDA stores the Philox offset as a signed 64-bit integer)."""


class AuthenticationError(RNGCoordError):
    """The bearer token is missing or wrong for the job (UNAUTHENTICATED)."""


class PermissionDeniedError(AuthenticationError):
    """The token is valid, but its role or jobs do not allow the call (PERMISSION_DENIED)."""


class StoreMismatchError(RNGCoordError):
    """The coordinator answers from another store than the one this job's streams came from,
    or its state went backwards (an older epoch, a lower high-water mark): continuing would
    hand out offsets that were already used, so the client stops."""


class RestoreTimeoutError(RNGCoordError):
    """A Restore did not take effect in time: not every member of the group asked for it; the
    message and ``metadata["missing"]`` name the ranks that did not."""


class JoinTimeoutError(RNGCoordError):
    """A JoinGroup barrier timed out; the message names the ranks that did not join."""


class UnsupportedTorchError(RNGCoordError):
    """The installed torch lacks the DTensor internals the tracker hooks into."""
