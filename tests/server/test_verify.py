"""`verify` on real SQLite stores: a healthy chain passes; each tampering is caught, by name.

Stores are filled through the real Coordinator in this process, with a keyed audit chain,
then changed behind its back with sqlite3, as someone with write access to the database file
(but not the audit key) could. Each tampering the integrity issue listed has a test:
truncating the tail, appending a forged record, editing a grant and rehashing the chain,
lowering a high-water mark, inserting a restore row, and changing a group's seed.
"""

from __future__ import annotations

import hashlib
import json
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
    rehash_from,
    reserve,
)
from rngcoord.server.audit.anchors import read_anchors
from rngcoord.server.audit.chain import Chain, key_id, load_key
from rngcoord.server.audit.verify import UNANCHORED_NOTE, verify
from rngcoord.server.storage.sqlite import SqliteStore
from rngcoord.server.storage.store import Tx, to_db

KEY = bytes(range(32))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "verify.db"


@pytest.fixture
def h(db: Path) -> Iterator[InProcess]:
    """A keyed store with one group of 2 ranks and 3 grants: records 1 key, 2 job, 3 group,
    4 epoch, 5-7 grants."""
    loop = LoopThread()
    store = CountingStore(SqliteStore(db, create=True))
    harness = InProcess(loop, store, ManualClock(), key=KEY)
    form(harness)
    for seq in range(3):
        reserve(harness, seq)
    yield harness
    harness.close()
    store.close()
    loop.close()


def anchor_now(h: InProcess) -> dict[str, object]:
    """The anchor a server would write for the current head."""
    record_id, record_hash = h.store.read(lambda tx: audit_head(tx))
    return {
        "store_id": h.store.store_id,
        "id": record_id,
        "hash": record_hash,
        "mac": h.coord.chain.anchor_mac(record_id, record_hash),
        "source": "test:1",
    }


def audit_head(tx: Tx) -> tuple[int, str]:
    row = tx.fetchone("SELECT last_id, last_hash FROM audit_head")
    assert row is not None
    return int(row[0]), str(row[1])


def test_verify_passes_on_a_healthy_keyed_store(h: InProcess) -> None:
    report = verify(h.store, key=KEY, anchors=[anchor_now(h)])
    assert report.problems == [] and report.notes == [] and report.ok
    assert (report.records, report.grants, report.groups) == (7, 3, 1)
    assert report.summary() == "ok: 7 records, 3 grants in 1 groups, chain intact, no overlaps"


def test_without_the_key_verify_says_what_it_could_not_check(h: InProcess) -> None:
    report = verify(h.store)
    assert report.ok
    assert report.notes == [
        f"records from 1 on are MACed under key id {key_id(KEY)}: their MACs and the "
        "anchors' signatures were not checked (pass --audit-key)",
        UNANCHORED_NOTE,
    ]
    # Without an anchor, a cut tail cannot be seen, and the summary says so.
    assert report.summary() == (
        "ok: 7 records, 3 grants in 1 groups, chain intact, no overlaps; "
        "its tail unchecked (no --anchor)"
    )


def test_a_wrong_key_is_named(h: InProcess) -> None:
    report = verify(h.store, key=b"another key, 32 bytes long......")
    assert not report.ok
    assert report.problems[0].startswith("the key given (key id ")


def test_an_edited_grant_is_caught_even_after_rehashing_without_the_key(
    h: InProcess, db: Path
) -> None:
    (grant,) = [r for r in records(h, "grant") if r.detail["seq"] == 1]
    with sqlite3.connect(db) as raw:
        raw.execute(
            "UPDATE audit SET detail = replace(detail, '\"size\":64', '\"size\":65') WHERE id = ?",
            (grant.id,),
        )
        rehash_from(raw, grant.id)
    problems = verify(h.store, key=KEY).problems
    # Every record from the edited one on fails its MAC: the forger could not recompute it.
    assert problems[0] == f"record {grant.id}: its MAC does not match its contents"
    assert f"record {grant.id + 1}: its MAC does not match its contents" in problems


def test_a_forged_record_appended_with_a_correct_hash_is_caught(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        last_id, last_hash = raw.execute("SELECT last_id, last_hash FROM audit_head").fetchone()
        detail = json.dumps(
            {"epoch": 1, "seq": 3, "start": 192, "end": 256, "size": 64}, separators=(",", ":")
        )
        body = Chain("x").digest(
            last_id + 1, 0, TEST_JOB, "g", "grant", "forger", detail, last_hash
        )
        raw.execute(
            "INSERT INTO audit (id, ts_us, job, grp, kind, actor, detail, prev_hash, hash) "
            "VALUES (?, 0, ?, 'g', 'grant', 'forger', ?, ?, ?)",
            (last_id + 1, TEST_JOB, detail, last_hash, body),
        )
        raw.execute("UPDATE audit_head SET last_id = ?, last_hash = ?", (last_id + 1, body))
    problems = verify(h.store, key=KEY).problems
    assert problems[0] == f"record {last_id + 1}: its MAC does not match its contents"


def test_a_truncated_tail_is_caught_by_an_anchor_and_by_the_high_water_mark(
    h: InProcess, db: Path
) -> None:
    anchor = anchor_now(h)
    with sqlite3.connect(db) as raw:
        # The last grant goes, with its lease row, and the head is rewound to its predecessor.
        raw.execute("DELETE FROM audit WHERE id = 7")
        raw.execute("DELETE FROM leases WHERE seq = 2")
        prev = raw.execute("SELECT hash FROM audit WHERE id = 6").fetchone()[0]
        raw.execute("UPDATE audit_head SET last_id = 6, last_hash = ?", (prev,))
    problems = verify(h.store, key=KEY, anchors=[anchor]).problems
    assert (
        "anchor test:1 names record 7, but the chain ends at record 6: records were removed "
        "from its tail" in problems
    )
    assert (
        "groups row (job 'job-1' group 'g'): high_water 192, but the chain's grants end at 128 "
        "(record 6)" in problems
    )


def test_a_truncation_that_also_lowers_the_high_water_mark_needs_the_anchor(
    h: InProcess, db: Path
) -> None:
    anchor = anchor_now(h)
    with sqlite3.connect(db) as raw:
        raw.execute("DELETE FROM audit WHERE id = 7")
        raw.execute("DELETE FROM leases WHERE seq = 2")
        prev = raw.execute("SELECT hash FROM audit WHERE id = 6").fetchone()[0]
        raw.execute("UPDATE audit_head SET last_id = 6, last_hash = ?", (prev,))
        raw.execute("UPDATE groups SET high_water = ?", (to_db(128),))
    assert verify(h.store, key=KEY).ok  # a consistent rewrite: only an anchor can tell
    assert verify(h.store, key=KEY, anchors=[anchor]).problems == [
        "anchor test:1 names record 7, but the chain ends at record 6: records were removed "
        "from its tail"
    ]


def test_a_rewritten_chain_below_an_anchor_is_caught_even_with_valid_hashes(
    h: InProcess, db: Path
) -> None:
    anchor = anchor_now(h)
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE audit SET actor = 'someone else' WHERE id = 6")
        rehash_from(raw, 6)
    problems = verify(h.store, anchors=[anchor]).problems  # no key: hashes only
    assert problems == [
        f"anchor test:1: record 7 has hash {problems[0].split('hash ')[1].split('...')[0]}..., "
        f"not the anchored {str(anchor['hash'])[:16]}...: the chain was rewritten"
    ]


def test_a_forged_anchor_is_named(h: InProcess) -> None:
    anchor = {**anchor_now(h), "mac": "0" * 64}
    assert verify(h.store, key=KEY, anchors=[anchor]).problems == [
        "anchor test:1: its signature does not match (forged or another key)"
    ]


def test_anchors_are_read_from_anchor_files_logs_and_client_heads(h: InProcess) -> None:
    a = anchor_now(h)
    line = json.dumps({k: a[k] for k in ("store_id", "id", "hash", "mac")})
    log = json.dumps(
        {"event": "audit_anchor", "fields": {k: a[k] for k in ("store_id", "id", "hash", "mac")}}
    )
    head = f"{a['store_id']}:{a['id']}:{a['hash']}:{a['mac']}"
    found = read_anchors([line, "not an anchor", log, head], "f")
    assert [x["source"] for x in found] == ["f:1", "f:3", "f:4"]
    assert verify(h.store, key=KEY, anchors=found).ok


def test_a_lowered_high_water_mark_is_named(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE groups SET high_water = ?", (to_db(64),))
    assert verify(h.store, key=KEY).problems == [
        "groups row (job 'job-1' group 'g'): high_water 64, but the chain's grants end at 192 "
        "(record 7)"
    ]


def test_an_inserted_restore_row_is_named(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute("INSERT INTO restores VALUES (?, 'g', 1, 3, ?, 0)", (TEST_JOB, to_db(0)))
    assert verify(h.store, key=KEY).problems == [
        "restores row (group 'g' epoch 1 seq 3) has no restore record"
    ]


def test_a_changed_group_seed_is_named(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE groups SET seed = ?", (to_db(7),))
    (group,) = records(h, "group")
    assert verify(h.store, key=KEY).problems == [
        f"groups row (job 'job-1' group 'g'): seed 7, but its group record {group.id} says "
        f"{group.detail['seed']}"
    ]


def test_a_changed_job_seed_is_named(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE jobs SET seed = ?", (to_db(43),))
    assert verify(h.store, key=KEY).problems[0] == (
        "jobs row 'job-1': seed 43, but its job record 2 says 42"
    )


def test_a_lease_inserted_by_hand_is_named(h: InProcess, db: Path) -> None:
    with sqlite3.connect(db) as raw:
        raw.execute(
            "INSERT INTO leases VALUES (?, 'g', 1, 9, ?, ?, ?, x'00', 0, 'm0', 0, '', '')",
            (TEST_JOB, to_db(32), to_db(96), to_db(64)),
        )
    assert verify(h.store, key=KEY).problems == [
        "lease (job 'job-1' group 'g' epoch 1 seq 9, [32, 96)) has no grant record"
    ]


def test_an_overlapping_grant_is_named_even_with_a_valid_chain(h: InProcess) -> None:
    def forge(tx: Tx) -> int:
        tx.execute(
            "INSERT INTO leases VALUES (?, 'g', 1, 3, ?, ?, ?, x'00', 0, 'm0', 0, '', '')",
            (TEST_JOB, to_db(32), to_db(96), to_db(64)),
        )
        detail = {"epoch": 1, "seq": 3, "start": 32, "end": 96, "size": 64}
        record_id, _ = h.coord.chain.append(
            tx, ts_us=0, job=TEST_JOB, group="g", kind="grant", actor="insider", detail=detail
        )
        return record_id

    forged = h.store.write(forge)  # an insider with the key: only the overlap check can tell
    problems = verify(h.store, key=KEY).problems
    assert len(problems) == 2
    assert all(p.startswith(f"grant record {forged} (group 'g' epoch 1 seq 3") for p in problems)
    assert {p.split(" overlaps ")[1].split(" (")[0] for p in problems} == {
        "grant record 5",
        "grant record 6",
    }


def test_key_files_are_checked_and_never_echoed(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not-hex-secret-material\n")
    with pytest.raises(ValueError) as caught:
        load_key(str(bad))
    assert "secret" not in str(caught.value)
    fresh = tmp_path / "fresh.key"
    key = load_key(str(fresh), create=True)
    assert len(key) == 32 and fresh.stat().st_mode & 0o777 == 0o600
    assert load_key(str(fresh)) == key
    assert key_id(key) == hashlib.sha256(key).hexdigest()[:16]
