"""rngcoord server: the coordinator, its storage backends, the audit chain and the CLI.

The public names of the server side live here; the `rngcoord` command is
`rngcoord.server.cli:main`. Nothing in this package imports torch, so the coordinator image
stays small. The names load lazily, on first use, so that `rngcoord audit` or a store-only
script does not pay for the gRPC server's imports.

Example, an embedded coordinator on SQLite::

    from rngcoord.server import start_server

    running = start_server("127.0.0.1:0", "sqlite:///rngcoord.db")
    print(running.address)  # "127.0.0.1:PORT"
    running.stop(grace_s=5)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rngcoord.server.app import RunningServer, serve, start_server
    from rngcoord.server.audit.verify import VerifyReport, verify
    from rngcoord.server.core.coordinator import Coordinator
    from rngcoord.server.core.seeds import group_seed
    from rngcoord.server.errors import CoordinatorError
    from rngcoord.server.options import TLSConfig
    from rngcoord.server.storage.store import Store
    from rngcoord.server.storage.stores import open_store
    from rngcoord.v1.types import GroupInfo, JoinResult, Lease, RestoreResult

# public name -> the module that defines it
_EXPORTS = {
    "Coordinator": "core.coordinator",
    "CoordinatorError": "errors",
    "GroupInfo": "rngcoord.v1.types",
    "JoinResult": "rngcoord.v1.types",
    "Lease": "rngcoord.v1.types",
    "RestoreResult": "rngcoord.v1.types",
    "RunningServer": "app",
    "Store": "storage.store",
    "TLSConfig": "options",
    "VerifyReport": "audit.verify",
    "group_seed": "core.seeds",
    "open_store": "storage.stores",
    "serve": "app",
    "start_server": "app",
    "verify": "audit.verify",
}

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "GroupInfo",
    "JoinResult",
    "Lease",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rngcoord.server' has no attribute {name!r}")
    path = module if module.startswith("rngcoord.") else f"rngcoord.server.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
