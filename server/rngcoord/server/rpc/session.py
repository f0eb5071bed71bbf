"""The Session stream: a process's member calls as messages on one bidirectional stream.

Each SessionRequest is served by the same servicer handler as its unary RPC, through a
`MessageContext` that stands in for the call's context: the same Coordinator code, auth
(`admit`, once per request), limits and errors, whose status travels back in the response
instead of ending a call. Requests are served concurrently and answered in completion order.
A stream holds at most `MAX_IN_FLIGHT` requests (served, or answered and not yet taken) and
reads no more while `MAX_UNTAKEN` answers wait for its client, so a client that floods or
never reads holds a bounded amount of the server; `StreamCaps` bounds the streams of each
peer host. When the stream ends, however it ends, the
requests still in flight are cancelled, as their unary calls would be (a waiting join leaves
its barrier). docs/design.md §7.7.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn

import grpc
from google.rpc import status_pb2

from rngcoord.server.addresses import peer_host
from rngcoord.server.errors import CoordinatorError, InvalidArgument
from rngcoord.server.logs import event, get_logger
from rngcoord.server.rpc.gate import StreamCaps
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import HEAD_TRAILER, rich_status

__all__ = ["MAX_IN_FLIGHT", "MAX_UNTAKEN", "MessageContext", "SessionEnded", "serve"]

#: Requests one stream holds at once: served, or answered but not yet taken by its client.
#: Joins wait in it for their barriers, so it is the most ranks of one barrier that one stream
#: can carry (unary calls have the like in the per-connection stream cap).
MAX_IN_FLIGHT = 4096
#: Answers that may wait for the client before the stream reads no more requests.
MAX_UNTAKEN = 64

_log = get_logger("session")
_READER_DONE = object()
#: Where grpcio-status puts the serialized google.rpc.Status (rpc_status.to_status).
_DETAILS_KEY = "grpc-status-details-bin"

Handler = Callable[[Any, Any], Awaitable[Any]]
Admit = Callable[[str, Any, str, Any], "grpc.Status | None"]


class SessionEnded(Exception):
    """A request, or the whole stream, ended with `status`: what `abort` ends a unary call
    with. The servicer ends the stream with it when `serve` raises it."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


class MessageContext:
    """The part of a call's context that the servicer's handlers use, for one request.

    Args:
        peer: the stream's peer address.
        metadata: the stream's invocation metadata.
        deadline: the request's deadline on the monotonic clock; None for none.
    """

    def __init__(self, peer: str, metadata: Any, deadline: float | None) -> None:
        self._peer = peer
        self._metadata = metadata
        self._deadline = deadline
        self.head = ""

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> Any:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Any) -> None:
        for key, value in metadata:
            if key == HEAD_TRAILER:
                self.head = value

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        self.set_trailing_metadata(trailing_metadata)
        raise SessionEnded(_status_of(code, details, trailing_metadata))


def _status_of(code: grpc.StatusCode, details: str, trailing_metadata: Any) -> status_pb2.Status:
    for key, value in trailing_metadata or ():
        if key == _DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return status_pb2.Status(code=code.value[0], message=details)


def _status(refusal: grpc.Status | CoordinatorError) -> status_pb2.Status:
    if isinstance(refusal, CoordinatorError):
        refusal = rich_status(refusal.code, refusal.message, refusal.reason_name, refusal.metadata)
    return _status_of(refusal.code, refusal.details, refusal.trailing_metadata)


async def serve(
    requests: AsyncIterator[Any],
    context: grpc.aio.ServicerContext[Any, Any],
    *,
    handlers: Mapping[str, tuple[str, Handler]],
    admit: Admit | None,
    caps: StreamCaps,
) -> AsyncIterator[pb.SessionResponse]:
    """Serve one Session stream: answer each request of `requests` with the handler that
    `handlers` names for its call (oneof field -> (method, handler)), after `admit` (None:
    every request is admitted). Raises what ends the stream: a `CoordinatorError` when `caps`
    refuse it, or when a message does not decode (no id to answer it by)."""
    peer = context.peer()
    metadata = context.invocation_metadata()
    host = peer_host(peer)
    caps.take(host)
    room = asyncio.Semaphore(MAX_IN_FLIGHT)
    # Answers; None: a request was withdrawn, and its place freed (the loop below wakes to see
    # it); _READER_DONE: the reader ended.
    answers: asyncio.Queue[Any] = asyncio.Queue()
    untaken = [0]  # answers in `answers`
    taken = asyncio.Event()  # set when an answer is taken
    tasks: dict[int, asyncio.Task[None]] = {}

    def put(response: pb.SessionResponse) -> None:
        untaken[0] += 1
        answers.put_nowait(response)

    async def answer(message: pb.SessionRequest, kind: str) -> None:
        method, handler = handlers[kind]
        request = getattr(message, kind)
        deadline_s = message.deadline_ms / 1000 if message.deadline_ms else None
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        ctx = MessageContext(peer, metadata, deadline)
        response = pb.SessionResponse(id=message.id)
        try:
            refusal = admit(method, request, peer, metadata) if admit is not None else None
            if refusal is not None:
                raise SessionEnded(_status(refusal))
            if deadline_s is None:
                reply = await handler(request, ctx)
            else:
                async with asyncio.timeout(deadline_s):
                    reply = await handler(request, ctx)
            getattr(response, kind).CopyFrom(reply)
        except SessionEnded as answered:
            response.error = answered.status.SerializeToString()
        except TimeoutError:
            response.error = status_pb2.Status(
                code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="Deadline Exceeded"
            ).SerializeToString()
        except Exception:
            # The handlers turn every failure into a status; this is a bug in between. The
            # request still gets an answer (an unanswered one would hold its place forever).
            incident = uuid.uuid4().hex[:12]
            event(
                _log,
                logging.ERROR,
                "session_request_failed",
                exc_info=True,
                peer=peer,
                method=method,
                incident=incident,
            )
            response.ClearField("reply")
            text = f"internal error in {method}; the server logged it as incident {incident}"
            response.error = _status(
                rich_status(
                    grpc.StatusCode.INTERNAL,
                    text,
                    pb.ErrorReason.Name(pb.INTERNAL_ERROR),
                    {"incident": incident},
                )
            ).SerializeToString()
        response.audit_head = ctx.head
        # Gone from `tasks` before its answer is queued: the loop below ends the stream once
        # the reader is done, no task is left and every answer is taken.
        del tasks[message.id]
        put(response)

    def refuse(message: pb.SessionRequest, error: InvalidArgument) -> None:
        status = _status(error).SerializeToString()
        put(pb.SessionResponse(id=message.id, error=status))

    def withdrawn(task: asyncio.Task[None], *, request_id: int) -> None:
        if not task.cancelled():
            return  # answered: `answer` took it out of `tasks`
        del tasks[request_id]
        room.release()  # no answer will take its place
        answers.put_nowait(None)

    async def read() -> None:
        async for message in requests:
            if not isinstance(message, pb.SessionRequest):
                status = admit("Session", message, peer, metadata) if admit is not None else None
                raise SessionEnded(
                    _status(
                        status
                        if status is not None
                        else InvalidArgument("a Session message could not be decoded")
                    )
                )
            kind = message.WhichOneof("call")
            if kind == "cancel":
                task = tasks.get(message.id)
                if task is not None:
                    task.cancel()
                continue
            while untaken[0] >= MAX_UNTAKEN:  # the client reads too slowly: read no more
                taken.clear()
                await taken.wait()
            await room.acquire()
            if kind is None:
                refuse(message, InvalidArgument(f"Session request {message.id} holds no call"))
            elif message.id in tasks:
                refuse(
                    message,
                    InvalidArgument(
                        f"Session request id {message.id} is already in flight on this stream: "
                        "ids must be unique among the requests in flight"
                    ),
                )
            else:
                task = asyncio.create_task(answer(message, kind))
                tasks[message.id] = task
                task.add_done_callback(functools.partial(withdrawn, request_id=message.id))

    reader = asyncio.create_task(read())
    # The reader's end wakes the loop below through the same queue as the answers, so one
    # `get` waits for either (a wait on both would cost a task and a future per answer).
    reader.add_done_callback(lambda _: answers.put_nowait(_READER_DONE))
    reading = True
    try:
        while reading or tasks or not answers.empty():
            response = await answers.get()
            if response is _READER_DONE:
                reading = False
                if not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                continue
            if response is None:
                continue
            yield response
            untaken[0] -= 1
            taken.set()
            room.release()
    finally:
        reader.cancel()
        for task in list(tasks.values()):
            task.cancel()
        caps.give(host)
