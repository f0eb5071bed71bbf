"""The connection to the coordinator: targets, failover, deadlines, the outage budget, token
and TLS.

:class:`CoordinatorClient` mirrors the ``rngcoord.v1.Coordinator`` RPCs with Python types and
turns every gRPC status into an :mod:`rngcoord.client.errors` exception whose message says
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
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from rngcoord.client.errors import (
    AuthenticationError,
    CoordinatorUnavailable,
    DivergenceError,
    FailedPreconditionError,
    InvalidRequest,
    JoinTimeoutError,
    NotFoundError,
    NotMemberError,
    OffsetsExhausted,
    PermissionDeniedError,
    RestoreTimeoutError,
    RNGCoordError,
    StaleEpochError,
    StoreMismatchError,
)
from rngcoord.client.session import SessionStub
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import HEAD_TRAILER, error_info
from rngcoord.v1.types import AuditRecord, GroupInfo, JoinResult, Lease, RestoreResult

#: Where the client looks for the coordinator when neither ``targets`` nor RNGCOORD_ADDR say.
DEFAULT_ADDR = "localhost:29520"

_T = TypeVar("_T")
_RETRIABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# gRPC channels back off exponentially (up to 120 s by default) after a failed connect, and
# fail calls fast meanwhile; a coordinator restart must be picked up by our next retry.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_MAX_SLEEP_S = 5.0
# Failures further apart than this (with no attempt between) are separate outages: a call long
# after a given-up one has no evidence that the coordinator stayed down meanwhile.
_OUTAGE_GAP_S = 30.0
# An outage that heals within this (a dropped connection, one replica's failover) is not
# announced.
_ANNOUNCE_AFTER_S = 1.0
_LAST_CHANCE_S = 2.0

logger = logging.getLogger(__name__)


_SECRETS: dict[str, bytes] = {}
_SECRETS_LOCK = threading.Lock()


def member_secret(member_id: str) -> bytes:
    """This process's credential for `member_id`: 32 random bytes, drawn the first time the
    member id is used and sent with every call as that member, so that a member id alone
    (GetGroup lists them) lets no other process act as it. Member ids name one process
    incarnation, so the secret lives as long as the process."""
    with _SECRETS_LOCK:
        found = _SECRETS.get(member_id)
        if found is None:
            found = _SECRETS[member_id] = secrets.token_bytes(32)
        return found


def adopt_member_secret(member_id: str, secret: bytes) -> None:
    """Act, from this process, as `member_id`, which joined with `secret` by other means
    (a tool that joined through the raw stubs). Raises ValueError if this process already
    holds another secret for it."""
    with _SECRETS_LOCK:
        if _SECRETS.setdefault(member_id, secret) != secret:
            raise ValueError(f"member {member_id!r} already has another secret in this process")


class _ChannelPool:
    """One channel per (target, CA bundle) in this process, shared by every client: all the
    groups and trackers of a process, thread-ranks included, talk over one connection per
    coordinator, and their calls are multiplexed on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, bytes | None], tuple[grpc.Channel, int]] = {}

    def acquire(self, target: str, root: bytes | None) -> grpc.Channel:
        with self._lock:
            found = self._channels.get((target, root))
            if found is None:
                if root is None:
                    channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                else:
                    credentials = grpc.ssl_channel_credentials(root_certificates=root)
                    channel = grpc.secure_channel(target, credentials, options=_CHANNEL_OPTIONS)
                found = (channel, 0)
            self._channels[target, root] = (found[0], found[1] + 1)
            return found[0]

    def release(self, target: str, root: bytes | None) -> None:
        with self._lock:
            channel, users = self._channels[target, root]
            if users > 1:
                self._channels[target, root] = (channel, users - 1)
                return
            del self._channels[target, root]
        channel.close()


_CHANNELS = _ChannelPool()


def _env_targets() -> list[str]:
    return [
        t.strip() for t in os.environ.get("RNGCOORD_ADDR", DEFAULT_ADDR).split(",") if t.strip()
    ]


class CoordinatorClient:
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
            Restore, RecordResize) as messages on one Session stream per target
            (:mod:`rngcoord.client.session`), with the same errors and retries as unary
            calls, at a fraction of their cost. Default ``False``: unary calls, for tools
            that make a few; ``install()`` passes ``True``.
    """

    def __init__(
        self,
        targets: str | Sequence[str] | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        deadline_s: float = 10.0,
        outage_s: float = 5.0,
        backoff_s: float = 0.1,
        log_outages: bool = True,
        session: bool = False,
    ) -> None:
        if targets is None:
            resolved = _env_targets()
        elif isinstance(targets, str):
            resolved = [t.strip() for t in targets.split(",") if t.strip()]
        else:
            resolved = [t.strip() for t in targets if t.strip()]
        if not resolved:
            raise InvalidRequest(
                f"no coordinator target in {targets!r}: pass targets='HOST:PORT' or set "
                "RNGCOORD_ADDR"
            )
        if not deadline_s > 0 or not outage_s >= 0 or not backoff_s >= 0:
            raise InvalidRequest(
                f"deadline_s must be > 0, outage_s and backoff_s >= 0; got deadline_s="
                f"{deadline_s}, outage_s={outage_s}, backoff_s={backoff_s}"
            )
        self._targets = resolved
        token = token if token is not None else os.environ.get("RNGCOORD_TOKEN") or None
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        tls_ca = tls_ca if tls_ca is not None else os.environ.get("RNGCOORD_TLS_CA") or None
        root: bytes | None = None
        if tls_ca:
            try:
                with open(tls_ca, "rb") as f:
                    root = f.read()
            except OSError as e:
                raise InvalidRequest(
                    f"cannot read the CA bundle {tls_ca!r} ({e}): point tls_ca or "
                    "RNGCOORD_TLS_CA at a PEM file"
                ) from e
        self._keys = [(t, root) for t in resolved]
        self._channels = [_CHANNELS.acquire(t, root) for t in resolved]
        self._closed = False
        self._sessions = [SessionStub(c, self._metadata) for c in self._channels] if session else []
        self._stubs: list[Any] = self._sessions or [
            pb_grpc.CoordinatorStub(c) for c in self._channels
        ]
        self._current = 0
        self.deadline_s = deadline_s
        self.outage_s = outage_s
        self.backoff_s = backoff_s
        self.log_outages = log_outages
        #: What join_group sends by default (JoinGroupRequest.launch, restart_count and
        #: takeover); install() sets them from the launcher's environment.
        self.launch = ""
        self.restart_count = 0
        self.takeover = False
        # The outage state, shared by every thread's calls (under _outage_lock).
        self._outage_lock = threading.Lock()
        self._outage_began: float | None = None  # monotonic time of its first failed attempt
        self._outage_began_wall = 0.0
        self._outage_announced = False
        self._last_failure = 0.0  # monotonic
        self._last_reply_wall: float | None = None  # None: never reached
        self._store_id: str | None = None
        self._head = ""
        self._head_id = -1
        self._store_lock = threading.Lock()

    @property
    def targets(self) -> tuple[str, ...]:
        """The coordinator addresses, in failover order."""
        return tuple(self._targets)

    @property
    def store_id(self) -> str | None:
        """The id of the store this client's job draws from: the first one a reply named, or
        the one `expect_store` set; None before either."""
        return self._store_id

    @property
    def audit_head(self) -> str:
        """The latest audit chain head a reply carried, "STORE_ID:RECORD_ID:HASH:MAC" ("" before
        any): keep it with checkpoints; `rngcoord verify --anchor` checks the chain against it."""
        return self._head

    def expect_store(self, store_id: str) -> None:
        """Accept replies only from the store `store_id` (a checkpoint's); raise
        :class:`StoreMismatchError` if another one has answered already."""
        self._note_store(store_id, "the checkpoint being loaded")

    def _note_store(self, store_id: str, where: str) -> None:
        if not store_id:
            return  # a coordinator older than store ids
        with self._store_lock:
            known = self._store_id
            if known is None:
                self._store_id = store_id
                return
        if known != store_id:
            raise StoreMismatchError(
                f"{where} names store {store_id}, but this job's random streams came from "
                f"store {known}: the coordinator lost its store, or was started on another "
                "one, and continuing could hand out offsets it already gave (the same random "
                "numbers again). Restart the coordinator on the original store (--db); after a "
                "loss, recover with `rngcoord serve --init --floor-from AUDIT_EXPORT`; to "
                "start over on the new store on purpose, load the checkpoint without its "
                "'store_id'",
                reason="STORE_MISMATCH",
                metadata={"expected": known, "found": store_id},
            )

    def _note_head(self, call: Any, where: str) -> None:
        for key, value in call.trailing_metadata() or ():
            if key != HEAD_TRAILER or not isinstance(value, str):
                continue
            parts = value.split(":")
            if len(parts) != 4 or not parts[1].isdigit():
                return
            self._note_store(parts[0], where)
            record_id = int(parts[1])
            with self._store_lock:
                if record_id > self._head_id:
                    self._head_id, self._head = record_id, value
            return

    def close(self) -> None:
        """Release the channels (the last client of a target closes its channel); the client
        cannot be used afterwards. Idempotent."""
        if not self._closed:
            self._closed = True
            for stub in self._sessions:
                stub.close()
            for target, root in self._keys:
                _CHANNELS.release(target, root)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        invoke: Callable[[Any, float, tuple[tuple[str, str], ...]], _T],
        deadline_s: float,
        deadline_is_timeout: bool = False,
        cancel: threading.Event | None = None,
        budget_s: float | None = None,
    ) -> _T:
        """Run ``invoke(stub, deadline, metadata)`` with failover, backoff and error mapping.

        ``deadline_is_timeout``: DEADLINE_EXCEEDED means the server's barrier timed out (a
        JoinGroup), which is reported, not retried. ``cancel``: once set, the call stops
        retrying and raises :class:`CoordinatorUnavailable` (a closing lease manager).
        ``budget_s``: this call's own budget, counted from its start, instead of the shared
        outage's ``outage_s`` (install()'s bounded first contact).
        """
        started = time.monotonic()
        tried: set[int] = set()
        rounds = 0
        began = started
        last: grpc.RpcError | None = None
        while True:
            index = self._current
            tried.add(index)
            try:
                result = invoke(self._stubs[index], deadline_s, self._metadata)
            except grpc.RpcError as e:
                self._note_head(e, f"{method} at {self._targets[index]}")
                code = e.code()
                wait_s = _rate_limited_wait(e)
                if wait_s is not None:
                    self._reached()
                    budget = self.outage_s if budget_s is None else budget_s
                    if time.monotonic() - started + wait_s <= max(budget, wait_s):
                        # The server said when; the same target will take it.
                        self._sleep(wait_s, cancel)
                        continue
                if code not in _RETRIABLE or (
                    deadline_is_timeout and code is grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    self._reached()
                    raise _map_error(method, self._targets[index], e) from e
                began, last = self._failed(), e
            else:
                self._reached()
                return result
            self._current = (index + 1) % len(self._targets)
            if self._current not in tried:
                continue  # fail over at once to a target this round has not tried
            # Every target failed in this round.
            tried.clear()
            now = time.monotonic()
            if budget_s is None:
                # The shared outage's budget; a call that starts past it still gets a short
                # chance, longer than a channel's reconnect backoff, to find the coordinator
                # back.
                grace = min(self.outage_s, _LAST_CHANCE_S) - (now - started)
                left = max(self.outage_s - (now - began), grace)
            else:
                left = budget_s - (now - started)
            if left <= 0 or (cancel is not None and cancel.is_set()):
                assert last is not None
                raise self._unavailable(method, last, now - began, budget_s) from last
            self._announce(now - began, left)
            cap = min(_MAX_SLEEP_S, self.backoff_s * 2**rounds)
            rounds += 1
            self._sleep(min(random.uniform(0, cap), left), cancel)

    @staticmethod
    def _sleep(seconds: float, cancel: threading.Event | None) -> None:
        if cancel is None:
            time.sleep(seconds)
        else:
            cancel.wait(seconds)

    def _failed(self) -> float:
        """Count a failed attempt; return when its outage began (monotonic)."""
        now = time.monotonic()
        with self._outage_lock:
            if self._outage_began is None or now - self._last_failure > _OUTAGE_GAP_S:
                self._outage_began = now
                self._outage_began_wall = time.time()
                self._outage_announced = False
            self._last_failure = now
            return self._outage_began

    def _reached(self) -> None:
        """A target answered: any outage is over."""
        with self._outage_lock:
            began, announced = self._outage_began, self._outage_announced
            self._outage_began = None
            self._outage_announced = False
            self._last_reply_wall = time.time()
        if began is not None and announced and self.log_outages:
            logger.warning(
                "rngcoord: coordinator outage over after %.1f s: %s answers again",
                time.monotonic() - began,
                self._targets[self._current],
            )

    def _announce(self, lasted_s: float, left_s: float) -> None:
        """Warn once per outage, once it outlasts a blip."""
        if not self.log_outages or lasted_s < _ANNOUNCE_AFTER_S:
            return
        with self._outage_lock:
            if self._outage_announced or self._outage_began is None:
                return
            self._outage_announced = True
            since = self._outage_began_wall
        logger.warning(
            "rngcoord: coordinator unreachable at [%s] since %s; random ops continue on the "
            "leases held, and wait for new ones, for up to %.0f s more (outage budget %g s: "
            "install(outage_s=...) or RNGCOORD_OUTAGE_S)",
            ", ".join(self._targets),
            _clock(since),
            left_s,
            self.outage_s,
        )

    def _unavailable(
        self, method: str, last: grpc.RpcError, lasted_s: float, budget_s: float | None
    ) -> CoordinatorUnavailable:
        with self._outage_lock:
            reached = self._last_reply_wall
            since = self._outage_began_wall
        where = f"[{', '.join(self._targets)}]"
        error = f"{method}: last error {last.code().name}: {last.details()}"
        if budget_s is not None:
            message = (
                f"coordinator unreachable at {where} for {budget_s:g} s ({error}): start it with "
                "`rngcoord serve`, or point RNGCOORD_ADDR (install(target=...)) at it"
            )
        else:
            seen = "never reached" if reached is None else f"reachable until {_clock(reached)}"
            message = (
                f"coordinator unreachable at {where} since {_clock(since)} ({seen}), for "
                f"{lasted_s:.1f} s, past the outage budget of {self.outage_s:g} s ({error}): "
                "start the coordinator on its store (`rngcoord serve`), check RNGCOORD_ADDR, "
                "or ride out longer outages with install(outage_s=...) or RNGCOORD_OUTAGE_S"
            )
        return CoordinatorUnavailable(
            message,
            code=last.code().name,
            metadata={"targets": ",".join(self._targets), "outage_s": f"{lasted_s:.1f}"},
        )

    def probe(self, job: str, within_s: float = 30.0) -> None:
        """Check, within ``within_s`` seconds, that a coordinator answers and accepts the token
        for ``job``: a GetGroup of a group no job has, whose NOT_FOUND proves both.

        Raises:
            CoordinatorUnavailable: no target answered within ``within_s``.
            AuthenticationError: the token is missing or wrong (PermissionDeniedError: its
                role or jobs do not allow ``job``).
        """
        request = pb.GetGroupRequest(job=job, group=_PROBE_GROUP, members_limit=1)
        with contextlib.suppress(NotFoundError):
            self._call(
                "GetGroup",
                lambda s, d, m: s.GetGroup(request, timeout=d, metadata=m),
                min(self.deadline_s, max(within_s, 0.1)),
                budget_s=within_s,
            )

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


# What the caller should do, by the coordinator's ErrorReason; the class each reason raises.
_HINTS: dict[str, tuple[type[RNGCoordError], str]] = {
    "INVALID_FIELD": (InvalidRequest, ""),
    "UNKNOWN_JOB": (NotFoundError, "check the job and group names (RNGCOORD_JOB)"),
    "UNKNOWN_GROUP": (
        NotFoundError,
        "check the group name, and join the group first (install() joins lazily)",
    ),
    "UNKNOWN_EPOCH": (NotFoundError, "join the group for a current epoch"),
    "STALE_EPOCH": (
        StaleEpochError,
        "the group's membership changed: call rngcoord.client.install() again on every rank",
    ),
    "NOT_MEMBER": (
        NotMemberError,
        "this process is not a member of the epoch: rejoin the group (install() again)",
    ),
    "DIVERGENCE": (
        DivergenceError,
        "every rank of a group must run the same random DTensor ops (names and global "
        "shapes) in the same order: compare the ranks' code paths up to this point",
    ),
    "SEED_CONFLICT": (
        FailedPreconditionError,
        "pass the job's root seed, or none, to install(); or use a new job name",
    ),
    "WORLD_SIZE_MISMATCH": (
        FailedPreconditionError,
        "every rank of a group must join with the same world size",
    ),
    "SEQ_OUT_OF_ORDER": (FailedPreconditionError, "request leases in seq order"),
    "RESTORE_CONFLICT": (
        FailedPreconditionError,
        "load the same checkpoint on every rank at the same point of its op sequence",
    ),
    "OFFSETS_EXHAUSTED": (OffsetsExhausted, "start a new job, or Restore to an earlier cursor"),
    "JOIN_TIMEOUT": (
        JoinTimeoutError,
        "start every rank of the group, or raise the join timeout",
    ),
    "BAD_TOKEN": (AuthenticationError, "pass token= or set RNGCOORD_TOKEN to the job's token"),
    "NOT_PERMITTED": (
        PermissionDeniedError,
        "use a token whose role and job patterns allow this call (the server's token file)",
    ),
    "BAD_CREDENTIAL": (
        PermissionDeniedError,
        "only the process that joined as a member may act as it; this process must join the "
        "group itself (install() again)",
    ),
    "JOB_IN_USE": (
        FailedPreconditionError,
        "another launch is training this job: stop it, use another job name, or pass "
        "install(takeover=True) to replace it",
    ),
    "RESTORE_TIMEOUT": (
        RestoreTimeoutError,
        "every rank of the group must load the same checkpoint (load_state_dict) at the same "
        "point of its op sequence",
    ),
    "MALFORMED_REQUEST": (InvalidRequest, "client and coordinator must speak rngcoord.v1"),
    "RATE_LIMITED": (
        CoordinatorUnavailable,
        "this host sends more calls than the coordinator's --peer-rate allows",
    ),
    "TOO_MANY_STREAMS": (
        CoordinatorUnavailable,
        "this host (or the coordinator) has as many ListAudit streams open as it allows: "
        "finish or close one, or raise --max-audit-streams-per-host / --max-audit-streams",
    ),
}


def _clock(wall: float) -> str:
    """A wall-clock time as log lines show it, with the zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(wall))


# A group name no job uses: install()'s probe asks for it and expects NOT_FOUND.
_PROBE_GROUP = "rngcoord.probe"


def _rate_limited_wait(error: grpc.RpcError) -> float | None:
    """Seconds to wait before retrying a call refused as RATE_LIMITED (None: not refused so)."""
    if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    info = error_info(error)
    if info is None or info.reason != "RATE_LIMITED":
        return None
    try:
        wait_ms = int(info.metadata.get("retry_after_ms", "100"))
    except ValueError:
        wait_ms = 100
    return min(max(wait_ms, 1) / 1000, _MAX_SLEEP_S)


def _map_error(method: str, target: str, error: grpc.RpcError) -> RNGCoordError:
    """The client error for a non-retriable failure of ``method`` at ``target``, chosen by the
    ErrorInfo reason the coordinator sent (the status code only when it sent none)."""
    code: grpc.StatusCode = error.code()
    details: str = error.details() or ""
    info = error_info(error)
    reason = info.reason if info is not None else None
    metadata = info.metadata if info is not None else {}
    where = f"{method} at {target}"
    found = _HINTS.get(reason or "")
    if found is None:
        cls = _BY_CODE.get(code, RNGCoordError)
        message = f"{where} failed with {code.name}: {details}"
    else:
        cls, hint = found
        message = f"{where}: {details}" + (f"; {hint}" if hint else "")
    return cls(message, code.name, reason, metadata)


# Statuses without an ErrorInfo of ours: the transport's, or another server's.
_BY_CODE: dict[grpc.StatusCode, type[RNGCoordError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OffsetsExhausted,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.DEADLINE_EXCEEDED: JoinTimeoutError,
}


def _join_spec(spec: tuple[str, int, int] | tuple[str, int, int, int]) -> tuple[str, int, int, int]:
    """A join_groups entry as (group, rank, world_size, position), position 0 when left out."""
    return (spec[0], spec[1], spec[2], spec[3] if len(spec) > 3 else 0)
