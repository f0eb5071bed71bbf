"""LeaseManager against a real coordinator: placement, deterministic requests and
fingerprints, spanning leases, Restore, fencing, and an unreachable coordinator.

Two managers stand for two ranks of one group (joined through a real JoinGroup barrier);
no torch.distributed is needed.
"""

from __future__ import annotations

import functools
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
from rngcoord.client._leases import FINGERPRINT_BYTES, INITIAL_DIGEST, LeaseSchedule, StreamState
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
) -> tuple[dict[int, tuple[int, int, bytes]], int]:
    """The documented rule, simulated: every fixed lease, seq -> (start, end, fingerprint),
    and the last seq every rank must have sent (the current lease's prefetch). Which fixed
    leases beyond that a rank sends depends on its timing; what each asks does not."""
    fixed: dict[int, tuple[int, int, bytes]] = {}

    def fix(fingerprint: bytes, largest: int, stop: int) -> None:
        start = fixed[len(fixed) - 1][1] if fixed else 0
        size = schedule.size(largest_op=largest, consumed=max(stop, start))
        fixed[len(fixed)] = (start, start + size, fingerprint)

    def fix_through(seq: int, fingerprint: bytes, largest: int, stop: int) -> None:
        while len(fixed) <= seq:
            fix(fingerprint, largest, stop)

    digest, cursor, largest = INITIAL_DIGEST, 0, 0
    fix_through(schedule.lookahead, digest[:FINGERPRINT_BYTES], 0, 0)
    current = sent = 0
    for key, n in ops:
        digest = hashlib.sha256(digest + key).digest()
        cursor += n
        largest = max(largest, n)
        fingerprint = digest[:FINGERPRINT_BYTES]
        while fixed[len(fixed) - 1][1] < cursor:
            fix(fingerprint, largest, cursor)
        need = max(s for s, (start, _, _) in fixed.items() if start <= cursor - 1)
        if need > current:
            current = need
            fix_through(need + schedule.lookahead, fingerprint, largest, cursor)
        sent = max(sent, need + 1)
    return fixed, sent


@pytest.fixture
def client(module_coordinator: Any) -> Any:
    # The tests share one coordinator, each in jobs of its own; the one that stops the
    # coordinator has its own.
    with CoordinatorClient(module_coordinator.address) as c:
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

    # Every rank asked for leases the rule fixes, with the same sizes and fingerprints, at
    # least up to the last one's prefetch: the coordinator granted each once, contiguous
    # from 0 (a different request for a granted seq would have been a divergence).
    fixed, sent = expected_requests(schedule)

    def settled(m: LeaseManager) -> Callable[[], bool]:
        return lambda: m.stats.received == m.stats.reserves > sent

    for manager in ranks:
        wait_until(settled(manager))
    grants = client.list_audit(job="leases", group=group, kinds=["grant"])
    details = sorted((g.detail for g in grants), key=lambda d: d["seq"])
    expected = [fixed[seq] for seq in range(len(details))]
    assert sent < len(details) <= len(fixed)
    assert [d["seq"] for d in details] == list(range(len(details)))
    assert [(d["start"], d["end"]) for d in details] == [(s, e) for s, e, _ in expected]
    assert [bytes.fromhex(d["fingerprint"]) for d in details] == [f for _, _, f in expected]
    info = client.get_group("leases", group)
    assert info.high_water == expected[-1][1]
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
    client = CoordinatorClient(coordinator.address, deadline_s=2.0, outage_s=2.0, backoff_s=0.1)
    (manager,) = managers(client, "down", "g", 64, world=1)
    manager.advance(32, b"a")  # lease 0 current, lease 1 prefetched
    wait_until(lambda: manager.stats.received == 2)
    coordinator.kill()
    manager.advance(96, b"b")  # up to the end of lease 1: no RPC needed
    # Lease 2 is needed: the op waits out the outage budget (2 s) for it, then gives up.
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="outage budget of 2 s"):
        manager.advance(16, b"c")
    assert 1.5 < time.monotonic() - started < 10
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


def test_a_different_op_sequence_is_caught_within_the_lookahead(
    client: CoordinatorClient,
) -> None:
    # Rank 1 runs one extra op at step 3. Leases are fixed (size and fingerprint) up to
    # LOOKAHEAD ahead by the op that first touches a lease, so the leases fixed after the
    # extra op carry different fingerprints (and sizes) on the two ranks. The second to ask
    # learns of the divergence when its op needs one of those; the first at its next request
    # or attestation (every 1,024 ops: design §6.1).
    schedule = LeaseSchedule(min_size=64, op_factor=2, growth=2, max_size=1 << 16)
    ranks = managers(client, "diverge", "g", None, schedule=schedule)
    ops = [(b"rand(64,)", 64)] * 3000
    extra = [*ops[:3], (b"randn(8,)", 8), *ops[3:]]
    raised = _two_rank_ops(ranks, [ops, extra])
    assert all(isinstance(e, DivergenceError) for e in raised), raised
    assert ranks[0].cursor < 3000 * 64 or ranks[1].cursor < 3000 * 64 + 8
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


def test_the_worked_example_of_the_module_docstring_holds(client: CoordinatorClient) -> None:
    (manager,) = managers(client, "example", "g", None, world=1, schedule=LeaseSchedule())
    manager.prefetch_s = 0.0  # send only what the rule must: needed leases and the prefetch
    dropout = (b"dropout(8, 64, 4096, 4096)", 1 << 33)

    def granted() -> list[tuple[int, int]]:
        records = client.list_audit(job="example", kinds=["grant"])
        details = sorted((r.detail for r in records), key=lambda d: d["seq"])
        return [(d["start"], d["end"]) for d in details]

    manager.advance(dropout[1], dropout[0])
    wait_until(lambda: manager.stats.received == manager.stats.reserves == 7)
    fifth = 153419776
    assert granted() == [
        (0, 1 << 16),
        (1 << 16, 327680),
        (327680, 2424832),
        (2424832, 19202048),
        (19202048, fifth),
        (fifth, fifth + (1 << 37)),
        (fifth + (1 << 37), fifth + (1 << 37) + (1 << 40)),
    ]
    for _ in range(15):  # ops 2..16 stay inside lease 5
        manager.advance(dropout[1], dropout[0])
    assert manager.stats.reserves == 7
    manager.advance(dropout[1], dropout[0])  # op 17 makes lease 6 current and sends lease 7
    wait_until(lambda: manager.stats.received == manager.stats.reserves == 8)
    manager.close()


def test_attestation_strides_follow_the_rate_and_still_meet(client: CoordinatorClient) -> None:
    """Rank 0 draws one op a second (stride 1,024); rank 1 draws 100 a second, so 30 s of it
    is 3,000 ops and its stride becomes 4,096 after its first attestation. Rank 1 runs an
    extra op after op 1,500: the ranks share no attested count at 2,048 or 3,072 and meet at
    4,096, the larger stride, where the divergence is recorded. Rank 1 sent 2 attestations
    where stride 1,024 would have sent 4."""
    joined = join(client, "strides", "g", 2)
    now = [0.0, 0.0]
    per_op_s = [1.0, 0.01]
    group = [
        LeaseManager(
            client,
            "strides",
            "g",
            rank=rank,
            member_id=f"m{rank}",
            joined=joined[rank],
            schedule=LeaseSchedule(fixed=2**30),  # one lease: only attestations can tell
            heartbeat_s=0,
            attest_min_s=30.0,
            clock=functools.partial(now.__getitem__, rank),
        )
        for rank in range(2)
    ]
    try:
        for rank, manager in enumerate(group):
            for op in range(4600):
                now[rank] += per_op_s[rank]
                manager.advance(64, b"rand(16,)")
                if rank == 1 and op == 1500:
                    manager.advance(64, b"randn(16,)")
            if rank == 0:
                time.sleep(1.0)  # rank 0's attestations are in before rank 1's
        deadline = time.monotonic() + 10
        while group[1]._fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(DivergenceError, match="ops 4096"):
            group[1].advance(64, b"rand(16,)")
        assert group[1].stats.attestations == 2  # 1,024 and 4,096
        assert group[0].stats.attestations == 4  # 1,024 ... 4,096
        (record,) = client.list_audit(job="strides", kinds=["divergence"])
        assert record.detail["ops"] == 4096
    finally:
        for manager in group:
            manager.close(leave=False)


def test_recorded_ops_replay_onto_another_position_as_the_ops_moved_the_stream(
    client: CoordinatorClient,
) -> None:
    # rngcoord.client.torchft replays a step's recorded ops onto a peer's position: the
    # cursor moves by their sizes and the fingerprint chain by their keys, as advance() does.
    (manager,) = managers(client, "recorded", "g", 64, world=1)
    manager.advance(16, b"before")
    assert manager.recorded_ops() == []
    manager.record_ops()
    start_cursor, start_digest = manager.cursor, manager.digest
    for key, size in OPS[:5]:
        manager.advance(size, key)
    assert manager.recorded_ops() == [(size, key) for key, size in OPS[:5]]
    cursor, digest = start_cursor, start_digest
    for size, key in manager.recorded_ops():
        cursor, digest = cursor + size, hashlib.sha256(digest + key).digest()
    assert (cursor, digest) == (manager.cursor, manager.digest)
    manager.record_ops()  # starts over
    assert manager.recorded_ops() == []
    manager.close()
