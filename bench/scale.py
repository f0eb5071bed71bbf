"""Benchmark the coordinator at the scale of real jobs, against torch's TCPStore, in one run.

Usage:
    python bench/scale.py [--quick] [--db URL] [--workers N] [--channels N]

What runs:
1. `rngcoord serve` (a subprocess; `--workers` processes, default: the number of cores) on a
   fresh SQLite store, or on a scratch PostgreSQL database with `--db postgresql://...`.
2. Join storms from bench/loadgen.py (simulated ranks: coroutines over `--channels`
   real gRPC connections): N ranks in one group plus N/8 groups of 8, every rank joining both,
   as the ranks of a dp x tp job join their root mesh and their tp sub-mesh. `join_s_N` is the
   time from the first JoinGroup to the last rank holding its epochs, for N = 10,000 and
   100,000 (`--quick`: 10,000 only), with two unary JoinGroup calls per rank;
   `join_s_N_one_message` the same storm with one JoinGroups message per rank (both groups) on
   one Session stream per connection, as `install()`'s client sends it.
3. torch's TCPStore store-based barrier (the one torchrun's c10d rendezvous uses; libuv
   backend) for the same N over the same number of connections: a TCPStore server in a
   subprocess, each connection adding one per rank it carries to a counter, the rank that
   completes it setting a key, then every rank waiting for that key.
4. At 1,000 concurrent simulated ranks (each alone in its group): Reserve hits (leases
   already granted, answered from memory) and grants (a new durable lease per call) in closed
   loops for `--seconds`, with throughput and latency percentiles; then the same ranks asking
   once a second each (an open loop), whose latency (`p99_ms`) is the service time rather than
   the queue that 1,000 closed-loop callers build (latency = callers / throughput). The same
   hits as messages on one Session stream per connection (`msgs_per_s_session`, beside the
   unary `hits_per_s`), and grants as messages too (`grants_per_s_session`, as `install()`
   sends them). The same hits load against a no-op servicer in one process, as unary calls
   (`calls_per_s_unary_noop`) and as Session messages (`msgs_per_s_session_noop`): the
   transport's ceilings, with the server CPU per no-op message and the load generator's share
   of a core. 10,000 messages at the no-op Session rate (`join_floor_s_10k_noop_session`) is
   the least a one-message join storm of 10,000 ranks can take through this transport here.
5. Leases sized to the work: a model-shaped op trace drives the real LeaseManager against the
   server: 96 layers, each one dropout of 8 x 64 x 4096 x 4096 elements and two of
   8 x 4096 x 12288, with a little compute per op, for 300 steps at a simulated step a second
   (the manager's clock; attestations are time-bounded, docs/design.md §6.1).
   `rpcs_per_rank_per_step` is every message a rank sends per step after a warm-up of 10
   steps: `reserves_per_rank_per_step` + `attests_per_rank_per_step` (measured) +
   `heartbeats_per_rank_per_step` (rank 0 of a tp group of 8 reads its epoch every 15 s:
   computed from that period). `stalls_after_warmup` counts the ops that waited for a lease.
   `coordinator_cpu_s_per_1k_rank_steps` prices those messages at the server CPU (all its
   processes, from /proc) that a session hit and a grant cost under the loads of 4
   (`server_cpu_ms_per_session_hit`, `server_cpu_ms_per_grant`).
6. `--workers` scaling: the reserve loads of 4 against `--workers 1` and `--workers 2`, each on
   a fresh store, side by side (`workers_scaling_2_vs_1`, for hits; the grants' ratio too),
   with the share of a core the load generator used.
7. Outages: `outage_stall_ms`, the longest op wait for a lease while the trace's coordinator
   is SIGKILLed for 30 s and restarted (aim: 0); `reconnect_s_10k`, the time for 10,000
   simulated ranks (groups of 8) to be served again after a SIGKILL and a restart 2 s later,
   counted from the restart, every rank retrying with full-jitter backoff meanwhile.

The load generator runs on the same cores as the server. Progress goes to stderr; stdout gets
a table, and as its last line one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from loadgen import (
    Rank,
    join_storm,
    join_storm_grouped,
    open_channels,
    prepare,
    reconnect_storm,
    reserve_load,
)
from rngcoord.server.addresses import redact_url


def log(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ the coordinator


#: The process id of each running `coordinator()`, by address (for `server_cpu_s`).
_SERVERS: dict[str, int] = {}


def server_cpu_s(address: str) -> float:
    """CPU seconds (user + system) of the coordinator at `address` and its worker processes
    so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [_SERVERS[address]]
    while pending:
        pid = pending.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue  # exited meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        pending += [int(c) for c in children]
    return total


@contextmanager
def coordinator(db_url: str, workers: int, workdir: Path) -> Iterator[str]:
    """A `rngcoord serve` subprocess on `db_url`; yields its address."""
    ready = workdir / "ready"
    log_path = workdir / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "rngcoord.server.cli",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--db",
        db_url,
        "--metrics",
        "off",
        "--workers",
        str(workers),
        "--ready-file",
        str(ready),
        "--log-level",
        "WARNING",
        "--init",
        # Every simulated rank runs on this one host: a per-host rate limit would measure
        # the limit, not the coordinator.
        "--peer-rate",
        "0",
    ]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rngcoord serve did not start:\n{log_path.read_text()}")
            time.sleep(0.05)
        address = ready.read_text().strip()
        _SERVERS[address] = proc.pid
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def postgres_scratch(admin_url: str) -> Iterator[str]:
    import psycopg

    name = f"rngcoord_scale_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(admin_url)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ----------------------------------------------------------------------------- joins


def storm_ranks(n: int) -> list[Rank]:
    """N ranks in one group, and the same N in N/8 groups of 8: 2N joins."""
    ranks = [Rank("root", r, n) for r in range(n)]
    ranks += [Rank(f"tp{r // 8}", r % 8, 8) for r in range(n)]
    return ranks


async def measure_join(address: str, n: int, channels: int, *, one_message: bool) -> float:
    """Seconds for the storm of `storm_ranks(n)` to form every group: each rank joining its
    two groups in two unary JoinGroup calls, or with `one_message` in one JoinGroups message
    on a Session stream."""
    opened = open_channels(address, channels)
    job = f"join-{n}-{uuid.uuid4().hex[:6]}"
    ranks = storm_ranks(n)
    try:
        # A generous join timeout: the storm is measured, not cut short.
        if one_message:
            plans = [(ranks[r], ranks[n + r]) for r in range(n)]
            outcome = await join_storm_grouped(opened, job, plans, timeout_s=1500)
        else:
            outcome = await join_storm(opened, job, ranks, timeout_s=1500)
    finally:
        for channel in opened:
            await channel.close(None)
    if outcome.errors:
        raise RuntimeError(f"{len(outcome.errors)} joins failed: {outcome.errors[:3]}")
    if outcome.formed != 1 + n // 8:
        raise RuntimeError(f"only {outcome.formed} of {1 + n // 8} groups formed")
    return outcome.seconds


# ---------------------------------------------------------------------------- TCPStore

_TCPSTORE_SERVER = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""


def tcpstore_barrier(n: int, connections: int) -> float:
    """torch's store-based barrier for `n` ranks over `connections` TCPStore clients."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    server = subprocess.Popen(
        [sys.executable, "-c", _TCPSTORE_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        clients = [
            TCPStore(
                "127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=300)
            )
            for _ in range(connections)
        ]
        per = [range(i, n, connections) for i in range(connections)]
        start = threading.Barrier(connections + 1)
        finished: list[float] = []

        def connection(i: int) -> None:
            store = clients[i]
            start.wait()
            for _ in per[i]:
                if store.add("arrived", 1) == n:
                    store.set("done", "1")
            for _ in per[i]:
                store.wait(["done"])
            finished.append(time.perf_counter())

        threads = [threading.Thread(target=connection, args=(i,)) for i in range(connections)]
        for t in threads:
            t.start()
        start.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        return max(finished) - began
    finally:
        server.kill()
        server.wait()


# ------------------------------------------------------------------------ hits, grants


async def measure_reserves(
    address: str, ranks: int, channels: int, seconds: float
) -> dict[str, Any]:
    job = f"load-{uuid.uuid4().hex[:6]}"
    opened = open_channels(address, channels)
    population = [Rank(f"g{i}", 0, 1) for i in range(ranks)]
    try:
        await prepare(opened, job, population)
        hits = await reserve_load(opened, job, population, grants=False, seconds=seconds)
        # The same hits as messages on one Session stream per channel, as install() sends them.
        meter = (lambda: server_cpu_s(address)) if address in _SERVERS else None
        streamed = await reserve_load(
            opened, job, population, grants=False, seconds=seconds, session=True, meter=meter
        )
        grants = await reserve_load(
            opened, job, population, grants=True, seconds=seconds, meter=meter
        )
        # The same grants as Session messages, as install() sends them, on groups of their
        # own (the groups above have granted the seqs these would ask for).
        streamed_job = f"{job}-s"
        await prepare(opened, streamed_job, population)
        streamed_grants = await reserve_load(
            opened, streamed_job, population, grants=True, seconds=seconds, session=True,
            meter=meter,
        )  # fmt: skip
        # Open loop: every rank asks once a second (a training step's worth of ops), so the
        # latency is the service time, not the queue a closed loop of 1,000 callers builds.
        paced = await reserve_load(
            opened, job, population, grants=False, seconds=seconds, interval_s=1.0
        )
    finally:
        for channel in opened:
            await channel.close(None)
    for name, outcome in (
        ("hits", hits),
        ("session hits", streamed),
        ("grants", grants),
        ("session grants", streamed_grants),
        ("paced", paced),
    ):
        if outcome.errors:
            raise RuntimeError(f"{name}: errors {outcome.errors}")
    return {
        "hits_per_s": round(hits.per_s),
        "hits_p50_ms": round(hits.percentile(0.5), 2),
        "hits_p99_ms": round(hits.percentile(0.99), 2),
        "msgs_per_s_session": round(streamed.per_s),
        "session_p50_ms": round(streamed.percentile(0.5), 2),
        "session_p99_ms": round(streamed.percentile(0.99), 2),
        "ratio_session_to_unary_hits": round(streamed.per_s / max(hits.per_s, 1e-9), 2),
        # The server's CPU per answer (all its processes), over the measured window.
        "server_cpu_ms_per_session_hit": round(1000 * streamed.metered / max(streamed.calls, 1), 4),
        "server_cpu_ms_per_grant": round(1000 * grants.metered / max(grants.calls, 1), 4),
        "grants_per_s": round(grants.per_s),
        "grants_p50_ms": round(grants.percentile(0.5), 2),
        "grants_p99_ms": round(grants.percentile(0.99), 2),
        "grants_per_s_session": round(streamed_grants.per_s),
        "grants_session_p50_ms": round(streamed_grants.percentile(0.5), 2),
        "grants_session_p99_ms": round(streamed_grants.percentile(0.99), 2),
        "server_cpu_ms_per_session_grant": round(
            1000 * streamed_grants.metered / max(streamed_grants.calls, 1), 4
        ),
        "p99_ms": round(paced.percentile(0.99), 2),
        "p50_ms": round(paced.percentile(0.5), 2),
    }


def workers_scaling(ranks: int, channels: int, seconds: float) -> dict[str, Any]:
    """Hits and grants per second with `--workers 1` and `--workers 2`, each on a fresh
    SQLite store, under the same load, side by side; with the load generator's share of a
    core, since it runs on the same cores."""
    out: dict[str, Any] = {}
    for workers in (1, 2):
        workdir = Path(tempfile.mkdtemp(prefix=f"rngcoord-workers{workers}-"))
        try:
            with coordinator(f"sqlite:///{workdir / 'w.db'}", workers, workdir) as address:
                wall, cpu = time.monotonic(), time.process_time()
                got = asyncio.run(measure_reserves(address, ranks, channels, seconds))
                share = (time.process_time() - cpu) / (time.monotonic() - wall)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        out[f"hits_per_s_{workers}w"] = got["hits_per_s"]
        out[f"grants_per_s_{workers}w"] = got["grants_per_s"]
        out[f"loadgen_core_share_{workers}w"] = round(share, 2)
        log(f"  --workers {workers}: {got['hits_per_s']} hits/s, {got['grants_per_s']} grants/s")
    out["workers_scaling_2_vs_1"] = round(out["hits_per_s_2w"] / out["hits_per_s_1w"], 2)
    out["workers_scaling_grants_2_vs_1"] = round(out["grants_per_s_2w"] / out["grants_per_s_1w"], 2)
    return out


_NOOP_SERVER = """
import asyncio, sys
import grpc
from rngcoord.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc

class Noop(pb_grpc.CoordinatorServicer):
    async def Reserve(self, request, context):
        lease = pb.Lease(group=request.group, epoch=1, seq=request.seq, seed=1, start=0, end=64)
        return pb.ReserveResponse(lease=lease, existing=True)

    async def Session(self, requests, context):
        async for message in requests:
            reply = await self.Reserve(message.reserve, context)
            yield pb.SessionResponse(id=message.id, reserve=reply)

async def main():
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(Noop(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def noop_ceiling(ranks: int, channels: int, seconds: float) -> dict[str, Any]:
    """The same hits load against a servicer that answers constants, in one process: as
    unary calls and as Session messages (answered one by one, as they come: the cheapest a
    stream servicer can be). What one Python gRPC server process and this load generator do
    on this machine, with the server's CPU per message and the load generator's share of a
    core while it runs."""
    server = subprocess.Popen(
        [sys.executable, "-c", _NOOP_SERVER], stdout=subprocess.PIPE, text=True
    )
    address = ""
    try:
        assert server.stdout is not None
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        _SERVERS[address] = server.pid

        async def load(session: bool) -> tuple[float, float, float]:
            opened = open_channels(address, channels)
            population = [Rank(f"g{i}", 0, 1) for i in range(ranks)]
            t0, own0 = time.perf_counter(), time.process_time()
            outcome = await reserve_load(
                opened,
                "noop",
                population,
                grants=False,
                seconds=seconds,
                session=session,
                meter=lambda: server_cpu_s(address),
            )
            own = (time.process_time() - own0) / (time.perf_counter() - t0)
            for channel in opened:
                await channel.close(None)
            return outcome.per_s, outcome.metered / max(outcome.calls, 1), own

        unary, _, _ = asyncio.run(load(session=False))
        session, cpu_per_msg, loadgen_share = asyncio.run(load(session=True))
        return {
            "calls_per_s_unary_noop": round(unary),
            "msgs_per_s_session_noop": round(session),
            "server_cpu_ms_per_noop_session_msg": round(1000 * cpu_per_msg, 4),
            "loadgen_core_share_session_noop": round(loadgen_share, 2),
        }
    finally:
        _SERVERS.pop(address, None)
        server.kill()
        server.wait()


# ------------------------------------------------------------------- lease schedule


def model_trace_reserves(address: str, steps: int, warmup: int) -> dict[str, Any]:
    """The RPCs per step of a model-shaped trace through the real LeaseManager, at a
    simulated step a second (the manager's clock moves 1/288 s per op; the ops themselves
    run as fast as they can)."""
    from rngcoord.client import CoordinatorClient, LeaseManager
    from rngcoord.client._leases import HEARTBEAT_S

    layer = [
        (b"dropout(8, 64, 4096, 4096)", 8 * 64 * 4096 * 4096),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
    ]
    step = layer * 96
    job = f"model-{uuid.uuid4().hex[:6]}"
    with CoordinatorClient(address) as client:
        joined = client.join_group(job, "tp", rank=0, world_size=1, member_id="m0")
        now = [0.0]
        manager = LeaseManager(
            client,
            job,
            "tp",
            rank=0,
            member_id="m0",
            joined=joined,
            heartbeat_s=0,  # counted below, from its period
            clock=lambda: now[0],
        )
        warm = stalls = attests = 0
        for i in range(steps):
            if i == warmup:
                warm, stalls = manager.stats.reserves, manager.stats.stalls
                attests = manager.stats.attestations
            for key, size in step:
                manager.advance(size, key)
                now[0] += 1.0 / len(step)
                # A little compute per op (a real dropout of these sizes takes milliseconds).
                time.sleep(0.00002)
        measured = steps - warmup
        reserves = (manager.stats.reserves - warm) / measured
        attestations = (manager.stats.attestations - attests) / measured
        # Rank 0 of each group reads its epoch every heartbeat_s: per rank of a tp group of
        # 8 at a step a second (the root group's share, one read per 15 s for 10^5 ranks, is
        # negligible).
        heartbeats = 1.0 / (HEARTBEAT_S * 8)
        result = {
            "reserves_per_rank_per_step": round(reserves, 4),
            "attests_per_rank_per_step": round(attestations, 4),
            "heartbeats_per_rank_per_step": round(heartbeats, 4),
            "rpcs_per_rank_per_step": round(reserves + attestations + heartbeats, 4),
            "stalls_after_warmup": manager.stats.stalls - stalls,
            "reserves_in_warmup": warm,
            "fixed_2p32_leases_per_step": round(sum(s for _, s in step) / 2**32, 1),
        }
        manager.close()
    return result


def coordinator_cpu_per_1k_rank_steps(results: dict[str, Any]) -> float:
    """The coordinator's CPU seconds per 1,000 rank-steps of the model-shaped trace: each
    message the trace's rank sends per step, at the server CPU an answer cost under load. In
    a tp group of 8, one rank's Reserve or first attestation of a count writes (a grant's
    cost) and the other 7 read it back or compare in memory (a session hit's cost); a
    heartbeat is a read."""
    hit = float(results["server_cpu_ms_per_session_hit"]) / 1000
    grant = float(results["server_cpu_ms_per_grant"]) / 1000
    shared = grant / 8 + 7 * hit / 8
    per_step = (
        float(results["reserves_per_rank_per_step"]) * shared
        + float(results["attests_per_rank_per_step"]) * shared
        + float(results["heartbeats_per_rank_per_step"]) * hit
    )
    return round(1000 * per_step, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_on(port: int, db: str, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A one-worker `rngcoord serve` on 127.0.0.1:`port` (started again on the same store
    and port after a SIGKILL); returns once it serves."""
    ready = workdir / f"ready-{time.monotonic_ns()}"
    cmd = [
        sys.executable, "-m", "rngcoord.server.cli", "serve", "--listen", f"127.0.0.1:{port}",
        "--db", db, "--metrics", "off", "--workers", "1", "--ready-file", str(ready),
        "--log-level", "WARNING", "--peer-rate", "0", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rngcoord serve did not start on port {port}")
        time.sleep(0.05)
    return proc


def reconnect_s(workdir: Path, ranks: int = 10_000, down_s: float = 2.0) -> dict[str, Any]:
    """How long `ranks` simulated ranks (groups of 8, over 32 connections) take to be served
    again after their coordinator is SIGKILLed: every rank asks for a lease while it is down,
    retrying with capped exponential backoff and full jitter as the client does, and it comes
    back on the same store and port after `down_s`. The figure runs from the restart (the new
    process serving) to the last rank served."""
    port = _free_port()
    db = f"sqlite:///{workdir / 'reconnect.db'}"
    proc = _serve_on(port, db, workdir, "--init")
    ranks_ = [Rank(f"tp{r // 8}", r % 8, 8) for r in range(ranks)]

    async def storm() -> tuple[float, int]:
        nonlocal proc
        opened = open_channels(f"127.0.0.1:{port}", 32)
        try:
            await prepare(opened, "reconnect", ranks_)
            proc.kill()
            proc.wait()
            asked = asyncio.ensure_future(reconnect_storm(opened, "reconnect", ranks_, seq=3))
            await asyncio.sleep(down_s)
            proc = await asyncio.get_running_loop().run_in_executor(
                None, lambda: _serve_on(port, db, workdir)
            )
            back = time.perf_counter()
            outcome = await asked
            served_s = time.perf_counter() - back
        finally:
            for channel in opened:
                await channel.close(None)
        if outcome.errors or outcome.served != ranks:
            raise RuntimeError(f"{ranks - outcome.served} ranks not served: {outcome.errors[:3]}")
        return served_s, outcome.retries

    try:
        served_s, retries = asyncio.run(storm())
    finally:
        proc.terminate()
        proc.wait(30)
    return {f"reconnect_s_{ranks // 1000}k": round(served_s, 2), "reconnect_retries": retries}


def outage_stall_ms(workdir: Path, outage_s: float = 30.0, warmup_s: float = 10.0) -> float:
    """The longest wait of an op for a lease while the coordinator is down for `outage_s`:
    the model-shaped trace of `model_trace_reserves` runs for `warmup_s`, then its own
    coordinator (SQLite, one worker) is SIGKILLed and restarted on the same store and port
    after `outage_s`, and the trace runs on for 5 s more. Aim: 0."""
    from rngcoord.client import CoordinatorClient, LeaseManager

    port = _free_port()
    db = f"sqlite:///{workdir / 'outage.db'}"

    def serve(*extra: str) -> subprocess.Popen[bytes]:
        return _serve_on(port, db, workdir, *extra)

    layer = [
        (b"dropout(8, 64, 4096, 4096)", 8 * 64 * 4096 * 4096),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
    ]
    proc = serve("--init")
    job = f"outage-{uuid.uuid4().hex[:6]}"
    try:
        with CoordinatorClient(f"127.0.0.1:{port}", outage_s=600.0) as client:
            joined = client.join_group(job, "tp", rank=0, world_size=1, member_id="m0")
            manager = LeaseManager(client, job, "tp", rank=0, member_id="m0", joined=joined)
            phases = [(warmup_s, "kill"), (outage_s, "restart"), (5.0, "end")]
            for seconds, then in phases:
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    for key, size in layer:
                        manager.advance(size, key)
                        time.sleep(0.00002)  # a little compute per op, as above
                if then == "kill":
                    proc.kill()
                    proc.wait()
                    manager.stats.longest_stall_s = 0.0  # count the outage's waits only
                elif then == "restart":
                    proc = serve()
            stall_s = manager.stats.longest_stall_s
            manager.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return round(stall_s * 1000, 1)


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the 100,000-rank storm")
    parser.add_argument("--db", help="postgresql://... admin URL (default: SQLite)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--channels", type=int, default=64, help="connections of the storms")
    parser.add_argument("--ranks", type=int, default=1000, help="ranks of the reserve loads")
    parser.add_argument("--seconds", type=float, default=5.0, help="each reserve load's time")
    args = parser.parse_args(argv)

    sizes = [10_000] if args.quick else [10_000, 100_000]
    workdir = Path(tempfile.mkdtemp(prefix="rngcoord-scale-"))
    results: dict[str, Any] = {"workers": args.workers, "channels": args.channels}
    try:
        with contextlib_db(args.db, workdir) as db_url:
            results["db"] = redact_url(db_url).split("://")[0]
            with coordinator(db_url, args.workers, workdir) as address:
                log(f"coordinator at {address}, {args.workers} workers, {redact_url(db_url)}")
                for n in sizes:
                    log(f"join storm: {n} ranks in one group + {n // 8} groups of 8 ...")
                    results[f"join_s_{n // 1000}k"] = round(
                        asyncio.run(measure_join(address, n, args.channels, one_message=False)), 2
                    )
                    log(f"  {results[f'join_s_{n // 1000}k']} s")
                    log("the same storm, one JoinGroups message per rank on Session streams ...")
                    results[f"join_s_{n // 1000}k_one_message"] = round(
                        asyncio.run(measure_join(address, n, args.channels, one_message=True)), 2
                    )
                    log(f"  {results[f'join_s_{n // 1000}k_one_message']} s")
                log(f"reserve loads at {args.ranks} ranks, {args.seconds:g} s each ...")
                results.update(
                    asyncio.run(measure_reserves(address, args.ranks, args.channels, args.seconds))
                )
                log("model-shaped trace through the LeaseManager ...")
                results.update(model_trace_reserves(address, steps=300, warmup=10))
        results["coordinator_cpu_s_per_1k_rank_steps"] = coordinator_cpu_per_1k_rank_steps(results)
        log("the model-shaped trace through a 30 s coordinator outage ...")
        results["outage_stall_ms"] = outage_stall_ms(workdir)
        log("10,000 ranks served again after a SIGKILL and a restart ...")
        results.update(reconnect_s(workdir))
        log("--workers 1 and 2 under the same reserve loads ...")
        results.update(workers_scaling(args.ranks, args.channels, args.seconds))
        log("the transport's ceiling: the hits load against a no-op servicer ...")
        results.update(noop_ceiling(args.ranks, args.channels, args.seconds))
        results["hits_ratio_to_noop_grpc"] = round(
            results["hits_per_s"] / results["calls_per_s_unary_noop"], 2
        )
        results["session_ratio_to_noop_session"] = round(
            results["msgs_per_s_session"] / results["msgs_per_s_session_noop"], 2
        )
        log(f"TCPStore barrier: 10000 ranks over {args.channels} connections ...")
        results["tcpstore_barrier_s_10k"] = round(tcpstore_barrier(10_000, args.channels), 3)
        results["ratio_join_to_tcpstore_10k"] = round(
            results["join_s_10k"] / results["tcpstore_barrier_s_10k"], 1
        )
        results["ratio_join_one_message_to_tcpstore_10k"] = round(
            results["join_s_10k_one_message"] / results["tcpstore_barrier_s_10k"], 1
        )
        # 10,000 join messages at the no-op stream servicer's rate: the least a one-message
        # storm can take through this transport here, whatever the coordinator does.
        floor_s = 10_000 / results["msgs_per_s_session_noop"]
        results["join_floor_s_10k_noop_session"] = round(floor_s, 2)
        results["ratio_floor_to_tcpstore_10k"] = round(
            floor_s / results["tcpstore_barrier_s_10k"], 1
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [
        ("join, 10k ranks (+1,250 groups of 8)", f"{results['join_s_10k']} s"),
        ("TCPStore barrier, 10k ranks", f"{results['tcpstore_barrier_s_10k']} s"),
        ("ratio join / TCPStore", f"{results['ratio_join_to_tcpstore_10k']}"),
        ("join, 10k ranks, one JoinGroups message each on Session streams",
         f"{results['join_s_10k_one_message']} s (ratio to TCPStore "
         f"{results['ratio_join_one_message_to_tcpstore_10k']})"),
    ]  # fmt: skip
    if "join_s_100k" in results:
        rows.insert(1, ("join, 100k ranks (+12,500 groups of 8)", f"{results['join_s_100k']} s"))
        rows.insert(2, ("join, 100k ranks, one JoinGroups message each",
                        f"{results['join_s_100k_one_message']} s"))  # fmt: skip
    rows += [
        ("hits/s at 1,000 ranks (p50 / p99 ms)",
         f"{results['hits_per_s']} ({results['hits_p50_ms']} / {results['hits_p99_ms']})"),
        ("the same hits on Session streams, msgs/s (p50 / p99 ms)",
         f"{results['msgs_per_s_session']} ({results['session_p50_ms']} / "
         f"{results['session_p99_ms']}; {results['ratio_session_to_unary_hits']}x unary)"),
        ("grants/s at 1,000 ranks (p50 / p99 ms)",
         f"{results['grants_per_s']} ({results['grants_p50_ms']} / {results['grants_p99_ms']})"),
        ("the same grants on Session streams (p50 / p99 ms)",
         f"{results['grants_per_s_session']} ({results['grants_session_p50_ms']} / "
         f"{results['grants_session_p99_ms']})"),
        ("hit latency, 1,000 ranks asking 1/s (p50 / p99 ms)",
         f"{results['p50_ms']} / {results['p99_ms']}"),
        ("no-op gRPC servicer, same hits load (one process)",
         f"{results['calls_per_s_unary_noop']} calls/s (hits reach "
         f"{results['hits_ratio_to_noop_grpc']} of it)"),
        ("no-op Session servicer, same hits as messages (one process)",
         f"{results['msgs_per_s_session_noop']} msgs/s, "
         f"{results['server_cpu_ms_per_noop_session_msg']} ms server CPU each, load "
         f"generator {results['loadgen_core_share_session_noop']} core (session hits reach "
         f"{results['session_ratio_to_noop_session']} of it)"),
        ("10k join messages at the no-op Session rate (floor)",
         f"{results['join_floor_s_10k_noop_session']} s (ratio to TCPStore "
         f"{results['ratio_floor_to_tcpstore_10k']})"),
        ("Reserve RPCs per rank per step, after warm-up",
         f"{results['reserves_per_rank_per_step']} (fixed 2^32 leases: "
         f"{results['fixed_2p32_leases_per_step']})"),
        ("every RPC per rank per step (reserve + attest + heartbeat)",
         f"{results['rpcs_per_rank_per_step']} ({results['reserves_per_rank_per_step']} + "
         f"{results['attests_per_rank_per_step']} + "
         f"{results['heartbeats_per_rank_per_step']})"),
        ("ops that waited for a lease, after warm-up", f"{results['stalls_after_warmup']}"),
        ("coordinator CPU per 1,000 rank-steps of the trace",
         f"{results['coordinator_cpu_s_per_1k_rank_steps']} s (a session hit "
         f"{results['server_cpu_ms_per_session_hit']} ms, a grant "
         f"{results['server_cpu_ms_per_grant']} ms of server CPU)"),
        ("hits/s with --workers 1 / 2 (ratio)",
         f"{results['hits_per_s_1w']} / {results['hits_per_s_2w']} "
         f"({results['workers_scaling_2_vs_1']}; load generator: "
         f"{results['loadgen_core_share_1w']} / {results['loadgen_core_share_2w']} core)"),
        ("grants/s with --workers 1 / 2 (ratio)",
         f"{results['grants_per_s_1w']} / {results['grants_per_s_2w']} "
         f"({results['workers_scaling_grants_2_vs_1']})"),
        ("longest op wait in a 30 s coordinator outage", f"{results['outage_stall_ms']} ms"),
        ("10k ranks served again after a restart",
         f"{results['reconnect_s_10k']} s ({results['reconnect_retries']} retries)"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    print(json.dumps(results, sort_keys=True))
    return 0


@contextmanager
def contextlib_db(admin_url: str | None, workdir: Path) -> Iterator[str]:
    if admin_url is None:
        yield f"sqlite:///{workdir / 'scale.db'}"
        return
    with postgres_scratch(admin_url) as url:
        yield url


if __name__ == "__main__":
    sys.exit(main())
