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
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from rngcoord.server.auth import Identity, TokenTable
from rngcoord.server.logs import event, get_logger
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import rich_status

__all__ = ["Gate", "PeerRateLimit", "current_identity", "peer_host"]

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


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: "ipv4:10.0.0.7:41234" -> "ipv4:10.0.0.7"."""
    if peer.startswith("unix:"):
        return "unix"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


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
    """

    def __init__(
        self,
        *,
        tokens: TokenTable | None,
        rate_limit: PeerRateLimit | None,
        on_refuse: Callable[[grpc.StatusCode], None] | None = None,
    ) -> None:
        self._tokens = tokens
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
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler  # type: ignore[return-value]
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
                await self._admit(name, request, context)
                return await unary(request, context)  # type: ignore[arg-type]

            return grpc.unary_unary_rpc_method_handler(
                gated_unary,
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def gated_stream(request: Any, context: _Context) -> Any:
                await self._admit(name, request, context)
                return await stream(request, context)  # type: ignore[arg-type, misc]

            return grpc.unary_stream_rpc_method_handler(
                gated_stream,
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        raise TypeError(f"rngcoord has no client-streaming RPCs; cannot gate {handler!r}")

    async def _admit(self, method: str, request: Any, context: _Context) -> None:
        """Return when the call may proceed (with its identity set); else end it."""
        if self._rate_limit is not None:
            wait_s = self._rate_limit.admit(peer_host(context.peer()))
            if wait_s:
                await self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    pb.RATE_LIMITED,
                    f"too many calls from {peer_host(context.peer())}: the limit is "
                    f"{self._rate_limit.rate:g}/s per peer host (burst "
                    f"{self._rate_limit.burst:g}); retry in {wait_s * 1000:.0f} ms",
                    peer=peer_host(context.peer()),
                    rate=f"{self._rate_limit.rate:g}",
                    retry_after_ms=f"{max(1, round(wait_s * 1000))}",
                )
        if isinstance(request, _Malformed):
            await self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                pb.MALFORMED_REQUEST,
                f"the {method} request could not be decoded as rngcoord.v1.{method}Request: "
                f"{type(request.error).__name__}",
                method=method,
            )
        tokens = self._tokens
        if tokens is None:
            return
        job: str = request.job
        token = _bearer_token(context.invocation_metadata())
        who = tokens.identify(token) if token is not None else None
        if who is None:
            self._log_refusal("unauthenticated", method, job, context, None)
            await self._refuse(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                pb.BAD_TOKEN,
                "missing or unknown bearer token (metadata `authorization: Bearer TOKEN`)",
                job=job[:128],
            )
        refusal = who.refusal(method, job, force=bool(getattr(request, "force", False)))
        if refusal is not None:
            self._log_refusal("not_permitted", method, job, context, who)
            await self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                pb.NOT_PERMITTED,
                refusal,
                job=job[:128],
                method=method,
                identity=who.name,
                role=who.role,
            )
        _identity.set(who)

    async def _refuse(
        self,
        context: _Context,
        code: grpc.StatusCode,
        reason: pb.ErrorReason.ValueType,
        message: str,
        **metadata: str,
    ) -> NoReturn:
        if self._on_refuse is not None:
            self._on_refuse(code)
        status = rich_status(code, message, pb.ErrorReason.Name(reason), metadata)
        await context.abort(status.code, status.details, status.trailing_metadata)
        raise AssertionError("context.abort returned")  # it always raises

    def _log_refusal(
        self, what: str, method: str, job: str, context: _Context, who: Identity | None
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
            peer=context.peer(),
            identity=who.name if who is not None else "",
            suppressed_before=suppressed,
        )


def _bearer_token(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            if value[: len(_BEARER)].lower() == _BEARER:
                return value[len(_BEARER) :].strip().encode("utf-8")
            return None
    return None
