"""Benchmark the coordinator: durable grants and idempotent hits over gRPC, against bare SQL.

Usage:
    python bench/coordinator.py [--quick] [--db URL] [--replicas N] [--clients 1,16,64]

What runs, all in one invocation so that the figures are measured side by side:
1. N coordinator servers (`rngcoord serve` subprocesses, metrics off) on one fresh store: a
   SQLite file in a temporary directory by default, or, with `--db postgresql://...`, a scratch
   database created on that server for the run and dropped afterwards.
2. Client processes (`--client-processes`, default 4), each running threads over one channel,
   so that the client's GIL does not cap the server. Every client owns a group of world size
   1 and calls Reserve in a closed loop. "durable": each call asks for the next seq, so each
   one is a new grant, committed before the reply. "hits": each call repeats one of 8 leases
   granted during setup, answered from a read. "durable-session": the durable calls as
   messages on one Session stream per client process, as install()'s client sends them
   (rngcoord.client._session). Client i talks to replica i mod N.
3. The transport's ceiling: the hits workload against a no-op servicer (constant replies) on
   the coordinator's thread pool, started by this script (`serve-noop`).
4. The baselines: the same two workloads as bare SQL transactions, no gRPC, one connection per
   client thread in this process: `BEGIN IMMEDIATE; UPDATE groups SET high_water = high_water
   + size ... RETURNING high_water; INSERT INTO leases ...; COMMIT` on SQLite (WAL,
   synchronous=FULL), and a primary-key SELECT for hits. With a PostgreSQL --db the same
   transactions also run through psycopg on a second scratch database.
5. With a PostgreSQL --db, the store's grant path without the transport: durable grants
   through a `Coordinator` in this process (no gRPC) at the highest client count, on a third
   scratch database (`store-postgres`).

Throughput counts the calls completed inside the measured window (after a warm-up); latency
is each call's wall time as the client sees it. Progress goes to stderr; stdout gets a table
and, as its last line, one JSON object with durable_grants_per_s, idempotent_hits_per_s and
p99_ms_at_64 (coordinator, at the highest client count), durable_grants_per_s_session (the
same grants as Session messages), ratio_to_sqlite_baseline (durable
grants over the bare-SQLite baseline at that count), hits_ratio_to_noop_grpc (coordinator hits
over the no-op server's calls), and every per-level figure; with PostgreSQL also
ratio_to_psycopg_baseline, session_ratio_to_psycopg_baseline (the Session grants over bare
psycopg), store_ratio_to_psycopg_baseline (step 5 over bare psycopg) and
noop_grpc_ratio_to_psycopg_baseline (the most any coordinator could reach through gRPC here).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc

from rngcoord.client._session import SessionStub
from rngcoord.server.addresses import redact_url
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

LEASE_SIZE = 1 << 20
HIT_KEYS = 8
FINGERPRINT = bytes(range(16))
#: "durable-session": the durable grants as Session messages, as install()'s client sends them
#: (one stream per client process, shared by its threads).
MODES = ("durable", "hits", "durable-session")


def _member_secret(member_id: str) -> bytes:
    """A member's credential (JoinGroupRequest.member_secret); a fixed function of the member
    id is enough for this tool, whose members are its own."""
    return hashlib.sha256(b"rngcoord-tool:" + member_id.encode()).digest()


@dataclass
class Result:
    """One measured configuration."""

    system: str
    mode: str
    clients: int
    ops: int
    errors: int
    seconds: float
    per_s: float
    p50_ms: float
    p99_ms: float


def _result(
    system: str, mode: str, clients: int, latencies: list[float], errors: int, seconds: float
) -> Result:
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0

    return Result(
        system=system,
        mode=mode,
        clients=clients,
        ops=len(ordered),
        errors=errors,
        seconds=seconds,
        per_s=len(ordered) / seconds,
        p50_ms=pct(0.50),
        p99_ms=pct(0.99),
    )


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- client workers


class Phase:
    """What the threads of one run share: the set-up barrier, the go signal, the window."""

    def __init__(self, threads: int) -> None:
        self.ready = threading.Barrier(threads + 1)
        self.go = threading.Event()
        self.window = (0.0, 0.0)
        self.failures: list[str] = []
        self.errors = 0
        self.lock = threading.Lock()

    def fail(self, who: str, exc: BaseException) -> None:
        """A thread could not set up: record why and release everyone from the barrier."""
        self.failures.append(f"{who}: {exc!r}"[:500])
        self.ready.abort()

    def start(self, warmup_s: float, seconds: float) -> None:
        start_at = time.perf_counter() + warmup_s
        self.window = (start_at, start_at + seconds)
        self.go.set()


def timed_loop(
    op: Callable[[int], object], phase: Phase, out: list[float], stop_on_error: bool
) -> None:
    """Call op(0), op(1), ... until the window closes, keeping the latencies inside it."""
    try:
        phase.ready.wait()
    except threading.BrokenBarrierError:
        return
    phase.go.wait()
    start_at, end_at = phase.window
    clock = time.perf_counter
    i = 0
    while True:
        t0 = clock()
        try:
            op(i)
        except Exception:
            with phase.lock:
                phase.errors += 1
            if stop_on_error:
                return
        t1 = clock()
        i += 1
        if t0 >= start_at:
            if t1 > end_at:
                return
            out.append(t1 - t0)


def _client_thread(stub: Any, mode: str, group: str, phase: Phase, out: list[float]) -> None:
    member = "bench"
    try:
        epoch = stub.JoinGroup(
            pb.JoinGroupRequest(
                job="bench",
                group=group,
                rank=0,
                world_size=1,
                member_id=member,
                member_secret=_member_secret(member),
                timeout_ms=60_000,
            ),
            timeout=120,
        ).epoch
        requests = [
            pb.ReserveRequest(
                job="bench",
                group=group,
                epoch=epoch,
                seq=seq,
                size=LEASE_SIZE,
                fingerprint=FINGERPRINT,
                rank=0,
                member_id=member,
                member_secret=_member_secret(member),
            )
            for seq in range(HIT_KEYS)
        ]
        if mode == "hits":
            for request in requests:
                stub.Reserve(request, timeout=60)
    except Exception as exc:
        phase.fail(group, exc)
        return

    def durable(i: int) -> object:
        request = pb.ReserveRequest()
        request.CopyFrom(requests[0])
        request.seq = i
        return stub.Reserve(request, timeout=30)

    def hit(i: int) -> object:
        return stub.Reserve(requests[i % HIT_KEYS], timeout=30)

    # A durable sequence cannot go on past a failed seq; hits can.
    timed_loop(hit if mode == "hits" else durable, phase, out, stop_on_error=mode != "hits")


def client_worker(conn: Connection) -> None:
    """A client process: performs the runs its parent sends over `conn` until it gets None.

    Per run: set up the threads (each joins its own group), reply "ready" (or the set-up
    failure), receive (warmup_s, seconds), run, reply (latencies as array('d') bytes, errors).
    """
    channels: dict[str, grpc.Channel] = {}
    while (command := conn.recv()) is not None:
        target, mode, run_id, threads = command
        if target not in channels:
            channels[target] = grpc.insecure_channel(target)
        stub: Any = (
            SessionStub(channels[target], ())
            if mode.endswith("-session")
            else pb_grpc.CoordinatorStub(channels[target])
        )
        phase = Phase(threads)
        outs: list[list[float]] = [[] for _ in range(threads)]
        workers = [
            threading.Thread(
                target=_client_thread, args=(stub, mode, f"{run_id}-t{t}", phase, outs[t])
            )
            for t in range(threads)
        ]
        for w in workers:
            w.start()
        try:
            phase.ready.wait()
        except threading.BrokenBarrierError:
            for w in workers:
                w.join()
            conn.send(f"set-up failed: {phase.failures[0]}")
            break
        conn.send("ready")
        # perf_counter is CLOCK_MONOTONIC, shared by all processes, so the parent's window
        # could be used directly; the warm-up is timed here so each process starts at once.
        warmup_s, seconds = conn.recv()
        phase.start(warmup_s, seconds)
        for w in workers:
            w.join()
        if isinstance(stub, SessionStub):
            stub.close()
        conn.send((array.array("d", [x for out in outs for x in out]).tobytes(), phase.errors))
    for channel in channels.values():
        channel.close()


class ClientPool:
    """Long-lived client processes, so process start-up stays out of the measurements."""

    def __init__(self, processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_worker, args=(child,), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(
        self, targets: list[str], mode: str, clients: int, warmup_s: float, seconds: float
    ) -> tuple[list[float], int]:
        n = len(self._conns)
        run_id = f"{mode}-{clients}-{uuid.uuid4().hex[:6]}"
        for i, conn in enumerate(self._conns):
            threads = clients // n + (1 if i < clients % n else 0)
            conn.send((targets[i % len(targets)], mode, f"{run_id}-p{i}", threads))
        replies = [conn.recv() for conn in self._conns]
        for reply in replies:
            if reply != "ready":
                raise RuntimeError(f"a client process could not start its run: {reply}")
        for conn in self._conns:
            conn.send((warmup_s, seconds))
        latencies: list[float] = []
        errors = 0
        for conn in self._conns:
            raw, errs = conn.recv()
            latencies.extend(array.array("d", raw))
            errors += errs
        return latencies, errors

    def close(self) -> None:
        """Stop the processes: politely when they are idle, else (after a failure) by force."""
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


# ------------------------------------------------------------------------------ servers


class Server:
    """A `rngcoord serve` subprocess on an ephemeral port."""

    def __init__(
        self, db_url: str, workdir: Path, index: int, command: list[str] | None = None
    ) -> None:
        ready = workdir / f"ready-{index}"
        # A run may start several coordinators in turn (PostgreSQL, then SQLite): a ready file
        # left by an earlier one would hand out a dead address.
        ready.unlink(missing_ok=True)
        self.log = workdir / f"server-{index}.log"
        cmd = command or [sys.executable, "-m", "rngcoord.server.cli", "serve"]
        cmd += ["--listen", "127.0.0.1:0", "--ready-file", str(ready)]
        if command is None:
            cmd += ["--db", db_url, "--metrics", "off", "--log-level", "WARNING", "--init"]
            cmd += ["--peer-rate", "0"]  # every client is on this host
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coordinator did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.address = ready.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------- the transport ceiling


class NoopCoordinator(pb_grpc.CoordinatorServicer):
    """Answers JoinGroup and Reserve with constants: what Python gRPC alone costs.

    The other RPCs keep the generated servicer's UNIMPLEMENTED answers."""

    LeaveGroup = pb_grpc.CoordinatorServicer.LeaveGroup
    GetGroup = pb_grpc.CoordinatorServicer.GetGroup
    Restore = pb_grpc.CoordinatorServicer.Restore
    ListAudit = pb_grpc.CoordinatorServicer.ListAudit
    Attest = pb_grpc.CoordinatorServicer.Attest
    RecordResize = pb_grpc.CoordinatorServicer.RecordResize
    RecordQuorum = pb_grpc.CoordinatorServicer.RecordQuorum
    Session = pb_grpc.CoordinatorServicer.Session
    JoinGroups = pb_grpc.CoordinatorServicer.JoinGroups

    async def JoinGroup(
        self, request: pb.JoinGroupRequest, context: object
    ) -> pb.JoinGroupResponse:
        return pb.JoinGroupResponse(epoch=1, seed=1, start=0, job_seed=1, world_size=1)

    async def Reserve(self, request: pb.ReserveRequest, context: object) -> pb.ReserveResponse:
        lease = pb.Lease(
            group=request.group,
            epoch=request.epoch,
            seq=request.seq,
            seed=1,
            start=request.seq * LEASE_SIZE,
            end=(request.seq + 1) * LEASE_SIZE,
        )
        return pb.ReserveResponse(lease=lease, existing=True)


def serve_noop(listen: str, ready_file: str) -> int:
    """Run NoopCoordinator on a grpc.aio server, as the coordinator runs, until terminated."""

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(NoopCoordinator(), server)
        port = server.add_insecure_port(listen)
        await server.start()
        await asyncio.to_thread(Path(ready_file).write_text, f"127.0.0.1:{port}")
        await server.wait_for_termination()

    asyncio.run(main())
    return 0


# ---------------------------------------------------------------------------- baselines

_BASELINE_SCHEMA = (
    "CREATE TABLE groups (grp TEXT PRIMARY KEY, high_water BIGINT NOT NULL)",
    "CREATE TABLE leases (grp TEXT NOT NULL, seq BIGINT NOT NULL, start BIGINT NOT NULL, "
    '"end" BIGINT NOT NULL, PRIMARY KEY (grp, seq))',
)


def _baseline_threads(
    baseline: SqliteBaseline | PsycopgBaseline,
    mode: str,
    clients: int,
    warmup_s: float,
    seconds: float,
) -> tuple[list[float], int]:
    """Run `clients` threads of bare transactions; each thread owns a group and a connection."""
    run_id = uuid.uuid4().hex[:6]
    phase = Phase(clients)
    outs: list[list[float]] = [[] for _ in range(clients)]

    def thread(t: int) -> None:
        group = f"{mode}-{run_id}-{t}"
        try:
            conn = baseline.connect()
        except Exception as exc:
            phase.fail(group, exc)
            return
        try:
            baseline.grant(conn, group, -1)  # creates the group row
            if mode == "hits":
                for seq in range(HIT_KEYS):
                    baseline.grant(conn, group, seq)
        except Exception as exc:
            phase.fail(group, exc)
            conn.close()
            return
        try:
            if mode == "hits":
                timed_loop(lambda i: baseline.hit(conn, group, i % HIT_KEYS), phase, outs[t], False)
            else:
                timed_loop(lambda i: baseline.grant(conn, group, i), phase, outs[t], True)
        finally:
            conn.close()

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(clients)]
    for th in threads:
        th.start()
    try:
        phase.ready.wait()
    except threading.BrokenBarrierError:
        for th in threads:
            th.join()
        raise RuntimeError(f"{baseline.name} could not set up: {phase.failures[0]}") from None
    phase.start(warmup_s, seconds)
    for th in threads:
        th.join()
    return [x for out in outs for x in out], phase.errors


class SqliteBaseline:
    """Bare SQLite: WAL, synchronous=FULL, one connection per thread, BEGIN IMMEDIATE."""

    name = "bare-sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA journal_mode = WAL")
            for statement in _BASELINE_SCHEMA:
                conn.execute(statement)

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    @staticmethod
    def grant(conn: sqlite3.Connection, group: str, seq: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            if seq < 0:
                conn.execute("INSERT INTO groups (grp, high_water) VALUES (?, 0)", (group,))
            else:
                (end,) = conn.execute(
                    "UPDATE groups SET high_water = high_water + ? WHERE grp = ? "
                    "RETURNING high_water",
                    (LEASE_SIZE, group),
                ).fetchone()
                conn.execute(
                    'INSERT INTO leases (grp, seq, start, "end") VALUES (?, ?, ?, ?)',
                    (group, seq, end - LEASE_SIZE, end),
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @staticmethod
    def hit(conn: sqlite3.Connection, group: str, seq: int) -> None:
        conn.execute(
            'SELECT start, "end" FROM leases WHERE grp = ? AND seq = ?', (group, seq)
        ).fetchone()


class PsycopgBaseline:
    """Bare PostgreSQL through psycopg: one connection per thread, one transaction per grant."""

    name = "bare-psycopg"

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in _BASELINE_SCHEMA:
                conn.execute(statement)

    def connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.url)

    @staticmethod
    def grant(conn: Any, group: str, seq: int) -> None:
        with conn.transaction():
            if seq < 0:
                conn.execute("INSERT INTO groups (grp, high_water) VALUES (%s, 0)", (group,))
            else:
                (end,) = conn.execute(
                    "UPDATE groups SET high_water = high_water + %s WHERE grp = %s "
                    "RETURNING high_water",
                    (LEASE_SIZE, group),
                ).fetchone()
                conn.execute(
                    'INSERT INTO leases (grp, seq, start, "end") VALUES (%s, %s, %s, %s)',
                    (group, seq, end - LEASE_SIZE, end),
                )

    @staticmethod
    def hit(conn: Any, group: str, seq: int) -> None:
        with conn.transaction():
            conn.execute(
                'SELECT start, "end" FROM leases WHERE grp = %s AND seq = %s', (group, seq)
            ).fetchone()


# ------------------------------------------------------------------------------- stores


@contextmanager
def scratch_postgres(url: str, label: str) -> Iterator[str]:
    """A database created on the server of `url` for this run, dropped afterwards."""
    import psycopg

    name = f"rngcoord_bench_{label}_{os.getpid()}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--db",
        default="sqlite",
        metavar="URL",
        help="`sqlite` (a temporary file; the default) or postgresql://USER@HOST/DB: the "
        "server on which a scratch database is created and dropped",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="coordinator processes on the store (default 1; more need PostgreSQL)",
    )
    parser.add_argument(
        "--clients",
        default="1,16,64",
        help="comma-separated concurrent client counts (default 1,16,64)",
    )
    parser.add_argument(
        "--client-processes", type=int, default=4, help="client processes (default 4)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="measured seconds per run (default 5; 1.5 quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="short runs; the whole benchmark stays under a minute"
    )
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = 1.5 if args.quick else 5.0
    args.warmup = 0.3 if args.quick else 1.0
    args.levels = [int(c) for c in args.clients.split(",")]
    postgres = args.db.startswith(("postgresql://", "postgres://"))
    if args.db != "sqlite" and not postgres:
        parser.error("--db must be `sqlite` or a postgresql:// URL")
    if args.replicas > 1 and not postgres:
        parser.error("--replicas above 1 needs a shared store: pass --db postgresql://...")
    args.postgres = postgres
    return args


def report_line(r: Result) -> str:
    return (
        f"{r.system:<14} {r.mode:<15} clients={r.clients:<3} {r.per_s:9.0f}/s  "
        f"p50={r.p50_ms:7.2f} ms  p99={r.p99_ms:7.2f} ms  ops={r.ops}"
        + (f"  ERRORS={r.errors}" if r.errors else "")
    )


def measure_coordinator(
    args: argparse.Namespace,
    db_url: str,
    workdir: Path,
    *,
    system: str = "coordinator",
    replicas: int = 1,
    modes: tuple[str, ...] = MODES,
    command: list[str] | None = None,
) -> list[Result]:
    servers = [Server(db_url, workdir, i, command) for i in range(replicas)]
    targets = [s.address for s in servers]
    log(f"{len(servers)} coordinator(s) at {', '.join(targets)} on {redact_url(db_url)}")
    pool = ClientPool(min(args.client_processes, max(args.levels)))
    results = []
    try:
        for mode in modes:
            for clients in args.levels:
                latencies, errors = pool.run(targets, mode, clients, args.warmup, args.seconds)
                result = _result(system, mode, clients, latencies, errors, args.seconds)
                log(report_line(result))
                results.append(result)
    finally:
        pool.close()
        for server in servers:
            server.stop()
    return results


def measure_in_process(args: argparse.Namespace, db_url: str, system: str) -> Result:
    """Durable grants through a `Coordinator` in this process, with no gRPC: what the store's
    grant path can do by itself. Its callers are coroutines on the Coordinator's loop (each
    owns a group of world size 1 and asks for the next seq in a closed loop), so they share
    its GIL, as the servicer's loop does in a server."""
    from rngcoord.server.core.coordinator import Coordinator
    from rngcoord.server.core.membership import Caller
    from rngcoord.server.storage.stores import open_store

    clients = max(args.levels)

    async def run() -> tuple[list[float], int]:
        coordinator = Coordinator(open_store(db_url, create=True), join_timeout_s=30)
        await coordinator.start()
        callers = []
        for i in range(clients):
            member = f"m{i}"
            await coordinator.join(
                "bench", f"g{i}", rank=0, world_size=1, member_id=member,
                member_secret=_member_secret(member), job_seed=1,
            )  # fmt: skip
            callers.append(Caller("bench", f"g{i}", 1, 0, member, _member_secret(member)))
        latencies: list[float] = []
        errors = 0
        loop = asyncio.get_running_loop()
        measure_from = loop.time() + args.warmup
        stop = measure_from + args.seconds

        async def grant(caller: Caller) -> None:
            nonlocal errors
            seq = 0
            while (now := loop.time()) < stop:
                try:
                    await coordinator.reserve(
                        caller, seq=seq, size=LEASE_SIZE, fingerprint=FINGERPRINT
                    )
                except Exception:
                    errors += 1
                    continue
                seq += 1
                if now >= measure_from:
                    latencies.append(loop.time() - now)

        try:
            await asyncio.gather(*(grant(c) for c in callers))
        finally:
            await coordinator.close()
        return latencies, errors

    latencies, errors = asyncio.run(run())
    result = _result(system, "durable", clients, latencies, errors, args.seconds)
    log(report_line(result))
    return result


def measure_baseline(
    baseline: SqliteBaseline | PsycopgBaseline, args: argparse.Namespace
) -> list[Result]:
    results = []
    for mode in ("durable", "hits"):  # bare SQL has no transport to vary
        for clients in args.levels:
            latencies, errors = _baseline_threads(
                baseline, mode, clients, args.warmup, args.seconds
            )
            result = _result(baseline.name, mode, clients, latencies, errors, args.seconds)
            log(report_line(result))
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="rngcoord-bench-"))
    results: list[Result] = []
    try:
        if args.postgres:
            with scratch_postgres(args.db, "coord") as url:
                results += measure_coordinator(args, url, workdir, replicas=args.replicas)
            with scratch_postgres(args.db, "store") as url:
                results.append(measure_in_process(args, url, "store-postgres"))
            with scratch_postgres(args.db, "bare") as url:
                results += measure_baseline(PsycopgBaseline(url), args)
            # The same workload on the embedded default, so the PostgreSQL figures come with
            # their ratio to a SQLite coordinator measured in this run.
            results += measure_coordinator(
                args, f"sqlite:///{workdir / 'bench.db'}", workdir, system="coord-sqlite"
            )
        else:
            results += measure_coordinator(args, f"sqlite:///{workdir / 'bench.db'}", workdir)
        results += measure_baseline(SqliteBaseline(workdir / "baseline.db"), args)
        # The transport's ceiling: the hits workload against a servicer that does no work.
        results += measure_coordinator(
            args,
            "",
            workdir,
            system="grpc-noop",
            modes=("hits",),
            command=[sys.executable, str(Path(__file__).resolve()), "serve-noop"],
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def pick(system: str, mode: str, clients: int) -> Result:
        return next(r for r in results if (r.system, r.mode, r.clients) == (system, mode, clients))

    top = max(args.levels)
    durable, hits = pick("coordinator", "durable", top), pick("coordinator", "hits", top)
    streamed = pick("coordinator", "durable-session", top)
    sqlite_durable = pick("bare-sqlite", "durable", top)
    ceiling = pick("grpc-noop", "hits", top)
    summary: dict[str, Any] = {
        "durable_grants_per_s": round(durable.per_s),
        "idempotent_hits_per_s": round(hits.per_s),
        "p99_ms_at_64": round(durable.p99_ms, 2),
        "p99_hits_ms_at_64": round(hits.p99_ms, 2),
        "ratio_to_sqlite_baseline": round(durable.per_s / max(sqlite_durable.per_s, 1e-9), 2),
        "durable_grants_per_s_session": round(streamed.per_s),
        "p99_session_ms_at_64": round(streamed.p99_ms, 2),
        "noop_grpc_calls_per_s": round(ceiling.per_s),
        "hits_ratio_to_noop_grpc": round(hits.per_s / max(ceiling.per_s, 1e-9), 2),
        "at_clients": top,
        "store": "postgresql" if args.postgres else "sqlite",
        "replicas": args.replicas,
        "cpus": os.cpu_count(),
        "seconds_per_run": args.seconds,
        "quick": args.quick,
        "errors": sum(r.errors for r in results),
        "wall_s": round(time.monotonic() - started, 1),
        "results": [asdict(r) for r in results],
    }
    if args.postgres:
        bare = pick("bare-psycopg", "durable", top)
        summary["ratio_to_psycopg_baseline"] = round(durable.per_s / max(bare.per_s, 1e-9), 2)
        summary["session_ratio_to_psycopg_baseline"] = round(
            streamed.per_s / max(bare.per_s, 1e-9), 2
        )
        on_sqlite = pick("coord-sqlite", "durable", top)
        summary["ratio_to_sqlite_coordinator"] = round(
            durable.per_s / max(on_sqlite.per_s, 1e-9), 2
        )
        # Without gRPC: the store's grant path by itself, and what the transport would
        # allow a coordinator that did no work at all (a no-op servicer's calls).
        store = pick("store-postgres", "durable", top)
        summary["store_grants_per_s"] = round(store.per_s)
        summary["store_ratio_to_psycopg_baseline"] = round(store.per_s / max(bare.per_s, 1e-9), 2)
        summary["noop_grpc_ratio_to_psycopg_baseline"] = round(
            ceiling.per_s / max(bare.per_s, 1e-9), 2
        )
        hits_on_sqlite = pick("coord-sqlite", "hits", top)
        summary["hits_ratio_to_sqlite_coordinator"] = round(
            hits.per_s / max(hits_on_sqlite.per_s, 1e-9), 2
        )
    for r in results:
        print(report_line(r))
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-noop"]:
        # How this script starts its own no-op server (see `ceiling`): serve-noop --listen
        # HOST:PORT --ready-file FILE.
        options = dict(zip(sys.argv[2::2], sys.argv[3::2], strict=True))
        sys.exit(serve_noop(options["--listen"], options["--ready-file"]))
    sys.exit(main())
