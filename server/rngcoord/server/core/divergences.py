"""Divergences: ranks of one epoch that disagree about the sequence of random ops.

A divergence is found at a *point* of the epoch: a lease seq whose key two members asked with
another size or fingerprint, or an attested op count whose fingerprints differ (docs/design.md
§6.1). The first time, the writer marks the epoch diverged (`epochs.diverged`, a JSON record)
and appends a `divergence` audit record; every later Reserve or Attest of the epoch is
refused. Members that speak at the same point afterwards are heard, not just refused: each
one's side is kept (`divergence_sides`, at most one row per rank, written only in a diverged
epoch), so the record and every refusal name all the ranks on each side, the rank that spoke
first, and the divergent side: the minority with three ranks or more, or on a tie every side
but the first speaker's. One bogus request from a holder of the job's token therefore names
that member, not the honest ranks that follow it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rngcoord.server.audit.chain import Chain
from rngcoord.server.core.membership import rank_list
from rngcoord.server.errors import Divergence
from rngcoord.server.storage import attestation_queries, queries
from rngcoord.server.storage.store import Tx

__all__ = ["HEARD", "Side", "add_side", "hears", "record", "record_ranks", "refusal", "summary"]


@dataclass(frozen=True, slots=True)
class Side:
    """What one rank sent at the point of a divergence.

    Args:
        rank: the rank.
        sent: what it sent, for people ("size=65536 fingerprint=3f9c...").
        actor: the token identity that sent it.
        peer: the address it came from.
    """

    rank: int
    sent: str
    actor: str
    peer: str


def lease_sent(size: int, fingerprint: bytes) -> str:
    return f"size={size} fingerprint={fingerprint.hex()}"


def attest_sent(fingerprint: bytes) -> str:
    return f"fingerprint={fingerprint.hex()}"


def hears(stored: str, at: str, rank: int) -> bool:
    """Whether a member of an epoch whose divergence was recorded as `stored` is to be heard,
    speaking at point `at` as `rank`: the divergence is at that point, the rank was not heard
    there yet, and fewer than `HEARD` ranks were. The cap bounds what a divergence costs at
    10^5 ranks: each rank heard re-derives the record from the sides, one write each."""
    try:
        data = json.loads(stored)
    except ValueError:
        return False
    if not isinstance(data, dict) or data.get("at") != at:
        return False
    heard = [r for ranks in data.get("sides", {}).values() for r in ranks]
    return rank not in heard and len(heard) < HEARD


def summary(stored: str | None) -> tuple[str | None, tuple[int, ...]]:
    """The message and every rank heard of an epoch's `diverged` column (None and () when it
    did not diverge)."""
    if stored is None:
        return None, ()
    try:
        data = json.loads(stored)
    except ValueError:
        return stored, ()
    if not isinstance(data, dict):
        return stored, ()
    sides: dict[str, list[int]] = data.get("sides", {})
    ranks = sorted(int(r) for listed in sides.values() for r in listed)
    return str(data.get("message", stored)), tuple(ranks)


def record_ranks(detail: dict[str, Any]) -> tuple[int, ...]:
    """The ranks a `divergence` audit record names: its rank, and the first speaker's."""
    first = detail.get("first")
    ranks = {int(detail["rank"])}
    if isinstance(first, dict):
        ranks.add(int(first["rank"]))
    return tuple(sorted(ranks))


def refusal(job: str, group: str, epoch: int, stored: str, rank: int | None = None) -> Divergence:
    """The refusal of a call in an epoch whose divergence was recorded as `stored`; with the
    caller's `rank`, it names the ranks that disagree with that rank."""
    try:
        data: dict[str, Any] = json.loads(stored)
    except ValueError:
        data = {"message": stored}
    message = str(data.get("message", stored))
    sides: dict[str, list[int]] = data.get("sides", {})
    disagree: list[int] = []
    if rank is not None:
        mine = next((sent for sent, ranks in sides.items() if rank in ranks), None)
        if mine is not None:
            disagree = sorted(r for sent, ranks in sides.items() if sent != mine for r in ranks)
            message += f" Disagreeing with rank {rank}: {_ranks(disagree)}."
    return Divergence(
        message,
        job=job,
        group=group,
        epoch=epoch,
        **{k: data[k] for k in ("seq", "anchor_seq", "ops") if k in data},
        ranks=rank_list(sorted(r for ranks in sides.values() for r in ranks)),
        first=data.get("first", ""),
        divergent=rank_list(data.get("divergent", [])),
        disagree=rank_list(disagree),
    )


def record(
    tx: Tx,
    chain: Chain,
    *,
    job: str,
    group: str,
    epoch: int,
    at: str,
    where: dict[str, int],
    first: Side,
    caller: Side,
    actor: str,
    now_us: int,
) -> Divergence:
    """Mark the epoch diverged at point `at` (located by `where`: a lease seq, or an attested
    op count) between the first speaker and the caller, and audit it, inside the writer's
    transaction; return the caller's refusal (raise it: `Divergence` keeps its writes)."""
    for side, is_first in ((first, True), (caller, False)):
        attestation_queries.insert_side(tx, job, group, epoch, at, side, is_first, now_us)
    stored = _rederive(
        tx,
        chain,
        job=job,
        group=group,
        epoch=epoch,
        at=at,
        where=where,
        caller=caller,
        actor=actor,
        now_us=now_us,
        detail={"first": _side_detail(first)},
    )
    return refusal(job, group, epoch, stored, caller.rank)


def add_side(
    tx: Tx,
    chain: Chain,
    *,
    job: str,
    group: str,
    epoch: int,
    at: str,
    where: dict[str, int],
    caller: Side,
    actor: str,
    now_us: int,
) -> Divergence:
    """Hear a member that speaks at the point of the epoch's divergence: keep its side (once
    per rank), re-derive the sides and audit the addition; return its refusal."""
    if attestation_queries.insert_side(tx, job, group, epoch, at, caller, False, now_us):
        stored = _rederive(
            tx,
            chain,
            job=job,
            group=group,
            epoch=epoch,
            at=at,
            where=where,
            caller=caller,
            actor=actor,
            now_us=now_us,
            detail={"heard": True},
        )
    else:
        row = queries.epoch_row(tx, job, group, epoch)
        stored = "" if row is None or row.diverged is None else row.diverged
    return refusal(job, group, epoch, stored, caller.rank)


def _rederive(
    tx: Tx,
    chain: Chain,
    *,
    job: str,
    group: str,
    epoch: int,
    at: str,
    where: dict[str, int],
    caller: Side,
    actor: str,
    now_us: int,
    detail: dict[str, object],
) -> str:
    """Re-derive the epoch's divergence record from every side heard, store it, and audit
    the caller's side (with `detail`); return the record."""
    stored = _summarise(tx, job, group, epoch, at, where)
    queries.set_diverged(tx, job, group, epoch, stored)
    chain.append(
        tx,
        ts_us=now_us,
        job=job,
        group=group,
        kind="divergence",
        actor=actor,
        detail={
            "epoch": epoch,
            **where,
            **detail,
            "rank": caller.rank,
            "sent": caller.sent,
            "peer": caller.peer,
        },
    )
    return stored


def _side_detail(side: Side) -> dict[str, object]:
    return {"rank": side.rank, "sent": side.sent, "actor": side.actor, "peer": side.peer}


HEARD = 256
"""The most ranks heard at a divergence's point: its record lists all of them, and the ranks
that ask later get the record as it stands."""


def _summarise(tx: Tx, job: str, group: str, epoch: int, at: str, where: dict[str, int]) -> str:
    """The epoch's divergence record, from every side heard at point `at`."""
    rows = attestation_queries.sides(tx, job, group, epoch, at)
    by_sent: dict[str, list[int]] = defaultdict(list)
    first_rank, first_sent = -1, ""
    for rank, sent, is_first in rows:
        by_sent[sent].append(rank)
        if is_first:
            first_rank, first_sent = rank, sent
    sizes = sorted((len(ranks) for ranks in by_sent.values()), reverse=True)
    # The majority stands; on a tie, the first speaker's side, as it is the stored one.
    stands = first_sent
    if len(sizes) > 1 and sizes[0] > sizes[1]:
        stands = max(by_sent, key=lambda sent: len(by_sent[sent]))
    divergent = sorted(r for sent, ranks in by_sent.items() if sent != stands for r in ranks)
    point = ", ".join(f"{k} {v}" for k, v in where.items())
    described = "; ".join(f"{_ranks(sorted(ranks))} sent {sent}" for sent, ranks in by_sent.items())
    message = (
        f"divergence in group {group!r} epoch {epoch} at {point}: {described}. Rank "
        f"{first_rank} spoke first; the divergent side: {_ranks(divergent)}. The ranks disagree "
        "about the sequence of random ops."
    )
    return json.dumps(
        {
            "message": message,
            "at": at,
            **where,
            "first": first_rank,
            "divergent": divergent,
            "sides": {sent: sorted(ranks) for sent, ranks in by_sent.items()},
        }
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"
