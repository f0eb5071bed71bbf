"""A member speaks only for itself (docs/design.md §7.2): member ids are no credentials.

A process that holds the job's token and knows the other ranks' member ids (JoinGroup and
GetGroup list them) but not their secrets tries to act as them on a real server: Reserve,
Attest, a Restore vote and LeaveGroup are refused PERMISSION_DENIED / BAD_CREDENTIAL, the
refusal shows no secret, and the honest members carry on. A Restore needs every live
member's own credential.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from harness import CoordinatorProcess, join_all, secret_for
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import error_info

JOB = "creds"
FORGED = b"forged-secret-0123456789abcdef!!"


def _refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, dict[str, str], str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    assert info is not None, caught.value
    return caught.value.code(), info.reason, dict(info.metadata), caught.value.details() or ""


def _as(member: str, rank: int, secret: bytes | None = None) -> dict[str, Any]:
    return {
        "job": JOB,
        "group": "g",
        "epoch": 1,
        "rank": rank,
        "member_id": member,
        "member_secret": secret_for(member) if secret is None else secret,
    }


def test_no_member_call_is_served_without_the_members_own_secret(
    coordinator: CoordinatorProcess,
) -> None:
    stub = coordinator.stub()
    members = list(join_all(stub, JOB, "g", 3, job_seed=1)[0].members)
    # The members are listed to any holder of the job's token.
    listed = stub.GetGroup(pb.GetGroupRequest(job=JOB, group="g"), timeout=10)
    assert list(listed.members) == members
    victim = _as(members[1], 1, FORGED)
    attempts: dict[str, Callable[[], object]] = {
        "Reserve": lambda: stub.Reserve(
            pb.ReserveRequest(seq=0, size=64, fingerprint=b"x", **victim), timeout=10
        ),
        "Attest": lambda: stub.Attest(
            pb.AttestRequest(anchor_seq=0, ops=1024, fingerprint=b"x", **victim), timeout=10
        ),
        "Restore": lambda: stub.Restore(
            pb.RestoreRequest(seq=0, cursor=0, timeout_ms=500, **victim), timeout=10
        ),
        "RecordResize": lambda: stub.RecordResize(
            pb.RecordResizeRequest(saved_group="tp:4[0-3]", saved_cursor=64, **victim),
            timeout=10,
        ),
        "LeaveGroup": lambda: stub.LeaveGroup(pb.LeaveGroupRequest(**victim), timeout=10),
    }
    for method, attempt in attempts.items():
        code, reason, meta, details = _refused(attempt)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "BAD_CREDENTIAL"), method
        assert meta == {"job": JOB, "group": "g", "epoch": "1", "rank": "1"}, method
        assert FORGED.decode() not in details and secret_for(members[1]).hex() not in details
    # Nothing was recorded in the victim's name, and it carries on with its own secret.
    audit = list(stub.ListAudit(pb.ListAuditRequest(job=JOB), timeout=10))
    assert [r.kind for r in audit if r.kind in ("grant", "leave", "restore", "resize")] == []
    lease = stub.Reserve(
        pb.ReserveRequest(seq=0, size=64, fingerprint=b"x", **_as(members[1], 1)), timeout=10
    )
    assert lease.lease.end - lease.lease.start == 64


def test_a_restore_needs_every_live_members_own_vote(coordinator: CoordinatorProcess) -> None:
    stub = coordinator.stub()
    members = list(join_all(stub, JOB, "g", 3, job_seed=1)[0].members)
    stub.Reserve(
        pb.ReserveRequest(seq=0, size=64, fingerprint=b"x", **_as(members[0], 0)), timeout=10
    )

    def vote(rank: int, secret: bytes | None = None, timeout_ms: int = 1500) -> Any:
        request = pb.RestoreRequest(
            seq=1, cursor=0, timeout_ms=timeout_ms, **_as(members[rank], rank, secret)
        )
        return stub.Restore.future(request, timeout=10)

    # Rank 0 votes honestly; one token tries to fill in ranks 1 and 2, or to make rank 2
    # leave so that fewer votes would do: each is refused, and the Restore times out naming
    # the ranks that did not vote.
    honest = vote(0)
    for forged in (vote(1, FORGED), vote(2, FORGED)):
        code, reason, _, _ = _refused(forged.result)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "BAD_CREDENTIAL")
    code, reason, _, _ = _refused(
        lambda: stub.LeaveGroup(pb.LeaveGroupRequest(**_as(members[2], 2, FORGED)), timeout=10)
    )
    assert reason == "BAD_CREDENTIAL"
    code, reason, meta, _ = _refused(honest.result)
    assert (code, reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "RESTORE_TIMEOUT")
    assert meta["missing"] == "1,2"
    # With every member's own vote, it takes effect.
    votes = [vote(rank, timeout_ms=5000) for rank in range(3)]
    assert [v.result().cursor for v in votes] == [0, 0, 0]


def test_joins_need_a_secret_and_a_retry_needs_the_same_one(
    coordinator: CoordinatorProcess,
) -> None:
    stub = coordinator.stub()
    bare = pb.JoinGroupRequest(
        job=JOB, group="j", rank=0, world_size=2, member_id="m0", timeout_ms=5000
    )
    code, reason, meta, details = _refused(lambda: stub.JoinGroup(bare, timeout=10))
    assert (code, reason, meta["field"]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
        "member_secret",
    )
    assert "16 to 64 random bytes" in details
    waiting = stub.JoinGroup.future(
        pb.JoinGroupRequest(
            job=JOB,
            group="j",
            rank=0,
            world_size=2,
            member_id="m0",
            member_secret=secret_for("m0"),
            timeout_ms=5000,
        ),
        timeout=10,
    )
    stolen = pb.JoinGroupRequest(
        job=JOB,
        group="j",
        rank=0,
        world_size=2,
        member_id="m0",
        member_secret=FORGED,
        timeout_ms=5000,
    )
    code, reason, _, _ = _refused(lambda: stub.JoinGroup(stolen, timeout=10))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "BAD_CREDENTIAL")
    stub.JoinGroup(
        pb.JoinGroupRequest(
            job=JOB,
            group="j",
            rank=1,
            world_size=2,
            member_id="m1",
            member_secret=secret_for("m1"),
            timeout_ms=5000,
        ),
        timeout=10,
    )
    assert waiting.result().epoch == 1


def test_requests_with_fields_from_a_newer_contract_are_served(
    coordinator: CoordinatorProcess,
) -> None:
    # Wire compatibility: the contract only grows. A request carrying a field this server does
    # not know (number 100, as a newer client might send) decodes and is served.
    stub = coordinator.stub()
    members = list(join_all(stub, JOB, "w", 1)[0].members)
    request = pb.ReserveRequest(seq=0, size=64, fingerprint=b"x", **_as(members[0], 0))
    request.group = "w"
    request.member_secret = secret_for(members[0])
    unknown_field = bytes([0xA0, 0x06, 0x01])  # field 100, varint 1
    with grpc.insecure_channel(coordinator.address) as channel:
        reserve = channel.unary_unary(
            "/rngcoord.v1.Coordinator/Reserve",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.ReserveResponse.FromString,
        )
        reply = reserve(request.SerializeToString() + unknown_field, timeout=10)
    assert reply.lease.end == reply.lease.start + 64
