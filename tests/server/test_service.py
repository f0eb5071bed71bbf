"""Every RPC end to end over gRPC: the fields that come back and the status codes of refusals.

One live server on a SQLite store per test. The domain rules themselves are the core's tests;
these check what a client sees on the wire: messages filled field by field, the documented
group-seed function, existing flags, the audit stream, and the code and message of divergence,
fencing, seed conflicts and join timeouts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import grpc
import pytest

from harness import CoordinatorProcess, join_all, secret_for
from rngcoord.server.core.resizes import MAX_PER_EPOCH
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

JOB = "rpcs"


def _group_seed(job_seed: int, group: str) -> int:
    # Written out from the contract rather than imported, so a change to it fails here.
    data = b"rngcoord/v1/group-seed\0" + job_seed.to_bytes(8, "big") + group.encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def _reserve(
    stub: pb_grpc.CoordinatorStub,
    group: str,
    seq: int,
    member: str,
    *,
    epoch: int = 1,
    rank: int = 0,
    size: int = 256,
    fingerprint: bytes = b"ops",
) -> pb.ReserveResponse:
    reply: pb.ReserveResponse = stub.Reserve(
        pb.ReserveRequest(
            job=JOB,
            group=group,
            epoch=epoch,
            seq=seq,
            size=size,
            fingerprint=fingerprint,
            rank=rank,
            member_id=member,
            member_secret=secret_for(member),
        ),
        timeout=10,
    )
    return reply


def _refused(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    error: grpc.RpcError = caught.value
    return error


def test_join_reserve_and_get_group_fill_every_field(coordinator: CoordinatorProcess) -> None:
    stub = coordinator.stub()
    replies = join_all(stub, JOB, "tp", 3, job_seed=2**64 - 1)
    for reply in replies:
        assert (reply.epoch, reply.start, reply.job_seed) == (1, 0, 2**64 - 1)
        assert reply.seed == _group_seed(2**64 - 1, "tp")
        assert list(reply.members) == list(replies[0].members)
    assert [m.partition("-")[0] for m in replies[0].members] == ["m0", "m1", "m2"]
    member = replies[2].members[2]

    first = _reserve(stub, "tp", 0, member, rank=2, size=2**40)
    assert not first.existing
    lease = first.lease
    assert (lease.group, lease.epoch, lease.seq, lease.seed) == ("tp", 1, 0, replies[0].seed)
    assert (lease.start, lease.end) == (0, 2**40)
    again = _reserve(stub, "tp", 0, replies[0].members[0], rank=0, size=2**40)
    assert again.existing and again.lease == lease

    info = stub.GetGroup(pb.GetGroupRequest(job=JOB, group="tp"), timeout=10)
    assert (info.job, info.group, info.seed, info.epoch) == (JOB, "tp", lease.seed, 1)
    assert list(info.members) == list(replies[0].members)
    assert (info.high_water, info.leases, info.job_seed) == (2**40, 1, 2**64 - 1)


def test_restore_and_leave(coordinator: CoordinatorProcess) -> None:
    stub = coordinator.stub()
    a, b = join_all(stub, JOB, "dp", 2)[0].members
    for seq in range(2):
        _reserve(stub, "dp", seq, a)
    votes = [
        pb.RestoreRequest(
            job=JOB,
            group="dp",
            epoch=1,
            seq=2,
            cursor=256,
            rank=rank,
            member_id=member,
            member_secret=secret_for(member),
        )
        for rank, member in enumerate((a, b))
    ]
    # Rank 0's vote waits for rank 1's; both return once the Restore has taken effect.
    first = stub.Restore.future(votes[0], timeout=10)
    assert stub.Restore(votes[1], timeout=10) == pb.RestoreResponse(cursor=256, existing=False)
    assert first.result() == pb.RestoreResponse(cursor=256, existing=False)
    assert stub.Restore(votes[0], timeout=10) == pb.RestoreResponse(cursor=256, existing=True)
    assert _reserve(stub, "dp", 2, a).lease.start == 256
    assert _reserve(stub, "dp", 3, a).lease.start == 512
    granted = _refused(
        stub.Restore,
        pb.RestoreRequest(
            job=JOB,
            group="dp",
            epoch=1,
            seq=1,
            cursor=0,
            rank=0,
            member_id=a,
            member_secret=secret_for(a),
        ),
        timeout=10,
    )
    assert granted.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already granted" in (granted.details() or "")

    leave = pb.LeaveGroupRequest(
        job=JOB, group="dp", epoch=1, rank=1, member_id=b, member_secret=secret_for(b)
    )
    assert stub.LeaveGroup(leave, timeout=10) == pb.LeaveGroupResponse()
    info = stub.GetGroup(pb.GetGroupRequest(job=JOB, group="dp"), timeout=10)
    assert list(info.members) == [a, ""]
    # The rank that left is fenced; the other member carries on.
    left = _refused(_reserve, stub, "dp", 4, b, rank=1)
    assert left.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _reserve(stub, "dp", 4, a).lease.start == 768


def test_record_resize_is_audited_once_and_refuses_bad_input(
    coordinator: CoordinatorProcess,
) -> None:
    stub = coordinator.stub()
    a, b = join_all(stub, JOB, "tp:2[0-1]", 2)[0].members

    def record(member: str, rank: int, **fields: object) -> pb.RecordResizeResponse:
        request: dict[str, Any] = dict(
            job=JOB,
            group="tp:2[0-1]",
            epoch=1,
            saved_group="tp:4[0-3]",
            saved_cursor=2**64 - 4,
            rank=rank,
            member_id=member,
            member_secret=secret_for(member),
        )
        request.update(fields)
        reply: pb.RecordResizeResponse = stub.RecordResize(
            pb.RecordResizeRequest(**request), timeout=10
        )
        return reply

    assert not record(a, 0).existing
    assert record(b, 1).existing  # a retry, or another rank: still one record
    records = list(stub.ListAudit(pb.ListAuditRequest(job=JOB, kinds=["resize"]), timeout=10))
    assert [json.loads(r.detail) for r in records] == [
        {"epoch": 1, "rank": 0, "saved_cursor": 2**64 - 4, "saved_group": "tp:4[0-3]"}
    ]
    for fields, field in (
        ({"saved_group": "tp:2[0-1]"}, "saved_group"),
        ({"saved_group": "no spaces"}, "saved_group"),
        ({"saved_cursor": 6}, "saved_cursor"),
    ):
        error = _refused(record, a, 0, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert field in (error.details() or ""), error.details()
    assert _refused(record, a, 0, epoch=2).code() == grpc.StatusCode.NOT_FOUND
    join_all(stub, JOB, "tp:2[0-1]", 2)  # epoch 2: epoch 1's members are fenced
    stale = _refused(record, a, 0)
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale" in (stale.details() or "")
    assert (
        len(list(stub.ListAudit(pb.ListAuditRequest(job=JOB, kinds=["resize"]), timeout=10))) == 1
    )


def test_record_quorum_is_audited_once_and_refuses_bad_input(
    coordinator: CoordinatorProcess,
) -> None:
    """A torchft replica's quorum, recorded in its group: one audit record per (epoch, quorum
    id), whoever of its ranks sends it and however often; every malformed field refused by
    name, a group that is not a replica's refused, a forged credential refused, and nothing
    recorded by any refusal."""
    stub = coordinator.stub()
    group = "tp:2[0-1]/replica:1"
    a, b = join_all(stub, JOB, group, 2)[0].members

    def record(member: str, rank: int, **fields: object) -> pb.RecordQuorumResponse:
        request: dict[str, Any] = dict(
            job=JOB,
            group=group,
            epoch=1,
            quorum_id=2**64 - 1,
            step=7,
            participants=2,
            healed_from="0",
            rank=rank,
            member_id=member,
            member_secret=secret_for(member),
        )
        request.update(fields)
        reply: pb.RecordQuorumResponse = stub.RecordQuorum(
            pb.RecordQuorumRequest(**request), timeout=10
        )
        return reply

    def quorums() -> list[dict[str, Any]]:
        listed = stub.ListAudit(pb.ListAuditRequest(job=JOB, kinds=["quorum"]), timeout=10)
        return [json.loads(r.detail) for r in listed]

    assert not record(a, 0).existing
    assert record(b, 1).existing  # another rank, or a retry: still one record
    assert not record(a, 0, quorum_id=3, step=9, participants=1, healed_from="").existing
    assert quorums() == [
        {"epoch": 1, "rank": 0, "replica": "1", "quorum_id": 2**64 - 1, "step": 7,
         "participants": 2, "healed_from": "0"},
        {"epoch": 1, "rank": 0, "replica": "1", "quorum_id": 3, "step": 9,
         "participants": 1, "healed_from": ""},
    ]  # fmt: skip
    for fields, field in (
        ({"step": 2**63}, "step"),
        ({"participants": 0}, "participants"),
        ({"healed_from": "no spaces"}, "healed_from"),
        ({"healed_from": "1"}, "healed_from"),  # its own replica
        ({"job": "bad job"}, "job"),
    ):
        error = _refused(record, a, 0, quorum_id=11, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert field in (error.details() or ""), error.details()
    (plain,) = join_all(stub, JOB, "tp:2[2-3]", 1)[0].members
    not_a_replica = _refused(record, plain, 0, group="tp:2[2-3]", quorum_id=11)
    assert not_a_replica.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a replica's group" in (not_a_replica.details() or "")
    forged = _refused(record, a, 0, quorum_id=11, member_secret=b"f" * 32)
    assert forged.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _refused(record, a, 0, epoch=2, quorum_id=11).code() == grpc.StatusCode.NOT_FOUND
    join_all(stub, JOB, group, 2)  # epoch 2: epoch 1's members are fenced
    stale = _refused(record, a, 0, quorum_id=11)
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert [q["quorum_id"] for q in quorums()] == [2**64 - 1, 3]


def test_one_member_cannot_grow_the_log_with_resizes(coordinator: CoordinatorProcess) -> None:
    """A member's valid credential naming ever new saved groups: MAX_PER_EPOCH records, then
    INVALID_ARGUMENT; a repeat of a recorded one is still answered."""
    stub = coordinator.stub()
    (member,) = join_all(stub, JOB, "cap", 1)[0].members

    def record(saved_group: str) -> pb.RecordResizeResponse:
        reply: pb.RecordResizeResponse = stub.RecordResize(
            pb.RecordResizeRequest(
                job=JOB,
                group="cap",
                epoch=1,
                saved_group=saved_group,
                saved_cursor=64,
                rank=0,
                member_id=member,
                member_secret=secret_for(member),
            ),
            timeout=10,
        )
        return reply

    for i in range(MAX_PER_EPOCH):
        assert not record(f"tp:4[{4 * i}-{4 * i + 3}]").existing
    full = _refused(record, "tp:8[0-7]")
    assert full.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"already records {MAX_PER_EPOCH} resizes" in (full.details() or "")
    assert record("tp:4[0-3]").existing
    records = list(stub.ListAudit(pb.ListAuditRequest(job=JOB, kinds=["resize"]), timeout=10))
    assert len(records) == MAX_PER_EPOCH


def test_list_audit_streams_the_chain_with_filters(coordinator: CoordinatorProcess) -> None:
    stub = coordinator.stub()
    for group in ("a", "b"):
        member = join_all(stub, JOB, group, 1, job_seed=5)[0].members[0]
        for seq in range(3):
            _reserve(stub, group, seq, member)

    records = list(stub.ListAudit(pb.ListAuditRequest(), timeout=10))
    assert [r.id for r in records] == list(range(1, len(records) + 1))
    assert records[0].prev_hash == "0" * 64
    for previous, record in itertools.pairwise(records):
        assert record.prev_hash == previous.hash
    for record in records:
        body = {
            "id": record.id,
            "ts_us": record.ts_us,
            "job": record.job,
            "group": record.group,
            "kind": record.kind,
            "actor": record.actor,
            "detail": json.loads(record.detail),
            "prev_hash": record.prev_hash,
        }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        assert hashlib.sha256(canonical).hexdigest() == record.hash
    assert [r.kind for r in records[:4]] == ["job", "group", "epoch", "grant"]
    assert "ipv4:127.0.0.1:" in records[3].actor

    grants_b = list(stub.ListAudit(pb.ListAuditRequest(job=JOB, group="b", kinds=["grant"])))
    assert [(r.group, json.loads(r.detail)["seq"]) for r in grants_b] == [
        ("b", 0),
        ("b", 1),
        ("b", 2),
    ]
    assert len(list(stub.ListAudit(pb.ListAuditRequest(limit=2)))) == 2
    middle = records[5].ts_us
    since = list(stub.ListAudit(pb.ListAuditRequest(since_us=middle)))
    assert all(r.ts_us >= middle for r in since) and records[5] in since
    assert not list(stub.ListAudit(pb.ListAuditRequest(job="nobody")))


def test_divergence_fencing_seed_conflict_and_join_timeout_codes(
    coordinator: CoordinatorProcess,
) -> None:
    stub = coordinator.stub()
    a, b = join_all(stub, JOB, "tp", 2, job_seed=11)[0].members
    _reserve(stub, "tp", 0, a, fingerprint=b"\x01")

    diverged = _refused(_reserve, stub, "tp", 0, b, rank=1, fingerprint=b"\x02")
    assert diverged.code() == grpc.StatusCode.FAILED_PRECONDITION
    message = diverged.details() or ""
    for part in ("'tp'", "epoch 1", "seq 0", "rank 1", "rank 0"):
        assert part in message, message
    kinds = [r.kind for r in stub.ListAudit(pb.ListAuditRequest(job=JOB, kinds=["divergence"]))]
    assert kinds == ["divergence"]
    # The epoch stays diverged for every later lease; each rank is told who disagrees with it.
    later = _refused(_reserve, stub, "tp", 1, a)
    assert later.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert later.details() == message.replace("with rank 1: rank 0.", "with rank 0: rank 1.")

    # Rejoining forms epoch 2 and fences epoch 1.
    join_all(stub, JOB, "tp", 2)
    stale = _refused(_reserve, stub, "tp", 1, a, epoch=1)
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "current epoch is 2" in (stale.details() or "")

    conflict = _refused(
        stub.JoinGroup,
        pb.JoinGroupRequest(
            job=JOB,
            group="x",
            rank=0,
            world_size=1,
            member_id="z",
            member_secret=secret_for("z"),
            job_seed=12,
        ),
        timeout=10,
    )
    assert conflict.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert conflict.details() == f"job {JOB!r} has root seed 11; the request asked for 12"

    timeout = _refused(
        stub.JoinGroup,
        pb.JoinGroupRequest(
            job=JOB,
            group="late",
            rank=1,
            world_size=4,
            member_id="l1",
            member_secret=secret_for("l1"),
            timeout_ms=300,
        ),
        timeout=10,
    )
    assert timeout.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ranks [0, 2, 3] of world size 4 did not join" in (timeout.details() or "")
