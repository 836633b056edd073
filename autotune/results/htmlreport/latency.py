"""The report's latency sections: per-request TTFT and TPOT of the chosen config and of vLLM's defaults at
their operating points, read from their probe files, as cumulative distributions against the SLO limits
and as a table; and their latency against load (each SLO term's statistic at each probed arrival rate, from
the trials' stored curves), as GuideLLM draws it."""

from __future__ import annotations

from collections.abc import Sequence

from autotune.inputs.loader import LoadedStudy
from autotune.results.htmlreport import svg
from autotune.results.htmlreport.charts import legend
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.data import (
    Latencies,
    LoadCurve,
    TrialRow,
    load_curve,
    operating_probe,
    read_latencies,
)
from autotune.results.htmlreport.fmt import esc, ms, rate_text, trial_link
from autotune.results.htmlreport.style import css_class
from autotune.units import format_figure


def latency_section(ctx: ReportContext) -> str:
    """The chosen config's and the defaults' latency distributions (one side when they are the same)."""
    head = (
        '<section id="latency"><h2>Latency of the chosen config and the defaults</h2>'
        '<p class="note-text">Per-request TTFT and TPOT at each one\'s operating point (the judged '
        "requests "
        "of its highest passing probe), as cumulative distributions; the dashed red line is the SLO "
        "limit.</p>"
    )
    sides, missing = _sides(ctx)
    if not sides:
        note = (
            f"Probe files not found on this host for {', '.join(missing)}."
            if missing
            else "Nothing measured yet."
        )
        return head + f"<p>{esc(note)}</p></section>"
    charts = [
        _distribution(ctx, sides, metric, attr) for metric, attr in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"))
    ]
    table = _latency_table(sides, ctx.loaded)
    key = legend([("square", css_class(cls), label) for label, cls, _ in sides])
    note = (
        f'<p class="small note-text">Not found on this host: {esc(", ".join(missing))}.</p>'
        if missing
        else ""
    )
    return head + key + f'<div class="grid2">{"".join(charts)}</div>' + table + note + "</section>"


def _sides(ctx: ReportContext) -> tuple[list[tuple[str, str, Latencies]], list[str]]:
    """((label, CSS class, latencies) of the pick and the defaults whose probe files are here, the trials
    whose probe files are not)."""
    sides: list[tuple[str, str, Latencies]] = []
    missing = []
    same = ctx.pick is not None and ctx.base is not None and ctx.pick.number == ctx.base.number
    chosen = "chosen: the vLLM defaults" if same else "chosen"
    for label, cls, row in ((chosen, "pick", ctx.pick), ("vLLM defaults", "default", ctx.base)):
        if row is None or row.state != "complete":
            continue
        if sides and sides[0][2].trial == row.number:
            continue
        path = operating_probe(ctx.loaded, row)
        found = read_latencies(row.number, path) if path is not None else None
        if found is None:
            missing.append(f"trial {row.number} ({label})")
            continue
        sides.append((label, cls, found))
    return sides, missing


def _distribution(
    ctx: ReportContext, sides: Sequence[tuple[str, str, Latencies]], metric: str, attr: str
) -> str:
    """One metric's (``ttft``) cumulative distributions, a step line per side, its SLO limits dashed."""
    series = [(label, cls, getattr(lat, attr)) for label, cls, lat in sides]
    values = [v for _, _, vs in series for v in vs]
    limits = [t for t in ctx.spec.slo.terms if t.metric == metric]
    xs = values + [t.limit_s * 1000 for t in limits]
    chart = svg.Chart.over(
        520,
        300,
        xs,
        [0.0, 1.0],
        xzero=True,
        xlabel=f"{metric.upper()} (ms)",
        ylabel="fraction of requests",
        label=f"{metric} distribution",
    )
    chart.y = svg.Scale(0.0, 1.0, chart.y.start, chart.y.end)
    for term in limits:
        limit_ms = term.limit_s * 1000
        chart.vline(limit_ms, "slo", f"{term.statistic} ≤ {format_figure(limit_ms, 'ms')}")
    for _, cls, vs in series:
        chart.line(svg.ecdf(vs), css_class(cls), step=True)
    return chart.render()


def _latency_table(sides: Sequence[tuple[str, str, Latencies]], loaded: LoadedStudy) -> str:
    """The latency section's table: each side's rate, requests, TTFT and TPOT p50/p95, probe file."""
    q = svg.quantile
    rows = [
        '<table><tr><th>config</th><th>trial</th><th class="n">req/s</th><th class="n">requests</th>'
        '<th class="n">TTFT p50</th><th class="n">TTFT p95</th><th class="n">TPOT p50</th>'
        '<th class="n">TPOT p95</th><th>probe file</th></tr>'
    ]
    for label, _, lat in sides:
        rows.append(
            f"<tr><td>{esc(label)}</td><td>{trial_link(lat.trial)}</td>"
            f'<td class="n">{rate_text(lat.rate)}</td>'
            f'<td class="n">{len(lat.ttft_ms)}</td><td class="n">{ms(q(lat.ttft_ms, 0.5))}</td>'
            f'<td class="n">{ms(q(lat.ttft_ms, 0.95))}</td><td class="n">{ms(q(lat.tpot_ms, 0.5))}</td>'
            f'<td class="n">{ms(q(lat.tpot_ms, 0.95))}</td>'
            f"<td><code>{esc(_relative(lat.path, loaded))}</code></td></tr>"
        )
    return "".join(rows) + "</table>"


def _relative(path: object, loaded: LoadedStudy) -> str:
    """``path`` relative to the study's workdir when under it."""
    text = str(path)
    base = str(loaded.workdir)
    return text[len(base) + 1 :] if text.startswith(base + "/") else text


TERM_SHAPES = ("circle", "square", "triangle", "diamond", "cross")
"""The marker of each SLO term on the latency-against-load chart, in the spec's order."""


def load_section(ctx: ReportContext) -> str:
    """The chosen config's and the defaults' SLO terms against the arrival rate, one line per config and
    term, the terms' limits as dashed lines (one side when they are the same trial)."""
    head = (
        '<section id="load"><h2>Latency against load</h2><p class="note-text">Each SLO term\'s '
        "statistic at each arrival rate the rate search probed (the probes that ran their course), for the "
        "chosen config and the defaults; the dashed red lines are the SLO limits. Latency is on a log "
        "scale.</p>"
    )
    sides = _load_sides(ctx)
    if not sides:
        return (
            head + "<p>No probe of the chosen config or the defaults measured every term yet.</p></section>"
        )
    terms = _terms(ctx, sides)
    limits = _limits_ms(ctx)
    rates = [rate for _, _, curve in sides for rate, _ in curve.points]
    values = [v for _, _, curve in sides for _, vs in curve.points for v in vs]
    chart = svg.Chart.over(
        720,
        380,
        [*rates, 0.0],
        values + [limits[t] for t in terms if t in limits],
        ylog=True,
        xzero=True,
        xlabel="request rate (req/s)",
        ylabel="latency (ms)",
        label="latency against load of the chosen config and the defaults",
    )
    for term in terms:
        if term in limits:
            chart.hline(limits[term], "slo", f"{term_label(term)} ≤ {format_figure(limits[term], 'ms')}")
    entries: list[tuple[str, str, str]] = []
    for label, cls, curve in sides:
        for term in terms:
            if term not in curve.terms:
                continue
            shape = TERM_SHAPES[terms.index(term) % len(TERM_SHAPES)]
            i = curve.terms.index(term)
            points = [(rate, vs[i]) for rate, vs in curve.points]
            chart.line(points, css_class(cls) + (" dash" if terms.index(term) % 2 else ""))
            for rate, value in points:
                over = " (over its limit)" if term in limits and value > limits[term] else ""
                chart.point(
                    rate,
                    value,
                    css_class(cls),
                    shape=shape,
                    r=4.0,
                    href=f"#trial-{curve.trial}",
                    title=f"trial {curve.trial} ({label}): {term_label(term)} "
                    f"{format_figure(value, 'ms')} at {rate_text(rate)} req/s{over}",
                )
            entries.append((shape, css_class(cls), f"{label} (trial {curve.trial}): {term_label(term)}"))
    return head + legend(entries) + chart.render() + "</section>"


def _load_sides(ctx: ReportContext) -> list[tuple[str, str, LoadCurve]]:
    """(label, CSS class, curve) of the pick and of the defaults, each that stored a curve."""
    same = ctx.pick is not None and ctx.base is not None and ctx.pick.number == ctx.base.number
    chosen = "chosen: the vLLM defaults" if same else "chosen"
    sides: list[tuple[str, str, LoadCurve]] = []
    pairs: tuple[tuple[str, str, TrialRow | None], ...] = (
        (chosen, "pick", ctx.pick),
        ("vLLM defaults", "default", ctx.base),
    )
    for label, cls, row in pairs:
        if row is None or any(curve.trial == row.number for _, _, curve in sides):
            continue
        curve = load_curve(row)
        if curve is not None:
            sides.append((label, cls, curve))
    return sides


def _terms(ctx: ReportContext, sides: Sequence[tuple[str, str, LoadCurve]]) -> list[str]:
    """The terms the curves measured: the spec's order first, then any other a curve holds."""
    held = [t for _, _, curve in sides for t in curve.terms]
    ordered = [t.key for t in ctx.spec.slo.terms if t.key in held]
    return list(dict.fromkeys([*ordered, *held]))


def _limits_ms(ctx: ReportContext) -> dict[str, float]:
    """Each SLO term's tightest limit in milliseconds, by its key (``ttft:p95``)."""
    out: dict[str, float] = {}
    for term in ctx.spec.slo.terms:
        limit = term.limit_s * 1000
        out[term.key] = min(out.get(term.key, limit), limit)
    return out


def term_label(key: str) -> str:
    """A term's key for people: ``ttft:p95`` → ``p95 TTFT``."""
    metric, _, stat = key.partition(":")
    return f"{stat} {metric.upper()}" if stat else metric.upper()
