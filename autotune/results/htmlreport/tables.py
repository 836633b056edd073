"""The report's per-trial tables: each launched trial's rate search as a strip of its probes on one
request-rate axis, and every trial with its flags, outcome and figures (the rows the charts link to)."""

from __future__ import annotations

import math

from autotune.results.htmlreport import svg
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.data import TrialRow
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
        "arrival rate "
        '(req/s): <span class="ok">●</span> met every SLO term, <span class="bad">●</span> did not, ▲ '
        "the "
        "saturation probe's measured capacity; the band is the estimated SLO boundary's interval, the "
        "diamond its estimate.</p>"
    )
    if not rows:
        return head + "<p>No probe was run yet.</p></section>"
    rates: list[float] = []
    for row in rows:
        for probe in row.probes:
            rate = probe.get("rate") if probe.get("rate") is not None else probe.get("capacity")
            if isinstance(rate, int | float):
                rates.append(float(rate))
        if row.rate_interval is not None:
            rates += [v for v in row.rate_interval if math.isfinite(v)]
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
            f'<td>{_strip(row, axis)}</td><td class="n">{rate_text(row.rate)}</td></tr>'
        )
    out.append("</table>")
    return head + "".join(out) + "</section>"


def _strip(row: TrialRow, axis: svg.Chart) -> str:
    """One trial's rate search on ``axis``'s rates: the boundary's interval as a band, each probe as a
    dot (its verdict's colour; the saturation probe a triangle at its capacity), the estimate a diamond."""
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
    for k, probe in enumerate(row.probes, start=1):
        why = str(probe.get("why", ""))
        if probe.get("saturation") or probe.get("rate") is None:
            cap = probe.get("capacity")
            if isinstance(cap, int | float):
                strip.point(
                    float(cap),
                    0.5,
                    css_class("infeasible"),
                    shape="triangle",
                    r=4.5,
                    title=f"probe {k}: saturation, capacity {rate_text(cap)} req/s: {why}",
                )
            continue
        passed = bool(probe.get("passed", probe.get("status") == "pass"))  # the short form: status
        strip.point(
            float(probe["rate"]),
            0.5,
            css_class("pass" if passed else "fail"),
            r=4.5,
            title=f"probe {k} at {rate_text(float(probe['rate']))} req/s: {why}",
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
    """Every trial: its flags, outcome, figures at the operating point, time taken and summary."""
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
        "outcome, "
        f"figures at the operating point (ms), summary</summary><table>{header}{''.join(body)}</table>"
        "</details></section>"
    )
