"""`rngcoord report`: one self-contained HTML file describing a job's history, for offline reading.

For each group of the job, a timeline drawn with matplotlib as SVG and inlined in the page (no
script, no external file: it opens offline and prints): the epochs as bands along the time
axis, the leases as bars along the offset axis against time, each Restore as a marker at its
cursor, each divergence as a line naming its ranks, each torchft quorum a replica recorded as a
dashed line naming its step, replicas and heal. Above them, a summary table. The store is
only read, and never created: a missing store is `StoreNotFound`, as for `rngcoord audit`.

The timelines stay readable and small at any number of grants: the leases of an epoch are
aggregated into at most `MAX_BARS` time buckets, each drawn as one bar from the lowest start to
the highest end of the leases granted in it (shaded by how many it holds).

matplotlib is an optional dependency (the `report` extra): the coordinator never imports this
module, and `write_report` raises `ReportUnavailable` naming the extra when it is missing.
"""

from __future__ import annotations

import html
import io
import itertools
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rngcoord.server.storage.store import Store
from rngcoord.server.web.views import GroupHistory, JobReport, LeasePoint, job_report
from rngcoord.v1.rules import MAX_OFFSET

__all__ = ["MAX_BARS", "ReportUnavailable", "render_report", "write_report"]

MAX_BARS = 400
"""Most lease bars drawn per epoch; more leases are aggregated into this many time buckets."""

_BAND_COLORS = ("#dde8f7", "#f7ecdd")
_LEASE_RGB = (0.12, 0.37, 0.75)


class ReportUnavailable(RuntimeError):
    """The report cannot be drawn here: matplotlib (the `report` extra) is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ReportUnavailable(
            "rngcoord report draws with matplotlib, which is not installed: "
            "pip install 'rngcoord[report]'"
        ) from exc
    # No display: the figures only become SVG text.
    matplotlib.use("Agg")
    # Text stays text in the SVG: smaller, selectable, searchable.
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    return plt


def write_report(store: Store, job: str, out: Path) -> JobReport:
    """Write the report of `job` in `store` to `out`; return what it drew.

    Raises:
        ValueError: the store has no job of that name.
        ReportUnavailable: matplotlib is missing.
        OSError: `out` cannot be written.
    """
    plt = _pyplot()
    report = store.read(lambda tx: job_report(tx, job, store.store_id))
    if report is None:
        raise ValueError(f"the store at {store.location} has no job {job!r}")
    out.write_text(render_report(report, plt), encoding="utf-8")
    return report


def render_report(report: JobReport, plt: Any) -> str:
    """The report's HTML: a summary table, then each group's timeline as inline SVG."""
    head_id, head_hash = report.head
    rows = "\n".join(_summary_row(g) for g in report.groups)
    sections = "\n".join(_group_section(i, g, plt) for i, g in enumerate(report.groups))
    e = html.escape
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>rngcoord report: {e(report.job)}</title>
<style>
  body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
  table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
  th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: left; }}
  th {{ background: #f2f2f2; }}
  td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
  .meta {{ color: #555; font-size: 0.9em; }}
  section.group {{ margin: 1.5em 0; }}
  section.group svg {{ max-width: 100%; height: auto; }}
</style>
</head>
<body>
<h1>rngcoord report: job <code>{e(report.job)}</code></h1>
<p class="meta">Store <code>{e(report.store_id)}</code>; audit head at record {head_id}
(<code>{e(head_hash)}</code>); written {_utc_s(datetime.now(UTC).timestamp() * 1e6)} UTC.
Offsets are Philox offsets in the group's stream; the usable space is [0, {MAX_OFFSET}].</p>
<h2>Summary</h2>
<table id="summary">
<tr><th>group</th><th>epochs</th><th>last world size</th><th>leases</th>
<th>high-water mark</th><th>offset space used</th><th>restores</th><th>divergences</th>
<th>first grant (UTC)</th><th>last grant (UTC)</th></tr>
{rows}
</table>
<h2>Timelines</h2>
<p class="meta">Bands: epochs. Bars: leases, the offsets each granted against the time it was
granted; with more than {MAX_BARS} leases in an epoch, one bar per time bucket spans the leases
granted in it (darker: more leases). Triangles: Restores, at the cursor they set. Red lines:
divergences.</p>
{sections}
</body>
</html>
"""


def _summary_row(g: GroupHistory) -> str:
    e = html.escape
    first = _utc_s(g.leases[0].created_us) if g.leases else "-"
    last = _utc_s(g.leases[-1].created_us) if g.leases else "-"
    world = g.epochs[-1].world_size if g.epochs else 0
    share = g.high_water / MAX_OFFSET
    return (
        f'<tr class="group-row" data-group="{e(g.group)}" data-epochs="{len(g.epochs)}" '
        f'data-restores="{len(g.restores)}"><td><code>{e(g.group)}</code></td>'
        f'<td class="num">{len(g.epochs)}</td><td class="num">{world}</td>'
        f'<td class="num">{len(g.leases)}</td><td class="num">{g.high_water}</td>'
        f'<td class="num">{share * 100:.3g}%</td><td class="num">{len(g.restores)}</td>'
        f'<td class="num">{len(g.divergences)}</td><td>{first}</td><td>{last}</td></tr>'
    )


def _group_section(index: int, g: GroupHistory, plt: Any) -> str:
    e = html.escape
    return (
        f'<section class="group" id="group-{index}" data-group="{e(g.group)}">\n'
        f"<h3>Group <code>{e(g.group)}</code></h3>\n{_timeline_svg(f'g{index}', g, plt)}\n"
        "</section>"
    )


def _timeline_svg(ids: str, g: GroupHistory, plt: Any) -> str:
    """The group's timeline as an <svg> element; its parts' ids start with `ids` (unique in
    the page): `-epoch-N`, `-lease-N-K` (bar K of epoch N), `-restore-N-SEQ`,
    `-divergence-K`, `-quorum-ID`."""
    times = [lease.created_us for lease in g.leases]
    times += [ep.created_us for ep in g.epochs]
    times += [r[0] for r in g.restores] + [d[0] for d in g.divergences]
    times += [q[0] for q in g.quorums]
    if not times:
        return '<p class="meta">No epoch formed in this group.</p>'
    t0 = min(times)
    t_end = max(times)
    unit, scale = _time_unit((t_end - t0) / 1e6)
    span = max((t_end - t0) / 1e6 / scale, 1e-3)

    def at(ts_us: float) -> float:
        return (ts_us - t0) / 1e6 / scale

    fig, ax = plt.subplots(figsize=(11, 3.6), dpi=96)
    try:
        for i, ep in enumerate(g.epochs):
            # The first band starts at the axis' left edge, a little before 0.
            left = at(ep.created_us) if i else min(at(ep.created_us), -span * 0.01)
            right = at(g.epochs[i + 1].created_us) if i + 1 < len(g.epochs) else span * 1.04
            ax.axvspan(
                left, right, color=_BAND_COLORS[i % 2], zorder=0, gid=f"{ids}-epoch-{ep.epoch}"
            )
            ax.text(
                left + (right - left) / 2,
                1.01,
                f"epoch {ep.epoch} ({ep.world_size} ranks)",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=9,
            )
        # A lease is a sliver of a long stream: each bar is at least a visible sliver.
        min_height = max(g.high_water, 1) * 0.006
        for ep in g.epochs:
            leases = [lease for lease in g.leases if lease.epoch == ep.epoch]
            bars = _draw_leases(ax, leases, at, span, min_height)
            for k, bar in enumerate(bars):
                bar.set_gid(f"{ids}-lease-{ep.epoch}-{k}")
        for ts_us, epoch, seq, cursor in g.restores:
            ax.plot(
                [at(ts_us)],
                [cursor],
                marker="v",
                color="black",
                markersize=9,
                zorder=4,
                gid=f"{ids}-restore-{epoch}-{seq}",
            )
            ax.annotate(
                f"restore: epoch {epoch} seq {seq} to {cursor}",
                (at(ts_us), cursor),
                textcoords="offset points",
                xytext=(6, 8),
                fontsize=8,
            )
        for k, (ts_us, epoch, ranks) in enumerate(g.divergences):
            ax.axvline(
                at(ts_us), color="#c00020", linewidth=1.5, zorder=5, gid=f"{ids}-divergence-{k}"
            )
            ax.text(
                at(ts_us),
                0.92,
                f" divergence: epoch {epoch}, ranks {', '.join(map(str, ranks))} ",
                transform=ax.get_xaxis_transform(),
                # Toward the middle, so that the text stays over the axes.
                ha="right" if at(ts_us) > span / 2 else "left",
                color="#c00020",
                fontsize=8,
            )
        for ts_us, quorum_id, step, participants, healed_from in g.quorums:
            ax.axvline(
                at(ts_us),
                color="#1f5fbf",
                linestyle="--",
                linewidth=1,
                zorder=3,
                gid=f"{ids}-quorum-{quorum_id}",
            )
            healed = f", healed from replica {healed_from}" if healed_from else ""
            ax.text(
                at(ts_us),
                0.80,
                f" quorum {quorum_id}: step {step}, {participants} replicas{healed} ",
                transform=ax.get_xaxis_transform(),
                ha="right" if at(ts_us) > span / 2 else "left",
                color="#1f5fbf",
                fontsize=8,
            )
        # A little room left of 0: the first lease's bar starts there.
        ax.set_xlim(-span * 0.01, span * 1.04)
        ax.set_ylim(bottom=0, top=max(g.high_water, 1) * 1.05)
        ax.set_xlabel(f"{unit} since {_utc_s(t0)} UTC")
        ax.set_ylabel("offset")
        ax.yaxis.set_major_formatter(_thousands(plt))
        ax.xaxis.set_major_formatter(_thousands(plt, digits=True))
        ax.grid(axis="y", color="#ddd", linewidth=0.5)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
    finally:
        plt.close(fig)
    svg = buf.getvalue()
    # The XML prolog and DOCTYPE belong to a file of its own, not to an inline element.
    return svg[svg.index("<svg") :]


def _draw_leases(
    ax: Any, leases: list[LeasePoint], at: Callable[[int], float], span: float, min_height: float
) -> list[Any]:
    """Draw `leases` (one epoch's) as at most MAX_BARS bars; return the bars."""
    if not leases:
        return []
    if len(leases) <= MAX_BARS:
        # One bar per lease, as wide as most gaps between grants allow (so that a job of a
        # few leases shows bars, not hairlines), and never narrower than 1/MAX_BARS of the
        # axis.
        xs = [at(lease.created_us) for lease in leases]
        gaps = sorted(b - a for a, b in itertools.pairwise(xs) if b > a)
        typical = gaps[len(gaps) // 2] * 0.8 if gaps else span / 40
        bars = ax.bar(
            xs,
            [max(lease.end - lease.start, min_height) for lease in leases],
            bottom=[lease.start for lease in leases],
            width=min(max(typical, span / MAX_BARS), span / 40),
            align="edge",
            color=_LEASE_RGB,
            linewidth=0,
            zorder=3,
        )
        return list(bars)
    first, last = at(leases[0].created_us), at(leases[-1].created_us)
    width = max((last - first) / MAX_BARS, 1e-9)
    lows: list[float] = [float("inf")] * MAX_BARS
    highs: list[float] = [0.0] * MAX_BARS
    counts = [0] * MAX_BARS
    for lease in leases:
        i = min(int((at(lease.created_us) - first) / width), MAX_BARS - 1)
        lows[i] = min(lows[i], lease.start)
        highs[i] = max(highs[i], lease.end)
        counts[i] += 1
    most = max(counts)
    xs, bottoms, heights, colors = [], [], [], []
    for i, n in enumerate(counts):
        if n:
            xs.append(first + i * width)
            bottoms.append(lows[i])
            heights.append(max(highs[i] - lows[i], min_height))
            colors.append((*_LEASE_RGB, 0.35 + 0.65 * n / most))
    bars = ax.bar(
        xs, heights, bottom=bottoms, width=width, align="edge", color=colors, linewidth=0, zorder=3
    )
    return list(bars)


def _time_unit(span_s: float) -> tuple[str, float]:
    """The time axis' unit for a timeline `span_s` seconds long, and its length in seconds:
    a job of a few seconds reads in seconds (or milliseconds), a week-long one in hours."""
    if span_s < 2:
        return "milliseconds", 1e-3
    if span_s < 300:
        return "seconds", 1.0
    if span_s < 3 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def _thousands(plt: Any, *, digits: bool = False) -> Any:
    """A tick formatter with thousands separators (offsets reach 2^64, times 10^5 ms)."""

    def fmt(value: float, _pos: int) -> str:
        if digits and value != int(value):
            return f"{value:,.1f}"
        return f"{value:,.0f}"

    return plt.FuncFormatter(fmt)


def _utc_s(ts_us: float) -> str:
    return datetime.fromtimestamp(ts_us / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S")
