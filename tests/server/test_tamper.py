"""A tampered store is caught by `verify`, and `serve` never grants its offsets again.

One real `rngcoord serve` (keyed chain, anchors beside its SQLite file) grants leases in two
phases, with a copy of the store taken between them. Each test then changes a copy of the
final store with sqlite3, as someone with write access to the file but not the audit key could
(docs/design.md §11), and checks:

- `rngcoord verify --audit-key KEY --anchor ANCHORS` fails, and so does `verify --audit-key`
  alone for the forgeries that need no anchor;
- `rngcoord serve` restarted on the store, without `--init`, either refuses to start, naming
  why, or grants nothing that overlaps what the store granted before.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from harness import CoordinatorProcess, rehash_from, run_cli, secret_for
from rngcoord.server.audit.chain import GENESIS_HASH
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

JOB = "job"
SIZE = 1 << 16


def _reserve(stub: pb_grpc.CoordinatorStub, group: str, epoch: int, seq: int) -> pb.Lease:
    reply: pb.ReserveResponse = stub.Reserve(
        pb.ReserveRequest(
            job=JOB,
            group=group,
            epoch=epoch,
            seq=seq,
            size=SIZE,
            fingerprint=b"f" * 16,
            rank=0,
            member_id="m0",
            member_secret=secret_for("m0"),
        ),
        timeout=10,
    )
    return reply.lease


def _join(stub: pb_grpc.CoordinatorStub, group: str, member: str) -> pb.JoinGroupResponse:
    reply: pb.JoinGroupResponse = stub.JoinGroup(
        pb.JoinGroupRequest(
            job=JOB,
            group=group,
            rank=0,
            world_size=1,
            member_id=member,
            member_secret=secret_for(member),
            timeout_ms=5000,
        ),
        timeout=10,
    )
    return reply


def _anchored(server: CoordinatorProcess, db: Path) -> None:
    """Wait until the server's anchor file holds its chain's head."""
    anchors = db.with_name(db.name + ".anchors.jsonl")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as raw:
        head = raw.execute("SELECT last_id FROM audit_head").fetchone()[0]
    deadline = time.monotonic() + 10
    while f'"id": {head},' not in (anchors.read_text() if anchors.exists() else ""):
        assert time.monotonic() < deadline, "the server never anchored its head"
        time.sleep(0.1)


def _copy_store(source: Path, target: Path) -> None:
    """A whole copy of an SQLite store, whatever its WAL file still holds."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    src.close()
    dst.close()


@dataclass(frozen=True)
class Pristine:
    """The stores the tests start from: `old` after phase 1, `final` after phase 2, with the
    final anchor file, the key, and the end of every group's last grant."""

    folder: Path
    key: Path
    ends: dict[str, int]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pristine]:
    folder = tmp_path_factory.mktemp("pristine")
    db = folder / "rngcoord.db"
    key = folder / "audit.key"
    server = CoordinatorProcess(
        f"sqlite:///{db}", folder / "server", args=("--audit-key", str(key))
    ).start()
    ends: dict[str, int] = {}
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            epochs = {g: _join(stub, g, "m0").epoch for g in ("g", "h")}
            for group, seqs in (("g", range(3)), ("h", range(2))):
                for seq in seqs:
                    ends[group] = _reserve(stub, group, epochs[group], seq).end
        _anchored(server, db)
        server.terminate()
        _copy_store(db, folder / "old.db")
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for group, seqs in (("g", range(3, 6)), ("h", range(2, 3))):
                for seq in seqs:
                    ends[group] = _reserve(stub, group, epochs[group], seq).end
        _anchored(server, db)
        server.terminate()
    finally:
        server.close()
    yield Pristine(folder, key, ends)


# Each tampering changes the store through a raw connection; `forged` marks those that
# `verify --audit-key` must catch without any anchor.
Tamper = Callable[[sqlite3.Connection, Path], None]


def _delete_lease_row(raw: sqlite3.Connection, _: Path) -> None:
    raw.execute("DELETE FROM leases WHERE grp = 'g' AND seq = 4")


def _delete_middle_record(raw: sqlite3.Connection, _: Path) -> None:
    (middle,) = raw.execute("SELECT MIN(id) FROM audit WHERE kind = 'grant'").fetchone()
    raw.execute("DELETE FROM audit WHERE id = ?", (middle + 1,))


def _delete_group_rows(raw: sqlite3.Connection, _: Path) -> None:
    for table in ("leases", "members", "epochs", "groups"):
        raw.execute(f"DELETE FROM {table} WHERE grp = 'h'")


def _delete_audit_table(raw: sqlite3.Connection, _: Path) -> None:
    raw.execute("DROP TABLE audit")


def _state_tables(raw: sqlite3.Connection) -> list[str]:
    rows = raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return [name for (name,) in rows if name not in ("meta", "schema_version")]


def _empty_state_tables(raw: sqlite3.Connection, _: Path) -> None:
    for table in _state_tables(raw):
        if table not in ("audit", "audit_head"):
            raw.execute(f"DELETE FROM {table}")


def _empty_every_table(raw: sqlite3.Connection, _: Path) -> None:
    for table in _state_tables(raw):
        raw.execute(f"DELETE FROM {table}")
    raw.execute("INSERT INTO audit_head (id, last_id, last_hash) VALUES (1, 0, ?)", ("0" * 64,))


def _cut_tail(raw: sqlite3.Connection, _: Path) -> None:
    # A clean cut: the last grant of g goes, with its lease row, and g's high-water mark and
    # audit_head step back, so that the chain and the tables agree.
    (last,) = raw.execute("SELECT MAX(id) FROM audit").fetchone()
    grant = raw.execute("SELECT detail FROM audit WHERE id = ?", (last,)).fetchone()
    assert grant is not None
    raw.execute("DELETE FROM audit WHERE id >= ?", (last - 1,))
    raw.execute("DELETE FROM leases WHERE seq >= 2 AND grp = 'h'")
    raw.execute("DELETE FROM leases WHERE seq >= 5 AND grp = 'g'")
    raw.execute("UPDATE groups SET high_water = high_water - ?", (SIZE,))
    prev = raw.execute("SELECT id, hash FROM audit ORDER BY id DESC LIMIT 1").fetchone()
    raw.execute("UPDATE audit_head SET last_id = ?, last_hash = ?", prev)


def _edit_lease_range(raw: sqlite3.Connection, _: Path) -> None:
    raw.execute("UPDATE leases SET start = start - 8 WHERE grp = 'g' AND seq = 1")


def _edit_grant_record(raw: sqlite3.Connection, _: Path) -> None:
    row = raw.execute(
        "SELECT id, detail FROM audit WHERE kind = 'grant' ORDER BY id LIMIT 1"
    ).fetchone()
    raw.execute("UPDATE audit SET detail = ? WHERE id = ?", (row[1].replace("0", "1", 1), row[0]))


def _edit_seed(raw: sqlite3.Connection, _: Path) -> None:
    raw.execute("UPDATE groups SET seed = seed + 1 WHERE grp = 'g'")


def _forge_by_rehashing(raw: sqlite3.Connection, _: Path) -> None:
    _edit_grant_record(raw, _)
    (first,) = raw.execute("SELECT MIN(id) FROM audit WHERE kind = 'grant'").fetchone()
    rehash_from(raw, first)


def _forge_keyed_from(raw: sqlite3.Connection, _: Path) -> None:
    _edit_grant_record(raw, _)
    rehash_from(raw, 1)
    raw.execute("UPDATE meta SET value = '1000000000' WHERE name = 'keyed_from'")


def _drop_key_record(raw: sqlite3.Connection, _: Path) -> None:
    (key_record,) = raw.execute("SELECT id FROM audit WHERE kind = 'key'").fetchone()
    raw.execute("DELETE FROM audit WHERE id = ?", (key_record,))
    raw.execute("UPDATE audit SET id = id - 1 WHERE id > ?", (key_record,))
    raw.execute("UPDATE meta SET value = '' WHERE name = 'audit_key_id'")
    raw.execute("UPDATE meta SET value = '0' WHERE name = 'keyed_from'")
    _edit_grant_record(raw, _)
    rehash_from(raw, 1)


def _swap_in_older_copy(_: sqlite3.Connection, db: Path) -> None:
    shutil.copy(db.with_name("old.db"), db)


def _drop_every_table(raw: sqlite3.Connection, _: Path) -> None:
    for table in [*_state_tables(raw), "meta"]:
        raw.execute(f"DROP TABLE {table}")
    raw.execute("DELETE FROM schema_version")


# name: (tampering, caught by `verify --audit-key` alone, what `serve` says when it refuses;
# None: it serves, and grants nothing twice).
TAMPERINGS: dict[str, tuple[Tamper, bool, str | None]] = {
    "delete-lease-row": (_delete_lease_row, False, None),
    "delete-middle-record": (_delete_middle_record, True, None),
    "delete-group-rows": (_delete_group_rows, False, None),
    "delete-audit-table": (_delete_audit_table, False, "its tables are damaged or gone"),
    "empty-state-tables": (_empty_state_tables, False, None),
    "empty-every-table": (_empty_every_table, False, "its keying state was edited"),
    "cut-tail": (_cut_tail, False, "below the anchored record"),
    "edit-lease-range": (_edit_lease_range, False, None),
    "edit-grant-record": (_edit_grant_record, True, None),
    "edit-seed": (_edit_seed, False, None),
    "forge-by-rehashing": (_forge_by_rehashing, True, "the chain was rewritten"),
    "forge-keyed-from": (_forge_keyed_from, True, "its keying state was edited"),
    "drop-key-record": (_drop_key_record, True, "is not keyed, but --audit-key was given"),
    "swap-in-older-copy": (_swap_in_older_copy, False, "below the anchored record"),
    "drop-every-table": (_drop_every_table, False, "no schema in it"),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_tampering_is_caught_and_never_granted_again(
    name: str, pristine: Pristine, tmp_path: Path
) -> None:
    tamper, forged, refusal = TAMPERINGS[name]
    db = tmp_path / "rngcoord.db"
    anchors = tmp_path / "rngcoord.db.anchors.jsonl"
    for source in ("rngcoord.db", "old.db"):
        _copy_store(pristine.folder / source, tmp_path / source)
    shutil.copy(pristine.folder / anchors.name, anchors)
    with sqlite3.connect(db, isolation_level=None) as raw:
        raw.execute("BEGIN")
        tamper(raw, db)
        raw.execute("COMMIT")
    raw.close()

    url = f"sqlite:///{db}"
    key = ("--audit-key", str(pristine.key))
    checked = run_cli("verify", "--db", url, *key, "--anchor", str(anchors))
    assert checked.returncode != 0, checked.stdout + checked.stderr
    if forged:
        alone = run_cli("verify", "--db", url, *key)
        assert alone.returncode != 0, f"a forgery passed verify --audit-key:\n{alone.stdout}"

    server = CoordinatorProcess(url, tmp_path / "server", args=key, init=False)
    if refusal is not None:
        with pytest.raises(RuntimeError, match="before it was ready") as refused:
            server.start()
        assert refusal in str(refused.value)
        assert "Traceback" not in str(refused.value)
        return
    server.start()
    try:
        _grants_nothing_twice(server, pristine.ends)
    finally:
        server.close()


def _grants_nothing_twice(server: CoordinatorProcess, ends: dict[str, int]) -> None:
    """Each group's next grant, in a new epoch, starts above everything granted before (or the
    server refuses it)."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for group, end in ends.items():
            try:
                joined = _join(stub, group, "again")
                lease = _reserve(stub, group, joined.epoch, 0)
            except grpc.RpcError as refused:
                assert refused.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ), refused
                continue
            assert lease.start >= end, f"group {group}: [{lease.start}, {lease.end}) again"


def test_serve_refuses_a_store_rolled_back_below_its_anchor_and_names_both(
    pristine: Pristine, tmp_path: Path
) -> None:
    _copy_store(pristine.folder / "old.db", tmp_path / "rngcoord.db")
    shutil.copy(pristine.folder / "rngcoord.db.anchors.jsonl", tmp_path)
    server = CoordinatorProcess(
        f"sqlite:///{tmp_path / 'rngcoord.db'}",
        tmp_path / "server",
        args=("--audit-key", str(pristine.key)),
        init=False,
    )
    with pytest.raises(RuntimeError) as refused:
        server.start()
    message = str(refused.value)
    assert "rngcoord.db.anchors.jsonl" in message and "ends at record" in message
    assert "below the anchored record" in message


def test_verify_names_a_stripped_keying(pristine: Pristine, tmp_path: Path) -> None:
    db = tmp_path / "rngcoord.db"
    _copy_store(pristine.folder / "rngcoord.db", db)
    with sqlite3.connect(db) as raw:
        _forge_keyed_from(raw, db)
    raw.close()
    checked = run_cli("verify", "--db", f"sqlite:///{db}", "--audit-key", str(pristine.key))
    assert checked.returncode == 1
    assert "keying state was edited" in checked.stdout
    assert GENESIS_HASH not in checked.stdout


def test_serve_checks_the_heads_it_is_given_as_well(pristine: Pristine, tmp_path: Path) -> None:
    # No anchor file this time (as on PostgreSQL by default): the head a client kept in its
    # checkpoint, given with --anchor, is what catches an older copy.
    _copy_store(pristine.folder / "old.db", tmp_path / "rngcoord.db")
    newest = json.loads(
        (pristine.folder / "rngcoord.db.anchors.jsonl").read_text().splitlines()[-1]
    )
    head = tmp_path / "checkpoint-head"
    head.write_text(f"{newest['store_id']}:{newest['id']}:{newest['hash']}:{newest['mac']}\n")
    args = ("--audit-key", str(pristine.key), "--anchor-file", str(tmp_path / "fresh.jsonl"))
    server = CoordinatorProcess(
        f"sqlite:///{tmp_path / 'rngcoord.db'}",
        tmp_path / "server",
        args=(*args, "--anchor", str(head)),
        init=False,
    )
    with pytest.raises(RuntimeError, match="below the anchored record") as refused:
        server.start()
    assert str(head) in str(refused.value)
    # Without the head, nothing tells this server that the copy is old.
    alone = CoordinatorProcess(
        f"sqlite:///{tmp_path / 'rngcoord.db'}", tmp_path / "alone", args=args, init=False
    )
    try:
        alone.start()
    finally:
        alone.close()


def test_serve_checks_every_anchor_not_only_the_newest(pristine: Pristine, tmp_path: Path) -> None:
    """A store that went back in time and then went on, as after a database failover that
    lost commits under a server that kept writing: its newest anchors match its chain, and
    only the older anchors of the lost records tell. serve finds the first of them."""
    db = tmp_path / "rngcoord.db"
    _copy_store(pristine.folder / "old.db", db)
    lost_anchors = (pristine.folder / "rngcoord.db.anchors.jsonl").read_text()
    lost_ids = [json.loads(line)["id"] for line in lost_anchors.splitlines()]
    lost_top = max(lost_ids)
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as raw:
        copy_head = raw.execute("SELECT last_id FROM audit_head").fetchone()[0]
    raw.close()
    assert copy_head < lost_top
    key = ("--audit-key", str(pristine.key))
    # The older copy is served, and anchored, by a server that never saw the lost anchors,
    # until its chain runs past them with records of its own.
    server = CoordinatorProcess(f"sqlite:///{db}", tmp_path / "server", args=key, init=False)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            epoch = _join(stub, "k", "m0").epoch
            for seq in range(lost_top + 2):
                _reserve(stub, "k", epoch, seq)
        _anchored(server, db)
        server.terminate()
    finally:
        server.close()
    anchor_file = db.with_name(db.name + ".anchors.jsonl")
    went_on = anchor_file.read_text()
    newest = json.loads(went_on.splitlines()[-1])
    assert newest["id"] > lost_top
    # The anchor file as a server that was there all along would have it: the anchors of the
    # lost records first, then those written after the failover.
    anchor_file.write_text(lost_anchors + went_on)
    restarted = CoordinatorProcess(f"sqlite:///{db}", tmp_path / "again", args=key, init=False)
    try:
        with pytest.raises(RuntimeError, match="the chain was rewritten from there") as refused:
            restarted.start()
    finally:
        restarted.close()
    message = str(refused.value)
    assert "rngcoord.db.anchors.jsonl" in message
    # The first anchor that disagrees is the lowest of the lost records', not the newest.
    first_lost = min(i for i in lost_ids if i > copy_head)
    assert f"(record {first_lost}, hash" in message
