"""Read-only views of a store for people: the status page (rngcoord.server.web.status) and the
report (rngcoord.server.report).

Every function here takes an open transaction and only reads. The status page refreshes each
second, so its queries are bounded whatever the store holds: the group list is one query (each
group's lease count and restore count come from primary-key lookups inside it), the members of
every group's current epoch one more (the first `member_limit` ranks of each), and the audit
tail reads at most `limit` rows from the end of the chain. The report reads a whole job once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rngcoord.server.core import divergences
from rngcoord.server.storage.store import Tx, from_db
from rngcoord.v1.rules import MAX_OFFSET

__all__ = [
    "EpochView",
    "GroupHistory",
    "GroupView",
    "JobReport",
    "LeasePoint",
    "MemberView",
    "group_state",
    "group_views",
    "job_names",
    "job_report",
]


@dataclass(frozen=True, slots=True)
class MemberView:
    """One rank of a group's current epoch.

    Args:
        rank: the rank.
        member_id: the process incarnation holding it.
        peer: the address it joined from ("" when unknown).
        joined_us: when its join reached the coordinator (Unix µs).
        left_us: when it left (Unix µs), or None while it is in.
    """

    rank: int
    member_id: str
    peer: str
    joined_us: int
    left_us: int | None


@dataclass(frozen=True, slots=True)
class GroupView:
    """A group as the status page shows it.

    Args:
        job: the job's name.
        group: the group's name.
        epoch: the current epoch (0 before the first forms).
        world_size: ranks in the current epoch (0 before the first forms).
        epoch_start: the offset the current epoch started at.
        epoch_created_us: when the current epoch formed (Unix µs; 0 before the first forms).
        high_water: one past the highest offset ever granted in the group.
        leases: leases granted in the current epoch.
        leases_total: leases granted in every epoch of the group.
        restores: Restores that took effect in the group, every epoch.
        left: members of the current epoch that left.
        waiting: ranks waiting in the group's join barrier.
        divergence: the current epoch's divergence message, or None.
        diverged_ranks: the ranks that disagreed (empty without a divergence).
        members: the first ranks of the current epoch (see `group_views`' `member_limit`).
        last_grant_us: when the current epoch's latest lease was granted (Unix µs), or 0.
    """

    job: str
    group: str
    epoch: int
    world_size: int
    epoch_start: int
    epoch_created_us: int
    high_water: int
    leases: int
    leases_total: int
    restores: int
    left: int
    waiting: int
    divergence: str | None
    diverged_ranks: tuple[int, ...]
    members: tuple[MemberView, ...] = ()
    last_grant_us: int = 0

    @property
    def finished(self) -> bool:
        """Whether every member of the current epoch has left (a job that ended cleanly)."""
        return self.world_size > 0 and self.left >= self.world_size

    @property
    def last_activity_us(self) -> int:
        """The latest of: the current epoch forming, its latest grant, a listed member
        joining or leaving (Unix µs; 0 before anything happened)."""
        times = [self.epoch_created_us, self.last_grant_us]
        for m in self.members:
            times.append(m.joined_us)
            if m.left_us is not None:
                times.append(m.left_us)
        return max(times)

    @property
    def used_share(self) -> float:
        """The high-water mark as a share of the usable offset space [0, MAX_OFFSET]."""
        return self.high_water / MAX_OFFSET

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (offsets as decimal strings: they pass 2^53)."""
        return {
            "job": self.job,
            "group": self.group,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "epoch_start": str(self.epoch_start),
            "epoch_created_us": self.epoch_created_us,
            "high_water": str(self.high_water),
            "used_share": self.used_share,
            "leases": self.leases,
            "leases_total": self.leases_total,
            "restores": self.restores,
            "left": self.left,
            "waiting": self.waiting,
            "divergence": self.divergence,
            "diverged_ranks": list(self.diverged_ranks),
            "last_activity_us": self.last_activity_us,
            "finished": self.finished,
            "members": [
                {
                    "rank": m.rank,
                    "member_id": m.member_id,
                    "peer": m.peer,
                    "joined_us": m.joined_us,
                    "left_us": m.left_us,
                }
                for m in self.members
            ],
        }


# Each group's lease counts are primary-key probes: MAX(seq) of one (job, grp, epoch) prefix
# reads one B-tree entry, so the list costs O(groups x epochs x log(leases)), not O(leases).
# The latest grant's time is read the same way, from the row of the highest seq.
_GROUPS = (
    "SELECT g.job, g.grp, g.epoch, g.high_water, g.barrier_count, "
    "e.world_size, e.start, e.created_us, e.diverged, e.left_count, "
    "(SELECT MAX(l.seq) FROM leases l "
    " WHERE l.job = g.job AND l.grp = g.grp AND l.epoch = g.epoch), "
    "(SELECT SUM((SELECT MAX(l2.seq) + 1 FROM leases l2 "
    "  WHERE l2.job = e2.job AND l2.grp = e2.grp AND l2.epoch = e2.epoch)) "
    " FROM epochs e2 WHERE e2.job = g.job AND e2.grp = g.grp), "
    "(SELECT COUNT(*) FROM restores r WHERE r.job = g.job AND r.grp = g.grp), "
    "(SELECT l3.created_us FROM leases l3 "
    " WHERE l3.job = g.job AND l3.grp = g.grp AND l3.epoch = g.epoch "
    " ORDER BY l3.seq DESC LIMIT 1) "
    "FROM groups g "
    "LEFT JOIN epochs e ON e.job = g.job AND e.grp = g.grp AND e.epoch = g.epoch "
    "ORDER BY g.job, g.grp"
)

_MEMBERS = (
    "SELECT m.job, m.grp, m.rank, m.member_id, m.peer, m.joined_us, m.left_us "
    "FROM members m JOIN groups g "
    "ON m.job = g.job AND m.grp = g.grp AND m.epoch = g.epoch "
    "WHERE m.rank < ? ORDER BY m.job, m.grp, m.rank"
)


def group_views(tx: Tx, *, member_limit: int = 64) -> list[GroupView]:
    """Every group, by job then name, with the first `member_limit` ranks of its current
    epoch; two queries in all.

    Args:
        tx: an open transaction.
        member_limit: ranks listed per group (the counts cover them all). Default 64.
    """
    members: dict[tuple[str, str], list[MemberView]] = {}
    for job, group, rank, member_id, peer, joined_us, left_us in tx.fetchall(
        _MEMBERS, (member_limit,)
    ):
        members.setdefault((job, group), []).append(
            MemberView(
                int(rank),
                member_id,
                peer,
                int(joined_us),
                None if left_us is None else int(left_us),
            )
        )
    views = []
    for row in tx.fetchall(_GROUPS):
        (job, group, epoch, high_water, waiting, world_size, start, created_us, diverged) = row[:9]
        left, max_seq, total, restores, last_grant_us = row[9:]
        message, ranks = divergences.summary(diverged)
        views.append(
            GroupView(
                job=job,
                group=group,
                epoch=int(epoch),
                world_size=0 if world_size is None else int(world_size),
                epoch_start=0 if start is None else from_db(start),
                epoch_created_us=0 if created_us is None else int(created_us),
                high_water=from_db(high_water),
                leases=0 if max_seq is None else int(max_seq) + 1,
                leases_total=0 if total is None else int(total),
                restores=int(restores),
                left=0 if left is None else int(left),
                waiting=int(waiting),
                divergence=message,
                diverged_ranks=ranks,
                members=tuple(members.get((job, group), ())),
                last_grant_us=0 if last_grant_us is None else int(last_grant_us),
            )
        )
    return views


def group_state(g: GroupView, now_us: int, idle_after_s: float) -> str:
    """ "finished" when every member of the current epoch has left; else "active" when ranks
    wait to join or something happened within `idle_after_s` of `now_us` (an epoch formed,
    a lease was granted, a member joined or left); else "idle" (a job that stopped without
    its ranks leaving, or one between runs)."""
    if g.finished:
        return "finished"
    if g.waiting or now_us - g.last_activity_us < idle_after_s * 1_000_000:
        return "active"
    return "idle"


def job_names(tx: Tx) -> list[str]:
    """Every job's name, in order."""
    return [str(job) for (job,) in tx.fetchall("SELECT job FROM jobs ORDER BY job")]


# ------------------------------------------------------------------------------ report


@dataclass(frozen=True, slots=True)
class EpochView:
    """One epoch of a group, for the report.

    Args:
        epoch: its number.
        world_size: its ranks.
        start: the offset it started at.
        created_us: when it formed (Unix µs).
        divergence: its divergence message, or None.
        diverged_ranks: the ranks that disagreed.
    """

    epoch: int
    world_size: int
    start: int
    created_us: int
    divergence: str | None
    diverged_ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LeasePoint:
    """A granted lease: when, and which offsets.

    Args:
        created_us: when it was granted (Unix µs).
        epoch: the epoch it belongs to.
        start: its first offset.
        end: one past its last offset.
    """

    created_us: int
    epoch: int
    start: int
    end: int


@dataclass
class GroupHistory:
    """Everything the report draws for one group.

    Args:
        group: the group's name.
        high_water: one past the highest offset granted.
        epochs: its epochs, in order.
        leases: its leases, by grant time.
        restores: (time µs, epoch, seq, cursor) of each Restore that took effect.
        divergences: (time µs, epoch, ranks) of each divergence, from the audit chain.
        quorums: (time µs, quorum id, step, participants, healed from) of each torchft
            quorum a replica recorded in the group, from the audit chain.
    """

    group: str
    high_water: int
    epochs: list[EpochView] = field(default_factory=list)
    leases: list[LeasePoint] = field(default_factory=list)
    restores: list[tuple[int, int, int, int]] = field(default_factory=list)
    divergences: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    quorums: list[tuple[int, int, int, int, str]] = field(default_factory=list)


@dataclass
class JobReport:
    """One job's history, as `rngcoord report` draws it.

    Args:
        job: the job's name.
        store_id: the store's id.
        head: (id, hash) of the audit chain's head when it was read.
        groups: the job's groups, by name.
    """

    job: str
    store_id: str
    head: tuple[int, str]
    groups: list[GroupHistory]


def job_report(tx: Tx, job: str, store_id: str) -> JobReport | None:
    """Read one job's groups, epochs, leases, restores, divergences and torchft quorums in one
    snapshot; None
    when the store has no such job."""
    if tx.fetchone("SELECT 1 FROM jobs WHERE job = ?", (job,)) is None:
        return None
    groups = {
        grp: GroupHistory(grp, from_db(hw))
        for grp, hw in tx.fetchall(
            "SELECT grp, high_water FROM groups WHERE job = ? ORDER BY grp", (job,)
        )
    }
    for grp, epoch, world_size, start, created_us, diverged in tx.fetchall(
        "SELECT grp, epoch, world_size, start, created_us, diverged FROM epochs "
        "WHERE job = ? ORDER BY grp, epoch",
        (job,),
    ):
        message, ranks = divergences.summary(diverged)
        groups[grp].epochs.append(
            EpochView(int(epoch), int(world_size), from_db(start), int(created_us), message, ranks)
        )
    for grp, epoch, start, end, created_us in tx.fetchall(
        'SELECT grp, epoch, start, "end", created_us FROM leases WHERE job = ? '
        "ORDER BY grp, created_us",
        (job,),
    ):
        groups[grp].leases.append(
            LeasePoint(int(created_us), int(epoch), from_db(start), from_db(end))
        )
    for grp, epoch, seq, cursor, created_us in tx.fetchall(
        'SELECT grp, epoch, seq, "cursor", created_us FROM restores WHERE job = ? '
        "ORDER BY grp, created_us",
        (job,),
    ):
        groups[grp].restores.append((int(created_us), int(epoch), int(seq), from_db(cursor)))
    for grp, ts_us, detail in tx.fetchall(
        "SELECT grp, ts_us, detail FROM audit WHERE job = ? AND kind = 'divergence' ORDER BY id",
        (job,),
    ):
        d = json.loads(detail)
        groups[grp].divergences.append((int(ts_us), int(d["epoch"]), divergences.record_ranks(d)))
    for grp, ts_us, detail in tx.fetchall(
        "SELECT grp, ts_us, detail FROM audit WHERE job = ? AND kind = 'quorum' ORDER BY id",
        (job,),
    ):
        d = json.loads(detail)
        groups[grp].quorums.append(
            (int(ts_us), int(d["quorum_id"]), int(d["step"]), int(d["participants"]),
             str(d["healed_from"]))
        )  # fmt: skip
    head = tx.fetchone("SELECT last_id, last_hash FROM audit_head WHERE id = 1")
    assert head is not None
    return JobReport(job, store_id, (int(head[0]), str(head[1])), list(groups.values()))
