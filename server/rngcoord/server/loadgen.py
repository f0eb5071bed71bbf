"""Simulated ranks: an asyncio load generator over real gRPC channels to a coordinator.

One process simulates thousands of ranks: each rank is a coroutine, and `channels` channels
carry them (rank i uses channel i mod channels), as the ranks of many real processes would
arrive. It speaks only the contract (rngcoord.v1), so it measures what a deployment serves.
The scale tests and bench/scale.py drive it; an operator can point it at a coordinator to
check a deployment before a large job.

- `join_storm`: ranks join their groups at once; returns when every rank has its epoch (or
  failed), with the time from the first request to the last epoch held.
- `reserve_load`: ranks call Reserve in a closed loop for a fixed time, either repeating
  leases already granted (hits) or asking for new ones (grants); returns throughput and
  latency percentiles.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "JoinOutcome",
    "LoadOutcome",
    "Rank",
    "join_storm",
    "open_channels",
    "prepare",
    "reserve_load",
]

# Each channel gets a TCP connection of its own (gRPC otherwise shares one per target across
# a process's channels), as the ranks of many processes would: the server's workers then
# share the load (SO_REUSEPORT spreads connections, not calls).
_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


@dataclass(frozen=True, slots=True)
class Rank:
    """One simulated rank: which group it joins, as which rank of how many."""

    group: str
    rank: int
    world_size: int
    member_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


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
    """

    calls: int
    seconds: float
    latencies_ms: list[float]
    errors: dict[str, int]

    @property
    def per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        index = min(len(self.latencies_ms) - 1, int(q * len(self.latencies_ms)))
        return self.latencies_ms[index]


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
    """Every rank of `ranks` joins its group at once; wait until all have an answer."""
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
            timeout_ms=int(timeout_s * 1000),
        )
        if job_seed is not None:
            request.job_seed = job_seed
        try:
            reply = await stubs[i % len(stubs)].JoinGroup(
                request, timeout=timeout_s + 30, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{r.group} {r.rank}: {exc.code().name}: {exc.details()}")
            return
        epochs.setdefault(r.group, set()).add(reply.epoch)
        finished = time.perf_counter()

    started = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(ranks)))
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
) -> LoadOutcome:
    """Ranks call Reserve in a closed loop for `seconds` after `warmup_s`.

    With `grants`, each call asks for the next seq of the rank's group, from seq 8: a new
    lease every time, so every rank must be alone in its group. Otherwise each call repeats
    one of the leases seq 0..7 of its group, which `prepare` granted (a hit). With
    `interval_s`, each rank starts a call every `interval_s` seconds, from a random phase (an
    open loop), instead of as soon as its last one returns.
    """
    if grants and len({r.group for r in ranks}) != len(ranks):
        raise ValueError("grants need one rank per group: seqs of a group are granted in order")
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
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

    start = time.perf_counter()
    window[0], window[1] = start + warmup_s, start + warmup_s + seconds
    await asyncio.gather(*(one(i, r) for i, r in enumerate(ranks)))
    latencies.sort()
    return LoadOutcome(calls, seconds, latencies, errors)
