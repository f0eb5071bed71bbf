"""The audit log: an append-only SHA-256 hash chain written in the state change's transaction.

Record `id` counts from 1 without gaps. Each record's hash is the hex SHA-256 of the canonical
JSON (sorted keys, no spaces) of {"id", "ts_us", "job", "group", "kind", "actor", "detail",
"prev_hash"}, where `prev_hash` is the previous record's hash ("0" * 64 for the first). The
one-row table `audit_head` holds the last id and hash; `append` reads and advances it in the
caller's transaction, so the chain stays linear under concurrent writers (on PostgreSQL the
backend locks that row when the transaction begins).

Kinds: job, group, epoch, grant, divergence, restore, leave, join_timeout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from rngcoord.server.store import Store, Tx
from rngcoord.v1.types import AuditRecord, canonical_json

__all__ = [
    "GENESIS_HASH",
    "KINDS",
    "AuditRecord",
    "append",
    "canonical_json",
    "fetch_page",
    "record_hash",
]

GENESIS_HASH = "0" * 64
"""The `prev_hash` of record 1."""

_string = encode_basestring_ascii
"""A str as `json.dumps` writes it with ensure_ascii, quotes included."""

KINDS = ("job", "group", "epoch", "grant", "divergence", "restore", "leave", "join_timeout")


def record_hash(
    *,
    id: int,
    ts_us: int,
    job: str,
    group: str,
    kind: str,
    actor: str,
    detail: dict[str, Any],
    prev_hash: str,
) -> str:
    """The hex SHA-256 that chains a record to its predecessor.

    It is the SHA-256 of `canonical_json` of {"id", "ts_us", "job", "group", "kind", "actor",
    "detail", "prev_hash"}.
    """
    return _hash(id, ts_us, job, group, kind, actor, canonical_json(detail), prev_hash)


def _hash(
    id: int,
    ts_us: int,
    job: str,
    group: str,
    kind: str,
    actor: str,
    detail_json: str,
    prev_hash: str,
) -> str:
    """`record_hash` around the detail's canonical JSON, which `append` also stores.

    The body is assembled as `canonical_json` writes it (keys in sorted order, strings escaped
    by the same encoder, integers as `repr`), so the detail is encoded once per record instead
    of twice: the grant path appends a record per lease on the store's single writer thread.
    """
    body = (
        f'{{"actor":{_string(actor)},"detail":{detail_json},"group":{_string(group)},'
        f'"id":{id},"job":{_string(job)},"kind":{_string(kind)},'
        f'"prev_hash":{_string(prev_hash)},"ts_us":{ts_us}}}'
    )
    return hashlib.sha256(body.encode("ascii")).hexdigest()


def append(
    tx: Tx,
    *,
    ts_us: int,
    job: str,
    group: str,
    kind: str,
    actor: str,
    detail: dict[str, Any],
    head: tuple[int, str] | None = None,
) -> int:
    """Append a record inside the caller's write transaction and return its id.

    Args:
        tx: the open write transaction.
        ts_us, job, group, kind, actor, detail: the record's fields (see `AuditRecord`).
        head: `audit_head`'s (last_id, last_hash) as the caller read it in this transaction
            after its last append, which saves a query (the grant path reads it in the same
            join as the group's state); None reads it here. Default None.
    """
    if head is None:
        row = tx.fetchone("SELECT last_id, last_hash FROM audit_head WHERE id = 1")
        if row is None:
            raise RuntimeError("audit_head has no row: the schema migration did not run")
        head = (int(row[0]), str(row[1]))
    record_id, prev_hash = head[0] + 1, head[1]
    detail_json = canonical_json(detail)
    digest = _hash(record_id, ts_us, job, group, kind, actor, detail_json, prev_hash)
    tx.execute(
        "INSERT INTO audit (id, ts_us, job, grp, kind, actor, detail, prev_hash, hash) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (record_id, ts_us, job, group, kind, actor, detail_json, prev_hash, digest),
    )
    tx.execute("UPDATE audit_head SET last_id = ?, last_hash = ? WHERE id = 1", (record_id, digest))
    return record_id


def records(
    store: Store,
    *,
    job: str = "",
    group: str = "",
    kinds: Sequence[str] = (),
    since_us: int = 0,
    until_us: int = 0,
    limit: int = 0,
    page: int = 500,
) -> Iterator[AuditRecord]:
    """Records passing the filters (as in `fetch_page`), oldest first, read page by page from a
    store outside any server (the `rngcoord audit` command); `limit` 0 means all."""
    after_id, left = 0, limit or math.inf
    while left > 0:
        size = int(min(page, left))
        batch = store.read(
            functools.partial(
                fetch_page,
                after_id=after_id,
                limit=size,
                job=job,
                group=group,
                kinds=kinds,
                since_us=since_us,
                until_us=until_us,
            )
        )
        yield from batch
        if len(batch) < size:
            return
        after_id = batch[-1].id
        left -= len(batch)


def fetch_page(
    tx: Tx,
    *,
    after_id: int = 0,
    limit: int = 500,
    job: str = "",
    group: str = "",
    kinds: Sequence[str] = (),
    since_us: int = 0,
    until_us: int = 0,
) -> list[AuditRecord]:
    """Up to `limit` records with id > `after_id` that pass the filters, oldest first.

    Args:
        tx: an open transaction.
        after_id: return records after this id. Default 0 (from the start).
        limit: most records returned. Default 500.
        job: only this job; "" for every job. Default "".
        group: only this group; "" for every group. Default "".
        kinds: only these kinds; empty for every kind. Default ().
        since_us: only records with ts_us >= since_us; 0 for no lower bound. Default 0.
        until_us: only records with ts_us < until_us; 0 for no upper bound. Default 0.
    """
    where = ["id > ?"]
    params: list[object] = [after_id]
    for column, value in (("job", job), ("grp", group)):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    if kinds:
        where.append(f"kind IN ({', '.join('?' for _ in kinds)})")
        params.extend(kinds)
    if since_us:
        where.append("ts_us >= ?")
        params.append(since_us)
    if until_us:
        where.append("ts_us < ?")
        params.append(until_us)
    params.append(limit)
    rows = tx.fetchall(
        "SELECT id, ts_us, job, grp, kind, actor, detail, prev_hash, hash FROM audit "
        f"WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",
        params,
    )
    return [
        AuditRecord(
            id=int(row[0]),
            ts_us=int(row[1]),
            job=row[2],
            group=row[3],
            kind=row[4],
            actor=row[5],
            detail=json.loads(row[6]),
            prev_hash=row[7],
            hash=row[8],
        )
        for row in rows
    ]
