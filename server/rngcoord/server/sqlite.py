"""The embedded SQLite store: WAL, synchronous=FULL, one group-committing writer.

One writer connection belongs to the `GroupCommitWriter` thread; it opens every write
transaction with `BEGIN IMMEDIATE`, which also serialises it against other processes on the
same file. Reads run on per-thread connections set to `query_only`, each in its own deferred
transaction, so a read sees one snapshot and WAL lets it run beside the writer; a read of one
query (`read_row`) skips the BEGIN and ROLLBACK, as a lone statement is its own snapshot. With
synchronous=FULL a commit returns only after the WAL is fsynced: a write is durable when
`write` returns. Schema migrations (server/migrations/sqlite) run at open.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from rngcoord.server.errors import Unavailable
from rngcoord.server.groupcommit import GroupCommitWriter
from rngcoord.server.store import Tx, apply_migrations

__all__ = ["SqliteStore", "SqliteTx"]

T = TypeVar("T")

_BUSY_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})

_STATEMENT_CACHE = 512
"""Prepared statements kept per connection (sqlite3's default is 128). The coordinator runs a
few dozen fixed statements, but audit listings build one per filter combination, and a
statement that falls out of the cache is parsed and planned again on its next use."""


class SqliteTx:
    """`Tx` over one sqlite3 connection (in autocommit mode; transactions are explicit).

    Args:
        conn: the connection to run statements on.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[object] = ()) -> int:
        return self._conn.execute(sql, tuple(params)).rowcount

    def executemany(self, sql: str, params: Sequence[Sequence[object]]) -> None:
        self._conn.executemany(sql, [tuple(row) for row in params])

    def fetchone(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._conn.execute(sql, tuple(params)).fetchone()
        return row

    def fetchall(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, tuple(params)).fetchall()


def _is_busy(exc: BaseException) -> bool:
    """Another process held the write lock past busy_timeout: worth running the batch again."""
    return isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode in _BUSY_CODES


class SqliteStore:
    """A `Store` in one SQLite file.

    Args:
        path: the database file; created with its schema when missing.
        busy_timeout_ms: how long a connection waits for a lock held by another process
            before failing. Default 5000.
        max_batch: most write operations per transaction. Default 256.
    """

    dialect = "sqlite"

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 5000, max_batch: int = 256):
        self.path = Path(path)
        self._busy_timeout_ms = busy_timeout_ms
        self._conn = self._connect()
        mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            self._conn.close()
            raise RuntimeError(f"SQLite could not use WAL for {self.path} (journal_mode={mode})")
        self._conn.execute("PRAGMA synchronous = FULL")
        self._tx = SqliteTx(self._conn)
        self._writer = GroupCommitWriter(
            begin=self._begin,
            commit=self._commit,
            rollback=self._rollback,
            is_retryable=_is_busy,
            name=f"rngcoord-sqlite-writer:{self.path.name}",
            max_batch=max_batch,
        )
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        try:
            self._writer.write(lambda tx: apply_migrations(tx, "sqlite"))
        except BaseException:
            self.close()
            raise

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: the module must not open transactions behind our back; and
        # connections move between the opening thread, the writer thread and close().
        conn = sqlite3.connect(
            self.path,
            isolation_level=None,
            check_same_thread=False,
            cached_statements=_STATEMENT_CACHE,
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        return conn

    def _begin(self) -> SqliteTx:
        self._conn.execute("BEGIN IMMEDIATE")
        return self._tx

    def _commit(self) -> None:
        self._conn.execute("COMMIT")

    def _rollback(self) -> None:
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            # SQLite already rolled back on the error that brought us here.
            pass

    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            with self._readers_lock:
                if self._closed:
                    raise Unavailable("store is closed")
                conn = self._connect()
                conn.execute("PRAGMA query_only = ON")
                self._readers.append(conn)
            self._local.conn = conn
        return conn

    def read(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in a read-only snapshot on this thread's reader connection."""
        if self._closed:
            raise Unavailable("store is closed")
        conn = self._reader()
        conn.execute("BEGIN")
        try:
            return fn(SqliteTx(conn))
        finally:
            conn.execute("ROLLBACK")

    def read_row(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        """Run one query on this thread's reader connection, outside any explicit transaction.

        In autocommit mode SQLite holds a read transaction only while the statement runs, so
        the query sees one snapshot, and it costs one statement where `read` adds a BEGIN and
        a ROLLBACK. The cursor is closed before returning: a statement left unfinished would
        keep its read transaction open and hold back WAL checkpoints.
        """
        if self._closed:
            raise Unavailable("store is closed")
        cursor = self._reader().execute(sql, tuple(params))
        try:
            row: tuple[Any, ...] | None = cursor.fetchone()
            return row
        finally:
            cursor.close()

    def write(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in the next group commit; durable (WAL fsynced) on return."""
        return self._writer.write(fn)

    def submit(self, fn: Callable[[Tx], T]) -> Future[T]:
        """`write` without waiting; see `Store.submit`."""
        return self._writer.submit(fn)

    def data_version(self) -> int:
        """SQLite's `PRAGMA data_version` on this thread's reader connection: it changes
        whenever another connection (another thread's, another process's) commits, and costs no
        lock, so the coordinator's change feed polls it before reading the audit tail."""
        if self._closed:
            raise Unavailable("store is closed")
        row = self._reader().execute("PRAGMA data_version").fetchone()
        return int(row[0])

    def close(self) -> None:
        """Finish queued writes, then close every connection. Idempotent."""
        self._writer.close()
        with self._readers_lock:
            self._closed = True
            readers, self._readers = self._readers, []
        for conn in readers:
            conn.close()
        self._conn.close()
