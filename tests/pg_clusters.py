"""PostgreSQL clusters of a test's own: a primary and a streaming standby, killed and promoted.

The failover tests need what the shared server at RNGCOORD_TEST_POSTGRES cannot give: a
primary to SIGKILL (postmaster and children at once, as a host crash) and a standby to
promote. `PostgresPair` makes both in a temporary directory with initdb, ``pg_basebackup -R``
and pg_ctl, on ephemeral ports of 127.0.0.1, and tears them down at the end.

The server binaries come from /usr/lib/postgresql/<newest>/bin (Debian's layout, which
.ci/run installs). PostgreSQL refuses to run as root, so as root every server command runs as
the ``postgres`` user (runuser) on directories that user owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from ports import free_port

_BASE = Path("/usr/lib/postgresql")


def binaries() -> Path | None:
    """The newest installed PostgreSQL's bin directory, or None without one."""
    versions = sorted(
        (p for p in _BASE.glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    return versions[-1] if versions else None


def unavailable() -> str | None:
    """Why a pair cannot be made here, or None."""
    if binaries() is None:
        return f"no PostgreSQL server binaries under {_BASE}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user to run PostgreSQL as"
    return None


class Cluster:
    """One PostgreSQL data directory and the server running on it.

    Args:
        data: the data directory.
        port: the port it listens on (127.0.0.1 only).
    """

    def __init__(self, data: Path, port: int) -> None:
        self.data = data
        self.port = port

    @property
    def url(self) -> str:
        """A libpq URL of this cluster's ``postgres`` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def execute(self, sql: str) -> list[tuple[object, ...]]:
        return self.execute_in("postgres", sql)

    def execute_in(self, database: str, sql: str) -> list[tuple[object, ...]]:
        """Run `sql` in `database` of this cluster; its rows (none for a statement)."""
        url = self.url.rsplit("/", 1)[0] + f"/{database}"
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(sql)
            return cur.fetchall() if cur.description else []


class PostgresPair:
    """A primary and a streaming standby of it, on two ephemeral ports.

    Both data directories and their logs go in a directory of their own under the system's
    temporary directory (pytest's tmp_path is not reachable by the postgres user), removed by
    `close`.

    Args:
        synchronous: the primary waits for the standby to flush each commit
            (``synchronous_standby_names = '*'``); otherwise replication is asynchronous.
    """

    def __init__(self, *, synchronous: bool) -> None:
        bin_dir = binaries()
        assert bin_dir is not None, unavailable()
        self._bin = bin_dir
        self._root = root = Path(tempfile.mkdtemp(prefix="rngcoord-pg-"))
        self._as_postgres = os.geteuid() == 0
        self._chown(root)
        self.primary = Cluster(root / "primary", free_port())
        self.standby = Cluster(root / "standby", free_port())
        self._run("initdb", "-D", str(self.primary.data), "-U", "postgres", "--auth=trust", "-N")
        conf = [
            "listen_addresses = '127.0.0.1'",
            "unix_socket_directories = ''",
            "wal_level = replica",
            "max_wal_senders = 5",
            "fsync = off",
            # The standby reports its flush position every second ('100ms' would round down to
            # 0, which turns the reports off and keeps a synchronous commit waiting for ~20 s).
            "wal_receiver_status_interval = 1s",
        ]
        if synchronous:
            conf += ["synchronous_standby_names = '*'", "synchronous_commit = on"]
        with (self.primary.data / "postgresql.conf").open("a") as f:
            f.write("\n".join(conf) + "\n")
        with (self.primary.data / "pg_hba.conf").open("a") as f:
            f.write("host replication postgres 127.0.0.1/32 trust\n")
        self._start(self.primary)
        self._run(
            "pg_basebackup",
            "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.standby.data), "-R", "-X", "stream",
        )  # fmt: skip
        with (self.standby.data / "postgresql.conf").open("a") as f:
            # The base backup copied the primary's synchronous_standby_names; promoted, the
            # standby has no standby of its own, and every commit would wait for one for ever
            # (Patroni and cloud failover clear it the same way).
            f.write(f"port = {self.standby.port}\nsynchronous_standby_names = ''\n")
        self._start(self.standby)
        self.wait_streaming()

    @property
    def url(self) -> str:
        """A multi-host URL that finds whichever of the two is the writable primary."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
            "/postgres?target_session_attrs=read-write"
        )

    def database_url(self, name: str) -> str:
        """The multi-host URL of database `name` (made with `create_database`)."""
        return self.url.replace("/postgres?", f"/{name}?")

    def create_database(self, name: str) -> None:
        self.primary.execute(f'CREATE DATABASE "{name}"')

    def wait_streaming(self, timeout_s: float = 30) -> None:
        """Until the primary has a standby streaming from it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.primary.execute("SELECT state FROM pg_stat_replication")
            if ("streaming",) in rows:
                return
            time.sleep(0.1)
        raise AssertionError(f"the standby did not start streaming in {timeout_s} s")

    def cut_standby(self, timeout_s: float = 30) -> None:
        """Stop the standby's WAL receiver, as a standby that falls behind would: commits the
        primary acknowledges from now on never reach it. (Pausing replay is not enough: a
        paused standby still receives the WAL and replays it when promoted.)"""
        auto = self.standby.data / "postgresql.auto.conf"
        # pg_basebackup -R wrote primary_conninfo there; an empty one stops the receiver on
        # a reload (PostgreSQL 13 and later).
        lines = auto.read_text().splitlines()
        lines = [line for line in lines if not line.startswith("primary_conninfo")]
        auto.write_text("\n".join([*lines, "primary_conninfo = ''"]) + "\n")
        self._run("pg_ctl", "reload", "-D", str(self.standby.data))
        deadline = time.monotonic() + timeout_s
        while self.primary.execute("SELECT state FROM pg_stat_replication"):
            assert time.monotonic() < deadline, "the standby's WAL receiver did not stop"
            time.sleep(0.05)

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every child at once, as a host crash would."""
        pid = self.primary.postmaster_pid()
        children = subprocess.run(
            ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        for p in [pid, *map(int, children)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)

    def promote(self, timeout_s: float = 30) -> None:
        """Promote the standby (``pg_ctl promote``) and wait until it accepts writes."""
        wait = ["-w", "-t", str(int(timeout_s))]
        self._run("pg_ctl", "promote", *wait, "-D", str(self.standby.data))
        deadline = time.monotonic() + timeout_s
        while self.standby.execute("SELECT pg_is_in_recovery()") != [(False,)]:
            assert time.monotonic() < deadline, "the promoted standby stays in recovery"
            time.sleep(0.05)

    def close(self) -> None:
        for cluster in (self.standby, self.primary):
            if (cluster.data / "postmaster.pid").exists():
                self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(cluster.data), check=False)
        shutil.rmtree(self._root, ignore_errors=True)

    # -- running the server binaries -------------------------------------------------------

    def _start(self, cluster: Cluster) -> None:
        log = self._root / f"{cluster.data.name}.log"
        self._run(
            "pg_ctl", "start", "-w", "-D", str(cluster.data), "-l", str(log),
            "-o", f"-p {cluster.port}",
        )  # fmt: skip

    def _chown(self, path: Path) -> None:
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        cmd = [str(self._bin / tool), *args]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd="/")
        if check and done.returncode != 0:
            raise AssertionError(f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}")
