"""Offline verification of a store: the audit chain and docs/design.md §2.1 (no offset reused).

`verify(store)` checks, against one snapshot of the chain's head:
- every record's hash recomputes from its contents, each `prev_hash` is its predecessor's
  hash, ids run 1, 2, ... without gaps, and `audit_head` names the last record;
- every lease row has a grant record with the same range, and every grant record a lease row;
- within each group no two grants overlap, except a grant at or after a Restore: a grant whose
  (epoch, seq) is at or after a restore record of the same epoch that precedes it in the
  chain may reuse offsets.

Problems are reported as sentences naming the records; `VerifyReport.ok` is True when there
are none. `rngcoord verify` prints the report.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rngcoord.server import audit
from rngcoord.server.store import Store, Tx, from_db

__all__ = ["VerifyReport", "verify"]

_PAGE = 1000


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of `verify`.

    Args:
        ok: True when no problem was found.
        records: audit records checked.
        grants: grant records among them.
        groups: groups in the store.
        problems: one sentence per problem, naming the records involved.
    """

    ok: bool
    records: int
    grants: int
    groups: int
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: what was checked and whether it held."""
        counts = f"{self.records} records, {self.grants} grants in {self.groups} groups"
        if self.ok:
            return f"ok: {counts}, chain intact, no overlaps"
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
    groups: int
    leases: dict[tuple[str, str, int, int], tuple[int, int]]


def _snapshot(tx: Tx) -> _Snapshot:
    head = tx.fetchone("SELECT last_id, last_hash FROM audit_head WHERE id = 1")
    last_id, last_hash = (0, audit.GENESIS_HASH) if head is None else (int(head[0]), head[1])
    count = tx.fetchone("SELECT COUNT(*) FROM groups")
    leases = {
        (job, grp, int(epoch), int(seq)): (from_db(start), from_db(end))
        for job, grp, epoch, seq, start, end in tx.fetchall(
            'SELECT job, grp, epoch, seq, start, "end" FROM leases'
        )
    }
    return _Snapshot(last_id, last_hash, 0 if count is None else int(count[0]), leases)


def _grant(record: audit.AuditRecord) -> _Grant:
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


def verify(store: Store, *, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check the audit chain and that no two grants of a group overlap without a Restore.

    Records appended after the check began are left for the next run.

    Args:
        store: the store to check; it is only read.
        progress: called after each page of records with (records checked, records in all),
            for long chains. Default None.
    """
    snap = store.read(_snapshot)
    problems: list[str] = []
    grants: list[_Grant] = []
    # (job, group) -> [(record id, epoch, seq)] of restore records, in chain order.
    restores: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    expected_id, prev_hash, checked = 1, audit.GENESIS_HASH, 0
    while expected_id <= snap.last_id:
        page = store.read(
            functools.partial(audit.fetch_page, after_id=expected_id - 1, limit=_PAGE)
        )
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
            recomputed = audit.record_hash(
                id=rec.id,
                ts_us=rec.ts_us,
                job=rec.job,
                group=rec.group,
                kind=rec.kind,
                actor=rec.actor,
                detail=rec.detail,
                prev_hash=rec.prev_hash,
            )
            if recomputed != rec.hash:
                problems.append(f"record {rec.id}: its hash does not match its contents")
            if rec.kind == "grant":
                try:
                    grants.append(_grant(rec))
                except (KeyError, TypeError, ValueError) as exc:
                    problems.append(f"record {rec.id}: malformed grant detail ({exc!r})")
            elif rec.kind == "restore":
                try:
                    restores[rec.job, rec.group].append(
                        (rec.id, int(rec.detail["epoch"]), int(rec.detail["seq"]))
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    problems.append(f"record {rec.id}: malformed restore detail ({exc!r})")
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
    problems += _check_leases(grants, snap.leases)
    problems += _check_overlaps(grants, restores)
    return VerifyReport(not problems, checked, len(grants), snap.groups, problems)


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
