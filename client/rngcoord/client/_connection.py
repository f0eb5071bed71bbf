"""The connection to the coordinator: targets, failover, deadlines, the outage budget, token
and TLS.

:class:`CoordinatorClient` mirrors the ``rngcoord.v1.Coordinator`` RPCs with Python types and
turns every gRPC status into an :mod:`rngcoord.client._errors` exception whose message says
what failed and what to do. All RPCs of the contract are idempotent (a JoinGroup retried with
the same member id, a Reserve of the same key, an identical Restore), so the client retries
them on UNAVAILABLE and DEADLINE_EXCEEDED, failing over across targets, with capped
exponential backoff and full jitter, for as long as the *outage budget* allows (and after the
wait a RATE_LIMITED refusal names).

An outage is the time since the first failed attempt of a run of failures, shared by every
call of the client (its lease, attestation and leave calls): it ends at the first reply, and
only a call that fails once the outage is older than ``outage_s`` raises
:class:`CoordinatorUnavailable`. So a coordinator restart, upgrade or failover costs a job a
wait, never the run (docs/design.md §6.2). ``install()`` gives training a budget of 10
minutes; tools keep the short default, and fail within seconds when nothing listens.

The client also watches *which* store answers: the store id of JoinGroup and GetGroup replies
and of the audit head that JoinGroup and Reserve replies carry in their trailing metadata. The
first one seen (or the one a checkpoint names, `expect_store`) is the job's store; another one
raises :class:`StoreMismatchError` instead of handing out offsets a lost store already gave.
The latest head is kept in `audit_head`, for checkpoints and `rngcoord verify --anchor`.

The machinery of one call (channels, retries, failover, the outage budget, the store check,
the error mapping) is :class:`rngcoord.client._transport.Transport`, which the client extends.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from rngcoord.client._transport import (
    DEFAULT_ADDR,
    Transport,
    adopt_member_secret,
    member_secret,
)
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.types import AuditRecord, GroupInfo, JoinResult, Lease, RestoreResult

__all__ = ["DEFAULT_ADDR", "CoordinatorClient", "adopt_member_secret", "member_secret"]


class CoordinatorClient(Transport):
    """A client of one coordinator deployment (one or more replicas).

    Args:
        targets: ``"HOST:PORT"`` addresses, as a sequence or one comma-separated string.
            Default ``None``: RNGCOORD_ADDR, else ``localhost:29520``. Calls go to one target
            and fail over to the next on UNAVAILABLE or DEADLINE_EXCEEDED.
        token: Bearer token sent as ``authorization`` metadata. Default ``None``:
            RNGCOORD_TOKEN, else no token.
        tls_ca: Path of a PEM CA bundle that verifies the coordinator; it turns TLS on.
            Default ``None``: RNGCOORD_TLS_CA, else plaintext.
        deadline_s: Deadline of each RPC attempt, in seconds (a JoinGroup waits its barrier
            timeout on top). Default 10.0.
        outage_s: The outage budget, in seconds: calls keep retrying on UNAVAILABLE and
            DEADLINE_EXCEEDED until the coordinator answers or the outage (counted from its
            first failed attempt, across every call of this client) is older than this; then
            they raise :class:`CoordinatorUnavailable`. 0 tries each target once. Default 5.0,
            for tools; ``install()`` passes its own (10 minutes by default).
        backoff_s: Base of the backoff after a round in which every target failed: the n-th
            sleep is uniform(0, min(5 s, backoff_s * 2^n)) ("full jitter", so that many
            ranks do not reconnect in lockstep). A failover to a target not yet tried in the
            round does not wait. Channels reconnect at least every 0.5 s. Default 0.1.
        log_outages: Log a warning when an outage begins (the targets, since when, the budget
            left) and a line when it ends (how long it lasted). Default ``True``;
            ``install()`` logs from rank 0 only.
        session: Send the member calls (JoinGroup, Reserve, Attest, LeaveGroup, GetGroup,
            Restore, RecordResize, RecordQuorum) as messages on one Session stream per target
            (:mod:`rngcoord.client._session`), with the same errors and retries as unary
            calls, at a fraction of their cost. Default ``False``: unary calls, for tools
            that make a few; ``install()`` passes ``True``.
    """

    def join_group(
        self,
        job: str,
        group: str,
        *,
        rank: int,
        world_size: int,
        member_id: str,
        job_seed: int | None = None,
        timeout_s: float = 60.0,
        include_members: bool = False,
        launch: str | None = None,
        restart_count: int | None = None,
        takeover: bool | None = None,
        position: int = 0,
    ) -> JoinResult:
        """Join ``group``'s barrier; returns once ``world_size`` ranks have joined.

        The member's credential is drawn here, once per ``member_id`` in this process
        (`member_secret`), and every later call as this member carries it.

        Args:
            job: The job name.
            group: The group name.
            rank: This member's rank in the group.
            world_size: Ranks that form the epoch.
            member_id: This process incarnation's id.
            job_seed: The job's root seed; ``None`` (default) lets the first join decide.
            timeout_s: How long the server waits for the other ranks. Default 60.0.
            include_members: Also return every member id (O(world size) bytes). Default
                ``False``: the result carries the member set's digest only.
            launch, restart_count, takeover: Which launch of the job this rank belongs to,
                its torchelastic restart count, and whether to replace a live epoch of
                another launch (JoinGroupRequest). Default ``None``: this client's
                :attr:`launch`, :attr:`restart_count` and :attr:`takeover`.
            position: Where this member knows the group's grants reach (one past the end of
                the newest lease it held, or a loaded checkpoint's cursor); an epoch it forms
                starts at or above it (JoinGroupRequest.position). Default 0: none known.
        """
        request = self._join_request(
            job,
            group,
            rank,
            world_size,
            member_id,
            job_seed,
            timeout_s,
            include_members,
            launch,
            restart_count,
            takeover,
            position,
        )
        reply, call = self._call(
            "JoinGroup",
            lambda s, d, m: s.JoinGroup.with_call(request, timeout=d, metadata=m),
            timeout_s + self.deadline_s,
            deadline_is_timeout=True,
        )
        where = f"JoinGroup of group {group!r} at {self._targets[self._current]}"
        self._note_store(reply.store_id, where)
        self._note_head(call, where)
        return JoinResult.from_pb(reply)

    def join_groups(
        self,
        job: str,
        groups: Sequence[tuple[str, int, int]] | Sequence[tuple[str, int, int, int]],
        *,
        member_id: str,
        job_seed: int | None = None,
        timeout_s: float = 60.0,
        include_members: bool = False,
        launch: str | None = None,
        restart_count: int | None = None,
        takeover: bool | None = None,
    ) -> list[JoinResult]:
        """Join several groups of ``job`` in one call (a rank's root mesh and its
        sub-meshes), each as :meth:`join_group` would; returns once every one has formed.

        Args:
            job: The job name.
            groups: ``(group, rank, world_size)`` of each group to join, at most 16,
                distinct, or ``(group, rank, world_size, position)`` (see
                :meth:`join_group`).
            member_id, job_seed, timeout_s, include_members, launch, restart_count,
                takeover: As for :meth:`join_group`, the same for every group.

        Returns:
            Each group's result, in the order of ``groups``. The first join that fails
            raises its error, and the others are withdrawn.
        """
        request = pb.JoinGroupsRequest(
            job=job,
            joins=[
                self._join_request(
                    job,
                    group,
                    rank,
                    world_size,
                    member_id,
                    job_seed,
                    timeout_s,
                    include_members,
                    launch,
                    restart_count,
                    takeover,
                    position,
                )
                for group, rank, world_size, position in map(_join_spec, groups)
            ],
        )
        reply, call = self._call(
            "JoinGroups",
            lambda s, d, m: s.JoinGroups.with_call(request, timeout=d, metadata=m),
            timeout_s + self.deadline_s,
            deadline_is_timeout=True,
        )
        where = f"JoinGroups of {len(groups)} groups at {self._targets[self._current]}"
        for result in reply.results:
            self._note_store(result.store_id, where)
        self._note_head(call, where)
        return [JoinResult.from_pb(result) for result in reply.results]

    def _join_request(
        self,
        job: str,
        group: str,
        rank: int,
        world_size: int,
        member_id: str,
        job_seed: int | None,
        timeout_s: float,
        include_members: bool,
        launch: str | None,
        restart_count: int | None,
        takeover: bool | None,
        position: int = 0,
    ) -> pb.JoinGroupRequest:
        request = pb.JoinGroupRequest(
            job=job,
            group=group,
            rank=rank,
            world_size=world_size,
            member_id=member_id,
            member_secret=member_secret(member_id),
            timeout_ms=max(1, round(timeout_s * 1000)),
            include_members=include_members,
            launch=self.launch if launch is None else launch,
            restart_count=self.restart_count if restart_count is None else restart_count,
            takeover=self.takeover if takeover is None else takeover,
            position=position,
        )
        if job_seed is not None:
            request.job_seed = job_seed
        return request

    def reserve(
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
        cancel: threading.Event | None = None,
    ) -> Lease:
        """The lease for ``(group, epoch, seq)``: granted now, or read back. Once ``cancel``
        (default ``None``: never) is set, an outage raises at once instead of waiting."""
        request = pb.ReserveRequest(
            job=job,
            group=group,
            epoch=epoch,
            seq=seq,
            size=size,
            fingerprint=fingerprint,
            rank=rank,
            member_id=member_id,
            member_secret=member_secret(member_id),
        )
        reply, call = self._call(
            "Reserve",
            lambda s, d, m: s.Reserve.with_call(request, timeout=d, metadata=m),
            self.deadline_s,
            cancel=cancel,
        )
        self._note_head(call, f"Reserve of group {group!r} at {self._targets[self._current]}")
        return Lease.from_pb(reply)

    def attest(
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
        cancel: threading.Event | None = None,
    ) -> None:
        """Attest this member's op fingerprint after ``ops`` random ops since the anchor
        ``anchor_seq``; raises DivergenceError if another member attested other bytes. Once
        ``cancel`` (default ``None``: never) is set, an outage raises at once."""
        request = pb.AttestRequest(
            job=job,
            group=group,
            epoch=epoch,
            anchor_seq=anchor_seq,
            ops=ops,
            fingerprint=fingerprint,
            rank=rank,
            member_id=member_id,
            member_secret=member_secret(member_id),
        )
        self._call(
            "Attest",
            lambda s, d, m: s.Attest(request, timeout=d, metadata=m),
            self.deadline_s,
            cancel=cancel,
        )

    def leave_group(self, job: str, group: str, *, epoch: int, rank: int, member_id: str) -> None:
        """Record that this member leaves ``group``'s epoch."""
        request = pb.LeaveGroupRequest(
            job=job,
            group=group,
            epoch=epoch,
            rank=rank,
            member_id=member_id,
            member_secret=member_secret(member_id),
        )
        self._call(
            "LeaveGroup",
            lambda s, d, m: s.LeaveGroup(request, timeout=d, metadata=m),
            self.deadline_s,
        )

    def record_resize(
        self,
        job: str,
        group: str,
        *,
        epoch: int,
        saved_group: str,
        saved_cursor: int,
        rank: int,
        member_id: str,
    ) -> bool:
        """Audit that ``group``'s epoch could not continue a checkpoint stream saved in
        ``saved_group`` at ``saved_cursor`` (a resume on another mesh under the offsets
        policy); True when that was recorded already."""
        request = pb.RecordResizeRequest(
            job=job,
            group=group,
            epoch=epoch,
            saved_group=saved_group,
            saved_cursor=saved_cursor,
            rank=rank,
            member_id=member_id,
            member_secret=member_secret(member_id),
        )
        reply = self._call(
            "RecordResize",
            lambda s, d, m: s.RecordResize(request, timeout=d, metadata=m),
            self.deadline_s,
        )
        return bool(reply.existing)

    def record_quorum(
        self,
        job: str,
        group: str,
        *,
        epoch: int,
        quorum_id: int,
        step: int,
        participants: int,
        healed_from: str,
        rank: int,
        member_id: str,
    ) -> bool:
        """Audit that the replica of ``group`` took part in torchft quorum ``quorum_id``,
        formed at ``step`` with ``participants`` replicas, healing from replica
        ``healed_from`` ("" for none); True when that was recorded already."""
        request = pb.RecordQuorumRequest(
            job=job,
            group=group,
            epoch=epoch,
            quorum_id=quorum_id,
            step=step,
            participants=participants,
            healed_from=healed_from,
            rank=rank,
            member_id=member_id,
            member_secret=member_secret(member_id),
        )
        reply = self._call(
            "RecordQuorum",
            lambda s, d, m: s.RecordQuorum(request, timeout=d, metadata=m),
            self.deadline_s,
        )
        return bool(reply.existing)

    def get_group(
        self, job: str, group: str, *, members_from: int = 0, members_limit: int = 0
    ) -> GroupInfo:
        """Describe ``group``: seed, current epoch, a page of its members from rank
        ``members_from`` (at most ``members_limit``; 0: the server's default, 1024), and the
        high-water mark."""
        request = pb.GetGroupRequest(
            job=job, group=group, members_from=members_from, members_limit=members_limit
        )
        reply = self._call(
            "GetGroup",
            lambda s, d, m: s.GetGroup(request, timeout=d, metadata=m),
            self.deadline_s,
        )
        self._note_store(reply.store_id, f"GetGroup at {self._targets[self._current]}")
        return GroupInfo.from_pb(reply)

    def restore(
        self,
        job: str,
        group: str,
        *,
        epoch: int,
        seq: int,
        cursor: int,
        rank: int,
        member_id: str,
        timeout_s: float = 60.0,
        force: bool = False,
        from_job: str = "",
    ) -> RestoreResult:
        """Vote to make lease ``seq`` of the current epoch start at ``cursor`` (audited).

        It takes effect, and this returns, once every current member of the epoch has asked
        for the same ``(seq, cursor)``: each rank of the group calls it when it loads the same
        checkpoint.

        Args:
            job, group, epoch, seq, cursor, rank, member_id: as the request.
            timeout_s: How long the coordinator waits for the other members. Default 60.0.
            force: Take effect without the other members (admin tokens only). Default
                ``False``.
            from_job: The job whose checkpoint ``cursor`` comes from, when it is another
                job's; the restore record names it. Default ``""``: this job's.

        Raises:
            RestoreTimeoutError: not every member asked within ``timeout_s``.
        """
        request = pb.RestoreRequest(
            job=job,
            group=group,
            epoch=epoch,
            seq=seq,
            cursor=cursor,
            rank=rank,
            member_id=member_id,
            member_secret=member_secret(member_id),
            force=force,
            timeout_ms=max(1, round(timeout_s * 1000)),
            from_job=from_job,
        )
        reply = self._call(
            "Restore",
            lambda s, d, m: s.Restore(request, timeout=d, metadata=m),
            timeout_s + self.deadline_s,
            deadline_is_timeout=True,
        )
        return RestoreResult.from_pb(reply)

    def list_audit(
        self,
        job: str = "",
        group: str = "",
        kinds: Sequence[str] = (),
        since_us: int = 0,
        until_us: int = 0,
        limit: int = 0,
    ) -> list[AuditRecord]:
        """Audit records in chain order, oldest first; empty filters match everything."""
        request = pb.ListAuditRequest(
            job=job,
            group=group,
            kinds=list(kinds),
            since_us=since_us,
            until_us=until_us,
            limit=limit,
        )
        records = self._call(
            "ListAudit",
            lambda s, d, m: list(s.ListAudit(request, timeout=d, metadata=m)),
            self.deadline_s,
        )
        return [AuditRecord.from_pb(r) for r in records]


def _join_spec(spec: tuple[str, int, int] | tuple[str, int, int, int]) -> tuple[str, int, int, int]:
    """A join_groups entry as (group, rank, world_size, position), position 0 when left out."""
    return (spec[0], spec[1], spec[2], spec[3] if len(spec) > 3 else 0)
