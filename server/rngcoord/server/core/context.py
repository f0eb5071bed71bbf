"""What the Coordinator's request handlers share: its store access, memory, chain and clock.

Grants (Reserve), Attestations and Restores each take one `Context` from the Coordinator that
wires them (docs/design.md §3).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rngcoord.server.audit.chain import Chain
from rngcoord.server.clock import Clock
from rngcoord.server.core.cache import Cache
from rngcoord.server.storage.store import ReadAhead, Tx

__all__ = ["Context", "Handler", "Write"]

T = TypeVar("T")


class Write(Protocol):
    """Runs a write operation in the group-commit writer from the event loop; `ahead` is the
    query the operation reads first (`store.ReadAhead`), or None."""

    def __call__(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> Awaitable[T]: ...


@dataclass(frozen=True)
class Context:
    """The Coordinator's shared parts, for its request handlers.

    Args:
        read: runs a read-only function of a transaction from the event loop.
        read_row: the first row of one read-only query, from the event loop, without a
            transaction of its own (`store.row_reader`: one round trip on PostgreSQL).
        write: runs a write operation in the group-commit writer from the event loop.
        cache: the coordinator's memory of hits.
        fresh: whether the change feed is fresh enough for a hit from memory.
        chain: how audit records are hashed.
        clock: the time source.
    """

    read: Callable[[Callable[[Tx], Any]], Awaitable[Any]]
    read_row: Callable[[str, Sequence[object]], Awaitable[tuple[Any, ...] | None]]
    write: Write
    cache: Cache
    fresh: Callable[[], bool]
    chain: Chain
    clock: Clock


class Handler:
    """A request handler of the Coordinator: it reads and writes through its `Context`.

    Args:
        context: the Coordinator's store access, memory, chain and clock.
    """

    def __init__(self, context: Context) -> None:
        self._read = context.read
        self._read_row = context.read_row
        self._write = context.write
        self._cache = context.cache
        self._fresh = context.fresh
        self._chain = context.chain
        self._clock = context.clock
