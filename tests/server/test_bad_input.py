"""Bad requests get the precise status code, change nothing, and leave the server serving.

Hypothesis generates malformed names, member ids, sizes, fingerprints, cursors, epochs, world
sizes and ranks, and sends them to a live server (one per store backend, shared by the module).
docs/design.md §2.9: each request gets the right code with a message naming the field;
afterwards the server still reports SERVING, the reference group is unchanged, and
`rngcoord verify` passes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import CoordinatorProcess, run_cli, secret_for, wait_for_group
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import MAX_WORLD_SIZE

JOB, GROUP = "bad-input", "ref"
MAX_OFFSET = 2**64 - 4
U64 = 2**64 - 1
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@,\[\]-]{0,127}")
MEMBER = re.compile(r"[A-Za-z0-9._:-]{1,128}")
EXAMPLES = settings(max_examples=50, deadline=None)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
FAILED = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

# Protobuf strings must be valid UTF-8, so surrogates are left out.
_any_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=140)
bad_names = st.one_of(
    st.sampled_from(["", "-lead", ".x", "a b", "a\nb", "ж", "x" * 129, "g#1", "a\x00"]),
    _any_text.filter(lambda s: NAME.fullmatch(s) is None),
)
bad_members = st.one_of(
    st.sampled_from(["", "m/1", "m 1", "m@1", "y" * 129]),
    _any_text.filter(lambda s: MEMBER.fullmatch(s) is None),
)
unknown_names = st.from_regex(r"zz[A-Za-z0-9._:/@,\[\]-]{0,60}", fullmatch=True)


class Ref:
    """The reference group: epoch 2 formed after epoch 1, with one lease granted in it."""

    def __init__(self, server: CoordinatorProcess) -> None:
        self.server = server
        self.stub = server.stub()
        for member in ("old-member", "member-b"):
            joined = self.stub.JoinGroup(
                pb.JoinGroupRequest(
                    job=JOB,
                    group=GROUP,
                    rank=0,
                    world_size=1,
                    member_id=member,
                    member_secret=secret_for(member),
                    job_seed=99,
                ),
                timeout=30,
            )
        self.epoch = joined.epoch
        self.member = "member-b"
        self.lease = self.stub.Reserve(self.reserve_request(seq=0, size=1 << 20), timeout=30).lease
        self.snapshot = self.group()

    def group(self) -> pb.GetGroupResponse:
        reply: pb.GetGroupResponse = self.stub.GetGroup(
            pb.GetGroupRequest(job=JOB, group=GROUP), timeout=30
        )
        return reply

    def reserve_request(self, **fields: Any) -> pb.ReserveRequest:
        base: dict[str, Any] = {
            "job": JOB,
            "group": GROUP,
            "epoch": self.epoch,
            "seq": 1,
            "size": 4096,
            "fingerprint": b"\x01" * 16,
            "rank": 0,
            "member_id": self.member,
        }
        base.update(fields)
        base.setdefault("member_secret", secret_for(base["member_id"]))
        return pb.ReserveRequest(**base)

    def restore_request(self, **fields: Any) -> pb.RestoreRequest:
        base: dict[str, Any] = {
            "job": JOB,
            "group": GROUP,
            "epoch": self.epoch,
            "seq": 1,
            "cursor": 0,
            "rank": 0,
            "member_id": self.member,
        }
        base.update(fields)
        base.setdefault("member_secret", secret_for(base["member_id"]))
        return pb.RestoreRequest(**base)

    def leave_request(self, **fields: Any) -> pb.LeaveGroupRequest:
        base: dict[str, Any] = {
            "job": JOB,
            "group": GROUP,
            "epoch": self.epoch,
            "rank": 0,
            "member_id": self.member,
        }
        base.update(fields)
        base.setdefault("member_secret", secret_for(base["member_id"]))
        return pb.LeaveGroupRequest(**base)

    def join_request(self, **fields: Any) -> pb.JoinGroupRequest:
        base: dict[str, Any] = {
            "job": JOB,
            "group": GROUP,
            "rank": 0,
            "world_size": 1,
            "member_id": "joiner",
            "timeout_ms": 2000,
            "include_members": True,
        }
        base.update(fields)
        base.setdefault("member_secret", secret_for(base["member_id"]))
        return pb.JoinGroupRequest(**base)

    def call(self, method: str, request: Any) -> grpc.RpcError:
        """Send `request`; it must fail. Returns the error."""
        with pytest.raises(grpc.RpcError) as caught:
            getattr(self.stub, method)(request, timeout=30)
        error: grpc.RpcError = caught.value
        return error

    def expect(self, code: grpc.StatusCode, method: str, request: Any, *words: str) -> None:
        """Send `request` and check the status code and that the message has every word."""
        error = self.call(method, request)
        assert error.code() == code, f"{method}({request}) -> {error.code()}: {error.details()}"
        details = error.details() or ""
        for word in words:
            assert word in details, f"{method} error {details!r} does not mention {word!r}"

    def check_untouched(self) -> None:
        """The server serves, the reference group is as it was, and the store verifies."""
        assert self.server.health() == "SERVING"
        assert self.group() == self.snapshot
        verified = run_cli("verify", "--db", self.server.db_url)
        assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.fixture(scope="module")
def ref(module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ref]:
    server = CoordinatorProcess(module_store_url, tmp_path_factory.mktemp("bad-input-server"))
    try:
        yield Ref(server.start())
    finally:
        server.close()


def test_bad_job_and_group_names_are_invalid_argument(ref: Ref) -> None:
    @EXAMPLES
    @given(name=bad_names, field=st.sampled_from(["job", "group"]))
    def check(name: str, field: str) -> None:
        ref.expect(INVALID, "JoinGroup", ref.join_request(**{field: name}), field)
        ref.expect(INVALID, "Reserve", ref.reserve_request(**{field: name}), field)
        ref.expect(INVALID, "Restore", ref.restore_request(**{field: name}), field)
        ref.expect(INVALID, "LeaveGroup", ref.leave_request(**{field: name}), field)
        get: dict[str, Any] = {"job": JOB, "group": GROUP, field: name}
        ref.expect(INVALID, "GetGroup", pb.GetGroupRequest(**get), field)
        if name:  # empty: the cursor is this job's own
            ref.expect(INVALID, "Restore", ref.restore_request(from_job=name), "from_job")

    check()
    ref.check_untouched()


def test_bad_member_ids_are_invalid_argument(ref: Ref) -> None:
    @EXAMPLES
    @given(member=bad_members)
    def check(member: str) -> None:
        ref.expect(INVALID, "JoinGroup", ref.join_request(member_id=member), "member_id")
        ref.expect(INVALID, "Reserve", ref.reserve_request(member_id=member), "member_id")
        ref.expect(INVALID, "Restore", ref.restore_request(member_id=member), "member_id")
        ref.expect(INVALID, "LeaveGroup", ref.leave_request(member_id=member), "member_id")

    check()
    ref.check_untouched()


def test_bad_sizes_fingerprints_and_cursors_are_invalid_argument(ref: Ref) -> None:
    @EXAMPLES
    @given(
        size=st.integers(0, U64).filter(lambda v: v == 0 or v % 4 != 0),
        fingerprint=st.one_of(st.just(b""), st.binary(min_size=65, max_size=300)),
        cursor=st.integers(0, U64).filter(lambda v: v % 4 != 0),
    )
    def check(size: int, fingerprint: bytes, cursor: int) -> None:
        ref.expect(INVALID, "Reserve", ref.reserve_request(size=size), "size")
        ref.expect(INVALID, "Reserve", ref.reserve_request(fingerprint=fingerprint), "fingerprint")
        ref.expect(INVALID, "Restore", ref.restore_request(cursor=cursor), "cursor")
        # A join's position is a cursor too (a failover gap moves the high-water mark to it).
        ref.expect(INVALID, "JoinGroup", ref.join_request(position=cursor), "position")

    check()
    ref.check_untouched()


def test_leases_past_the_offset_space_are_resource_exhausted(ref: Ref) -> None:
    # Sizes are uint64 on the wire, so "at least 2^64" cannot be sent; what can be sent is a
    # size that, added to the group's cursor, would pass 2^64 - 4.
    room = MAX_OFFSET - ref.lease.end

    @EXAMPLES
    @given(size=st.integers(room // 4 + 1, MAX_OFFSET // 4).map(lambda k: 4 * k))
    def check(size: int) -> None:
        ref.expect(EXHAUSTED, "Reserve", ref.reserve_request(size=size), GROUP)

    check()
    ref.check_untouched()


def test_a_group_can_use_its_whole_offset_space_and_no_more(ref: Ref) -> None:
    group, member = "full", "f0"
    ref.stub.JoinGroup(ref.join_request(group=group, member_id=member), timeout=30)
    whole = ref.stub.Reserve(
        ref.reserve_request(group=group, epoch=1, seq=0, size=MAX_OFFSET, member_id=member),
        timeout=30,
    )
    assert (whole.lease.start, whole.lease.end) == (0, MAX_OFFSET)
    ref.expect(
        EXHAUSTED,
        "Reserve",
        ref.reserve_request(group=group, epoch=1, seq=1, size=4, member_id=member),
        group,
    )
    # A new epoch starts at the high-water mark, so it has no room either.
    rejoined = ref.stub.JoinGroup(ref.join_request(group=group, member_id="f1"), timeout=30)
    assert rejoined.start == MAX_OFFSET
    ref.expect(
        EXHAUSTED,
        "Reserve",
        ref.reserve_request(group=group, epoch=rejoined.epoch, seq=0, size=4, member_id="f1"),
    )
    ref.check_untouched()


def test_unknown_jobs_groups_and_future_epochs_are_not_found(ref: Ref) -> None:
    @EXAMPLES
    @given(
        name=unknown_names,
        field=st.sampled_from(["job", "group"]),
        # Epoch 0 means "none formed yet": no request can name it.
        epoch=st.one_of(st.just(0), st.integers(ref.epoch + 1, U64)),
    )
    def check(name: str, field: str, epoch: int) -> None:
        ref.expect(NOT_FOUND, "Reserve", ref.reserve_request(**{field: name}))
        ref.expect(NOT_FOUND, "Restore", ref.restore_request(**{field: name}))
        ref.expect(NOT_FOUND, "LeaveGroup", ref.leave_request(**{field: name}))
        get: dict[str, Any] = {"job": JOB, "group": GROUP, field: name}
        ref.expect(NOT_FOUND, "GetGroup", pb.GetGroupRequest(**get))
        ref.expect(NOT_FOUND, "Reserve", ref.reserve_request(epoch=epoch), str(epoch))

    check()
    ref.check_untouched()


def test_stale_epochs_and_non_members_are_failed_precondition(ref: Ref) -> None:
    @EXAMPLES
    @given(epoch=st.integers(1, ref.epoch - 1), seq=st.integers(0, 2**40))
    def check(epoch: int, seq: int) -> None:
        current = str(ref.epoch)
        ref.expect(FAILED, "Reserve", ref.reserve_request(epoch=epoch, seq=seq), current)
        ref.expect(FAILED, "Restore", ref.restore_request(epoch=epoch, seq=seq), current)
        ref.expect(FAILED, "LeaveGroup", ref.leave_request(epoch=epoch), current)

    check()
    # The member of the fenced epoch 1, and a stranger, are refused in the current epoch.
    for member in ("old-member", "stranger"):
        ref.expect(FAILED, "Reserve", ref.reserve_request(member_id=member), member)
        ref.expect(FAILED, "Restore", ref.restore_request(member_id=member), member)
    ref.check_untouched()


def test_bad_world_sizes_and_ranks_are_refused(ref: Ref) -> None:
    group = "barrier"
    # Rank 0 waits in the barrier of world size 2 while the bad joins arrive.
    first: dict[str, Any] = {}
    waiting = threading.Thread(
        target=lambda: first.update(
            reply=ref.stub.JoinGroup(
                ref.join_request(group=group, world_size=2, member_id="w0", timeout_ms=60_000),
                timeout=90,
            )
        )
    )
    waiting.start()
    try:
        wait_for_group(ref.stub, JOB, group)

        @EXAMPLES
        @given(
            world_size=st.one_of(st.just(0), st.integers(MAX_WORLD_SIZE + 1, 2**32 - 1)),
            mismatch=st.integers(3, MAX_WORLD_SIZE).flatmap(
                lambda ws: st.tuples(st.just(ws), st.integers(1, ws - 1))
            ),
            overflow=st.integers(1, MAX_WORLD_SIZE).flatmap(
                lambda ws: st.tuples(st.just(ws), st.integers(ws, 2**32 - 1))
            ),
        )
        def check(world_size: int, mismatch: tuple[int, int], overflow: tuple[int, int]) -> None:
            join = ref.join_request
            ref.expect(INVALID, "JoinGroup", join(world_size=world_size), "world_size")
            size, rank = overflow
            ref.expect(INVALID, "JoinGroup", join(world_size=size, rank=rank), "rank")
            size, rank = mismatch
            ref.expect(
                FAILED,
                "JoinGroup",
                join(group=group, world_size=size, rank=rank, member_id=f"w{rank}"),
                "2",
                str(size),
            )

        check()
        # The barrier was not disturbed: rank 1 completes it.
        second = ref.stub.JoinGroup(
            ref.join_request(group=group, world_size=2, rank=1, member_id="w1"), timeout=30
        )
    finally:
        waiting.join(timeout=90)
    assert first["reply"].epoch == second.epoch == 1
    assert list(second.members) == ["w0", "w1"]
    ref.check_untouched()
