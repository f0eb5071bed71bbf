"""Floors: offsets below which new groups never start, after a store was lost.

A coordinator that lost its store knows nothing of what it granted; a new store would start
every stream at offset 0 again, and a job with a fixed seed would draw the same random numbers
twice. `rngcoord serve --init --floor-from FILE` records floors in the new store first, so
that each group, when it is created there, starts above everything the lost store granted it
(docs/design.md §2.11).

FILE is either

- an audit export, `rngcoord audit --json` lines (taken from the lost store while it lived,
  by a backup or `rngcoord audit --json --follow`): each group's floor is the highest offset
  its records name (grant ends, epoch starts, restore cursors, earlier floors); or
- a high-water file, `JOB GROUP OFFSET` lines, where `*` as GROUP means every group of JOB
  and `* *` every group of every job (for when only an upper bound is known).

Blank lines and `#` comments are skipped in both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from rngcoord.server.audit.chain import Chain
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import Store, Tx
from rngcoord.v1.rules import MAX_OFFSET, RuleViolation, check_name

__all__ = ["apply_floors", "read_floors"]

_OFFSET_FIELDS = ("end", "start", "cursor", "floor", "high_water")


def read_floors(path: str | Path) -> dict[tuple[str, str], int]:
    """{(job, group): floor} from an audit export or a high-water file; "" stands for `*`.

    Raises:
        OSError: the file cannot be read.
        ValueError: naming the file and line of the first line that is neither.
    """
    floors: dict[tuple[str, str], int] = {}

    def raise_to(job: str, group: str, offset: int) -> None:
        floors[job, group] = max(offset, floors.get((job, group), 0))

    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{lineno}"
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                    job, group, detail = record["job"], record["group"], record["detail"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{where}: not an audit record ({exc})") from None
                if not job or not isinstance(detail, dict):
                    continue  # a record of no group (a key change)
                offsets = [
                    v for k in _OFFSET_FIELDS if isinstance(v := detail.get(k), int) and v >= 0
                ]
                if offsets:
                    raise_to(job, group or "", max(offsets))
                continue
            parts = line.split()
            if len(parts) != 3:
                raise ValueError(
                    f"{where}: expected an audit record (JSON) or 'JOB GROUP OFFSET', got "
                    f"{len(parts)} fields"
                )
            job, group, text = parts
            try:
                offset = int(text, 0)
            except ValueError:
                raise ValueError(f"{where}: offset {text[:40]!r} is not an integer") from None
            if not 0 <= offset <= MAX_OFFSET:
                raise ValueError(f"{where}: offset {offset} is outside [0, 2^64)")
            if job == "*" and group != "*":
                raise ValueError(f"{where}: a job of '*' needs a group of '*' too")
            for field, name in (("job", job), ("group", group)):
                if name != "*":
                    try:
                        check_name(field, name)
                    except RuleViolation as exc:
                        raise ValueError(f"{where}: {exc}") from None
            raise_to("" if job == "*" else job, "" if group == "*" else group, offset)
    return floors


def apply_floors(
    store: Store,
    chain: Chain,
    floors: Mapping[tuple[str, str], int],
    *,
    now_us: int,
    actor: str,
) -> None:
    """Record `floors` in `store` (raising, never lowering, what it holds), each with a
    `floor` audit record.

    Raises:
        ValueError: a group named already exists below its floor: it was created before the
            floor and has granted from there; the message says what to do.
    """

    def write(tx: Tx) -> None:
        for (job, group), floor in sorted(floors.items()):
            if job and group:
                g = queries.group_row(tx, job, group)
                if g is not None and g.high_water < floor:
                    raise ValueError(
                        f"group {group!r} of job {job!r} already exists in this store with "
                        f"high-water mark {g.high_water}, below its floor {floor}: floors only "
                        "apply to groups created after them; use a new job name for it"
                    )
            if queries.floor_of(tx, job, group) >= floor:
                continue
            queries.insert_floor(tx, job, group, floor)
            chain.append(
                tx,
                ts_us=now_us,
                job=job,
                group=group,
                kind="floor",
                actor=actor,
                detail={"floor": floor},
            )

    store.write(write)
