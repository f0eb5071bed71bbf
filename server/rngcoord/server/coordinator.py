"""The coordinator's domain logic, free of any transport: joins, leases, leaves, restores.

`Coordinator` validates every request, answers idempotent repeats from a read-only snapshot
(no write), and makes every state change in one group-committed write operation that also
appends its audit record. Each write operation re-checks, inside its transaction, everything
the read path checked, so concurrent requests and other replicas on the same store cannot
slip between the check and the change. Refusals are `CoordinatorError`s; the servicer maps
them to gRPC statuses.

Reserve is the hot path, so each of its two steps is one joined primary-key query: a hit reads
the group, its current epoch and the lease at once (no write, and nothing cached but the
decoding of membership lists, because another replica may form a new epoch at any time); a
grant re-reads that state, the previous lease, any restore and the audit head in one query
inside its write, then makes its four writes.

The join barrier keeps its waiting outside the store: a join writes a pending row, and when
its epoch has not formed yet it waits on a condition that this coordinator notifies whenever
one of its joins forms an epoch, and polls the store every 50 ms for epochs formed through
other replicas. (Waking on epoch formation rather than on every commit keeps a barrier of N
ranks from re-reading the store N times per join.)
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rngcoord.server import audit
from rngcoord.server.audit import AuditRecord
from rngcoord.server.errors import (
    Divergence,
    FailedPrecondition,
    InvalidArgument,
    JoinTimeout,
    NotFound,
    NotMember,
    ResourceExhausted,
    StaleEpoch,
)
from rngcoord.server.seeds import draw_job_seed, group_seed
from rngcoord.server.store import Store, Tx, from_db, row_reader, to_db
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import (
    MAX_OFFSET,
    RuleViolation,
    check_cursor,
    check_fingerprint,
    check_member_id,
    check_name,
    check_rank,
    check_seq,
    check_size,
    check_u64,
    check_world_size,
)

__all__ = [
    "Coordinator",
    "GroupInfo",
    "JoinResult",
    "ReserveResult",
    "RestoreResult",
    "now_us",
]

_POLL_S = 0.05
"""How often a waiting join re-reads the store, for epochs formed through other replicas."""

_AUDIT_PAGE = 500
_MAX_LISTED_RANKS = 16
_MEMBERS_CACHE_CHARS = 8 << 20
"""Membership text kept parsed: four lists of 65536 ranks, or thousands of small ones."""

# Reserve's two statements. Each gathers in one primary-key join what the checks need, so a
# hit costs one query and a grant one query before its writes: on SQLite every statement
# releases and retakes the GIL, which under a full gRPC thread pool means a wait behind other
# threads, and on PostgreSQL every statement is a network round trip. The epoch and lease rows
# are joined on the group's current epoch: the caller's epoch is compared with it in Python,
# so a stale or future epoch number never reaches the database (nor its signed 64-bit range).
_RESERVE_LOOKUP = (
    'SELECT g.seed, g.epoch, e.members, e.diverged, l.start, l."end", l.size, l.fingerprint '
    "FROM groups g "
    "LEFT JOIN epochs e ON e.job = g.job AND e.grp = g.grp AND e.epoch = g.epoch "
    "LEFT JOIN leases l ON l.job = g.job AND l.grp = g.grp AND l.epoch = g.epoch AND l.seq = ? "
    "WHERE g.job = ? AND g.grp = ?"
)
"""The read path: group, current epoch and lease (seq); params (seq, job, group)."""

_RESERVE_STATE = (
    "SELECT g.seed, g.epoch, g.high_water, e.start, e.members, e.diverged, "
    'l.start, l."end", l.size, l.fingerprint, l.rank, p."end", r."cursor", '
    "h.last_id, h.last_hash "
    "FROM groups g JOIN audit_head h ON h.id = 1 "
    "LEFT JOIN epochs e ON e.job = g.job AND e.grp = g.grp AND e.epoch = g.epoch "
    "LEFT JOIN leases l ON l.job = g.job AND l.grp = g.grp AND l.epoch = g.epoch AND l.seq = ? "
    "LEFT JOIN leases p ON p.job = g.job AND p.grp = g.grp AND p.epoch = g.epoch AND p.seq = ? "
    "LEFT JOIN restores r ON r.job = g.job AND r.grp = g.grp AND r.epoch = g.epoch AND r.seq = ? "
    "WHERE g.job = ? AND g.grp = ?"
)
"""The grant's re-check inside its write: the lookup's rows plus the previous lease (seq - 1),
the restore of seq and the audit chain's head; params (seq, seq - 1, seq, job, group)."""


def now_us() -> int:
    """Unix time in microseconds."""
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True)
class JoinResult:
    """The epoch a join barrier formed.

    Args:
        epoch: the epoch number, the same for every rank of the barrier.
        seed: the group's seed.
        start: where lease seq 0 of the epoch starts (the high-water mark at formation).
        job_seed: the job's root seed.
        members: member ids by rank.
    """

    epoch: int
    seed: int
    start: int
    job_seed: int
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """A lease: offsets [start, end) of the group's stream for (epoch, seq).

    Args:
        group: the group's name.
        epoch: the epoch it belongs to.
        seq: its position in the epoch.
        seed: the group's seed.
        start: the first offset.
        end: one past the last offset.
        existing: True when the lease had been granted before and was read back.
    """

    group: str
    epoch: int
    seq: int
    seed: int
    start: int
    end: int
    existing: bool


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A group's state.

    Args:
        job: the job's name.
        group: the group's name.
        seed: the group's seed.
        epoch: the current epoch, 0 before the first forms.
        members: the current epoch's member ids by rank; "" marks a rank that left.
        high_water: one past the highest offset ever granted in the group.
        leases: number of leases granted in the current epoch.
        job_seed: the job's root seed.
    """

    job: str
    group: str
    seed: int
    epoch: int
    members: tuple[str, ...]
    high_water: int
    leases: int
    job_seed: int


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """The outcome of a Restore.

    Args:
        cursor: where lease `seq` will start.
        existing: True when the same Restore had been recorded before.
    """

    cursor: int
    existing: bool


@dataclass(frozen=True, slots=True)
class _Group:
    seed: int
    epoch: int
    high_water: int


@dataclass(frozen=True, slots=True)
class _Epoch:
    epoch: int
    world_size: int
    start: int
    members: tuple[str, ...]
    diverged: str | None

    def has(self, rank: int, member_id: str) -> bool:
        return _has(self.members, rank, member_id)


@dataclass(frozen=True, slots=True)
class _Lease:
    start: int
    end: int
    size: int
    fingerprint: bytes
    rank: int


class _MembersCache:
    """Parsed `epochs.members` columns (JSON lists of member ids by rank), keyed by the text.

    Every request still reads the column from the store, since another replica may have
    changed the membership; only the decoding is saved. Looking a text up costs a hash of it,
    far less than decoding it: about 1 ms against 8 ms for 65536 ranks. The cache is bounded
    by the total length of the texts it keeps, as one such list is ~2 MB of text; the oldest
    entry goes first.

    Args:
        max_chars: most characters of text kept, all entries together.
    """

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._entries: dict[str, tuple[str, ...]] = {}
        self._chars = 0
        self._lock = threading.Lock()

    def __call__(self, text: str) -> tuple[str, ...]:
        found = self._entries.get(text)
        if found is not None:
            return found
        members = tuple(json.loads(text))
        if len(text) <= self._max_chars:
            with self._lock:
                if text not in self._entries:
                    while self._chars + len(text) > self._max_chars:
                        oldest = next(iter(self._entries))
                        self._chars -= len(oldest)
                        del self._entries[oldest]
                    self._entries[text] = members
                    self._chars += len(text)
        return members


_members = _MembersCache(max_chars=_MEMBERS_CACHE_CHARS)


@contextlib.contextmanager
def _fields() -> Iterator[None]:
    """Turn a broken contract rule (rngcoord.v1.rules) into the INVALID_ARGUMENT refusal."""
    try:
        yield
    except RuleViolation as violation:
        raise InvalidArgument.of(violation) from None


def _has(members: tuple[str, ...], rank: int, member_id: str) -> bool:
    return rank < len(members) and members[rank] == member_id


def _not_member(job: str, group: str, epoch: int, rank: int, member_id: str) -> NotMember:
    return NotMember(
        f"rank {rank} member {member_id!r} is not a member of epoch {epoch} of group "
        f"{group!r}; rejoin the group",
        job=job,
        group=group,
        epoch=epoch,
        rank=rank,
        member_id=member_id,
    )


def _ranks(ranks: Sequence[int]) -> str:
    """A rank list for a message, cut short when long."""
    if len(ranks) <= _MAX_LISTED_RANKS:
        return str(list(ranks))
    shown = ", ".join(str(r) for r in ranks[:_MAX_LISTED_RANKS])
    return f"[{shown}, ...] ({len(ranks)} ranks)"


def _rank_list(ranks: Sequence[int]) -> str:
    """A rank list for ErrorInfo metadata: "0,2,5", cut short past 16 as "0,...,15,+N"."""
    shown = ",".join(str(r) for r in ranks[:_MAX_LISTED_RANKS])
    extra = len(ranks) - _MAX_LISTED_RANKS
    return f"{shown},+{extra}" if extra > 0 else shown


def _diverged(job: str, group: str, epoch: int, stored: str) -> Divergence:
    """The refusal of a Reserve in an epoch whose divergence was recorded as `stored`."""
    try:
        record = json.loads(stored)
    except ValueError:  # a store written before divergences were recorded as JSON
        record = {"message": stored}
    return Divergence(
        str(record["message"]),
        job=job,
        group=group,
        epoch=epoch,
        seq=record.get("seq", ""),
        ranks=_rank_list(record.get("ranks", [])),
    )


def _job_seed(tx: Tx, job: str) -> int | None:
    row = tx.fetchone("SELECT seed FROM jobs WHERE job = ?", (job,))
    return None if row is None else from_db(row[0])


def _group(tx: Tx, job: str, group: str) -> _Group | None:
    row = tx.fetchone(
        "SELECT seed, epoch, high_water FROM groups WHERE job = ? AND grp = ?", (job, group)
    )
    if row is None:
        return None
    return _Group(seed=from_db(row[0]), epoch=int(row[1]), high_water=from_db(row[2]))


def _require_group(tx: Tx, job: str, group: str) -> _Group:
    found = _group(tx, job, group)
    if found is not None:
        return found
    if _job_seed(tx, job) is None:
        raise NotFound(
            f"unknown job {job!r}: a JoinGroup creates it", reason=pb.UNKNOWN_JOB, job=job
        )
    raise NotFound(
        f"unknown group {group!r} in job {job!r}: a JoinGroup creates it",
        reason=pb.UNKNOWN_GROUP,
        job=job,
        group=group,
    )


def _epoch(tx: Tx, job: str, group: str, epoch: int) -> _Epoch:
    row = tx.fetchone(
        "SELECT world_size, start, members, diverged FROM epochs "
        "WHERE job = ? AND grp = ? AND epoch = ?",
        (job, group, epoch),
    )
    if row is None:
        raise RuntimeError(f"group {group!r} of job {job!r} lacks its epoch {epoch} row")
    return _Epoch(
        epoch=epoch,
        world_size=int(row[0]),
        start=from_db(row[1]),
        members=_members(row[2]),
        diverged=row[3],
    )


def _check_epoch(current: int, job: str, group: str, epoch: int) -> None:
    """Fencing: only the group's current epoch is served."""
    if epoch == 0 or epoch > current:
        raise NotFound(
            f"epoch {epoch} of group {group!r} does not exist (current {current})",
            reason=pb.UNKNOWN_EPOCH,
            job=job,
            group=group,
            epoch=epoch,
            current_epoch=current,
        )
    if epoch < current:
        raise StaleEpoch(
            f"epoch {epoch} of group {group!r} is stale: the current epoch is {current}; "
            "rejoin the group",
            job=job,
            group=group,
            epoch=epoch,
            current_epoch=current,
        )


def _member_epoch(
    tx: Tx, job: str, group: str, epoch: int, rank: int, member_id: str
) -> tuple[_Group, _Epoch]:
    """The group and its current epoch `epoch`, of which (rank, member_id) must be a member."""
    g = _require_group(tx, job, group)
    _check_epoch(g.epoch, job, group, epoch)
    e = _epoch(tx, job, group, epoch)
    if not e.has(rank, member_id):
        raise _not_member(job, group, epoch, rank, member_id)
    return g, e


def _lease(tx: Tx, job: str, group: str, epoch: int, seq: int) -> _Lease | None:
    row = tx.fetchone(
        'SELECT start, "end", size, fingerprint, rank FROM leases '
        "WHERE job = ? AND grp = ? AND epoch = ? AND seq = ?",
        (job, group, epoch, seq),
    )
    if row is None:
        return None
    return _Lease(
        start=from_db(row[0]),
        end=from_db(row[1]),
        size=from_db(row[2]),
        fingerprint=bytes(row[3]),
        rank=int(row[4]),
    )


def _restore_cursor(tx: Tx, job: str, group: str, epoch: int, seq: int) -> int | None:
    row = tx.fetchone(
        'SELECT "cursor" FROM restores WHERE job = ? AND grp = ? AND epoch = ? AND seq = ?',
        (job, group, epoch, seq),
    )
    return None if row is None else from_db(row[0])


class Coordinator:
    """The seed/offset authority over one store.

    Args:
        store: where state and the audit chain live; shared by all replicas of a deployment.
        join_timeout_s: how long a join waits for the other ranks when the request sets no
            timeout. Default 60.0.
        clock: the source of timestamps (Unix microseconds) for records and join expiry.
            Default `now_us`.
    """

    def __init__(
        self,
        store: Store,
        *,
        join_timeout_s: float = 60.0,
        clock: Callable[[], int] = now_us,
    ) -> None:
        self._store = store
        self._read_row = row_reader(store)
        self._join_timeout_s = join_timeout_s
        self._clock = clock
        # Notified when a join of this coordinator forms an epoch, to wake its waiting joins
        # at once; joins that reach other replicas are seen by polling.
        self._epoch_formed = threading.Condition()

    def _audit(
        self, tx: Tx, job: str, group: str, kind: str, actor: str, detail: dict[str, Any]
    ) -> None:
        audit.append(
            tx, ts_us=self._clock(), job=job, group=group, kind=kind, actor=actor, detail=detail
        )

    # ----------------------------------------------------------------------------- join

    def join(
        self,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        member_id: str,
        job_seed: int | None,
        timeout_s: float | None,
        actor: str,
    ) -> JoinResult:
        """Join the group's barrier; return the epoch it forms once all ranks have joined.

        Creates the job (with `job_seed`, or a drawn root seed) and the group when they are
        new. A repeated join of a member already in the current epoch returns that epoch.

        Args:
            job: the job's name.
            group: the group's name.
            rank: the caller's rank in [0, world_size).
            world_size: number of ranks that form the epoch.
            member_id: the caller's process incarnation id.
            job_seed: the root seed to fix for a new job, or None to accept the job's seed.
            timeout_s: how long to wait for the other ranks; None for the coordinator's
                default.
            actor: who asks, for the audit log.

        Raises:
            InvalidArgument: a malformed field.
            FailedPrecondition: `job_seed` differs from the job's, or pending joins of the
                group use another world size.
            JoinTimeout: the other ranks did not all join in time; names the missing ranks.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_world_size(world_size)
            check_rank(rank, world_size)
            check_member_id(member_id)
            if job_seed is not None:
                check_u64("job_seed", job_seed)
        if timeout_s is None:
            timeout_s = self._join_timeout_s
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise InvalidArgument(
                f"invalid timeout {timeout_s!r}: it must be positive",
                field="timeout_ms",
                value=timeout_s,
            )

        current = self._store.read(
            lambda tx: self._joined_current(tx, job, group, rank, world_size, member_id, job_seed)
        )
        if current is not None:
            return current
        drawn = job_seed if job_seed is not None else draw_job_seed()
        deadline = time.monotonic() + timeout_s
        expires_us = self._clock() + math.ceil(timeout_s * 1e6)
        outcome = self._store.write(
            lambda tx: self._join_tx(
                tx, job, group, rank, world_size, member_id, job_seed, drawn, expires_us, actor
            )
        )
        if isinstance(outcome, JoinResult):
            with self._epoch_formed:
                self._epoch_formed.notify_all()
            return outcome
        base_epoch = outcome
        while (remaining := deadline - time.monotonic()) > 0:
            with self._epoch_formed:
                self._epoch_formed.wait(min(_POLL_S, remaining))
            formed = self._store.read(
                lambda tx: self._joined_since(tx, job, group, rank, member_id, base_epoch)
            )
            if formed is not None:
                return formed
        final = self._store.write(
            lambda tx: self._join_timeout_tx(
                tx, job, group, rank, world_size, member_id, base_epoch, timeout_s, actor
            )
        )
        if isinstance(final, JoinResult):
            return final
        message, missing = final
        raise JoinTimeout(
            f"join of group {group!r} timed out after {timeout_s:g}s: {message}",
            job=job,
            group=group,
            world_size=world_size,
            missing=_rank_list(missing),
        )

    @staticmethod
    def _check_job_seed(job: str, stored: int, asked: int | None) -> None:
        if asked is not None and asked != stored:
            raise FailedPrecondition(
                f"job {job!r} has root seed {stored}; the request asked for {asked}",
                reason=pb.SEED_CONFLICT,
                job=job,
                seed=stored,
                requested_seed=asked,
            )

    def _joined_current(
        self,
        tx: Tx,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        member_id: str,
        job_seed: int | None,
    ) -> JoinResult | None:
        """The current epoch when the caller already belongs to it with this world size."""
        stored = _job_seed(tx, job)
        if stored is None:
            return None
        self._check_job_seed(job, stored, job_seed)
        g = _group(tx, job, group)
        if g is None or g.epoch == 0:
            return None
        e = _epoch(tx, job, group, g.epoch)
        if e.world_size != world_size or not e.has(rank, member_id):
            return None
        return JoinResult(g.epoch, g.seed, e.start, stored, e.members)

    @staticmethod
    def _joined_since(
        tx: Tx, job: str, group: str, rank: int, member_id: str, base_epoch: int
    ) -> JoinResult | None:
        """The first epoch after `base_epoch` that has (rank, member_id), if one formed."""
        rows = tx.fetchall(
            "SELECT epoch, start, members FROM epochs WHERE job = ? AND grp = ? AND epoch > ? "
            "ORDER BY epoch",
            (job, group, base_epoch),
        )
        for epoch, start, members_json in rows:
            members = _members(members_json)
            if _has(members, rank, member_id):
                g = _require_group(tx, job, group)
                stored = _job_seed(tx, job)
                assert stored is not None  # the group exists, so its job does
                return JoinResult(int(epoch), g.seed, from_db(start), stored, members)
        return None

    def _join_tx(
        self,
        tx: Tx,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        member_id: str,
        job_seed: int | None,
        drawn_seed: int,
        expires_us: int,
        actor: str,
    ) -> JoinResult | int:
        """Record the caller's join; return the epoch it formed, or the epoch to wait past."""
        now = self._clock()
        stored = _job_seed(tx, job)
        if stored is None:
            stored = drawn_seed
            tx.execute(
                "INSERT INTO jobs (job, seed, created_us) VALUES (?, ?, ?)",
                (job, to_db(stored), now),
            )
            self._audit(tx, job, "", "job", actor, {"seed": stored})
        self._check_job_seed(job, stored, job_seed)
        g = _group(tx, job, group)
        if g is None:
            g = _Group(seed=group_seed(stored, group), epoch=0, high_water=0)
            tx.execute(
                "INSERT INTO groups (job, grp, seed, epoch, high_water) VALUES (?, ?, ?, 0, ?)",
                (job, group, to_db(g.seed), to_db(0)),
            )
            self._audit(tx, job, group, "group", actor, {"seed": g.seed})
        else:
            # The epoch may have formed since the read path looked.
            current = self._joined_current(tx, job, group, rank, world_size, member_id, job_seed)
            if current is not None:
                return current

        tx.execute(
            "DELETE FROM pending_joins WHERE job = ? AND grp = ? AND expires_us <= ?",
            (job, group, now),
        )
        others = tx.fetchall(
            "SELECT rank, member_id, world_size FROM pending_joins "
            "WHERE job = ? AND grp = ? AND rank <> ? ORDER BY rank",
            (job, group, rank),
        )
        mismatched = [(int(r), int(ws)) for r, _, ws in others if int(ws) != world_size]
        if mismatched:
            sizes = sorted({ws for _, ws in mismatched})
            waiting = [r for r, _ in mismatched]
            raise FailedPrecondition(
                f"rank {rank} joined group {group!r} with world size {world_size}, but ranks "
                f"{_ranks(waiting)} are waiting with world size "
                f"{', '.join(map(str, sizes))}; every rank of a barrier must join with the "
                "same world size",
                reason=pb.WORLD_SIZE_MISMATCH,
                job=job,
                group=group,
                world_size=world_size,
                waiting_world_size=",".join(map(str, sizes)),
                ranks=_rank_list(waiting),
            )
        # A new member id for a rank replaces the old one (a restarted process).
        tx.execute(
            "DELETE FROM pending_joins WHERE job = ? AND grp = ? AND rank = ?", (job, group, rank)
        )
        if len(others) + 1 < world_size:
            tx.execute(
                "INSERT INTO pending_joins (job, grp, rank, member_id, world_size, expires_us) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job, group, rank, member_id, world_size, expires_us),
            )
            return g.epoch

        members = [""] * world_size
        for r, m, _ in others:
            members[int(r)] = m
        members[rank] = member_id
        epoch = g.epoch + 1
        tx.execute("DELETE FROM pending_joins WHERE job = ? AND grp = ?", (job, group))
        tx.execute(
            "INSERT INTO epochs (job, grp, epoch, world_size, start, members, diverged, "
            "created_us) VALUES (?, ?, ?, ?, ?, ?, NULL, ?)",
            (job, group, epoch, world_size, to_db(g.high_water), json.dumps(members), now),
        )
        # Raising the group's epoch fences every older one.
        tx.execute("UPDATE groups SET epoch = ? WHERE job = ? AND grp = ?", (epoch, job, group))
        self._audit(
            tx,
            job,
            group,
            "epoch",
            actor,
            {
                "epoch": epoch,
                "world_size": world_size,
                "start": g.high_water,
                "members": members,
                "previous_epoch": g.epoch,
            },
        )
        return JoinResult(epoch, g.seed, g.high_water, stored, tuple(members))

    def _join_timeout_tx(
        self,
        tx: Tx,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        member_id: str,
        base_epoch: int,
        timeout_s: float,
        actor: str,
    ) -> JoinResult | tuple[str, list[int]]:
        """Withdraw the caller's pending join; return the epoch if it formed after all, else
        why the barrier did not complete and the ranks that are missing.

        The caller's row is withdrawn by expiring it rather than deleting it: no barrier counts
        it any more (joins drop expired rows first), yet peers timing out at the same moment
        still see that this rank did join, so they name only the ranks that never came.
        """
        formed = self._joined_since(tx, job, group, rank, member_id, base_epoch)
        if formed is not None:
            return formed
        g = _require_group(tx, job, group)
        if g.epoch > base_epoch:
            return f"epoch {g.epoch} formed without rank {rank} member {member_id!r}; rejoin", []
        pending = tx.fetchall(
            "SELECT rank, member_id, world_size FROM pending_joins WHERE job = ? AND grp = ?",
            (job, group),
        )
        holder = next((m for r, m, _ in pending if int(r) == rank), member_id)
        if holder != member_id:
            return f"rank {rank} is now joining as member {holder!r}, not {member_id!r}", []
        present = {int(r) for r, _, ws in pending if int(ws) == world_size} | {rank}
        missing = [r for r in range(world_size) if r not in present]
        if any(int(r) == rank for r, _, _ in pending):
            tx.execute(
                "UPDATE pending_joins SET expires_us = ? WHERE job = ? AND grp = ? AND rank = ?",
                (self._clock(), job, group, rank),
            )
            self._audit(
                tx,
                job,
                group,
                "join_timeout",
                actor,
                {
                    "rank": rank,
                    "world_size": world_size,
                    "missing": missing,
                    "timeout_s": timeout_s,
                },
            )
        return f"ranks {_ranks(missing)} of world size {world_size} did not join", missing

    # -------------------------------------------------------------------------- reserve

    def reserve(
        self,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        size: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
        actor: str,
    ) -> ReserveResult:
        """Return the lease (epoch, seq) of the group, granting it durably if it is new.

        Lease seq k starts where lease k-1 ended (seq 0 at the epoch's start), unless a
        Restore set its start. A repeat with the same size and fingerprint reads the lease
        back without a write.

        Args:
            job: the job's name.
            group: the group's name.
            epoch: the caller's epoch; it must be the current one.
            seq: the lease's position in the epoch.
            size: number of offsets, a multiple of 4 in [4, 2^64).
            fingerprint: digest of the random ops the caller ran, 1 to 64 bytes.
            rank: the caller's rank in the epoch.
            member_id: the caller's member id; (rank, member_id) must be in the epoch.
            actor: who asks, for the audit log.

        Raises:
            InvalidArgument: a malformed field.
            NotFound: unknown job, group or epoch.
            StaleEpoch: the epoch has been replaced.
            FailedPrecondition: the caller is not a member, or seq - 1 is not granted yet.
            Divergence: the key was granted with another size or fingerprint, now or before.
            ResourceExhausted: the lease would end past 2^64 - 4.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_u64("epoch", epoch)
            check_seq(seq)
            check_size(size)
            check_fingerprint(fingerprint)
            check_rank(rank)
            check_member_id(member_id)

        row = self._read_row(_RESERVE_LOOKUP, (seq, job, group))
        if row is None:
            # Unknown job or group: a read of its own says which. Should the group have been
            # created since, the write below re-checks everything.
            self._store.read(lambda tx: _require_group(tx, job, group))
        else:
            seed, current, members, diverged, start, end, granted_size, granted_fp = row
            _check_epoch(current, job, group, epoch)
            if members is None:
                raise RuntimeError(f"group {group!r} of job {job!r} lacks its epoch {epoch} row")
            if not _has(_members(members), rank, member_id):
                raise _not_member(job, group, epoch, rank, member_id)
            if diverged is not None:
                raise _diverged(job, group, epoch, diverged)
            if start is not None and granted_size == to_db(size) and granted_fp == fingerprint:
                return ReserveResult(
                    group, epoch, seq, from_db(seed), from_db(start), from_db(end), True
                )
        return self._store.write(
            lambda tx: self._reserve_tx(
                tx, job, group, epoch, seq, size, fingerprint, rank, member_id, actor
            )
        )

    def _reserve_tx(
        self,
        tx: Tx,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        size: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
        actor: str,
    ) -> ReserveResult:
        row = tx.fetchone(_RESERVE_STATE, (seq, seq - 1, seq, job, group))
        if row is None:
            _require_group(tx, job, group)
            raise RuntimeError("audit_head has no row: the schema migration did not run")
        (
            seed_db,
            current,
            high_water,
            epoch_start,
            members,
            diverged,
            granted_start,
            granted_end,
            granted_size,
            granted_fp,
            granted_rank,
            previous_end,
            cursor,
            last_id,
            last_hash,
        ) = row
        _check_epoch(current, job, group, epoch)
        if members is None:
            raise RuntimeError(f"group {group!r} of job {job!r} lacks its epoch {epoch} row")
        if not _has(_members(members), rank, member_id):
            raise _not_member(job, group, epoch, rank, member_id)
        if diverged is not None:
            raise _diverged(job, group, epoch, diverged)
        seed = from_db(seed_db)
        head = (int(last_id), str(last_hash))
        now = self._clock()
        if granted_start is not None:
            lease_size, lease_fp = from_db(granted_size), bytes(granted_fp)
            if lease_size == size and lease_fp == fingerprint:
                return ReserveResult(
                    group, epoch, seq, seed, from_db(granted_start), from_db(granted_end), True
                )
            message = (
                f"divergence in group {group!r} epoch {epoch} seq {seq}: rank {rank} asked for "
                f"size={size} fingerprint={fingerprint.hex()} but rank {granted_rank} was "
                f"granted size={lease_size} fingerprint={lease_fp.hex()}; the ranks "
                "disagree about the sequence of random ops"
            )
            ranks = sorted({rank, int(granted_rank)})
            record = {"message": message, "seq": seq, "ranks": ranks}
            tx.execute(
                "UPDATE epochs SET diverged = ? WHERE job = ? AND grp = ? AND epoch = ?",
                (json.dumps(record), job, group, epoch),
            )
            audit.append(
                tx,
                ts_us=now,
                job=job,
                group=group,
                kind="divergence",
                actor=actor,
                detail={
                    "epoch": epoch,
                    "seq": seq,
                    "rank": rank,
                    "size": size,
                    "fingerprint": fingerprint.hex(),
                    "granted_rank": int(granted_rank),
                    "granted_size": lease_size,
                    "granted_fingerprint": lease_fp.hex(),
                },
                head=head,
            )
            raise _diverged(job, group, epoch, json.dumps(record))

        if cursor is not None:
            start = from_db(cursor)
        elif seq == 0:
            start = from_db(epoch_start)
        elif previous_end is None:
            raise FailedPrecondition(
                f"lease seq {seq} of group {group!r} epoch {epoch} requested before seq {seq - 1}",
                reason=pb.SEQ_OUT_OF_ORDER,
                job=job,
                group=group,
                epoch=epoch,
                seq=seq,
            )
        else:
            start = from_db(previous_end)
        end = start + size
        if end > MAX_OFFSET:
            raise ResourceExhausted(
                f"group {group!r} has used its offset space: lease of {size} at {start} would "
                "pass 2^64; start a new job or Restore",
                job=job,
                group=group,
                start=start,
                size=size,
            )
        tx.execute(
            'INSERT INTO leases (job, grp, epoch, seq, start, "end", size, fingerprint, rank, '
            "member_id, created_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job,
                group,
                epoch,
                seq,
                to_db(start),
                to_db(end),
                to_db(size),
                fingerprint,
                rank,
                member_id,
                now,
            ),
        )
        if to_db(end) > high_water:
            tx.execute(
                "UPDATE groups SET high_water = ? WHERE job = ? AND grp = ?",
                (to_db(end), job, group),
            )
        audit.append(
            tx,
            ts_us=now,
            job=job,
            group=group,
            kind="grant",
            actor=actor,
            detail={
                "epoch": epoch,
                "seq": seq,
                "seed": seed,
                "start": start,
                "end": end,
                "size": size,
                "fingerprint": fingerprint.hex(),
                "rank": rank,
            },
            head=head,
        )
        return ReserveResult(group, epoch, seq, seed, start, end, False)

    # ---------------------------------------------------------------------------- leave

    def leave(
        self, job: str, group: str, epoch: int, rank: int, member_id: str, actor: str
    ) -> None:
        """Record that a member leaves its epoch; the epoch stays valid for the others.

        Repeating a leave whose rank has already left is a no-op.

        Args:
            job: the job's name.
            group: the group's name.
            epoch: the member's epoch; it must be the current one.
            rank: the member's rank.
            member_id: the member's id.
            actor: who asks, for the audit log.

        Raises:
            InvalidArgument, NotFound, StaleEpoch: as for `reserve`.
            FailedPrecondition: another member holds that rank.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_u64("epoch", epoch)
            check_rank(rank)
            check_member_id(member_id)

        def slot(tx: Tx) -> _Epoch | None:
            """The epoch when the caller has to leave it, None when it has already left."""
            g = _require_group(tx, job, group)
            _check_epoch(g.epoch, job, group, epoch)
            e = _epoch(tx, job, group, epoch)
            if rank < len(e.members) and e.members[rank] == "":
                return None
            if not e.has(rank, member_id):
                raise _not_member(job, group, epoch, rank, member_id)
            return e

        def leave_tx(tx: Tx) -> None:
            e = slot(tx)
            if e is None:
                return
            members = list(e.members)
            members[rank] = ""
            tx.execute(
                "UPDATE epochs SET members = ? WHERE job = ? AND grp = ? AND epoch = ?",
                (json.dumps(members), job, group, epoch),
            )
            self._audit(
                tx,
                job,
                group,
                "leave",
                actor,
                {"epoch": epoch, "rank": rank, "member_id": member_id},
            )

        if self._store.read(slot) is not None:
            self._store.write(leave_tx)

    # ------------------------------------------------------------------------ get_group

    def get_group(self, job: str, group: str) -> GroupInfo:
        """Describe a group: seeds, current epoch and members, high-water mark, lease count.

        Raises:
            InvalidArgument: a malformed name.
            NotFound: unknown job or group.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)

        def read(tx: Tx) -> GroupInfo:
            g = _require_group(tx, job, group)
            stored = _job_seed(tx, job)
            assert stored is not None  # the group exists, so its job does
            members: tuple[str, ...] = ()
            leases = 0
            if g.epoch:
                members = _epoch(tx, job, group, g.epoch).members
                row = tx.fetchone(
                    "SELECT COUNT(*) FROM leases WHERE job = ? AND grp = ? AND epoch = ?",
                    (job, group, g.epoch),
                )
                leases = 0 if row is None else int(row[0])
            return GroupInfo(job, group, g.seed, g.epoch, members, g.high_water, leases, stored)

        return self._store.read(read)

    # -------------------------------------------------------------------------- restore

    def restore(
        self,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        cursor: int,
        rank: int,
        member_id: str,
        actor: str,
    ) -> RestoreResult:
        """Make lease `seq` of the current epoch start at `cursor` (a bitwise-exact resume).

        It may reuse offsets granted before; the audit log records it. Repeating the same
        Restore returns existing=True without a write.

        Args:
            job: the job's name.
            group: the group's name.
            epoch: the current epoch.
            seq: the first lease that starts at `cursor`; it must not be granted yet.
            cursor: a multiple of 4 in [0, 2^64 - 4].
            rank: the caller's rank.
            member_id: the caller's member id; (rank, member_id) must be in the epoch.
            actor: who asks, for the audit log.

        Raises:
            InvalidArgument, NotFound, StaleEpoch: as for `reserve`.
            FailedPrecondition: the caller is not a member, the seq is already granted, or
                it was restored to another cursor.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_u64("epoch", epoch)
            check_seq(seq)
            check_cursor(cursor)
            check_rank(rank)
            check_member_id(member_id)

        def recorded(tx: Tx) -> _Group | None:
            """The group when the restore is new; None when it is recorded already."""
            conflict = {"job": job, "group": group, "epoch": epoch, "seq": seq, "cursor": cursor}
            g, _ = _member_epoch(tx, job, group, epoch, rank, member_id)
            earlier = _restore_cursor(tx, job, group, epoch, seq)
            if earlier == cursor:
                return None
            if earlier is not None:
                raise FailedPrecondition(
                    f"seq {seq} of group {group!r} epoch {epoch} was already restored to "
                    f"cursor {earlier}, not {cursor}",
                    reason=pb.RESTORE_CONFLICT,
                    **conflict,
                )
            if _lease(tx, job, group, epoch, seq) is not None:
                raise FailedPrecondition(
                    f"lease {seq} of group {group!r} epoch {epoch} already granted: restore "
                    "a seq that has not been reserved yet",
                    reason=pb.RESTORE_CONFLICT,
                    **conflict,
                )
            return g

        def restore_tx(tx: Tx) -> bool:
            g = recorded(tx)
            if g is None:
                return True
            tx.execute(
                'INSERT INTO restores (job, grp, epoch, seq, "cursor", created_us) '
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job, group, epoch, seq, to_db(cursor), self._clock()),
            )
            self._audit(
                tx,
                job,
                group,
                "restore",
                actor,
                {
                    "epoch": epoch,
                    "seq": seq,
                    "cursor": cursor,
                    "high_water": g.high_water,
                    "rank": rank,
                },
            )
            return False

        if self._store.read(recorded) is None:
            return RestoreResult(cursor, existing=True)
        return RestoreResult(cursor, existing=self._store.write(restore_tx))

    # ----------------------------------------------------------------------- list_audit

    def list_audit(
        self,
        job: str = "",
        group: str = "",
        kinds: Sequence[str] = (),
        since_us: int = 0,
        until_us: int = 0,
        limit: int = 0,
    ) -> Iterator[AuditRecord]:
        """Audit records in chain order, oldest first, read page by page.

        Validation happens at the call; the store is read as the iterator advances.

        Args:
            job: only this job; "" for all. Default "".
            group: only this group; "" for all. Default "".
            kinds: only these kinds; empty for all. Default ().
            since_us: only records at or after this Unix time (µs); 0 for no bound. Default 0.
            until_us: only records before this Unix time (µs); 0 for no bound. Default 0.
            limit: stop after this many records; 0 for no limit. Default 0.

        Raises:
            InvalidArgument: a malformed name or a negative limit.
        """
        with _fields():
            if job:
                check_name("job", job)
            if group:
                check_name("group", group)
        if limit < 0:
            raise InvalidArgument(
                f"invalid limit {limit!r}: it must be 0 (no limit) or more",
                field="limit",
                value=limit,
            )
        kinds = tuple(kinds)
        return self._audit_pages(job, group, kinds, since_us, until_us, limit)

    def _audit_pages(
        self,
        job: str,
        group: str,
        kinds: tuple[str, ...],
        since_us: int,
        until_us: int,
        limit: int,
    ) -> Iterator[AuditRecord]:
        after_id, left = 0, limit or math.inf
        while left > 0:
            size = int(min(_AUDIT_PAGE, left))
            page = self._store.read(
                functools.partial(
                    audit.fetch_page,
                    after_id=after_id,
                    limit=size,
                    job=job,
                    group=group,
                    kinds=kinds,
                    since_us=since_us,
                    until_us=until_us,
                )
            )
            yield from page
            if len(page) < size:
                return
            after_id = page[-1].id
            left -= len(page)
