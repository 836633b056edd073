"""The report's per-trial tables: each launched trial's rate search as a strip of its probes on one
request-rate axis, and every trial with its flags, outcome and figures (the rows the charts link to)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from autotune.results.htmlreport import svg
from autotune.results.htmlreport.charts import legend
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.data import ProbeMark, TrialRow, probe_marks
from autotune.results.htmlreport.fmt import (
    dashed,
    duration_text,
    esc,
    interval_text,
    ms,
    rate_text,
    tok,
    trial_link,
)
from autotune.results.htmlreport.style import css_class

STRIP_WIDTH = 600
"""The rate searches' strips and their shared axis, in pixels."""


def searches_section(ctx: ReportContext) -> str:
    """Each launched trial's probes by arrival rate, its boundary estimate and interval."""
    rows = [r for r in ctx.rows if r.launched and r.probes]
    head = (
        '<section id="searches"><h2>Each trial\'s rate search</h2><p class="note-text">Probes by '
        "arrival rate (req/s), each coloured by its verdict; the band is the estimated SLO boundary's "
        "interval, the diamond its estimate. A probe's tooltip says why it passed or failed.</p>"
        + legend(
            [
                ("circle", css_class("pass"), "met every SLO term"),
                ("circle", css_class("fail"), "missed a term (or stopped early, or over-saturated)"),
                (
                    "triangle",
                    css_class("saturation"),
                    "saturation probe (every request at once), at its measured capacity",
                ),
                ("diamond", css_class("complete"), "estimated SLO boundary"),
            ]
        )
    )
    if not rows:
        return head + "<p>No probe was run yet.</p></section>"
    marks = {row.number: probe_marks(row) for row in rows}
    rates: list[float] = []
    for row in rows:
        rates += [v for m in marks[row.number] for v in (m.rate, m.capacity) if v is not None]
        if row.rate_interval is not None:
            rates += [v for v in row.rate_interval if math.isfinite(v)]
    rates = [r for r in rates if math.isfinite(r)]
    axis = svg.Chart.over(STRIP_WIDTH, 34, [*rates, 0.0], [0.0, 1.0], xzero=True, label="request rate axis")
    axis.y = svg.Scale(0.0, 1.0, 4, 6)
    out = [
        f'<table class="strip"><tr><th>trial</th><th>outcome</th><th>{_axis_only(axis)}</th>'
        '<th class="n">estimate req/s</th></tr>'
    ]
    for row in rows:
        tag = " ★" if ctx.is_pick(row) else ""
        tag += " (defaults)" if row.baseline else ""
        out.append(
            f"<tr><td>{trial_link(row.number)}{tag}</td><td>{esc(row.outcome)}</td>"
            f'<td>{_strip(row, marks[row.number], axis)}</td><td class="n">{rate_text(row.rate)}</td></tr>'
        )
    out.append("</table>")
    return head + "".join(out) + "</section>"


def _strip(row: TrialRow, marks: Sequence[ProbeMark], axis: svg.Chart) -> str:
    """One trial's rate search on ``axis``'s rates: the boundary's interval as a band, each probe as a
    dot in its verdict's colour (the saturation probe a triangle at its capacity, or at the axis' end when
    its capacity was not stored), the estimate a diamond."""
    strip = svg.Chart(
        STRIP_WIDTH, 22, axis.x, svg.Scale(0.0, 1.0, 18, 4), label=f"rate search of trial {row.number}"
    )
    if row.rate_interval is not None:
        strip.hspan(
            row.rate_interval[0],
            row.rate_interval[1],
            0.5,
            "est",
            title=f"boundary interval {rate_text(row.rate_interval[0])}–"
            f"{rate_text(row.rate_interval[1])} req/s",
        )
    for mark in marks:
        strip.point(
            _mark_rate(mark, axis),
            0.5,
            f"{css_class(mark.verdict)} probe-{mark.verdict}",
            shape="triangle" if mark.saturation else "circle",
            r=4.5,
            title=_mark_title(mark),
        )
    if row.rate is not None:
        strip.point(
            row.rate,
            0.5,
            css_class("complete"),
            shape="diamond",
            r=4.0,
            title=f"estimated boundary {rate_text(row.rate)} req/s"
            + (f", {row.binding} binds" if row.binding else ""),
        )
    return strip.render(axes=False)


def _mark_rate(mark: ProbeMark, axis: svg.Chart) -> float:
    """Where ``mark`` goes on the rate axis: its rate, the saturation probe's capacity, or (a capacity not
    stored) the axis' right end, the side of an unbounded rate."""
    if mark.rate is not None:
        return mark.rate
    return mark.capacity if mark.capacity is not None else axis.x.hi


def _mark_title(mark: ProbeMark) -> str:
    """A probe's tooltip: which probe, at what rate, and its verdict with why (the stored reason, or one
    built from what is stored)."""
    if mark.rate is not None:
        where = f"at {rate_text(mark.rate)} req/s"
    elif mark.capacity is not None:
        where = f"saturation (every request at once), capacity {rate_text(mark.capacity)} req/s"
    else:
        where = "saturation (every request at once), capacity not recorded"
    return f"probe {mark.index} {where}: {mark.why}"


def _axis_only(axis: svg.Chart) -> str:
    """The strips' shared request-rate axis: its ticks and grid lines alone."""
    ticks = "".join(
        f'<text class="tick" x="{axis.x(v):.1f}" y="14" text-anchor="middle">{svg.fmt(v)}</text>'
        f'<line class="grid" x1="{axis.x(v):.1f}" x2="{axis.x(v):.1f}" y1="18" y2="30"/>'
        for v in axis.x.ticks(8)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{axis.width}" height="30" viewBox="0 0 '
        f'{axis.width} 30" '
        f'role="img" aria-label="request rate (req/s)">{ticks}</svg>'
    )


def trials_section(ctx: ReportContext) -> str:
    """Every trial: its flags, outcome, latencies (at the reference load where it was probed there), time
    taken and summary."""
    names = ctx.params
    header = (
        "<tr><th>trial</th><th>outcome</th>"
        + "".join(f"<th>{esc(dashed(n))}</th>" for n in names)
        + '<th class="n">SLO tok/s</th><th>interval</th><th class="n">req/s</th><th class="n">TTFT '
        "p95</th>"
        '<th class="n">TPOT p95</th><th class="n">E2EL p99</th><th '
        'class="n">took</th><th>summary</th></tr>'
    )
    body = []
    for row in ctx.rows:
        cls = ""
        if ctx.is_pick(row):
            cls = ' class="pick"'
        elif row.baseline:
            cls = ' class="base"'
        summary = row.summary if len(row.summary) <= 140 else row.summary[:137] + "…"
        body.append(
            f'<tr id="trial-{row.number}"{cls}>'
            f"<td>{row.number}{' (defaults)' if row.baseline else ''}</td>"
            f"<td>{esc(row.outcome)}</td>"
            + "".join(f"<td>{esc(row.flags.get(n, '-'))}</td>" for n in names)
            + f'<td class="n">{tok(row.slo_throughput)}</td><td>{interval_text(row.interval)}</td>'
            f'<td class="n">{rate_text(row.operating_rate)}</td>'
            + "".join(
                f'<td class="n">{ms(row.latency.get(k))}</td>' for k in ("ttft:p95", "tpot:p95", "e2el:p99")
            )
            + f'<td class="n">{duration_text(row.seconds)}</td><td '
            f'title="{esc(row.summary)}">{esc(summary)}</td></tr>'
        )
    return (
        f'<section id="trials"><h2>All trials</h2><details><summary>{len(ctx.rows)} trials: flags, '
        "outcome, latencies at the reference load, else at the operating point (ms), summary</summary>"
        f"<table>{header}{''.join(body)}</table>"
        "</details></section>"
    )
