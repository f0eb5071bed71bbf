"""Every refusal carries a typed reason: the ErrorInfo on the wire, and the client's error.

One live `rngcoord serve` (tokens on) is driven into each refusal of coordinator.proto's
`ErrorReason`. For each, the raw gRPC error must carry the documented status code and an
ErrorInfo of domain "rngcoord.v1" with the reason and metadata, and `CoordinatorClient` must
raise the error class that the reason (never the message's text) selects, carrying the same
reason and metadata.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import grpc
import pytest

from harness import CoordinatorProcess, join_all, secret_for
from rngcoord.client import (
    AuthenticationError,
    CoordinatorClient,
    DivergenceError,
    FailedPreconditionError,
    InvalidRequest,
    JoinTimeoutError,
    NotFoundError,
    NotMemberError,
    OffsetsExhausted,
    PermissionDeniedError,
    RestoreTimeoutError,
    RNGCoordError,
    StaleEpochError,
)
from rngcoord.client._connection import adopt_member_secret
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.rules import DOMAIN, MAX_OFFSET
from rngcoord.v1.status import error_info

JOB = "reasons"
TOKEN = "reasons-token"
ADMIN = "admin-token"
AUDITOR = "auditor-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    root = tmp_path_factory.mktemp("reasons")
    tokens = root / "tokens"
    tokens.write_text(f"{JOB} {TOKEN}\n* {ADMIN}\nreader auditor {JOB} {AUDITOR}\n")
    proc = CoordinatorProcess(
        f"sqlite:///{root / 'store.db'}", root, args=("--tokens", str(tokens))
    )
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def stub(server: CoordinatorProcess) -> pb_grpc.CoordinatorStub:
    return server.stub()


@pytest.fixture(scope="module")
def client(server: CoordinatorProcess) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(server.address, token=TOKEN, outage_s=0) as c:
        yield c


def _raw(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, Mapping[str, str]]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error = caught.value
    info = error_info(error)
    assert info is not None, f"no ErrorInfo of domain {DOMAIN} in {error}"
    return error.code(), info.reason, info.metadata


def _client(call: Callable[[], object], cls: type[RNGCoordError]) -> RNGCoordError:
    with pytest.raises(RNGCoordError) as caught:
        call()
    assert type(caught.value) is cls, caught.value
    return caught.value


def _formed(stub: pb_grpc.CoordinatorStub, group: str, world_size: int = 1) -> list[str]:
    """Form an epoch of `group`; return its member ids by rank (the client below may act as
    them: it holds their test secrets)."""
    members = list(join_all(stub, JOB, group, world_size, metadata=AUTH)[0].members)
    for member in members:
        adopt_member_secret(member, secret_for(member))
    return members


def _reserve(
    group: str, member: str, *, epoch: int = 1, seq: int = 0, size: int = 64, fp: bytes = b"a"
) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        job=JOB,
        group=group,
        epoch=epoch,
        seq=seq,
        size=size,
        fingerprint=fp,
        rank=0,
        member_id=member,
        member_secret=secret_for(member),
    )


def test_invalid_field(stub: pb_grpc.CoordinatorStub, client: CoordinatorClient) -> None:
    request = pb.GetGroupRequest(job=JOB, group="bad group")
    code, reason, meta = _raw(lambda: stub.GetGroup(request, metadata=AUTH))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    assert meta == {"field": "group", "value": "'bad group'"}
    error = _client(lambda: client.get_group(JOB, "bad group"), InvalidRequest)
    assert (error.reason, dict(error.metadata)) == ("INVALID_FIELD", meta)


def test_unknown_job_group_and_epoch(
    stub: pb_grpc.CoordinatorStub, client: CoordinatorClient, server: CoordinatorProcess
) -> None:
    with CoordinatorClient(server.address, token=ADMIN, outage_s=0) as admin:
        error = _client(lambda: admin.get_group("no-such-job", "g"), NotFoundError)
    assert (error.reason, dict(error.metadata)) == ("UNKNOWN_JOB", {"job": "no-such-job"})
    _formed(stub, "known")
    code, reason, meta = _raw(
        lambda: stub.GetGroup(pb.GetGroupRequest(job=JOB, group="unknown"), metadata=AUTH)
    )
    assert (code, reason, meta) == (
        grpc.StatusCode.NOT_FOUND,
        "UNKNOWN_GROUP",
        {"job": JOB, "group": "unknown"},
    )
    _client(lambda: client.get_group(JOB, "unknown"), NotFoundError)
    members = _formed(stub, "epochs")
    code, reason, meta = _raw(
        lambda: stub.Reserve(_reserve("epochs", members[0], epoch=7), metadata=AUTH)
    )
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_EPOCH")
    assert meta == {"job": JOB, "group": "epochs", "epoch": "7", "current_epoch": "1"}


def test_stale_epoch_and_not_member(
    stub: pb_grpc.CoordinatorStub, client: CoordinatorClient
) -> None:
    old = _formed(stub, "fenced")
    _formed(stub, "fenced")
    code, reason, meta = _raw(lambda: stub.Reserve(_reserve("fenced", old[0]), metadata=AUTH))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH")
    assert meta == {"job": JOB, "group": "fenced", "epoch": "1", "current_epoch": "2"}
    error = _client(
        lambda: client.reserve(
            JOB, "fenced", epoch=1, seq=0, size=64, fingerprint=b"a", rank=0, member_id=old[0]
        ),
        StaleEpochError,
    )
    assert error.metadata["current_epoch"] == "2"
    code, reason, meta = _raw(
        lambda: stub.Reserve(_reserve("fenced", "intruder", epoch=2), metadata=AUTH)
    )
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NOT_MEMBER")
    assert meta == {
        "job": JOB,
        "group": "fenced",
        "epoch": "2",
        "rank": "0",
        "member_id": "intruder",
    }
    _client(
        lambda: client.reserve(
            JOB, "fenced", epoch=2, seq=0, size=64, fingerprint=b"a", rank=0, member_id="intruder"
        ),
        NotMemberError,
    )


def test_divergence(stub: pb_grpc.CoordinatorStub, client: CoordinatorClient) -> None:
    members = _formed(stub, "diverging", world_size=2)
    stub.Reserve(_reserve("diverging", members[0], fp=b"rank0"), metadata=AUTH)
    request = pb.ReserveRequest(
        job=JOB,
        group="diverging",
        epoch=1,
        seq=0,
        size=64,
        fingerprint=b"rank1",
        rank=1,
        member_id=members[1],
        member_secret=secret_for(members[1]),
    )
    code, reason, meta = _raw(lambda: stub.Reserve(request, metadata=AUTH))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "DIVERGENCE")
    assert meta == {
        "job": JOB,
        "group": "diverging",
        "epoch": "1",
        "seq": "0",
        "ranks": "0,1",
        "first": "0",
        "divergent": "1",
        "disagree": "0",
    }
    # Every later Reserve of the epoch is refused with the same reason and metadata.
    error = _client(
        lambda: client.reserve(
            JOB,
            "diverging",
            epoch=1,
            seq=1,
            size=64,
            fingerprint=b"x",
            rank=0,
            member_id=members[0],
        ),
        DivergenceError,
    )
    assert (error.reason, dict(error.metadata)) == ("DIVERGENCE", {**meta, "disagree": "1"})


def test_bad_credential(stub: pb_grpc.CoordinatorStub, client: CoordinatorClient) -> None:
    # Member ids are no credentials: GetGroup lists them to any holder of the job's token.
    members = list(join_all(stub, JOB, "impersonated", 2, metadata=AUTH)[0].members)
    forged = b"f" * 32
    request = pb.ReserveRequest(
        job=JOB,
        group="impersonated",
        epoch=1,
        seq=0,
        size=64,
        fingerprint=b"a",
        rank=1,
        member_id=members[1],
        member_secret=forged,
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Reserve(request, metadata=AUTH)
    code, reason, meta = _raw(lambda: stub.Reserve(request, metadata=AUTH))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "BAD_CREDENTIAL")
    assert meta == {"job": JOB, "group": "impersonated", "epoch": "1", "rank": "1"}
    assert forged.decode() not in (caught.value.details() or "")
    # This process never joined as that member: its client holds another secret for it.
    error = _client(
        lambda: client.reserve(
            JOB,
            "impersonated",
            epoch=1,
            seq=0,
            size=64,
            fingerprint=b"a",
            rank=1,
            member_id=members[1],
        ),
        PermissionDeniedError,
    )
    assert (error.reason, dict(error.metadata)) == ("BAD_CREDENTIAL", meta)


def test_seed_conflict_and_world_size_mismatch(
    stub: pb_grpc.CoordinatorStub, client: CoordinatorClient
) -> None:
    _formed(stub, "seeded")
    job_seed = stub.GetGroup(pb.GetGroupRequest(job=JOB, group="seeded"), metadata=AUTH).job_seed
    wrong = (job_seed + 1) % 2**64
    error = _client(
        lambda: client.join_group(
            JOB, "seeded", rank=0, world_size=1, member_id="m-seed", job_seed=wrong, timeout_s=5
        ),
        FailedPreconditionError,
    )
    assert error.reason == "SEED_CONFLICT"
    assert error.metadata == {"job": JOB, "seed": str(job_seed), "requested_seed": str(wrong)}
    waiting: grpc.Future = stub.JoinGroup.future(  # type: ignore[type-arg]
        pb.JoinGroupRequest(
            job=JOB,
            group="sizes",
            rank=0,
            world_size=2,
            member_id="w0",
            member_secret=secret_for("w0"),
            timeout_ms=20_000,
        ),
        metadata=AUTH,
    )
    # Rank 0 must be waiting (its join committed, so the group exists) before rank 1 asks.
    deadline = time.monotonic() + 30
    while True:
        try:
            stub.GetGroup(pb.GetGroupRequest(job=JOB, group="sizes"), metadata=AUTH, timeout=5)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline
            time.sleep(0.02)
    try:
        error = _client(
            lambda: client.join_group(
                JOB, "sizes", rank=1, world_size=3, member_id="w1", timeout_s=5
            ),
            FailedPreconditionError,
        )
        assert error.reason == "WORLD_SIZE_MISMATCH"
        assert error.metadata == {
            "job": JOB,
            "group": "sizes",
            "world_size": "3",
            "waiting_world_size": "2",
            "ranks": "0",
        }
    finally:
        waiting.cancel()


def test_seq_out_of_order_and_offsets_exhausted(
    stub: pb_grpc.CoordinatorStub, client: CoordinatorClient
) -> None:
    members = _formed(stub, "order")
    error = _client(
        lambda: client.reserve(
            JOB, "order", epoch=1, seq=3, size=64, fingerprint=b"a", rank=0, member_id=members[0]
        ),
        FailedPreconditionError,
    )
    assert (error.reason, dict(error.metadata)) == (
        "SEQ_OUT_OF_ORDER",
        {"job": JOB, "group": "order", "epoch": "1", "seq": "3"},
    )
    huge = MAX_OFFSET - 60
    stub.Reserve(_reserve("order", members[0], size=huge), metadata=AUTH)
    code, reason, meta = _raw(
        lambda: stub.Reserve(_reserve("order", members[0], seq=1, size=64), metadata=AUTH)
    )
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OFFSETS_EXHAUSTED")
    assert meta == {"job": JOB, "group": "order", "start": str(huge), "size": "64"}
    _client(
        lambda: client.reserve(
            JOB, "order", epoch=1, seq=1, size=64, fingerprint=b"a", rank=0, member_id=members[0]
        ),
        OffsetsExhausted,
    )


def test_restore_conflict(stub: pb_grpc.CoordinatorStub, client: CoordinatorClient) -> None:
    members = _formed(stub, "restored")
    stub.Reserve(_reserve("restored", members[0]), metadata=AUTH)
    error = _client(
        lambda: client.restore(
            JOB, "restored", epoch=1, seq=0, cursor=0, rank=0, member_id=members[0]
        ),
        FailedPreconditionError,
    )
    assert error.reason == "RESTORE_CONFLICT"
    assert error.metadata == {
        "job": JOB,
        "group": "restored",
        "epoch": "1",
        "seq": "0",
        "cursor": "0",
    }


def test_join_timeout(client: CoordinatorClient) -> None:
    error = _client(
        lambda: client.join_group(
            JOB, "alone", rank=0, world_size=3, member_id="a0", timeout_s=0.3
        ),
        JoinTimeoutError,
    )
    assert error.code == "DEADLINE_EXCEEDED"
    assert (error.reason, dict(error.metadata)) == (
        "JOIN_TIMEOUT",
        {"job": JOB, "group": "alone", "world_size": "3", "missing": "1,2"},
    )


def test_bad_token(server: CoordinatorProcess, tmp_path: Path) -> None:
    with CoordinatorClient(server.address, token="wrong", outage_s=0) as wrong:
        error = _client(lambda: wrong.get_group(JOB, "known"), AuthenticationError)
    assert (error.reason, dict(error.metadata)) == ("BAD_TOKEN", {"job": JOB})


def test_not_permitted(server: CoordinatorProcess) -> None:
    with CoordinatorClient(server.address, token=AUDITOR, outage_s=0) as auditor:
        error = _client(
            lambda: auditor.join_group(JOB, "g", rank=0, world_size=1, member_id="x"),
            PermissionDeniedError,
        )
    assert error.reason == "NOT_PERMITTED"
    assert dict(error.metadata) == {
        "job": JOB,
        "method": "JoinGroup",
        "identity": "reader",
        "role": "auditor",
    }


def test_restore_timeout(stub: pb_grpc.CoordinatorStub, client: CoordinatorClient) -> None:
    members = _formed(stub, "voted", world_size=2)
    error = _client(
        lambda: client.restore(
            JOB, "voted", epoch=1, seq=0, cursor=0, rank=0, member_id=members[0], timeout_s=0.2
        ),
        RestoreTimeoutError,
    )
    assert error.reason == "RESTORE_TIMEOUT"
    assert dict(error.metadata) == {
        "job": JOB,
        "group": "voted",
        "epoch": "1",
        "seq": "0",
        "cursor": "0",
        "missing": "1",
    }


def test_malformed_request(server: CoordinatorProcess) -> None:
    raw = server.channel().unary_unary(
        "/rngcoord.v1.Coordinator/Reserve", request_serializer=None, response_deserializer=None
    )
    code, reason, meta = _raw(lambda: raw(b"\xff\xff", metadata=AUTH, timeout=10))
    assert (code, reason, dict(meta)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_REQUEST",
        {"method": "Reserve"},
    )


def test_every_reason_is_exercised() -> None:
    # The reasons a live server can be driven into here. Tests of their own: STORE_UNAVAILABLE
    # and STORE_LOST (tests/server/test_store_loss.py), RATE_LIMITED (test_gate.py),
    # TOO_MANY_STREAMS (tests/server/test_hostile.py), JOB_IN_USE (tests/server/test_launches.py),
    # INTERNAL_ERROR (a server bug).
    tested = {
        "INVALID_FIELD",
        "UNKNOWN_JOB",
        "UNKNOWN_GROUP",
        "UNKNOWN_EPOCH",
        "STALE_EPOCH",
        "NOT_MEMBER",
        "DIVERGENCE",
        "SEED_CONFLICT",
        "WORLD_SIZE_MISMATCH",
        "SEQ_OUT_OF_ORDER",
        "RESTORE_CONFLICT",
        "OFFSETS_EXHAUSTED",
        "JOIN_TIMEOUT",
        "BAD_TOKEN",
        "NOT_PERMITTED",
        "RESTORE_TIMEOUT",
        "MALFORMED_REQUEST",
        "BAD_CREDENTIAL",
    }
    declared = set(pb.ErrorReason.keys()) - {"ERROR_REASON_UNSPECIFIED"}
    assert declared - tested == {
        "STORE_UNAVAILABLE",
        "STORE_LOST",
        "RATE_LIMITED",
        "TOO_MANY_STREAMS",
        "JOB_IN_USE",
        "INTERNAL_ERROR",
    }
    assert tested <= declared
