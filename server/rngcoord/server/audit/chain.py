"""The audit log: an append-only hash chain, keyed, written in the state change's transaction.

Record `id` counts from 1 without gaps. Each record's hash covers the canonical JSON (sorted
keys, no spaces) of {"id", "ts_us", "job", "group", "kind", "actor", "detail", "prev_hash"},
where `prev_hash` is the previous record's hash ("0" * 64 for the first):

- from record `keyed_from` on, it is the hex HMAC-SHA256 of that body under the server's audit
  key (`rngcoord serve --audit-key FILE`), so nobody without the key can rewrite a record and
  rehash the chain after it, nor append a forged one;
- before it (a store whose chain was unkeyed), the hex SHA-256 of the body.

The store's `meta` table records `audit_key_id` (the first 16 hex digits of the key's SHA-256,
never the key) and `keyed_from`. The one-row table `audit_head` holds the last id and hash;
`Chain.append` reads and advances it in the caller's transaction, so the chain stays linear
under concurrent writers (on PostgreSQL the backend locks that row when the transaction
begins).

An *anchor* is a (store id, record id, hash) triple with its MAC under the key: servers write
them outside the store (an append-only file, the log, every JoinGroup and Reserve reply) and
`rngcoord verify --anchor` checks that the chain still holds what they saw: a truncated or
rewritten chain cannot match an anchor taken before.

Kinds: job, group, epoch, grant, divergence, restore, leave, join_timeout, key, floor.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from rngcoord.server.errors import InvalidArgument
from rngcoord.server.storage.store import Store, Tx
from rngcoord.v1.rules import RuleViolation, check_name
from rngcoord.v1.types import AuditRecord, canonical_json

__all__ = [
    "GENESIS_HASH",
    "KINDS",
    "AuditRecord",
    "Chain",
    "Pages",
    "anchor_message",
    "canonical_json",
    "fetch_page",
    "key_id",
    "load_key",
    "open_chain",
    "records",
]

GENESIS_HASH = "0" * 64
"""The `prev_hash` of record 1."""

_string = encode_basestring_ascii
"""A str as `json.dumps` writes it with ensure_ascii, quotes included."""

KINDS = (
    "job",
    "group",
    "epoch",
    "grant",
    "divergence",
    "restore",
    "leave",
    "join_timeout",
    "key",
    "floor",
    "resize",
    "failover-gap",
    "rewind",
    "quorum",
)


def key_id(key: bytes) -> str:
    """A key's public name: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:16]


def load_key(path: str, *, create: bool = False) -> bytes:
    """The audit key in the file at `path` (64 hex digits); with `create`, a fresh random one
    is written there (mode 0600) when the file does not exist.

    Raises:
        OSError: the file cannot be read or written.
        ValueError: the file does not hold a key; the message never shows its contents.
    """
    if create and not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    with open(path, encoding="ascii", errors="replace") as f:
        text = f.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(
            f"{path} does not hold an audit key: it must be one line of hex digits (at least 32); "
            "`rngcoord serve --init --audit-key FILE` writes a fresh one"
        )
    return key


def anchor_message(store_id: str, record_id: int, record_hash: str) -> bytes:
    """What an anchor's MAC covers."""
    return f"rngcoord/v1/anchor:{store_id}:{record_id}:{record_hash}".encode()


@dataclass(frozen=True)
class Chain:
    """How the records of one store are hashed, and anchors signed.

    Args:
        store_id: the store's id.
        key: the audit key, or None for an unkeyed chain. Default None.
        keyed_from: the first record hashed under the key. Default 0.
    """

    store_id: str
    key: bytes | None = None
    keyed_from: int = 0

    @property
    def keyed(self) -> bool:
        return self.key is not None

    def digest(
        self,
        id: int,
        ts_us: int,
        job: str,
        group: str,
        kind: str,
        actor: str,
        detail_json: str,
        prev_hash: str,
    ) -> str:
        """A record's hash, from the detail's canonical JSON (which `append` also stores).

        The body is assembled as `canonical_json` writes it (keys in sorted order, strings
        escaped by the same encoder, integers as `repr`), so the detail is encoded once per
        record instead of twice: the grant path appends a record per lease on the store's
        single writer thread.
        """
        body = (
            f'{{"actor":{_string(actor)},"detail":{detail_json},"group":{_string(group)},'
            f'"id":{id},"job":{_string(job)},"kind":{_string(kind)},'
            f'"prev_hash":{_string(prev_hash)},"ts_us":{ts_us}}}'
        ).encode("ascii")
        if self.key is not None and id >= self.keyed_from > 0:
            return hmac.new(self.key, body, hashlib.sha256).hexdigest()
        return hashlib.sha256(body).hexdigest()

    def record_hash(self, record: AuditRecord) -> str:
        """What `record`'s hash must be."""
        return self.digest(
            record.id,
            record.ts_us,
            record.job,
            record.group,
            record.kind,
            record.actor,
            canonical_json(record.detail),
            record.prev_hash,
        )

    def anchor_mac(self, record_id: int, record_hash: str) -> str:
        """The MAC of an anchor at (record_id, record_hash); "" when the chain is unkeyed."""
        if self.key is None:
            return ""
        message = anchor_message(self.store_id, record_id, record_hash)
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def append(
        self,
        tx: Tx,
        *,
        ts_us: int,
        job: str,
        group: str,
        kind: str,
        actor: str,
        detail: dict[str, Any],
    ) -> tuple[int, str]:
        """Append a record inside the caller's write transaction; return its (id, hash), the
        chain's new head, which `tx.head` then holds (so the next append reads nothing).

        Args:
            tx: the open write transaction.
            ts_us, job, group, kind, actor, detail: the record's fields (see `AuditRecord`).
        """
        head = tx.head
        if head is None:
            row = tx.fetchone("SELECT last_id, last_hash FROM audit_head WHERE id = 1")
            if row is None:
                raise RuntimeError("audit_head has no row: the schema migration did not run")
            head = (int(row[0]), str(row[1]))
        record_id, prev_hash = head[0] + 1, head[1]
        detail_json = canonical_json(detail)
        digest = self.digest(record_id, ts_us, job, group, kind, actor, detail_json, prev_hash)
        tx.write(
            "INSERT INTO audit (id, ts_us, job, grp, kind, actor, detail, prev_hash, hash) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (record_id, ts_us, job, group, kind, actor, detail_json, prev_hash, digest),
        )
        tx.write(
            "UPDATE audit_head SET last_id = ?, last_hash = ? WHERE id = 1", (record_id, digest)
        )
        tx.head = (record_id, digest)
        return record_id, digest


def read_meta(tx: Tx) -> dict[str, str]:
    """The store's `meta` table."""
    return {str(name): str(value) for name, value in tx.fetchall("SELECT name, value FROM meta")}


def keying_problem(tx: Tx, chain: Chain) -> str | None:
    """Why the keyed part of the chain disagrees with `chain`'s key, or None.

    The keying state in `meta` (key id, `keyed_from`) is not trusted by itself: record
    `keyed_from` must be the chain's `key` record, naming this key and MACed under it. Its MAC
    covers its id and its `prev_hash`, so whoever lacks the key can neither move `keyed_from`
    past records they rewrote (there is no other MACed `key` record to point at) nor rewrite
    the unkeyed records before it.
    """
    if chain.key is None:
        return None
    head = tx.fetchone("SELECT last_id FROM audit_head WHERE id = 1")
    last_id = 0 if head is None else int(head[0])
    first = chain.keyed_from
    if not 1 <= first <= last_id:
        return (
            f"meta says the chain is keyed from record {first}, but it ends at record "
            f"{last_id}: its keying state was edited"
        )
    page = fetch_page(tx, after_id=first - 1, limit=1)
    record = page[0] if page and page[0].id == first else None
    wanted = key_id(chain.key)
    if record is None or record.kind != "key" or record.detail.get("key_id") != wanted:
        return (
            f"record {first}, where meta says keying begins, is not the key record of key id "
            f"{wanted}: the keying state was edited"
        )
    if not hmac.compare_digest(chain.record_hash(record), record.hash):
        return f"record {first}, the key record, is not MACed under this key: it was forged"
    return None


def open_chain(
    store: Store, key: bytes | None, *, now_us: int, actor: str, init: bool = False
) -> Chain:
    """The chain of `store`, keyed by `key`: a store whose chain is unkeyed starts keying it
    from its next record (appending a `key` record) when the chain is empty or `init` says so;
    a keyed one needs its own key, and keying state that agrees with its key record.

    Raises:
        ValueError: the store's chain is keyed and `key` is missing or another key; or `key`
            is given for a non-empty unkeyed chain without `init` (its keying may have been
            stripped); or the keying state disagrees with the chain (`keying_problem`).
    """
    meta = store.read(read_meta)
    stored = meta.get("audit_key_id", "")
    if key is None:
        if stored:
            raise ValueError(
                f"the audit chain of the store at {store.location} is keyed (key id {stored}): "
                "pass --audit-key with that key (RNGCOORD_AUDIT_KEY)"
            )
        return Chain(store.store_id)
    wanted = key_id(key)
    if stored and stored != wanted:
        raise ValueError(
            f"the audit chain of the store at {store.location} is keyed with key id {stored}, "
            f"but --audit-key holds key id {wanted}: pass the store's key"
        )
    if stored:
        try:
            chain = Chain(store.store_id, key, int(meta.get("keyed_from", "0")))
        except ValueError:
            chain = Chain(store.store_id, key, 0)
        problem = store.read(lambda tx: keying_problem(tx, chain))
        if problem is not None:
            raise ValueError(
                f"the audit chain of the store at {store.location} cannot be trusted: {problem}"
                ". Check it with `rngcoord verify --audit-key KEY --anchor ANCHORS`; do not "
                "serve it"
            )
        return chain
    head = store.read(lambda tx: tx.fetchone("SELECT last_id FROM audit_head WHERE id = 1"))
    if head is not None and int(head[0]) > 0 and not init:
        raise ValueError(
            f"the audit chain of the store at {store.location} is not keyed, but --audit-key "
            f"was given: if the chain was never keyed, start keying it from its next record "
            "on purpose with --init; if it was keyed, its keying was stripped (records rehashed "
            "without the key): check it with `rngcoord verify --audit-key KEY --anchor ANCHORS`"
        )

    def adopt(tx: Tx) -> int:
        current = read_meta(tx)
        if current.get("audit_key_id"):  # another worker or replica adopted it meanwhile
            return int(current["keyed_from"])
        row = tx.fetchone("SELECT last_id FROM audit_head WHERE id = 1")
        last_id = 0 if row is None else int(row[0])
        first = int(last_id) + 1
        tx.execute("UPDATE meta SET value = ? WHERE name = 'audit_key_id'", (wanted,))
        tx.execute("UPDATE meta SET value = ? WHERE name = 'keyed_from'", (str(first),))
        Chain(store.store_id, key, first).append(
            tx, ts_us=now_us, job="", group="", kind="key", actor=actor, detail={"key_id": wanted}
        )
        return first

    return Chain(store.store_id, key, store.write(adopt))


@dataclass
class Pages:
    """Keyset paging over the chain, oldest first: the query of the next page, advanced by
    what each page returned. One home for `records` (a store read outside any server) and
    the server's ListAudit stream.

    Args:
        filters: `fetch_page`'s filters (job, group, kinds, since_us, until_us).
        limit: the most records in all; 0 for every one.
        page: the most records per page.
    """

    filters: dict[str, Any]
    limit: int
    page: int
    after_id: int = 0
    taken: int = 0
    done: bool = False

    @classmethod
    def checked(
        cls,
        *,
        job: str = "",
        group: str = "",
        kinds: Sequence[str] = (),
        since_us: int = 0,
        until_us: int = 0,
        limit: int = 0,
        page: int = 500,
    ) -> Pages:
        """Pages of the records that pass the filters, checked as a ListAudit request is.

        Raises:
            InvalidArgument: a malformed name, an unknown kind or a negative limit.
        """
        try:
            if job:
                check_name("job", job)
            if group:
                check_name("group", group)
        except RuleViolation as violation:
            raise InvalidArgument.of(violation) from None
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            shown = ", ".join(repr(k[:32]) for k in unknown[:3])
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise InvalidArgument(
                f"unknown audit kinds {shown}{more}: the kinds are {', '.join(KINDS)}",
                field="kinds",
                value=unknown[0][:32],
            )
        if limit < 0:
            raise InvalidArgument(
                f"invalid limit {limit!r}: it must be 0 (no limit) or more",
                field="limit",
                value=limit,
            )
        filters = {
            "job": job,
            "group": group,
            "kinds": tuple(sorted(set(kinds))),
            "since_us": since_us,
            "until_us": until_us,
        }
        return cls(filters, limit, page)

    def next_query(self) -> Callable[[Tx], list[AuditRecord]] | None:
        """The read of the next page, or None when there is none."""
        left = self.limit - self.taken if self.limit else self.page
        if self.done or left <= 0:
            return None
        return functools.partial(
            fetch_page, after_id=self.after_id, limit=min(self.page, left), **self.filters
        )

    def took(self, batch: Sequence[AuditRecord]) -> None:
        """Advance past `batch`, the page the last query returned."""
        left = self.limit - self.taken if self.limit else self.page
        if len(batch) < min(self.page, left):
            self.done = True
        if batch:
            self.after_id = batch[-1].id
            self.taken += len(batch)


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
    pages = Pages.checked(
        job=job,
        group=group,
        kinds=kinds,
        since_us=since_us,
        until_us=until_us,
        limit=limit,
        page=page,
    )
    while (query := pages.next_query()) is not None:
        batch = store.read(query)
        yield from batch
        pages.took(batch)


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
    newest: bool = False,
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
        newest: the newest `limit` of them (a bounded tail) instead of the oldest. Default
            False.
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
        f"WHERE {' AND '.join(where)} ORDER BY id {'DESC' if newest else 'ASC'} LIMIT ?",
        params,
    )
    if newest:
        rows = rows[::-1]
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
