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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rngcoord.client import (
    CoordinatorClient,
    CoordinatorUnavailable,
    DivergenceError,
    InvalidRequest,
    LeaseManager,
    StaleEpochError,
)
from rngcoord.client.leases import FINGERPRINT_BYTES, INITIAL_DIGEST, LeaseSchedule, StreamState
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
    client: CoordinatorClient,
    job: str,
    group: str,
    lease: int | None,
    world: int = 2,
    schedule: LeaseSchedule | None = None,
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
            schedule=schedule or LeaseSchedule(fixed=lease),
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


def expected_requests(
    schedule: LeaseSchedule, ops: list[tuple[bytes, int]] = OPS
) -> dict[int, tuple[int, int, bytes]]:
    """The documented request rule, simulated: seq -> (start, end, fingerprint)."""

    def size(largest: int, cursor: int) -> int:
        return schedule.size(largest_op=largest, consumed=cursor)

    first = size(0, 0)
    requests = {0: (0, first, INITIAL_DIGEST[:FINGERPRINT_BYTES])}
    digest, cursor, largest, next_start = INITIAL_DIGEST, 0, 0, first
    for key, n in ops:
        digest = hashlib.sha256(digest + key).digest()
        cursor += n
        largest = max(largest, n)
        fingerprint = digest[:FINGERPRINT_BYTES]
        while next_start < cursor:
            requests[len(requests)] = (next_start, next_start + size(largest, cursor), fingerprint)
            next_start = requests[len(requests) - 1][1]
        need = max(s for s, (start, _, _) in requests.items() if start <= cursor - 1)
        if len(requests) <= need + 1:
            requests[len(requests)] = (next_start, next_start + size(largest, cursor), fingerprint)
            next_start = requests[len(requests) - 1][1]
    return requests


@pytest.fixture
def client(coordinator: Any) -> Any:
    with CoordinatorClient(coordinator.address) as c:
        yield c


SCHEDULES = {
    "fixed16": LeaseSchedule(fixed=16),
    "fixed64": LeaseSchedule(fixed=64),
    "fixed4096": LeaseSchedule(fixed=4096),
    # Small enough that the ops above span many leases, which grow as the stream does.
    "growing": LeaseSchedule(min_size=16, op_factor=2, growth=2, max_size=1 << 20),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_placement_and_requests_are_deterministic(client: CoordinatorClient, name: str) -> None:
    group = f"g-{name}"
    schedule = SCHEDULES[name]
    ranks = managers(client, "leases", group, None, schedule=schedule)
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

    # Every rank asked for exactly the leases the rule names, with the same sizes and
    # fingerprints: the coordinator granted each once, contiguous from 0.
    expected = expected_requests(schedule)

    def settled(m: LeaseManager) -> Callable[[], bool]:
        return lambda: m.stats.received == m.stats.reserves == len(expected)

    for manager in ranks:
        wait_until(settled(manager))
    grants = client.list_audit(job="leases", group=group, kinds=["grant"])
    details = sorted((g.detail for g in grants), key=lambda d: d["seq"])
    assert [d["seq"] for d in details] == list(expected)
    assert [(d["start"], d["end"]) for d in details] == [(s, e) for s, e, _ in expected.values()]
    assert [bytes.fromhex(d["fingerprint"]) for d in details] == [
        f for _, _, f in expected.values()
    ]
    info = client.get_group("leases", group)
    assert info.high_water == expected[len(expected) - 1][1]
    for manager in ranks:
        manager.close()


def test_restore_moves_the_next_lease(client: CoordinatorClient) -> None:
    ranks = managers(client, "restore", "g", 64)
    for m in ranks:
        run_ops(m, jitter=False)
    digest = ranks[0].digest
    # Every rank votes, as each loads the checkpoint; the Restore waits for all of them.
    with ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(lambda m: m.restore(128, digest), ranks))
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


def _two_rank_ops(
    ranks: list[LeaseManager], ops: list[list[tuple[bytes, int]]]
) -> list[BaseException | None]:
    """Rank r runs ops[r] in a thread of its own; returns what each raised, if anything."""
    raised: list[BaseException | None] = [None, None]

    def rank_main(rank: int) -> None:
        try:
            for key, size in ops[rank]:
                ranks[rank].advance(size, key)
        except BaseException as exc:  # the test inspects it
            raised[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


def test_a_different_op_sequence_is_caught_within_one_lease(client: CoordinatorClient) -> None:
    # Rank 1 runs one extra op at step 3. The schedule sizes the next lease from the op
    # sequence, so the ranks ask for the same seq with different fingerprints (and sizes),
    # and both learn of the divergence by the time their ops need the lease after next.
    schedule = LeaseSchedule(min_size=64, op_factor=2, growth=2, max_size=1 << 16)
    ranks = managers(client, "diverge", "g", None, schedule=schedule)
    ops = [(b"rand(64,)", 64)] * 40
    extra = [*ops[:3], (b"randn(8,)", 8), *ops[3:]]
    raised = _two_rank_ops(ranks, [ops, extra])
    assert all(isinstance(e, DivergenceError) for e in raised), raised
    assert ranks[0].cursor < 40 * 64 or ranks[1].cursor < 40 * 64 + 8
    for m in ranks:
        m.close(leave=False)


def test_a_checkpoint_taken_mid_schedule_resumes_bitwise(client: CoordinatorClient) -> None:
    schedule = LeaseSchedule(min_size=16, op_factor=2, growth=2, max_size=1 << 20)
    ops = [(b"dropout(24,)", 24), (b"rand(100,)", 100)] * 20
    (straight,) = managers(client, "resume", "straight", None, world=1, schedule=schedule)
    expected = [straight.advance(size, key) for key, size in ops]
    (first,) = managers(client, "resume", "split", None, world=1, schedule=schedule)
    before = [first.advance(size, key) for key, size in ops[:17]]
    saved = first.state
    first.close()
    # A restarted process joins a new epoch and continues from the checkpoint: the same
    # offsets as the uninterrupted run, and the schedule's state continues too.
    (joined,) = join(client, "resume", "split", 1)
    resumed = LeaseManager(
        client,
        "resume",
        "split",
        rank=0,
        member_id="m0",
        joined=joined,
        schedule=schedule,
        resume=StreamState(saved.cursor, saved.digest, saved.origin, saved.largest_op),
    )
    after = [resumed.advance(size, key) for key, size in ops[17:]]
    assert before + after == expected
    assert resumed.state == straight.state
    resumed.close()
    straight.close()


def test_work_sized_leases_bound_the_rpcs_per_training_step(client: CoordinatorClient) -> None:
    # A model-shaped trace with the default schedule: 96 layers, each one dropout of
    # 8 x 64 x 4096 x 4096 elements and two of 8 x 4096 x 12288. After a warm-up of 10 steps,
    # a rank asks for at most one lease per 10 steps (a fixed 2^32 lease would need about 212
    # per step).
    layer = [
        (b"dropout(8, 64, 4096, 4096)", 8 * 64 * 4096 * 4096),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
        (b"dropout(8, 4096, 12288)", 8 * 4096 * 12288),
    ]
    step = layer * 96
    (manager,) = managers(client, "model", "g", None, world=1)
    for _ in range(10):
        for key, size in step:
            manager.advance(size, key)
    warm = manager.stats.reserves
    for _ in range(30):
        for key, size in step:
            manager.advance(size, key)
    assert (manager.stats.reserves - warm) / 30 <= 0.1
    manager.close()
