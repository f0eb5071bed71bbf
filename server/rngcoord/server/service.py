"""The gRPC servicer: translates rngcoord.v1 messages to Coordinator calls and back.

It holds no domain logic. Every handler is a coroutine on the server's event loop: a waiting
JoinGroup holds no thread, and a caller that cancels or disconnects cancels its handler (the
barrier withdraws its join). Calls reach it through the gate (rngcoord.server.gate), which has
admitted, decoded and authorized them. For every RPC it calls the transport-free
`Coordinator` and:

- names the caller in audit records: the token's identity, rank, member id and peer;
- puts the store id in JoinGroup and GetGroup replies, and the audit chain's head in the
  trailing metadata `rngcoord-audit-head` of JoinGroup and Reserve replies and of every
  refusal;
- refuses everything with UNAVAILABLE / STORE_LOST once the coordinator found its store gone;
- turns a `CoordinatorError` into the rich status it carries (code, message, and an ErrorInfo
  with its reason and metadata), a database that cannot serve into UNAVAILABLE /
  STORE_UNAVAILABLE, and anything else into INTERNAL (the traceback is logged under an
  incident id; the caller gets only the id);
- counts the outcome in `Metrics`.

Nothing is logged per request: the hot path (Reserve) does a few attribute lookups, one
Coordinator call and one response message.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from time import perf_counter
from typing import NoReturn

import grpc

from rngcoord.server.coordinator import Coordinator
from rngcoord.server.errors import CoordinatorError, Divergence, Unavailable
from rngcoord.server.gate import current_identity
from rngcoord.server.logs import event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import rich_status

_log = get_logger("service")
_INTERNAL = pb.ErrorReason.Name(pb.INTERNAL_ERROR)
HEAD_TRAILER = "rngcoord-audit-head"


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
        self._attest_seconds = latency["Attest"]
        self._leave_seconds = latency["LeaveGroup"]
        self._get_seconds = latency["GetGroup"]
        self._restore_seconds = latency["Restore"]
        self._audit_seconds = latency["ListAudit"]
        self._grants = self._metrics.grants
        self._hits = self._metrics.hits
        self._store_id = coordinator.store.store_id

    def _check_store(self) -> None:
        lost = self._coord.lost
        if lost is not None:
            raise Unavailable(
                f"this coordinator's store is lost ({lost}); it refuses every call until it "
                "is restarted on the right store",
                reason=pb.STORE_LOST,
                store_id=self._store_id,
                location=self._coord.store.location,
            )

    def _set_head(self, context: grpc.aio.ServicerContext[object, object]) -> None:
        context.set_trailing_metadata(((HEAD_TRAILER, self._coord.head_anchor()),))

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
            self._check_store()
            r = await self._coord.join(
                request.job,
                request.group,
                rank=request.rank,
                world_size=request.world_size,
                member_id=request.member_id,
                job_seed=request.job_seed if request.HasField("job_seed") else None,
                timeout_s=timeout_s,
                actor=_actor(request.rank, request.member_id, context),
                peer=peer,
                include_members=request.include_members,
            )
        except Exception as exc:
            await self._fail("JoinGroup", exc, context, t0)
        self._join_seconds.observe(perf_counter() - t0)
        reply = r.to_pb(include_members=request.include_members)
        reply.store_id = self._store_id
        self._set_head(context)
        return reply

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ReserveResponse:
        t0 = perf_counter()
        try:
            self._check_store()
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
        self._set_head(context)
        return r.to_pb()

    async def Attest(
        self, request: pb.AttestRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.AttestResponse:
        t0 = perf_counter()
        try:
            self._check_store()
            await self._coord.attest(
                request.job,
                request.group,
                epoch=request.epoch,
                anchor_seq=request.anchor_seq,
                ops=request.ops,
                fingerprint=request.fingerprint,
                rank=request.rank,
                member_id=request.member_id,
                actor=_actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            await self._fail("Attest", exc, context, t0)
        self._attest_seconds.observe(perf_counter() - t0)
        return pb.AttestResponse()

    async def LeaveGroup(
        self, request: pb.LeaveGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.LeaveGroupResponse:
        t0 = perf_counter()
        try:
            self._check_store()
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
            self._check_store()
            g = await self._coord.get_group(
                request.job,
                request.group,
                members_from=request.members_from,
                members_limit=request.members_limit,
            )
        except Exception as exc:
            await self._fail("GetGroup", exc, context, t0)
        self._get_seconds.observe(perf_counter() - t0)
        reply = g.to_pb()
        reply.store_id = self._store_id
        return reply

    async def Restore(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RestoreResponse:
        t0 = perf_counter()
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else None
        remaining = context.time_remaining()
        if remaining is not None:
            # Waiting for votes past the caller's own deadline would answer nobody.
            timeout_s = max(min(timeout_s or remaining, remaining), 0.001)
        try:
            self._check_store()
            r = await self._coord.restore(
                request.job,
                request.group,
                epoch=request.epoch,
                seq=request.seq,
                cursor=request.cursor,
                rank=request.rank,
                member_id=request.member_id,
                actor=_actor(request.rank, request.member_id, context),
                force=request.force,
                timeout_s=timeout_s,
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
            self._check_store()
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
        if not isinstance(exc, CoordinatorError) and self._coord.store.is_unavailable(exc):
            exc = Unavailable(f"the store cannot serve {method} now: {exc}")
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
        # Refusals carry the head too: a client that meets another store learns it from the
        # first refusal (an unknown job, say), not from a reply it never gets.
        trailers = (*status.trailing_metadata, (HEAD_TRAILER, self._coord.head_anchor()))
        await context.abort(status.code, status.details, trailers)
        raise AssertionError("context.abort returned")  # it always raises


def _actor(rank: int, member_id: str, context: grpc.aio.ServicerContext[object, object]) -> str:
    """Who made a request, for the audit log: "trainer: rank 1 member m-abc @
    ipv4:10.0.0.7:41234" (the token's identity first, when tokens are on)."""
    who = current_identity()
    name = f"{who.name}: " if who is not None else ""
    return f"{name}rank {rank} member {member_id[:128]} @ {context.peer()}"
