"""Prometheus metrics of one coordinator server.

Each `Metrics` owns its own registry, so several servers in one process (tests, embedding)
never collide. The servicer counts; the Coordinator itself knows nothing of Prometheus. The
registry is exposed at /metrics by the server's HTTP side (rngcoord.server.web.status).

Exposed series:
- `rngcoord_grants_total`: leases granted by a durable write.
- `rngcoord_hits_total`: Reserve calls answered from an existing lease (no write).
- `rngcoord_divergences_total`: Reserve calls refused because ranks disagree.
- `rngcoord_errors_total{code}`: RPCs that ended with a gRPC error, by status code name.
- `rngcoord_rpc_seconds{method}`: RPC latency inside the server, by method name.
- `rngcoord_store_replication_synchronous` (PostgreSQL only): 1 while the primary replicates
  synchronously, so that a failover loses no acknowledged grant; 0 while it does not
  (docs/operations.md); NaN before the writer connected.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from rngcoord.server.replication import Replication

# Coordinator RPCs take well under a millisecond on a hit and one group-commit fsync on a grant;
# the buckets resolve both, and joins that wait for a barrier land in the top ones.
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
    5.0,
    30.0,
)

METHODS = (
    "JoinGroup",
    "JoinGroups",
    "Reserve",
    "Attest",
    "LeaveGroup",
    "GetGroup",
    "Restore",
    "ListAudit",
    "RecordResize",
    "RecordQuorum",
    "Session",
)


class Metrics:
    """The counters and histograms of one server.

    Args:
        registry: the registry to register into. Default: a fresh registry that also carries
            the process, platform and GC collectors of this Python process.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        self.grants = Counter(
            "rngcoord_grants", "Leases granted by a durable write.", registry=registry
        )
        self.hits = Counter(
            "rngcoord_hits",
            "Reserve calls answered from an existing lease, without a write.",
            registry=registry,
        )
        self.divergences = Counter(
            "rngcoord_divergences",
            "Reserve calls refused because ranks disagree about the sequence of random ops.",
            registry=registry,
        )
        self.errors = Counter(
            "rngcoord_errors",
            "RPCs that ended with a gRPC error, by status code.",
            ["code"],
            registry=registry,
        )
        self.rpc_seconds = Histogram(
            "rngcoord_rpc_seconds",
            "Time spent serving an RPC inside the server, by method.",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        # Resolved once: a labels() lookup per request would take a lock and hash the labels.
        self.latency = {m: self.rpc_seconds.labels(method=m) for m in METHODS}
        self._errors_by_code = {c: self.errors.labels(code=c.name) for c in grpc.StatusCode}

    def error(self, code: grpc.StatusCode) -> None:
        """Count one RPC that ended with status `code`."""
        self._errors_by_code[code].inc()

    def follow_replication(self, replication: Callable[[], Replication | None]) -> None:
        """Expose `rngcoord_store_replication_synchronous`, read from `replication()` at each
        scrape. For a store with standbys only (PostgreSQL)."""
        gauge = Gauge(
            "rngcoord_store_replication_synchronous",
            "1 while the PostgreSQL primary replicates synchronously (a failover to its standby "
            "loses no acknowledged grant), 0 while it does not; NaN before the writer connected.",
            registry=self.registry,
        )

        def value() -> float:
            found = replication()
            return float("nan") if found is None else float(found.synchronous)

        gauge.set_function(value)
