"""The gRPC servicer: translates rngcoord.v1 messages to Coordinator calls and back.

It holds no domain logic. Every handler is a coroutine on the server's event loop: a waiting
JoinGroup holds no thread, and a caller that cancels or disconnects cancels its handler (the
barrier withdraws its join). Calls reach it through the gate (rngcoord.server.rpc.gate), which has
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
from collections.abc import AsyncIterator
from time import perf_counter
from typing import NoReturn

import grpc
from grpc_status import rpc_status

from rngcoord.server.addresses import peer_host
from rngcoord.server.core.coordinator import Coordinator
from rngcoord.server.core.membership import Caller
from rngcoord.server.errors import CoordinatorError, Divergence, InvalidArgument, Unavailable
from rngcoord.server.logs import event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.server.rpc import session
from rngcoord.server.rpc.gate import StreamCaps, current_identity
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import HEAD_TRAILER, rich_status

_log = get_logger("service")
_INTERNAL = pb.ErrorReason.Name(pb.INTERNAL_ERROR)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Serves the rngcoord.v1.Coordinator service from a `Coordinator`.

    Args:
        coordinator: the domain logic and its store.
        metrics: where outcomes are counted. Default: a fresh `Metrics` nobody exports.
        audit_streams: the caps on open ListAudit streams, per peer host and in all.
            Default: `StreamCaps()`'s defaults.
        audit_stall_s: a ListAudit stream whose client takes no record for this long is
            ended (DEADLINE_EXCEEDED). Default 60.
        sessions: the caps on open Session streams, per peer host and in all. Default:
            128 per host, 16,384 in all.
        admit: checks each request of a Session stream as the gate checks a call
            (`Gate.admit`). Default None: every request is admitted (no gate).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        metrics: Metrics | None = None,
        *,
        audit_streams: StreamCaps | None = None,
        audit_stall_s: float = 60.0,
        sessions: StreamCaps | None = None,
        admit: session.Admit | None = None,
    ) -> None:
        self._coord = coordinator
        self._sessions = (
            sessions if sessions is not None else StreamCaps(128, 16384, method="Session")
        )
        self._admit = admit
        self._session_handlers: dict[str, tuple[str, session.Handler]] = {
            "join_group": ("JoinGroup", self.JoinGroup),
            "join_groups": ("JoinGroups", self.JoinGroups),
            "reserve": ("Reserve", self.Reserve),
            "attest": ("Attest", self.Attest),
            "leave_group": ("LeaveGroup", self.LeaveGroup),
            "get_group": ("GetGroup", self.GetGroup),
            "restore": ("Restore", self.Restore),
            "record_resize": ("RecordResize", self.RecordResize),
            "record_quorum": ("RecordQuorum", self.RecordQuorum),
        }
        self._audit_streams = audit_streams if audit_streams is not None else StreamCaps()
        self._audit_stall_s = audit_stall_s
        self._metrics = metrics if metrics is not None else Metrics()
        latency = self._metrics.latency
        # Bound once so that the hot path does no dictionary or label lookups.
        self._join_seconds = latency["JoinGroup"]
        self._join_groups_seconds = latency["JoinGroups"]
        self._reserve_seconds = latency["Reserve"]
        self._attest_seconds = latency["Attest"]
        self._leave_seconds = latency["LeaveGroup"]
        self._get_seconds = latency["GetGroup"]
        self._restore_seconds = latency["Restore"]
        self._audit_seconds = latency["ListAudit"]
        self._resize_seconds = latency["RecordResize"]
        self._quorum_seconds = latency["RecordQuorum"]
        self._session_seconds = latency["Session"]
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
        try:
            self._check_store()
            reply = await self._join(request, context)
        except Exception as exc:
            await self._fail("JoinGroup", exc, context, t0)
        self._join_seconds.observe(perf_counter() - t0)
        self._set_head(context)
        return reply

    async def JoinGroups(
        self, request: pb.JoinGroupsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.JoinGroupsResponse:
        t0 = perf_counter()
        try:
            self._check_store()
            joins = _joins_of(request)
            try:
                # The first join to fail cancels the others (their barriers are left).
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._join(j, context)) for j in joins]
            except BaseExceptionGroup as failed:
                raise _first(failed) from None
        except Exception as exc:
            await self._fail("JoinGroups", exc, context, t0)
        self._join_groups_seconds.observe(perf_counter() - t0)
        self._set_head(context)
        return pb.JoinGroupsResponse(results=[t.result() for t in tasks])

    async def _join(
        self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.JoinGroupResponse:
        r = await self._coord.join(
            request.job,
            request.group,
            rank=request.rank,
            world_size=request.world_size,
            member_id=request.member_id,
            member_secret=request.member_secret,
            job_seed=request.job_seed if request.HasField("job_seed") else None,
            timeout_s=self._coord.wait_s(_timeout_s(request), context.time_remaining()),
            actor=_actor(request.rank, request.member_id, context),
            peer=context.peer(),
            include_members=request.include_members,
            launch=request.launch,
            restart_count=request.restart_count,
            takeover=request.takeover,
            position=request.position,
        )
        reply = r.to_pb(include_members=request.include_members)
        reply.store_id = self._store_id
        return reply

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ReserveResponse:
        t0 = perf_counter()
        try:
            self._check_store()
            r = await self._coord.reserve(
                _caller(request, context),
                seq=request.seq,
                size=request.size,
                fingerprint=request.fingerprint,
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
                _caller(request, context),
                anchor_seq=request.anchor_seq,
                ops=request.ops,
                fingerprint=request.fingerprint,
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
            await self._coord.leave(_caller(request, context))
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
        try:
            self._check_store()
            r = await self._coord.restore(
                _caller(request, context),
                seq=request.seq,
                cursor=request.cursor,
                force=request.force,
                timeout_s=self._coord.wait_s(_timeout_s(request), context.time_remaining()),
                from_job=request.from_job,
            )
        except Exception as exc:
            await self._fail("Restore", exc, context, t0)
        self._restore_seconds.observe(perf_counter() - t0)
        return r.to_pb()

    async def RecordResize(
        self, request: pb.RecordResizeRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RecordResizeResponse:
        t0 = perf_counter()
        try:
            self._check_store()
            existing = await self._coord.record_resize(
                _caller(request, context),
                saved_group=request.saved_group,
                saved_cursor=request.saved_cursor,
            )
        except Exception as exc:
            await self._fail("RecordResize", exc, context, t0)
        self._resize_seconds.observe(perf_counter() - t0)
        return pb.RecordResizeResponse(existing=existing)

    async def RecordQuorum(
        self, request: pb.RecordQuorumRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RecordQuorumResponse:
        t0 = perf_counter()
        try:
            self._check_store()
            existing = await self._coord.record_quorum(
                _caller(request, context),
                quorum_id=request.quorum_id,
                step=request.step,
                participants=request.participants,
                healed_from=request.healed_from,
            )
        except Exception as exc:
            await self._fail("RecordQuorum", exc, context, t0)
        self._quorum_seconds.observe(perf_counter() - t0)
        return pb.RecordQuorumResponse(existing=existing)

    async def ListAudit(  # type: ignore[override]
        self, request: pb.ListAuditRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> None:
        # A write waits until HTTP/2 flow control lets the record out, and the next page is
        # read only once the last record of this one was written. So a stream its client does
        # not read holds one small page of records and gRPC's state for the call (about
        # 40 KB; measured in docs/design.md §11.4), never the log; the caps per peer host and
        # per process bound how many such streams there are, and a write the client does not
        # take for `audit_stall_s` ends the stream.
        t0 = perf_counter()
        host = peer_host(context.peer())
        admitted = stalled = False
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
            self._audit_streams.take(host)
            admitted = True
            async for record in records:
                try:
                    await asyncio.wait_for(context.write(record.to_pb()), self._audit_stall_s)
                except TimeoutError:
                    stalled = True
                    break
        except Exception as exc:
            await self._fail("ListAudit", exc, context, t0)
        finally:
            if admitted:
                self._audit_streams.give(host)
        if stalled:
            # Its client reads nothing, so it will hardly see this status: ending the call is
            # what frees the stream's place and its page.
            self._metrics.error(grpc.StatusCode.DEADLINE_EXCEEDED)
            event(
                _log,
                logging.WARNING,
                "audit_stream_stalled",
                peer=context.peer(),
                stalled_s=self._audit_stall_s,
            )
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the client took no audit record for {self._audit_stall_s:g} s, so the server "
                "ended the stream; open it again (from since_us) to go on",
            )
        self._audit_seconds.observe(perf_counter() - t0)

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[pb.SessionResponse]:
        t0 = perf_counter()
        try:
            self._check_store()
            async for response in session.serve(
                request_iterator,
                context,
                handlers=self._session_handlers,
                admit=self._admit,
                caps=self._sessions,
            ):
                yield response
        except session.SessionEnded as ended:
            status = rpc_status.to_status(ended.status)
            self._metrics.error(status.code)
            await context.abort(status.code, status.details, status.trailing_metadata)
        except Exception as exc:
            await self._fail("Session", exc, context, t0)
        self._session_seconds.observe(perf_counter() - t0)

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


#: The most joins one JoinGroups carries: a rank's root mesh and its sub-meshes.
MAX_JOINS = 16


def _joins_of(request: pb.JoinGroupsRequest) -> list[pb.JoinGroupRequest]:
    """The joins of `request`, each under the request's job; InvalidArgument where the joins
    are none, too many, of another job, or of one group twice."""
    count = len(request.joins)
    if not 1 <= count <= MAX_JOINS:
        raise InvalidArgument(
            f"JoinGroups carries {count} joins; it takes 1 to {MAX_JOINS}",
            field="joins",
            value=count,
        )
    joins, groups = [], set()
    for join in request.joins:
        if join.job and join.job != request.job:
            raise InvalidArgument(
                f"a join of JoinGroups names job {join.job[:128]!r}, but the request is for "
                f"job {request.job[:128]!r}: one call joins groups of one job",
                field="joins.job",
                value=join.job[:128],
            )
        if join.group in groups:
            raise InvalidArgument(
                f"JoinGroups joins group {join.group[:128]!r} twice",
                field="joins.group",
                value=join.group[:128],
            )
        groups.add(join.group)
        copy = pb.JoinGroupRequest()
        copy.CopyFrom(join)
        copy.job = request.job
        joins.append(copy)
    return joins


def _first(failed: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of `failed` that is not a cancellation (else the first leaf)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [failed]
    while pending:
        e = pending.pop(0)
        if isinstance(e, BaseExceptionGroup):
            pending[:0] = list(e.exceptions)
        else:
            leaves.append(e)
    return next((e for e in leaves if not isinstance(e, asyncio.CancelledError)), leaves[0])


def _timeout_s(request: pb.JoinGroupRequest | pb.RestoreRequest) -> float | None:
    """A JoinGroup's or Restore's wait as the request asks it; None for the default."""
    return request.timeout_ms / 1000 if request.timeout_ms else None


def _caller(
    request: pb.ReserveRequest
    | pb.AttestRequest
    | pb.LeaveGroupRequest
    | pb.RestoreRequest
    | pb.RecordResizeRequest
    | pb.RecordQuorumRequest,
    context: grpc.aio.ServicerContext[object, object],
) -> Caller:
    """Who asks, as which member: the request's member fields, the token's identity and the
    peer address."""
    return Caller(
        request.job,
        request.group,
        request.epoch,
        request.rank,
        request.member_id,
        request.member_secret,
        _actor(request.rank, request.member_id, context),
        context.peer(),
    )
