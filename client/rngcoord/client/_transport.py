"""How :class:`~rngcoord.client.CoordinatorClient` reaches the coordinator:
targets, channels, failover, deadlines, the outage budget, token and TLS, and each member's
credential.

:class:`Transport` runs one call (``_call``): it retries on UNAVAILABLE and DEADLINE_EXCEEDED,
failing over across targets with capped exponential backoff and full jitter, for as long as
the outage budget allows, watches which store answers, and maps every gRPC status to an
:mod:`rngcoord.client._errors` exception. The RPCs themselves, with Python types, are
:class:`~rngcoord.client.CoordinatorClient`'s (see that module for the semantics).
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
from typing import Any, Self, TypeVar

import grpc

from rngcoord.client._errors import (
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
from rngcoord.client._session import SessionStub
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc
from rngcoord.v1.status import HEAD_TRAILER, error_info

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

# The outage messages' logger, as documented (docs/design.md §6.2) since this code lived in
# connection.py: the name users configure, whichever module now holds it.
logger = logging.getLogger("rngcoord.client.connection")


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


class Transport:
    """The connection machinery under :class:`~rngcoord.client.CoordinatorClient`
    (its arguments are documented there)."""

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

    def __enter__(self) -> Self:
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

_BY_CODE: dict[grpc.StatusCode, type[RNGCoordError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OffsetsExhausted,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.DEADLINE_EXCEEDED: JoinTimeoutError,
}
