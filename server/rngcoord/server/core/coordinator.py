"""The coordinator's rules: joins, leases, leaves, restores and the audit listing, on one store.

`Coordinator` is transport-free and asynchronous: it runs on the event loop of a coordinator
process, waits on futures (never on threads), and leaves the store work to the store's
group-commit writer thread and to reader threads. Its layers:

- who calls as which member, and the one fencing rule: `membership` (in this package,
  rngcoord.server.core);
- the join barrier: `barrier`; Reserve: `grants`; attestations: `attestations`; restores:
  `restores`; divergences: `divergences`;
- SQL and row decoding: rngcoord.server.storage.queries; field checks: rngcoord.v1.rules;
- what a hit answers from memory: `cache`, kept current by the change feed (`feed`) across
  the processes that share the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rngcoord.server.audit.chain import GENESIS_HASH, Chain, Pages
from rngcoord.server.clock import Clock, SystemClock
from rngcoord.server.core.attestations import Attestations
from rngcoord.server.core.barrier import Barriers
from rngcoord.server.core.cache import Cache
from rngcoord.server.core.context import Context
from rngcoord.server.core.feed import Feed, FeedRecord, log_change
from rngcoord.server.core.grants import Grants
from rngcoord.server.core.joins import JoinRequest, check_join
from rngcoord.server.core.membership import (
    Caller,
    fence,
    fields,
    not_found,
    secret_hash,
    wait_s,
)
from rngcoord.server.core.quorums import Quorums
from rngcoord.server.core.resizes import Resizes
from rngcoord.server.core.restores import Restores
from rngcoord.server.errors import (
    InvalidArgument,
    Unavailable,
)
from rngcoord.server.logs import event, get_logger
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import ReadAhead, Store, StoreLost, StoreRewound, Tx, row_reader
from rngcoord.v1.rules import (
    check_name,
    check_rank,
)
from rngcoord.v1.types import AuditRecord, GroupInfo, JoinResult, Lease, RestoreResult

__all__ = ["Coordinator"]

T = TypeVar("T")
_log = get_logger("coordinator")

# A ListAudit stream whose client stops reading holds its current page until it is ended,
# at about 1.7 KB of Python objects per record: 32 keep an unread stream near 100 KB all told,
# and cost a reader round trip per 32 records to a stream that is read.
_AUDIT_PAGE = 32
MEMBERS_PAGE = 1024
"""Members GetGroup returns when the request sets no limit."""
MAX_MEMBERS_PAGE = 65536


class Coordinator:
    """The seed/offset authority over one store, for one process's event loop.

    Args:
        store: where state and the audit chain live; shared by all workers and replicas.
        join_timeout_s: how long a join (or a Restore vote) waits when the request sets no
            timeout. Default 60.
        max_join_timeout_s: the most any join or Restore vote waits, whatever the request
            asks. Default 1800.
        clock: the time source. Default: the system clock.
        staleness_s: how old the change feed's last confirmation may be for a hit to be
            answered from memory (docs/design.md §7.4). Default 0.5.
        feed_poll_s: how often the change feed looks for other processes' changes. Default
            None: 0.02 s on SQLite (a lock-free counter), 0.1 s on PostgreSQL (which also
            notifies).
        chain: how audit records are hashed (keyed or not; see
            rngcoord.server.audit.chain.open_chain). Default: the store's unkeyed chain.
        watch_s: how often to check that the store is still the one opened (its file, its
            schema, its id). Default 1.
        write_stall_s: a write batch that has not committed after this long makes the
            coordinator unhealthy (`health_problem`) until it does. Default 10.
        log_changes: log, at INFO, each group event committed by any process that shares
            the store (an epoch formed or replaced, a divergence, a restore, a leave). Default
            False: one process of a deployment logs them (worker 0).

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
        write_stall_s: float = 10.0,
        log_changes: bool = False,
    ) -> None:
        self._log_changes = log_changes
        self._store = store
        self._write_stall_s = write_stall_s
        self._chain = chain if chain is not None else Chain(store.store_id)
        self._head = (0, GENESIS_HASH)
        self._anchor = ""
        self._join_timeout_s = join_timeout_s
        self._max_join_timeout_s = max_join_timeout_s
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._cache = Cache()
        # SQLite reads take microseconds from the page cache and never wait for the writer
        # (WAL), so they run on the event loop; PostgreSQL reads are round trips, in threads.
        self._inline_reads = store.dialect == "sqlite"
        self._readers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rngcoord-read")
        self._barriers = Barriers(
            store, self._read, self._clock, self._formed_here, self._store_lost, self._chain
        )
        self._row_reader = row_reader(store)
        context = Context(
            read=self._read,
            read_row=self._read_row,
            write=self._write,
            cache=self._cache,
            fresh=lambda: self._feed.fresh(),
            chain=self._chain,
            clock=self._clock,
        )
        self._attestations = Attestations(context)
        self._grants = Grants(context)
        self._restores = Restores(context)
        self._resizes = Resizes(context)
        self._quorums = Quorums(context)
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
        self._tasks: set[asyncio.Task[None]] = set()
        self._lost: str | None = None
        # The lost heads already taken care of: a check that read the known head before the
        # recovery reset it may report the same loss once more, after it.
        self._rewound: set[tuple[int, str]] = set()
        self._write_failure: str | None = None
        # Why the latest store check failed (the database unreachable), or None once one passes.
        self._check_failure: str | None = None
        self._watch_s = watch_s
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def store(self) -> Store:
        return self._store

    @property
    def lost(self) -> str | None:
        """Why the store is gone or replaced (found by the watch, or by a write); None while
        it is the store this coordinator opened. Once set, it stays, and the server refuses
        every call until it is restarted on the right store; except for a store that went
        back in time (`StoreRewound`), which is refused only until this process has taken
        it as it now is (docs/design.md §11.6)."""
        return self._lost

    @property
    def health_problem(self) -> str | None:
        """Why this coordinator should not get traffic now (its store is lost, its last write
        failed, its latest store check could not read it, or writes have stopped moving), or
        None when it is healthy."""
        if self._lost or self._write_failure or self._check_failure:
            return self._lost or self._write_failure or self._check_failure
        problem = self._store.write_problem(self._write_stall_s)
        return problem.reason if problem is not None else None

    @property
    def fatal(self) -> str | None:
        """Why this process can no longer serve at all (its store's writer thread died), or
        None: the server then exits, for its supervisor to start a fresh one."""
        problem = self._store.write_problem(self._write_stall_s)
        return problem.reason if problem is not None and problem.fatal else None

    @property
    def chain(self) -> Chain:
        return self._chain

    def _saw_head(self, record_id: int, record_hash: str) -> None:
        if record_id > self._head[0]:
            self._head = (record_id, record_hash)
            self._anchor = ""
            # What the feed saw committed, by any replica, the store must go on holding.
            self._store.saw_head(record_id, record_hash)

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
                self._store_lost(exc)
            except Exception as exc:
                # The database is down (or no primary answers yet after a failover): health
                # says so even while no write comes to find out, and turns SERVING again by
                # itself once a check passes.
                if self._check_failure is None:
                    event(_log, logging.WARNING, "store_check_failed", error=str(exc))
                self._check_failure = f"the store cannot be read: {exc}"
            else:
                self._check_failure = None

    def _store_lost(self, exc: StoreLost) -> None:
        if isinstance(exc, StoreRewound) and exc.known in self._rewound:
            return
        if self._lost is None:
            self._lost = str(exc)
            event(_log, logging.ERROR, "store_lost", reason=str(exc), store_id=self._store.store_id)
            if isinstance(exc, StoreRewound):
                task = asyncio.get_running_loop().create_task(self._serve_rewound(exc))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _serve_rewound(self, exc: StoreRewound) -> None:
        """Take a store that went back in time as it now is, and serve it again (§11.6).

        Every call is refused meanwhile. What this process believed about the lost records
        goes (its memory of grants, members and groups; the newest head it knew), its feed
        reads on from where the chain ended when the loss was found (so that what other
        processes wrote since is not skipped), and a `rewind` record names the lost head and
        that chain end. Then
        the store is served from there: a lease asked again within its epoch is granted anew
        from its predecessor, as it was before, and an epoch formed from now on starts past
        what its members report (JoinGroupRequest.position). Tried again every second while
        the store cannot be written (a primary still being promoted).
        """
        while True:
            try:
                head: tuple[int, str] = await self._read(queries.audit_head)
                self._store.went_back_to(*head)
                self._feed.restart_at(exc.chain_end)
                self._head, self._anchor = head, ""
                self._cache.clear()
                detail = {
                    "lost_id": exc.known[0],
                    "lost_hash": exc.known[1],
                    "chain_end": exc.chain_end,
                }
                await self._write(functools.partial(self._append_rewind, detail=detail))
            except Exception as failed:
                event(_log, logging.WARNING, "rewind_retry", error=str(failed))
                await asyncio.sleep(1.0)
                continue
            break
        self._rewound.add(exc.known)
        self._lost = None
        event(
            _log,
            logging.WARNING,
            "store_rewound_served",
            lost_id=exc.known[0],
            chain_end=detail["chain_end"],
            store_id=self._store.store_id,
        )
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_store())

    def _append_rewind(self, tx: Tx, *, detail: dict[str, object]) -> None:
        self._chain.append(
            tx,
            ts_us=self._clock.now_us(),
            job="",
            group="",
            kind="rewind",
            actor="coordinator",
            detail=detail,
        )

    async def _read(self, fn: Callable[[Tx], T]) -> T:
        if self._inline_reads:
            return self._store.read(fn)
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._store.read, fn)

    async def _read_row(self, sql: str, params: Sequence[object]) -> tuple[Any, ...] | None:
        if self._inline_reads:
            return self._row_reader(sql, params)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._row_reader, sql, params)

    async def _write(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> T:
        try:
            result = await asyncio.wrap_future(self._store.submit(fn, ahead))
        except Unavailable as exc:
            self._write_failure = exc.message
            if isinstance(exc.__cause__, StoreLost):
                self._store_lost(exc.__cause__)
            raise
        self._write_failure = None
        return result

    # ----------------------------------------------------------------- cache upkeep

    def _formed_here(self, job: str, group: str, epoch: int) -> None:
        self._cache.groups.drop((job, group))

    def _on_change(self, record: FeedRecord) -> None:
        """A change committed by any process (this one included) that a hit or join must see."""
        if self._log_changes:
            log_change(record)
        key = (record.job, record.group)
        if record.kind == "leave":
            self._cache.members.drop(
                (record.job, record.group, int(record.detail["epoch"]), int(record.detail["rank"]))
            )
            return
        if record.kind == "restore":
            self._restores.restored(record)
            return
        if record.kind in ("resize", "quorum"):
            return
        self._cache.groups.drop(key)
        if record.kind == "epoch":
            task = asyncio.get_running_loop().create_task(
                self._barriers.epoch_formed(record.job, record.group, int(record.detail["epoch"]))
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def wait_s(self, requested_s: float | None, remaining_s: float | None) -> float:
        """How long a JoinGroup or Restore vote waits (`membership.wait_s` with this
        coordinator's default and maximum)."""
        return wait_s(requested_s, remaining_s, self._join_timeout_s, self._max_join_timeout_s)

    # -------------------------------------------------------------------------- join

    async def join(
        self,
        job: str,
        group: str,
        *,
        rank: int,
        world_size: int,
        member_id: str,
        member_secret: bytes,
        job_seed: int | None = None,
        timeout_s: float | None = None,
        actor: str = "",
        peer: str = "",
        include_members: bool = False,
        launch: str = "",
        restart_count: int = 0,
        takeover: bool = False,
        position: int = 0,
    ) -> JoinResult:
        """Join the group's barrier; return the epoch it forms once all ranks have joined.

        Creates the job (with `job_seed`, or a drawn root seed) and the group when they are
        new. A repeated join of a member already in the current epoch, with the same secret,
        returns that epoch.

        Args:
            job: the job's name.
            group: the group's name.
            rank: the caller's rank in [0, world_size).
            world_size: number of ranks that form the epoch.
            member_id: the caller's process incarnation id.
            member_secret: the member's credential (16 to 64 bytes); later calls as this
                member must carry it.
            job_seed: the root seed to fix for a new job, or None to accept the job's seed.
            timeout_s: how long to wait for the other ranks; None for the coordinator's
                default. Capped at `max_join_timeout_s`.
            actor: who asks, for the audit log. Default "".
            peer: the caller's address, kept with its membership. Default "".
            include_members: also return every member id (O(world size)). Default False.
            launch: which launch of the job the caller belongs to; "" (default) for no check.
            restart_count: the launch's torchelastic restart count. Default 0.
            takeover: replace the group's epoch even if another launch is using it.
            position: where the caller knows the group's grants reach; an epoch it forms
                starts at or above it (docs/design.md §11.6). Default 0.

        Raises:
            InvalidArgument: a malformed field.
            FailedPrecondition: SEED_CONFLICT, WORLD_SIZE_MISMATCH, JOB_IN_USE (another
                launch's epoch is live), or the epoch formed without this member (NOT_MEMBER).
            PermissionDenied: BAD_CREDENTIAL, a retried join with another secret.
            JoinTimeout: the other ranks did not all join in time; names the missing ranks.
        """
        check_join(
            job,
            group,
            rank=rank,
            world_size=world_size,
            member_id=member_id,
            member_secret=member_secret,
            job_seed=job_seed,
            position=position,
            launch=launch,
        )
        request = JoinRequest(
            job=job,
            group=group,
            rank=rank,
            world_size=world_size,
            member_id=member_id,
            secret_hash=secret_hash(member_secret),
            job_seed=job_seed,
            timeout_s=self.wait_s(timeout_s, None),
            actor=actor,
            peer=peer,
            launch=launch,
            restart_count=restart_count,
            takeover=takeover,
            position=position,
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

    async def reserve(self, caller: Caller, *, seq: int, size: int, fingerprint: bytes) -> Lease:
        """Return the lease (epoch, seq) of the caller's group, granting it durably if new
        (rngcoord.server.core.grants)."""
        return await self._grants.reserve(caller, seq=seq, size=size, fingerprint=fingerprint)

    # ---------------------------------------------------------- attest and restore

    async def attest(
        self, caller: Caller, *, anchor_seq: int, ops: int, fingerprint: bytes
    ) -> None:
        """Compare the caller's op fingerprint after `ops` random ops since the anchor lease
        `anchor_seq` with the first one attested (rngcoord.server.core.attestations)."""
        await self._attestations.attest(
            caller, anchor_seq=anchor_seq, ops=ops, fingerprint=fingerprint
        )

    async def restore(
        self,
        caller: Caller,
        *,
        seq: int,
        cursor: int,
        force: bool = False,
        timeout_s: float | None = None,
        from_job: str = "",
    ) -> RestoreResult:
        """The caller's vote to make lease `seq` of its epoch start at `cursor`, waiting at
        most `timeout_s` (None: the join timeout; capped at `max_join_timeout_s`) for the
        other members (rngcoord.server.core.restores); `from_job` names the job whose checkpoint
        the cursor comes from, when it is another job's ("" by default: this job's)."""
        return await self._restores.restore(
            caller,
            seq=seq,
            cursor=cursor,
            force=force,
            timeout_s=self.wait_s(timeout_s, None),
            from_job=from_job,
        )

    async def record_resize(self, caller: Caller, *, saved_group: str, saved_cursor: int) -> bool:
        """Audit that the caller's epoch could not continue the checkpoint stream of
        `saved_group` (rngcoord.server.core.resizes); True when it had been recorded already."""
        return await self._resizes.record(
            caller, saved_group=saved_group, saved_cursor=saved_cursor
        )

    async def record_quorum(
        self, caller: Caller, *, quorum_id: int, step: int, participants: int, healed_from: str
    ) -> bool:
        """Audit a torchft quorum that the caller's replica took part in
        (rngcoord.server.core.quorums); True when it had been recorded already."""
        return await self._quorums.record(
            caller,
            quorum_id=quorum_id,
            step=step,
            participants=participants,
            healed_from=healed_from,
        )

    # -------------------------------------------------------------------------- leave

    async def leave(self, caller: Caller) -> None:
        """Record that a member leaves its epoch; the epoch stays valid for the others.

        Repeating a leave whose rank has already left is a no-op.

        Raises:
            InvalidArgument, NotFound, StaleEpoch, NotMember, PermissionDenied: as for
                `reserve`.
        """
        caller.check()

        def leave_tx(tx: Tx, now_us: int) -> queries.Member | None:
            job, group, epoch, rank = caller.job, caller.group, caller.epoch, caller.rank
            g = queries.group_row(tx, job, group)
            if g is None:
                raise not_found(job, group, queries.job_seed(tx, job) is not None)
            held = queries.member(tx, job, group, epoch, rank)
            fence(caller, g.epoch, held, left=True)
            assert held is not None
            if held.left:
                return None
            queries.set_left(tx, job, group, epoch, rank, now_us)
            self._chain.append(
                tx,
                ts_us=now_us,
                job=job,
                group=group,
                kind="leave",
                actor=caller.actor,
                detail={"epoch": epoch, "rank": rank, "member_id": caller.member_id},
            )
            return queries.Member(held.member_id, True, held.secret_hash)

        left = await self._write(functools.partial(leave_tx, now_us=self._clock.now_us()))
        if left is not None:
            self._cache.members.put((caller.job, caller.group, caller.epoch, caller.rank), left)

    # ---------------------------------------------------------------------- get_group

    async def get_group(
        self, job: str, group: str, *, members_from: int = 0, members_limit: int = 0
    ) -> GroupInfo:
        """Describe a group, with a page of its current epoch's members (their ids, never
        their secrets).

        Args:
            job: the job's name.
            group: the group's name.
            members_from: the first rank of the page. Default 0.
            members_limit: most members in the page; 0 for the default (1024). At most 65536.

        Raises:
            InvalidArgument: a malformed name or page.
            NotFound: unknown job or group.
        """
        with fields():
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
                raise not_found(job, group, stored is not None)
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
        consumes them: a caller that stops consuming holds one page (at most 32 records) and
        its position, and the next page is read only when it asks for the next record.

        Validation happens at the call; the store is read as the iterator advances. The
        filters are those of `fetch_page`; `limit` 0 means every record.

        Raises:
            InvalidArgument: a malformed name, an unknown kind or a negative limit.
        """
        pages = Pages.checked(
            job=job,
            group=group,
            kinds=kinds,
            since_us=since_us,
            until_us=until_us,
            limit=limit,
            page=_AUDIT_PAGE,
        )
        return self._audit_pages(pages)

    async def _audit_pages(self, pages: Pages) -> AsyncIterator[AuditRecord]:
        loop = asyncio.get_running_loop()
        while (query := pages.next_query()) is not None:
            page = await loop.run_in_executor(self._readers, self._store.read, query)
            for record in page:
                yield record
            pages.took(page)
