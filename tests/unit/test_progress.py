"""Progress lines and the progress bar's figures (autotune/results/progress.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from autotune.events import Event, Kind
from autotune.flags import FlagValue
from autotune.outcome import TrialOutcome
from autotune.results.notify import payload
from autotune.results.progress import Tracker, best_short, event_line, fit
from autotune.results.status import status_of
from autotune.study.standing import best_line

from .fake_trials import FakeTrials
from .test_finalists import _outcome
from .test_study import run, write_spec

BEST = "trial 7: slo_throughput=909 tok/s"

# Texts as the study loop and the rate search write them (from the demo's events.jsonl).
PROBE_FAIL = (
    "probe 1 at rate inf: fail (80 requests, 4.1 s) - fail: ttft:p95 = 2109.1 ms > 500 ms (+322%); "
    "tpot:p95 = 80.4 ms > 35 ms (+130%)"
)
DONE = (
    "complete: slo_throughput=868 tok/s, ttft:p95=163 ms; operating point at 15.7 req/s (10.9-22.6, tpot:p95 "
    "binds)"
)
PRUNED = (
    "pruned (invalid_config): rejected before launch: enable_chunked_prefill or max_num_batched_tokens >= "
    "max_model_len is false (vLLM SchedulerConfig: without chunked prefill, max_num_batched_tokens must be "
    ">= max_model_len)"
)


def _event(kind: Kind, text: str, trial: int | None = 3, **kw: object) -> Event:
    fields: dict[str, object] = {"launches": 4, "budget": 12, "elapsed_s": 343.0, "best": BEST}
    fields.update(kw)
    return Event(kind, text, trial, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("event", "verdict"),
    [
        (_event(Kind.PHASE, PROBE_FAIL), "probe 1 at inf req/s: fail"),
        (_event(Kind.PHASE, "confirming: " + PROBE_FAIL), "confirming: probe 1 at inf req/s: fail"),
        (_event(Kind.TRIAL_DONE, DONE), "#3 complete"),
        (_event(Kind.TRIAL_DONE, PRUNED), "#3 pruned (invalid_config)"),
    ],
)
def test_a_line_cut_to_80_columns_keeps_the_verdict_and_the_best(event: Event, verdict: str) -> None:
    """At 80 columns the line still shows the launches, the best so far and the verdict (the detail is
    what gets cut, with an ellipsis)."""
    line = event_line(event, 80)
    assert len(line) <= 80
    assert line.startswith("[ 5m43s] 4/12 best #7 909 tok/s | ")
    assert verdict in line, line
    assert line.endswith("…")


def test_an_uncut_line_keeps_everything_and_a_probe_says_its_verdict_before_its_numbers() -> None:
    """Width 0 (a log file) never cuts; a probe line reads `probe K at RATE req/s: VERDICT: why (n, s)`."""
    line = event_line(_event(Kind.PHASE, PROBE_FAIL), 0)
    assert line == (
        "[ 5m43s] 4/12 best #7 909 tok/s | #3 probe 1 at inf req/s: fail: ttft:p95 = 2109.1 ms > 500 ms "
        "(+322%); tpot:p95 = 80.4 ms > 35 ms (+130%) (80 requests, 4.1 s)"
    )
    assert (
        event_line(_event(Kind.STARTED, "tuner x started", None, best=None), 0)
        == "[ 5m43s] 4/12 | tuner x started"
    )


def test_fit_and_best_short() -> None:
    """fit cuts to the width with one ellipsis character and flattens newlines; best_short keeps the
    trial and the value, and leaves other shapes alone."""
    assert fit("abcdef", 4) == "abc…"
    assert fit("ab\ncd", 0) == "ab cd"
    assert best_short(BEST) == "#7 909 tok/s"
    assert best_short("something else") == "something else"
    assert best_short(None) == ""


def _launch(tracker: Tracker, trial: int, start: float, seconds: float, *, launched: bool = True) -> None:
    tracker.update(Event(Kind.TRIAL, "launching", trial, launches=trial, budget=10, time=start))
    tracker.update(
        Event(
            Kind.TRIAL_DONE,
            "complete",
            trial,
            launches=trial + 1,
            budget=10,
            time=start + seconds,
            data={"launched": launched},
        )
    )


def test_eta_is_the_mean_launch_times_the_launches_left() -> None:
    """Two launches of 40 s and 60 s with 8 of 10 left: ETA 400 s, said as `50s × 8 left`."""
    tracker = Tracker()
    assert tracker.standing().eta_s is None
    _launch(tracker, 0, 1000.0, 40.0)
    _launch(tracker, 1, 1100.0, 60.0)
    tracker.update(Event(Kind.PHASE, "probe 2 at rate 15.5: pass", 2, launches=2, budget=10, time=1200.0))
    now = tracker.standing()
    assert now.mean_launch_s == pytest.approx(50.0)
    assert now.eta_s == pytest.approx(400.0)
    assert now.eta_text() == "ETA 6m40s (50s × 8 left)"
    assert now.phase_text() == "#2 probe 2 at rate 15.5: pass"


def test_eta_is_shared_by_the_trials_running_at_once() -> None:
    """Four tuners on one study (four trials running, as the latest event counted them): the launches
    left take a quarter of the time, said as such; never divided by more than the launches left."""
    tracker = Tracker()
    _launch(tracker, 0, 1000.0, 40.0)
    _launch(tracker, 1, 1100.0, 60.0)
    tracker.update(Event(Kind.PHASE, "starting", 2, launches=2, budget=10, running=4, time=1200.0))
    now = tracker.standing()
    assert now.eta_s == pytest.approx(100.0) and now.tuners == 4
    assert now.eta_text() == "ETA 1m40s (50s × 8 left ÷ 4 running)"
    tracker.update(Event(Kind.PHASE, "starting", 9, launches=8, budget=10, running=4, time=1300.0))
    assert tracker.standing().eta_s == pytest.approx(50.0)  # 2 left, shared by 2 of the 4


def test_eta_learns_from_earlier_runs_and_ignores_rejected_configs() -> None:
    """A resumed study's ETA comes from the event log of earlier runs; a config rejected before a launch
    (launched false) is not a launch; a spent budget says so."""
    past = Tracker()
    _launch(past, 0, 0.0, 30.0, launched=False)
    assert past.standing().mean_launch_s is None
    tracker = Tracker()
    tracker.seed(
        [
            Event(Kind.TRIAL, "launching", 4, time=10.0, worker="w"),
            Event(Kind.TRIAL_DONE, "complete", 4, time=100.0, worker="w", data={"launched": True}),
        ]
    )
    assert tracker.standing().mean_launch_s == pytest.approx(90.0)
    tracker.update(Event(Kind.FINISHED, "study finished", None, launches=10, budget=10))
    assert tracker.standing().eta_text() == "budget spent"


def test_a_fleet_prints_a_worker_error_or_command_whole() -> None:
    """The fleet cuts its workers' lines to the terminal, but never an error (it says why a worker
    stopped: wrapped whole within the width, a path longer than it on its own line) or a command to copy."""
    from autotune.cli import relayed

    path = "sqlite:////a/very/long/path/" + "x" * 80 + "/study.db:"
    error = (
        f"[gpus 0] error: storage {path} the file is empty; rerun once the storage is back, or give --storage"
    )
    shown = relayed(error, 80).splitlines()
    assert " ".join(" ".join(shown).split()) == error
    assert shown[0] == "[gpus 0] error: storage" and shown[1] == f"  {path}"
    assert all(len(line) <= 80 for line in shown if path not in line), shown
    command = "[gpus 1]   autotune export " + "y" * 90 + ".yaml -o best.yaml"
    assert relayed(command, 80) == command
    progress = "[gpus 1] [   10s] 4/4 best #2 1478 | #3 complete: slo_throughput=1440, " + "z" * 60
    assert len(relayed(progress, 80)) == 80


def test_a_probe_rate_written_with_an_exponent_reads_as_a_figure() -> None:
    """The rate search writes a rate to three significant figures (``1.99e+03`` from 1,990 req/s): the
    progress line says ``1,990 req/s``."""
    text = "probe 2 at rate 1.99e+03: pass (800 requests, 20.0 s) - meets every SLO term"
    line = event_line(_event(Kind.PHASE, text), 0)
    assert "probe 2 at 1,990 req/s: pass: meets every SLO term (800 requests, 20.0 s)" in line
    assert "e+" not in line


def test_a_big_throughput_reads_with_thousands_separators_in_progress_status_and_notifications(
    tmp_path: Path,
) -> None:
    """A study whose best is 19,926.4 tok/s (the user saw `best #0 1.993e+04`): the best-so-far line,
    the trial's own line, `autotune status` and a notification's text all say `19,926`, never `e+`."""

    def measure(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return _outcome(19926.4 if number == 0 else 15000.0 + number)  # an interval of ±2%

    loaded = write_spec(tmp_path, trials=3)
    study, events = run(loaded, FakeTrials(measure))
    line = best_line(study, loaded)  # measured again by the finalists' stage: with its reruns
    assert line is not None and line.startswith("trial 0: slo_throughput=19,926 tok/s"), line
    news = [e for e in events if e.kind is Kind.NEW_BEST]
    assert news and news[0].text == "new best: trial 0: slo_throughput=19,926 tok/s"
    lines = [event_line(e, 0) for e in events]
    assert any(" best #0 19,926 tok/s | " in line for line in lines), lines
    shown = status_of(study, loaded, events, now=events[-1].time).render()
    assert "(trial 0); SLO-constrained throughput 19,926 tok/s [19,528-20,325]" in shown, shown
    told = payload("new_best", news[0], loaded.spec.study.name)["text"]
    assert "19,926 tok/s" in told
    for text in [*lines, shown, told]:
        assert "e+" not in text and "e+0" not in text, text
