"""Attest: op-count fingerprints compared across an epoch's members, on a live server.

The first attestation of (epoch, anchor_seq, ops) stands; equal ones write nothing; other
bytes make the epoch diverged (DIVERGENCE, audited, refused from then on by Attest and
Reserve); bad fields, unknown groups, stale epochs and non-members get their precise reason
and change nothing; `rngcoord verify` passes on the store afterwards.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import pytest

from harness import CoordinatorProcess, join_all, run_cli, secret_for
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import ATTEST_EVERY
from rngcoord.v1.status import error_info

JOB, GROUP = "attest", "g"


def _refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, Mapping[str, str]]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info = error_info(caught.value)
    assert info is not None, caught.value
    return caught.value.code(), info.reason, info.metadata


def test_attest(coordinator: CoordinatorProcess) -> None:
    stub = coordinator.stub()
    replies = join_all(stub, JOB, GROUP, 3, job_seed=5)
    epoch = replies[0].epoch
    members = list(replies[0].members)

    def attest(rank: int, fingerprint: bytes, **fields: Any) -> pb.AttestResponse:
        request: dict[str, Any] = {
            "job": JOB,
            "group": GROUP,
            "epoch": epoch,
            "anchor_seq": 0,
            "ops": ATTEST_EVERY,
            "fingerprint": fingerprint,
            "rank": rank,
            "member_id": members[rank],
            "member_secret": secret_for(members[rank]),
        }
        request.update(fields)
        reply: pb.AttestResponse = stub.Attest(pb.AttestRequest(**request), timeout=30)
        return reply

    # The ops attested drew from leases: 4 of 2 * ATTEST_EVERY ops each (an attestation may
    # not come ahead of what the leases since its anchor hold).
    for seq in range(4):
        stub.Reserve(
            pb.ReserveRequest(
                job=JOB,
                group=GROUP,
                epoch=epoch,
                seq=seq,
                size=8 * ATTEST_EVERY,
                fingerprint=b"same",
                rank=0,
                member_id=members[0],
                member_secret=secret_for(members[0]),
            ),
            timeout=30,
        )
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for fields, field in (
        ({"ops": 0}, "ops"),
        ({"ops": ATTEST_EVERY + 1}, "ops"),
        ({"ops": 1 << 63}, "ops"),
        ({"anchor_seq": 1 << 63}, "seq"),
        ({"member_id": "a b"}, "member_id"),
    ):
        code, reason, meta = _refusal(functools.partial(attest, 0, b"f", **fields))
        assert (code, reason, meta.get("field")) == (invalid, "INVALID_FIELD", field)
    for fingerprint in (b"", b"x" * 65):
        code, reason, meta = _refusal(functools.partial(attest, 0, fingerprint))
        assert (code, reason, meta.get("field")) == (invalid, "INVALID_FIELD", "fingerprint")
    assert _refusal(lambda: attest(0, b"f", group="nope"))[1] == "UNKNOWN_GROUP"
    assert _refusal(lambda: attest(0, b"f", epoch=epoch + 1))[1] == "UNKNOWN_EPOCH"
    assert _refusal(lambda: attest(0, b"f", member_id="someone-else"))[1] == "NOT_MEMBER"

    # Agreeing members: the first stands, the others compare and write nothing.
    attest(0, b"same")
    attest(1, b"same")
    attest(0, b"same")  # a retry is harmless
    attest(0, b"other", ops=2 * ATTEST_EVERY)  # another count: its own first attestation
    attest(0, b"again", anchor_seq=3)  # another anchor (after a Restore): its own count

    # A member that ran other ops: divergence, naming both ranks, audited.
    code, reason, meta = _refusal(lambda: attest(2, b"diff"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "DIVERGENCE")
    assert meta["group"] == GROUP and meta["epoch"] == str(epoch)
    # From then on the epoch refuses attestations and leases, to every member.
    assert _refusal(lambda: attest(1, b"same", ops=2 * ATTEST_EVERY))[1] == "DIVERGENCE"
    reserve = pb.ReserveRequest(
        job=JOB,
        group=GROUP,
        epoch=epoch,
        seq=0,
        size=8 * ATTEST_EVERY,
        fingerprint=b"same",
        rank=0,
        member_id=members[0],
        member_secret=secret_for(members[0]),
    )
    assert _refusal(lambda: stub.Reserve(reserve, timeout=30))[1] == "DIVERGENCE"
    records = [
        r
        for r in stub.ListAudit(pb.ListAuditRequest(job=JOB), timeout=30)
        if r.kind == "divergence"
    ]
    assert len(records) == 1
    detail = json.loads(records[0].detail)
    assert (detail["ops"], detail["rank"], detail["first"]["rank"]) == (ATTEST_EVERY, 2, 0)

    # A new epoch starts clean, and the store verifies.
    again = join_all(stub, JOB, GROUP, 1)
    assert again[0].epoch == epoch + 1
    verified = run_cli("verify", "--db", coordinator.db_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
