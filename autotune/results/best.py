"""Plain-text reports of a study: the Pareto front against the vLLM defaults, as a table, JSON or CSV.

The table fits a given width: one table of measurements (a row per config on the front, then the
defaults) and one of flags with a column per config, listing only the flags that differ from vLLM's
defaults somewhere (the others are named once, folded). Which config the export picks and every gain
come from :func:`autotune.results.export.choose` (one :class:`~autotune.results.export.Choice` per row): the
recommended config by :func:`autotune.study.finalists.pick`, gains from paired reruns. Functions here
build strings; only the CLI prints them.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich import box
from rich.console import Console, JustifyMethod
from rich.table import Table

from autotune.flags import FlagValue, dashed, dashed_flags
from autotune.formats import BestFormat
from autotune.inputs.loader import LoadedStudy
from autotune.predict.surrogate.propose import describe, track_record
from autotune.results.export import (
    Choice,
    choose,
    defaults_fields,
    defaults_of,
    gain_fields,
    headline,
    pareto_front,
    reruns_fields,
    throughput_fields,
    versus,
)
from autotune.results.serving import serving, serving_lines, tokens_per_request
from autotune.store.record import TrialRecord, full_record
from autotune.study.finalists import Finalist, Gain, left_out, narrowing, reruns
from autotune.study.loop import default_trial
from autotune.units import figure_spread, gain_spread, plural, wrap

STATS = (("ttft", "p95"), ("tpot", "p95"), ("e2el", "p99"))
"""The latencies the table shows (milliseconds, at the study's reference load; at the operating point for a
trial that has no probe there)."""

SAME = "·"
"""A flag equal to vLLM's default, in the flags table."""


@dataclass(frozen=True)
class Row:
    """One measured config of the report: a member of the Pareto front, or vLLM's defaults."""

    choice: Choice
    """The config as :func:`~autotune.results.export.choose` sees it (its reruns and gain)."""
    role: str
    """``front`` or ``defaults`` (vLLM's defaults, on the front or not)."""
    picked: bool
    """Whether the export picks this config (``autotune export`` with no ``--trial``/``--policy``)."""
    on_front: bool
    record: TrialRecord
    """The trial's whole record (:func:`autotune.store.record.full_record`)."""
    vs_pick: Gain | None = None
    """Its throughput over the pick's, paired on the requests both met
    (:func:`autotune.study.finalists.gain`); zero for the pick itself."""

    @property
    def number(self) -> int:
        return self.choice.trial.number

    @property
    def point(self) -> Mapping[str, Any]:
        return self.record.operating_point or {}

    @property
    def reference(self) -> Mapping[str, Any] | None:
        """The trial's probe at the study's reference load (where its latencies are read), if it ran."""
        ref = self.record.reference
        return ref if isinstance(ref, Mapping) else None

    def latency(self, metric: str, stat: str) -> float | None:
        """A latency (ms) at the reference load, else at the operating point."""
        value = (self.reference or self.point).get(f"{stat}_{metric}_ms")
        return float(value) if isinstance(value, int | float) else None

    @property
    def latency_rate(self) -> float | None:
        """The load (req/s) at which :meth:`latency` was read."""
        rate = self.reference.get("request_rate") if self.reference is not None else self.rate
        return float(rate) if isinstance(rate, int | float) else None

    @property
    def rate(self) -> float | None:
        """Requests/s at the SLO boundary: the stated figure's (the reruns' once measured again) over the
        output tokens of a request; else the search's estimate (``None``: every request at once passed, or
        unknown)."""
        shown, tokens = self.choice.figure, tokens_per_request(self.record)
        if shown.source == "reruns" and shown.value and tokens:
            return shown.value / tokens
        est = self.record.estimate or {}
        rate = est.get("rate") if est.get("kind") in ("crossed", "above") else self.point.get("request_rate")
        return float(rate) if isinstance(rate, int | float) else None


@dataclass(frozen=True)
class Front:
    """What ``autotune best`` reports: the front, the defaults, the export's pick and the outcomes."""

    study: str
    objectives: tuple[str, ...]
    """The objectives' metrics, in the study's order."""
    names: tuple[str, ...]
    """The tuned flags (snake case, the space's order)."""
    defaults: dict[str, FlagValue]
    """vLLM's defaults of the tuned flags (the search space's)."""
    rows: tuple[Row, ...]
    """The front by trial number, then the recommended config when it is not on the front (picked by
    its reruns), then the defaults when they were measured."""
    baseline: FrozenTrial | None
    """The defaults' trial, measured or not."""
    pick: Choice | None
    outcomes: dict[str, int]


def front(study: optuna.Study, loaded: LoadedStudy) -> Front:
    """Read the front and the defaults from ``study`` (every figure through :func:`choose`)."""
    members = pareto_front(study)
    table = reruns(study)  # read once: every row's figure and comparison comes from it
    pick = choose(study, loaded, trial=None, policy=None, table=table) if members else None
    baseline = default_trial(study)
    base = baseline.number if baseline is not None else None

    def row(number: int, role: str, on_front: bool) -> Row:
        found = _row(study, loaded, number, role, pick, on_front, table)
        if pick is None:
            return found
        return dataclasses.replace(found, vs_pick=versus(table, found.choice, pick))

    rows = [row(t.number, "defaults" if t.number == base else "front", True) for t in members]
    shown = {t.number for t in members}
    if pick is not None and pick.trial.number not in shown and pick.trial.number != base:
        # the recommendation comes from the finalists' reruns: it may be off the search's front
        rows.append(row(pick.trial.number, "front", False))
        shown.add(pick.trial.number)
    if baseline is not None and baseline.state == TrialState.COMPLETE and base not in shown:
        rows.append(row(baseline.number, "defaults", False))
    return Front(
        study=loaded.spec.study.name,
        objectives=tuple(o.metric for o in loaded.spec.objectives),
        names=tuple(loaded.space.params),
        defaults=defaults_of(loaded, baseline),
        rows=tuple(rows),
        baseline=baseline,
        pick=pick,
        outcomes=_outcomes(study),
    )


def _row(
    study: optuna.Study,
    loaded: LoadedStudy,
    number: int,
    role: str,
    pick: Choice | None,
    on_front: bool,
    table: Mapping[int, Finalist],
) -> Row:
    choice = choose(study, loaded, trial=number, policy=None, table=table)
    record = full_record(choice.trial, loaded.trial_dir(number))
    return Row(choice, role, pick is not None and pick.trial.number == number, on_front, record)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _source_text(row: Row) -> str:
    """Where a row's figure comes from: ``2 reruns`` (``, 1 missed``), or ``search``."""
    shown = row.choice.figure
    missed = f", {shown.missed} missed" if shown.missed else ""
    if shown.source == "reruns":
        return plural(shown.runs, "rerun") + missed
    return f"search{missed}" if shown.value is not None else f"missed{missed}"


def _plus_minus(interval: tuple[float, float] | None, value: float | None) -> str:
    """`` ±3.1%`` or `` [486.0–2261.0]`` for an interval around ``value`` (:func:`figure_spread`; a lower
    bound when it is open above, nothing when unknown)."""
    if interval is None or not value:
        return ""
    if math.isinf(interval[1]):
        return " (lower bound)"
    return figure_spread(value, *interval)


def _throughput_text(row: Row) -> str:
    """The row's one figure (:attr:`~autotune.results.export.Choice.figure`); its interval is in the JSON
    and CSV: the table compares, and the comparisons carry their own (paired) intervals. A figure the
    search bounded only from below says so."""
    shown = row.choice.figure
    text = _plus_minus(shown.interval, shown.value)
    if text == " (lower bound)" and _client_limit(row.record):
        text = " (lower bound: the client's)"  # the headline says why
    return _num(shown.value, 1) + (text if "lower bound" in text else "")


def _client_limit(record: TrialRecord) -> str | None:
    """Why the client could not measure the trial's search to its end, when it could not."""
    limit = (record.estimate or {}).get("client_limit")
    return str(limit) if limit else None


def _vs_pick_text(row: Row) -> str:
    if row.picked:
        return "pick"
    return _comparison(row.vs_pick)


def _gain_text(row: Row) -> str:
    return "defaults" if row.role == "defaults" else _comparison(row.choice.gain)


def _comparison(found: Gain | None) -> str:
    """A paired gain as a cell: ``+3.1% ±2.0%``, ``(noise)`` where its interval holds zero; ``-`` unknown."""
    if found is None:
        return "-"
    return gain_spread(found.value, found.lo, found.hi) + (" (noise)" if found.within_noise else "")


def _render(table: Table, width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


UNBOUNDED = 10_000
"""A width no table reaches: a table laid out at it shows its natural width."""


@dataclass(frozen=True)
class Column:
    """A column of a table :func:`_fitted` lays out: its header, how it aligns, and its cells."""

    header: str
    cells: tuple[str, ...]
    justify: JustifyMethod = "right"
    keep: int = 0
    """How much the column matters: a narrow terminal drops the lowest first (ties: the rightmost), never
    an :data:`ESSENTIAL` one."""


ESSENTIAL = 100
"""A column a table is never shown without."""


def _table(columns: Sequence[Column]) -> Table:
    """The columns as a table; the first (the row's name) is never wrapped."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for i, column in enumerate(columns):
        table.add_column(column.header, justify=column.justify, no_wrap=i == 0)
    for cells in zip(*(c.cells for c in columns), strict=True):
        table.add_row(*cells)
    return table


def _fitted(columns: Sequence[Column], width: int) -> tuple[str, list[str]]:
    """The table of ``columns`` within ``width``: while its natural width is wider, the least important
    column is left out whole (its values are never cut short); returns the table and the headers of the
    columns left out, in the table's order."""
    kept = list(range(len(columns)))
    while True:
        shown = [columns[i] for i in kept]
        natural = max(len(line) for line in _render(_table(shown), UNBOUNDED).splitlines())
        droppable = [i for i in reversed(kept) if columns[i].keep < ESSENTIAL]
        if natural <= width or not droppable:
            break
        kept.remove(min(droppable, key=lambda i: columns[i].keep))
    dropped = [" ".join(c.header.split()) for i, c in enumerate(columns) if i not in kept]
    return _render(_table(shown), width), dropped


def _dropped_line(dropped: Sequence[str], width: int) -> list[str]:
    """The one line that names the columns a narrow terminal left out (none: no line)."""
    if not dropped:
        return []
    return _wrap(
        f"Not shown at {width} columns: {', '.join(dropped)} (a wider terminal or --format csv shows them).",
        width,
    )


def _label(row: Row) -> str:
    return f"{row.number}{'*' if row.picked else ''}"


MEASUREMENTS_KEEP = {"vs pick": 6, "from": 3, "req/s": 1, "TTFT": 5, "TPOT": 4, "E2EL": 2}
"""How much each droppable column of the measurements matters (higher: kept longer)."""


def _measurements(rows: Sequence[Row], width: int) -> tuple[str, list[str]]:
    """The measurements table within ``width`` and the columns it left out."""
    latencies = [
        Column(
            f"{m.upper()}\n{s} ms",
            tuple(_num(r.latency(m, s)) for r in rows),
            keep=MEASUREMENTS_KEEP[m.upper()],
        )
        for m, s in STATS
    ]
    columns = [
        Column("trial", tuple(_label(r) for r in rows), "left", ESSENTIAL),
        Column("SLO\ntok/s", tuple(_throughput_text(r) for r in rows), keep=ESSENTIAL),
        Column("\nfrom", tuple(_source_text(r) for r in rows), "left", keep=MEASUREMENTS_KEEP["from"]),
        Column(
            "\nreq/s",
            tuple("sat" if r.rate is None else f"{r.rate:.2f}" for r in rows),
            keep=MEASUREMENTS_KEEP["req/s"],
        ),
        *latencies,
        Column("vs\npick", tuple(_vs_pick_text(r) for r in rows), keep=MEASUREMENTS_KEEP["vs pick"]),
        Column("vs\ndefaults", tuple(_gain_text(r) for r in rows), keep=ESSENTIAL),
    ]
    return _fitted(columns, width)


def _flags(report: Front, width: int) -> tuple[str, list[str], list[str]]:
    """The flags table (flags that differ from the defaults in some config) within ``width``, the columns
    it left out (the configs not recommended, the last first) and the folded flags."""
    rows = [r for r in report.rows if r.role == "front"]
    changed = [n for n in report.names if any(r.choice.tuned.get(n) != report.defaults.get(n) for r in rows)]
    folded = [n for n in report.names if n not in changed]
    if not changed:
        return "", [], folded
    defaults = [report.defaults.get(n, "-") for n in changed]
    configs = [
        Column(
            f"#{_label(r)}",
            tuple(
                SAME if r.choice.tuned.get(n) == d else _value(r.choice.tuned.get(n))
                for n, d in zip(changed, defaults, strict=True)
            ),
            keep=ESSENTIAL if r.picked else 1,
        )
        for r in rows
    ]
    columns = [
        Column("flag", tuple(dashed(n) for n in changed), "left", ESSENTIAL),
        Column("default", tuple(_value(d) for d in defaults), keep=ESSENTIAL),
        *configs,
    ]
    table, dropped = _fitted(columns, width)
    return table, dropped, folded


def _value(value: object, missing: str = "-") -> str:
    """A flag's value as YAML and `vllm serve --config` spell it (booleans ``true``/``false``), ``missing``
    for none."""
    if value is None:
        return missing
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` as lines within ``width`` (:func:`autotune.units.wrap`: continuation lines indented)."""
    return wrap(text, width).split("\n")


def best_table(study: optuna.Study, loaded: LoadedStudy, width: int = 100) -> str:
    """The Pareto front (feasible, complete) and the defaults: measurements, flags that differ from the
    defaults, the export's pick and the trial outcomes, within ``width`` columns."""
    report = front(study, loaded)
    lines: list[str] = []
    if not any(r.on_front for r in report.rows):
        lines.append("No complete trial meets the SLOs yet.")
    else:
        count = sum(r.on_front for r in report.rows)
        configs = f"{count} config" + ("" if count == 1 else "s")
        lines += _wrap(f"Pareto front of study {report.study!r}: {configs} (* recommended)", width)
        table, dropped = _measurements(report.rows, width)
        lines += ["", table, *_dropped_line(dropped, width), *_wrap(_latencies_line(report.rows), width), ""]
        flags, left, folded = _flags(report, width)
        if flags:
            lines += _wrap(f"Flags ({SAME} = vLLM's default):", width)
            lines += ["", flags, *_dropped_line(left, width), ""]
        if folded:
            same = ", ".join(f"{dashed(n)}={_value(report.defaults.get(n))}" for n in folded)
            lines += _wrap(f"The defaults in every config: {same}", width)
        assert report.pick is not None
        lines += _wrap(f"Recommended: {headline(report.pick)}.", width)
        for line in _serving_lines(report, loaded):
            lines += _wrap(line, width)
        narrower = narrowing(study, loaded)
        if narrower is not None:
            lines += _wrap(narrower.text(), width)
        found = left_out(study, loaded)
        if found is not None:
            lines += _wrap(found.left_out_text(loaded), width)
    baseline = report.baseline
    if baseline is None:
        lines.append("vLLM defaults: not measured yet.")
    elif baseline.state != TrialState.COMPLETE:
        record = TrialRecord.from_trial(baseline)
        lines += _wrap(
            f"vLLM defaults (trial {baseline.number}): pruned ({record.cause}): {record.summary}", width
        )
    elif not any(r.on_front for r in report.rows):
        table, dropped = _measurements(report.rows, width)
        lines += ["", table, *_dropped_line(dropped, width)]
    if baseline is not None:
        for warning in TrialRecord.from_trial(baseline).default_warnings:
            lines += _wrap(f"vLLM defaults: {warning}", width)
    lines += _wrap(outcome_line(report.outcomes), width)
    surrogate = describe(track_record(study.get_trials(deepcopy=False)))
    if surrogate is not None:
        lines += _wrap(surrogate, width)
    return "\n".join(lines)


def _serving_lines(report: Front, loaded: LoadedStudy) -> list[str]:
    """The pick's and the defaults' replicas for the expected traffic and cost per million tokens."""
    if report.pick is None:
        return []
    base = next((r for r in report.rows if r.role == "defaults"), None)
    defaults = serving(base.choice, loaded) if base is not None else None
    return serving_lines(serving(report.pick, loaded), defaults, loaded)


def reference_load(rows: Sequence[Row]) -> dict[str, Any] | None:
    """The study's reference load as its trials measured it: ``request_rate`` and ``source``."""
    ref = next((r.reference for r in rows if r.reference is not None), None)
    return None if ref is None else {"request_rate": ref.get("request_rate"), "source": ref.get("source")}


def _latencies_line(rows: Sequence[Row]) -> str:
    """Where the table's latencies were read: the one reference load, and which rows lack a probe there."""
    ref = reference_load(rows)
    if ref is None:
        return "Latencies at each config's operating point (its SLO rate, req/s)."
    rate = ref["request_rate"]
    shown = f"{rate:.2f} req/s" if isinstance(rate, int | float) else "?"
    without = [str(r.number) for r in rows if r.reference is None]
    rest = f"; trials {', '.join(without)} at their operating point (no probe there)" if without else ""
    return (
        f"Latencies at one load for every config, {shown} ({ref['source']}){rest}; req/s is each "
        "config's SLO rate."
    )


def _outcomes(study: optuna.Study) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.PRUNED:
            counts[f"pruned:{TrialRecord.from_trial(trial).cause or '?'}"] += 1
        else:
            counts[trial.state.name.lower()] += 1
    order = sorted(counts, key=lambda k: (not k.startswith("complete"), k))
    return {k: counts[k] for k in order}


def outcome_line(outcomes: Mapping[str, int]) -> str:
    """``Trials: 9 complete, 2 pruned:oom, ...``."""
    return "Trials: " + ", ".join(f"{n} {k}" for k, n in outcomes.items())


def outcome_summary(study: optuna.Study) -> str:
    """One line: how many trials completed, were pruned (by cause), failed or are still running."""
    return outcome_line(_outcomes(study))


def _record(row: Row, report: Front, loaded: LoadedStudy) -> dict[str, Any]:
    trial = row.choice.trial
    record = row.record
    finalist = row.choice.finalist
    tuned = row.choice.tuned
    return {
        "trial": trial.number,
        "role": row.role,
        "on_front": row.on_front,
        "picked": row.picked,
        "flags": dashed_flags(tuned),
        "changed": dashed_flags({k: v for k, v in tuned.items() if report.defaults.get(k, v) != v}),
        "objectives": dict(zip(report.objectives, trial.values or [], strict=False)),
        **throughput_fields(row.choice.figure),
        "client_limit": _client_limit(record),
        "reruns": reruns_fields(finalist),
        "request_rate": row.rate,
        "latency_request_rate": row.latency_rate,
        **{f"{m}_{s}_ms": row.latency(m, s) for m, s in STATS},
        **gain_fields(row.choice.gain if row.role == "front" else None),
        **_vs_pick_fields(row),
        **serving(row.choice, loaded).as_dict(),
    }


def best_record(study: optuna.Study, loaded: LoadedStudy) -> dict[str, Any]:
    """The report as one JSON-serialisable object (``autotune best --format json``)."""
    report = front(study, loaded)
    return {
        "study": report.study,
        "objectives": [f"{o.direction} {o.metric}" for o in loaded.spec.objectives],
        "slo": [str(t) for t in loaded.spec.slo.terms],
        "defaults": {"flags": dashed_flags(report.defaults), **defaults_fields(report.pick, report.baseline)},
        "pick": None
        if report.pick is None
        else {
            "trial": report.pick.trial.number,
            "headline": headline(report.pick),
            **_narrowing(study, loaded),
        },
        "reference_load": reference_load(report.rows),
        "tied_not_measured_again": _left_out(study, loaded),
        "configs": [_record(r, report, loaded) for r in report.rows],
        "trials": report.outcomes,
        "surrogate": _surrogate(study),
    }


def _vs_pick_fields(row: Row) -> dict[str, Any]:
    """The config against the pick, paired: ``gain_over_pick`` (-0.05: 5 % less), its interval and the
    paired reruns it rests on (0: the search's stream)."""
    found = row.vs_pick
    return {
        "gain_over_pick": None if found is None else found.value,
        "gain_over_pick_interval": None if found is None else [found.lo, found.hi],
        "gain_over_pick_paired_reruns": None if found is None else found.rounds,
    }


def _narrowing(study: optuna.Study, loaded: LoadedStudy) -> dict[str, Any]:
    """What more paired rounds would make of the pick's gain (:func:`~autotune.study.finalists.narrowing`):
    ``gain_half_width`` now, and the ``more_rounds`` and their ``more_seconds`` to reach ``target``."""
    found = narrowing(study, loaded)
    if found is None:
        return {"narrowing": None}
    return {
        "narrowing": {
            "gain_half_width": found.half,
            "paired_reruns": found.rounds,
            "more_rounds": found.more,
            "more_seconds": found.seconds,
            "target": found.target,
        }
    }


def _left_out(study: optuna.Study, loaded: LoadedStudy) -> dict[str, Any] | None:
    """The configs the search could not tell from its leader that the finalists' stage left out."""
    found = left_out(study, loaded)
    if found is None:
        return None
    return {"trials": [t.number for t in found.left_out], "left_out_by": f"finalists.{found.bound}"}


def _surrogate(study: optuna.Study) -> dict[str, Any] | None:
    """Each measured proposal of the surrogate: predicted and measured SLO rates (req/s)."""
    record = track_record(study.get_trials(deepcopy=False))
    if not record.predictions:
        return None
    return {
        "predictions": [
            {"trial": p.trial, "predicted_rate": p.predicted, "measured_rate": p.measured}
            for p in record.predictions
        ],
        "handed_over": record.handed_over,
    }


def best_json(study: optuna.Study, loaded: LoadedStudy) -> str:
    """:func:`best_record` as indented JSON (ends with a newline)."""
    return json.dumps(best_record(study, loaded), indent=2) + "\n"


def best_csv(study: optuna.Study, loaded: LoadedStudy) -> str:
    """One CSV row per config (the front, then the defaults): flags as dashed columns, then figures."""
    data = best_record(study, loaded)
    flags = [dashed(n) for n in loaded.space.params]
    figures = [
        "slo_throughput",
        "slo_throughput_low",
        "slo_throughput_high",
        "slo_throughput_from",
        "reruns_runs",
        "reruns_missed",
        "search_slo_throughput",
        "search_slo_throughput_low",
        "search_slo_throughput_high",
        "request_rate",
        "latency_request_rate",
        *[f"{m}_{s}_ms" for m, s in STATS],
        "gain_over_defaults",
        "gain_low",
        "gain_high",
        "gain_within_noise",
        "gain_over_pick",
        "gain_over_pick_low",
        "gain_over_pick_high",
    ]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["trial", "role", "on_front", "picked", *flags, *figures])
    for config in data["configs"]:
        again = config["reruns"] or {}
        values = {
            **config,
            **_bounds("slo_throughput", config["slo_throughput_interval"]),
            **_bounds("search_slo_throughput", config["search_slo_throughput_interval"]),
            **_bounds("gain", config["gain_interval"]),
            **_bounds("gain_over_pick", config["gain_over_pick_interval"]),
            "reruns_runs": again.get("runs"),
            "reruns_missed": again.get("missed"),
        }
        writer.writerow(
            [
                config["trial"],
                config["role"],
                _cell(config["on_front"]),
                _cell(config["picked"]),
                *[_cell(config["flags"].get(f)) for f in flags],
                *[_cell(values.get(f)) for f in figures],
            ]
        )
    return out.getvalue()


def _bounds(name: str, interval: Sequence[float | None] | None) -> dict[str, float | None]:
    """``{name}_low`` and ``{name}_high`` from an interval (empty where it is unknown or open above)."""
    low, high = interval if interval else (None, None)
    return {f"{name}_low": low, f"{name}_high": high}


def _cell(value: object) -> str:
    """A CSV cell: :func:`_value`, empty for none."""
    return _value(value, missing="")


def render_best(study: optuna.Study, loaded: LoadedStudy, fmt: BestFormat, width: int = 100) -> str:
    """``autotune best`` in ``fmt`` (the table within ``width`` columns); ends with a newline."""
    if fmt is BestFormat.JSON:
        return best_json(study, loaded)
    if fmt is BestFormat.CSV:
        return best_csv(study, loaded)
    return best_table(study, loaded, width) + "\n"
