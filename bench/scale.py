"""Benchmark the coordinator at the scale of real jobs, against torch's TCPStore, in one run.

Usage:
    python bench/scale.py [--quick] [--db URL] [--workers N] [--channels N]

What runs:
1. `rngcoord serve` (a subprocess; `--workers` processes, default: the number of cores) on a
   fresh SQLite store, or on a scratch PostgreSQL database with `--db postgresql://...`.
2. Join storms from rngcoord.server.loadgen (simulated ranks: coroutines over `--channels`
   real gRPC connections): N ranks in one group plus N/8 groups of 8, every rank joining both,
   as the ranks of a dp x tp job join their root mesh and their tp sub-mesh. `join_s_N` is the
   time from the first JoinGroup to the last rank holding its epochs, for N = 10,000 and
   100,000 (`--quick`: 10,000 only).
3. torch's TCPStore store-based barrier (the one torchrun's c10d rendezvous uses; libuv
   backend) for the same N over the same number of connections: a TCPStore server in a
   subprocess, each connection adding one per rank it carries to a counter, the rank that
   completes it setting a key, then every rank waiting for that key.
4. At 1,000 concurrent simulated ranks (each alone in its group): Reserve hits (leases
   already granted, answered from memory) and grants (a new durable lease per call) in closed
   loops for `--seconds`, with throughput and latency percentiles; then the same ranks asking
   once a second each (an open loop), whose latency (`p99_ms`) is the service time rather than
   the queue that 1,000 closed-loop callers build (latency = callers / throughput). The same
   hits load against a no-op servicer in one process measures the transport's ceiling.
5. Leases sized to the work: a model-shaped op trace drives the real LeaseManager against the
   server: 96 layers, each one dropout of 8 x 64 x 4096 x 4096 elements and two of
   8 x 4096 x 12288, with a little compute per op. `reserves_per_rank_per_step` counts the
   Reserve RPCs per step after a warm-up of 10 steps; `stalls_after_warmup` the ops that
   waited for a lease.

The load generator runs on the same cores as the server. Progress goes to stderr; stdout gets
a table, and as its last line one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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

from rngcoord.server.addresses import redact_url
from rngcoord.server.loadgen import (
    Rank,
    join_storm,
    open_channels,
    prepare,
    reserve_load,
)


def log(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ the coordinator


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
        yield ready.read_text().strip()
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


async def measure_join(address: str, n: int, channels: int) -> float:
    opened = open_channels(address, channels)
    job = f"join-{n}-{uuid.uuid4().hex[:6]}"
    try:
        # A generous join timeout: the storm is measured, not cut short.
        outcome = await join_storm(opened, job, storm_ranks(n), timeout_s=1500)
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
        grants = await reserve_load(opened, job, population, grants=True, seconds=seconds)
        # Open loop: every rank asks once a second (a training step's worth of ops), so the
        # latency is the service time, not the queue a closed loop of 1,000 callers builds.
        paced = await reserve_load(
            opened, job, population, grants=False, seconds=seconds, interval_s=1.0
        )
    finally:
        for channel in opened:
            await channel.close(None)
    for name, outcome in (("hits", hits), ("grants", grants), ("paced", paced)):
        if outcome.errors:
            raise RuntimeError(f"{name}: errors {outcome.errors}")
    return {
        "hits_per_s": round(hits.per_s),
        "hits_p50_ms": round(hits.percentile(0.5), 2),
        "hits_p99_ms": round(hits.percentile(0.99), 2),
        "grants_per_s": round(grants.per_s),
        "grants_p50_ms": round(grants.percentile(0.5), 2),
        "grants_p99_ms": round(grants.percentile(0.99), 2),
        "p99_ms": round(paced.percentile(0.99), 2),
        "p50_ms": round(paced.percentile(0.5), 2),
    }


_NOOP_SERVER = """
import asyncio, sys
import grpc
from rngcoord.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc

class Noop(pb_grpc.CoordinatorServicer):
    async def Reserve(self, request, context):
        lease = pb.Lease(group=request.group, epoch=1, seq=request.seq, seed=1, start=0, end=64)
        return pb.ReserveResponse(lease=lease, existing=True)

async def main():
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(Noop(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def noop_ceiling(ranks: int, channels: int, seconds: float) -> float:
    """Calls/s of the same hits load against a servicer that answers constants: what one
    Python gRPC server process and this load generator do on this machine."""
    server = subprocess.Popen(
        [sys.executable, "-c", _NOOP_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        address = f"127.0.0.1:{int(server.stdout.readline())}"

        async def load() -> float:
            opened = open_channels(address, channels)
            population = [Rank(f"g{i}", 0, 1) for i in range(ranks)]
            outcome = await reserve_load(opened, "noop", population, grants=False, seconds=seconds)
            for channel in opened:
                await channel.close(None)
            return outcome.per_s

        return asyncio.run(load())
    finally:
        server.kill()
        server.wait()


# ------------------------------------------------------------------- lease schedule


def model_trace_reserves(address: str, steps: int, warmup: int) -> dict[str, Any]:
    """Reserve RPCs per step of a model-shaped trace through the real LeaseManager."""
    from rngcoord.client import CoordinatorClient, LeaseManager

    layer = [
        (b"dropout(8, 64, 4096, 4096)", 8 * 64 * 4096 * 4096),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
    ]
    step = layer * 96
    job = f"model-{uuid.uuid4().hex[:6]}"
    with CoordinatorClient(address) as client:
        joined = client.join_group(job, "tp", rank=0, world_size=1, member_id="m0")
        manager = LeaseManager(client, job, "tp", rank=0, member_id="m0", joined=joined)
        warm = stalls = 0
        for i in range(steps):
            if i == warmup:
                warm, stalls = manager.stats.reserves, manager.stats.stalls
            for key, size in step:
                manager.advance(size, key)
                # A little compute per op (a real dropout of these sizes takes milliseconds).
                time.sleep(0.00002)
        measured = steps - warmup
        result = {
            "reserves_per_rank_per_step": round((manager.stats.reserves - warm) / measured, 4),
            "stalls_after_warmup": manager.stats.stalls - stalls,
            "reserves_in_warmup": warm,
            "fixed_2p32_leases_per_step": round(sum(s for _, s in step) / 2**32, 1),
        }
        manager.close()
    return result


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
                        asyncio.run(measure_join(address, n, args.channels)), 2
                    )
                    log(f"  {results[f'join_s_{n // 1000}k']} s")
                log(f"reserve loads at {args.ranks} ranks, {args.seconds:g} s each ...")
                results.update(
                    asyncio.run(measure_reserves(address, args.ranks, args.channels, args.seconds))
                )
                log("model-shaped trace through the LeaseManager ...")
                results.update(model_trace_reserves(address, steps=40, warmup=10))
        log("the transport's ceiling: the hits load against a no-op servicer ...")
        results["noop_grpc_calls_per_s"] = round(
            noop_ceiling(args.ranks, args.channels, args.seconds)
        )
        results["hits_ratio_to_noop_grpc"] = round(
            results["hits_per_s"] / results["noop_grpc_calls_per_s"], 2
        )
        log(f"TCPStore barrier: 10000 ranks over {args.channels} connections ...")
        results["tcpstore_barrier_s_10k"] = round(tcpstore_barrier(10_000, args.channels), 3)
        results["ratio_join_to_tcpstore_10k"] = round(
            results["join_s_10k"] / results["tcpstore_barrier_s_10k"], 1
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [
        ("join, 10k ranks (+1,250 groups of 8)", f"{results['join_s_10k']} s"),
        ("TCPStore barrier, 10k ranks", f"{results['tcpstore_barrier_s_10k']} s"),
        ("ratio join / TCPStore", f"{results['ratio_join_to_tcpstore_10k']}"),
    ]
    if "join_s_100k" in results:
        rows.insert(1, ("join, 100k ranks (+12,500 groups of 8)", f"{results['join_s_100k']} s"))
    rows += [
        ("hits/s at 1,000 ranks (p50 / p99 ms)",
         f"{results['hits_per_s']} ({results['hits_p50_ms']} / {results['hits_p99_ms']})"),
        ("grants/s at 1,000 ranks (p50 / p99 ms)",
         f"{results['grants_per_s']} ({results['grants_p50_ms']} / {results['grants_p99_ms']})"),
        ("hit latency, 1,000 ranks asking 1/s (p50 / p99 ms)",
         f"{results['p50_ms']} / {results['p99_ms']}"),
        ("no-op gRPC servicer, same hits load (one process)",
         f"{results['noop_grpc_calls_per_s']} calls/s (hits reach "
         f"{results['hits_ratio_to_noop_grpc']} of it)"),
        ("Reserve RPCs per rank per step, after warm-up",
         f"{results['reserves_per_rank_per_step']} (fixed 2^32 leases: "
         f"{results['fixed_2p32_leases_per_step']})"),
        ("ops that waited for a lease, after warm-up", f"{results['stalls_after_warmup']}"),
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
