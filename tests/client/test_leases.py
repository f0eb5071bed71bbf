"""LeaseManager against a real coordinator: placement, deterministic requests and
fingerprints, spanning leases, Restore, fencing, and an unreachable coordinator.

Two managers stand for two ranks of one group (joined through a real JoinGroup barrier);
no torch.distributed is needed.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from rngcoord.client import (
    CoordinatorClient,
    CoordinatorUnavailable,
    InvalidRequest,
    LeaseManager,
    StaleEpochError,
)
from rngcoord.client.leases import FINGERPRINT_BYTES, INITIAL_DIGEST
from rngcoord.v1.types import JoinResult

# (op key, size in offsets): sizes below, at, and well above the lease sizes used.
OPS = [(b"rand(3, 5)", 16), (b"randn(8,)", 8), (b"dropout(40,)", 40), (b"uniform_(200,)", 200)]
OPS = OPS * 3 + [(b"rand(1,)", 4), (b"normal_(1000,)", 1000), (b"rand(2, 2)", 4)]


def join(client: CoordinatorClient, job: str, group: str, world: int) -> list[JoinResult]:
    """Every rank joins at once (the barrier); returns the results by rank."""
    results: list[JoinResult | None] = [None] * world

    def run(rank: int) -> None:
        results[rank] = client.join_group(
            job, group, rank=rank, world_size=world, member_id=f"m{rank}", job_seed=3
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def managers(
    client: CoordinatorClient, job: str, group: str, lease: int, world: int = 2
) -> list[LeaseManager]:
    joined = join(client, job, group, world)
    return [
        LeaseManager(
            client,
            job,
            group,
            rank=rank,
            member_id=f"m{rank}",
            joined=joined[rank],
            lease_size=lease,
        )
        for rank in range(world)
    ]


def run_ops(manager: LeaseManager, jitter: bool) -> list[int]:
    bases = []
    for key, size in OPS:
        if jitter:
            time.sleep(random.uniform(0, 0.003))
        bases.append(manager.advance(size, key))
    return bases


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def expected_requests(lease: int) -> dict[int, bytes]:
    """The documented request rule, simulated: seq -> fingerprint."""
    fingerprints = {0: INITIAL_DIGEST[:FINGERPRINT_BYTES]}
    digest, cursor, next_seq = INITIAL_DIGEST, 0, 1
    for key, size in OPS:
        digest = hashlib.sha256(digest + key).digest()
        cursor += size
        last = (cursor - 1) // lease
        while next_seq <= last + 1:
            fingerprints[next_seq] = digest[:FINGERPRINT_BYTES]
            next_seq += 1
    return fingerprints


@pytest.fixture
def client(coordinator: Any) -> Any:
    with CoordinatorClient(coordinator.address) as c:
        yield c


@pytest.mark.parametrize("lease", [16, 64, 4096])
def test_placement_and_requests_are_deterministic(client: CoordinatorClient, lease: int) -> None:
    group = f"g{lease}"
    ranks = managers(client, "leases", group, lease)
    bases: list[list[int]] = [[], []]

    def rank_main(rank: int) -> None:
        bases[rank].extend(run_ops(ranks[rank], jitter=rank == 1))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Bases are the running sum of the sizes, on both ranks and for every lease size: an op
    # bigger than a lease simply needs several consecutive leases.
    sums = [sum(size for _, size in OPS[:i]) for i in range(len(OPS))]
    assert bases == [sums, sums]
    total = sum(size for _, size in OPS)
    assert all(m.cursor == total for m in ranks)

    # Every rank asked for exactly the leases the rule names, with the same fingerprints: the
    # coordinator granted each once, contiguous from 0.
    expected = expected_requests(lease)

    def settled(m: LeaseManager) -> Callable[[], bool]:
        return lambda: m.stats.received == m.stats.reserves == len(expected)

    for manager in ranks:
        wait_until(settled(manager))
    grants = client.list_audit(job="leases", group=group, kinds=["grant"])
    details = sorted((g.detail for g in grants), key=lambda d: d["seq"])
    assert [d["seq"] for d in details] == list(expected)
    assert [(d["start"], d["end"]) for d in details] == [
        (s * lease, (s + 1) * lease) for s in expected
    ]
    assert [bytes.fromhex(d["fingerprint"]) for d in details] == list(expected.values())
    info = client.get_group("leases", group)
    assert info.high_water == len(expected) * lease
    for manager in ranks:
        manager.close()


def test_restore_moves_the_next_lease(client: CoordinatorClient) -> None:
    ranks = managers(client, "restore", "g", 64)
    for m in ranks:
        run_ops(m, jitter=False)
    digest = ranks[0].digest
    for m in ranks:
        m.restore(128, digest)
    assert [m.advance(20, b"rand(20,)") for m in ranks] == [128, 128]
    assert [m.advance(100, b"rand(100,)") for m in ranks] == [148, 148]
    restores = client.list_audit(job="restore", kinds=["restore"])
    assert len(restores) == 1
    assert restores[0].detail["cursor"] == 128
    with pytest.raises(InvalidRequest, match="multiple of 4"):
        ranks[0].restore(130, digest)
    for m in ranks:
        m.close()


def test_fenced_epoch_is_reported(client: CoordinatorClient) -> None:
    (old,) = managers(client, "fence", "g", 16, world=1)
    old.advance(8, b"a")
    # A new member set forms epoch 2; the old member's next lease is refused.
    client.join_group("fence", "g", rank=0, world_size=1, member_id="new-member")
    with pytest.raises(StaleEpochError, match="install\\(\\) again"):
        for _ in range(10):
            old.advance(16, b"b")
    old.close(leave=False)


@pytest.mark.slow
def test_unreachable_coordinator_then_back(coordinator: Any) -> None:
    client = CoordinatorClient(coordinator.address, deadline_s=2.0, retries=4, backoff_s=0.1)
    (manager,) = managers(client, "down", "g", 64, world=1)
    manager.advance(32, b"a")  # lease 0 current, lease 1 prefetched
    wait_until(lambda: manager.stats.received == 2)
    coordinator.kill()
    manager.advance(96, b"b")  # up to the end of lease 1: no RPC needed
    with pytest.raises(CoordinatorUnavailable, match="rngcoord serve"):
        manager.advance(16, b"c")  # needs lease 2
    assert manager.cursor == 128  # the refused op left the stream alone
    coordinator.restart()
    assert manager.advance(16, b"c") == 128
    manager.close()
    client.close()
