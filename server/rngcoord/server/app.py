"""Assembles and runs one coordinator server process on an asyncio event loop.

`run_server` builds everything and serves until told to stop: the store (created only with
`init`; see `open_for_serving`), the audit chain (keyed with the audit key), the Coordinator,
a `grpc.aio` server carrying the Coordinator servicer behind the gate (rate limit, decoding,
tokens and roles: rngcoord.server.rpc.gate), the grpc.health.v1 health service (NOT_SERVING while
the store is lost or failing) and server reflection, optional TLS/mTLS, the HTTP side on the
same event loop (status page, JSON API and Prometheus /metrics: rngcoord.server.web.status), and
the anchor writer (the chain's head, signed, to an append-only file and the
log). No RPC holds a thread: handlers are coroutines, the store's writes go to its
group-commit writer thread and its reads to a few reader threads.

Limits (each refusal names itself): connections per process (`max_connections`, below the
file-descriptor limit, which is raised to its hard maximum), a handshake timeout for
connections that never speak HTTP/2, an idle timeout, keepalive pings, requests of at most
1 MiB, concurrent streams per connection, a per-peer-host call rate, and the JoinGroup and
Restore wait caps.

`start_server` runs one in a background thread of its own, for embedding in another program
or a test. `serve` is what `rngcoord serve` runs in one process; several worker processes that
share the port are rngcoord.server.workers.serve_workers. It writes the ready
file, reloads the token file on SIGHUP, waits for SIGTERM or SIGINT, then drains (health
NOT_SERVING, in-flight RPCs get `grace_s` to finish), closes the store and returns exit
status 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rngcoord.server.addresses import join_host_port, redact_url, split_host_port
from rngcoord.server.audit import anchors
from rngcoord.server.audit.chain import Chain, load_key, open_chain
from rngcoord.server.auth import TokenTable, load_tokens
from rngcoord.server.core.coordinator import Coordinator
from rngcoord.server.core.floors import apply_floors, read_floors
from rngcoord.server.logs import configure, event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.server.options import ServerOptions, TLSConfig
from rngcoord.server.rpc.connections import ConnectionGuard
from rngcoord.server.rpc.gate import Gate, PeerActivity, PeerRateLimit, RefusalLog, StreamCaps
from rngcoord.server.rpc.service import CoordinatorServicer
from rngcoord.server.storage.store import Store, StoreNotFound
from rngcoord.server.storage.stores import open_store
from rngcoord.server.web.status import StatusServer
from rngcoord.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = [
    "RunningServer",
    "ServerFailed",
    "ServerOptions",
    "TLSConfig",
    "run_server",
    "serve",
    "start_server",
]

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name

_log = get_logger("app")

_MAX_PENDING_CALLS = 1 << 20
_MAX_QUEUED_S = 600
_MAX_REQUEST_BYTES = 1 << 20
_FDS_KEPT = 256
"""File descriptors kept back from the connection cap: the store, its WAL, reader
connections, log files and the metrics endpoint must always find one."""
_HEALTH_POLL_S = 0.25
_ANCHOR_EVERY_S = 1.0
# EX_SOFTWARE: the process could not go on serving, and should be started again.
_EXIT_FAILED = 70


def open_for_serving(options: ServerOptions) -> tuple[Store, Chain]:
    """Open the store and its audit chain as `options` say: create the store only with `init`
    (writing a fresh audit key when its file is missing), record the floors of `floor_from`,
    and key the chain.

    Raises:
        StoreNotFound: no store, and no `init`.
        StoreRolledBack: the store's chain lacks what its anchor file last anchored.
        OSError, ValueError: an unreadable or malformed key or floor file, the wrong key, or
            keying state that disagrees with the chain.
    """
    key = None
    if options.audit_key is not None:
        key = load_key(str(options.audit_key), create=options.init)
    floors: dict[tuple[str, str], int] = {}
    for path in options.floor_from:
        for where, floor in read_floors(path).items():
            floors[where] = max(floor, floors.get(where, 0))
    store = open_store(
        options.db_url,
        create=options.init,
        require_sync_replication=options.require_sync_replication,
    )
    try:
        now_us = time.time_ns() // 1000
        actor = f"rngcoord serve pid {os.getpid()}"
        try:
            chain = open_chain(store, key, now_us=now_us, actor=actor, init=options.init)
            anchors.check_store(
                store,
                chain,
                _anchors_at_start(options),
                init=options.init,
                given=anchors.read_anchor_files(list(options.anchors), missing_ok=False),
            )
        except Exception as exc:
            if not store.is_unavailable(exc):
                raise
            raise StoreNotFound(
                f"the store at {store.location} cannot be read ({exc}): its tables are damaged "
                "or gone. Restore it from a backup, or recover on a new store with "
                "`rngcoord serve --init --floor-from AUDIT_EXPORT`"
            ) from exc
        if floors:
            apply_floors(store, chain, floors, now_us=now_us, actor=actor)
    except BaseException:
        store.close()
        raise
    return store, chain


def anchor_file(options: ServerOptions) -> Path | None:
    """Where this server anchors its chain: `--anchor-file`, else beside an SQLite store."""
    if options.anchor_file is not None:
        return options.anchor_file
    return anchors.default_anchor_file(options.db_url)


# The newest anchors are at the end of the file; 1 MiB holds thousands of them.
_ANCHOR_TAIL_BYTES = 1 << 20


def _anchors_at_start(options: ServerOptions) -> list[dict[str, Any]]:
    path = anchor_file(options)
    if path is None:
        return []
    return anchors.read_anchor_files([path], missing_ok=True, tail_bytes=_ANCHOR_TAIL_BYTES)


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard maximum; return the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def connection_caps(options: ServerOptions, fd_limit: int) -> tuple[int, int]:
    """(connections per process, connections per peer host) under `options`."""
    max_connections = options.max_connections
    if max_connections is None:
        max_connections = max(16, fd_limit - _FDS_KEPT)
    per_host = options.max_connections_per_host
    if per_host is None:
        per_host = max(1, max_connections // 4)
    return max_connections, min(per_host, max_connections)


def grpc_options(options: ServerOptions, fd_limit: int) -> list[tuple[str, int]]:
    """The gRPC core settings that bound what one client, or many, can take from a process."""
    max_connections, _ = connection_caps(options, fd_limit)
    return [
        ("grpc.so_reuseport", 1 if options.reuse_port else 0),
        # A waiting JoinGroup keeps its stream open; a process whose many ranks share one
        # connection must not be held at HTTP/2's default of 100 streams, or the ranks a
        # barrier waits for never reach it.
        ("grpc.max_concurrent_streams", options.max_streams),
        # gRPC core sheds calls that wait to be picked up by the application once more than
        # 1,000 (at random) or 3,000 (all) are queued, and cancels any queued for 30 s: a join
        # storm of 10^5 ranks arrives as exactly such a burst, and its shed joins would come
        # back CANCELLED. The event loop picks calls up as fast as it can; the barrier itself
        # bounds what each costs.
        ("grpc.server.max_pending_requests", _MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", _MAX_PENDING_CALLS),
        ("grpc.server_max_unrequested_time_in_server", _MAX_QUEUED_S),
        # Connections past the cap are closed at accept, so idle sockets can never take the
        # file descriptors that the store and the accepted clients need; one that never
        # completes its HTTP/2 handshake is dropped after the handshake timeout. gRPC closes
        # them whoever they come from: the connection guard (rngcoord.server.rpc.connections)
        # keeps one host from taking every place, and keeps places free below the cap.
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", round(options.handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", round(options.idle_timeout_s * 1000)),
        ("grpc.keepalive_time_ms", round(options.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 20_000),
        # Clients' keepalive pings are welcome, at most one per 10 s.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_receive_message_length", _MAX_REQUEST_BYTES),
    ]


async def run_server(
    options: ServerOptions,
    stop: asyncio.Event,
    *,
    started: Callable[[str, str | None], None] | None = None,
    grace_s: float = 10.0,
    metrics: Metrics | None = None,
    reload: asyncio.Event | None = None,
    token_loader: Callable[[Path], TokenTable] = load_tokens,
) -> None:
    """Serve `options` on the running loop until `stop` is set, then drain and close.

    Args:
        options: what to serve.
        stop: set it to begin the drain.
        started: called with the bound gRPC address and the metrics address (or None) once
            serving. Default None.
        grace_s: how long in-flight RPCs may finish after `stop`. Default 10.
        metrics: where outcomes are counted. Default: a fresh `Metrics`.
        reload: set it to read the token file again (SIGHUP); a file that no longer parses
            is logged and the tokens in use stay. Default None.
        token_loader: reads `options.tokens`, at start and on each reload. Default
            `load_tokens`; the workers of `rngcoord serve --workers N` use the table their
            supervisor read instead (rngcoord.server.workers).

    Raises:
        StoreNotFound: no store at `options.db_url`, and `options.init` is False.
        OSError: an address cannot be bound, or a TLS, key or token file cannot be read.
        ValueError: a malformed address, token, key or floor file.
    """
    host, _ = split_host_port(options.listen)
    metrics = metrics if metrics is not None else Metrics()
    tokens = token_loader(options.tokens) if options.tokens is not None else None
    if tokens is None and options.worker == 0:
        event(_log, logging.WARNING, "auth_disabled", hint="pass --tokens or set RNGCOORD_TOKENS")
    if options.audit_key is None and options.worker == 0:
        event(
            _log,
            logging.WARNING,
            "audit_chain_unkeyed",
            hint="pass --audit-key or set RNGCOORD_AUDIT_KEY: without it, whoever can write "
            "the database can rewrite the chain and rehash it",
        )
    activity = PeerActivity()
    refusals = RefusalLog()
    gate = Gate(
        tokens=tokens,
        rate_limit=PeerRateLimit(options.peer_rate, options.peer_burst)
        if options.peer_rate > 0
        else None,
        on_refuse=metrics.error,
        activity=activity,
    )
    credentials = options.tls.credentials() if options.tls is not None else None
    fd_limit = raise_fd_limit()

    loop = asyncio.get_running_loop()
    store, chain = await loop.run_in_executor(None, open_for_serving, options)
    if store.dialect == "postgresql":
        metrics.follow_replication(lambda: store.replication)
    coordinator = Coordinator(
        store,
        # One process logs the group events that every process follows: worker 0.
        log_changes=options.worker == 0,
        join_timeout_s=options.join_timeout_s,
        max_join_timeout_s=options.max_join_timeout_s,
        staleness_s=options.staleness_s,
        chain=chain,
    )
    server: grpc.aio.Server | None = None
    status_http: StatusServer | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        await coordinator.start()
        server = grpc.aio.server(interceptors=[gate], options=grpc_options(options, fd_limit))
        servicer = CoordinatorServicer(
            coordinator,
            metrics,
            audit_streams=StreamCaps(
                options.max_audit_streams_per_host, options.max_audit_streams, refusals=refusals
            ),
            audit_stall_s=options.audit_stall_s,
            sessions=StreamCaps(
                options.max_sessions_per_host,
                options.max_sessions,
                refusals=refusals,
                method="Session",
            ),
            admit=gate.admit,
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = _bind(server, options.listen, credentials)
        metrics_address = None
        if options.metrics_listen is not None:
            status_http = StatusServer(
                coordinator,
                metrics.registry,
                tokens,
                open_access=options.status_open,
                tls=options.tls,
            )
            metrics_address = await status_http.start(*split_host_port(options.metrics_listen))
            if status_http.is_open and options.worker == 0:
                event(
                    _log,
                    logging.WARNING,
                    "status_page_open",
                    address=metrics_address,
                    reason="--status-open" if options.status_open else "no token file",
                )
        await server.start()
        await _set_health(health_servicer, True)
        failed: list[str] = []
        tasks.append(loop.create_task(_keep_health(coordinator, health_servicer, stop, failed)))
        max_connections, per_host = connection_caps(options, fd_limit)
        guard = ConnectionGuard(
            port,
            max_connections=max_connections,
            per_host=per_host,
            crowded_idle_s=options.crowded_idle_timeout_s,
            activity=activity,
            refusals=refusals,
        )
        tasks.append(loop.create_task(guard.run()))
        if options.worker == 0:  # one writer of anchors, which sees every worker's head
            last = anchors.last_anchored_id(_anchors_at_start(options), store.store_id)
            tasks.append(loop.create_task(_write_anchors(coordinator, anchor_file(options), last)))
        if reload is not None:
            tasks.append(
                loop.create_task(
                    _reload_tokens(reload, options.tokens, gate, status_http, token_loader)
                )
            )
        address = join_host_port(host, port)
        event(
            _log,
            logging.INFO,
            "serving",
            address=address,
            db=redact_url(options.db_url),
            store_id=store.store_id,
            audit_key=chain.key is not None,
            # A worker of `--workers N` leaves the HTTP side to its supervisor, whose
            # `workers_serving` line names it.
            metrics=metrics_address or ("supervisor" if options.reuse_port else "off"),
            auth="tokens" if tokens is not None else "off",
            tls="off"
            if options.tls is None
            else ("mtls" if options.tls.client_ca is not None else "tls"),
            worker=options.worker,
            pid=os.getpid(),
            fd_limit=fd_limit,
            max_connections=max_connections,
            max_connections_per_host=per_host,
        )
        if started is not None:
            started(address, metrics_address)
        await stop.wait()
        for task in tasks:
            task.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
        if failed:
            raise ServerFailed(failed[0])
    finally:
        for task in tasks:
            task.cancel()
        if server is not None:
            await server.stop(None)
        await coordinator.close()
        if status_http is not None:
            await status_http.stop()
        await loop.run_in_executor(None, store.close)


async def _set_health(servicer: Any, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


class ServerFailed(RuntimeError):
    """The server stopped because it could no longer serve (its store's writer died); the
    process exits non-zero so that its supervisor or container runtime starts a fresh one."""


async def _keep_health(
    coordinator: Coordinator, servicer: Any, stop: asyncio.Event, failed: list[str]
) -> None:
    """Report NOT_SERVING while the store is lost, its writes fail or stall, SERVING
    otherwise; on a fatal problem, report NOT_SERVING, record it in `failed` and stop."""
    serving = True
    while True:
        await asyncio.sleep(_HEALTH_POLL_S)
        fatal = coordinator.fatal
        if fatal is not None:
            await _set_health(servicer, False)
            event(_log, logging.CRITICAL, "exiting", reason=fatal)
            failed.append(fatal)
            stop.set()
            return
        problem = coordinator.health_problem
        if serving != (problem is None):
            serving = problem is None
            await _set_health(servicer, serving)
            if problem is not None:
                event(_log, logging.ERROR, "not_serving", reason=problem)
            else:
                event(_log, logging.INFO, "serving_again")


async def _write_anchors(coordinator: Coordinator, path: Path | None, written: int) -> None:
    """Each second the head moved past `written`, write it signed: a JSON line appended to
    `path` and a log event `audit_anchor`."""
    while True:
        await asyncio.sleep(_ANCHOR_EVERY_S)
        record_id, record_hash = coordinator.head
        if record_id <= written:
            continue
        written = record_id
        anchor: dict[str, Any] = {
            "store_id": coordinator.chain.store_id,
            "id": record_id,
            "hash": record_hash,
            "mac": coordinator.chain.anchor_mac(record_id, record_hash),
        }
        event(_log, logging.INFO, "audit_anchor", **anchor)
        if path is not None:
            line = {"ts_us": time.time_ns() // 1000, **anchor}
            await asyncio.get_running_loop().run_in_executor(
                None, anchors.append_anchor, path, line
            )


async def _reload_tokens(
    reload: asyncio.Event,
    path: Path | None,
    gate: Gate,
    status_http: StatusServer | None,
    token_loader: Callable[[Path], TokenTable] = load_tokens,
) -> None:
    while True:
        await reload.wait()
        reload.clear()
        if path is None:
            event(_log, logging.INFO, "tokens_not_reloaded", reason="no token file (--tokens)")
            continue
        try:
            table: TokenTable = token_loader(path)
        except (OSError, ValueError) as exc:
            event(_log, logging.ERROR, "tokens_reload_failed", error=str(exc), kept="previous")
            continue
        gate.reload(table)
        if status_http is not None:
            status_http.reload(table)
        event(_log, logging.INFO, "tokens_reloaded", tokens=len(table), file=str(path))


class RunningServer:
    """A coordinator served by `run_server` in a background thread; `stop()` drains it.

    Attributes:
        address: the gRPC address actually bound, "HOST:PORT".
        metrics_address: the HTTP side (status page, /metrics) actually bound, or None when
            it is off.
    """

    def __init__(self, options: ServerOptions, metrics: Metrics | None = None) -> None:
        self._options = options
        self._metrics = metrics
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self.metrics_address: str | None = None
        self._grace_s = 10.0
        self._thread = threading.Thread(target=self._run, name="rngcoord-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _run(self) -> None:
        def started(address: str, metrics_address: str | None) -> None:
            self.address, self.metrics_address = address, metrics_address
            self._ready.set()

        async def main() -> None:
            await run_server(
                self._options,
                self._stop,
                started=started,
                grace_s=self._grace_s,
                metrics=self._metrics,
            )

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # reported by the constructor, or by stop()
            self._error = exc
        finally:
            self._ready.set()
            self._loop.close()

    def stop(self, grace_s: float = 10.0) -> None:
        """Report NOT_SERVING, give in-flight RPCs `grace_s` seconds, then close the store."""
        self._grace_s = grace_s
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()


def start_server(listen: str, db_url: str, **options: Any) -> RunningServer:
    """Start a coordinator in a background thread of this process; see `ServerOptions` for
    the keyword arguments. Returns once it serves."""
    return RunningServer(ServerOptions(listen, db_url, **options))


def serve(
    options: ServerOptions,
    *,
    ready_file: Path | None = None,
    grace_s: float = 10.0,
    log_level: int | str = logging.INFO,
) -> int:
    """Serve from this process until SIGTERM or SIGINT, then drain; returns the exit status
    (0). Several processes on one port: rngcoord.server.workers.serve_workers.

    Args:
        options: what to serve.
        ready_file: once serving, the bound "HOST:PORT" is written here (atomically, so a
            reader never sees half of it). Default None: no file.
        grace_s: how long in-flight RPCs may run on after the signal. Default 10.
        log_level: the lowest level logged to stderr. Default INFO.

    Must run on the main thread (it installs signal handlers). A second SIGTERM or SIGINT
    during the drain ends the process at once; SIGHUP reloads the token file.
    """
    configure(log_level)
    return asyncio.run(_serve_here(options, ready_file, grace_s))


async def _serve_here(options: ServerOptions, ready_file: Path | None, grace_s: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            os._exit(128 + signum)  # a second signal: stop draining at once
        event(_log, logging.INFO, "draining", grace_s=grace_s, signal=signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    reload = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, reload.set)
    # `rngcoord serve` blocked SIGHUP first thing; one held since then is a reload now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})

    def started(address: str, _metrics: str | None) -> None:
        if ready_file is not None:
            write_atomically(ready_file, address)

    try:
        await run_server(options, stop, started=started, grace_s=grace_s, reload=reload)
    except ServerFailed:
        return _EXIT_FAILED
    event(_log, logging.INFO, "stopped")
    return 0


def _bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is in use or not local")
    return port


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
