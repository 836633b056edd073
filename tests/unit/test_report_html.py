"""The HTML report: the answer first and as the export picks it, self-contained, every section drawn from
the stored trials; signed importances; per-request latencies from probe files; the SVG helpers."""

from __future__ import annotations

import datetime
import html
import json
import math
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from html.parser import HTMLParser
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.events import Event, EventLog, Kind
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.results.export import Format, choose, headline, render, reruns_fields
from autotune.results.htmlreport import build_report
from autotune.results.htmlreport.data import TrialRow, probe_marks, read_latencies, trial_rows, tuner_seconds
from autotune.results.htmlreport.fmt import fmt_pair, rate_text
from autotune.results.htmlreport.importance import MIN_TRIALS, importances, spearman
from autotune.results.htmlreport.style import COLOURS
from autotune.results.htmlreport.svg import Chart, Scale, ecdf, fmt, quantile
from autotune.results.status import read_study
from autotune.store.record import TrialRecord
from autotune.study.finalists import narrowing, reruns
from autotune.study.loop import StudyRunner, close_study, open_study
from autotune.units import format_figure

from .fake_trials import FakeTrials
from .report_study import _probe_file, run_study, stand_in, write_spec

NOW = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)
SECTIONS = [
    "answer", "front", "progress", "launches", "failures", "importance", "latency", "load", "searches",
    "trials", "facts", "method",
]  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> LoadedStudy:
    """The stand-in study run to its budget (shared: the tests here only read it)."""
    return run_study(tmp_path_factory.mktemp("report"))


def _page(loaded: LoadedStudy) -> str:
    study = read_study(loaded)
    assert study is not None
    return build_report(study, loaded, now=NOW)


class _Ids(HTMLParser):
    """Collects element ids in document order, and each section's text."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.text: dict[str, list[str]] = {}
        self._section: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs).get("id")
        if found:
            self.ids.append(found)
        if tag == "section":
            self._section = found

    def handle_data(self, data: str) -> None:
        if self._section:
            self.text.setdefault(self._section, []).append(data)


def _parse(page: str) -> _Ids:
    parser = _Ids()
    parser.feed(page)
    return parser


def test_the_answer_comes_first_and_is_the_exports_pick(finished: LoadedStudy) -> None:
    """The first section is the answer: the trial ``choose`` picks, ``headline``'s sentence, the chosen
    flags against the defaults (changed ones marked) and the `vllm serve` line ``render`` writes; then
    every other section in order."""
    page = _page(finished)
    parsed = _parse(page)
    sections = [i for i in parsed.ids if i in SECTIONS]
    assert sections == SECTIONS
    study = read_study(finished)
    assert study is not None
    choice = choose(study, finished, trial=None, policy=None)
    answer = "".join(parsed.text["answer"])
    assert f"Use trial {choice.trial.number}" in answer
    assert headline(choice) in answer
    assert render(choice, finished, Format.ARGS).strip() in answer
    baseline = choice.baseline
    assert baseline is not None
    changed = sum(1 for k, v in choice.tuned.items() if baseline.params.get(k) != v)
    assert page.count('<tr class="changed">') == changed
    assert f"Flags: {changed} of 4 changed from the defaults" in answer
    assert choice.gain is not None and f"{choice.gain.value:+.1%}" in answer


def test_every_trial_and_outcome_is_shown(finished: LoadedStudy) -> None:
    """Each trial has its row (the charts link to it), launches are counted by outcome, the failure map
    has a mark per config tried, each launched trial's probes are drawn."""
    page = _page(finished)
    study = read_study(finished)
    assert study is not None
    rows = trial_rows(study)
    for row in rows:
        assert f'id="trial-{row.number}"' in page
    text = "".join(_parse(page).text["launches"])
    launched = sum(1 for r in rows if r.launched)
    assert f"{launched} launches (the budget counts these)" in text
    for outcome in ("complete", "oom", "slo_unreachable", "predicted_infeasible"):
        assert outcome in text
    failures = page[page.index('id="failures"') : page.index('id="importance"')]
    assert failures.count('href="#trial-') == len(rows)
    searches = page[page.index('id="searches"') : page.index('id="trials"')]
    assert searches.count("<tr>") == 1 + sum(1 for r in rows if r.launched and r.probes)


def test_the_report_is_self_contained_and_well_formed(finished: LoadedStudy) -> None:
    """No external resource (script, style, image, font or link to load), every SVG parses as XML, and no
    Python ``None``/``nan`` leaks into the text."""
    page = _page(finished)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "url(" not in page and "<link" not in page and "@import" not in page
    assert "<script src" not in page
    for svg in re.findall(r"<svg.*?</svg>", page, flags=re.S):
        ET.fromstring(svg)
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    assert not re.search(r"\b(None|nan|inf)\b", text)


def test_a_study_with_nothing_feasible_says_so(tmp_path: Path) -> None:
    """When no config met the SLOs the answer says so with the causes and what to do, and every section
    still renders."""
    loaded = load_study(write_spec(tmp_path, launches=3))

    def crash(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return TrialOutcome(Cause.OOM, "CUDA out of memory", attrs={"launched": True})

    log = EventLog(loaded.workdir / "events.jsonl")
    study = open_study(loaded, create=True)
    StudyRunner(loaded, study, FakeTrials(crash), on_event=log, on_stale=lambda t: None).run()
    page = _page(loaded)
    answer = "".join(_parse(page).text["answer"])
    assert "No config met the SLOs" in answer and "3 oom" in answer
    assert [i for i in _parse(page).ids if i in SECTIONS] == SECTIONS


def test_importances_are_signed_for_the_objective_direction() -> None:
    """A flag that raises a maximised objective is signed +, one that lowers it -, a noise flag has no
    clear trend; with the objective minimised the signs follow "better", not "higher"."""
    rng = random.Random(0)
    space = {
        "up": optuna.distributions.IntDistribution(1, 100),
        "down": optuna.distributions.FloatDistribution(0.0, 1.0),
        "noise": optuna.distributions.IntDistribution(1, 100),
        "dtype": optuna.distributions.CategoricalDistribution(["auto", "fp8"]),
    }
    for maximize in (True, False):
        study = optuna.create_study(directions=["maximize" if maximize else "minimize", "minimize"])
        drawn = [
            {"up": rng.randint(1, 100), "down": rng.random(), "dtype": rng.choice(["auto", "fp8"])}
            for _ in range(40)
        ]
        goods = [p["up"] - 60 * p["down"] + (80 if p["dtype"] == "fp8" else 0) for p in drawn]
        ranked = sorted(range(40), key=lambda i: goods[i])
        for rank, i in enumerate(ranked):  # noise rises and falls with the result: no monotone relation
            drawn[i]["noise"] = 50 + rank // 2 if rank % 2 == 0 else 50 - rank // 2 - 1
        for params, good in zip(drawn, goods, strict=True):
            value = good if maximize else -good
            study.add_trial(
                optuna.trial.create_trial(params=params, distributions=space, values=[value, 1.0])
            )
        result = importances(study, list(space), maximize=maximize)
        signs = {i.name: i.sign for i in result.items}
        assert signs["up"] == 1 and signs["down"] == -1 and signs["noise"] == 0
        assert signs["dtype"] is None and result.items[-1].name in ("noise", "dtype")
        assert {i.name: i.best_choice for i in result.items}["dtype"] == "fp8"
        assert math.isclose(sum(i.importance for i in result.items), 1.0)
        assert result.trials == 40 and "PED-ANOVA" in result.method


def test_too_few_trials_give_no_importances_and_say_why() -> None:
    """Below the minimum of measured trials no importance is given, and the reason names the count."""
    study = optuna.create_study(directions=["maximize"])
    dist = {"x": optuna.distributions.IntDistribution(1, 10)}
    for x in range(1, MIN_TRIALS):
        study.add_trial(optuna.trial.create_trial(params={"x": x}, distributions=dist, values=[float(x)]))
    result = importances(study, ["x"], maximize=True)
    assert result.items == () and f"only {MIN_TRIALS - 1} measured trials" in result.reason


def test_spearman() -> None:
    """Rank correlation: monotone is 1 whatever the spacing, reversed is -1, ties take their mean rank,
    a constant side has none."""
    assert spearman([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.894427, abs=1e-6)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_latencies_are_the_judged_successful_requests_of_the_probe(tmp_path: Path) -> None:
    """From a probe file: the judged requests only (warm-up left out), failed ones left out, TPOT as
    ``vllm bench serve`` defines it: (E2EL - TTFT) / (output tokens - 1), in ms."""
    path = tmp_path / "probe-2.json"
    _probe_file(path, 3.0, random.Random(1), 100.0, 20.0)
    data = json.loads(path.read_text())
    got = read_latencies(7, path)
    assert got is not None and got.trial == 7 and got.rate == 3.0
    keep = [i for i in range(10, 60) if not data["errors"][i]]
    assert len(got.ttft_ms) == len(keep) == 49
    assert got.ttft_ms[0] == pytest.approx(data["ttfts"][10] * 1000)
    i = keep[0]
    tpot = (data["latencies"][i] - data["ttfts"][i]) / (data["output_lens"][i] - 1) * 1000
    assert got.tpot_ms[0] == pytest.approx(tpot)
    assert read_latencies(7, tmp_path / "missing.json") is None


def test_scales_ticks_and_charts() -> None:
    """Ticks are round and inside the scale (linear and log); a chart is one well-formed SVG element; the
    ECDF and quantiles are those of the values."""
    linear = Scale.fit([3.0, 97.0], 0, 100)
    assert all(linear.lo <= t <= linear.hi for t in linear.ticks()) and 20.0 in linear.ticks()
    log = Scale.fit([8.0, 512.0], 0, 100, log=True)
    assert {10.0, 100.0} <= set(log.ticks()) and log(8.0) < log(64.0) < log(512.0)
    chart = Chart.over(300, 200, [1.0, 2.0], [5.0, 9.0], xlabel="x & y", label="a <test>")
    chart.point(1.5, 7.0, "c-pick", shape="star", title="trial 1 <best>", href="#trial-1")
    chart.line([(1.0, 5.0), (2.0, 9.0)], "c-front", step=True)
    chart.span(1.0, 5.0, math.inf, "err")
    root = ET.fromstring(chart.render())
    assert root.tag.endswith("svg") and root.get("aria-label") == "a <test>"
    assert ecdf([3.0, 1.0, 2.0]) == [(1.0, 1 / 3), (2.0, 2 / 3), (3.0, 1.0)]
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)


def test_figures_in_the_report_never_read_in_exponent_notation(finished: LoadedStudy) -> None:
    """Tooltips and tick labels write figures with thousands separators or three significant figures
    (``19,926``, ``0.00005``, ``12.5k``), never ``1.993e+04``."""
    assert fmt(25_000.0) == "25k" and fmt(12_500.0) == "12.5k" and fmt(1500.0) == "1,500"
    assert fmt(0.00005) == "0.00005" and fmt(0.0) == "0" and fmt(-250.0) == "-250"
    pair = fmt_pair("SLO-constrained throughput (tok/s)", 19926.4, "p95 TTFT (ms)", 412.3)
    assert pair == "SLO-constrained throughput (tok/s) 19,926, p95 TTFT (ms) 412"
    page = _page(finished)
    shown = re.findall(r"<title>(.*?)</title>", page) + re.findall(
        r'<text class="tick"[^>]*>(.*?)</text>', page
    )
    assert shown
    assert not [t for t in shown if re.search(r"\d[eE][+-]?\d", t)]


def test_the_tuners_wall_time_counts_overlapping_runs_once() -> None:
    """Two workers running at once count once; a resumed run adds its own span, not the pause."""

    def at(worker: str, t: float) -> Event:
        return Event(kind=Kind.PHASE, text="", worker=worker, time=t)

    events = [at("a", 0), at("b", 10), at("a", 100), at("b", 120), at("c", 1000), at("c", 1050)]
    assert tuner_seconds(events) == 170.0
    assert tuner_seconds([]) is None


def test_a_study_just_created_renders(tmp_path: Path) -> None:
    """A study whose only trial (the defaults) is still queued gives a page with every section, each
    saying there is nothing yet."""
    loaded = load_study(write_spec(tmp_path))
    close_study(open_study(loaded, create=True))
    page = _page(loaded)
    parsed = _parse(page)
    assert [i for i in parsed.ids if i in SECTIONS] == SECTIONS
    assert "No answer yet" in page and "No trial was measured yet" in page


def test_the_rate_search_strip_reads_each_probes_verdict_from_the_whole_record(tmp_path: Path) -> None:
    """A trial whose probes did not fit optuna-dashboard's limit keeps a short form of each on the trial
    (no verdict, no capacity) and its whole record in its folder: the report reads the whole record, so
    the saturation probe is drawn with its capacity and the passing probe as passed, with its reason."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from autotune.store.record import TrialRecord, save_record, stored_attrs

    loaded = load_study(write_spec(tmp_path, launches=1))
    flags = {"gpu_memory_utilization": 0.9, "max_num_seqs": 32, "block_size": 16, "kv_cache_dtype": "auto"}
    common = {"completed": 200, "failed": 0, "output_throughput": 950.0, "terms": {"x": "y" * 200}}
    probes = (
        {"rate": None, "saturation": True, "passed": False, "status": "fail", "capacity": 14.0, **common,
         "why": "saturation: the burst's capacity"},
        {"rate": 9.7, "saturation": False, "passed": True, "status": "pass", **common,
         "why": "meets every SLO term"},
        {"rate": 11.0, "saturation": False, "passed": False, "status": "fail", **common,
         "why": "fail: tpot:p95"},
    )  # fmt: skip
    attrs = TrialRecord(launched=True, flags=flags, probes=probes, summary="measured").to_attrs()
    shown, shortened = stored_attrs(attrs)
    assert shortened and all("passed" not in p for p in shown["probes"])
    study = open_study(loaded, create=True)  # the defaults are queued as trial 0: this one is trial 1
    try:
        detail = save_record(loaded.trial_dir(1), loaded.workdir, attrs)
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE,
                values=[950.0, 100.0],
                params=flags,
                distributions={
                    "gpu_memory_utilization": FloatDistribution(0.8, 0.98),
                    "max_num_seqs": IntDistribution(8, 512),
                    "block_size": CategoricalDistribution([16, 32]),
                    "kv_cache_dtype": CategoricalDistribution(["auto", "fp8"]),
                },
                user_attrs={**shown, **detail},
            )
        )
        short = {r.number: r for r in trial_rows(study)}[1]
        whole = {r.number: r for r in trial_rows(study, loaded)}[1]
    finally:
        close_study(study)
    assert [p.get("passed") for p in short.probes] == [None, None, None]
    assert [p.get("passed") for p in whole.probes] == [False, True, False]
    searches = _section(_page(loaded), "searches")
    marks = _strip_marks(searches)[1]
    assert marks == [
        ("saturation", "probe 1 saturation (every request at once), capacity 14 req/s: saturation: the "
         "burst's capacity"),
        ("pass", "probe 2 at 9.7 req/s: meets every SLO term"),
        ("fail", "probe 3 at 11 req/s: fail: tpot:p95"),
    ]  # fmt: skip
    # Without the whole record (another host): the short form still draws, its verdicts derived from the
    # stored status, the saturation probe at the axis' end (its capacity was not kept), every tooltip said.
    (loaded.trial_dir(1) / "record.json").unlink()
    marks = _strip_marks(_section(_page(loaded), "searches"))[1]
    assert [m[0] for m in marks] == ["saturation", "pass", "fail"]
    assert marks[0][1] == (
        "probe 1 saturation (every request at once), capacity not recorded: fail; 200 completed; 950 tok/s "
        "(no reason stored with this probe)"
    )
    assert (
        marks[1][1]
        == "probe 2 at 9.7 req/s: pass; 200 completed; 950 tok/s (no reason stored with this probe)"
    )


def _section(page: str, name: str) -> str:
    """The markup of section ``name`` (up to the next section)."""
    start = page.index(f'<section id="{name}"')
    end = page.find("<section", start + 1)
    return page[start : end if end >= 0 else len(page)]


def _strip_marks(searches: str) -> dict[int, list[tuple[str, str]]]:
    """Each strip's probe marks, by trial: (the verdict its CSS class names, its tooltip)."""
    out: dict[int, list[tuple[str, str]]] = {}
    for row in re.finditer(r'<tr><td><a href="#trial-(\d+)">.*?</tr>', searches, flags=re.S):
        out[int(row.group(1))] = [
            (verdict, html.unescape(title))
            for verdict, title in re.findall(
                r'class="pt c-[\w-]+ probe-(\w+)"[^>]*><title>(.*?)</title>', row.group(0), flags=re.S
            )
        ]
    return out


def _row(probes: list[dict[str, object]], curve: dict[str, object] | None = None) -> TrialRow:
    """A launched trial's row holding ``probes`` (and ``curve``) as stored."""
    return TrialRow(
        number=3, state="complete", cause=None, launched=True, baseline=False, feasible=True, flags={},
        values=None, slo_throughput=None, interval=None, rate=None, rate_interval=None, binding=None,
        latency={}, start=None, end=None, summary="", probes=tuple(probes), curve=curve,
    )  # fmt: skip


def test_a_probe_without_its_verdict_still_draws_with_the_verdict_its_record_implies() -> None:
    """A probe's stored ``passed``, ``why`` and ``capacity`` are read as they are; a probe from an older or
    shortened record gets its verdict from what is stored: the SLO status (an early stop or
    over-saturation fails it), else the terms' violations; the saturation probe its capacity from the
    trial's curve; and a reason built from its figures."""
    marks = probe_marks(
        _row(
            [
                {"rate": None, "status": "fail", "completed": 80, "failed": 0},
                {"rate": 3.0, "saturation": False, "passed": True, "status": "fail", "why": "stored"},
                {"rate": 9.0, "passed": False, "status": "pass", "why": "over-saturated: queue grew"},
                {"rate": 5.0, "status": "pass", "completed": 40, "failed": 1, "output_throughput": 912.5},
                {"rate": 6.0, "status": "pass", "early_stopped": True},
                {"rate": 7.0, "status": "fail"},
                {"rate": 4.0, "terms": {"ttft:p95": {"value_ms": 120.0, "violation": -0.2},
                                        "tpot:p95": {"value_ms": 18.0, "violation": -0.1}}},
                {"rate": 8.0, "terms": {"ttft:p95": {"value_ms": 360.0, "violation": 0.2}}},
            ],
            curve={"terms": [], "points": [], "capacity": 12.5},
        )
    )  # fmt: skip
    assert [(m.verdict, m.passed, m.derived) for m in marks] == [
        ("saturation", False, True),
        ("pass", True, False),
        ("fail", False, False),
        ("pass", True, True),
        ("fail", False, True),
        ("fail", False, True),
        ("pass", True, True),
        ("fail", False, True),
    ]
    assert marks[0].rate is None and marks[0].capacity == 12.5
    assert marks[1].why == "stored" and marks[2].why == "over-saturated: queue grew"
    assert marks[3].why == "pass; 40 completed, 1 failed; 912 tok/s (no reason stored with this probe)"
    assert marks[4].why.startswith("pass; stopped early")
    assert marks[7].why == "no verdict stored; ttft:p95 = 360 ms (+20%) (no reason stored with this probe)"
    alone = probe_marks(_row([{"rate": None}]))
    assert alone[0].verdict == "saturation" and alone[0].capacity is None


def test_the_strips_colours_are_the_probes_stored_verdicts(finished: LoadedStudy) -> None:
    """Every launched trial's strip draws each stored probe in its verdict's colour (pass, fail, the
    saturation probe its own), with its reason as the tooltip; the three colours differ and the legend
    names each."""
    study = read_study(finished)
    assert study is not None
    page = _page(finished)
    searches = _section(page, "searches")
    drawn = _strip_marks(searches)
    rows = [r for r in trial_rows(study, finished) if r.launched and r.probes]
    assert rows and sorted(drawn) == [r.number for r in rows]
    for row in rows:
        expected = []
        for k, p in enumerate(row.probes, start=1):
            if p["saturation"]:
                where = f"saturation (every request at once), capacity {rate_text(p['capacity'])} req/s"
            else:
                where = f"at {rate_text(p['rate'])} req/s"
            verdict = "saturation" if p["saturation"] else "pass" if p["passed"] else "fail"
            expected.append((verdict, f"probe {k} {where}: {p['why']}"))
        assert drawn[row.number] == expected
        assert [v for v, _ in expected] == ["saturation", "pass", "fail"]  # the stand-in's every kind
    assert len({COLOURS["pass"], COLOURS["fail"], COLOURS["saturation"]}) == 3
    for verdict in ("pass", "fail", "saturation"):
        assert f"svg .c-{verdict}{{fill:{COLOURS[verdict]};" in page
    legend = re.search(r'<p class="legend">(.*?)</p>', searches, flags=re.S)
    assert legend is not None
    keyed = re.findall(r'class="pt (c-[\w-]+)"[^>]*/></svg>([^<]*)</span>', legend.group(1))
    assert keyed[:3] == [
        ("c-pass", "met every SLO term"),
        ("c-fail", "missed a term (or stopped early, or over-saturated)"),
        ("c-saturation", "saturation probe (every request at once), at its measured capacity"),
    ]


def test_latency_against_load_draws_the_stored_curves_of_the_pick_and_the_defaults(
    finished: LoadedStudy,
) -> None:
    """The load chart has a point per stored curve point of the pick and of the defaults (each term's value
    in ms at its rate, as the tooltip says), and each SLO limit as a dashed line: a point over its limit is
    drawn above that line, one within it below."""
    study = read_study(finished)
    assert study is not None
    choice = choose(study, finished, trial=None, policy=None)
    assert choice.baseline is not None and choice.baseline.number != choice.trial.number
    load = _section(_page(finished), "load")
    lines = {
        html.unescape(label): float(y)
        for y, label in re.findall(
            r'<line class="slo" x1="[\d.]+" x2="[\d.]+" y1="([\d.]+)" y2="[\d.]+"/>'
            r'<text class="note" x="[\d.]+" y="[\d.]+">([^<]*)</text>',
            load,
        )
    }
    assert lines.keys() == {"p95 TTFT ≤ 500 ms", "p95 TPOT ≤ 50 ms"}
    circles = {
        html.unescape(title): float(cy)
        for cy, title in re.findall(
            r'<circle class="pt [^"]*" cx="[\d.]+" cy="([\d.]+)"[^>]*><title>(.*?)</title>', load
        )
    }
    shown = 0
    placed: list[tuple[float, float]] = []  # (TTFT in ms, its circle's y)
    for trial, label in ((choice.trial, "chosen"), (choice.baseline, "vLLM defaults")):
        curve = TrialRecord.from_trial(trial).curve
        assert curve is not None and curve["terms"] == ["ttft:p95", "tpot:p95"]
        for rate, ttft_s, tpot_s in curve["points"]:
            for name, value in (("p95 TTFT", ttft_s * 1000), ("p95 TPOT", tpot_s * 1000)):
                over = value > (500 if name == "p95 TTFT" else 50)
                title = (
                    f"trial {trial.number} ({label}): {name} {format_figure(value, 'ms')} at "
                    f"{format_figure(rate)} req/s{' (over its limit)' if over else ''}"
                )
                assert title in load
                shown += 1
                if name == "p95 TTFT":
                    assert (circles[title] < lines["p95 TTFT ≤ 500 ms"]) == over
                    placed.append((value, circles[title]))
    assert shown == 8 and load.count('class="pt ') == shown + 4  # and the legend's four swatches
    # The limits sit where the latency axis (log scale, fitted through two of the points) puts them.
    (v1, y1), (v2, y2) = min(placed), max(placed)
    assert v2 > v1 * 1.1

    def at(value: float) -> float:
        return y1 + (y2 - y1) * math.log(value / v1) / math.log(v2 / v1)

    assert (
        abs(at(500.0) - lines["p95 TTFT ≤ 500 ms"]) < 1.0 and abs(at(50.0) - lines["p95 TPOT ≤ 50 ms"]) < 1.0
    )


def test_the_defaults_rerun_figures_are_shown_as_the_picks_are(finished: LoadedStudy, tmp_path: Path) -> None:
    """With the finalists measured again, the answer shows the defaults' figure as the mean of their
    reruns (each rerun's figure, the interval and the search's figure beside it), the export's
    ``reruns_fields`` exactly; without reruns, the search's figure."""
    loaded = load_study(write_spec(tmp_path, launches=6, finalists={"count": 1, "max_share": 1}))
    trials = stand_in(lambda: loaded)
    first = trials.run

    def again(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        outcome = first(number, flags, phase)  # measured again 20 % lower: the reruns differ from the search
        if outcome.values is None:
            return outcome
        estimate = {
            k: v * 0.8 if k.startswith("slo_throughput") else v for k, v in outcome.attrs["estimate"].items()
        }
        values = (outcome.values[0] * 0.8, *outcome.values[1:])
        return TrialOutcome(
            None, outcome.summary, values, outcome.constraints, {**outcome.attrs, "estimate": estimate}
        )

    trials.again = again
    study = open_study(loaded, create=True)
    study.enqueue_trial(  # beats the defaults (fp8, 128 sequences) without running out of memory
        {"gpu_memory_utilization": 0.9, "max_num_seqs": 128, "block_size": 16, "kv_cache_dtype": "fp8"}
    )
    try:
        StudyRunner(
            loaded, study, trials, on_event=lambda e: None, on_stale=lambda t: None, sleep=lambda s: None
        ).run()
    finally:
        close_study(study)
    study = read_study(loaded)
    assert study is not None
    choice = choose(study, loaded, trial=None, policy=None)
    base = choice.baseline
    assert base is not None and base.number != choice.trial.number
    fields = reruns_fields(reruns(study).get(base.number))
    assert fields is not None and fields["runs"] == 1
    search = TrialRecord.from_trial(base).slo_throughput
    assert search is not None and fields["slo_throughput_mean"] == pytest.approx(search * 0.8)
    answer = " ".join(html.unescape("".join(_parse(_page(loaded)).text["answer"])).split())
    lo, hi = fields["interval"]
    assert (
        f"{format_figure(fields['slo_throughput_mean'])}tok/svLLM defaults (trial {base.number}), mean of 1 "
        f"rerun(s)interval {format_figure(lo)}–{format_figure(hi)}; reruns "
        f"{format_figure(fields['slo_throughput_runs'][0])}; search {format_figure(search)}"
    ) in answer.replace(" tok/s", "tok/s")
    narrower = narrowing(study, loaded)  # what more rounds would give, as best says it
    assert (narrower is not None) == ("The gain is known to" in answer)
    assert narrower is None or " ".join(narrower.text().split()) in answer
    plain = " ".join(html.unescape("".join(_parse(_page(finished)).text["answer"])).split())
    record = TrialRecord.from_trial(study_of(finished).trials[0])
    figure, interval = record.slo_throughput, record.slo_throughput_interval
    assert figure is not None and interval is not None
    assert (
        f"{format_figure(figure)}tok/svLLM defaults (trial 0), SLO-constrained throughputinterval "
        f"{format_figure(interval[0])}–{format_figure(interval[1])} (search)"
    ) in plain
    assert "rerun" not in plain


def study_of(loaded: LoadedStudy) -> optuna.Study:
    """The study of ``loaded``, read-only."""
    study = read_study(loaded)
    assert study is not None
    return study


def test_the_spec_is_named_as_the_user_typed_it(
    finished: LoadedStudy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header, the run's facts, the export hint and the footer name the spec as given to `autotune
    report` (relative, quoted for a shell where it must be), not its resolved path; without it, the
    resolved path."""
    study = read_study(finished)
    assert study is not None
    typed = "studies/my spec.yaml"
    page = build_report(study, finished, now=NOW, spec_shown=typed)
    assert f'spec <code id="spec-path">{typed}</code>' in page
    assert f"<tr><th>spec</th><td>{typed}</td></tr>" in page
    assert "autotune export &#x27;studies/my spec.yaml&#x27; -o best.yaml" in page
    assert "rerun <code>autotune report &#x27;studies/my spec.yaml&#x27;</code>" in page
    assert str(finished.spec_path) not in page.replace(str(finished.workdir), "")
    assert f'<code id="spec-path">{finished.spec_path}</code>' in _page(finished)
    monkeypatch.chdir(finished.spec_path.parent.parent)
    relative = f"{finished.spec_path.parent.name}/{finished.spec_path.name}"
    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["report", relative, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f'<code id="spec-path">{relative}</code>' in out.read_text()
