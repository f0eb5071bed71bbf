"""Two coordinator replicas on one PostgreSQL database, hammered by client processes at once.

Each group has world size 2; rank 0 talks to replica A first and rank 1 to replica B, so both
replicas serve every group at the same time. Client processes (tests/server/replica_client.py,
the real `CoordinatorClient` with both targets) reserve leases until told to stop. Afterwards
the ranks must agree on every lease, leases must be contiguous, every lease a client received
must read back identically, and `rngcoord verify` must pass. One test SIGKILLs replica A in
the middle of the storm: its clients fail over to B and nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from storm import Storm, check_agreement, check_read_back, check_verify

from harness import CoordinatorProcess

pytestmark = pytest.mark.slow


def test_two_replicas_serve_the_same_groups_at_once(
    postgres_url_factory: Callable[[], str],
    coordinator_factory: Callable[..., CoordinatorProcess],
    tmp_path: Path,
) -> None:
    db_url = postgres_url_factory()
    replicas = [coordinator_factory(db_url), coordinator_factory(db_url)]
    with Storm(replicas, tmp_path) as storm:
        storm.wait_for_progress({})
        storm.wait_for_progress(storm.lease_counts())
        chains = check_agreement(storm.finish(), one_grant_each=True)
    for replica in replicas:
        check_read_back(replica.address, {g: chain[:5] for g, chain in chains.items()})
    check_verify(db_url)


def test_clients_fail_over_when_a_replica_is_killed_and_nothing_is_lost(
    postgres_url_factory: Callable[[], str],
    coordinator_factory: Callable[..., CoordinatorProcess],
    tmp_path: Path,
) -> None:
    db_url = postgres_url_factory()
    replicas = [coordinator_factory(db_url), coordinator_factory(db_url)]
    with Storm(replicas, tmp_path) as storm:
        storm.wait_for_progress({})
        replicas[0].kill()
        # Every member keeps getting leases, so A's clients carry on through B.
        storm.wait_for_progress(storm.lease_counts())
        chains = check_agreement(storm.finish(), one_grant_each=False)
    check_read_back(replicas[1].address, chains)
    check_verify(db_url)
