"""The report's latency section: per-request TTFT and TPOT of the chosen config and of vLLM's defaults at
their operating points, read from their probe files, as cumulative distributions against the SLO limits
and as a table."""

from __future__ import annotations

from collections.abc import Sequence

from autotune.inputs.loader import LoadedStudy
from autotune.results.htmlreport import svg
from autotune.results.htmlreport.charts import legend
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.data import Latencies, operating_probe, read_latencies
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
