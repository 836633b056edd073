"""The report's first section, the answer: the chosen trial with its figures against the SLOs and the
defaults, its flags against vLLM's defaults and the ``vllm serve`` line to copy; or, when no config met
the SLOs, why and what to do."""

from __future__ import annotations

import shlex
from collections import Counter

from autotune.results.export import Choice, Format, choose, headline, render
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.data import TrialRow
from autotune.results.htmlreport.fmt import dashed, esc, interval_text, ms, rate_text, tok, trial_link
from autotune.results.serving import serving, serving_lines
from autotune.study.finalists import narrowing
from autotune.units import format_figure


def answer_section(ctx: ReportContext) -> str:
    """The answer: the chosen config (or why there is none)."""
    if ctx.choice is None or ctx.pick is None:
        return _no_answer(ctx)
    choice, pick = ctx.choice, ctx.pick
    line = render(choice, ctx.loaded, Format.ARGS).strip()
    gain_text = "" if choice.gain is not None else "Not compared: the vLLM defaults were not measured. "
    title = f"Use trial {trial_link(pick.number)}" + (" (vLLM's defaults)" if pick.baseline else "")
    return (
        f'<section id="answer" class="answer"><h2>The answer: {title}</h2>'
        f'<p class="headline">{esc(headline(choice))}.</p>'
        f'<p class="small">{esc(gain_text)}{esc(_where(pick))}</p>'
        f"{_serving(ctx, choice)}"
        f'<div class="kpis">{"".join(_kpis(ctx, choice, pick))}</div>'
        f"{_diff(ctx, choice)}"
        f'<h3>Serve it <button id="copy-serve" type="button">Copy</button></h3>'
        f'<pre id="serve-line">{esc(line)}</pre>'
        f'<p class="small">Or as a file: <code>autotune export {esc(shell_word(ctx.spec_shown))} -o '
        "best.yaml</code>, "
        f"then <code>{esc(' '.join(ctx.spec.server.command))} --config best.yaml</code>.</p></section>"
    )


def _serving(ctx: ReportContext, choice: Choice) -> str:
    """The replicas the pick and the defaults need for the expected traffic, their cost per million output
    tokens (:mod:`autotune.results.serving`), and what more paired rounds would make of the gain
    (:func:`autotune.study.finalists.narrowing`), as a paragraph; nothing when none applies."""
    base = ctx.base
    defaults = None
    if base is not None and base.state == "complete":
        defaults = serving(choose(ctx.study, ctx.loaded, trial=base.number, policy=None), ctx.loaded)
    lines = serving_lines(serving(choice, ctx.loaded), defaults, ctx.loaded)
    narrower = narrowing(ctx.study, ctx.loaded)
    if narrower is not None:
        lines.append(narrower.text())
    return f'<p class="serving">{esc(" ".join(lines))}</p>' if lines else ""


def _where(pick: TrialRow) -> str:
    """Where the pick's latencies were read: the reference load, or its operating point."""
    if pick.reference_rate is not None:
        return (
            f"Latencies at the study's reference load, {rate_text(pick.reference_rate)} req/s, the one load "
            "every config is compared at; its SLO rate: "
            f"{rate_text(pick.operating_rate)} req/s."
        )
    return (
        "Latencies at the trial's operating point: the highest arrival rate probed that met every SLO term "
        f"({rate_text(pick.operating_rate)} req/s)."
    )


def shell_word(text: str) -> str:
    """``text`` as one word of a shell command (quoted only when it must be)."""
    return shlex.quote(text)


def _no_answer(ctx: ReportContext) -> str:
    """No config met the SLOs: the launches' causes so far, and what to change."""
    counts = Counter(r.outcome for r in ctx.rows if r.launched)
    causes = ", ".join(f"{n} {k}" for k, n in counts.most_common()) or "no launch has finished"
    return (
        '<section id="answer" class="answer none"><h2>No answer yet</h2>'
        f'<p class="headline">No config met the SLOs: {esc(ctx.why_none)}.</p>'
        f"<p>Launches so far: {esc(causes)}. Read the causes below; then loosen "
        "<code>slo.terms</code>, "
        "widen the search space or raise <code>budget.launches</code>, and rerun "
        "<code>autotune tune</code> to continue the study.</p></section>"
    )


def _kpis(ctx: ReportContext, choice: Choice, pick: TrialRow) -> list[str]:
    """The figures: the throughput (the reruns' mean once measured again), the gain over the defaults, the
    defaults' own throughput (their reruns' mean once measured again), and the latencies (at the reference
    load) against their SLO limits."""
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
    gain = choice.gain
    kpis = [
        _kpi(label, tok(value), "tok/s", first),
        _kpi(
            "over the vLLM defaults",
            f"{gain.value:+.1%}" if gain is not None else "-",
            "",
            "within the noise" if gain is not None and gain.within_noise else "",
        ),
        *_defaults_kpi(ctx, pick),
    ]
    for key in ("ttft:p95", "tpot:p95", "e2el:p99"):
        limit = _limit(ctx, key)
        value = pick.latency.get(key)
        status = ""
        if limit is not None and value is not None:
            ok = value <= limit
            status = f'<span class="{"ok" if ok else "bad"}">SLO ≤ {format_figure(limit, "ms")}</span>'
        metric, stat = key.split(":")
        kpis.append(_kpi(f"{stat} {metric.upper()}", ms(value), "ms", status, raw=True))
    return kpis


def _defaults_kpi(ctx: ReportContext, pick: TrialRow) -> list[str]:
    """The defaults' SLO-constrained throughput (none when they are the pick, or were not measured): the
    mean of their reruns with each rerun's figure once the finalists' stage measured them again
    (:func:`autotune.results.export.reruns_fields`), else the search's figure."""
    base = ctx.base
    if base is None or base.number == pick.number:
        return []
    label = f"vLLM defaults (trial {base.number})"
    search = f"search {tok(base.slo_throughput)}" if base.slo_throughput is not None else ""
    fields = ctx.base_reruns
    if fields is None:
        sub = f"interval {interval_text(base.interval)} (search)" if base.interval else "search"
        return [_kpi(f"{label}, SLO-constrained throughput", tok(base.slo_throughput), "tok/s", sub)]
    runs = [v for v in fields.get("slo_throughput_runs") or [] if isinstance(v, int | float)]
    mean = fields.get("slo_throughput_mean")
    interval = fields.get("interval")
    missed = fields.get("missed") or 0
    parts = []
    if isinstance(interval, list) and len(interval) == 2:
        parts.append(f"interval {interval_text((float(interval[0]), float(interval[1])))}")
    if runs:
        parts.append(f"reruns {', '.join(tok(float(v)) for v in runs)}")
    if missed:
        parts.append(f"{missed} rerun(s) missed the SLOs")
    if search:
        parts.append(search)
    value = tok(float(mean)) if isinstance(mean, int | float) else "-"
    shown = f"{label}, mean of {fields.get('runs', len(runs))} rerun(s)"
    return [_kpi(shown, value, "tok/s", "; ".join(parts))]


def _kpi(label: str, value: str, unit: str, sub: str, *, raw: bool = False) -> str:
    sub_html = sub if raw else esc(sub)
    return (
        f'<div class="kpi"><span class="v">{esc(value)}</span><span class="u">{esc(unit)}</span>'
        f'<span class="l">{esc(label)}</span><span class="s">{sub_html}</span></div>'
    )


def _limit(ctx: ReportContext, key: str) -> float | None:
    """The tightest SLO limit on ``key`` (``ttft:p95``) in milliseconds, if any."""
    limits = [t.limit_s * 1000 for t in ctx.spec.slo.terms if t.key == key]
    return min(limits) if limits else None


def _diff(ctx: ReportContext, choice: Choice) -> str:
    """The tuned flags, vLLM's default against the chosen value, and where the defaults come from."""
    rows = []
    changed = 0
    for name in ctx.params:
        old, new = ctx.defaults.get(name), choice.tuned.get(name)
        differs = old != new
        changed += differs
        mark = ' class="changed"' if differs else ""
        rows.append(
            f"<tr{mark}><td><code>{esc(dashed(name))}</code></td><td>{esc(old)}</td><td>{esc(new)}</td></tr>"
        )
    fixed = " ".join(f"{dashed(k)} {v}" for k, v in ctx.spec.server.args.items())
    source = (
        f"The defaults are trial {trial_link(ctx.base.number)}'s: launched with none of the tuned flags, "
        "with the values its server reported (the search space's where it reported none)."
        if ctx.base is not None
        else "The defaults are the search space's (not measured yet)."
    )
    if fixed:
        source += f" Fixed for every trial: <code>{esc(fixed)}</code>."
    return (
        f"<h3>Flags: {changed} of {len(ctx.params)} changed from the defaults</h3>"
        '<table class="diff"><tr><th>flag</th><th>vLLM default</th><th>chosen</th></tr>'
        f'{"".join(rows)}</table><p class="small">{source}</p>'
    )
