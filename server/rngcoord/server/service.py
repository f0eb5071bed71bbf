"""The gRPC servicer: translates rngcoord.v1 messages to Coordinator calls and back.

It holds no domain logic. Every handler is a coroutine on the server's event loop: a waiting
JoinGroup holds no thread, and a caller that cancels or disconnects cancels its handler (the
barrier withdraws its join). For every RPC it calls the transport-free `Coordinator`, turns a
`CoordinatorError` into the rich status it carries (code, message, and an ErrorInfo with its
reason and metadata), turns any other exception into INTERNAL (the traceback is logged under
an incident id; the caller gets only the id), and counts the outcome in `Metrics`. Nothing is
logged per request: the hot path (Reserve) does a few attribute lookups, one Coordinator call
and one response message.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from time import perf_counter
from typing import NoReturn

import grpc

from rngcoord.server.coordinator import Coordinator
from rngcoord.server.errors import CoordinatorError, Divergence
from rngcoord.server.logs import event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import rich_status

_log = get_logger("service")
_INTERNAL = pb.ErrorReason.Name(pb.INTERNAL_ERROR)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Serves the rngcoord.v1.Coordinator service from a `Coordinator`.

    Args:
        coordinator: the domain logic and its store.
        metrics: where outcomes are counted. Default: a fresh `Metrics` nobody exports.
    """

    def __init__(self, coordinator: Coordinator, metrics: Metrics | None = None) -> None:
        self._coord = coordinator
        self._metrics = metrics if metrics is not None else Metrics()
        latency = self._metrics.latency
        # Bound once so that the hot path does no dictionary or label lookups.
        self._join_seconds = latency["JoinGroup"]
        self._reserve_seconds = latency["Reserve"]
        self._leave_seconds = latency["LeaveGroup"]
        self._get_seconds = latency["GetGroup"]
        self._restore_seconds = latency["Restore"]
        self._audit_seconds = latency["ListAudit"]
        self._grants = self._metrics.grants
        self._hits = self._metrics.hits

    async def JoinGroup(
        self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.JoinGroupResponse:
        t0 = perf_counter()
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else None
        remaining = context.time_remaining()
        if timeout_s is not None and remaining is not None:
            # Waiting past the caller's own deadline would keep a place for nobody.
            timeout_s = max(min(timeout_s, remaining), 0.001)
        peer = context.peer()
        try:
            r = await self._coord.join(
                request.job,
                request.group,
                rank=request.rank,
                world_size=request.world_size,
                member_id=request.member_id,
                job_seed=request.job_seed if request.HasField("job_seed") else None,
                timeout_s=timeout_s,
                actor=f"rank {request.rank} member {request.member_id[:128]} @ {peer}",
                peer=peer,
                include_members=request.include_members,
            )
        except Exception as exc:
            await self._fail("JoinGroup", exc, context, t0)
        self._join_seconds.observe(perf_counter() - t0)
        return r.to_pb(include_members=request.include_members)

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ReserveResponse:
        t0 = perf_counter()
        try:
            r = await self._coord.reserve(
                request.job,
                request.group,
                epoch=request.epoch,
                seq=request.seq,
                size=request.size,
                fingerprint=request.fingerprint,
                rank=request.rank,
                member_id=request.member_id,
                actor=_actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            await self._fail("Reserve", exc, context, t0)
        (self._hits if r.existing else self._grants).inc()
        self._reserve_seconds.observe(perf_counter() - t0)
        return r.to_pb()

    async def LeaveGroup(
        self, request: pb.LeaveGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.LeaveGroupResponse:
        t0 = perf_counter()
        try:
            await self._coord.leave(
                request.job,
                request.group,
                epoch=request.epoch,
                rank=request.rank,
                member_id=request.member_id,
                actor=_actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            await self._fail("LeaveGroup", exc, context, t0)
        self._leave_seconds.observe(perf_counter() - t0)
        return pb.LeaveGroupResponse()

    async def GetGroup(
        self, request: pb.GetGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetGroupResponse:
        t0 = perf_counter()
        try:
            g = await self._coord.get_group(
                request.job,
                request.group,
                members_from=request.members_from,
                members_limit=request.members_limit,
            )
        except Exception as exc:
            await self._fail("GetGroup", exc, context, t0)
        self._get_seconds.observe(perf_counter() - t0)
        return g.to_pb()

    async def Restore(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RestoreResponse:
        t0 = perf_counter()
        try:
            r = await self._coord.restore(
                request.job,
                request.group,
                epoch=request.epoch,
                seq=request.seq,
                cursor=request.cursor,
                rank=request.rank,
                member_id=request.member_id,
                actor=_actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            await self._fail("Restore", exc, context, t0)
        self._restore_seconds.observe(perf_counter() - t0)
        return r.to_pb()

    async def ListAudit(  # type: ignore[override]
        self, request: pb.ListAuditRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> None:
        # Each write waits for the client to take the record (HTTP/2 flow control), so a
        # stream that is not read holds only its position; a cancelled one stops here.
        t0 = perf_counter()
        try:
            records = self._coord.list_audit(
                job=request.job,
                group=request.group,
                kinds=tuple(request.kinds),
                since_us=request.since_us,
                until_us=request.until_us,
                limit=request.limit,
            )
            async for record in records:
                await context.write(record.to_pb())
        except Exception as exc:
            await self._fail("ListAudit", exc, context, t0)
        self._audit_seconds.observe(perf_counter() - t0)

    async def _fail(
        self,
        method: str,
        exc: Exception,
        context: grpc.aio.ServicerContext[object, object],
        t0: float,
    ) -> NoReturn:
        """Count and log the failure of `method`, then end the call with its status."""
        self._metrics.latency[method].observe(perf_counter() - t0)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if isinstance(exc, CoordinatorError):
            if isinstance(exc, Divergence):
                self._metrics.divergences.inc()
            self._metrics.error(exc.code)
            status = rich_status(exc.code, exc.message, exc.reason_name, exc.metadata)
        else:
            incident = uuid.uuid4().hex[:12]
            # The caller gets the incident id only; the details may name internals or paths.
            event(
                _log,
                logging.ERROR,
                "rpc_failed",
                exc_info=True,
                method=method,
                incident=incident,
                peer=context.peer(),
            )
            self._metrics.error(grpc.StatusCode.INTERNAL)
            message = f"internal error in {method}; the server logged it as incident {incident}"
            status = rich_status(
                grpc.StatusCode.INTERNAL, message, _INTERNAL, {"incident": incident}
            )
        await context.abort(status.code, status.details, status.trailing_metadata)
        raise AssertionError("context.abort returned")  # it always raises


def _actor(rank: int, member_id: str, context: grpc.aio.ServicerContext[object, object]) -> str:
    """Who made a request, for the audit log: "rank 1 member m-abc @ ipv4:10.0.0.7:41234"."""
    return f"rank {rank} member {member_id[:128]} @ {context.peer()}"
