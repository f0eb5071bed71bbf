"""The store layer on real SQLite files: group commit, savepoints, retries, migrations."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest

from rngcoord.server.errors import Divergence, InvalidArgument, Unavailable
from rngcoord.server.storage.groupcommit import GroupCommitWriter
from rngcoord.server.storage.sqlite import SqliteStore, SqliteTx
from rngcoord.server.storage.store import (
    KnownHead,
    StoreRewound,
    Tx,
    from_db,
    split_sql,
    to_db,
)
from rngcoord.server.storage.stores import open_store


def _insert_job(name: str, seed: int = 7) -> Callable[[Tx], str]:
    def op(tx: Tx) -> str:
        tx.execute("INSERT INTO jobs (job, seed, created_us) VALUES (?, ?, 0)", (name, to_db(seed)))
        return name

    return op


def _jobs(store: SqliteStore) -> list[str]:
    return [row[0] for row in store.read(lambda tx: tx.fetchall("SELECT job FROM jobs"))]


def test_bias_keeps_order_and_range() -> None:
    values = [0, 1, 4, (1 << 63) - 1, 1 << 63, (1 << 64) - 4, (1 << 64) - 1]
    stored = [to_db(v) for v in values]
    assert stored == sorted(stored)
    assert all(-(1 << 63) <= s < (1 << 63) for s in stored)
    assert [from_db(s) for s in stored] == values


def test_write_is_durable_and_visible_to_a_second_store(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    first = SqliteStore(path, create=True)
    assert first.write(_insert_job("j1", seed=(1 << 64) - 1)) == "j1"
    # The first store is abandoned (not closed): what write() returned must already be on disk.
    second = open_store(f"sqlite:///{path}")
    row = second.read(lambda tx: tx.fetchone("SELECT seed FROM jobs WHERE job = 'j1'"))
    assert row is not None and from_db(row[0]) == (1 << 64) - 1
    second.close()
    first.close()


def test_errors_roll_back_only_their_own_operation(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "c.db", create=True)

    def refused(tx: Tx) -> None:
        tx.execute("INSERT INTO jobs (job, seed, created_us) VALUES ('refused', 0, 0)")
        raise InvalidArgument("no")

    def kept(tx: Tx) -> None:
        tx.execute("INSERT INTO jobs (job, seed, created_us) VALUES ('kept', 0, 0)")
        raise Divergence("recorded, then refused")

    def broken(tx: Tx) -> None:
        tx.execute("INSERT INTO jobs (job, seed, created_us) VALUES ('broken', 0, 0)")
        tx.execute("INSERT INTO no_such_table VALUES (1)")

    store.write(_insert_job("ok"))
    with pytest.raises(InvalidArgument, match="no"):
        store.write(refused)
    with pytest.raises(Divergence, match="recorded, then refused"):
        store.write(kept)
    # A missing table may be a dropped schema: the database cannot serve, so UNAVAILABLE.
    with pytest.raises(Unavailable, match="no such table: no_such_table"):
        store.write(broken)
    assert sorted(_jobs(store)) == ["kept", "ok"]
    store.close()


def test_concurrent_writers_share_batches_and_all_commit(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "c.db", create=True)
    names = [f"job-{i}" for i in range(64)]
    results: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        value = store.write(_insert_job(name))
        with lock:
            results.append(value)

    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(names)
    assert sorted(_jobs(store)) == sorted(names)
    store.close()


def test_reads_never_write(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "c.db", create=True)
    with pytest.raises(sqlite3.OperationalError, match=r"readonly|read-only|query_only"):
        store.read(lambda tx: tx.execute("INSERT INTO jobs VALUES ('x', 0, 0)"))
    assert _jobs(store) == []
    store.close()


def test_closed_store_refuses(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "c.db", create=True)
    store.close()
    store.close()
    with pytest.raises(Unavailable, match="closed"):
        store.write(_insert_job("late"))
    with pytest.raises(Unavailable, match="closed"):
        store.read(lambda tx: tx.fetchall("SELECT 1"))


def test_migrations_apply_once(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    SqliteStore(path, create=True).close()
    store = SqliteStore(path)
    rows = store.read(lambda tx: tx.fetchall("SELECT version, name FROM schema_version"))
    assert rows == [
        (1, "001_initial"),
        (2, "002_members_by_rank"),
        (3, "003_integrity"),
        (4, "004_attestations"),
        (5, "005_member_credentials"),
        (6, "006_launches"),
        (7, "007_resizes"),
        (8, "008_quorums"),
    ]
    head = store.read(lambda tx: tx.fetchone("SELECT last_id, last_hash FROM audit_head"))
    assert head == (0, "0" * 64)
    store.close()


def test_a_version_1_store_keeps_its_members_and_barriers(tmp_path: Path) -> None:
    # A store written by the first schema: members as a JSON list ("" for a rank that left)
    # and two ranks waiting in a barrier of another group.
    path = tmp_path / "v1.db"
    script = (
        resources.files("rngcoord.server.storage") / "migrations/sqlite/001_initial.sql"
    ).read_text()
    with sqlite3.connect(path) as conn:
        conn.executescript(script)
        conn.execute(
            "CREATE TABLE schema_version (version BIGINT NOT NULL PRIMARY KEY, "
            "name TEXT NOT NULL, applied_us BIGINT NOT NULL)"
        )
        conn.execute("INSERT INTO schema_version VALUES (1, '001_initial', 0)")
        conn.execute("INSERT INTO jobs VALUES ('j', 0, 0)")
        conn.execute("INSERT INTO groups VALUES ('j', 'g', 0, 1, 0)")
        conn.execute("INSERT INTO groups VALUES ('j', 'h', 0, 0, 0)")
        conn.execute("INSERT INTO epochs VALUES ('j', 'g', 1, 3, 0, '[\"a\",\"\",\"c\"]', NULL, 5)")
        for rank in (0, 2):
            conn.execute(
                "INSERT INTO pending_joins VALUES ('j', 'h', ?, ?, 4, 99)", (rank, f"p{rank}")
            )
    store = SqliteStore(path)
    members = store.read(
        lambda tx: tx.fetchall(
            "SELECT rank, member_id, joined_us, left_us FROM members WHERE grp = 'g' ORDER BY rank"
        )
    )
    assert members == [(0, "a", 5, None), (1, "", 5, 5), (2, "c", 5, None)]
    barrier = store.read(
        lambda tx: tx.fetchone("SELECT barrier_size, barrier_count FROM groups WHERE grp = 'h'")
    )
    assert barrier == (4, 2)
    store.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    SqliteStore(path, create=True).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_version VALUES (99, '099_future', 0)")
    with pytest.raises(RuntimeError, match="schema version 99"):
        SqliteStore(path)


def test_unknown_url_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported store URL 'mysql://x'"):
        open_store("mysql://x")


def test_split_sql_respects_quotes_and_comments() -> None:
    script = """
    -- a comment; with a semicolon
    CREATE TABLE "a;b" (x TEXT DEFAULT 'it''s; fine');
    /* block; comment */ INSERT INTO t VALUES (';');
    ;
    """
    assert split_sql(script) == [
        "CREATE TABLE \"a;b\" (x TEXT DEFAULT 'it''s; fine')",
        "INSERT INTO t VALUES (';')",
    ]


class _Conflict(Exception):
    """Stands in for a serialization failure that the backend asks to retry."""


def _raw_writer(
    path: Path, *, commit_error: Exception | None = None, max_attempts: int = 5
) -> tuple[GroupCommitWriter, sqlite3.Connection]:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")

    def begin() -> Tx:
        conn.execute("BEGIN IMMEDIATE")
        return SqliteTx(conn)

    def commit() -> None:
        if commit_error is not None:
            raise commit_error
        conn.execute("COMMIT")

    def rollback() -> None:
        if conn.in_transaction:
            conn.execute("ROLLBACK")

    writer = GroupCommitWriter(
        begin=begin,
        commit=commit,
        rollback=rollback,
        is_retryable=lambda exc: isinstance(exc, _Conflict),
        max_attempts=max_attempts,
        backoff_s=0.001,
    )
    return writer, conn


def test_retryable_error_reruns_the_whole_batch(tmp_path: Path) -> None:
    writer, conn = _raw_writer(tmp_path / "raw.db")
    runs = []

    def flaky(tx: Tx) -> int:
        runs.append(1)
        tx.execute("INSERT INTO t VALUES (1)")
        if len(runs) < 3:
            raise _Conflict("could not serialize access")
        return len(runs)

    assert writer.write(flaky) == 3
    writer.close()
    # The two aborted attempts left nothing behind.
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone() == (1,)


def test_persistent_conflict_gives_up_with_unavailable(tmp_path: Path) -> None:
    writer, conn = _raw_writer(tmp_path / "raw.db", max_attempts=3)

    def always(tx: Tx) -> None:
        tx.execute("INSERT INTO t VALUES (1)")
        raise _Conflict("deadlock detected")

    with pytest.raises(Unavailable, match=r"failed 3 times on conflicting writes.*deadlock"):
        writer.write(always)
    writer.close()
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)


def test_failed_commit_fails_every_operation(tmp_path: Path) -> None:
    writer, conn = _raw_writer(tmp_path / "raw.db", commit_error=OSError("disk full"))

    def op(tx: Tx) -> None:
        tx.execute("INSERT INTO t VALUES (1)")
        raise Divergence("would have been kept")

    with pytest.raises(Unavailable, match="store commit failed: disk full"):
        writer.write(op)
    writer.close()
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)


def test_the_writer_commits_to_stable_storage(store_url: str) -> None:
    # A grant is answered only after its commit; these settings make that commit durable.
    # (The crash tests SIGKILL the server, which the OS page cache survives, so they cannot
    # tell a commit that reached the disk from one that did not.)
    store = open_store(store_url, create=True)
    try:
        if store.dialect == "sqlite":
            assert store.write(lambda tx: tx.fetchone("PRAGMA synchronous")) == (2,)  # FULL
            assert store.write(lambda tx: tx.fetchone("PRAGMA journal_mode")) == ("wal",)
        else:
            assert store.write(lambda tx: tx.fetchone("SHOW synchronous_commit")) == ("on",)
    finally:
        store.close()


def test_a_rewound_store_names_the_chain_end_it_went_back_below() -> None:
    """The chain end a `StoreRewound` carries bounds what was lost: records after it are gone
    (or other ones), whether the chain is now shorter or was written on past the lost head."""
    known = KnownHead("test-store")
    known.saw(8, "h8")
    with pytest.raises(StoreRewound) as shorter:
        known.check(5, None, known.head)
    assert (shorter.value.known, shorter.value.chain_end) == ((8, "h8"), 5)
    with pytest.raises(StoreRewound) as rewritten:
        known.check(12, "another", known.head)  # written on past 8 by another process
    assert rewritten.value.chain_end == 7  # record 8 itself is lost
    known.check(12, "h8", known.head)  # holds the known head: not rewound
