"""How the status page and its JSON API present what they show: groups in sections by state,
audit records as one-line summaries (ranges and columns in plain sight, hashes on hover), and
times, ages and shares as people read them. The page's Jinja filters are `utc`, `ago` and
`percent`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rngcoord.server.web.views import GroupView, group_state
from rngcoord.v1.types import AuditRecord

__all__ = ["IDLE_AFTER_S", "ago", "by_state", "percent", "record_json", "utc"]


IDLE_AFTER_S = 60.0
"""A group that has not been heard from for this long is idle (see views.group_state)."""

_STATE_ORDER = ("active", "idle", "finished")


def by_state(
    groups: list[GroupView], now_us: int
) -> list[tuple[str, list[tuple[str, str, int, list[tuple[GroupView, str]]]]]]:
    """The jobs under each state (active, idle, finished), newest activity first: (state,
    [(job, job state, last activity µs, [(group, group state)])]). A job is as awake as its
    most awake group."""
    jobs: dict[str, list[tuple[GroupView, str]]] = {}
    for g in groups:
        jobs.setdefault(g.job, []).append((g, group_state(g, now_us, IDLE_AFTER_S)))
    sections: dict[str, list[tuple[str, str, int, list[tuple[GroupView, str]]]]] = {
        state: [] for state in _STATE_ORDER
    }
    for job, members in jobs.items():
        state = min((s for _, s in members), key=_STATE_ORDER.index)
        last = max(g.last_activity_us for g, _ in members)
        members.sort(key=lambda m: (_STATE_ORDER.index(m[1]), -m[0].last_activity_us))
        sections[state].append((job, state, last, members))
    for listed in sections.values():
        listed.sort(key=lambda j: (-j[2], j[0]))
    return [(state, sections[state]) for state in _STATE_ORDER]


# Shown in their own columns (epoch, range) or only on hover (long hex and seeds).
_COLUMNS = frozenset({"epoch", "start", "end", "cursor", "floor"})


_HOVER_ONLY = ("seed", "fingerprint", "digest", "hash", "key_id")


def _offset_range(detail: dict[str, Any]) -> str:
    start, end = detail.get("start"), detail.get("end")
    if isinstance(start, int) and isinstance(end, int):
        return f"{start:,}\u2013{end:,}"
    if isinstance(detail.get("cursor"), int):
        return f"→ {detail['cursor']:,}"
    if isinstance(start, int):
        return f"from {start:,}"
    if isinstance(detail.get("floor"), int):
        return f"floor {detail['floor']:,}"
    return ""


def _summary(detail: dict[str, Any]) -> str:
    parts = []
    for key, value in sorted(detail.items()):
        if key in _COLUMNS or any(word in key for word in _HOVER_ONLY):
            continue
        if isinstance(value, list):
            value = ",".join(map(str, value[:8])) + ("…" if len(value) > 8 else "")
        parts.append(f"{key.replace('_', ' ')} {value}")
    return ", ".join(parts)


def record_json(r: AuditRecord) -> dict[str, Any]:
    detail = r.detail
    epoch = detail.get("epoch")
    hover = [f"record {r.id}", f"hash {r.hash}", f"prev {r.prev_hash}"]
    hover += [f"{k} {v}" for k, v in sorted(detail.items())]
    return {
        "id": r.id,
        "time": utc(r.ts_us),
        "job": r.job,
        "group": r.group,
        "kind": r.kind,
        "actor": r.actor,
        "epoch": epoch if isinstance(epoch, int) else None,
        "range": _offset_range(detail),
        "summary": _summary(detail),
        "title": "\n".join(hover),
        "detail": " ".join(f"{k}={v}" for k, v in sorted(detail.items())),
    }


def utc(ts_us: int | None) -> str:
    if not ts_us:
        return "-"
    return datetime.fromtimestamp(ts_us / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def ago(seconds: float) -> str:
    """'4 s ago', '12 min ago', '3 h ago', '2 d ago'."""
    if seconds < 1:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def percent(share: float) -> str:
    if share == 0:
        return "0%"
    # A training job uses a sliver of 2^64: three significant digits show that it moves.
    return f"{share * 100:.3g}%"
