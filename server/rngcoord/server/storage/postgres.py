"""The PostgreSQL store: several coordinator replicas sharing one database.

Responsibilities:
- Writes: one dedicated writer connection drives the shared `GroupCommitWriter`. Every write
  transaction first locks the single `audit_head` row (`SELECT ... FOR UPDATE`). That lock
  serialises writers across all replicas, so two replicas can never grant overlapping ranges
  and the audit chain stays linear. Under READ COMMITTED, each statement after the lock sees
  everything committed before it, so the operations' re-checks read the latest state.
- Round trips: a batch waits on the database four times however many grants it holds
  (docs/design.md §7.3): BEGIN with the head lock; the batch's read-aheads (`Tx.read_ahead`);
  the writes, which `Tx.write` holds back and sends as one simple query before the next
  statement whose answer is needed or before COMMIT; and COMMIT. An operation's writes are
  taken back by dropping them while none was sent, so only an operation that sends its writes
  before it ends opens a savepoint. An error of a held statement surfaces where they are
  sent; such an attempt runs again sending each write as it comes, where each operation's
  error is its own. The next batch holds its writes back again.
- Retries: serialization failures (40001), deadlocks (40P01) and lost connections abort the
  batch, which runs again with bounded backoff (at most `max_attempts` times), then callers
  get UNAVAILABLE. A broken writer connection is replaced before the next attempt. A
  connection lost during COMMIT is different: the outcome is unknown, so the batch fails with
  UNAVAILABLE and is not re-run (clients retry, and leases are idempotent).
- Reads: a `psycopg_pool.ConnectionPool` of read-only sessions. `read` runs in one REPEATABLE
  READ transaction, so it sees one snapshot; `read_row` (a single query, the idempotent-hit
  path) runs as a lone statement, one round trip. Lost connections are retried the same
  bounded way.
- Schema: storage/migrations/postgres/NNN_*.sql, applied at open under a transaction-scoped
  advisory lock, so replicas that start together migrate once.
- SQL: the coordinator's portable SQL uses `?` placeholders; `convert_placeholders` turns them
  into psycopg's `%s`.

Only portable SQL runs on the request path. The advisory lock orders migrations and nothing
else; correctness rests on the row lock and the retries, which Postgres-compatible distributed
SQL engines provide too.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import psycopg
import psycopg.conninfo
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from rngcoord.server.errors import Unavailable
from rngcoord.server.logs import event
from rngcoord.server.replication import SQL as REPLICATION_SQL
from rngcoord.server.replication import Replication, ReplicationRefused
from rngcoord.server.storage.groupcommit import GroupCommitWriter
from rngcoord.server.storage.postgres_tx import PostgresTx, convert_placeholders
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

__all__ = ["ISOLATION_LEVELS", "PostgresStore"]

T = TypeVar("T")

_log = logging.getLogger(__name__)

ISOLATION_LEVELS: Final = ("read committed", "repeatable read", "serializable")
"""The values `PostgresStore(isolation=...)` accepts (None keeps the server's default)."""

MIGRATION_LOCK_KEY: Final = 0x726E67636F6F7264
"""The advisory-lock key ("rngcoord" in ASCII) that orders concurrent migrations."""

_LOCK_HEAD = (
    "SELECT m.value, h.last_id, h.last_hash, (SELECT a.hash FROM audit a WHERE a.id = %s) "
    "FROM audit_head h, meta m WHERE h.id = 1 AND m.name = 'store_id' FOR UPDATE OF h"
)
"""Locks the chain's head for the transaction, and reads the store id, the head and the hash
of the newest record this process knows was committed (`KnownHead`) in the same round trip: a
write never lands in a store that replaced this one under the server, or in one that went back
in time (a failover that lost commits), and the batch's records chain on from the head without
reading it again."""

CHANGES_CHANNEL: Final = "rngcoord_changes"
"""Every write transaction sends a NOTIFY on this channel, delivered when it commits: the
replicas' change feeds (rngcoord.server.core.feed) listen to it."""
_BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"

# SQLSTATEs after which a transaction certainly did not commit and may simply run again:
# serialization_failure, deadlock_detected, and the ways the server ends a session
# (idle_in_transaction_session_timeout, admin_shutdown, crash_shutdown, cannot_connect_now).
# Connection exceptions (class 08) are matched by prefix.
_RETRY_SQLSTATES: Final = frozenset({"40001", "40P01", "25P03", "57P01", "57P02", "57P03"})

_WRITER_IDLE_TIMEOUT: Final = "30s"
"""How long the server lets the writer's session sit idle inside a transaction: a replica
frozen while it holds the audit_head lock (stopped, swapped out) would stall every replica;
the server ends its session instead, rolling its batch back, and the others carry on."""


class _CommitOutcomeUnknown(Exception):
    """The connection broke during COMMIT: the transaction may or may not have committed."""


def _is_retryable(exc: BaseException) -> bool:
    """True when the failed transaction certainly did not commit and may run again."""
    if isinstance(exc, PoolTimeout) or not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        # Raised by the driver itself: the connection was lost (or never made).
        return isinstance(exc, psycopg.OperationalError)
    return state in _RETRY_SQLSTATES or state.startswith("08")


def _retry_reason(exc: BaseException) -> str:
    """What a retryable error (`_is_retryable`) means, for the error once retries are spent:
    a lost connection is not a conflict, and an operator reading the log must tell them
    apart."""
    state = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    if state is None or state.startswith("08"):
        return "a lost database connection (the server is down, restarting or failing over)"
    if state.startswith("57P"):
        return "the database server shutting down or restarting"
    if state == "25P03":
        return "the session's idle-in-transaction timeout"
    return "conflicting writes"


def _parse(url: str) -> dict[str, Any]:
    """The connection parameters of a libpq URL.

    Raises:
        ValueError: the URL does not parse; the message never holds its password.
    """
    try:
        return psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        message = str(exc).strip()
        password = urlsplit(url).password
        if password:
            message = message.replace(password, "***")
        # `from None`: the original exception's message may quote the password.
        raise ValueError(f"cannot parse the PostgreSQL URL: {message}") from None


def _describe(params: dict[str, Any]) -> str:
    """A URL naming the user, host, port and database, without the password, for messages."""
    user = f"{params['user']}@" if params.get("user") else ""
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{user}{params.get('host', '')}{port}/{params.get('dbname', '')}"


class PostgresStore:
    """A `Store` on a PostgreSQL database, safe to share between coordinator replicas.

    The schema is created or upgraded on open. Durability comes from the server: the writer
    session sets `synchronous_commit = on`, so a commit returns after its WAL is flushed. The
    writer session also sets `idle_in_transaction_session_timeout`, so that a replica frozen
    while it holds the `audit_head` lock loses its session (and its uncommitted batch) after
    30 s rather than stall every other replica.

    Args:
        url: a libpq connection URL, `postgresql://USER[:PASSWORD]@HOST[:PORT]/DB[?...]`.
        create: create rngcoord's schema when the database has none. Default False:
            `StoreNotFound`.
        isolation: the writer's isolation level, one of `ISOLATION_LEVELS`, or None for the
            server's default (READ COMMITTED on PostgreSQL; SERIALIZABLE on CockroachDB).
            Every level is correct: the `audit_head` lock orders writers, and conflicts that a
            stricter level reports are retried. Default None.
        min_readers: reader connections kept open. Default 1.
        max_readers: most reader connections; reads beyond that wait for one. Default 16.
        max_batch: most write operations per transaction. Default 256.
        max_attempts: most runs of a write batch, or of a read, when the database asks for a
            retry or the connection drops. Default 5.
        backoff_s: delay before the second attempt; it doubles on each further one, with
            jitter. Default 0.02.
        connect_timeout_s: how long opening the store, or a read waiting for a free
            connection, may take before failing. Default 10.

    Raises:
        ConnectionError: the database cannot be reached when the store opens.
        ValueError: `url` does not parse, or `isolation` is not one of `ISOLATION_LEVELS`.
    """

    dialect = "postgresql"

    def __init__(
        self,
        url: str,
        *,
        create: bool = False,
        isolation: str | None = None,
        min_readers: int = 1,
        max_readers: int = 16,
        max_batch: int = 256,
        max_attempts: int = 5,
        backoff_s: float = 0.02,
        connect_timeout_s: float = 10.0,
        require_sync_replication: bool = False,
    ) -> None:
        if isolation is not None and isolation not in ISOLATION_LEVELS:
            raise ValueError(
                f"isolation must be one of {', '.join(ISOLATION_LEVELS)} or None; got {isolation!r}"
            )
        self._url_params = _parse(url)
        self.url = _describe(self._url_params)
        self.location = self.url
        self._create = create
        self._conninfo = url
        self._begin_sql = "BEGIN" if isolation is None else f"BEGIN ISOLATION LEVEL {isolation}"
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._connect_timeout_s = connect_timeout_s
        self._closed = False
        self._close_lock = threading.Lock()
        self._require_sync = require_sync_replication
        self._known = KnownHead(self.url)
        self.replication: Replication | None = None
        """The primary's replication settings, read by the writer's latest connection."""

        self._conn: psycopg.Connection[Any] | None = None
        # Whether the next write attempt holds its writes back, whether the current one does,
        # and its transaction while open (set before `_migrate`, whose failure calls
        # `_rollback`).
        self._deferred = True
        self._attempt_deferred = False
        self._tx: PostgresTx | None = None
        try:
            self._migrate()
        except psycopg.OperationalError as exc:
            self._close_writer_connection()
            raise ConnectionError(f"cannot open the store at {self.url}: {exc}") from exc
        except BaseException:
            self._close_writer_connection()
            raise
        self._pool = ConnectionPool(
            url,
            min_size=min_readers,
            max_size=max_readers,
            kwargs=self._connect_kwargs("rngcoord-reader"),
            configure=_configure_reader,
            timeout=connect_timeout_s,
            name="rngcoord-readers",
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except PoolTimeout as exc:
            self._pool.close()
            self._close_writer_connection()
            raise ConnectionError(
                f"cannot open reader connections to {self.url} within {connect_timeout_s}s: {exc}"
            ) from exc
        self._writer = GroupCommitWriter(
            begin=self._begin,
            commit=self._commit,
            rollback=self._rollback,
            is_retryable=_is_retryable,
            retry_reason=_retry_reason,
            rerun=self._rerun,
            is_unavailable=self.is_unavailable,
            name="rngcoord-postgres-writer",
            max_batch=max_batch,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
        )

    # ------------------------------------------------------------------------ connections

    def _connect_kwargs(self, name: str) -> dict[str, Any]:
        """Connection defaults for what the URL leaves unset. application_name tells an
        operator (and pg_stat_activity) which session is which."""
        defaults = {
            "connect_timeout": max(1, round(self._connect_timeout_s)),
            "application_name": name,
        }
        return {k: v for k, v in defaults.items() if k not in self._url_params}

    def _writer_connection(self) -> psycopg.Connection[Any]:
        """The writer's connection, replaced by a new one when the old one broke."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._close_writer_connection()
            # autocommit: the writer issues BEGIN, SAVEPOINT and COMMIT itself.
            conn = psycopg.connect(
                self._conninfo, autocommit=True, **self._connect_kwargs("rngcoord-writer")
            )
            try:
                # A grant must be on stable storage before the reply leaves (docs/design.md
                # §2.3), whatever the server's default says.
                conn.execute("SET synchronous_commit TO on")
                conn.execute(f"SET idle_in_transaction_session_timeout TO '{_WRITER_IDLE_TIMEOUT}'")
                self._check_replication(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return conn

    def _check_replication(self, conn: psycopg.Connection[Any]) -> None:
        """Read the primary's replication settings (this connection may have found a new
        primary), log them when they changed, and refuse an asynchronous primary when
        synchronous replication is required."""
        row = conn.execute(REPLICATION_SQL).fetchone()
        assert row is not None
        found = Replication(*(str(v) for v in row))
        if found != self.replication:
            self.replication = found
            level = logging.INFO if found.synchronous else logging.WARNING
            event(
                _log,
                level,
                "store_replication",
                description=found.describe(),
                synchronous=found.synchronous,
                synchronous_standby_names=found.standby_names,
                synchronous_commit=found.synchronous_commit,
                standbys=found.standbys,
            )
        if self._require_sync and not found.synchronous:
            raise ReplicationRefused(
                f"the primary of {self.url} does not replicate synchronously, and "
                f"--require-sync-replication asks that it does: {found.describe()}"
            )

    def _close_writer_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _migrate(self) -> None:
        """Apply pending migrations in one transaction; replicas starting at once take turns.

        The transaction is READ COMMITTED whatever the server's default, so that once the
        advisory lock is ours, `apply_migrations` sees the schema another replica just
        committed and skips what it applied.
        """
        conn = self._writer_connection()
        conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        try:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            exists = conn.execute("SELECT to_regclass('schema_version')").fetchone()
            if not self._create and (exists is None or exists[0] is None):
                raise StoreNotFound(
                    f"no rngcoord store in {self.url}: create one with `rngcoord serve --init` "
                    "(a new store starts every stream again at offset 0; after losing a store, "
                    "add --floor-from AUDIT_EXPORT), or point --db at the existing one"
                )
            apply_migrations(
                PostgresTx(conn), "postgres", create=self._create, location=self.location
            )
            self.store_id = read_store_id(PostgresTx(conn))
            conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    # ------------------------------------------------------------------------- writes

    def _begin(self) -> PostgresTx:
        # First: a failure to connect must not be taken for an error of held writes (`_rerun`),
        # which would run the batch again at once, for ever.
        self._attempt_deferred = self._deferred
        conn = self._writer_connection()
        binder = psycopg.ClientCursor(conn)
        known = self._known.head
        try:
            # BEGIN and the lock in one round trip.
            binder.execute(f"{self._begin_sql}; {_LOCK_HEAD}", (known[0],))
            binder.nextset()
            row = binder.fetchone()
        except psycopg.errors.UndefinedTable as exc:
            raise StoreLost(f"rngcoord's tables are gone from {self.url}: {exc}") from exc
        if row is None or row[0] != self.store_id:
            found = "none" if row is None else row[0]
            raise StoreLost(f"the database {self.url} now holds another store ({found})")
        head = (int(row[1]), str(row[2]))
        self._known.check(head[0], None if row[3] is None else str(row[3]), known)
        if self._reads_acknowledged():
            self._known.saw(*head)
        self._tx = PostgresTx(conn, deferred=self._deferred, head=head)
        return self._tx

    def _rerun(self, exc: BaseException) -> bool:
        """True for a database error of an attempt whose writes were held back, since their
        error may belong to an earlier operation than the one it surfaced in: the batch runs
        again at once sending each write as it comes (`_rollback` turns deferring off), where
        each operation's error is its own."""
        return self._attempt_deferred and isinstance(exc, psycopg.Error)

    def _commit(self) -> None:
        # Never `_writer_connection()` here: a fresh connection would have no transaction to
        # commit, and the COMMIT would "succeed" with nothing written.
        conn, tx = self._conn, self._tx
        if conn is None or tx is None:
            raise _CommitOutcomeUnknown(f"no connection to {self.url} to commit on")
        # The held writes go first, on their own: an error of any of them raises here, with
        # nothing committed (`_rerun` then runs the batch again without deferring).
        tx.write(f"NOTIFY {CHANGES_CHANNEL}")
        tx.flush()
        self._tx = None
        self._deferred = True
        try:
            conn.execute("COMMIT")
        except psycopg.Error as exc:
            if conn.broken:
                raise _CommitOutcomeUnknown(
                    f"the connection to {self.url} was lost during COMMIT, so the writes may "
                    f"or may not have committed; retry the request ({exc})"
                ) from exc
            raise
        if tx.head is not None:
            self._known.saw(*tx.head)

    def _rollback(self) -> None:
        # The next attempt sends each write as it comes, so that a rerun gets each error where
        # it belongs; the next commit turns deferring back on.
        self._deferred = False
        self._tx = None
        conn = self._conn
        if conn is None or conn.closed:
            return
        if conn.broken:
            self._close_writer_connection()
            return
        try:
            if conn.info.transaction_status != TransactionStatus.IDLE:
                conn.execute("ROLLBACK")
        except psycopg.Error:
            # The session is in no state to reuse; the next attempt connects afresh.
            self._close_writer_connection()

    def write(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in the next group commit; durable (WAL flushed) on return.

        Raises:
            Unavailable: the batch could not commit, even after retries.
        """
        return self._writer.write(fn)

    def submit(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> Future[T]:
        """`write` without waiting; see `Store.submit`."""
        return self._writer.submit(fn, ahead)

    def write_problem(self, stall_s: float) -> WriteProblem | None:
        """See `Store.write_problem`."""
        return self._writer.problem(stall_s)

    # -------------------------------------------------------------------------- reads

    def read(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in a read-only REPEATABLE READ transaction (one snapshot) on a pooled
        connection.

        Raises:
            Unavailable: the store is closed, no connection came free within
                `connect_timeout_s`, or the database stayed unreachable over every attempt.
        """

        def run(conn: psycopg.Connection[Any]) -> T:
            conn.execute(_BEGIN_READ)
            try:
                result = fn(PostgresTx(conn))
            except BaseException:
                # A broken connection cannot roll back; the pool discards it either way.
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
                raise
            conn.execute("ROLLBACK")
            return result

        return self._with_reader(run)

    def read_row(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        """Run one query, which must not write, and return its first row or None.

        A lone statement reads one snapshot by itself, so it runs without a transaction of
        its own: one round trip where `read` takes three. The reader sessions default to
        read-only transactions, so the statement cannot write either.

        Raises:
            Unavailable: as for `read`.
        """
        query = convert_placeholders(sql)
        values = tuple(params)

        def run(conn: psycopg.Connection[Any]) -> tuple[Any, ...] | None:
            row: tuple[Any, ...] | None = conn.execute(query, values).fetchone()
            return row

        return self._with_reader(run)

    def _with_reader(self, run: Callable[[psycopg.Connection[Any]], T]) -> T:
        """`run(conn)` on a pooled reader connection, retried on a lost connection."""
        attempt = 1
        while True:
            if self._closed:
                raise Unavailable("store is closed")
            try:
                with self._pool.connection() as conn:
                    return run(conn)
            except PoolTimeout as exc:
                raise Unavailable(
                    f"no database connection to {self.url} came free within "
                    f"{self._connect_timeout_s}s: {exc}"
                ) from exc
            except psycopg.Error as exc:
                if not _is_retryable(exc):
                    raise
                if attempt == self._max_attempts:
                    raise Unavailable(
                        f"store read failed {attempt} times, giving up: {exc}"
                    ) from exc
            # After a server restart every idle connection is dead: drop them all now rather
            # than spend one attempt on each.
            self._pool.check()
            time.sleep(self._backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
            attempt += 1

    def is_unavailable(self, exc: BaseException) -> bool:
        """A connection failure, a pool timeout, a server-side resource or I/O error, or
        rngcoord's tables gone; not a constraint violation or a bad statement (bugs)."""
        return isinstance(
            exc,
            StoreLost
            | Unavailable
            | PoolTimeout
            | psycopg.OperationalError
            | psycopg.errors.UndefinedTable
            | psycopg.errors.InsufficientResources
            | psycopg.errors.DiskFull,
        )

    def check_identity(self) -> None:
        """Raise `StoreLost` unless the database still holds this store (its schema and id),
        and `StoreRewound` unless it still holds the newest audit head this process saw."""
        check = identity_reader(self.store_id, self._known, advance=self._reads_acknowledged())
        try:
            found = self.read(check)
        except psycopg.errors.UndefinedTable as exc:
            raise StoreLost(f"rngcoord's tables are gone from {self.url}: {exc}") from exc
        if found != self.store_id:
            raise StoreLost(f"the database {self.url} now holds another store ({found})")

    def went_back_to(self, record_id: int, record_hash: str) -> None:
        """See `Store.went_back_to`."""
        self._known.reset(record_id, record_hash)

    def saw_head(self, record_id: int, record_hash: str) -> None:
        """See `Store.saw_head`; ignored under synchronous replication (`_reads_acknowledged`)."""
        if self._reads_acknowledged():
            self._known.saw(record_id, record_hash)

    def _reads_acknowledged(self) -> bool:
        """Whether a record this process reads, rather than commits, was acknowledged, so that
        a store without it went back in time (`KnownHead`).

        Not under synchronous replication: PostgreSQL makes a commit visible on the primary
        before the standby has it, while its committer still waits for the standby, and a
        primary that dies then leaves a promoted standby without a record that other sessions
        read but nobody acknowledged (tests/server/test_failover.py met it: the feed read record
        70, the promoted standby ended at 69). There this process knows a head from its own
        acknowledged commits, each of which the standby flushed with everything before it.
        Asynchronously, a visible commit has been, or is about to be, acknowledged.
        """
        replication = self.replication
        return replication is None or not replication.synchronous

    # ------------------------------------------------------------------------ changes

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (from a listener thread) whenever any replica commits a write, and
        once after every (re)connection, since notifications sent meanwhile are lost. Returns
        a function that stops listening."""
        stopped = threading.Event()

        def run() -> None:
            while not stopped.is_set():
                try:
                    with psycopg.connect(
                        self._conninfo, autocommit=True, **self._connect_kwargs("rngcoord-listener")
                    ) as conn:
                        conn.execute(f"LISTEN {CHANGES_CHANNEL}")
                        callback()
                        while not stopped.is_set():
                            for _ in conn.notifies(timeout=0.5):
                                callback()
                except psycopg.Error:
                    stopped.wait(1.0)

        thread = threading.Thread(target=run, name="rngcoord-postgres-listener", daemon=True)
        thread.start()

        def stop() -> None:
            stopped.set()
            thread.join(timeout=5)

        return stop

    # -------------------------------------------------------------------------- close

    def close(self) -> None:
        """Finish queued writes, then close every connection. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._writer.close()
        self._pool.close()
        self._close_writer_connection()


def _configure_reader(conn: psycopg.Connection[Any]) -> None:
    # Reader sessions run in autocommit mode, so that `read_row` costs one round trip, and
    # default to read-only transactions, so that no statement on them can ever write; `read`
    # opens its own REPEATABLE READ transaction for a multi-statement snapshot.
    conn.autocommit = True
    conn.execute("SET default_transaction_read_only TO on")
