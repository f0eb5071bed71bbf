"""The storage interface every backend implements, and the helpers they share.

- `Tx` and `Store`: the protocols the coordinator codes against. SQL is written once, with `?`
  placeholders and portable statements only; a backend adapts it to its driver.
- `ReadAhead`: the query a write operation reads first, which the writer may send together
  with the rest of its batch's (docs/design.md §7.3).
- `row_reader(store)`: the cheapest way a store offers to read one row of one query; a backend
  opts in by implementing `RowReader`.
- `to_db` / `from_db`: uint64 values (seeds, offsets, sizes, cursors) live in signed 64-bit
  columns as `v - 2**63`, which keeps their order.
- `apply_migrations`: runs storage/migrations/<folder>/NNN_*.sql in order inside a caller's
  transaction and records each in `schema_version`.

`rngcoord.server.storage.stores.open_store(url)` picks the backend from a URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from importlib import resources
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from rngcoord.server.replication import Replication

__all__ = [
    "BIAS",
    "KnownHead",
    "ReadAhead",
    "RowReader",
    "Store",
    "StoreLost",
    "StoreNotFound",
    "StoreRewound",
    "Tx",
    "apply_migrations",
    "from_db",
    "identity_reader",
    "row_reader",
    "split_sql",
    "to_db",
]

T = TypeVar("T")

BIAS = 1 << 63
"""Subtracted from a uint64 before it is stored in a signed BIGINT column."""


class StoreNotFound(RuntimeError):
    """The URL names no rngcoord store, and creating one was not asked for (`--init`).

    A coordinator never starts over on an empty store by itself: the streams of every job
    would begin again at offset 0 (docs/design.md §2.11).
    """


class StoreRolledBack(StoreNotFound):
    """The store is not the one this server last served: its audit chain lacks the head an
    anchor recorded (an older copy swapped in, its tail cut, its tables emptied), another
    store's anchors are the newest, or its keying was stripped (docs/design.md §11.1). Serving
    it could grant offsets again; the error names the anchored record and where the chain
    ends."""


class StoreLost(RuntimeError):
    """The store a server opened is gone or was replaced under it (its file unlinked or
    swapped, its schema dropped, another store's id in its place)."""


class StoreRewound(StoreLost):
    """The store a running server writes to no longer holds an audit record that the server
    saw committed: the database failed over to a standby that had not received it
    (asynchronous replication), or an older copy was put back in place. Grants acknowledged
    with those records may be gone (docs/design.md §11.6).

    Args:
        message: what happened, for the log and the callers.
        known: (record id, hash) of the newest record this process saw committed, now gone.
        chain_end: the id of the store's chain head when this was found: the chain went back
            to it or below (other processes may have appended since the failover).
    """

    def __init__(self, message: str, known: tuple[int, str], chain_end: int) -> None:
        super().__init__(message)
        self.known = known
        self.chain_end = chain_end


class KnownHead:
    """The newest audit chain head (record id, hash) that this process saw committed in a
    store, and the check that the store still holds it.

    An append-only chain never loses a record, and its records never change: a store whose
    chain ends before the known head, or whose record at the known head's id has another
    hash, went back in time under the server, whatever its store id says. This process's
    acknowledged commits move the known head forward, and so do the heads it reads (its write
    transactions' head lock, and the change feed, which sees every replica's commits) where a
    record read was acknowledged: not so under synchronous replication (`PostgresStore`).

    Args:
        location: where the store is, for the error message.
    """

    def __init__(self, location: str) -> None:
        self._location = location
        self._head: tuple[int, str] = (0, "")

    @property
    def head(self) -> tuple[int, str]:
        """(record id, hash) of the newest head seen; (0, "") before any."""
        return self._head

    def saw(self, record_id: int, record_hash: str) -> None:
        """The store committed the chain up to `record_id`, whose hash is `record_hash`."""
        # One tuple assignment: readers on other threads see the old head or the new one.
        if record_id > self._head[0]:
            self._head = (record_id, record_hash)

    def reset(self, record_id: int, record_hash: str) -> None:
        """Take (record_id, record_hash) as the newest head: the store went back in time to
        it, and this process goes on from there (docs/design.md §11.6)."""
        self._head = (record_id, record_hash)

    def check(self, last_id: int, hash_at_known: str | None, known: tuple[int, str]) -> None:
        """Raise `StoreRewound` unless the store still holds `known`, the head this process
        knew when it read the store.

        Args:
            last_id: the id of the store's chain head now.
            hash_at_known: the hash of the store's record with the id of `known`, or None
                where it has none.
            known: `head` as it was when the store was read.
        """
        known_id, known_hash = known
        if known_id == 0 or (last_id >= known_id and hash_at_known == known_hash):
            return
        if hash_at_known is None:
            where = f"its audit chain now ends at record {last_id}"
        else:
            where = f"its record {known_id} now has another hash ({hash_at_known[:12]}...)"
        raise StoreRewound(
            f"the store at {self._location} went back in time: this server saw audit record "
            f"{known_id} (hash {known_hash[:12]}...) committed, and {where}. A database "
            "failover to a standby that had not received every commit (asynchronous "
            "replication), or an older copy put in its place, loses acknowledged grants. "
            "Run PostgreSQL with synchronous replication (docs/operations.md); "
            "docs/design.md §11.6 says what the server does now",
            known,
            # The record at `known_id` is gone, or is another one: the chain went back below it.
            min(last_id, known_id - 1),
        )


def to_db(value: int) -> int:
    """Map a uint64 onto a signed 64-bit column value, keeping the order."""
    return value - BIAS


def from_db(value: int) -> int:
    """Inverse of `to_db`."""
    return value + BIAS


class Tx(Protocol):
    """One open transaction. Statements use `?` placeholders."""

    head: tuple[int, str] | None
    """The audit chain's head (last id, last hash) as this write transaction has it, or None
    where nobody has read it yet: `audit.Chain.append` reads it once and then keeps it here, so
    a batch of grants reads the head once, not once per record. The writer restores it when
    it rolls an operation's savepoint back."""

    def read_ahead(self, reads: Sequence[ReadAhead]) -> list[tuple[Any, ...] | None] | None:
        """Run each read and return its first row (None for none), in one round trip where the
        backend can (PostgreSQL); None where that would gain nothing (SQLite), and then each
        read runs when its operation asks for it."""
        ...

    def begin_op(self) -> None:
        """Start one operation of a write batch, whose writes `end_op` may take back without
        touching the operations before it (a savepoint, where the backend needs one)."""
        ...

    def end_op(self, keep: bool) -> None:
        """End the operation `begin_op` started, keeping its writes or taking them back."""
        ...

    def execute(self, sql: str, params: Sequence[object] = ()) -> int:
        """Run a statement whose rows (if any) are not needed; return the rows it changed."""
        ...

    def write(self, sql: str, params: Sequence[object] = ()) -> None:
        """Run a statement whose outcome nobody reads before the commit. A backend may hold
        it back and send it with others (PostgreSQL), so an error it raises may surface at a
        later statement of the transaction, or at the commit, which then fails."""
        ...

    def executemany(self, sql: str, params: Sequence[Sequence[object]]) -> None:
        """Run one statement once per parameter row (one round trip where the driver can)."""
        ...

    def fetchone(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        """Run a query and return its first row, or None when it has none."""
        ...

    def fetchall(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Run a query and return all of its rows."""
        ...


class ReadAhead(NamedTuple):
    """The first query of a write operation, known before the operation runs.

    The group-commit writer sends the read-aheads of a whole batch in one round trip, then
    hands each operation its row when the operation's `fetchone` asks this query with these
    parameters, unless an earlier operation of the batch may have changed what it reads: one
    with the same `key`, or one without a read-ahead (which could write anything). Then the
    operation reads for itself, as it would without one.

    Attributes:
        key: what the read depends on; operations with other keys never write its rows.
        sql: the query, with `?` placeholders, exactly as the operation passes it.
        params: its parameters, exactly as the operation passes them.
    """

    key: tuple[str, ...]
    sql: str
    params: tuple[object, ...]


class WriteProblem(NamedTuple):
    """Why a store's writes are not completing.

    Attributes:
        reason: what is wrong, for health and logs.
        fatal: True when the store cannot write again in this process (its writer thread
            died): the server exits so that its supervisor or container runtime restarts it.
    """

    reason: str
    fatal: bool


class Store(Protocol):
    """A transactional store: concurrent snapshot reads and durable group-committed writes."""

    dialect: str
    """Which SQL dialect the backend speaks: "sqlite" or "postgresql"."""

    store_id: str
    """The store's identity, drawn when it was created (the `meta` table)."""

    location: str
    """Where the store is, for messages (an absolute file path, or a URL without password)."""

    replication: Replication | None
    """The primary's replication settings as the writer's latest connection read them
    (PostgreSQL); None for a store without standbys (SQLite), or before the writer connected."""

    def is_unavailable(self, exc: BaseException) -> bool:
        """Whether `exc`, raised by the driver, means the database cannot serve now (down,
        unreachable, full, unreadable, its tables gone) rather than a bug: such a failure is
        answered UNAVAILABLE, which clients retry, and fails the whole write batch."""
        ...

    def check_identity(self) -> None:
        """Raise `StoreLost` unless the store is still the one that was opened, and
        `StoreRewound` when it no longer holds the newest audit head this process saw."""
        ...

    def saw_head(self, record_id: int, record_hash: str) -> None:
        """The store committed the audit chain up to `record_id` (seen by the change feed,
        which follows every replica's commits): from now on, a store without that record is
        one that went back in time (`KnownHead`)."""
        ...

    def went_back_to(self, record_id: int, record_hash: str) -> None:
        """The store went back in time to the chain head (record_id, record_hash), and this
        process serves it from there on: the newest head it knows is that one now."""
        ...

    def read(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in a read-only snapshot and return its result. Safe from any thread."""
        ...

    def write(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in a write transaction; on return its writes are committed and durable.

        `fn` must be a pure function of the transaction: a backend may run it again when the
        database asks for a retry. A `CoordinatorError` from `fn` rolls back `fn`'s writes
        (unless the error has `keep_writes`) and is raised here; a failed commit raises
        `Unavailable`.
        """
        ...

    def submit(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> Future[T]:
        """`write` without waiting: the future completes as `write` would return or raise. The
        coordinator's event loop awaits it, so no thread waits on a commit. `ahead`: the query
        `fn` reads first (`ReadAhead`), or None."""
        ...

    def write_problem(self, stall_s: float) -> WriteProblem | None:
        """Why writes are not completing, or None: the writer thread died (fatal), or a batch
        has run for `stall_s` seconds or more (the server then reports NOT_SERVING)."""
        ...

    def close(self) -> None:
        """Finish queued writes, then release connections. Later calls raise `Unavailable`."""
        ...


@runtime_checkable
class RowReader(Protocol):
    """A store that runs a single query without wrapping it in a transaction of its own.

    One statement reads one consistent snapshot by itself, in SQLite as in PostgreSQL, so the
    BEGIN and ROLLBACK around it buy nothing; a backend whose transaction control costs
    something per read (SQLite: each statement releases and retakes the GIL) implements this.
    """

    def read_row(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        """Run one query, which must not write, and return its first row or None."""
        ...


def row_reader(store: Store) -> Callable[[str, Sequence[object]], tuple[Any, ...] | None]:
    """How to read the first row of one query from `store`: its `read_row` when it is a
    `RowReader`, else a `read` running that one query."""
    if isinstance(store, RowReader):
        return store.read_row

    def read_row(sql: str, params: Sequence[object]) -> tuple[Any, ...] | None:
        return store.read(lambda tx: tx.fetchone(sql, params))

    return read_row


def split_sql(script: str) -> list[str]:
    """Split a migration script into statements at semicolons outside quotes and comments.

    Handles '...' strings, "..." identifiers, `--` line comments and `/* */` block comments;
    migrations must not use dollar quoting. Empty statements are dropped.
    """
    statements: list[str] = []
    current: list[str] = []
    i, n = 0, len(script)
    while i < n:
        ch = script[i]
        if ch in "'\"":
            close = script.find(ch, i + 1)
            # A doubled quote inside a literal escapes it; find() lands on the first of the two
            # and the next pass continues the literal from the second.
            end = n if close < 0 else close + 1
            current.append(script[i:end])
            i = end
        elif script.startswith("--", i):
            newline = script.find("\n", i)
            i = n if newline < 0 else newline + 1
        elif script.startswith("/*", i):
            close = script.find("*/", i + 2)
            i = n if close < 0 else close + 2
        elif ch == ";":
            statements.append("".join(current).strip())
            current = []
            i += 1
        else:
            current.append(ch)
            i += 1
    statements.append("".join(current).strip())
    return [s for s in statements if s]


def _migration_files(folder: str) -> list[tuple[int, str, str]]:
    """(version, name, script) of storage/migrations/<folder>/NNN_*.sql, in version order."""
    root = resources.files("rngcoord.server.storage") / "migrations" / folder
    found: list[tuple[int, str, str]] = []
    for entry in root.iterdir():
        stem, dot, ext = entry.name.partition(".")
        number, _, _ = stem.partition("_")
        if dot and ext == "sql" and number.isdigit():
            found.append((int(number), stem, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [version for version, _, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(
            f"migrations in storage/migrations/{folder} must be numbered 1..N without gaps; "
            f"found {versions}"
        )
    return found


HEAD_CHECK_SQL = (
    "SELECT h.last_id, h.last_hash, (SELECT a.hash FROM audit a WHERE a.id = ?) "
    "FROM audit_head h WHERE h.id = 1"
)
"""The chain's head, and the hash of the record with a given id (`KnownHead.check`)."""


def identity_reader(
    store_id: str, known: KnownHead, *, advance: bool = True
) -> Callable[[Tx], str]:
    """A read (for `Store.read`) that returns the store's id and, where it is `store_id`,
    raises `StoreRewound` unless the store still holds `known`'s head; then, with `advance`,
    moves `known` to the store's head (see `PostgresStore` for when a head that was read is
    not yet known to last).

    `known.head` is taken now, before the read's snapshot begins: a commit that lands after
    the snapshot moves `known.head` past what the snapshot can see, and a store that is only
    behind would look rewound (a test met it on SQLite: known 3905, snapshot at 3882).
    """
    head = known.head

    def read(tx: Tx) -> str:
        found = read_store_id(tx)
        if found != store_id:
            return found
        row = tx.fetchone(HEAD_CHECK_SQL, (head[0],))
        if row is None:
            raise StoreLost("the store has no audit_head row: its tables were emptied")
        known.check(int(row[0]), None if row[2] is None else str(row[2]), head)
        if advance:
            known.saw(int(row[0]), str(row[1]))
        return found

    return read


def read_store_id(tx: Tx) -> str:
    """The store's id from `meta` (migration 003 draws it)."""
    row = tx.fetchone("SELECT value FROM meta WHERE name = 'store_id'")
    if row is None:
        raise StoreLost("the store has no store_id: its meta table was emptied")
    return str(row[0])


def apply_migrations(tx: Tx, folder: str, *, create: bool, location: str) -> int:
    """Apply the migrations of `folder` that `schema_version` lacks; return the version.

    Runs inside the caller's write transaction, so a failed migration leaves no trace and
    concurrent starters serialise on the backend's write lock.

    Args:
        tx: an open write transaction.
        folder: the dialect's folder under storage/migrations ("sqlite" or "postgres").
        create: whether a database without any migration may get the whole schema (`--init`).
        location: where the store is, for messages.

    Raises:
        StoreNotFound: no migration was ever applied (an empty `schema_version`, as a store
            whose tables were dropped may leave), and `create` is False.
        RuntimeError: the database was migrated by a newer rngcoord, or the files are
            misnumbered.
    """
    tx.execute(
        "CREATE TABLE IF NOT EXISTS schema_version ("
        "version BIGINT NOT NULL PRIMARY KEY, name TEXT NOT NULL, applied_us BIGINT NOT NULL)"
    )
    row = tx.fetchone("SELECT MAX(version) FROM schema_version")
    current = 0 if row is None or row[0] is None else int(row[0])
    files = _migration_files(folder)
    if current == 0 and not create:
        raise StoreNotFound(
            f"the database at {location} has rngcoord's schema_version table but no schema in "
            "it (its tables were dropped?): a fresh schema would start every stream again at "
            "offset 0. Restore the store from a backup, or create a new one on purpose with "
            "`rngcoord serve --init --floor-from AUDIT_EXPORT`"
        )
    if current > len(files):
        raise RuntimeError(
            f"the database has schema version {current} but this rngcoord knows only up to "
            f"{len(files)}: upgrade rngcoord"
        )
    for version, name, script in files[current:]:
        for statement in split_sql(script):
            tx.execute(statement)
        tx.execute(
            "INSERT INTO schema_version (version, name, applied_us) VALUES (?, ?, ?)",
            (version, name, time.time_ns() // 1000),
        )
    return len(files)
