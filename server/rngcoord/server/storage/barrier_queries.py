"""The join barrier's SQL: the ranks that wait to join a group's next epoch (`pending_joins`).

The rules that decide what to write live in rngcoord.server.core.barrier; the statements are
portable, as those of rngcoord.server.storage.queries, and look rows up by primary key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rngcoord.server.storage.store import Tx

__all__ = [
    "WITHDRAWN",
    "PendingRow",
    "first_pending_us",
    "missing_ranks",
    "pending_members",
    "pending_of_ranks",
    "pending_ranks",
    "promote_pending",
    "sweep_expired",
    "upsert_pending",
    "withdraw_pending",
]


@dataclass(frozen=True, slots=True)
class PendingRow:
    """A rank waiting in a join barrier."""

    rank: int
    member_id: str
    world_size: int
    expires_us: int
    secret_hash: bytes | None


WITHDRAWN = 0
"""`expires_us` of a pending join whose caller gave up: it no longer counts for the barrier,
but until the group's next batch clears it, peers that time out still see that the rank came,
so they name only the ranks that never did."""


def sweep_expired(tx: Tx, job: str, group: str, now_us: int) -> int:
    """Delete the group's pending joins that expired by `now_us`, and the withdrawn ones;
    return how many of the first kind (the withdrawn ones were already uncounted)."""
    expired = tx.execute(
        "DELETE FROM pending_joins WHERE job = ? AND grp = ? AND expires_us <= ? "
        "AND expires_us <> ?",
        (job, group, now_us, WITHDRAWN),
    )
    tx.execute(
        "DELETE FROM pending_joins WHERE job = ? AND grp = ? AND expires_us = ?",
        (job, group, WITHDRAWN),
    )
    return expired


def pending_of_ranks(tx: Tx, job: str, group: str, ranks: Sequence[int]) -> dict[int, PendingRow]:
    """The group's pending (not withdrawn) joins of `ranks`, by rank."""
    found: dict[int, PendingRow] = {}
    wanted = sorted(set(ranks))
    for i in range(0, len(wanted), 500):
        chunk = wanted[i : i + 500]
        rows = tx.fetchall(
            "SELECT rank, member_id, world_size, expires_us, secret_hash FROM pending_joins "
            f"WHERE job = ? AND grp = ? AND expires_us <> ? "
            f"AND rank IN ({', '.join('?' for _ in chunk)})",
            (job, group, WITHDRAWN, *chunk),
        )
        for rank, member_id, world_size, expires_us, secret in rows:
            found[int(rank)] = PendingRow(
                int(rank),
                member_id,
                int(world_size),
                int(expires_us),
                None if secret is None else bytes(secret),
            )
    return found


def pending_ranks(tx: Tx, job: str, group: str, limit: int) -> list[int]:
    """Up to `limit` ranks waiting in the group's barrier, in rank order (for messages)."""
    rows = tx.fetchall(
        "SELECT rank FROM pending_joins WHERE job = ? AND grp = ? AND expires_us <> ? "
        "ORDER BY rank LIMIT ?",
        (job, group, WITHDRAWN, limit),
    )
    return [int(r) for (r,) in rows]


def missing_ranks(
    tx: Tx, job: str, group: str, world_size: int, limit: int
) -> tuple[list[int], int]:
    """The first `limit` ranks below `world_size` that never came (no pending join, withdrawn
    ones counting as come), in rank order, and how many never came in all.

    It reads every pending rank of the group: a timeout's cost, once per timed-out join.
    """
    came = {
        int(r)
        for (r,) in tx.fetchall(
            "SELECT rank FROM pending_joins WHERE job = ? AND grp = ?", (job, group)
        )
        if int(r) < world_size
    }
    first: list[int] = []
    for rank in range(world_size):
        if len(first) == limit:
            break
        if rank not in came:
            first.append(rank)
    return first, world_size - len(came)


def upsert_pending(tx: Tx, job: str, group: str, rows: Sequence[tuple[object, ...]]) -> None:
    """Insert or replace pending joins: rows of (rank, member_id, world_size, expires_us,
    joined_us, peer, secret_hash)."""
    tx.executemany(
        "INSERT INTO pending_joins (job, grp, rank, member_id, world_size, expires_us, joined_us, "
        "peer, secret_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job, grp, rank) DO "
        "UPDATE SET member_id = excluded.member_id, world_size = excluded.world_size, "
        "expires_us = excluded.expires_us, joined_us = excluded.joined_us, peer = excluded.peer, "
        "secret_hash = excluded.secret_hash",
        [(job, group, *row) for row in rows],
    )


def withdraw_pending(tx: Tx, job: str, group: str, rank: int, member_id: str) -> int:
    """Withdraw `rank`'s pending join if `member_id` holds it; return 1 if it did, else 0."""
    return tx.execute(
        "UPDATE pending_joins SET expires_us = ? WHERE job = ? AND grp = ? AND rank = ? "
        "AND member_id = ? AND expires_us <> ?",
        (WITHDRAWN, job, group, rank, member_id, WITHDRAWN),
    )


def pending_members(tx: Tx, job: str, group: str) -> list[tuple[int, str]]:
    """(rank, member_id) of every pending (not withdrawn) join of the group, in rank order."""
    rows = tx.fetchall(
        "SELECT rank, member_id FROM pending_joins WHERE job = ? AND grp = ? AND expires_us <> ? "
        "ORDER BY rank",
        (job, group, WITHDRAWN),
    )
    return [(int(r), m) for r, m in rows]


def first_pending_us(tx: Tx, job: str, group: str) -> int | None:
    """When the earliest pending (not withdrawn) join of the group arrived, or None."""
    row = tx.fetchone(
        "SELECT MIN(joined_us) FROM pending_joins WHERE job = ? AND grp = ? AND expires_us <> ?",
        (job, group, WITHDRAWN),
    )
    return None if row is None or row[0] is None else int(row[0])


def promote_pending(tx: Tx, job: str, group: str, epoch: int) -> None:
    """Make the group's pending joins the members of `epoch`, and clear them all."""
    tx.execute(
        "INSERT INTO members (job, grp, epoch, rank, member_id, joined_us, left_us, peer, "
        "secret_hash) SELECT job, grp, ?, rank, member_id, joined_us, NULL, peer, secret_hash "
        "FROM pending_joins "
        "WHERE job = ? AND grp = ? AND expires_us <> ?",
        (epoch, job, group, WITHDRAWN),
    )
    tx.execute("DELETE FROM pending_joins WHERE job = ? AND grp = ?", (job, group))
