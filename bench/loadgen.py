"""Simulated ranks: an asyncio load generator over real gRPC channels to a coordinator.

One process simulates thousands of ranks: each rank is a coroutine, and `channels` channels
carry them (rank i uses channel i mod channels), as the ranks of many real processes would
arrive. It speaks only the contract (rngcoord.v1), so it measures what a deployment serves.
bench/scale.py and tests/server/test_scale.py drive it; it lives beside them, not in the
server package, so the coordinator's image does not carry it.

- `join_storm`: ranks join their groups at once; returns when every rank has its epoch (or
  failed), with the time from the first request to the last epoch held.
- `reserve_load`: ranks call Reserve in a closed loop for a fixed time, either repeating
  leases already granted (hits) or asking for new ones (grants); returns throughput and
  latency percentiles.
- `reconnect_storm`: every rank asks for a lease at once, right after a coordinator restart,
  retrying as the client does (capped exponential backoff with full jitter); returns how long
  until every rank was served.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import status_pb2

from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "JoinOutcome",
    "LoadOutcome",
    "Rank",
    "ReconnectOutcome",
    "join_storm",
    "join_storm_grouped",
    "open_channels",
    "prepare",
    "reconnect_storm",
    "reserve_load",
]

# Each channel gets a TCP connection of its own (gRPC otherwise shares one per target across
# a process's channels), as the ranks of many processes would: the server's workers then
# share the load (SO_REUSEPORT spreads connections, not calls). Reconnects are retried at
# least every 0.5 s, as rngcoord's client channels do, so a restart is seen at once.
_CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True, slots=True)
class Rank:
    """One simulated rank: which group it joins, as which rank of how many."""

    group: str
    rank: int
    world_size: int
    member_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)


@dataclass(frozen=True)
class JoinOutcome:
    """What a join storm did.

    Args:
        seconds: from the first JoinGroup sent to the last epoch received.
        epochs: per group, the epoch numbers its ranks got (one distinct value when it formed).
        errors: "group rank: status: message" of every join that failed.
    """

    seconds: float
    epochs: dict[str, set[int]]
    errors: list[str]

    @property
    def formed(self) -> int:
        """Groups whose every rank got the same epoch."""
        return sum(1 for epochs in self.epochs.values() if len(epochs) == 1)


@dataclass(frozen=True)
class LoadOutcome:
    """What a closed-loop Reserve load did.

    Args:
        calls: calls completed inside the measured window.
        seconds: the window's length.
        latencies_ms: each call's latency, sorted.
        errors: calls that failed, by status code name.
        metered: what the load's `meter` rose by over the window (e.g. the server's CPU
            seconds); 0.0 without one.
    """

    calls: int
    seconds: float
    latencies_ms: list[float]
    errors: dict[str, int]
    metered: float = 0.0

    @property
    def per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        index = min(len(self.latencies_ms) - 1, int(q * len(self.latencies_ms)))
        return self.latencies_ms[index]


@dataclass(frozen=True)
class ReconnectOutcome:
    """What a reconnect storm did.

    Args:
        seconds: from the storm's start to the last rank served.
        served: ranks that got their lease.
        retries: attempts that failed with UNAVAILABLE or DEADLINE_EXCEEDED and were retried.
        errors: "group rank: status: message" of every rank that failed for good.
    """

    seconds: float
    served: int
    retries: int
    errors: list[str]


def open_channels(target: str, channels: int) -> list[grpc.aio.Channel]:
    """`channels` plaintext aio channels to `target`."""
    return [grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS) for _ in range(channels)]


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


async def join_storm(
    channels: Sequence[grpc.aio.Channel],
    job: str,
    ranks: Sequence[Rank],
    *,
    timeout_s: float = 60.0,
    token: str | None = None,
    job_seed: int | None = None,
) -> JoinOutcome:
    """Every rank of `ranks` joins its group at once; wait until all have an answer. A join
    refused UNAVAILABLE (a connection the server did not take in time) is retried with
    full-jitter backoff within `timeout_s`."""
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    metadata = _metadata(token)
    epochs: dict[str, set[int]] = {}
    errors: list[str] = []
    finished = 0.0

    async def one(i: int, r: Rank) -> None:
        nonlocal finished
        request = pb.JoinGroupRequest(
            job=job,
            group=r.group,
            rank=r.rank,
            world_size=r.world_size,
            member_id=r.member_id,
            member_secret=r.secret,
            timeout_ms=int(timeout_s * 1000),
        )
        if job_seed is not None:
            request.job_seed = job_seed
        attempt = 0
        while True:
            try:
                reply = await stubs[i % len(stubs)].JoinGroup(
                    request, timeout=timeout_s + 30, metadata=metadata
                )
                break
            except grpc.aio.AioRpcError as exc:
                # A connection the busy server did not take in time is retried, as a client
                # retries it (the join is idempotent: same member id and secret).
                if exc.code() is grpc.StatusCode.UNAVAILABLE and (
                    time.perf_counter() - started < timeout_s
                ):
                    await asyncio.sleep(random.uniform(0, min(5.0, 0.1 * 2**attempt)))
                    attempt += 1
                    continue
                errors.append(f"{r.group} {r.rank}: {exc.code().name}: {exc.details()}")
                return
        epochs.setdefault(r.group, set()).add(reply.epoch)
        finished = time.perf_counter()

    started = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(ranks)))
    return JoinOutcome(max(finished - started, 0.0), epochs, errors)


async def join_storm_grouped(
    channels: Sequence[grpc.aio.Channel],
    job: str,
    plans: Sequence[Sequence[Rank]],
    *,
    timeout_s: float = 60.0,
    token: str | None = None,
) -> JoinOutcome:
    """Every simulated rank joins all its groups at once in one JoinGroups message, on one
    Session stream per channel (as `install()` would send it); wait until all have an
    answer. A plan is one rank's groups; its first entry's member id and secret stand for
    all of them."""
    sessions = [_Session(c, _metadata(token)) for c in channels]
    epochs: dict[str, set[int]] = {}
    errors: list[str] = []
    finished = 0.0

    async def one(i: int, plan: Sequence[Rank]) -> None:
        nonlocal finished
        me = plan[0]
        request = pb.JoinGroupsRequest(
            job=job,
            joins=[
                pb.JoinGroupRequest(
                    group=r.group,
                    rank=r.rank,
                    world_size=r.world_size,
                    member_id=me.member_id,
                    member_secret=me.secret,
                    timeout_ms=int(timeout_s * 1000),
                )
                for r in plan
            ],
        )
        try:
            reply = await sessions[i % len(sessions)].call("join_groups", request)
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{me.group} {me.rank}: {exc.code().name}: {exc.details()}")
            return
        for r, result in zip(plan, reply.results, strict=True):
            epochs.setdefault(r.group, set()).add(result.epoch)
        finished = time.perf_counter()

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(i, plan) for i, plan in enumerate(plans)))
    finally:
        for session in sessions:
            await session.close()
    return JoinOutcome(max(finished - started, 0.0), epochs, errors)


async def prepare(
    channels: Sequence[grpc.aio.Channel],
    job: str,
    ranks: Sequence[Rank],
    *,
    size: int = 1 << 16,
    token: str | None = None,
) -> None:
    """Form every group of `ranks` (epoch 1) and grant leases 0..7 of each, for `reserve_load`."""
    outcome = await join_storm(channels, job, ranks, token=token)
    if outcome.errors or outcome.formed != len(outcome.epochs):
        raise RuntimeError(f"groups did not form: {outcome.errors[:3]}")
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    first: dict[str, Rank] = {}
    for r in ranks:
        first.setdefault(r.group, r)

    async def grant(i: int, r: Rank) -> None:
        for seq in range(8):
            request = pb.ReserveRequest(
                job=job,
                group=r.group,
                epoch=1,
                seq=seq,
                size=size,
                fingerprint=b"loadgen",
                rank=r.rank,
                member_id=r.member_id,
                member_secret=r.secret,
            )
            await stubs[i % len(stubs)].Reserve(request, timeout=30, metadata=_metadata(token))

    await asyncio.gather(*(grant(i, r) for i, r in enumerate(first.values())))


async def reserve_load(
    channels: Sequence[grpc.aio.Channel],
    job: str,
    ranks: Sequence[Rank],
    *,
    grants: bool,
    seconds: float,
    warmup_s: float = 0.5,
    size: int = 1 << 16,
    epoch: int = 1,
    token: str | None = None,
    interval_s: float = 0.0,
    session: bool = False,
    meter: Callable[[], float] | None = None,
) -> LoadOutcome:
    """Ranks call Reserve in a closed loop for `seconds` after `warmup_s`.

    With `grants`, each call asks for the next seq of the rank's group, from seq 8: a new
    lease every time, so every rank must be alone in its group. Otherwise each call repeats
    one of the leases seq 0..7 of its group, which `prepare` granted (a hit). With
    `interval_s`, each rank starts a call every `interval_s` seconds, from a random phase (an
    open loop), instead of as soon as its last one returns. With `session`, the calls are
    messages on one Session stream per channel instead of unary calls. With `meter`, its
    rise over the window (read at the window's start and end) is the outcome's `metered`.
    """
    if grants and len({r.group for r in ranks}) != len(ranks):
        raise ValueError("grants need one rank per group: seqs of a group are granted in order")
    stubs: Sequence[Any] = (
        [_Session(c, _metadata(token)) for c in channels]
        if session
        else [pb_grpc.CoordinatorStub(c) for c in channels]
    )
    metadata = _metadata(token)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    window = [0.0, 0.0]
    calls = 0

    async def one(i: int, r: Rank) -> None:
        nonlocal calls
        stub = stubs[i % len(stubs)]
        counter = itertools.count(8)
        hit = itertools.cycle(range(8))
        due = time.perf_counter() + random.uniform(0, interval_s)
        while True:
            if interval_s:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                due += interval_s
            now = time.perf_counter()
            if now >= window[1]:
                return
            seq = next(counter) if grants else next(hit)
            request = pb.ReserveRequest(
                job=job,
                group=r.group,
                epoch=epoch,
                seq=seq,
                size=size,
                fingerprint=b"loadgen",
                rank=r.rank,
                member_id=r.member_id,
                member_secret=r.secret,
            )
            t0 = time.perf_counter()
            try:
                await stub.Reserve(request, timeout=30, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                continue
            t1 = time.perf_counter()
            if window[0] <= t0 and t1 <= window[1]:
                calls += 1
                latencies.append((t1 - t0) * 1000)

    metered = [0.0]

    async def read_meter() -> None:
        if meter is None:
            return
        await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
        first = meter()
        await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
        metered[0] = meter() - first

    start = time.perf_counter()
    window[0], window[1] = start + warmup_s, start + warmup_s + seconds
    try:
        await asyncio.gather(read_meter(), *(one(i, r) for i, r in enumerate(ranks)))
    finally:
        for stub in stubs:
            if isinstance(stub, _Session):
                await stub.close()
    latencies.sort()
    return LoadOutcome(calls, seconds, latencies, errors, metered[0])


class _Session:
    """Reserve as messages on one Session stream (a process's stream, as `install()` opens),
    with the unary stub's call shape. An error answer raises AioRpcError with its code."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        open_stream: Any = channel.stream_stream(
            "/rngcoord.v1.Coordinator/Session",
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
        )
        self._call: Any = open_stream(metadata=metadata)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[pb.SessionResponse]] = {}
        self._writing = asyncio.Lock()  # one write at a time on a stream
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for response in self._call:
            answer = self._pending.pop(response.id, None)
            if answer is not None and not answer.done():
                answer.set_result(response)

    async def Reserve(self, request: pb.ReserveRequest, **_: Any) -> pb.ReserveResponse:
        reply: pb.ReserveResponse = await self.call("reserve", request)
        return reply

    async def call(self, field: str, request: Any) -> Any:
        """Send `request` as the `field` call; its reply, or AioRpcError with its status."""
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[request_id] = answer
        async with self._writing:
            await self._call.write(pb.SessionRequest(id=request_id, **{field: request}))
        response = await answer
        if response.error:
            status = status_pb2.Status.FromString(response.error)
            code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), status.message, None
            )
        return getattr(response, field)

    async def close(self) -> None:
        await self._call.done_writing()
        await self._reader


async def reconnect_storm(
    channels: Sequence[grpc.aio.Channel],
    job: str,
    ranks: Sequence[Rank],
    *,
    seq: int = 0,
    epoch: int = 1,
    size: int = 1 << 16,
    budget_s: float = 120.0,
    backoff_s: float = 0.1,
    max_backoff_s: float = 5.0,
    token: str | None = None,
) -> ReconnectOutcome:
    """Every rank asks for lease `seq` of its group at once (granted before, by `prepare`),
    retrying UNAVAILABLE and DEADLINE_EXCEEDED for up to `budget_s` with full-jitter backoff
    (a random wait in [0, min(max_backoff_s, backoff_s * 2^attempt)]), so that the ranks do
    not come back in lockstep."""
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    metadata = _metadata(token)
    errors: list[str] = []
    served = retries = 0
    finished = 0.0
    started = time.perf_counter()

    async def one(i: int, r: Rank) -> None:
        nonlocal served, retries, finished
        request = pb.ReserveRequest(
            job=job,
            group=r.group,
            epoch=epoch,
            seq=seq,
            size=size,
            fingerprint=b"loadgen",
            rank=r.rank,
            member_id=r.member_id,
            member_secret=r.secret,
        )
        attempt = 0
        while True:
            try:
                await stubs[i % len(stubs)].Reserve(request, timeout=10, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RETRIED and time.perf_counter() - started < budget_s:
                    retries += 1
                    await asyncio.sleep(
                        random.uniform(0, min(max_backoff_s, backoff_s * 2**attempt))
                    )
                    attempt += 1
                    continue
                errors.append(f"{r.group} {r.rank}: {exc.code().name}: {exc.details()}")
                return
            served += 1
            finished = time.perf_counter()
            return

    await asyncio.gather(*(one(i, r) for i, r in enumerate(ranks)))
    return ReconnectOutcome(max(finished - started, 0.0), served, retries, errors)
