"""What `rngcoord serve` logs (docs/design.md §7): group events at INFO, once per deployment.

A real server with two workers forms, replaces, diverges, restores and leaves a group; its log
has one line per event (worker 0 follows every worker's changes through the change feed and
logs them), each worker's `serving` line says who serves the HTTP side, and every anchor is
logged once.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import grpc
import pytest

from harness import CoordinatorFactory, join_all, secret_for
from rngcoord.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow

JOB = "logged"


def _member(rank: int, member: str, epoch: int) -> dict[str, Any]:
    return {
        "job": JOB,
        "group": "g",
        "epoch": epoch,
        "rank": rank,
        "member_id": member,
        "member_secret": secret_for(member),
    }


def test_group_events_are_logged_once_each(coordinator_factory: CoordinatorFactory) -> None:
    server = coordinator_factory(args=("--workers", "2", "--metrics", "127.0.0.1:0"))
    stub = server.stub()
    first = list(join_all(stub, JOB, "g", 2)[0].members)
    second = list(join_all(stub, JOB, "g", 2)[0].members)  # epoch 2 replaces epoch 1
    a, b = (_member(rank, second[rank], 2) for rank in (0, 1))
    stub.Reserve(pb.ReserveRequest(seq=0, size=64, fingerprint=b"one", **a), timeout=10)
    restores = [
        stub.Restore.future(pb.RestoreRequest(seq=1, cursor=0, timeout_ms=5000, **m), timeout=10)
        for m in (a, b)
    ]
    assert [r.result().cursor for r in restores] == [0, 0]
    with pytest.raises(grpc.RpcError):
        stub.Reserve(pb.ReserveRequest(seq=1, size=64, fingerprint=b"two", **a), timeout=10)
        stub.Reserve(pb.ReserveRequest(seq=1, size=64, fingerprint=b"other", **b), timeout=10)
    stub.LeaveGroup(pb.LeaveGroupRequest(**b), timeout=10)
    assert first != second

    wanted = {"group_formed": 2, "epoch_replaced": 1, "restore": 1, "divergence": 1, "leave": 1}
    deadline = time.monotonic() + 10
    while True:
        events = server.log_events()
        counts = Counter(e.get("event") for e in events)
        if all(counts[name] >= n for name, n in wanted.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a second worker logging them too would show by now
    events = server.log_events()
    counts = Counter(e.get("event") for e in events)
    assert {name: counts[name] for name in wanted} == wanted, counts
    (replaced,) = [e["fields"] for e in events if e.get("event") == "epoch_replaced"]
    assert (replaced["job"], replaced["group"], replaced["epoch"], replaced["replaced"]) == (
        JOB,
        "g",
        2,
        1,
    )
    formed = [e["fields"] for e in events if e.get("event") == "group_formed"]
    assert [f["epoch"] for f in formed] == [1, 2] and all(f["world_size"] == 2 for f in formed)
    assert all(isinstance(f["waited_s"], float) for f in formed)
    # Each worker says the supervisor serves HTTP, never that metrics are off.
    serving = [e["fields"] for e in events if e.get("event") == "serving"]
    assert len(serving) == 2 and {s["metrics"] for s in serving} == {"supervisor"}
    (supervisor,) = [e["fields"] for e in events if e.get("event") == "workers_serving"]
    assert supervisor["metrics"].startswith("127.0.0.1:")
    # Every anchor once: one writer of anchors.
    anchors = [e["fields"]["id"] for e in events if e.get("event") == "audit_anchor"]
    assert anchors and len(anchors) == len(set(anchors))
