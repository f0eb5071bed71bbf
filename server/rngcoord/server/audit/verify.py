"""Offline verification of a store: the audit chain, its anchors, and docs/design.md §2.1 (no
offset reused).

`verify(store, key=..., anchors=...)` checks, against one snapshot of the chain's head:

- **the chain**: every record's hash recomputes from its contents (an HMAC under the audit key
  from the record the chain was keyed at, so a record edited or forged and the chain rehashed
  after it is caught), each `prev_hash` is its predecessor's hash, ids run 1, 2, ... without
  gaps, and `audit_head` names the last record;
- **the anchors** (`--anchor FILE`: lines a server wrote, or heads a client kept): each is
  signed by the key, names this store, and its record is in the chain with its hash, so a
  chain truncated below an anchor, or rewritten before it, is caught;
- **the tables against the chain**, which every state change records: the job seeds; the
  group seeds (also against their derivation from the job seed); the epochs (start, world
  size, the digest of the member set, which is recomputed from the member rows); the high-water
  mark of every group (the end of its last grant, its floor, or a failover gap's end); every
  restore row; every floor; every lease row and grant record, one for one;
- **no overlap**: within each group no two grants overlap, except a grant at or after a
  Restore: a grant whose (epoch, seq) is at or after a restore record of the same epoch that
  precedes it in the chain may reuse offsets.

Notes say what the checks cannot see: a tail cut without an anchor given, each `rewind`
record (records a failover lost) and each `failover-gap` record (the offsets it lost, which
epochs formed since start past).

Problems are sentences naming the first record or row that disagrees; `VerifyReport.ok` is
True when there are none. `rngcoord verify` prints the report.
"""

from __future__ import annotations

import functools
import hmac
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rngcoord.server.audit.anchors import lost_in_rewind, rewound_range
from rngcoord.server.audit.chain import (
    GENESIS_HASH,
    Chain,
    fetch_page,
    key_id,
    keying_problem,
    read_meta,
)
from rngcoord.server.storage.store import Store, Tx, from_db
from rngcoord.v1.seeds import group_seed
from rngcoord.v1.types import AuditRecord, members_digest

__all__ = ["UNANCHORED_NOTE", "VerifyReport", "verify"]

_PAGE = 1000

UNANCHORED_NOTE = (
    "no anchor was given, so a chain cut at its tail looks intact: an older copy put back, or "
    "a database failover to a standby that lacked the last commits (docs/operations.md), "
    "loses records and the grants they made without a trace in what is left. Pass --anchor "
    "with the server's anchor file, or with the audit head a client's checkpoint kept"
)
"""What `verify` says when it was given no anchor."""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of `verify`.

    Args:
        ok: True when no problem was found.
        records: audit records checked.
        grants: grant records among them.
        groups: groups in the store.
        problems: one sentence per problem, naming the records or rows involved.
        notes: what could not be checked, and why (for example, no audit key given).
        anchored: whether anchors were checked: without one, a chain cut at its tail looks
            intact (`UNANCHORED_NOTE`).
    """

    ok: bool
    records: int
    grants: int
    groups: int
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    anchored: bool = False

    def summary(self) -> str:
        """One line: what was checked and whether it held."""
        counts = f"{self.records} records, {self.grants} grants in {self.groups} groups"
        if self.ok:
            tail = "" if self.anchored else "; its tail unchecked (no --anchor)"
            return f"ok: {counts}, chain intact, no overlaps{tail}"
        return f"FAILED: {len(self.problems)} problems in {counts}"


@dataclass(frozen=True, slots=True)
class _Grant:
    record: int
    job: str
    group: str
    epoch: int
    seq: int
    start: int
    end: int

    def describe(self) -> str:
        return (
            f"grant record {self.record} (group {self.group!r} epoch {self.epoch} seq "
            f"{self.seq}, [{self.start}, {self.end}))"
        )


@dataclass(frozen=True, slots=True)
class _Snapshot:
    last_id: int
    last_hash: str
    meta: dict[str, str]
    jobs: dict[str, int]
    groups: dict[tuple[str, str], tuple[int, int]]  # seed, high_water
    epochs: dict[tuple[str, str, int], tuple[int, int, bytes]]  # world_size, start, digest
    leases: dict[tuple[str, str, int, int], tuple[int, int]]
    restores: dict[tuple[str, str, int, int], int]
    digests: dict[tuple[str, str, int], bytes]
    floors: dict[tuple[str, str], int]


def _snapshot(tx: Tx) -> _Snapshot:
    head = tx.fetchone("SELECT last_id, last_hash FROM audit_head WHERE id = 1")
    last_id, last_hash = (0, GENESIS_HASH) if head is None else (int(head[0]), head[1])
    digests: dict[tuple[str, str, int], bytes] = {}
    current: tuple[str, str, int] | None = None
    ranks: list[tuple[int, str]] = []
    # Member rows in key order, one epoch after another: each epoch's digest is recomputed as
    # the coordinator computed it when the epoch formed.
    for job, grp, epoch, rank, member_id in tx.fetchall(
        "SELECT job, grp, epoch, rank, member_id FROM members ORDER BY job, grp, epoch, rank"
    ):
        key = (job, grp, int(epoch))
        if key != current:
            if current is not None:
                digests[current] = members_digest(ranks)
            current, ranks = key, []
        ranks.append((int(rank), member_id))
    if current is not None:
        digests[current] = members_digest(ranks)
    return _Snapshot(
        last_id=last_id,
        last_hash=last_hash,
        meta=read_meta(tx),
        jobs={job: from_db(seed) for job, seed in tx.fetchall("SELECT job, seed FROM jobs")},
        groups={
            (job, grp): (from_db(seed), from_db(high))
            for job, grp, seed, high in tx.fetchall("SELECT job, grp, seed, high_water FROM groups")
        },
        epochs={
            (job, grp, int(epoch)): (int(world), from_db(start), bytes(digest))
            for job, grp, epoch, world, start, digest in tx.fetchall(
                "SELECT job, grp, epoch, world_size, start, members_digest FROM epochs"
            )
        },
        leases={
            (job, grp, int(epoch), int(seq)): (from_db(start), from_db(end))
            for job, grp, epoch, seq, start, end in tx.fetchall(
                'SELECT job, grp, epoch, seq, start, "end" FROM leases'
            )
        },
        restores={
            (job, grp, int(epoch), int(seq)): from_db(cursor)
            for job, grp, epoch, seq, cursor in tx.fetchall(
                'SELECT job, grp, epoch, seq, "cursor" FROM restores'
            )
        },
        digests=digests,
        floors={
            (job, grp): from_db(floor)
            for job, grp, floor in tx.fetchall("SELECT job, grp, floor FROM floors")
        },
    )


def _grant(record: AuditRecord) -> _Grant:
    d: dict[str, Any] = record.detail
    return _Grant(
        record.id,
        record.job,
        record.group,
        int(d["epoch"]),
        int(d["seq"]),
        int(d["start"]),
        int(d["end"]),
    )


def verify(
    store: Store,
    *,
    key: bytes | None = None,
    anchors: Iterable[Mapping[str, Any]] = (),
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check the audit chain, the anchors, the tables against the chain, and that no two
    grants of a group overlap without a Restore.

    Records appended after the check began are left for the next run.

    Args:
        store: the store to check; it is only read.
        key: the audit key. Default None: a keyed chain's MACs are not checked (a note says
            so), and neither are anchors' signatures.
        anchors: anchors to check the chain against (see `anchors.read_anchors`). Default
            none.
        progress: called after each page of records with (records checked, records in all),
            for long chains. Default None.
    """
    snap = store.read(_snapshot)
    problems: list[str] = []
    notes: list[str] = []
    keyed_from = (
        int(snap.meta.get("keyed_from", "0")) if snap.meta.get("keyed_from", "0").isdigit() else -1
    )
    store_key = snap.meta.get("audit_key_id", "")
    store_id = snap.meta.get("store_id", "")
    if key is not None and store_key and key_id(key) != store_key:
        problems.append(
            f"the key given (key id {key_id(key)}) is not the store's (key id {store_key})"
        )
        key = None
    if key is not None and not store_key:
        problems.append(
            "an audit key was given, but the chain is not keyed (meta names no key): its "
            "keying was stripped and its records rehashed without the key, or it was never "
            "keyed"
        )
        key = None
    if store_key and key is None:
        notes.append(
            f"records from {keyed_from} on are MACed under key id {store_key}: their MACs and the "
            "anchors' signatures were not checked (pass --audit-key)"
        )
    chain = Chain(store_id, key, keyed_from if key is not None else 0)
    if key is not None:
        keying = store.read(lambda tx: keying_problem(tx, chain))
        if keying is not None:
            problems.append(keying)

    grants: list[_Grant] = []
    # (job, group) -> [(record id, epoch, seq)] of restore records, in chain order.
    restores: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    derived = _Derived()
    rewinds: list[tuple[int, int]] = []  # record ids (lo, hi] that a rewind record says were lost
    hashes: dict[int, str] = {}
    anchor_list = list(anchors)
    wanted = {int(a["id"]) for a in anchor_list if isinstance(a.get("id"), int)}
    expected_id, prev_hash, checked = 1, GENESIS_HASH, 0
    while expected_id <= snap.last_id:
        page = store.read(functools.partial(fetch_page, after_id=expected_id - 1, limit=_PAGE))
        page = [r for r in page if r.id <= snap.last_id]
        if not page:
            break
        for rec in page:
            if rec.id != expected_id:
                problems.append(f"records {expected_id} to {rec.id - 1} are missing")
            if rec.prev_hash != prev_hash:
                problems.append(
                    f"record {rec.id}: prev_hash {rec.prev_hash[:16]}... does not match the "
                    f"hash {prev_hash[:16]}... of the record before it"
                )
            unchecked = store_key and key is None and rec.id >= keyed_from
            if not unchecked and chain.record_hash(rec) != rec.hash:
                what = "MAC" if key is not None and rec.id >= keyed_from else "hash"
                problems.append(f"record {rec.id}: its {what} does not match its contents")
            if rec.id in wanted:
                hashes[rec.id] = rec.hash
            try:
                derived.take(rec)
                if rec.kind == "grant":
                    grants.append(_grant(rec))
                elif rec.kind == "restore":
                    restores[rec.job, rec.group].append(
                        (rec.id, int(rec.detail["epoch"]), int(rec.detail["seq"]))
                    )
                elif rec.kind == "failover-gap":
                    notes.append(_gap_note(rec))
                elif rec.kind == "rewind":
                    rewinds.append(rewound_range(rec.detail))
                    notes.append(_rewind_note(rec))
            except (KeyError, TypeError, ValueError) as exc:
                problems.append(f"record {rec.id}: malformed {rec.kind} detail ({exc!r})")
            expected_id, prev_hash = rec.id + 1, rec.hash
            checked += 1
        if progress is not None:
            progress(checked, snap.last_id)
    if expected_id - 1 != snap.last_id or prev_hash != snap.last_hash:
        problems.append(
            f"audit_head says the chain ends at record {snap.last_id} with hash "
            f"{snap.last_hash[:16]}..., but it ends at record {expected_id - 1} with hash "
            f"{prev_hash[:16]}..."
        )
    problems += _check_anchors(anchor_list, chain, store_id, snap.last_id, hashes, key, rewinds)
    problems += derived.compare(snap)
    problems += _check_leases(grants, snap.leases)
    problems += _check_overlaps(grants, restores)
    if not anchor_list:
        notes.append(UNANCHORED_NOTE)
    return VerifyReport(
        not problems, checked, len(grants), len(snap.groups), problems, notes, bool(anchor_list)
    )


def _rewind_note(rec: AuditRecord) -> str:
    lo, hi = rewound_range(rec.detail)
    return (
        f"record {rec.id}: the store went back in time: a server had seen record {hi} "
        f"committed, and the chain then ended at record {lo} (a failover that lost commits); "
        f"records {lo + 1} to {hi} as they were are gone, with what they granted, and anchors "
        "naming them are not counted against the chain. Epochs formed since start past "
        "what their members reported (failover-gap records)"
    )


def _gap_note(rec: AuditRecord) -> str:
    d = rec.detail
    lo, hi = int(d["from"]), int(d["to"])
    return (
        f"record {rec.id}: failover gap in job {rec.job!r} group {rec.group!r}: offsets "
        f"[{lo}, {hi}) were granted before and lost by the store (a failover that lost "
        f"commits), as rank {int(d['rank'])} (member {str(d['member_id'])!r}) reported when it "
        "joined; the group's high-water mark moved past them, so epochs formed since start "
        "past them"
    )


class _Derived:
    """What the tables must hold, re-derived from the chain's records."""

    def __init__(self) -> None:
        self.jobs: dict[str, tuple[int, int]] = {}  # job -> (seed, record)
        self.groups: dict[tuple[str, str], tuple[int, int]] = {}  # -> (seed, record)
        self.epochs: dict[tuple[str, str, int], tuple[int, int, str, int]] = {}
        self.high: dict[tuple[str, str], tuple[int, int]] = {}  # -> (high water, record)
        self.restores: dict[tuple[str, str, int, int], tuple[int, int]] = {}  # -> cursor, record
        self.floors: dict[tuple[str, str], int] = {}

    def take(self, rec: AuditRecord) -> None:
        d = rec.detail
        key = (rec.job, rec.group)
        if rec.kind == "job":
            self.jobs[rec.job] = (int(d["seed"]), rec.id)
        elif rec.kind == "group":
            self.groups[key] = (int(d["seed"]), rec.id)
            floor = int(d.get("floor", 0))
            if floor:
                self._raise(key, floor, rec.id)
        elif rec.kind == "epoch":
            self.epochs[(rec.job, rec.group, int(d["epoch"]))] = (
                int(d["world_size"]),
                int(d["start"]),
                str(d.get("members_digest", "")),
                rec.id,
            )
        elif rec.kind == "grant":
            self._raise(key, int(d["end"]), rec.id)
        elif rec.kind == "restore":
            self.restores[(rec.job, rec.group, int(d["epoch"]), int(d["seq"]))] = (
                int(d["cursor"]),
                rec.id,
            )
        elif rec.kind == "floor":
            self.floors[key] = int(d["floor"])
        elif rec.kind == "failover-gap":
            self._raise(key, int(d["to"]), rec.id)

    def _raise(self, key: tuple[str, str], value: int, record: int) -> None:
        if value > self.high.get(key, (0, 0))[0]:
            self.high[key] = (value, record)

    def compare(self, snap: _Snapshot) -> list[str]:
        problems: list[str] = []
        for job, seed in sorted(snap.jobs.items()):
            found = self.jobs.get(job)
            if found is None:
                problems.append(f"jobs row {job!r} has no job record")
            elif found[0] != seed:
                problems.append(
                    f"jobs row {job!r}: seed {seed}, but its job record {found[1]} says {found[0]}"
                )
        for (job, group), (seed, high) in sorted(snap.groups.items()):
            found = self.groups.get((job, group))
            job_seed = self.jobs.get(job, (None, 0))[0]
            name = f"groups row (job {job!r} group {group!r})"
            if found is None:
                problems.append(f"{name} has no group record")
            elif found[0] != seed:
                problems.append(
                    f"{name}: seed {seed}, but its group record {found[1]} says {found[0]}"
                )
            elif job_seed is not None and group_seed(job_seed, group) != seed:
                problems.append(
                    f"{name}: seed {seed} is not the one derived from the job's root seed "
                    f"({group_seed(job_seed, group)})"
                )
            expected, record = self.high.get((job, group), (0, 0))
            if high != expected:
                where = f"record {record}" if record else "no grant"
                problems.append(
                    f"{name}: high_water {high}, but the chain's grants end at {expected} ({where})"
                )
        for (job, group, epoch), (world, start, digest) in sorted(snap.epochs.items()):
            name = f"epochs row (group {group!r} epoch {epoch})"
            found_epoch = self.epochs.get((job, group, epoch))
            if found_epoch is None:
                problems.append(f"{name} has no epoch record")
                continue
            rec_world, rec_start, rec_digest, record = found_epoch
            if (world, start) != (rec_world, rec_start):
                problems.append(
                    f"{name}: world size {world} start {start}, but its epoch record {record} "
                    f"says {rec_world} and {rec_start}"
                )
            if rec_digest and (
                digest.hex() != rec_digest
                or snap.digests.get((job, group, epoch), b"").hex() != rec_digest
            ):
                problems.append(
                    f"{name}: its members are not the set its epoch record {record} names "
                    f"(digest {rec_digest[:16]}...)"
                )
        for (job, group, epoch, seq), cursor in sorted(snap.restores.items()):
            name = f"restores row (group {group!r} epoch {epoch} seq {seq})"
            found_restore = self.restores.get((job, group, epoch, seq))
            if found_restore is None:
                problems.append(f"{name} has no restore record")
            elif found_restore[0] != cursor:
                problems.append(
                    f"{name}: cursor {cursor}, but its restore record {found_restore[1]} says "
                    f"{found_restore[0]}"
                )
        for (job, group), floor in sorted(snap.floors.items()):
            name = f"floors row (job {job!r} group {group!r})"
            if self.floors.get((job, group)) != floor:
                said = self.floors.get((job, group))
                problems.append(
                    f"{name}: floor {floor}, but "
                    + ("no floor record names it" if said is None else f"its record says {said}")
                )
        return problems


def _check_anchors(
    anchors: list[Mapping[str, Any]],
    chain: Chain,
    store_id: str,
    last_id: int,
    hashes: dict[int, str],
    key: bytes | None,
    rewinds: list[tuple[int, int]],
) -> list[str]:
    problems: list[str] = []
    for anchor in anchors:
        where = f"anchor {anchor.get('source', '?')}"
        record_id, record_hash = anchor.get("id"), anchor.get("hash")
        if not isinstance(record_id, int) or not isinstance(record_hash, str):
            problems.append(f"{where}: malformed ({dict(anchor)!r})")
            continue
        if anchor.get("store_id") != store_id:
            problems.append(f"{where} is of store {anchor.get('store_id')}, not {store_id}")
            continue
        if key is not None:
            mac = chain.anchor_mac(record_id, record_hash)
            if not hmac.compare_digest(mac, str(anchor.get("mac", ""))):
                problems.append(f"{where}: its signature does not match (forged or another key)")
                continue
        if hashes.get(record_id) != record_hash and lost_in_rewind(record_id, rewinds):
            continue  # a record the store lost, as a rewind record says (a note names it)
        if record_id > last_id:
            problems.append(
                f"{where} names record {record_id}, but the chain ends at record {last_id}: "
                "records were removed from its tail"
            )
        elif hashes.get(record_id) != record_hash:
            problems.append(
                f"{where}: record {record_id} has hash {str(hashes.get(record_id))[:16]}..., "
                f"not the anchored {record_hash[:16]}...: the chain was rewritten"
            )
    return problems


def _check_leases(
    grants: list[_Grant], leases: dict[tuple[str, str, int, int], tuple[int, int]]
) -> list[str]:
    problems: list[str] = []
    by_key: dict[tuple[str, str, int, int], _Grant] = {}
    for g in grants:
        key = (g.job, g.group, g.epoch, g.seq)
        if key in by_key:
            problems.append(f"{g.describe()} repeats the key of grant record {by_key[key].record}")
            continue
        by_key[key] = g
        lease = leases.get(key)
        if lease is None:
            problems.append(f"{g.describe()} has no lease row")
        elif lease != (g.start, g.end):
            problems.append(f"{g.describe()} does not match its lease row [{lease[0]}, {lease[1]})")
    for (job, group, epoch, seq), (start, end) in sorted(leases.items()):
        if (job, group, epoch, seq) not in by_key:
            problems.append(
                f"lease (job {job!r} group {group!r} epoch {epoch} seq {seq}, [{start}, {end})) "
                "has no grant record"
            )
    return problems


def _check_overlaps(
    grants: list[_Grant], restores: dict[tuple[str, str], list[tuple[int, int, int]]]
) -> list[str]:
    def restored(g: _Grant) -> bool:
        return any(
            rid < g.record and epoch == g.epoch and seq <= g.seq
            for rid, epoch, seq in restores.get((g.job, g.group), ())
        )

    by_group: dict[tuple[str, str], list[_Grant]] = defaultdict(list)
    for g in grants:
        by_group[g.job, g.group].append(g)
    problems: list[str] = []
    for group_grants in by_group.values():
        # Sweep by start: `active` holds the grants that reach past the current start, so each
        # overlapping pair is seen once.
        active: list[_Grant] = []
        for g in sorted(group_grants, key=lambda g: (g.start, g.end, g.record)):
            active = [a for a in active if a.end > g.start]
            for a in active:
                earlier, later = (a, g) if a.record < g.record else (g, a)
                if not restored(later):
                    problems.append(
                        f"{later.describe()} overlaps {earlier.describe()} and no earlier "
                        "restore allows it"
                    )
            active.append(g)
    return problems
