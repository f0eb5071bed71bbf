"""Join barriers: epochs formed from the joins of a group's ranks, with no thread per waiter.

A join is a coroutine. It waits on a future, never on a thread, so 10^5 ranks can wait on one
group while the server keeps answering everything else; a caller that cancels (or whose
connection drops) is withdrawn at once.

Arrivals are written in batches. The joins of one group that arrive while that group's
previous batch is being written are written together, in one operation of the store's
group-commit writer: one savepoint for the whole batch, one `executemany` of its pending rows,
and O(1) statements besides. The barrier's state is two counters on the group's row
(`barrier_size`, `barrier_count`), so no statement reads all the waiting ranks until the epoch
forms. Expired pending rows (of waiters whose server died) are swept by the next batch, each
row once.

When the count reaches the world size, that batch forms the epoch in the same transaction: the
pending rows become the epoch's `members`, their digest is recorded, the group's epoch rises
(fencing every older one) and an `epoch` audit record is appended. The waiters of this process
wake at once; those of other processes (workers, replicas) wake when their change feed
(rngcoord.server.core.feed) reads the audit record.

A waiter whose deadline passes withdraws its pending row (if it still holds it), appends a
`join_timeout` record naming up to 16 missing ranks, and fails with JOIN_TIMEOUT. The deadline
comes from the injectable clock (rngcoord.server.clock).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rngcoord.server.audit.chain import Chain
from rngcoord.server.clock import Clock
from rngcoord.server.core.joins import (
    LISTED_RANKS,
    JoinRequest,
    formed_without,
    in_use,
    never_recorded,
    ranks_text,
)
from rngcoord.server.core.membership import bad_credential, rank_list
from rngcoord.server.core.seeds import draw_job_seed
from rngcoord.server.errors import CoordinatorError, FailedPrecondition, JoinTimeout
from rngcoord.server.logs import event, get_logger
from rngcoord.server.storage import barrier_queries, queries
from rngcoord.server.storage.store import Store, StoreLost, Tx
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.seeds import group_seed
from rngcoord.v1.types import JoinResult, members_digest

__all__ = ["Barriers"]

T = TypeVar("T")

_MAX_BATCH = 4096
_log = get_logger("barrier")


@dataclass(eq=False, slots=True)
class _Waiter:
    request: JoinRequest
    formed: asyncio.Future[JoinResult] = field(default_factory=asyncio.Future)
    # Its pending row is committed: an epoch that formed without it means it lost its place.
    flushed: bool = False
    # The caller went away before its pending row was committed: withdraw it once it is.
    cancelled: bool = False


@dataclass(slots=True)
class _Group:
    arrivals: list[tuple[_Waiter, asyncio.Future[JoinResult | None]]] = field(default_factory=list)
    flushing: bool = False
    waiters: set[_Waiter] = field(default_factory=set)


_WAITING = object()


class Barriers:
    """The join barriers of one coordinator process.

    Args:
        store: where pending joins and epochs live.
        read: runs a read-only function of a transaction from the event loop.
        clock: the time source.
        on_formed: called with (job, group, epoch) when this process forms an epoch, before
            its waiters wake (the coordinator drops its cached state of the group).
        on_lost: called with the `StoreLost` error when a batch finds the store lost, so
            that the coordinator stops serving it.
        chain: how audit records are hashed.
    """

    def __init__(
        self,
        store: Store,
        read: Callable[[Callable[[Tx], T]], Awaitable[T]],
        clock: Clock,
        on_formed: Callable[[str, str, int], None],
        on_lost: Callable[[StoreLost], None],
        chain: Chain,
    ) -> None:
        self._store = store
        self._chain = chain
        self._read: Callable[[Callable[[Tx], Any]], Awaitable[Any]] = read
        self._clock = clock
        self._on_formed = on_formed
        self._on_lost = on_lost
        self._groups: dict[tuple[str, str], _Group] = {}
        # (job, group) -> (when, world size, first missing ranks, how many): what `_missing`
        # read, dropped whenever this process writes arrivals of the group.
        self._missing_cache: dict[tuple[str, str], tuple[float, int, list[int], int]] = {}

    @property
    def waiting(self) -> int:
        """Joins of this process waiting for their epoch."""
        return sum(len(g.waiters) for g in self._groups.values())

    async def join(self, request: JoinRequest) -> JoinResult:
        """Wait until the barrier of `request`'s group forms an epoch with this rank in it.

        Raises:
            FailedPrecondition: SEED_CONFLICT or WORLD_SIZE_MISMATCH.
            JoinTimeout: the epoch did not form within `request.timeout_s`.
            asyncio.CancelledError: the caller went away; its pending join was withdrawn.
        """
        deadline = self._clock.monotonic() + request.timeout_s
        key = (request.job, request.group)
        group = self._groups.setdefault(key, _Group())
        waiter = _Waiter(request)
        group.waiters.add(waiter)
        decided: asyncio.Future[JoinResult | None] = asyncio.get_running_loop().create_future()
        group.arrivals.append((waiter, decided))
        if not group.flushing:
            group.flushing = True
            asyncio.get_running_loop().create_task(self._flush(key, group))
        try:
            # Shielded: a cancelled caller must not cancel the batch's decision about it.
            outcome = await asyncio.shield(decided)
            if outcome is not None:
                return outcome
            if waiter.formed.done():
                return waiter.formed.result()
            if not await self._clock.wait(
                waiter.formed,  # type: ignore[arg-type]
                deadline - self._clock.monotonic(),
            ):
                return await self._timed_out(waiter)
            return waiter.formed.result()
        except asyncio.CancelledError:
            # The caller is gone: free its place now rather than at its expiry.
            if not waiter.flushed:
                waiter.cancelled = True  # _flush withdraws it once its row is written
            elif not waiter.formed.done():
                await asyncio.shield(self._withdraw(waiter, audit_timeout=False))
            raise
        finally:
            group.waiters.discard(waiter)
            self._forget(key, group)

    def _forget(self, key: tuple[str, str], group: _Group) -> None:
        idle = not group.waiters and not group.arrivals and not group.flushing
        if idle and self._groups.get(key) is group:
            del self._groups[key]

    # ----------------------------------------------------------------------- batches

    async def _flush(self, key: tuple[str, str], group: _Group) -> None:
        """Write the group's arrivals in batches until none is left."""
        try:
            while group.arrivals:
                batch, group.arrivals = group.arrivals[:_MAX_BATCH], group.arrivals[_MAX_BATCH:]
                requests = [w.request for w, _ in batch]
                self._missing_cache.pop(key, None)
                drawn = draw_job_seed()
                now_us = self._clock.now_us()
                try:
                    outcomes, formed = await asyncio.wrap_future(
                        self._store.submit(
                            functools.partial(
                                self._batch_tx, requests=requests, drawn=drawn, now_us=now_us
                            )
                        )
                    )
                except Exception as exc:  # the store failed: every join of the batch fails
                    if isinstance(exc.__cause__, StoreLost):
                        self._on_lost(exc.__cause__)
                    for _, decided in batch:
                        if not decided.done():
                            decided.set_exception(exc)
                    continue
                # Waiters of earlier batches first: this batch's are decided below.
                for result, members in formed:
                    self._on_formed(key[0], key[1], result.epoch)
                    self._wake(group, result, dict(members))
                for (waiter, decided), outcome in zip(batch, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        decided.set_exception(outcome)
                    elif outcome is _WAITING:
                        waiter.flushed = True
                        decided.set_result(None)
                        if waiter.cancelled and not waiter.formed.done():
                            asyncio.get_running_loop().create_task(
                                self._withdraw(waiter, audit_timeout=False)
                            )
                    else:
                        assert isinstance(outcome, JoinResult)
                        decided.set_result(outcome)
        finally:
            group.flushing = False
            self._forget(key, group)

    def _batch_tx(
        self, tx: Tx, *, requests: Sequence[JoinRequest], drawn: int, now_us: int
    ) -> tuple[list[object], list[tuple[JoinResult, list[tuple[int, str]]]]]:
        """Record a batch of joins of one group; return each one's outcome (a JoinResult, an
        exception, or _WAITING) and the epochs formed, with their members.

        Pure function of the transaction: the writer may run it again on a retry.
        """
        job, group = requests[0].job, requests[0].group
        first = requests[0]
        stored = queries.job_seed(tx, job)
        if stored is None:
            never_recorded(tx, job, "", "job")
            asked = next((r.job_seed for r in requests if r.job_seed is not None), None)
            stored = drawn if asked is None else asked
            queries.insert_job(tx, job, stored, now_us)
            self._chain.append(
                tx,
                ts_us=now_us,
                job=job,
                group="",
                kind="job",
                actor=first.actor,
                detail={"seed": stored},
            )
        g = queries.group_row(tx, job, group)
        if g is None:
            never_recorded(tx, job, group, "group")
            floor = queries.floor_of(tx, job, group)
            g = queries.insert_group(tx, job, group, group_seed(stored, group), floor)
            detail: dict[str, object] = {"seed": g.seed}
            if floor:
                detail["floor"] = floor
            self._chain.append(
                tx,
                ts_us=now_us,
                job=job,
                group=group,
                kind="group",
                actor=first.actor,
                detail=detail,
            )
        count = max(0, g.barrier_count - barrier_queries.sweep_expired(tx, job, group, now_us))
        size = g.barrier_size if count else 0
        ranks = [r.rank for r in requests]
        current = queries.epoch_row(tx, job, group, g.epoch) if g.epoch else None
        in_current = queries.members_of_ranks(tx, job, group, g.epoch, ranks) if current else {}
        pending = {
            rank: (row.member_id, row.secret_hash)
            for rank, row in barrier_queries.pending_of_ranks(tx, job, group, ranks).items()
        }
        epoch, high_water = g.epoch, g.high_water
        live: list[queries.EpochLaunch | None] = []  # the current epoch's, read once if needed
        outcomes: list[object] = []
        formed: list[tuple[JoinResult, list[tuple[int, str]]]] = []
        upserts: list[tuple[object, ...]] = []
        waiting_since: list[int] = []  # outcomes decided _WAITING in the current barrier
        for i, r in enumerate(requests):
            if r.job_seed is not None and r.job_seed != stored:
                outcomes.append(
                    FailedPrecondition(
                        f"job {job!r} has root seed {stored}; the request asked for {r.job_seed}",
                        reason=pb.SEED_CONFLICT,
                        job=job,
                        seed=stored,
                        requested_seed=r.job_seed,
                    )
                )
                continue
            if (
                current is not None
                and current.world_size == r.world_size
                and in_current.get(r.rank) == r.member_id
            ):
                held = queries.member(tx, job, group, epoch, r.rank)
                if held is None or not _same_secret(held.secret_hash, r.secret_hash):
                    outcomes.append(bad_credential(job, group, epoch, r.rank))
                    continue
                outcomes.append(
                    JoinResult(
                        epoch,
                        g.seed,
                        current.start,
                        stored,
                        current.world_size,
                        current.members_digest,
                    )
                )
                continue
            refusal = in_use(tx, r, epoch, live, now_us) if current is not None else None
            if refusal is not None:
                outcomes.append(refusal)
                continue
            if count and size != r.world_size:
                if upserts:
                    barrier_queries.upsert_pending(tx, job, group, upserts)
                    upserts = []
                waiting = barrier_queries.pending_ranks(tx, job, group, LISTED_RANKS)
                outcomes.append(
                    FailedPrecondition(
                        f"rank {r.rank} joined group {group!r} with world size {r.world_size}, "
                        f"but ranks {ranks_text(waiting, count)} are waiting with world size "
                        f"{size}; every rank of a barrier must join with the same world size",
                        reason=pb.WORLD_SIZE_MISMATCH,
                        job=job,
                        group=group,
                        world_size=r.world_size,
                        waiting_world_size=size,
                        ranks=rank_list(waiting, count),
                    )
                )
                continue
            waiting_as = pending.get(r.rank)
            if (
                waiting_as is not None
                and waiting_as[0] == r.member_id
                and not _same_secret(waiting_as[1], r.secret_hash)
            ):
                outcomes.append(bad_credential(job, group, 0, r.rank))
                continue
            if r.position > high_water:
                self._skip_gap(tx, r, high_water, now_us)
                high_water = r.position
            if r.rank not in pending:
                count += 1
            pending[r.rank] = (r.member_id, r.secret_hash)
            size = r.world_size
            expires_us = now_us + math.ceil(r.timeout_s * 1e6)
            upserts.append(
                (r.rank, r.member_id, r.world_size, expires_us, now_us, r.peer, r.secret_hash)
            )
            outcomes.append(_WAITING)
            waiting_since.append(i)
            if count < size:
                continue
            # The barrier is complete: the pending rows become the next epoch.
            barrier_queries.upsert_pending(tx, job, group, upserts)
            upserts = []
            members = barrier_queries.pending_members(tx, job, group)
            digest = members_digest(members)
            first_us = barrier_queries.first_pending_us(tx, job, group)
            epoch += 1
            queries.insert_epoch(
                tx,
                job,
                group,
                epoch,
                world_size=size,
                start=high_water,
                digest=digest,
                now_us=now_us,
                launch=r.launch,
                restart_count=r.restart_count,
            )
            barrier_queries.promote_pending(tx, job, group, epoch)
            self._chain.append(
                tx,
                ts_us=now_us,
                job=job,
                group=group,
                kind="epoch",
                actor=r.actor,
                detail={
                    "epoch": epoch,
                    "world_size": size,
                    "start": high_water,
                    "members_digest": digest.hex(),
                    "previous_epoch": epoch - 1,
                    # From the first pending join to the epoch: how long the barrier waited.
                    "waited_s": round(max(0, now_us - (first_us or now_us)) / 1e6, 3),
                    **({"launch": r.launch} if r.launch else {}),
                },
            )
            result = JoinResult(epoch, g.seed, high_water, stored, size, digest)
            member_of = dict(members)
            for j in waiting_since:
                req = requests[j]
                if member_of.get(req.rank) == req.member_id:
                    outcomes[j] = result
            formed.append((result, members))
            current = queries.EpochRow(epoch, size, high_water, digest, None, 0)
            live = [queries.EpochLaunch(r.launch, r.restart_count, now_us)]
            in_current = {rank: member_of[rank] for rank in ranks if rank in member_of}
            count, size, pending, waiting_since = 0, 0, {}, []
        if upserts:
            barrier_queries.upsert_pending(tx, job, group, upserts)
        queries.set_barrier(tx, job, group, size, count)
        return outcomes, formed

    def _skip_gap(self, tx: Tx, r: JoinRequest, high_water: int, now_us: int) -> None:
        """Move the group's high-water mark up to where the joining member knows its grants
        reach: the store lost grants that ranks still hold (docs/design.md §11.6), and the
        epoch about to form must start past them."""
        queries.set_high_water(tx, r.job, r.group, r.position)
        self._chain.append(
            tx,
            ts_us=now_us,
            job=r.job,
            group=r.group,
            kind="failover-gap",
            actor=r.actor,
            detail={
                "from": high_water,
                "to": r.position,
                "rank": r.rank,
                "member_id": r.member_id,
            },
        )
        event(
            _log,
            logging.WARNING,
            "failover_gap",
            job=r.job,
            group=r.group,
            high_water=high_water,
            position=r.position,
            rank=r.rank,
            member_id=r.member_id,
        )

    # ------------------------------------------------------------------------ waking

    def _wake(self, group: _Group, result: JoinResult, members: dict[int, str]) -> None:
        """Resolve the waiters of `group` that the epoch `result` includes; fail the flushed
        ones it does not (their pending row is gone: another member took the rank)."""
        for waiter in list(group.waiters):
            if waiter.formed.done():
                continue
            r = waiter.request
            if members.get(r.rank) == r.member_id:
                waiter.formed.set_result(result)
            elif waiter.flushed:
                waiter.formed.set_exception(formed_without(r, result.epoch))

    async def epoch_formed(self, job: str, group: str, epoch: int) -> None:
        """An epoch of `group` formed in another process: wake this process's waiters in it."""
        state = self._groups.get((job, group))
        if state is None:
            return
        # Waiters whose batch is still being written count too: the epoch may include them if
        # their batch committed before it formed and its answer has not reached this loop yet.
        waiters = [w for w in state.waiters if not w.formed.done()]
        if not waiters:
            return
        ranks = [w.request.rank for w in waiters]

        def read(tx: Tx) -> tuple[JoinResult | None, dict[int, str], dict[int, str], bool]:
            g = queries.group_row(tx, job, group)
            row = queries.epoch_row(tx, job, group, epoch)
            seed = queries.job_seed(tx, job)
            if g is None or row is None or seed is None:
                return None, {}, {}, False
            result = JoinResult(epoch, g.seed, row.start, seed, row.world_size, row.members_digest)
            members = queries.members_of_ranks(tx, job, group, epoch, ranks)
            pending = barrier_queries.pending_of_ranks(tx, job, group, ranks)
            return result, members, {r: p.member_id for r, p in pending.items()}, g.epoch == epoch

        result, members, pending, current = await self._read(read)
        if result is None:
            return
        for waiter in waiters:
            if waiter.formed.done():
                continue
            r = waiter.request
            if members.get(r.rank) == r.member_id:
                waiter.formed.set_result(result)
            elif current and waiter.flushed and pending.get(r.rank) != r.member_id:
                waiter.formed.set_exception(formed_without(r, epoch))
            # else: it waits in the next barrier (or its batch is still being written). A late
            # notice of an epoch the group has moved past says nothing of a waiter that is not
            # in it: its pending row may be gone because a newer epoch took it in, whose answer
            # has not reached this loop yet (test_launches met it: a takeover's rank told that
            # the epoch before it formed without it).

    # --------------------------------------------------------------------- withdrawal

    async def _timed_out(self, waiter: _Waiter) -> JoinResult:
        r = waiter.request
        missing = await self._missing(r.job, r.group, r.world_size)
        result = await self._withdraw(waiter, audit_timeout=True, missing=missing)
        if isinstance(result, JoinResult):
            return result
        message, missing_ranks, missing_count = result
        raise JoinTimeout(
            f"join of group {r.group!r} timed out after {r.timeout_s:g}s: {message}",
            job=r.job,
            group=r.group,
            world_size=r.world_size,
            missing=rank_list(missing_ranks, missing_count),
        )

    async def _missing(self, job: str, group: str, world_size: int) -> tuple[list[int], int]:
        """The first missing ranks of a barrier and how many: read once per group per second
        and shared by this process's waiters, since naming them reads every pending rank and a
        barrier of 10^5 ranks that times out times out 10^5 joins at once."""
        now = self._clock.monotonic()
        cached = self._missing_cache.get((job, group))
        if cached is not None and cached[1] == world_size and now - cached[0] < 1.0:
            return cached[2], cached[3]
        first, count = await self._read(
            lambda tx: barrier_queries.missing_ranks(tx, job, group, world_size, LISTED_RANKS + 1)
        )
        self._missing_cache[job, group] = (now, world_size, first, count)
        return first, count

    async def _withdraw(
        self,
        waiter: _Waiter,
        *,
        audit_timeout: bool,
        missing: tuple[list[int], int] = ([], 0),
    ) -> JoinResult | tuple[str, list[int], int]:
        r = waiter.request
        now_us = self._clock.now_us()
        try:
            return await asyncio.wrap_future(
                self._store.submit(
                    functools.partial(
                        self._withdraw_tx,
                        r=r,
                        now_us=now_us,
                        audit_timeout=audit_timeout,
                        missing=missing,
                    )
                )
            )
        except CoordinatorError:
            raise
        except Exception:
            event(_log, logging.WARNING, "withdraw_failed", exc_info=True, group=r.group)
            raise

    def _withdraw_tx(
        self,
        tx: Tx,
        *,
        r: JoinRequest,
        now_us: int,
        audit_timeout: bool,
        missing: tuple[list[int], int],
    ) -> JoinResult | tuple[str, list[int], int]:
        """Withdraw `r`'s pending join; return the epoch if it formed with `r` after all, else
        (why the barrier did not complete, the first missing ranks, how many are missing),
        from `missing` as read before (the rank itself, which did come, left out)."""
        g = queries.group_row(tx, r.job, r.group)
        if g is None:
            return "the group no longer exists", [], 0
        if (
            g.epoch
            and queries.members_of_ranks(tx, r.job, r.group, g.epoch, [r.rank]).get(r.rank)
            == r.member_id
        ):
            row = queries.epoch_row(tx, r.job, r.group, g.epoch)
            seed = queries.job_seed(tx, r.job)
            assert row is not None and seed is not None
            return JoinResult(g.epoch, g.seed, row.start, seed, row.world_size, row.members_digest)
        if barrier_queries.withdraw_pending(tx, r.job, r.group, r.rank, r.member_id):
            queries.set_barrier(tx, r.job, r.group, g.barrier_size, g.barrier_count - 1)
        elif barrier_queries.pending_of_ranks(tx, r.job, r.group, [r.rank]):
            return f"rank {r.rank} is now joining as another member, not {r.member_id!r}", [], 0
        first, missing_count = missing
        if r.rank in first:
            missing_count -= 1
        listed = [m for m in first if m != r.rank][:LISTED_RANKS]
        if audit_timeout:
            self._chain.append(
                tx,
                ts_us=now_us,
                job=r.job,
                group=r.group,
                kind="join_timeout",
                actor=r.actor,
                detail={
                    "rank": r.rank,
                    "world_size": r.world_size,
                    "missing": listed,
                    "missing_count": missing_count,
                    "timeout_s": r.timeout_s,
                },
            )
        return (
            f"ranks {ranks_text(listed, missing_count)} of world size {r.world_size} did not join",
            listed,
            missing_count,
        )


def _same_secret(stored: bytes | None, presented: bytes) -> bool:
    return stored is not None and hmac.compare_digest(stored, presented)
