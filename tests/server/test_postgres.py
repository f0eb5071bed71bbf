"""The PostgreSQL store on a real server: migrations, replicas, retries and reconnection.

Two `PostgresStore`s on one database stand for two coordinator replicas. Each test gets a
fresh database from the `postgres_url_factory` fixture (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from harness import DEFAULT_POSTGRES, POSTGRES_ENV, LoopThread, caller, gather_list, secret_for
from rngcoord.server.audit.chain import Chain
from rngcoord.server.audit.verify import verify
from rngcoord.server.core.coordinator import Coordinator
from rngcoord.server.errors import Divergence, InvalidArgument, StaleEpoch, Unavailable
from rngcoord.server.storage.postgres import PostgresStore
from rngcoord.server.storage.postgres_tx import convert_placeholders
from rngcoord.server.storage.store import ReadAhead, Tx
from rngcoord.v1.types import JoinResult, Lease

ADMIN_URL = os.environ.get(POSTGRES_ENV) or DEFAULT_POSTGRES
JOB = "job"
FINGERPRINT = b"\x01" * 16


@pytest.fixture
def db_url(postgres_url_factory: Callable[[], str]) -> str:
    """A fresh, empty database."""
    return postgres_url_factory()


@pytest.fixture
def open_stores(db_url: str) -> Iterator[Callable[..., PostgresStore]]:
    """`open_stores(**kwargs)` opens a `PostgresStore` on `db_url`; all close at the end."""
    opened: list[PostgresStore] = []

    def open_one(**kwargs: Any) -> PostgresStore:
        store = PostgresStore(db_url, create=True, **kwargs)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def _admin(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def _size(seq: int) -> int:
    """Lease sizes vary with seq, so a misplaced start shows up as an overlap."""
    return 4 * (1 + seq % 7)


@pytest.mark.parametrize(
    ("portable", "psycopg_form"),
    [
        ("SELECT a FROM t WHERE b = ? AND c = ?", "SELECT a FROM t WHERE b = %s AND c = %s"),
        ("SELECT '?', \"?\" FROM t WHERE x = ?", "SELECT '?', \"?\" FROM t WHERE x = %s"),
        (
            "SELECT 'it''s ?' WHERE x LIKE 'a%' AND y = ?",
            "SELECT 'it''s ?' WHERE x LIKE 'a%%' AND y = %s",
        ),
        ("SELECT 5 % ? -- why?\n, ?", "SELECT 5 %% %s -- why?\n, %s"),
        ("SELECT /* ? */ ?", "SELECT /* ? */ %s"),
    ],
)
def test_placeholders_are_rewritten_outside_literals_only(portable: str, psycopg_form: str) -> None:
    assert convert_placeholders(portable) == psycopg_form


def test_rewritten_sql_runs_with_literal_percent_and_question_marks(
    open_stores: Callable[..., PostgresStore],
) -> None:
    store = open_stores()
    row = store.read(lambda tx: tx.fetchone("SELECT '100%?', ? || '%', 7 % ?", ("a", 4)))
    assert row == ("100%?", "a%", 3)


def test_reads_see_writes_and_never_write(open_stores: Callable[..., PostgresStore]) -> None:
    store = open_stores()
    assert store.write(_add_job("j1")) == "j1"
    assert store.read_row("SELECT job FROM jobs WHERE job = ?", ("j1",)) == ("j1",)
    assert store.read_row("SELECT job FROM jobs WHERE job = ?", ("j2",)) is None
    write = "INSERT INTO jobs (job, seed, created_us) VALUES ('sneaky', 0, 0)"
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        store.read(lambda tx: tx.execute(write))
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        store.read_row(write + " RETURNING job")
    # The failed reads left their connections usable.
    assert store.read(lambda tx: tx.fetchall("SELECT job FROM jobs")) == [("j1",)]


def test_concurrent_opens_migrate_once(db_url: str) -> None:
    # Four replicas start at the same moment on an empty database.
    barrier = threading.Barrier(4)

    def open_one(_: int) -> PostgresStore:
        barrier.wait()
        return PostgresStore(db_url, create=True, max_readers=2)

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(open_one, range(4)))
    for store in stores:
        store.close()
    # And once more, on the migrated database.
    PostgresStore(db_url, create=True).close()

    folder = resources.files("rngcoord.server.storage") / "migrations" / "postgres"
    names = sorted(entry.name.removesuffix(".sql") for entry in folder.iterdir())
    expected = [(int(name.partition("_")[0]), name) for name in names if name[:3].isdigit()]
    assert expected[0] == (1, "001_initial")
    with _admin(db_url) as conn:
        versions = conn.execute("SELECT version, name FROM schema_version ORDER BY version")
        assert versions.fetchall() == expected
        head = conn.execute("SELECT id, last_id FROM audit_head").fetchall()
        assert head == [(1, 0)]


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def _replicas(loop: LoopThread, stores: list[PostgresStore]) -> list[Coordinator]:
    """Coordinators on `stores`, started on `loop`: each one a replica's."""

    async def start() -> list[Coordinator]:
        made = [Coordinator(store, join_timeout_s=30) for store in stores]
        for coordinator in made:
            await coordinator.start()
        return made

    return loop.run(start())


def _close(loop: LoopThread, replicas: list[Coordinator]) -> None:
    async def close() -> None:
        for coordinator in replicas:
            await coordinator.close()

    loop.run(close())


def test_two_replicas_serve_one_group_without_overlap(
    open_stores: Callable[..., PostgresStore], loop: LoopThread
) -> None:
    replicas = _replicas(loop, [open_stores(), open_stores()])
    groups = ["g0", "g1", "g2"]
    seqs = 25

    # Rank r of every group joins through replica r; the barrier spans both replicas.
    async def join_all() -> list[JoinResult]:
        return await asyncio.gather(
            *(
                replicas[rank].join(
                    JOB,
                    group,
                    rank=rank,
                    world_size=2,
                    member_id=f"m{rank}",
                    member_secret=secret_for(f"m{rank}"),
                    job_seed=42,
                )
                for group in groups
                for rank in (0, 1)
            )
        )

    joined = loop.run(join_all())
    assert {(r.epoch, r.world_size) for r in joined} == {(1, 2)}

    # Both ranks of every group ask for every lease, each through its own replica, at once.
    async def ask_all(group: str, rank: int) -> list[Lease]:
        return [
            await replicas[rank].reserve(
                caller(f"m{rank}", rank=rank, epoch=1, group=group, job=JOB),
                seq=seq,
                size=_size(seq),
                fingerprint=FINGERPRINT,
            )
            for seq in range(seqs)
        ]

    async def everyone() -> dict[tuple[str, int], list[Lease]]:
        keys = [(g, r) for g in groups for r in (0, 1)]
        results = await asyncio.gather(*(ask_all(g, r) for g, r in keys))
        return dict(zip(keys, results, strict=True))

    leases = loop.run(everyone())
    for group in groups:
        rank0, rank1 = leases[group, 0], leases[group, 1]
        # Agreement: both ranks got the same ranges, whichever replica granted them.
        assert [(x.start, x.end) for x in rank0] == [(x.start, x.end) for x in rank1]
        # Contiguity (hence no overlap): lease k starts where k-1 ended.
        expected_start = 0
        for seq, lease in enumerate(rank0):
            assert (lease.seq, lease.start, lease.end) == (
                seq,
                expected_start,
                expected_start + _size(seq),
            )
            expected_start = lease.end
        # Exactly one of the two requests of each seq granted it; the other read it back.
        assert all(a.existing != b.existing for a, b in zip(rank0, rank1, strict=True))
    _close(loop, replicas)
    report = verify(open_stores())
    assert report.ok, report.problems
    assert report.grants == len(groups) * seqs


def test_fencing_holds_across_replicas(
    open_stores: Callable[..., PostgresStore], loop: LoopThread
) -> None:
    # An old member keeps reserving through replica A while a replacement forms a new epoch
    # through replica B. Once fenced, A must refuse, hits and grants alike, whatever A's cache
    # holds; the new epoch must start above every lease the old one got.
    a, b = _replicas(loop, [open_stores(), open_stores()])
    loop.run(
        a.join(
            JOB,
            "g",
            rank=0,
            world_size=1,
            member_id="old",
            member_secret=secret_for("old"),
            job_seed=42,
        )
    )

    def reserve(coordinator: Coordinator, member: str, epoch: int, seq: int) -> Lease:
        return loop.run(
            coordinator.reserve(
                caller(member, rank=0, epoch=epoch, group="g", job=JOB),
                seq=seq,
                size=64,
                fingerprint=FINGERPRINT,
            )
        )

    granted = [reserve(a, "old", 1, seq) for seq in range(5)]
    assert reserve(a, "old", 1, 4).existing  # a hit, answered from A's memory
    new = loop.run(
        b.join(
            JOB,
            "g",
            rank=0,
            world_size=1,
            member_id="new",
            member_secret=secret_for("new"),
            job_seed=42,
        )
    )
    assert new.epoch == 2
    # A grant through A consults the store at once.
    with pytest.raises(StaleEpoch, match="the current epoch is 2"):
        reserve(a, "old", 1, 5)
    # A hit through A is refused too once A's feed has seen the epoch (LISTEN/NOTIFY, or the
    # poll within the staleness bound).
    deadline = time.monotonic() + 5
    while True:
        try:
            reserve(a, "old", 1, 4)
        except StaleEpoch:
            break
        assert time.monotonic() < deadline, "replica A kept answering hits of a stale epoch"
        time.sleep(0.01)
    assert new.start == max(lease.end for lease in granted)
    first = reserve(b, "new", 2, 0)
    assert first.start == new.start
    _close(loop, [a, b])
    report = verify(open_stores())
    assert report.ok, report.problems


def test_idempotent_hits_are_readable_from_either_replica(
    open_stores: Callable[..., PostgresStore], loop: LoopThread
) -> None:
    a, b = _replicas(loop, [open_stores(), open_stores()])
    loop.run(
        a.join(
            JOB,
            "g",
            rank=0,
            world_size=1,
            member_id="m0",
            member_secret=secret_for("m0"),
            job_seed=42,
        )
    )

    def reserve(coordinator: Coordinator, seq: int) -> Lease:
        return loop.run(
            coordinator.reserve(
                caller("m0", rank=0, epoch=1, group="g", job=JOB),
                seq=seq,
                size=128,
                fingerprint=FINGERPRINT,
            )
        )

    grants = [reserve(a, seq) for seq in range(3)]
    for replica in (a, b):
        hits = [reserve(replica, seq) for seq in range(3)]
        assert [(h.start, h.end, h.seed) for h in hits] == [
            (g.start, g.end, g.seed) for g in grants
        ]
        assert all(h.existing for h in hits)
    assert loop.run(a.get_group(JOB, "g")) == loop.run(b.get_group(JOB, "g"))
    # The hits wrote nothing: one job, one group, one epoch and three grants.
    kinds = [r.kind for r in loop.run(gather_list(b.list_audit(job=JOB)))]
    assert kinds == ["job", "group", "epoch"] + ["grant"] * 3
    _close(loop, [a, b])


def _wait_until_blocked_on_a_lock(conn: psycopg.Connection[Any], timeout_s: float = 30) -> None:
    """Wait until some session of this database waits for a lock."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
        if row is not None and row[0] > 0:
            return
        assert time.monotonic() < deadline, "the store's write never waited for the lock"
        time.sleep(0.01)


@contextmanager
def _conflicting_head_update(db_url: str) -> Iterator[Callable[[], None]]:
    """Hold a concurrent update of audit_head; `release()` commits it once a writer waits.

    A SERIALIZABLE writer that took its snapshot before the commit must then fail with a
    serialization failure (40001) when it gets the row lock.
    """
    with _admin(db_url) as conn:
        conn.execute("BEGIN")
        conn.execute("UPDATE audit_head SET last_id = last_id WHERE id = 1")

        def release() -> None:
            with _admin(db_url) as observer:
                _wait_until_blocked_on_a_lock(observer)
            conn.execute("COMMIT")

        yield release


def _write_behind_a_conflict(db_url: str, store: PostgresStore, fn: Callable[[Tx], Any]) -> Any:
    # The conflict is the inner context: should anything fail, its lock goes first, so the
    # pool's shutdown never waits on a write that waits on the lock.
    with ThreadPoolExecutor(1) as pool, _conflicting_head_update(db_url) as release:
        outcome = pool.submit(store.write, fn)
        release()
        return outcome.result(timeout=60)


def _add_job(name: str) -> Callable[[Tx], str]:
    def op(tx: Tx) -> str:
        tx.execute("INSERT INTO jobs (job, seed, created_us) VALUES (?, 0, 0)", (name,))
        return name

    return op


def test_an_error_of_a_held_back_write_fails_only_its_own_operation(
    open_stores: Callable[..., PostgresStore],
) -> None:
    """Writes are held back and sent together, so a bad write's error surfaces at a later
    operation's read, or before COMMIT. The batch then runs again sending each write as it
    comes: the operation that wrote it gets its error, and the others of the batch commit.
    max_attempts=1: the rerun is not an attempt."""
    store = open_stores(max_attempts=1)
    held = threading.Event()

    def hold(tx: Tx) -> None:
        held.set()
        time.sleep(0.3)  # the next operations queue up meanwhile: they form one batch

    def bad(tx: Tx) -> str:
        tx.write("INSERT INTO meta (name, value) VALUES ('store_id', 'another')")
        return "bad"

    def good(name: str) -> Callable[[Tx], int]:
        def op(tx: Tx) -> int:
            tx.write("INSERT INTO jobs (job, seed, created_us) VALUES (?, 0, 0)", (name,))
            row = tx.fetchone("SELECT COUNT(*) FROM jobs WHERE job = ?", (name,))
            assert row is not None
            return int(row[0])

        return op

    first = store.submit(hold)
    assert held.wait(5)
    futures: list[Future[Any]] = [
        store.submit(good("a")),
        store.submit(bad),
        store.submit(good("b")),
    ]
    first.result(10)
    assert futures[0].result(10) == 1 and futures[2].result(10) == 1
    with pytest.raises(psycopg.errors.UniqueViolation):
        futures[1].result(10)
    jobs = store.read(lambda tx: tx.fetchall("SELECT job FROM jobs ORDER BY job"))
    assert jobs == [("a",), ("b",)]
    # And the next batch holds its writes back again, and commits.
    assert store.write(good("c")) == 1


def _count_jobs(tx: Tx) -> int:
    row = tx.fetchone(_COUNT_JOBS)
    assert row is not None
    return int(row[0])


_COUNT_JOBS = "SELECT COUNT(*) FROM jobs"


def _batch_of_reads_ahead(store: PostgresStore, *, break_batch: bool) -> list[Any]:
    """One batch (the writer is held while it queues): operations that count the jobs and add
    one. Their read-aheads claim keys that do not match what they write, on purpose, so that a
    count from the read-ahead (taken before the batch ran) differs from a live one."""
    held = threading.Event()

    def hold(tx: Tx) -> None:
        held.set()
        time.sleep(0.3)

    def count_and_add(name: str, again: bool = False) -> Callable[[Tx], Any]:
        def op(tx: Tx) -> Any:
            first = _count_jobs(tx)
            tx.write(
                "INSERT INTO jobs (job, seed, created_us) VALUES (?, 0, 0)",
                (f"{name}-{break_batch}",),
            )
            return (first, _count_jobs(tx)) if again else first

        return op

    def add_then_count(name: str) -> Callable[[Tx], int]:
        def op(tx: Tx) -> int:
            tx.write(
                "INSERT INTO jobs (job, seed, created_us) VALUES (?, 0, 0)",
                (f"{name}-{break_batch}",),
            )
            return _count_jobs(tx)  # not its first statement: the row read ahead is stale

        return op

    def bad(tx: Tx) -> None:
        tx.write("INSERT INTO meta (name, value) VALUES ('store_id', 'another')")

    def ahead(key: str) -> ReadAhead:
        return ReadAhead((JOB, key), _COUNT_JOBS, ())

    first = store.submit(hold)
    assert held.wait(5)
    ops: list[tuple[Callable[[Tx], Any], ReadAhead | None]] = [
        (count_and_add("x1"), ahead("x")),
        (add_then_count("v1"), ahead("v")),  # writes before it reads: live
        (count_and_add("y1", again=True), ahead("y")),  # primed once, then live
        (count_and_add("x2"), ahead("x")),  # x was written: live
        (count_and_add("z1"), None),  # no read-ahead: it could write anything
        (count_and_add("w1"), ahead("w")),  # so everything after it reads live
    ]
    if break_batch:
        ops.insert(1, (bad, None))
    futures = [store.submit(fn, read) for fn, read in ops]
    first.result(10)
    return [f.exception(10) or f.result(10) for f in futures]


def test_reads_ahead_answer_a_batch_until_their_key_is_written(
    open_stores: Callable[..., PostgresStore],
) -> None:
    """The writer sends a batch's read-aheads in one round trip, and answers each operation's
    first read from them only while no earlier operation of the batch wrote its key or went
    without a read-ahead. After an error of a held-back write the batch reruns, reading live."""
    store = open_stores()
    assert _batch_of_reads_ahead(store, break_batch=False) == [0, 2, (0, 3), 3, 4, 5]
    results = _batch_of_reads_ahead(store, break_batch=True)
    assert isinstance(results[1], psycopg.errors.UniqueViolation)
    assert results[:1] + results[2:] == [6, 8, (8, 9), 9, 10, 11]
    assert _count_jobs_now(store) == 12


def _count_jobs_now(store: PostgresStore) -> int:
    return store.read(_count_jobs)


def test_a_rolled_back_operation_leaves_the_chain_head_where_it_was(
    open_stores: Callable[..., PostgresStore],
) -> None:
    """A batch's appends chain on the head its lock read; an operation whose savepoint rolls
    back takes its record back with it, so the next one chains on the record before."""
    store = open_stores()
    chain = Chain(store.store_id)
    held = threading.Event()

    def hold(tx: Tx) -> None:
        held.set()
        time.sleep(0.3)

    def append(kind: str, fail: bool = False) -> Callable[[Tx], tuple[int, str]]:
        def op(tx: Tx) -> tuple[int, str]:
            head = chain.append(tx, ts_us=1, job=JOB, group="g", kind=kind, actor="t", detail={})
            if fail:
                raise InvalidArgument("rolled back")
            return head

        return op

    first = store.submit(hold)
    assert held.wait(5)
    futures = [store.submit(append("a")), store.submit(append("b", fail=True)),
               store.submit(append("c"))]  # fmt: skip
    first.result(10)
    a, c = futures[0].result(10), futures[2].result(10)
    with pytest.raises(InvalidArgument):
        futures[1].result(10)
    assert c[0] == a[0] + 1
    report = verify(store)
    assert report.ok, report.problems
    assert report.records == c[0]


@pytest.mark.parametrize("rerun", [False, True], ids=["held-back", "rerun-as-they-come"])
def test_each_operation_keeps_or_loses_its_own_writes(
    open_stores: Callable[..., PostgresStore], rerun: bool
) -> None:
    """Writes held back are taken back by dropping them, or, once an operation has sent them
    (it read after writing), by the savepoint that sending opened; an error with keep_writes
    keeps them. The same batch, rerun after a held write failed, ends the same way."""
    store = open_stores(max_attempts=1)
    held = threading.Event()

    def hold(tx: Tx) -> None:
        held.set()
        time.sleep(0.3)

    def op(name: str, *, read: bool, error: type[Exception] | None) -> Callable[[Tx], str]:
        def run(tx: Tx) -> str:
            tx.write("INSERT INTO jobs (job, seed, created_us) VALUES (?, 0, 0)", (name,))
            if read:
                assert tx.fetchone("SELECT 1 FROM jobs WHERE job = ?", (name,)) == (1,)
            if error is Divergence:
                raise Divergence("kept")
            if error is not None:
                raise error("taken back")
            return name

        return run

    def bad(tx: Tx) -> None:
        tx.write("INSERT INTO meta (name, value) VALUES ('store_id', 'another')")

    first = store.submit(hold)
    assert held.wait(5)
    futures: list[Future[Any]] = [
        store.submit(op("dropped", read=False, error=InvalidArgument)),
        store.submit(op("sent-then-rolled-back", read=True, error=InvalidArgument)),
        store.submit(op("other-error", read=True, error=ValueError)),
        store.submit(op("read", read=True, error=None)),
        store.submit(op("kept", read=False, error=Divergence)),
        store.submit(op("kept-after-read", read=True, error=Divergence)),
        store.submit(op("plain", read=False, error=None)),
    ]
    if rerun:
        futures.append(store.submit(bad))
    first.result(10)
    outcomes = [type(f.exception(10)).__name__ if f.exception(10) else "ok" for f in futures]
    assert outcomes[:7] == ["InvalidArgument", "InvalidArgument", "ValueError", "ok",
                            "Divergence", "Divergence", "ok"]  # fmt: skip
    if rerun:
        assert outcomes[7] == "UniqueViolation"
    jobs = store.read(lambda tx: tx.fetchall("SELECT job FROM jobs ORDER BY job"))
    assert [job for (job,) in jobs] == ["kept", "kept-after-read", "plain", "read"]


def test_serialization_failure_is_retried(
    db_url: str, open_stores: Callable[..., PostgresStore]
) -> None:
    # One attempt only: the conflict is real, and the caller gets a clear UNAVAILABLE.
    single = open_stores(isolation="serializable", max_attempts=1)
    with pytest.raises(Unavailable, match=r"failed 1 times.*could not serialize"):
        _write_behind_a_conflict(db_url, single, _add_job("lost"))
    # Two attempts: the same conflict is retried, and the second attempt commits.
    retrying = open_stores(isolation="serializable", max_attempts=2)
    assert _write_behind_a_conflict(db_url, retrying, _add_job("kept")) == "kept"
    jobs = retrying.read(lambda tx: tx.fetchall("SELECT job FROM jobs ORDER BY job"))
    assert jobs == [("kept",)]


def test_serializable_replicas_grant_correctly_under_contention(
    open_stores: Callable[..., PostgresStore], loop: LoopThread
) -> None:
    # Two SERIALIZABLE replicas (as on CockroachDB) conflict on every concurrent batch; the
    # retries must hide that from callers.
    replicas = _replicas(
        loop, [open_stores(isolation="serializable", max_attempts=8) for _ in (0, 1)]
    )

    async def run(index: int) -> list[Lease]:
        replica, group = replicas[index % 2], f"g{index}"
        await replica.join(
            JOB,
            group,
            rank=0,
            world_size=1,
            member_id="m0",
            member_secret=secret_for("m0"),
            job_seed=42,
        )
        return [
            await replica.reserve(
                caller("m0", rank=0, epoch=1, group=group, job=JOB),
                seq=seq,
                size=_size(seq),
                fingerprint=FINGERPRINT,
            )
            for seq in range(10)
        ]

    async def four() -> list[list[Lease]]:
        return await asyncio.gather(*(run(i) for i in range(4)))

    for leases in loop.run(four()):
        assert [lease.start for lease in leases[1:]] == [lease.end for lease in leases[:-1]]
    _close(loop, replicas)
    report = verify(open_stores())
    assert report.ok, report.problems
    assert report.grants == 40


def _terminate(db_url: str, application_name: str) -> int:
    """End the sessions of one kind on the database; return how many there were."""
    with _admin(ADMIN_URL) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name = %s",
            (_database(db_url), application_name),
        ).fetchall()
    return len(rows)


def _database(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def test_dropped_connections_are_replaced(
    db_url: str, open_stores: Callable[..., PostgresStore]
) -> None:
    store = open_stores(min_readers=2)
    assert store.write(_add_job("before")) == "before"
    assert store.read(lambda tx: tx.fetchone("SELECT count(*) FROM jobs")) == (1,)

    assert _terminate(db_url, "rngcoord-writer") == 1
    assert _terminate(db_url, "rngcoord-reader") >= 1
    assert store.write(_add_job("after")) == "after"
    assert store.read_row("SELECT count(*) FROM jobs") == (2,)
    assert _terminate(db_url, "rngcoord-reader") >= 1
    assert store.read(lambda tx: tx.fetchall("SELECT job FROM jobs ORDER BY job")) == [
        ("after",),
        ("before",),
    ]


def test_unreachable_database_gives_unavailable_then_recovers(
    db_url: str, open_stores: Callable[..., PostgresStore]
) -> None:
    store = open_stores(max_attempts=3, backoff_s=0.01)
    name = _database(db_url)
    with _admin(ADMIN_URL) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            assert _terminate(db_url, "rngcoord-writer") == 1
            with pytest.raises(Unavailable, match="store begin failed 3 times"):
                store.write(_add_job("refused"))
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    assert store.write(_add_job("accepted")) == "accepted"
    assert store.read(lambda tx: tx.fetchall("SELECT job FROM jobs")) == [("accepted",)]


def test_opening_an_unreachable_database_names_it_without_the_password(db_url: str) -> None:
    parts = urlsplit(db_url)
    netloc = f"{parts.username or 'postgres'}:s3cret@{parts.hostname}:{parts.port or 5432}"
    missing = parts._replace(netloc=netloc, path="/no_such_db").geturl()
    with pytest.raises(ConnectionError, match="no_such_db") as info:
        PostgresStore(missing, connect_timeout_s=3)
    assert "s3cret" not in str(info.value)


def test_unknown_isolation_is_refused(db_url: str) -> None:
    with pytest.raises(ValueError, match="isolation must be one of"):
        PostgresStore(db_url, isolation="snapshot")
