"""The transport-free Coordinator on real SQLite files: leases, joins, fencing, leave, restore.

Every test opens a fresh database file in tmp_path and drives the asynchronous Coordinator
from a `LoopThread`. `CountingStore` wraps the real SqliteStore only to count the writes that
go through it, which is how "an idempotent hit does no write" is checked. Join timeouts run on
a `ManualClock`, so no test sleeps through one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from harness import (
    CountingStore,
    InProcess,
    LoopThread,
    ManualClock,
    caller,
    form,
    gather_list,
    join,
    records,
    reserve,
    secret_for,
)
from rngcoord.server.audit.verify import verify
from rngcoord.server.core import divergences, seeds
from rngcoord.server.core.coordinator import Coordinator
from rngcoord.server.core.membership import Caller
from rngcoord.server.errors import (
    CoordinatorError,
    Divergence,
    FailedPrecondition,
    InvalidArgument,
    JoinTimeout,
    NotFound,
    NotMember,
    ResourceExhausted,
    RestoreTimeout,
    StaleEpoch,
)
from rngcoord.server.storage.sqlite import SqliteStore
from rngcoord.v1.rules import ATTEST_EVERY, MAX_OFFSET
from rngcoord.v1.types import AuditRecord, JoinResult, Lease, RestoreResult, members_digest

T = TypeVar("T")

JOB = "job-1"
TABLES = (
    "jobs",
    "groups",
    "epochs",
    "members",
    "pending_joins",
    "leases",
    "restores",
    "audit",
    "audit_head",
)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "coordinator.db"


@pytest.fixture
def store(db: Path) -> Iterator[CountingStore]:
    s = CountingStore(SqliteStore(db, create=True))
    yield s
    s.close()


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def h(loop: LoopThread, store: CountingStore, clock: ManualClock) -> Iterator[InProcess]:
    harness = InProcess(loop, store, clock)
    yield harness
    harness.close()


def dump(store: CountingStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, to show that a request changed nothing."""
    return store.read(lambda tx: {t: sorted(tx.fetchall(f"SELECT * FROM {t}")) for t in TABLES})


def pending(h: InProcess) -> list[tuple[Any, ...]]:
    """(rank, member_id) of the joins waiting in a barrier (withdrawn ones left out)."""
    return h.store.read(
        lambda tx: tx.fetchall(
            "SELECT rank, member_id FROM pending_joins WHERE expires_us <> 0 ORDER BY rank"
        )
    )


def settle(h: InProcess, condition: Callable[[], bool]) -> None:
    """Let the loop run until `condition` holds (the test's timeout bounds one that never
    does). Time does not move: only tasks that are ready run."""
    while not condition():
        h.run(asyncio.sleep(0.005))


# ------------------------------------------------------------------------------ leases


def test_reserve_is_idempotent_and_a_hit_does_no_write(h: InProcess) -> None:
    epoch = form(h)
    first = reserve(h, 0, rank=0, member="m0")
    assert first == Lease("g", 1, 0, epoch.seed, 0, 64, existing=False)
    writes, before = h.store.writes, dump(h.store)
    again = reserve(h, 0, rank=1, member="m1")
    replay = reserve(h, 0, rank=0, member="m0")
    assert again == replay == Lease("g", 1, 0, epoch.seed, 0, 64, existing=True)
    assert h.store.writes == writes
    assert dump(h.store) == before
    assert len(records(h, "grant")) == 1


def test_a_lease_that_memory_dropped_is_answered_by_the_writer_as_a_hit(h: InProcess) -> None:
    # Memory knows the epoch and the member but not the lease (the bounded cache evicted
    # it): the Reserve goes to the writer without a read first, and the writer's transaction
    # finds the lease and answers it, granting nothing and appending no record.
    epoch = form(h)
    reserve(h, 0)
    reserve(h, 0)  # a hit: the epoch and the member are now in memory
    h.coord._cache.leases.drop((JOB, "g", 1, 0))
    writes, before = h.store.writes, dump(h.store)
    assert reserve(h, 0) == Lease("g", 1, 0, epoch.seed, 0, 64, existing=True)
    assert h.store.writes == writes + 1
    assert dump(h.store) == before
    assert len(records(h, "grant")) == 1
    # A different size for the same lease is still a divergence, recorded by the writer.
    h.coord._cache.leases.drop((JOB, "g", 1, 0))
    with pytest.raises(Divergence):
        reserve(h, 0, size=128)
    assert len(records(h, "divergence")) == 1


def test_seqs_are_contiguous_and_raise_the_high_water_mark(h: InProcess) -> None:
    form(h)
    sizes = [4, 64, 1 << 32, 12]
    leases = [reserve(h, seq, size=size) for seq, size in enumerate(sizes)]
    assert leases[0].start == 0
    for prev, lease, size in zip(leases, leases[1:], sizes[1:], strict=False):
        assert lease.start == prev.end
        assert lease.end - lease.start == size
    info = h.run(h.coord.get_group(JOB, "g"))
    assert (info.high_water, info.leases) == (leases[-1].end, 4)
    # A new epoch continues from the high-water mark, so nothing is reused.
    second = form(h, members=("n0", "n1"))
    assert (second.epoch, second.start) == (2, leases[-1].end)
    assert reserve(h, 0, epoch=2, member="n0").start == leases[-1].end


def test_out_of_order_seq_is_refused_without_a_write(h: InProcess) -> None:
    form(h)
    reserve(h, 0)
    before = dump(h.store)
    with pytest.raises(FailedPrecondition) as err:
        reserve(h, 2)
    assert err.value.message == "lease seq 2 of group 'g' epoch 1 requested before seq 1"
    assert err.value.reason_name == "SEQ_OUT_OF_ORDER"
    assert dump(h.store) == before


def test_divergence_is_recorded_named_and_poisons_the_epoch(h: InProcess) -> None:
    form(h)
    reserve(h, 0, fp=b"\x01\x02", rank=0, member="m0")
    with pytest.raises(Divergence) as err:
        reserve(h, 0, size=128, fp=b"\x03", rank=1, member="m1")
    message = err.value.message
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    said = (
        "divergence in group 'g' epoch 1 at seq 0: rank 0 sent size=64 fingerprint=0102; "
        "rank 1 sent size=128 fingerprint=03. Rank 0 spoke first; the divergent side: rank 1. "
        "The ranks disagree about the sequence of random ops."
    )
    assert message == said + " Disagreeing with rank 1: rank 0."
    assert err.value.metadata == {
        "job": JOB,
        "group": "g",
        "epoch": "1",
        "seq": "0",
        "ranks": "0,1",
        "first": "0",
        "divergent": "1",
        "disagree": "0",
    }
    (record,) = records(h, "divergence")
    assert record.detail["first"]["rank"] == 0 and record.detail["rank"] == 1
    # From now on the epoch refuses every lease, even a matching repeat, without writing;
    # each rank hears which ranks disagree with it.
    before = dump(h.store)
    for seq, rank, member, disagree in [(0, 0, "m0", 1), (1, 0, "m0", 1), (1, 1, "m1", 0)]:
        with pytest.raises(Divergence) as later:
            reserve(h, seq, fp=b"\x01\x02", rank=rank, member=member)
        assert later.value.message == f"{said} Disagreeing with rank {rank}: rank {disagree}."
    assert dump(h.store) == before


def test_a_divergence_names_every_side_and_the_minority_as_divergent(h: InProcess) -> None:
    # A member that reserves the next seq first with a bogus fingerprint is the one named.
    form(h, members=("m0", "m1", "m2"))
    reserve(h, 0, fp=b"bogus", rank=2, member="m2")
    with pytest.raises(Divergence):
        reserve(h, 0, fp=b"honest", rank=0, member="m0")
    with pytest.raises(Divergence) as third:
        reserve(h, 0, fp=b"honest", rank=1, member="m1")
    assert third.value.metadata["ranks"] == "0,1,2"
    assert third.value.metadata["first"] == "2"
    assert third.value.metadata["divergent"] == "2"
    assert third.value.metadata["disagree"] == "2"
    assert "the divergent side: rank 2." in third.value.message
    # The record of each rank heard names it, its side and its address.
    heard = records(h, "divergence")
    assert [r.detail["rank"] for r in heard] == [0, 1]
    assert heard[0].detail["first"]["rank"] == 2
    # The first speaker asking again sees the same sides.
    with pytest.raises(Divergence) as again:
        reserve(h, 1, fp=b"bogus", rank=2, member="m2")
    assert again.value.metadata["disagree"] == "0,1"


def test_a_divergence_hears_a_bounded_number_of_ranks(
    h: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank heard re-derives the record: past HEARD ranks, later ones get the record as it
    # stands, without a write, so a divergence of a 10^5-rank epoch costs O(HEARD) writes.
    monkeypatch.setattr(divergences, "HEARD", 2)
    form(h, members=("m0", "m1", "m2"))
    reserve(h, 0, fp=b"a", rank=0, member="m0")
    with pytest.raises(Divergence):
        reserve(h, 0, fp=b"b", rank=1, member="m1")
    before = dump(h.store)
    with pytest.raises(Divergence) as late:
        reserve(h, 0, fp=b"a", rank=2, member="m2")
    assert dump(h.store) == before
    assert late.value.metadata["ranks"] == "0,1" and late.value.metadata["disagree"] == ""
    assert len(records(h, "divergence")) == 1


def test_exhaustion_near_two_to_the_64_refuses_without_wrapping(h: InProcess) -> None:
    form(h)
    reserve(h, 0, size=MAX_OFFSET - 16)
    top = reserve(h, 1, size=16)
    assert (top.start, top.end) == (MAX_OFFSET - 16, MAX_OFFSET)
    before = dump(h.store)
    with pytest.raises(ResourceExhausted) as err:
        reserve(h, 2, size=4)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == (
        f"group 'g' has used its offset space: lease of 4 at {MAX_OFFSET} would pass 2^64; "
        "start a new job or Restore"
    )
    assert dump(h.store) == before
    assert h.run(h.coord.get_group(JOB, "g")).high_water == MAX_OFFSET


def test_the_largest_lease_fits_exactly(h: InProcess) -> None:
    form(h)
    lease = reserve(h, 0, size=MAX_OFFSET)
    assert (lease.start, lease.end) == (0, MAX_OFFSET)
    with pytest.raises(ResourceExhausted):
        reserve(h, 1, size=4)


# ----------------------------------------------------------------------------- fencing


def test_stale_and_future_epochs_and_non_members_are_refused(h: InProcess) -> None:
    form(h)
    reserve(h, 0)
    form(h, members=("n0", "n1"))
    with pytest.raises(StaleEpoch) as stale:
        reserve(h, 1, epoch=1)
    assert stale.value.message == (
        "epoch 1 of group 'g' is stale: the current epoch is 2; rejoin the group"
    )
    with pytest.raises(NotFound, match=r"epoch 3 of group 'g' does not exist \(current 2\)"):
        reserve(h, 0, epoch=3)
    with pytest.raises(NotMember) as outsider:
        reserve(h, 0, epoch=2, rank=0, member="m0")
    assert "rank 0 member 'm0' is not a member of epoch 2 of group 'g'" in outsider.value.message
    with pytest.raises(NotMember):
        reserve(h, 0, epoch=2, rank=5, member="n0")
    with pytest.raises(StaleEpoch):
        h.run(h.coord.restore(caller("m0", job=JOB), seq=1, cursor=0))


def test_a_stale_epoch_is_fenced_from_memory_and_from_the_store(h: InProcess) -> None:
    # Hits of epoch 1 are cached; once epoch 2 forms, neither a hit nor a grant of epoch 1
    # is answered, whatever the cache held.
    form(h)
    reserve(h, 0)
    reserve(h, 0, rank=1, member="m1")
    form(h, members=("n0", "n1"))
    for seq in (0, 1):
        with pytest.raises(StaleEpoch):
            reserve(h, seq, epoch=1, rank=1, member="m1")


def test_unknown_job_and_group_are_not_found(h: InProcess) -> None:
    with pytest.raises(NotFound, match="unknown job 'nope'") as job:
        h.run(h.coord.get_group("nope", "g"))
    assert job.value.reason_name == "UNKNOWN_JOB"
    form(h)
    with pytest.raises(NotFound, match="unknown group 'other' in job 'job-1'") as group:
        reserve(h, 0, group="other")
    assert group.value.reason_name == "UNKNOWN_GROUP"
    with pytest.raises(NotFound, match="unknown job 'nope'"):
        h.run(h.coord.reserve(caller("m0", job="nope"), seq=0, size=4, fingerprint=b"x"))


def _bad_reserve(**fields: Any) -> Callable[[Coordinator], Coroutine[Any, Any, object]]:
    args: dict[str, Any] = {"seq": 0, "size": 4, "fingerprint": b"x"}
    args.update(fields)
    return lambda c: c.reserve(caller("m", job=JOB), **args)


def _bad_join(**fields: Any) -> Callable[[Coordinator], Coroutine[Any, Any, object]]:
    args: dict[str, Any] = {
        "rank": 0,
        "world_size": 1,
        "member_id": "m",
        "member_secret": secret_for("m"),
        "timeout_s": 1.0,
    }
    args.update(fields)
    return lambda c: c.join(JOB, "g", **args)


async def _first(items: Any) -> object:
    return [item async for item in items]


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda c: c.get_group("bad name", "g"), "invalid job 'bad name'"),
        (lambda c: c.get_group(JOB, "-g"), "invalid group '-g'"),
        (lambda c: c.get_group(JOB, "g" * 200), "invalid group 'ggg"),
        (_bad_join(rank=2, world_size=2), "invalid rank 2"),
        (_bad_join(world_size=0), "invalid world_size 0"),
        (_bad_join(member_id="m m"), "invalid member_id 'm m'"),
        (_bad_join(job_seed=1 << 64), "invalid job_seed"),
        (_bad_join(timeout_s=float("nan")), "invalid timeout nan"),
        (_bad_reserve(size=6), "invalid size 6"),
        (_bad_reserve(size=0), "invalid size 0"),
        (_bad_reserve(size=1 << 64), "invalid size"),
        (_bad_reserve(fingerprint=b""), "invalid fingerprint b''"),
        (_bad_reserve(fingerprint=b"x" * 65), "invalid fingerprint"),
        (_bad_reserve(seq=1 << 63), "invalid seq"),
        (lambda c: c.restore(caller("m", job=JOB), seq=0, cursor=2), "invalid cursor 2"),
        (
            lambda c: c.restore(caller("m", job=JOB), seq=0, cursor=MAX_OFFSET + 4),
            "invalid cursor",
        ),
        (_bad_join(member_secret=b"short"), "invalid member_secret '<5 bytes>'"),
        (
            lambda c: c.reserve(caller("m", job=JOB, secret=b""), seq=0, size=4, fingerprint=b"x"),
            "invalid member_secret '<0 bytes>'",
        ),
        (lambda c: _first(c.list_audit(limit=-1)), "invalid limit -1"),
        (lambda c: c.get_group(JOB, "g", members_limit=70000), "invalid members_limit 70000"),
    ],
)
def test_malformed_fields_are_named(
    h: InProcess, call: Callable[[Coordinator], Coroutine[Any, Any, object]], fragment: str
) -> None:
    before = dump(h.store)

    async def attempt() -> object:
        return await call(h.coord)

    with pytest.raises(InvalidArgument) as err:
        h.run(attempt())
    assert fragment in err.value.message
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason_name == "INVALID_FIELD"
    assert dump(h.store) == before


# -------------------------------------------------------------------------------- join


def test_join_barrier_gives_every_rank_the_same_epoch(h: InProcess) -> None:
    members = [f"member-{r}" for r in range(4)]
    formed = form(h, "tp", members, job_seed=7)
    digest = members_digest(enumerate(members))
    assert formed == JoinResult(1, seeds.group_seed(7, "tp"), 0, 7, 4, digest)
    (epoch_record,) = records(h, "epoch")
    assert epoch_record.detail == {
        "epoch": 1,
        "world_size": 4,
        "start": 0,
        "members_digest": digest.hex(),
        "previous_epoch": 0,
        "waited_s": 0.0,  # one batch, on a manual clock
    }
    assert pending(h) == []
    info = h.run(h.coord.get_group(JOB, "tp", members_limit=3))
    assert (info.members, info.members_from, info.members_next) == (tuple(members[:3]), 0, 3)
    rest = h.run(h.coord.get_group(JOB, "tp", members_from=3))
    assert (rest.members, rest.members_next, rest.world_size) == ((members[3],), 4, 4)
    assert rest.members_digest == digest
    listed = h.run(
        h.coord.join(
            JOB,
            "tp",
            rank=2,
            world_size=4,
            member_id=members[2],
            member_secret=secret_for(members[2]),
            include_members=True,
        )
    )
    assert listed.members == tuple(members)


def test_a_barrier_of_many_ranks_forms_once(h: InProcess) -> None:
    members = [f"r{r}" for r in range(600)]
    formed = form(h, "wide", members)
    assert (formed.epoch, formed.world_size) == (1, 600)
    (epoch_record,) = records(h, "epoch")
    assert epoch_record.detail["members_digest"] == members_digest(enumerate(members)).hex()
    # Batched: far fewer writes than ranks (a write per arrival batch, not per join).
    assert h.store.writes < 100


def test_repeated_join_returns_the_epoch(h: InProcess) -> None:
    formed = form(h)
    assert h.run(join(h, 1, 2, "m1")) == formed
    assert h.run(join(h, 0, 2, "m0", job_seed=42)) == formed
    assert len(records(h, "epoch")) == 1


def test_join_timeout_names_the_missing_ranks(h: InProcess) -> None:
    patient = h.start(join(h, 1, 4, "m1", timeout_s=2.0))
    settle(h, lambda: len(pending(h)) == 1)
    hasty = h.start(join(h, 0, 4, "m0", timeout_s=0.2))
    settle(h, lambda: len(pending(h)) == 2)
    h.advance(0.2)
    with pytest.raises(JoinTimeout) as err:
        hasty.result(10)
    assert not patient.done()
    h.advance(1.8)
    # Rank 0 gave up first; rank 1 still names only the ranks that never came.
    with pytest.raises(JoinTimeout) as later:
        patient.result(10)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.message == (
        "join of group 'g' timed out after 0.2s: ranks [2, 3] of world size 4 did not join"
    )
    assert err.value.metadata["missing"] == "2,3"
    assert later.value.message == (
        "join of group 'g' timed out after 2s: ranks [2, 3] of world size 4 did not join"
    )
    assert [r.detail["rank"] for r in records(h, "join_timeout")] == [0, 1]
    assert h.run(h.coord.get_group(JOB, "g")).epoch == 0
    assert pending(h) == []
    # The withdrawn joins count for no later barrier.
    third = h.start(join(h, 2, 4, "m2", timeout_s=0.1))
    settle(h, lambda: len(pending(h)) == 1)
    h.advance(0.1)
    with pytest.raises(JoinTimeout, match=r"ranks \[0, 1, 3\] of world size 4 did not join"):
        third.result(10)


def test_a_cancelled_join_frees_its_place_at_once(h: InProcess) -> None:
    waiting = h.start(join(h, 0, 2, "gone"))
    settle(h, lambda: len(pending(h)) == 1)
    h.loop.loop.call_soon_threadsafe(waiting.cancel)
    settle(h, lambda: pending(h) == [])
    group = h.store.read(lambda tx: tx.fetchone("SELECT barrier_count FROM groups WHERE grp = 'g'"))
    assert group == (0,)
    # The place is free: a new pair forms epoch 1 without the cancelled member.
    formed = form(h, members=("a", "b"), job_seed=None)
    assert formed.epoch == 1


def test_world_size_mismatch_is_refused(h: InProcess) -> None:
    waiting = h.start(join(h, 0, 2, "m0"))
    settle(h, lambda: len(pending(h)) == 1)
    with pytest.raises(FailedPrecondition) as err:
        h.run(join(h, 1, 3, "m1"))
    assert err.value.message == (
        "rank 1 joined group 'g' with world size 3, but ranks [0] are waiting with world "
        "size 2; every rank of a barrier must join with the same world size"
    )
    assert err.value.reason_name == "WORLD_SIZE_MISMATCH"
    formed = h.run(join(h, 1, 2, "m1"))
    assert waiting.result(10) == formed


def test_a_new_member_id_replaces_a_pending_one(h: InProcess) -> None:
    old = h.start(join(h, 0, 2, "old"))
    settle(h, lambda: len(pending(h)) == 1)
    new = h.start(join(h, 0, 2, "new"))
    settle(h, lambda: pending(h) == [(0, "new")])
    formed = h.run(join(h, 1, 2, "m1"))
    assert new.result(10) == formed
    assert h.run(h.coord.get_group(JOB, "g")).members == ("new", "m1")
    # The replaced member learns at once that the epoch formed without it.
    with pytest.raises(FailedPrecondition) as err:
        old.result(10)
    assert err.value.reason_name == "NOT_MEMBER"
    assert err.value.message == (
        "epoch 1 of group 'g' formed without rank 0 member 'old' (another member took the "
        "rank, or the join expired); rejoin"
    )


def test_job_seed_is_fixed_drawn_or_refused(h: InProcess) -> None:
    fixed = form(h, job="fixed", job_seed=1234)
    assert fixed.job_seed == 1234
    drawn = form(h, job="drawn", job_seed=None)
    assert 0 <= drawn.job_seed < 1 << 64
    job_records = {r.job: r.detail["seed"] for r in records(h, "job")}
    assert job_records == {"fixed": 1234, "drawn": drawn.job_seed}
    with pytest.raises(FailedPrecondition) as err:
        h.run(join(h, 0, 1, "x", job="fixed", group="other", job_seed=99))
    assert err.value.message == "job 'fixed' has root seed 1234; the request asked for 99"
    assert err.value.reason_name == "SEED_CONFLICT"
    # A join that names no seed accepts the job's.
    assert h.run(join(h, 0, 1, "x", job="fixed", group="solo")).job_seed == 1234


def test_group_seeds_derive_from_root_seed_and_name(h: InProcess) -> None:
    a_tp = form(h, "tp", job="run-a", job_seed=2024)
    b_tp = form(h, "tp", job="run-b", job_seed=2024)
    b_dp = form(h, "dp", job="run-b", job_seed=2024)
    assert a_tp.seed == b_tp.seed == seeds.group_seed(2024, "tp")
    assert b_dp.seed != b_tp.seed
    assert a_tp.start == b_tp.start == b_dp.start == 0


def test_seed_derivation_worked_example() -> None:
    import doctest

    assert doctest.testmod(seeds).failed == 0
    assert seeds.group_seed(42, "tp") == 0x6AD612A92A154DB6


# ------------------------------------------------------------------------ leave, restore


def test_leave_fences_the_member_and_keeps_the_epoch(h: InProcess) -> None:
    form(h)
    reserve(h, 0, rank=1, member="m1")  # cached as a member: the leave must drop that
    h.run(h.coord.leave(caller("m1", rank=1, job=JOB)))
    assert h.run(h.coord.get_group(JOB, "g")).members == ("m0", "")
    with pytest.raises(NotMember):
        reserve(h, 0, rank=1, member="m1")
    assert reserve(h, 0).existing is True
    writes = h.store.writes
    h.run(h.coord.leave(caller("m1", rank=1, job=JOB)))
    assert [r.detail for r in records(h, "leave")] == [{"epoch": 1, "rank": 1, "member_id": "m1"}]
    assert h.store.writes == writes + 1  # the repeat checked, in a write, and changed nothing
    with pytest.raises(NotMember, match="rank 0 member 'x' is not a member"):
        h.run(h.coord.leave(caller("x", job=JOB)))


def _restore(
    h: InProcess, seq: int, cursor: int, rank: int, member: str, **kw: Any
) -> concurrent.futures.Future[RestoreResult]:
    """Start a Restore vote; the future completes when the Restore takes effect (or fails)."""
    return h.start(
        h.coord.restore(
            Caller(JOB, "g", kw.pop("epoch", 1), rank, member, secret_for(member), f"id{rank}"),
            seq=seq,
            cursor=cursor,
            **kw,
        )
    )


def _settled(future: concurrent.futures.Future[Any]) -> bool:
    """Whether `future` completes within a moment (the coordinator had time to act)."""
    try:
        future.result(timeout=0.3)
    except concurrent.futures.TimeoutError:
        return False
    except Exception:
        return True
    return True


def test_a_restore_takes_effect_only_when_every_member_asks(h: InProcess) -> None:
    form(h)
    for seq in range(3):
        reserve(h, seq)
    first = _restore(h, 3, 64, 0, "m0")
    assert not _settled(first)  # one member's vote changes nothing
    assert h.store.read(lambda tx: tx.fetchall("SELECT * FROM restores")) == []
    second = _restore(h, 3, 64, 1, "m1")
    assert second.result(5) == RestoreResult(64, existing=False)
    assert first.result(5) == RestoreResult(64, existing=False)
    # Asking again reads it back, writing nothing.
    writes, before = h.store.writes, dump(h.store)
    assert _restore(h, 3, 64, 0, "m0").result(5).existing is True
    assert dump(h.store) == before and h.store.writes == writes + 1
    replay = [reserve(h, seq) for seq in (3, 4)]
    assert [(r.start, r.end) for r in replay] == [(64, 128), (128, 192)]
    (record,) = records(h, "restore")
    assert record.detail == {
        "epoch": 1,
        "seq": 3,
        "cursor": 64,
        "high_water": 192,
        "rank": 1,
        "forced": False,
        "votes": 2,
        "voters": ["0:id0", "1:id1"],
    }
    assert verify(h.store).ok


def test_a_single_members_restore_times_out_naming_the_others(h: InProcess) -> None:
    form(h, members=("m0", "m1", "m2"))
    reserve(h, 0)
    lone = _restore(h, 1, 0, 0, "m0", timeout_s=5)
    assert not _settled(lone)
    h.advance(6)
    with pytest.raises(RestoreTimeout) as timeout:
        lone.result(5)
    assert timeout.value.message == (
        "restore of group 'g' epoch 1 seq 1 to cursor 0 timed out after 5s: ranks [1, 2] did "
        "not ask for it; every member must load the same checkpoint"
    )
    assert timeout.value.metadata["missing"] == "1,2"
    # It never took effect: the next lease continues the stream.
    assert (reserve(h, 1).start, records(h, "restore")) == (64, [])


def test_members_asking_for_different_cursors_conflict(h: InProcess) -> None:
    form(h)
    reserve(h, 0)
    first = _restore(h, 1, 0, 0, "m0")
    assert not _settled(first)
    with pytest.raises(FailedPrecondition) as conflict:
        _restore(h, 1, 32, 1, "m1").result(5)
    assert conflict.value.reason_name == "RESTORE_CONFLICT"
    assert conflict.value.message == (
        "rank 1 asked to restore seq 1 of group 'g' epoch 1 to cursor 32, but 1 members asked "
        "for cursor 0: every member must load the same checkpoint"
    )
    with pytest.raises(FailedPrecondition, match="lease 0 of group 'g' epoch 1 already granted"):
        _restore(h, 0, 0, 1, "m1").result(5)
    with pytest.raises(NotMember):
        _restore(h, 1, 0, 1, "m0").result(5)


def test_a_member_that_left_is_not_waited_for(h: InProcess) -> None:
    form(h, members=("m0", "m1", "m2"))
    h.run(h.coord.leave(caller("m2", rank=2, job=JOB)))
    first = _restore(h, 0, 0, 0, "m0")
    assert _restore(h, 0, 0, 1, "m1").result(5).cursor == 0
    assert first.result(5).cursor == 0


def test_a_forced_restore_takes_effect_alone(h: InProcess) -> None:
    form(h)
    reserve(h, 0)
    assert _restore(h, 1, 0, 0, "m0", force=True).result(5) == RestoreResult(0, existing=False)
    (record,) = records(h, "restore")
    assert (record.detail["forced"], record.detail["voters"]) == (True, ["id0"])
    assert (reserve(h, 1).start, verify(h.store).ok) == (0, True)


def test_a_restore_must_leave_room_to_continue(h: InProcess) -> None:
    form(h)
    with pytest.raises(ResourceExhausted) as refused:
        _restore(h, 0, MAX_OFFSET - 8, 0, "m0", force=True).result(5)
    assert "less than 2^32" in refused.value.message
    assert records(h, "restore") == []


def test_restore_at_seq_zero_of_a_new_epoch_resumes_a_checkpoint(h: InProcess) -> None:
    form(h)
    for seq in range(4):
        reserve(h, seq)
    form(h, members=("n0", "n1"))
    votes = [_restore(h, 0, 128, rank, m, epoch=2) for rank, m in enumerate(("n0", "n1"))]
    assert [v.result(5).cursor for v in votes] == [128, 128]
    resumed = reserve(h, 0, epoch=2, member="n0")
    assert (resumed.start, resumed.end) == (128, 192)
    assert verify(h.store).ok


def test_list_audit_filters_and_pages(h: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    import rngcoord.server.core.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "_AUDIT_PAGE", 2)
    form(h, "a")
    form(h, "b")
    for seq in range(3):
        reserve(h, seq, group="a")
        reserve(h, seq, group="b")

    def listed(**filters: Any) -> list[AuditRecord]:
        return h.run(gather_list(h.coord.list_audit(**filters)))

    everything = listed()
    assert [r.id for r in everything] == list(range(1, len(everything) + 1))
    assert [r.kind for r in everything[:3]] == ["job", "group", "epoch"]
    grants_a = listed(job=JOB, group="a", kinds=["grant"])
    assert [r.detail["seq"] for r in grants_a] == [0, 1, 2]
    assert [r.id for r in listed(limit=3)] == [1, 2, 3]
    middle = everything[4].ts_us
    since = [r for r in everything if r.ts_us >= middle]
    until = [r for r in everything if r.ts_us < middle]
    assert listed(since_us=middle) == since
    assert listed(until_us=middle) == until
    assert listed(job="other") == []
    for record in everything:
        assert record.hash == h.coord.chain.record_hash(record)


# -------------------------------------------------------------------- storm, durability


def test_storm_gets_identical_non_overlapping_leases(h: InProcess) -> None:
    world = ("m0", "m1", "m2", "m3")
    form(h, "storm", world)
    seqs = 24

    async def client(rank: int) -> list[Lease]:
        member = world[rank]
        return [
            await h.coord.reserve(
                caller(member, rank=rank, group="storm", job=JOB),
                seq=seq,
                size=4 * (seq + 1),
                fingerprint=b"fp",
            )
            for seq in range(seqs)
        ]

    async def storm() -> list[list[Lease]]:
        # Two clients per rank: a rank's retries race with its own first requests.
        return await asyncio.gather(*(client(rank) for rank in [0, 1, 2, 3, 0, 1, 2, 3]))

    runs = h.run(storm())
    ranges = [[(r.start, r.end) for r in run] for run in runs]
    assert all(r == ranges[0] for r in ranges)
    flat = ranges[0]
    assert flat[0][0] == 0
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(flat))
    assert len(records(h, "grant")) == seqs
    assert sum(1 for run in runs for r in run if not r.existing) == seqs
    assert verify(h.store).ok


def test_agreeing_attestations_write_once_and_a_divergent_one_is_recorded(h: InProcess) -> None:
    """64 members attest the same count: the first one writes, the others compare on a reader
    or in memory. Then a member with other bytes diverges the epoch (one more write)."""
    members = [f"m{rank}" for rank in range(64)]
    joined = form(h, "att", members, job=JOB)
    # The ops being attested drew from a lease (an attestation may not come ahead of them).
    reserve(h, 0, size=4 * ATTEST_EVERY, group="att")

    def attest(rank: int, fingerprint: bytes) -> None:
        h.run(
            h.coord.attest(
                caller(members[rank], rank=rank, epoch=joined.epoch, group="att", job=JOB),
                anchor_seq=0,
                ops=ATTEST_EVERY,
                fingerprint=fingerprint,
            )
        )

    writes = h.store.writes
    for rank in range(64):
        attest(rank, b"same")
    attest(0, b"same")
    assert h.store.writes == writes + 1
    with pytest.raises(Divergence, match="at anchor_seq 0, ops 1024: rank 0 sent"):
        attest(7, b"other")
    assert h.store.writes == writes + 2
    # Memory never answers for a diverged epoch, even for bytes that agree: a member that
    # attests the same count is heard, on rank 0's side, and rank 7 stays the divergent one.
    with pytest.raises(Divergence) as heard:
        attest(1, b"same")
    assert heard.value.metadata["divergent"] == "7"
    assert heard.value.metadata["disagree"] == "7"
    record, also = records(h, "divergence")
    assert (also.detail["rank"], also.detail["heard"]) == (1, True)
    assert (record.detail["ops"], record.detail["rank"], record.detail["first"]["rank"]) == (
        ATTEST_EVERY,
        7,
        0,
    )


def test_an_attestation_ahead_of_the_leases_is_refused(h: InProcess) -> None:
    # A far-future count (a time bomb: honest ranks would meet it later and diverge) is
    # refused: the leases since the anchor cannot hold that many ops.
    form(h)
    reserve(h, 0, size=4 * ATTEST_EVERY)
    ahead = caller("m1", rank=1, job=JOB)
    with pytest.raises(InvalidArgument, match="at most 1024 ops") as refused:
        h.run(h.coord.attest(ahead, anchor_seq=0, ops=1000 * ATTEST_EVERY, fingerprint=b"x"))
    assert refused.value.metadata["field"] == "ops"
    assert records(h, "divergence") == []
    # Within the leases, the same member's attestation is taken.
    h.run(h.coord.attest(ahead, anchor_seq=0, ops=ATTEST_EVERY, fingerprint=b"x"))


def test_a_committed_grant_survives_an_abandoned_store(db: Path, loop: LoopThread) -> None:
    async def make(store: SqliteStore) -> Coordinator:
        coordinator = Coordinator(store)
        await coordinator.start()
        return coordinator

    first = loop.run(make(SqliteStore(db, create=True)))

    async def form_and_grant() -> Lease:
        await asyncio.gather(
            *(
                first.join(
                    JOB,
                    "g",
                    rank=rank,
                    world_size=2,
                    member_id=f"m{rank}",
                    member_secret=secret_for(f"m{rank}"),
                    job_seed=1,
                )
                for rank in range(2)
            )
        )
        return await first.reserve(caller("m0", job=JOB), seq=0, size=64, fingerprint=b"ops")

    granted = loop.run(form_and_grant())
    # The first store is never closed: all that counts is what reached the disk.
    reopened = SqliteStore(db)
    second = loop.run(make(reopened))
    again = loop.run(
        second.reserve(caller("m1", rank=1, job=JOB), seq=0, size=64, fingerprint=b"ops")
    )
    assert again == Lease("g", 1, 0, granted.seed, granted.start, granted.end, existing=True)
    following = loop.run(
        second.reserve(caller("m1", rank=1, job=JOB), seq=1, size=4, fingerprint=b"ops")
    )
    assert following.start == granted.end
    assert verify(reopened).ok
    loop.run(second.close())
    reopened.close()


def test_errors_carry_their_grpc_codes() -> None:
    cases: list[tuple[type[CoordinatorError], grpc.StatusCode, bool, str]] = [
        (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, False, "INVALID_FIELD"),
        (NotFound, grpc.StatusCode.NOT_FOUND, False, "UNKNOWN_GROUP"),
        (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION, False, "STALE_EPOCH"),
        (NotMember, grpc.StatusCode.FAILED_PRECONDITION, False, "NOT_MEMBER"),
        (Divergence, grpc.StatusCode.FAILED_PRECONDITION, True, "DIVERGENCE"),
        (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, False, "OFFSETS_EXHAUSTED"),
        (JoinTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, False, "JOIN_TIMEOUT"),
    ]
    for cls, code, keep, reason in cases:
        error = cls("why")
        assert (error.code, error.keep_writes, error.message, str(error), error.reason_name) == (
            code,
            keep,
            "why",
            "why",
            reason,
        )
