"""The transport-free Coordinator on real SQLite files: leases, joins, fencing, restore, verify.

Every test opens a fresh database file in tmp_path. `CountingStore` wraps the real SqliteStore
only to count calls of `write`, which is how "an idempotent hit does no write" is checked.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from rngcoord.server import audit, seeds
from rngcoord.server.coordinator import Coordinator, JoinResult, ReserveResult
from rngcoord.server.errors import (
    CoordinatorError,
    Divergence,
    FailedPrecondition,
    InvalidArgument,
    JoinTimeout,
    NotFound,
    ResourceExhausted,
    StaleEpoch,
)
from rngcoord.server.sqlite import SqliteStore
from rngcoord.server.store import Tx, to_db
from rngcoord.server.verify import verify
from rngcoord.v1.rules import MAX_OFFSET

T = TypeVar("T")

JOB = "job-1"
TABLES = ("jobs", "groups", "epochs", "pending_joins", "leases", "restores", "audit", "audit_head")


class CountingStore:
    """The real SqliteStore, counting the writes that go through it."""

    def __init__(self, inner: SqliteStore) -> None:
        self.inner = inner
        self.dialect = inner.dialect
        self.writes = 0

    def read(self, fn: Callable[[Tx], T]) -> T:
        return self.inner.read(fn)

    def write(self, fn: Callable[[Tx], T]) -> T:
        self.writes += 1
        return self.inner.write(fn)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "coordinator.db"


@pytest.fixture
def store(db: Path) -> Iterator[CountingStore]:
    s = CountingStore(SqliteStore(db))
    yield s
    s.close()


@pytest.fixture
def coord(store: CountingStore) -> Coordinator:
    return Coordinator(store, join_timeout_s=10.0)


def dump(store: CountingStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, to show that a request changed nothing."""
    return store.read(lambda tx: {t: sorted(tx.fetchall(f"SELECT * FROM {t}")) for t in TABLES})


def records(coord: Coordinator, kind: str) -> list[audit.AuditRecord]:
    return list(coord.list_audit(kinds=[kind]))


def form(
    coord: Coordinator,
    group: str = "g",
    members: Sequence[str] = ("m0", "m1"),
    *,
    job: str = JOB,
    job_seed: int | None = 42,
) -> JoinResult:
    """Join every rank at once (each rank on its own thread) and return the common result."""
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [
            pool.submit(
                coord.join, job, group, rank, len(members), m, job_seed, 10.0, f"rank {rank}"
            )
            for rank, m in enumerate(members)
        ]
        results = [f.result() for f in futures]
    assert all(r == results[0] for r in results)
    return results[0]


def reserve(
    coord: Coordinator,
    seq: int,
    *,
    size: int = 64,
    fp: bytes = b"ops",
    rank: int = 0,
    member: str = "m0",
    epoch: int = 1,
    group: str = "g",
) -> ReserveResult:
    return coord.reserve(JOB, group, epoch, seq, size, fp, rank, member, f"rank {rank}")


def wait_for(condition: Callable[[], bool]) -> None:
    """Poll until `condition` holds; the test's own timeout bounds a condition that never does."""
    event = threading.Event()
    while not condition():
        event.wait(0.01)


# ------------------------------------------------------------------------------ leases


def test_reserve_is_idempotent_and_a_hit_does_no_write(
    coord: Coordinator, store: CountingStore
) -> None:
    epoch = form(coord)
    first = reserve(coord, 0, rank=0, member="m0")
    assert first == ReserveResult("g", 1, 0, epoch.seed, 0, 64, existing=False)
    writes, before = store.writes, dump(store)
    again = reserve(coord, 0, rank=1, member="m1")
    replay = reserve(coord, 0, rank=0, member="m0")
    assert again == replay == ReserveResult("g", 1, 0, epoch.seed, 0, 64, existing=True)
    assert store.writes == writes
    assert dump(store) == before
    assert len(records(coord, "grant")) == 1


def test_seqs_are_contiguous_and_raise_the_high_water_mark(coord: Coordinator) -> None:
    form(coord)
    sizes = [4, 64, 1 << 32, 12]
    leases = [reserve(coord, seq, size=size) for seq, size in enumerate(sizes)]
    assert leases[0].start == 0
    for prev, lease, size in zip(leases, leases[1:], sizes[1:], strict=False):
        assert lease.start == prev.end
        assert lease.end - lease.start == size
    info = coord.get_group(JOB, "g")
    assert (info.high_water, info.leases) == (leases[-1].end, 4)
    # A new epoch continues from the high-water mark, so nothing is reused.
    second = form(coord, members=("n0", "n1"))
    assert (second.epoch, second.start) == (2, leases[-1].end)
    assert reserve(coord, 0, epoch=2, member="n0").start == leases[-1].end


def test_out_of_order_seq_is_refused_without_a_write(
    coord: Coordinator, store: CountingStore
) -> None:
    form(coord)
    reserve(coord, 0)
    before = dump(store)
    with pytest.raises(FailedPrecondition) as err:
        reserve(coord, 2)
    assert err.value.message == "lease seq 2 of group 'g' epoch 1 requested before seq 1"
    assert dump(store) == before


def test_divergence_is_recorded_named_and_poisons_the_epoch(
    coord: Coordinator, store: CountingStore
) -> None:
    form(coord)
    reserve(coord, 0, fp=b"\x01\x02", rank=0, member="m0")
    with pytest.raises(Divergence) as err:
        reserve(coord, 0, size=128, fp=b"\x03", rank=1, member="m1")
    message = err.value.message
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert message == (
        "divergence in group 'g' epoch 1 seq 0: rank 1 asked for size=128 fingerprint=03 "
        "but rank 0 was granted size=64 fingerprint=0102; the ranks disagree about the "
        "sequence of random ops"
    )
    (record,) = records(coord, "divergence")
    assert record.detail["granted_rank"] == 0 and record.detail["rank"] == 1
    # From now on the epoch refuses every lease, even a matching repeat, without writing.
    before = dump(store)
    for seq, rank, member in [(0, 0, "m0"), (1, 0, "m0"), (1, 1, "m1")]:
        with pytest.raises(Divergence) as later:
            reserve(coord, seq, fp=b"\x01\x02", rank=rank, member=member)
        assert later.value.message == message
    assert dump(store) == before


def test_exhaustion_near_two_to_the_64_refuses_without_wrapping(
    coord: Coordinator, store: CountingStore
) -> None:
    form(coord)
    coord.restore(JOB, "g", 1, 0, MAX_OFFSET - 16, 0, "m0", "admin")
    top = reserve(coord, 0, size=16)
    assert (top.start, top.end) == (MAX_OFFSET - 16, MAX_OFFSET)
    before = dump(store)
    with pytest.raises(ResourceExhausted) as err:
        reserve(coord, 1, size=4)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == (
        f"group 'g' has used its offset space: lease of 4 at {MAX_OFFSET} would pass 2^64; "
        "start a new job or Restore"
    )
    assert dump(store) == before
    assert coord.get_group(JOB, "g").high_water == MAX_OFFSET


def test_the_largest_lease_fits_exactly(coord: Coordinator) -> None:
    form(coord)
    lease = reserve(coord, 0, size=MAX_OFFSET)
    assert (lease.start, lease.end) == (0, MAX_OFFSET)
    with pytest.raises(ResourceExhausted):
        reserve(coord, 1, size=4)


# ----------------------------------------------------------------------------- fencing


def test_stale_and_future_epochs_and_non_members_are_refused(coord: Coordinator) -> None:
    form(coord)
    reserve(coord, 0)
    form(coord, members=("n0", "n1"))
    with pytest.raises(StaleEpoch) as stale:
        reserve(coord, 1, epoch=1)
    assert stale.value.message == (
        "epoch 1 of group 'g' is stale: the current epoch is 2; rejoin the group"
    )
    with pytest.raises(NotFound, match=r"epoch 3 of group 'g' does not exist \(current 2\)"):
        reserve(coord, 0, epoch=3)
    with pytest.raises(FailedPrecondition) as outsider:
        reserve(coord, 0, epoch=2, rank=0, member="m0")
    assert "rank 0 member 'm0' is not a member of epoch 2 of group 'g'" in outsider.value.message
    with pytest.raises(FailedPrecondition, match="not a member"):
        reserve(coord, 0, epoch=2, rank=5, member="n0")
    with pytest.raises(StaleEpoch):
        coord.restore(JOB, "g", 1, 1, 0, 0, "m0", "rank 0")


def test_unknown_job_and_group_are_not_found(coord: Coordinator) -> None:
    with pytest.raises(NotFound, match="unknown job 'nope'"):
        coord.get_group("nope", "g")
    form(coord)
    with pytest.raises(NotFound, match="unknown group 'other' in job 'job-1'"):
        reserve(coord, 0, group="other")
    with pytest.raises(NotFound, match="unknown job 'nope'"):
        coord.reserve("nope", "g", 1, 0, 4, b"x", 0, "m0", "rank 0")


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda c: c.get_group("bad name", "g"), "invalid job 'bad name'"),
        (lambda c: c.get_group(JOB, "-g"), "invalid group '-g'"),
        (lambda c: c.get_group(JOB, "g" * 200), "invalid group 'ggg"),
        (lambda c: c.join(JOB, "g", 2, 2, "m", None, 1.0, "a"), "invalid rank 2"),
        (lambda c: c.join(JOB, "g", 0, 0, "m", None, 1.0, "a"), "invalid world_size 0"),
        (lambda c: c.join(JOB, "g", 0, 1, "m m", None, 1.0, "a"), "invalid member_id 'm m'"),
        (lambda c: c.join(JOB, "g", 0, 1, "m", 1 << 64, 1.0, "a"), "invalid job_seed"),
        (lambda c: c.reserve(JOB, "g", 1, 0, 6, b"x", 0, "m", "a"), "invalid size 6"),
        (lambda c: c.reserve(JOB, "g", 1, 0, 0, b"x", 0, "m", "a"), "invalid size 0"),
        (lambda c: c.reserve(JOB, "g", 1, 0, 1 << 64, b"x", 0, "m", "a"), "invalid size"),
        (lambda c: c.reserve(JOB, "g", 1, 0, 4, b"", 0, "m", "a"), "invalid fingerprint b''"),
        (lambda c: c.reserve(JOB, "g", 1, 0, 4, b"x" * 65, 0, "m", "a"), "invalid fingerprint"),
        (lambda c: c.reserve(JOB, "g", 1, 1 << 63, 4, b"x", 0, "m", "a"), "invalid seq"),
        (lambda c: c.restore(JOB, "g", 1, 0, 2, 0, "m", "a"), "invalid cursor 2"),
        (lambda c: c.restore(JOB, "g", 1, 0, MAX_OFFSET + 4, 0, "m", "a"), "invalid cursor"),
        (lambda c: c.list_audit(limit=-1), "invalid limit -1"),
    ],
)
def test_malformed_fields_are_named(
    coord: Coordinator, store: CountingStore, call: Callable[[Coordinator], object], fragment: str
) -> None:
    before = dump(store)
    with pytest.raises(InvalidArgument) as err:
        call(coord)
    assert fragment in err.value.message
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert dump(store) == before


# -------------------------------------------------------------------------------- join


def test_join_barrier_gives_every_rank_the_same_epoch(coord: Coordinator) -> None:
    members = [f"member-{r}" for r in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(coord.join, JOB, "tp", r, 4, m, 7, 10.0, f"rank {r}")
            for r, m in enumerate(members)
        ]
        results = [f.result() for f in futures]
    expected = JoinResult(1, seeds.group_seed(7, "tp"), 0, 7, tuple(members))
    assert results == [expected] * 4
    (epoch_record,) = records(coord, "epoch")
    assert epoch_record.detail == {
        "epoch": 1,
        "world_size": 4,
        "start": 0,
        "members": members,
        "previous_epoch": 0,
    }
    assert dump_pending(coord) == []


def dump_pending(coord: Coordinator) -> list[tuple[Any, ...]]:
    return coord._store.read(lambda tx: tx.fetchall("SELECT * FROM pending_joins"))


def test_repeated_join_returns_the_epoch_without_a_write(
    coord: Coordinator, store: CountingStore
) -> None:
    formed = form(coord)
    writes = store.writes
    assert coord.join(JOB, "g", 1, 2, "m1", None, 1.0, "rank 1") == formed
    assert coord.join(JOB, "g", 0, 2, "m0", 42, 1.0, "rank 0") == formed
    assert store.writes == writes


@pytest.mark.slow
def test_join_timeout_names_the_missing_ranks(coord: Coordinator, store: CountingStore) -> None:
    with ThreadPoolExecutor(1) as pool:
        patient = pool.submit(coord.join, JOB, "g", 1, 4, "m1", None, 2.0, "rank 1")
        wait_for(lambda: len(dump_pending(coord)) == 1)
        with pytest.raises(JoinTimeout) as err:
            coord.join(JOB, "g", 0, 4, "m0", None, 0.2, "rank 0")
        # Rank 0 gave up first; rank 1 still names only the ranks that never came.
        with pytest.raises(JoinTimeout) as later:
            patient.result()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.message == (
        "join of group 'g' timed out after 0.2s: ranks [2, 3] of world size 4 did not join"
    )
    assert later.value.message == (
        "join of group 'g' timed out after 2s: ranks [2, 3] of world size 4 did not join"
    )
    assert [r.detail["rank"] for r in records(coord, "join_timeout")] == [0, 1]
    assert coord.get_group(JOB, "g").epoch == 0
    # The withdrawn joins count for no later barrier.
    with pytest.raises(JoinTimeout, match=r"ranks \[0, 1, 3\] of world size 4 did not join"):
        coord.join(JOB, "g", 2, 4, "m2", None, 0.1, "rank 2")


def test_world_size_mismatch_is_refused(coord: Coordinator) -> None:
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(coord.join, JOB, "g", 0, 2, "m0", None, 10.0, "rank 0")
        wait_for(lambda: len(dump_pending(coord)) == 1)
        with pytest.raises(FailedPrecondition) as err:
            coord.join(JOB, "g", 1, 3, "m1", None, 10.0, "rank 1")
        assert err.value.message == (
            "rank 1 joined group 'g' with world size 3, but ranks [0] are waiting with world "
            "size 2; every rank of a barrier must join with the same world size"
        )
        formed = coord.join(JOB, "g", 1, 2, "m1", None, 10.0, "rank 1")
        assert waiting.result() == formed
    assert formed.members == ("m0", "m1")


@pytest.mark.slow
def test_a_new_member_id_replaces_a_pending_one(coord: Coordinator) -> None:
    with ThreadPoolExecutor(2) as pool:
        old = pool.submit(coord.join, JOB, "g", 0, 2, "old", None, 2.5, "rank 0")
        wait_for(lambda: len(dump_pending(coord)) == 1)
        new = pool.submit(coord.join, JOB, "g", 0, 2, "new", None, 10.0, "rank 0")
        wait_for(lambda: [row[3] for row in dump_pending(coord)] == ["new"])
        formed = coord.join(JOB, "g", 1, 2, "m1", None, 10.0, "rank 1")
        assert new.result() == formed
        assert formed.members == ("new", "m1")
        with pytest.raises(JoinTimeout) as err:
            old.result()
    assert err.value.message == (
        "join of group 'g' timed out after 2.5s: epoch 1 formed without rank 0 member 'old'; rejoin"
    )


def test_job_seed_is_fixed_drawn_or_refused(coord: Coordinator) -> None:
    fixed = form(coord, job="fixed", job_seed=1234)
    assert fixed.job_seed == 1234
    drawn = form(coord, job="drawn", job_seed=None)
    assert 0 <= drawn.job_seed < 1 << 64
    job_records = {r.job: r.detail["seed"] for r in records(coord, "job")}
    assert job_records == {"fixed": 1234, "drawn": drawn.job_seed}
    with pytest.raises(FailedPrecondition) as err:
        coord.join("fixed", "other", 0, 1, "x", 99, 1.0, "rank 0")
    assert err.value.message == "job 'fixed' has root seed 1234; the request asked for 99"
    with pytest.raises(NotFound, match="unknown group 'other'"):
        coord.get_group("fixed", "other")
    # A join that names no seed accepts the job's.
    assert coord.join("fixed", "solo", 0, 1, "x", None, 1.0, "rank 0").job_seed == 1234


def test_group_seeds_derive_from_root_seed_and_name(coord: Coordinator) -> None:
    a_tp = form(coord, "tp", job="run-a", job_seed=2024)
    b_tp = form(coord, "tp", job="run-b", job_seed=2024)
    b_dp = form(coord, "dp", job="run-b", job_seed=2024)
    assert a_tp.seed == b_tp.seed == seeds.group_seed(2024, "tp")
    assert b_dp.seed != b_tp.seed
    assert a_tp.start == b_tp.start == b_dp.start == 0


def test_seed_derivation_worked_example() -> None:
    import doctest

    assert doctest.testmod(seeds).failed == 0
    assert seeds.group_seed(42, "tp") == 0x6AD612A92A154DB6


# ------------------------------------------------------------------------ leave, restore


def test_leave_fences_the_member_and_keeps_the_epoch(
    coord: Coordinator, store: CountingStore
) -> None:
    form(coord)
    coord.leave(JOB, "g", 1, 1, "m1", "rank 1")
    assert coord.get_group(JOB, "g").members == ("m0", "")
    with pytest.raises(FailedPrecondition, match="not a member"):
        reserve(coord, 0, rank=1, member="m1")
    assert reserve(coord, 0).existing is False
    writes = store.writes
    coord.leave(JOB, "g", 1, 1, "m1", "rank 1")
    assert store.writes == writes
    with pytest.raises(FailedPrecondition, match="rank 0 member 'x' is not a member"):
        coord.leave(JOB, "g", 1, 0, "x", "rank 0")
    assert [r.detail for r in records(coord, "leave")] == [
        {"epoch": 1, "rank": 1, "member_id": "m1"}
    ]


def test_restore_rewinds_and_is_idempotent(coord: Coordinator, store: CountingStore) -> None:
    form(coord)
    for seq in range(3):
        reserve(coord, seq)
    assert coord.restore(JOB, "g", 1, 3, 64, 0, "m0", "rank 0").existing is False
    writes, before = store.writes, dump(store)
    assert coord.restore(JOB, "g", 1, 3, 64, 1, "m1", "rank 1").existing is True
    assert store.writes == writes and dump(store) == before
    with pytest.raises(FailedPrecondition) as conflict:
        coord.restore(JOB, "g", 1, 3, 128, 0, "m0", "rank 0")
    assert conflict.value.message == (
        "seq 3 of group 'g' epoch 1 was already restored to cursor 64, not 128"
    )
    with pytest.raises(FailedPrecondition, match="lease 1 of group 'g' epoch 1 already granted"):
        coord.restore(JOB, "g", 1, 1, 0, 0, "m0", "rank 0")
    with pytest.raises(FailedPrecondition, match="not a member"):
        coord.restore(JOB, "g", 1, 4, 0, 0, "m1", "rank 0")
    replay = [reserve(coord, seq) for seq in (3, 4)]
    assert [(r.start, r.end) for r in replay] == [(64, 128), (128, 192)]
    info = coord.get_group(JOB, "g")
    assert info.high_water == 192 and info.leases == 5
    (restore_record,) = records(coord, "restore")
    assert restore_record.detail == {
        "epoch": 1,
        "seq": 3,
        "cursor": 64,
        "high_water": 192,
        "rank": 0,
    }
    assert verify(coord._store).ok


def test_restore_at_seq_zero_of_a_new_epoch_resumes_a_checkpoint(coord: Coordinator) -> None:
    form(coord)
    for seq in range(4):
        reserve(coord, seq)
    form(coord, members=("n0", "n1"))
    coord.restore(JOB, "g", 2, 0, 128, 0, "n0", "rank 0")
    resumed = reserve(coord, 0, epoch=2, member="n0")
    assert (resumed.start, resumed.end) == (128, 192)
    assert verify(coord._store).ok


def test_list_audit_filters_and_pages(coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    import rngcoord.server.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "_AUDIT_PAGE", 2)
    form(coord, "a")
    form(coord, "b")
    for seq in range(3):
        reserve(coord, seq, group="a")
        reserve(coord, seq, group="b")
    everything = list(coord.list_audit())
    assert [r.id for r in everything] == list(range(1, len(everything) + 1))
    assert [r.kind for r in everything[:3]] == ["job", "group", "epoch"]
    grants_a = list(coord.list_audit(job=JOB, group="a", kinds=["grant"]))
    assert [r.detail["seq"] for r in grants_a] == [0, 1, 2]
    assert [r.id for r in coord.list_audit(limit=3)] == [1, 2, 3]
    middle = everything[4].ts_us
    since = [r for r in everything if r.ts_us >= middle]
    until = [r for r in everything if r.ts_us < middle]
    assert since and until, "the records must straddle the cut for this check to mean anything"
    assert list(coord.list_audit(since_us=middle)) == since
    assert list(coord.list_audit(until_us=middle)) == until
    assert list(coord.list_audit(job="other")) == []
    for record in everything:
        assert record.hash == audit.record_hash(
            id=record.id,
            ts_us=record.ts_us,
            job=record.job,
            group=record.group,
            kind=record.kind,
            actor=record.actor,
            detail=record.detail,
            prev_hash=record.prev_hash,
        )


# -------------------------------------------------------------------------------- verify


def _healthy(coord: Coordinator) -> None:
    form(coord)
    for seq in range(3):
        reserve(coord, seq)


def test_verify_passes_on_a_healthy_store(coord: Coordinator) -> None:
    _healthy(coord)
    report = verify(coord._store)
    assert report.ok and report.problems == []
    assert (report.records, report.grants, report.groups) == (6, 3, 1)
    assert report.summary() == "ok: 6 records, 3 grants in 1 groups, chain intact, no overlaps"


def test_verify_names_a_record_whose_detail_was_changed(coord: Coordinator, db: Path) -> None:
    _healthy(coord)
    (grant,) = [r for r in records(coord, "grant") if r.detail["seq"] == 1]
    with sqlite3.connect(db) as raw:
        raw.execute(
            "UPDATE audit SET detail = replace(detail, '\"size\":64', '\"size\":65') WHERE id = ?",
            (grant.id,),
        )
    report = verify(coord._store)
    assert not report.ok
    assert report.problems == [f"record {grant.id}: its hash does not match its contents"]
    assert report.summary().startswith("FAILED: 1 problems")


def test_verify_names_a_deleted_record(coord: Coordinator, db: Path) -> None:
    _healthy(coord)
    with sqlite3.connect(db) as raw:
        raw.execute("DELETE FROM audit WHERE id = 4")
    problems = verify(coord._store).problems
    assert "records 4 to 4 are missing" in problems
    assert any(p.startswith("record 5: prev_hash") for p in problems)
    assert any("has no grant record" in p and "seq 0" in p for p in problems)


def test_verify_names_a_deleted_last_record(coord: Coordinator, db: Path) -> None:
    _healthy(coord)
    with sqlite3.connect(db) as raw:
        raw.execute("DELETE FROM audit WHERE id = 6")
    problems = verify(coord._store).problems
    assert any(p.startswith("audit_head says the chain ends at record 6") for p in problems)


def test_verify_names_a_lease_inserted_by_hand(coord: Coordinator, db: Path) -> None:
    _healthy(coord)
    with sqlite3.connect(db) as raw:
        raw.execute(
            "INSERT INTO leases VALUES (?, 'g', 1, 9, ?, ?, ?, x'00', 0, 'm0', 0)",
            (JOB, to_db(32), to_db(96), to_db(64)),
        )
    assert verify(coord._store).problems == [
        "lease (job 'job-1' group 'g' epoch 1 seq 9, [32, 96)) has no grant record"
    ]


def test_verify_names_an_overlapping_grant_even_with_a_valid_chain(
    coord: Coordinator, store: CountingStore
) -> None:
    _healthy(coord)

    def forge(tx: Tx) -> int:
        tx.execute(
            "INSERT INTO leases VALUES (?, 'g', 1, 3, ?, ?, ?, x'00', 0, 'm0', 0)",
            (JOB, to_db(32), to_db(96), to_db(64)),
        )
        detail = {"epoch": 1, "seq": 3, "start": 32, "end": 96, "size": 64}
        return audit.append(
            tx, ts_us=0, job=JOB, group="g", kind="grant", actor="forger", detail=detail
        )

    forged = store.write(forge)
    problems = verify(store).problems
    assert len(problems) == 2
    assert all(p.startswith(f"grant record {forged} (group 'g' epoch 1 seq 3") for p in problems)
    assert {p.split(" overlaps ")[1].split(" (")[0] for p in problems} == {
        "grant record 4",
        "grant record 5",
    }


# -------------------------------------------------------------------- storm, durability


def test_storm_of_threads_gets_identical_non_overlapping_leases(coord: Coordinator) -> None:
    world = ("m0", "m1", "m2", "m3")
    form(coord, "storm", world)
    seqs = 24

    def client(rank: int) -> list[ReserveResult]:
        member = world[rank]
        return [
            coord.reserve(JOB, "storm", 1, seq, 4 * (seq + 1), b"fp", rank, member, "storm")
            for seq in range(seqs)
        ]

    # Two threads per rank: a rank's retries race with its own first requests.
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(client, [0, 1, 2, 3, 0, 1, 2, 3]))
    ranges = [[(r.start, r.end) for r in run] for run in runs]
    assert all(r == ranges[0] for r in ranges)
    flat = ranges[0]
    assert flat[0][0] == 0
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(flat))
    grants = records(coord, "grant")
    assert len(grants) == seqs
    assert sum(1 for run in runs for r in run if not r.existing) == seqs
    assert verify(coord._store).ok


def test_a_committed_grant_survives_an_abandoned_store(db: Path) -> None:
    first = Coordinator(SqliteStore(db))
    form(first)
    granted = first.reserve(JOB, "g", 1, 0, 64, b"ops", 0, "m0", "rank 0")
    # The first store is never closed: all that counts is what reached the disk.
    reopened = SqliteStore(db)
    second = Coordinator(reopened)
    assert second.reserve(JOB, "g", 1, 0, 64, b"ops", 1, "m1", "rank 1") == ReserveResult(
        "g", 1, 0, granted.seed, granted.start, granted.end, existing=True
    )
    assert second.reserve(JOB, "g", 1, 1, 4, b"ops", 1, "m1", "rank 1").start == granted.end
    assert verify(reopened).ok
    reopened.close()


def test_errors_carry_their_grpc_codes() -> None:
    cases: list[tuple[type[CoordinatorError], grpc.StatusCode, bool]] = [
        (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, False),
        (NotFound, grpc.StatusCode.NOT_FOUND, False),
        (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION, False),
        (Divergence, grpc.StatusCode.FAILED_PRECONDITION, True),
        (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (JoinTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, False),
    ]
    for cls, code, keep in cases:
        error = cls("why")
        assert (error.code, error.keep_writes, error.message, str(error)) == (
            code,
            keep,
            "why",
            "why",
        )
