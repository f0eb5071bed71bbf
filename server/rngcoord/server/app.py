"""Assembles and runs one coordinator server process on an asyncio event loop.

`run_server` builds everything and serves until told to stop: the store, the Coordinator, a
`grpc.aio` server carrying the Coordinator servicer (behind the bearer-token interceptor when
tokens are given), the grpc.health.v1 health service and server reflection, optional
TLS/mTLS, and the Prometheus HTTP endpoint. No RPC holds a thread: handlers are coroutines,
the store's writes go to its group-commit writer thread and its reads to a few reader
threads.

`start_server` runs one in a background thread of its own, for embedding in another program
or a test. `serve` is what `rngcoord serve` runs: one process (`workers=1`), or a supervisor
of several worker processes that share the port (rngcoord.server.workers). It writes the ready
file, waits for SIGTERM or SIGINT, then drains (health NOT_SERVING, in-flight RPCs get
`grace_s` to finish), closes the store and returns exit status 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from http.server import HTTPServer
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rngcoord.server.addresses import join_host_port, redact_url, split_host_port
from rngcoord.server.auth import TokenAuthInterceptor, load_tokens
from rngcoord.server.coordinator import Coordinator
from rngcoord.server.logs import configure, event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.server.service import CoordinatorServicer
from rngcoord.server.stores import open_store
from rngcoord.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = ["RunningServer", "ServerOptions", "TLSConfig", "run_server", "serve", "start_server"]

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name

_log = get_logger("app")

_MAX_PENDING_CALLS = 1 << 20
_MAX_QUEUED_S = 600


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS. With `client_ca`, clients must present a certificate it signed (mTLS).

    Args:
        cert: PEM certificate chain of the server.
        key: PEM private key of the server.
        client_ca: PEM CA bundle that client certificates must chain to. Default None: no
            client certificates are asked for.
    """

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """The gRPC server credentials; raises OSError naming a file that cannot be read."""
        client_ca = self.client_ca.read_bytes() if self.client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True)
class ServerOptions:
    """What one coordinator server process serves, and how.

    Args:
        listen: the gRPC listen address, "HOST:PORT"; port 0 picks a free one.
        db_url: the store, `sqlite:///PATH` or `postgresql://...`.
        metrics_listen: the Prometheus HTTP address. Default None: no metrics endpoint.
        tokens: a token file (see rngcoord.server.auth). Default None: no authentication,
            which is logged as a warning.
        tls: TLS settings. Default None: plaintext.
        join_timeout_s: how long a JoinGroup waits when the request gives no timeout.
            Default 60.
        max_join_timeout_s: the most any JoinGroup waits. Default 1800.
        staleness_s: how stale the change feed may be for a hit from memory. Default 0.5.
        max_streams: most concurrent calls on one client connection. Default 65536.
        reuse_port: bind with SO_REUSEPORT, so that the workers of one `rngcoord serve`
            share the port. Default False: a second server cannot silently share it.
        worker: this process's index among the workers, for logs. Default 0.
    """

    listen: str
    db_url: str
    metrics_listen: str | None = None
    tokens: Path | None = None
    tls: TLSConfig | None = None
    join_timeout_s: float = 60.0
    max_join_timeout_s: float = 1800.0
    staleness_s: float = 0.5
    max_streams: int = 65536
    reuse_port: bool = False
    worker: int = 0


async def run_server(
    options: ServerOptions,
    stop: asyncio.Event,
    *,
    started: Callable[[str, str | None], None] | None = None,
    grace_s: float = 10.0,
    metrics: Metrics | None = None,
) -> None:
    """Serve `options` on the running loop until `stop` is set, then drain and close.

    Args:
        options: what to serve.
        stop: set it to begin the drain.
        started: called with the bound gRPC address and the metrics address (or None) once
            serving. Default None.
        grace_s: how long in-flight RPCs may finish after `stop`. Default 10.
        metrics: where outcomes are counted. Default: a fresh `Metrics`.

    Raises:
        OSError: an address cannot be bound or a TLS file cannot be read.
        ValueError: a malformed address or token file.
    """
    host, _ = split_host_port(options.listen)
    metrics = metrics if metrics is not None else Metrics()
    interceptors: list[Any] = []
    if options.tokens is not None:
        table = load_tokens(options.tokens)
        interceptors.append(
            TokenAuthInterceptor(
                table, on_reject=lambda: metrics.error(grpc.StatusCode.UNAUTHENTICATED)
            )
        )
    elif options.worker == 0:
        event(_log, logging.WARNING, "auth_disabled", hint="pass --tokens or set RNGCOORD_TOKENS")
    credentials = options.tls.credentials() if options.tls is not None else None

    loop = asyncio.get_running_loop()
    store = await loop.run_in_executor(None, open_store, options.db_url)
    coordinator = Coordinator(
        store,
        join_timeout_s=options.join_timeout_s,
        max_join_timeout_s=options.max_join_timeout_s,
        staleness_s=options.staleness_s,
    )
    server: grpc.aio.Server | None = None
    metrics_http: HTTPServer | None = None
    try:
        await coordinator.start()
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 1 if options.reuse_port else 0),
                # A waiting JoinGroup keeps its stream open; a process whose many ranks share
                # one connection must not be held at HTTP/2's default of 100 streams, or the
                # ranks a barrier waits for never reach it.
                ("grpc.max_concurrent_streams", options.max_streams),
                # gRPC core sheds calls that wait to be picked up by the application once more
                # than 1,000 (at random) or 3,000 (all) are queued, and cancels any queued for
                # 30 s: a join storm of 10^5 ranks arrives as exactly such a burst, and its
                # shed joins would come back CANCELLED. The event loop picks calls up as fast
                # as it can; the barrier itself bounds what each costs.
                ("grpc.server.max_pending_requests", _MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", _MAX_PENDING_CALLS),
                ("grpc.server_max_unrequested_time_in_server", _MAX_QUEUED_S),
            ],
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(coordinator, metrics), server
        )
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = _bind(server, options.listen, credentials)
        if options.metrics_listen is not None:
            metrics_http = metrics.serve_http(*split_host_port(options.metrics_listen))
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        address = join_host_port(host, port)
        metrics_address = None
        if metrics_http is not None:
            metrics_host, metrics_port = metrics_http.server_address[:2]
            metrics_address = join_host_port(str(metrics_host), metrics_port)
        event(
            _log,
            logging.INFO,
            "serving",
            address=address,
            db=redact_url(options.db_url),
            metrics=metrics_address or "off",
            auth="tokens" if options.tokens is not None else "off",
            tls="off"
            if options.tls is None
            else ("mtls" if options.tls.client_ca is not None else "tls"),
            worker=options.worker,
            pid=os.getpid(),
        )
        if started is not None:
            started(address, metrics_address)
        await stop.wait()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
    finally:
        if server is not None:
            await server.stop(None)
        await coordinator.close()
        await loop.run_in_executor(None, store.close)
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()


class RunningServer:
    """A coordinator served by `run_server` in a background thread; `stop()` drains it.

    Attributes:
        address: the gRPC address actually bound, "HOST:PORT".
        metrics_address: the Prometheus endpoint actually bound, or None when it is off.
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
    workers: int = 1,
    ready_file: Path | None = None,
    grace_s: float = 10.0,
    log_level: int | str = logging.INFO,
) -> int:
    """Run until SIGTERM or SIGINT, then drain; returns the exit status (0).

    Args:
        options: what to serve.
        workers: processes serving the port, each with its own event loop (one core each).
            Default 1: this process serves.
        ready_file: once serving, the bound "HOST:PORT" is written here (atomically, so a
            reader never sees half of it). Default None: no file.
        grace_s: how long in-flight RPCs may run on after the signal. Default 10.
        log_level: the lowest level logged to stderr. Default INFO.

    Must run on the main thread (it installs signal handlers). A second signal during the
    drain ends the process at once.
    """
    configure(log_level)
    if workers > 1:
        from rngcoord.server.workers import supervise

        return supervise(options, workers, ready_file=ready_file, grace_s=grace_s)
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

    def started(address: str, _metrics: str | None) -> None:
        if ready_file is not None:
            write_atomically(ready_file, address)

    await run_server(options, stop, started=started, grace_s=grace_s)
    event(_log, logging.INFO, "stopped")
    return 0


def with_port(options: ServerOptions, port: int) -> ServerOptions:
    """`options` listening on `port` of the same host."""
    host, _ = split_host_port(options.listen)
    return replace(options, listen=join_host_port(host, port))


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
