"""`verify` on real SQLite stores: a healthy chain passes; each tampering is named.

Stores are filled through the real Coordinator in this process, then changed behind its back
with sqlite3, as someone with access to the database file could.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import (
    TEST_JOB,
    CountingStore,
    InProcess,
    LoopThread,
    ManualClock,
    form,
    records,
    reserve,
)
from rngcoord.server import audit
from rngcoord.server.sqlite import SqliteStore
from rngcoord.server.store import Tx, to_db
from rngcoord.server.verify import verify


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "verify.db"


@pytest.fixture
def h(db: Path) -> Iterator[InProcess]:
    loop = LoopThread()
    store = CountingStore(SqliteStore(db))
    harness = InProcess(loop, store, ManualClock())
    form(harness)
    for seq in range(3):
        reserve(harness, seq)
    yield harness
    harness.close()
    store.close()
    loop.close()


def test_verify_passes_on_a_healthy_store(h: InProcess) -> None:
    report = verify(h.store)
    assert report.ok and report.problems == []
    assert (report.records, report.grants, report.groups) == (6, 3, 1)
    assert report.summary() == "ok: 6 records, 3 grants in 1 groups, chain intact, no overlaps"


def test_verify_names_a_record_whose_detail_was_changed(h: InProcess, db: Path) -> None:
    (grant,) = [r for r in records(h, "grant") if r.detail["seq"] == 1]
    with sqlite3.connect(db) as raw:
        raw.execute(
            "UPDATE audit SET detail = replace(detail, '\"size\":64', '\"size\":65') WHERE id = ?",
            (grant.id,),
        )
    report = verify(h.store)
    assert not report.ok
    assert report.problems == [f"record {grant.id}: its hash does not match its contents"]
    assert report.summary().startswith("FAILED: 1 problems")


def test_verify_names_a_deleted_record(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute("DELETE FROM audit WHERE id = 4")
    problems = verify(h.store).problems
    assert "records 4 to 4 are missing" in problems
    assert any(p.startswith("record 5: prev_hash") for p in problems)
    assert any("has no grant record" in p and "seq 0" in p for p in problems)


def test_verify_names_a_deleted_last_record(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute("DELETE FROM audit WHERE id = 6")
    problems = verify(h.store).problems
    assert any(p.startswith("audit_head says the chain ends at record 6") for p in problems)


def test_verify_names_a_lease_inserted_by_hand(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute(
            "INSERT INTO leases VALUES (?, 'g', 1, 9, ?, ?, ?, x'00', 0, 'm0', 0)",
            (TEST_JOB, to_db(32), to_db(96), to_db(64)),
        )
    assert verify(h.store).problems == [
        "lease (job 'job-1' group 'g' epoch 1 seq 9, [32, 96)) has no grant record"
    ]


def test_verify_names_an_overlapping_grant_even_with_a_valid_chain(h: InProcess) -> None:
    def forge(tx: Tx) -> int:
        tx.execute(
            "INSERT INTO leases VALUES (?, 'g', 1, 3, ?, ?, ?, x'00', 0, 'm0', 0)",
            (TEST_JOB, to_db(32), to_db(96), to_db(64)),
        )
        detail = {"epoch": 1, "seq": 3, "start": 32, "end": 96, "size": 64}
        return audit.append(
            tx, ts_us=0, job=TEST_JOB, group="g", kind="grant", actor="forger", detail=detail
        )

    forged = h.store.write(forge)
    problems = verify(h.store).problems
    assert len(problems) == 2
    assert all(p.startswith(f"grant record {forged} (group 'g' epoch 1 seq 3") for p in problems)
    assert {p.split(" overlaps ")[1].split(" (")[0] for p in problems} == {
        "grant record 4",
        "grant record 5",
    }
