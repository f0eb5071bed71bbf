"""Test harness shared by the suites: coordinator server subprocesses and scratch stores.

- `CoordinatorProcess`: a real `rngcoord serve` subprocess on 127.0.0.1 and an ephemeral port.
- `run_cli(*args)`: runs `python -m rngcoord.server.cli ARGS` and returns the completed process.
- `join_all(stub, job, group, world_size)`: joins every rank of a group at once (a barrier).
- `wait_for_group(stub, job, group)`: waits until a group exists (its first join is in flight).
- `PostgresDatabases`: creates and drops scratch databases on the test PostgreSQL server
  named by RNGCOORD_TEST_POSTGRES (default postgresql://postgres@127.0.0.1:5432/postgres).

The fixtures that use these live in conftest.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rngcoord.v1 import coordinator_pb2, coordinator_pb2_grpc

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

    Attributes: `address` ("127.0.0.1:PORT", set once started), `port`, `db_url`, `popen`.
    The server runs with `--metrics off` unless `args` passes `--metrics`.
    """

    def __init__(
        self,
        db_url: str,
        workdir: Path,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.db_url = db_url
        self.workdir = workdir
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

    def restart(self) -> CoordinatorProcess:
        """Start again on the same store, on the same port when it is free, else on a new one.

        The server must have stopped (`kill()` or `terminate()`) first.
        """
        if self.running:
            raise RuntimeError("stop the coordinator before restarting it")
        try:
            return self.start()
        except RuntimeError:
            # The old port was taken meanwhile; any free port will do.
            self.port = 0
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


def run_cli(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run `python -m rngcoord.server.cli ARGS...` and return the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "rngcoord.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


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

    Member ids are `m<rank>-<random>`; the replies' `members` field lists them. `metadata` goes
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
            job_seed=job_seed,
            timeout_ms=timeout_ms,
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
    return importlib.util.find_spec("rngcoord.server.postgres") is None


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
            return "postgres backend not available (rngcoord.server.postgres does not exist yet)"
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
