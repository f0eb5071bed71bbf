"""Concurrency and idempotency of Reserve on a live server, once per store backend.

Ranks in threads of this process and in spawned processes form epochs together, then all of
them reserve the same keys at the same time. docs/design.md §2.1 and §2.2: everyone gets
the same lease for a key, exactly one request allocates it, consecutive seqs are contiguous and
never overlap, and replaying a request returns the same lease without a new grant.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness import CoordinatorFactory, join_all, secret_for
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

JOB = "concurrency"
GROUPS = ("tp", "dp[0]")
THREAD_RANKS = 4
PROCESS_RANKS = 2
WORLD = THREAD_RANKS + PROCESS_RANKS
SEQS = 25

# (seq, epoch, seed, start, end, existing) as one rank saw it.
Seen = tuple[int, int, int, int, int, bool]


def _size(group: str, seq: int) -> int:
    # Varying sizes catch an allocator that assumes equal leases.
    return 4 * (1 + (seq * 7 + len(group)) % 50) * 1024


def _fingerprint(group: str, seq: int) -> bytes:
    return hashlib.sha256(f"{group}/{seq}".encode()).digest()[:16]


def _member(rank: int) -> str:
    return f"rank{rank}-incarnation1"


def run_rank(address: str, rank: int) -> dict[str, list[Seen]]:
    """One rank: join every group, then reserve seq 0..SEQS-1 of each, interleaved."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        epochs = {}
        for group in GROUPS:
            joined = stub.JoinGroup(
                pb.JoinGroupRequest(
                    job=JOB,
                    group=group,
                    rank=rank,
                    world_size=WORLD,
                    member_id=_member(rank),
                    member_secret=secret_for(_member(rank)),
                    job_seed=2024,
                    timeout_ms=60_000,
                ),
                timeout=90,
            )
            epochs[group] = joined.epoch
        seen: dict[str, list[Seen]] = {group: [] for group in GROUPS}
        for seq in range(SEQS):
            for group in GROUPS:
                reply = stub.Reserve(
                    pb.ReserveRequest(
                        job=JOB,
                        group=group,
                        epoch=epochs[group],
                        seq=seq,
                        size=_size(group, seq),
                        fingerprint=_fingerprint(group, seq),
                        rank=rank,
                        member_id=_member(rank),
                        member_secret=secret_for(_member(rank)),
                    ),
                    timeout=30,
                )
                lease = reply.lease
                assert (lease.group, lease.seq) == (group, seq)
                seen[group].append(
                    (lease.seq, lease.epoch, lease.seed, lease.start, lease.end, reply.existing)
                )
        return seen


@pytest.mark.slow
def test_ranks_in_threads_and_processes_get_identical_contiguous_leases(
    store_url: str, coordinator_factory: CoordinatorFactory
) -> None:
    server = coordinator_factory(store_url)
    ctx = multiprocessing.get_context("spawn")
    with (
        ctx.Pool(PROCESS_RANKS) as processes,
        ThreadPoolExecutor(THREAD_RANKS) as threads,
    ):
        remote = [
            processes.apply_async(run_rank, (server.address, rank))
            for rank in range(THREAD_RANKS, WORLD)
        ]
        local = [threads.submit(run_rank, server.address, rank) for rank in range(THREAD_RANKS)]
        by_rank = [f.result(timeout=120) for f in local] + [r.get(timeout=120) for r in remote]

    seeds = set()
    for group in GROUPS:
        views = [[entry[:5] for entry in seen[group]] for seen in by_rank]
        assert all(view == views[0] for view in views), f"ranks disagree about {group}"
        leases = views[0]
        seeds.add(leases[0][2])
        assert {lease[1] for lease in leases} == {1}
        assert leases[0][3] == 0, "a group's first epoch starts at cursor 0"
        for (seq, _, _, start, end), previous in zip(leases, [None, *leases], strict=False):
            assert end - start == _size(group, seq)
            if previous is not None:
                assert start == previous[4], (
                    f"{group} seq {seq} does not start where {seq - 1} ends"
                )
        # Exactly one of the WORLD concurrent requests for a key allocated it.
        for seq in range(SEQS):
            allocations = [seen[group][seq][5] for seen in by_rank].count(False)
            assert allocations == 1, f"{group} seq {seq} was allocated {allocations} times"
    assert len(seeds) == len(GROUPS), "different groups must get different seeds"

    stub = server.stub()
    grants = list(stub.ListAudit(pb.ListAuditRequest(job=JOB, kinds=["grant"]), timeout=30))
    assert len(grants) == len(GROUPS) * SEQS


def test_replayed_requests_return_the_same_lease_without_a_new_grant(
    store_url: str, coordinator_factory: CoordinatorFactory
) -> None:
    server = coordinator_factory(store_url)
    stub = server.stub()
    group, world = "replay", 2
    members = join_all(stub, JOB, group, world)[0].members

    def reserve(seq: int, rank: int) -> Seen:
        reply = stub.Reserve(
            pb.ReserveRequest(
                job=JOB,
                group=group,
                epoch=1,
                seq=seq,
                size=_size(group, seq),
                fingerprint=_fingerprint(group, seq),
                rank=rank,
                member_id=members[rank],
                member_secret=secret_for(members[rank]),
            ),
            timeout=30,
        )
        lease = reply.lease
        return (lease.seq, lease.epoch, lease.seed, lease.start, lease.end, reply.existing)

    granted = [reserve(seq, 0) for seq in range(SEQS)]
    assert not any(lease[5] for lease in granted)
    # Retries after lost replies, by both ranks, from many threads at once, three times over.
    keys = [(seq, rank) for seq in range(SEQS) for rank in range(world)] * 3
    with ThreadPoolExecutor(8) as threads:
        replays = list(threads.map(lambda key: reserve(*key), keys))
    for (seq, rank), got in zip(keys, replays, strict=True):
        assert got[5], f"replay of seq {seq} by rank {rank} allocated instead of reading back"
        assert got[:5] == granted[seq][:5]
    grants = list(stub.ListAudit(pb.ListAuditRequest(job=JOB, group=group, kinds=["grant"])))
    assert len(grants) == SEQS
