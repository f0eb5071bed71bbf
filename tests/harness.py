"""Test harness shared by the suites: coordinator server subprocesses and scratch stores.

- `CoordinatorProcess`: a real `rngcoord serve` subprocess on 127.0.0.1 and an ephemeral port.
- `run_cli(*args)`: runs `python -m rngcoord.server.cli ARGS` and returns the completed process.
- `side_by_side(*calls)`: runs calls at once on threads, so that their waits overlap.
- `join_all(stub, job, group, world_size)`: joins every rank of a group at once (a barrier).
- `wait_for_group(stub, job, group)`: waits until a group exists (its first join is in flight).
- `PostgresDatabases`: creates and drops scratch databases on the test PostgreSQL server
  named by RNGCOORD_TEST_POSTGRES (default postgresql://postgres@127.0.0.1:5432/postgres).

The fixtures that use these live in conftest.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import heapq
import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rngcoord.server.audit.chain import GENESIS_HASH, Chain, open_chain
from rngcoord.server.core.coordinator import Coordinator
from rngcoord.server.core.membership import Caller
from rngcoord.server.storage.sqlite import SqliteStore
from rngcoord.server.storage.store import ReadAhead, Tx, WriteProblem
from rngcoord.v1 import coordinator_pb2, coordinator_pb2_grpc
from rngcoord.v1.types import AuditRecord, JoinResult, Lease

T = TypeVar("T")

TEST_JOB = "job-1"
"""The job the in-process helpers (`form`, `reserve`, `join`) use unless told otherwise."""

POSTGRES_ENV = "RNGCOORD_TEST_POSTGRES"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
BACKENDS = ("sqlite", "postgresql")

# Settings from the developer's shell must not leak into the servers the tests start.
_SERVER_ENV_BLOCKLIST = (
    "RNGCOORD_LISTEN",
    "RNGCOORD_DB",
    "RNGCOORD_METRICS",
    "RNGCOORD_TOKENS",
    "RNGCOORD_TLS_CERT",
    "RNGCOORD_TLS_KEY",
    "RNGCOORD_TLS_CLIENT_CA",
)


class CoordinatorProcess:
    """A `rngcoord serve` subprocess bound to 127.0.0.1 on an ephemeral port.

    Args:
        db_url: the store URL the server opens.
        workdir: a directory for the ready file and the server's stderr logs (one file per
            start, `server-N.log`); it is also the server's working directory.
        args: extra `rngcoord serve` flags, e.g. ("--tokens", path). Default none.
        env: extra environment variables for the server. Default none; RNGCOORD_* server
            settings of the calling shell are removed either way.
        start_timeout_s: how long `start()` waits for the ready file. Default 30.
        init: pass `--init` at the first start, creating the store. Default True; restarts
            pass it only when asked (a lost store must not be created again by accident).

    Attributes: `address` ("127.0.0.1:PORT", set once started), `port`, `db_url`, `popen`.
    The server runs with `--metrics off`, `--workers 1` and `--peer-rate 0` (every test
    client is on one host) unless `args` passes them.
    """

    def __init__(
        self,
        db_url: str,
        workdir: Path,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 30.0,
        init: bool = True,
    ) -> None:
        self.db_url = db_url
        self.workdir = workdir
        self._init_next = init
        self.args = tuple(args)
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.popen: subprocess.Popen[bytes] | None = None
        self._env = {k: v for k, v in os.environ.items() if k not in _SERVER_ENV_BLOCKLIST}
        self._env.update(env or {})
        self._starts = 0
        self._channels: list[grpc.Channel] = []
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        if not self.port:
            raise RuntimeError("the coordinator has not been started")
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """The stderr log of the latest start."""
        return self.workdir / f"server-{self._starts}.log"

    def start(self) -> CoordinatorProcess:
        """Start the server on `self.port` (0 at first: any free port); wait until it serves.

        Raises RuntimeError, with the server's stderr, when it exits or is not ready within
        `start_timeout_s`.
        """
        if self.running:
            raise RuntimeError(f"the coordinator at {self.address} is already running")
        self._starts += 1
        ready = self.workdir / f"ready-{self._starts}"
        cmd = [
            sys.executable,
            "-m",
            "rngcoord.server.cli",
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--db",
            self.db_url,
            "--ready-file",
            str(ready),
        ]
        if "--metrics" not in self.args:
            cmd += ["--metrics", "off"]
        if "--workers" not in self.args:
            # One process unless a test asks for more: tests of several workers say so.
            cmd += ["--workers", "1"]
        if "--peer-rate" not in self.args:
            cmd += ["--peer-rate", "0"]
        if self._init_next:
            cmd += ["--init"]
            self._init_next = False
        cmd += self.args
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                cmd, cwd=self.workdir, env=self._env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"rngcoord serve exited with status {self.popen.returncode} before it was "
                    f"ready; its output:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"rngcoord serve was not ready after {self.start_timeout_s}s; its output:\n"
                    f"{self.output()}"
                )
            time.sleep(0.02)
        self.port = int(ready.read_text().rpartition(":")[2])
        return self

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain), wait for the exit, and return the exit status."""
        assert self.popen is not None, "the coordinator was never started"
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no drain, no cleanup) and reap it."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def restart(self, *, init: bool = False) -> CoordinatorProcess:
        """Start again on the same store, on the same port when it is free, else on a new one;
        with `init`, pass `--init` (create the store if it is gone).

        The server must have stopped (`kill()` or `terminate()`) first.
        """
        if self.running:
            raise RuntimeError("stop the coordinator before restarting it")
        self._init_next = init
        try:
            return self.start()
        except RuntimeError as exc:
            if "no rngcoord store" in str(exc):
                raise
            # The old port was taken meanwhile; any free port will do.
            self.port = 0
            self._init_next = init
            return self.start()

    def output(self) -> str:
        """Everything the latest start wrote to stdout and stderr."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_events(self) -> list[dict[str, Any]]:
        """The JSON log lines of the latest start, parsed; other lines are skipped."""
        events = []
        for line in self.output().splitlines():
            with contextlib.suppress(ValueError):
                parsed = json.loads(line)
                if isinstance(parsed, dict):
                    events.append(parsed)
        return events

    def channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        """A new channel to the server, closed by `close()`."""
        if credentials is None:
            channel = grpc.insecure_channel(self.address)
        else:
            channel = grpc.secure_channel(self.address, credentials)
        self._channels.append(channel)
        return channel

    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        """A Coordinator stub on a new plaintext channel."""
        return coordinator_pb2_grpc.CoordinatorStub(self.channel())

    def health(self, service: str = "", timeout_s: float = 5.0) -> str:
        """The grpc.health.v1 status name of `service` ("SERVING", "NOT_SERVING", ...)."""
        with grpc.insecure_channel(self.address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return name

    def close(self) -> None:
        """Close the channels and kill the server if it still runs."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        self.kill()


def run_cli(
    *args: str, timeout_s: float = 120.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m rngcoord.server.cli ARGS...` (in `cwd`) and return the completed
    process."""
    return subprocess.run(
        [sys.executable, "-m", "rngcoord.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=cwd,
    )


def side_by_side(*calls: Callable[[], T]) -> list[T]:
    """Run `calls` at once, each on a thread of its own, and return their results in order
    (the first exception raised, once every call has ended).

    For runs that mostly wait (torchrun jobs on rendezvous, peers and checkpoints, a
    coordinator held down for an outage): side by side, their waits overlap other work.
    """
    # Leaving the `with` waits for every call.
    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="side-by-side") as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.result() for f in futures]


def join_all(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    job: str,
    group: str,
    world_size: int,
    *,
    job_seed: int | None = None,
    timeout_ms: int = 30_000,
    metadata: tuple[tuple[str, str], ...] = (),
) -> list[coordinator_pb2.JoinGroupResponse]:
    """Join every rank of `group` at once (one thread per rank); return the replies by rank.

    Member ids are `m<rank>-<random>`; the replies' `members` field lists them (the requests
    set `include_members`). `metadata` goes
    with every call (a bearer token).
    """
    suffix = uuid.uuid4().hex[:8]

    def join(rank: int) -> coordinator_pb2.JoinGroupResponse:
        request = coordinator_pb2.JoinGroupRequest(
            job=job,
            group=group,
            rank=rank,
            world_size=world_size,
            member_id=f"m{rank}-{suffix}",
            member_secret=secret_for(f"m{rank}-{suffix}"),
            job_seed=job_seed,
            timeout_ms=timeout_ms,
            include_members=True,
        )
        response: coordinator_pb2.JoinGroupResponse = stub.JoinGroup(
            request, timeout=timeout_ms / 1000 + 10, metadata=metadata
        )
        return response

    with ThreadPoolExecutor(max_workers=world_size) as pool:
        return list(pool.map(join, range(world_size)))


def wait_for_group(
    stub: coordinator_pb2_grpc.CoordinatorStub, job: str, group: str, timeout_s: float = 30.0
) -> None:
    """Block until `group` exists, i.e. the first JoinGroup naming it has reached the server
    and committed (a join that then waits for other ranks is in flight)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stub.GetGroup(coordinator_pb2.GetGroupRequest(job=job, group=group), timeout=5)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def postgres_backend_missing() -> bool:
    return importlib.util.find_spec("rngcoord.server.storage.postgres") is None


class PostgresDatabases:
    """Creates and drops scratch databases on the test PostgreSQL server."""

    def __init__(self) -> None:
        self.explicit = POSTGRES_ENV in os.environ
        self.admin_url = os.environ.get(POSTGRES_ENV) or DEFAULT_POSTGRES
        self._checked = False
        self._skip: str | None = None
        self._error: str | None = None

    def unavailable(self) -> str | None:
        """Why no database can be made (a skip reason), or None when the server answers.

        Raises RuntimeError when RNGCOORD_TEST_POSTGRES names a server that does not answer.
        """
        if postgres_backend_missing():
            return "postgres backend not available (rngcoord.server.storage.postgres is missing)"
        if not self._checked:
            self._checked = True
            import psycopg

            try:
                psycopg.connect(self.admin_url, connect_timeout=3).close()
            except psycopg.Error as exc:
                problem = f"no PostgreSQL at {self.admin_url}: {str(exc).strip()[:200]}"
                if self.explicit:
                    self._error = f"{problem} (it is named by {POSTGRES_ENV})"
                else:
                    self._skip = f"{problem}; start one or set {POSTGRES_ENV}"
        if self._error is not None:
            raise RuntimeError(self._error)
        return self._skip

    def create(self) -> str:
        """Create an empty database and return its URL."""
        import psycopg

        name = f"rngcoord_test_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return urlunsplit(urlsplit(self.admin_url)._replace(path=f"/{name}"))

    def drop(self, url: str) -> None:
        """Drop the database of `url`, ending any session still connected to it."""
        import psycopg

        name = urlsplit(url).path.lstrip("/")
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


CoordinatorFactory = Callable[..., CoordinatorProcess]
"""What the `coordinator_factory` fixture gives: `(db_url=None, *, args=(), env=None)` to a
started `CoordinatorProcess`."""


class LoopThread:
    """An asyncio event loop running in a background thread, so that synchronous tests can
    call the asynchronous Coordinator: `loop.run(coordinator.reserve(...))`.

    Objects that belong to a loop (the Coordinator, its futures) must be made on this one:
    build them inside a coroutine passed to `run`.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coro` on the loop and return its result (or raise its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop without waiting; the future gives its outcome."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class ManualClock:
    """A `rngcoord.server.clock.Clock` whose time moves only when `advance` is awaited, so that
    timeout tests never sleep.

    Args:
        now_s: the starting time, Unix seconds. Default 1.7e9.
    """

    def __init__(self, now_s: float = 1.7e9) -> None:
        self._now = now_s
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._count = 0

    def now_us(self) -> int:
        return int(self._now * 1_000_000)

    def monotonic(self) -> float:
        return self._now

    async def wait(self, future: asyncio.Future[object], timeout_s: float) -> bool:
        if future.done() or timeout_s <= 0:
            return future.done()
        alarm: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._count += 1
        heapq.heappush(self._timers, (self._now + timeout_s, self._count, alarm))
        await asyncio.wait((future, alarm), return_when=asyncio.FIRST_COMPLETED)
        return future.done()

    async def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, fire every wait that expires, and let the woken tasks run
        until they wait again."""
        self._now += seconds
        while self._timers and self._timers[0][0] <= self._now:
            _, _, alarm = heapq.heappop(self._timers)
            if not alarm.done():
                alarm.set_result(None)
        for _ in range(20):
            await asyncio.sleep(0.01)


async def gather_list(items: AsyncIterator[T]) -> list[T]:
    """Every item of an async iterator, as a list."""
    return [item async for item in items]


class CountingStore:
    """The real SqliteStore, counting the writes that go through it."""

    def __init__(self, inner: SqliteStore) -> None:
        self.inner = inner
        self.dialect = inner.dialect
        self.store_id = inner.store_id
        self.location = inner.location
        self.replication = inner.replication
        self.writes = 0

    def check_identity(self) -> None:
        self.inner.check_identity()

    def went_back_to(self, record_id: int, record_hash: str) -> None:
        self.inner.went_back_to(record_id, record_hash)

    def saw_head(self, record_id: int, record_hash: str) -> None:
        self.inner.saw_head(record_id, record_hash)

    def is_unavailable(self, exc: BaseException) -> bool:
        return self.inner.is_unavailable(exc)

    def read(self, fn: Callable[[Tx], T]) -> T:
        return self.inner.read(fn)

    def write(self, fn: Callable[[Tx], T]) -> T:
        self.writes += 1
        return self.inner.write(fn)

    def submit(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> Future[T]:
        self.writes += 1
        return self.inner.submit(fn, ahead)

    def data_version(self) -> int:
        return self.inner.data_version()

    def write_problem(self, stall_s: float) -> WriteProblem | None:
        return self.inner.write_problem(stall_s)

    def close(self) -> None:
        self.inner.close()


class InProcess:
    """An asynchronous Coordinator on `store` in `loop`, driven from the test's thread (its
    clock is `clock`; its audit chain keyed by `key` when given)."""

    def __init__(
        self,
        loop: LoopThread,
        store: CountingStore,
        clock: ManualClock,
        *,
        key: bytes | None = None,
    ) -> None:
        self.loop = loop
        self.store = store
        self.clock = clock
        chain = open_chain(store, key, now_us=clock.now_us(), actor="test")

        async def make() -> Coordinator:
            coordinator = Coordinator(store, join_timeout_s=10.0, clock=clock, chain=chain)
            await coordinator.start()
            return coordinator

        self.coord = loop.run(make())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coro)

    def start(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return self.loop.start(coro)

    def advance(self, seconds: float) -> None:
        self.run(self.clock.advance(seconds))

    def close(self) -> None:
        self.run(self.coord.close())


def secret_for(member_id: str) -> bytes:
    """The member secret the tests' members join with: one per member id, known to the test
    (a client draws its own at random: rngcoord.client._connection.member_secret)."""
    return hashlib.sha256(b"test-secret:" + member_id.encode()).digest()


def caller(
    member: str,
    *,
    rank: int = 0,
    epoch: int = 1,
    group: str = "g",
    job: str = TEST_JOB,
    secret: bytes | None = None,
) -> Caller:
    """A `Caller` as `member`, with its test secret unless `secret` says otherwise."""
    return Caller(
        job,
        group,
        epoch,
        rank,
        member,
        secret_for(member) if secret is None else secret,
        actor=f"rank {rank}",
    )


def records(h: InProcess, kind: str) -> list[AuditRecord]:
    return h.run(gather_list(h.coord.list_audit(kinds=[kind])))


def form(
    h: InProcess,
    group: str = "g",
    members: Sequence[str] = ("m0", "m1"),
    *,
    job: str = TEST_JOB,
    job_seed: int | None = 42,
) -> JoinResult:
    """Join every rank at once and return the common result."""

    async def all_ranks() -> list[JoinResult]:
        return await asyncio.gather(
            *(
                h.coord.join(
                    job,
                    group,
                    rank=rank,
                    world_size=len(members),
                    member_id=m,
                    member_secret=secret_for(m),
                    job_seed=job_seed,
                    actor=f"rank {rank}",
                )
                for rank, m in enumerate(members)
            )
        )

    results = h.run(all_ranks())
    assert all(r == results[0] for r in results)
    return results[0]


def reserve(
    h: InProcess,
    seq: int,
    *,
    size: int = 64,
    fp: bytes = b"ops",
    rank: int = 0,
    member: str = "m0",
    epoch: int = 1,
    group: str = "g",
) -> Lease:
    return h.run(
        h.coord.reserve(
            caller(member, rank=rank, epoch=epoch, group=group), seq=seq, size=size, fingerprint=fp
        )
    )


def join(
    h: InProcess,
    rank: int,
    world_size: int,
    member: str,
    *,
    timeout_s: float = 10.0,
    group: str = "g",
    job: str = TEST_JOB,
    job_seed: int | None = None,
) -> Coroutine[Any, Any, JoinResult]:
    return h.coord.join(
        job,
        group,
        rank=rank,
        world_size=world_size,
        member_id=member,
        member_secret=secret_for(member),
        job_seed=job_seed,
        timeout_s=timeout_s,
        actor=f"rank {rank}",
    )


def rehash_from(raw: sqlite3.Connection, first: int) -> None:
    """Recompute every hash of an SQLite store's chain from record `first` on with plain
    SHA-256 and fix audit_head, as a forger without the key would."""
    chain = Chain("ignored")  # unkeyed: the forger has no key
    row = raw.execute("SELECT hash FROM audit WHERE id = ?", (first - 1,)).fetchone()
    prev = GENESIS_HASH if row is None else row[0]
    rows = raw.execute(
        "SELECT id, ts_us, job, grp, kind, actor, detail FROM audit WHERE id >= ? ORDER BY id",
        (first,),
    ).fetchall()
    for rid, ts, job, grp, kind, actor, detail in rows:
        digest = chain.digest(rid, ts, job, grp, kind, actor, detail, prev)
        raw.execute("UPDATE audit SET prev_hash = ?, hash = ? WHERE id = ?", (prev, digest, rid))
        prev = digest
    raw.execute("UPDATE audit_head SET last_id = ?, last_hash = ?", (rows[-1][0], prev))


# Shorter "tokens" are words that a log may hold for other reasons.
_TOKEN_MIN_CHARS = 8
# Source files, and the bytecode compiled from them: tests copy or install the checkout, whose
# code may hold a test token's words (the token "member-secret" is also the member credential
# hash's domain string, in membership.py and so in the image test's venv's membership.pyc).
_SOURCE_SUFFIXES = frozenset({".py", ".pyc", ".pyi", ".proto", ".sql", ".md", ".toml"})


def token_leaks(root: Path) -> list[str]:
    """Files under `root` that hold a token of a token file there (a file named `tokens`):
    "PATH: TOKEN[:4]..." for each. A token is the last field of a line, where it stands in
    well-formed lines and in broken ones."""
    tokens: set[str] = set()
    for path in root.rglob("tokens"):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            fields = line.split()
            if fields and not fields[0].startswith("#") and len(fields[-1]) >= _TOKEN_MIN_CHARS:
                tokens.add(fields[-1])
    leaks: list[str] = []
    if not tokens:
        return leaks
    for path in root.rglob("*"):
        if path.name == "tokens" or not path.is_file() or path.stat().st_size > 64 << 20:
            continue
        if path.suffix in _SOURCE_SUFFIXES:  # a copy of the checkout (the shadowing tests)
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        leaks += [f"{path}: {token[:4]}..." for token in sorted(tokens) if token in text]
    return leaks
