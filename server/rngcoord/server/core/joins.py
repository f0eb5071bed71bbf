"""What a join asks (`JoinRequest`), and the rules that refuse one: an epoch of another launch
still live (JOB_IN_USE), an epoch that formed without the rank, and a job or group that the
audit chain records but the store lost; with how rank lists read in their messages.

rngcoord.server.core.barrier applies them as it forms epochs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rngcoord.server.addresses import peer_host
from rngcoord.server.core.membership import fields
from rngcoord.server.errors import FailedPrecondition, InvalidArgument
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import StoreLost, Tx
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import (
    check_cursor,
    check_member_id,
    check_member_secret,
    check_name,
    check_rank,
    check_u64,
    check_world_size,
)

__all__ = [
    "LISTED_RANKS",
    "LIVE_EPOCH_S",
    "MAX_LAUNCH",
    "JoinRequest",
    "check_join",
    "formed_without",
    "in_use",
    "never_recorded",
    "ranks_text",
]


MAX_LAUNCH = 256
"""The longest launch name a join may carry."""

LISTED_RANKS = 16
"""How many ranks a message or an audit record names before it says how many more."""


#: An epoch whose members were active this recently is live: a join of another launch does
#: not replace it (JOB_IN_USE) unless it asks for a takeover. Activity is what the store
#: records (leases, first attestations), and a steady rank attests once per 30 to 60 s
#: (docs/design.md §6.1): three times the longest interval, so a live job never looks idle.
LIVE_EPOCH_S = 180.0


def ranks_text(ranks: Sequence[int], total: int | None = None) -> str:
    """A rank list for a message, cut short when long: "[0, 1, ..., 15, ...] (N ranks)"."""
    total = len(ranks) if total is None else total
    if total <= LISTED_RANKS and len(ranks) == total:
        return str(list(ranks))
    shown = ", ".join(str(r) for r in ranks[:LISTED_RANKS])
    return f"[{shown}, ...] ({total} ranks)"


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """One rank's join, validated.

    Args:
        job, group: the names.
        rank: the rank, below `world_size`.
        world_size: ranks that form the epoch.
        member_id: the process incarnation.
        secret_hash: `membership.secret_hash` of the member's secret: a retried join must
            carry the same secret, and later calls as the member too.
        job_seed: the root seed asked for, or None.
        timeout_s: how long to wait.
        actor: who asks, for the audit log.
        peer: the caller's address, kept with its membership.
        launch: which launch of the job the rank belongs to ("": no launch check).
        restart_count: the launch's torchelastic restart count.
        takeover: replace a live epoch of another launch.
        position: where the member knows the group's grants reach (JoinGroupRequest.position);
            an epoch it forms starts at or above it, a move audited as `failover-gap`.
    """

    job: str
    group: str
    rank: int
    world_size: int
    member_id: str
    secret_hash: bytes
    job_seed: int | None
    timeout_s: float
    actor: str
    peer: str
    launch: str = ""
    restart_count: int = 0
    takeover: bool = False
    position: int = 0


def formed_without(r: JoinRequest, epoch: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"epoch {epoch} of group {r.group!r} formed without rank {r.rank} member "
        f"{r.member_id!r} (another member took the rank, or the join expired); rejoin",
        reason=pb.NOT_MEMBER,
        job=r.job,
        group=r.group,
        epoch=epoch,
        rank=r.rank,
        member_id=r.member_id,
    )


def never_recorded(tx: Tx, job: str, group: str, kind: str) -> None:
    """Refuse to create a job or group that the audit chain already records: its rows were
    deleted from the store, and starting it again would grant its offsets again."""
    if queries.chain_records(tx, job, group, kind):
        what = f"job {job!r}" if kind == "job" else f"group {group!r} of job {job!r}"
        raise StoreLost(
            f"the audit chain records {what}, but the store has no row of it: its state was "
            "deleted, and serving it again could grant its offsets twice. Check the store with "
            "`rngcoord verify`, and restore it from a backup"
        )


def in_use(
    tx: Tx,
    r: JoinRequest,
    epoch: int,
    live: list[queries.EpochLaunch | None],
    now_us: int,
) -> FailedPrecondition | None:
    """JOB_IN_USE if `r` would replace epoch `epoch`, live and of another launch (or of an
    earlier restart of its own); None if it may. `live` caches the epoch's launch."""
    if r.takeover or not r.launch:
        return None
    if not live:
        live.append(queries.epoch_launch(tx, r.job, r.group, epoch))
    current = live[0]
    if current is None or not current.launch:
        return None
    if current.launch == r.launch and r.restart_count >= current.restart_count:
        return None  # the same launch, or a torchelastic restart of it
    idle_s = max(0.0, (now_us - current.active_us) / 1e6)
    if idle_s >= LIVE_EPOCH_S:
        return None
    peers = queries.member_peers(tx, r.job, r.group, epoch, 4 * LISTED_RANKS)
    hosts = sorted({peer_host(p) for p in peers if p})[:LISTED_RANKS]
    if current.launch == r.launch:
        why = (
            f"restart {r.restart_count} of launch {r.launch!r} is older than restart "
            f"{current.restart_count}, which formed the group's epoch {epoch}"
        )
    else:
        why = (
            f"launch {current.launch!r} of job {r.job!r} is using group {r.group!r} (epoch {epoch})"
        )
    return FailedPrecondition(
        f"{why}: its members, on {', '.join(hosts) or 'unknown hosts'}, were active "
        f"{idle_s:.0f}s ago. Two launches under one job name would both train on one "
        f"stream; stop that job, use another job name, or pass install(takeover=True) to "
        f"replace it (its ranks then fail with StaleEpochError). A job idle for "
        f"{LIVE_EPOCH_S:g}s is replaced without asking",
        reason=pb.JOB_IN_USE,
        job=r.job,
        group=r.group,
        epoch=epoch,
        launch=current.launch,
        hosts=",".join(hosts),
        idle_s=f"{idle_s:.0f}",
    )


def check_join(
    job: str,
    group: str,
    *,
    rank: int,
    world_size: int,
    member_id: str,
    member_secret: bytes,
    job_seed: int | None,
    position: int,
    launch: str,
) -> None:
    """Refuse a malformed join (the fields of `Coordinator.join`) before it waits.

    Raises:
        InvalidArgument: naming the first malformed field.
    """
    with fields():
        check_name("job", job)
        check_name("group", group)
        check_world_size(world_size)
        check_rank(rank, world_size)
        check_member_id(member_id)
        check_member_secret(member_secret)
        if job_seed is not None:
            check_u64("job_seed", job_seed)
        check_cursor(position, "position")
        if len(launch) > MAX_LAUNCH:
            raise InvalidArgument(
                f"launch is {len(launch)} characters long; at most {MAX_LAUNCH}",
                field="launch",
                value=repr(launch[:64]),
            )
