"""Reserve: a lease for (group, epoch, seq), answered from memory, from one read, or granted
by the writer (docs/design.md §6, §7.4).

Reserve is the hot path. A hit (a lease already granted, asked again with the same size and
fingerprint) is answered from the cache when the feed is fresh; otherwise from one
primary-key join (`queries.RESERVE_LOOKUP`), unless memory knows the caller's epoch and
membership and lacks only the lease: that goes straight to the writer. A grant is one
operation of the group-commit writer that re-checks, inside its transaction, everything the
read path checked, so concurrent requests and other processes cannot slip between the
check and the change: a member of a replaced epoch never gets a new grant, whatever any
cache holds (§2.4). Every path fences the caller with `membership.fence`; a divergence is
recorded and named by rngcoord.server.core.divergences.
"""

from __future__ import annotations

import functools
import logging

from rngcoord.server.core import divergences
from rngcoord.server.core.cache import GroupState
from rngcoord.server.core.context import Handler
from rngcoord.server.core.membership import Caller, check_epoch, fence, fields, not_found
from rngcoord.server.errors import Divergence, FailedPrecondition, ResourceExhausted
from rngcoord.server.logs import event, get_logger
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import Tx, from_db
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import MAX_OFFSET, check_fingerprint, check_seq, check_size
from rngcoord.v1.types import Lease

__all__ = ["Grants"]

_log = get_logger("grants")


class Grants(Handler):
    """The Reserve RPC over one store.

    Args:
        context: the Coordinator's store access, memory, chain and clock.
    """

    async def reserve(self, caller: Caller, *, seq: int, size: int, fingerprint: bytes) -> Lease:
        """Return the lease (epoch, seq) of the caller's group, granting it durably if new.

        Lease seq k starts where lease k-1 ended (seq 0 at the epoch's start), unless a
        Restore set its start. A repeat with the same size and fingerprint reads the lease
        back without a write.

        Args:
            caller: who asks, as which member of which epoch (`membership.fence`).
            seq: the lease's position in the epoch.
            size: number of offsets, a multiple of 4 in [4, 2^64).
            fingerprint: digest of the random ops the caller ran, 1 to 64 bytes.

        Raises:
            InvalidArgument: a malformed field.
            NotFound: unknown job, group or epoch.
            StaleEpoch: the epoch has been replaced.
            NotMember: another member holds the caller's rank, or it left.
            PermissionDenied: BAD_CREDENTIAL, the secret is not the member's.
            FailedPrecondition: SEQ_OUT_OF_ORDER: seq - 1 is not granted yet.
            Divergence: the key was granted with another size or fingerprint, now or before.
            ResourceExhausted: the lease would end past 2^64 - 4.
        """
        caller.check()
        with fields():
            check_seq(seq)
            check_size(size)
            check_fingerprint(fingerprint)
        hit, known = self._hit(caller, seq, size, fingerprint)
        if hit is None and not known:
            hit = await self._read_hit(caller, seq, size, fingerprint)
        if hit is not None:
            return hit
        try:
            lease: Lease = await self._write(
                functools.partial(
                    self._grant_tx,
                    caller=caller,
                    seq=seq,
                    size=size,
                    fingerprint=fingerprint,
                    now_us=self._clock.now_us(),
                ),
                queries.reserve_ahead(caller.job, caller.group, caller.rank, seq),
            )
        except Divergence:
            self._cache.groups.drop((caller.job, caller.group))
            raise
        self._cache.leases.put(
            (caller.job, caller.group, caller.epoch, seq),
            queries.LeaseRow(lease.start, lease.end, size, fingerprint),
        )
        if _log.isEnabledFor(logging.DEBUG):  # the hot path pays one check
            event(
                _log,
                logging.DEBUG,
                "lease",
                job=caller.job,
                group=caller.group,
                epoch=caller.epoch,
                seq=seq,
                start=lease.start,
                end=lease.end,
                rank=caller.rank,
                existing=lease.existing,
            )
        return lease

    def _hit(
        self, caller: Caller, seq: int, size: int, fingerprint: bytes
    ) -> tuple[Lease | None, bool]:
        """The lease from memory, if memory holds it; and whether memory knows the caller's
        epoch and membership, so that a lease it lacks goes straight to the writer. A lease
        that memory lacks may still be in the store (memory is bounded), but the writer's
        transaction finds it there and answers it as a hit: a read first would only add a
        query to every grant."""
        if not self._fresh():
            return None, False
        state = self._cache.groups.get((caller.job, caller.group))
        if state is None or caller.epoch > state.epoch:
            return None, False  # a newer epoch may have formed elsewhere: ask the store
        check_epoch(state.epoch, caller.job, caller.group, caller.epoch)
        if state.diverged is not None:
            self._refuse_diverged(caller, state.diverged, seq)
            return None, True
        held = self._cache.members.get((caller.job, caller.group, caller.epoch, caller.rank))
        if held is None:
            return None, False
        fence(caller, state.epoch, held)
        lease = self._cache.leases.get((caller.job, caller.group, caller.epoch, seq))
        if lease is None or lease.size != size or lease.fingerprint != fingerprint:
            return None, True  # a grant, or a divergence, which the grant path records
        hit = Lease(caller.group, caller.epoch, seq, state.seed, lease.start, lease.end, True)
        return hit, True

    @staticmethod
    def _refuse_diverged(caller: Caller, stored: str, seq: int) -> None:
        """Refuse a Reserve of a diverged epoch, unless the writer must hear it first: it
        speaks at the very seq where the epoch diverged (`divergences.hears`)."""
        if not divergences.hears(stored, _point(seq), caller.rank):
            raise divergences.refusal(caller.job, caller.group, caller.epoch, stored, caller.rank)

    async def _read_hit(
        self, caller: Caller, seq: int, size: int, fingerprint: bytes
    ) -> Lease | None:
        """The lease from one store read, filling the cache; None when it must be granted."""
        job, group = caller.job, caller.group
        row = await self._read_row(queries.RESERVE_LOOKUP, (caller.rank, seq, job, group))
        if row is None:
            job_exists = await self._read(lambda tx: queries.job_seed(tx, job) is not None)
            raise not_found(job, group, job_exists)
        seed_db, current, diverged, member_id, left_us, secret = row[:6]
        start, end, granted_size, granted_fp = row[6:]
        seed = from_db(seed_db)
        self._cache.groups.put((job, group), GroupState(seed, int(current), diverged))
        check_epoch(int(current), job, group, caller.epoch)
        held = None
        if member_id is not None:
            held = queries.Member(
                member_id, left_us is not None, None if secret is None else bytes(secret)
            )
            self._cache.members.put((job, group, caller.epoch, caller.rank), held)
        fence(caller, int(current), held)
        if diverged is not None:
            self._refuse_diverged(caller, diverged, seq)
            return None
        if start is None:
            return None
        lease = queries.LeaseRow(
            from_db(start), from_db(end), from_db(granted_size), bytes(granted_fp)
        )
        self._cache.leases.put((job, group, caller.epoch, seq), lease)
        if lease.size != size or lease.fingerprint != fingerprint:
            return None
        return Lease(group, caller.epoch, seq, seed, lease.start, lease.end, True)

    def _grant_tx(
        self, tx: Tx, *, caller: Caller, seq: int, size: int, fingerprint: bytes, now_us: int
    ) -> Lease:
        """Grant (epoch, seq) inside the writer's transaction, re-checking everything. A
        divergence is raised as `Divergence`, whose writes commit."""
        job, group, epoch = caller.job, caller.group, caller.epoch
        state = queries.reserve_state(tx, job, group, caller.rank, seq)
        if state is None:
            raise not_found(job, group, queries.job_seed(tx, job) is not None)
        fence(caller, state.epoch, state.member)
        mine = divergences.Side(
            caller.rank, divergences.lease_sent(size, fingerprint), caller.actor, caller.peer
        )
        if state.diverged is not None:
            if not divergences.hears(state.diverged, _point(seq), caller.rank):
                raise divergences.refusal(job, group, epoch, state.diverged, caller.rank)
            raise divergences.add_side(
                tx,
                self._chain,
                job=job,
                group=group,
                epoch=epoch,
                at=_point(seq),
                where={"seq": seq},
                caller=mine,
                actor=caller.actor,
                now_us=now_us,
            )
        granted = state.granted
        if granted is not None:
            if granted.size == size and granted.fingerprint == fingerprint:
                return Lease(group, epoch, seq, state.seed, granted.start, granted.end, True)
            first_rank, first_actor, first_peer = state.granted_by or (0, "", "")
            raise divergences.record(
                tx,
                self._chain,
                job=job,
                group=group,
                epoch=epoch,
                at=_point(seq),
                where={"seq": seq},
                first=divergences.Side(
                    first_rank,
                    divergences.lease_sent(granted.size, granted.fingerprint),
                    first_actor,
                    first_peer,
                ),
                caller=mine,
                actor=caller.actor,
                now_us=now_us,
            )
        if state.restored_cursor is not None:
            start = state.restored_cursor
        elif seq == 0:
            assert state.epoch_start is not None
            start = state.epoch_start
        elif state.previous_end is None:
            raise FailedPrecondition(
                f"lease seq {seq} of group {group!r} epoch {epoch} requested before seq {seq - 1}",
                reason=pb.SEQ_OUT_OF_ORDER,
                job=job,
                group=group,
                epoch=epoch,
                seq=seq,
            )
        else:
            start = state.previous_end
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
        queries.insert_lease(
            tx,
            job,
            group,
            epoch,
            seq,
            queries.LeaseRow(start, end, size, fingerprint),
            rank=caller.rank,
            member_id=caller.member_id,
            actor=caller.actor,
            peer=caller.peer,
            now_us=now_us,
            high_water=state.high_water,
        )
        self._chain.append(
            tx,
            ts_us=now_us,
            job=job,
            group=group,
            kind="grant",
            actor=caller.actor,
            detail={
                "epoch": epoch,
                "seq": seq,
                "seed": state.seed,
                "start": start,
                "end": end,
                "size": size,
                "fingerprint": fingerprint.hex(),
                "rank": caller.rank,
            },
        )
        return Lease(group, epoch, seq, state.seed, start, end, False)


def _point(seq: int) -> str:
    """The divergence point of a lease seq."""
    return f"seq:{seq}"
