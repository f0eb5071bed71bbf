"""Restore: rewind a group's stream for a bitwise-exact resume, by consensus (docs/design.md
§7.6).

A Restore may reuse offsets, so it takes effect only once every current member of the epoch
has voted for the same (seq, cursor), each with its own credential (one vote per member that
holds its secret); an admin token may force it alone. Votes wait on futures, resolved here or,
through the change feed, when another process records the restore.
"""

from __future__ import annotations

import asyncio
import collections
import functools

from rngcoord.server.core.context import Context, Handler
from rngcoord.server.core.feed import FeedRecord
from rngcoord.server.core.membership import Caller, fields, read_epoch, read_member
from rngcoord.server.errors import FailedPrecondition, ResourceExhausted, RestoreTimeout
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import Tx
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import MAX_OFFSET, check_cursor, check_name, check_seq
from rngcoord.v1.types import RestoreResult

__all__ = ["RESTORE_ROOM", "Restores"]

RESTORE_ROOM = 1 << 32
"""The fewest offsets a Restore may leave a group: a cursor closer to the end would leave it
unable to continue for long, which a Restore must not do silently."""

_Key = tuple[str, str, int, int]


class Restores(Handler):
    """The Restore RPC over one store, and the votes waiting in this process.

    Args:
        context: the Coordinator's store access, memory, chain and clock.
    """

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        # (job, group, epoch, seq) -> resolved with the cursor once it takes effect.
        self._waiters: dict[_Key, asyncio.Future[int]] = {}
        self._voting: collections.Counter[_Key] = collections.Counter()

    def restored(self, record: FeedRecord) -> None:
        """A restore committed by any process: wake the votes waiting for it here."""
        key = (record.job, record.group, int(record.detail["epoch"]), int(record.detail["seq"]))
        waiter = self._waiters.get(key)
        if waiter is not None and not waiter.done():
            waiter.set_result(int(record.detail["cursor"]))

    async def restore(
        self,
        caller: Caller,
        *,
        seq: int,
        cursor: int,
        force: bool,
        timeout_s: float,
        from_job: str = "",
    ) -> RestoreResult:
        """The caller's vote to make lease `seq` of the current epoch start at `cursor`;
        returns once it takes effect (at once with `force`, which the gate allows admins
        only). Repeating a Restore that took effect returns existing=True.

        Raises:
            InvalidArgument, NotFound, StaleEpoch, NotMember, PermissionDenied: as for Reserve.
            FailedPrecondition: RESTORE_CONFLICT: the seq is already granted, restored to
                another cursor, or other members voted for another cursor.
            ResourceExhausted: the cursor leaves the group less than 2^32 offsets.
            RestoreTimeout: not every member voted within `timeout_s`; names those that did not.
        """
        caller.check(secret=not force)
        with fields():
            check_seq(seq)
            check_cursor(cursor)
            if from_job:
                check_name("from_job", from_job)
        job, group, epoch = caller.job, caller.group, caller.epoch
        if cursor > MAX_OFFSET - RESTORE_ROOM:
            raise ResourceExhausted(
                f"a restore of group {group!r} to cursor {cursor} leaves it {MAX_OFFSET - cursor} "
                f"offsets, less than 2^32: it could not continue for long; restore to an earlier "
                "cursor, or start a new job",
                job=job,
                group=group,
                start=cursor,
                size=RESTORE_ROOM,
            )
        key = (job, group, epoch, seq)
        waiter = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
        self._voting[key] += 1
        try:
            outcome = await self._write(
                functools.partial(
                    self._vote_tx,
                    caller=caller,
                    seq=seq,
                    cursor=cursor,
                    force=force,
                    now_us=self._clock.now_us(),
                    from_job=from_job if from_job != job else "",
                )
            )
            if outcome != "pending":
                if outcome == "effective" and not waiter.done():
                    waiter.set_result(cursor)
                return RestoreResult(cursor, existing=outcome == "existing")
            if not await self._clock.wait(waiter, timeout_s):  # type: ignore[arg-type]
                missing = await self._read(
                    functools.partial(
                        queries.restore_missing_voters,
                        job=job,
                        group=group,
                        epoch=epoch,
                        seq=seq,
                        limit=16,
                    )
                )
                raise RestoreTimeout(
                    f"restore of group {group!r} epoch {epoch} seq {seq} to cursor {cursor} "
                    f"timed out after {timeout_s:g}s: ranks {missing} did not ask for it; every "
                    "member must load the same checkpoint",
                    job=job,
                    group=group,
                    epoch=epoch,
                    seq=seq,
                    cursor=cursor,
                    missing=",".join(map(str, missing)),
                )
            if waiter.result() != cursor:
                raise FailedPrecondition(
                    f"seq {seq} of group {group!r} epoch {epoch} was restored to cursor "
                    f"{waiter.result()}, not {cursor}",
                    reason=pb.RESTORE_CONFLICT,
                    job=job,
                    group=group,
                    epoch=epoch,
                    seq=seq,
                    cursor=cursor,
                )
            return RestoreResult(cursor, existing=False)
        finally:
            self._voting[key] -= 1
            if self._voting[key] == 0:
                del self._voting[key]
                self._waiters.pop(key, None)

    def _vote_tx(
        self,
        tx: Tx,
        *,
        caller: Caller,
        seq: int,
        cursor: int,
        force: bool,
        now_us: int,
        from_job: str = "",
    ) -> str:
        """Record a Restore vote; return "existing" (recorded before), "effective" (this vote
        completed it, or it was forced) or "pending"."""
        job, group, epoch, rank = caller.job, caller.group, caller.epoch, caller.rank
        # A forced Restore is an admin's (the gate checks the token): it speaks for no member,
        # so only the epoch is fenced.
        g, row = read_epoch(tx, caller) if force else read_member(tx, caller)
        conflict = {"job": job, "group": group, "epoch": epoch, "seq": seq, "cursor": cursor}
        earlier = queries.restore_cursor(tx, job, group, epoch, seq)
        if earlier == cursor:
            return "existing"
        if earlier is not None:
            raise FailedPrecondition(
                f"seq {seq} of group {group!r} epoch {epoch} was already restored to "
                f"cursor {earlier}, not {cursor}",
                reason=pb.RESTORE_CONFLICT,
                **conflict,
            )
        if queries.lease_row(tx, job, group, epoch, seq) is not None:
            raise FailedPrecondition(
                f"lease {seq} of group {group!r} epoch {epoch} already granted: restore "
                "a seq that has not been reserved yet",
                reason=pb.RESTORE_CONFLICT,
                **conflict,
            )
        if force:
            voters, votes = [caller.actor], 0
        else:
            tally = queries.restore_tally(tx, job, group, epoch, seq)
            if tally is not None and tally[0] != cursor:
                raise FailedPrecondition(
                    f"rank {rank} asked to restore seq {seq} of group {group!r} epoch {epoch} to "
                    f"cursor {cursor}, but {tally[1]} members asked for cursor {tally[0]}: "
                    "every member must load the same checkpoint",
                    reason=pb.RESTORE_CONFLICT,
                    **conflict,
                )
            votes = queries.add_restore_vote(
                tx,
                job,
                group,
                epoch,
                seq,
                rank=rank,
                cursor=cursor,
                member_id=caller.member_id,
                actor=caller.actor,
                now_us=now_us,
            )
            if votes < row.world_size - row.left_count:
                return "pending"
            voters = queries.restore_voters(tx, job, group, epoch, seq, limit=64)
        queries.insert_restore(tx, job, group, epoch, seq, cursor, now_us)
        self._chain.append(
            tx,
            ts_us=now_us,
            job=job,
            group=group,
            kind="restore",
            actor=caller.actor,
            detail={
                "epoch": epoch,
                "seq": seq,
                "cursor": cursor,
                "high_water": g.high_water,
                "rank": rank,
                "forced": force,
                "votes": votes,
                "voters": voters,
                # Whose checkpoint the cursor comes from, where not this job's (the vote
                # that completed the restore says so; every member loaded the same state).
                **({"from_job": from_job} if from_job else {}),
            },
        )
        return "effective"
