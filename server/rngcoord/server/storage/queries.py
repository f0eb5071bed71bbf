"""The coordinator's SQL: every statement it runs, and the decoding of the rows they return.

Statements are portable (`?` placeholders; the PostgreSQL backend rewrites them) and look rows
up by primary key, so that a request costs O(1) whatever the world size: membership is kept
by (epoch, rank) in `members`, and a join barrier's state is two counters on its group's row.
uint64 values are stored biased (`rngcoord.server.storage.store.to_db`). The rules that
decide what to write live in rngcoord.server.core.coordinator and rngcoord.server.core.barrier; this
module only reads and writes rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rngcoord.server.storage.store import ReadAhead, Tx, from_db, to_db

__all__ = [
    "RESERVE_LOOKUP",
    "EpochRow",
    "GroupRow",
    "LeaseRow",
    "Member",
    "ReserveState",
    "audit_head",
    "chain_records",
    "epoch_row",
    "group_row",
    "insert_epoch",
    "insert_group",
    "insert_job",
    "insert_lease",
    "job_seed",
    "lease_count",
    "lease_row",
    "member",
    "members_of_ranks",
    "members_page",
    "reserve_ahead",
    "reserve_state",
    "restore_cursor",
]


@dataclass(frozen=True, slots=True)
class GroupRow:
    """A group: its seed, current epoch, high-water mark and join barrier."""

    seed: int
    epoch: int
    high_water: int
    barrier_size: int
    barrier_count: int


@dataclass(frozen=True, slots=True)
class EpochRow:
    """An epoch: its world size, start cursor, member-set digest, and divergence if any."""

    epoch: int
    world_size: int
    start: int
    members_digest: bytes
    diverged: str | None
    left_count: int


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """A granted lease."""

    start: int
    end: int
    size: int
    fingerprint: bytes


@dataclass(frozen=True, slots=True)
class Member:
    """What the store holds of a rank of an epoch.

    Args:
        member_id: the member id that holds the rank.
        left: whether it left the epoch.
        secret_hash: `secret_hash` of its secret; None for members of epochs formed before
            members had credentials, who must join again.
    """

    member_id: str
    left: bool
    secret_hash: bytes | None


def job_seed(tx: Tx, job: str) -> int | None:
    row = tx.fetchone("SELECT seed FROM jobs WHERE job = ?", (job,))
    return None if row is None else from_db(row[0])


def insert_job(tx: Tx, job: str, seed: int, now_us: int) -> None:
    tx.execute(
        "INSERT INTO jobs (job, seed, created_us) VALUES (?, ?, ?)", (job, to_db(seed), now_us)
    )


def group_row(tx: Tx, job: str, group: str) -> GroupRow | None:
    row = tx.fetchone(
        "SELECT seed, epoch, high_water, barrier_size, barrier_count FROM groups "
        "WHERE job = ? AND grp = ?",
        (job, group),
    )
    if row is None:
        return None
    return GroupRow(from_db(row[0]), int(row[1]), from_db(row[2]), int(row[3]), int(row[4]))


def chain_records(tx: Tx, job: str, group: str, kind: str) -> bool:
    """Whether the audit chain holds a `kind` record of (job, group): one index lookup."""
    row = tx.fetchone(
        "SELECT 1 FROM audit WHERE job = ? AND grp = ? AND kind = ? LIMIT 1", (job, group, kind)
    )
    return row is not None


def floor_of(tx: Tx, job: str, group: str) -> int:
    """Where a new group starts: the highest floor recorded for it, its job, or every job (0
    when none; floors come from `rngcoord serve --init --floor-from`)."""
    row = tx.fetchone(
        "SELECT MAX(floor) FROM floors "
        "WHERE (job = ? AND grp IN (?, '')) OR (job = '' AND grp = '')",
        (job, group),
    )
    return 0 if row is None or row[0] is None else from_db(row[0])


def insert_floor(tx: Tx, job: str, group: str, floor: int) -> None:
    """Record a floor (raising an existing one only)."""
    row = tx.fetchone("SELECT floor FROM floors WHERE job = ? AND grp = ?", (job, group))
    if row is None:
        tx.execute(
            "INSERT INTO floors (job, grp, floor) VALUES (?, ?, ?)", (job, group, to_db(floor))
        )
    elif from_db(row[0]) < floor:
        tx.execute(
            "UPDATE floors SET floor = ? WHERE job = ? AND grp = ?", (to_db(floor), job, group)
        )


def insert_group(tx: Tx, job: str, group: str, seed: int, floor: int = 0) -> GroupRow:
    """Record a new group, whose stream starts at `floor`."""
    tx.execute(
        "INSERT INTO groups (job, grp, seed, epoch, high_water, barrier_size, barrier_count) "
        "VALUES (?, ?, ?, 0, ?, 0, 0)",
        (job, group, to_db(seed), to_db(floor)),
    )
    return GroupRow(seed, 0, floor, 0, 0)


def set_barrier(tx: Tx, job: str, group: str, size: int, count: int) -> None:
    tx.execute(
        "UPDATE groups SET barrier_size = ?, barrier_count = ? WHERE job = ? AND grp = ?",
        (size if count else 0, count, job, group),
    )


def epoch_row(tx: Tx, job: str, group: str, epoch: int) -> EpochRow | None:
    row = tx.fetchone(
        "SELECT world_size, start, members_digest, diverged, left_count FROM epochs "
        "WHERE job = ? AND grp = ? AND epoch = ?",
        (job, group, epoch),
    )
    if row is None:
        return None
    return EpochRow(epoch, int(row[0]), from_db(row[1]), bytes(row[2]), row[3], int(row[4]))


def insert_epoch(
    tx: Tx,
    job: str,
    group: str,
    epoch: int,
    *,
    world_size: int,
    start: int,
    digest: bytes,
    now_us: int,
    launch: str = "",
    restart_count: int = 0,
) -> None:
    """Record a new epoch and make it the group's current one, which fences every older one."""
    tx.execute(
        "INSERT INTO epochs (job, grp, epoch, world_size, start, members_digest, diverged, "
        "created_us, launch, restart_count) VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?, ?)",
        (job, group, epoch, world_size, to_db(start), digest, now_us, launch, restart_count),
    )
    tx.execute(
        "UPDATE groups SET epoch = ?, barrier_size = 0, barrier_count = 0 "
        "WHERE job = ? AND grp = ?",
        (epoch, job, group),
    )


@dataclass(frozen=True, slots=True)
class EpochLaunch:
    """Which launch formed an epoch, and when its members were last seen active."""

    launch: str
    restart_count: int
    active_us: int


def epoch_launch(tx: Tx, job: str, group: str, epoch: int) -> EpochLaunch | None:
    """The launch of an epoch and the time of its members' latest activity that the store
    records: the epoch's forming, its latest lease and its latest attestation. Three reads by
    key (the latest lease and attestation by their primary key's order), whatever the size."""
    row = tx.fetchone(
        "SELECT launch, restart_count, created_us FROM epochs "
        "WHERE job = ? AND grp = ? AND epoch = ?",
        (job, group, epoch),
    )
    if row is None:
        return None
    active = int(row[2])
    for sql in (
        "SELECT created_us FROM leases WHERE job = ? AND grp = ? AND epoch = ? "
        "ORDER BY seq DESC LIMIT 1",
        "SELECT created_us FROM attestations WHERE job = ? AND grp = ? AND epoch = ? "
        "ORDER BY anchor_seq DESC, ops DESC LIMIT 1",
    ):
        latest = tx.fetchone(sql, (job, group, epoch))
        if latest is not None:
            active = max(active, int(latest[0]))
    return EpochLaunch(str(row[0]), int(row[1]), active)


def member_peers(tx: Tx, job: str, group: str, epoch: int, limit: int) -> list[str]:
    """Up to `limit` distinct peer addresses of an epoch's members."""
    rows = tx.fetchall(
        "SELECT DISTINCT peer FROM members WHERE job = ? AND grp = ? AND epoch = ? LIMIT ?",
        (job, group, epoch, limit),
    )
    return [str(r[0]) for r in rows]


def set_diverged(tx: Tx, job: str, group: str, epoch: int, record: str) -> None:
    tx.execute(
        "UPDATE epochs SET diverged = ? WHERE job = ? AND grp = ? AND epoch = ?",
        (record, job, group, epoch),
    )


# ------------------------------------------------------------------------------- members


def member(tx: Tx, job: str, group: str, epoch: int, rank: int) -> Member | None:
    """`rank` of the epoch, or None when the epoch has no such rank."""
    row = tx.fetchone(
        "SELECT member_id, left_us, secret_hash FROM members "
        "WHERE job = ? AND grp = ? AND epoch = ? AND rank = ?",
        (job, group, epoch, rank),
    )
    return None if row is None else _member(row[0], row[1], row[2])


def _member(member_id: str, left_us: int | None, secret: bytes | None) -> Member:
    return Member(member_id, left_us is not None, None if secret is None else bytes(secret))


def members_page(
    tx: Tx, job: str, group: str, epoch: int, from_rank: int, limit: int
) -> list[tuple[int, str, int | None]]:
    """(rank, member_id, left_us) of up to `limit` ranks from `from_rank`, in rank order."""
    rows = tx.fetchall(
        "SELECT rank, member_id, left_us FROM members WHERE job = ? AND grp = ? AND epoch = ? "
        "AND rank >= ? ORDER BY rank LIMIT ?",
        (job, group, epoch, from_rank, limit),
    )
    return [(int(r), m, None if left is None else int(left)) for r, m, left in rows]


def members_of_ranks(
    tx: Tx, job: str, group: str, epoch: int, ranks: Iterable[int]
) -> dict[int, str]:
    """{rank: member_id} of the epoch's members among `ranks` (a rank that left maps to "")."""
    wanted = sorted(set(ranks))
    found: dict[int, str] = {}
    for i in range(0, len(wanted), 500):
        chunk = wanted[i : i + 500]
        rows = tx.fetchall(
            "SELECT rank, member_id, left_us FROM members WHERE job = ? AND grp = ? AND epoch = ? "
            f"AND rank IN ({', '.join('?' for _ in chunk)})",
            (job, group, epoch, *chunk),
        )
        found.update({int(r): ("" if left is not None else m) for r, m, left in rows})
    return found


def set_left(tx: Tx, job: str, group: str, epoch: int, rank: int, now_us: int) -> None:
    """Mark `rank` as having left the epoch (the caller checked it had not)."""
    tx.execute(
        "UPDATE members SET left_us = ? WHERE job = ? AND grp = ? AND epoch = ? AND rank = ?",
        (now_us, job, group, epoch, rank),
    )
    tx.execute(
        "UPDATE epochs SET left_count = left_count + 1 WHERE job = ? AND grp = ? AND epoch = ?",
        (job, group, epoch),
    )


# ------------------------------------------------------------------------- join barrier


# ------------------------------------------------------------------------------- leases

RESERVE_LOOKUP = (
    "SELECT g.seed, g.epoch, e.diverged, m.member_id, m.left_us, m.secret_hash, "
    'l.start, l."end", l.size, l.fingerprint '
    "FROM groups g "
    "LEFT JOIN epochs e ON e.job = g.job AND e.grp = g.grp AND e.epoch = g.epoch "
    "LEFT JOIN members m ON m.job = g.job AND m.grp = g.grp AND m.epoch = g.epoch AND m.rank = ? "
    "LEFT JOIN leases l ON l.job = g.job AND l.grp = g.grp AND l.epoch = g.epoch AND l.seq = ? "
    "WHERE g.job = ? AND g.grp = ?"
)
"""Reserve's read path in one primary-key join: the group, its current epoch, the caller's
membership by rank and the lease; params (rank, seq, job, group). The caller's epoch is
compared with the current one in Python, so a stale or future epoch number never reaches the
database (nor its signed 64-bit range)."""

_RESERVE_STATE = (
    "SELECT g.seed, g.epoch, g.high_water, e.start, e.diverged, m.member_id, m.left_us, "
    'm.secret_hash, l.start, l."end", l.size, l.fingerprint, l.rank, l.actor, l.peer, '
    'p."end", r."cursor" '
    "FROM groups g "
    "LEFT JOIN epochs e ON e.job = g.job AND e.grp = g.grp AND e.epoch = g.epoch "
    "LEFT JOIN members m ON m.job = g.job AND m.grp = g.grp AND m.epoch = g.epoch AND m.rank = ? "
    "LEFT JOIN leases l ON l.job = g.job AND l.grp = g.grp AND l.epoch = g.epoch AND l.seq = ? "
    "LEFT JOIN leases p ON p.job = g.job AND p.grp = g.grp AND p.epoch = g.epoch AND p.seq = ? "
    "LEFT JOIN restores r ON r.job = g.job AND r.grp = g.grp AND r.epoch = g.epoch AND r.seq = ? "
    "WHERE g.job = ? AND g.grp = ?"
)


@dataclass(frozen=True, slots=True)
class ReserveState:
    """What a grant re-checks inside its write transaction, read in one query."""

    seed: int
    epoch: int
    high_water: int
    epoch_start: int | None
    diverged: str | None
    member: Member | None
    granted: LeaseRow | None
    granted_by: tuple[int, str, str] | None  # (rank, actor, peer) of the grant's requester
    previous_end: int | None
    restored_cursor: int | None


def reserve_ahead(job: str, group: str, rank: int, seq: int) -> ReadAhead:
    """`reserve_state`'s query, for the writer to read ahead of the grant."""
    return ReadAhead((job, group), _RESERVE_STATE, (rank, seq, seq - 1, seq, job, group))


def reserve_state(tx: Tx, job: str, group: str, rank: int, seq: int) -> ReserveState | None:
    """The grant's view of the group, the caller's membership, leases seq and seq - 1 and the
    restore of seq; None when the group does not exist."""
    ahead = reserve_ahead(job, group, rank, seq)
    row = tx.fetchone(ahead.sql, ahead.params)
    if row is None:
        return None
    (seed, epoch, high_water, start, diverged, member_id, left_us, secret) = row[:8]
    (g_start, g_end, g_size, g_fp, g_rank, g_actor, g_peer) = row[8:15]
    (prev_end, cursor) = row[15:]
    granted = None
    if g_start is not None:
        granted = LeaseRow(from_db(g_start), from_db(g_end), from_db(g_size), bytes(g_fp))
    return ReserveState(
        seed=from_db(seed),
        epoch=int(epoch),
        high_water=from_db(high_water),
        epoch_start=None if start is None else from_db(start),
        diverged=diverged,
        member=None if member_id is None else _member(member_id, left_us, secret),
        granted=granted,
        granted_by=None if g_rank is None else (int(g_rank), g_actor, g_peer),
        previous_end=None if prev_end is None else from_db(prev_end),
        restored_cursor=None if cursor is None else from_db(cursor),
    )


def lease_row(tx: Tx, job: str, group: str, epoch: int, seq: int) -> LeaseRow | None:
    row = tx.fetchone(
        'SELECT start, "end", size, fingerprint FROM leases '
        "WHERE job = ? AND grp = ? AND epoch = ? AND seq = ?",
        (job, group, epoch, seq),
    )
    if row is None:
        return None
    return LeaseRow(from_db(row[0]), from_db(row[1]), from_db(row[2]), bytes(row[3]))


def lease_count(tx: Tx, job: str, group: str, epoch: int) -> int:
    """Leases granted in the epoch: seqs run from 0 without gaps, so one past the largest."""
    row = tx.fetchone(
        "SELECT MAX(seq) FROM leases WHERE job = ? AND grp = ? AND epoch = ?", (job, group, epoch)
    )
    return 0 if row is None or row[0] is None else int(row[0]) + 1


def insert_lease(
    tx: Tx,
    job: str,
    group: str,
    epoch: int,
    seq: int,
    lease: LeaseRow,
    *,
    rank: int,
    member_id: str,
    actor: str,
    peer: str,
    now_us: int,
    high_water: int,
) -> None:
    """Record a grant (and who asked for it) and raise the group's high-water mark past it."""
    tx.write(
        'INSERT INTO leases (job, grp, epoch, seq, start, "end", size, fingerprint, rank, '
        "member_id, actor, peer, created_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            job,
            group,
            epoch,
            seq,
            to_db(lease.start),
            to_db(lease.end),
            to_db(lease.size),
            lease.fingerprint,
            rank,
            member_id,
            actor,
            peer,
            now_us,
        ),
    )
    if lease.end > high_water:
        tx.write(
            "UPDATE groups SET high_water = ? WHERE job = ? AND grp = ?",
            (to_db(lease.end), job, group),
        )


def set_high_water(tx: Tx, job: str, group: str, high_water: int) -> None:
    """Move the group's high-water mark up to `high_water` (a failover gap, never down)."""
    tx.write(
        "UPDATE groups SET high_water = ? WHERE job = ? AND grp = ? AND high_water < ?",
        (to_db(high_water), job, group, to_db(high_water)),
    )


def restore_cursor(tx: Tx, job: str, group: str, epoch: int, seq: int) -> int | None:
    row = tx.fetchone(
        'SELECT "cursor" FROM restores WHERE job = ? AND grp = ? AND epoch = ? AND seq = ?',
        (job, group, epoch, seq),
    )
    return None if row is None else from_db(row[0])


def insert_restore(
    tx: Tx, job: str, group: str, epoch: int, seq: int, cursor: int, now_us: int
) -> None:
    tx.execute(
        'INSERT INTO restores (job, grp, epoch, seq, "cursor", created_us) '
        "VALUES (?, ?, ?, ?, ?, ?)",
        (job, group, epoch, seq, to_db(cursor), now_us),
    )


def restore_tally(tx: Tx, job: str, group: str, epoch: int, seq: int) -> tuple[int, int] | None:
    """(cursor, votes) of the Restore of `seq` being voted on, or None when nobody asked yet."""
    row = tx.fetchone(
        'SELECT "cursor", votes FROM restore_tallies '
        "WHERE job = ? AND grp = ? AND epoch = ? AND seq = ?",
        (job, group, epoch, seq),
    )
    return None if row is None else (from_db(row[0]), int(row[1]))


def add_restore_vote(
    tx: Tx,
    job: str,
    group: str,
    epoch: int,
    seq: int,
    *,
    rank: int,
    cursor: int,
    member_id: str,
    actor: str,
    now_us: int,
) -> int:
    """Record `rank`'s vote for restoring `seq` to `cursor` (the caller checked the tally's
    cursor matches); return the votes so far. A rank voting again counts once."""
    if tx.fetchone(
        "SELECT 1 FROM restore_votes WHERE job = ? AND grp = ? AND epoch = ? AND seq = ? "
        "AND rank = ?",
        (job, group, epoch, seq, rank),
    ):
        tally = restore_tally(tx, job, group, epoch, seq)
        assert tally is not None
        return tally[1]
    tx.execute(
        'INSERT INTO restore_votes (job, grp, epoch, seq, rank, "cursor", member_id, actor, '
        "created_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (job, group, epoch, seq, rank, to_db(cursor), member_id, actor, now_us),
    )
    if tx.execute(
        "UPDATE restore_tallies SET votes = votes + 1 "
        "WHERE job = ? AND grp = ? AND epoch = ? AND seq = ?",
        (job, group, epoch, seq),
    ):
        tally = restore_tally(tx, job, group, epoch, seq)
        assert tally is not None
        return tally[1]
    tx.execute(
        'INSERT INTO restore_tallies (job, grp, epoch, seq, "cursor", votes) '
        "VALUES (?, ?, ?, ?, ?, 1)",
        (job, group, epoch, seq, to_db(cursor)),
    )
    return 1


def restore_voters(tx: Tx, job: str, group: str, epoch: int, seq: int, *, limit: int) -> list[str]:
    """ "rank:actor" of up to `limit` voters for restoring `seq`, in rank order."""
    rows = tx.fetchall(
        "SELECT rank, actor FROM restore_votes WHERE job = ? AND grp = ? AND epoch = ? "
        "AND seq = ? ORDER BY rank LIMIT ?",
        (job, group, epoch, seq, limit),
    )
    return [f"{int(r)}:{a}" for r, a in rows]


def restore_missing_voters(
    tx: Tx, *, job: str, group: str, epoch: int, seq: int, limit: int
) -> list[int]:
    """Up to `limit` current members of the epoch (not left) that have not voted on `seq`."""
    rows = tx.fetchall(
        "SELECT m.rank FROM members m WHERE m.job = ? AND m.grp = ? AND m.epoch = ? "
        "AND m.left_us IS NULL AND NOT EXISTS (SELECT 1 FROM restore_votes v "
        "WHERE v.job = m.job AND v.grp = m.grp AND v.epoch = m.epoch AND v.seq = ? "
        "AND v.rank = m.rank) ORDER BY m.rank LIMIT ?",
        (job, group, epoch, seq, limit),
    )
    return [int(r[0]) for r in rows]


def audit_head(tx: Tx) -> tuple[int, str]:
    """(last id, last hash) of the audit chain."""
    row = tx.fetchone("SELECT last_id, last_hash FROM audit_head WHERE id = 1")
    if row is None:
        raise RuntimeError("audit_head has no row: the schema migration did not run")
    return int(row[0]), str(row[1])


def audit_feed(
    tx: Tx, after_id: int, kinds: Sequence[str], limit: int
) -> list[tuple[int, str, str, str, str]]:
    """(id, kind, job, group, detail JSON) of the records after `after_id` of `kinds`: the
    change feed that keeps every coordinator process's cache and barrier current."""
    rows = tx.fetchall(
        "SELECT id, kind, job, grp, detail FROM audit WHERE id > ? "
        f"AND kind IN ({', '.join('?' for _ in kinds)}) ORDER BY id LIMIT ?",
        (after_id, *kinds, limit),
    )
    return [(int(i), k, j, g, d) for i, k, j, g, d in rows]


def insert_resize(
    tx: Tx, job: str, group: str, epoch: int, saved_group: str, saved_cursor: int, now_us: int
) -> bool:
    """Record that epoch `epoch` of `group` could not continue `saved_group`'s stream; False
    when that was recorded already."""
    return (
        tx.execute(
            "INSERT INTO resizes (job, grp, epoch, saved_grp, saved_cursor, created_us) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (job, grp, epoch, saved_grp) DO NOTHING",
            (job, group, epoch, saved_group, to_db(saved_cursor), now_us),
        )
        > 0
    )


def resize_count(tx: Tx, job: str, group: str, epoch: int) -> int:
    """How many resizes epoch `epoch` of `group` records (a primary-key prefix range)."""
    row = tx.fetchone(
        "SELECT COUNT(*) FROM resizes WHERE job = ? AND grp = ? AND epoch = ?",
        (job, group, epoch),
    )
    return 0 if row is None else int(row[0])


def has_resize(tx: Tx, job: str, group: str, epoch: int, saved_group: str) -> bool:
    """Whether epoch `epoch` of `group` records a resize from `saved_group`."""
    return (
        tx.fetchone(
            "SELECT 1 FROM resizes WHERE job = ? AND grp = ? AND epoch = ? AND saved_grp = ?",
            (job, group, epoch, saved_group),
        )
        is not None
    )


def insert_quorum(
    tx: Tx,
    job: str,
    group: str,
    epoch: int,
    quorum_id: int,
    *,
    step: int,
    participants: int,
    healed_from: str,
    now_us: int,
) -> bool:
    """Record that the replica of `group` took part in torchft quorum `quorum_id` in epoch
    `epoch`; False when that was recorded already."""
    return (
        tx.execute(
            "INSERT INTO quorums (job, grp, epoch, quorum_id, step, participants, healed_from, "
            "created_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (job, grp, epoch, quorum_id) DO NOTHING",
            (job, group, epoch, to_db(quorum_id), step, participants, healed_from, now_us),
        )
        > 0
    )
