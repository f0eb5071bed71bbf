"""Opening a store: the backend a store URL names.

The backends (`sqlite`, `postgres` in rngcoord.server.storage) implement the interface of
rngcoord.server.storage.store; this module is the one place that knows them all, so the
interface module depends on none of them.
"""

from __future__ import annotations

from rngcoord.server.storage.store import Store

__all__ = ["open_store"]


def open_store(url: str, *, create: bool = False, require_sync_replication: bool = False) -> Store:
    """Open the store a URL names, applying pending schema migrations.

    Args:
        url: `sqlite:///PATH` (PATH relative to the working directory; `sqlite:////abs/path`
            for an absolute one) or `postgresql://...` (a libpq connection URL).
        create: create the store when there is none (`rngcoord serve --init`). Default False:
            a missing or empty store raises `StoreNotFound`, so that nothing silently starts
            over at offset 0.
        require_sync_replication: refuse a PostgreSQL primary that does not replicate
            synchronously (rngcoord.server.replication); an SQLite store has no replicas, so
            it is refused too. Default False: the mode is only logged.

    Raises:
        ValueError: the URL names no supported backend.
        StoreNotFound: no store there, and `create` is False.
    """
    if url.startswith("sqlite:///"):
        if require_sync_replication:
            raise ValueError(
                "--require-sync-replication needs a PostgreSQL store; an SQLite store has no "
                "standby to replicate to"
            )
        from rngcoord.server.storage.sqlite import SqliteStore

        return SqliteStore(url.removeprefix("sqlite:///"), create=create)
    if url.startswith(("postgresql://", "postgres://")):
        # Imported lazily: the SQLite-only deployment never needs psycopg.
        from rngcoord.server.storage.postgres import PostgresStore

        store: Store = PostgresStore(
            url, create=create, require_sync_replication=require_sync_replication
        )
        return store
    raise ValueError(
        f"unsupported store URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST/DB"
    )
