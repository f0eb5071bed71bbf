"""rngcoord server: the coordinator, its storage backends, the audit chain and the CLI.

The public names of the server side live here; the `rngcoord` command is
`rngcoord.server.cli:main`. Nothing in this package imports torch, so the coordinator image
stays small.

Example, an embedded coordinator on SQLite::

    from rngcoord.server import start_server

    running = start_server("127.0.0.1:0", "sqlite:///rngcoord.db")
    print(running.address)  # "127.0.0.1:PORT"
    running.stop(grace_s=5)
"""

from __future__ import annotations

from rngcoord.server.app import RunningServer, TLSConfig, serve, start_server
from rngcoord.server.coordinator import (
    Coordinator,
    GroupInfo,
    JoinResult,
    ReserveResult,
    RestoreResult,
)
from rngcoord.server.errors import CoordinatorError
from rngcoord.server.seeds import group_seed
from rngcoord.server.store import Store, open_store
from rngcoord.server.verify import VerifyReport, verify

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "GroupInfo",
    "JoinResult",
    "ReserveResult",
    "RestoreResult",
    "RunningServer",
    "Store",
    "TLSConfig",
    "VerifyReport",
    "group_seed",
    "open_store",
    "serve",
    "start_server",
    "verify",
]
