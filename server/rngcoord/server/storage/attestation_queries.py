"""The SQL of the op-sequence checks: the first attestation of each op count, the offsets an
anchor covers, and what each rank sent at a divergence's point.

The rules live in rngcoord.server.core.attestations and rngcoord.server.core.divergences; the
statements are portable, as those of rngcoord.server.storage.queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rngcoord.server.storage.store import Tx, from_db

__all__ = [
    "Attestation",
    "attestation",
    "covered_offsets",
    "insert_attestation",
    "insert_side",
    "sides",
]


@dataclass(frozen=True, slots=True)
class Attestation:
    """The first attestation of an op count: what was sent, and by whom."""

    fingerprint: bytes
    rank: int
    actor: str
    peer: str


def attestation(
    tx: Tx, job: str, group: str, epoch: int, anchor_seq: int, ops: int
) -> Attestation | None:
    """The first attestation of the key, or None."""
    row = tx.fetchone(
        "SELECT fingerprint, rank, actor, peer FROM attestations "
        "WHERE job = ? AND grp = ? AND epoch = ? AND anchor_seq = ? AND ops = ?",
        (job, group, epoch, anchor_seq, ops),
    )
    return None if row is None else Attestation(bytes(row[0]), int(row[1]), row[2], row[3])


def insert_attestation(
    tx: Tx,
    job: str,
    group: str,
    epoch: int,
    anchor_seq: int,
    ops: int,
    first: Attestation,
    now_us: int,
) -> None:
    tx.write(
        "INSERT INTO attestations "
        "(job, grp, epoch, anchor_seq, ops, fingerprint, rank, actor, peer, created_us) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            job,
            group,
            epoch,
            anchor_seq,
            ops,
            first.fingerprint,
            first.rank,
            first.actor,
            first.peer,
            now_us,
        ),
    )


def covered_offsets(tx: Tx, job: str, group: str, epoch: int, anchor_seq: int) -> int:
    """Offsets granted in the epoch from the start of lease `anchor_seq` to the end of its
    last lease: what the ops since that anchor can have drawn from (0 with no lease)."""
    row = tx.fetchone(
        'SELECT a.start, MAX(l."end") FROM leases a JOIN leases l ON l.job = a.job '
        "AND l.grp = a.grp AND l.epoch = a.epoch AND l.seq >= a.seq "
        "WHERE a.job = ? AND a.grp = ? AND a.epoch = ? AND a.seq = ? GROUP BY a.start",
        (job, group, epoch, anchor_seq),
    )
    if row is None or row[0] is None:
        return 0
    return from_db(row[1]) - from_db(row[0])


def insert_side(
    tx: Tx, job: str, group: str, epoch: int, at: str, side: Any, first: bool, now_us: int
) -> bool:
    """Keep what a rank sent at a divergence's point (a `divergences.Side`); False when that
    rank was heard there already."""
    return (
        tx.execute(
            "INSERT INTO divergence_sides (job, grp, epoch, at, rank, side, first, actor, peer, "
            "created_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (job, grp, epoch, at, rank) DO NOTHING",
            (
                job,
                group,
                epoch,
                at,
                side.rank,
                side.sent,
                1 if first else 0,
                side.actor,
                side.peer,
                now_us,
            ),
        )
        > 0
    )


def sides(tx: Tx, job: str, group: str, epoch: int, at: str) -> list[tuple[int, str, bool]]:
    """(rank, what it sent, whether it spoke first) of every rank heard at a divergence's
    point, in rank order."""
    rows = tx.fetchall(
        "SELECT rank, side, first FROM divergence_sides "
        "WHERE job = ? AND grp = ? AND epoch = ? AND at = ? ORDER BY rank",
        (job, group, epoch, at),
    )
    return [(int(r), str(sent), bool(first)) for r, sent, first in rows]
