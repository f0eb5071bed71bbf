"""The embedded SQLite store: WAL, synchronous=FULL, one group-committing writer.

One writer connection belongs to the `GroupCommitWriter` thread; it opens every write
transaction with `BEGIN IMMEDIATE`, which also serialises it against other processes on the
same file. Reads run on per-thread connections set to `query_only`, each in its own deferred
transaction, so a read sees one snapshot and WAL lets it run beside the writer; a read of one
query (`read_row`) skips the BEGIN and ROLLBACK, as a lone statement is its own snapshot. With
synchronous=FULL a commit returns only after the WAL is fsynced: a write is durable when
`write` returns. Schema migrations (storage/migrations/sqlite) run at open.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rngcoord.server.errors import Unavailable
from rngcoord.server.storage.groupcommit import GroupCommitWriter
from rngcoord.server.storage.store import (
    KnownHead,
    ReadAhead,
    StoreLost,
    StoreNotFound,
    Tx,
    WriteProblem,
    apply_migrations,
    identity_reader,
    read_store_id,
)

if TYPE_CHECKING:
    from rngcoord.server.replication import Replication

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
        self.head: tuple[int, str] | None = None

    def read_ahead(self, reads: Sequence[ReadAhead]) -> list[tuple[Any, ...] | None] | None:
        return None  # a local read costs no round trip: each operation reads for itself

    def begin_op(self) -> None:
        self._conn.execute("SAVEPOINT op")

    def end_op(self, keep: bool) -> None:
        if not keep:
            self._conn.execute("ROLLBACK TO SAVEPOINT op")
        self._conn.execute("RELEASE SAVEPOINT op")

    def execute(self, sql: str, params: Sequence[object] = ()) -> int:
        return self._conn.execute(sql, tuple(params)).rowcount

    def write(self, sql: str, params: Sequence[object] = ()) -> None:
        self._conn.execute(sql, tuple(params))

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
        path: the database file.
        create: create the file with its schema when there is no store there. Default False:
            `StoreNotFound` (a relative path is resolved against the working directory, which
            the message names).
        busy_timeout_ms: how long a connection waits for a lock held by another process
            before failing. Default 5000.
        max_batch: most write operations per transaction. Default 256.

    Every write transaction first checks that the file at `path` is still the one opened
    (same device and inode): a store deleted or replaced under a running server fails every
    later write with UNAVAILABLE instead of acknowledging it into an unlinked file.
    """

    dialect = "sqlite"

    def __init__(
        self,
        path: str | Path,
        *,
        create: bool = False,
        busy_timeout_ms: int = 5000,
        max_batch: int = 256,
    ):
        self.path = Path(path).absolute()
        self.location = str(self.path)
        self.replication: Replication | None = None  # a file has no standby
        self._known = KnownHead(self.location)
        if not create and not _has_schema(self.path):
            raise StoreNotFound(
                f"no rngcoord store at {self.path}: create one with `rngcoord serve --init` "
                "(a new store starts every stream again at offset 0; after losing a store, "
                "add --floor-from AUDIT_EXPORT), or point --db at the existing one"
            )
        self._busy_timeout_ms = busy_timeout_ms
        self._conn = self._connect()
        stat = os.stat(self.path)
        self._identity = (stat.st_dev, stat.st_ino)
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
            retry_reason=lambda exc: "a database locked by another process",
            is_unavailable=self.is_unavailable,
            name=f"rngcoord-sqlite-writer:{self.path.name}",
            max_batch=max_batch,
        )
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        try:
            self._writer.write(
                lambda tx: apply_migrations(tx, "sqlite", create=create, location=self.location)
            )
            self.store_id = self._writer.write(read_store_id)
        except BaseException:
            self.close()
            raise

    def is_unavailable(self, exc: BaseException) -> bool:
        """A disk full, I/O error, lock timeout, unreadable or missing file or table; not a
        constraint or API misuse (those are bugs)."""
        return isinstance(exc, StoreLost) or (
            isinstance(exc, sqlite3.DatabaseError)
            and not isinstance(
                exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError
            )
        )

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
        self._check_file()
        self._conn.execute("BEGIN IMMEDIATE")
        self._tx.head = None  # another process may have appended since the last batch
        return self._tx

    def _check_file(self) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            raise StoreLost(f"the store file {self.path} was deleted") from None
        if (stat.st_dev, stat.st_ino) != self._identity:
            raise StoreLost(f"the store file {self.path} was replaced by another file")

    def check_identity(self) -> None:
        """Raise `StoreLost` unless `path` is still the file opened, with the same store id,
        and `StoreRewound` unless it still holds the newest audit head this process saw (an
        older copy written over the file in place keeps its inode)."""
        self._check_file()
        if self.read(identity_reader(self.store_id, self._known)) != self.store_id:
            raise StoreLost(f"the store at {self.path} now has another store id")

    def went_back_to(self, record_id: int, record_hash: str) -> None:
        """See `Store.went_back_to`."""
        self._known.reset(record_id, record_hash)

    def saw_head(self, record_id: int, record_hash: str) -> None:
        """See `Store.saw_head`."""
        self._known.saw(record_id, record_hash)

    def _commit(self) -> None:
        self._conn.execute("COMMIT")
        if self._tx.head is not None:
            self._known.saw(*self._tx.head)

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

    def submit(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> Future[T]:
        """`write` without waiting; see `Store.submit`."""
        return self._writer.submit(fn, ahead)

    def write_problem(self, stall_s: float) -> WriteProblem | None:
        """See `Store.write_problem`."""
        return self._writer.problem(stall_s)

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


def _has_schema(path: Path) -> bool:
    """Whether `path` is an SQLite file with rngcoord's schema in it."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return False
    try:
        row = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        ).fetchone()
    except sqlite3.DatabaseError:
        return False  # not an SQLite file, so no store either
    finally:
        conn.close()
    return row is not None
