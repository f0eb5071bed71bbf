"""Per-job bearer tokens: the token file and the gRPC server interceptor that checks them.

Token file format (RNGCOORD_TOKENS / `rngcoord serve --tokens`): one `JOB TOKEN` pair per
line, separated by whitespace. Blank lines and lines starting with `#` are ignored. A job may
have several tokens (for rotation). The job `*` is the admin: its tokens are valid for every
job and for a ListAudit without a job filter.

Every Coordinator RPC must carry the metadata `authorization: Bearer <token>`, where the token
belongs to the request's `job` field (or is an admin token). Anything else ends the call with
UNAUTHENTICATED before the servicer sees it. The health and reflection services are open.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from rngcoord.v1 import coordinator_pb2
from rngcoord.v1.rules import RuleViolation, check_name
from rngcoord.v1.status import rich_status

ADMIN = "*"
SERVICE_PREFIX = f"/{coordinator_pb2.DESCRIPTOR.services_by_name['Coordinator'].full_name}/"

_BEARER = "bearer "


def load_tokens(path: str | Path) -> dict[str, tuple[bytes, ...]]:
    """Parse a token file into {job: tokens}; the admin's tokens are under "*".

    Raises ValueError naming the file and line of the first malformed entry, or when the file
    lists no token at all (every request would be refused).
    """
    tokens: dict[str, list[bytes]] = {}
    text = Path(path).read_text(encoding="utf-8")
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(
                f"{path}:{lineno}: expected 'JOB TOKEN', got {len(parts)} fields: {line[:80]!r}"
            )
        job, token = parts
        if job != ADMIN:
            try:
                check_name("job", job)
            except RuleViolation as exc:
                raise ValueError(f"{path}:{lineno}: {exc}, nor '*'") from None
        tokens.setdefault(job, []).append(token.encode("utf-8"))
    if not tokens:
        raise ValueError(f"token file {path} lists no tokens; every request would be refused")
    return {job: tuple(values) for job, values in tokens.items()}


if TYPE_CHECKING:
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:  # grpc's runtime class is not generic; only its type stubs are.
    _ServerInterceptor = grpc.aio.ServerInterceptor


class TokenAuthInterceptor(_ServerInterceptor):
    """Refuses Coordinator RPCs whose bearer token does not belong to the request's job.

    Args:
        tokens: {job: accepted tokens}, as `load_tokens` returns; "*" holds admin tokens.
        on_reject: called once per refused call (the server counts them). Default: nothing.

    It caches the wrapped handler per method, so it builds no handler object per call. The
    check runs in the handler, where the request (and so its job) is known.
    """

    def __init__(
        self,
        tokens: Mapping[str, Sequence[bytes]],
        *,
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        self._admin = tuple(tokens.get(ADMIN, ()))
        self._tokens = {job: tuple(v) for job, v in tokens.items() if job != ADMIN}
        self._on_reject = on_reject
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

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
        wrapped = self._wrap(handler)
        self._wrapped[method] = wrapped
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def checked_unary(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> Any:
                await self._check(request, context)
                return await unary(request, context)  # type: ignore[arg-type]

            return grpc.unary_unary_rpc_method_handler(
                checked_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def checked_stream(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> Any:
                await self._check(request, context)
                return await stream(request, context)  # type: ignore[arg-type, misc]

            return grpc.unary_stream_rpc_method_handler(
                checked_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        raise TypeError(f"rngcoord has no client-streaming RPCs; cannot guard {handler!r}")

    async def _check(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        job: str = request.job
        token = _bearer_token(tuple(context.invocation_metadata() or ()))
        if token is not None and (
            _matches(token, self._tokens.get(job, ())) or _matches(token, self._admin)
        ):
            return
        if self._on_reject is not None:
            self._on_reject()
        if job:
            message = f"missing or wrong bearer token for job {job[:128]!r}"
        else:
            message = "missing or wrong bearer token: a request without a job needs the admin token"
        status = rich_status(
            grpc.StatusCode.UNAUTHENTICATED,
            message,
            coordinator_pb2.ErrorReason.Name(coordinator_pb2.BAD_TOKEN),
            {"job": job[:128]},
        )
        await context.abort(status.code, status.details, status.trailing_metadata)


def _bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            if value[: len(_BEARER)].lower() == _BEARER:
                return value[len(_BEARER) :].strip().encode("utf-8")
            return None
    return None


def _matches(token: bytes, accepted: Sequence[bytes]) -> bool:
    # Constant-time comparison for each candidate, so timing does not reveal a token's prefix.
    found = False
    for candidate in accepted:
        found |= hmac.compare_digest(token, candidate)
    return found
