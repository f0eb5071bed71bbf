"""The client side of the Session stream: member calls as messages on one stream per target.

`SessionStub` stands where a generated `CoordinatorStub` stands in `CoordinatorClient`: its
member calls (JoinGroup, JoinGroups, Reserve, Attest, LeaveGroup, GetGroup, Restore,
RecordResize) send a message on the target's stream and wait for the answer with that id;
anything else (ListAudit) is the unary stub's. A failed answer raises a `grpc.RpcError` that
carries the same code, details and trailing metadata (ErrorInfo, audit head) as the unary
call's, so the client's one retry and error path serves both. When the stream breaks, its
unanswered calls fail with the stream's status (UNAVAILABLE for a lost server), the retry
logic sends them again, and the next call opens a new stream: member calls are idempotent.
docs/design.md §7.7.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
from google.rpc import status_pb2

from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import HEAD_TRAILER

__all__ = ["SessionStub"]

_METHOD = "/rngcoord.v1.Coordinator/Session"
_DETAILS_KEY = "grpc-status-details-bin"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END = object()
# Stub attribute -> SessionRequest field.
_CALLS = {
    "JoinGroup": "join_group",
    "JoinGroups": "join_groups",
    "Reserve": "reserve",
    "Attest": "attest",
    "LeaveGroup": "leave_group",
    "GetGroup": "get_group",
    "Restore": "restore",
    "RecordResize": "record_resize",
    "RecordQuorum": "record_quorum",
}


class SessionError(grpc.RpcError, grpc.Call):
    """A failed answer on a Session stream, shaped as the unary call's failure."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, Any], ...] = ()
    ) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._trailers = trailers

    @classmethod
    def of(cls, error: bytes, head: str) -> SessionError:
        status = status_pb2.Status.FromString(error)
        trailers: tuple[tuple[str, Any], ...] = ((_DETAILS_KEY, error),)
        if head:
            trailers += ((HEAD_TRAILER, head),)
        return cls(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message, trailers)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers

    def initial_metadata(self) -> Any:
        return ()

    def debug_error_string(self) -> str:
        return f"{self._code.name}: {self._details}"

    # grpc.Call's RPC-context half, which a finished answer has no use for.
    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


class _Answer:
    """What `with_call` returns beside the reply: the trailing metadata the unary call's
    reply would carry (the audit head)."""

    def __init__(self, head: str) -> None:
        self._trailers = ((HEAD_TRAILER, head),) if head else ()

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


class _Stream:
    """One Session stream: a queue of requests out, a thread that reads the answers in."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._out: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[pb.SessionResponse]] = {}
        self.broken: grpc.RpcError | None = None
        call = channel.stream_stream(
            _METHOD,
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
        )
        self._responses: Any = call(self._requests(), metadata=metadata)
        threading.Thread(target=self._read, name="rngcoord-session", daemon=True).start()

    def _requests(self) -> Iterator[pb.SessionRequest]:
        while True:
            item = self._out.get()
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def send(self, request: pb.SessionRequest) -> Future[pb.SessionResponse]:
        answer: Future[pb.SessionResponse] = Future()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            self._pending[request.id] = answer
        self._out.put(request)
        return answer

    def withdraw(self, request_id: int) -> None:
        with self._lock:
            if self._pending.pop(request_id, None) is None or self.broken is not None:
                return
        self._out.put(pb.SessionRequest(id=request_id, cancel=True))

    def close(self) -> None:
        self._out.put(_END)
        self._responses.cancel()

    def _read(self) -> None:
        error: grpc.RpcError
        try:
            for response in self._responses:
                with self._lock:
                    answer = self._pending.pop(response.id, None)
                if answer is not None:
                    answer.set_result(response)
            error = SessionError(
                grpc.StatusCode.UNAVAILABLE, "the coordinator ended the Session stream"
            )
        except grpc.RpcError as e:  # the stream's own status: the server is gone, or refused
            error = e
        with self._lock:
            self.broken = error
            pending, self._pending = self._pending, {}
        self._out.put(_END)
        for answer in pending.values():
            answer.set_exception(error)


class _Method:
    """One member call of a `SessionStub`, callable as the generated stub's method is."""

    def __init__(self, stub: SessionStub, field: str) -> None:
        self._stub = stub
        self._field = field

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Any:
        return self.with_call(request, timeout=timeout, metadata=metadata)[0]

    def with_call(
        self, request: Any, timeout: float | None = None, metadata: Any = None
    ) -> tuple[Any, _Answer]:
        # `metadata` is the stream's (the client's token), sent once when it opened.
        response = self._stub.ask(self._field, request, timeout)
        if response.WhichOneof("reply") == "error":
            raise SessionError.of(response.error, response.audit_head)
        return getattr(response, self._field), _Answer(response.audit_head)


class SessionStub:
    """The member calls of one coordinator target on a Session stream.

    Args:
        channel: the target's channel.
        metadata: the stream's metadata (the bearer token), sent when it opens.
    """

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._channel = channel
        self._metadata = metadata
        self._unary = pb_grpc.CoordinatorStub(channel)
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self._closed = False
        for name, field in _CALLS.items():
            setattr(self, name, _Method(self, field))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._unary, name)  # ListAudit: unary, as it always is

    def ask(self, field: str, request: Any, timeout: float | None) -> pb.SessionResponse:
        """Send `request` as the `field` call and wait up to `timeout` s for its answer."""
        message = pb.SessionRequest(id=next(self._ids), **{field: request})
        if timeout is not None:
            message.deadline_ms = max(1, round(timeout * 1000))
        stream = self._open()
        answer = stream.send(message)
        try:
            return answer.result(timeout)
        except TimeoutError:
            stream.withdraw(message.id)
            raise SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def _open(self) -> _Stream:
        with self._lock:
            if self._closed:
                raise SessionError(grpc.StatusCode.CANCELLED, "the client was closed")
            stream = self._stream
            if stream is None or stream.broken is not None:
                stream = self._stream = _Stream(self._channel, self._metadata)
            return stream

    def close(self) -> None:
        """End the stream; calls waiting on it fail with CANCELLED."""
        with self._lock:
            self._closed = True
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
