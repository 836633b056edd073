"""The report page: one self-contained HTML file (inline CSS, SVG and a few lines of JavaScript; nothing
fetched), the answer first, then the evidence.

Order: the chosen flags against the defaults with their figures and the ``vllm serve`` line; the Pareto
front; best so far against launches and wall time; where every launch went; the failure map; signed
parameter importances; TTFT and TPOT distributions of the chosen config and the defaults; each trial's
rate search; all trials; the run's facts; how it was measured; where the records are.
"""

from __future__ import annotations

import datetime
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import optuna

from autotune.errors import ExportError, SpecError
from autotune.events import read_events
from autotune.export import Choice, Format, choose, defaults_of, headline, pareto_front, render
from autotune.finalists import left_out
from autotune.htmlreport import svg
from autotune.htmlreport.data import (
    Latencies,
    Progress,
    TrialRow,
    operating_probe,
    progress,
    read_latencies,
    trial_rows,
    tuner_seconds,
)
from autotune.htmlreport.fmt import dashed, duration_text, esc, interval_text, ms, rate_text, tok
from autotune.htmlreport.importance import Importances, importances
from autotune.htmlreport.style import COLOURS, CSS, JS, colour_css, css_class
from autotune.loader import LoadedStudy
from autotune.record import TrialRecord
from autotune.spec import CategoricalParam, FlagValue, FloatParam, IntParam, objective_unit
from autotune.status import records
from autotune.storage import redact_url
from autotune.surrogate.propose import describe, track_record
from autotune.units import format_figure

PREFERRED_MAP = ("gpu_memory_utilization", "max_num_seqs")
"""The failure map's axes when the space has both (memory asked against concurrency)."""


def _link(number: int) -> str:
    return f'<a href="#trial-{number}">{number}</a>'


class Report:
    """Builds the page of one study (``html``)."""

    def __init__(self, study: optuna.Study, loaded: LoadedStudy, *, now: datetime.datetime) -> None:
        self.study = study
        self.loaded = loaded
        self.spec = loaded.spec
        self.now = now
        self.rows = trial_rows(study, loaded)
        self.by_number = {r.number: r for r in self.rows}
        self.params = list(loaded.space.params)
        self.maximize = self.spec.objectives[0].direction == "maximize"
        self.choice: Choice | None
        self.why_none = ""
        try:
            self.choice = choose(study, loaded, trial=None, policy=None)
        except (ExportError, SpecError) as exc:
            self.choice, self.why_none = None, str(exc)
        self.pick = self.by_number.get(self.choice.trial.number) if self.choice is not None else None
        base = self.choice.baseline if self.choice is not None else None
        self.base = self.by_number.get(base.number) if base is not None else self._baseline_row()
        frozen = {t.number: t for t in study.get_trials(deepcopy=False)}
        base_trial = frozen.get(self.base.number) if self.base is not None else None
        self.defaults: Mapping[str, FlagValue] = defaults_of(loaded, base_trial)
        """vLLM's defaults as the server reported them at the defaults' trial (the space's otherwise)."""
        self.default_warnings = (
            TrialRecord.from_trial(base_trial).default_warnings if base_trial is not None else ()
        )
        """Where the space's declared defaults and what the server reported disagreed."""
        self.front = {t.number for t in pareto_front(study)}
        self.progress: Progress = progress(self.rows, self.maximize)
        ran = tuner_seconds(list(read_events(loaded.workdir / "events.jsonl")))
        self.wall_s = ran if ran is not None else self.progress.hours * 3600
        """The tuners' wall time from the event log (finalists included), else the trials' span."""
        self.importances: Importances = importances(study, self.params, maximize=self.maximize)

    def _baseline_row(self) -> TrialRow | None:
        done = [r for r in self.rows if r.baseline and r.state not in ("given back", "running", "queued")]
        return done[-1] if done else None

    # -- the page ------------------------------------------------------------------------------

    def html(self) -> str:
        """The whole page."""
        sections = [
            self._answer(),
            self._nav(),
            self._front(),
            self._progress(),
            self._launches(),
            self._failure_map(),
            self._importance(),
            self._latency(),
            self._searches(),
            self._trials(),
            self._facts(),
            self._method(),
        ]
        title = f"autotune report: {self.spec.study.name}"
        return (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><style>{CSS}{colour_css()}</style></head><body>"
            f"{self._header()}{''.join(sections)}"
            f"<footer>Generated by autotune on {self.now:%Y-%m-%d %H:%M} UTC from "
            f"{esc(redact_url(self.loaded.storage_url))}. A snapshot: rerun <code>autotune report</code> "
            f"for a fresh one.</footer><script>{JS}</script></body></html>\n"
        )

    def _header(self) -> str:
        launched = sum(1 for r in self.rows if r.launched)
        running = sum(1 for r in self.rows if r.state == "running")
        state = f", {running} running now: a snapshot" if running else ""
        facts = [
            esc(self.spec.server.model),
            f"{launched}/{self.spec.budget.launches} launches{state}",
            f"wall time {duration_text(self.wall_s)}",
            f"SLO {esc(', '.join(str(t) for t in self.spec.slo.terms))}",
        ]
        return (
            f"<header><h1>autotune report: study <code>{esc(self.spec.study.name)}</code></h1>"
            f'<p class="sub">{" · ".join(facts)}</p></header>'
        )

    def _nav(self) -> str:
        links = [
            ("front", "Pareto front"),
            ("progress", "Progress"),
            ("launches", "Launches"),
            ("failures", "Failure map"),
            ("importance", "Importance"),
            ("latency", "Latency"),
            ("searches", "Rate searches"),
            ("trials", "Trials"),
            ("facts", "Run facts"),
            ("method", "Method"),
        ]
        return "<nav>" + "".join(f'<a href="#{k}">{v}</a>' for k, v in links) + "</nav>"

    # -- the answer ----------------------------------------------------------------------------

    def _answer(self) -> str:
        if self.choice is None or self.pick is None:
            counts = Counter(r.outcome for r in self.rows if r.launched)
            causes = ", ".join(f"{n} {k}" for k, n in counts.most_common()) or "no launch has finished"
            return (
                '<section id="answer" class="answer none"><h2>No answer yet</h2>'
                f'<p class="headline">No config met the SLOs: {esc(self.why_none)}.</p>'
                f"<p>Launches so far: {esc(causes)}. Read the causes below; then loosen "
                "<code>slo.terms</code>, "
                "widen the search space or raise <code>budget.launches</code>, and rerun "
                "<code>autotune tune</code> to continue the study.</p></section>"
            )
        choice, pick = self.choice, self.pick
        line = render(choice, self.loaded, Format.ARGS).strip()
        gain = choice.gain
        gain_text = "" if gain is not None else "Not compared: the vLLM defaults were not measured. "
        first = f"interval {interval_text(pick.interval)}" if pick.interval else ""
        rerun = choice.finalist
        value: float | None
        if rerun is not None and rerun.throughput is not None:
            value = rerun.throughput
            label = f"SLO-constrained throughput, mean of {len(rerun.met)} rerun(s)"
            first = (f"interval {interval_text(rerun.interval)}; " if rerun.interval else "") + (
                f"search {tok(pick.slo_throughput)}"
            )
        else:
            value, label = pick.slo_throughput, "SLO-constrained throughput"
        kpis = [
            self._kpi(label, tok(value), "tok/s", first),
            self._kpi(
                "over the vLLM defaults",
                f"{gain.value:+.1%}" if gain is not None else "-",
                "",
                "within the noise" if gain is not None and gain.within_noise else "",
            ),
        ]
        for key in ("ttft:p95", "tpot:p95", "e2el:p99"):
            limit = self._limit(key)
            value = pick.latency.get(key)
            status = ""
            if limit is not None and value is not None:
                ok = value <= limit
                status = f'<span class="{"ok" if ok else "bad"}">SLO ≤ {format_figure(limit, "ms")}</span>'
            metric, stat = key.split(":")
            kpis.append(self._kpi(f"{stat} {metric.upper()}", ms(value), "ms", status, raw=True))
        title = f"Use trial {_link(pick.number)}" + (" (vLLM's defaults)" if pick.baseline else "")
        return (
            f'<section id="answer" class="answer"><h2>The answer: {title}</h2>'
            f'<p class="headline">{esc(headline(choice))}.</p>'
            f'<p class="small">{esc(gain_text)}Latencies at the trial\'s operating point: the highest '
            f"arrival rate probed that met every SLO term ({rate_text(pick.operating_rate)} req/s).</p>"
            f'<div class="kpis">{"".join(kpis)}</div>'
            f"{self._diff(choice)}"
            f'<h3>Serve it <button id="copy-serve" type="button">Copy</button></h3>'
            f'<pre id="serve-line">{esc(line)}</pre>'
            f'<p class="small">Or as a file: <code>autotune export {esc(self._spec_arg())} -o '
            "best.yaml</code>, "
            f"then <code>{esc(' '.join(self.spec.server.command))} --config best.yaml</code>.</p></section>"
        )

    def _spec_arg(self) -> str:
        return self.loaded.spec_path.name

    @staticmethod
    def _kpi(label: str, value: str, unit: str, sub: str, *, raw: bool = False) -> str:
        sub_html = sub if raw else esc(sub)
        return (
            f'<div class="kpi"><span class="v">{esc(value)}</span><span class="u">{esc(unit)}</span>'
            f'<span class="l">{esc(label)}</span><span class="s">{sub_html}</span></div>'
        )

    def _limit(self, key: str) -> float | None:
        limits = [t.limit_s * 1000 for t in self.spec.slo.terms if t.key == key]
        return min(limits) if limits else None

    def _diff(self, choice: Choice) -> str:
        defaults = self.defaults
        rows = []
        changed = 0
        for name in self.params:
            old, new = defaults.get(name), choice.tuned.get(name)
            differs = old != new
            changed += differs
            mark = ' class="changed"' if differs else ""
            rows.append(
                f"<tr{mark}><td><code>{esc(dashed(name))}</code></td><td>{esc(old)}</td><td>{esc(new)}</td></tr>"
            )
        fixed = " ".join(f"{dashed(k)} {v}" for k, v in self.spec.server.args.items())
        source = (
            f"The defaults are trial {_link(self.base.number)}'s: launched with none of the tuned flags, "
            "with the values its server reported (the search space's where it reported none)."
            if self.base is not None
            else "The defaults are the search space's (not measured yet)."
        )
        if fixed:
            source += f" Fixed for every trial: <code>{esc(fixed)}</code>."
        return (
            f"<h3>Flags: {changed} of {len(self.params)} changed from the defaults</h3>"
            '<table class="diff"><tr><th>flag</th><th>vLLM default</th><th>chosen</th></tr>'
            f'{"".join(rows)}</table><p class="small">{source}</p>'
        )

    # -- the Pareto front ----------------------------------------------------------------------

    def _axes_of_front(self) -> tuple[str, str, int | None, int]:
        """(x label, y label, x objective index or None for TTFT p95 at the operating point, y index)."""
        objectives = self.spec.objectives
        ylabel = _objective_label(objectives[0].metric)
        if len(objectives) > 1:
            return _objective_label(objectives[1].metric), ylabel, 1, 0
        return "p95 TTFT at the operating point (ms)", ylabel, None, 0

    def _front(self) -> str:
        xlabel, ylabel, xi, yi = self._axes_of_front()
        points = []
        for row in self.rows:
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
        ys = [y for _, _, y in points]
        if yi == 0 and self.spec.objectives[0].metric == "slo_throughput":
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
        if yi == 0 and self.spec.objectives[0].metric == "slo_throughput":
            for row, x, _ in points:
                if row.interval:
                    chart.span(
                        x,
                        row.interval[0],
                        row.interval[1],
                        "err",
                        title=f"trial {row.number}: interval {interval_text(row.interval)} tok/s",
                    )
        front = sorted((x, y) for row, x, y in points if row.number in self.front)
        chart.line(front, css_class("front"))
        for row, x, y in points:
            cls, shape, r = css_class("infeasible"), "circle", 4.0
            if row.feasible:
                cls = css_class("complete")
            if row.number in self.front:
                r = 5.0
            if row.baseline:
                cls, shape, r = css_class("default"), "square", 6.0
            if self.pick is not None and row.number == self.pick.number:
                cls, shape, r = css_class("pick"), "star", 6.0
            extra = " (SLOs missed)" if not row.feasible else ""
            chart.point(
                x,
                y,
                cls,
                r=r,
                shape=shape,
                href=f"#trial-{row.number}",
                title=f"trial {row.number}{extra}: {fmt_pair(xlabel, x, ylabel, y)}",
            )
        legend = _legend(
            [
                ("star", css_class("pick"), "chosen"),
                ("square", css_class("default"), "vLLM defaults"),
                ("circle", css_class("complete"), "met the SLOs"),
                ("circle", css_class("infeasible"), "missed an SLO"),
            ]
        )
        return head + legend + chart.render() + "</section>"

    # -- progress ------------------------------------------------------------------------------

    def _progress(self) -> str:
        prog = self.progress
        head = (
            '<section id="progress"><h2>Best so far</h2><p class="note-text">The best feasible '
            f"{esc(self.spec.objectives[0].metric)} after each launch (the line), each launch's own result "
            "(dots), against launches and against wall time.</p>"
        )
        if not prog.by_launch:
            return head + "<p>No launch met the SLOs yet.</p></section>"
        ylabel = _objective_label(self.spec.objectives[0].metric)
        unit = objective_unit(self.spec.objectives[0].metric)
        base_value = (
            self.base.values[0] if self.base is not None and self.base.feasible and self.base.values else None
        )
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
            chart.line(
                [(c[0] * scale if by_time else c[0], c[1]) for c in curve], css_class("pick"), step=True
            )
            for count, hours, value, number in prog.values:
                x = hours * scale if by_time else count
                chart.point(
                    x,
                    value,
                    css_class("complete"),
                    r=3.5,
                    href=f"#trial-{number}",
                    title=f"trial {number}: {format_figure(value, unit)}",
                )
            charts.append(chart.render())
        return head + f'<div class="grid2">{"".join(charts)}</div></section>'

    # -- where launches went --------------------------------------------------------------------

    def _launches(self) -> str:
        launched = Counter(r.outcome for r in self.rows if r.launched)
        rejected = Counter(r.outcome for r in self.rows if r.state == "rejected")
        other = Counter(r.state for r in self.rows if r.state in ("given back", "running", "queued"))
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

    # -- the failure map --------------------------------------------------------------------------

    def _map_axes(self) -> tuple[str, str] | None:
        numeric = [
            n
            for n, p in self.loaded.space.params.items()
            if isinstance(p, IntParam | FloatParam)
            or (isinstance(p, CategoricalParam) and all(isinstance(c, int | float) for c in p.choices))
        ]
        if all(n in numeric for n in PREFERRED_MAP):
            return PREFERRED_MAP
        ranked = [i.name for i in self.importances.items if i.name in numeric]
        ordered = ranked + [n for n in numeric if n not in ranked]
        return (ordered[0], ordered[1]) if len(ordered) >= 2 else None

    def _failure_map(self) -> str:
        head = (
            '<section id="failures"><h2>Failure map</h2><p class="note-text">Every config tried, by two '
            "flags, coloured by how it ended: filled when launched, hollow when ruled out before a "
            "launch.</p>"
        )
        axes = self._map_axes()
        if axes is None:
            return head + "<p>The space has fewer than two numeric flags.</p></section>"
        xname, yname = axes
        rows = [r for r in self.rows if _is_num(r.flags.get(xname)) and _is_num(r.flags.get(yname))]
        if not rows:
            return head + "<p>No config was tried yet.</p></section>"
        params = self.loaded.space.params
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
        legend = _legend(
            [("circle", css_class(o if o in COLOURS else "start_failed"), o) for o in sorted(seen)]
        )
        return head + legend + chart.render() + "</section>"

    # -- importance ---------------------------------------------------------------------------

    def _importance(self) -> str:
        result = self.importances
        head = (
            '<section id="importance"><h2>Which flags mattered</h2><p class="note-text">How much each flag '
            f"explains of {esc(self.spec.objectives[0].metric)} among the measured configs, and which way it "
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

    # -- latency distributions -----------------------------------------------------------------

    def _latency(self) -> str:
        head = (
            '<section id="latency"><h2>Latency of the chosen config and the defaults</h2>'
            '<p class="note-text">Per-request TTFT and TPOT at each one\'s operating point (the judged '
            "requests "
            "of its highest passing probe), as cumulative distributions; the dashed red line is the SLO "
            "limit.</p>"
        )
        sides: list[tuple[str, str, Latencies]] = []
        missing = []
        same = self.pick is not None and self.base is not None and self.pick.number == self.base.number
        chosen = "chosen: the vLLM defaults" if same else "chosen"
        for label, cls, row in ((chosen, "pick", self.pick), ("vLLM defaults", "default", self.base)):
            if row is None or row.state != "complete":
                continue
            if sides and sides[0][2].trial == row.number:
                continue
            path = operating_probe(self.loaded, row)
            found = read_latencies(row.number, path) if path is not None else None
            if found is None:
                missing.append(f"trial {row.number} ({label})")
                continue
            sides.append((label, cls, found))
        if not sides:
            note = (
                f"Probe files not found on this host for {', '.join(missing)}."
                if missing
                else "Nothing measured yet."
            )
            return head + f"<p>{esc(note)}</p></section>"
        charts = []
        for metric, attr in (("ttft", "ttft_ms"), ("tpot", "tpot_ms")):
            series = [(label, cls, getattr(lat, attr)) for label, cls, lat in sides]
            values = [v for _, _, vs in series for v in vs]
            limits = [t for t in self.spec.slo.terms if t.metric == metric]
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
            charts.append(chart.render())
        table = _latency_table(sides, self.loaded)
        legend = _legend([("square", css_class(cls), label) for label, cls, _ in sides])
        note = (
            f'<p class="small note-text">Not found on this host: {esc(", ".join(missing))}.</p>'
            if missing
            else ""
        )
        return head + legend + f'<div class="grid2">{"".join(charts)}</div>' + table + note + "</section>"

    # -- rate searches ---------------------------------------------------------------------------

    def _searches(self) -> str:
        rows = [r for r in self.rows if r.launched and r.probes]
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
        width = 600
        axis = svg.Chart.over(width, 34, [*rates, 0.0], [0.0, 1.0], xzero=True, label="request rate axis")
        axis.y = svg.Scale(0.0, 1.0, 4, 6)
        out = [
            f'<table class="strip"><tr><th>trial</th><th>outcome</th><th>{_axis_only(axis)}</th>'
            '<th class="n">estimate req/s</th></tr>'
        ]
        for row in rows:
            strip = svg.Chart(
                width, 22, axis.x, svg.Scale(0.0, 1.0, 18, 4), label=f"rate search of trial {row.number}"
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
            tag = " ★" if self.pick is not None and row.number == self.pick.number else ""
            tag += " (defaults)" if row.baseline else ""
            out.append(
                f"<tr><td>{_link(row.number)}{tag}</td><td>{esc(row.outcome)}</td>"
                f'<td>{strip.render(axes=False)}</td><td class="n">{rate_text(row.rate)}</td></tr>'
            )
        out.append("</table>")
        return head + "".join(out) + "</section>"

    # -- all trials ---------------------------------------------------------------------------------

    def _trials(self) -> str:
        names = self.params
        header = (
            "<tr><th>trial</th><th>outcome</th>"
            + "".join(f"<th>{esc(dashed(n))}</th>" for n in names)
            + '<th class="n">SLO tok/s</th><th>interval</th><th class="n">req/s</th><th class="n">TTFT '
            "p95</th>"
            '<th class="n">TPOT p95</th><th class="n">E2EL p99</th><th '
            'class="n">took</th><th>summary</th></tr>'
        )
        body = []
        for row in self.rows:
            cls = ""
            if self.pick is not None and row.number == self.pick.number:
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
                    f'<td class="n">{ms(row.latency.get(k))}</td>'
                    for k in ("ttft:p95", "tpot:p95", "e2el:p99")
                )
                + f'<td class="n">{duration_text(row.seconds)}</td><td '
                f'title="{esc(row.summary)}">{esc(summary)}</td></tr>'
            )
        return (
            f'<section id="trials"><h2>All trials</h2><details><summary>{len(self.rows)} trials: flags, '
            "outcome, "
            f"figures at the operating point (ms), summary</summary><table>{header}{''.join(body)}</table>"
            "</details></section>"
        )

    # -- facts ------------------------------------------------------------------------------------

    def _facts(self) -> str:
        spec = self.spec
        versions = sorted({r.server_version for r in self.rows if r.server_version})
        devices = sorted({r.gpu for r in self.rows if r.gpu})
        profile = (
            spec.memory_model.gpu
            if spec.memory_model is not None and spec.memory_model.gpu != "auto"
            else None
        )
        if devices:
            gpu = ", ".join(devices) + (f" (memory model's profile: {profile})" if profile else "")
        elif profile:
            gpu = f"{profile} (the memory model's profile; no trial saw a device through NVML)"
        else:
            gpu = "not recorded (no trial saw a device through NVML, no memory model)"
        dataset = spec.workload.dataset
        if dataset.kind == "synthetic":
            data = f"synthetic: input {_dist(dataset.input_len)}, output {_dist(dataset.output_len)} tokens"
            if dataset.prefix_len:
                data += f", shared prefix {dataset.prefix_len}"
        else:
            data = f"{dataset.kind}: {dataset.path}"
        arrival = spec.workload.arrival.process
        budget = f"{spec.budget.launches} launches" + (
            f", wall time {duration_text(spec.budget.wall_time)}" if spec.budget.wall_time else ""
        )
        launched = sum(1 for r in self.rows if r.launched)
        measurement = spec.measurement
        items = [
            ("model", spec.server.model),
            ("server command", " ".join(spec.server.command)),
            ("GPU", gpu),
            ("vLLM version (the server's /version)", ", ".join(versions) or "not recorded"),
            ("search space", f"{self.loaded.space_path.name}: {', '.join(dashed(p) for p in self.params)}"),
            (
                "workload",
                f"{spec.workload.endpoint} endpoint, {data}, {arrival} arrivals, seed {spec.workload.seed}",
            ),
            (
                "SLO",
                f"{', '.join(str(t) for t in spec.slo.terms)}, "
                f"error budget {format_figure(spec.slo.error_budget)}",
            ),
            ("objectives", ", ".join(f"{o.direction} {o.metric}" for o in spec.objectives)),
            ("budget", f"{budget}; used {launched} launches"),
            ("wall time", duration_text(self.wall_s)),
            (
                "sampler",
                f"{spec.sampler.name}, seed {spec.sampler.seed}, {spec.sampler.startup_trials} startup "
                "trials",
            ),
            ("surrogate", self._surrogate()),
            (
                "vLLM's defaults against the space",
                "; ".join(self.default_warnings)
                if self.default_warnings
                else "the defaults' trial ran with what the space declares (or declares nothing)",
            ),
            (
                "measurement",
                f"probes of {format_figure(measurement.probe_duration, 's')}, at least "
                f"{measurement.min_requests} requests, at most {measurement.max_probes} per launch, "
                f"{measurement.client} client",
            ),
            ("finalists", self._finalists()),
        ]
        where = records(self.loaded)
        rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in items)
        rec = "".join(f"<tr><th>{esc(k)}</th><td><code>{esc(v)}</code></td></tr>" for k, v in where.items())
        return (
            '<section id="facts"><h2>The run</h2><div class="grid2">'
            f"<table>{rows}</table><div><h3>Where the records are</h3><table>{rec}</table>"
            f'<p class="small">Browse the study interactively: <code>optuna-dashboard '
            f"{esc(redact_url(self.loaded.storage_url))}</code></p></div></div></section>"
        )

    def _finalists(self) -> str:
        """The finalists' stage as configured, and the ties it left out."""
        spec = self.spec.finalists
        if not spec.count:
            return "off"
        text = (
            f"{spec.count} best and the defaults measured again {spec.rounds}× with "
            f"{format_figure(spec.probe_scale)}× longer probes"
        )
        found = left_out(self.study, self.loaded)
        return f"{text}. {found.left_out_text(self.loaded)}" if found is not None else text

    def _surrogate(self) -> str:
        """How the surrogate's proposals fared, or whether it was on at all."""
        said = describe(track_record(self.study.get_trials(deepcopy=False)))
        if said is not None:
            return said
        on = self.spec.sampler.surrogate and self.spec.memory_model is not None
        return "on, no proposal measured" if on else "off (no memory model, or sampler.surrogate: false)"

    def _method(self) -> str:
        return (
            '<section id="method"><h2>How it was measured</h2><ul class="small">'
            "<li>Each trial launched a fresh <code>vllm serve</code> with the sampled flags and drove it "
            "with "
            "the workload above: streaming requests, a timestamp per chunk, TTFT, TPOT, ITL and E2EL as "
            "<code>vllm bench serve</code> defines them.</li>"
            "<li>SLO-constrained throughput: every trial met the same stream of requests at the same "
            "rate (common random numbers); each probe warmed the server up for one request lifetime, "
            "judged a window of several lifetimes and kept the load on until its judged requests ended. "
            "The SLO boundary is interpolated between the probes around it, with an interval that holds "
            "that bracket and the probes' sampling noise; the output tokens per second at that rate is "
            "the figure. The latencies shown are those of the highest probe that met every term.</li>"
            "<li>Crashes, OOMs and configs that could not start are recorded with their cause (pruned), "
            "never as a zero. Configs ruled out before a launch spend no budget.</li>"
            "<li>The chosen config is the recommendation: the leader, the configs the search could not "
            "tell from it, and the defaults were measured again on a fresh stream shared by all; the "
            "pick is the finalist with the best mean over those reruns, and its gain over the defaults "
            "comes from them, paired round by round, with its interval (within the noise when the "
            "interval holds zero).</li>"
            "<li>Importances: "
            f"{esc(self.importances.method or 'Optuna PED-ANOVA, signed by Spearman rank correlation')}; "
            f"{self.importances.trials} measured trials.</li>"
            "</ul></section>"
        )


def _legend(items: Sequence[tuple[str, str, str]]) -> str:
    return (
        '<p class="legend">'
        + "".join(f"<span>{svg.swatch(shape, cls)}{esc(text)}</span>" for shape, cls, text in items)
        + "</p>"
    )


def _axis_only(axis: svg.Chart) -> str:
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


def _objective_label(metric: str) -> str:
    if metric == "slo_throughput":
        name = "SLO-constrained throughput"
    elif ":" in metric:
        latency, stat = metric.split(":", 1)
        name = f"{stat} {latency.upper()}"
    else:
        name = metric.replace("_", " ")
    unit = objective_unit(metric)
    return f"{name} ({unit})" if unit else name


def fmt_pair(xlabel: str, x: float, ylabel: str, y: float) -> str:
    """``x label x, y label y`` for a tooltip (the figures as :func:`autotune.units.format_figure` writes
    them)."""
    return f"{xlabel} {format_figure(x)}, {ylabel} {format_figure(y)}"


def _is_num(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_log(param: object) -> bool:
    return bool(getattr(param, "log", False))


def _dist(dist: object) -> str:
    kind = getattr(dist, "dist", "")
    if kind == "fixed":
        return str(getattr(dist, "value", ""))
    low, high = getattr(dist, "low", None), getattr(dist, "high", None)
    clip = f" {low if low is not None else ''}–{high if high is not None else ''}" if (low or high) else ""
    if kind == "uniform":
        return f"uniform{clip}"
    return f"{kind} mean {getattr(dist, 'mean', '')} std {getattr(dist, 'std', '')}{clip}"


def _relative(path: object, loaded: LoadedStudy) -> str:
    text = str(path)
    base = str(loaded.workdir)
    return text[len(base) + 1 :] if text.startswith(base + "/") else text


def build_report(study: optuna.Study, loaded: LoadedStudy, *, now: datetime.datetime | None = None) -> str:
    """The self-contained HTML report of ``study``."""
    when = now or datetime.datetime.now(datetime.UTC)
    return Report(study, loaded, now=when).html()


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
            f"<tr><td>{esc(label)}</td><td>{_link(lat.trial)}</td>"
            f'<td class="n">{rate_text(lat.rate)}</td>'
            f'<td class="n">{len(lat.ttft_ms)}</td><td class="n">{ms(q(lat.ttft_ms, 0.5))}</td>'
            f'<td class="n">{ms(q(lat.ttft_ms, 0.95))}</td><td class="n">{ms(q(lat.tpot_ms, 0.5))}</td>'
            f'<td class="n">{ms(q(lat.tpot_ms, 0.95))}</td>'
            f"<td><code>{esc(_relative(lat.path, loaded))}</code></td></tr>"
        )
    return "".join(rows) + "</table>"
