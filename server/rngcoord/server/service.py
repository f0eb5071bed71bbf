"""The gRPC servicer: translates rngcoord.v1 messages to Coordinator calls and back.

It holds no domain logic. For every RPC it calls the transport-free `Coordinator`, turns a
`CoordinatorError` into the rich status it carries (code, message, and an ErrorInfo with its
reason and metadata), turns any other exception into INTERNAL (the traceback is logged under
an incident id; the caller gets only the id),
and counts the outcome in `Metrics`. Nothing is logged per request: the hot path (Reserve)
does a few attribute lookups, one Coordinator call and one response message.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from time import perf_counter
from typing import NoReturn

import grpc

from rngcoord.server.audit import canonical_json
from rngcoord.server.coordinator import Coordinator
from rngcoord.server.errors import CoordinatorError, Divergence
from rngcoord.server.logs import event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import rich_status

_log = get_logger("service")


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

    def JoinGroup(
        self, request: pb.JoinGroupRequest, context: grpc.ServicerContext
    ) -> pb.JoinGroupResponse:
        t0 = perf_counter()
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else None
        remaining = context.time_remaining()
        if timeout_s is not None and remaining is not None:
            # Waiting past the caller's own deadline would hold a thread for nobody.
            timeout_s = max(min(timeout_s, remaining), 0.001)
        try:
            r = self._coord.join(
                request.job,
                request.group,
                request.rank,
                request.world_size,
                request.member_id,
                request.job_seed if request.HasField("job_seed") else None,
                timeout_s,
                _actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            self._fail("JoinGroup", exc, context, t0)
        self._join_seconds.observe(perf_counter() - t0)
        return pb.JoinGroupResponse(
            epoch=r.epoch, seed=r.seed, start=r.start, job_seed=r.job_seed, members=r.members
        )

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        t0 = perf_counter()
        try:
            r = self._coord.reserve(
                request.job,
                request.group,
                request.epoch,
                request.seq,
                request.size,
                request.fingerprint,
                request.rank,
                request.member_id,
                _actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            self._fail("Reserve", exc, context, t0)
        (self._hits if r.existing else self._grants).inc()
        self._reserve_seconds.observe(perf_counter() - t0)
        return pb.ReserveResponse(
            lease=pb.Lease(
                group=r.group, epoch=r.epoch, seq=r.seq, seed=r.seed, start=r.start, end=r.end
            ),
            existing=r.existing,
        )

    def LeaveGroup(
        self, request: pb.LeaveGroupRequest, context: grpc.ServicerContext
    ) -> pb.LeaveGroupResponse:
        t0 = perf_counter()
        try:
            self._coord.leave(
                request.job,
                request.group,
                request.epoch,
                request.rank,
                request.member_id,
                _actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            self._fail("LeaveGroup", exc, context, t0)
        self._leave_seconds.observe(perf_counter() - t0)
        return pb.LeaveGroupResponse()

    def GetGroup(
        self, request: pb.GetGroupRequest, context: grpc.ServicerContext
    ) -> pb.GetGroupResponse:
        t0 = perf_counter()
        try:
            g = self._coord.get_group(request.job, request.group)
        except Exception as exc:
            self._fail("GetGroup", exc, context, t0)
        self._get_seconds.observe(perf_counter() - t0)
        return pb.GetGroupResponse(
            job=g.job,
            group=g.group,
            seed=g.seed,
            epoch=g.epoch,
            members=g.members,
            high_water=g.high_water,
            leases=g.leases,
            job_seed=g.job_seed,
        )

    def Restore(
        self, request: pb.RestoreRequest, context: grpc.ServicerContext
    ) -> pb.RestoreResponse:
        t0 = perf_counter()
        try:
            r = self._coord.restore(
                request.job,
                request.group,
                request.epoch,
                request.seq,
                request.cursor,
                request.rank,
                request.member_id,
                _actor(request.rank, request.member_id, context),
            )
        except Exception as exc:
            self._fail("Restore", exc, context, t0)
        self._restore_seconds.observe(perf_counter() - t0)
        return pb.RestoreResponse(cursor=r.cursor, existing=r.existing)

    def ListAudit(
        self, request: pb.ListAuditRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AuditRecord]:
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
            for rec in records:
                yield pb.AuditRecord(
                    id=rec.id,
                    ts_us=rec.ts_us,
                    job=rec.job,
                    group=rec.group,
                    kind=rec.kind,
                    actor=rec.actor,
                    detail=canonical_json(rec.detail),
                    prev_hash=rec.prev_hash,
                    hash=rec.hash,
                )
        except Exception as exc:
            self._fail("ListAudit", exc, context, t0)
        self._audit_seconds.observe(perf_counter() - t0)

    def _fail(
        self, method: str, exc: Exception, context: grpc.ServicerContext, t0: float
    ) -> NoReturn:
        """Count and log the failure of `method`, then end the call with its status."""
        self._metrics.latency[method].observe(perf_counter() - t0)
        if isinstance(exc, CoordinatorError):
            if isinstance(exc, Divergence):
                self._metrics.divergences.inc()
            self._metrics.error(exc.code)
            context.abort_with_status(
                rich_status(exc.code, exc.message, exc.reason_name, exc.metadata)
            )
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
        context.abort_with_status(
            rich_status(
                grpc.StatusCode.INTERNAL,
                f"internal error in {method}; the server logged it as incident {incident}",
                pb.ErrorReason.Name(pb.INTERNAL_ERROR),
                {"incident": incident},
            )
        )


def _actor(rank: int, member_id: str, context: grpc.ServicerContext) -> str:
    """Who made a request, for the audit log: "rank 1 member m-abc @ ipv4:10.0.0.7:41234"."""
    return f"rank {rank} member {member_id[:128]} @ {context.peer()}"
