"""Audit records as `rngcoord audit` prints them: an aligned table for people, JSON lines for
tools."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TextIO

from rngcoord.server.audit.chain import AuditRecord

__all__ = ["audit_json", "print_table"]

_TABLE_SAMPLE = 1000
_MAX_COLUMN = 40
_MIN_DETAIL = 24
_COLUMNS = 5
_INDENT = 4


def audit_json(rec: AuditRecord) -> dict[str, object]:
    """One audit record as a JSON-ready dict; `detail` stays an object, `time` is added."""
    return {
        "id": rec.id,
        "ts_us": rec.ts_us,
        "time": _format_time(rec.ts_us),
        "job": rec.job,
        "group": rec.group,
        "kind": rec.kind,
        "actor": rec.actor,
        "detail": rec.detail,
        "prev_hash": rec.prev_hash,
        "hash": rec.hash,
    }


def print_table(
    records: Iterable[AuditRecord],
    out: TextIO,
    *,
    width: int = 0,
    then: Iterable[AuditRecord] | None = None,
) -> None:
    """Print records as an aligned table: ID, TIME, JOB, GROUP, KIND, then DETAIL followed by
    "by ACTOR".

    Column widths come from the first rows of `records` (capped). Nothing is ever cut: a cell
    longer than its column, and the DETAIL column, wrap onto the record's next lines; the
    actor (who did it, identity first) starts a line of its own when the record wraps, and a
    word longer than the line is printed whole. When the width leaves DETAIL too little room
    beside the other columns, DETAIL and the actor go on indented lines under the record.

    Args:
        records: the records to print.
        out: where to print.
        width: the line width to fit; 0 for none (one line per record). Default 0.
        then: records to print after `records`, as they come (`--follow`), at the same
            widths. Default None: "no audit records match" when `records` is empty.
    """
    it = iter(records)
    sample: list[tuple[str, ...]] = []
    for rec in it:
        sample.append(_row(rec))
        if len(sample) == _TABLE_SAMPLE:
            break
    if not sample and then is None:
        print("no audit records match", file=out)
        return
    header: tuple[str, ...] = ("ID", "TIME (UTC)", "JOB", "GROUP", "KIND", "DETAIL, by ACTOR", "")
    widths = [max(len(r[i]) for r in [header, *sample]) for i in range(_COLUMNS)]
    # Names wrap inside their columns rather than leave DETAIL no room.
    cap = _MAX_COLUMN if not width else max(8, min(_MAX_COLUMN, width // 6))
    widths[2:] = [min(cap, w) for w in widths[2:]]
    prefix = sum(w + 2 for w in widths)
    # Too narrow for a DETAIL column beside the others: DETAIL goes under them, indented.
    below = bool(width) and width - prefix < _MIN_DETAIL
    detail = 0 if not width else (width - _INDENT if below else width - prefix)
    if below:
        header = (*header[:_COLUMNS], "", "")
    print(_format_row(header, widths, detail, below), file=out, flush=True)
    for row in sample:
        print(_format_row(row, widths, detail, below), file=out)
    for rec in it:
        print(_format_row(_row(rec), widths, detail, below), file=out)
    if then is not None:
        out.flush()
        for rec in then:
            print(_format_row(_row(rec), widths, detail, below), file=out, flush=True)


def _row(rec: AuditRecord) -> tuple[str, ...]:
    detail = " ".join(
        f"{k}={v if isinstance(v, str | int) else json.dumps(v, separators=(',', ':'))}"
        for k, v in sorted(rec.detail.items())
    )
    when = datetime.fromtimestamp(rec.ts_us / 1e6, UTC)
    return (
        str(rec.id),
        when.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
        rec.job,
        rec.group,
        rec.kind,
        detail,
        f"by {rec.actor}" if rec.actor else "",
    )


def _format_row(row: tuple[str, ...], widths: list[int], detail: int, below: bool) -> str:
    """A record's lines: its cells side by side, each wrapped to its column; then DETAIL and
    "by ACTOR" in a last column (or, `below`, on lines of their own under the record),
    wrapped to `detail` characters (0: not wrapped)."""
    cells = [_wrap(row[i], w, split_words=True) for i, w in enumerate(widths)]
    parts = [part for part in row[-2:] if part]
    if detail:
        last = [line for part in parts for line in _wrap(part, detail)]
    else:
        last = ["  ".join(parts)]
    if not below:
        cells.append(last or [""])
    lines = []
    for n in range(max(len(c) for c in cells)):
        texts = []
        for i, cell in enumerate(cells):
            text = cell[n] if n < len(cell) else ""
            if i < len(widths):
                text = text.rjust(widths[i]) if i == 0 else text.ljust(widths[i])
            texts.append(text)
        lines.append("  ".join(texts).rstrip())
    if below:
        lines += [" " * _INDENT + line for line in last]
    return "\n".join(lines)


def _wrap(text: str, width: int, *, split_words: bool = False) -> list[str]:
    """`text` in lines of at most `width` characters, whole: words longer than `width` are
    split only with `split_words` (names), else kept whole on a line of their own."""
    if len(text) <= width or not text:
        return [text]
    return textwrap.wrap(text, width, break_long_words=split_words, break_on_hyphens=False) or [
        text
    ]


def _format_time(ts_us: int) -> str:
    return datetime.fromtimestamp(ts_us / 1e6, UTC).isoformat(timespec="milliseconds")
