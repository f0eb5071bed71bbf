"""The contract's results as Python values, shared by the coordinator and the client.

The coordinator returns these from its domain logic and the servicer turns them into messages
with the `*_pb` functions; the client turns reply messages back into them with `from_pb`
functions. One definition per result, so both sides agree on every field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rngcoord.v1 import coordinator_pb2 as pb

__all__ = [
    "AuditRecord",
    "GroupInfo",
    "JoinResult",
    "Lease",
    "RestoreResult",
    "members_digest",
]


def members_digest(members: Iterable[tuple[int, str]]) -> bytes:
    """SHA-256 of a member set: of "RANK:MEMBER_ID\\n" for each (rank, member id) in rank order.

    >>> members_digest([(0, "a"), (1, "b")]).hex()[:16]
    '45e51abf5e17e7c6'
    """
    digest = hashlib.sha256()
    for rank, member_id in members:
        digest.update(f"{rank}:{member_id}\n".encode())
    return digest.digest()


@dataclass(frozen=True, slots=True)
class JoinResult:
    """The epoch a join barrier formed.

    Args:
        epoch: the epoch number, the same for every rank of the barrier.
        seed: the group's seed.
        start: where lease seq 0 of the epoch starts (the high-water mark at formation).
        job_seed: the job's root seed.
        world_size: number of ranks in the epoch.
        members_digest: `members_digest` of the epoch's member set.
        members: member ids by rank, when they were asked for; else empty. Default empty.
        store_id: the id of the store the coordinator serves from. Default "" (the server
            sets it on the reply).
    """

    epoch: int
    seed: int
    start: int
    job_seed: int
    world_size: int
    members_digest: bytes
    members: tuple[str, ...] = ()
    store_id: str = ""

    def to_pb(self, *, include_members: bool) -> pb.JoinGroupResponse:
        return pb.JoinGroupResponse(
            epoch=self.epoch,
            seed=self.seed,
            start=self.start,
            job_seed=self.job_seed,
            members=self.members if include_members else (),
            members_digest=self.members_digest,
            world_size=self.world_size,
            store_id=self.store_id,
        )

    @classmethod
    def from_pb(cls, reply: pb.JoinGroupResponse) -> JoinResult:
        return cls(
            reply.epoch,
            reply.seed,
            reply.start,
            reply.job_seed,
            reply.world_size,
            reply.members_digest,
            tuple(reply.members),
            reply.store_id,
        )


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease `[start, end)` of offsets for (group, epoch, seq).

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

    def to_pb(self) -> pb.ReserveResponse:
        lease = pb.Lease(
            group=self.group,
            epoch=self.epoch,
            seq=self.seq,
            seed=self.seed,
            start=self.start,
            end=self.end,
        )
        return pb.ReserveResponse(lease=lease, existing=self.existing)

    @classmethod
    def from_pb(cls, reply: pb.ReserveResponse) -> Lease:
        lease = reply.lease
        return cls(
            lease.group, lease.epoch, lease.seq, lease.seed, lease.start, lease.end, reply.existing
        )


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A group's state, with one page of its current epoch's members.

    Args:
        job: the job's name.
        group: the group's name.
        seed: the group's seed.
        epoch: the current epoch, 0 before the first forms.
        world_size: ranks in the current epoch (0 before the first forms).
        members_digest: `members_digest` of the current epoch's members (empty before the first
            epoch forms).
        members: member ids of ranks `members_from` onwards; "" marks a rank that left.
        members_from: the first rank of `members`.
        members_next: where the next page starts (`world_size` when this one is the last).
        high_water: one past the highest offset ever granted in the group.
        leases: number of leases granted in the current epoch.
        job_seed: the job's root seed.
        store_id: as in `JoinResult`. Default "".
    """

    job: str
    group: str
    seed: int
    epoch: int
    world_size: int
    members_digest: bytes
    members: tuple[str, ...]
    members_from: int
    members_next: int
    high_water: int
    leases: int
    job_seed: int
    store_id: str = ""

    def to_pb(self) -> pb.GetGroupResponse:
        return pb.GetGroupResponse(
            job=self.job,
            group=self.group,
            seed=self.seed,
            epoch=self.epoch,
            members=self.members,
            high_water=self.high_water,
            leases=self.leases,
            job_seed=self.job_seed,
            world_size=self.world_size,
            members_from=self.members_from,
            members_next=self.members_next,
            members_digest=self.members_digest,
            store_id=self.store_id,
        )

    @classmethod
    def from_pb(cls, reply: pb.GetGroupResponse) -> GroupInfo:
        return cls(
            reply.job,
            reply.group,
            reply.seed,
            reply.epoch,
            reply.world_size,
            reply.members_digest,
            tuple(reply.members),
            reply.members_from,
            reply.members_next,
            reply.high_water,
            reply.leases,
            reply.job_seed,
            reply.store_id,
        )


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """The outcome of a Restore.

    Args:
        cursor: where lease `seq` will start.
        existing: True when the same Restore had been recorded before.
    """

    cursor: int
    existing: bool

    def to_pb(self) -> pb.RestoreResponse:
        return pb.RestoreResponse(cursor=self.cursor, existing=self.existing)

    @classmethod
    def from_pb(cls, reply: pb.RestoreResponse) -> RestoreResult:
        return cls(reply.cursor, reply.existing)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One record of the audit chain.

    Args:
        id: position in the chain, from 1.
        ts_us: Unix time in microseconds when it was written.
        job: the job it concerns.
        group: the group it concerns ("" for a job record).
        kind: what happened: job, group, epoch, grant, divergence, restore, leave, join_timeout.
        actor: who caused it, for example "rank 1 member m-abc @ ipv4:10.0.0.7:5123".
        detail: what happened; its canonical JSON is what the hash covers.
        prev_hash: the previous record's hash.
        hash: this record's hash.
    """

    id: int
    ts_us: int
    job: str
    group: str
    kind: str
    actor: str
    detail: dict[str, Any] = field(default_factory=dict)
    prev_hash: str = ""
    hash: str = ""

    def to_pb(self) -> pb.AuditRecord:
        return pb.AuditRecord(
            id=self.id,
            ts_us=self.ts_us,
            job=self.job,
            group=self.group,
            kind=self.kind,
            actor=self.actor,
            detail=canonical_json(self.detail),
            prev_hash=self.prev_hash,
            hash=self.hash,
        )

    @classmethod
    def from_pb(cls, record: pb.AuditRecord) -> AuditRecord:
        detail: dict[str, Any] = json.loads(record.detail) if record.detail else {}
        return cls(
            record.id,
            record.ts_us,
            record.job,
            record.group,
            record.kind,
            record.actor,
            detail,
            record.prev_hash,
            record.hash,
        )


def canonical_json(value: object) -> str:
    """JSON with sorted keys, no spaces and ASCII escapes: the form the audit stores and hashes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
