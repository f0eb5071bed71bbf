"""The gate every Coordinator call passes before the servicer: rate, decoding, identity, role.

`Gate` is a gRPC server interceptor. For each call of the rngcoord.v1.Coordinator service it:

1. admits the call under its peer's rate limit (a token bucket per peer host: a flood from
   one address is answered RESOURCE_EXHAUSTED / RATE_LIMITED, with the time to wait);
2. refuses a request that does not decode as its message with INVALID_ARGUMENT /
   MALFORMED_REQUEST (gRPC itself would answer INTERNAL, which clients treat as a server bug);
3. when tokens are configured, finds the identity of the bearer token (UNAUTHENTICATED /
   BAD_TOKEN when there is none) and checks its role and jobs for this call (PERMISSION_DENIED /
   NOT_PERMITTED), logging each refusal with the peer and never the token;
4. runs the handler with `current_identity()` set, so that audit records name who asked.

The health and reflection services pass untouched. The token table can be replaced while
serving (`reload`, on SIGHUP): calls already admitted finish under the table they were
admitted with. The wrapped handler is built once per method, so a call costs a few attribute
lookups, a SHA-256 of its token, and the bucket arithmetic.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from rngcoord.server.addresses import peer_host
from rngcoord.server.auth import Identity, TokenTable
from rngcoord.server.errors import ResourceExhausted
from rngcoord.server.logs import event, get_logger
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import rich_status

__all__ = [
    "Gate",
    "PeerActivity",
    "PeerRateLimit",
    "RefusalLog",
    "StreamCaps",
    "current_identity",
]

SERVICE_PREFIX = f"/{pb.DESCRIPTOR.services_by_name['Coordinator'].full_name}/"

_identity: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "rngcoord_identity", default=None
)
_log = get_logger("gate")
_BEARER = "bearer "
_MAX_PEERS = 1 << 16
_REJECTION_LOGS_PER_S = 10.0


def current_identity() -> Identity | None:
    """The identity the current call was admitted as; None when tokens are off."""
    return _identity.get()


class PeerRateLimit:
    """A token bucket per peer host.

    Args:
        rate: calls per second each host may sustain.
        burst: calls a host may make at once after being idle.
        now: the clock. Default time.monotonic.

    At most 65,536 hosts are tracked; beyond that, the buckets that have refilled (their
    hosts idle) are forgotten, which loses nothing.
    """

    def __init__(
        self, rate: float, burst: float, *, now: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._now = now
        self._buckets: dict[str, list[float]] = {}

    def admit(self, host: str) -> float:
        """Take one call from `host`'s bucket; return 0, or the seconds until it may call."""
        now = self._now()
        bucket = self._buckets.get(host)
        if bucket is None:
            if len(self._buckets) >= _MAX_PEERS:
                self._forget_idle(now)
            bucket = self._buckets[host] = [self.burst, now]
        level = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if level >= 1:
            bucket[0] = level - 1
            return 0.0
        bucket[0] = level
        return (1 - level) / self.rate

    def _forget_idle(self, now: float) -> None:
        full = (self.burst - 1) / self.rate
        for host, (_, last) in list(self._buckets.items()):
            if now - last >= full:
                del self._buckets[host]


class RefusalLog:
    """Logs refusals at most once per peer host, event and reason per window, with a count.

    Args:
        window_s: the least time between two lines of one (host, event, reason). Default 10.
        now: the clock. Default time.monotonic.

    The first refusal is logged at once; later ones within the window are counted, and
    `flush()` (called a few times a second by the connection guard) logs the count once the
    window has passed. Safe to use from several threads.
    """

    def __init__(
        self, window_s: float = 10.0, *, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self._now = now
        self._lock = threading.Lock()
        # (host, event, reason) -> [time of its last line, refusals since, fields]
        self._keys: dict[tuple[str, str, str], list[Any]] = {}

    def note(self, host: str, name: str, reason: str, count: int = 1, **fields: Any) -> None:
        """`count` refusals of `host`: the event `name` for `reason`, with `fields`."""
        now = self._now()
        key = (host, name, reason)
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None and now - entry[0] < self.window_s:
                entry[1] += count
                entry[2] = fields
                return
            if len(self._keys) >= _MAX_PEERS:
                self._drop_quiet(now)
            self._keys[key] = [now, 0, fields]
        event(_log, logging.WARNING, name, peer=host, reason=reason, count=count, **fields)

    def flush(self) -> None:
        """Log the counts whose window has passed."""
        now = self._now()
        lines = []
        with self._lock:
            for key, entry in self._keys.items():
                if entry[1] and now - entry[0] >= self.window_s:
                    lines.append((key, entry[1], entry[2]))
                    entry[0], entry[1] = now, 0
        for (host, name, reason), count, fields in lines:
            event(_log, logging.WARNING, name, peer=host, reason=reason, count=count, **fields)

    def _drop_quiet(self, now: float) -> None:
        quiet = [k for k, e in self._keys.items() if not e[1] and now - e[0] >= self.window_s]
        for key in quiet:
            del self._keys[key]


class PeerActivity:
    """Calls in flight, and when the last one ended, per connection (gRPC's peer string,
    "ipv4:10.0.0.7:41234", names one connection): what tells the connection guard which
    connections are idle. Used on the event loop only.

    Args:
        now: the clock. Default time.monotonic.
    """

    def __init__(self, *, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._in_flight: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def begin(self, peer: str) -> None:
        """A call of `peer` starts."""
        self._in_flight[peer] = self._in_flight.get(peer, 0) + 1

    def end(self, peer: str) -> None:
        """A call of `peer` ended."""
        left = self._in_flight.get(peer, 1) - 1
        if left > 0:
            self._in_flight[peer] = left
        else:
            self._in_flight.pop(peer, None)
        self._last[peer] = self._now()

    def in_flight(self, peer: str) -> int:
        """Calls of `peer` in flight now."""
        return self._in_flight.get(peer, 0)

    def last_call(self, peer: str) -> float | None:
        """When the last call of `peer` ended (the clock's time), or None: none yet."""
        return self._last.get(peer)

    def forget(self, keep: set[str]) -> None:
        """Forget the connections not in `keep` (closed) that have no call in flight."""
        for peer in [p for p in self._last if p not in keep]:
            del self._last[peer]

    def forget_older(self, before: float) -> None:
        """Forget the connections whose last call ended before `before`: they count as idle
        for that long whether remembered or not."""
        if len(self._last) > _MAX_PEERS:
            for peer in [p for p, t in self._last.items() if t < before]:
                del self._last[peer]

    def __len__(self) -> int:
        return len(self._last)


class StreamCaps:
    """Open long-lived streams of one method (ListAudit, Session), counted per peer host and
    in all.

    Args:
        per_host: the most one peer host may hold open. Default 16.
        total: the most the process holds open. Default 256.
        refusals: where refusals are logged. Default None: they are not.
        method: the streams' RPC, for messages and logs. Default ``"ListAudit"``.

    Each open stream costs memory for as long as it is open (a page of records and gRPC's
    state for the call), so the number of them is what bounds that memory; the per-host cap
    keeps one host from taking the whole process's share.
    """

    def __init__(
        self,
        per_host: int = 16,
        total: int = 256,
        *,
        refusals: RefusalLog | None = None,
        method: str = "ListAudit",
    ) -> None:
        if per_host < 1 or total < 1:
            raise ValueError(f"stream caps must be at least 1, got {per_host}, {total}")
        self.method = method
        self.per_host = per_host
        self.total = total
        self._refusals = refusals
        self._open: dict[str, int] = {}
        self._count = 0

    def take(self, host: str) -> None:
        """Count one more stream of `host`, or raise ResourceExhausted / TOO_MANY_STREAMS."""
        held = self._open.get(host, 0)
        if held >= self.per_host or self._count >= self.total:
            scope = "host" if held >= self.per_host else "server"
            if self._refusals is not None:
                self._refusals.note(
                    host,
                    "audit_stream_refused" if self.method == "ListAudit" else "session_refused",
                    f"{scope}_cap",
                    limit=self.per_host if scope == "host" else self.total,
                )
        if held >= self.per_host:
            raise ResourceExhausted(
                f"{host} already has {held} {self.method} streams open, the most one peer host "
                "may have: end or cancel one first",
                reason=pb.TOO_MANY_STREAMS,
                peer=host,
                limit=self.per_host,
                scope="host",
                method=self.method,
            )
        if self._count >= self.total:
            raise ResourceExhausted(
                f"the server already has {self._count} {self.method} streams open, the most it "
                "serves at once: retry later",
                reason=pb.TOO_MANY_STREAMS,
                peer=host,
                limit=self.total,
                scope="server",
                method=self.method,
            )
        self._open[host] = held + 1
        self._count += 1

    def give(self, host: str) -> None:
        """One stream of `host` ended."""
        held = self._open.get(host, 0) - 1
        if held > 0:
            self._open[host] = held
        else:
            self._open.pop(host, None)
        self._count -= 1

    def open_streams(self, host: str | None = None) -> int:
        """Streams open now: of `host`, or in all."""
        return self._count if host is None else self._open.get(host, 0)


class _Malformed:
    """What a request that did not decode becomes, so that the gate can refuse it precisely."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


if TYPE_CHECKING:
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:  # grpc's runtime class is not generic; only its type stubs are.
    _ServerInterceptor = grpc.aio.ServerInterceptor

_Context = grpc.aio.ServicerContext[Any, Any]


class Gate(_ServerInterceptor):
    """Admits, decodes, authenticates and authorizes Coordinator calls.

    Args:
        tokens: the token table; None turns authentication off (every caller may do
            everything; the server logs a warning at start).
        rate_limit: the per-peer-host limit; None for none.
        on_refuse: called with the status code of each call the gate refuses (the server
            counts them). Default: nothing.
        activity: where the calls of each connection are counted, for every service (the
            connection guard closes idle connections by it). Default None: not counted.
    """

    def __init__(
        self,
        *,
        tokens: TokenTable | None,
        rate_limit: PeerRateLimit | None,
        on_refuse: Callable[[grpc.StatusCode], None] | None = None,
        activity: PeerActivity | None = None,
    ) -> None:
        self._tokens = tokens
        self._activity = activity
        self._rate_limit = rate_limit
        self._on_refuse = on_refuse
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._log_budget = _REJECTION_LOGS_PER_S
        self._log_refill = time.monotonic()
        self._suppressed = 0

    def reload(self, tokens: TokenTable) -> None:
        """Use `tokens` for the calls admitted from now on."""
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method: str = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        # None for an unknown method, whatever the stubs say: gRPC answers UNIMPLEMENTED.
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:
            return handler  # type: ignore[return-value]
        if not method.startswith(SERVICE_PREFIX):
            # Health checks and reflection pass untouched, but their calls are counted: a
            # connection watching health is not idle.
            if self._activity is None:
                return handler
            wrapped = _counted(handler, self._activity)
        else:
            wrapped = self._wrap(method.removeprefix(SERVICE_PREFIX), handler)
        self._wrapped[method] = wrapped
        return wrapped

    def _wrap(
        self, name: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        decode = handler.request_deserializer

        def safe_decode(data: bytes) -> Any:
            try:
                return decode(data) if decode is not None else data
            except Exception as exc:  # DecodeError, or a field that is not valid UTF-8
                return _Malformed(exc)

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def gated_unary(request: Any, context: _Context) -> Any:
                activity = self._activity
                if activity is None:
                    await self._admit(name, request, context)
                    return await unary(request, context)  # type: ignore[arg-type]
                peer = context.peer()
                activity.begin(peer)
                try:
                    await self._admit(name, request, context)
                    return await unary(request, context)  # type: ignore[arg-type]
                finally:
                    activity.end(peer)

            return grpc.unary_unary_rpc_method_handler(
                gated_unary,
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def gated_stream(request: Any, context: _Context) -> Any:
                activity = self._activity
                if activity is None:
                    await self._admit(name, request, context)
                    return await stream(request, context)  # type: ignore[arg-type, misc]
                peer = context.peer()
                activity.begin(peer)
                try:
                    await self._admit(name, request, context)
                    return await stream(request, context)  # type: ignore[arg-type, misc]
                finally:
                    activity.end(peer)

            return grpc.unary_stream_rpc_method_handler(
                gated_stream,
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            session = handler.stream_stream

            # Admission is per request: the servicer calls `admit` for each one (Session).
            async def gated_session(requests: Any, context: _Context) -> Any:
                activity = self._activity
                # Read once, at the start: once a stream is cancelled, its generator may be
                # closed after gRPC has freed the call, and context.peer() then crashes the
                # process (SIGSEGV in cygrpc).
                peer = context.peer()
                if activity is not None:
                    activity.begin(peer)
                try:
                    async for response in session(requests, context):  # type: ignore[arg-type, attr-defined]
                        yield response
                finally:
                    if activity is not None:
                        activity.end(peer)

            return grpc.stream_stream_rpc_method_handler(
                gated_session,
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        raise TypeError(f"rngcoord has no client-streaming RPCs; cannot gate {handler!r}")

    async def _admit(self, method: str, request: Any, context: _Context) -> None:
        """Return when the call may proceed (with its identity set); else end it."""
        refusal = self.admit(method, request, context.peer(), context.invocation_metadata())
        if refusal is not None:
            await context.abort(refusal.code, refusal.details, refusal.trailing_metadata)
            raise AssertionError("context.abort returned")  # it always raises

    def admit(self, method: str, request: Any, peer: str, metadata: Any) -> grpc.Status | None:
        """Admit one call of `method` (or one request of a Session stream) from `peer` with
        `metadata`: None when it may proceed, with `current_identity()` set in the calling
        context; else the status that refuses it (counted and logged here)."""
        try:
            _identity.set(self._identify(method, request, peer, metadata))
        except _Refused as refused:
            if self._on_refuse is not None:
                self._on_refuse(refused.status.code)
            return refused.status
        return None

    def _identify(self, method: str, request: Any, peer: str, metadata: Any) -> Identity | None:
        host = peer_host(peer)
        if self._rate_limit is not None:
            wait_s = self._rate_limit.admit(host)
            if wait_s:
                raise _Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    pb.RATE_LIMITED,
                    f"too many calls from {host}: the limit is {self._rate_limit.rate:g}/s per "
                    f"peer host (burst {self._rate_limit.burst:g}); retry in "
                    f"{wait_s * 1000:.0f} ms",
                    peer=host,
                    rate=f"{self._rate_limit.rate:g}",
                    retry_after_ms=f"{max(1, round(wait_s * 1000))}",
                )
        if isinstance(request, _Malformed):
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                pb.MALFORMED_REQUEST,
                f"the {method} request could not be decoded as rngcoord.v1.{method}Request: "
                f"{type(request.error).__name__}",
                method=method,
            )
        tokens = self._tokens
        if tokens is None:
            return None
        job: str = request.job
        token = _bearer_token(metadata)
        who = tokens.identify(token) if token is not None else None
        if who is None:
            self._log_refusal("unauthenticated", method, job, peer, None)
            raise _Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                pb.BAD_TOKEN,
                "missing or unknown bearer token (metadata `authorization: Bearer TOKEN`)",
                job=job[:128],
            )
        refusal = who.refusal(method, job, force=bool(getattr(request, "force", False)))
        if refusal is not None:
            self._log_refusal("not_permitted", method, job, peer, who)
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                pb.NOT_PERMITTED,
                refusal,
                job=job[:128],
                method=method,
                identity=who.name,
                role=who.role,
            )
        return who

    def _log_refusal(
        self, what: str, method: str, job: str, peer: str, who: Identity | None
    ) -> None:
        # A flood of bad calls must not become a flood of log lines: at most a few a second,
        # and the next line says how many were left out.
        now = time.monotonic()
        self._log_budget = min(
            _REJECTION_LOGS_PER_S,
            self._log_budget + (now - self._log_refill) * _REJECTION_LOGS_PER_S,
        )
        self._log_refill = now
        if self._log_budget < 1:
            self._suppressed += 1
            return
        self._log_budget -= 1
        suppressed, self._suppressed = self._suppressed, 0
        event(
            _log,
            logging.WARNING,
            f"call_{what}",
            method=method,
            job=job[:128],
            peer=peer,
            identity=who.name if who is not None else "",
            suppressed_before=suppressed,
        )


class _Refused(Exception):
    """A call the gate refuses, with the status that says why."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: pb.ErrorReason.ValueType,
        message: str,
        **metadata: str,
    ) -> None:
        super().__init__(message)
        self.status = rich_status(code, message, pb.ErrorReason.Name(reason), metadata)


def _counted(
    handler: grpc.RpcMethodHandler[Any, Any], activity: PeerActivity
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with its calls counted in `activity`; as it is when its behaviour is not a
    coroutine or an async generator (one that runs on a thread is left there)."""
    makers = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    kind = next((k for k in makers if getattr(handler, k) is not None), None)
    if kind is None:
        return handler
    behaviour = getattr(handler, kind)
    make: Any = makers[kind]
    counted: Any
    if inspect.isasyncgenfunction(behaviour):

        async def counted_gen(request: Any, context: _Context) -> Any:
            peer = context.peer()
            activity.begin(peer)
            try:
                async for item in behaviour(request, context):
                    yield item
            finally:
                activity.end(peer)

        counted = counted_gen
    elif inspect.iscoroutinefunction(behaviour):

        async def counted_call(request: Any, context: _Context) -> Any:
            peer = context.peer()
            activity.begin(peer)
            try:
                return await behaviour(request, context)
            finally:
                activity.end(peer)

        counted = counted_call
    else:
        return handler
    made: grpc.RpcMethodHandler[Any, Any] = make(
        counted,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    return made


def _bearer_token(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            if value[: len(_BEARER)].lower() == _BEARER:
                return value[len(_BEARER) :].strip().encode("utf-8")
            return None
    return None
