"""The `rngcoord` command line: serve, audit, report, verify, demo and replay.

Exit status: 0 on success; 1 when `verify` finds a problem; 2 for a usage error or when the
command cannot run (an unreadable database, an address that cannot be bound, a bad token
file). Flags take their defaults from environment variables where the CLI reference
(docs/operations.md) names one.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from rngcoord.server.argtypes import (
    env_flag,
    env_float,
    env_int,
    env_path,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    time_us,
)
from rngcoord.server.audit.chain import KINDS, AuditRecord
from rngcoord.server.audit.table import audit_json, print_table
from rngcoord.server.replication import ReplicationRefused
from rngcoord.server.storage.store import Store, StoreNotFound, Tx

DEFAULT_LISTEN = "0.0.0.0:29520"
DEFAULT_DB = "sqlite:///rngcoord.db"
DEFAULT_METRICS = "0.0.0.0:9464"
# The table sizes its columns from the first rows, then streams the rest at those widths.
"""Columns before DETAIL: ID, TIME, JOB, GROUP, KIND."""
_FOLLOW_PAGE = 500


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["demo"], ["replay"]):
        # Every flag, --help included, belongs to the client module's own parser.
        return _client_command(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        return command(args)
    except BrokenPipeError:
        # `rngcoord audit | head` closed our stdout; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ValueError, StoreNotFound, ReplicationRefused) as exc:
        print(f"rngcoord {args.command}: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults are read from the environment when it is built."""
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="rngcoord",
        description="Seed and Philox offset authority for distributed PyTorch.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `rngcoord COMMAND --help` for the flags of a command.\n\n"
        "exit status: 0 on success, 1 when verify finds a problem, 2 for a usage error or a\n"
        "command that cannot run (unreadable database, address in use, bad token file)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the coordinator gRPC server",
        description="Run the coordinator until SIGTERM or SIGINT, then drain and exit 0.",
    )
    serve.add_argument(
        "--listen",
        default=env.get("RNGCOORD_LISTEN", DEFAULT_LISTEN),
        metavar="HOST:PORT",
        help=f"gRPC listen address; port 0 picks one (env RNGCOORD_LISTEN; "
        f"default {DEFAULT_LISTEN})",
    )
    _add_db(serve, env)
    serve.add_argument(
        "--metrics",
        default=env.get("RNGCOORD_METRICS", DEFAULT_METRICS),
        metavar="HOST:PORT|off",
        help=f"HTTP listen address of the status page (/), its JSON API (/api/...) and "
        f"Prometheus (/metrics), or `off` (env RNGCOORD_METRICS; default {DEFAULT_METRICS})",
    )
    serve.add_argument(
        "--status-open",
        action="store_true",
        default=env_flag(env, "RNGCOORD_STATUS_OPEN"),
        help="serve the status page and /api without a token even with --tokens (default: "
        "they need an auditor or admin token; without a token file they are open, logged as a "
        "warning) (env RNGCOORD_STATUS_OPEN=1)",
    )
    serve.add_argument(
        "--init",
        action="store_true",
        default=env_flag(env, "RNGCOORD_INIT"),
        help="create the store (and the --audit-key file) when there is none; without it, a "
        "missing store is an error, so that no stream silently starts over at offset 0 "
        "(env RNGCOORD_INIT=1)",
    )
    serve.add_argument(
        "--require-sync-replication",
        action="store_true",
        default=env_flag(env, "RNGCOORD_REQUIRE_SYNC_REPLICATION"),
        help="refuse a PostgreSQL primary that does not replicate synchronously "
        "(synchronous_standby_names empty), at start and after every reconnect: with "
        "asynchronous replication a promoted standby may lack acknowledged grants and grant "
        "their offsets again (env RNGCOORD_REQUIRE_SYNC_REPLICATION=1; default: the mode is "
        "only logged)",
    )
    serve.add_argument(
        "--audit-key",
        type=Path,
        default=env_path(env, "RNGCOORD_AUDIT_KEY"),
        metavar="FILE",
        help="HMAC key of the audit chain (64 hex digits; --init writes a fresh one); keep it "
        "away from the database (env RNGCOORD_AUDIT_KEY; default: unkeyed, logged as a warning)",
    )
    serve.add_argument(
        "--anchor-file",
        type=Path,
        default=env_path(env, "RNGCOORD_ANCHOR_FILE"),
        metavar="FILE",
        help="append the signed head of the audit chain here (and to the log) each second it "
        "moved, for `verify --anchor`; read at start: a store whose chain lacks the newest "
        "anchor is refused (env RNGCOORD_ANCHOR_FILE; default: PATH.anchors.jsonl beside an "
        "SQLite store, the log only for PostgreSQL)",
    )
    serve.add_argument(
        "--anchor",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="more anchors to check the store against at start (repeatable): another server's "
        "--anchor-file or log, or the audit heads clients keep in checkpoints; a store whose "
        "chain lacks the newest of them is refused",
    )
    serve.add_argument(
        "--floor-from",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="after losing a store: an audit export (`rngcoord audit --json`) or lines "
        "`JOB GROUP OFFSET` (`*` for all); new groups start above those offsets; repeatable",
    )
    serve.add_argument(
        "--tokens",
        type=Path,
        default=env_path(env, "RNGCOORD_TOKENS"),
        metavar="FILE",
        help="token file, lines `NAME ROLE JOBS TOKEN` (roles member, auditor, admin; JOBS: "
        "comma-separated patterns) or the older `JOB TOKEN`; reloaded on SIGHUP "
        "(env RNGCOORD_TOKENS; default: no authentication, logged as a warning)",
    )
    serve.add_argument(
        "--tls-cert",
        type=Path,
        default=env_path(env, "RNGCOORD_TLS_CERT"),
        metavar="PEM",
        help="server certificate chain; turns TLS on (env RNGCOORD_TLS_CERT; default off)",
    )
    serve.add_argument(
        "--tls-key",
        type=Path,
        default=env_path(env, "RNGCOORD_TLS_KEY"),
        metavar="PEM",
        help="server private key (env RNGCOORD_TLS_KEY)",
    )
    serve.add_argument(
        "--tls-client-ca",
        type=Path,
        default=env_path(env, "RNGCOORD_TLS_CLIENT_CA"),
        metavar="PEM",
        help="CA bundle for client certificates; turns mTLS on (env RNGCOORD_TLS_CLIENT_CA; "
        "default off)",
    )
    serve.add_argument(
        "--ready-file",
        type=Path,
        metavar="FILE",
        help="write the bound HOST:PORT here once serving (default: none)",
    )
    serve.add_argument(
        "--join-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="JoinGroup wait when the request sets no timeout (default 60)",
    )
    serve.add_argument(
        "--max-join-timeout",
        type=positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="the longest any JoinGroup waits, whatever it asks (default 1800)",
    )
    serve.add_argument(
        "--workers",
        type=positive_int,
        default=env_int(env, "RNGCOORD_WORKERS", os.cpu_count() or 1),
        metavar="N",
        help="server processes sharing the port, one core each (env RNGCOORD_WORKERS; "
        "default: the number of cores)",
    )
    serve.add_argument(
        "--cache-staleness",
        type=non_negative_float,
        default=0.5,
        metavar="SECONDS",
        help="a hit is answered from memory only while this process has seen every change "
        "made through other workers or replicas up to this long ago; otherwise it reads the "
        "store (default 0.5)",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_int,
        default=None,
        metavar="N",
        help="most client connections per server process (default: the open-file limit, "
        "raised to its hard maximum, less 256)",
    )
    serve.add_argument(
        "--max-connections-per-host",
        type=positive_int,
        default=None,
        metavar="N",
        help="most client connections of one peer host per server process; the newest past it "
        "are closed, so one host can never lock others out (default: a quarter of "
        "--max-connections)",
    )
    serve.add_argument(
        "--crowded-idle-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="while a process holds more than half of --max-connections, close connections "
        "without a call for this long (default 10)",
    )
    serve.add_argument(
        "--max-audit-streams-per-host",
        type=positive_int,
        default=16,
        metavar="N",
        help="most ListAudit streams one peer host may hold open; more are refused "
        "RESOURCE_EXHAUSTED / TOO_MANY_STREAMS (default 16)",
    )
    serve.add_argument(
        "--max-audit-streams",
        type=positive_int,
        default=256,
        metavar="N",
        help="most ListAudit streams per server process (default 256)",
    )
    serve.add_argument(
        "--max-sessions-per-host",
        type=positive_int,
        default=128,
        metavar="N",
        help="most Session streams one peer host may hold open (a client process holds one "
        "per coordinator target); more are refused RESOURCE_EXHAUSTED / TOO_MANY_STREAMS "
        "(default 128)",
    )
    serve.add_argument(
        "--max-sessions",
        type=positive_int,
        default=16384,
        metavar="N",
        help="most Session streams per server process (default 16384)",
    )
    serve.add_argument(
        "--audit-stall-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="end a ListAudit stream whose client takes no record for this long (default 60)",
    )
    serve.add_argument(
        "--handshake-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection that has not started HTTP/2 within this long (default 10)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="close a connection without calls for this long; clients reconnect (default 600)",
    )
    serve.add_argument(
        "--peer-rate",
        type=non_negative_float,
        default=env_float(env, "RNGCOORD_PEER_RATE", 5000.0),
        metavar="CALLS_PER_S",
        help="calls per second each peer host may sustain; 0 for no limit "
        "(env RNGCOORD_PEER_RATE; default 5000)",
    )
    serve.add_argument(
        "--peer-burst",
        type=positive_float,
        default=20000.0,
        metavar="CALLS",
        help="calls a peer host may make at once (default 20000)",
    )
    serve.add_argument(
        "--grace",
        type=non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="how long in-flight RPCs may finish after SIGTERM (default 10)",
    )
    serve.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="lowest level of the JSON log lines on stderr (default INFO)",
    )
    serve.set_defaults(run=_serve)

    audit = sub.add_parser(
        "audit",
        help="print the audit log",
        description="Print audit records, oldest first, as a table or as JSON lines. "
        "TIME is ISO 8601 (UTC unless it names a zone) or Unix seconds.",
    )
    _add_db(audit, env)
    audit.add_argument("--job", default="", help="only this job (default: all)")
    audit.add_argument("--group", default="", help="only this group (default: all)")
    audit.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="KIND",
        help=f"only this kind ({', '.join(KINDS)}); repeat for several (default: all)",
    )
    audit.add_argument(
        "--since", type=time_us, default=0, metavar="TIME", help="records at or after TIME"
    )
    audit.add_argument(
        "--until", type=time_us, default=0, metavar="TIME", help="records before TIME"
    )
    audit.add_argument(
        "--limit",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="at most N records (default 0: all)",
    )
    audit.add_argument("--json", action="store_true", help="one JSON object per line")
    audit.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="after the records so far, print new ones as they are appended (polls the "
        "store; Ctrl-C ends it)",
    )
    audit.add_argument(
        "--poll",
        type=positive_float,
        default=0.5,
        metavar="SECONDS",
        help="how often --follow reads the store (default 0.5)",
    )
    audit.add_argument(
        "--width",
        type=non_negative_int,
        default=None,
        metavar="COLUMNS",
        help="fit the table to this many columns, wrapping long cells, never cutting them; 0 "
        "for one line per record (default: the terminal's width, or 0 when not a terminal)",
    )
    audit.set_defaults(run=_audit)

    verify = sub.add_parser(
        "verify",
        help="check the audit chain and that no offsets were granted twice",
        description="Check the hash chain, that leases and grant records match, and that no "
        "two grants of a group overlap except through a recorded Restore. Exit 0 when all "
        "holds, else print each problem and exit 1.",
    )
    _add_db(verify, env)
    verify.add_argument(
        "--audit-key",
        type=Path,
        default=env_path(env, "RNGCOORD_AUDIT_KEY"),
        metavar="FILE",
        help="the server's audit key: check the chain's MACs and the anchors' signatures "
        "(env RNGCOORD_AUDIT_KEY; default: hashes only, and a note says so)",
    )
    verify.add_argument(
        "--anchor",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="anchors to check the chain against: a server's --anchor-file or log, or heads "
        "kept by clients (STORE_ID:ID:HASH:MAC lines); repeatable",
    )
    verify.set_defaults(run=_verify)

    report = sub.add_parser(
        "report",
        help="write a job's history as one self-contained HTML file (needs the report extra)",
        description="Draw each group of a job (epochs, leases along the offset axis against "
        "time, restores, divergences) with a summary table into one HTML file that opens "
        "offline. Reads the store only; never creates one.",
    )
    _add_db(report, env)
    report.add_argument("--job", required=True, help="the job to report on")
    report.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="FILE",
        help="the HTML file to write (replaced if it exists)",
    )
    report.set_defaults(run=_report)

    demo = sub.add_parser(
        "demo",
        help="run a local elastic training demo against a fresh coordinator (needs the client "
        "extra: torch)",
        description="Runs rngcoord.demo; `rngcoord demo --help` lists its flags.",
    )
    replay = sub.add_parser(
        "replay",
        help="regenerate a sharding_invariant op's values offline from an audit export "
        "(needs the client extra: torch)",
        description="Runs rngcoord.client._replay; `rngcoord replay --help` lists its flags.",
    )
    # main() hands `demo ARGS...` and `replay ARGS...` to the client before this parser.
    del demo, replay
    return parser


def _serve(args: argparse.Namespace) -> int:
    # A SIGHUP (a token reload) that arrives while the server starts would end the process:
    # hold it until the handlers are in place (app._serve_here, workers._Signals).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    # gRPC core logs to stderr in its own format, read once when grpc is first imported.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    # Imported here so that `audit` and `verify` do not pay for the gRPC server's imports.
    from rngcoord.server.app import serve
    from rngcoord.server.options import ServerOptions, TLSConfig

    tls: TLSConfig | None = None
    if args.tls_cert is not None or args.tls_key is not None:
        if args.tls_cert is None or args.tls_key is None:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca is not None:
        raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
    metrics = None if args.metrics.strip().lower() == "off" else args.metrics
    if args.join_timeout > args.max_join_timeout:
        raise ValueError(
            f"--join-timeout {args.join_timeout:g} is above --max-join-timeout "
            f"{args.max_join_timeout:g}"
        )
    options = ServerOptions(
        args.listen,
        args.db,
        metrics_listen=metrics,
        tokens=args.tokens,
        tls=tls,
        join_timeout_s=args.join_timeout,
        max_join_timeout_s=args.max_join_timeout,
        staleness_s=args.cache_staleness,
        init=args.init,
        audit_key=args.audit_key,
        anchor_file=args.anchor_file,
        anchors=tuple(args.anchor),
        floor_from=tuple(args.floor_from),
        require_sync_replication=args.require_sync_replication,
        max_connections=args.max_connections,
        max_connections_per_host=args.max_connections_per_host,
        crowded_idle_timeout_s=args.crowded_idle_timeout,
        max_audit_streams_per_host=args.max_audit_streams_per_host,
        max_audit_streams=args.max_audit_streams,
        max_sessions_per_host=args.max_sessions_per_host,
        max_sessions=args.max_sessions,
        audit_stall_s=args.audit_stall_timeout,
        handshake_timeout_s=args.handshake_timeout,
        idle_timeout_s=args.idle_timeout,
        peer_rate=args.peer_rate,
        peer_burst=args.peer_burst,
        status_open=args.status_open,
    )
    if args.workers > 1:
        from rngcoord.server.workers import serve_workers

        return serve_workers(
            options,
            args.workers,
            ready_file=args.ready_file,
            grace_s=args.grace,
            log_level=args.log_level,
        )
    return serve(options, ready_file=args.ready_file, grace_s=args.grace, log_level=args.log_level)


def _audit(args: argparse.Namespace) -> int:
    from rngcoord.server.audit.chain import records as audit_records
    from rngcoord.server.storage.queries import audit_head
    from rngcoord.server.storage.stores import open_store

    if args.follow and (args.until or args.limit):
        raise ValueError("--follow streams records as they come: it takes no --until or --limit")
    width = args.width
    if width is None:
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 0
    filters = {
        "job": args.job,
        "group": args.group,
        "kinds": tuple(args.kind),
        "since_us": args.since,
    }
    stop = _stop_on_signals() if args.follow else None
    store = open_store(args.db)
    try:
        # Every record up to this head is listed (or filtered out) by the listing below.
        seen = [store.read(audit_head)[0] if args.follow else 0]
        listed = _noting_ids(
            audit_records(store, **filters, until_us=args.until, limit=args.limit), seen
        )
        more = _follow(store, seen, filters, args.poll, stop) if stop is not None else None
        if args.json:
            for rec in itertools.chain(listed, more or ()):
                line = json.dumps(audit_json(rec), sort_keys=True, separators=(",", ":"))
                print(line, flush=args.follow)
        else:
            print_table(listed, sys.stdout, width=width, then=more)
    finally:
        store.close()
    return 0


def _noting_ids(records: Iterable[AuditRecord], seen: list[int]) -> Iterator[AuditRecord]:
    for rec in records:
        seen[0] = max(seen[0], rec.id)
        yield rec


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set. `--follow` ends on it between polls: a
    KeyboardInterrupt raised inside a store read could leave the store's locks held, and
    its close hanging."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def _follow(
    store: Store, seen: list[int], filters: dict[str, Any], poll_s: float, stop: threading.Event
) -> Iterator[AuditRecord]:
    """Records after `seen[0]` passing `filters`, as they are appended, until `stop`."""
    from rngcoord.server.audit.chain import fetch_page
    from rngcoord.server.storage.queries import audit_head

    def read(tx: Tx) -> tuple[int, list[AuditRecord]]:
        head = audit_head(tx)[0]
        return head, fetch_page(tx, after_id=seen[0], limit=_FOLLOW_PAGE, **filters)

    while not stop.is_set():
        head, page = store.read(read)
        yield from _noting_ids(page, seen)
        if len(page) < _FOLLOW_PAGE:
            # Whatever else was appended up to `head` did not pass the filters.
            seen[0] = max(seen[0], head)
            stop.wait(poll_s)


def _report(args: argparse.Namespace) -> int:
    from rngcoord.server.report import ReportUnavailable, write_report
    from rngcoord.server.storage.stores import open_store

    store = open_store(args.db)
    try:
        written = write_report(store, args.job, args.output)
    except ReportUnavailable as exc:
        print(f"rngcoord report: error: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()
    leases = sum(len(g.leases) for g in written.groups)
    print(
        f"wrote {args.output}: job {args.job!r}, {len(written.groups)} groups, {leases} leases, "
        f"audit head {written.head[0]}"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from rngcoord.server.audit.anchors import read_anchors
    from rngcoord.server.audit.chain import load_key
    from rngcoord.server.audit.verify import verify
    from rngcoord.server.storage.stores import open_store

    key = load_key(str(args.audit_key)) if args.audit_key is not None else None
    anchors = []
    for path in args.anchor:
        with open(path, encoding="utf-8", errors="replace") as f:
            found = read_anchors(f, str(path))
        if not found:
            raise ValueError(f"{path} holds no anchors (JSON lines or STORE_ID:ID:HASH:MAC)")
        anchors += found
    store = open_store(args.db)
    try:
        report = verify(store, key=key, anchors=anchors, progress=_Progress(sys.stderr))
    finally:
        store.close()
    for problem in report.problems:
        print(f"problem: {problem}")
    for note in report.notes:
        print(f"note: {note}")
    print(report.summary())
    return 0 if report.ok else 1


class _Progress:
    """Prints "verify: N/M records checked" to `out` at most once a second, for long chains."""

    def __init__(self, out: TextIO, min_records: int = 10_000, every_s: float = 1.0) -> None:
        self._out = out
        self._min_records = min_records
        self._every_s = every_s
        self._last = time.monotonic()

    def __call__(self, checked: int, total: int) -> None:
        now = time.monotonic()
        if total >= self._min_records and (now - self._last >= self._every_s or checked == total):
            self._last = now
            print(f"verify: {checked}/{total} records checked", file=self._out, flush=True)


def _client_command(name: str, args: Sequence[str]) -> int:
    # `demo` trains and `replay` draws with torch, which the server package never imports
    # (the coordinator image has none): they live beside the client (rngcoord.demo, and
    # rngcoord.client._replay), and run in a process of their own.
    missing = [
        module
        for module in ("torch", "rngcoord.client")
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        print(
            f"rngcoord {name}: error: it needs the client extra ({', '.join(missing)} not "
            "installed): pip install 'rngcoord[client]', or run `make demo` in a source checkout",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    module = "rngcoord.demo" if name == "demo" else "rngcoord.client._replay"
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, check=False).returncode


def _add_db(parser: argparse.ArgumentParser, env: os._Environ[str]) -> None:
    parser.add_argument(
        "--db",
        default=env.get("RNGCOORD_DB", DEFAULT_DB),
        metavar="URL",
        help=f"store URL, sqlite:///PATH or postgresql://USER@HOST/DB (env RNGCOORD_DB; "
        f"default {DEFAULT_DB})",
    )


if __name__ == "__main__":
    sys.exit(main())
