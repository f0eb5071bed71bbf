"""The database primary dies and a standby is promoted, under two coordinator replicas.

PostgreSQL clusters of the test's own (tests/pg_clusters.py): a primary and a streaming
standby on ephemeral ports; the replicas' ``--db`` is libpq's multi-host URL with
``target_session_attrs=read-write``, so every connection they open finds whichever cluster is
the writable primary. The storm of tests/server/storm.py runs while the whole primary is
SIGKILLed (postmaster and children, as a host crash) and the standby is promoted with
``pg_ctl promote``: with synchronous replication every lease a client was given before the
kill reads back identically from the promoted store, no two grants overlap, the coordinators
go on granting without a restart, and ``rngcoord verify`` passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from storm import Storm, check_agreement, check_read_back, check_verify

import pg_clusters
from harness import CoordinatorProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def pg_pair() -> Iterator[Callable[..., pg_clusters.PostgresPair]]:
    """`pg_pair(synchronous=...)` makes a primary and a standby; both go when the test ends."""
    reason = pg_clusters.unavailable()
    if reason is not None:
        pytest.skip(reason)
    pairs: list[pg_clusters.PostgresPair] = []

    def make(*, synchronous: bool) -> pg_clusters.PostgresPair:
        pairs.append(pg_clusters.PostgresPair(synchronous=synchronous))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def test_a_synchronous_standby_is_promoted_and_no_acknowledged_lease_is_lost(
    pg_pair: Callable[..., pg_clusters.PostgresPair],
    coordinator_factory: Callable[..., CoordinatorProcess],
    tmp_path: Path,
) -> None:
    pair = pg_pair(synchronous=True)
    pair.create_database("rngcoord")
    db_url = pair.database_url("rngcoord")
    replicas = [coordinator_factory(db_url), coordinator_factory(db_url)]
    with Storm(replicas, tmp_path) as storm:
        storm.wait_for_progress({})
        before = storm.lease_counts()
        pair.kill_primary()
        killed = time.monotonic()
        pair.promote()
        promoted = time.monotonic() - killed
        # Every member gets more leases from the promoted store, from the same processes.
        storm.wait_for_progress(before, timeout_s=90)
        chains = check_agreement(storm.finish(), one_grant_each=False)
    assert all(r.popen is not None and r.popen.poll() is None for r in replicas), "a replica exited"
    for replica in replicas:
        check_read_back(replica.address, chains)
    check_verify(db_url)
    print(f"promoted in {promoted:.2f} s; {sum(before.values())} leases before the kill")
