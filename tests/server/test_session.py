"""The Session stream on a real server: the same answers and refusals as the unary RPCs,
withdrawn requests, flow control, caps, malformed messages, and a stream broken by a killed
server, whose calls the client sends again on a new one (docs/design.md §7.7).
"""

from __future__ import annotations

import itertools
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from harness import CoordinatorFactory, CoordinatorProcess, LoopThread, join_all, secret_for
from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._errors import RNGCoordError
from rngcoord.client._session import SessionStub
from rngcoord.server.rpc import session
from rngcoord.server.rpc.gate import StreamCaps
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import error_info

JOB = "sessions"


def _reserve(group: str, epoch: int, seq: int, member: str, rank: int = 0) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        job=JOB,
        group=group,
        epoch=epoch,
        seq=seq,
        size=64,
        fingerprint=b"f",
        rank=rank,
        member_id=member,
        member_secret=secret_for(member),
    )


def _formed(server: CoordinatorProcess, group: str, world_size: int = 2) -> list[str]:
    """Form `group` over unary calls; its member ids by rank."""
    replies = join_all(server.stub(), JOB, group, world_size)
    return list(replies[0].members)


class RawStream:
    """A Session stream driven by hand: requests put in, answers read only when asked."""

    def __init__(self, channel: grpc.Channel, serializer: Any = None) -> None:
        self.sent = 0
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        call = channel.stream_stream(
            "/rngcoord.v1.Coordinator/Session",
            request_serializer=serializer or pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
        )
        self.responses: Any = call(self._requests())

    def _requests(self) -> Iterator[Any]:
        while (item := self._out.get()) is not None:
            self.sent += 1
            yield item

    def send(self, item: Any) -> None:
        self._out.put(item)

    def close(self) -> None:
        self._out.put(None)

    def take(self, n: int) -> list[pb.SessionResponse]:
        return [next(self.responses) for _ in range(n)]


def _refusal(call: Any) -> tuple[str, str | None, str | None, dict[str, str]]:
    """(exception type, code, reason, metadata) of what `call()` raises."""
    with pytest.raises(RNGCoordError) as caught:
        call()
    e = caught.value
    return type(e).__name__, e.code, e.reason, dict(e.metadata)


def _joined(client: CoordinatorClient, group: str, world_size: int) -> list[str]:
    """Join every rank of `group` through `client` (whose process knows the members'
    secrets, so any client of this process may act as them); member ids by rank."""
    members = [f"m{rank}-{uuid.uuid4().hex[:6]}" for rank in range(world_size)]

    def join(rank: int) -> Any:
        return client.join_group(
            JOB, group, rank=rank, world_size=world_size, member_id=members[rank]
        )

    with ThreadPoolExecutor(world_size) as pool:
        joined = list(pool.map(join, range(world_size)))
    assert all(j == joined[0] for j in joined)
    return members


def test_member_calls_answer_as_the_unary_calls_do(coordinator: CoordinatorProcess) -> None:
    session = CoordinatorClient(coordinator.address, session=True, outage_s=0)
    unary = CoordinatorClient(coordinator.address, outage_s=0)
    members = _joined(session, "g", 2)
    assert session.get_group(JOB, "g").epoch == 1
    for seq in range(4):
        granted = session.reserve(
            JOB, "g", epoch=1, seq=seq, size=64, fingerprint=b"f", rank=0, member_id=members[0]
        )
        assert not granted.existing
        # The unary call reads back the lease that the session's message granted.
        read = unary.reserve(
            JOB, "g", epoch=1, seq=seq, size=64, fingerprint=b"f", rank=0, member_id=members[0]
        )
        assert read.existing and (read.start, read.end, read.seed) == (
            granted.start,
            granted.end,
            granted.seed,
        )
    # The replies carry the audit head, as the unary trailers do.
    assert session.audit_head and session.audit_head.split(":")[0] == session.store_id
    assert session.get_group(JOB, "g") == unary.get_group(JOB, "g")
    session.leave_group(JOB, "g", epoch=1, rank=1, member_id=members[1])
    session.close()
    unary.close()


def test_refusals_carry_the_unary_calls_reason_and_metadata(
    coordinator: CoordinatorProcess,
) -> None:
    session = CoordinatorClient(coordinator.address, session=True, outage_s=0)
    unary = CoordinatorClient(coordinator.address, outage_s=0)
    members = _joined(session, "r", 2)
    cases = [
        # An epoch that does not exist, a group that does not exist, a stranger's member id.
        lambda c: c.reserve(
            JOB, "r", epoch=9, seq=0, size=64, fingerprint=b"f", rank=0, member_id=members[0]
        ),
        lambda c: c.get_group(JOB, "nowhere"),
        lambda c: c.reserve(
            JOB, "r", epoch=1, seq=0, size=64, fingerprint=b"f", rank=0, member_id="stranger"
        ),
        lambda c: c.reserve(
            JOB, "r", epoch=1, seq=0, size=0, fingerprint=b"f", rank=0, member_id=members[0]
        ),
    ]
    for case in cases:
        by_session = _refusal(lambda c=case: c(session))
        by_unary = _refusal(lambda c=case: c(unary))
        assert by_session == by_unary
    session.close()
    unary.close()


@pytest.mark.slow
def test_a_join_withdrawn_at_its_deadline_leaves_the_barrier(
    coordinator: CoordinatorProcess,
) -> None:
    stub = SessionStub(coordinator.channel(), ())
    request = pb.JoinGroupRequest(
        job=JOB,
        group="w",
        rank=0,
        world_size=2,
        member_id="early",
        member_secret=secret_for("early"),
        timeout_ms=30_000,
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.JoinGroup.with_call(request, timeout=0.5)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.3)  # the cancel message reaches the server
    # Rank 1 alone does not form an epoch with the withdrawn rank 0.
    late = pb.JoinGroupRequest(
        job=JOB,
        group="w",
        rank=1,
        world_size=2,
        member_id="late",
        member_secret=secret_for("late"),
        timeout_ms=1_000,
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.JoinGroup.with_call(late, timeout=10)
    info = error_info(caught.value)
    assert info is not None and info.reason == "JOIN_TIMEOUT", caught.value
    assert "[0]" in (caught.value.details() or "")  # rank 0 is named as the one missing
    stub.close()


def test_requests_are_answered_by_id_and_bad_ones_refused_alone(
    coordinator: CoordinatorProcess,
) -> None:
    members = _formed(coordinator, "ids")
    stream = RawStream(coordinator.channel())
    waiting = pb.JoinGroupRequest(
        job=JOB,
        group="other",
        rank=0,
        world_size=2,
        member_id="w0",
        member_secret=secret_for("w0"),
        timeout_ms=30_000,
    )
    stream.send(pb.SessionRequest(id=5, join_group=waiting))
    stream.send(pb.SessionRequest(id=5, get_group=pb.GetGroupRequest(job=JOB, group="ids")))
    stream.send(pb.SessionRequest(id=6))
    stream.send(pb.SessionRequest(id=7, reserve=_reserve("ids", 1, 0, members[0])))
    answers = {r.id: r for r in stream.take(3)}
    assert set(answers) == {5, 6, 7}
    assert answers[7].WhichOneof("reply") == "reserve" and answers[7].audit_head
    for request_id, words in ((5, "already in flight"), (6, "holds no call")):
        error = answers[request_id].error
        assert error, answers[request_id]
        status = status_pb2.Status.FromString(error)
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and words in status.message
    # Withdrawing the waiting join answers nothing; the stream goes on.
    stream.send(pb.SessionRequest(id=5, cancel=True))
    stream.send(pb.SessionRequest(id=8, get_group=pb.GetGroupRequest(job=JOB, group="ids")))
    (answer,) = stream.take(1)
    assert answer.id == 8 and answer.get_group.epoch == 1
    stream.close()
    assert list(stream.responses) == []  # half-closed, nothing in flight: the stream ends


@pytest.mark.slow
def test_a_stream_its_client_does_not_read_holds_back_and_others_are_served(
    coordinator: CoordinatorProcess,
) -> None:
    members = _formed(coordinator, "flood")
    stream = RawStream(coordinator.channel())
    count = 2000
    for i in range(count):
        stream.send(pb.SessionRequest(id=i, reserve=_reserve("flood", 1, i % 8, members[0])))
    time.sleep(1.0)
    # Nothing is read from the flooding stream, and another client is served meanwhile.
    with CoordinatorClient(coordinator.address, session=True, outage_s=0) as other:
        assert other.get_group(JOB, "flood").epoch == 1
    answers = stream.take(count)
    assert sorted(a.id for a in answers) == list(range(count))
    assert all(a.WhichOneof("reply") == "reserve" for a in answers)
    starts = {a.reserve.lease.seq: a.reserve.lease.start for a in answers}
    assert starts == {seq: seq * 64 for seq in range(8)}  # one lease per seq, however asked
    stream.close()


def test_one_stream_carries_every_rank_of_a_barrier_past_the_answer_window(
    coordinator: CoordinatorProcess,
) -> None:
    """300 ranks of one group join on one stream: all 300 wait in the barrier at once (more
    than the 64 answers that may wait untaken), and the epoch forms for every one."""
    stream = RawStream(coordinator.channel())
    world = 300
    for rank in range(world):
        member = f"b{rank}"
        join = pb.JoinGroupRequest(
            job=JOB,
            group="wide",
            rank=rank,
            world_size=world,
            member_id=member,
            member_secret=secret_for(member),
            timeout_ms=20_000,
        )
        stream.send(pb.SessionRequest(id=rank, join_group=join))
    answers = stream.take(world)
    assert sorted(a.id for a in answers) == list(range(world))
    assert {a.WhichOneof("reply") for a in answers} == {"join_group"}, answers[0]
    assert {a.join_group.epoch for a in answers} == {1}
    stream.close()


def test_undecodable_message_ends_the_stream_as_malformed(
    coordinator: CoordinatorProcess,
) -> None:
    stream = RawStream(coordinator.channel(), serializer=lambda b: b)
    stream.send(b"\xff\xff\xff")
    with pytest.raises(grpc.RpcError) as caught:
        next(stream.responses)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert info is not None and info.reason == "MALFORMED_REQUEST"
    stream.close()


def test_sessions_past_the_per_host_cap_are_refused(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(args=["--max-sessions-per-host", "2"])
    ask = pb.SessionRequest(id=1, get_group=pb.GetGroupRequest(job=JOB, group="g"))
    streams = [RawStream(server.channel()) for _ in range(2)]
    for stream in streams:
        stream.send(ask)
        stream.take(1)  # open, and served
    third = RawStream(server.channel())
    third.send(ask)
    with pytest.raises(grpc.RpcError) as caught:
        third.take(1)
    info = error_info(caught.value)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info is not None and info.reason == "TOO_MANY_STREAMS"
    assert info.metadata["method"] == "Session" and info.metadata["scope"] == "host"
    streams[0].close()
    assert list(streams[0].responses) == []
    again = RawStream(server.channel())
    again.send(ask)
    assert again.take(1)[0].id == 1  # a place came free
    for stream in (streams[1], third, again):
        stream.close()


@pytest.mark.slow
def test_calls_in_flight_when_the_server_dies_are_sent_again_on_a_new_stream(
    coordinator: CoordinatorProcess,
) -> None:
    client = CoordinatorClient(coordinator.address, session=True, outage_s=60)
    members = _joined(client, "kill", 4)
    granted: dict[tuple[int, int], tuple[int, int]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def rank(r: int) -> None:
        seq = 0
        while not stop.is_set() or seq < 40:
            lease = client.reserve(
                JOB,
                "kill",
                epoch=1,
                seq=seq,
                size=64,
                fingerprint=b"f",
                rank=r,
                member_id=members[r],
            )
            with lock:
                granted[r, seq] = (lease.start, lease.end)
            seq += 1
            if seq >= 200:
                return

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(rank, r) for r in range(4)]
        time.sleep(0.3)
        coordinator.kill()
        time.sleep(1.0)
        coordinator.restart()
        stop.set()
        for f in futures:
            f.result(timeout=120)
    client.close()
    # Every rank read the same lease for each seq, and the seqs' ranges never overlap.
    by_seq: dict[int, set[tuple[int, int]]] = {}
    for (_, seq), span in granted.items():
        by_seq.setdefault(seq, set()).add(span)
    assert all(len(spans) == 1 for spans in by_seq.values()), by_seq
    spans = sorted(next(iter(s)) for s in by_seq.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.slow
def test_streams_cancelled_mid_call_leave_the_server_serving(
    coordinator: CoordinatorProcess,
) -> None:
    """Streams cancelled by their clients with requests in flight (a waiting join, hits), and
    a client process SIGKILLed mid-stream: the server serves on, and every join withdrawn."""
    members = _formed(coordinator, "cancel")
    for round_ in range(20):
        stream = RawStream(coordinator.channel())
        waiting = pb.JoinGroupRequest(
            job=JOB,
            group=f"never-{round_}",
            rank=0,
            world_size=2,
            member_id=f"w{round_}",
            member_secret=secret_for(f"w{round_}"),
            timeout_ms=30_000,
        )
        stream.send(pb.SessionRequest(id=1, join_group=waiting))
        for i in range(2, 40):
            stream.send(pb.SessionRequest(id=i, reserve=_reserve("cancel", 1, i % 8, members[0])))
        stream.take(round_ % 5)  # some answers taken, most not
        stream.responses.cancel()
        stream.close()
    killed = subprocess.Popen(
        [sys.executable, "-c", _FLOOD_AND_WAIT, coordinator.address, members[0]],
        stdout=subprocess.PIPE,
    )
    assert killed.stdout is not None and killed.stdout.readline().strip() == b"streaming"
    killed.kill()
    killed.wait()
    time.sleep(0.5)
    assert coordinator.running
    with CoordinatorClient(coordinator.address, session=True, outage_s=0) as client:
        assert client.get_group(JOB, "cancel").epoch == 1
    assert coordinator.health() == "SERVING"


# A client process that floods a Session stream, says so, and waits to be SIGKILLed.
_FLOOD_AND_WAIT = """
import sys, time, queue, hashlib
import grpc
from rngcoord.v1 import coordinator_pb2 as pb
address, member = sys.argv[1], sys.argv[2]
secret = hashlib.sha256(b"test-secret:" + member.encode()).digest()
out = queue.SimpleQueue()
def requests():
    while True:
        yield out.get()
channel = grpc.insecure_channel(address)
call = channel.stream_stream(
    "/rngcoord.v1.Coordinator/Session",
    request_serializer=pb.SessionRequest.SerializeToString,
    response_deserializer=pb.SessionResponse.FromString,
)(requests())
for i in range(500):
    out.put(pb.SessionRequest(id=i, reserve=pb.ReserveRequest(
        job="sessions", group="cancel", epoch=1, seq=i % 8, size=64, fingerprint=b"f",
        rank=0, member_id=member, member_secret=secret)))
next(call)
print("streaming", flush=True)
time.sleep(60)
"""


def test_a_handler_that_raises_is_answered_internal_and_the_stream_goes_on() -> None:
    """A fault injected between the stream and the handlers (a handler that raises instead of
    ending its call with a status): that request is answered INTERNAL with an incident id,
    the next is served, and the stream still ends once every answer is taken. The session
    code runs on a real grpc.aio server; only the two handlers are the test's."""
    loop = LoopThread()

    async def broken(request: Any, context: Any) -> Any:
        raise RuntimeError("a bug between the stream and the coordinator")

    async def fine(request: Any, context: Any) -> Any:
        return pb.GetGroupResponse(epoch=7)

    async def stream(requests: Any, context: Any) -> Any:
        async for response in session.serve(
            requests,
            context,
            handlers={"reserve": ("Reserve", broken), "get_group": ("GetGroup", fine)},
            admit=None,
            caps=StreamCaps(method="Session"),
        ):
            yield response

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "rngcoord.v1.Coordinator",
            {
                "Session": grpc.stream_stream_rpc_method_handler(
                    stream,
                    request_deserializer=pb.SessionRequest.FromString,
                    response_serializer=pb.SessionResponse.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = RawStream(channel)
            raw.send(pb.SessionRequest(id=1, reserve=_reserve("x", 1, 0, "m")))
            raw.send(pb.SessionRequest(id=2, get_group=pb.GetGroupRequest(job=JOB, group="x")))
            answers = {a.id: a for a in raw.take(2)}
            status = status_pb2.Status.FromString(answers[1].error)
            assert status.code == grpc.StatusCode.INTERNAL.value[0]
            assert "incident" in status.message and "bug" not in status.message
            assert answers[2].get_group.epoch == 7
            raw.close()
            assert list(raw.responses) == []
    finally:
        loop.run(server.stop(None))
        loop.close()
