"""The rich error model on the wire: a refusal's `google.rpc.Status` with one `ErrorInfo`.

The coordinator builds a refusal with :func:`rich_status`; the client reads it back with
:func:`error_info`. Both go through the well-kept grpcio-status package, which puts the
serialised `google.rpc.Status` in the `grpc-status-details-bin` trailer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rngcoord.v1.rules import DOMAIN

__all__ = ["HEAD_TRAILER", "ErrorInfo", "error_info", "rich_status"]

HEAD_TRAILER = "rngcoord-audit-head"
"""The trailing metadata key of the audit chain's head, "STORE_ID:RECORD_ID:HASH:MAC", on
JoinGroup and Reserve replies and on every refusal (coordinator.proto)."""


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why the coordinator refused a call.

    Args:
        reason: an `ErrorReason` name from coordinator.proto, e.g. "STALE_EPOCH".
        metadata: what was refused, e.g. {"group": "tp", "epoch": "3"}.
    """

    reason: str
    metadata: Mapping[str, str] = field(default_factory=dict)


def rich_status(
    code: grpc.StatusCode, message: str, reason: str, metadata: Mapping[str, str]
) -> grpc.Status:
    """The status to end a call with: `code`, `message`, and an ErrorInfo in its details."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    result: grpc.Status = rpc_status.to_status(status)
    return result


def error_info(error: grpc.RpcError) -> ErrorInfo | None:
    """The ErrorInfo of rngcoord's domain that a failed call carries, or None (a transport
    error, or a server that sent none)."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:  # a details trailer that contradicts the call's code or message
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return ErrorInfo(info.reason, dict(info.metadata))
    return None
