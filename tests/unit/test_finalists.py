"""Finalists: the leader, its rivals within the noise and the defaults measured again on fresh shared
requests, each (finalist, round) once however many workers; one rule picks the recommended config, and its
gain over the defaults comes from paired reruns, with its interval, called noise when it holds zero."""

from __future__ import annotations

import dataclasses
import html
import math
import random
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState, create_trial

from autotune.cli import _summary
from autotune.events import Kind
from autotune.flags import FlagValue
from autotune.outcome import TrialOutcome
from autotune.results.best import best_record, best_table
from autotune.results.export import Format, choose, headline, render
from autotune.results.htmlreport import build_report
from autotune.results.notify import notification_for
from autotune.store.record import TrialRecord
from autotune.study.finalists import (
    ROUND_SEED_STEP,
    Finalist,
    Gain,
    Rerun,
    finalists,
    gain,
    ledger,
    pick,
    reruns,
    round_seed,
    schedule,
    scheduled,
    stage,
    tied,
)
from autotune.study.loop import StudyRunner, default_trial, open_study
from autotune.study.standing import best_line, is_launch

from .fake_trials import FakeTrials
from .test_study import run, write_spec


def _outcome(
    tput: float, spread: float = 0.02, batches: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
) -> TrialOutcome:
    """A measured config at ``tput`` tok/s (50 tokens a request) with an interval of ±``spread``."""
    rate = tput / 50
    estimate = {
        "kind": "crossed",
        "rate": rate,
        "slo_throughput": tput,
        "slo_throughput_lo": tput * (1 - spread),
        "slo_throughput_hi": tput * (1 + spread),
        "batch_rates": [rate * b for b in batches],
        "bracket": [rate * 0.995, rate * 1.005],
        "noise": spread / 1.96,
        "pace": [2.0, 20.0],
    }
    return TrialOutcome(
        cause=None,
        summary=f"{tput:.0f} tok/s",
        values=(tput, 100.0),
        constraints=(-0.1, 0.0),
        attrs={"operating_point": {"output_throughput": tput}, "estimate": estimate},
    )


def surface(flags: Mapping[str, FlagValue]) -> float:
    return 1000.0 * float(flags["gpu_memory_utilization"]) * min(int(flags["max_num_seqs"]), 64) / 64


def unshared(flags: Mapping[str, FlagValue], spread: float) -> tuple[float, ...]:
    """Batch rates (relative) that move by about ``spread`` and differently for each config: luck the
    configs did not share, which the search cannot pair away."""
    draw = random.Random(repr(sorted(flags.items())))
    return tuple(1 + spread * draw.uniform(-1, 1) for _ in range(4))


def steady(spread: float = 0.02, shared: bool = False) -> FakeTrials:
    """Every config at :func:`surface` with an interval of ±``spread`` and batches that move as much, each
    config its own way, or (``shared``) all alike."""

    def measure(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        batches = (1 - spread, 1 + spread, 1.0, 1.0) if shared else unshared(flags, spread)
        return _outcome(surface(flags), spread, batches)

    return FakeTrials(measure)


def test_after_the_budget_the_finalists_and_the_defaults_are_measured_again(tmp_path: Path) -> None:
    """Wide noise: the best three cannot be told apart and are all measured again, with the defaults, once, on
    round 1's shared fresh stream, each search starting at its trial's boundary; a rerun of the finished
    study measures nothing again."""
    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 3, "target": None})
    trials = steady(spread=0.5)
    study, events = run(loaded, trials)
    launched = [t for t in study.get_trials(deepcopy=False) if is_launch(t)]
    assert len(launched) == 8  # reruns spend no launch and are not trials
    baseline = default_trial(study)
    assert baseline is not None
    assert baseline.number in trials.confirmed and len(set(trials.confirmed)) == len(trials.confirmed)
    assert 3 <= len(trials.confirmed) <= 4  # three best, plus the defaults unless among them
    best = sorted(launched, key=lambda t: (-t.values[0], t.number))[0]
    assert trials.confirmed[0] == best.number  # the leader first
    assert set(trials.seeds) == {round_seed(loaded.spec.workload.seed, 1)}
    assert all(s is not None and s.pace == (2.0, 20.0) for s in trials.starts)
    assert set(reruns(study)) == set(trials.confirmed)
    assert [e.kind for e in events].count(Kind.CONFIRMED) == len(trials.confirmed)
    again = steady()
    run(loaded, again)
    assert again.confirmed == []


@pytest.mark.parametrize("shared", [False, True], ids=["narrow", "paired"])
def test_only_configs_the_search_could_not_tell_from_the_leader_are_measured_again(
    tmp_path: Path, shared: bool
) -> None:
    """Narrow intervals, or wide ones whose luck every config shared (their batches moved alike on the
    one stream they all met, so the pairs are told apart though the intervals overlap): only the leader
    and the defaults run again."""
    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 3})
    trials = steady(spread=0.3, shared=True) if shared else steady(spread=0.0001)
    study, _ = run(loaded, trials)
    top = max(
        (t for t in study.get_trials(deepcopy=False) if is_launch(t) and t.values), key=lambda t: t.values[0]
    )
    base = default_trial(study)
    assert base is not None
    assert sorted(trials.confirmed) == sorted({top.number, base.number})


def test_trials_without_batches_are_told_apart_by_their_own_intervals(tmp_path: Path) -> None:
    """Estimates without batches (a boundary beyond every rate, records from before batches): no pairing,
    so overlapping intervals of their own tie, and the best three are measured again with the defaults."""

    def plain(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return _outcome(surface(flags), 0.5, batches=())

    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 3, "target": None})
    trials = FakeTrials(plain)
    run(loaded, trials)
    assert 3 <= len(trials.confirmed) <= 4


def test_the_pick_is_made_by_the_reruns_not_the_luckiest_first_figure(tmp_path: Path) -> None:
    """The leader measured at half of its figure again loses to a runner-up measured alike: the progress
    line, the table, the export header and the export all name the runner-up."""
    lucky: list[int] = []

    def again(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        if not lucky:  # the leader is measured again first
            lucky.append(number)
            return _outcome(surface(flags) * 0.5)
        return _outcome(surface(flags))

    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 3})
    trials = FakeTrials(steady(spread=0.5).run, again)
    study, events = run(loaded, trials)
    chosen = pick(study, loaded)
    assert chosen is not None and chosen.confirmed and chosen.trial.number != lucky[0]
    choice = choose(study, loaded, trial=None, policy=None)
    assert choice.trial.number == chosen.trial.number
    assert choice.finalist is not None and len(choice.finalist.met) == 1
    line = best_line(study, loaded)
    assert line is not None and line.startswith(f"trial {chosen.trial.number}:") and "(1 rerun)" in line
    assert events[-1].best == line
    assert f"Recommended: trial {chosen.trial.number}" in best_table(study, loaded)
    text = render(choice, loaded, Format.VLLM_YAML)
    assert f"trial {chosen.trial.number}" in text.splitlines()[0]
    assert "mean of 1 rerun)" in text.splitlines()[1]


def test_only_a_confirmed_best_notifies_when_finalists_are_measured(tmp_path: Path) -> None:
    """With finalists, the search's new bests (its luckiest first figures) are not notified; the rerun
    that first confirms the pick, or makes another config the pick, is; reruns that leave the pick as it
    was are not. Without finalists the search's new bests notify."""
    loaded = write_spec(tmp_path, trials=6, finalists={"max_share": 1, "count": 2, "rounds": 2})
    _, events = run(loaded, steady(spread=0.0001))
    bests = [e for e in events if e.kind is Kind.NEW_BEST]
    told = [e for e in bests if notification_for(e) == "new_best"]
    assert any(not e.data["confirmed"] for e in bests), "the search found bests"
    assert all(e.data["confirmed"] for e in told) and 1 <= len(told) < len(
        [e for e in bests if e.data["confirmed"]]
    )
    (tmp_path / "plain").mkdir()
    plain = write_spec(tmp_path / "plain", trials=4, finalists={"count": 0})
    _, events = run(plain, steady(spread=0.0001))
    assert next(notification_for(e) for e in events if e.kind is Kind.NEW_BEST) == "new_best"


def test_a_gain_within_the_noise_is_called_so(tmp_path: Path) -> None:
    """Every config measures within a few percent of one value, with wide intervals: nothing beats the
    defaults beyond the noise, and every output says so in those words."""

    def flat(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        batches = (0.8, 1.2, 0.9, 1.1) if number % 2 else (1.2, 0.8, 1.1, 0.9)  # their luck not shared
        return _outcome(500.0 + number, spread=0.2, batches=batches)

    loaded = write_spec(tmp_path, trials=6, finalists={"max_share": 1, "count": 2, "target": None})
    study, _ = run(loaded, FakeTrials(flat))
    choice = choose(study, loaded, trial=None, policy=None)
    assert choice.gain is not None and choice.gain.confirmed and choice.gain.within_noise, choice.gain
    assert "no config beats the vLLM defaults beyond the noise" in headline(choice)
    assert "within the noise" in headline(choice)
    table = " ".join(best_table(study, loaded).split())
    assert "no config beats the vLLM defaults beyond the noise" in table
    assert "(noise)" in table
    assert not choice.beats_defaults


def test_defaults_that_measure_best_are_the_answer_in_the_same_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's defaults measure best: the verdict says nothing beats them in the words of a gain within the
    noise, and the end of the run says to keep them instead of offering an export."""

    def defaults_best(
        number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]
    ) -> TrialOutcome:
        return _outcome(1000.0 if flags["max_num_seqs"] == 64 else 400.0, spread=0.05)

    loaded = write_spec(tmp_path, trials=4, finalists={"max_share": 1, "count": 2})
    study, _ = run(loaded, FakeTrials(defaults_best))
    choice = choose(study, loaded, trial=None, policy=None)
    assert choice.baseline is not None and choice.trial.number == choice.baseline.number
    assert choice.verdict.startswith("no config beats the vLLM defaults beyond the noise: the defaults")
    assert not choice.beats_defaults
    _summary(tmp_path / "spec.yaml", study, loaded)
    out = " ".join(capsys.readouterr().out.split())
    assert "No config beats vLLM's defaults beyond the noise: keep serving with them" in out
    assert "Export the chosen flags" not in out


def test_a_paired_gain_is_stated_with_its_interval(tmp_path: Path) -> None:
    """Two rounds in which the pick beats the defaults by 25 % on the same requests (their batches moving
    together): the gain is +25 %, from 2 paired reruns, with a narrow interval clear of zero."""

    def measured(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return _outcome(
            800.0 if flags["max_num_seqs"] != 64 else 640.0, spread=0.1, batches=(0.9, 1.1, 1.0, 1.0)
        )

    loaded = write_spec(tmp_path, trials=5, finalists={"max_share": 1, "count": 1, "rounds": 2})
    study, _ = run(loaded, FakeTrials(measured))
    choice = choose(study, loaded, trial=None, policy=None)
    g = choice.gain
    assert g is not None and g.rounds == 2 and not g.within_noise
    assert abs(g.value - 0.25) < 1e-9 and (g.hi - g.lo) / 2 < 0.05
    assert "+25.0% ±" in headline(choice) and "2 paired reruns" in headline(choice)
    assert choice.beats_defaults
    assert gain(reruns(study), choice.trial, choice.trial) is not None


def test_each_rerun_is_measured_once_however_many_workers(tmp_path: Path) -> None:
    """Two workers on one study take turns claiming reruns, and one (finalist, round) was queued twice by
    a race: every (finalist, round) is measured exactly once, the duplicate is dropped."""
    loaded = write_spec(tmp_path, trials=6, finalists={"max_share": 1, "count": 2, "target": None})
    run(loaded, steady(spread=0.5))  # the search, its finalists measured again in round 1
    study = open_study(loaded, create=False, heartbeat=False)
    book = ledger(study)
    chosen = finalists(study, loaded)
    schedule(book, chosen, [2], loaded.spec.workload.seed)
    book.enqueue_trial({}, user_attrs={"finalist": chosen[0].number, "round": 2, "seed": 5})  # the race
    workers = [steady(), steady()]
    runners = [
        StudyRunner(
            loaded,
            open_study(loaded, create=False, heartbeat=False),
            w,
            on_event=lambda e: None,
            on_stale=lambda t: None,
        )
        for w in workers
    ]
    turn = 0
    while (claimed := runners[turn % 2].reruns.next(first=False)) is not None:
        runners[turn % 2].reruns.confirm(*claimed)
        turn += 1
    done = [n for w in workers for n in w.confirmed]
    assert sorted(done) == sorted(t.number for t in chosen)
    assert all(w.confirmed for w in workers)  # both took part
    live = scheduled(book)
    assert all(t.state == TrialState.COMPLETE for (f, r), t in live.items() if r == 2)
    duplicate = max(t.number for t in book.get_trials(deepcopy=False))
    assert all(
        t.state != TrialState.COMPLETE for t in book.get_trials(deepcopy=False) if t.number == duplicate
    )


def test_a_dead_workers_rerun_is_claimed_again(tmp_path: Path) -> None:
    """A rerun left RUNNING by a tuner that died on this host is failed and queued again, then measured."""
    loaded = write_spec(tmp_path, trials=5, finalists={"max_share": 1, "count": 1})
    run(loaded, steady())
    study = open_study(loaded, create=False, heartbeat=False)
    book = ledger(study)
    schedule(book, finalists(study, loaded), [2], loaded.spec.workload.seed)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    orphan = book.ask()
    orphan.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}:1.000")
    trials = steady()
    runner = StudyRunner(loaded, study, trials, on_event=lambda e: None, on_stale=lambda t: None)
    while (claimed := runner.reruns.next(first=False)) is not None:
        runner.reruns.confirm(*claimed)
    assert len(trials.confirmed) == len(finalists(study, loaded))
    assert all(t.state != TrialState.RUNNING for t in book.get_trials(deepcopy=False))


def test_no_finalists_when_count_is_zero(tmp_path: Path) -> None:
    """Without finalists nothing runs again, and the gain is said to be unconfirmed."""
    loaded = write_spec(tmp_path, trials=5, finalists={"count": 0})
    trials = steady()
    study, _ = run(loaded, trials)
    assert trials.confirmed == [] and reruns(study) == {}
    choice = choose(study, loaded, trial=None, policy=None)
    assert choice.finalist is None and "unconfirmed" in headline(choice)


def test_a_figure_the_client_bounded_is_called_a_lower_bound_with_why(tmp_path: Path) -> None:
    """A trial whose search stopped where the client could not measure (an ``above`` estimate with its
    ``client_limit``) is recommended, if at all, as a lower bound that names the limit, not as the
    server's figure."""
    limit = "the client could not measure a probe at 130 req/s validly (measurement invalid: ...)"

    def measure(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        outcome = _outcome(surface(flags))
        estimate = {**outcome.attrs["estimate"], "kind": "above", "slo_throughput_hi": None}
        if number == 0:
            estimate["client_limit"] = limit
        return dataclasses.replace(outcome, attrs={**outcome.attrs, "estimate": estimate})

    loaded = write_spec(tmp_path, trials=1, finalists={"count": 0})
    study, _ = run(loaded, FakeTrials(measure))
    choice = choose(study, loaded, trial=None, policy=None)
    assert f"or more (a lower bound, not the server's limit: {limit})" in headline(choice), headline(choice)
    assert "(lower bound: the client's)" in " ".join(best_table(study, loaded, 400).split())
    (row,) = [r for r in best_record(study, loaded)["configs"] if r["trial"] == 0]
    assert row["client_limit"] == limit


def test_verify_adds_one_round_on_a_fresh_stream(tmp_path: Path) -> None:
    """`autotune verify` measures every finalist once more, on the next round's stream."""
    loaded = write_spec(tmp_path, trials=6, finalists={"max_share": 1, "count": 2, "target": None})
    study, _ = run(loaded, steady(spread=0.5))
    before = sum(len(f.reruns) for f in reruns(study).values())
    trials = steady()
    StudyRunner(loaded, open_study(loaded, create=False), trials, on_event=lambda e: None,
                on_stale=lambda t: None).verify()  # fmt: skip
    assert sum(len(f.reruns) for f in reruns(study).values()) == before + len(trials.confirmed)
    assert len(trials.confirmed) >= 2
    assert set(trials.seeds) == {loaded.spec.workload.seed + 2 * ROUND_SEED_STEP}


def test_a_finalist_that_missed_a_round_does_not_win_on_its_one_lucky_rerun(tmp_path: Path) -> None:
    """Two rounds: the leader measures twice its figure once and misses the SLOs at every rate once; a
    runner-up meets both. The mean over the reruns that met would crown the leader; the rule prefers
    the finalist with fewer misses."""
    from autotune.outcome import Cause

    seen: dict[int, int] = {}
    first: list[int] = []

    def again(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        if not first and number != 0:
            first.append(number)  # the leader is measured again first
        seen[number] = seen.get(number, 0) + 1
        if first and number == first[0]:
            if seen[number] == 1:
                return _outcome(surface(flags) * 2.0)
            return TrialOutcome(cause=Cause.SLO_UNREACHABLE, summary="no rate met the SLOs")
        return _outcome(surface(flags))

    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 3, "rounds": 2})
    study, _ = run(loaded, FakeTrials(steady(spread=0.5).run, again))
    table = reruns(study)
    assert table[first[0]].misses == 1 and len(table[first[0]].met) == 1
    chosen = pick(study, loaded)
    assert chosen is not None and chosen.confirmed
    assert chosen.trial.number != first[0] and table[chosen.trial.number].misses == 0


def test_a_rerun_the_client_cannot_measure_is_neither_met_nor_missed(tmp_path: Path) -> None:
    """Two rounds: the client cannot measure the leader's second rerun at any rate (its limit, not the
    config's). The round is stored as unmeasurable, counts as no miss, pairs into no gain, and the stage
    goes on to the end."""
    from autotune.outcome import Cause

    first: list[int] = []
    seen: dict[int, int] = {}

    def again(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        if not first and number != 0:
            first.append(number)
        seen[number] = seen.get(number, 0) + 1
        if number == first[0] and seen[number] == 2:
            return TrialOutcome(cause=Cause.UNMEASURABLE, summary="the client could not measure this rerun")
        return _outcome(surface(flags))

    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 3, "rounds": 2})
    study, _ = run(loaded, FakeTrials(steady(spread=0.5).run, again))
    table = reruns(study)
    leader = table[first[0]]
    assert [r.unmeasured for r in leader.reruns] == [False, True] and leader.misses == 0
    assert len(leader.met) == 1 and leader.reruns[1].cause == "unmeasurable"
    assert all(len(f.reruns) == 2 for f in table.values())  # every round of every finalist ran
    base = default_trial(study)
    assert base is not None
    stated = gain(table, study.trials[first[0]], base)
    assert stated is not None and stated.rounds == 1  # the unmeasured round pairs into nothing


def _timed(number: int, tput: float, seconds: float, probes: float, baseline: bool = False) -> FrozenTrial:
    """A measured trial of ``seconds`` (``probes`` of them probing) at ``tput`` tok/s, its interval wide
    (every config ties with every other)."""
    outcome = _outcome(tput, spread=0.5)
    attrs = {**outcome.attrs, "flags": {"max_num_seqs": number + 1}, "probe_seconds": probes}
    trial = create_trial(
        state=TrialState.COMPLETE,
        values=list(outcome.values),
        user_attrs={**attrs, "baseline": True} if baseline else attrs,
        system_attrs={"constraints": list(outcome.constraints)},
    )
    trial.datetime_start = datetime(2026, 12, 6)
    trial.datetime_complete = trial.datetime_start + timedelta(seconds=seconds)
    return trial


@pytest.mark.parametrize(
    ("launches", "share", "scale", "kept"),
    [
        (30, 0.1, 1.0, 1),  # 1,200 s: 133 s for the stage; the leader and the defaults 80, one more 40
        (30, 0.1, 2.0, 0),  # reruns of 60 s (probes twice as long): the leader and the defaults alone
        (12, 0.1, 1.0, 0),  # 480 s: 53 s, less than the leader and the defaults take: they run anyway
        (30, 0.2, 1.0, 2),  # 300 s: `count` (3 besides the defaults) bounds it first
        (12, 1.0, 1.0, 2),  # no bound but `count`
    ],
)
def test_the_stage_is_kept_within_its_share_of_the_studys_time(
    tmp_path: Path, launches: int, share: float, scale: float, kept: int
) -> None:
    """Configs the search could not tell from the leader are measured again only while the stage, each
    rerun estimated from its own trial's duration with its probes ``probe_scale`` times longer, stays
    within ``finalists.max_share`` of the study's time; the leader and the defaults always are."""
    loaded = write_spec(
        tmp_path, trials=launches, finalists={"count": 3, "max_share": share, "probe_scale": scale}
    )
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_timed(0, 900.0, 40.0, 20.0, baseline=True))
    for number in range(1, launches):
        study.add_trial(_timed(number, 1000.0 + number, 40.0, 20.0))
    chosen = [t.number for t in finalists(study, loaded)]
    top = launches - 1
    assert chosen == [top, *range(top - 1, top - 1 - kept, -1), 0]


@pytest.mark.parametrize(
    ("launches", "count", "share", "bound"),
    [
        (30, 3, 0.1, "max_share"),  # room for one tie besides the leader and the defaults
        (12, 3, 0.1, "max_share"),  # none: the leader and the defaults alone exceed the share
        (30, 3, 0.2, "count"),  # two ties fit, `count` stops the third
        (12, 10, 1.0, None),  # every tie measured again: nothing to say
    ],
)
def test_ties_left_out_of_the_stage_are_named_with_what_left_them_out(
    tmp_path: Path, launches: int, count: int, share: float, bound: str | None
) -> None:
    """Every config the search could not tell from the leader is measured again or named as left out, with
    the bound that left it out and how to measure it, in `best` (text and JSON) and the HTML report, once
    the stage's reruns are queued."""
    loaded = write_spec(tmp_path, trials=launches, finalists={"count": count, "max_share": share})
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_timed(0, 900.0, 40.0, 20.0, baseline=True))
    for number in range(1, launches):
        study.add_trial(_timed(number, 1000.0 + number, 40.0, 20.0))
    found = stage(study, loaded)
    top = TrialRecord.from_trial(found.chosen[0])
    ties = {
        t.number
        for t in study.get_trials(deepcopy=False)
        if t.number != found.chosen[0].number and tied(top, TrialRecord.from_trial(t))
    }
    assert len(ties) >= 4  # the fixture: several configs within the search's paired noise
    measured = {t.number for t in found.chosen[1:-1]}  # between the leader and the defaults
    left = [t.number for t in found.left_out]
    assert measured | set(left) == ties and not measured & set(left)
    assert left == sorted(left, reverse=True)  # best first
    assert found.bound == bound and bool(left) == (bound is not None)
    before = " ".join(best_table(study, loaded, 400).split())
    assert "Not measured again" not in before  # the stage has not run: a longer study may take them in
    schedule(ledger(study), found.chosen, [1], loaded.spec.workload.seed)
    text = " ".join(best_table(study, loaded, 400).split())
    page = " ".join(html.unescape(build_report(study, loaded, now=datetime(2026, 12, 6))).split())
    record = best_record(study, loaded)["tied_not_measured_again"]
    if bound is None:
        assert "Not measured again" not in text and "Not measured again" not in page and record is None
        return
    said = f"trials {', '.join(map(str, left))}, left out by finalists.{bound}"
    assert said in text and said in page and "autotune verify" in text
    assert record == {"trials": left, "left_out_by": f"finalists.{bound}"}


def racing_reruns(defaults_spread: float) -> Callable[..., TrialOutcome]:
    """Reruns at each config's :func:`surface` where the tuned configs share every batch's luck (so the
    pick and a runner-up behind it compare tightly), while the defaults' batches move by
    ``defaults_spread`` their own way each round, and their figure with their batches' mean (the gain over
    them is loose until rounds add up)."""
    count: dict[int, int] = {}

    def again(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        count[number] = count.get(number, 0) + 1
        shared = (0.97, 1.03, 1.0, 1.0)
        if number == 0:
            draw = random.Random(count[number])
            shared = tuple(b * (1 + defaults_spread * draw.uniform(-1, 1)) for b in shared)
        return _outcome(surface(flags) * statistics.fmean(shared), 0.01, shared)

    return again


def test_a_race_adds_rounds_until_the_gain_is_precise_and_drops_who_trails(tmp_path: Path) -> None:
    """finalists.target, 0.03 by default: after the first round the gain over the defaults is wider than
    ±3 points, so rounds go on, each on a fresh stream shared by the pick, the finalists still in the race
    and the defaults, up to max_rounds; the runners-up, behind the pick beyond their tight paired interval,
    drop out after round 1."""
    spec = {"max_share": 1, "count": 3, "max_rounds": 4}
    loaded = write_spec(tmp_path, trials=8, finalists=spec)
    trials = FakeTrials(steady(spread=0.5).run, racing_reruns(0.3))
    study, events = run(loaded, trials)
    table = reruns(study)
    chosen = pick(study, loaded, table)
    assert chosen is not None and chosen.confirmed
    rounds = {r.round for f in table.values() for r in f.reruns}
    assert rounds == {1, 2, 3, 4}  # the gain never got within ±3 points: max_rounds ended the race
    assert len(table[0].reruns) == 4 and len(table[chosen.trial.number].reruns) == 4
    others = [f for n, f in table.items() if n not in (0, chosen.trial.number)]
    assert others and all(len(f.reruns) == 1 for f in others)  # trailing beyond the pairing: out
    by_round = {round_seed(loaded.spec.workload.seed, n) for n in rounds}
    assert set(trials.seeds) == by_round  # one fresh stream a round, shared by all who ran it
    racing = [e for e in events if e.kind == Kind.PHASE and e.text.startswith("racing the finalists")]
    assert len(racing) == 3 and "round 2" in racing[0].text


def test_a_race_stops_once_the_gain_is_precise(tmp_path: Path) -> None:
    """Defaults whose luck the pick shared: the first round states the gain within ±3 points, and the
    race adds none."""
    spec = {"max_share": 1, "count": 3, "target": 0.03, "max_rounds": 4}
    loaded = write_spec(tmp_path, trials=8, finalists=spec)
    study, events = run(loaded, FakeTrials(steady(spread=0.5).run, racing_reruns(0.0)))
    assert {r.round for f in reruns(study).values() for r in f.reruns} == {1}
    assert not [e for e in events if e.text.startswith("racing the finalists")]


def test_best_says_what_would_narrow_the_gain(tmp_path: Path) -> None:
    """One paired round with a loose gain: best names how many more rounds (as one over the square root of
    the rounds) would bring it to about ±3 points, in its table and its JSON."""
    loaded = write_spec(tmp_path, trials=8, finalists={"max_share": 1, "count": 1, "target": None})
    study, _ = run(loaded, FakeTrials(steady(spread=0.5).run, racing_reruns(0.3)))
    chosen = pick(study, loaded)
    assert chosen is not None
    over = gain(reruns(study), chosen.trial, default_trial(study))
    assert over is not None and over.rounds == 1
    half = (over.hi - over.lo) / 2
    assert half > 0.03
    more = math.ceil((half / 0.03) ** 2) - 1
    table = best_table(study, loaded, 300)
    assert f"The gain is known to ±{half * 100:.1f} points from 1 paired rerun; {more} more round" in table
    shown = best_record(study, loaded)["pick"]["narrowing"]
    assert shown["more_rounds"] == more and shown["gain_half_width"] == pytest.approx(half)


def test_a_gains_interval_pools_each_rounds_own_noise_with_the_rounds_spread() -> None:
    """Over several paired rounds, a round's variance is read twice and pooled by degrees of freedom: each
    round's own batches and brackets (three each) and the spread of the rounds' ratios (one a round, less
    one); the half-width is Student's t on those degrees of freedom over the square root of the rounds.
    Rounds that agree exactly still state an interval (their batches' noise); rounds that disagree
    widen it."""
    pick_estimate = _outcome(1100.0, 0.5, (0.5, 1.5, 0.7, 1.3)).attrs["estimate"]
    base_estimate = _outcome(1000.0, 0.5, (1.3, 0.7, 1.5, 0.5)).attrs["estimate"]
    mine, theirs = create_trial(values=[1100.0, 1.0]), create_trial(values=[1000.0, 1.0])
    mine.number, theirs.number = 1, 0

    def stated(figures: tuple[float, ...]) -> float:
        pick_runs = tuple(Rerun(1, k + 1, f, pick_estimate) for k, f in enumerate(figures))
        base_runs = tuple(Rerun(0, k + 1, 1000.0, base_estimate) for k in range(len(figures)))
        over = gain({1: Finalist(1, pick_runs), 0: Finalist(0, base_runs)}, mine, theirs)
        assert over is not None and over.rounds == len(figures)
        mean = statistics.fmean(math.log(f / 1000.0) for f in figures)
        assert over.value == pytest.approx(math.exp(mean) - 1)
        return math.log1p(over.hi) - mean

    own = (stated((1100.0,)) / 3.182) ** 2  # one round: t on three degrees of freedom over its own noise
    figures = (1100.0, 1110.0, 1090.0)
    spread = statistics.variance([math.log(f / 1000.0) for f in figures])
    assert stated(figures) == pytest.approx(2.201 * math.sqrt((9 * own + 2 * spread) / 11 / 3))
    assert stated((1100.0, 1100.0, 1100.0)) == pytest.approx(2.201 * math.sqrt(9 * own / 11 / 3))
    assert stated((1100.0, 1300.0, 900.0)) > stated(figures) > stated((1100.0, 1100.0, 1100.0)) > 0
    two = (1100.0, 1110.0)
    assert stated(two) == pytest.approx(
        2.365 * math.sqrt((6 * own + statistics.variance([math.log(f / 1000.0) for f in two])) / 7 / 2)
    )


def test_a_config_against_itself_gains_exactly_zero() -> None:
    """With reruns as without: the same figures on both sides, whatever the reruns' brackets."""
    estimate = _outcome(1000.0, 0.5, (0.9, 1.1, 1.0, 1.05)).attrs["estimate"]
    trial = create_trial(values=[1000.0, 1.0], user_attrs={"estimate": estimate})
    trial.number = 0
    table = {0: Finalist(0, (Rerun(0, 1, 1000.0, estimate), Rerun(0, 2, 1010.0, estimate)))}
    assert gain(table, trial, trial) == Gain(0.0, 0.0, 0.0, 2)
    assert gain({}, trial, trial) == Gain(0.0, 0.0, 0.0, 0)


def test_students_t_beyond_the_table() -> None:
    """The 97.5 % quantile of Student's t: the table's values, then within 0.1 % of the table at 15, 30
    and 120 degrees of freedom, and never below the normal's."""
    from autotune.load.crossing import t_975

    assert t_975(1) == 12.706 and t_975(3) == 3.182
    for df, table in ((15, 2.131), (30, 2.042), (120, 1.980)):
        assert t_975(df) == pytest.approx(table, rel=0.001)
    assert t_975(10_000) > 1.959964
    with pytest.raises(ValueError, match="at least 1"):
        t_975(0)


def test_a_gain_without_reruns_is_paired_on_the_searchs_stream() -> None:
    """Two searches on the study's one stream, each ±20 % on its own but with batches that moved alike:
    their comparison is paired batch by batch (a few points wide), not their intervals combined (±28 %);
    a search without batches falls back to the combined intervals."""

    def searched(number: int, tput: float, batches: tuple[float, ...]) -> FrozenTrial:
        found = _outcome(tput, 0.2, batches)
        trial = create_trial(values=list(found.values), user_attrs=dict(found.attrs))
        trial.number = number
        return trial

    moved = (0.8, 1.2, 0.9, 1.1)
    mine, theirs = searched(1, 1100.0, moved), searched(0, 1000.0, moved)
    over = gain({}, mine, theirs)
    assert over is not None and over.rounds == 0
    assert over.value == pytest.approx(0.1)
    assert over.hi - over.lo < 0.05
    estimate = {"slo_throughput": 1000.0, "slo_throughput_lo": 800.0, "slo_throughput_hi": 1250.0}
    bare = create_trial(values=[1000.0, 100.0], user_attrs={"estimate": estimate})
    loose = gain({}, mine, bare)
    assert loose is not None and loose.hi - loose.lo > 0.4
