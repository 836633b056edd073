"""The report's charts of the whole study: the Pareto front, best so far against launches and wall time,
where every launch went, the failure map by two flags, and the signed parameter importances (each a
section of the page, drawn from :class:`~autotune.results.htmlreport.context.ReportContext`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from autotune.inputs.spec import CategoricalParam, FloatParam, IntParam, objective_unit
from autotune.results.htmlreport import svg
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.data import TrialRow
from autotune.results.htmlreport.fmt import dashed, esc, fmt_pair, interval_text
from autotune.results.htmlreport.style import COLOURS, css_class
from autotune.units import format_figure

PREFERRED_MAP = ("gpu_memory_utilization", "max_num_seqs")
"""The failure map's axes when the space has both (memory asked against concurrency)."""


def legend(items: Sequence[tuple[str, str, str]]) -> str:
    """A chart's legend: (shape, CSS class, text) per entry."""
    return (
        '<p class="legend">'
        + "".join(f"<span>{svg.swatch(shape, cls)}{esc(text)}</span>" for shape, cls, text in items)
        + "</p>"
    )


# -- the Pareto front ------------------------------------------------------------------------------


def front_section(ctx: ReportContext) -> str:
    """Every measured config by the two objectives (or the first and TTFT), the front joined by a line."""
    xlabel, ylabel, xi, yi = _axes_of_front(ctx)
    points = []
    for row in ctx.rows:
        if row.state != "complete" or not row.values:
            continue
        x = row.values[xi] if xi is not None else row.latency.get("ttft:p95")
        if x is None:
            continue
        points.append((row, x, row.values[yi]))
    head = (
        '<section id="front"><h2>Pareto front</h2><p class="note-text">Every measured config: the front '
        "(no other config is better on both objectives while meeting the SLOs) is joined by a line; "
        "bars are the SLO-constrained throughput's interval.</p>"
    )
    if not points:
        return head + "<p>No trial was measured yet.</p></section>"
    intervals = yi == 0 and ctx.spec.objectives[0].metric == "slo_throughput"
    ys = [y for _, _, y in points]
    if intervals:
        ys += [r.interval[0] for r, _, _ in points if r.interval]
        ys += [r.interval[1] for r, _, _ in points if r.interval and math.isfinite(r.interval[1])]
    chart = svg.Chart.over(
        720,
        380,
        [x for _, x, _ in points],
        ys,
        xlabel=xlabel,
        ylabel=ylabel,
        yzero=True,
        label="Pareto front of the measured configs",
    )
    if intervals:
        for row, x, _ in points:
            if row.interval:
                chart.span(
                    x,
                    row.interval[0],
                    row.interval[1],
                    "err",
                    title=f"trial {row.number}: interval {interval_text(row.interval)} tok/s",
                )
    front = sorted((x, y) for row, x, y in points if row.number in ctx.front)
    chart.line(front, css_class("front"))
    for row, x, y in points:
        _front_point(ctx, chart, row, (x, y), (xlabel, ylabel))
    key = legend(
        [
            ("star", css_class("pick"), "chosen"),
            ("square", css_class("default"), "vLLM defaults"),
            ("circle", css_class("complete"), "met the SLOs"),
            ("circle", css_class("infeasible"), "missed an SLO"),
        ]
    )
    return head + key + chart.render() + "</section>"


def _front_point(
    ctx: ReportContext, chart: svg.Chart, row: TrialRow, at: tuple[float, float], labels: tuple[str, str]
) -> None:
    """One config's mark on the front's chart: the pick a star, the defaults a square."""
    x, y = at
    cls, shape, r = css_class("infeasible"), "circle", 4.0
    if row.feasible:
        cls = css_class("complete")
    if row.number in ctx.front:
        r = 5.0
    if row.baseline:
        cls, shape, r = css_class("default"), "square", 6.0
    if ctx.is_pick(row):
        cls, shape, r = css_class("pick"), "star", 6.0
    extra = " (SLOs missed)" if not row.feasible else ""
    chart.point(
        x,
        y,
        cls,
        r=r,
        shape=shape,
        href=f"#trial-{row.number}",
        title=f"trial {row.number}{extra}: {fmt_pair(labels[0], x, labels[1], y)}",
    )


def _axes_of_front(ctx: ReportContext) -> tuple[str, str, int | None, int]:
    """(x label, y label, x objective index or None for TTFT p95, y index); latency read at the study's
    reference load when its trials have one."""
    objectives = ctx.spec.objectives
    ylabel = objective_label(objectives[0].metric)
    rates = {r.reference_rate for r in ctx.rows if r.reference_rate is not None}
    where = f" at {rates.pop():.2f} req/s" if len(rates) == 1 else " at the operating point"
    if len(objectives) > 1:
        latency = ":" in objectives[1].metric
        return objective_label(objectives[1].metric, where if latency else ""), ylabel, 1, 0
    return f"p95 TTFT{where} (ms)", ylabel, None, 0


def objective_label(metric: str, where: str = "") -> str:
    """An objective's axis label, ``where`` it was read and its unit: ``SLO-constrained throughput
    (tok/s)``, ``p95 TTFT at 8.49 req/s (ms)``."""
    if metric == "slo_throughput":
        name = "SLO-constrained throughput"
    elif ":" in metric:
        latency, stat = metric.split(":", 1)
        name = f"{stat} {latency.upper()}"
    else:
        name = metric.replace("_", " ")
    unit = objective_unit(metric)
    return f"{name}{where} ({unit})" if unit else f"{name}{where}"


# -- progress --------------------------------------------------------------------------------------


def progress_section(ctx: ReportContext) -> str:
    """Best so far against launches and against wall time, each launch's own result as a dot."""
    prog = ctx.progress
    metric = ctx.spec.objectives[0].metric
    head = (
        '<section id="progress"><h2>Best so far</h2><p class="note-text">The best feasible '
        f"{esc(metric)} after each launch (the line), each launch's own result "
        "(dots), against launches and against wall time.</p>"
    )
    if not prog.by_launch:
        return head + "<p>No launch met the SLOs yet.</p></section>"
    ylabel = objective_label(metric)
    unit = objective_unit(metric)
    base = ctx.base
    base_value = base.values[0] if base is not None and base.feasible and base.values else None
    ys = [v for _, _, v, _ in prog.values] + ([base_value] if base_value is not None else [])
    minutes = prog.hours < 2
    scale = 60.0 if minutes else 1.0
    charts = []
    for by_time in (False, True):
        curve = prog.by_time if by_time else prog.by_launch
        xs = [c[0] * scale if by_time else c[0] for c in curve] + [0.0]
        chart = svg.Chart.over(
            520,
            300,
            xs,
            ys,
            xzero=True,
            yzero=True,
            xlabel=("wall time (min)" if minutes else "wall time (h)") if by_time else "launches",
            ylabel=ylabel,
            label="best so far against " + ("wall time" if by_time else "launches"),
        )
        if base_value is not None:
            chart.hline(base_value, "base", "vLLM defaults")
        chart.line([(c[0] * scale if by_time else c[0], c[1]) for c in curve], css_class("pick"), step=True)
        for count, hours, value, number in prog.values:
            chart.point(
                hours * scale if by_time else count,
                value,
                css_class("complete"),
                r=3.5,
                href=f"#trial-{number}",
                title=f"trial {number}: {format_figure(value, unit)}",
            )
        charts.append(chart.render())
    return head + f'<div class="grid2">{"".join(charts)}</div></section>'


# -- where launches went ---------------------------------------------------------------------------


def launches_section(ctx: ReportContext) -> str:
    """Bars of how the launches ended, the configs never launched, and the trials given back or running."""
    rows = ctx.rows
    launched = Counter(r.outcome for r in rows if r.launched)
    rejected = Counter(r.outcome for r in rows if r.state == "rejected")
    other = Counter(r.state for r in rows if r.state in ("given back", "running", "queued"))
    total = max([*launched.values(), *rejected.values(), *other.values(), 1])

    def bars(counts: Counter[str]) -> str:
        out = []
        for name, n in sorted(counts.items(), key=lambda kv: (kv[0] != "complete", -kv[1], kv[0])):
            width = max(2, round(420 * n / total))
            out.append(
                f'<div class="bar"><span class="k">{esc(name)}</span>'
                f'<span class="t {css_class(name)}" style="width:{width}px"></span>{n}</div>'
            )
        return "".join(out) or '<p class="small">none</p>'

    n_launched = sum(launched.values())
    return (
        '<section id="launches"><h2>Where every launch went</h2>'
        f'<div class="grid2"><div class="bars"><h3>{n_launched} launches (the budget counts these)</h3>'
        f"{bars(launched)}</div>"
        f'<div class="bars"><h3>{sum(rejected.values())} configs never launched</h3>{bars(rejected)}'
        + (f"<h3>Other</h3>{bars(other)}" if other else "")
        + '</div></div><p class="note-text small">Never launched: a known constraint, a repeat of a '
        "config "
        "already tried, or the memory boundary and model ruled it out. Given back: the tuner's own fault "
        "(retried, never data).</p></section>"
    )


# -- the failure map -------------------------------------------------------------------------------


def failure_map_section(ctx: ReportContext) -> str:
    """Every config tried by two numeric flags, coloured by how it ended."""
    head = (
        '<section id="failures"><h2>Failure map</h2><p class="note-text">Every config tried, by two '
        "flags, coloured by how it ended: filled when launched, hollow when ruled out before a "
        "launch.</p>"
    )
    axes = _map_axes(ctx)
    if axes is None:
        return head + "<p>The space has fewer than two numeric flags.</p></section>"
    xname, yname = axes
    rows = [r for r in ctx.rows if _is_num(r.flags.get(xname)) and _is_num(r.flags.get(yname))]
    if not rows:
        return head + "<p>No config was tried yet.</p></section>"
    params = ctx.loaded.space.params
    chart = svg.Chart.over(
        720,
        400,
        [float(r.flags[xname]) for r in rows],
        [float(r.flags[yname]) for r in rows],
        xlog=_is_log(params[xname]),
        ylog=_is_log(params[yname]),
        xlabel=dashed(xname),
        ylabel=dashed(yname),
        label="failure map",
    )
    seen: dict[str, bool] = {}
    for row in rows:
        outcome = row.outcome
        cls = css_class(outcome if outcome in COLOURS else "start_failed")
        if row.state == "rejected":
            cls += " rej"
        seen[outcome] = seen.get(outcome, False) or row.launched
        shape = "square" if row.baseline else "circle"
        flags = " ".join(f"{dashed(k)}={v}" for k, v in row.flags.items())
        chart.point(
            float(row.flags[xname]),
            float(row.flags[yname]),
            cls,
            r=5.0,
            shape=shape,
            href=f"#trial-{row.number}",
            title=f"trial {row.number}: {outcome}: {flags}",
        )
    key = legend([("circle", css_class(o if o in COLOURS else "start_failed"), o) for o in sorted(seen)])
    return head + key + chart.render() + "</section>"


def _map_axes(ctx: ReportContext) -> tuple[str, str] | None:
    """The failure map's two flags: :data:`PREFERRED_MAP` when numeric, else the two most important
    numeric flags; ``None`` when the space has fewer than two."""
    numeric = [
        n
        for n, p in ctx.loaded.space.params.items()
        if isinstance(p, IntParam | FloatParam)
        or (isinstance(p, CategoricalParam) and all(isinstance(c, int | float) for c in p.choices))
    ]
    if all(n in numeric for n in PREFERRED_MAP):
        return PREFERRED_MAP
    ranked = [i.name for i in ctx.importances.items if i.name in numeric]
    ordered = ranked + [n for n in numeric if n not in ranked]
    return (ordered[0], ordered[1]) if len(ordered) >= 2 else None


def _is_num(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_log(param: object) -> bool:
    return bool(getattr(param, "log", False))


# -- importance ------------------------------------------------------------------------------------


def importance_section(ctx: ReportContext) -> str:
    """Each flag's importance for the first objective as a bar, signed by which way it pushed."""
    result = ctx.importances
    head = (
        '<section id="importance"><h2>Which flags mattered</h2><p class="note-text">How much each flag '
        f"explains of {esc(ctx.spec.objectives[0].metric)} among the measured configs, and which way it "
        'pushed: <span class="ok">green</span> means a higher value did better, '
        '<span class="bad">red</span> a lower one, grey no clear trend.</p>'
    )
    if not result.items:
        return head + f"<p>Not shown: {esc(result.reason)}.</p></section>"
    out = []
    top = max(i.importance for i in result.items) or 1.0
    for item in result.items:
        width = max(2, round(360 * item.importance / top))
        if item.sign is None:
            cls, way = "flat", f"best: {item.best_choice}"
        elif item.sign > 0:
            cls, way = "pos", f"higher is better (ρ {item.correlation:+.2f})"
        elif item.sign < 0:
            cls, way = "neg", f"lower is better (ρ {item.correlation:+.2f})"
        else:
            rho = f" (ρ {item.correlation:+.2f})" if item.correlation is not None else ""
            cls, way = "flat", f"no clear trend{rho}"
        out.append(
            f'<div class="bar"><span class="k"><code>{esc(dashed(item.name))}</code></span>'
            f'<span class="t {cls}" style="width:{width}px"></span>{item.importance:.2f} · '
            f"{esc(way)}</div>"
        )
    constant = ""
    if result.constant:
        names = ", ".join(dashed(n) for n in result.constant)
        constant = f" Not varied among the measured trials (one value each): {names}."
    return (
        head + f'<div class="bars">{"".join(out)}</div>'
        f'<p class="small note-text">{esc(result.method)}.{esc(constant)}</p></section>'
    )
