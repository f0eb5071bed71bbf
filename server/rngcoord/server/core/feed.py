"""The change feed: every coordinator process tails the audit chain for changes made by others.

Several processes may serve one store: the workers of `rngcoord serve --workers N`, and
replicas on one PostgreSQL database. Each keeps a cache (rngcoord.server.core.cache) and waiting
joins (rngcoord.server.core.barrier) that must learn of epochs formed, members that left and
divergences recorded by the others. Every such change appends an audit record in the same
transaction, so the chain itself is the feed: each process reads the records after the last
one it has seen, of the kinds that matter, and hands them to `on_record`.

How often it reads:
- SQLite: every `poll_s` it asks `PRAGMA data_version`, which changes when any other connection
  commits and costs no lock; only then does it read the chain.
- PostgreSQL: the writer of every replica sends `NOTIFY rngcoord_changes` in each write
  transaction; a listening connection wakes the feed at once, and it also reads every `poll_s`
  in case a notification was lost (a dropped connection).

`fresh()` says whether the feed has confirmed, within `staleness_s`, that it has seen every
change: the cache answers hits only then (docs/design.md §7.4).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from rngcoord.server.clock import Clock
from rngcoord.server.logs import event, get_logger
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import Tx

__all__ = [
    "FEED_KINDS",
    "Feed",
    "FeedRecord",
    "NotifyingStore",
    "VersionedStore",
    "log_change",
]

T = TypeVar("T")

FEED_KINDS = ("epoch", "leave", "divergence", "restore", "resize", "quorum")
"""The audit kinds that change what a hit or a waiting join may answer, and `resize` and
`quorum`, which change nothing but are logged (rngcoord.server.core.coordinator logs
every kind here once)."""

_PAGE = 2000
_log = get_logger("feed")
_changes_log = get_logger("coordinator")


@dataclass(frozen=True, slots=True)
class FeedRecord:
    """One change: an audit record's id, kind, job, group and detail."""

    id: int
    kind: str
    job: str
    group: str
    detail: dict[str, Any]


@runtime_checkable
class VersionedStore(Protocol):
    """A store with a cheap "has anyone else committed?" counter (SQLite)."""

    def data_version(self) -> int: ...


@runtime_checkable
class NotifyingStore(Protocol):
    """A store that calls back when another process commits (PostgreSQL LISTEN/NOTIFY)."""

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (from any thread) on every notification; return a function that
        stops listening."""
        ...


class Feed:
    """Tails the audit chain of one store for one process.

    Args:
        store: the store; a `VersionedStore` or `NotifyingStore` is polled more cheaply.
        read: how this process reads the store from its event loop (inline or in a thread).
        on_record: called in the event loop with each change, in chain order.
        clock: the time source.
        poll_s: how often to look for changes. Default 0.02; the coordinator passes 0.1 for
            PostgreSQL.
        staleness_s: how old the last confirmation may be for `fresh()`. Default 0.5.
        on_head: called with the chain's head (id, hash) each time the feed reads it.
            Default None.
    """

    def __init__(
        self,
        store: object,
        read: Callable[[Callable[[Tx], T]], Awaitable[T]],
        on_record: Callable[[FeedRecord], None],
        clock: Clock,
        *,
        poll_s: float = 0.02,
        staleness_s: float = 0.5,
        on_head: Callable[[int, str], None] | None = None,
    ) -> None:
        self._store = store
        self._read: Callable[[Callable[[Tx], Any]], Awaitable[Any]] = read
        self._on_record = on_record
        self._on_head = on_head
        self._clock = clock
        self._poll_s = poll_s
        self._staleness_s = staleness_s
        self._position = 0
        self._confirmed = float("-inf")
        self._version: int | None = None
        self._wake = asyncio.Event()
        self._stop_listening: Callable[[], None] | None = None

    @property
    def position(self) -> int:
        """The id of the last audit record this feed has seen."""
        return self._position

    def fresh(self) -> bool:
        """True when every change committed more than `staleness_s` ago has been applied."""
        return self._clock.monotonic() - self._confirmed <= self._staleness_s

    async def start(self) -> None:
        """Start at the chain's current head: what came before is read from the store on
        demand, so nothing older needs applying."""
        head = await self._read(queries.audit_head)
        self._position = head[0]
        if self._on_head is not None:
            self._on_head(*head)
        self._confirmed = self._clock.monotonic()
        if isinstance(self._store, NotifyingStore):
            loop = asyncio.get_running_loop()

            def notified() -> None:
                loop.call_soon_threadsafe(self._wake.set)

            self._stop_listening = self._store.listen(notified)

    def restart_at(self, position: int) -> None:
        """Follow the chain from record `position` on: the store went back in time to it,
        and the records after it are new ones, not the ones seen before. Records read twice
        are harmless: every `on_record` effect can be applied again."""
        self._position = position
        self._version = None

    async def stop(self) -> None:
        """Stop listening for notifications (the listener thread ends off the loop)."""
        stop, self._stop_listening = self._stop_listening, None
        if stop is not None:
            await asyncio.get_running_loop().run_in_executor(None, stop)

    async def run(self) -> None:
        """Poll until cancelled; a failed read is logged and retried at the next poll."""
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:
                event(_log, logging.WARNING, "feed_read_failed", exc_info=True)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)

    async def poll(self) -> None:
        """Apply every change committed since the last poll."""
        started = self._clock.monotonic()
        if isinstance(self._store, VersionedStore):
            version = self._store.data_version()
            if version == self._version:
                self._confirmed = started
                return
            self._version = version
        while True:
            head, rows = await self._read(functools.partial(_page, after_id=self._position))
            if self._on_head is not None:
                self._on_head(*head)
            for rid, kind, job, group, detail in rows:
                self._on_record(FeedRecord(rid, kind, job, group, json.loads(detail)))
            self._position = rows[-1][0] if len(rows) == _PAGE else max(head[0], self._position)
            if len(rows) < _PAGE:
                break
        self._confirmed = started


def _page(tx: Tx, after_id: int) -> tuple[tuple[int, str], list[tuple[int, str, str, str, str]]]:
    # The head is read first: records up to it are in this snapshot, so the position can move
    # to it even when none of them is of a feed kind.
    head = queries.audit_head(tx)
    return head, queries.audit_feed(tx, after_id, FEED_KINDS, _PAGE)


def log_change(record: FeedRecord) -> None:
    """The log line of a group event, from its audit record, under the coordinator's logger
    (one process of a server logs them: the Coordinator's `log_changes`)."""
    d = record.detail
    where: dict[str, Any] = {"job": record.job, "group": record.group, "epoch": d.get("epoch")}
    if record.kind == "epoch":
        event(
            _changes_log,
            logging.INFO,
            "group_formed",
            **where,
            world_size=d.get("world_size"),
            start=d.get("start"),
            waited_s=d.get("waited_s"),
        )
        if int(d.get("previous_epoch") or 0) > 0:
            event(
                _changes_log, logging.INFO, "epoch_replaced", **where, replaced=d["previous_epoch"]
            )
    elif record.kind == "divergence":
        at = {k: d[k] for k in ("seq", "anchor_seq", "ops") if k in d}
        event(_changes_log, logging.WARNING, "divergence", **where, **at, rank=d.get("rank"))
    elif record.kind == "restore":
        event(
            _changes_log,
            logging.INFO,
            "restore",
            **where,
            seq=d.get("seq"),
            cursor=d.get("cursor"),
            forced=d.get("forced"),
            votes=d.get("votes"),
        )
    elif record.kind == "leave":
        event(_changes_log, logging.INFO, "leave", **where, rank=d.get("rank"))
    elif record.kind == "resize":
        event(
            _changes_log,
            logging.WARNING,
            "resize",
            **where,
            saved_group=d.get("saved_group"),
            saved_cursor=d.get("saved_cursor"),
        )
    elif record.kind == "quorum":
        event(
            _changes_log,
            logging.INFO,
            "quorum",
            **where,
            replica=d.get("replica"),
            quorum_id=d.get("quorum_id"),
            step=d.get("step"),
            participants=d.get("participants"),
            healed_from=d.get("healed_from"),
        )
