"""The coordinator's rules: joins, leases, leaves, restores and the audit listing, on one store.

`Coordinator` is transport-free and asynchronous: it runs on the event loop of a coordinator
process, waits on futures (never on threads), and leaves the store work to the store's
group-commit writer thread and to reader threads. Its layers:

- field checks: rngcoord.v1.rules, shared with the client;
- SQL and row decoding: rngcoord.server.queries;
- the join barrier: rngcoord.server.barrier;
- what a hit answers from memory: rngcoord.server.cache, kept current by the change feed
  (rngcoord.server.feed) across the processes that share the store;
- results: rngcoord.v1.types, shared with the client.

Reserve is the hot path. A hit (a lease already granted, asked again with the same size and
fingerprint) is answered from the cache when the feed is fresh; otherwise from one
primary-key join (`queries.RESERVE_LOOKUP`). A grant is one operation of the group-commit
writer that re-checks, inside its transaction, everything the read path checked, so
concurrent requests and other processes cannot slip between the check and the change: a
member of a replaced epoch never gets a new grant, whatever any cache holds (docs/design.md
§2.4, §7.4).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rngcoord.server import audit, queries
from rngcoord.server.audit import Chain
from rngcoord.server.barrier import Barriers, JoinRequest, rank_list
from rngcoord.server.cache import AttestationKey, Cache, GroupState
from rngcoord.server.clock import Clock, SystemClock
from rngcoord.server.errors import (
    Divergence,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotMember,
    ResourceExhausted,
    RestoreTimeout,
    StaleEpoch,
    Unavailable,
)
from rngcoord.server.feed import Feed, FeedRecord
from rngcoord.server.logs import event, get_logger
from rngcoord.server.store import Store, StoreLost, Tx, from_db
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.rules import (
    MAX_OFFSET,
    RuleViolation,
    check_attested_ops,
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
from rngcoord.v1.types import AuditRecord, GroupInfo, JoinResult, Lease, RestoreResult

__all__ = ["Coordinator"]

T = TypeVar("T")
_log = get_logger("coordinator")

_AUDIT_PAGE = 500
RESTORE_ROOM = 1 << 32
"""The fewest offsets a Restore may leave a group: a cursor closer to the end would leave it
unable to continue for long, which a Restore must not do silently."""
MEMBERS_PAGE = 1024
"""Members GetGroup returns when the request sets no limit."""
MAX_MEMBERS_PAGE = 65536


@contextlib.contextmanager
def _fields() -> Iterator[None]:
    """Turn a broken contract rule (rngcoord.v1.rules) into the INVALID_ARGUMENT refusal."""
    try:
        yield
    except RuleViolation as violation:
        raise InvalidArgument.of(violation) from None


def _not_found(job: str, group: str, job_exists: bool) -> NotFound:
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
        ranks=rank_list(record.get("ranks", [])),
    )


class Coordinator:
    """The seed/offset authority over one store, for one process's event loop.

    Args:
        store: where state and the audit chain live; shared by all workers and replicas.
        join_timeout_s: how long a join waits when the request sets no timeout. Default 60.
        max_join_timeout_s: the most any join waits, whatever the request asks. Default 1800.
        clock: the time source. Default: the system clock.
        staleness_s: how old the change feed's last confirmation may be for a hit to be
            answered from memory (docs/design.md §7.4). Default 0.5.
        feed_poll_s: how often the change feed looks for other processes' changes. Default
            None: 0.02 s on SQLite (a lock-free counter), 0.1 s on PostgreSQL (which also
            notifies).
        chain: how audit records are hashed (keyed or not; see rngcoord.server.audit.open_chain).
            Default: the store's unkeyed chain.
        watch_s: how often to check that the store is still the one opened (its file, its
            schema, its id). Default 1.

    Call `start()` on the event loop before serving and `close()` after.
    """

    def __init__(
        self,
        store: Store,
        *,
        join_timeout_s: float = 60.0,
        max_join_timeout_s: float = 1800.0,
        clock: Clock | None = None,
        staleness_s: float = 0.5,
        feed_poll_s: float | None = None,
        chain: Chain | None = None,
        watch_s: float = 1.0,
    ) -> None:
        self._store = store
        self._chain = chain if chain is not None else Chain(store.store_id)
        self._head = (0, audit.GENESIS_HASH)
        self._anchor = ""
        self._join_timeout_s = join_timeout_s
        self._max_join_timeout_s = max_join_timeout_s
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._cache = Cache()
        # SQLite reads take microseconds from the page cache and never wait for the writer
        # (WAL), so they run on the event loop; PostgreSQL reads are round trips, in threads.
        self._inline_reads = store.dialect == "sqlite"
        self._readers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rngcoord-read")
        self._barriers = Barriers(store, self._read, self._clock, self._formed_here, self._chain)
        poll = feed_poll_s if feed_poll_s is not None else (0.02 if self._inline_reads else 0.1)
        self._feed = Feed(
            store,
            self._read,
            self._on_change,
            self._clock,
            poll_s=poll,
            staleness_s=staleness_s,
            on_head=self._saw_head,
        )
        self._feed_task: asyncio.Task[None] | None = None
        # Restores being voted on: (job, group, epoch, seq) -> resolved with the cursor once
        # it takes effect, here or (read from the change feed) in another process.
        self._restore_waiters: dict[tuple[str, str, int, int], asyncio.Future[int]] = {}
        self._restore_voting: collections.Counter[tuple[str, str, int, int]] = collections.Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._lost: str | None = None
        self._write_failure: str | None = None
        self._watch_s = watch_s
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def store(self) -> Store:
        return self._store

    @property
    def lost(self) -> str | None:
        """Why the store is gone or replaced (found by the watch, or by a write); None while
        it is the store this coordinator opened. Once set, it stays: the server refuses every
        call until it is restarted on the right store."""
        return self._lost

    @property
    def health_problem(self) -> str | None:
        """Why this coordinator should not get traffic now (its store is lost, or its last
        write failed), or None when it is healthy."""
        return self._lost or self._write_failure

    @property
    def chain(self) -> Chain:
        return self._chain

    def _saw_head(self, record_id: int, record_hash: str) -> None:
        if record_id > self._head[0]:
            self._head = (record_id, record_hash)
            self._anchor = ""

    @property
    def head(self) -> tuple[int, str]:
        """(record id, hash) of the chain's latest head this process has seen: read by the
        change feed, so at most one feed poll behind the store."""
        return self._head

    def head_anchor(self) -> str:
        """The head as the `rngcoord-audit-head` trailer: "STORE_ID:RECORD_ID:HASH:MAC" (MAC
        empty when the chain is unkeyed); computed once per head."""
        if not self._anchor:
            record_id, record_hash = self._head
            mac = self._chain.anchor_mac(record_id, record_hash)
            self._anchor = f"{self._chain.store_id}:{record_id}:{record_hash}:{mac}"
        return self._anchor

    @property
    def waiting_joins(self) -> int:
        """Joins of this process waiting for their epoch."""
        return self._barriers.waiting

    async def start(self) -> None:
        """Start following the store's change feed, and watching that the store is still
        the one opened."""
        await self._feed.start()
        loop = asyncio.get_running_loop()
        self._feed_task = loop.create_task(self._feed.run())
        self._watch_task = loop.create_task(self._watch_store())

    async def close(self) -> None:
        """Stop following the feed and release the reader threads (the store stays open)."""
        await self._feed.stop()
        for task in (self._feed_task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._readers.shutdown(wait=False, cancel_futures=True)

    async def _watch_store(self) -> None:
        # A deleted SQLite file or a dropped schema fails the next write by itself; this also
        # catches it on a server that is only answering hits, and turns health NOT_SERVING.
        loop = asyncio.get_running_loop()
        while self._lost is None:
            await asyncio.sleep(self._watch_s)
            try:
                await loop.run_in_executor(self._readers, self._store.check_identity)
            except StoreLost as exc:
                self._store_lost(str(exc))
            except Exception as exc:  # the database is down: writes report it themselves
                event(_log, logging.WARNING, "store_check_failed", error=str(exc))

    def _store_lost(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            event(_log, logging.ERROR, "store_lost", reason=why, store_id=self._store.store_id)

    async def _read(self, fn: Callable[[Tx], T]) -> T:
        if self._inline_reads:
            return self._store.read(fn)
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._store.read, fn)

    async def _write(self, fn: Callable[[Tx], T]) -> T:
        try:
            result = await asyncio.wrap_future(self._store.submit(fn))
        except Unavailable as exc:
            self._write_failure = exc.message
            if isinstance(exc.__cause__, StoreLost):
                self._store_lost(str(exc.__cause__))
            raise
        self._write_failure = None
        return result

    # ----------------------------------------------------------------- cache upkeep

    def _formed_here(self, job: str, group: str, epoch: int) -> None:
        self._cache.groups.drop((job, group))

    def _on_change(self, record: FeedRecord) -> None:
        """A change committed by any process (this one included) that a hit or join must see."""
        key = (record.job, record.group)
        if record.kind == "leave":
            self._cache.members.drop(
                (record.job, record.group, int(record.detail["epoch"]), int(record.detail["rank"]))
            )
            return
        if record.kind == "restore":
            restored = (record.job, record.group, int(record.detail["epoch"]))
            waiter = self._restore_waiters.get((*restored, int(record.detail["seq"])))
            if waiter is not None and not waiter.done():
                waiter.set_result(int(record.detail["cursor"]))
            return
        self._cache.groups.drop(key)
        if record.kind == "epoch":
            task = asyncio.get_running_loop().create_task(
                self._barriers.epoch_formed(record.job, record.group, int(record.detail["epoch"]))
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -------------------------------------------------------------------------- join

    async def join(
        self,
        job: str,
        group: str,
        *,
        rank: int,
        world_size: int,
        member_id: str,
        job_seed: int | None = None,
        timeout_s: float | None = None,
        actor: str = "",
        peer: str = "",
        include_members: bool = False,
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
                default. Capped at `max_join_timeout_s`.
            actor: who asks, for the audit log. Default "".
            peer: the caller's address, kept with its membership. Default "".
            include_members: also return every member id (O(world size)). Default False.

        Raises:
            InvalidArgument: a malformed field.
            FailedPrecondition: SEED_CONFLICT, WORLD_SIZE_MISMATCH, or the epoch formed without
                this member (NOT_MEMBER).
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
        request = JoinRequest(
            job,
            group,
            rank,
            world_size,
            member_id,
            job_seed,
            min(timeout_s, self._max_join_timeout_s),
            actor,
            peer,
        )
        result = await self._barriers.join(request)
        if not include_members:
            return result
        rows = await self._read(
            lambda tx: queries.members_page(tx, job, group, result.epoch, 0, result.world_size)
        )
        members = tuple("" if left is not None else m for _, m, left in rows)
        return JoinResult(
            result.epoch,
            result.seed,
            result.start,
            result.job_seed,
            result.world_size,
            result.members_digest,
            members,
        )

    # ------------------------------------------------------------------------ reserve

    async def reserve(
        self,
        job: str,
        group: str,
        *,
        epoch: int,
        seq: int,
        size: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
        actor: str = "",
    ) -> Lease:
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
            actor: who asks, for the audit log. Default "".

        Raises:
            InvalidArgument: a malformed field.
            NotFound: unknown job, group or epoch.
            StaleEpoch: the epoch has been replaced.
            NotMember: (rank, member_id) is not a member of the epoch.
            FailedPrecondition: SEQ_OUT_OF_ORDER: seq - 1 is not granted yet.
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
        hit = self._hit(job, group, epoch, seq, size, fingerprint, rank, member_id)
        if hit is None:
            hit = await self._read_hit(job, group, epoch, seq, size, fingerprint, rank, member_id)
        if hit is not None:
            return hit
        lease = await self._write(
            functools.partial(
                self._grant_tx,
                job=job,
                group=group,
                epoch=epoch,
                seq=seq,
                size=size,
                fingerprint=fingerprint,
                rank=rank,
                member_id=member_id,
                actor=actor,
                now_us=self._clock.now_us(),
            )
        )
        if isinstance(lease, Divergence):
            self._cache.groups.drop((job, group))
            raise lease
        self._cache.leases.put(
            (job, group, epoch, seq),
            queries.LeaseRow(lease.start, lease.end, size, fingerprint),
        )
        return lease

    def _hit(
        self,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        size: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
    ) -> Lease | None:
        """The lease from memory, or None when memory cannot answer (or a grant must)."""
        if not self._feed.fresh():
            return None
        state = self._cache.groups.get((job, group))
        if state is None or epoch > state.epoch:
            return None  # a newer epoch may have formed elsewhere: ask the store
        _check_epoch(state.epoch, job, group, epoch)
        if state.diverged is not None:
            raise _diverged(job, group, epoch, state.diverged)
        member = self._cache.members.get((job, group, epoch, rank))
        lease = self._cache.leases.get((job, group, epoch, seq))
        if member is None or lease is None:
            return None
        if member != member_id:
            raise _not_member(job, group, epoch, rank, member_id)
        if lease.size != size or lease.fingerprint != fingerprint:
            return None  # a divergence: the grant path records it
        return Lease(group, epoch, seq, state.seed, lease.start, lease.end, True)

    async def _read_hit(
        self,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        size: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
    ) -> Lease | None:
        """The lease from one store read, filling the cache; None when it must be granted."""
        row = await self._read(
            lambda tx: tx.fetchone(queries.RESERVE_LOOKUP, (rank, seq, job, group))
        )
        if row is None:
            job_exists = await self._read(lambda tx: queries.job_seed(tx, job) is not None)
            raise _not_found(job, group, job_exists)
        seed_db, current, diverged, member, left_us, start, end, granted_size, granted_fp = row
        seed = from_db(seed_db)
        self._cache.groups.put((job, group), GroupState(seed, int(current), diverged))
        _check_epoch(int(current), job, group, epoch)
        if member is not None:
            self._cache.members.put(
                (job, group, epoch, rank), "" if left_us is not None else member
            )
        if member is None or left_us is not None or member != member_id:
            raise _not_member(job, group, epoch, rank, member_id)
        if diverged is not None:
            raise _diverged(job, group, epoch, diverged)
        if start is None:
            return None
        lease = queries.LeaseRow(
            from_db(start), from_db(end), from_db(granted_size), bytes(granted_fp)
        )
        self._cache.leases.put((job, group, epoch, seq), lease)
        if lease.size != size or lease.fingerprint != fingerprint:
            return None
        return Lease(group, epoch, seq, seed, lease.start, lease.end, True)

    def _grant_tx(
        self,
        tx: Tx,
        *,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        size: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
        actor: str,
        now_us: int,
    ) -> Lease | Divergence:
        """Grant (epoch, seq) inside the writer's transaction, re-checking everything.

        A divergence is returned rather than raised: its record must commit.
        """
        state = queries.reserve_state(tx, job, group, rank, seq)
        if state is None:
            raise _not_found(job, group, queries.job_seed(tx, job) is not None)
        _check_epoch(state.epoch, job, group, epoch)
        if state.member_id is None or state.left or state.member_id != member_id:
            raise _not_member(job, group, epoch, rank, member_id)
        if state.diverged is not None:
            raise _diverged(job, group, epoch, state.diverged)
        granted = state.granted
        if granted is not None:
            if granted.size == size and granted.fingerprint == fingerprint:
                return Lease(group, epoch, seq, state.seed, granted.start, granted.end, True)
            return self._record_divergence(
                tx,
                job=job,
                group=group,
                epoch=epoch,
                message=(
                    f"divergence in group {group!r} epoch {epoch} seq {seq}: rank {rank} asked "
                    f"for size={size} fingerprint={fingerprint.hex()} but rank "
                    f"{state.granted_rank} was granted size={granted.size} "
                    f"fingerprint={granted.fingerprint.hex()}; the ranks disagree about the "
                    "sequence of random ops"
                ),
                ranks=(rank, state.granted_rank or 0),
                at={"seq": seq},
                detail={
                    "rank": rank,
                    "size": size,
                    "fingerprint": fingerprint.hex(),
                    "granted_rank": state.granted_rank,
                    "granted_size": granted.size,
                    "granted_fingerprint": granted.fingerprint.hex(),
                },
                actor=actor,
                now_us=now_us,
                head=state.head,
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
            rank=rank,
            member_id=member_id,
            now_us=now_us,
            high_water=state.high_water,
        )
        self._chain.append(
            tx,
            ts_us=now_us,
            job=job,
            group=group,
            kind="grant",
            actor=actor,
            detail={
                "epoch": epoch,
                "seq": seq,
                "seed": state.seed,
                "start": start,
                "end": end,
                "size": size,
                "fingerprint": fingerprint.hex(),
                "rank": rank,
            },
            head=state.head,
        )
        return Lease(group, epoch, seq, state.seed, start, end, False)

    # ------------------------------------------------------------------------- attest

    async def attest(
        self,
        job: str,
        group: str,
        *,
        epoch: int,
        anchor_seq: int,
        ops: int,
        fingerprint: bytes,
        rank: int,
        member_id: str,
        actor: str = "",
    ) -> None:
        """Compare a member's op fingerprint at an op count with the first one attested.

        The first attestation of (epoch, anchor_seq, ops) is stored; a later one with other
        bytes makes the epoch diverged, recorded and audited as a Reserve divergence is. With
        attestations every 1,024 ops, ranks whose op sequences differ are caught within 1,024
        ops of the later rank's attestation, whatever the lease sizes.

        Raises:
            InvalidArgument, NotFound, StaleEpoch, NotMember: as for `reserve`.
            Divergence: the epoch diverged, now or before.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_u64("epoch", epoch)
            check_seq(anchor_seq)
            check_attested_ops(ops)
            check_fingerprint(fingerprint)
            check_rank(rank)
            check_member_id(member_id)

        key = (job, group, epoch, anchor_seq, ops)
        if self._attested_in_memory(key, rank, member_id, fingerprint):
            return
        # Every member attests each count and the first one writes it: the others compare on
        # a reader, and only a first attestation or a divergence reaches the writer.
        first = await self._read(
            functools.partial(self._attest_state, key=key, rank=rank, member_id=member_id)
        )
        if first is not None and first[0] == fingerprint:
            self._cache.attestations.put(key, fingerprint)
            return

        def attest_tx(tx: Tx, now_us: int) -> Divergence | None:
            first = self._attest_state(tx, key=key, rank=rank, member_id=member_id)
            if first is None:
                queries.insert_attestation(tx, *key, fingerprint, rank, now_us)
                return None
            if first[0] == fingerprint:
                return None
            return self._record_divergence(
                tx,
                job=job,
                group=group,
                epoch=epoch,
                message=(
                    f"divergence in group {group!r} epoch {epoch} after {ops} random ops: rank "
                    f"{rank} attested fingerprint={fingerprint.hex()} but rank {first[1]} "
                    f"attested fingerprint={first[0].hex()}; the ranks disagree about the "
                    "sequence of random ops"
                ),
                ranks=(rank, first[1]),
                at={"anchor_seq": anchor_seq, "ops": ops},
                detail={
                    "rank": rank,
                    "fingerprint": fingerprint.hex(),
                    "attested_rank": first[1],
                    "attested_fingerprint": first[0].hex(),
                },
                actor=actor,
                now_us=now_us,
            )

        diverged = await self._write(functools.partial(attest_tx, now_us=self._clock.now_us()))
        if diverged is not None:
            self._cache.groups.drop((job, group))
            raise diverged
        self._cache.attestations.put(key, fingerprint)

    def _attested_in_memory(
        self, key: AttestationKey, rank: int, member_id: str, fingerprint: bytes
    ) -> bool:
        """True when memory alone shows this attestation agrees: the group's current epoch,
        not diverged, this member, and the same first attestation (which never changes)."""
        if not self._feed.fresh():
            return False
        job, group, epoch = key[:3]
        state = self._cache.groups.get((job, group))
        if state is None or state.epoch != epoch or state.diverged is not None:
            return False
        if self._cache.members.get((job, group, epoch, rank)) != member_id:
            return False
        return self._cache.attestations.get(key) == fingerprint

    def _attest_state(
        self, tx: Tx, *, key: AttestationKey, rank: int, member_id: str
    ) -> tuple[bytes, int] | None:
        """Refuse an Attest from outside the group's current, undiverged epoch; return the
        first attestation of `key`, if any. Fills the cache as Reserve's reads do."""
        job, group, epoch = key[:3]
        g = queries.group_row(tx, job, group)
        if g is None:
            raise _not_found(job, group, queries.job_seed(tx, job) is not None)
        _check_epoch(g.epoch, job, group, epoch)
        found = queries.member(tx, job, group, epoch, rank)
        if found is None or found[0] != member_id or found[1] is not None:
            raise _not_member(job, group, epoch, rank, member_id)
        row = queries.epoch_row(tx, job, group, epoch)
        diverged = None if row is None else row.diverged
        self._cache.groups.put((job, group), GroupState(g.seed, g.epoch, diverged))
        self._cache.members.put((job, group, epoch, rank), member_id)
        if diverged is not None:
            raise _diverged(job, group, epoch, diverged)
        return queries.attestation(tx, *key)

    def _record_divergence(
        self,
        tx: Tx,
        *,
        job: str,
        group: str,
        epoch: int,
        message: str,
        ranks: tuple[int, int],
        at: dict[str, int],
        detail: dict[str, object],
        actor: str,
        now_us: int,
        head: tuple[int, str] | None = None,
    ) -> Divergence:
        """Mark the epoch diverged and audit it, inside the writer's transaction; return the
        refusal (returned, not raised: the record must commit). `at` locates it: a lease
        seq, or an attested op count."""
        record = json.dumps({"message": message, **at, "ranks": sorted(set(ranks))})
        queries.set_diverged(tx, job, group, epoch, record)
        self._chain.append(
            tx,
            ts_us=now_us,
            job=job,
            group=group,
            kind="divergence",
            actor=actor,
            detail={"epoch": epoch, **at, **detail},
            head=head,
        )
        return _diverged(job, group, epoch, record)

    # -------------------------------------------------------------------------- leave

    async def leave(
        self, job: str, group: str, *, epoch: int, rank: int, member_id: str, actor: str = ""
    ) -> None:
        """Record that a member leaves its epoch; the epoch stays valid for the others.

        Repeating a leave whose rank has already left is a no-op.

        Raises:
            InvalidArgument, NotFound, StaleEpoch: as for `reserve`.
            NotMember: another member holds that rank.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_u64("epoch", epoch)
            check_rank(rank)
            check_member_id(member_id)

        def leave_tx(tx: Tx, now_us: int) -> bool:
            g = queries.group_row(tx, job, group)
            if g is None:
                raise _not_found(job, group, queries.job_seed(tx, job) is not None)
            _check_epoch(g.epoch, job, group, epoch)
            found = queries.member(tx, job, group, epoch, rank)
            if found is None or found[0] != member_id:
                raise _not_member(job, group, epoch, rank, member_id)
            if found[1] is not None:
                return False
            queries.set_left(tx, job, group, epoch, rank, now_us)
            self._chain.append(
                tx,
                ts_us=now_us,
                job=job,
                group=group,
                kind="leave",
                actor=actor,
                detail={"epoch": epoch, "rank": rank, "member_id": member_id},
            )
            return True

        if await self._write(functools.partial(leave_tx, now_us=self._clock.now_us())):
            self._cache.members.put((job, group, epoch, rank), "")

    # ---------------------------------------------------------------------- get_group

    async def get_group(
        self, job: str, group: str, *, members_from: int = 0, members_limit: int = 0
    ) -> GroupInfo:
        """Describe a group, with a page of its current epoch's members.

        Args:
            job: the job's name.
            group: the group's name.
            members_from: the first rank of the page. Default 0.
            members_limit: most members in the page; 0 for the default (1024). At most 65536.

        Raises:
            InvalidArgument: a malformed name or page.
            NotFound: unknown job or group.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_rank(members_from)
        if not 0 <= members_limit <= MAX_MEMBERS_PAGE:
            raise InvalidArgument(
                f"invalid members_limit {members_limit}: it must be in [0, {MAX_MEMBERS_PAGE}]",
                field="members_limit",
                value=members_limit,
            )
        limit = members_limit or MEMBERS_PAGE

        def read(tx: Tx) -> GroupInfo:
            g = queries.group_row(tx, job, group)
            stored = queries.job_seed(tx, job)
            if g is None or stored is None:
                raise _not_found(job, group, stored is not None)
            if not g.epoch:
                return GroupInfo(job, group, g.seed, 0, 0, b"", (), 0, 0, g.high_water, 0, stored)
            row = queries.epoch_row(tx, job, group, g.epoch)
            assert row is not None
            page = queries.members_page(tx, job, group, g.epoch, members_from, limit)
            members = tuple("" if left is not None else m for _, m, left in page)
            return GroupInfo(
                job,
                group,
                g.seed,
                g.epoch,
                row.world_size,
                row.members_digest,
                members,
                members_from,
                min(row.world_size, members_from + limit),
                g.high_water,
                queries.lease_count(tx, job, group, g.epoch),
                stored,
            )

        return await self._read(read)

    # ------------------------------------------------------------------------ restore

    async def restore(
        self,
        job: str,
        group: str,
        *,
        epoch: int,
        seq: int,
        cursor: int,
        rank: int,
        member_id: str,
        actor: str = "",
        force: bool = False,
        timeout_s: float | None = None,
    ) -> RestoreResult:
        """Make lease `seq` of the current epoch start at `cursor` (a bitwise-exact resume).

        It may reuse offsets granted before, so it takes effect only by consensus: each call
        is the vote of (rank, member_id), and returns once every current member of the epoch
        (those that have not left) has asked for the same (seq, cursor). With `force` (admin
        tokens only; the server checks) it takes effect at once. The audit record names the
        voters. Repeating a Restore that took effect returns existing=True.

        Args:
            job, group, epoch, seq, cursor, rank, member_id, actor: as the request.
            force: take effect without the other members' votes. Default False.
            timeout_s: how long to wait for the other votes; None for the join timeout.
                Capped at `max_join_timeout_s`.

        Raises:
            InvalidArgument, NotFound, StaleEpoch, NotMember: as for `reserve`.
            FailedPrecondition: RESTORE_CONFLICT: the seq is already granted, restored to
                another cursor, or other members voted for another cursor.
            ResourceExhausted: the cursor leaves the group less than 2^32 offsets.
            RestoreTimeout: not every member voted in time; names those that did not.
        """
        with _fields():
            check_name("job", job)
            check_name("group", group)
            check_u64("epoch", epoch)
            check_seq(seq)
            check_cursor(cursor)
            check_rank(rank)
            check_member_id(member_id)
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
        timeout = min(
            self._join_timeout_s if timeout_s is None else timeout_s, self._max_join_timeout_s
        )
        key = (job, group, epoch, seq)
        waiter = self._restore_waiters.setdefault(key, asyncio.get_running_loop().create_future())
        self._restore_voting[key] += 1
        try:
            outcome = await self._write(
                functools.partial(
                    self._vote_tx,
                    job=job,
                    group=group,
                    epoch=epoch,
                    seq=seq,
                    cursor=cursor,
                    rank=rank,
                    member_id=member_id,
                    actor=actor,
                    force=force,
                    now_us=self._clock.now_us(),
                )
            )
            if outcome != "pending":
                if outcome == "effective" and not waiter.done():
                    waiter.set_result(cursor)
                return RestoreResult(cursor, existing=outcome == "existing")
            if not await self._clock.wait(waiter, timeout):  # type: ignore[arg-type]
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
                    f"timed out after {timeout:g}s: ranks {missing} did not ask for it; every "
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
            self._restore_voting[key] -= 1
            if self._restore_voting[key] == 0:
                del self._restore_voting[key]
                self._restore_waiters.pop(key, None)

    def _vote_tx(
        self,
        tx: Tx,
        *,
        job: str,
        group: str,
        epoch: int,
        seq: int,
        cursor: int,
        rank: int,
        member_id: str,
        actor: str,
        force: bool,
        now_us: int,
    ) -> str:
        """Record a Restore vote; return "existing" (recorded before), "effective" (this vote
        completed it, or it was forced) or "pending"."""
        g = queries.group_row(tx, job, group)
        if g is None:
            raise _not_found(job, group, queries.job_seed(tx, job) is not None)
        _check_epoch(g.epoch, job, group, epoch)
        found = queries.member(tx, job, group, epoch, rank)
        if found is None or found[1] is not None or found[0] != member_id:
            raise _not_member(job, group, epoch, rank, member_id)
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
            voters, votes = [actor], 0
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
                member_id=member_id,
                actor=actor,
                now_us=now_us,
            )
            row = queries.epoch_row(tx, job, group, epoch)
            assert row is not None
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
            actor=actor,
            detail={
                "epoch": epoch,
                "seq": seq,
                "cursor": cursor,
                "high_water": g.high_water,
                "rank": rank,
                "forced": force,
                "votes": votes,
                "voters": voters,
            },
        )
        return "effective"

    # --------------------------------------------------------------------- list_audit

    def list_audit(
        self,
        job: str = "",
        group: str = "",
        kinds: Sequence[str] = (),
        since_us: int = 0,
        until_us: int = 0,
        limit: int = 0,
    ) -> AsyncIterator[AuditRecord]:
        """Audit records in chain order, oldest first, read page by page as the caller
        consumes them (a stream that is not read holds nothing but its position).

        Validation happens at the call; the store is read as the iterator advances.

        Args:
            job: only this job; "" for all. Default "".
            group: only this group; "" for all. Default "".
            kinds: only these kinds; empty for all. Default ().
            since_us: only records at or after this Unix time (µs); 0 for no bound. Default 0.
            until_us: only records before this Unix time (µs); 0 for no bound. Default 0.
            limit: stop after this many records; 0 for no limit. Default 0.

        Raises:
            InvalidArgument: a malformed name, an unknown kind or a negative limit.
        """
        with _fields():
            if job:
                check_name("job", job)
            if group:
                check_name("group", group)
        unknown = sorted(set(kinds) - set(audit.KINDS))
        if unknown:
            shown = ", ".join(repr(k[:32]) for k in unknown[:3])
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise InvalidArgument(
                f"unknown audit kinds {shown}{more}: the kinds are {', '.join(audit.KINDS)}",
                field="kinds",
                value=unknown[0][:32],
            )
        if limit < 0:
            raise InvalidArgument(
                f"invalid limit {limit!r}: it must be 0 (no limit) or more",
                field="limit",
                value=limit,
            )
        return self._audit_pages(job, group, tuple(sorted(set(kinds))), since_us, until_us, limit)

    async def _audit_pages(
        self,
        job: str,
        group: str,
        kinds: tuple[str, ...],
        since_us: int,
        until_us: int,
        limit: int,
    ) -> AsyncIterator[AuditRecord]:
        after_id, left = 0, limit or math.inf
        while left > 0:
            size = int(min(_AUDIT_PAGE, left))
            page: list[AuditRecord] = await asyncio.get_running_loop().run_in_executor(
                self._readers,
                self._store.read,
                functools.partial(
                    audit.fetch_page,
                    after_id=after_id,
                    limit=size,
                    job=job,
                    group=group,
                    kinds=kinds,
                    since_us=since_us,
                    until_us=until_us,
                ),
            )
            for record in page:
                yield record
            if len(page) < size:
                return
            after_id = page[-1].id
            left -= len(page)
