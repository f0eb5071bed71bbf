"""Anchors: signed (store id, record id, hash) triples of the audit chain, kept outside the store.

A server appends one to its anchor file each second the chain's head moved, and checks them
all (those in the file's last MiB) when it starts, so that it never serves a store rolled back
below what it already anchored: an older copy swapped in, the chain's tail cut, the tables
emptied, a failover that lost commits, or another store in the old one's place
(docs/design.md §8 and §11.1). `rngcoord verify --anchor` checks a chain against anchors the
same way, and against the heads clients keep in their checkpoints.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rngcoord.server.audit.chain import Chain
from rngcoord.server.storage.store import Store, StoreRolledBack, Tx

__all__ = [
    "append_anchor",
    "check_store",
    "default_anchor_file",
    "last_anchored_id",
    "lost_in_rewind",
    "read_anchor_files",
    "read_anchors",
    "rewound_range",
]


def default_anchor_file(db_url: str) -> Path | None:
    """Where a server on `db_url` keeps its anchors when `--anchor-file` is not given: beside
    an SQLite file (`PATH.anchors.jsonl`), so that a file swapped in, emptied or cut is found
    at the next start; None for PostgreSQL, whose server may run anywhere."""
    if not db_url.startswith("sqlite:///"):
        return None
    path = Path(db_url.removeprefix("sqlite:///")).absolute()
    return path.with_name(path.name + ".anchors.jsonl")


def read_anchors(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """Anchors from JSON lines ({"store_id", "id", "hash", "mac"}: a server's anchor file or
    log), or from heads as the `rngcoord-audit-head` trailer writes them
    ("STORE_ID:RECORD_ID:HASH:MAC", as clients keep them in checkpoints). Other lines are
    skipped; each anchor carries `source` ("FILE:LINE") for messages."""
    found: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        parts = line.strip().split(":")
        if len(parts) == 4 and parts[1].isdigit():
            store_id, record_id, record_hash, mac = parts
            found.append(
                {
                    "store_id": store_id,
                    "id": int(record_id),
                    "hash": record_hash,
                    "mac": mac,
                    "source": f"{source}:{number}",
                }
            )
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "fields" in data and isinstance(data["fields"], dict):
            data = data["fields"]  # a server log line (event audit_anchor)
        if isinstance(data, dict) and {"store_id", "id", "hash", "mac"} <= data.keys():
            found.append({**data, "source": f"{source}:{number}"})
    return found


def read_anchor_files(
    paths: Sequence[Path], *, missing_ok: bool, tail_bytes: int | None = None
) -> list[dict[str, Any]]:
    """The anchors of every file in `paths`, in order.

    Args:
        paths: anchor files, server logs or checkpoint heads.
        missing_ok: skip files that do not exist (a server's own anchor file does not before
            its first anchor). Default: a missing file raises.
        tail_bytes: read only the last this many bytes of each file, which hold its newest
            anchors (a server's anchor file grows by a line each second its chain moved).
            Default None: whole files.

    Raises:
        OSError: a file cannot be read.
    """
    found: list[dict[str, Any]] = []
    for path in paths:
        if missing_ok and not path.exists():
            continue
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = 0 if tail_bytes is None else max(0, size - tail_bytes)
            f.seek(start)
            lines = f.read().decode("utf-8", errors="replace").splitlines()
        if start > 0:
            lines = lines[1:]  # the first one is cut
        found += read_anchors(lines, str(path))
    return found


def append_anchor(path: Path, anchor: dict[str, Any]) -> None:
    """Append `anchor` as one JSON line, durably. O_APPEND: several processes' lines never
    interleave."""
    line = json.dumps(anchor, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def last_anchored_id(anchors: Sequence[dict[str, Any]], store_id: str) -> int:
    """The highest record id anchored for `store_id` (0 when none is)."""
    ids = [a["id"] for a in anchors if a.get("store_id") == store_id and isinstance(a["id"], int)]
    return max(ids, default=0)


def check_store(
    store: Store,
    chain: Chain,
    anchors: Sequence[dict[str, Any]],
    *,
    init: bool,
    given: Sequence[dict[str, Any]] = (),
) -> None:
    """Refuse to serve `store` unless its chain holds every anchor of it.

    The newest of the server's own anchors (`anchors`, the last one read) must be of this
    store, unless `init` (a new store on purpose, whose anchors start now). Each of this
    store's anchors, its own and those `given` (`serve --anchor`: another server's file or
    log, heads kept in checkpoints), must be in the chain with its hash, and signed by the
    chain's key when the chain is keyed; a signed anchor of a chain that is not keyed (any
    more) means its keying was stripped.

    Raises:
        StoreRolledBack: naming the anchor, the record it holds and where the chain ends.
    """
    newest = anchors[-1] if anchors else None
    if newest is not None and newest.get("store_id") != chain.store_id and not init:
        raise StoreRolledBack(
            f"the newest anchor ({newest.get('source')}) is of store {newest.get('store_id')}, "
            f"but the store at {store.location} is {chain.store_id}: another store was put in "
            "its place. Point --db at the anchored store, or start a new one on purpose with "
            "--init (add --floor-from AUDIT_EXPORT to stay above what the old one granted)"
        )
    own = [a for a in [*anchors, *given] if a.get("store_id") == chain.store_id]
    if not own:
        return
    for anchor in own:
        _check_signature(anchor, chain, store.location)
    ids = sorted({int(a["id"]) for a in own})

    def read(tx: Tx) -> tuple[int, dict[int, str], list[tuple[int, int]]]:
        head = tx.fetchone("SELECT last_id FROM audit_head WHERE id = 1")
        rewinds = [rewound_range(json.loads(d)) for (d,) in tx.fetchall(_REWINDS, ())]
        hashes: dict[int, str] = {}
        for i in range(0, len(ids), _IDS_PER_QUERY):
            chunk = ids[i : i + _IDS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            for record_id, record_hash in tx.fetchall(
                f"SELECT id, hash FROM audit WHERE id IN ({marks})", chunk
            ):
                hashes[int(record_id)] = str(record_hash)
        return (0 if head is None else int(head[0])), hashes, rewinds

    last_id, stored, rewinds = store.read(read)
    # Every anchor, not only the newest: a store that went back in time and then went on
    # (a database failover that lost commits, under servers that kept writing) has newest
    # anchors that match it; the anchors of the lost records do not. The lowest that
    # disagrees is where the chain went another way.
    for anchor in sorted(own, key=lambda a: int(a["id"])):
        record_id, record_hash = int(anchor["id"]), str(anchor["hash"])
        found = stored.get(record_id)
        if found == record_hash or lost_in_rewind(record_id, rewinds):
            continue  # in the chain, or one of the records a recorded rewind lost
        where = f"anchor {anchor.get('source')} (record {record_id}, hash {record_hash[:16]}...)"
        if found is None:
            raise StoreRolledBack(
                f"{where}: the audit chain of the store at {store.location} ends at record "
                f"{last_id}, below the anchored record: the store was rolled back (an older "
                "copy, its tail cut, its tables emptied, or a database failover to a standby "
                "that lacked the last commits) and could grant offsets again. Restore the "
                "newest copy, or recover with `rngcoord serve --init --floor-from "
                "AUDIT_EXPORT` on a new store"
            )
        raise StoreRolledBack(
            f"{where}: record {record_id} of the store at {store.location} has hash "
            f"{found[:16]}... (the chain ends at record {last_id}): the chain was rewritten "
            "from there (edited, or rolled back by a database failover that lost commits and "
            "then written on). Check it with `rngcoord verify --anchor`"
        )


_REWINDS = "SELECT detail FROM audit WHERE job = '' AND grp = '' AND kind = 'rewind'"
"""The `rewind` records (the (job, grp) index finds them among the few job-less records)."""


def rewound_range(detail: dict[str, Any]) -> tuple[int, int]:
    """The record ids (lo, hi] that a `rewind` record says the store lost: after the chain
    end it went back to, up to the newest record the server had seen committed."""
    return int(detail["chain_end"]), int(detail["lost_id"])


def lost_in_rewind(record_id: int, rewinds: Iterable[tuple[int, int]]) -> bool:
    """Whether record `record_id` is one that a rewind (`rewound_range`) says was lost: an
    anchor of it is not counted against the chain."""
    return any(lo < record_id <= hi for lo, hi in rewinds)


_IDS_PER_QUERY = 500
"""Anchored record ids looked up per query (SQLite allows 32,766 parameters a statement)."""


def _check_signature(anchor: dict[str, Any], chain: Chain, location: str) -> None:
    """Refuse an anchor signed for an unkeyed chain (its keying stripped), or one of a keyed
    chain whose signature is not this chain's key's."""
    record_id, record_hash = int(anchor["id"]), str(anchor["hash"])
    where = f"anchor {anchor.get('source')} (record {record_id}, hash {record_hash[:16]}...)"
    mac = str(anchor.get("mac", ""))
    if mac and not chain.keyed:
        raise StoreRolledBack(
            f"{where} is signed, but the audit chain of the store at {location} is not "
            "keyed: its keying was stripped, or --audit-key is missing"
        )
    if chain.keyed and not hmac.compare_digest(mac, chain.anchor_mac(record_id, record_hash)):
        raise StoreRolledBack(
            f"{where} is not signed by this chain's key: the anchor file was edited, or it "
            "belongs to another key"
        )
