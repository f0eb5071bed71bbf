"""Assembles and runs a coordinator server process.

`start_server` builds everything and returns a running `RunningServer`: the store, the
Coordinator, a gRPC server on a 64-thread pool carrying the Coordinator servicer (behind the
bearer-token interceptor when tokens are given), the grpc.health.v1 health service and server
reflection, optional TLS/mTLS, and the Prometheus HTTP endpoint. It touches no signal, so it
also embeds in another program or a test.

`serve` is what `rngcoord serve` runs: it starts the server, writes the ready file, waits for
SIGTERM or SIGINT, then drains (health NOT_SERVING, in-flight RPCs get `grace_s` to finish),
closes the store and returns exit status 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import HTTPServer
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rngcoord.server.auth import TokenAuthInterceptor, load_tokens
from rngcoord.server.coordinator import Coordinator
from rngcoord.server.logs import configure, event, get_logger
from rngcoord.server.metrics import Metrics
from rngcoord.server.service import CoordinatorServicer
from rngcoord.server.store import Store
from rngcoord.server.stores import open_store
from rngcoord.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
WORKERS = 64

_log = get_logger("app")


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


class RunningServer:
    """A started coordinator server; `stop()` drains it and releases everything it holds.

    Attributes:
        address: the gRPC address actually bound, "HOST:PORT".
        metrics_address: the Prometheus endpoint actually bound, or None when it is off.
    """

    def __init__(
        self,
        grpc_server: grpc.Server,
        health_servicer: health.HealthServicer,
        store: Store,
        metrics_http: HTTPServer | None,
        address: str,
    ) -> None:
        self._grpc = grpc_server
        self._health = health_servicer
        self._store = store
        self._metrics_http = metrics_http
        self.address = address
        self.metrics_address = None
        if metrics_http is not None:
            metrics_host, metrics_port = metrics_http.server_address[:2]
            self.metrics_address = _join_host_port(str(metrics_host), metrics_port)

    def stop(self, grace_s: float = 10.0) -> None:
        """Report NOT_SERVING, give in-flight RPCs `grace_s` seconds, then close the store."""
        self._health.enter_graceful_shutdown()
        self._grpc.stop(grace_s).wait()
        self._store.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()


def start_server(
    listen: str,
    db_url: str,
    *,
    metrics_listen: str | None = None,
    tokens: Path | None = None,
    tls: TLSConfig | None = None,
    join_timeout_s: float = 60.0,
) -> RunningServer:
    """Open the store and start serving on `listen` ("HOST:PORT"; port 0 picks a free one).

    Args:
        listen: the gRPC listen address.
        db_url: the store, `sqlite:///PATH` or `postgresql://...`.
        metrics_listen: the Prometheus HTTP address. Default None: no metrics endpoint.
        tokens: a token file (see rngcoord.server.auth). Default None: no authentication,
            which is logged as a warning.
        tls: TLS settings. Default None: plaintext.
        join_timeout_s: how long a JoinGroup waits when the request gives no timeout.
            Default 60.
    """
    host, _ = split_host_port(listen)
    metrics = Metrics()
    interceptors: list[grpc.ServerInterceptor[Any, Any]] = []
    if tokens is not None:
        table = load_tokens(tokens)
        interceptors.append(
            TokenAuthInterceptor(
                table, on_reject=lambda: metrics.error(grpc.StatusCode.UNAUTHENTICATED)
            )
        )
    else:
        event(_log, logging.WARNING, "auth_disabled", hint="pass --tokens or set RNGCOORD_TOKENS")
    credentials = tls.credentials() if tls is not None else None

    store = open_store(db_url)
    try:
        server = grpc.server(
            ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rpc"),
            interceptors=interceptors,
            # Without this, a second server could bind the same port and silently share it.
            options=[("grpc.so_reuseport", 0)],
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(Coordinator(store, join_timeout_s=join_timeout_s), metrics),
            server,
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = _bind(server, listen, credentials)
        metrics_http = None
        if metrics_listen is not None:
            metrics_http = metrics.serve_http(*split_host_port(metrics_listen))
    except BaseException:
        store.close()
        raise
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningServer(
        server, health_servicer, store, metrics_http, _join_host_port(host, port)
    )
    event(
        _log,
        logging.INFO,
        "serving",
        address=running.address,
        db=redact_url(db_url),
        metrics=running.metrics_address or "off",
        auth="tokens" if tokens is not None else "off",
        tls="off" if tls is None else ("mtls" if tls.client_ca is not None else "tls"),
        workers=WORKERS,
    )
    return running


def serve(
    listen: str,
    db_url: str,
    *,
    metrics_listen: str | None = None,
    tokens: Path | None = None,
    tls: TLSConfig | None = None,
    ready_file: Path | None = None,
    grace_s: float = 10.0,
    join_timeout_s: float = 60.0,
    log_level: int | str = logging.INFO,
) -> int:
    """Run a server until SIGTERM or SIGINT, then drain it; returns the exit status (0).

    Args:
        listen, db_url, metrics_listen, tokens, tls, join_timeout_s: as for `start_server`.
        ready_file: once serving, the bound "HOST:PORT" is written here (atomically, so a
            reader never sees half of it). Default None: no file.
        grace_s: how long in-flight RPCs may run on after the signal. Default 10.
        log_level: the lowest level logged to stderr. Default INFO.

    Must run on the main thread (it installs signal handlers). A second signal during the
    drain ends the process at once.
    """
    configure(log_level)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)
        stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    running = start_server(
        listen,
        db_url,
        metrics_listen=metrics_listen,
        tokens=tokens,
        tls=tls,
        join_timeout_s=join_timeout_s,
    )
    if ready_file is not None:
        _write_atomically(ready_file, running.address)
    stopping.wait()
    event(_log, logging.INFO, "draining", grace_s=grace_s)
    running.stop(grace_s)
    event(_log, logging.INFO, "stopped")
    return 0


def redact_url(url: str) -> str:
    """`url` with any password (in the authority or a `password=` query) replaced by "***"."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and all(k != "password" for k, _ in query):
        return url
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    shown = "&".join(f"{k}={'***' if k == 'password' else v}" for k, v in query)
    return urlunsplit(parts._replace(netloc=netloc, query=shown))


def _bind(server: grpc.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
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


def split_host_port(address: str) -> tuple[str, int]:
    """Split "HOST:PORT" (IPv6 hosts in brackets) into (host, port).

    Raises ValueError naming the address when it is malformed.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
