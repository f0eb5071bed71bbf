"""The coordinator's refusals: each carries a gRPC status code, an ErrorReason and metadata.

The domain logic and the stores raise these; the servicer sends each as a rich status
(`google.rpc.Status` with one `ErrorInfo{reason, domain "rngcoord.v1", metadata}`, built by
`rngcoord.v1.status`), so that clients branch on the reason and never on the message. The
reasons and their metadata keys are documented in coordinator.proto's `ErrorReason`. Anything
else that escapes is a bug and becomes INTERNAL there. `keep_writes` tells the group-commit
writer to commit what the failing operation wrote (a divergence records its audit entry) and
raise the error after the commit.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import RuleViolation, show

__all__ = [
    "CoordinatorError",
    "Divergence",
    "FailedPrecondition",
    "InvalidArgument",
    "JoinTimeout",
    "NotFound",
    "NotMember",
    "PermissionDenied",
    "RateLimited",
    "ResourceExhausted",
    "RestoreTimeout",
    "StaleEpoch",
    "Unavailable",
]


class CoordinatorError(Exception):
    """A refused request: a gRPC status code, a reason, metadata and a message for people.

    Args:
        message: what failed and, where it helps, what to do; sent to the client verbatim.
        reason: the `ErrorReason` value. Default: the class's.
        **metadata: the ErrorInfo metadata, e.g. group="tp", epoch=3; values become strings.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    default_reason: ClassVar[pb.ErrorReason.ValueType] = pb.INTERNAL_ERROR
    keep_writes: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        reason: pb.ErrorReason.ValueType | None = None,
        **metadata: object,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = self.default_reason if reason is None else reason
        self.metadata = {key: str(value) for key, value in metadata.items()}

    @property
    def reason_name(self) -> str:
        """The reason as ErrorInfo carries it, e.g. "STALE_EPOCH"."""
        return pb.ErrorReason.Name(self.reason)


class InvalidArgument(CoordinatorError):
    """A malformed request field; the message names the field and the bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = pb.INVALID_FIELD

    @classmethod
    def of(cls, violation: RuleViolation) -> InvalidArgument:
        """The refusal of a field that broke one of the contract's rules."""
        return cls(str(violation), field=violation.field, value=show(violation.value))


class NotFound(CoordinatorError):
    """An unknown job, group or epoch (reason UNKNOWN_JOB, UNKNOWN_GROUP or UNKNOWN_EPOCH)."""

    code = grpc.StatusCode.NOT_FOUND
    default_reason = pb.UNKNOWN_GROUP


class FailedPrecondition(CoordinatorError):
    """The request is well formed but the stored state refuses it; `reason` says why."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = pb.ERROR_REASON_UNSPECIFIED


class StaleEpoch(FailedPrecondition):
    """The caller's epoch has been fenced by a newer one; the message names the current one."""

    default_reason = pb.STALE_EPOCH


class NotMember(FailedPrecondition):
    """(rank, member_id) is not a member of the epoch."""

    default_reason = pb.NOT_MEMBER


class Divergence(FailedPrecondition):
    """Ranks disagree about a lease; the audit record of the event commits with the refusal."""

    default_reason = pb.DIVERGENCE
    keep_writes = True


class ResourceExhausted(CoordinatorError):
    """The group's offset space cannot hold the requested lease."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = pb.OFFSETS_EXHAUSTED


class JoinTimeout(CoordinatorError):
    """A join barrier timed out; the message names the missing ranks."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = pb.JOIN_TIMEOUT


class RestoreTimeout(CoordinatorError):
    """A Restore's vote timed out before every member asked; the message names the missing."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = pb.RESTORE_TIMEOUT


class PermissionDenied(CoordinatorError):
    """The caller's token does not allow this call on this job (its role or job patterns)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = pb.NOT_PERMITTED


class RateLimited(CoordinatorError):
    """The peer sent more calls than its rate allows; retry after the `retry_after_ms`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = pb.RATE_LIMITED


class Unavailable(CoordinatorError):
    """The store could not complete the operation; the client may retry."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = pb.STORE_UNAVAILABLE
