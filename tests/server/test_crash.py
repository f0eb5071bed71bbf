"""A coordinator SIGKILLed in the middle of a reservation storm loses nothing it answered.

Client processes, each with several threads, reserve leases as fast as the server answers.
The server is killed with SIGKILL while they run, then restarted on the same store.
docs/design.md §2.1 and §2.3: every lease a client received before the kill comes back identical,
new grants continue exactly where the old ones end (no overlap), a new epoch starts past
everything granted, and `rngcoord verify` passes. Runs once per store backend.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from multiprocessing.sharedctypes import Synchronized
from typing import NamedTuple

import grpc
import pytest

from harness import CoordinatorFactory, run_cli, secret_for
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

JOB = "crash"
CLIENT_PROCESSES = 2
THREADS_PER_PROCESS = 3
SIZE = 1 << 16
KILL_AFTER_GRANTS = 150


class Held(NamedTuple):
    """A lease one client received, with the request that produced it."""

    group: str
    member: str
    epoch: int
    seq: int
    seed: int
    start: int
    end: int


def _fingerprint(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _reserve(
    stub: pb_grpc.CoordinatorStub, group: str, member: str, epoch: int, seq: int
) -> pb.ReserveResponse:
    reply: pb.ReserveResponse = stub.Reserve(
        pb.ReserveRequest(
            job=JOB,
            group=group,
            epoch=epoch,
            seq=seq,
            size=SIZE,
            fingerprint=_fingerprint(seq),
            rank=0,
            member_id=member,
            member_secret=secret_for(member),
        ),
        timeout=30,
    )
    return reply


def storm_client(
    address: str, index: int, granted: Synchronized[int], results: multiprocessing.Queue[object]
) -> None:
    """One client process: each thread owns a group and reserves seq 0, 1, ... until an RPC
    fails (the server died). Puts the leases it received on `results`."""
    held: list[Held] = []
    lock = threading.Lock()

    def run(thread: int) -> None:
        group, member = f"g{index}-{thread}", f"p{index}t{thread}-a"
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            try:
                epoch = stub.JoinGroup(
                    pb.JoinGroupRequest(
                        job=JOB,
                        group=group,
                        rank=0,
                        world_size=1,
                        member_id=member,
                        member_secret=secret_for(member),
                        timeout_ms=30_000,
                    ),
                    timeout=60,
                ).epoch
            except grpc.RpcError:
                return  # killed before this thread got going: it holds no lease

            seq = 0
            while True:
                try:
                    lease = _reserve(stub, group, member, epoch, seq).lease
                except grpc.RpcError:
                    return
                with lock:
                    held.append(Held(group, member, epoch, seq, lease.seed, lease.start, lease.end))
                with granted.get_lock():
                    granted.value += 1
                seq += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS_PER_PROCESS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(held)


def test_sigkill_mid_storm_loses_no_answered_lease(
    store_url: str, coordinator_factory: CoordinatorFactory
) -> None:
    server = coordinator_factory(store_url)
    ctx = multiprocessing.get_context("spawn")
    granted = ctx.Value("q", 0)
    results: multiprocessing.Queue[object] = ctx.Queue()
    clients = [
        ctx.Process(target=storm_client, args=(server.address, i, granted, results))
        for i in range(CLIENT_PROCESSES)
    ]
    for client in clients:
        client.start()
    try:
        deadline = time.monotonic() + 90
        while granted.value < KILL_AFTER_GRANTS:
            assert time.monotonic() < deadline, (
                f"the storm granted only {granted.value} leases in 90 s; server output:\n"
                + server.output()
            )
            assert all(c.is_alive() for c in clients), "a storm client died before the kill"
            time.sleep(0.01)
        server.kill()
        held: list[Held] = []
        for _ in clients:
            try:
                held.extend(results.get(timeout=60))  # type: ignore[arg-type]
            except queue.Empty:
                raise AssertionError("a storm client did not report after the kill") from None
    finally:
        for client in clients:
            client.join(timeout=10)
            if client.is_alive():
                client.kill()
    assert len(held) >= KILL_AFTER_GRANTS

    server.restart()
    stub = server.stub()
    # 1. Every lease a client received is identical after the restart.
    for lease in held:
        reply = _reserve(stub, lease.group, lease.member, lease.epoch, lease.seq)
        got = (reply.lease.seed, reply.lease.start, reply.lease.end)
        assert reply.existing, f"{lease} was answered before the crash but is missing after it"
        assert got == (lease.seed, lease.start, lease.end), f"{lease} changed to {got}"

    by_group: dict[str, list[Held]] = {}
    for lease in sorted(held, key=lambda h: (h.group, h.seq)):
        by_group.setdefault(lease.group, []).append(lease)
    for group, leases in by_group.items():
        assert [h.seq for h in leases] == list(range(len(leases))), f"{group} has a gap"
        last = leases[-1]
        # 2. New grants continue exactly where the received ones end. The first may have been
        #    committed before the kill with its reply lost: then it reads back, still contiguous.
        end = last.end
        for seq in range(last.seq + 1, last.seq + 4):
            next_lease = _reserve(stub, group, last.member, last.epoch, seq).lease
            assert next_lease.start == end, f"{group} seq {seq} overlaps or leaves a hole"
            end = next_lease.end
        # 3. A restarted member forms a new epoch, which starts past everything granted.
        rejoined = stub.JoinGroup(
            pb.JoinGroupRequest(
                job=JOB,
                group=group,
                rank=0,
                world_size=1,
                member_id=f"{last.member}-b",
                member_secret=secret_for(f"{last.member}-b"),
            ),
            timeout=30,
        )
        assert rejoined.epoch == last.epoch + 1
        assert rejoined.start >= end
        fresh = _reserve(stub, group, f"{last.member}-b", rejoined.epoch, 0)
        assert fresh.lease.start == rejoined.start and not fresh.existing

    assert server.terminate() == 0
    verified = run_cli("verify", "--db", store_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines()[-1].startswith("ok:")
