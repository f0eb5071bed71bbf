"""Who is calling, as which member, and the one rule that serves only the current epoch's
members (docs/design.md §2.4, §7.2 and §11.3).

Every call that acts as a member (Reserve, Attest, a Restore vote, LeaveGroup) carries a
`Caller` and passes `fence` against what the store or the cache holds: the epoch must be the
group's current one, the rank must be held by the caller's member id, and the caller must hold
that member's credential, the secret it joined with (only its SHA-256 is kept, and compared in
constant time). A member id alone, which GetGroup lists, lets nobody act as that member.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rngcoord.server.errors import (
    InvalidArgument,
    NotFound,
    NotMember,
    PermissionDenied,
    StaleEpoch,
)
from rngcoord.server.storage import queries
from rngcoord.server.storage.queries import EpochRow, GroupRow, Member
from rngcoord.server.storage.store import Tx
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import (
    RuleViolation,
    check_member_id,
    check_member_secret,
    check_name,
    check_rank,
    check_u64,
)

__all__ = [
    "Caller",
    "fence",
    "fields",
    "not_found",
    "rank_list",
    "read_epoch",
    "read_member",
    "secret_hash",
    "wait_s",
]

# Ranks an ErrorInfo's metadata lists before it cuts the list short.
_LISTED_RANKS = 16


@contextlib.contextmanager
def fields() -> Iterator[None]:
    """Turn a broken contract rule (rngcoord.v1.rules) into the INVALID_ARGUMENT refusal."""
    try:
        yield
    except RuleViolation as violation:
        raise InvalidArgument.of(violation) from None


def rank_list(ranks: Sequence[int], total: int | None = None) -> str:
    """A rank list for ErrorInfo metadata: "0,2,5", cut short past 16 as "0,...,15,+N"."""
    total = len(ranks) if total is None else total
    shown = ",".join(str(r) for r in ranks[:_LISTED_RANKS])
    extra = total - min(len(ranks), _LISTED_RANKS)
    return f"{shown},+{extra}" if extra > 0 else shown


def secret_hash(secret: bytes) -> bytes:
    """What the store keeps of a member secret."""
    return hashlib.sha256(b"rngcoord/v1/member-secret\0" + secret).digest()


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as which member of which epoch.

    Args:
        job: the job's name.
        group: the group's name.
        epoch: the epoch the caller says it belongs to.
        rank: its rank in the epoch.
        member_id: its member id (one process incarnation).
        secret: the member secret it joined with.
        actor: the token identity that asks, for the audit log. Default "".
        peer: the caller's address, for the audit log. Default "".
    """

    job: str
    group: str
    epoch: int
    rank: int
    member_id: str
    secret: bytes
    actor: str = ""
    peer: str = ""

    def check(self, *, secret: bool = True) -> Caller:
        """Refuse a malformed field (INVALID_ARGUMENT); return the caller. `secret`: whether
        it must carry a member secret (an admin's forced Restore speaks for no member)."""
        with fields():
            check_name("job", self.job)
            check_name("group", self.group)
            check_u64("epoch", self.epoch)
            check_rank(self.rank)
            check_member_id(self.member_id)
            if secret:
                check_member_secret(self.secret)
        return self

    @property
    def secret_hash(self) -> bytes:
        return secret_hash(self.secret)


def not_found(job: str, group: str, job_exists: bool) -> NotFound:
    if not job_exists:
        return NotFound(
            f"unknown job {job!r}: a JoinGroup creates it", reason=pb.UNKNOWN_JOB, job=job
        )
    return NotFound(
        f"unknown group {group!r} in job {job!r}: a JoinGroup creates it",
        reason=pb.UNKNOWN_GROUP,
        job=job,
        group=group,
    )


def check_epoch(current: int, job: str, group: str, epoch: int) -> None:
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


def bad_credential(job: str, group: str, epoch: int, rank: int) -> PermissionDenied:
    return PermissionDenied(
        f"rank {rank} of group {group!r} epoch {epoch}: the member secret is not the one this "
        "member joined with; only the process that joined may act as it (rejoin to get a "
        "membership of your own)",
        reason=pb.BAD_CREDENTIAL,
        job=job,
        group=group,
        epoch=epoch,
        rank=rank,
    )


def fence(caller: Caller, current_epoch: int, member: Member | None, *, left: bool = False) -> None:
    """The rule every member call passes: the current epoch, the caller's rank held by its
    member id (and not left, unless `left`), and the caller holding that member's secret.

    Raises:
        NotFound: UNKNOWN_EPOCH, an epoch that does not exist (yet).
        StaleEpoch: the epoch was replaced.
        NotMember: another member holds the rank, or it left.
        PermissionDenied: BAD_CREDENTIAL, the secret is not the member's.
    """
    check_epoch(current_epoch, caller.job, caller.group, caller.epoch)
    if member is None or member.member_id != caller.member_id or (member.left and not left):
        raise NotMember(
            f"rank {caller.rank} member {caller.member_id!r} is not a member of epoch "
            f"{caller.epoch} of group {caller.group!r}; rejoin the group",
            job=caller.job,
            group=caller.group,
            epoch=caller.epoch,
            rank=caller.rank,
            member_id=caller.member_id,
        )
    if member.secret_hash is None or not hmac.compare_digest(
        member.secret_hash, caller.secret_hash
    ):
        raise bad_credential(caller.job, caller.group, caller.epoch, caller.rank)


def read_member(tx: Tx, caller: Caller, *, left: bool = False) -> tuple[GroupRow, EpochRow]:
    """Read the caller's group, epoch and membership in `tx` and `fence` them; return the
    group and its current epoch."""
    g = _group(tx, caller)
    held = queries.member(tx, caller.job, caller.group, caller.epoch, caller.rank)
    fence(caller, g.epoch, held, left=left)
    row = queries.epoch_row(tx, caller.job, caller.group, caller.epoch)
    assert row is not None  # the member row exists, so its epoch does
    return g, row


def read_epoch(tx: Tx, caller: Caller) -> tuple[GroupRow, EpochRow]:
    """Read the caller's group and epoch and fence the epoch only (an admin's call, which
    speaks for no member)."""
    g = _group(tx, caller)
    check_epoch(g.epoch, caller.job, caller.group, caller.epoch)
    row = queries.epoch_row(tx, caller.job, caller.group, caller.epoch)
    assert row is not None
    return g, row


def _group(tx: Tx, caller: Caller) -> GroupRow:
    g = queries.group_row(tx, caller.job, caller.group)
    if g is None:
        raise not_found(caller.job, caller.group, queries.job_seed(tx, caller.job) is not None)
    return g


def wait_s(
    requested_s: float | None, remaining_s: float | None, default_s: float, max_s: float
) -> float:
    """How long a JoinGroup or Restore waits: what the request asks (its default when it asks
    nothing), capped by the server's maximum and by the caller's own deadline (waiting past it
    would keep a place for nobody).

    Raises:
        InvalidArgument: a wait that is not positive.
    """
    wanted = default_s if requested_s is None else requested_s
    if not (math.isfinite(wanted) and wanted > 0):
        raise InvalidArgument(
            f"invalid timeout {wanted!r}: it must be positive", field="timeout_ms", value=wanted
        )
    wanted = min(wanted, max_s)
    if remaining_s is not None:
        wanted = max(min(wanted, remaining_s), 0.001)
    return wanted
