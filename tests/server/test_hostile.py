"""Hostile connections: one host's clients can never lock out the others.

Real `rngcoord serve` subprocesses, flooded over loopback from other 127.0.0.0/8 addresses:
idle HTTP/2 connections past the per-host cap are closed while 127.0.0.1 and health checks
are served; idle connections are closed once the server is crowded while busy ones stay; and
unread ListAudit streams hold bounded memory, past the per-host cap are refused with
TOO_MANY_STREAMS, and end when their client takes nothing for the stall timeout.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from harness import CoordinatorFactory, CoordinatorProcess, secret_for
from rngcoord.server.rpc.connections import Connection, scan_connections, shut_down, tcp_in_use
from rngcoord.server.rpc.gate import RefusalLog
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import error_info

# What an HTTP/2 client sends first: the preface and an empty SETTINGS frame. A connection
# that sends this and nothing more has finished its handshake and never calls.
H2_START = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.fixture(autouse=True, scope="module")
def _many_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _idle_h2(port: int, source: str, n: int) -> list[socket.socket]:
    """`n` connections from `source` that start HTTP/2 and then never call."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(H2_START)
        s.setblocking(False)
        socks.append(s)
    return socks


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server ended `s` (EOF or reset), reading what it sent meanwhile."""
    try:
        while data := s.recv(1 << 16):
            del data
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def _wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def _healthy(server: CoordinatorProcess) -> bool:
    try:
        return server.health(timeout_s=2) == "SERVING"
    except grpc.RpcError:
        return False


def _join_and_reserve(stub: pb_grpc.CoordinatorStub, group: str) -> None:
    joined = stub.JoinGroup(
        pb.JoinGroupRequest(
            job="hostile",
            group=group,
            rank=0,
            world_size=1,
            member_id="m0",
            member_secret=secret_for("m0"),
            timeout_ms=5000,
        ),
        timeout=10,
    )
    lease = stub.Reserve(
        pb.ReserveRequest(
            job="hostile",
            group=group,
            epoch=joined.epoch,
            seq=0,
            size=64,
            fingerprint=b"f",
            rank=0,
            member_id="m0",
            member_secret=secret_for("m0"),
        ),
        timeout=10,
    )
    assert lease.lease.end - lease.lease.start == 64


def _events(server: CoordinatorProcess, name: str) -> list[dict[str, Any]]:
    return [e["fields"] for e in server.log_events() if e["event"] == name]


def _rss_mb(server: CoordinatorProcess) -> float:
    assert server.popen is not None
    with open(f"/proc/{server.popen.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_an_idle_flood_from_one_host_leaves_the_others_served(
    coordinator_factory: CoordinatorFactory,
) -> None:
    # 1,000 connections that never call, from 127.0.0.2, against a cap of 400 (100 per
    # host): without the guard gRPC keeps 400 of them and refuses everyone else for good.
    server = coordinator_factory(args=["--max-connections", "400"])
    flood = _idle_h2(server.port, "127.0.0.2", 1000)
    try:
        _wait_for(lambda: _healthy(server), 10, "health SERVING during the flood")
        _join_and_reserve(server.stub(), "during-flood")
        still_open = [s for s in flood if not _closed_by_server(s)]
        assert len(still_open) <= 100, "the flooding host holds more than its cap"
        assert still_open, "the flooding host's first connections were closed too"
        refused = [
            f for f in _events(server, "connections_closed") if f["reason"] == "per_host_cap"
        ]
        assert refused, server.output()
        assert {f["peer"] for f in refused} == {"ipv4:127.0.0.2"}
        assert refused[0]["count"] >= 1 and refused[0]["cap"] == 100
    finally:
        for s in flood:
            s.close()


@pytest.mark.slow
def test_idle_connections_close_once_crowded_and_busy_ones_stay(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(
        args=[
            "--max-connections",
            "40",
            "--max-connections-per-host",
            "40",
            "--crowded-idle-timeout",
            "1",
        ]
    )
    stub = server.stub()
    _join_and_reserve(stub, "busy")
    stop = threading.Event()
    failures: list[BaseException] = []

    def keep_calling() -> None:
        while not stop.is_set():
            try:
                stub.GetGroup(pb.GetGroupRequest(job="hostile", group="busy"), timeout=5)
            except grpc.RpcError as exc:
                failures.append(exc)
            time.sleep(0.1)

    caller = threading.Thread(target=keep_calling)
    caller.start()
    few = _idle_h2(server.port, "127.0.0.3", 10)
    more: list[socket.socket] = []
    try:
        # Below half the cap, idle connections stay (until --idle-timeout).
        time.sleep(2.5)
        assert not any(_closed_by_server(s) for s in few)
        more = _idle_h2(server.port, "127.0.0.3", 20)
        idle = few + more
        # Past half the cap (20), the connections idle for a second go, the longest idle
        # first, until the server is back at half or below; the busy one stays.
        _wait_for(lambda: all(_closed_by_server(s) for s in few), 10, "old idle ones closed")
        _wait_for(
            lambda: sum(not _closed_by_server(s) for s in idle) + 1 <= 20,
            10,
            "back to half the cap",
        )
        time.sleep(1)
        assert not failures, failures[:1]
        reaped = [
            f for f in _events(server, "connections_closed") if f["reason"] == "idle_while_crowded"
        ]
        assert reaped and {f["peer"] for f in reaped} == {"ipv4:127.0.0.3"}
    finally:
        stop.set()
        caller.join()
        for s in few + more:
            s.close()


def _fill_audit(stub: pb_grpc.CoordinatorStub, records: int, groups: int = 20) -> None:
    def fill(g: int) -> None:
        joined = stub.JoinGroup(
            pb.JoinGroupRequest(
                job="audit",
                group=f"g{g}",
                rank=0,
                world_size=1,
                member_id="m",
                member_secret=secret_for("m"),
                timeout_ms=9000,
            ),
            timeout=10,
        )
        for seq in range(records // groups):
            stub.Reserve(
                pb.ReserveRequest(
                    job="audit",
                    group=f"g{g}",
                    epoch=joined.epoch,
                    seq=seq,
                    size=64,
                    fingerprint=b"f" * 32,
                    rank=0,
                    member_id="m",
                    member_secret=secret_for("m"),
                ),
                timeout=10,
            )

    with ThreadPoolExecutor(groups) as pool:
        list(pool.map(fill, range(groups)))


def _reader_channels(server: CoordinatorProcess, n: int) -> list[grpc.Channel]:
    # Separate connections (no shared subchannel), and a fixed 64 KiB receive window, so
    # that a stream nobody reads stops the server's writes soon.
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
    channels = [grpc.insecure_channel(server.address, options=options) for _ in range(n)]
    server._channels.extend(channels)  # closed with the server
    return channels


@pytest.mark.slow
def test_unread_audit_streams_hold_bounded_memory_and_are_capped_per_host(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(
        args=["--max-audit-streams-per-host", "750", "--max-audit-streams", "1000"]
    )
    stub = server.stub()
    _fill_audit(stub, 3000)
    time.sleep(1)
    before = _rss_mb(server)
    channels = _reader_channels(server, 10)
    streams: list[Any] = []
    refusals: list[grpc.RpcError] = []
    for i in range(1000):
        stream: Any = pb_grpc.CoordinatorStub(channels[i % 10]).ListAudit(pb.ListAuditRequest())
        try:
            next(stream)  # one record, and then it is never read again
            streams.append(stream)
        except grpc.RpcError as exc:
            refusals.append(exc)
    time.sleep(2)
    grown = _rss_mb(server) - before
    logging.getLogger(__name__).info("1,000 unread streams: RSS %.0f -> +%.0f MB", before, grown)
    assert len(streams) == 750
    assert len(refusals) == 250
    for refusal in refusals:
        assert refusal.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(refusal)
        assert info is not None and info.reason == "TOO_MANY_STREAMS"
        assert info.metadata["scope"] == "host" and info.metadata["limit"] == "750"
        assert info.metadata["peer"] == "ipv4:127.0.0.1"
    assert grown <= 100, f"1,000 unread ListAudit streams grew the server by {grown:.0f} MB"
    # Other work goes on.
    t0 = time.monotonic()
    _join_and_reserve(stub, "while-streams-wait")
    assert time.monotonic() - t0 < 5
    assert any(f["reason"] == "host_cap" for f in _events(server, "audit_stream_refused"))
    for stream in streams:
        stream.cancel()


@pytest.mark.slow
def test_a_stalled_audit_stream_is_ended_and_frees_its_place(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(
        args=["--max-audit-streams-per-host", "2", "--audit-stall-timeout", "1"]
    )
    stub = server.stub()
    _fill_audit(stub, 1000, groups=10)
    (channel,) = _reader_channels(server, 1)
    reader = pb_grpc.CoordinatorStub(channel)
    stalled: list[Any] = [reader.ListAudit(pb.ListAuditRequest()) for _ in range(2)]
    for stream in stalled:
        next(stream)
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(reader.ListAudit(pb.ListAuditRequest())))
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(3)
    with pytest.raises(grpc.RpcError) as ended:
        for _ in stalled[0]:
            pass
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The stalled streams' places are free again: a full read goes through.
    assert len(list(reader.ListAudit(pb.ListAuditRequest(limit=100), timeout=10))) == 100
    assert len(_events(server, "audit_stream_stalled")) == 2


def test_the_scan_finds_accepted_connections_and_shut_down_checks_the_socket() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    with listener, client, accepted:
        assert tcp_in_use() is not None
        (found,) = scan_connections(port)  # not the listener, nor the client's own end
        assert found.fd == accepted.fileno()
        assert found.peer == f"ipv4:127.0.0.1:{client.getsockname()[1]}"
        assert found.host == "ipv4:127.0.0.1"
        # A descriptor number that now names another socket is left alone.
        assert not shut_down(Connection(found.inode + 1, found.fd, found.host, found.peer))
        client.settimeout(0.2)
        with pytest.raises(TimeoutError):
            client.recv(1)
        assert shut_down(found)
        client.settimeout(5)
        assert client.recv(1) == b""  # EOF
        assert accepted.fileno() == found.fd  # only the duplicate was closed


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.fields: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(getattr(record, "fields", {}))


def test_refusals_are_logged_once_per_host_per_window() -> None:
    now = [0.0]
    log = RefusalLog(10, now=lambda: now[0])
    lines = _Lines()
    logger = logging.getLogger("rngcoord.gate")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        log.note("ipv4:10.0.0.1", "connections_closed", "per_host_cap", 5)
        log.note("ipv4:10.0.0.1", "connections_closed", "per_host_cap", 7)
        log.note("ipv4:10.0.0.2", "connections_closed", "per_host_cap", 1)
        now[0] = 9.9
        log.flush()
        now[0] = 10.0
        log.flush()
        log.flush()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    counts = [(f["peer"], f["count"]) for f in lines.fields]
    assert counts == [("ipv4:10.0.0.1", 5), ("ipv4:10.0.0.2", 1), ("ipv4:10.0.0.1", 7)]
