"""The gate in front of every Coordinator call, on a real server: token roles, SIGHUP reload,
malformed requests, the per-peer rate limit, unknown audit kinds.

Each role (member, auditor, admin) calls each RPC on its own job and on another job, and the
status code is checked against the permission table of rngcoord.server.auth. "Passed" means
the gate let the call through: the reply is OK or a refusal of the coordinator itself.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness import CoordinatorFactory, CoordinatorProcess, secret_for
from rngcoord.client._session import SessionStub
from rngcoord.server.addresses import peer_host
from rngcoord.server.rpc.gate import PeerRateLimit
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import error_info

OWN, OTHER = "ops", "elsewhere"
TOKENS = """\
# NAME     ROLE     JOBS        TOKEN
trainer    member   ops,ops-*   member-secret
reader     auditor  ops         auditor-secret
root       admin    *           admin-secret
"""
PASSED = "passed"


def _get_group(server: CoordinatorProcess, token: str) -> str:
    return _call(server, "GetGroup", pb.GetGroupRequest(job=OWN, group="x"), token)


def _requests(job: str) -> dict[str, Any]:
    return {
        "JoinGroup": pb.JoinGroupRequest(
            job=job,
            group="g",
            rank=0,
            world_size=1,
            member_id="m0",
            member_secret=secret_for("m0"),
            timeout_ms=5000,
        ),
        "JoinGroups": pb.JoinGroupsRequest(
            job=job,
            joins=[
                pb.JoinGroupRequest(
                    group="h",
                    rank=0,
                    world_size=1,
                    member_id="m0",
                    member_secret=secret_for("m0"),
                    timeout_ms=5000,
                )
            ],
        ),
        "Reserve": pb.ReserveRequest(
            job=job,
            group="g",
            epoch=1,
            seq=0,
            size=64,
            fingerprint=b"f",
            rank=0,
            member_id="m0",
            member_secret=secret_for("m0"),
        ),
        "GetGroup": pb.GetGroupRequest(job=job, group="g"),
        "Restore": pb.RestoreRequest(
            job=job,
            group="g",
            epoch=1,
            seq=5,
            cursor=0,
            rank=0,
            member_id="m0",
            member_secret=secret_for("m0"),
            timeout_ms=50,
        ),
        "ForcedRestore": pb.RestoreRequest(
            job=job,
            group="g",
            epoch=1,
            seq=6,
            cursor=0,
            rank=0,
            member_id="m0",
            member_secret=secret_for("m0"),
            force=True,
        ),
        "ListAudit": pb.ListAuditRequest(job=job),
        "LeaveGroup": pb.LeaveGroupRequest(
            job=job, group="g", epoch=1, rank=0, member_id="m0", member_secret=secret_for("m0")
        ),
    }


def _call(
    server: CoordinatorProcess,
    method: str,
    request: Any,
    token: str | None,
    transport: str = "unary",
) -> str:
    """PASSED, or the status code name of a refusal by the gate. `transport` "session" sends
    the member calls on a Session stream that carries the token (ListAudit stays unary)."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    stub: Any = server.stub() if transport == "unary" else SessionStub(server.channel(), metadata)
    rpc = "Restore" if method == "ForcedRestore" else method
    try:
        reply = getattr(stub, rpc)(request, metadata=metadata, timeout=10)
        if method == "ListAudit":
            list(reply)
    except grpc.RpcError as e:
        info = error_info(e)
        if info is not None and info.reason in ("BAD_TOKEN", "NOT_PERMITTED"):
            return str(e.code().name)
    finally:
        if isinstance(stub, SessionStub):
            stub.close()
    return PASSED


# What each role gets, by RPC, on its own job; every role but admin is refused elsewhere.
EXPECTED = {
    "member": {
        "JoinGroup": PASSED,
        "JoinGroups": PASSED,
        "Reserve": PASSED,
        "GetGroup": PASSED,
        "Restore": PASSED,
        "ForcedRestore": "PERMISSION_DENIED",
        "ListAudit": PASSED,
        "LeaveGroup": PASSED,
    },
    "auditor": {
        "JoinGroup": "PERMISSION_DENIED",
        "JoinGroups": "PERMISSION_DENIED",
        "Reserve": "PERMISSION_DENIED",
        "GetGroup": PASSED,
        "Restore": "PERMISSION_DENIED",
        "ForcedRestore": "PERMISSION_DENIED",
        "ListAudit": PASSED,
        "LeaveGroup": "PERMISSION_DENIED",
    },
    "admin": dict.fromkeys(
        (
            "JoinGroup",
            "JoinGroups",
            "Reserve",
            "GetGroup",
            "Restore",
            "ForcedRestore",
            "ListAudit",
            "LeaveGroup",
        ),
        PASSED,
    ),
}
SECRETS = {"member": "member-secret", "auditor": "auditor-secret", "admin": "admin-secret"}


@pytest.fixture
def server(coordinator_factory: CoordinatorFactory, tmp_path: Path) -> CoordinatorProcess:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    return coordinator_factory(args=["--tokens", str(tokens)])


@pytest.mark.parametrize("transport", ["unary", pytest.param("session", marks=pytest.mark.slow)])
def test_each_role_on_each_rpc_on_its_own_job_and_another(
    server: CoordinatorProcess, transport: str
) -> None:
    got: dict[tuple[str, str, str], str] = {}
    for role, secret in SECRETS.items():
        for where, job in (("own", OWN), ("other", OTHER)):
            for method, request in _requests(job).items():
                got[role, where, method] = _call(server, method, request, secret, transport)
    expected = {
        (role, where, method): (
            outcome if where == "own" or role == "admin" else "PERMISSION_DENIED"
        )
        for role, table in EXPECTED.items()
        for where in ("own", "other")
        for method, outcome in table.items()
    }
    assert got == expected
    # Unknown or missing tokens are UNAUTHENTICATED, for every RPC.
    for token in (None, "member-secret-", "MEMBER-SECRET", ""):
        for method, request in _requests(OWN).items():
            outcome = _call(server, method, request, token, transport)
            assert outcome == "UNAUTHENTICATED", (method, token)


def test_reading_every_job_at_once_needs_the_star_pattern(server: CoordinatorProcess) -> None:
    everything = pb.ListAuditRequest()
    assert _call(server, "ListAudit", everything, "member-secret") == "PERMISSION_DENIED"
    assert _call(server, "ListAudit", everything, "auditor-secret") == "PERMISSION_DENIED"
    assert _call(server, "ListAudit", everything, "admin-secret") == PASSED


def test_refusals_name_the_identity_and_are_logged_without_the_token(
    server: CoordinatorProcess,
) -> None:
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as refused:
        stub.Reserve(
            _requests(OWN)["Reserve"],
            metadata=(("authorization", "Bearer auditor-secret"),),
            timeout=10,
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        refused.value.details() == "Reserve needs the member or admin role; 'reader' is an auditor"
    )
    info = error_info(refused.value)
    assert info is not None and info.metadata["identity"] == "reader"
    _call(server, "GetGroup", _requests(OWN)["GetGroup"], "wrong-secret-123")
    events = {e["event"]: e["fields"] for e in server.log_events()}
    assert events["call_not_permitted"]["identity"] == "reader"
    assert events["call_unauthenticated"]["peer"].startswith("ipv4:127.0.0.1:")
    assert "secret" not in server.output()


def test_audit_records_carry_the_authenticated_identity(server: CoordinatorProcess) -> None:
    token = (("authorization", "Bearer member-secret"),)
    stub = server.stub()
    stub.JoinGroup(_requests(OWN)["JoinGroup"], metadata=token, timeout=10)
    records = list(stub.ListAudit(pb.ListAuditRequest(job=OWN), metadata=token, timeout=10))
    epoch = next(r for r in records if r.kind == "epoch")
    assert epoch.actor.startswith("trainer: rank 0 member m0 @ ipv4:127.0.0.1:")


def test_sighup_reloads_the_token_file_without_dropping_calls(
    server: CoordinatorProcess, tmp_path: Path
) -> None:
    stub = server.stub()
    waiting: dict[str, Any] = {}

    def first_rank() -> None:
        request = pb.JoinGroupRequest(
            job=OWN,
            group="h",
            rank=0,
            world_size=2,
            member_id="a",
            member_secret=secret_for("a"),
            timeout_ms=30_000,
        )
        try:
            waiting["reply"] = stub.JoinGroup(
                request, metadata=(("authorization", "Bearer member-secret"),), timeout=40
            )
        except grpc.RpcError as e:
            waiting["error"] = e

    thread = threading.Thread(target=first_rank)
    thread.start()
    time.sleep(0.5)  # rank 0 waits in the barrier through the reload
    (tmp_path / "tokens").write_text(TOKENS.replace("member-secret", "rotated-secret"))
    assert server.popen is not None
    os.kill(server.popen.pid, signal.SIGHUP)
    second = pb.JoinGroupRequest(
        job=OWN,
        group="h",
        rank=1,
        world_size=2,
        member_id="b",
        member_secret=secret_for("b"),
        timeout_ms=30_000,
    )
    deadline = time.monotonic() + 10
    while (
        _call(server, "GetGroup", pb.GetGroupRequest(job=OWN, group="x"), "rotated-secret")
        != PASSED
    ):
        assert time.monotonic() < deadline, "the reload never took effect"
        time.sleep(0.05)
    assert _get_group(server, "member-secret") == "UNAUTHENTICATED"
    rotated = (("authorization", "Bearer rotated-secret"),)
    reply = stub.JoinGroup(second, metadata=rotated, timeout=40)
    thread.join(40)
    assert "error" not in waiting, waiting.get("error")
    assert waiting["reply"].epoch == reply.epoch == 1
    assert server.running
    # A reload of a broken file keeps the tokens in use.
    (tmp_path / "tokens").write_text("broken line with secret\n")
    os.kill(server.popen.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not any(e["event"] == "tokens_reload_failed" for e in server.log_events()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (
        _call(server, "GetGroup", pb.GetGroupRequest(job=OWN, group="h"), "rotated-secret")
        == PASSED
    )
    assert "with secret" not in server.output()


def test_undecodable_requests_are_invalid_argument(coordinator_factory: CoordinatorFactory) -> None:
    server = coordinator_factory()
    channel = server.channel()
    for method in ("JoinGroup", "Reserve", "GetGroup", "Restore", "LeaveGroup"):
        raw = channel.unary_unary(
            f"/rngcoord.v1.Coordinator/{method}",
            request_serializer=None,
            response_deserializer=None,
        )
        for garbage in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xc3\x28"):
            with pytest.raises(grpc.RpcError) as refused:
                raw(garbage, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, garbage)
            info = error_info(refused.value)
            assert info is not None and info.reason == "MALFORMED_REQUEST"
    assert server.health() == "SERVING"


def test_unknown_audit_kinds_are_named(coordinator_factory: CoordinatorFactory) -> None:
    stub = coordinator_factory().stub()
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.ListAudit(pb.ListAuditRequest(kinds=["grant", "grnat"]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).startswith(
        "unknown audit kinds 'grnat': the kinds are job, "
    )
    many = [f"k{i}" for i in range(300_000)]
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.ListAudit(pb.ListAuditRequest(kinds=many), timeout=30))
    assert refused.value.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # gRPC's own 1 MiB request cap may come first
    )
    assert list(stub.ListAudit(pb.ListAuditRequest(kinds=["grant"] * 1000), timeout=10)) == []


def test_a_flooding_peer_is_rate_limited_and_the_client_waits_it_out(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(args=["--peer-rate", "20", "--peer-burst", "5"])
    stub = server.stub()
    request = pb.GetGroupRequest(job=OWN, group="g")
    codes = []
    for _ in range(12):
        try:
            stub.GetGroup(request, timeout=10)
            codes.append("OK")
        except grpc.RpcError as e:
            info = error_info(e)
            codes.append(info.reason if info is not None else e.code().name)
    # The first 5 pass the gate (and find no job); later ones are refused until it refills.
    assert codes[:5] == ["UNKNOWN_JOB"] * 5
    assert "RATE_LIMITED" in codes[5:]
    from rngcoord.client import CoordinatorClient, NotFoundError

    with CoordinatorClient(server.address, outage_s=30.0) as client:
        for _ in range(30):  # 1.5 s of calls at 20/s: the client waits as told
            with pytest.raises(NotFoundError):
                client.get_group(OWN, "g")


def test_the_peer_rate_limit_refills_and_forgets_idle_hosts() -> None:
    now = [0.0]
    limit = PeerRateLimit(10, 2, now=lambda: now[0])
    assert [limit.admit("a") for _ in range(3)][:2] == [0.0, 0.0]
    assert limit.admit("a") == pytest.approx(0.1)
    now[0] += 0.1
    assert limit.admit("a") == 0.0
    assert limit.admit("b") == 0.0  # hosts are separate
    assert peer_host("ipv4:10.0.0.7:41234") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    with pytest.raises(ValueError):
        PeerRateLimit(0, 1)


@pytest.mark.slow
def test_idle_connections_past_the_cap_do_not_take_the_server_down(
    coordinator_factory: CoordinatorFactory,
) -> None:
    # 300 idle sockets against a cap of 100 connections and a 1 s handshake timeout: the
    # excess is closed at accept, the idle ones go after a second, and the server serves.
    server = coordinator_factory(args=["--max-connections", "100", "--handshake-timeout", "1"])
    idle = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", server.port))
        idle.append(s)
    time.sleep(2.5)
    try:
        assert server.health(timeout_s=10) == "SERVING"
        stub = server.stub()
        reply = stub.JoinGroup(_requests(OWN)["JoinGroup"], timeout=10)
        assert reply.epoch == 1
    finally:
        for s in idle:
            s.close()
