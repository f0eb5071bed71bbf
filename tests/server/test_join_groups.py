"""JoinGroups on a real server: one call joins a rank's root mesh and its sub-meshes, each as
its own JoinGroup would, over unary calls and Session messages alike; bad requests are
refused whole, and a join that fails withdraws the others from their barriers.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness import (
    TEST_JOB,
    CoordinatorProcess,
    CountingStore,
    InProcess,
    LoopThread,
    ManualClock,
    form,
    join,
    secret_for,
)
from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._errors import InvalidRequest
from rngcoord.server.storage.sqlite import SqliteStore
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import error_info
from rngcoord.v1.types import JoinResult

JOB = "join-groups"


def _mesh_groups(rank: int) -> list[tuple[str, int, int]]:
    """The groups of `rank` on a 2 x 2 (dp, tp) mesh: the root mesh and its tp sub-mesh."""
    dp, tp = divmod(rank, 2)
    return [("root", rank, 4), (f"tp-{dp}", tp, 2)]


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_one_call_joins_the_root_mesh_and_its_sub_mesh(
    coordinator: CoordinatorProcess, session: bool
) -> None:
    client = CoordinatorClient(coordinator.address, session=session, outage_s=0)
    job = f"{JOB}-{session}"
    members = [f"m{rank}-{uuid.uuid4().hex[:6]}" for rank in range(4)]

    def join(rank: int) -> list[JoinResult]:
        return client.join_groups(
            job, _mesh_groups(rank), member_id=members[rank], job_seed=7, timeout_s=20
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(join, range(4)))
    roots = [r[0] for r in results]
    assert all(r == roots[0] for r in roots) and roots[0].epoch == 1 and roots[0].world_size == 4
    for dp in range(2):
        assert results[2 * dp][1] == results[2 * dp + 1][1]
        assert results[2 * dp][1].world_size == 2
    assert results[0][1].seed != results[2][1].seed  # two sub-meshes, two streams
    assert {r.job_seed for pair in results for r in pair} == {7}
    # Each group is a group like any other: a member of it reserves as usual.
    lease = client.reserve(
        job, "tp-1", epoch=1, seq=0, size=64, fingerprint=b"f", rank=1, member_id=members[3]
    )
    assert lease.seed == results[3][1].seed
    assert client.audit_head
    client.close()


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_bad_requests_are_refused_whole(coordinator: CoordinatorProcess, session: bool) -> None:
    client = CoordinatorClient(coordinator.address, session=session, outage_s=0)
    cases = {
        "joins": [],
        "joins.group": [("g", 0, 1), ("g", 0, 1)],
    }
    for field, groups in cases.items():
        with pytest.raises(InvalidRequest) as caught:
            client.join_groups(JOB, groups, member_id="m", timeout_s=2)
        assert caught.value.metadata["field"] == field, caught.value
    with pytest.raises(InvalidRequest) as caught:
        client.join_groups(JOB, [(f"g{i}", 0, 1) for i in range(17)], member_id="m", timeout_s=2)
    assert "1 to 16" in str(caught.value)
    # Nothing was joined by the refused calls.
    with pytest.raises(Exception, match="unknown"):
        client.get_group(JOB, "g")
    client.close()


def _join(group: str, rank: int, world_size: int, member: str, timeout_ms: int) -> Any:
    return pb.JoinGroupRequest(
        group=group,
        rank=rank,
        world_size=world_size,
        member_id=member,
        member_secret=secret_for(member),
        timeout_ms=timeout_ms,
    )


@pytest.mark.slow
def test_a_join_that_fails_withdraws_the_others(coordinator: CoordinatorProcess) -> None:
    # "lonely" times out after 1 s (nobody else joins it), while rank 0 of "pair" waits: the
    # timeout fails the call, and rank 0 of "pair" leaves its barrier.
    request = pb.JoinGroupsRequest(
        job=JOB,
        joins=[_join("pair", 0, 2, "early", 30_000), _join("lonely", 0, 2, "early", 1_000)],
    )
    with pytest.raises(grpc.RpcError) as caught:
        coordinator.stub().JoinGroups(request, timeout=20)
    info = error_info(caught.value)
    assert info is not None and info.reason == "JOIN_TIMEOUT", caught.value
    assert info.metadata["group"] == "lonely"
    # Rank 1 of "pair" alone does not form an epoch with the withdrawn rank 0.
    late = pb.JoinGroupsRequest(job=JOB, joins=[_join("pair", 1, 2, "late", 1_000)])
    with pytest.raises(grpc.RpcError) as caught:
        coordinator.stub().JoinGroups(late, timeout=20)
    info = error_info(caught.value)
    assert info is not None and info.reason == "JOIN_TIMEOUT"
    assert "[0]" in (caught.value.details() or "")


def test_a_late_notice_of_an_older_epoch_fails_no_waiter(tmp_path: Path) -> None:
    """The change feed's notice of epoch 1 comes after epoch 2 formed with a waiting rank in
    it, but before that batch's answer reached the loop (answers are held back here, as a
    loaded machine does): the rank is not told that epoch 1 formed without it."""

    class SlowAnswers(CountingStore):
        def submit(self, fn: Any, ahead: Any = None) -> Future[Any]:
            inner, out = super().submit(fn, ahead), Future[Any]()

            def later(done: Future[Any]) -> None:
                threading.Timer(0.3, lambda: _copy(done, out)).start()

            inner.add_done_callback(later)
            return out

    loop = LoopThread()
    store = SlowAnswers(SqliteStore(tmp_path / "late.db", create=True))
    h = InProcess(loop, store, ManualClock())
    try:
        form(h, members=("a0", "a1"))

        def epochs() -> int:
            row = store.read(lambda tx: tx.fetchone("SELECT max(epoch) FROM epochs"))
            assert row is not None
            return int(row[0])

        async def scenario() -> list[Any]:
            b0 = asyncio.ensure_future(join(h, 0, 2, "b0"))
            await asyncio.sleep(1.0)  # b0's batch written and answered: it waits, flushed
            b1 = asyncio.ensure_future(join(h, 1, 2, "b1"))
            while epochs() < 2:  # noqa: ASYNC110 (the database has no event to wait on)
                await asyncio.sleep(0.001)
            # Epoch 2 is committed; its batch's answer is still held back.
            await h.coord._barriers.epoch_formed(TEST_JOB, "g", 1)
            return list(await asyncio.gather(b0, b1, return_exceptions=True))

        results = h.run(scenario())
        assert [getattr(r, "epoch", r) for r in results] == [2, 2]
    finally:
        h.close()
        store.close()
        loop.close()


def _copy(source: Future[Any], target: Future[Any]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
