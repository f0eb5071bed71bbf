"""A PostgreSQL write transaction (`PostgresTx`), and the conversion of the portable SQL's `?`
placeholders to psycopg's `%s` (`convert_placeholders`).

The transaction holds its writes back and sends them as one simple query before the next
statement whose answer is needed, or before COMMIT; rngcoord.server.storage.postgres drives it
(the round trips of a batch are described there).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import psycopg

from rngcoord.server.storage.store import ReadAhead

__all__ = ["PostgresTx", "convert_placeholders"]


@functools.lru_cache(maxsize=1024)
def convert_placeholders(sql: str) -> str:
    """Rewrite portable `?` placeholders to psycopg's `%s`, escaping literal `%` as `%%`.

    A `?` inside a '...' literal, a "..." identifier or a comment is kept as it is (the
    project's SQL uses no dollar quoting). psycopg reads `%` everywhere, literals included, so
    every `%` is doubled.

    Example: `SELECT '?%', x FROM t WHERE a = ?` becomes `SELECT '?%%', x FROM t WHERE a = %s`.
    """
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in "'\"":
            close = sql.find(ch, i + 1)
            end = n if close < 0 else close + 1
            # A doubled quote escapes itself: the scan resumes at the second quote, which
            # reopens the literal, so no `?` inside it is ever taken for a placeholder.
            out.append(sql[i:end].replace("%", "%%"))
            i = end
        elif sql.startswith("--", i):
            newline = sql.find("\n", i)
            end = n if newline < 0 else newline + 1
            out.append(sql[i:end].replace("%", "%%"))
            i = end
        elif sql.startswith("/*", i):
            close = sql.find("*/", i + 2)
            end = n if close < 0 else close + 2
            out.append(sql[i:end].replace("%", "%%"))
            i = end
        else:
            out.append("%s" if ch == "?" else "%%" if ch == "%" else ch)
            i += 1
    return "".join(out)


class PostgresTx:
    """`Tx` over one psycopg connection; statements are written with `?` placeholders.

    Args:
        conn: the connection whose open transaction the statements run in.
        deferred: whether `write` holds its statement back: held statements go to the server
            together, as one simple query (bound client-side), before the next statement whose
            outcome the caller needs (a query, `execute`) or at `flush`. An error of a held
            statement then surfaces there, not where it was written. Default False.
        head: the audit chain's head, as the write transaction's lock read it. Default None.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        *,
        deferred: bool = False,
        head: tuple[int, str] | None = None,
    ) -> None:
        self._conn = conn
        self._binder = psycopg.ClientCursor(conn) if deferred else None
        self._held: list[str] = []
        # The operation begun (`begin_op`): where its held writes start while it has no
        # savepoint, and whether it has one.
        self._op_start: int | None = None
        self._op_saved = False
        self.head = head

    def flush(self) -> None:
        """Send the statements held back, in one round trip."""
        if self._sendable():
            self._conn.execute(self._take_held())  # no parameters: the simple protocol

    def _sendable(self) -> bool:
        """Whether statements are held; places the savepoint that the operation begun now
        needs, if its writes are among them."""
        if self._op_start is not None and self._op_start < len(self._held):
            # The operation's writes reach the server before it ends: only a savepoint can
            # take them back now. An operation that never sends them needs none, so a batch
            # of grants opens no subtransactions (past 64 in one transaction, every snapshot
            # on the server gets slower: the subxid cache overflows).
            self._held.insert(self._op_start, "SAVEPOINT op")
            self._op_start = None
            self._op_saved = True
        elif self._op_start is not None:
            self._op_start = 0  # nothing of its own was held: the held list starts afresh
        return bool(self._held)

    def _take_held(self) -> str:
        statements = ";".join(self._held)
        self._held.clear()
        return statements

    def _query(self, sql: str, params: Sequence[object]) -> psycopg.Cursor[Any]:
        """Run one statement after the held ones, all in one round trip; the cursor is at the
        statement's result."""
        query = convert_placeholders(sql)
        if not self._sendable():
            return self._conn.execute(query, tuple(params))
        binder = self._binder
        assert binder is not None  # statements are held only when deferred
        self._held.append(binder.mogrify(query, tuple(params)))
        binder.execute(self._take_held())
        while binder.nextset():
            pass
        return binder

    def begin_op(self) -> None:
        if self._binder is None:
            self._conn.execute("SAVEPOINT op")
            self._op_saved = True
        else:
            self._op_start = len(self._held)

    def end_op(self, keep: bool) -> None:
        if self._op_saved:
            if not keep:
                self.write("ROLLBACK TO SAVEPOINT op")
            self.write("RELEASE SAVEPOINT op")
        elif not keep and self._op_start is not None:
            del self._held[self._op_start :]  # never sent: dropping them takes them back
        self._op_start = None
        self._op_saved = False

    def read_ahead(self, reads: Sequence[ReadAhead]) -> list[tuple[Any, ...] | None] | None:
        binder = self._binder
        if binder is None:
            return None
        self.flush()
        binder.execute(
            ";".join(binder.mogrify(convert_placeholders(r.sql), r.params) for r in reads)
        )
        rows = [binder.fetchone()]
        while binder.nextset():
            rows.append(binder.fetchone())
        return rows

    def execute(self, sql: str, params: Sequence[object] = ()) -> int:
        return self._query(sql, params).rowcount

    def write(self, sql: str, params: Sequence[object] = ()) -> None:
        if self._binder is None:
            self._conn.execute(convert_placeholders(sql), tuple(params))
        else:
            self._held.append(self._binder.mogrify(convert_placeholders(sql), tuple(params)))

    def executemany(self, sql: str, params: Sequence[Sequence[object]]) -> None:
        self.flush()
        with self._conn.cursor() as cursor:
            cursor.executemany(convert_placeholders(sql), [tuple(row) for row in params])

    def fetchone(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._query(sql, params).fetchone()
        return row

    def fetchall(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._query(sql, params).fetchall()
