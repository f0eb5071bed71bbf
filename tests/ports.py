"""Ports for the tests' own listeners, and ports where nothing listens."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["closed_address", "free_port"]

_LOWEST = 10_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a listener that starts later (a gloo rendezvous, a
    PostgreSQL cluster), below the kernel's ephemeral range. A port that bind(0) hands out is
    in that range, where any outgoing connection (the suite's gRPC and PostgreSQL clients, on
    two workers) may take it as its source port before the listener binds: EADDRINUSE, seen
    as a failed gloo rendezvous in a full `make test`."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(_LOWEST, low) if low > _LOWEST + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port in [{_LOWEST}, {low}) after 200 tries")


def closed_address() -> str:
    """HOST:PORT of a port where nothing listens (for now)."""
    return f"127.0.0.1:{free_port()}"
