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

from autotune.events import Event, EventLog, Kind
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.results.export import Format, choose, headline, render
from autotune.results.htmlreport import build_report
from autotune.results.htmlreport.data import read_latencies, trial_rows, tuner_seconds
from autotune.results.htmlreport.fmt import fmt_pair
from autotune.results.htmlreport.importance import MIN_TRIALS, importances, spearman
from autotune.results.htmlreport.svg import Chart, Scale, ecdf, fmt, quantile
from autotune.results.status import read_study
from autotune.study.loop import StudyRunner, close_study, open_study

from .fake_trials import FakeTrials
from .report_study import _probe_file, run_study, write_spec

NOW = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)
SECTIONS = [
    "answer", "front", "progress", "launches", "failures", "importance", "latency", "searches", "trials",
    "facts", "method",
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
    searches = _page(loaded)
    searches = searches[searches.index('id="searches"') : searches.index('id="trials"')]
    assert "probe 1: saturation, capacity 14 req/s: saturation: the burst&#x27;s capacity" in searches
    assert "probe 2 at 9.7 req/s: meets every SLO term" in searches
