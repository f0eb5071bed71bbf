"""A store that lost grants is moved past what its members report (docs/design.md §11.6).

A real SQLite store loses its last grants the way a promoted standby under asynchronous
replication does: an older copy of it comes back, consistent, only shorter. A coordinator that
never saw the lost records serves it. Members that join report where they know the group's
grants reach (JoinGroupRequest.position); the epoch they form starts past it, the move is
audited as a `failover-gap` record, and `verify` names it.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from harness import (
    TEST_JOB,
    CoordinatorProcess,
    CountingStore,
    InProcess,
    LoopThread,
    ManualClock,
    form,
    records,
    reserve,
    run_cli,
    secret_for,
)
from rngcoord.client import CoordinatorClient
from rngcoord.server.audit.anchors import read_anchor_files
from rngcoord.server.audit.verify import verify
from rngcoord.server.storage.sqlite import SqliteStore
from rngcoord.v1.types import JoinResult, Lease


def _open(db: Path) -> tuple[LoopThread, CountingStore, InProcess]:
    loop = LoopThread()
    store = CountingStore(SqliteStore(db, create=True))
    return loop, store, InProcess(loop, store, ManualClock())


def _close(loop: LoopThread, store: CountingStore, h: InProcess) -> None:
    h.close()
    store.close()
    loop.close()


def _join(h: InProcess, members: list[tuple[str, int]]) -> list[JoinResult]:
    """Every rank of a new epoch of group "g" at once: (member id, position) by rank."""

    async def all_ranks() -> list[JoinResult]:
        return await asyncio.gather(
            *(
                h.coord.join(
                    TEST_JOB,
                    "g",
                    rank=rank,
                    world_size=len(members),
                    member_id=member,
                    member_secret=secret_for(member),
                    timeout_s=10.0,
                    actor=f"rank {rank}",
                    position=position,
                )
                for rank, (member, position) in enumerate(members)
            )
        )

    return h.run(all_ranks())


def test_an_epoch_starts_past_the_grants_a_member_reports_and_the_gap_is_audited(
    tmp_path: Path,
) -> None:
    db, older = tmp_path / "store.db", tmp_path / "older.db"
    loop, store, h = _open(db)
    form(h)
    reserve(h, 0)
    with sqlite3.connect(db) as live, sqlite3.connect(older) as copy:
        live.backup(copy)
    held = [reserve(h, seq) for seq in (1, 2)]  # [64, 128) and [128, 192): lost below
    _close(loop, store, h)
    for stale in db.parent.glob(db.name + "*"):
        stale.unlink()
    shutil.copy(older, db)

    loop, store, h = _open(db)
    try:
        # The store lost both grants: a member that knows nothing would start at 64.
        rank0_knows = held[-1].end
        results = _join(h, [("m2", rank0_knows), ("m3", 0)])
        assert {(r.epoch, r.start) for r in results} == {(2, rank0_knows)}
        lease = reserve(h, 0, member="m2", epoch=2)
        assert lease.start == rank0_knows  # nothing the lost store granted is granted again
        (gap,) = records(h, "failover-gap")
        assert (gap.job, gap.group) == (TEST_JOB, "g")
        assert gap.detail == {"from": 64, "to": 192, "rank": 0, "member_id": "m2"}
        report = verify(h.store)
        assert report.ok, report.problems
        assert any(
            f"record {gap.id}: failover gap in job {TEST_JOB!r} group 'g': offsets [64, 192)"
            in note
            for note in report.notes
        ), report.notes

        # A position at or below the high-water mark is what every healthy join reports:
        # nothing moves and nothing is recorded.
        results = _join(h, [("m4", lease.end), ("m5", 4)])
        assert {(r.epoch, r.start) for r in results} == {(3, lease.end)}
        assert len(records(h, "failover-gap")) == 1
        assert verify(h.store).ok
    finally:
        _close(loop, store, h)


def test_a_running_server_serves_a_store_that_went_back_and_restarts_on_it(
    coordinator_factory: Callable[..., CoordinatorProcess], tmp_path: Path
) -> None:
    """A real `serve` on SQLite, whose file gets an older copy of itself written into it (the
    same file, as a promoted standby is the same database): the server notices the lost
    records, audits a `rewind` and serves the store as it now is. Lost leases asked again get
    the ranges they had; an epoch formed afterwards starts past what its member reports; and
    the server starts again on its own anchor file, whose anchors of the lost records the
    rewind record accounts for, as `verify --anchor` does."""
    server = coordinator_factory()
    db = Path(server.db_url.removeprefix("sqlite:///"))
    anchors = db.with_name(db.name + ".anchors.jsonl")
    older = tmp_path / "older.db"
    with CoordinatorClient([server.address], deadline_s=10.0, outage_s=30.0) as client:
        joined = client.join_group("rewound", "g", rank=0, world_size=1, member_id="r0")

        def lease(seq: int, member: str = "r0", epoch: int = joined.epoch) -> Lease:
            return client.reserve(
                "rewound", "g", epoch=epoch, seq=seq, size=64, fingerprint=b"ops", rank=0,
                member_id=member,
            )  # fmt: skip

        lease(0)
        with sqlite3.connect(db) as live, sqlite3.connect(older) as copy:
            live.backup(copy)
        held = [lease(1), lease(2)]
        deadline = time.monotonic() + 30  # the server anchors the head it moved to each second
        while _newest_anchor(anchors) < _head_id(db):
            assert time.monotonic() < deadline, "no anchor of the newest head"
            time.sleep(0.1)
        with sqlite3.connect(older) as copy, sqlite3.connect(db) as live:
            copy.backup(live)
        deadline = time.monotonic() + 30
        while not [e for e in server.log_events() if e["event"] == "store_rewound_served"]:
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.1)
        # Asked again, the lost leases are granted anew from their predecessors: the same
        # ranges, which the ranks already hold.
        again = [lease(1), lease(2)]
        assert [(x.start, x.end) for x in again] == [(x.start, x.end) for x in held]
        back = client.join_group(
            "rewound", "g", rank=0, world_size=1, member_id="r1", position=held[-1].end
        )
        assert back.start == held[-1].end
    server.kill()
    server.restart()  # its anchor file names records the store lost: the rewind explains them
    report = run_cli("verify", "--db", server.db_url, "--anchor", str(anchors))
    assert report.returncode == 0, report.stdout + report.stderr
    assert "the store went back in time" in report.stdout
    assert "failover gap in job 'rewound' group 'g'" not in report.stdout  # its grants came back
    with CoordinatorClient([server.address], deadline_s=10.0) as client:
        assert client.join_group("rewound", "g", rank=0, world_size=1, member_id="r2").epoch


def _newest_anchor(path: Path) -> int:
    return max((int(a["id"]) for a in read_anchor_files([path], missing_ok=True)), default=0)


def _head_id(db: Path) -> int:
    with sqlite3.connect(db) as raw:
        return int(raw.execute("SELECT last_id FROM audit_head").fetchone()[0])
