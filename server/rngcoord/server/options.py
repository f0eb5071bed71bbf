"""What one coordinator server process serves, and how: `ServerOptions`, which `rngcoord
serve` builds from its flags and environment, and `TLSConfig`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from rngcoord.server.addresses import join_host_port, split_host_port

__all__ = ["ServerOptions", "TLSConfig", "with_port"]


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
        metrics_listen: the HTTP address of the status page, its API and Prometheus
            /metrics. Default None: no HTTP side.
        tokens: a token file (see rngcoord.server.auth). Default None: no authentication,
            which is logged as a warning.
        tls: TLS settings. Default None: plaintext.
        join_timeout_s: how long a JoinGroup waits when the request gives no timeout.
            Default 60.
        max_join_timeout_s: the most any JoinGroup waits. Default 1800.
        staleness_s: how stale the change feed may be for a hit from memory. Default 0.5.
        max_streams: most concurrent calls on one client connection. Default 65536.
        init: create the store when there is none. Default False: a missing store is an
            error (`StoreNotFound`), so that no stream silently starts over at offset 0.
        audit_key: file holding the audit chain's HMAC key (created with `init` when
            missing). Default None: the chain is unkeyed, which is logged as a warning.
        anchor_file: append-only file that receives the signed head of the audit chain
            whenever it moved (at most once a second), and whose newest anchors the server
            checks its store against at start. Default None: `PATH.anchors.jsonl` beside an
            SQLite store; the log only for PostgreSQL.
        anchors: more anchors to check the store against at start (`serve --anchor`):
            another server's anchor file or log, or audit heads kept in checkpoints.
            Default ().
        floor_from: audit exports (`rngcoord audit --json`) or `JOB GROUP OFFSET` files whose
            offsets new groups must start above (recovery after losing a store). Default ().
        require_sync_replication: refuse a PostgreSQL primary that does not replicate
            synchronously, at start and on every reconnect of the store's writer
            (`--require-sync-replication`; rngcoord.server.replication). Default False: the
            mode is logged, as a warning when acknowledged grants would not survive a
            failover.
        max_connections: most client connections this process holds. Default None: the
            file-descriptor limit (raised to its hard maximum) less 256.
        handshake_timeout_s: how long a new connection may take to start HTTP/2. Default 10.
        idle_timeout_s: a connection with no call for this long is closed (clients reconnect
            by themselves). Default 600.
        keepalive_s: how often the server pings a connection to find dead peers. Default 60.
        peer_rate: calls per second each peer host may sustain; 0 for no limit. Default 5000.
        peer_burst: calls a peer host may make at once. Default 20000.
        reuse_port: bind with SO_REUSEPORT, so that the workers of one `rngcoord serve`
            share the port. Default False: a second server cannot silently share it.
        worker: this process's index among the workers, for logs. Default 0.
        status_open: serve the status page and its API without a token even when there is
            a token file (`--status-open`). Default False: they need an auditor or admin
            token (and are open only when there is no token file at all).
        max_connections_per_host: most client connections of one peer host; the guard
            (rngcoord.server.rpc.connections) closes the newest past it. Default None: a quarter
            of `max_connections`.
        crowded_idle_timeout_s: while the process holds more than half its connection cap,
            a connection with no call for this long is closed. Default 10.
        max_audit_streams_per_host: most ListAudit streams one peer host may hold open.
            Default 16.
        max_audit_streams: most ListAudit streams the process holds open. Default 256.
        audit_stall_s: a ListAudit stream whose client takes no record for this long is
            ended. Default 60.
        max_sessions_per_host: most Session streams one peer host may hold open (a client
            process holds one per coordinator target). Default 128.
        max_sessions: most Session streams the process holds open. Default 16384.
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
    init: bool = False
    audit_key: Path | None = None
    anchor_file: Path | None = None
    anchors: tuple[Path, ...] = ()
    floor_from: tuple[Path, ...] = ()
    require_sync_replication: bool = False
    max_connections: int | None = None
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0
    keepalive_s: float = 60.0
    peer_rate: float = 5000.0
    peer_burst: float = 20000.0
    reuse_port: bool = False
    worker: int = 0
    status_open: bool = False
    max_connections_per_host: int | None = None
    crowded_idle_timeout_s: float = 10.0
    max_audit_streams_per_host: int = 16
    max_audit_streams: int = 256
    audit_stall_s: float = 60.0
    max_sessions_per_host: int = 128
    max_sessions: int = 16384


def with_port(options: ServerOptions, port: int) -> ServerOptions:
    """`options` listening on `port` of the same host."""
    host, _ = split_host_port(options.listen)
    return replace(options, listen=join_host_port(host, port))
